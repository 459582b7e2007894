//! The SLA watchdog, first-token hedging, mid-stream failover and models
//! that reload live, against the fake OpenAI upstream (switched slow or
//! killed mid-stream at run time) and the real in-process model.
#![allow(clippy::unwrap_used)]

mod common;
use common::infer::*;
use common::*;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The fake's text for tokens 0..n.
fn words(n: usize) -> String {
    const W: &[&str] = &[
        "The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", ".",
    ];
    (0..n).map(|i| W[i % W.len()]).collect()
}

fn post(uf: &Ultrafast, body: &str) -> Resp {
    Client::connect(uf.addr)
        .unwrap()
        .request(
            "POST",
            "/v1/chat/completions",
            &[("content-type", "application/json")],
            body.as_bytes(),
        )
        .unwrap()
}

fn chat(model: &str, max_tokens: u32, stream: bool) -> String {
    format!(
        r#"{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}],"max_tokens":{max_tokens},"stream":{stream}}}"#
    )
}

/// The watchdog's state of `model`'s standard lane.
fn slo_state(uf: &Ultrafast, model: &str) -> String {
    let v = get(uf.admin, "/admin/slo", &[]).json();
    v["lanes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["model"] == model && l["lane"] == "standard")
        .map(|l| l["state"].as_str().unwrap().to_string())
        .unwrap_or_default()
}

#[test]
fn a_slow_member_violates_the_lane_the_fallback_serves_and_the_lane_recovers() {
    let slow = Fake::start(&["--tokens", "4", "--ttft-ms", "10", "--itl-ms", "2"]);
    let spare = Fake::start(&["--tokens", "4", "--ttft-ms", "10", "--itl-ms", "2"]);
    let watchdog = "watchdog = { window_ms = 1000, enter_after = 2, leave_after = 2, min_samples = 3, probe_interval_ms = 100, ttft_ms = 300 }\nfallback = \"spare\"";
    // Two keys: one may use every model, one only `m`.
    let keys = scratch("fallback-keys").join("keys.toml");
    std::fs::write(
        &keys,
        "[[keys]]\nname = \"all\"\nkey = \"sk-all\"\n\n\
         [[keys]]\nname = \"only-m\"\nkey = \"sk-only-m\"\nmodels = [\"m\"]\n",
    )
    .unwrap();
    let uf = Ultrafast::start(&format!(
        "[api_keys]\nfile = \"{}\"\n\n{INFERENCE_ROUTE}{}{}",
        keys.display(),
        upstream_model("m", &[&slow], watchdog),
        upstream_model("spare", &[&spare], "")
    ));
    // Steady traffic from four clients until the test ends (bounded).
    let stop = Arc::new(AtomicBool::new(false));
    let served_by_spare = Arc::new(AtomicU64::new(0));
    let clients: Vec<_> = (0..4)
        .map(|_| {
            let (stop, spare_n, addr) = (stop.clone(), served_by_spare.clone(), uf.addr);
            std::thread::spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(90);
                while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                    let r = Client::connect(addr).and_then(|mut c| {
                        c.request(
                            "POST",
                            "/v1/chat/completions",
                            &[("Authorization", "Bearer sk-all")],
                            chat("m", 4, false).as_bytes(),
                        )
                    });
                    if let Ok(r) = r {
                        assert_eq!(r.status, 200, "{}", r.text());
                        if r.header("x-ultrafast-fallback") == Some("spare") {
                            spare_n.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            })
        })
        .collect();
    assert!(eventually(Duration::from_secs(5), || slo_state(&uf, "m") == "ok"));
    let spare_before = spare.stat("requests");
    // The member turns slow: 800 ms to the first token against 300.
    let turned = Instant::now();
    slow.control(r#"{"ttft_ms": 800}"#);
    assert!(
        eventually(Duration::from_secs(20), || slo_state(&uf, "m")
            == "violated"),
        "{}",
        get(uf.admin, "/admin/slo", &[]).text()
    );
    let to_violated = turned.elapsed();
    assert!(eventually(Duration::from_secs(5), || served_by_spare
        .load(Ordering::Relaxed)
        > 3));
    assert!(spare.stat("requests") > spare_before);
    // A key that may use only `m` is never served the fallback: it waits
    // for its own model.
    let only_m = Client::connect(uf.addr)
        .unwrap()
        .request(
            "POST",
            "/v1/chat/completions",
            &[("Authorization", "Bearer sk-only-m")],
            chat("m", 4, false).as_bytes(),
        )
        .unwrap();
    assert_eq!(only_m.status, 200, "{}", only_m.text());
    assert_eq!(only_m.header("x-ultrafast-fallback"), None);
    let v = get(uf.admin, "/admin/slo", &[]).json();
    let lane = v["lanes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["model"] == "m" && l["lane"] == "standard")
        .unwrap()
        .clone();
    assert_eq!(lane["fallback_active"], true, "{lane}");
    assert!(lane["windows"]["1m"]["ttft"]["p99_ms"].as_f64().unwrap() >= 700.0);
    // Fast again: the probes bring the lane back, and traffic with it.
    slow.control(r#"{"ttft_ms": 10}"#);
    let healed = Instant::now();
    assert!(
        eventually(Duration::from_secs(20), || slo_state(&uf, "m") == "ok"),
        "{}",
        get(uf.admin, "/admin/slo", &[]).text()
    );
    let back = healed.elapsed();
    let primary_before = slow.stat("requests");
    std::thread::sleep(Duration::from_millis(500));
    assert!(slow.stat("requests") > primary_before + 3);
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.join().unwrap();
    }
    eprintln!("violated after {to_violated:?}, back after {back:?}");
    assert!(uf.metric("ultrafast_slo_transitions_total", &["to=\"violated\""]) >= 1.0);
    assert!(
        uf.metric(
            "ultrafast_slo_transitions_total",
            &["from=\"violated\"", "to=\"ok\""]
        ) >= 1.0
    );
    assert!(uf.metric("ultrafast_fallback_requests_total", &["fallback=\"spare\""]) > 3.0);
    // Each transition is one JSON log line.
    let log = uf.stderr();
    let line = log
        .lines()
        .find(|l| l.contains("\"slo_transition\"") && l.contains("\"to\":\"violated\""))
        .unwrap();
    let json: serde_json::Value = serde_json::from_str(&line[line.find('{').unwrap()..]).unwrap();
    assert_eq!(json["model"], "m");
    assert!(json["window"]["ttft_p99_ms"].as_f64().unwrap() > 300.0);
}

#[test]
fn a_hedge_beats_a_slow_first_token_and_the_slow_connection_is_closed() {
    let slow = Fake::start(&["--tokens", "4", "--ttft-ms", "3000"]);
    let fast = Fake::start(&["--tokens", "4", "--ttft-ms", "10"]);
    let uf = Ultrafast::start(&format!(
        "{INFERENCE_ROUTE}{}",
        upstream_model(
            "m",
            &[&slow, &fast],
            "hedge = { after_ms = 150, max_ratio = 1.0 }"
        )
    ));
    // Least outstanding rotates ties: four requests land on each member.
    for _ in 0..8 {
        let t = Instant::now();
        let r = post(&uf, &chat("m", 4, false));
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(
            r.json()["choices"][0]["message"]["content"],
            words(4).as_str()
        );
        assert!(
            t.elapsed() < Duration::from_millis(1500),
            "{:?}",
            t.elapsed()
        );
    }
    assert!(slow.stat("requests") >= 1);
    assert!(uf.metric("ultrafast_upstream_hedges_total", &["outcome=\"won\""]) >= 1.0);
    assert!(uf.metric("ultrafast_upstream_hedges_total", &["outcome=\"sent\""]) >= 1.0);
    // Every request the slow member got was cancelled: its connection was
    // closed as soon as the hedge won.
    let slow_requests = slow.stat("requests");
    assert!(eventually(Duration::from_secs(2), || slow
        .stat("cancelled")
        == slow_requests));
    assert_eq!(slow.stat("completed"), 0);
}

#[test]
fn a_member_killed_mid_stream_is_continued_on_another_without_an_error() {
    let dying = Fake::start(&["--tokens", "16", "--itl-ms", "5", "--die-after", "5"]);
    let healthy = Fake::start(&["--tokens", "16", "--itl-ms", "5"]);
    let uf = Ultrafast::start(&format!(
        "{INFERENCE_ROUTE}{}",
        upstream_model("m", &[&dying, &healthy], "")
    ));
    // Text completions continue on any pool.
    for _ in 0..4 {
        let body = r#"{"model":"m","prompt":"Say something:","max_tokens":32,"stream":true,"stream_options":{"include_usage":true}}"#;
        let s = post_stream(uf.addr, "/v1/completions", body, &[]);
        let (evs, _) = read_sse(s, Duration::from_secs(10));
        assert_eq!(evs.last().unwrap().data, "[DONE]");
        let mut text = String::new();
        let mut usage = None;
        for e in &evs[..evs.len() - 1] {
            let v: serde_json::Value = serde_json::from_str(&e.data).unwrap();
            assert!(v.get("error").is_none(), "{}", e.data);
            if let Some(t) = v["choices"][0]["text"].as_str() {
                text.push_str(t);
            }
            if v["usage"].is_object() {
                usage = Some(v["usage"].clone());
            }
        }
        assert_eq!(text, words(16));
        assert_eq!(usage.unwrap()["completion_tokens"], 16);
    }
    assert!(dying.stat("killed") >= 1);
    assert!(healthy.stat("resumed") >= 1);
    assert!(uf.metric("ultrafast_upstream_failovers_total", &["outcome=\"ok\""]) >= 1.0);
    assert_eq!(
        uf.metric(
            "ultrafast_upstream_failovers_total",
            &["outcome=\"failed\""]
        ),
        0.0
    );
}

#[test]
fn a_chat_stream_continues_only_on_a_pool_that_declares_vllm_resume() {
    let dying = Fake::start(&["--tokens", "12", "--itl-ms", "5", "--die-after", "3"]);
    let healthy = Fake::start(&["--tokens", "12", "--itl-ms", "5"]);
    let pool = |resume: &str| {
        format!(
            "[pools.p]\nmembers = [{{ addr = \"{}\" }}, {{ addr = \"{}\" }}]\nresume = \"{resume}\"\n\n\
             [models.m]\nbackend = \"upstream\"\npool = \"p\"\n",
            dying.addr, healthy.addr
        )
    };
    let uf = Ultrafast::start(&format!("{INFERENCE_ROUTE}{}", pool("vllm")));
    let text_of = |uf: &Ultrafast| {
        let s = post_stream(uf.addr, "/v1/chat/completions", &chat("m", 32, true), &[]);
        let (evs, _) = read_sse(s, Duration::from_secs(10));
        let errored = evs.iter().any(|e| e.data.contains("\"error\""));
        let text: String = contents(&evs).into_iter().map(|(_, t)| t).collect();
        (text, errored)
    };
    let mut checked = false;
    for _ in 0..4 {
        let before = healthy.stat("resumed");
        assert_eq!(text_of(&uf), (words(12), false));
        if healthy.stat("resumed") > before {
            let last = healthy.stats()["last_body"].clone();
            assert_eq!(last["continue_final_message"], true, "{last}");
            assert_eq!(last["add_generation_prompt"], false);
            let msgs = last["messages"].as_array().unwrap();
            assert_eq!(msgs.last().unwrap()["role"], "assistant");
            checked = true;
        }
    }
    assert!(checked, "no stream broke on the dying member");
    // Without `resume = "vllm"` the break ends the stream with an error.
    uf.write_config(&format!("{INFERENCE_ROUTE}{}", pool("none")));
    assert_eq!(uf.reload().status, 200);
    let outcomes: Vec<bool> = (0..4).map(|_| text_of(&uf).1).collect();
    assert!(outcomes.contains(&true), "{outcomes:?}");
}

#[test]
fn watchdog_hedge_and_resume_settings_are_validated() {
    let fake = Fake::start(&[]);
    let uf = Ultrafast::start(&format!(
        "{INFERENCE_ROUTE}{}",
        upstream_model("m", &[&fake], "")
    ));
    for (extra, field) in [
        ("fallback = \"nope\"\nwatchdog = {}", "models.m.fallback"),
        ("fallback = \"m\"\nwatchdog = {}", "models.m.fallback"),
        (
            "watchdog = { percentile = \"q9\" }",
            "models.m.watchdog.percentile",
        ),
        (
            "watchdog = { window_ms = 0 }",
            "models.m.watchdog.window_ms",
        ),
        ("hedge = { max_ratio = 0.5 }", "models.m.hedge.after_ms"),
        ("hedge = { after = \"p101\" }", "models.m.hedge.after"),
        (
            "hedge = { after_ms = 5, max_ratio = 2.0 }",
            "models.m.hedge.max_ratio",
        ),
    ] {
        uf.write_config(&format!(
            "{INFERENCE_ROUTE}{}",
            upstream_model("m", &[&fake], extra)
        ));
        let r = uf.reload();
        assert_eq!(r.status, 400, "{extra}: {}", r.text());
        assert!(r.text().contains(field), "{extra}: {}", r.text());
    }
    uf.write_config(&format!(
        "{INFERENCE_ROUTE}{}",
        upstream_model("m", &[&fake], "hedge = { after = \"p90\" }")
    ));
    assert_eq!(uf.reload().status, 200);
}

const MODEL: &str = "smollm2-135m-instruct";

fn engine(kv_blocks: usize, source: &str) -> String {
    format!(
        "{INFERENCE_ROUTE}[models.{MODEL}]\nbackend = \"engine\"\nsource = \"{source}\"\nkv_blocks = {kv_blocks}\nmax_num_seqs = 4\nwarmup_prompt_lens = [16]\nmax_concurrency = 8\n"
    )
}

fn kv_total(uf: &Ultrafast) -> f64 {
    // Used, free and prefix-cached blocks together: the pool's size.
    uf.metric("ultrafast_engine_kv_blocks", &[])
}

#[test]
fn reloading_an_engine_model_under_load_serves_the_new_setting_with_no_failed_request() {
    let uf = Ultrafast::start(&engine(256, MODEL));
    uf.wait_models_ready(Duration::from_secs(300));
    assert_eq!(kv_total(&uf), 256.0);
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    // What a failed stream received, for the failure message.
    let bad: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
    let clients: Vec<_> = (0..3)
        .map(|_| {
            let (stop, ok, failed, addr) = (stop.clone(), ok.clone(), failed.clone(), uf.addr);
            let bad = bad.clone();
            std::thread::spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(240);
                while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                    let body = format!(
                        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"Name a color."}}],"max_tokens":12,"temperature":0,"stream":true}}"#
                    );
                    let s = post_stream(addr, "/v1/chat/completions", &body, &[]);
                    let (evs, _) = read_sse(s, Duration::from_secs(60));
                    let good = evs.last().is_some_and(|e| e.data == "[DONE]")
                        && !evs.iter().any(|e| e.data.contains("\"error\""))
                        && !contents(&evs).is_empty();
                    if !good {
                        let got: Vec<&str> = evs.iter().map(|e| e.data.as_str()).collect();
                        if let Ok(mut b) = bad.lock() {
                            b.push(got.join(" | "));
                        }
                    }
                    if good { &ok } else { &failed }.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    assert!(eventually(Duration::from_secs(60), || ok
        .load(Ordering::Relaxed)
        >= 3));
    // A source that cannot load fails the reload, naming the model; the
    // running engine keeps serving.
    uf.write_config(&engine(128, "/nonexistent/model.gguf"));
    let r = uf.reload();
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(
        r.text().contains(MODEL) && r.text().contains("failed to load"),
        "{}",
        r.text()
    );
    assert_eq!(kv_total(&uf), 256.0);
    // The real change: loaded and warmed beside the old engine, then swapped.
    uf.write_config(&engine(128, MODEL));
    let r = uf.reload();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.json()["diff"]["models"][MODEL],
        "reloaded",
        "{}",
        r.text()
    );
    assert_eq!(kv_total(&uf), 128.0);
    let served = ok.load(Ordering::Relaxed);
    assert!(eventually(Duration::from_secs(60), || ok
        .load(Ordering::Relaxed)
        >= served + 3));
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.join().unwrap();
    }
    assert_eq!(
        failed.load(Ordering::Relaxed),
        0,
        "failed streams: {:?}\n{}",
        bad.lock().map(|b| b.clone()).unwrap_or_default(),
        uf.stderr()
    );
    assert!(ok.load(Ordering::Relaxed) >= 6);
    // A removed model drains: the stream in flight finishes, new requests
    // get a 404.
    let body = format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"Tell me a story."}}],"max_tokens":48,"stream":true}}"#
    );
    let s = post_stream(uf.addr, "/v1/chat/completions", &body, &[]);
    let reader = std::thread::spawn(move || read_sse(s, Duration::from_secs(60)).0);
    std::thread::sleep(Duration::from_millis(300));
    uf.write_config(INFERENCE_ROUTE);
    let r = uf.reload();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["diff"]["models"][MODEL], "removed", "{}", r.text());
    let evs = reader.join().unwrap();
    assert_eq!(evs.last().unwrap().data, "[DONE]");
    assert!(!evs.iter().any(|e| e.data.contains("\"error\"")), "{evs:?}");
    assert!(contents(&evs).len() > 3);
    let r = post(&uf, &body.replace("\"stream\":true", "\"stream\":false"));
    assert_eq!(r.status, 404, "{}", r.text());
    assert_eq!(uf.metric("ultrafast_engine_ready", &[]), 0.0);
}
