//! Inference test parts: the fake OpenAI upstream (the benches binary), a
//! raw SSE reader with arrival times, and the Python `openai` checks.
#![allow(dead_code, clippy::unwrap_used)]

use super::*;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// The fake upstream binary, brought up to date once per test process
/// (`cargo test` does not build another package's binaries, and one left
/// from an older checkout would lack what the tests ask of it).
pub fn fake_bin() -> PathBuf {
    bench_bin("fake-openai")
}

/// A binary of the benches package (`fake-openai`, `fleet-sim`), built as
/// [`fake_bin`] says.
pub fn bench_bin(name: &str) -> PathBuf {
    let dir = PathBuf::from(bin()).parent().unwrap().to_path_buf();
    let p = dir.join(name);
    static BUILT: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut built = BUILT.lock().unwrap();
    if !built.iter().any(|b| b == name) {
        let mut cmd = Command::new(env!("CARGO"));
        cmd.args(["build", "-p", "ultrafast-benches", "--bin", name]);
        // Without the variables `cargo test` set for this test (its package
        // name, manifest dir, ...): build scripts that read them would see
        // a change and rebuild ring, rustls, pingora and the rest, here and
        // again at the next build from a shell.
        for (k, _) in std::env::vars_os() {
            let k = k.to_string_lossy();
            let injected = ["CARGO_PKG_", "CARGO_BIN_EXE_"]
                .iter()
                .any(|p| k.starts_with(p))
                || [
                    "CARGO_MANIFEST_DIR",
                    "CARGO_MANIFEST_PATH",
                    "CARGO_CRATE_NAME",
                    "CARGO_BIN_NAME",
                    "CARGO_TARGET_TMPDIR",
                    "CARGO_PRIMARY_PACKAGE",
                    "OUT_DIR",
                ]
                .contains(&k.as_ref());
            if injected {
                cmd.env_remove(k.as_ref());
            }
        }
        if dir.ends_with("release") {
            cmd.arg("--release");
        }
        let st = cmd.status().unwrap();
        assert!(st.success(), "building {name} failed");
        built.push(name.to_string());
    }
    p
}

/// A running fake OpenAI-compatible server.
pub struct Fake {
    pub child: Child,
    pub addr: SocketAddr,
}

impl Fake {
    pub fn start(args: &[&str]) -> Fake {
        let mut child = Command::new(fake_bin())
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap()
            .parse()
            .unwrap();
        Fake { child, addr }
    }

    pub fn stats(&self) -> serde_json::Value {
        get(self.addr, "/stats", &[]).json()
    }

    /// `POST /control`: new settings for the requests that start from now.
    pub fn control(&self, body: &str) {
        let r = Client::connect(self.addr)
            .unwrap()
            .request("POST", "/control", &[], body.as_bytes())
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    }

    pub fn stat(&self, k: &str) -> u64 {
        self.stats()[k].as_u64().unwrap()
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Config text of an upstream model over these fakes.
pub fn upstream_model(name: &str, fakes: &[&Fake], extra: &str) -> String {
    upstream_model_in(name, fakes, "", extra)
}

/// `upstream_model` with `pool_extra` in the pool's section.
pub fn upstream_model_in(name: &str, fakes: &[&Fake], pool_extra: &str, extra: &str) -> String {
    let members: Vec<String> = fakes
        .iter()
        .map(|f| format!("{{ addr = \"{}\" }}", f.addr))
        .collect();
    format!(
        "[pools.{name}-pool]\nmembers = [{}]\n{pool_extra}\n\n[models.{name}]\nbackend = \"upstream\"\npool = \"{name}-pool\"\n{extra}\n",
        members.join(", ")
    )
}

/// `POST /v1/chat/completions` with `body`, as API key `key`.
pub fn post_as(uf: &Ultrafast, key: &str, body: &str, extra: &[(&str, &str)]) -> Resp {
    let auth = format!("Bearer {key}");
    let mut h = vec![
        ("Authorization", auth.as_str()),
        ("Content-Type", "application/json"),
    ];
    h.extend_from_slice(extra);
    Client::connect(uf.addr)
        .unwrap()
        .request("POST", "/v1/chat/completions", &h, body.as_bytes())
        .unwrap()
}

/// `POST path` with JSON `body` and `headers`.
pub fn post_to(uf: &Ultrafast, path: &str, body: &str, headers: &[(&str, &str)]) -> Resp {
    let mut h = vec![("Content-Type", "application/json")];
    h.extend_from_slice(headers);
    Client::connect(uf.addr)
        .unwrap()
        .request("POST", path, &h, body.as_bytes())
        .unwrap()
}

/// `GET path` as API key `key`.
pub fn get_as(uf: &Ultrafast, key: &str, path: &str) -> Resp {
    let auth = format!("Bearer {key}");
    get(uf.addr, path, &[("Authorization", &auth)])
}

pub const INFERENCE_ROUTE: &str =
    "[[routes]]\nname = \"openai\"\npath = \"/v1/\"\ninference = true\n\n";

/// Run a check of `py/openai_checks.py`; panics with its output on failure.
pub fn python_check(check: &str, uf: &Ultrafast, model: &str) {
    let base = format!("http://{}/v1", uf.addr);
    py("openai_checks.py", check, uf, &[&base, model]);
}

/// Run `tests/py/SCRIPT CHECK ARGS...`; a failure shows the script's output
/// and the server's log.
pub fn py(script: &str, check: &str, uf: &Ultrafast, args: &[&str]) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/py")
        .join(script);
    let out = Command::new("python3")
        .arg(path)
        .arg(check)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{script} `{check}` failed:\n{}\n{}\nserver log:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        uf.stderr()
    );
}

/// One SSE `data:` payload and when its bytes arrived.
#[derive(Debug, Clone)]
pub struct Arrival {
    pub at: Instant,
    pub data: String,
}

/// POST a streaming request on a raw socket; returns the open socket after
/// the request is written.
pub fn post_stream(
    addr: SocketAddr,
    path: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    let mut req = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).unwrap();
    s
}

/// Read SSE data events (chunked HTTP/1.1) until `[DONE]` or close, with
/// arrival times; also returns SSE comments seen.
pub fn read_sse(s: TcpStream, limit: Duration) -> (Vec<Arrival>, Vec<String>) {
    s.set_read_timeout(Some(limit)).unwrap();
    let mut r = BufReader::new(s);
    let mut line = String::new();
    // Head.
    loop {
        line.clear();
        if r.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
            break;
        }
    }
    let mut out = Vec::new();
    let mut comments = Vec::new();
    loop {
        line.clear();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            break;
        }
        let l = line.trim_end();
        if let Some(d) = l.strip_prefix("data: ") {
            out.push(Arrival {
                at: Instant::now(),
                data: d.to_string(),
            });
            if d == "[DONE]" {
                break;
            }
        } else if let Some(c) = l.strip_prefix(": ") {
            comments.push(c.to_string());
        }
    }
    (out, comments)
}

/// Content pieces of chat chunks.
pub fn contents(evs: &[Arrival]) -> Vec<(Instant, String)> {
    evs.iter()
        .filter_map(|a| {
            let v: serde_json::Value = serde_json::from_str(&a.data).ok()?;
            let c = v["choices"][0]["delta"]["content"].as_str()?;
            (!c.is_empty()).then(|| (a.at, c.to_string()))
        })
        .collect()
}

const SMALL_CHAT: &str =
    r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":6}"#;

/// Closed loops of the same small chat (`max_tokens` 6, model `m`): per
/// (headers, clients), that many clients for `secs` seconds; returns each
/// entry's completed requests (any refusal fails the test).
pub fn closed_loops(
    addr: SocketAddr,
    tenants: &[(Vec<(String, String)>, usize)],
    secs: u64,
) -> Vec<usize> {
    let stop = Arc::new(AtomicBool::new(false));
    let counts: Vec<Arc<AtomicUsize>> = tenants.iter().map(|_| Arc::default()).collect();
    let refused = Arc::new(AtomicUsize::new(0));
    let mut threads = Vec::new();
    for ((headers, clients), count) in tenants.iter().zip(&counts) {
        for _ in 0..*clients {
            let (stop, count, refused) = (stop.clone(), count.clone(), refused.clone());
            let headers = headers.clone();
            threads.push(std::thread::spawn(move || {
                let mut h: Vec<(&str, &str)> = vec![("Content-Type", "application/json")];
                h.extend(headers.iter().map(|(k, v)| (k.as_str(), v.as_str())));
                // Bounded: at most this many requests per client.
                for _ in 0..1000 {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let r = Client::connect(addr)
                        .unwrap()
                        .request("POST", "/v1/chat/completions", &h, SMALL_CHAT.as_bytes())
                        .unwrap();
                    if r.status == 200 && !stop.load(Ordering::Relaxed) {
                        count.fetch_add(1, Ordering::Relaxed);
                    } else if r.status != 200 {
                        refused.fetch_add(1, Ordering::Relaxed);
                        std::thread::sleep(Duration::from_millis(20));
                    }
                }
            }));
        }
    }
    std::thread::sleep(Duration::from_secs(secs));
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(refused.load(Ordering::Relaxed), 0, "requests were refused");
    counts.iter().map(|c| c.load(Ordering::Relaxed)).collect()
}

/// One header as `closed_loops` takes it.
pub fn header(name: &str, v: &str) -> Vec<(String, String)> {
    vec![(name.to_string(), v.to_string())]
}
