//! The run description of `slo-flood`: a JSON spec (file, stdin or
//! `--group k=v,...` flags) checked into typed groups, each with its
//! request bytes rendered once up front.
//!
//! Spec: `{"target": "127.0.0.1:PORT", "path": "/v1/chat/completions",
//! "model": NAME, "run_cap_s": 300, "groups": [GROUP, ...]}`; a group:
//! `{"name", "concurrency": N | "rate": PER_S, "count": N, "duration_s",
//! "start_delay_ms", "lane", "prompt", "prompt_repeat", "unique_prompt",
//! "marker_base",
//! "max_tokens", "stream", "timeout_ms", "honor_retry_after",
//! "max_backoff_ms", "headers": {..}, "extra": {..}}` (`extra` is merged
//! into the request body, e.g. `{"temperature": 0}`). Unknown keys are errors, so a typo
//! never silently runs a different load.

use serde_json::{json, Map, Value};
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Duration;

/// How a group offers load.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Load {
    /// Closed loop: this many requests in flight, each worker starting its
    /// next request when the previous one ends.
    Concurrency(usize),
    /// Open loop: request i planned at start + i / rate, latency counted
    /// from the planned time (no coordinated omission).
    Rate(f64),
}

/// One group of identical requests.
#[derive(Debug)]
pub struct Group {
    /// Label written on every record.
    pub name: String,
    /// Offered load.
    pub load: Load,
    /// Requests at most.
    pub count: u64,
    /// Start no request after this long from the group's start.
    pub duration: Option<Duration>,
    /// Delay from the run's start to the group's start.
    pub start_delay: Duration,
    /// `X-Request-Priority` value (none: header not sent).
    pub lane: Option<String>,
    /// Deadline of each request, from its latency origin.
    pub timeout: Duration,
    /// Closed loop: after a refusal, pause as long as the server asks.
    pub honor_retry_after: bool,
    /// Longest such pause.
    pub max_backoff: Duration,
    /// The HTTP request, rendered once around the per-request marker.
    pub request: Template,
}

/// A request rendered up front, split where each request's own marker goes
/// (`#i: ` before the prompt, so no two prompts share a prefix-cache entry
/// beyond the chat template; empty when `unique_prompt` is false).
#[derive(Debug)]
pub struct Template {
    head: String,
    body_pre: String,
    body_post: String,
    unique: bool,
    /// Added to the request index in the marker, so that two groups with
    /// the same prompt never share a prefix-cache entry either.
    base: u64,
}

/// Where the marker goes in the rendered body.
const MARK: &str = "@@SLOFLOOD@@";

impl Template {
    /// Request `i`'s bytes.
    pub fn render(&self, i: u64) -> Vec<u8> {
        let id = if self.unique {
            format!("#{}: ", self.base + i)
        } else {
            String::new()
        };
        let len = self.body_pre.len() + id.len() + self.body_post.len();
        let mut out = Vec::with_capacity(self.head.len() + 32 + len);
        out.extend_from_slice(self.head.as_bytes());
        out.extend_from_slice(
            format!("Content-Length: {len}\r\nConnection: close\r\n\r\n").as_bytes(),
        );
        for part in [&self.body_pre, &id, &self.body_post] {
            out.extend_from_slice(part.as_bytes());
        }
        out
    }
}

/// The whole run.
#[derive(Debug)]
pub struct Spec {
    /// Server address (loopback only).
    pub target: SocketAddr,
    /// Nothing runs past this, from the run's start.
    pub run_cap: Duration,
    /// Groups, all started together (each after its own delay).
    pub groups: Vec<Rc<Group>>,
}

const TOP_KEYS: &[&str] = &["target", "path", "model", "run_cap_s", "groups"];
const GROUP_KEYS: &[&str] = &[
    "name",
    "concurrency",
    "rate",
    "count",
    "duration_s",
    "start_delay_ms",
    "lane",
    "prompt",
    "prompt_repeat",
    "unique_prompt",
    "marker_base",
    "max_tokens",
    "stream",
    "timeout_ms",
    "honor_retry_after",
    "max_backoff_ms",
    "headers",
    "extra",
];

fn unknown(o: &Map<String, Value>, known: &[&str], at: &str) -> Result<(), String> {
    match o.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) => Err(format!(
            "{at}: unknown key `{k}` (known: {})",
            known.join(", ")
        )),
        None => Ok(()),
    }
}

fn num(o: &Map<String, Value>, k: &str, at: &str) -> Result<Option<f64>, String> {
    match o.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .filter(|x| x.is_finite() && *x >= 0.0)
            .map(Some)
            .ok_or(format!("{at}.{k}: expected a number >= 0, got {v}")),
    }
}

fn text(o: &Map<String, Value>, k: &str, at: &str) -> Result<Option<String>, String> {
    match o.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => Err(format!("{at}.{k}: expected a string, got {v}")),
    }
}

fn flag(o: &Map<String, Value>, k: &str, at: &str, default: bool) -> Result<bool, String> {
    match o.get(k) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(format!("{at}.{k}: expected true or false, got {v}")),
    }
}

fn ms(x: f64) -> Duration {
    Duration::from_secs_f64(x / 1000.0)
}

/// Check a spec and render its requests.
pub fn parse(v: &Value) -> Result<Spec, String> {
    let o = v.as_object().ok_or("spec: expected a JSON object")?;
    unknown(o, TOP_KEYS, "spec")?;
    let target: SocketAddr = text(o, "target", "spec")?
        .ok_or("spec.target: required (127.0.0.1:PORT)")?
        .parse()
        .map_err(|e| format!("spec.target: {e}"))?;
    if !target.ip().is_loopback() {
        return Err(format!("spec.target: {target} is not a loopback address"));
    }
    let path = text(o, "path", "spec")?.unwrap_or("/v1/chat/completions".into());
    let model = text(o, "model", "spec")?.unwrap_or("smollm2-135m-instruct".into());
    let run_cap = num(o, "run_cap_s", "spec")?.unwrap_or(300.0);
    if run_cap <= 0.0 || run_cap > 3600.0 {
        return Err("spec.run_cap_s: must be in (0, 3600]".into());
    }
    let groups = o
        .get("groups")
        .and_then(Value::as_array)
        .ok_or("spec.groups: expected a non-empty array")?;
    if groups.is_empty() {
        return Err("spec.groups: expected a non-empty array".into());
    }
    let groups = groups
        .iter()
        .enumerate()
        .map(|(i, g)| group(g, i, target, &path, &model))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Spec {
        target,
        run_cap: Duration::from_secs_f64(run_cap),
        groups,
    })
}

fn group(
    v: &Value,
    i: usize,
    target: SocketAddr,
    path: &str,
    model: &str,
) -> Result<Rc<Group>, String> {
    let at = format!("groups[{i}]");
    let o = v.as_object().ok_or(format!("{at}: expected an object"))?;
    unknown(o, GROUP_KEYS, &at)?;
    let load = match (num(o, "concurrency", &at)?, num(o, "rate", &at)?) {
        (Some(c), None) if (1.0..=10_000.0).contains(&c) => Load::Concurrency(c as usize),
        (None, Some(r)) if r > 0.0 && r <= 1e5 => Load::Rate(r),
        _ => {
            return Err(format!(
                "{at}: give exactly one of concurrency (1..10000) or rate (> 0 per s)"
            ))
        }
    };
    let count = num(o, "count", &at)?.ok_or(format!("{at}.count: required"))? as u64;
    if count == 0 || count > 1_000_000 {
        return Err(format!("{at}.count: must be in 1..1000000"));
    }
    let lane = text(o, "lane", &at)?.filter(|l| !l.is_empty());
    let prompt = text(o, "prompt", &at)?.unwrap_or("Hello".into());
    let repeat = num(o, "prompt_repeat", &at)?.unwrap_or(1.0).max(1.0) as usize;
    let max_tokens = num(o, "max_tokens", &at)?.unwrap_or(16.0) as u64;
    let stream = flag(o, "stream", &at, true)?;
    let prompt = format!("{MARK}{}", prompt.repeat(repeat));
    let mut body = if path.contains("chat") {
        json!({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": stream})
    } else {
        json!({"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": stream})
    };
    if stream {
        body["stream_options"] = json!({"include_usage": true});
    }
    match o.get("extra") {
        None | Some(Value::Null) => {}
        Some(Value::Object(extra)) => extra.iter().for_each(|(k, v)| body[k] = v.clone()),
        Some(v) => return Err(format!("{at}.extra: expected an object, got {v}")),
    }
    let body = body.to_string();
    let (body_pre, body_post) = body
        .split_once(MARK)
        .ok_or(format!("{at}: the request body lost its marker"))?;
    let mut head = format!(
        "POST {path} HTTP/1.1\r\nHost: {target}\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\n"
    );
    if let Some(l) = &lane {
        head.push_str(&format!("X-Request-Priority: {l}\r\n"));
    }
    match o.get("headers") {
        None | Some(Value::Null) => {}
        Some(Value::Object(h)) => {
            for (k, v) in h {
                let v = v
                    .as_str()
                    .ok_or(format!("{at}.headers.{k}: expected a string"))?;
                if k.contains(['\r', '\n', ':']) || v.contains(['\r', '\n']) {
                    return Err(format!("{at}.headers.{k}: bad header"));
                }
                head.push_str(&format!("{k}: {v}\r\n"));
            }
        }
        Some(v) => return Err(format!("{at}.headers: expected an object, got {v}")),
    }
    let request = Template {
        head,
        body_pre: body_pre.into(),
        body_post: body_post.into(),
        unique: flag(o, "unique_prompt", &at, true)?,
        base: num(o, "marker_base", &at)?.unwrap_or(0.0).max(0.0) as u64,
    };
    Ok(Rc::new(Group {
        name: text(o, "name", &at)?.unwrap_or(format!("g{i}")),
        load,
        count,
        duration: num(o, "duration_s", &at)?.map(Duration::from_secs_f64),
        start_delay: ms(num(o, "start_delay_ms", &at)?.unwrap_or(0.0)),
        lane,
        timeout: ms(num(o, "timeout_ms", &at)?.unwrap_or(120_000.0)),
        honor_retry_after: flag(o, "honor_retry_after", &at, true)?,
        max_backoff: ms(num(o, "max_backoff_ms", &at)?.unwrap_or(2000.0)),
        request,
    }))
}

/// A `--group k=v,k=v` flag as a spec group object. Values that parse as
/// numbers or booleans become those, except text keys; a prompt with commas
/// belongs in a JSON spec.
pub fn group_flag(s: &str) -> Result<Value, String> {
    let mut o = Map::new();
    for kv in s.split(',').filter(|kv| !kv.is_empty()) {
        let (k, v) = kv
            .split_once('=')
            .ok_or(format!("--group: `{kv}` is not key=value"))?;
        let value = if matches!(k, "name" | "lane" | "prompt") {
            Value::String(v.into())
        } else if let Ok(b) = v.parse::<bool>() {
            Value::Bool(b)
        } else if let Ok(n) = v.parse::<f64>() {
            json!(n)
        } else {
            Value::String(v.into())
        };
        o.insert(k.into(), value);
    }
    Ok(Value::Object(o))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_renders() {
        let g = group_flag("name=f,concurrency=4,count=8,lane=ultra,max_tokens=32,prompt=hi there")
            .unwrap();
        let g1 =
            json!({"rate": 2.5, "count": 3, "extra": {"temperature": 0}, "unique_prompt": false});
        let s = parse(&json!({"target": "127.0.0.1:9", "groups": [g, g1]})).unwrap();
        assert_eq!(s.groups[0].load, Load::Concurrency(4));
        assert_eq!(s.groups[1].load, Load::Rate(2.5));
        let req = String::from_utf8(s.groups[0].request.render(7)).unwrap();
        assert!(req.starts_with("POST /v1/chat/completions HTTP/1.1\r\n"));
        assert!(req.contains("X-Request-Priority: ultra\r\n"));
        let (head, body) = req.split_once("\r\n\r\n").unwrap();
        assert!(head.contains(&format!("Content-Length: {}", body.len())));
        let b: Value = serde_json::from_str(body).unwrap();
        assert_eq!(b["max_tokens"], 32);
        assert_eq!(b["messages"][0]["content"], "#7: hi there");
        assert_eq!(b["stream_options"]["include_usage"], true);
        let r1 = String::from_utf8(s.groups[1].request.render(12345)).unwrap();
        let (h1, b1) = r1.split_once("\r\n\r\n").unwrap();
        assert!(h1.contains(&format!("Content-Length: {}", b1.len())));
        assert!(!r1.contains("X-Request-Priority"));
        assert!(r1.contains("\"temperature\":0"));
        assert!(r1.contains("\"content\":\"Hello\""));
        let g2 = json!({"concurrency": 1, "count": 1, "prompt": "hi", "marker_base": 200});
        let s = parse(&json!({"target": "127.0.0.1:9", "groups": [g2]})).unwrap();
        let r2 = String::from_utf8(s.groups[0].request.render(3)).unwrap();
        assert!(r2.contains("\"content\":\"#203: hi\""), "{r2}");
    }

    #[test]
    fn refuses_bad_specs() {
        let bad = [
            json!({"target": "10.0.0.1:80", "groups": [{"rate": 1, "count": 1}]}),
            json!({"target": "127.0.0.1:80", "groups": []}),
            json!({"target": "127.0.0.1:80", "groups": [{"rate": 1, "concurrency": 2, "count": 1}]}),
            json!({"target": "127.0.0.1:80", "groups": [{"rate": 1}]}),
            json!({"target": "127.0.0.1:80", "groups": [{"rate": 1, "count": 1, "lanes": "x"}]}),
            json!({"target": "127.0.0.1:80", "groups": [{"rate": 1, "count": 1, "headers": {"a\r\nb": "c"}}]}),
        ];
        for b in bad {
            assert!(parse(&b).is_err(), "{b}");
        }
    }
}
