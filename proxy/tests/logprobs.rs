//! Log-probabilities, echo and the tokenizer endpoints over HTTP, with
//! the real model and the official `openai` client (`py/logprobs_checks.py`):
//! chat's `logprobs`/`top_logprobs` whole and streamed, the Responses
//! API's `include` and `top_logprobs`, completions'
//! legacy `logprobs` with `echo` (scoring with `max_tokens` 0, a prompt of
//! token ids, streamed echo), each held to the float32 numpy reference;
//! vLLM's `/tokenize`, `/detokenize` and `/tokenizer_info`; `n` choices
//! from one prefill (the prefix cache's hits show the shared blocks); and
//! an upstream's scores relayed in either shape; and the refusals by name
//! (bounds, async requests, what an upstream cannot be asked).
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
    check("responses", &uf);
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
    // A background response cannot keep reports either.
    let body = format!(
        r#"{{"model":"{MODEL}","input":"hi","max_output_tokens":4,"top_logprobs":2,"background":true}}"#
    );
    let r = post_to(&uf, "/v1/responses", &body, &[]);
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "logprobs");
}

#[test]
fn an_upstream_models_scores_are_relayed_and_echo_n_and_token_ids_refused() {
    let fake = Fake::start(&[]);
    let uf = Ultrafast::start(&format!(
        "{INFERENCE_ROUTE}{}",
        upstream_model("up", &[&fake], "")
    ));
    // The fake scores a token -0.25 - 0.125 x (its length mod 7) and
    // lists `altJ` alternatives below it.
    let want = |t: &str| -0.25 - (t.len() % 7) as f64 * 0.125;
    let chat = r#"{"model":"up","messages":[{"role":"user","content":"hi"}],"max_tokens":5,"logprobs":true,"top_logprobs":2"#;
    for stream in [false, true] {
        let body = format!("{chat},\"stream\":{stream}}}");
        let r = post_to(&uf, "/v1/chat/completions", &body, &[]);
        assert_eq!(r.status, 200, "{}", r.text());
        let entries: Vec<serde_json::Value> = if stream {
            r.text()
                .lines()
                .filter_map(|l| l.strip_prefix("data: "))
                .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
                .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array().cloned())
                .flatten()
                .collect()
        } else {
            r.json()["choices"][0]["logprobs"]["content"]
                .as_array()
                .unwrap()
                .clone()
        };
        assert_eq!(entries.len(), 5, "stream {stream}: {}", r.text());
        for e in &entries {
            let t = e["token"].as_str().unwrap();
            assert_eq!(e["logprob"].as_f64().unwrap(), want(t), "{e}");
            assert_eq!(e["top_logprobs"].as_array().unwrap().len(), 2, "{e}");
            assert_eq!(e["bytes"], serde_json::json!(t.as_bytes()));
        }
    }
    let body = r#"{"model":"up","prompt":"hi","max_tokens":4,"logprobs":1}"#;
    let r = post_to(&uf, "/v1/completions", body, &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    let lp = &r.json()["choices"][0]["logprobs"];
    let tokens = lp["tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), 4, "{lp}");
    for (i, t) in tokens.iter().enumerate() {
        let t = t.as_str().unwrap();
        assert_eq!(lp["token_logprobs"][i].as_f64().unwrap(), want(t));
        assert!(lp["top_logprobs"][i].get(t).is_some(), "{lp}");
    }
    // The fake was asked in its own dialect's shape.
    let last = fake.stats()["last_body"].clone();
    assert_eq!(last["logprobs"], 1, "{last}");
    for (extra, param) in [
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
