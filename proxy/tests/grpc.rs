//! gRPC through the edge with real peers: the official `grpcio` server
//! (`py/grpc_origin.py`, plaintext and TLS) behind an h2c pool and an h2
//! (TLS) pool, and the official `grpcio` client (`py/grpc_checks.py`)
//! through an h2c listener and a TLS listener: unary (1 MiB too), server
//! streaming, bidirectional streaming (in lockstep), a deadline, an error
//! status with its message, trailers, health; the edge's own refusals as
//! gRPC statuses; connection reuse and the stream limit per connection; a
//! deadline the edge itself enforces on a member that never answers; gRPC
//! health checks taking a member down and up.

#![allow(clippy::unwrap_used)]
mod common;
use common::*;
use std::io::{BufRead, BufReader, Read};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

fn py(script: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/py")
        .join(script)
}

/// `py/grpc_origin.py`, stopped on drop.
struct GrpcOrigin {
    child: Child,
    port: u16,
}

impl GrpcOrigin {
    fn start(args: &[&str]) -> GrpcOrigin {
        let mut child = Command::new("python3")
            .arg(py("grpc_origin.py"))
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("python3 with grpcio (.ci/run installs it in .venv)");
        let mut line = String::new();
        BufReader::new(child.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        let port = line
            .trim()
            .strip_prefix("PORT ")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("grpc_origin.py said {line:?}"));
        GrpcOrigin { child, port }
    }
}

impl Drop for GrpcOrigin {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Run `py/grpc_checks.py` with `args`; every line it printed, and
/// whether it passed.
fn checks(args: &[&str]) -> (bool, String) {
    let out = Command::new("python3")
        .arg(py("grpc_checks.py"))
        .args(args)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// A member that takes connections and never says a word.
fn deaf() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for c in l.incoming().flatten() {
            std::thread::spawn(move || {
                let mut c = c;
                let mut buf = [0u8; 4096];
                while matches!(c.read(&mut buf), Ok(n) if n > 0) {}
            });
        }
    });
    port
}

struct Setup {
    uf: Ultrafast,
    /// The h2c listener's address.
    h2c: String,
    plain: GrpcOrigin,
    _tls: GrpcOrigin,
    tls_port: u16,
    ca: PathBuf,
    health_file: PathBuf,
}

fn setup() -> Setup {
    let dir = scratch("grpc");
    std::fs::create_dir_all(&dir).unwrap();
    let (cert, key) = dev_certs(&dir);
    let ca = dir.join("ca.pem");
    let health_file = dir.join("health");
    let plain = GrpcOrigin::start(&["--health-file", health_file.to_str().unwrap()]);
    let tls = GrpcOrigin::start(&[
        "--tls-cert",
        cert.to_str().unwrap(),
        "--tls-key",
        key.to_str().unwrap(),
    ]);
    let closed = free_port();
    let tls_port = free_port();
    let h2c_port = free_port();
    let uf = Ultrafast::start(&format!(
        r#"[limits]
# The 1 MiB message with its framing (nginx needs client_max_body_size too).
client_max_body_bytes = 4194304

[[listeners]]
address = "127.0.0.1:{tls_port}"
tls = {{ certs = [{{ cert = "{cert}", key = "{key}", default = true }}] }}

[[listeners]]
address = "127.0.0.1:{h2c_port}"
h2c = true

[rate_limits.one]
key = "route"
rate_per_s = 0.001
burst = 1

[pools.plain]
members = [{{ addr = "127.0.0.1:{plain}" }}]
protocol = "h2c"
health_check = {{ grpc = "", interval_ms = 200, timeout_ms = 1000, rise = 1, fall = 2 }}

[pools.tls]
members = [{{ addr = "127.0.0.1:{tls}" }}]
protocol = "h2"
tls = {{ sni = "localhost", ca_file = "{ca}" }}
health_check = {{ grpc = "test.Echo", interval_ms = 500 }}

[pools.narrow]
members = [{{ addr = "127.0.0.1:{plain}" }}]
protocol = "h2c"
max_streams_per_connection = 2

[pools.down]
members = [{{ addr = "127.0.0.1:{closed}" }}]
protocol = "h2c"
retry = {{ attempts = 1 }}

[pools.deaf]
members = [{{ addr = "127.0.0.1:{deaf}" }}]
protocol = "h2c"
retry = {{ attempts = 1 }}

[[routes]]
hosts = ["localhost"]
path = "/"
pool = "tls"

[[routes]]
path = "/test.Down/"
pool = "down"

[[routes]]
path = "/test.Deaf/"
pool = "deaf"

[[routes]]
path = "/test.Limited/"
pool = "plain"
rate_limits = ["one"]

[[routes]]
hosts = ["narrow"]
path = "/"
pool = "narrow"

[[routes]]
path = "/"
pool = "plain"
"#,
        cert = cert.display(),
        key = key.display(),
        ca = ca.display(),
        plain = plain.port,
        tls = tls.port,
        deaf = deaf(),
    ));
    Setup {
        uf,
        h2c: format!("127.0.0.1:{h2c_port}"),
        plain,
        _tls: tls,
        tls_port,
        ca,
        health_file,
    }
}

#[test]
fn grpcio_through_h2c_and_h2_pools_with_the_edges_own_answers_as_grpc_statuses() {
    let s = setup();
    let uf = &s.uf;
    // Plain HTTP/2 (prior knowledge) to the edge, h2c to the member.
    let (ok, out) = checks(&[&s.h2c, "--edge"]);
    assert!(ok, "through the h2c pool:\n{out}");
    assert_eq!(out.matches("PASS").count(), 14, "{out}");
    // TLS (ALPN h2) to the edge, h2 over TLS to the member.
    let target = format!("127.0.0.1:{}", s.tls_port);
    let ca = s.ca.to_str().unwrap();
    let (ok, out) = checks(&[&target, "--tls", "--ca", ca, "--server-name", "localhost"]);
    assert!(ok, "through the h2 (TLS) pool:\n{out}");
    assert_eq!(out.matches("PASS").count(), 11, "{out}");
    // Calls share connections: a handful opened, most reused.
    for pool in ["plain", "tls"] {
        let new = uf.metric(
            "ultrafast_upstream_connections_total",
            &[&format!("pool=\"{pool}\""), "reused=\"false\""],
        );
        let reused = uf.metric(
            "ultrafast_upstream_connections_total",
            &[&format!("pool=\"{pool}\""), "reused=\"true\""],
        );
        assert!((1.0..=3.0).contains(&new), "{pool}: {new} new connections");
        assert!(reused >= 10.0, "{pool}: {reused} reused");
    }
}

/// Six calls at once through the pool of `authority`, after one call
/// alone opened a connection; the connections the pool opened for the six.
fn six_at_once(s: &Setup, authority: &str) -> f64 {
    let pool = match authority {
        "narrow" => "narrow",
        _ => "plain",
    };
    let opened = || {
        s.uf.metric(
            "ultrafast_upstream_connections_total",
            &[&format!("pool=\"{pool}\""), "reused=\"false\""],
        )
    };
    let run = |n: usize| {
        let code = format!(
            "import grpc, concurrent.futures as f\n\
             ch = grpc.insecure_channel('{}', options=[('grpc.default_authority', '{authority}')])\n\
             slow = ch.unary_unary('/test.Echo/Slow', lambda b: b, lambda b: b)\n\
             with f.ThreadPoolExecutor({n}) as ex:\n\
             \x20   got = list(ex.map(lambda _: slow(b'0.6', timeout=10), range({n})))\n\
             assert got == [b'slept'] * {n}, got\n",
            s.h2c
        );
        let out = Command::new("python3")
            .args(["-c", &code])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{err}");
    };
    run(1);
    let before = opened();
    run(6);
    opened() - before
}

#[test]
fn concurrent_calls_share_a_connection_up_to_its_stream_limit() {
    let s = setup();
    // 100 streams a connection: the open one takes all six.
    let wide = six_at_once(&s, "x");
    assert_eq!(wide, 0.0, "{wide} more connections for six calls");
    // Two streams a connection: the open one takes two, the other four
    // need at least two more.
    let narrow = six_at_once(&s, "narrow");
    assert!(
        narrow >= 2.0,
        "{narrow} more connections for six calls, two each"
    );
}

#[test]
fn the_edge_answers_deadline_exceeded_for_a_member_that_never_answers() {
    let s = setup();
    let port: u16 = s.h2c.rsplit(':').next().unwrap().parse().unwrap();
    let req = http::Request::post(format!("http://127.0.0.1:{port}/test.Deaf/Unary"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("grpc-timeout", "400m")
        .body(())
        .unwrap();
    let a = h2c(port, req, true);
    assert_eq!(a.status, 200, "{:?}", a.headers);
    assert_eq!(a.headers.get("grpc-status").map(String::as_str), Some("4"));
    assert_eq!(
        a.headers.get("content-type").map(String::as_str),
        Some("application/grpc")
    );
    assert!(
        a.headers.contains_key("x-request-id"),
        "the response policy"
    );
    assert!(
        a.took >= Duration::from_millis(350) && a.took < Duration::from_secs(3),
        "answered after {:?}",
        a.took
    );
    // A deadline already spent is not sent at all.
    let req = http::Request::post(format!("http://127.0.0.1:{port}/test.Echo/Unary"))
        .header("content-type", "application/grpc")
        .header("grpc-timeout", "1n")
        .body(())
        .unwrap();
    let a = h2c(port, req, true);
    assert_eq!(a.headers.get("grpc-status").map(String::as_str), Some("4"));
}

#[test]
fn grpc_health_checks_take_a_member_down_and_up() {
    let s = setup();
    let uf = &s.uf;
    let healthy = || uf.metric("ultrafast_upstream_member_healthy", &["pool=\"plain\""]);
    let tls_healthy = || uf.metric("ultrafast_upstream_member_healthy", &["pool=\"tls\""]);
    assert!(eventually(Duration::from_secs(5), || healthy() == 1.0));
    assert_eq!(tls_healthy(), 1.0, "the TLS member is SERVING test.Echo");
    std::fs::write(&s.health_file, "NOT_SERVING").unwrap();
    assert!(
        eventually(Duration::from_secs(5), || healthy() == 0.0),
        "NOT_SERVING takes the member down"
    );
    std::fs::write(&s.health_file, "SERVING").unwrap();
    assert!(
        eventually(Duration::from_secs(5), || healthy() == 1.0),
        "SERVING brings it back"
    );
    let (ok, out) = checks(&[&s.h2c, "--only", "unary"]);
    assert!(ok, "{out}");
    // A member that is gone is down too.
    drop(s.plain);
    assert!(eventually(Duration::from_secs(5), || healthy() == 0.0));
}
