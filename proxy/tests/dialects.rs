//! Anthropic's Messages API (official `anthropic` client) and OpenAI's
//! Responses API (official `openai` client), `py/dialect_checks.py`: on the
//! in-process engine with the real model, and on an upstream pool of
//! fake-openai (where the requests must reach the upstream as chat
//! completions with tools, results and stored turns in OpenAI's shape).
//! Anthropic's `x-api-key` authenticates as a bearer token does, and its
//! refusals come in Anthropic's error shape.
#![allow(clippy::unwrap_used)]

mod common;
use common::infer::*;
use common::*;
use std::time::Duration;

const MODEL: &str = "smollm2-135m-instruct";

fn check(name: &str, uf: &Ultrafast, model: &str, stats: Option<String>) {
    let base = format!("http://{}", uf.addr);
    let mut args = vec![base.as_str(), model];
    args.extend(stats.as_deref());
    py("dialect_checks.py", name, uf, &args);
}

#[test]
fn messages_and_responses_on_the_engine() {
    let uf = Ultrafast::start(&format!(
        "{INFERENCE_ROUTE}[models.{MODEL}]\nbackend = \"engine\"\nsource = \"{MODEL}\"\nkv_blocks = 512\nmax_num_seqs = 8\nwarmup_prompt_lens = [16]\n"
    ));
    uf.wait_models_ready(Duration::from_secs(300));
    check("messages", &uf, MODEL, None);
    check("responses", &uf, MODEL, None);
    // The engine served both dialects through the same pipeline.
    assert!(
        uf.metric(
            "ultrafast_inference_ttft_seconds_count",
            &["backend=\"engine\""]
        ) > 10.0
    );
}

#[test]
fn messages_and_responses_on_an_upstream_pool() {
    let fake = Fake::start(&["--tokens", "12", "--itl-ms", "1"]);
    let uf = Ultrafast::start(&format!(
        "{INFERENCE_ROUTE}{}",
        upstream_model("m", &[&fake], "")
    ));
    let stats = Some(format!("http://{}/stats", fake.addr));
    check("messages", &uf, "m", stats.clone());
    check("responses", &uf, "m", stats);
}

#[test]
fn x_api_key_authenticates_and_refusals_are_in_anthropic_shape() {
    let fake = Fake::start(&["--tokens", "4"]);
    let dir = scratch("dialect-keys");
    let file = dir.join("keys.toml");
    std::fs::write(&file, "[[keys]]\nname = \"a\"\nkey = \"sk-ant-a\"\n").unwrap();
    let uf = Ultrafast::start(&format!(
        "[api_keys]\nfile = \"{}\"\n\n{INFERENCE_ROUTE}{}",
        file.display(),
        upstream_model("m", &[&fake], "")
    ));
    let body = r#"{"model":"m","max_tokens":4,"messages":[{"role":"user","content":"hi"}]}"#;
    let ok = post_to(
        &uf,
        "/v1/messages",
        body,
        &[
            ("x-api-key", "sk-ant-a"),
            ("anthropic-version", "2023-06-01"),
        ],
    );
    assert_eq!(ok.status, 200, "{}", ok.text());
    assert_eq!(ok.json()["type"], "message");
    let bearer = post_to(
        &uf,
        "/v1/messages",
        body,
        &[("authorization", "Bearer sk-ant-a")],
    );
    assert_eq!(bearer.status, 200, "{}", bearer.text());
    for h in [vec![], vec![("x-api-key", "sk-wrong")]] {
        let r = post_to(&uf, "/v1/messages", body, &h);
        assert_eq!(r.status, 401, "{}", r.text());
        let j = r.json();
        assert_eq!(j["type"], "error", "{}", r.text());
        assert_eq!(j["error"]["type"], "authentication_error", "{}", r.text());
        assert!(r.header("x-request-id").is_some());
    }
    // The same refusal on chat completions keeps OpenAI's shape.
    let r = post_to(
        &uf,
        "/v1/chat/completions",
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
        &[],
    );
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["code"], "invalid_api_key", "{}", r.text());
}
