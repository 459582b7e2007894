//! A fake OpenAI-compatible inference server: stands in for a GPU farm in
//! tests and benchmarks (never where the real engine can serve).
//!
//! It speaks the real protocol: `POST /v1/chat/completions` and
//! `/v1/completions`, streaming (`data: {chunk}` events, a usage chunk when
//! asked, `data: [DONE]`) or whole JSON, `GET /v1/models`, `GET /health`.
//! Its behaviour is set by flags: time to first token and inter-token
//! interval with jitter, tokens delivered in bursts, a capacity limit with
//! its own FIFO queue (so it behaves like a loaded vLLM), failures of the
//! first N requests, a stall or malformed SSE after N tokens. `GET /stats`
//! reports counters (requests, active, completed, cancelled) and the last
//! request body, so tests can see what the proxy sent and cancelled.
//!
//! Usage: fake-openai [--listen ADDR] [--name NAME] [--ttft-ms N]
//!   [--itl-ms N] [--jitter-ms N] [--burst N] [--tokens N] [--capacity N]
//!   [--fail-first N] [--stall-after N] [--malformed-after N]
//! Prints `listening on ADDR` once bound.

use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Mutex, Semaphore};

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
}

#[derive(Default)]
struct Stats {
    requests: AtomicU64,
    active: AtomicU64,
    completed: AtomicU64,
    cancelled: AtomicU64,
    failed: AtomicU64,
    rng: AtomicU64,
}

struct State {
    o: Opts,
    s: Stats,
    slots: Semaphore,
    last_body: Mutex<Value>,
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
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
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
            other => return Err(format!("unknown flag {other}")),
        }
        i += 2;
    }
    Ok(o)
}

impl State {
    /// Uniform jitter in [-j, +j] ms (splitmix64).
    fn jitter(&self, base: u64) -> Duration {
        let j = self.o.jitter_ms;
        if j == 0 {
            return Duration::from_millis(base);
        }
        let mut z = self
            .s
            .rng
            .fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        let r = (z ^ (z >> 31)) % (2 * j + 1);
        Duration::from_millis((base + r).saturating_sub(j))
    }
}

const WORDS: &[&str] = &[
    "The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", ".",
];

async fn read_request(
    r: &mut BufReader<tokio::net::tcp::OwnedReadHalf>,
) -> Option<(String, String, Vec<u8>)> {
    let mut line = String::new();
    if r.read_line(&mut line).await.ok()? == 0 {
        return None;
    }
    let mut parts = line.split_whitespace();
    let method = parts.next()?.to_string();
    let path = parts.next()?.to_string();
    let mut len = 0usize;
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
            }
        }
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await.ok()?;
    Some((method, path, body))
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
    while let Some((method, path, body)) = read_request(&mut r).await {
        let out = match (method.as_str(), path.as_str()) {
            ("GET", "/health") => response(200, "text/plain", "ok"),
            ("GET", "/v1/models") => response(
                200,
                "application/json",
                &json!({"object": "list", "data": [{"id": st.o.name, "object": "model", "created": 0, "owned_by": "fake"}]}).to_string(),
            ),
            ("GET", "/stats") => {
                let s = &st.s;
                let v = json!({"requests": s.requests.load(Ordering::Relaxed), "active": s.active.load(Ordering::Relaxed),
                    "completed": s.completed.load(Ordering::Relaxed), "cancelled": s.cancelled.load(Ordering::Relaxed),
                    "failed": s.failed.load(Ordering::Relaxed), "last_body": *st.last_body.lock().await, "name": st.o.name});
                response(200, "application/json", &v.to_string())
            }
            ("POST", "/v1/chat/completions") | ("POST", "/v1/completions") => {
                let chat = path.ends_with("chat/completions");
                match complete(&st, chat, &body, &mut r, &mut w).await {
                    Some(()) => continue,
                    None => return,
                }
            }
            _ => response(404, "application/json", r#"{"error":{"message":"not found","type":"invalid_request_error","param":null,"code":null}}"#),
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
    let n = st.s.requests.fetch_add(1, Ordering::Relaxed);
    let req: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => {
            let b = json!({"error": {"message": format!("bad json: {e}"), "type": "invalid_request_error", "param": null, "code": null}});
            w.write_all(&response(400, "application/json", &b.to_string()))
                .await
                .ok()?;
            return Some(());
        }
    };
    *st.last_body.lock().await = req.clone();
    if n < st.o.fail_first {
        st.s.failed.fetch_add(1, Ordering::Relaxed);
        let b = r#"{"error":{"message":"fake overload","type":"server_error","param":null,"code":null}}"#;
        w.write_all(&response(500, "application/json", b))
            .await
            .ok()?;
        return Some(());
    }
    let stream = req["stream"].as_bool().unwrap_or(false);
    let usage_wanted = req["stream_options"]["include_usage"]
        .as_bool()
        .unwrap_or(false);
    let max = req["max_tokens"].as_u64().unwrap_or(u64::MAX);
    let total = st.o.tokens.min(max);
    let finish = if max <= st.o.tokens { "length" } else { "stop" };
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
    let mk = |text: &str, first: bool, fin: Option<&str>| -> String {
        if chat {
            let delta = if first {
                json!({"role": "assistant", "content": text})
            } else if fin.is_some() {
                json!({})
            } else {
                json!({"content": text})
            };
            json!({"id": id, "object": "chat.completion.chunk", "created": 0, "model": req["model"], "system_fingerprint": st.o.name,
                "choices": [{"index": 0, "delta": delta, "finish_reason": fin}]}).to_string()
        } else {
            json!({"id": id, "object": "text_completion", "created": 0, "model": req["model"], "system_fingerprint": st.o.name,
                "choices": [{"index": 0, "text": text, "finish_reason": fin}]}).to_string()
        }
    };
    if !sleep_or_close(st.jitter(st.o.ttft_ms), r).await {
        st.s.cancelled.fetch_add(1, Ordering::Relaxed);
        return None;
    }
    let usage = json!({"prompt_tokens": prompt_tokens, "completion_tokens": total, "total_tokens": prompt_tokens + total});
    if !stream {
        if !sleep_or_close(
            Duration::from_millis(st.o.itl_ms * total.saturating_sub(1)),
            r,
        )
        .await
        {
            st.s.cancelled.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let text: String = (0..total)
            .map(|i| WORDS[i as usize % WORDS.len()])
            .collect();
        let b = if chat {
            json!({"id": id, "object": "chat.completion", "created": 0, "model": req["model"], "system_fingerprint": st.o.name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}], "usage": usage})
        } else {
            json!({"id": id, "object": "text_completion", "created": 0, "model": req["model"], "system_fingerprint": st.o.name,
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
        if st.o.stall_after > 0 && i == st.o.stall_after {
            // Hang with the connection open until the client gives up.
            let mut b = [0u8; 1];
            let _ = r.read(&mut b).await;
            st.s.cancelled.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        if st.o.malformed_after > 0 && i == st.o.malformed_after {
            chunk(&mut buf, "{this is not json");
            w.write_all(&buf).await.ok()?;
            return None;
        }
        let n_burst = st.o.burst.min(total - i);
        for k in 0..n_burst {
            chunk(
                &mut buf,
                &mk(WORDS[((i + k) as usize) % WORDS.len()], i + k == 0, None),
            );
        }
        if w.write_all(&buf).await.is_err() {
            st.s.cancelled.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        buf.clear();
        i += n_burst;
        if i < total && !sleep_or_close(st.jitter(st.o.itl_ms * n_burst), r).await {
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
        o,
        s: Stats::default(),
        last_body: Mutex::new(Value::Null),
    });
    loop {
        if let Ok((sock, _)) = listener.accept().await {
            tokio::spawn(handle(st.clone(), sock));
        }
    }
}
