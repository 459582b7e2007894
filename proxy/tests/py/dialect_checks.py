"""The Anthropic Messages API through the official `anthropic` client, and
OpenAI's Responses API through the official `openai` client, against a
running ultrafast. Called by proxy/tests/dialects.rs:
`python3 dialect_checks.py CHECK ROOT_URL MODEL [FAKE_STATS_URL]`
(ROOT_URL without /v1). Each check raises on the first failed expectation.

With a FAKE_STATS_URL (an upstream pool of fake-openai) the tool requests
are also checked to reach the upstream as chat completions with the tools
in OpenAI's shape."""

import json
import sys
import time

import anthropic
import httpx
import jsonschema
import openai

WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                           "population": {"type": "integer", "minimum": 0, "maximum": 100000000}},
          "required": ["city", "population"], "additionalProperties": False}


# Greedy decoding. The current anthropic SDK no longer has a `temperature`
# argument; the API (and ultrafast) still take the field.
T0 = {"temperature": 0}
# A question the model answers in one sentence, then ends.
Q = "What is the capital of France? Answer in one sentence."


def upstream_body(stats):
    return httpx.get(stats, timeout=10).json()["last_body"] if stats else None


def messages(root, model, stats=None):
    c = anthropic.Anthropic(base_url=root, api_key="unused", max_retries=0, timeout=300)
    q = [{"role": "user", "content": "What is the capital of France?"}]
    r = c.messages.create(model=model, max_tokens=24, system="Answer briefly.", messages=q, extra_body=T0)
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_"), r
    assert r.content[0].type == "text" and r.content[0].text, r
    assert r.stop_reason in ("end_turn", "max_tokens"), r
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0, r.usage
    text = r.content[0].text

    # Streaming: Anthropic's event sequence, and the same text.
    kinds, streamed, stop = [], "", None
    with c.messages.stream(model=model, max_tokens=24, system="Answer briefly.", messages=q, extra_body=T0) as s:
        for ev in s:
            kinds.append(ev.type)
            if ev.type == "content_block_delta" and ev.delta.type == "text_delta":
                streamed += ev.delta.text
        final = s.get_final_message()
    assert kinds[0] == "message_start", kinds
    for k in ("content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop"):
        assert k in kinds, (k, kinds)
    assert kinds.index("message_delta") > kinds.index("content_block_stop"), kinds
    assert streamed == text, (streamed, text)
    assert final.stop_reason == r.stop_reason and final.usage.output_tokens == r.usage.output_tokens, final
    raw = httpx.post(root + "/v1/messages", json={"model": model, "max_tokens": 8, "messages": q, "stream": True},
                     headers={"anthropic-version": "2023-06-01"}, timeout=120).text
    assert "event: ping" in raw and "event: message_stop" in raw and "[DONE]" not in raw, raw

    # stop_sequences: the answer ends before the sequence, which is named.
    words = [w for w in text.split() if len(w) > 2]
    # (Only the engine: the fake upstream does not apply stop sequences.)
    if len(words) >= 2 and not stats:
        seq = " " + words[1]
        r2 = c.messages.create(model=model, max_tokens=24, system="Answer briefly.", messages=q,
                               extra_body=T0, stop_sequences=["zzzz", seq])
        assert r2.stop_reason == "stop_sequence" and r2.stop_sequence == seq, r2
        assert r2.content[0].text == text[:text.index(seq)], (r2, text)

    # Tools: a forced tool_use block whose input fits the schema.
    tools = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER_PARAMS}]
    wq = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = c.messages.create(model=model, max_tokens=120, messages=wq, tools=tools,
                          tool_choice={"type": "tool", "name": "get_weather"}, extra_body=T0)
    assert r.stop_reason == "tool_use", r
    use = [b for b in r.content if b.type == "tool_use"]
    assert len(use) == 1 and use[0].name == "get_weather" and use[0].id.startswith("toolu_"), r
    jsonschema.validate(use[0].input, WEATHER_PARAMS)
    if stats:
        body = upstream_body(stats)
        assert body["tools"][0]["function"]["name"] == "get_weather", body
        assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}, body
    # Streamed: input_json_delta pieces that join into the input.
    with c.messages.stream(model=model, max_tokens=120, messages=wq, tools=tools,
                           tool_choice={"type": "any"}, extra_body=T0) as s:
        parts = {}
        for ev in s:
            if ev.type == "content_block_delta" and ev.delta.type == "input_json_delta":
                parts.setdefault(ev.index, []).append(ev.delta.partial_json)
        final = s.get_final_message()
    assert final.stop_reason == "tool_use", final
    for i, b in enumerate(final.content):
        if b.type == "tool_use":
            assert json.loads("".join(parts[i])) == b.input, (parts, b)
    block = [b for b in final.content if b.type == "tool_use"][0]
    jsonschema.validate(block.input, WEATHER_PARAMS)

    # A tool_result turn goes on.
    history = wq + [{"role": "assistant", "content": [{"type": "tool_use", "id": use[0].id, "name": "get_weather",
                                                       "input": use[0].input}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id,
                                                  "content": "18 degrees and sunny"}]}]
    r = c.messages.create(model=model, max_tokens=20, messages=history, tools=tools,
                          tool_choice={"type": "none"}, extra_body=T0)
    assert r.content and r.content[0].type == "text", r
    if stats:
        body = upstream_body(stats)
        assert body["messages"][1]["tool_calls"][0]["id"] == use[0].id, body
        assert body["messages"][2] == {"role": "tool", "content": "18 degrees and sunny", "tool_call_id": use[0].id}, body

    # Async mode (Prefer: respond-async): the store's 202, then the message.
    with httpx.Client(timeout=60) as h:
        a = h.post(root + "/v1/messages", headers={"Prefer": "respond-async"},
                   json={"model": model, "max_tokens": 8, "messages": q, **T0})
        assert a.status_code == 202, a.text
        jid = a.json()["id"]
        for _ in range(600):
            st = h.get(root + f"/v1/requests/{jid}").json()
            if st["status"] == "completed":
                break
            time.sleep(0.05)
        assert st["result"]["type"] == "message" and st["result"]["content"][0]["type"] == "text", st
        with h.stream("GET", root + f"/v1/requests/{jid}/events") as es:
            types = [json.loads(line[6:])["type"] for line in es.iter_lines()
                     if line.startswith("data: {")]
        assert types[0] == "message_start" and types[-1] == "message_stop", types

    # Errors in Anthropic's shape.
    for bad, kind in [({"model": model, "messages": q}, "invalid_request_error"),
                      ({"model": model, "max_tokens": 5, "messages": [{"role": "user", "content": [
                          {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
                       "invalid_request_error"),
                      ({"model": "nope", "max_tokens": 5, "messages": q}, "not_found_error")]:
        h = httpx.post(root + "/v1/messages", json=bad, timeout=30)
        j = h.json()
        assert j["type"] == "error" and j["error"]["type"] == kind, (bad, h.status_code, j)
    try:
        c.messages.create(model=model, max_tokens=5, messages=[{"role": "robot", "content": "x"}])
        raise AssertionError("bad role accepted")
    except anthropic.BadRequestError as e:
        assert e.body["error"]["type"] == "invalid_request_error", e.body
    print("messages ok")


def responses(root, model, stats=None):
    c = openai.OpenAI(base_url=root + "/v1", api_key="unused", max_retries=0, timeout=300)
    r = c.responses.create(model=model, input=Q, max_output_tokens=64, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.status in ("completed", "incomplete"), r
    assert r.output[0].type == "message" and r.output_text, r
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0, r.usage
    text = r.output_text

    # Streamed, with the response.* events in order.
    kinds, streamed, done, seqs = [], "", None, []
    with c.responses.stream(model=model, input=Q, max_output_tokens=64, temperature=0) as s:
        for ev in s:
            kinds.append(ev.type)
            seqs.append(ev.sequence_number)
            if ev.type == "response.output_text.delta":
                streamed += ev.delta
        assert kinds[-1] == "response.completed", (kinds, streamed)
        done = s.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    for k in ("response.output_item.added", "response.content_part.added", "response.output_text.delta",
              "response.output_text.done", "response.output_item.done"):
        assert k in kinds, (k, kinds)
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    assert streamed == text == done.output_text, (streamed, text)
    assert seqs == list(range(len(seqs))), seqs
    # The conversation a stored response keeps is never shown.
    raw = httpx.post(root + "/v1/responses", json={"model": model, "input": "hi", "max_output_tokens": 4}, timeout=60)
    assert raw.status_code == 200 and "ultrafast_conversation" not in raw.text, raw.text

    # instructions become the system message.
    ri = c.responses.create(model=model, input="Hi", instructions="Answer briefly.", max_output_tokens=8, temperature=0)
    assert ri.instructions == "Answer briefly." and ri.output_text, ri
    if stats:
        assert upstream_body(stats)["messages"][0] == {"role": "system", "content": "Answer briefly."}

    # Stored: GET finds it; previous_response_id continues the conversation.
    g = c.responses.retrieve(r.id)
    assert g.id == r.id and g.output_text == text, g
    r2 = c.responses.create(model=model, input="And of Germany?", previous_response_id=r.id,
                            max_output_tokens=16, temperature=0)
    assert r2.output_text, r2
    if stats:
        msgs = upstream_body(stats)["messages"]
        assert [m["role"] for m in msgs] == ["user", "assistant", "user"], msgs
        assert msgs[1]["content"] == text and msgs[2]["content"] == "And of Germany?", msgs
    try:
        c.responses.create(model=model, input="x", previous_response_id="resp_" + "0" * 32, max_output_tokens=4)
        raise AssertionError("unknown previous_response_id accepted")
    except openai.BadRequestError as e:
        assert e.body["code"] == "previous_response_not_found", e.body
    nostore = c.responses.create(model=model, input="hi", store=False, max_output_tokens=4)
    try:
        c.responses.retrieve(nostore.id)
        raise AssertionError("an unstored response was found")
    except openai.NotFoundError:
        pass

    # Structured output through text.format, and a function call.
    r = c.responses.create(model=model, input="Name a big city and its population as JSON.", max_output_tokens=200,
                           temperature=0, text={"format": {"type": "json_schema", "name": "city", "schema": SCHEMA}})
    jsonschema.validate(json.loads(r.output_text), SCHEMA) if not stats else json.loads(r.output_text)
    if stats:
        assert upstream_body(stats)["response_format"]["json_schema"]["schema"] == SCHEMA
    tools = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER_PARAMS}]
    r = c.responses.create(model=model, input="What is the weather in Paris?", tools=tools, tool_choice="required",
                           max_output_tokens=120, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) >= 1 and calls[0].name == "get_weather" and calls[0].call_id, r
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_PARAMS)
    kinds, args = [], ""
    with c.responses.stream(model=model, input="What is the weather in Paris?", tools=tools,
                            tool_choice={"type": "function", "name": "get_weather"},
                            max_output_tokens=120, temperature=0) as s:
        for ev in s:
            kinds.append(ev.type)
            if ev.type == "response.function_call_arguments.delta":
                args += ev.delta
        final = s.get_final_response()
    assert "response.function_call_arguments.done" in kinds, kinds
    fc = [o for o in final.output if o.type == "function_call"][0]
    assert json.loads(args) == json.loads(fc.arguments), (args, fc)
    # The call's output goes back as input.
    r = c.responses.create(model=model, previous_response_id=final.id, max_output_tokens=16, temperature=0,
                           input=[{"type": "function_call_output", "call_id": fc.call_id, "output": "18 degrees"}])
    assert r.status in ("completed", "incomplete"), r

    # background: queued at once, then completed, and cancellable.
    b = c.responses.create(model=model, input="Count to five.", background=True, max_output_tokens=12, temperature=0)
    assert b.status in ("queued", "in_progress", "completed") and b.id.startswith("resp_"), b
    for _ in range(600):
        g = c.responses.retrieve(b.id)
        if g.status in ("completed", "incomplete"):
            break
        time.sleep(0.1)
    assert g.status in ("completed", "incomplete") and g.output_text, g
    def started(rid):
        # Cancel as soon as it generates: a fixed sleep races a fast engine.
        for _ in range(3000):
            if c.responses.retrieve(rid).status != "queued":
                return
            time.sleep(0.01)

    if stats:
        # Slow the fake down, so that the response is still running.
        httpx.post(stats.replace("/stats", "/control"), json={"itl_ms": 300}, timeout=10)
    b = c.responses.create(model=model, input="Write a very long story.", background=True, max_output_tokens=4000)
    started(b.id)
    d = httpx.delete(root + f"/v1/responses/{b.id}", timeout=30).json()
    assert d["status"] == "cancelled", d
    assert c.responses.retrieve(b.id).status == "cancelled"
    # The SDK's cancel (POST /v1/responses/{id}/cancel) does the same.
    b = c.responses.create(model=model, input="Write a very long story.", background=True, max_output_tokens=4000)
    started(b.id)
    assert c.responses.cancel(b.id).status == "cancelled"
    st = httpx.get(root + "/v1/requests/req_" + b.id[len("resp_"):], timeout=30).json()
    assert st["status"] == "cancelled", st
    print("responses ok")


if __name__ == "__main__":
    check, root, model = sys.argv[1], sys.argv[2], sys.argv[3]
    stats = sys.argv[4] if len(sys.argv) > 4 else None
    {"messages": messages, "responses": responses}[check](root, model, stats)
