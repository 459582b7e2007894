//! What the engine's tests on the real model share: the model, loaded once
//! per test process, and a user message rendered through its chat template.
#![allow(dead_code, clippy::unwrap_used)]

use std::sync::{Arc, OnceLock};
use ultrafast_engine::fetch::{self, SMOLLM2};
use ultrafast_engine::generate::{self, Loaded};
use ultrafast_engine::tokenizer::ChatMessage;

/// SmolLM2, fetched (sha256-checked) and loaded once.
pub fn loaded() -> Arc<Loaded> {
    static L: OnceLock<Arc<Loaded>> = OnceLock::new();
    L.get_or_init(|| Arc::new(generate::load(&fetch::pull(&SMOLLM2).unwrap()).unwrap()))
        .clone()
}

/// The tokens of `q` as one user turn of the chat template.
pub fn prompt(q: &str) -> Vec<u32> {
    let l = loaded();
    let t = l.codec.render_chat(&[ChatMessage::new("user", q)]).unwrap();
    l.codec.encode(&t).unwrap()
}

/// A lane-1 request of `prompt` with nothing but its sampling and length.
pub fn request(
    prompt: Vec<u32>,
    sampling: ultrafast_engine::sampling::SamplingParams,
    max_tokens: usize,
) -> ultrafast_engine::scheduler::GenerateRequest {
    ultrafast_engine::scheduler::GenerateRequest {
        prompt,
        max_tokens,
        sampling,
        stop: vec![],
        lane_rank: 1,
        tenant: None,
        guide: None,
    }
}

/// Run the float32 numpy reference (`tests/reference/llama_ref.py`) on
/// `req` (its JSON input) and return its answer, one value per prompt.
pub fn float32_reference(req: &serde_json::Value) -> Vec<serde_json::Value> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/reference/llama_ref.py");
    serde_json::from_value(python_json(&[script], req)).unwrap()
}

/// Run `python3 ARGS` with `req` as JSON on stdin and return its stdout
/// as JSON (the `.venv` on `PATH` has `gguf` and `numpy`, `.ci/run`).
pub fn python_json(args: &[&str], req: &serde_json::Value) -> serde_json::Value {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let mut child = Command::new("python3")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 with the `gguf` and `numpy` packages (.ci/run installs them)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(req.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "python3 {args:?} failed");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The text a request's events spell until `Done`, refusing events
/// nothing asked for (raw tokens, reports, choices) and errors.
pub fn text(mut rx: tokio::sync::mpsc::UnboundedReceiver<ultrafast_engine::api::Event>) -> String {
    use ultrafast_engine::api::Event;
    let mut out = String::new();
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            Event::Raw { .. } => panic!("the engine sent a raw event"),
            Event::Prompt(_) | Event::Logprob(_) | Event::Indexed(..) => {
                panic!("nothing asked for reports or choices")
            }
            Event::Token { text, .. } => out.push_str(&text),
            Event::Done { text, .. } => {
                out.push_str(&text);
                return out;
            }
            Event::Error(e) => panic!("engine error: {e}"),
        }
    }
    out
}
