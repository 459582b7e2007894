//! The latency promise against hostile clients and changing machines, over
//! fake OpenAI upstreams (the real protocol): lanes granted per API key
//! and to anonymous requests (403 `lane_not_allowed` in each dialect's
//! shape, or a move down where the lane says so), and the latency model's
//! calibration following a backend that turns slower, then faster.
#![allow(clippy::unwrap_used)]

mod common;
use common::infer::*;
use common::*;
use std::time::{Duration, Instant};

const KEYS: &str = r#"
[[keys]]
name = "limited"
key = "sk-limited"
lanes = ["standard", "batch"]

[[keys]]
name = "open"
key = "sk-open"
"#;

fn lanes(ultra_forbidden: &str, standard_forbidden: &str) -> String {
    format!(
        "[lanes.ultra]\nrank = 0\non_forbidden = \"{ultra_forbidden}\"\n\n\
         [lanes.standard]\nrank = 1\non_forbidden = \"{standard_forbidden}\"\n\n\
         [lanes.batch]\nrank = 2\n\n"
    )
}

fn chat(stream: bool) -> String {
    serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4, "stream": stream})
    .to_string()
}

fn messages() -> String {
    serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4})
    .to_string()
}

#[test]
fn lanes_are_granted_per_key() {
    let fake = Fake::start(&["--tokens", "4", "--itl-ms", "1"]);
    let dir = scratch("lanes");
    let file = dir.join("keys.toml");
    std::fs::write(&file, KEYS).unwrap();
    let conf = |ultra: &str| {
        format!(
            "[api_keys]\nfile = \"{}\"\n\n{}{INFERENCE_ROUTE}{}",
            file.display(),
            lanes(ultra, "reject"),
            upstream_model("m", &[&fake], ""),
        )
    };
    let uf = Ultrafast::start(&conf("reject"));
    let ultra = [("X-Request-Priority", "ultra")];
    // A key without `ultra` asking for it: 403 in OpenAI's shape.
    let r = post_as(&uf, "sk-limited", &chat(false), &ultra);
    assert_eq!(r.status, 403, "{}", r.text());
    let e = &r.json()["error"];
    assert_eq!(e["code"], "lane_not_allowed", "{e}");
    assert_eq!(e["param"], "priority");
    assert!(e["message"].as_str().unwrap().contains("limited"), "{e}");
    // The same through the body's `priority`, streamed: refused before
    // any stream starts.
    let body = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4, "stream": true, "priority": "ultra"});
    let r = post_as(&uf, "sk-limited", &body.to_string(), &[]);
    assert_eq!(r.status, 403, "{}", r.text());
    // In Anthropic's dialect, Anthropic's error shape.
    let r = post_to(
        &uf,
        "/v1/messages",
        &messages(),
        &[("x-api-key", "sk-limited"), ("X-Request-Priority", "ultra")],
    );
    assert_eq!(r.status, 403, "{}", r.text());
    assert_eq!(r.json()["type"], "error", "{}", r.text());
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("ultra"));
    // Its granted lanes serve; a key without `lanes` may use any.
    let r = post_as(&uf, "sk-limited", &chat(false), &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-ultrafast-lane"), Some("standard"));
    let r = post_as(&uf, "sk-open", &chat(false), &ultra);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-ultrafast-lane"), Some("ultra"));
    // `on_forbidden = "downgrade"`: moved to the next lane it is granted.
    uf.write_config(&conf("downgrade"));
    assert_eq!(uf.reload().status, 200);
    let r = post_as(&uf, "sk-limited", &chat(false), &ultra);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-ultrafast-lane"), Some("standard"));
}

#[test]
fn anonymous_lanes_bound_requests_without_a_key() {
    let fake = Fake::start(&["--tokens", "4", "--itl-ms", "1"]);
    let route = "[[routes]]\nname = \"openai\"\npath = \"/v1/\"\ninference = true\nanonymous_lanes = [\"batch\"]\n\n";
    let conf = |standard: &str| {
        format!(
            "{}{route}{}",
            lanes("reject", standard),
            upstream_model("m", &[&fake], "")
        )
    };
    let uf = Ultrafast::start(&conf("reject"));
    // The route's default lane (standard) is not granted to anonymous
    // requests.
    let r = post_to(&uf, "/v1/chat/completions", &chat(false), &[]);
    assert_eq!(r.status, 403, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "lane_not_allowed");
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("without an API key"));
    let r = post_to(
        &uf,
        "/v1/chat/completions",
        &chat(false),
        &[("X-Request-Priority", "batch")],
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-ultrafast-lane"), Some("batch"));
    // Downgrade moves it to `batch`.
    uf.write_config(&conf("downgrade"));
    assert_eq!(uf.reload().status, 200);
    let r = post_to(&uf, "/v1/chat/completions", &chat(false), &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-ultrafast-lane"), Some("batch"));
    // An unknown lane in `anonymous_lanes` is a config error naming the
    // field; the old config keeps serving.
    uf.write_config(&conf("reject").replace("[\"batch\"]", "[\"gold\"]"));
    let r = uf.reload();
    assert_ne!(r.status, 200);
    assert!(r.text().contains("anonymous_lanes"), "{}", r.text());
    let r = post_to(&uf, "/v1/chat/completions", &chat(false), &[]);
    assert_eq!(r.status, 200, "{}", r.text());
}

/// What one streamed request saw: the server's TTFT (from arrival) and the
/// calibrated prediction it was admitted on, from `ultrafast_timing`.
#[derive(Debug, Clone, Copy)]
struct Seen {
    at: Instant,
    ttft_ms: f64,
    predicted_ms: f64,
}

/// `clients` closed-loop clients streaming for `run`.
fn load(uf: &Ultrafast, clients: usize, run: Duration) -> Vec<Seen> {
    let addr = uf.addr;
    let end = Instant::now() + run;
    let hs: Vec<_> = (0..clients)
        .map(|_| {
            std::thread::spawn(move || {
                let mut out = Vec::new();
                // Bounded in count and in time.
                for _ in 0..500 {
                    if Instant::now() >= end {
                        break;
                    }
                    let s = post_stream(addr, "/v1/chat/completions", &chat(true), &[]);
                    let (evs, _) = read_sse(s, Duration::from_secs(30));
                    let t = evs.iter().find_map(|a| {
                        let v: serde_json::Value = serde_json::from_str(&a.data).ok()?;
                        let t = v.get("ultrafast_timing")?.clone();
                        Some((t["ttft_ms"].as_f64()?, t["predicted_ttft_ms"].as_f64()?))
                    });
                    if let Some((ttft_ms, predicted_ms)) = t {
                        out.push(Seen {
                            at: Instant::now(),
                            ttft_ms,
                            predicted_ms,
                        });
                    }
                }
                out
            })
        })
        .collect();
    let mut all: Vec<Seen> = hs.into_iter().flat_map(|h| h.join().unwrap()).collect();
    all.sort_by_key(|s| s.at);
    all
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The requests of the last `tail` of a phase: how many, how many came
/// later than their calibrated prediction (10 ms of slack for the time
/// before admission), and the median prediction.
fn judge(seen: &[Seen], tail: Duration) -> (usize, usize, f64) {
    let last = seen.last().unwrap().at;
    let recent: Vec<&Seen> = seen
        .iter()
        .filter(|s| last.duration_since(s.at) <= tail)
        .collect();
    let late = recent
        .iter()
        .filter(|s| s.ttft_ms > s.predicted_ms + 10.0)
        .count();
    let med = median(recent.iter().map(|s| s.predicted_ms).collect());
    (recent.len(), late, med)
}

#[test]
fn calibration_follows_a_backend_that_turns_slower_then_faster() {
    // Two slots upstream, three clients: one always waits in the
    // upstream's own queue, which the model has to predict.
    let fake = Fake::start(&[
        "--ttft-ms",
        "60",
        "--itl-ms",
        "4",
        "--tokens",
        "4",
        "--capacity",
        "2",
    ]);
    let uf = Ultrafast::start(&format!(
        "[lanes.standard]\nrank = 1\nttft_slo_ms = 2000\nmax_wait_ms = 60000\n\n{INFERENCE_ROUTE}{}",
        upstream_model("m", &[&fake], "max_concurrency = 2\ncalibration_window_s = 3"),
    ));
    let factor = |uf: &Ultrafast| {
        uf.metric(
            "ultrafast_inference_ttft_correction_factor",
            &["model=\"m\"", "lane=\"standard\""],
        )
    };
    let phase1 = load(&uf, 3, Duration::from_secs(4));
    let (n1, late1, pred1) = judge(&phase1, Duration::from_secs(2));
    let f1 = factor(&uf);
    // The backend's speed halves (first tokens and the gaps between
    // tokens take twice as long).
    let control = |ttft: u64, itl: u64| {
        fake.control(&format!("{{\"ttft_ms\": {ttft}, \"itl_ms\": {itl}}}"));
    };
    control(240, 8);
    let phase2 = load(&uf, 3, Duration::from_secs(6));
    let (n2, late2, pred2) = judge(&phase2, Duration::from_secs(3));
    let f2 = factor(&uf);
    // And doubles again: after the window, the slow samples are gone.
    control(60, 4);
    let phase3 = load(&uf, 3, Duration::from_secs(6));
    let (n3, late3, pred3) = judge(&phase3, Duration::from_secs(2));
    let f3 = factor(&uf);
    let report = format!(
        "phase n/late/median predicted ms/factor: 1: {n1}/{late1}/{pred1}/{f1} 2: {n2}/{late2}/{pred2}/{f2} 3: {n3}/{late3}/{pred3}/{f3}"
    );
    eprintln!("{report}");
    for (n, late) in [(n1, late1), (n2, late2), (n3, late3)] {
        assert!(n >= 8, "too few requests to judge: {report}");
        // Converged: the first token comes within the calibrated
        // prediction for (nearly) every request at the end of a phase.
        assert!(late <= n / 10, "{report}");
    }
    // The predictions followed the speed: up when it halved, down when it
    // doubled.
    assert!(pred2 > 1.5 * pred1, "{report}");
    assert!(pred3 < 0.7 * pred2, "{report}");
    assert!(f1 > 0.0 && f2 > 0.0 && f3 > 0.0, "{report}");
}
