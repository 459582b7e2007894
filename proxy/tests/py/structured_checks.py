"""Structured outputs and tool calls through the official `openai` client,
validated with `jsonschema`. Called by proxy/tests/structured.rs:
`python3 structured_checks.py CHECK BASE_URL MODEL [FAKE_STATS_URL]`.

With a FAKE_STATS_URL (an upstream pool of fake-openai), every request is
also checked to have reached the upstream with `response_format`, `tools`
and `tool_choice` exactly as the client sent them."""

import concurrent.futures
import json
import sys

import httpx
import jsonschema
import openai
import pydantic

S = {"type": "string", "maxLength": 24}

# At least 20 schemas of varied shape: nested objects, enums, bounded
# arrays, unions, refs, formats, patterns, tuples, numbers with bounds.
SCHEMAS = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"address": {"type": "object", "properties": {
        "street": S, "city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["street", "city", "zip"], "additionalProperties": False}},
     "required": ["address"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"people": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "object", "properties": {"name": S, "role": {"enum": ["admin", "user"]}},
        "required": ["name", "role"], "additionalProperties": False}}},
     "required": ["people"]},
    {"type": "object", "properties": {"done": {"type": "boolean"}, "count": {"type": "integer", "minimum": 1, "maximum": 9}},
     "required": ["done", "count"]},
    # Cents: a bounded "number" alone allows endless fraction digits,
    # and greedy SmolLM2 wrote "100.0000000000000111..." until
    # `max_tokens` once the kernels' rounding changed.
    {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 1000, "multipleOf": 0.01}},
     "required": ["price"]},
    {"type": "object", "properties": {"nickname": {"type": ["string", "null"], "maxLength": 16}},
     "required": ["nickname"]},
    {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99999}, S]}},
     "required": ["id"]},
    {"type": "object", "properties": {"kind": {"const": "event"}, "title": S}, "required": ["kind", "title"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["c"], "additionalProperties": False}},
        "required": ["b"], "additionalProperties": False}}, "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"title": S, "subtitle": S}, "required": ["title"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["code"]},
    {"type": "object", "properties": {"day": {"type": "string", "format": "date"}}, "required": ["day"]},
    {"type": "object", "properties": {"scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 10},
                                                 "minItems": 3, "maxItems": 3}}, "required": ["scores"]},
    {"type": "object", "properties": {"point": {"type": "array", "prefixItems": [{"type": "number", "minimum": -90, "maximum": 90},
                                                                                {"type": "number", "minimum": -180, "maximum": 180}],
                                                "items": False}}, "required": ["point"]},
    {"$defs": {"item": {"type": "object", "properties": {"sku": S, "qty": {"type": "integer", "minimum": 1, "maximum": 5}},
                        "required": ["sku", "qty"], "additionalProperties": False}},
     "type": "object", "properties": {"order": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 2}},
     "required": ["order"]},
    {"type": "object", "properties": {"shape": {"oneOf": [
        {"type": "object", "properties": {"circle": {"type": "number", "minimum": 0, "maximum": 10}}, "required": ["circle"], "additionalProperties": False},
        {"type": "object", "properties": {"square": {"type": "integer", "minimum": 0, "maximum": 10}}, "required": ["square"], "additionalProperties": False}]}},
     "required": ["shape"]},
    {"type": "object", "properties": {"level": {"type": "integer", "exclusiveMinimum": 0, "maximum": 5}}, "required": ["level"]},
    {"type": "object", "properties": {"word": {"type": "string", "minLength": 3, "maxLength": 8}}, "required": ["word"]},
    {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                      "y": {"type": "integer", "minimum": 0, "maximum": 9},
                                      "label": {"enum": ["start", "end"]}},
     "required": ["x", "y", "label"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 4},
]



def closed(schema):
    """Objects without extra keys, as OpenAI's strict mode has them: an
    open object lets a small model add keys without end."""
    if isinstance(schema, dict):
        if schema.get("type") == "object" and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
        for v in schema.values():
            closed(v)
    elif isinstance(schema, list):
        for v in schema:
            closed(v)
    return schema


SCHEMAS = [closed(s) for s in SCHEMAS]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                   "required": ["zone"]}}}


def client(base):
    return openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=300)


class Sent:
    """What the fake upstream last received, to compare with what was sent."""

    def __init__(self, stats):
        self.stats = stats

    def check(self, **fields):
        if not self.stats:
            return
        body = httpx.get(self.stats, timeout=10).json()["last_body"]
        for k, v in fields.items():
            assert body.get(k) == v, (k, body.get(k), v)


def ask_json(c, model, i, schema, stream, validate=True):
    rf = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}
    msgs = [{"role": "user", "content": f"Give an example as JSON (example {i})."}]
    if stream:
        text, finish = "", None
        with c.chat.completions.create(model=model, messages=msgs, response_format=rf, max_tokens=300,
                                       temperature=0, stream=True) as s:
            for ch in s:
                if ch.choices:
                    text += ch.choices[0].delta.content or ""
                    finish = ch.choices[0].finish_reason or finish
    else:
        r = c.chat.completions.create(model=model, messages=msgs, response_format=rf, max_tokens=300, temperature=0)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert finish == "stop", (i, finish, text)
    value = json.loads(text)
    if validate:
        jsonschema.validate(value, schema)
    return rf


def schemas(base, model, stats=None):
    c, sent = client(base), Sent(stats)
    # Four at a time, so constrained sequences share engine steps.
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        jobs = [pool.submit(ask_json, c, model, i, s, i % 2 == 1, stats is None) for i, s in enumerate(SCHEMAS)]
        for j in jobs:
            j.result()
    # The last request alone, to see what reached the upstream.
    rf = ask_json(c, model, 0, SCHEMAS[0], False)
    sent.check(response_format=rf)

    # json_object: any JSON object.
    r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "A JSON object about a cat."}],
                                  response_format={"type": "json_object"}, max_tokens=200, temperature=0)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict), r
    sent.check(response_format={"type": "json_object"})

    if stats:
        print("schemas ok")
        return
    # The client's own Pydantic helper: a strict schema with $defs.
    class Item(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        count: int = pydantic.Field(ge=0, le=99)

    class Basket(pydantic.BaseModel):
        items: list[Item] = pydantic.Field(min_length=1, max_length=2)
        owner: str = pydantic.Field(max_length=20)

    p = c.chat.completions.parse(model=model, messages=[{"role": "user", "content": "Fill a basket."}],
                                 response_format=Basket, max_tokens=300, temperature=0)
    assert isinstance(p.choices[0].message.parsed, Basket), p
    print("schemas ok")


def tools(base, model, stats=None):
    c, sent = client(base), Sent(stats)
    msgs = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    # Named, whole: one call of that function, arguments valid.
    r = c.chat.completions.create(model=model, messages=msgs, tools=[WEATHER, TIME], tool_choice=choice,
                                  max_tokens=200, temperature=0)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls", r
    assert len(m.tool_calls) == 1 and m.tool_calls[0].function.name == "get_weather", m
    assert m.tool_calls[0].id.startswith("call_") and m.tool_calls[0].type == "function"
    args = json.loads(m.tool_calls[0].function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    sent.check(tools=[WEATHER, TIME], tool_choice=choice)

    # Required, streamed: the first delta of a call has its id and name,
    # the arguments follow as deltas, the finish reason is tool_calls.
    calls, finish, firsts = {}, None, []
    with c.chat.completions.create(model=model, messages=msgs, tools=[WEATHER, TIME], tool_choice="required",
                                   parallel_tool_calls=False, max_tokens=200, temperature=0, stream=True) as s:
        for ch in s:
            if not ch.choices:
                continue
            d = ch.choices[0]
            finish = d.finish_reason or finish
            for tc in d.delta.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.function.name, tc
                    calls[tc.index] = {"name": tc.function.name, "args": ""}
                    firsts.append(tc)
                calls[tc.index]["args"] += tc.function.arguments or ""
    assert finish == "tool_calls" and len(calls) == 1, (finish, calls)
    call = calls[0]
    tool = {"get_weather": WEATHER, "get_time": TIME}[call["name"]]
    jsonschema.validate(json.loads(call["args"]), tool["function"]["parameters"])
    sent.check(tool_choice="required", parallel_tool_calls=False)

    # Auto: text or calls, whichever, well formed.
    r = c.chat.completions.create(model=model, messages=msgs, tools=[WEATHER], max_tokens=120, temperature=0)
    m = r.choices[0].message
    if m.tool_calls:
        assert r.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(json.loads(m.tool_calls[0].function.arguments), WEATHER["function"]["parameters"])
    else:
        assert m.content is not None and r.choices[0].finish_reason in ("stop", "length"), r

    # A conversation that carries a call and its result goes on.
    history = msgs + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    r = c.chat.completions.create(model=model, messages=history, tools=[WEATHER], tool_choice="none",
                                  max_tokens=30, temperature=0)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls, r
    if stats:
        body = httpx.get(stats, timeout=10).json()["last_body"]
        assert body["messages"][1]["tool_calls"] == history[1]["tool_calls"], body
        assert body["messages"][2]["tool_call_id"] == "call_1", body
    print("tools ok")


def refusals(base, model, stats=None):
    c = client(base)
    msgs = [{"role": "user", "content": "hi"}]
    bad = [
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["n"]}}}),
         "response_format"),
        (dict(response_format={"type": "xml"}), "response_format"),
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools"),
        (dict(tools=[{"type": "retrieval"}]), "tools"),
    ]
    for kw, param in bad:
        if stats and param == "response_format" and "json_schema" in str(kw):
            continue  # an upstream compiles its own schemas
        try:
            c.chat.completions.create(model=model, messages=msgs, max_tokens=5, **kw)
            raise AssertionError(f"accepted: {kw}")
        except openai.BadRequestError as e:
            assert e.status_code == 400 and e.body["param"] == param, (kw, e.body)
            assert e.body["message"], e.body
    print("refusals ok")


if __name__ == "__main__":
    check, base, model = sys.argv[1], sys.argv[2], sys.argv[3]
    stats = sys.argv[4] if len(sys.argv) > 4 else None
    {"schemas": schemas, "tools": tools, "refusals": refusals}[check](base, model, stats)
