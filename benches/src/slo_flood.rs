//! slo-flood: a small load client for the SLA-aware admission benchmarks.
//!
//! It runs one or more groups of streaming OpenAI requests at the same
//! time against a loopback server (closed loop at a fixed concurrency, or
//! open loop at a constant arrival rate), each request on its own
//! connection over raw HTTP/1.1, and writes one JSON line per request:
//! status, time to the response head, time to the first content token (the
//! first SSE chunk whose `choices[0].delta.content` or `choices[0].text` is
//! non-empty), completion tokens, the `x-ultrafast-*` headers, the
//! predicted TTFT and the server's `ultrafast_timing`. A summary per group
//! goes to stderr. Latencies count from each request's latency origin: its
//! planned start in an open-loop group, its actual start in a closed loop.
//!
//! The design choice: one thread (a current-thread runtime with local
//! tasks), request bytes rendered once per group, responses decoded
//! incrementally as they arrive (`wire`), so the client takes as little CPU
//! as possible from the server it measures on a 2-core machine.
//!
//! Bounded: every request has a deadline (its group's `timeout_ms`), no
//! deadline reaches past the run cap (`run_cap_s`), and the process exits
//! by itself at the cap at the latest.
//!
//! Usage: slo-flood [--spec FILE|-] [--target ADDR] [--path P] [--model M]
//!   [--run-cap-s N] [--out FILE] [--group k=v,k=v ...]
//! e.g. `slo-flood --target 127.0.0.1:8080 --group name=flood,concurrency=200,count=200,lane=standard,max_tokens=128`
//! (spec keys: `slo_flood/spec.rs`).

#[path = "slo_flood/spec.rs"]
mod spec;
#[path = "slo_flood/wire.rs"]
mod wire;

use serde_json::{json, Value};
use spec::{Group, Load, Spec};
use std::cell::{Cell, RefCell};
use std::io::Write;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::{sleep_until, timeout_at, Instant};

/// What one request did. Times in ms: `t_*` from the run's start,
/// `*_ms` durations from the request's latency origin.
#[derive(Debug, Default)]
struct Record {
    t_origin: f64,
    t_sent: f64,
    status: u16,
    head_ms: Option<f64>,
    ttft_ms: Option<f64>,
    e2e_ms: f64,
    content_chunks: u64,
    usage_tokens: Option<u64>,
    complete: bool,
    shed: Option<String>,
    lane: Option<String>,
    predicted_header: Option<f64>,
    retry_after_ms: Option<f64>,
    body_predicted: Option<f64>,
    error_code: Option<String>,
    error: Option<String>,
    timing: Option<Value>,
}

impl Record {
    fn refused(&self) -> bool {
        self.status >= 400
    }

    fn json(&self, group: &str, i: u64) -> Value {
        let timing = self.timing.as_ref();
        let tf = |k: &str| timing.and_then(|t| t.get(k)).and_then(Value::as_f64);
        // The timing object's value has sub-ms precision; the header is whole ms.
        let predicted = tf("predicted_ttft_ms")
            .or(self.predicted_header)
            .or(self.body_predicted);
        json!({
            "group": group, "i": i, "t_origin_ms": self.t_origin, "t_sent_ms": self.t_sent,
            "status": self.status, "head_ms": self.head_ms, "ttft_ms": self.ttft_ms, "e2e_ms": self.e2e_ms,
            "completion_tokens": self.usage_tokens.unwrap_or(self.content_chunks),
            "content_chunks": self.content_chunks, "usage_completion_tokens": self.usage_tokens,
            "complete": self.complete, "shed": self.shed, "lane": self.lane,
            "predicted_ttft_ms": predicted, "predicted_ttft_ms_header": self.predicted_header,
            "server_ttft_ms": tf("ttft_ms"), "queue_ms": tf("queue_ms"),
            "retry_after_ms": self.retry_after_ms, "error_code": self.error_code, "error": self.error,
            "ultrafast_timing": self.timing,
        })
    }
}

fn ms_since(origin: Instant, now: Instant) -> f64 {
    now.saturating_duration_since(origin).as_secs_f64() * 1000.0
}

/// One SSE data payload of a stream.
fn on_event(rec: &mut Record, data: &str, origin: Instant, now: Instant) {
    if data == "[DONE]" {
        rec.complete = true;
        return;
    }
    let Ok(v) = serde_json::from_str::<Value>(data) else {
        rec.error
            .get_or_insert_with(|| "unparsable SSE chunk".into());
        return;
    };
    if let Some(e) = v.get("error") {
        rec.error_code = e
            .get("code")
            .or_else(|| e.get("type"))
            .and_then(Value::as_str)
            .map(String::from);
    }
    let c0 = &v["choices"][0];
    let content = c0["delta"]["content"].as_str().or(c0["text"].as_str());
    if content.is_some_and(|c| !c.is_empty()) {
        rec.content_chunks += 1;
        rec.ttft_ms.get_or_insert(ms_since(origin, now));
    }
    if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
        rec.usage_tokens = Some(n);
    }
    if let Some(t) = v.get("ultrafast_timing") {
        rec.timing = Some(t.clone());
    }
}

/// A whole (non-SSE) body: an error, or a non-streamed completion.
fn on_body(rec: &mut Record, body: &[u8], origin: Instant, now: Instant) {
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return;
    };
    if let Some(e) = v.get("error") {
        rec.error_code = e
            .get("code")
            .filter(|c| !c.is_null())
            .or_else(|| e.get("type"))
            .and_then(Value::as_str)
            .map(String::from);
    }
    rec.retry_after_ms = v["retry_after_ms"].as_f64().or(rec.retry_after_ms);
    rec.body_predicted = v["predicted_ttft_ms"].as_f64();
    if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
        rec.usage_tokens = Some(n);
        rec.complete = true;
    }
    let c0 = &v["choices"][0];
    let content = c0["message"]["content"].as_str().or(c0["text"].as_str());
    if content.is_some_and(|c| !c.is_empty()) {
        rec.ttft_ms.get_or_insert(ms_since(origin, now));
    }
}

/// Send one request and read its response into `rec` as it arrives (so a
/// deadline that cuts it short keeps what was seen).
async fn exchange(
    rec: &mut Record,
    target: SocketAddr,
    request: &[u8],
    origin: Instant,
) -> Result<(), String> {
    let mut sock = TcpStream::connect(target)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let _ = sock.set_nodelay(true);
    sock.write_all(request)
        .await
        .map_err(|e| format!("write: {e}"))?;
    let mut resp = wire::Response::new();
    let mut buf = vec![0u8; 16 * 1024];
    let mut events = Vec::new();
    loop {
        let n = sock
            .read(&mut buf)
            .await
            .map_err(|e| format!("read: {e}"))?;
        let now = Instant::now();
        let had_head = resp.head().is_some();
        if n == 0 {
            resp.eof(&mut events).map_err(|e| format!("wire: {e}"))?;
        } else {
            resp.feed(&buf[..n], &mut events)
                .map_err(|e| format!("wire: {e}"))?;
        }
        if let (false, Some(h)) = (had_head, resp.head()) {
            rec.head_ms = Some(ms_since(origin, now));
            rec.status = h.status;
            rec.shed = h.get("x-ultrafast-shed").map(String::from);
            rec.lane = h.get("x-ultrafast-lane").map(String::from);
            rec.predicted_header = h
                .get("x-ultrafast-predicted-ttft-ms")
                .and_then(|v| v.parse().ok());
            rec.retry_after_ms = h
                .get("retry-after")
                .and_then(|v| v.parse::<f64>().ok())
                .map(|s| s * 1000.0);
        }
        for ev in events.drain(..) {
            on_event(rec, &ev, origin, now);
        }
        if resp.is_done() || n == 0 {
            if resp.head().is_some_and(|h| {
                h.get("content-type")
                    .is_none_or(|c| !c.starts_with("text/event-stream"))
            }) {
                on_body(rec, resp.body(), origin, now);
            }
            return Ok(());
        }
    }
}

/// Shared state of a run: its clock, cap, output and tallies.
struct Run {
    t0: Instant,
    cap: Instant,
    target: SocketAddr,
    out: RefCell<Box<dyn Write>>,
    tallies: RefCell<Vec<Vec<Record>>>,
}

impl Run {
    async fn one(&self, g: &Group, gi: usize, i: u64, origin: Instant) -> (bool, Option<f64>) {
        let mut rec = Record {
            t_origin: ms_since(self.t0, origin),
            t_sent: ms_since(self.t0, Instant::now()),
            ..Record::default()
        };
        let deadline = (origin + g.timeout).min(self.cap);
        match timeout_at(
            deadline,
            exchange(&mut rec, self.target, &g.request.render(i), origin),
        )
        .await
        {
            Ok(Ok(())) => {}
            Ok(Err(e)) => rec.error = Some(e),
            Err(_) => {
                rec.error = Some(if deadline == self.cap {
                    "run cap".into()
                } else {
                    "timeout".into()
                })
            }
        }
        rec.e2e_ms = ms_since(origin, Instant::now());
        let line = rec.json(&g.name, i).to_string();
        if let Err(e) = writeln!(self.out.borrow_mut(), "{line}") {
            eprintln!("slo-flood: write: {e}");
        }
        let result = (rec.refused(), rec.retry_after_ms);
        // Tallies keep only what the summary needs: the record, minus timing.
        rec.timing = None;
        if let Some(t) = self.tallies.borrow_mut().get_mut(gi) {
            t.push(rec);
        }
        result
    }
}

/// Closed loop: `n` workers, each starting its next request when the last ends.
async fn closed(run: Rc<Run>, g: Rc<Group>, gi: usize, n: usize) {
    let start = run.t0 + g.start_delay;
    sleep_until(start).await;
    let stop = g.duration.map_or(run.cap, |d| (start + d).min(run.cap));
    let next = Rc::new(Cell::new(0u64));
    let mut workers = Vec::with_capacity(n);
    for _ in 0..n {
        let (run, g, next) = (run.clone(), g.clone(), next.clone());
        workers.push(tokio::task::spawn_local(async move {
            loop {
                let (now, i) = (Instant::now(), next.get());
                if now >= stop || i >= g.count {
                    return;
                }
                next.set(i + 1);
                let (refused, retry) = run.one(&g, gi, i, now).await;
                if refused && g.honor_retry_after {
                    // No Retry-After (a 4xx): a short pause all the same, so a
                    // refusing server is not hammered in a tight loop.
                    let pause = retry
                        .filter(|ms| ms.is_finite() && *ms >= 0.0)
                        .map_or(Duration::from_millis(100), |ms| {
                            Duration::from_secs_f64(ms / 1000.0)
                        })
                        .max(Duration::from_millis(10));
                    sleep_until((Instant::now() + pause.min(g.max_backoff)).min(stop)).await;
                }
            }
        }));
    }
    for w in workers {
        let _ = w.await;
    }
}

/// Open loop: request i planned at start + i / rate, started on time
/// whatever the earlier ones are doing.
async fn open(run: Rc<Run>, g: Rc<Group>, gi: usize, rate: f64) {
    let start = run.t0 + g.start_delay;
    let stop = g.duration.map_or(run.cap, |d| (start + d).min(run.cap));
    let mut tasks = Vec::new();
    for i in 0..g.count {
        let planned = start + Duration::from_secs_f64(i as f64 / rate);
        if planned >= stop {
            break;
        }
        sleep_until(planned).await;
        let (run, g) = (run.clone(), g.clone());
        tasks.push(tokio::task::spawn_local(async move {
            run.one(&g, gi, i, planned).await;
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
}

fn pct(v: &mut [f64], q: f64) -> String {
    if v.is_empty() {
        return "-".into();
    }
    v.sort_by(f64::total_cmp);
    let i = ((q * v.len() as f64) as usize).min(v.len() - 1);
    format!("{:.1}", v[i])
}

/// One summary line per group on stderr.
fn summary(spec: &Spec, run: &Run) {
    let tallies = run.tallies.borrow();
    for (g, recs) in spec.groups.iter().zip(tallies.iter()) {
        let mut statuses = std::collections::BTreeMap::<String, usize>::new();
        for r in recs {
            let k = match (&r.error, &r.shed) {
                (Some(e), _) if r.status == 0 => e.split(':').next().unwrap_or("error").to_string(),
                (_, Some(s)) => format!("{}:{s}", r.status),
                _ => r.status.to_string(),
            };
            *statuses.entry(k).or_default() += 1;
        }
        let ok: Vec<&Record> = recs.iter().filter(|r| r.status == 200).collect();
        let mut ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_ms).collect();
        let mut refusal: Vec<f64> = recs
            .iter()
            .filter(|r| r.refused())
            .map(|r| r.e2e_ms)
            .collect();
        let tokens: u64 = ok
            .iter()
            .map(|r| r.usage_tokens.unwrap_or(r.content_chunks))
            .sum();
        eprintln!(
            "slo-flood: {} ({:?}, lane {}): {} requests {:?}; admitted TTFT p50 {} p99 {} ms; refusal p50 {} p99 {} ms; {} completion tokens",
            g.name, g.load, g.lane.as_deref().unwrap_or("-"), recs.len(), statuses,
            pct(&mut ttft, 0.5), pct(&mut ttft, 0.99), pct(&mut refusal, 0.5), pct(&mut refusal, 0.99), tokens
        );
    }
}

fn read_spec(args: &[String]) -> Result<(Spec, Option<String>), String> {
    let mut spec = json!({"groups": []});
    let mut groups = Vec::new();
    let mut overrides = Vec::new();
    let mut out = None;
    let mut i = 0;
    while i < args.len() {
        let v = args
            .get(i + 1)
            .ok_or(format!("{} needs a value", args[i]))?;
        match args[i].as_str() {
            "--spec" => {
                let text = if v == "-" {
                    std::io::read_to_string(std::io::stdin()).map_err(|e| format!("stdin: {e}"))?
                } else {
                    std::fs::read_to_string(v).map_err(|e| format!("{v}: {e}"))?
                };
                spec = serde_json::from_str(&text).map_err(|e| format!("{v}: {e}"))?;
            }
            "--target" | "--path" | "--model" => {
                overrides.push((args[i][2..].to_string(), json!(v)))
            }
            "--run-cap-s" => {
                let cap = v.parse::<f64>().map_err(|_| format!("--run-cap-s: {v}"))?;
                overrides.push(("run_cap_s".into(), json!(cap)));
            }
            "--out" => out = Some(v.clone()),
            "--group" => groups.push(spec::group_flag(v)?),
            other => return Err(format!("unknown flag {other}")),
        }
        i += 2;
    }
    if !spec.is_object() {
        return Err("spec: expected a JSON object".into());
    }
    for (k, v) in overrides {
        spec[k] = v;
    }
    if !groups.is_empty() {
        spec["groups"] = Value::Array(groups);
    }
    Ok((spec::parse(&spec)?, out))
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.is_empty() || args.iter().any(|a| a == "-h" || a == "--help") {
        eprintln!("usage: slo-flood [--spec FILE|-] [--target ADDR] [--path P] [--model M] [--run-cap-s N] [--out FILE] [--group k=v,...]");
        std::process::exit(2);
    }
    let (spec, out) = match read_spec(&args) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("slo-flood: {e}");
            std::process::exit(2);
        }
    };
    let out: Box<dyn Write> = match out.as_deref() {
        None | Some("-") => Box::new(std::io::BufWriter::new(std::io::stdout())),
        Some(p) => match std::fs::File::create(p) {
            Ok(f) => Box::new(std::io::BufWriter::new(f)),
            Err(e) => {
                eprintln!("slo-flood: {p}: {e}");
                std::process::exit(2);
            }
        },
    };
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("slo-flood: runtime: {e}");
            std::process::exit(1);
        }
    };
    let local = tokio::task::LocalSet::new();
    let run = local.block_on(&rt, async {
        let t0 = Instant::now();
        let run = Rc::new(Run {
            t0,
            cap: t0 + spec.run_cap,
            target: spec.target,
            out: RefCell::new(out),
            tallies: RefCell::new(spec.groups.iter().map(|_| Vec::new()).collect()),
        });
        let mut tasks = Vec::new();
        for (gi, g) in spec.groups.iter().enumerate() {
            let (g, run) = (g.clone(), run.clone());
            tasks.push(tokio::task::spawn_local(async move {
                match g.load {
                    Load::Concurrency(n) => closed(run, g, gi, n).await,
                    Load::Rate(r) => open(run, g, gi, r).await,
                }
            }));
        }
        // Every request's deadline is at most the cap; the grace is for the
        // bookkeeping after it.
        let all = async {
            for t in tasks {
                let _ = t.await;
            }
        };
        if timeout_at(run.cap + Duration::from_secs(2), all)
            .await
            .is_err()
        {
            eprintln!("slo-flood: run cap reached with work left; exiting");
        }
        run
    });
    if let Err(e) = run.out.borrow_mut().flush() {
        eprintln!("slo-flood: flush: {e}");
    }
    summary(&spec, &run);
}
