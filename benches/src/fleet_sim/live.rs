//! The live mode: replicas on loopback ports speaking OpenAI's streaming
//! API, and a load generator that replays a trace against an edge.
//!
//! A replica answers `POST /v1/chat/completions` and `/v1/completions`
//! (streamed as SSE with a usage chunk when asked, or whole), `GET
//! /metrics` with vLLM's names (`vllm:num_requests_running`,
//! `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`), `GET
//! /health`, `GET /stats` (requests, completed, cancelled, active,
//! speed) and `POST /control` (`{"speed": 0.33}`: the replica runs at that
//! speed from its next step). Its tokens come when its step model says.

use super::replica::{Out, Replica, Seq, StepModel};
use super::stats::Done;
use super::trace::Req;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Notify};

/// Largest request body a replica reads.
const MAX_BODY: usize = 8 << 20;

/// A token event to a request's connection: (first, last).
type Tx = mpsc::UnboundedSender<(bool, bool)>;

struct Sim {
    replica: Mutex<Replica>,
    streams: Mutex<HashMap<u64, Tx>>,
    wake: Notify,
    next: AtomicU64,
    requests: AtomicU64,
    completed: AtomicU64,
    cancelled: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Start one replica per speed on loopback; their addresses.
pub async fn serve(speeds: &[f64], model: StepModel) -> std::io::Result<Vec<SocketAddr>> {
    let mut out = Vec::new();
    for &s in speeds {
        let l = TcpListener::bind("127.0.0.1:0").await?;
        out.push(l.local_addr()?);
        let sim = Arc::new(Sim {
            replica: Mutex::new(Replica::new(model, s)),
            streams: Mutex::default(),
            wake: Notify::new(),
            next: AtomicU64::new(1),
            requests: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
        });
        tokio::spawn(stepper(sim.clone()));
        tokio::spawn(async move {
            while let Ok((sock, _)) = l.accept().await {
                tokio::spawn(conn(sim.clone(), sock));
            }
        });
    }
    Ok(out)
}

/// The replica's step loop: plan a step, wait its time, deliver its
/// tokens; sleep while idle.
async fn stepper(sim: Arc<Sim>) {
    loop {
        let step = lock(&sim.replica).step();
        let Some((dur, out)) = step else {
            sim.wake.notified().await;
            continue;
        };
        tokio::time::sleep(Duration::from_secs_f64(dur)).await;
        let streams = lock(&sim.streams);
        for Out::Token { id, first, last } in out {
            if let Some(tx) = streams.get(&id) {
                let _ = tx.send((first, last));
            }
        }
    }
}

struct Request {
    method: String,
    path: String,
    body: Vec<u8>,
}

async fn read_request(r: &mut BufReader<tokio::net::tcp::OwnedReadHalf>) -> Option<Request> {
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
    if len > MAX_BODY {
        return None;
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await.ok()?;
    Some(Request { method, path, body })
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

async fn conn(sim: Arc<Sim>, sock: TcpStream) {
    let _ = sock.set_nodelay(true);
    let (r, mut w) = sock.into_split();
    let mut r = BufReader::new(r);
    while let Some(req) = read_request(&mut r).await {
        let reply = match (req.method.as_str(), req.path.as_str()) {
            ("POST", "/v1/chat/completions") | ("POST", "/v1/completions") => {
                if complete(&sim, &req, &mut w).await.is_err() {
                    return;
                }
                continue;
            }
            ("GET", "/metrics") => {
                let g = lock(&sim.replica);
                let (waiting, running) = g.counts();
                let page = format!(
                    "vllm:num_requests_running{{model_name=\"sim\"}} {running}\nvllm:num_requests_waiting{{model_name=\"sim\"}} {waiting}\nvllm:kv_cache_usage_perc{{model_name=\"sim\"}} {}\n",
                    g.kv_usage()
                );
                response(200, "text/plain; version=0.0.4", &page)
            }
            ("GET", "/health") => response(200, "text/plain", "ok"),
            ("GET", "/v1/models") => response(
                200,
                "application/json",
                &json!({"object": "list", "data": [{"id": "sim", "object": "model"}]}).to_string(),
            ),
            ("GET", "/stats") => {
                let g = lock(&sim.replica);
                let (waiting, running) = g.counts();
                let v = json!({
                    "requests": sim.requests.load(Ordering::Relaxed),
                    "completed": sim.completed.load(Ordering::Relaxed),
                    "cancelled": sim.cancelled.load(Ordering::Relaxed),
                    "active": waiting + running,
                    "speed": g.speed,
                    "cache_saved_tokens": g.saved,
                });
                response(200, "application/json", &v.to_string())
            }
            ("POST", "/control") => {
                let v: Value = serde_json::from_slice(&req.body).unwrap_or(Value::Null);
                match v["speed"].as_f64().filter(|s| *s > 0.0 && *s <= 1000.0) {
                    Some(s) => {
                        lock(&sim.replica).speed = s;
                        response(200, "application/json", &json!({"speed": s}).to_string())
                    }
                    None => response(
                        400,
                        "application/json",
                        r#"{"error":"want {\"speed\": a number in (0, 1000]}"}"#,
                    ),
                }
            }
            _ => response(404, "application/json", r#"{"error":"not found"}"#),
        };
        if w.write_all(&reply).await.is_err() {
            return;
        }
    }
}

/// The prompt as the replica's cache and tokenizer see it: roles and
/// texts (a chat) or the text; four bytes a token.
fn rendered(v: &Value) -> Vec<u8> {
    match v["messages"].as_array() {
        Some(m) => {
            let mut p = Vec::new();
            for x in m {
                p.extend_from_slice(x["role"].as_str().unwrap_or("").as_bytes());
                p.push(0);
                p.extend_from_slice(x["content"].as_str().unwrap_or("").as_bytes());
                p.push(0);
            }
            p
        }
        None => v["prompt"].as_str().unwrap_or("").as_bytes().to_vec(),
    }
}

/// One completion, streamed or whole.
async fn complete(
    sim: &Arc<Sim>,
    req: &Request,
    w: &mut tokio::net::tcp::OwnedWriteHalf,
) -> std::io::Result<()> {
    let Ok(v) = serde_json::from_slice::<Value>(&req.body) else {
        return w
            .write_all(&response(
                400,
                "application/json",
                r#"{"error":{"message":"bad json"}}"#,
            ))
            .await;
    };
    let chat = req.path.ends_with("chat/completions");
    let prompt = rendered(&v);
    let tokens = prompt.len().div_ceil(4).max(1);
    let max = v["max_tokens"].as_u64().unwrap_or(16).clamp(1, 1 << 16) as usize;
    let stream = v["stream"].as_bool().unwrap_or(false);
    let usage = v["stream_options"]["include_usage"]
        .as_bool()
        .unwrap_or(false);
    let block_tokens = lock(&sim.replica).model.block_tokens;
    let blocks = ultrafast::inference::fleet::prefix::blocks(&prompt, block_tokens);
    let id = sim.next.fetch_add(1, Ordering::Relaxed);
    let (tx, mut rx) = mpsc::unbounded_channel();
    lock(&sim.streams).insert(id, tx);
    sim.requests.fetch_add(1, Ordering::Relaxed);
    lock(&sim.replica).submit(Seq::new(id, tokens, blocks, max));
    sim.wake.notify_one();
    let rid = format!("cmpl-sim-{id}");
    let piece = |i: usize| ["tok ", "en ", "sim ", "ul "][i % 4];
    let mut out = 0usize;
    let r = async {
        if stream {
            w.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n").await?;
        }
        let mut text = String::new();
        while let Some((_, last)) = rx.recv().await {
            let t = piece(out);
            out += 1;
            let finish = last.then_some("length");
            if stream {
                let data = if chat {
                    json!({"id": rid, "object": "chat.completion.chunk", "created": 0, "model": v["model"],
                        "choices": [{"index": 0, "delta": {"content": t}, "finish_reason": finish}]})
                } else {
                    json!({"id": rid, "object": "text_completion", "created": 0, "model": v["model"],
                        "choices": [{"index": 0, "text": t, "finish_reason": finish}]})
                };
                let mut buf = Vec::new();
                chunk(&mut buf, &data.to_string());
                w.write_all(&buf).await?;
            } else {
                text.push_str(t);
            }
            if last {
                break;
            }
        }
        let u = json!({"prompt_tokens": tokens, "completion_tokens": out, "total_tokens": tokens + out});
        if stream {
            let mut buf = Vec::new();
            if usage {
                let obj = if chat { "chat.completion.chunk" } else { "text_completion" };
                chunk(&mut buf, &json!({"id": rid, "object": obj, "created": 0, "model": v["model"], "choices": [], "usage": u}).to_string());
            }
            chunk(&mut buf, "[DONE]");
            buf.extend_from_slice(b"0\r\n\r\n");
            w.write_all(&buf).await
        } else {
            let body = if chat {
                json!({"id": rid, "object": "chat.completion", "created": 0, "model": v["model"],
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}], "usage": u})
            } else {
                json!({"id": rid, "object": "text_completion", "created": 0, "model": v["model"],
                    "choices": [{"index": 0, "text": text, "finish_reason": "length"}], "usage": u})
            };
            w.write_all(&response(200, "application/json", &body.to_string())).await
        }
    }
    .await;
    lock(&sim.streams).remove(&id);
    if r.is_err() || out < max {
        lock(&sim.replica).cancel(id);
        sim.cancelled.fetch_add(1, Ordering::Relaxed);
    } else {
        sim.completed.fetch_add(1, Ordering::Relaxed);
    }
    r
}

/// Replay `trace` against the edge at `edge` (streamed chats of `model`,
/// `headers` added), from now; every request bounded by `timeout`.
pub async fn load(
    edge: SocketAddr,
    model: &str,
    trace: &[Req],
    headers: &[(String, String)],
    timeout: Duration,
) -> Vec<Done> {
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(trace.len());
    for r in trace {
        let at = start + Duration::from_secs_f64(r.at);
        let body = json!({
            "model": model, "stream": true, "max_tokens": r.max_tokens,
            "messages": [{"role": "system", "content": r.system}, {"role": "user", "content": r.user}],
        })
        .to_string();
        let extra: String = headers
            .iter()
            .map(|(k, v)| format!("{k}: {v}\r\n"))
            .collect();
        let arrived = r.at;
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(at.into()).await;
            let sent = Instant::now();
            let mut d = tokio::time::timeout(timeout, one(edge, &body, &extra, sent))
                .await
                .unwrap_or_default();
            d.at = arrived;
            d
        }));
    }
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        out.push(t.await.unwrap_or_default());
    }
    out
}

/// One streamed request: its status, first token and end.
async fn one(edge: SocketAddr, body: &str, extra: &str, sent: Instant) -> Done {
    let mut d = Done::default();
    let Ok(mut s) = TcpStream::connect(edge).await else {
        return d;
    };
    let _ = s.set_nodelay(true);
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: edge\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n{extra}\r\n",
        body.len()
    );
    if s.write_all(head.as_bytes()).await.is_err() || s.write_all(body.as_bytes()).await.is_err() {
        return d;
    }
    let mut r = BufReader::new(s);
    let mut status = String::new();
    if r.read_line(&mut status).await.unwrap_or(0) == 0 {
        return d;
    }
    let code: u16 = status
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let mut chunked = false;
    loop {
        let mut h = String::new();
        if r.read_line(&mut h).await.unwrap_or(0) == 0 {
            return d;
        }
        let h = h.trim_end().to_ascii_lowercase();
        if h.is_empty() {
            break;
        }
        if h.starts_with("transfer-encoding:") && h.contains("chunked") {
            chunked = true;
        }
    }
    if code != 200 {
        d.refused_in = Some(sent.elapsed().as_secs_f64());
        return d;
    }
    d.admitted = true;
    let mut sse = Vec::new();
    loop {
        let data = if chunked {
            let mut line = String::new();
            if r.read_line(&mut line).await.unwrap_or(0) == 0 {
                break;
            }
            let n = usize::from_str_radix(line.trim(), 16).unwrap_or(0);
            if n == 0 {
                break;
            }
            let mut b = vec![0u8; n + 2];
            if r.read_exact(&mut b).await.is_err() {
                break;
            }
            b.truncate(n);
            b
        } else {
            let mut b = vec![0u8; 16 << 10];
            match r.read(&mut b).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    b.truncate(n);
                    b
                }
            }
        };
        sse.extend_from_slice(&data);
        while let Some(end) = sse.windows(2).position(|w| w == b"\n\n") {
            let ev: Vec<u8> = sse.drain(..end + 2).collect();
            let Some(payload) = ev.strip_prefix(b"data: ") else {
                continue;
            };
            if payload.starts_with(b"[DONE]") {
                d.e2e = Some(sent.elapsed().as_secs_f64());
                return d;
            }
            let Ok(v) = serde_json::from_slice::<Value>(payload) else {
                continue;
            };
            let text = v["choices"][0]["delta"]["content"].as_str().unwrap_or("");
            if !text.is_empty() {
                d.tokens += 1;
                if d.ttft.is_none() {
                    d.ttft = Some(sent.elapsed().as_secs_f64());
                }
            }
        }
    }
    d
}
