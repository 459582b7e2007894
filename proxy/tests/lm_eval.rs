//! A real evaluation client: lm-evaluation-harness (`lm-eval` from PyPI,
//! in `.venv`) with its `local-completions` model runs a small
//! multiple-choice task from a local data file through ultrafast, scoring
//! every choice from the prompt's log-probabilities (`echo`, `logprobs`)
//! with lm-eval's `remote` tokenizer (vLLM's `/tokenize`, served here).
//! `py/lm_eval_checks.py` holds each choice's log-likelihood and the
//! accuracy to the float32 numpy reference on the same GGUF. The same
//! check against llama.cpp (which CI does not build) is
//! `benches/scripts/lm_eval_vs_llamacpp.py`, its figures in
//! `benches/RESULTS.md`.
#![allow(clippy::unwrap_used)]

mod common;
use common::infer::*;
use common::*;
use std::time::Duration;

const MODEL: &str = "smollm2-135m-instruct";

#[test]
fn lm_eval_scores_a_multiple_choice_task_as_the_references_do() {
    let uf = Ultrafast::start(&format!(
        "[[routes]]\nname = \"all\"\npath = \"/\"\ninference = true\n\n\
         [models.{MODEL}]\nbackend = \"engine\"\nsource = \"{MODEL}\"\nkv_blocks = 256\n\
         max_num_seqs = 8\nwarmup_prompt_lens = [16]\nmax_concurrency = 8\n"
    ));
    uf.wait_models_ready(Duration::from_secs(300));
    let gguf = ultrafast_engine::fetch::pull(&ultrafast_engine::fetch::SMOLLM2).unwrap();
    let work = scratch("lm-eval");
    py(
        "lm_eval_checks.py",
        &format!("http://{}", uf.addr),
        &uf,
        &[MODEL, gguf.to_str().unwrap(), work.to_str().unwrap()],
    );
}
