#!/usr/bin/env python3
"""lm-evaluation-harness through ultrafast against llama.cpp on the same
GGUF, in one run (#49): the multiple-choice task of `proxy/tests/py/
lm_eval_checks.py`, scored by lm-eval's `local-completions` model through
ultrafast, held to the float32 numpy reference and to llama.cpp's own
scores (`llama-cpp-python`, `logits_all`: row p predicts token p + 1); then
the same task through llama-cpp-python's OpenAI server, whose `echo`
log-probabilities are shifted by one token (llama-cpp-python issue
#1983), printed beside ours to show what a user of that server measures.

Needs `lm-eval[api]` (installed by .ci/run) and llama-cpp-python with its
server (not in CI: it compiles llama.cpp):
  CMAKE_ARGS="-DGGML_NATIVE=OFF" pip install 'llama-cpp-python[server]'
usage: benches/scripts/lm_eval_vs_llamacpp.py
Build first: cargo build --release -p ultrafast
"""
import glob, json, os, subprocess, sys, tempfile, time, urllib.request
from benchlib import ROOT, free_port, spawn, stop_tree, uf_head, wait_port, wait_ready

MODEL = "smollm2-135m-instruct"
CHECK = os.path.join(ROOT, "proxy", "tests", "py", "lm_eval_checks.py")


def main():
    gguf = sorted(glob.glob(os.path.expanduser("~/.cache/ultrafast/models/*SmolLM2*135M*.gguf"))
                  or glob.glob(os.path.expanduser("~/.cache/ultrafast/models/*.gguf")))[0]
    tmp = tempfile.mkdtemp(prefix="lm-eval-bench-")
    port, admin = free_port(), free_port()
    conf = os.path.join(tmp, "uf.toml")
    with open(conf, "w") as f:
        f.write(uf_head(tmp, port, admin))
        f.write('[[routes]]\nname = "all"\npath = "/"\ninference = true\n\n'
                f'[models.{MODEL}]\nbackend = "engine"\nsource = "{MODEL}"\nkv_blocks = 256\n')
    log = os.path.join(tmp, "uf.log")
    uf = spawn([os.path.join(ROOT, "target", "release", "ultrafast"), "serve", "-c", conf],
               stdout=open(log, "w"), stderr=subprocess.STDOUT)
    lc = None
    try:
        wait_ready(uf, admin, 300, log)
        root = f"http://127.0.0.1:{port}"
        work = os.path.join(tmp, "work")
        os.makedirs(work)
        subprocess.run([sys.executable, CHECK, root, MODEL, gguf, work, "--llama-cpp"], check=True)
        # The same task through llama-cpp-python's OpenAI server, tokenized
        # by ultrafast's /tokenize (that server has no tokenizer endpoint
        # lm-eval reads, and takes no token-id prompts).
        lport = free_port()
        lc = spawn([sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--logits_all", "true",
                    "--n_threads", "2", "--n_ctx", "2048", "--host", "127.0.0.1", "--port", str(lport)],
                   stdout=open(os.path.join(tmp, "llama.log"), "w"), stderr=subprocess.STDOUT)
        wait_port(lport, 120)
        sys.path.insert(0, os.path.dirname(CHECK))
        import lm_eval_checks as c
        from lm_eval.models.openai_completions import LocalCompletionsAPI
        from lm_eval.utils import RemoteTokenizer
        tasks = c.write_task(work)
        results = {}
        for name, base in (("ultrafast", root), ("llama-cpp-python server", f"http://127.0.0.1:{lport}")):
            lm = LocalCompletionsAPI(model=MODEL, base_url=base + "/v1/completions", tokenizer_backend=None,
                                     max_retries=1, num_concurrent=1)
            lm.tokenizer_backend, lm.tokenizer = "remote", RemoteTokenizer(root + "/v1/completions")
            lm.tokenized_requests = False
            t = time.perf_counter()
            acc, docs = c.evaluate(lm, tasks)
            results[name] = {"acc": acc, "seconds": round(time.perf_counter() - t, 2),
                             "lls": [[round(x, 3) for _, _, x in d] for d in docs]}
        diff = max(abs(a - b) for da, db in zip(results["ultrafast"]["lls"], results["llama-cpp-python server"]["lls"])
                   for a, b in zip(da, db))
        print(json.dumps({"through_servers": results,
                          "largest_difference_ultrafast_vs_llama_cpp_python_server": round(diff, 3)}))
    finally:
        if lc:
            stop_tree(lc)
        stop_tree(uf)


if __name__ == "__main__":
    main()
