//! The engine as a backend of the inference front: fetched, loaded and
//! warmed up on its own thread at start, so the proxy serves (and reports
//! "not ready" with the reason) while that happens or if it fails.

use crate::api::{
    Backend, BackendError, Compiled, EventStream, InferenceRequest, Prepared, Prompt, Readiness,
    Structure,
};
use crate::backend::loaded::{load, Loaded};
use crate::fetch::Source;
use crate::sampling::SamplingParams;
use crate::scheduler::{Engine, EngineConfig, GenerateRequest, StepObserver};
use crate::tokenizer::ChatMessage;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedReceiver;

/// How to build one served model.
#[derive(Debug, Clone, PartialEq)]
pub struct ServiceSpec {
    /// Name in `/v1/models`.
    pub name: String,
    /// Where the GGUF comes from.
    pub source: Source,
    /// Expected sha256 (hex) for repo and path sources.
    pub sha256: Option<String>,
    /// Scheduler and KV sizing.
    pub engine: EngineConfig,
    /// Warm-up prompt lengths, in tokens.
    pub warmup: Vec<usize>,
    /// `max_tokens` when a request gives none (None: what fits).
    pub default_max_tokens: Option<usize>,
}

enum State {
    Starting(String),
    Ready(Arc<Engine>),
    Failed(String),
}

/// Start-up durations.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StartupTimes {
    /// From start to a loaded model (fetch included).
    pub load: Option<Duration>,
    /// Warm-up steps.
    pub warmup: Option<Duration>,
}

/// A model served by the in-process engine.
pub struct EngineService {
    spec: ServiceSpec,
    state: Mutex<State>,
    times: Mutex<StartupTimes>,
}

impl std::fmt::Debug for EngineService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EngineService({})", self.spec.name)
    }
}

impl EngineService {
    /// Start fetching, loading and warming up in the background.
    pub fn start(spec: ServiceSpec, observer: Option<Arc<dyn StepObserver>>) -> Arc<Self> {
        let svc = Arc::new(EngineService {
            spec,
            state: Mutex::new(State::Starting("fetching the model".into())),
            times: Mutex::new(StartupTimes::default()),
        });
        let bg = svc.clone();
        let spawned = std::thread::Builder::new()
            .name("engine-start".into())
            .spawn(move || bg.bring_up(observer));
        if let Err(e) = spawned {
            svc.set(State::Failed(format!("cannot start a thread: {e}")));
        }
        svc
    }

    /// The spec it was built from.
    pub fn spec(&self) -> &ServiceSpec {
        &self.spec
    }

    fn set(&self, s: State) {
        *self.state.lock().unwrap_or_else(|p| p.into_inner()) = s;
    }

    fn bring_up(&self, observer: Option<Arc<dyn StepObserver>>) {
        let t0 = Instant::now();
        let name = &self.spec.name;
        let result = (|| -> Result<(), String> {
            let path = self
                .spec
                .source
                .resolve(self.spec.sha256.as_deref())
                .map_err(|e| e.to_string())?;
            self.set(State::Starting(format!("loading {}", path.display())));
            let loaded = Arc::new(load(&path).map_err(|e| e.to_string())?);
            let engine = Engine::start_observed(loaded, self.spec.engine.clone(), observer)
                .map_err(|e| e.to_string())?;
            let load_time = t0.elapsed();
            log::info!(
                "model {name}: loaded in {:.2}s, device {} ({})",
                load_time.as_secs_f64(),
                engine.device(),
                engine.runner()
            );
            self.set(State::Starting("warming up".into()));
            let t1 = Instant::now();
            warm(&engine, &self.spec.warmup)?;
            let warm_time = t1.elapsed();
            log::info!(
                "model {name}: warmed up on {:?}-token prompts in {:.2}s",
                self.spec.warmup,
                warm_time.as_secs_f64()
            );
            *self.times.lock().unwrap_or_else(|p| p.into_inner()) = StartupTimes {
                load: Some(load_time),
                warmup: Some(warm_time),
            };
            self.set(State::Ready(Arc::new(engine)));
            Ok(())
        })();
        if let Err(why) = result {
            log::error!("model {name}: not ready: {why}");
            self.set(State::Failed(why));
        }
    }

    /// The running engine, once ready.
    pub fn engine(&self) -> Option<Arc<Engine>> {
        match &*self.state.lock().unwrap_or_else(|p| p.into_inner()) {
            State::Ready(e) => Some(e.clone()),
            _ => None,
        }
    }

    /// How long loading and warm-up took (None until done).
    pub fn times(&self) -> StartupTimes {
        *self.times.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Block until ready or failed, at most `timeout`.
    pub fn wait(&self, timeout: Duration) -> Readiness {
        let end = Instant::now() + timeout;
        loop {
            let r = self.readiness();
            if !matches!(r, Readiness::Starting(_)) || Instant::now() >= end {
                return r;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Run one short greedy request per prompt length, so the first real
/// request does not pay for first-touch page faults and lazy setup.
fn warm(engine: &Engine, lens: &[usize]) -> Result<(), String> {
    let vocab = engine.loaded().model.cfg.vocab.max(2) as u32;
    let ctx = engine.loaded().model.max_positions();
    for &n in lens {
        let n = n.clamp(1, ctx.saturating_sub(2).max(1));
        let prompt: Vec<u32> = (0..n as u32)
            .map(|i| 1 + (i * 7919) % (vocab - 1))
            .collect();
        let req = GenerateRequest {
            prompt,
            max_tokens: 2,
            sampling: SamplingParams {
                temperature: 0.0,
                ..SamplingParams::default()
            },
            stop: Vec::new(),
            lane_rank: 0,
            tenant: None,
            guide: None,
        };
        finish(engine.submit(req).map_err(|e| format!("warm-up: {e}"))?)?;
    }
    // Then a few short requests at once: decode steps of several sequences,
    // so that the step-cost fit can tell a sequence's cost from a token's
    // before the first real request is predicted.
    let batch = engine.max_num_seqs().clamp(1, 8);
    let rxs = (0..batch as u32)
        .map(|i| {
            let req = GenerateRequest {
                prompt: vec![1 + i % (vocab - 1), 2 + i % (vocab - 2).max(1)],
                max_tokens: 6,
                sampling: SamplingParams {
                    temperature: 0.0,
                    ..SamplingParams::default()
                },
                stop: Vec::new(),
                lane_rank: 0,
                tenant: None,
                guide: None,
            };
            engine.submit(req).map_err(|e| format!("warm-up: {e}"))
        })
        .collect::<Result<Vec<_>, String>>()?;
    rxs.into_iter().try_for_each(finish)
}

/// The grammar of `s` for this model; what the library cannot compile is
/// a 400 in its words, naming the field it came from.
fn compile(l: &Loaded, s: &Structure) -> Result<crate::guide::Guide, BackendError> {
    let param = match s {
        Structure::Json(_) => "response_format",
        Structure::Tools { .. } => "tools",
    };
    let guides = l.guides.as_ref().map_err(|e| {
        BackendError::invalid(
            "structured_output_unavailable",
            Some(param),
            format!("this model cannot constrain its output: {e}"),
        )
    })?;
    guides.compile(s).map_err(|e| {
        BackendError::invalid(
            "invalid_schema",
            Some(param),
            format!("the schema cannot be used for structured output: {e}"),
        )
    })
}

/// The conversation with the tools described in its system message (the
/// first message, or a new one before it).
fn tools_in_system(m: &[ChatMessage], tools: &[crate::api::Tool]) -> Vec<ChatMessage> {
    let prompt = crate::guide::tools_prompt(tools);
    let mut out = m.to_vec();
    match out.first_mut() {
        Some(first) if first.role == "system" => {
            first.content = format!("{}\n\n{prompt}", first.content);
        }
        _ => out.insert(0, ChatMessage::new("system", prompt)),
    }
    out
}

/// Wait for a warm-up request to end.
fn finish(mut rx: UnboundedReceiver<crate::api::Event>) -> Result<(), String> {
    loop {
        match rx.blocking_recv() {
            Some(crate::api::Event::Done { .. }) | None => return Ok(()),
            Some(crate::api::Event::Error(e)) => return Err(format!("warm-up: {e}")),
            Some(_) => {}
        }
    }
}

#[async_trait::async_trait]
impl Backend for EngineService {
    fn kind(&self) -> &'static str {
        "engine"
    }

    fn readiness(&self) -> Readiness {
        match &*self.state.lock().unwrap_or_else(|p| p.into_inner()) {
            State::Starting(p) => Readiness::Starting(p.clone()),
            State::Ready(_) => Readiness::Ready,
            State::Failed(w) => Readiness::Failed(w.clone()),
        }
    }

    fn device(&self) -> Option<(String, String)> {
        self.engine()
            .map(|e| (e.device().to_string(), e.runner().to_string()))
    }

    fn prompt_bound(&self) -> Option<crate::api::PromptBound> {
        self.engine().map(|e| {
            let l: &Loaded = e.loaded();
            crate::api::PromptBound {
                context: l.model.max_positions(),
                max_token_bytes: Some(l.codec.max_token_bytes),
            }
        })
    }

    fn step_cost(&self) -> Option<crate::scheduler::StepCost> {
        self.engine()
            .map(|e| e.step_cost())
            .filter(|c| c.samples > 0)
    }

    fn prepare(&self, req: &InferenceRequest) -> Result<Prepared, BackendError> {
        let Some(engine) = self.engine() else {
            let why = match self.readiness() {
                Readiness::Starting(p) => {
                    format!("model `{}` is not ready yet ({p})", self.spec.name)
                }
                Readiness::Failed(w) => format!("model `{}` is not available: {w}", self.spec.name),
                Readiness::Ready => format!("model `{}` is not ready", self.spec.name),
            };
            return Err(BackendError::unavailable(why));
        };
        let l: &Loaded = engine.loaded();
        let vocab = l.model.cfg.vocab;
        if let Some((t, _)) = req
            .sampling
            .logit_bias
            .iter()
            .find(|(t, _)| *t as usize >= vocab)
        {
            return Err(BackendError::invalid(
                "invalid_request_error",
                Some("logit_bias"),
                format!("token id {t} is not in the model's vocabulary ({vocab} tokens)."),
            ));
        }
        if req.sampling.echo && req.sampling.prompt_logprobs.is_some() && !engine.scores_prompts() {
            return Err(BackendError::invalid(
                "invalid_request_error",
                Some("echo"),
                format!(
                    "scoring the prompt (`echo` with `logprobs`) is not supported on this model's runner ({}).",
                    engine.runner()
                ),
            ));
        }
        let guide = match &req.structure {
            None => None,
            Some(s) => Some(Compiled::new(compile(l, s)?)),
        };
        let (text, param) = match &req.prompt {
            Prompt::Chat(m) => (
                match &req.structure {
                    // A template that describes tools itself (Qwen2.5's) is
                    // given them; for others they go in the system message.
                    Some(Structure::Tools { tools, .. }) if l.codec.template_takes_tools() => {
                        l.codec.render_chat_tools(m, Some(tools))
                    }
                    Some(Structure::Tools { tools, .. }) => {
                        l.codec.render_chat(&tools_in_system(m, tools))
                    }
                    _ => l.codec.render_chat(m),
                }
                .map_err(|e| {
                    BackendError::invalid("invalid_messages", Some("messages"), e.to_string())
                })?,
                "messages",
            ),
            Prompt::Text(t) => (t.clone(), "prompt"),
            Prompt::Tokens(_) => (String::new(), "prompt"),
        };
        let tokens = match &req.prompt {
            Prompt::Tokens(t) => {
                if let Some(bad) = t.iter().find(|t| **t as usize >= vocab) {
                    return Err(BackendError::invalid(
                        "invalid_prompt",
                        Some("prompt"),
                        format!(
                            "token id {bad} is not in the model's vocabulary ({vocab} tokens)."
                        ),
                    ));
                }
                t.clone()
            }
            _ => l
                .codec
                .encode(&text)
                .map_err(|e| BackendError::invalid("invalid_prompt", Some(param), e.to_string()))?,
        };
        let ctx = l.model.max_positions();
        if tokens.is_empty() {
            return Err(BackendError::invalid(
                "invalid_prompt",
                Some(param),
                "the prompt is empty".into(),
            ));
        }
        if tokens.len() >= ctx {
            return Err(BackendError::invalid(
                "context_length_exceeded",
                Some(param),
                format!(
                    "This model's maximum context length is {ctx} tokens. However, your prompt has {} tokens.",
                    tokens.len()
                ),
            ));
        }
        let room = ctx - tokens.len();
        let cap = engine.pool_stats();
        let blocks = cap.used + cap.free + cap.cached;
        let max_tokens = match req.max_tokens {
            Some(m) if m > room => {
                return Err(BackendError::invalid(
                    "context_length_exceeded",
                    Some("max_tokens"),
                    format!(
                        "This model's maximum context length is {ctx} tokens. However, you requested {} tokens ({} in the prompt, {m} for the completion).",
                        tokens.len() + m,
                        tokens.len()
                    ),
                ))
            }
            Some(m) => m,
            // Omitted: what fits the context and the KV pool (a pool
            // smaller than the context would otherwise refuse every
            // request that leaves `max_tokens` out).
            None => {
                let fits = (blocks * self.spec.engine.block_size).saturating_sub(tokens.len());
                self.spec
                    .default_max_tokens
                    .unwrap_or(room)
                    .min(room)
                    .min(fits.max(1))
            }
        };
        let need = (tokens.len() + max_tokens).div_ceil(self.spec.engine.block_size.max(1));
        if need > blocks {
            return Err(BackendError::invalid(
                "context_length_exceeded",
                Some("max_tokens"),
                format!(
                    "prompt plus max_tokens ({} tokens) needs more KV cache than this server has ({} tokens)",
                    tokens.len() + max_tokens,
                    blocks * self.spec.engine.block_size
                ),
            ));
        }
        Ok(Prepared {
            prompt_tokens: tokens.len(),
            max_tokens,
            tokens,
            prefix_hash: 0,
            guide,
            member: None,
        })
    }

    async fn generate(
        &self,
        req: InferenceRequest,
        prepared: Prepared,
    ) -> Result<EventStream, BackendError> {
        let engine = self.engine().ok_or_else(|| {
            BackendError::unavailable(format!("model `{}` is not ready", self.spec.name))
        })?;
        engine
            .submit_n(
                GenerateRequest {
                    prompt: prepared.tokens,
                    max_tokens: prepared.max_tokens,
                    sampling: req.sampling,
                    stop: req.stop,
                    lane_rank: req.lane_rank,
                    tenant: req.tenant,
                    guide: prepared.guide.and_then(Compiled::take),
                },
                req.n,
            )
            .map_err(|e| BackendError::invalid("invalid_request", None, e.to_string()))
    }
}
