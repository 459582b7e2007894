"""lm-evaluation-harness through ultrafast (`proxy/tests/lm_eval.rs`):
`python3 lm_eval_checks.py ROOT_URL MODEL GGUF_PATH WORK_DIR [--llama-cpp]`.

A small multiple-choice task from a local data file (written here; nothing
is downloaded) runs with lm-eval's own `local-completions` model, which
scores each choice from the prompt's log-probabilities (`echo`,
`logprobs`, `max_tokens` 1) with lm-eval's `remote` tokenizer (ultrafast's
`/tokenize`), both as token ids (lm-eval's default) and as text. Each
choice's log-likelihood is held to the same choice scored by an
independent reference on the same GGUF, and the accuracy must be the
reference's:

- always, the float32 numpy forward pass of the engine's golden test
  (`engine/tests/reference/llama_ref.py`);
- with `--llama-cpp`, llama.cpp itself through `llama-cpp-python`
  (`Llama(logits_all=True)`: row p of its scores predicts token p + 1).
  Its OpenAI server's `echo` log-probabilities are shifted by one token
  (llama-cpp-python issue #1983: each prompt token is scored by the row
  after it), so lm-eval through that server measures that bug, not the
  model; the check runs lm-eval through it too and prints its figures
  beside ours, without holding us to them.

Tolerance: a choice's log-likelihood within LL_TOL nats of the
reference's (the golden test's logit tolerance: the engine's 8-bit
activations against float32; measured at most 0.87, on a question where
every choice's row is shifted alike), and the margins between the choices
of a question, which decide the answer, within MARGIN_TOL (measured at
most 0.35)."""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "engine", "tests", "reference"))

LL_TOL = 1.5
MARGIN_TOL = 0.75

QUESTIONS = [
    ("What is the capital of France?", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("Which animal says moo?", ["A cat", "A cow", "A dog", "A duck"], 1),
    ("What color is the sky on a clear day?", ["Green", "Red", "Blue", "Yellow"], 2),
    ("How many legs does a spider have?", ["Six", "Four", "Ten", "Eight"], 3),
    ("What do bees make?", ["Honey", "Milk", "Silk", "Wool"], 0),
    ("Which planet do we live on?", ["Mars", "Earth", "Venus", "Jupiter"], 1),
    ("What is frozen water called?", ["Steam", "Ice", "Sand", "Glass"], 1),
    ("Which of these is a fruit?", ["Carrot", "Potato", "Apple", "Onion"], 2),
]


def write_task(work):
    tasks = os.path.join(work, "tasks")
    os.makedirs(tasks, exist_ok=True)
    data = os.path.join(tasks, "mc.jsonl")
    with open(data, "w") as f:
        for q, c, a in QUESTIONS:
            f.write(json.dumps({"question": q, "choices": c, "answer": a}) + "\n")
    with open(os.path.join(tasks, "uf_mc.yaml"), "w") as f:
        f.write(f"""task: uf_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    return tasks


def evaluate(lm, tasks):
    """Accuracy and, per document, each choice's (context, continuation,
    log-likelihood) as lm-eval scored them."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    out = simple_evaluate(model=lm, tasks=["uf_mc"], task_manager=TaskManager(include_path=tasks),
                          log_samples=True, bootstrap_iters=0)
    acc = out["results"]["uf_mc"]["acc,none"]
    docs = []
    for s in sorted(out["samples"]["uf_mc"], key=lambda s: s["doc_id"]):
        docs.append([(a[0], a[1], float(r[0][0])) for a, r in zip(s["arguments"], s["resps"])])
    return acc, docs


def compare(docs, ref_lls, what):
    """The largest absolute and margin differences of lm-eval's scores
    (`docs`) from a reference's, checked against the tolerances."""
    worst, worst_margin = 0.0, 0.0
    for d, rd in zip(docs, ref_lls):
        ours = [x for _, _, x in d]
        worst = max(worst, max(abs(x - r) for x, r in zip(ours, rd)))
        for i in range(len(ours)):
            m = (ours[i] - ours[0]) - (rd[i] - rd[0])
            worst_margin = max(worst_margin, abs(m))
    print(f"{what}: largest per-choice log-likelihood difference {worst:.3f}, margin difference {worst_margin:.3f}")
    assert worst < LL_TOL and worst_margin < MARGIN_TOL, (what, worst, worst_margin)


def accuracy(lls_by_doc):
    right = sum(1 for (q, c, a), lls in zip(QUESTIONS, lls_by_doc) if max(range(len(lls)), key=lambda i: lls[i]) == a)
    return right / len(QUESTIONS)


def main():
    root, model, gguf, work = sys.argv[1:5]
    with_llama = "--llama-cpp" in sys.argv[5:]
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    tasks = write_task(work)
    base = root + "/v1/completions"
    ours = {}
    for tokenized in (True, False):
        lm = LocalCompletionsAPI(model=model, base_url=base, tokenizer_backend="remote",
                                 tokenized_requests=tokenized, max_retries=1, num_concurrent=1)
        ours[tokenized] = evaluate(lm, tasks)
    acc, docs = ours[True]
    # Token ids and text give the same scores (one tokenizer, one model).
    for a, b in zip(docs, ours[False][1]):
        for (_, _, x), (_, _, y) in zip(a, b):
            assert abs(x - y) < 1e-3, (a, b)
    assert ours[False][0] == acc
    # The pairs exactly as lm-eval tokenized them.
    pairs = [[lm._encode_pair(c, k) for c, k, _ in d] for d in docs]

    from llama_ref import Ref, score
    ref = Ref(gguf)
    ref_lls = []
    for d in pairs:
        row = []
        for ctx, cont in d:
            s = score(ref, ctx + cont, 1)
            row.append(sum(s[p]["logprob"] for p in range(len(ctx), len(ctx) + len(cont))))
        ref_lls.append(row)
    print(f"lm-eval through ultrafast: acc {acc:.3f}; numpy reference: acc {accuracy(ref_lls):.3f}")
    compare(docs, ref_lls, "ultrafast vs the numpy reference")
    assert acc == accuracy(ref_lls), (acc, accuracy(ref_lls))

    if with_llama:
        from llama_cpp import Llama
        llm = Llama(model_path=gguf, logits_all=True, n_ctx=512, n_threads=2, verbose=False)
        lc_lls = []
        for d in pairs:
            row = []
            for ctx, cont in d:
                ids = ctx + cont
                llm.reset()
                llm.eval(ids)
                lp = Llama.logits_to_logprobs(llm.scores[: len(ids)])
                row.append(sum(float(lp[p - 1][ids[p]]) for p in range(len(ctx), len(ids))))
            lc_lls.append(row)
        print(f"llama.cpp (llama-cpp-python, same GGUF): acc {accuracy(lc_lls):.3f}")
        compare(docs, lc_lls, "ultrafast vs llama.cpp")
        assert acc == accuracy(lc_lls), (acc, accuracy(lc_lls))


if __name__ == "__main__":
    main()
