//! `lb = "queue_aware"`: a pool that reads its members' own
//! `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc` (fake
//! upstreams that expose them as vLLM does) sends requests to the least
//! loaded member, and balances by requests in flight once a member's
//! figures go stale. Also: every inference request (whole, streaming,
//! async) is observed in the TTFT, inter-token and queue histograms.
#![allow(clippy::unwrap_used)]

mod common;
use common::infer::*;
use common::*;
use std::time::Duration;

fn chat(uf: &Ultrafast, stream: bool) -> Resp {
    let body = format!(
        r#"{{"model":"qa","messages":[{{"role":"user","content":"hi"}}],"max_tokens":3,"stream":{stream}}}"#
    );
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

/// Send `n` requests one at a time; how many each fake got.
fn spread(uf: &Ultrafast, fakes: &[&Fake], n: usize) -> Vec<u64> {
    let before: Vec<u64> = fakes.iter().map(|f| f.stat("requests")).collect();
    for _ in 0..n {
        let r = chat(uf, false);
        assert_eq!(r.status, 200, "{}", r.text());
    }
    fakes
        .iter()
        .zip(before)
        .map(|(f, b)| f.stat("requests") - b)
        .collect()
}

/// Wait until both fakes have been scraped twice more (so the latest
/// `/control` values are what the pool holds).
fn scraped(fakes: &[&Fake]) {
    let start: Vec<u64> = fakes.iter().map(|f| f.stat("metrics_gets")).collect();
    assert!(
        eventually(Duration::from_secs(5), || fakes
            .iter()
            .zip(&start)
            .all(|(f, s)| f.stat("metrics_gets") >= s + 2)),
        "the pool does not scrape its members"
    );
}

fn pool(a: &Fake, b: &Fake) -> Ultrafast {
    Ultrafast::start(&format!(
        "{INFERENCE_ROUTE}{}",
        upstream_model_in(
            "qa",
            &[a, b],
            "lb = \"queue_aware\"\nscrape_interval_ms = 100",
            ""
        )
    ))
}

#[test]
fn requests_go_where_fewest_wait_and_the_kv_cache_has_room() {
    let a = Fake::start(&["--name", "qa", "--tokens", "3", "--ttft-ms", "1"]);
    let b = Fake::start(&["--name", "qa", "--tokens", "3", "--ttft-ms", "1"]);
    let uf = pool(&a, &b);
    a.control(r#"{"vllm_waiting": 40}"#);
    b.control(r#"{"vllm_waiting": 0}"#);
    scraped(&[&a, &b]);
    assert_eq!(spread(&uf, &[&a, &b], 10), vec![0, 10]);
    a.control(r#"{"vllm_waiting": 0}"#);
    b.control(r#"{"vllm_waiting": 40}"#);
    scraped(&[&a, &b]);
    assert_eq!(spread(&uf, &[&a, &b], 10), vec![10, 0]);
    // Queues equal: the fuller KV cache loses.
    a.control(r#"{"vllm_waiting": 0, "vllm_kv_usage": 0.95}"#);
    b.control(r#"{"vllm_waiting": 0, "vllm_kv_usage": 0.1}"#);
    scraped(&[&a, &b]);
    assert_eq!(spread(&uf, &[&a, &b], 10), vec![0, 10]);
}

#[test]
fn stale_figures_fall_back_to_least_outstanding() {
    let a = Fake::start(&["--name", "qa", "--tokens", "3", "--ttft-ms", "1"]);
    let b = Fake::start(&["--name", "qa", "--tokens", "3", "--ttft-ms", "1"]);
    let uf = pool(&a, &b);
    b.control(r#"{"vllm_waiting": 40}"#);
    scraped(&[&a, &b]);
    assert_eq!(spread(&uf, &[&a, &b], 6), vec![6, 0]);
    // A's metrics stop answering: its figures go stale after three
    // intervals, and the pool spreads by requests in flight, so B (which
    // still says 40 wait) gets its share rather than none.
    a.control(r#"{"metrics": false}"#);
    std::thread::sleep(Duration::from_millis(600));
    let got = spread(&uf, &[&a, &b], 10);
    assert!(got[0] >= 3 && got[1] >= 3, "{got:?}");
}

#[test]
fn every_kind_of_request_is_observed_from_arrival() {
    let fake = Fake::start(&["--name", "qa", "--tokens", "4", "--ttft-ms", "20"]);
    let uf = Ultrafast::start(&format!(
        "{INFERENCE_ROUTE}{}",
        upstream_model("qa", &[&fake], "")
    ));
    let count = |family: &str| uf.metric(family, &["model=\"qa\""]);
    // One whole-response request alone gives a TTFT, inter-token and queue
    // sample (it used to give only e2e).
    assert_eq!(chat(&uf, false).status, 200);
    assert_eq!(count("ultrafast_inference_ttft_seconds_count"), 1.0);
    assert!(count("ultrafast_inference_inter_token_seconds_count") >= 1.0);
    assert_eq!(count("ultrafast_inference_queue_seconds_count"), 1.0);
    assert!(count("ultrafast_inference_ttft_seconds_sum") >= 0.02);
    assert_eq!(chat(&uf, true).status, 200);
    assert_eq!(count("ultrafast_inference_ttft_seconds_count"), 2.0);
    // Async: 202, then the job finishes in the background.
    let body = r#"{"model":"qa","messages":[{"role":"user","content":"hi"}],"max_tokens":3}"#;
    let r = Client::connect(uf.addr)
        .unwrap()
        .request(
            "POST",
            "/v1/chat/completions",
            &[
                ("content-type", "application/json"),
                ("prefer", "respond-async"),
            ],
            body.as_bytes(),
        )
        .unwrap();
    assert_eq!(r.status, 202, "{}", r.text());
    assert!(
        eventually(Duration::from_secs(5), || count(
            "ultrafast_inference_ttft_seconds_count"
        ) == 3.0),
        "{}",
        uf.metrics()
    );
    assert!(
        eventually(Duration::from_secs(5), || count(
            "ultrafast_inference_queue_seconds_count"
        ) == 3.0),
        "{}",
        uf.metrics()
    );
}
