//! What each kind of OpenAI-compatible server accepts (`[pools.X]
//! dialect`, a `ServerKind` here: in the code "dialect" is only the API a
//! request came in): the optional request fields it takes (a field it
//! would reject is not sent), whether it reports usage in a stream when asked
//! (`stream_options`), and the health path it offers. A stream without
//! usage is counted here (one token per content chunk); usage is read from
//! whichever chunk carries it.
//!
//! | dialect | `stream_options` | `priority` | `top_k` | `seed` | `continue_final_message` | `min_p`, `repetition_penalty` | health |
//! |---|---|---|---|---|---|---|---|
//! | `openai` (default) | yes | no | no | yes | no | no | `/v1/models` |
//! | `vllm` | yes | yes | yes | yes | yes | yes | `/health` |
//! | `sglang` | yes | no | yes | yes | yes | yes | `/health` |
//! | `tgi` | yes | no | no | yes | no | no | `/health` |
//! | `ollama` | yes | no | no | yes | no | no | `/v1/models` |
//! | `llamacpp` | no | no | yes | yes | no | no | `/health` |
//! | `llamacpp-python` | no | no | yes | yes | no | no | `/openapi.json` |
//!
//! `frequency_penalty`, `presence_penalty` and `logit_bias` are OpenAI's
//! and go to every kind. `min_p` and `repetition_penalty` go only where
//! the table says; elsewhere a request that sets them is refused (400
//! naming the field) rather than served without them.
//!
//! llama-cpp-python's server cuts a generation in flight short (finishing
//! it as `stop`) whenever another request needs the model, `/v1/models`
//! included, unless started with `--interrupt_requests false`: its health
//! path is one that does not touch the model, and such a pool wants
//! `max_concurrency = 1` on its models.

/// A server kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ServerKind {
    /// OpenAI's own API (and anything that only promises it).
    #[default]
    OpenAi,
    /// vLLM.
    Vllm,
    /// SGLang.
    Sglang,
    /// Hugging Face text-generation-inference (Messages API).
    Tgi,
    /// Ollama's OpenAI compatibility.
    Ollama,
    /// llama.cpp's own server (`llama-server`).
    LlamaCpp,
    /// llama-cpp-python's server.
    LlamaCppPython,
}

/// What a dialect accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    /// `stream_options: {include_usage: true}`.
    pub stream_options: bool,
    /// vLLM's `priority`.
    pub priority: bool,
    /// `top_k`.
    pub top_k: bool,
    /// `seed`.
    pub seed: bool,
    /// `continue_final_message` / `add_generation_prompt` (chat resume).
    pub continue_final_message: bool,
    /// vLLM's `min_p` and `repetition_penalty` (a server without them is
    /// not sent them: a request that sets them is refused with a 400).
    pub min_p: bool,
    /// The health path it serves.
    pub health_path: &'static str,
}

impl ServerKind {
    /// Every dialect's config name.
    pub const NAMES: &'static str = "openai, vllm, sglang, tgi, ollama, llamacpp, llamacpp-python";

    /// Its config name.
    pub fn name(self) -> &'static str {
        match self {
            ServerKind::OpenAi => "openai",
            ServerKind::Vllm => "vllm",
            ServerKind::Sglang => "sglang",
            ServerKind::Tgi => "tgi",
            ServerKind::Ollama => "ollama",
            ServerKind::LlamaCpp => "llamacpp",
            ServerKind::LlamaCppPython => "llamacpp-python",
        }
    }

    /// The sampling fields this kind does not take that a request (or a
    /// model's defaults) sets: `min_p` above 0, `repetition_penalty` other
    /// than 1. Refused, never dropped.
    pub fn refused_sampling(
        self,
        min_p: f32,
        repetition_penalty: f32,
    ) -> impl Iterator<Item = &'static str> {
        let takes = self.caps().min_p;
        [
            (min_p > 0.0, "min_p"),
            (repetition_penalty != 1.0, "repetition_penalty"),
        ]
        .into_iter()
        .filter_map(move |(set, field)| (set && !takes).then_some(field))
    }

    /// Parse the config value.
    pub fn parse(v: &str) -> Option<ServerKind> {
        Some(match v {
            "openai" => ServerKind::OpenAi,
            "vllm" => ServerKind::Vllm,
            "sglang" => ServerKind::Sglang,
            "tgi" => ServerKind::Tgi,
            "ollama" => ServerKind::Ollama,
            "llamacpp" => ServerKind::LlamaCpp,
            "llamacpp-python" => ServerKind::LlamaCppPython,
            _ => return None,
        })
    }

    /// What it accepts.
    pub fn caps(self) -> Caps {
        let (so, pr, tk, sd, cf, h) = match self {
            ServerKind::OpenAi => (true, false, false, true, false, "/v1/models"),
            ServerKind::Vllm => (true, true, true, true, true, "/health"),
            ServerKind::Sglang => (true, false, true, true, true, "/health"),
            ServerKind::Tgi => (true, false, false, true, false, "/health"),
            ServerKind::Ollama => (true, false, false, true, false, "/v1/models"),
            ServerKind::LlamaCpp => (false, false, true, true, false, "/health"),
            ServerKind::LlamaCppPython => (false, false, true, true, false, "/openapi.json"),
        };
        let min_p = matches!(self, ServerKind::Vllm | ServerKind::Sglang);
        Caps {
            stream_options: so,
            priority: pr,
            top_k: tk,
            seed: sd,
            continue_final_message: cf,
            min_p,
            health_path: h,
        }
    }
}
