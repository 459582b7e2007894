#!/usr/bin/env python3
"""The in-process engine vs llama.cpp on the same GGUF, same threads, one run.

ultrafast: `engine/examples/bench.rs` through the scheduler (the path the
proxy uses). llama.cpp: `llama-cpp-python` (which compiles llama.cpp from
source; not needed in CI):
  CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python
Measured: prefill tokens/s on a 512-token prompt, TTFT of a 128-token
prompt, single-stream decode tokens/s (greedy), and for ultrafast the
aggregate decode tokens/s at 4 and 16 concurrent streams. Medians of
--repeats runs inside each tool. Last, the two engines' first-step logits
for one chat prompt (the same token ids): largest difference, argmax,
top-10 overlap.

usage: benches/scripts/engine_vs_llamacpp.py [--threads 2] [--repeats 3] [--model NAME]
--model: a known model (smollm2-135m-instruct, the default, or
qwen2.5-coder-0.5b-instruct) or a path to a GGUF; both tools read that file.
Build first: cargo build --release -p ultrafast-engine --example bench
"""
import argparse, json, os, statistics, subprocess, sys, time
from benchlib import ROOT


def toks(n, salt):
    return [1 + (i * 7919 + salt * 104729) % 49000 for i in range(n)]


def last_logits(llm):
    """The last evaluated token's logits, read from llama.cpp's context:
    llama-cpp-python 0.3 keeps `scores` only with logits_all (without it
    they stay zeros, and an argmax over them would feed token 0)."""
    import numpy as np
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))


def llama_cpp(path, threads, repeats):
    from llama_cpp import Llama
    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=2048, n_batch=512, verbose=False)
    llm.reset(); llm.eval(toks(64, 999))
    pre, ttft, dec = [], [], []
    for r in range(repeats):
        llm.reset(); t = time.perf_counter(); llm.eval(toks(512, r * 10 + 1)); pre.append(512 / (time.perf_counter() - t))
        llm.reset(); t = time.perf_counter(); llm.eval(toks(128, r * 10 + 2)); ttft.append((time.perf_counter() - t) * 1000)
        llm.reset(); llm.eval(toks(32, r * 10 + 4))
        t = time.perf_counter()
        for _ in range(128):
            # Greedy: argmax of the last logits, as the engine does.
            llm.eval([int(last_logits(llm).argmax())])
        dec.append(128 / (time.perf_counter() - t))
    return {"prefill_512_tok_s": statistics.median(pre), "ttft_128_ms": statistics.median(ttft),
            "decode_1_tok_s": statistics.median(dec)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    a = ap.parse_args()
    exe = os.path.join(ROOT, "target", "release", "examples", "bench")
    if not os.path.exists(exe):
        sys.exit("missing target/release/examples/bench: cargo build --release -p ultrafast-engine --example bench")
    env = dict(os.environ, RAYON_NUM_THREADS=str(a.threads), ULTRAFAST_BENCH_MODEL=a.model)
    out = subprocess.run([exe, str(a.repeats)], env=env, capture_output=True, text=True, check=True).stdout
    uf = json.loads(out.strip().splitlines()[-1])
    # The file the engine resolved (and verified): llama.cpp reads the same.
    model = uf["model"]
    lc = llama_cpp(model, a.threads, a.repeats)
    print(f"\n{os.path.basename(model)}, {a.threads} threads, medians of {a.repeats}")
    print("| metric | ultrafast | llama.cpp | ultrafast / llama.cpp |")
    print("|---|---|---|---|")
    for k, better in (("prefill_512_tok_s", "higher"), ("ttft_128_ms", "lower"), ("decode_1_tok_s", "higher")):
        print(f"| {k} ({better} is better) | {uf[k]:.1f} | {lc[k]:.1f} | {uf[k] / lc[k]:.2f}x |")
    print(f"| decode_4_tok_s (aggregate) | {uf['decode_4_tok_s']:.1f} | - | {uf['decode_4_tok_s'] / uf['decode_1_tok_s']:.2f}x our single stream |")
    print(f"| decode_16_tok_s (aggregate) | {uf['decode_16_tok_s']:.1f} | - | {uf['decode_16_tok_s'] / uf['decode_1_tok_s']:.2f}x our single stream |")
    print(f"| decode_1_sampled_tok_s (temperature 0.8, top-p 0.95) | {uf['decode_1_sampled_tok_s']:.1f} | - | {uf['decode_1_sampled_tok_s'] / uf['decode_1_tok_s']:.2f}x our greedy |")
    # The same logits as llama.cpp's: first-step logits of one chat prompt
    # (the engine's token ids fed to both), compared over the vocabulary.
    out = subprocess.run([exe, "logits"], env=env, capture_output=True, text=True, check=True).stdout
    ours = json.loads(out.strip().splitlines()[-1])
    from llama_cpp import Llama
    import numpy as np
    llm = Llama(model_path=model, n_threads=a.threads, n_ctx=2048, verbose=False)
    llm.eval(ours["ids"])
    theirs = np.array(last_logits(llm), dtype=np.float32)
    mine = np.array(ours["logits"], dtype=np.float32)
    top = lambda v: set(np.argsort(-v)[:10].tolist())
    print(f"\nfirst-step logits over {len(mine)} tokens ({len(ours['ids'])}-token prompt): "
          f"max |ultrafast - llama.cpp| {np.abs(mine - theirs).max():.3f}, "
          f"argmax {'equal' if mine.argmax() == theirs.argmax() else 'DIFFERENT'}, "
          f"top-10 overlap {len(top(mine) & top(theirs))}/10")


if __name__ == "__main__":
    main()
