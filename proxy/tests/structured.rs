//! Structured outputs and tool calls through the official `openai` client
//! (`py/structured_checks.py`): on the in-process engine with the real
//! model, every output validates against its schema (22 schemas, streamed
//! and whole, four at a time); tools named, required and auto, streamed as
//! argument deltas; schemas the library cannot compile refused with a 400
//! naming the field. Against an upstream pool of fake-openai, the same
//! requests reach the upstream with their fields unchanged and its
//! `tool_calls` come back in the same shape.
#![allow(clippy::unwrap_used)]

mod common;
use common::infer::*;
use common::*;
use std::time::Duration;

const MODEL: &str = "smollm2-135m-instruct";

fn check(name: &str, uf: &Ultrafast, model: &str, stats: Option<String>) {
    let base = format!("http://{}/v1", uf.addr);
    let mut args = vec![base.as_str(), model];
    args.extend(stats.as_deref());
    py("structured_checks.py", name, uf, &args);
}

#[test]
fn the_engine_follows_schemas_and_calls_tools() {
    let uf = Ultrafast::start(&format!(
        "{INFERENCE_ROUTE}[models.{MODEL}]\nbackend = \"engine\"\nsource = \"{MODEL}\"\nkv_blocks = 512\nmax_num_seqs = 8\nwarmup_prompt_lens = [16]\n"
    ));
    uf.wait_models_ready(Duration::from_secs(300));
    check("schemas", &uf, MODEL, None);
    check("tools", &uf, MODEL, None);
    check("refusals", &uf, MODEL, None);
}

#[test]
fn upstream_models_get_the_fields_unchanged() {
    let fake = Fake::start(&["--tokens", "20", "--itl-ms", "1"]);
    let uf = Ultrafast::start(&format!(
        "{INFERENCE_ROUTE}{}",
        upstream_model("m", &[&fake], "")
    ));
    let stats = Some(format!("http://{}/stats", fake.addr));
    check("schemas", &uf, "m", stats.clone());
    check("tools", &uf, "m", stats.clone());
    check("refusals", &uf, "m", stats);
}
