//! The inference front over upstream pools of OpenAI-compatible servers
//! (the fake upstream from `benches/`, speaking the real protocol): the
//! official `openai` client, SSE framing, async mode, admission, cadence
//! pacing, cancellation, retries before the first token, prefix affinity,
//! priority passing and bad upstream behaviour.
#![allow(clippy::unwrap_used)]

mod common;
use common::infer::*;
use common::*;
use std::time::{Duration, Instant};

fn chat_body(max_tokens: u32, stream: bool) -> String {
    format!(
        r#"{{"model":"m","messages":[{{"role":"system","content":"Be brief."}},{{"role":"user","content":"hi"}}],"max_tokens":{max_tokens},"stream":{stream}}}"#
    )
}

#[test]
fn openai_client_against_an_upstream_pool() {
    let fake = Fake::start(&["--tokens", "400", "--itl-ms", "2", "--ttft-ms", "5"]);
    let uf = Ultrafast::start(&format!(
        "{INFERENCE_ROUTE}{}",
        upstream_model("m", &[&fake], "")
    ));
    python_check("basics", &uf, "m");
    python_check("async", &uf, "m");
    // Tokens were counted from the upstream's SSE.
    assert!(uf.metric("ultrafast_inference_tokens_total", &["kind=\"completion\""]) > 0.0);
    assert!(
        uf.metric(
            "ultrafast_inference_ttft_seconds_count",
            &["backend=\"upstream\""]
        ) > 0.0
    );
}

#[test]
fn an_inference_pool_speaks_h2c_to_its_members() {
    let fake = Fake::start(&["--tokens", "20"]);
    // The member: another ultrafast whose listener relays to the fake,
    // one with h2c and one without.
    let h2c = free_port();
    let relay = Ultrafast::start(&format!(
        "[[listeners]]\naddress = \"127.0.0.1:{h2c}\"\nh2c = true\n\n\
         [pools.f]\nmembers = [{{ addr = \"{}\" }}]\n\n[[routes]]\npath = \"/\"\npool = \"f\"\n",
        fake.addr
    ));
    let front = |member: String| {
        Ultrafast::start(&format!(
            "{INFERENCE_ROUTE}[pools.m-pool]\nmembers = [{{ addr = \"{member}\" }}]\n\
             protocol = \"h2c\"\nretry = {{ attempts = 1 }}\n\n\
             [models.m]\nbackend = \"upstream\"\npool = \"m-pool\"\n"
        ))
    };
    let uf = front(format!("127.0.0.1:{h2c}"));
    python_check("basics", &uf, "m");
    assert!(relay.metric("ultrafast_upstream_connections_total", &[]) > 0.0);
    // The same member behind a listener that speaks HTTP/1 only refuses
    // the HTTP/2 preface: the pool did speak h2c.
    let http1_only = front(relay.addr.to_string());
    let r = post_to(
        &http1_only,
        "/v1/chat/completions",
        &chat_body(5, false),
        &[],
    );
    assert!(r.status >= 500, "{} {}", r.status, r.text());
}

#[test]
fn an_inference_pool_speaks_h2_over_tls_to_its_members() {
    let fake = Fake::start(&["--tokens", "20"]);
    let dir = scratch("h2-member");
    std::fs::create_dir_all(&dir).unwrap();
    let (cert, key) = dev_certs(&dir);
    // The member: another ultrafast, TLS with ALPN h2 and http/1.1,
    // relaying to the fake.
    let tls = free_port();
    let relay = Ultrafast::start(&format!(
        "[[listeners]]\naddress = \"127.0.0.1:{tls}\"\n\
         tls = {{ certs = [{{ cert = \"{}\", key = \"{}\", default = true }}] }}\n\n\
         [pools.f]\nmembers = [{{ addr = \"{}\" }}]\n\n[[routes]]\npath = \"/\"\npool = \"f\"\n",
        cert.display(),
        key.display(),
        fake.addr
    ));
    let uf = Ultrafast::start(&format!(
        "{INFERENCE_ROUTE}[pools.m-pool]\nmembers = [{{ addr = \"127.0.0.1:{tls}\" }}]\n\
         protocol = \"h2\"\ntls = {{ sni = \"localhost\", ca_file = \"{}\" }}\n\n\
         [models.m]\nbackend = \"upstream\"\npool = \"m-pool\"\n",
        dir.join("ca.pem").display()
    ));
    python_check("basics", &uf, "m");
    // The member's listener negotiated h2 with the pool (ALPN).
    assert!(relay.metric("ultrafast_tls_alpn_total", &["protocol=\"h2\""]) >= 1.0);
    assert_eq!(
        relay.metric("ultrafast_tls_alpn_total", &["protocol=\"http/1.1\""]),
        0.0
    );
}

#[test]
fn admission_refusals_surface_as_client_exceptions() {
    let fake = Fake::start(&["--tokens", "30", "--itl-ms", "20"]);
    let uf = Ultrafast::start(&format!(
        "[rate_limits.tenant]\nkey = \"header:x-tenant\"\nrate_per_s = 0.01\nburst = 1\n\n\
         [[routes]]\nname = \"openai\"\npath = \"/v1/\"\ninference = true\nrate_limits = [\"tenant\"]\n\n\
         [lanes.standard]\nrank = 1\nqueue_len = 1\nmax_wait_ms = 200\n\n{}",
        upstream_model("m", &[&fake], "max_concurrency = 2\nmax_queued = 1")
    ));
    python_check("shed", &uf, "m");
}

#[test]
fn disconnect_mid_stream_cancels_the_upstream_request() {
    let fake = Fake::start(&["--tokens", "400", "--itl-ms", "10"]);
    let uf = Ultrafast::start(&format!(
        "{INFERENCE_ROUTE}{}",
        upstream_model("m", &[&fake], "")
    ));
    let s = post_stream(uf.addr, "/v1/chat/completions", &chat_body(400, true), &[]);
    let mut r = std::io::BufReader::new(s.try_clone().unwrap());
    let mut line = String::new();
    // Wait for the first data event, then hang up.
    while !line.starts_with("data:") {
        line.clear();
        std::io::BufRead::read_line(&mut r, &mut line).unwrap();
    }
    assert_eq!(fake.stat("active"), 1);
    let t = Instant::now();
    drop(r);
    drop(s);
    assert!(
        eventually(Duration::from_secs(2), || fake.stat("cancelled") == 1
            && fake.stat("active") == 0),
        "upstream request not cancelled: {}",
        fake.stats()
    );
    eprintln!("upstream cancelled {:?} after the client left", t.elapsed());
    assert_eq!(fake.stat("completed"), 0);
}

#[test]
fn a_client_that_pipelines_a_byte_and_leaves_cancels_the_upstream_request() {
    let fake = Fake::start(&["--tokens", "400", "--itl-ms", "10"]);
    let uf = Ultrafast::start(&format!(
        "{INFERENCE_ROUTE}{}",
        upstream_model("m", &[&fake], "")
    ));
    let body = chat_body(400, true);
    let mut s = std::net::TcpStream::connect(uf.addr).unwrap();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    std::io::Write::write_all(&mut s, req.as_bytes()).unwrap();
    assert!(
        eventually(Duration::from_secs(5), || fake.stat("active") == 1),
        "{}",
        fake.stats()
    );
    // Then one byte of a next request: the idle read that watches for the
    // client leaving stops at it.
    std::io::Write::write_all(&mut s, b"G").unwrap();
    std::thread::sleep(Duration::from_millis(200));
    drop(s);
    assert!(
        eventually(Duration::from_secs(3), || fake.stat("cancelled") == 1
            && fake.stat("active") == 0),
        "upstream request not cancelled: {}",
        fake.stats()
    );
    assert_eq!(fake.stat("completed"), 0);
}

#[test]
fn retries_before_the_first_token_never_after() {
    let failing = Fake::start(&["--fail-first", "1000"]);
    let good = Fake::start(&["--tokens", "5", "--itl-ms", "1"]);
    let uf = Ultrafast::start(&format!(
        "{INFERENCE_ROUTE}{}",
        upstream_model("m", &[&failing, &good], "attempts = 2")
    ));
    for _ in 0..4 {
        let (evs, _) = read_sse(
            post_stream(uf.addr, "/v1/chat/completions", &chat_body(5, true), &[]),
            Duration::from_secs(10),
        );
        assert_eq!(contents(&evs).len(), 5, "{evs:?}");
        assert_eq!(evs.last().unwrap().data, "[DONE]");
    }
    assert!(
        failing.stat("requests") >= 1,
        "the failing member was tried"
    );
    assert_eq!(good.stat("completed"), 4);

    // A member that breaks after tokens were sent: the stream ends with an
    // error event and nothing is retried elsewhere.
    let breaking = Fake::start(&["--tokens", "10", "--itl-ms", "2", "--malformed-after", "3"]);
    let spare = Fake::start(&[]);
    uf.write_config(&format!(
        "{INFERENCE_ROUTE}{}",
        upstream_model("m", &[&breaking], "attempts = 3")
    ));
    assert_eq!(uf.reload().status, 200);
    let (evs, _) = read_sse(
        post_stream(uf.addr, "/v1/chat/completions", &chat_body(10, true), &[]),
        Duration::from_secs(10),
    );
    assert_eq!(contents(&evs).len(), 3, "{evs:?}");
    let err = evs
        .iter()
        .find(|a| a.data.contains("\"error\""))
        .expect("an error event");
    assert!(err.data.contains("malformed"), "{}", err.data);
    assert_eq!(evs.last().unwrap().data, "[DONE]");
    assert_eq!(breaking.stat("requests"), 1);
    assert_eq!(spare.stat("requests"), 0);
}

#[test]
fn stalled_upstream_ends_the_stream_with_an_error() {
    let stalling = Fake::start(&["--tokens", "10", "--itl-ms", "2", "--stall-after", "2"]);
    let uf = Ultrafast::start(&format!(
        "{INFERENCE_ROUTE}{}",
        upstream_model("m", &[&stalling], "stall_timeout_ms = 300")
    ));
    let t = Instant::now();
    let (evs, _) = read_sse(
        post_stream(uf.addr, "/v1/chat/completions", &chat_body(10, true), &[]),
        Duration::from_secs(10),
    );
    assert!(t.elapsed() < Duration::from_secs(5));
    assert_eq!(contents(&evs).len(), 2);
    assert!(evs.iter().any(|a| a.data.contains("stalled")), "{evs:?}");
    assert_eq!(evs.last().unwrap().data, "[DONE]");
    // Whole responses get a 502 in OpenAI's shape instead.
    let r = Client::connect(uf.addr)
        .unwrap()
        .request(
            "POST",
            "/v1/chat/completions",
            &[("content-type", "application/json")],
            chat_body(10, false).as_bytes(),
        )
        .unwrap();
    assert_eq!(r.status, 502, "{}", r.text());
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("stalled"));
}

#[test]
fn prefix_affinity_keeps_a_conversation_on_one_member_with_bounded_load() {
    let fakes: Vec<Fake> = (0..3)
        .map(|_| Fake::start(&["--tokens", "2", "--itl-ms", "1", "--ttft-ms", "1"]))
        .collect();
    let refs: Vec<&Fake> = fakes.iter().collect();
    let uf = Ultrafast::start(&format!(
        "{INFERENCE_ROUTE}{}",
        upstream_model(
            "m",
            &refs,
            "lb = \"prefix_affinity\"\naffinity_load_factor = 1.25"
        )
    ));
    let body = |sys: &str, q: usize| {
        format!(
            r#"{{"model":"m","messages":[{{"role":"system","content":"{sys}"}},{{"role":"user","content":"question {q}"}}],"max_tokens":2}}"#
        )
    };
    for q in 0..9 {
        let r = Client::connect(uf.addr)
            .unwrap()
            .request(
                "POST",
                "/v1/chat/completions",
                &[],
                body("You are a pirate.", q).as_bytes(),
            )
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let counts: Vec<u64> = fakes.iter().map(|f| f.stat("requests")).collect();
    assert!(
        counts.contains(&9),
        "one member took the shared prefix: {counts:?}"
    );

    // Under concurrency the same prefix spills over once a member is above
    // 1.25x the average load.
    let slow: Vec<Fake> = (0..3)
        .map(|_| Fake::start(&["--tokens", "2", "--ttft-ms", "400"]))
        .collect();
    let refs: Vec<&Fake> = slow.iter().collect();
    uf.write_config(&format!(
        "{INFERENCE_ROUTE}{}",
        upstream_model(
            "m",
            &refs,
            "lb = \"prefix_affinity\"\naffinity_load_factor = 1.25"
        )
    ));
    assert_eq!(uf.reload().status, 200);
    let addr = uf.addr;
    let handles: Vec<_> = (0..9)
        .map(|q| {
            let b = body("You are a pirate.", q);
            std::thread::spawn(move || {
                Client::connect(addr)
                    .unwrap()
                    .request("POST", "/v1/chat/completions", &[], b.as_bytes())
                    .unwrap()
                    .status
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), 200);
    }
    let counts: Vec<u64> = slow.iter().map(|f| f.stat("requests")).collect();
    assert!(counts.iter().all(|&c| c < 9), "load is bounded: {counts:?}");
    assert!(*counts.iter().max().unwrap() >= 3, "{counts:?}");
}

#[test]
fn lane_is_passed_as_vllm_priority_and_heartbeats_flow_while_queued() {
    let fake = Fake::start(&["--tokens", "20", "--itl-ms", "15", "--capacity", "4"]);
    let uf = Ultrafast::start(&format!(
        "{INFERENCE_ROUTE}[inference]\nheartbeat_ms = 50\n\n{}",
        upstream_model_in(
            "m",
            &[&fake],
            "dialect = \"vllm\"",
            "priority_field = \"vllm\"\nmax_concurrency = 1"
        )
    ));
    let r = Client::connect(uf.addr)
        .unwrap()
        .request(
            "POST",
            "/v1/chat/completions",
            &[("x-request-priority", "ultra")],
            chat_body(1, false).as_bytes(),
        )
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(fake.stats()["last_body"]["priority"], 0);
    assert_eq!(
        fake.stats()["last_body"]["stream"],
        true,
        "upstreams are always streamed"
    );
    // Body `priority` picks the lane when no header does.
    let b = r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":1,"priority":"standard"}"#;
    Client::connect(uf.addr)
        .unwrap()
        .request("POST", "/v1/chat/completions", &[], b.as_bytes())
        .unwrap();
    assert_eq!(fake.stats()["last_body"]["priority"], 1);
    let b = r#"{"model":"m","messages":[{"role":"user","content":"x"}],"priority":"urgent"}"#;
    let r = Client::connect(uf.addr)
        .unwrap()
        .request("POST", "/v1/chat/completions", &[], b.as_bytes())
        .unwrap();
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["param"], "priority");

    // One slot: the second stream waits, with heartbeat comments.
    let first = post_stream(uf.addr, "/v1/chat/completions", &chat_body(20, true), &[]);
    std::thread::sleep(Duration::from_millis(50));
    let (evs, comments) = read_sse(
        post_stream(uf.addr, "/v1/chat/completions", &chat_body(3, true), &[]),
        Duration::from_secs(10),
    );
    assert!(comments.iter().any(|c| c == "waiting"), "{comments:?}");
    assert_eq!(contents(&evs).len(), 3);
    let (evs, _) = read_sse(first, Duration::from_secs(10));
    assert_eq!(contents(&evs).len(), 20);
}

fn stddev_ms(times: &[Instant]) -> (f64, f64) {
    let gaps: Vec<f64> = times
        .windows(2)
        .map(|w| (w[1] - w[0]).as_secs_f64() * 1000.0)
        .collect();
    let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
    let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64;
    (mean, var.sqrt())
}

#[test]
fn pacing_smooths_a_bursty_upstream_without_delaying_the_first_token() {
    // Tokens in bursts of 4 every 80 ms: 20 ms per token on average.
    let fake = Fake::start(&[
        "--tokens",
        "40",
        "--itl-ms",
        "20",
        "--burst",
        "4",
        "--ttft-ms",
        "50",
    ]);
    let uf = Ultrafast::start(&format!(
        "{INFERENCE_ROUTE}[lanes.ultra]\nrank = 0\npace = \"fixed\"\npace_interval_ms = 20\n\n\
         [lanes.standard]\nrank = 1\npace = \"off\"\n\n{}",
        upstream_model("m", &[&fake], "")
    ));
    let run = |lane: &str| {
        let t0 = Instant::now();
        let (evs, _) = read_sse(
            post_stream(
                uf.addr,
                "/v1/chat/completions",
                &chat_body(40, true),
                &[("x-request-priority", lane)],
            ),
            Duration::from_secs(10),
        );
        let c = contents(&evs);
        assert_eq!(c.len(), 40);
        let times: Vec<Instant> = c.iter().map(|(t, _)| *t).collect();
        // The last burst arrives together with the end of the stream, which
        // the pacer flushes at once by design: measure the cadence before it.
        (times[0] - t0, stddev_ms(&times[..36]))
    };
    let (ttft_off, (mean_off, sd_off)) = run("standard");
    // Best of three paced runs: the tests share two cores, and a run that
    // lost the CPU measures the machine, not the pacer.
    let (ttft_on, (mean_on, sd_on)) = (0..3)
        .map(|_| run("ultra"))
        .min_by(|a, b| a.1 .1.total_cmp(&b.1 .1))
        .unwrap();
    eprintln!("off: ttft {ttft_off:?} mean {mean_off:.1} ms sd {sd_off:.1} ms; on: ttft {ttft_on:?} mean {mean_on:.1} ms sd {sd_on:.1} ms");
    assert!(sd_off > 20.0, "the fake really is bursty: {sd_off}");
    assert!(sd_on < 5.0, "paced stream is steady: sd {sd_on} ms");
    assert!(
        ttft_on < ttft_off + Duration::from_millis(25),
        "first token not delayed: {ttft_on:?} vs {ttft_off:?}"
    );
    // Delivered intervals were measured at the socket write.
    assert!(
        uf.metric(
            "ultrafast_inference_inter_token_seconds_count",
            &["lane=\"ultra\""]
        ) >= 39.0
    );
}

#[test]
fn streams_keep_the_client_and_the_upstream_connection() {
    let fake = Fake::start(&["--tokens", "5", "--itl-ms", "1"]);
    let uf = Ultrafast::start(&format!(
        "{INFERENCE_ROUTE}{}",
        upstream_model("m", &[&fake], "")
    ));
    // HTTP/1.1: each stream is chunked, so one connection carries them all.
    let mut c = Client::connect(uf.addr).unwrap();
    let json = [("Content-Type", "application/json")];
    for i in 0..3 {
        let body = chat_body(5, true);
        let r = c
            .request("POST", "/v1/chat/completions", &json, body.as_bytes())
            .unwrap();
        assert_eq!(r.status, 200, "stream {i}");
        assert_eq!(r.header("transfer-encoding"), Some("chunked"), "stream {i}");
        let text = r.text();
        assert!(
            text.trim_end().ends_with("data: [DONE]"),
            "stream {i}: {text}"
        );
        assert!(text.matches("\"content\":\"").count() >= 5, "{text}");
        // The upstream connection goes back to the pool after the stream.
        std::thread::sleep(Duration::from_millis(100));
    }
    // Kept idle between the streams, one upstream connection served all.
    assert_eq!(fake.stat("inference_connections"), 1);
    // HTTP/1.0 knows no chunks: the close ends the body.
    let body = chat_body(5, true);
    let mut s = std::net::TcpStream::connect(uf.addr).unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    std::io::Write::write_all(&mut s, format!("{head}{body}").as_bytes()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut all = String::new();
    std::io::Read::read_to_string(&mut s, &mut all).unwrap();
    let (h, b) = all.split_once("\r\n\r\n").unwrap();
    assert!(
        h.starts_with("HTTP/1.0 200") || h.starts_with("HTTP/1.1 200"),
        "{h}"
    );
    assert!(!h.to_ascii_lowercase().contains("transfer-encoding"), "{h}");
    assert!(b.trim_end().ends_with("data: [DONE]"), "{b}");
    assert_eq!(fake.stat("inference_connections"), 1);
}

#[test]
fn bad_requests_get_openai_errors() {
    let fake = Fake::start(&[]);
    let uf = Ultrafast::start(&format!(
        "[limits]\nclient_max_body_bytes = 4096\n\n{INFERENCE_ROUTE}{}",
        upstream_model("m", &[&fake], "")
    ));
    let post = |body: &[u8]| {
        Client::connect(uf.addr)
            .unwrap()
            .request("POST", "/v1/chat/completions", &[], body)
            .unwrap()
    };
    let r = post(b"{\"model\": ");
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["code"], "invalid_json");
    let big = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "x".repeat(10_000)
    );
    let r = post(big.as_bytes());
    assert_eq!(r.status, 413, "{}", r.text());
    let r = post(br#"{"model":"m","messages":[{"role":"user","content":"x"}],"stop":[1,2]}"#);
    assert_eq!(
        (r.status, r.json()["error"]["param"].as_str()),
        (400, Some("stop"))
    );
    let r = post(br#"{"model":"nope","messages":[{"role":"user","content":"x"}]}"#);
    assert_eq!(
        (r.status, r.json()["error"]["code"].as_str()),
        (404, Some("model_not_found"))
    );
    let r = Client::connect(uf.addr)
        .unwrap()
        .request("GET", "/v1/chat/completions", &[], b"")
        .unwrap();
    assert_eq!(r.status, 405);
    assert_eq!(fake.stat("requests"), 0, "nothing bad reached the upstream");
}

#[test]
fn sse_is_not_buffered_over_http2() {
    // 6 tokens 250 ms apart: the first event must reach an HTTP/2 client
    // long before the stream ends.
    let fake = Fake::start(&["--tokens", "6", "--itl-ms", "250", "--ttft-ms", "10"]);
    let port = free_port();
    let uf = Ultrafast::start(&format!(
        "[[listeners]]\nname = \"h2c\"\naddress = \"127.0.0.1:{port}\"\nh2c = true\n\n{INFERENCE_ROUTE}{}",
        upstream_model("m", &[&fake], "")
    ));
    let t0 = std::time::Instant::now();
    let mut curl = std::process::Command::new("curl")
        .args([
            "-sN",
            "--http2-prior-knowledge",
            "-H",
            "content-type: application/json",
            "-d",
        ])
        .arg(chat_body(6, true))
        .arg(format!("http://127.0.0.1:{port}/v1/chat/completions"))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut r = std::io::BufReader::new(curl.stdout.take().unwrap());
    let mut line = String::new();
    let mut arrivals = Vec::new();
    while std::io::BufRead::read_line(&mut r, &mut line).unwrap() > 0 {
        if line.starts_with("data: {")
            && line.contains("\"content\":\"")
            && !line.contains("\"content\":\"\"")
        {
            arrivals.push(t0.elapsed());
        }
        line.clear();
    }
    curl.wait().unwrap();
    let _ = &uf;
    assert_eq!(arrivals.len(), 6, "{arrivals:?}");
    assert!(
        arrivals[0] < Duration::from_millis(700),
        "first token at {:?}",
        arrivals[0]
    );
    assert!(
        arrivals[5] - arrivals[0] > Duration::from_millis(1000),
        "events arrived together: {arrivals:?}"
    );
}

/// The data of a stream's events, parsed (`[DONE]` left out).
fn chunks(evs: &[Arrival]) -> Vec<serde_json::Value> {
    evs.iter()
        .filter(|e| e.data != "[DONE]")
        .map(|e| serde_json::from_str(&e.data).unwrap())
        .collect()
}

#[test]
fn a_stream_with_nothing_to_rewrite_passes_the_upstreams_events_through() {
    let fake = Fake::start(&["--tokens", "8", "--itl-ms", "1", "--name", "fp-up"]);
    let cfg = |lanes: &str| {
        format!(
            "{INFERENCE_ROUTE}{lanes}{}",
            upstream_model("m", &[&fake], "")
        )
    };
    let uf = Ultrafast::start(&cfg(""));
    let expected = "The quick brown fox jumps over the lazy";
    let usage_body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":8,"stream":true,"stream_options":{"include_usage":true}}"#;
    for (body, usage) in [(chat_body(8, true), false), (usage_body.to_string(), true)] {
        let s = post_stream(uf.addr, "/v1/chat/completions", &body, &[]);
        let (evs, comments) = read_sse(s, Duration::from_secs(10));
        assert_eq!(evs.last().unwrap().data, "[DONE]");
        assert_eq!(evs.iter().filter(|e| e.data == "[DONE]").count(), 1);
        let cs = chunks(&evs);
        // Every chunk is the upstream's own (its id and fingerprint), none
        // the edge's.
        for c in &cs {
            assert!(c["id"].as_str().unwrap().starts_with("fake-"), "{c}");
            if c["usage"].is_null() {
                assert_eq!(c["system_fingerprint"], "fp-up", "{c}");
            }
        }
        let text: String = contents(&evs).into_iter().map(|(_, t)| t).collect();
        assert_eq!(text, expected);
        let finish: Vec<_> = cs
            .iter()
            .filter_map(|c| c["choices"][0]["finish_reason"].as_str())
            .collect();
        assert_eq!(finish, ["length"]);
        // The finish chunk, held to the end, carries the edge's timing.
        let last = cs
            .iter()
            .find(|c| c["choices"][0]["finish_reason"].is_string())
            .unwrap();
        assert!(
            last["ultrafast_timing"]["total_ms"].as_f64().unwrap() > 0.0,
            "{last}"
        );
        // The usage chunk only for a client that asked for it.
        let usages: Vec<_> = cs.iter().filter(|c| c["usage"].is_object()).collect();
        if usage {
            assert_eq!(usages.len(), 1);
            assert_eq!(usages[0]["usage"]["completion_tokens"], 8);
        } else {
            assert!(usages.is_empty(), "{cs:?}");
            assert!(cs
                .iter()
                .all(|c| !c["choices"].as_array().unwrap().is_empty()));
        }
        // The edge's latency breakdown still ends the stream, as a comment.
        assert!(
            comments
                .iter()
                .any(|c| c.starts_with("server-timing network;dur=")),
            "{comments:?}"
        );
    }
    // Tokens were counted without parsing the chunks, and the time to
    // first token observed.
    assert_eq!(
        uf.metric_settled(
            "ultrafast_inference_tokens_total",
            &["kind=\"completion\""],
            16.0,
            Duration::from_secs(5)
        ),
        16.0
    );
    assert_eq!(
        uf.metric(
            "ultrafast_inference_ttft_seconds_count",
            &["backend=\"upstream\""]
        ),
        2.0
    );
    // A server that takes no `stream_options` sends no usage chunk: a
    // client that asks for one gets the edge's.
    uf.write_config(&format!(
        "{INFERENCE_ROUTE}{}",
        upstream_model_in("m", &[&fake], "dialect = \"llamacpp\"", "")
    ));
    assert_eq!(uf.reload().status, 200);
    let s = post_stream(uf.addr, "/v1/chat/completions", usage_body, &[]);
    let (evs, _) = read_sse(s, Duration::from_secs(10));
    let cs = chunks(&evs);
    let usages: Vec<_> = cs.iter().filter(|c| c["usage"].is_object()).collect();
    assert_eq!(usages.len(), 1, "{cs:?}");
    assert_eq!(usages[0]["system_fingerprint"], "ultrafast");
    assert_eq!(usages[0]["usage"]["completion_tokens"], 8);
    // On a paced lane the chunks are the edge's own, with the same text.
    uf.write_config(&cfg(
        "[lanes.standard]\nrank = 1\npace = \"fixed\"\npace_interval_ms = 1\n\n",
    ));
    assert_eq!(uf.reload().status, 200);
    let s = post_stream(uf.addr, "/v1/chat/completions", &chat_body(8, true), &[]);
    let (evs, _) = read_sse(s, Duration::from_secs(10));
    let cs = chunks(&evs);
    assert!(
        cs.iter().all(|c| c["system_fingerprint"] == "ultrafast"),
        "{cs:?}"
    );
    let text: String = contents(&evs).into_iter().map(|(_, t)| t).collect();
    assert_eq!(text, expected);
}

#[test]
fn penalties_and_bias_reach_the_upstream_and_what_it_cannot_take_is_refused() {
    let (plain, vllm) = (Fake::start(&[]), Fake::start(&[]));
    let uf = Ultrafast::start(&format!(
        "{INFERENCE_ROUTE}{}{}",
        upstream_model("m", &[&plain], ""),
        upstream_model_in("v", &[&vllm], "dialect = \"vllm\"", "")
    ));
    let body = |model: &str, extra: &str| {
        format!(
            r#"{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}],"max_tokens":4{extra}}}"#
        )
    };
    let r = post_to(
        &uf,
        "/v1/chat/completions",
        &body(
            "m",
            r#","frequency_penalty":0.5,"presence_penalty":0.25,"logit_bias":{"42":-100}"#,
        ),
        &[],
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let sent = &plain.stats()["last_body"];
    assert_eq!(sent["frequency_penalty"], 0.5, "{sent}");
    assert_eq!(sent["presence_penalty"], 0.25, "{sent}");
    assert_eq!(
        sent["logit_bias"],
        serde_json::json!({"42": -100.0}),
        "{sent}"
    );
    assert!(sent.get("min_p").is_none(), "{sent}");
    // An OpenAI-kind upstream takes neither min_p nor repetition_penalty:
    // refused by name rather than served without them.
    for field in ["min_p", "repetition_penalty"] {
        let r = post_to(
            &uf,
            "/v1/chat/completions",
            &body("m", &format!(r#","{field}":0.5"#)),
            &[],
        );
        assert_eq!(r.status, 400, "{}", r.text());
        assert_eq!(r.json()["error"]["param"], field);
    }
    // vLLM takes them.
    let r = post_to(
        &uf,
        "/v1/chat/completions",
        &body("v", r#","min_p":0.1,"repetition_penalty":1.3"#),
        &[],
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let sent = &vllm.stats()["last_body"];
    assert!(
        (sent["min_p"].as_f64().unwrap() - 0.1).abs() < 1e-6,
        "{sent}"
    );
    assert!(
        (sent["repetition_penalty"].as_f64().unwrap() - 1.3).abs() < 1e-6,
        "{sent}"
    );
}

#[test]
fn no_request_field_is_silently_ignored() {
    let fake = Fake::start(&[]);
    let uf = Ultrafast::start(&format!(
        "{INFERENCE_ROUTE}{}",
        upstream_model("m", &[&fake], "")
    ));
    let chat = |extra: &str| {
        post_to(
            &uf,
            "/v1/chat/completions",
            &format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}],"max_tokens":4{extra}}}"#
            ),
            &[],
        )
    };
    // Accepted and ignored for a stated reason, or asking for nothing.
    for extra in [
        r#","store":true"#,
        r#","service_tier":"auto""#,
        r#","logprobs":false"#,
        r#","modalities":["text"]"#,
    ] {
        assert_eq!(chat(extra).status, 200, "{extra}");
    }
    // Refused by name.
    for (extra, param) in [
        (r#","n":2"#, "n"),
        (
            r#","modalities":["text","audio"],"audio":{"voice":"alloy","format":"wav"}"#,
            "modalities",
        ),
        (r#","reasoning_effort":"high""#, "reasoning_effort"),
    ] {
        let r = chat(extra);
        assert_eq!(r.status, 400, "{extra}: {}", r.text());
        assert_eq!(r.json()["error"]["param"], param, "{extra}");
    }
    // Unknown, as OpenAI says it.
    let r = chat(r#","temprature":0.5"#);
    assert_eq!(r.status, 400);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("Unrecognized request argument supplied: temprature"));
    // A completion's fields in a chat.
    assert_eq!(chat(r#","echo":true"#).status, 400);
    // Anthropic and Responses have their own tables.
    let r = post_to(
        &uf,
        "/v1/messages",
        r#"{"model":"m","max_tokens":4,"messages":[{"role":"user","content":"hi"}],"thinking":{"type":"enabled","budget_tokens":1024}}"#,
        &[],
    );
    assert_eq!(r.status, 400, "{}", r.text());
    let r = post_to(
        &uf,
        "/v1/responses",
        r#"{"model":"m","input":"hi","reasoning":{"effort":"low"}}"#,
        &[],
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "reasoning");
}
