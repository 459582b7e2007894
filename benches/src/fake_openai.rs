//! A fake OpenAI-compatible inference server: stands in for a GPU farm in
//! tests and benchmarks (never where the real engine can serve).
//!
//! It speaks the real protocol: `POST /v1/chat/completions` and
//! `/v1/completions`, streaming (`data: {chunk}` events, a usage chunk when
//! asked, `data: [DONE]`) or whole JSON, `GET /v1/models`, `GET /health`.
//! Its behaviour is set by flags: time to first token and inter-token
//! interval with jitter, tokens delivered in bursts, a capacity limit with
//! its own FIFO queue (so it behaves like a loaded vLLM), failures of the
//! first N requests, a stall or malformed SSE after N tokens, a connection
//! reset (RST) after N streamed tokens, a fraction of slow first tokens.
//! Streamed chunks carry made-up `logprobs` when the request asks (chat's
//! or the legacy shape).
//! `GET /stats` reports counters (requests, active, completed, cancelled,
//! failed, slow, killed, resumed, connections that carried inference
//! requests) and the last request body, so tests can
//! see what the proxy sent and cancelled.
//!
//! Its text is deterministic: token i is `WORDS[i % WORDS.len()]`. So it can
//! resume a stream another instance started, as a proxy would ask: a chat
//! request with `continue_final_message` whose last (assistant) message is
//! the first k words, or a completion prompt that ends with them, gets
//! tokens k, k+1, ... (counted as `resumed`).
//!
//! `POST /control` with a JSON object changes, for requests that start
//! afterwards, any of `ttft_ms`, `itl_ms`, `tokens`, `die_after`,
//! `slow_fraction`, `slow_ttft_ms` and `fail` (true: every completion
//! answers 500); it answers with those settings.
//!
//! `GET /metrics` answers as vLLM's does for the figures an endpoint
//! picker reads: `vllm:num_requests_running` (its active requests),
//! `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc`, the last two
//! as set by `/control`'s `vllm_waiting` and `vllm_kv_usage` (default 0);
//! `"metrics": false` makes it answer 404 instead, as a server whose
//! metrics are off would.
//!
//! Usage: fake-openai [--listen ADDR] [--name NAME] [--ttft-ms N]
//!   [--itl-ms N] [--jitter-ms N] [--burst N] [--tokens N] [--capacity N]
//!   [--fail-first N] [--stall-after N] [--malformed-after N]
//!   [--die-after N] [--slow-fraction F] [--slow-ttft-ms N]
//!   [--uuid-request-ids]
//! `--uuid-request-ids` answers a request whose `X-Request-Id` is not a UUID
//! with an empty 400, as llama-cpp-python's server does; `/stats` shows the
//! last `last_request_id` received.
//! `--slow-fraction F` (0 to 1) gives that share of requests a first token
//! after `--slow-ttft-ms` (default 10 times `--ttft-ms`).
//! Prints `listening on ADDR` once bound.
//!
//! A chat request with `tools` (and `tool_choice` not `none`) is answered
//! with a call of the named tool, else the first, whose arguments fit its
//! schema; one with `response_format` `json_object` or `json_schema` with
//! JSON that fits it: as a server with a tool parser and guided decoding
//! answers, streamed or whole.

use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

#[derive(Debug, Clone)]
struct Opts {
    listen: String,
    name: String,
    ttft_ms: u64,
    itl_ms: u64,
    jitter_ms: u64,
    burst: u64,
    tokens: u64,
    capacity: usize,
    fail_first: u64,
    stall_after: u64,
    malformed_after: u64,
    /// Streamed tokens after which the connection is reset; 0: never.
    die_after: u64,
    /// Share of requests (0 to 1) whose first token takes `slow_ttft_ms`.
    slow_fraction: f64,
    /// 0: ten times `ttft_ms`, read when the request starts.
    slow_ttft_ms: u64,
    /// Every completion answers 500 (set through `/control` only).
    fail: bool,
    /// Refuse a non-UUID `X-Request-Id` with an empty 400.
    uuid_request_ids: bool,
    /// `vllm:num_requests_waiting` on `/metrics`.
    vllm_waiting: u64,
    /// `vllm:kv_cache_usage_perc` on `/metrics`.
    vllm_kv_usage: f64,
    /// Whether `/metrics` answers.
    metrics: bool,
}

#[derive(Default)]
struct Stats {
    requests: AtomicU64,
    active: AtomicU64,
    completed: AtomicU64,
    cancelled: AtomicU64,
    failed: AtomicU64,
    slow: AtomicU64,
    killed: AtomicU64,
    resumed: AtomicU64,
    health_gets: AtomicU64,
    models_gets: AtomicU64,
    metrics_gets: AtomicU64,
    /// Connections that carried at least one inference request.
    inference_connections: AtomicU64,
    rng: AtomicU64,
}

struct State {
    /// Changed by `POST /control`; each request works on a copy taken when
    /// it starts, so a change never alters a request halfway.
    o: Mutex<Opts>,
    s: Stats,
    slots: Semaphore,
    last_body: Mutex<Value>,
    last_request_id: Mutex<Value>,
    /// The last inference request's `traceparent`.
    last_traceparent: Mutex<Value>,
}

/// Lock, ignoring poisoning: the data is plain values that a panic elsewhere
/// cannot leave half-changed.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn parse_opts() -> Result<Opts, String> {
    let mut o = Opts {
        listen: "127.0.0.1:0".into(),
        name: "fake".into(),
        ttft_ms: 20,
        itl_ms: 10,
        jitter_ms: 0,
        burst: 1,
        tokens: 16,
        capacity: 64,
        fail_first: 0,
        stall_after: 0,
        malformed_after: 0,
        die_after: 0,
        slow_fraction: 0.0,
        slow_ttft_ms: 0,
        fail: false,
        uuid_request_ids: false,
        vllm_waiting: 0,
        vllm_kv_usage: 0.0,
        metrics: true,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        // A switch: takes no value.
        if args[i] == "--uuid-request-ids" {
            o.uuid_request_ids = true;
            i += 1;
            continue;
        }
        let v = args
            .get(i + 1)
            .ok_or(format!("{} needs a value", args[i]))?;
        let n = || {
            v.parse::<u64>()
                .map_err(|_| format!("{}: not a number: {v}", args[i]))
        };
        match args[i].as_str() {
            "--listen" => o.listen = v.clone(),
            "--name" => o.name = v.clone(),
            "--ttft-ms" => o.ttft_ms = n()?,
            "--itl-ms" => o.itl_ms = n()?,
            "--jitter-ms" => o.jitter_ms = n()?,
            "--burst" => o.burst = n()?.max(1),
            "--tokens" => o.tokens = n()?,
            "--capacity" => o.capacity = n()?.max(1) as usize,
            "--fail-first" => o.fail_first = n()?,
            "--stall-after" => o.stall_after = n()?,
            "--malformed-after" => o.malformed_after = n()?,
            "--die-after" => o.die_after = n()?,
            "--slow-fraction" => {
                o.slow_fraction = fraction(v).map_err(|e| format!("{}: {e}", args[i]))?
            }
            "--slow-ttft-ms" => o.slow_ttft_ms = n()?,
            other => return Err(format!("unknown flag {other}")),
        }
        i += 2;
    }
    Ok(o)
}

/// Whether `s` is a UUID in canonical text form.
fn is_uuid(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 36
        && b.iter().enumerate().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => *c == b'-',
            _ => c.is_ascii_hexdigit(),
        })
}

/// A share in [0, 1]; NaN is refused too.
fn fraction(v: &str) -> Result<f64, String> {
    match v.parse::<f64>() {
        Ok(f) if (0.0..=1.0).contains(&f) => Ok(f),
        _ => Err(format!("not a fraction between 0 and 1: {v}")),
    }
}

impl State {
    /// The settings for a request starting now.
    fn opts(&self) -> Opts {
        lock(&self.o).clone()
    }

    /// The next pseudo-random number (splitmix64 on a shared counter).
    fn draw(&self) -> u64 {
        let mut z = self
            .s
            .rng
            .fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform jitter in [-j, +j] ms.
    fn jitter(&self, j: u64, base: u64) -> Duration {
        if j == 0 {
            return Duration::from_millis(base);
        }
        let r = self.draw() % (2 * j + 1);
        Duration::from_millis((base + r).saturating_sub(j))
    }

    /// True with probability `f`: 53 random bits as a float in [0, 1).
    fn chance(&self, f: f64) -> bool {
        f > 0.0 && ((self.draw() >> 11) as f64 / (1u64 << 53) as f64) < f
    }
}

const WORDS: &[&str] = &[
    "The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", ".",
];

/// Tokens `from` .. `from + n` of the fake's one text.
fn words(from: u64, n: u64) -> String {
    (from..from + n).map(word).collect()
}

fn word(i: u64) -> &'static str {
    WORDS[(i % WORDS.len() as u64) as usize]
}

/// How many tokens of the fake's text `s` is, exactly; None when `s` is not
/// the text's beginning token for token (an empty `s` is 0 tokens).
fn words_prefix_len(s: &str) -> Option<u64> {
    let (mut rest, mut k) = (s, 0u64);
    while !rest.is_empty() {
        rest = rest.strip_prefix(word(k))?;
        k += 1;
    }
    Some(k)
}

/// Tokens of the answer already generated, when the request asks to
/// continue one: the fake then goes on from there, as a resumed stream.
fn resume_offset(req: &Value) -> u64 {
    if let Some(ms) = req["messages"].as_array() {
        // vLLM's way: the partial answer is the final assistant message.
        let last = ms.last().unwrap_or(&Value::Null);
        if req["continue_final_message"].as_bool() != Some(true) || last["role"] != "assistant" {
            return 0;
        }
        return last["content"]
            .as_str()
            .and_then(words_prefix_len)
            .unwrap_or(0);
    }
    // A completion prompt carries the partial answer at its end: the
    // earliest start from which the rest is the text's beginning, so the
    // longest such partial wins.
    let p = req["prompt"].as_str().unwrap_or("");
    p.char_indices()
        .find_map(|(j, _)| words_prefix_len(&p[j..]).filter(|&k| k > 0))
        .unwrap_or(0)
}

/// The settings `/control` can change, as it reports them.
fn settings(o: &Opts) -> Value {
    json!({"ttft_ms": o.ttft_ms, "itl_ms": o.itl_ms, "tokens": o.tokens, "die_after": o.die_after,
        "slow_fraction": o.slow_fraction, "slow_ttft_ms": o.slow_ttft_ms, "fail": o.fail,
        "vllm_waiting": o.vllm_waiting, "vllm_kv_usage": o.vllm_kv_usage, "metrics": o.metrics})
}

fn error(status: u16, kind: &str, message: &str) -> Vec<u8> {
    let b = json!({"error": {"message": message, "type": kind, "param": null, "code": null}});
    response(status, "application/json", &b.to_string())
}

/// `POST /control`: new settings for the requests that start from now on.
fn control(st: &State, body: &[u8]) -> Vec<u8> {
    let req: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => return error(400, "invalid_request_error", &format!("bad json: {e}")),
    };
    let Some(keys) = req.as_object() else {
        return error(400, "invalid_request_error", "want a JSON object");
    };
    // Work on a copy under the lock: a bad key changes nothing, and two
    // calls at once cannot lose each other's changes.
    let mut g = lock(&st.o);
    let mut o = g.clone();
    for (k, v) in keys {
        let n = || {
            v.as_u64()
                .ok_or(format!("{k}: want a non-negative integer"))
        };
        let r = match k.as_str() {
            "ttft_ms" => n().map(|n| o.ttft_ms = n),
            "itl_ms" => n().map(|n| o.itl_ms = n),
            "tokens" => n().map(|n| o.tokens = n),
            "die_after" => n().map(|n| o.die_after = n),
            "slow_ttft_ms" => n().map(|n| o.slow_ttft_ms = n),
            "slow_fraction" => v
                .as_f64()
                .filter(|f| (0.0..=1.0).contains(f))
                .map(|f| o.slow_fraction = f)
                .ok_or(format!("{k}: want a number between 0 and 1")),
            "fail" => v
                .as_bool()
                .map(|b| o.fail = b)
                .ok_or(format!("{k}: want true or false")),
            "vllm_waiting" => n().map(|n| o.vllm_waiting = n),
            "vllm_kv_usage" => v
                .as_f64()
                .filter(|f| (0.0..=1.0).contains(f))
                .map(|f| o.vllm_kv_usage = f)
                .ok_or(format!("{k}: want a number between 0 and 1")),
            "metrics" => v
                .as_bool()
                .map(|b| o.metrics = b)
                .ok_or(format!("{k}: want true or false")),
            // A typo must not pass silently as "no change".
            _ => Err(format!("unknown setting {k}")),
        };
        if let Err(e) = r {
            return error(400, "invalid_request_error", &e);
        }
    }
    *g = o;
    response(200, "application/json", &settings(&g).to_string())
}

/// The next request: method, path, body, and the headers a test asks
/// about.
struct Request {
    method: String,
    path: String,
    request_id: Option<String>,
    traceparent: Option<String>,
    body: Vec<u8>,
}

/// The next request on `r`.
async fn read_request(r: &mut BufReader<tokio::net::tcp::OwnedReadHalf>) -> Option<Request> {
    let mut line = String::new();
    if r.read_line(&mut line).await.ok()? == 0 {
        return None;
    }
    let mut parts = line.split_whitespace();
    let method = parts.next()?.to_string();
    let path = parts.next()?.to_string();
    let mut len = 0usize;
    let (mut request_id, mut traceparent) = (None, None);
    loop {
        let mut h = String::new();
        if r.read_line(&mut h).await.ok()? == 0 {
            return None;
        }
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.eq_ignore_ascii_case("content-length") {
                len = v.trim().parse().ok()?;
            } else if k.eq_ignore_ascii_case("x-request-id") {
                request_id = Some(v.trim().to_string());
            } else if k.eq_ignore_ascii_case("traceparent") {
                traceparent = Some(v.trim().to_string());
            }
        }
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await.ok()?;
    Some(Request {
        method,
        path,
        request_id,
        traceparent,
        body,
    })
}

fn response(status: u16, ctype: &str, body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 {status} X\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

fn chunk(w: &mut Vec<u8>, data: &str) {
    let payload = format!("data: {data}\n\n");
    w.extend_from_slice(format!("{:x}\r\n{payload}\r\n", payload.len()).as_bytes());
}

async fn handle(st: Arc<State>, sock: TcpStream) {
    let _ = sock.set_nodelay(true);
    let (r, mut w) = sock.into_split();
    let mut r = BufReader::new(r);
    let mut counted = false;
    while let Some(req) = read_request(&mut r).await {
        let Request {
            method,
            path,
            request_id,
            traceparent,
            body,
        } = req;
        let inference = method == "POST" && path.starts_with("/v1/");
        if inference && !counted {
            counted = true;
            st.s.inference_connections.fetch_add(1, Ordering::Relaxed);
        }
        if inference {
            *lock(&st.last_request_id) = request_id.clone().map_or(Value::Null, Value::from);
            *lock(&st.last_traceparent) = traceparent.map_or(Value::Null, Value::from);
        }
        // Like llama-cpp-python's server: an id that is not a UUID is an
        // empty 400.
        if inference
            && st.opts().uuid_request_ids
            && request_id.as_deref().is_some_and(|id| !is_uuid(id))
        {
            st.s.requests.fetch_add(1, Ordering::Relaxed);
            st.s.failed.fetch_add(1, Ordering::Relaxed);
            if w.write_all(&response(400, "application/json", ""))
                .await
                .is_err()
            {
                return;
            }
            continue;
        }
        let out = match (method.as_str(), path.as_str()) {
            ("GET", "/health") => {
                st.s.health_gets.fetch_add(1, Ordering::Relaxed);
                response(200, "text/plain", "ok")
            }
            ("GET", "/v1/models") => {
                st.s.models_gets.fetch_add(1, Ordering::Relaxed);
                response(
                200,
                "application/json",
                &json!({"object": "list", "data": [{"id": st.opts().name, "object": "model", "created": 0, "owned_by": "fake"}]}).to_string(),
            )
            }
            ("GET", "/stats") => {
                let s = &st.s;
                let c = |a: &AtomicU64| a.load(Ordering::Relaxed);
                let v = json!({"requests": c(&s.requests), "active": c(&s.active), "completed": c(&s.completed),
                    "cancelled": c(&s.cancelled), "failed": c(&s.failed), "slow": c(&s.slow), "killed": c(&s.killed),
                    "resumed": c(&s.resumed), "last_body": lock(&st.last_body).clone(), "name": st.opts().name,
                    "last_request_id": lock(&st.last_request_id).clone(),
                    "last_traceparent": lock(&st.last_traceparent).clone(),
                    "health_gets": c(&s.health_gets), "models_gets": c(&s.models_gets),
                    "metrics_gets": c(&s.metrics_gets),
                    "inference_connections": c(&s.inference_connections)});
                response(200, "application/json", &v.to_string())
            }
            ("POST", "/control") => control(&st, &body),
            ("GET", "/metrics") => {
                st.s.metrics_gets.fetch_add(1, Ordering::Relaxed);
                let o = st.opts();
                if o.metrics {
                    let running = st.s.active.load(Ordering::Relaxed);
                    let l = format!("{{model_name=\"{}\"}}", o.name);
                    let page = format!(
                        "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{l} {running}\n\
                         # TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{l} {}\n\
                         # TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{l} {}\n",
                        o.vllm_waiting, o.vllm_kv_usage
                    );
                    response(200, "text/plain; version=0.0.4", &page)
                } else {
                    error(404, "invalid_request_error", "not found")
                }
            }
            ("POST", "/v1/chat/completions") | ("POST", "/v1/completions") => {
                let chat = path.ends_with("chat/completions");
                match complete(&st, chat, &body, &mut r, &mut w).await {
                    Some(()) => continue,
                    None => {
                        // A plain close() when both halves go: without the
                        // write half's shutdown (a FIN) first, a socket set
                        // to linger 0 by --die-after sends only an RST.
                        w.forget();
                        return;
                    }
                }
            }
            _ => error(404, "invalid_request_error", "not found"),
        };
        if w.write_all(&out).await.is_err() {
            return;
        }
    }
}

/// Sleep unless the client closes first; false when it closed.
async fn sleep_or_close(d: Duration, r: &mut BufReader<tokio::net::tcp::OwnedReadHalf>) -> bool {
    let mut b = [0u8; 1];
    tokio::select! {
        _ = tokio::time::sleep(d) => true,
        n = r.read(&mut b) => !matches!(n, Ok(0) | Err(_)),
    }
}

/// One completion. None: the connection is finished.
async fn complete(
    st: &Arc<State>,
    chat: bool,
    body: &[u8],
    r: &mut BufReader<tokio::net::tcp::OwnedReadHalf>,
    w: &mut tokio::net::tcp::OwnedWriteHalf,
) -> Option<()> {
    let o = st.opts();
    let n = st.s.requests.fetch_add(1, Ordering::Relaxed);
    let req: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => {
            let b = error(400, "invalid_request_error", &format!("bad json: {e}"));
            w.write_all(&b).await.ok()?;
            return Some(());
        }
    };
    *lock(&st.last_body) = req.clone();
    if n < o.fail_first || o.fail {
        st.s.failed.fetch_add(1, Ordering::Relaxed);
        w.write_all(&error(500, "server_error", "fake overload"))
            .await
            .ok()?;
        return Some(());
    }
    let stream = req["stream"].as_bool().unwrap_or(false);
    let usage_wanted = req["stream_options"]["include_usage"]
        .as_bool()
        .unwrap_or(false);
    // A resumed answer goes on from token `from`; what is left of the text
    // is what an uninterrupted run would still have produced.
    let from = resume_offset(&req);
    if from > 0 {
        st.s.resumed.fetch_add(1, Ordering::Relaxed);
    }
    let left = o.tokens.saturating_sub(from);
    let max = req["max_tokens"].as_u64().unwrap_or(u64::MAX);
    let total = left.min(max);
    // As before resumption existed: max_tokens equal to what is left ends
    // on "length" (the end-of-text token never came), so a resumed stream
    // ends like the uninterrupted one would.
    let finish = if max <= left { "length" } else { "stop" };
    let ttft = if st.chance(o.slow_fraction) {
        st.s.slow.fetch_add(1, Ordering::Relaxed);
        match o.slow_ttft_ms {
            0 => o.ttft_ms.saturating_mul(10),
            s => s,
        }
    } else {
        o.ttft_ms
    };
    // Like a real server: the prompt's text (4 characters a token) plus a
    // few tokens of chat template per message, not the JSON around it.
    let prompt_tokens = match req["messages"].as_array() {
        Some(ms) => ms
            .iter()
            .map(|m| {
                m["content"]
                    .as_str()
                    .map_or(0, |c| c.len() as u64)
                    .div_ceil(4)
                    + 4
            })
            .sum(),
        None => req["prompt"]
            .as_str()
            .map_or(0, |p| p.len() as u64)
            .div_ceil(4),
    };
    // Capacity: wait for a slot like a loaded server (FIFO semaphore).
    let _slot = tokio::select! {
        p = st.slots.acquire() => p.ok()?,
        _ = async { let mut b = [0u8; 1]; let _ = r.read(&mut b).await; } => {
            st.s.cancelled.fetch_add(1, Ordering::Relaxed);
            return None;
        }
    };
    st.s.active.fetch_add(1, Ordering::Relaxed);
    struct Active<'a>(&'a Stats);
    impl Drop for Active<'_> {
        fn drop(&mut self) {
            self.0.active.fetch_sub(1, Ordering::Relaxed);
        }
    }
    let _active = Active(&st.s);
    let id = format!("fake-{n}");
    // Scores, when asked (chat: `logprobs` and `top_logprobs`;
    // completions: `logprobs`), made up but exact in binary so that they
    // read back equal: a token's is -0.25 - 0.125 x (its length mod 7).
    let want_lp: Option<usize> = if chat {
        req["logprobs"]
            .as_bool()
            .unwrap_or(false)
            .then(|| req["top_logprobs"].as_u64().unwrap_or(0) as usize)
    } else {
        req["logprobs"].as_u64().map(|k| k as usize)
    };
    let scores = |text: &str| -> Value {
        let l = -0.25 - (text.len() % 7) as f64 * 0.125;
        let k = want_lp.unwrap_or(0);
        if chat {
            let top: Vec<Value> = (0..k)
                .map(|j| {
                    let t = format!("alt{j}");
                    json!({"token": t, "logprob": l - 1.0 - j as f64, "bytes": t.as_bytes()})
                })
                .collect();
            json!({"content": [{"token": text, "logprob": l, "bytes": text.as_bytes(), "top_logprobs": top}], "refusal": null})
        } else {
            let mut m = serde_json::Map::new();
            m.insert(text.to_string(), json!(l));
            for j in 0..k {
                m.insert(format!("alt{j}"), json!(l - 1.0 - j as f64));
            }
            json!({"tokens": [text], "token_logprobs": [l], "top_logprobs": [m], "text_offset": [0]})
        }
    };
    let mk = |text: &str, first: bool, fin: Option<&str>| -> String {
        if chat {
            let delta = if first {
                json!({"role": "assistant", "content": text})
            } else if fin.is_some() {
                json!({})
            } else {
                json!({"content": text})
            };
            let mut v = json!({"id": id, "object": "chat.completion.chunk", "created": 0, "model": req["model"], "system_fingerprint": o.name,
                "choices": [{"index": 0, "delta": delta, "finish_reason": fin}]});
            if want_lp.is_some() && fin.is_none() {
                v["choices"][0]["logprobs"] = scores(text);
            }
            v.to_string()
        } else {
            let mut v = json!({"id": id, "object": "text_completion", "created": 0, "model": req["model"], "system_fingerprint": o.name,
                "choices": [{"index": 0, "text": text, "finish_reason": fin}]});
            if want_lp.is_some() && fin.is_none() {
                v["choices"][0]["logprobs"] = scores(text);
            }
            v.to_string()
        }
    };
    if !sleep_or_close(st.jitter(o.jitter_ms, ttft), r).await {
        st.s.cancelled.fetch_add(1, Ordering::Relaxed);
        return None;
    }
    if let Some(answer) = structured(&req) {
        return structured_reply(
            st,
            &req,
            &id,
            &o.name,
            stream,
            usage_wanted,
            prompt_tokens,
            answer,
            w,
        )
        .await;
    }
    let usage = json!({"prompt_tokens": prompt_tokens, "completion_tokens": total, "total_tokens": prompt_tokens + total});
    if !stream {
        if !sleep_or_close(Duration::from_millis(o.itl_ms * total.saturating_sub(1)), r).await {
            st.s.cancelled.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let text = words(from, total);
        let b = if chat {
            json!({"id": id, "object": "chat.completion", "created": 0, "model": req["model"], "system_fingerprint": o.name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}], "usage": usage})
        } else {
            json!({"id": id, "object": "text_completion", "created": 0, "model": req["model"], "system_fingerprint": o.name,
                "choices": [{"index": 0, "text": text, "finish_reason": finish}], "usage": usage})
        };
        w.write_all(&response(200, "application/json", &b.to_string()))
            .await
            .ok()?;
        st.s.completed.fetch_add(1, Ordering::Relaxed);
        return Some(());
    }
    let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n";
    w.write_all(head.as_bytes()).await.ok()?;
    let mut buf = Vec::new();
    let mut i = 0u64;
    while i < total {
        if o.stall_after > 0 && i == o.stall_after {
            // Hang with the connection open until the client gives up.
            let mut b = [0u8; 1];
            let _ = r.read(&mut b).await;
            st.s.cancelled.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        if o.malformed_after > 0 && i == o.malformed_after {
            chunk(&mut buf, "{this is not json");
            w.write_all(&buf).await.ok()?;
            return None;
        }
        let mut n_burst = o.burst.min(total - i);
        if o.die_after > i {
            // A burst must not carry the dying stream past its last token.
            n_burst = n_burst.min(o.die_after - i);
        }
        for b in 0..n_burst {
            chunk(&mut buf, &mk(word(from + i + b), i + b == 0, None));
        }
        if w.write_all(&buf).await.is_err() {
            st.s.cancelled.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        buf.clear();
        i += n_burst;
        if o.die_after > 0 && i == o.die_after {
            // Die like a crashed server: linger 0 makes the close an RST,
            // with no final chunk and no [DONE] (handle() closes it).
            let _ = w.as_ref().set_zero_linger();
            st.s.killed.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        if i < total && !sleep_or_close(st.jitter(o.jitter_ms, o.itl_ms * n_burst), r).await {
            st.s.cancelled.fetch_add(1, Ordering::Relaxed);
            return None;
        }
    }
    chunk(&mut buf, &mk("", false, Some(finish)));
    if usage_wanted {
        let u = json!({"id": id, "object": if chat {"chat.completion.chunk"} else {"text_completion"}, "created": 0, "model": req["model"], "choices": [], "usage": usage});
        chunk(&mut buf, &u.to_string());
    }
    buf.extend_from_slice(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n");
    w.write_all(&buf).await.ok()?;
    st.s.completed.fetch_add(1, Ordering::Relaxed);
    Some(())
}

/// A value that fits `schema` (the first enum value, the minimum, the
/// required properties, `minItems` items): what a server that follows the
/// schema could answer.
fn instance(schema: &Value) -> Value {
    if let Some(c) = schema.get("const") {
        return c.clone();
    }
    if let Some(e) = schema["enum"].get(0) {
        return e.clone();
    }
    if let Some(a) = schema["anyOf"].get(0).or_else(|| schema["oneOf"].get(0)) {
        return instance(a);
    }
    let ty = match &schema["type"] {
        Value::Array(t) => t.first().and_then(Value::as_str).unwrap_or("null"),
        t => t.as_str().unwrap_or("object"),
    };
    match ty {
        "string" => json!("x".repeat(schema["minLength"].as_u64().unwrap_or(1).max(1) as usize)),
        "integer" => json!(schema["minimum"].as_i64().unwrap_or(1)),
        "number" => json!(schema["minimum"].as_f64().unwrap_or(1.5)),
        "boolean" => json!(true),
        "null" => Value::Null,
        "array" => {
            let n = schema["minItems"].as_u64().unwrap_or(1);
            json!((0..n)
                .map(|_| instance(&schema["items"]))
                .collect::<Vec<_>>())
        }
        _ => {
            let mut o = serde_json::Map::new();
            if let Some(props) = schema["properties"].as_object() {
                for (k, v) in props {
                    let required = schema["required"]
                        .as_array()
                        .is_none_or(|r| r.iter().any(|x| x == k));
                    if required {
                        o.insert(k.clone(), instance(v));
                    }
                }
            }
            Value::Object(o)
        }
    }
}

/// What a structured request is answered with: a tool call (the named
/// tool, else the first) or JSON for `response_format`.
enum Answer {
    Call(String, String),
    Json(String),
}

fn structured(req: &Value) -> Option<Answer> {
    let choice = &req["tool_choice"];
    if let Some(tools) = req["tools"]
        .as_array()
        .filter(|t| !t.is_empty() && choice != "none")
    {
        let named = choice["function"]["name"].as_str();
        let t = tools
            .iter()
            .find(|t| named.is_none_or(|n| t["function"]["name"] == n))
            .unwrap_or(&tools[0]);
        let args = instance(&t["function"]["parameters"]).to_string();
        return Some(Answer::Call(
            t["function"]["name"].as_str().unwrap_or("f").to_string(),
            args,
        ));
    }
    match req["response_format"]["type"].as_str() {
        Some("json_object") => Some(Answer::Json(json!({"fake": true}).to_string())),
        Some("json_schema") => Some(Answer::Json(
            instance(&req["response_format"]["json_schema"]["schema"]).to_string(),
        )),
        _ => None,
    }
}

/// Answer a structured request as vLLM does: `tool_calls` (streamed as an
/// opening delta with the id and name, then the arguments in pieces) with
/// `finish_reason: "tool_calls"`, or the JSON as content.
#[allow(clippy::too_many_arguments)]
async fn structured_reply(
    st: &Arc<State>,
    req: &Value,
    id: &str,
    name: &str,
    stream: bool,
    usage_wanted: bool,
    prompt_tokens: u64,
    answer: Answer,
    w: &mut tokio::net::tcp::OwnedWriteHalf,
) -> Option<()> {
    let usage = json!({"prompt_tokens": prompt_tokens, "completion_tokens": 8, "total_tokens": prompt_tokens + 8});
    let head = |choices: Value| json!({"id": id, "object": "chat.completion.chunk", "created": 0, "model": req["model"], "system_fingerprint": name, "choices": choices});
    if !stream {
        let (message, finish) = match &answer {
            Answer::Call(f, args) => (
                json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": format!("call_{id}"), "type": "function", "function": {"name": f, "arguments": args}}]}),
                "tool_calls",
            ),
            Answer::Json(j) => (json!({"role": "assistant", "content": j}), "stop"),
        };
        let b = json!({"id": id, "object": "chat.completion", "created": 0, "model": req["model"], "system_fingerprint": name,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}], "usage": usage});
        w.write_all(&response(200, "application/json", &b.to_string()))
            .await
            .ok()?;
        st.s.completed.fetch_add(1, Ordering::Relaxed);
        return Some(());
    }
    let h = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n";
    w.write_all(h.as_bytes()).await.ok()?;
    let mut buf = Vec::new();
    let finish = match &answer {
        Answer::Call(f, args) => {
            chunk(&mut buf, &head(json!([{"index": 0, "delta": {"role": "assistant", "content": null, "tool_calls": [
                {"index": 0, "id": format!("call_{id}"), "type": "function", "function": {"name": f, "arguments": ""}}]}, "finish_reason": null}])).to_string());
            let cut: Vec<char> = args.chars().collect();
            for piece in cut.chunks(cut.len().div_ceil(3).max(1)) {
                let p: String = piece.iter().collect();
                chunk(&mut buf, &head(json!([{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": p}}]}, "finish_reason": null}])).to_string());
            }
            "tool_calls"
        }
        Answer::Json(j) => {
            chunk(&mut buf, &head(json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}])).to_string());
            let cut: Vec<char> = j.chars().collect();
            for piece in cut.chunks(cut.len().div_ceil(3).max(1)) {
                let p: String = piece.iter().collect();
                chunk(
                    &mut buf,
                    &head(json!([{"index": 0, "delta": {"content": p}, "finish_reason": null}]))
                        .to_string(),
                );
            }
            "stop"
        }
    };
    chunk(
        &mut buf,
        &head(json!([{"index": 0, "delta": {}, "finish_reason": finish}])).to_string(),
    );
    if usage_wanted {
        let mut u = head(json!([]));
        u["usage"] = usage;
        chunk(&mut buf, &u.to_string());
    }
    buf.extend_from_slice(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n");
    w.write_all(&buf).await.ok()?;
    st.s.completed.fetch_add(1, Ordering::Relaxed);
    Some(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let o = match parse_opts() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("fake-openai: {e}");
            std::process::exit(2);
        }
    };
    let listener = match TcpListener::bind(&o.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("fake-openai: bind {}: {e}", o.listen);
            std::process::exit(1);
        }
    };
    match listener.local_addr() {
        Ok(a) => println!("listening on {a}"),
        Err(e) => {
            eprintln!("fake-openai: {e}");
            std::process::exit(1);
        }
    }
    let st = Arc::new(State {
        slots: Semaphore::new(o.capacity),
        o: Mutex::new(o),
        s: Stats::default(),
        last_body: Mutex::new(Value::Null),
        last_request_id: Mutex::new(Value::Null),
        last_traceparent: Mutex::new(Value::Null),
    });
    loop {
        if let Ok((sock, _)) = listener.accept().await {
            tokio::spawn(handle(st.clone(), sock));
        }
    }
}
