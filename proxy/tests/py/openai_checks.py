"""Checks run with the official `openai` Python client (and httpx-sse for
raw SSE framing) against a running ultrafast. Called by the Rust
integration tests: `python3 openai_checks.py CHECK BASE_URL MODEL`.
Each check raises (non-zero exit) on the first failed expectation."""

import concurrent.futures
import json
import sys
import time

import httpx
import openai
from httpx_sse import connect_sse


def client(base):
    return openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)


def basics(base, model):
    c = client(base)
    models = [m.id for m in c.models.list()]
    assert model in models, models

    r = c.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "You are a storyteller."},
                  {"role": "user", "content": "Tell me a long story about a dragon."}],
        max_tokens=8, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content, r
    assert r.choices[0].finish_reason == "length", r.choices[0].finish_reason
    assert r.usage.completion_tokens == 8, r.usage
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8

    # Streaming with include_usage: content chunks, a finishing chunk, a
    # usage chunk with empty choices, then the stream ends ([DONE]).
    text, finish, usage, n = "", None, None, 0
    with c.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Write a long poem about the sea."}],
            max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True}) as s:
        for ch in s:
            n += 1
            if ch.usage is not None:
                assert ch.choices == [], ch
                usage = ch.usage
                continue
            d = ch.choices[0]
            text += d.delta.content or ""
            if d.finish_reason:
                finish = d.finish_reason
    assert text and finish == "length" and usage.completion_tokens == 6, (text, finish, usage)

    # Legacy completions.
    r = c.completions.create(model=model, prompt="Once upon a time", max_tokens=5, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text, r
    assert r.choices[0].finish_reason == "length"

    # Errors in OpenAI's shape, as the client's own exception types.
    try:
        c.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                  temperature="hot")
        raise AssertionError("bad temperature accepted")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and e.body["param"] == "temperature", e.body
    try:
        c.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], n=9)
        raise AssertionError("n=9 accepted")
    except openai.BadRequestError as e:
        assert e.body["param"] == "n", e.body
    try:
        c.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
        raise AssertionError("unknown model accepted")
    except openai.NotFoundError as e:
        assert e.body["code"] == "model_not_found", e.body

    # Raw framing with httpx-sse: headers, one JSON object per event, [DONE].
    with httpx.Client(timeout=60) as h:
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4, "stream": True}
        with connect_sse(h, "POST", base + "/chat/completions", json=body) as es:
            r = es.response
            assert r.headers["content-type"].startswith("text/event-stream"), r.headers
            assert r.headers["cache-control"] == "no-cache"
            assert r.headers["x-accel-buffering"] == "no"
            datas = [sse.data for sse in es.iter_sse()]
        assert datas[-1] == "[DONE]", datas
        chunks = [json.loads(d) for d in datas[:-1]]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        last = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]][0]
        t = last["ultrafast_timing"]
        for k in ("network_ms", "queue_ms", "ttft_ms", "compute_ms", "output_ms", "total_ms"):
            assert t[k] >= 0, t
        # Whole responses carry Server-Timing.
        r = h.post(base + "/chat/completions", json={**body, "stream": False})
        assert "compute;dur=" in r.headers["server-timing"], r.headers
        # Malformed JSON and a body that is not an object.
        r = h.post(base + "/chat/completions", content=b"{nope")
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    print("basics ok")


def stop_sequences(base, model):
    c = client(base)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    full = c.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0)
    text = full.choices[0].message.content
    # Stop at a word the model says: the answer ends right before it.
    words = [w for w in text.split() if len(w) > 2]
    assert len(words) >= 2, text
    stop = " " + words[1]
    assert stop in text, (stop, text)
    r = c.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0, stop=[stop])
    got = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", r
    assert got == text[:text.index(stop)], (got, text, stop)
    # Same through a stream.
    s = c.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0,
                                  stop=stop, stream=True)
    streamed = "".join((ch.choices[0].delta.content or "") for ch in s if ch.choices)
    assert streamed == got, (streamed, got)
    # Same seed, same sampled output.
    a = c.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0.9, seed=7)
    b = c.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0.9, seed=7)
    assert a.choices[0].message.content == b.choices[0].message.content
    # A prompt beyond the context window.
    try:
        c.completions.create(model=model, prompt="word " * 9000, max_tokens=4)
        raise AssertionError("oversized prompt accepted")
    except openai.BadRequestError as e:
        assert e.body["code"] == "context_length_exceeded", e.body
    try:
        c.completions.create(model=model, prompt="hi", max_tokens=100000)
        raise AssertionError("oversized max_tokens accepted")
    except openai.BadRequestError as e:
        assert e.body["code"] == "context_length_exceeded" and e.body["param"] == "max_tokens", e.body
    print("stop ok")


def asynchronous(base, model):
    root = base[: -len("/v1")]
    with httpx.Client(timeout=60) as h:
        body = {"model": model, "messages": [{"role": "user", "content": "Count to ten"}],
                "max_tokens": 10, "temperature": 0}
        r = h.post(base + "/chat/completions", json=body, headers={"Prefer": "respond-async"})
        assert r.status_code == 202, r.text
        j = r.json()
        assert j["status"] == "queued" and j["id"], j
        loc = r.headers["location"]
        assert loc == f"/v1/requests/{j['id']}/events", loc
        with connect_sse(h, "GET", root + loc) as es:
            evs = [(e.id, e.data) for e in es.iter_sse()]
        assert evs[-1][1] == "[DONE]", evs
        evs = evs[:-1]
        ids = [int(i) for i, _ in evs]
        assert ids == list(range(len(ids))), ids
        text = "".join(json.loads(d)["choices"][0]["delta"].get("content", "")
                       for _, d in evs if json.loads(d).get("choices"))
        # Resume after event 2: exactly the events after it.
        with connect_sse(h, "GET", root + loc, headers={"Last-Event-ID": "2"}) as es:
            rest = [(e.id, e.data) for e in es.iter_sse()][:-1]
        assert rest == evs[3:], (rest, evs)
        st = h.get(root + f"/v1/requests/{j['id']}").json()
        assert st["status"] == "completed", st
        assert st["result"]["choices"][0]["message"]["content"] == text, (st, text)
        # background: true in the body, then DELETE while it runs (a long
        # answer, cancelled as soon as it is generating: the engine writes a
        # short one faster than a fixed sleep).
        long = {**body, "messages": [{"role": "user", "content": "Write a very long story about a dragon, in many chapters."}],
                "max_tokens": 4000, "background": True}
        r = h.post(base + "/chat/completions", json=long)
        assert r.status_code == 202, r.text
        jid = r.json()["id"]
        deadline = time.time() + 30
        while h.get(root + f"/v1/requests/{jid}").json()["status"] == "queued" and time.time() < deadline:
            time.sleep(0.01)
        d = h.delete(root + f"/v1/requests/{jid}")
        assert d.status_code == 200 and d.json()["status"] == "cancelled", d.text
        st = h.get(root + f"/v1/requests/{jid}").json()
        assert st["status"] == "cancelled", st
        assert h.get(root + "/v1/requests/nope").status_code == 404
    print("async ok")


def shed(base, model):
    """429 (rate limit) and 503 (saturated) as the client's own exceptions."""
    c = client(base)
    msgs = [{"role": "user", "content": "x"}]
    limited = openai.OpenAI(base_url=base, api_key="k", max_retries=0,
                            default_headers={"x-tenant": "t1"})
    limited.chat.completions.create(model=model, messages=msgs, max_tokens=1)
    try:
        limited.chat.completions.create(model=model, messages=msgs, max_tokens=1)
        raise AssertionError("rate limit not applied")
    except openai.RateLimitError as e:
        assert e.status_code == 429 and e.response.headers.get("retry-after"), e.response.headers
    # Saturate: more concurrent long requests than slots plus queue.
    def one(i):
        c = openai.OpenAI(base_url=base, api_key="k", max_retries=0,
                          default_headers={"x-tenant": f"saturate-{i}"})
        try:
            c.chat.completions.create(model=model, messages=msgs, max_tokens=30)
            return "ok"
        except openai.InternalServerError as e:
            assert e.status_code == 503, e.status_code
            assert e.response.headers.get("retry-after")
            return "503"
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        got = list(ex.map(one, range(8)))
    assert "503" in got and "ok" in got, got
    print("shed ok")


def keys(base, model):
    """API keys and token budgets as the official client sees them (key
    `sk-alpha` may use `model` only, with a budget of 100 tokens)."""
    bad = openai.OpenAI(base_url=base, api_key="sk-nope", max_retries=0, timeout=60)
    try:
        bad.models.list()
        raise AssertionError("an unknown key listed the models")
    except openai.AuthenticationError as e:
        assert e.status_code == 401 and e.code == "invalid_api_key", e
    alpha = openai.OpenAI(base_url=base, api_key="sk-alpha", max_retries=0, timeout=60)
    assert [m.id for m in alpha.models.list()] == [model]
    msgs = [{"role": "user", "content": "hi"}]
    try:
        alpha.chat.completions.create(model="other", messages=msgs, max_tokens=5)
        raise AssertionError("a model outside the allow-list answered")
    except openai.PermissionDeniedError as e:
        assert e.status_code == 403 and e.code == "model_not_allowed", e
    # Each request reserves prompt + max_tokens (about 65 of 100) and is
    # refunded to its real usage (about 13): three in a row fit, where
    # without refunds the second would not.
    for _ in range(3):
        r = alpha.chat.completions.create(model=model, messages=msgs, max_tokens=60)
        assert r.usage.completion_tokens > 0
    try:
        alpha.chat.completions.create(model=model, messages=msgs, max_tokens=500)
        raise AssertionError("a request larger than the budget ran")
    except openai.RateLimitError as e:
        assert e.status_code == 429 and e.code == "token_budget", e
    print("keys ok")


if __name__ == "__main__":
    check, base, model = sys.argv[1], sys.argv[2], sys.argv[3]
    {"basics": basics, "stop": stop_sequences, "async": asynchronous, "shed": shed,
     "keys": keys}[check](base, model)
