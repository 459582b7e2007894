#!/usr/bin/env python3
"""The upstream path against a real llama.cpp server: llama-cpp-python's
OpenAI-compatible server (`llama-cpp-python[server]==0.3.36`, which builds
llama.cpp from source: 10-25 minutes on 2 cores the first time, so this runs
outside .ci/run; the virtual environment is cached in
~/.cache/ultrafast/interop-venv) serving the SmolLM2-135M-Instruct GGUF from
the model cache, with ultrafast in front (`dialect = "llamacpp-python"`, `max_concurrency = 1`:
that server cuts a generation short when another request needs the model,
health checks on `/v1/models` included).

The same OpenAI-client cases run directly against the server and through
ultrafast, and the table says which pass where. Then the project's own
client checks (proxy/tests/py/openai_checks.py: basics, stop, async), which
the in-process engine passes, run through ultrafast.

usage: benches/scripts/upstream_interop.py [--venv DIR] [--model GGUF]
Build first: cargo build --release -p ultrafast
Every process started is stopped by PID; every wait is bounded.
"""
import argparse, json, os, subprocess, sys, tempfile, time, traceback, urllib.request
from benchlib import ROOT, free_port, spawn, stop_tree, wait_port

CACHE = os.path.expanduser("~/.cache/ultrafast")
PKG = "llama-cpp-python[server]==0.3.36"
MODEL = "smollm2-135m-instruct"


def venv(path):
    """The cached virtual environment with the server and the client."""
    py = os.path.join(path, "bin", "python")
    if not os.path.exists(py):
        subprocess.run([sys.executable, "-m", "venv", path], check=True)
    probe = subprocess.run([py, "-c", "import llama_cpp.server, openai, httpx, httpx_sse"], capture_output=True)
    if probe.returncode != 0:
        print(f"installing {PKG} (compiles llama.cpp: 10-25 minutes on 2 cores)...", flush=True)
        subprocess.run([py, "-m", "pip", "install", "-q", PKG, "openai", "httpx", "httpx-sse"], check=True)
    return py


def model_file(exe):
    """The GGUF from the model cache (fetched and verified if missing)."""
    out = subprocess.run([exe, "models", "pull", MODEL], capture_output=True, text=True, timeout=900)
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines or not os.path.exists(lines[-1]):
        sys.exit(f"`ultrafast models pull {MODEL}` failed: {out.stderr.strip()[-300:]}")
    return lines[-1]


# llama.cpp's AMX weight repacking (an "extra buffer type") crashes this
# build on prompts of more than one token on CPUs with AMX (seen on a Xeon
# with AMX_INT8); llama-cpp-python 0.3.36 has no server flag for it, so the
# server is started with `use_extra_bufts = false` set in its model params.
LAUNCH = r'''
import runpy, sys
import llama_cpp.llama_cpp as C
_default = C.llama_model_default_params
def _params():
    p = _default()
    p.use_extra_bufts = False
    return p
C.llama_model_default_params = _params
sys.argv = ["llama_cpp.server"] + sys.argv[1:]
runpy.run_module("llama_cpp.server", run_name="__main__")
'''

CASES = r'''
import json, sys, httpx, openai
base, model, only = sys.argv[1], sys.argv[2], sys.argv[3]
c = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
msgs = [{"role": "user", "content": "Tell me a long story about a dragon."}]

def models():
    ids = [m.id for m in c.models.list()]
    assert model in ids, ids

def chat():
    r = c.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)
    assert r.choices[0].message.content and r.choices[0].finish_reason == "length", r
    assert r.usage.completion_tokens == 8, r.usage

def chat_with_client_request_id():
    # llama-cpp-python refuses an X-Request-Id that is not a UUID (empty 400).
    r = c.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=0,
                                  extra_headers={"x-request-id": "trace-42"})
    assert r.choices[0].message.content, r

def stream_with_usage():
    text, finish, usage = "", None, None
    with c.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0, stream=True,
                                   stream_options={"include_usage": True}) as s:
        for ch in s:
            if ch.usage is not None:
                usage = ch.usage
            if ch.choices:
                text += ch.choices[0].delta.content or ""
                finish = ch.choices[0].finish_reason or finish
    assert text and finish == "length", (text, finish)
    assert usage is not None and usage.completion_tokens == 6, usage

def completions():
    r = c.completions.create(model=model, prompt="Once upon a time", max_tokens=5, temperature=0)
    assert r.choices[0].text and r.choices[0].finish_reason == "length", r

def stop():
    r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count from 1 to 10."}],
                                  max_tokens=40, temperature=0, stop=["5"])
    assert "5" not in r.choices[0].message.content and r.choices[0].finish_reason == "stop", r

def error_bad_param():
    try:
        c.chat.completions.create(model=model, messages=msgs, temperature="hot")
    except openai.BadRequestError as e:
        assert isinstance(e.body, dict) and e.body.get("param") == "temperature", e.body
        return
    raise AssertionError("accepted")

def error_unknown_model():
    try:
        c.chat.completions.create(model="no-such-model", messages=msgs, max_tokens=2)
    except openai.NotFoundError as e:
        assert isinstance(e.body, dict) and e.body.get("code") == "model_not_found", e.body
        return
    raise AssertionError("accepted")

def async_202():
    r = httpx.post(base + "/chat/completions", headers={"prefer": "respond-async"}, timeout=60,
                   json={"model": model, "messages": msgs, "max_tokens": 4})
    assert r.status_code == 202, (r.status_code, r.text[:200])
    loc = r.headers["location"]
    root = base[: base.index("/v1")]
    with httpx.stream("GET", root + loc, timeout=60) as ev:
        body = "".join(ev.iter_text())
    assert "[DONE]" in body, body[-300:]

try:
    globals()[only]()
    print("ok")
except Exception as e:
    print(("FAIL " + type(e).__name__ + ": " + str(e)).replace("\n", " ")[:200])
'''
NAMES = ["models", "chat", "chat_with_client_request_id", "stream_with_usage", "completions", "stop",
         "error_bad_param", "error_unknown_model", "async_202"]


def run_case(py, script, base, name):
    out = subprocess.run([py, script, base, MODEL, name], capture_output=True, text=True, timeout=300)
    line = (out.stdout.strip().splitlines() or ["FAIL (no output) " + out.stderr.strip()[-150:]])[-1]
    return line


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--venv", default=os.path.join(CACHE, "interop-venv"))
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    exe = os.path.join(ROOT, "target", "release", "ultrafast")
    if not os.path.exists(exe):
        sys.exit("build first: cargo build --release -p ultrafast")
    py = venv(args.venv)
    gguf = args.model or model_file(exe)
    version = subprocess.run([py, "-c", "import llama_cpp; print(llama_cpp.__version__)"], capture_output=True, text=True).stdout.strip()
    print(f"llama-cpp-python {version}, model {gguf}")
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            sport = free_port()
            slog = open(os.path.join(tmp, "server.log"), "w")
            launch = os.path.join(tmp, "launch.py")
            with open(launch, "w") as f:
                f.write(LAUNCH)
            procs.append(spawn([py, launch, "--model", gguf, "--model_alias", MODEL, "--host", "127.0.0.1",
                                "--port", str(sport), "--n_ctx", "8192", "--n_threads", "2"], stdout=slog, stderr=subprocess.STDOUT))
            wait_port(sport, 120)
            uport, aport = free_port(), free_port()
            conf = os.path.join(tmp, "ultrafast.toml")
            with open(conf, "w") as f:
                f.write(f"[server]\nthreads = 1\npid_file = \"{tmp}/uf.pid\"\nupgrade_sock = \"{tmp}/uf.sock\"\n\n"
                        f"[admin]\nlisten = \"127.0.0.1:{aport}\"\n\n[log]\naccess_log = \"off\"\n\n"
                        f"[[listeners]]\nname = \"http\"\naddress = \"127.0.0.1:{uport}\"\n\n"
                        f"[[routes]]\nname = \"openai\"\npath = \"/v1/\"\ninference = true\n\n"
                        f"[pools.llama]\nmembers = [{{ addr = \"127.0.0.1:{sport}\" }}]\ndialect = \"llamacpp-python\"\n"
                        f"health_check = {{ interval_ms = 2000 }}\n\n"
                        f"[models.{MODEL}]\nbackend = \"upstream\"\npool = \"llama\"\nstall_timeout_ms = 60000\nmax_model_len = 8192\nmax_concurrency = 1\n")
            ulog = open(os.path.join(tmp, "ultrafast.log"), "w")
            procs.append(spawn([exe, "serve", "-c", conf], stdout=ulog, stderr=subprocess.STDOUT))
            wait_port(uport)
            script = os.path.join(tmp, "cases.py")
            with open(script, "w") as f:
                f.write(CASES)
            direct, through = f"http://127.0.0.1:{sport}/v1", f"http://127.0.0.1:{uport}/v1"
            print("\n| case | llama-cpp-python directly | through ultrafast |\n|---|---|---|")
            for name in NAMES:
                d = run_case(py, script, direct, name)
                t = run_case(py, script, through, name)
                print(f"| {name} | {d} | {t} |", flush=True)
            checks = os.path.join(ROOT, "proxy", "tests", "py", "openai_checks.py")
            print("\nThe project's client checks (proxy/tests/py/openai_checks.py) through ultrafast:")
            for check in ["basics", "stop", "async"]:
                out = subprocess.run([py, checks, check, through, MODEL], capture_output=True, text=True, timeout=600)
                status = "ok" if out.returncode == 0 else "FAIL " + (out.stderr.strip().splitlines() or ["?"])[-1][:600]
                print(f"- {check}: {status}", flush=True)
        finally:
            for p in reversed(procs):
                stop_tree(p)


if __name__ == "__main__":
    main()
