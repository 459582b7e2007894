//! The GPU check runs each stage as its own process (#45): a stage that
//! fails, crashes or hangs leaves the other stages' results, is run again
//! with `CUDA_LAUNCH_BLOCKING=1`, and the summary table says what came of
//! every stage. Checked here with stand-in stages, since the real ones
//! need a GPU.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Command;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap()
}

/// Runs `script` in bash after sourcing the stage runner; its output and
/// exit status.
fn run(script: &str) -> (String, i32) {
    let lib = root().join("benches/scripts/gpu_stages.sh");
    let out = Command::new("bash")
        .arg("-c")
        .arg(format!(". '{}'\n{script}", lib.display()))
        .env_remove("CUDA_LAUNCH_BLOCKING")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    (text, out.status.code().unwrap_or(-1))
}

fn row<'a>(out: &'a str, stage: &str) -> &'a str {
    out.lines()
        .find(|l| l.starts_with(&format!("| {stage} |")))
        .unwrap_or_else(|| panic!("no summary row for {stage} in:\n{out}"))
}

#[test]
fn a_failing_stage_leaves_the_others_results_and_is_rerun_blocking() {
    let (out, code) = run(r#"
stage first 10 bash -c 'echo "first ran"; exit 0'
stage mismatch 10 bash -c 'echo "mismatch ran blocking=${CUDA_LAUNCH_BLOCKING:-0}"; exit 1'
stage crash 10 bash -c 'echo "crash ran"; kill -SEGV $$'
stage cuda 10 bash -c '[ "${CUDA_LAUNCH_BLOCKING:-0}" = 1 ] && exit 0; exit 3'
stage hang 5 sleep 30
stage after 10 bash -c 'echo "after ran"; exit 0'
skip transformers "no torch here"
summary
exit $GPU_CHECK_STATUS
"#);
    assert_eq!(code, 1, "{out}");
    // Every stage ran, those after the failures too.
    for line in ["first ran", "crash ran", "after ran"] {
        assert!(out.contains(line), "{line}:\n{out}");
    }
    // A failed stage runs again with CUDA_LAUNCH_BLOCKING=1.
    assert!(out.contains("mismatch ran blocking=0"), "{out}");
    assert!(out.contains("mismatch ran blocking=1"), "{out}");
    assert!(row(&out, "first").contains("| pass |"), "{out}");
    assert!(row(&out, "first").ends_with("| - |"), "a pass is not rerun");
    assert!(row(&out, "mismatch").contains("FAIL (mismatch)"));
    assert!(row(&out, "crash").contains("FAIL (crashed, signal 11)"));
    // A fault the blocking rerun does not meet is still a failure.
    let cuda = row(&out, "cuda");
    assert!(
        cuda.contains("FAIL (CUDA error)") && cuda.ends_with("| pass |"),
        "{cuda}"
    );
    let hang = row(&out, "hang");
    assert!(hang.contains("FAIL (timed out)"), "{hang}");
    assert!(
        hang.ends_with("| not rerun: timed out |"),
        "a hang is not rerun: {hang}"
    );
    assert!(row(&out, "after").contains("| pass |"));
    assert!(row(&out, "transformers").contains("skipped: no torch here"));
}

#[test]
fn no_gpu_is_its_own_status_and_all_passed_is_zero() {
    let (out, code) =
        run("stage kernels 10 bash -c 'echo no GPU here; exit 2'\nsummary\nexit $GPU_CHECK_STATUS");
    assert_eq!(code, 2, "{out}");
    assert!(row(&out, "kernels").contains("| no GPU |"));
    assert!(
        row(&out, "kernels").ends_with("| - |"),
        "no GPU is not rerun"
    );
    let (out, code) = run("stage a 10 true\nstage b 10 true\nsummary\nexit $GPU_CHECK_STATUS");
    assert_eq!(code, 0, "{out}");
}

#[test]
fn the_check_keeps_within_its_budget() {
    let lib = root().join("benches/scripts/gpu_stages.sh");
    let t = std::time::Instant::now();
    let run = |script: &str| {
        let out = Command::new("bash")
            .arg("-c")
            .arg(format!(
                ". '{}'\n{script}\nsummary\nexit $GPU_CHECK_STATUS",
                lib.display()
            ))
            .env("GPU_CHECK_BUDGET_S", "10")
            .output()
            .unwrap();
        let code = out.status.code().unwrap_or(-1);
        (String::from_utf8_lossy(&out.stdout).to_string(), code)
    };
    // A failure near the end of the budget: its blocking rerun does not fit.
    let (out, code) =
        run("stage slow 6 sleep 4\nstage crash 6 bash -c 'sleep 2; exit 3'\nstage next 60 true");
    assert_eq!(code, 1, "{out}");
    assert!(row(&out, "slow").contains("| pass |"), "{out}");
    assert!(
        row(&out, "crash").ends_with("| not run: out of time |"),
        "{out}"
    );
    // A stage with no time left is skipped, and a skipped stage is no pass.
    assert!(row(&out, "next").contains("skipped: out of time"), "{out}");
    // A hang takes its limit once (no rerun) and the rest of the budget.
    let (out, code) = run("stage slow 60 sleep 30\nstage next 60 true");
    assert_eq!(code, 1, "{out}");
    assert!(row(&out, "slow").contains("FAIL (timed out)"), "{out}");
    assert!(row(&out, "next").contains("skipped: out of time"), "{out}");
    assert!(t.elapsed() < std::time::Duration::from_secs(25), "{out}");
}
