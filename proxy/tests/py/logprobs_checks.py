"""Log-probabilities through the official `openai` client, held to the
engine crate's float32 numpy reference (`engine/tests/reference/
llama_ref.py`, its `score`: one forward pass over every position, a
float64 log-softmax of each row). Called by `proxy/tests/logprobs.rs`:
`python3 logprobs_checks.py CHECK ROOT_URL MODEL GGUF_PATH`.

Tolerance: a token's log-probability within LP_TOL nats of the reference
(the engine quantizes activations to 8 bits; its own test measured at most
0.63), the reference's likeliest token ours wherever it leads the second by
NEAR_TIE or more."""

import json
import os
import sys

import httpx
import openai

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "engine", "tests", "reference"))
from llama_ref import Ref, score  # noqa: E402

LP_TOL = 1.0
NEAR_TIE = 0.5


def client(root):
    return openai.OpenAI(base_url=root + "/v1", api_key="unused", max_retries=0, timeout=300)


def byte_level_table():
    """GPT-2's byte-level characters back to bytes."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars = {b: b for b in printable}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + n
            n += 1
    return {chr(c): b for b, c in chars.items()}


class Vocab:
    """Token ids by bytes, from the GGUF (to name what the server lists)."""

    def __init__(self, gguf_path):
        from gguf import GGUFReader
        r = GGUFReader(gguf_path)
        f = r.fields["tokenizer.ggml.tokens"]
        toks = [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        back = byte_level_table()
        self.by_bytes = {}
        for i, t in enumerate(toks):
            b = bytes(back[c] if c in back else ord(c) for c in t) if all(c in back for c in t) else t.encode()
            self.by_bytes.setdefault(b, i)

    def id(self, b):
        return self.by_bytes[bytes(b)]


def tokenize(root, **body):
    r = httpx.post(root + "/tokenize", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def compare(got, ref, what):
    """got: [(logprob, [(alt_id, alt_logprob)])] of positions p0..; ref: the
    reference's entries for the same positions."""
    worst = 0.0
    for i, ((lp, alts), r) in enumerate(zip(got, ref)):
        d = abs(lp - r["logprob"])
        worst = max(worst, d)
        assert d < LP_TOL, f"{what} position {i}: {lp} vs {r['logprob']}"
        if r["margin"] >= NEAR_TIE:
            assert alts[0][0] == r["top"][0][0], f"{what} position {i}: top {alts[0]} vs {r['top'][0]}"
        ref_top = dict((t, l) for t, l in r["top"])
        for t, l in alts:
            if t in ref_top:
                assert abs(l - ref_top[t]) < LP_TOL, f"{what} position {i}: alt {t}"
    print(f"{what}: {len(got)} tokens, largest difference {worst:.3f}")


def chat(root, model, gguf):
    c = client(root)
    vocab = Vocab(gguf)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = c.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0,
                                  logprobs=True, top_logprobs=2)
    ch = r.choices[0]
    assert ch.finish_reason == "length", ch
    content = ch.logprobs.content
    assert len(content) == 8, content
    text = b"".join(bytes(t.bytes) for t in content).decode()
    assert text == ch.message.content, (text, ch.message.content)
    for t in content:
        assert t.token == bytes(t.bytes).decode("utf-8", "replace")
        assert len(t.top_logprobs) == 2
        # Greedy: the chosen token is the likeliest.
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
    # Streamed: each chunk carries its tokens' reports; together they are
    # the whole response's.
    streamed, stext = [], ""
    for chunk in c.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0,
                                           logprobs=True, top_logprobs=2, stream=True):
        if not chunk.choices:
            continue
        d = chunk.choices[0]
        stext += d.delta.content or ""
        if d.logprobs and d.logprobs.content:
            streamed += d.logprobs.content
    assert stext == ch.message.content, (stext, ch.message.content)
    assert [t.token for t in streamed] == [t.token for t in content]
    for a, b in zip(streamed, content):
        assert abs(a.logprob - b.logprob) < 1e-4, (a, b)
    # Held to the reference: the prompt as the server renders it, then the
    # tokens it generated.
    prompt = tokenize(root, messages=msgs)
    gen = [vocab.id(t.bytes) for t in content]
    ref = score(Ref(gguf), prompt + gen, 2)[len(prompt):]
    got = [(t.logprob, [(vocab.id(a.bytes), a.logprob) for a in t.top_logprobs]) for t in content]
    compare(got, ref, "chat output")
    # Bounds, by name.
    for kw, param in [({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
                      ({"top_logprobs": 2}, "top_logprobs")]:
        try:
            c.chat.completions.create(model=model, messages=msgs, max_tokens=1, **kw)
            raise AssertionError(f"{kw} accepted")
        except openai.BadRequestError as e:
            assert e.body["param"] == param, e.body


def completions(root, model, gguf):
    c = client(root)
    vocab = Vocab(gguf)
    prompt = "The capital of France is Paris. The capital of Germany is"
    ids = tokenize(root, prompt=prompt)
    # Scoring only: echo, logprobs, max_tokens 0.
    r = c.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=3,
                             temperature=0)
    ch = r.choices[0]
    assert ch.text == prompt, ch.text
    lp = ch.logprobs
    assert "".join(lp.tokens) == prompt
    assert len(lp.tokens) == len(ids), (lp.tokens, ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0, r.usage
    ref = score(Ref(gguf), ids, 3)
    got = []
    for i in range(1, len(ids)):
        alts = sorted(((vocab.id(t.encode()), v) for t, v in lp.top_logprobs[i].items()),
                      key=lambda x: -x[1])
        # The dict holds the 3 likeliest and the token itself.
        assert len(lp.top_logprobs[i]) in (3, 4), lp.top_logprobs[i]
        assert lp.top_logprobs[i][lp.tokens[i]] == lp.token_logprobs[i]
        got.append((lp.token_logprobs[i], alts))
    compare(got, ref[1:], "completions echo")
    # The same prompt as token ids gives the same scores.
    r2 = c.completions.create(model=model, prompt=ids, max_tokens=0, echo=True, logprobs=3,
                              temperature=0)
    assert r2.choices[0].logprobs.token_logprobs == lp.token_logprobs
    # Echo with generation, streamed: the prompt first, then the output,
    # each with its reports; offsets run across chunks.
    chunks = list(c.completions.create(model=model, prompt=prompt, max_tokens=4, echo=True,
                                       logprobs=1, temperature=0, stream=True))
    first = chunks[0].choices[0]
    assert first.text == prompt, first.text
    assert first.logprobs.tokens == lp.tokens
    toks, offs, text = [], [], ""
    for ch in chunks:
        if ch.choices and ch.choices[0].logprobs:
            toks += ch.choices[0].logprobs.tokens
            offs += ch.choices[0].logprobs.text_offset
        if ch.choices:
            text += ch.choices[0].text
    assert text.startswith(prompt) and len(toks) == len(ids) + 4, (text, toks)
    assert offs == [sum(len(t) for t in toks[:i]) for i in range(len(toks))]
    whole = c.completions.create(model=model, prompt=prompt, max_tokens=4, echo=True, logprobs=1,
                                 temperature=0)
    assert whole.choices[0].text == text
    assert whole.choices[0].logprobs.tokens == toks
    # Echo without logprobs: the prompt, no reports.
    e = c.completions.create(model=model, prompt=prompt, max_tokens=2, echo=True, temperature=0)
    assert e.choices[0].text.startswith(prompt) and e.choices[0].logprobs is None
    for kw, param in [({"logprobs": 6}, "logprobs"), ({"max_tokens": 0}, "max_tokens"),
                      ({"prompt": [[1, 2], [3]]}, "prompt"), ({"prompt": [99999999]}, "prompt")]:
        args = {"model": model, "prompt": prompt, "max_tokens": 1, **kw}
        try:
            c.completions.create(**args)
            raise AssertionError(f"{kw} accepted")
        except openai.BadRequestError as e:
            assert e.body["param"] == param, e.body


def hits(root_admin):
    t = httpx.get(root_admin + "/metrics").text
    return sum(float(l.rsplit(" ", 1)[1]) for l in t.splitlines()
               if l.startswith("vllm:prefix_cache_hits_total"))


def choices(root, model, admin):
    """`n` choices: indexed, usage as OpenAI counts it, one prefill whose
    blocks the other choices share (the prefix cache's hits), whole and
    streamed, and refusals by name."""
    c = client(root)
    msgs = [{"role": "user", "content": "Write one sentence about a lighthouse keeper who loves the stormy sea at night."}]
    one = c.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)
    prompt_tokens = one.usage.prompt_tokens
    before = hits(admin)
    r = c.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0.9,
                                  seed=3, n=4, logprobs=True)
    after = hits(admin)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3], r.choices
    assert r.usage.prompt_tokens == prompt_tokens, r.usage
    assert r.usage.completion_tokens == sum(len(ch.logprobs.content) for ch in r.choices), r.usage
    assert len({ch.message.content for ch in r.choices}) > 1, [ch.message.content for ch in r.choices]
    # The three followers found the leader's full prompt blocks cached
    # (16-token blocks: every full block of the prompt but a last partial).
    shared = (prompt_tokens - 1) // 16 * 16
    assert after - before >= 3 * shared, (before, after, shared)
    # Streamed with the same seed: each index gets the same text and its
    # own finish; the usage chunk sums the choices.
    texts, finishes, usage = {}, {}, None
    for chunk in c.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0.9,
                                           seed=3, n=4, logprobs=True, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert texts == {ch.index: ch.message.content for ch in r.choices}, (texts, r.choices)
    assert sorted(finishes) == [0, 1, 2, 3], finishes
    assert usage.completion_tokens == r.usage.completion_tokens, usage
    # Completions: each choice echoes the prompt.
    p = "Once upon a time"
    rc = c.completions.create(model=model, prompt=p, max_tokens=4, n=2, echo=True, logprobs=1,
                              temperature=1.0, seed=5)
    assert [ch.index for ch in rc.choices] == [0, 1]
    for ch in rc.choices:
        assert ch.text.startswith(p) and "".join(ch.logprobs.tokens) == ch.text, ch
    for kw in [{"n": 9}, {"n": 2, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}]:
        try:
            c.chat.completions.create(model=model, messages=msgs, max_tokens=1, **kw)
            raise AssertionError(f"{kw} accepted")
        except openai.BadRequestError as e:
            assert e.body["param"] == "n", e.body


def responses(root, model, gguf):
    """The Responses API's log-probabilities: `include` asks for them,
    `top_logprobs` sets the alternatives; the finished text lists them
    with bytes, each delta event without."""
    c = client(root)
    kw = dict(model=model, input="What is the capital of France?", max_output_tokens=8, temperature=0,
              top_logprobs=2, include=["message.output_text.logprobs"])
    r = c.responses.create(**kw)
    part = r.output[0].content[0]
    lps = part.logprobs
    assert len(lps) == r.usage.output_tokens == 8, (lps, r.usage)
    assert b"".join(bytes(t.bytes) for t in lps).decode() == part.text, (lps, part.text)
    for t in lps:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token, t
    deltas, text = [], ""
    for e in c.responses.create(stream=True, **kw):
        if e.type == "response.output_text.delta":
            text += e.delta
            deltas += e.logprobs
    assert text == part.text, (text, part.text)
    assert [d.token for d in deltas] == [t.token for t in lps]
    for d, t in zip(deltas, lps):
        assert abs(d.logprob - t.logprob) < 1e-4 and len(d.top_logprobs) == 2
    # Without `include`, nothing is listed.
    plain = c.responses.create(model=model, input="Hi", max_output_tokens=4, temperature=0)
    assert not plain.output[0].content[0].logprobs
    for bad, param in [({"include": ["file_search_call.results"]}, "include"), ({"top_logprobs": 21}, "top_logprobs")]:
        try:
            c.responses.create(model=model, input="Hi", max_output_tokens=2, **bad)
            raise AssertionError(f"{bad} accepted")
        except openai.BadRequestError as e:
            assert e.body["param"] == param, e.body


def tokenizer(root, model, gguf):
    ids = tokenize(root, prompt="Hello world")
    r = httpx.post(root + "/detokenize", json={"tokens": ids}).json()
    assert r["prompt"] == "Hello world", r
    info = httpx.get(root + "/tokenizer_info").json()
    assert info["eos_token"] and "im_start" in info["chat_template"], info
    v1 = httpx.post(root + "/v1/tokenize", json={"prompt": "Hello world", "model": model}).json()
    assert v1["tokens"] == ids and v1["count"] == len(ids), v1
    bad = httpx.post(root + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens", bad.text
    # More ids than the context holds: refused before any decoding.
    long = httpx.post(root + "/detokenize", json={"tokens": [1] * (info["model_max_length"] + 1)})
    assert long.status_code == 400 and long.json()["error"]["param"] == "tokens", long.text
    unknown = httpx.post(root + "/tokenize", json={"prompt": "x", "model": "nope"})
    assert unknown.status_code == 404, unknown.text


if __name__ == "__main__":
    check, root, model, gguf = sys.argv[1:5]
    {"chat": chat, "completions": completions, "tokenizer": tokenizer, "responses": responses,
     "choices": choices}[check](root, model, gguf)
