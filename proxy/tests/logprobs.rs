//! Log-probabilities, echo and the tokenizer endpoints over HTTP, with
//! the real model and the official `openai` client (`py/logprobs_checks.py`):
//! chat's `logprobs`/`top_logprobs` whole and streamed, completions'
//! legacy `logprobs` with `echo` (scoring with `max_tokens` 0, a prompt of
//! token ids, streamed echo), each held to the float32 numpy reference;
//! vLLM's `/tokenize`, `/detokenize` and `/tokenizer_info`; `n` choices
//! from one prefill (the prefix cache's hits show the shared blocks); and
//! the refusals by name (bounds, async requests, upstream models).
#![allow(clippy::unwrap_used)]

mod common;
use common::infer::*;
use common::*;
use std::time::Duration;

const MODEL: &str = "smollm2-135m-instruct";

/// Every path to the inference front (vLLM's tokenizer endpoints sit at
/// the root).
const ROOT_ROUTE: &str = "[[routes]]\nname = \"all\"\npath = \"/\"\ninference = true\n\n";

fn config(extra: &str) -> String {
    format!(
        "{ROOT_ROUTE}[models.{MODEL}]\nbackend = \"engine\"\nsource = \"{MODEL}\"\nkv_blocks = 256\nmax_num_seqs = 8\nwarmup_prompt_lens = [16]\nmax_concurrency = 8\n{extra}\n"
    )
}

fn check(name: &str, uf: &Ultrafast) {
    let gguf = ultrafast_engine::fetch::pull(&ultrafast_engine::fetch::SMOLLM2).unwrap();
    let root = format!("http://{}", uf.addr);
    py(
        "logprobs_checks.py",
        name,
        uf,
        &[&root, MODEL, gguf.to_str().unwrap()],
    );
}

#[test]
fn logprobs_and_echo_match_the_reference_through_the_openai_client() {
    let uf = Ultrafast::start(&config(""));
    uf.wait_models_ready(Duration::from_secs(300));
    check("tokenizer", &uf);
    check("chat", &uf);
    check("completions", &uf);
    py(
        "logprobs_checks.py",
        "choices",
        &uf,
        &[
            &format!("http://{}", uf.addr),
            MODEL,
            &format!("http://{}", uf.admin),
        ],
    );
    // An async request cannot keep reports: refused by name.
    let body = format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}],"max_tokens":2,"logprobs":true,"background":true}}"#
    );
    let r = post_to(&uf, "/v1/chat/completions", &body, &[]);
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "logprobs");
    // The Responses API's `top_logprobs` is refused by name, not ignored.
    let body = format!(r#"{{"model":"{MODEL}","input":"hi","top_logprobs":2}}"#);
    let r = post_to(&uf, "/v1/responses", &body, &[]);
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "top_logprobs");
}

#[test]
fn an_upstream_model_refuses_reports_by_name() {
    let fake = Fake::start(&[]);
    let uf = Ultrafast::start(&format!(
        "{INFERENCE_ROUTE}{}",
        upstream_model("up", &[&fake], "")
    ));
    for (extra, param) in [
        (r#","logprobs":2"#, "logprobs"),
        (r#","echo":true"#, "echo"),
        (r#","prompt":[1,2,3]"#, "prompt"),
        (r#","n":2"#, "n"),
    ] {
        let prompt = if param == "prompt" {
            ""
        } else {
            r#","prompt":"hi""#
        };
        let body = format!(r#"{{"model":"up","max_tokens":2{prompt}{extra}}}"#);
        let r = post_to(&uf, "/v1/completions", &body, &[]);
        assert_eq!(r.status, 400, "{}", r.text());
        assert_eq!(r.json()["error"]["param"], param, "{}", r.text());
    }
}
