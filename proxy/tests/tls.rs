//! TLS at the edge with real clients: `openssl s_client` for resumption
//! (tickets, cache, rotation, shared key files), OCSP stapling and SNI,
//! `curl --http2` and `h2load` for HTTP/2, `testssl.sh` for a protocol and
//! cipher audit, and hostile clients (garbage, TLS 1.0, stalls).

#![allow(clippy::unwrap_used)]
mod common;
use common::*;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Run a shell command with a deadline; (exit code, stdout + stderr).
fn sh(cmd: &str, stdin: &str) -> (i32, String) {
    let mut child = Command::new("timeout")
        .args(["20", "bash", "-c", cmd])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

const GET: &str = "GET / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";

fn s_client(port: u16, args: &str) -> String {
    sh(
        &format!("openssl s_client -connect 127.0.0.1:{port} -ign_eof {args}"),
        GET,
    )
    .1
}

/// A full handshake that saves its session to `path`.
fn save_session(port: u16, version: &str, path: &Path) -> String {
    s_client(
        port,
        &format!(
            "{version} -servername localhost -sess_out {}",
            path.display()
        ),
    )
}

/// A handshake offering the session saved in `path`.
fn resume(port: u16, version: &str, path: &Path) -> String {
    s_client(
        port,
        &format!(
            "{version} -servername localhost -sess_in {}",
            path.display()
        ),
    )
}

/// A CA (key + cert) made with openssl in `dir`.
fn ca(dir: &Path) {
    let d = dir.display();
    let (rc, out) = sh(&format!(
        "cd {d} && openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 30 -subj /CN=test-ca -addext basicConstraints=critical,CA:TRUE"
    ), "");
    assert_eq!(rc, 0, "{out}");
}

/// A leaf for `cn` signed by the CA in `dir`; `ec` picks ECDSA over RSA.
fn leaf(dir: &Path, file: &str, cn: &str, ec: bool) -> (PathBuf, PathBuf) {
    let d = dir.display();
    let key = if ec {
        "ec -pkeyopt ec_paramgen_curve:P-256"
    } else {
        "rsa:2048"
    };
    let (rc, out) = sh(&format!(
        "cd {d} && openssl req -newkey {key} -nodes -keyout {file}.key -out {file}.csr -subj '/CN={cn}' && \
         printf 'subjectAltName=DNS:{cn}\\n' > {file}.ext && \
         openssl x509 -req -in {file}.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out {file}.pem -days 10 -extfile {file}.ext"
    ), "");
    assert_eq!(rc, 0, "{out}");
    (
        dir.join(format!("{file}.pem")),
        dir.join(format!("{file}.key")),
    )
}

fn cert_entry(
    cert: &Path,
    key: &Path,
    names: &[&str],
    default: bool,
    ocsp: Option<&Path>,
) -> String {
    let names: Vec<String> = names.iter().map(|n| format!("\"{n}\"")).collect();
    let ocsp = ocsp
        .map(|o| format!(", ocsp = \"{}\"", o.display()))
        .unwrap_or_default();
    format!(
        "{{ cert = \"{}\", key = \"{}\", names = [{}], default = {default}{ocsp} }}",
        cert.display(),
        key.display(),
        names.join(", ")
    )
}

struct Tls {
    uf: Ultrafast,
    port: u16,
    _origin: Origin,
}

/// ultrafast with a TLS listener (`tls_extra` goes inside `tls = { ... }`)
/// proxying to a real origin.
fn start_tls(certs: &[String], tls_extra: &str) -> Tls {
    let origin = Origin::start("o");
    let port = free_port();
    let body = format!(
        "[[listeners]]\nname = \"https\"\naddress = \"127.0.0.1:{port}\"\ntls = {{ certs = [{}]{tls_extra} }}\n{}[[routes]]\npath = \"/\"\npool = \"p\"\n",
        certs.join(", "),
        pool_toml("p", &[&origin], "")
    );
    let uf = Ultrafast::start(&body);
    assert!(eventually(Duration::from_secs(5), || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    }));
    Tls {
        uf,
        port,
        _origin: origin,
    }
}

fn localhost_tls(extra: &str) -> (Tls, PathBuf) {
    let dir = scratch("certs");
    let (c, k) = dev_certs(&dir);
    (
        start_tls(&[cert_entry(&c, &k, &["localhost"], true, None)], extra),
        dir,
    )
}

#[test]
fn tls13_ticket_and_tls12_reconnect_resume() {
    let (t, dir) = localhost_tls("");
    let sess = dir.join("s13.pem");
    let first = save_session(t.port, "-tls1_3", &sess);
    assert!(first.contains("New, TLSv1.3"), "{first}");
    assert!(first.contains("HTTP/1.1 200"), "{first}");
    let second = resume(t.port, "-tls1_3", &sess);
    assert!(second.contains("Reused, TLSv1.3"), "{second}");
    let r12 = sh(
        &format!(
            "openssl s_client -connect 127.0.0.1:{} -tls1_2 -servername localhost -reconnect",
            t.port
        ),
        "",
    )
    .1;
    assert!(r12.matches("Reused, TLSv1.2").count() >= 5, "{r12}");
    assert!(t.uf.metric("ultrafast_tls_handshakes_total", &["resumed_ticket"]) >= 6.0);
    assert!(
        t.uf.metric("ultrafast_tls_versions_total", &["TLSv1.3"])
            + t.uf.metric("ultrafast_tls_versions_total", &["TLSv1_3"])
            >= 1.0
    );
}

#[test]
fn session_cache_resumes_without_tickets() {
    // TLS 1.2 session IDs go through the server-side cache.
    let (t, _dir) = localhost_tls("");
    let r12 = sh(&format!("openssl s_client -connect 127.0.0.1:{} -tls1_2 -no_ticket -servername localhost -reconnect", t.port), "").1;
    assert!(r12.matches("Reused, TLSv1.2").count() >= 5, "{r12}");
    assert!(t.uf.metric("ultrafast_tls_handshakes_total", &["resumed_cache"]) >= 5.0);
    // With tickets off, TLS 1.3 resumes statefully from the cache too.
    let (t, dir) = localhost_tls(", session_tickets = false");
    let sess = dir.join("cache.pem");
    let _ = save_session(t.port, "-tls1_3", &sess);
    let second = resume(t.port, "-tls1_3", &sess);
    assert!(second.contains("Reused, TLSv1.3"), "{second}");
    assert!(t.uf.metric("ultrafast_tls_handshakes_total", &["resumed_cache"]) >= 1.0);
    assert_eq!(
        t.uf.metric("ultrafast_tls_handshakes_total", &["resumed_ticket"]),
        0.0
    );
}

#[test]
fn a_ticket_from_two_rotations_ago_gets_a_full_handshake() {
    let (t, dir) = localhost_tls(", ticket_rotation_s = 1");
    let sess = dir.join("old.pem");
    let _ = save_session(t.port, "-tls1_2", &sess);
    let fresh = resume(t.port, "-tls1_2", &sess);
    assert!(fresh.contains("Reused"), "{fresh}");
    std::thread::sleep(Duration::from_millis(2200));
    let old = resume(t.port, "-tls1_2", &sess);
    assert!(old.contains("New, TLSv1.2"), "{old}");
    assert!(
        old.contains("HTTP/1.1 200"),
        "a full handshake, not an error: {old}"
    );
}

#[test]
fn instances_sharing_a_ticket_key_file_resume_each_other() {
    let dir = scratch("shared");
    let (c, k) = dev_certs(&dir);
    let key_file = dir.join("ticket.key");
    std::fs::write(&key_file, "ab".repeat(32)).unwrap();
    let set_mode = |m: &str| {
        Command::new("chmod")
            .arg(m)
            .arg(&key_file)
            .status()
            .unwrap()
    };
    set_mode("600");
    let entry = cert_entry(&c, &k, &["localhost"], true, None);
    let extra = format!(", ticket_key_file = \"{}\"", key_file.display());
    let (a, b) = (
        start_tls(std::slice::from_ref(&entry), &extra),
        start_tls(std::slice::from_ref(&entry), &extra),
    );
    let sess = dir.join("s.pem");
    let _ = save_session(a.port, "-tls1_3", &sess);
    let on_b = resume(b.port, "-tls1_3", &sess);
    assert!(on_b.contains("Reused, TLSv1.3"), "{on_b}");
    // A world-readable key file is refused, with its location.
    set_mode("644");
    let cfg = dir.join("bad.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[listeners]]\naddress = \"127.0.0.1:{}\"\ntls = {{ certs = [{entry}]{extra} }}\n",
            free_port()
        ),
    )
    .unwrap();
    let out = Command::new(bin())
        .args(["check", "-c"])
        .arg(&cfg)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        err.contains("listeners[0].tls.ticket_key_file") && err.contains("world-readable"),
        "{err}"
    );
}

#[test]
fn sni_picks_exact_wildcard_and_default_certificates() {
    let dir = scratch("sni");
    ca(&dir);
    let (a, ak) = leaf(&dir, "a", "a.example.test", false);
    let (w, wk) = leaf(&dir, "w", "*.wild.test", true);
    let (d, dk) = leaf(&dir, "d", "default.test", true);
    let certs = [
        cert_entry(&a, &ak, &["a.example.test"], false, None),
        cert_entry(&w, &wk, &["*.wild.test"], false, None),
        cert_entry(&d, &dk, &["default.test"], true, None),
    ];
    let t = start_tls(&certs, "");
    let subject = |name: &str| {
        let out = s_client(t.port, &format!("-servername {name}"));
        out.lines()
            .find(|l| l.starts_with("subject="))
            .unwrap_or("")
            .replace(' ', "")
    };
    assert_eq!(subject("a.example.test"), "subject=CN=a.example.test");
    assert_eq!(subject("x.wild.test"), "subject=CN=*.wild.test");
    assert_eq!(subject("other.test"), "subject=CN=default.test");
    // Without a default certificate an unknown name fails the handshake cleanly.
    let strict = start_tls(&certs[..2], "");
    let (rc, out) = sh(
        &format!(
            "openssl s_client -connect 127.0.0.1:{} -servername nope.test",
            strict.port
        ),
        "",
    );
    assert_ne!(rc, 0, "{out}");
    assert!(strict.uf.metric("ultrafast_tls_unknown_sni_total", &[]) >= 1.0);
    // The failure is counted as the handshake future returns, which can be
    // a moment after the client sees the close.
    assert!(eventually(Duration::from_secs(3), || strict
        .uf
        .metric("ultrafast_tls_handshakes_total", &["failed"])
        >= 1.0));
    assert!(t.uf.metric("ultrafast_tls_cert_expiry_seconds", &["a.example.test"]) > 8.0 * 86400.0);
}

/// An OCSP response for `leaf` from the CA in `dir`, optionally made at a
/// faked time in the past (so it is already expired).
fn ocsp_response(dir: &Path, leaf: &str, out: &str, past: bool) -> PathBuf {
    let d = dir.display();
    let fake = if past { "faketime -f -5d " } else { "" };
    let (rc, text) = sh(&format!(
        "cd {d} && serial=$(openssl x509 -in {leaf}.pem -noout -serial | cut -d= -f2) && \
         printf 'V\\t300101000000Z\\t\\t%s\\tunknown\\t/CN={leaf}\\n' $serial > index.txt && \
         openssl ocsp -issuer ca.pem -cert {leaf}.pem -reqout {out}.req && \
         {fake}openssl ocsp -index index.txt -rsigner ca.pem -rkey ca.key -CA ca.pem -reqin {out}.req -respout {out} -ndays 1"
    ), "");
    assert_eq!(rc, 0, "{text}");
    dir.join(out)
}

#[test]
fn ocsp_staple_is_served_while_fresh_and_never_stale() {
    let dir = scratch("ocsp");
    ca(&dir);
    let (c, k) = leaf(&dir, "localhost", "localhost", false);
    let good = ocsp_response(&dir, "localhost", "good.der", false);
    let t = start_tls(&[cert_entry(&c, &k, &["localhost"], true, Some(&good))], "");
    let out = s_client(t.port, "-servername localhost -status");
    assert!(out.contains("OCSP Response Status: successful"), "{out}");
    let expired = ocsp_response(&dir, "localhost", "old.der", true);
    let t2 = start_tls(
        &[cert_entry(&c, &k, &["localhost"], true, Some(&expired))],
        "",
    );
    let out = s_client(t2.port, "-servername localhost -status");
    assert!(out.contains("OCSP response: no response sent"), "{out}");
    assert!(t2.uf.metric("ultrafast_tls_ocsp_stale_total", &[]) >= 1.0);
    // Replacing the staple file is picked up for new handshakes.
    std::fs::copy(&good, &expired).unwrap();
    assert!(eventually(Duration::from_secs(5), || s_client(
        t2.port,
        "-servername localhost -status"
    )
    .contains("OCSP Response Status: successful")));
}

#[test]
fn an_ocsp_staple_for_another_certificate_is_refused_at_load() {
    let dir = scratch("ocspid");
    ca(&dir);
    let (c, k) = leaf(&dir, "localhost", "localhost", false);
    leaf(&dir, "other", "other.test", false);
    let theirs = ocsp_response(&dir, "other", "other.der", false);
    let ours = ocsp_response(&dir, "localhost", "ours.der", false);
    // With the issuer in the chain, its key hash is checked too.
    let chain = dir.join("chain.pem");
    let mut pem = std::fs::read(&c).unwrap();
    pem.extend(std::fs::read(dir.join("ca.pem")).unwrap());
    std::fs::write(&chain, pem).unwrap();
    let t = start_tls(
        &[cert_entry(&chain, &k, &["localhost"], true, Some(&ours))],
        "",
    );
    let out = s_client(t.port, "-servername localhost -status");
    assert!(out.contains("OCSP Response Status: successful"), "{out}");
    // Another certificate's staple: `serve` stops at load, naming the file.
    let cfg = dir.join("bad.toml");
    std::fs::write(
        &cfg,
        format!(
            "[server]\npid_file = \"{d}/p\"\nupgrade_sock = \"{d}/s\"\n[admin]\nlisten = \"\"\n[[listeners]]\nname = \"https\"\naddress = \"127.0.0.1:{}\"\ntls = {{ certs = [{}] }}\n",
            free_port(),
            cert_entry(&chain, &k, &["localhost"], true, Some(&theirs)),
            d = dir.display()
        ),
    )
    .unwrap();
    let (code, err) = serve_until_exit(&cfg, Duration::from_secs(10));
    assert_eq!(code, Some(1), "serve must stop on a wrong staple: {err}");
    assert!(err.contains("other.der"), "{err}");
    assert!(err.contains("another certificate"), "{err}");
}

#[test]
fn certificate_hot_reload_keeps_old_material_on_error() {
    let dir = scratch("reload");
    ca(&dir);
    let (c, k) = leaf(&dir, "one", "one.test", true);
    let t = start_tls(&[cert_entry(&c, &k, &["one.test"], true, None)], "");
    let subject = || {
        s_client(t.port, "-servername one.test")
            .lines()
            .find(|l| l.starts_with("subject="))
            .unwrap_or("")
            .replace(' ', "")
    };
    assert_eq!(subject(), "subject=CN=one.test");
    let (c2, k2) = leaf(&dir, "two", "two.test", true);
    std::fs::copy(&k2, &k).unwrap();
    std::fs::copy(&c2, &c).unwrap();
    assert!(eventually(Duration::from_secs(5), || subject()
        == "subject=CN=two.test"));
    std::fs::write(&c, "not a certificate").unwrap();
    assert!(eventually(Duration::from_secs(5), || t
        .uf
        .metric("ultrafast_tls_cert_reloads_total", &["error"])
        >= 1.0));
    assert_eq!(
        subject(),
        "subject=CN=two.test",
        "a bad certificate replaced a good one"
    );
}

#[test]
fn http2_negotiates_and_carries_many_concurrent_streams() {
    let (t, _dir) = localhost_tls("");
    let (rc, out) = sh(&format!("curl -sk --http2 -o /dev/null -w '%{{http_version}} %{{http_code}}' https://127.0.0.1:{}/", t.port), "");
    assert_eq!((rc, out.trim()), (0, "2 200"));
    let (rc, body) = sh(
        &format!("curl -sk --http2 https://127.0.0.1:{}/h2", t.port),
        "",
    );
    assert_eq!(rc, 0);
    assert!(body.contains("\"path\":\"/h2\""), "{body}");
    let (rc, out) = sh(
        &format!("h2load -n 400 -c 1 -m 100 https://127.0.0.1:{}/", t.port),
        "",
    );
    assert_eq!(rc, 0, "{out}");
    assert!(out.contains("400 succeeded, 0 failed"), "{out}");
    assert!(t.uf.metric("ultrafast_tls_alpn_total", &["h2"]) >= 2.0);
}

#[test]
fn hostile_clients_get_a_clean_close_and_others_are_unaffected() {
    let (t, _dir) = localhost_tls(", handshake_timeout_ms = 500");
    // Garbage.
    let mut g = std::net::TcpStream::connect(("127.0.0.1", t.port)).unwrap();
    g.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    g.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut buf = [0u8; 1024];
    let closed = matches!(g.read(&mut buf), Ok(_) | Err(_));
    assert!(closed);
    // A client that stalls mid-handshake is closed at the deadline.
    let mut stall = std::net::TcpStream::connect(("127.0.0.1", t.port)).unwrap();
    stall.write_all(&[0x16, 0x03, 0x01, 0x00, 0x50]).unwrap();
    stall
        .set_read_timeout(Some(Duration::from_secs(3)))
        .unwrap();
    let start = Instant::now();
    let n = stall.read(&mut buf).unwrap_or(0);
    assert_eq!(n, 0, "expected a close");
    assert!(
        start.elapsed() < Duration::from_millis(2000),
        "{:?}",
        start.elapsed()
    );
    // TLS 1.0 is refused.
    let (rc, out) = sh(
        &format!(
            "openssl s_client -connect 127.0.0.1:{} -tls1 -cipher DEFAULT@SECLEVEL=0",
            t.port
        ),
        "",
    );
    assert_ne!(rc, 0, "{out}");
    // Meanwhile a normal client is served.
    let (rc, out) = sh(
        &format!(
            "curl -sk -o /dev/null -w '%{{http_code}}' https://127.0.0.1:{}/",
            t.port
        ),
        "",
    );
    assert_eq!((rc, out.trim()), (0, "200"));
    assert!(eventually(Duration::from_secs(3), || {
        t.uf.metric("ultrafast_tls_handshake_failures_total", &["timeout"]) >= 1.0
            && t.uf.metric("ultrafast_tls_handshakes_total", &["failed"]) >= 3.0
    }));
}

#[test]
fn http_redirects_to_https_and_hsts_is_sent() {
    let dir = scratch("hsts");
    let (c, k) = dev_certs(&dir);
    let origin = Origin::start("o");
    let (tls_port, plain_port) = (free_port(), free_port());
    let body = format!(
        "[[listeners]]\nname = \"https\"\naddress = \"127.0.0.1:{tls_port}\"\ntls = {{ certs = [{}], hsts_max_age_s = 600 }}\n\
         [[listeners]]\nname = \"redirect\"\naddress = \"127.0.0.1:{plain_port}\"\nredirect_https_port = {tls_port}\n\
         {}[[routes]]\npath = \"/\"\npool = \"p\"\n",
        cert_entry(&c, &k, &["localhost"], true, None),
        pool_toml("p", &[&origin], "")
    );
    let uf = Ultrafast::start(&body);
    assert!(eventually(Duration::from_secs(5), || {
        std::net::TcpStream::connect(("127.0.0.1", tls_port)).is_ok()
    }));
    let r = get(
        format!("127.0.0.1:{plain_port}").parse().unwrap(),
        "/x?y=1",
        &[("Host", "localhost:9")],
    );
    assert_eq!(r.status, 301);
    assert_eq!(
        r.header("location"),
        Some(format!("https://localhost:{tls_port}/x?y=1").as_str())
    );
    let (rc, out) = sh(
        &format!("curl -sk -D - -o /dev/null https://127.0.0.1:{tls_port}/"),
        "",
    );
    assert_eq!(rc, 0);
    assert!(
        out.to_ascii_lowercase()
            .contains("strict-transport-security: max-age=600"),
        "{out}"
    );
    // Plain requests on the ordinary listener get no HSTS and no redirect.
    let r = uf.get("/");
    assert_eq!(r.status, 200);
    assert!(r.header("strict-transport-security").is_none());
}

/// `openssl s_server -www` on `port`: a real HTTPS origin (one connection
/// at a time), optionally demanding a client certificate.
struct SServer(std::process::Child);

impl SServer {
    fn start(dir: &Path, port: u16, cert: &str, verify_clients: bool) -> SServer {
        let mut cmd = Command::new("openssl");
        cmd.current_dir(dir)
            .args(["s_server", "-www", "-accept", &port.to_string(), "-cert"])
            .arg(format!("{cert}.pem"))
            .arg("-key")
            .arg(format!("{cert}.key"))
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if verify_clients {
            cmd.args(["-Verify", "1", "-CAfile", "ca.pem"]);
        }
        let s = SServer(cmd.spawn().unwrap());
        assert!(eventually(Duration::from_secs(5), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        }));
        s
    }
}

impl Drop for SServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn upstream_tls_with_sni_ca_verification_and_client_certificates() {
    let dir = scratch("uptls");
    ca(&dir);
    leaf(&dir, "origin", "origin.test", true);
    let (cc, ck) = leaf(&dir, "client", "client.test", true);
    let port = free_port();
    let _origin = SServer::start(&dir, port, "origin", true);
    let pool = |extra: &str| {
        format!(
            "[pools.up]\nmembers = [{{ addr = \"127.0.0.1:{port}\" }}]\nretry = {{ attempts = 1 }}\ntls = {{ sni = \"origin.test\", ca_file = \"{}/ca.pem\"{extra} }}\n[[routes]]\npath = \"/\"\npool = \"up\"\n",
            dir.display()
        )
    };
    let mtls = format!(
        ", client_cert = \"{}\", client_key = \"{}\"",
        cc.display(),
        ck.display()
    );
    let uf = Ultrafast::start(&pool(&mtls));
    let r = uf.get("/");
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.text().contains("s_server"), "{}", r.text());
    // Without a client certificate the origin refuses: a clean 502.
    let uf2 = Ultrafast::start(&pool(""));
    assert_eq!(uf2.get("/").status, 502);
    // A name the certificate does not carry fails verification: 502.
    let wrong = pool(&mtls).replace("sni = \"origin.test\"", "sni = \"other.test\"");
    let uf3 = Ultrafast::start(&wrong);
    assert_eq!(uf3.get("/").status, 502);
    // A missing CA file is a config error with its location.
    let bad = dir.join("bad.toml");
    let text = pool("").replace("ca.pem", "missing.pem");
    std::fs::write(
        &bad,
        format!(
            "[[listeners]]\naddress = \"127.0.0.1:{}\"\n{text}",
            free_port()
        ),
    )
    .unwrap();
    let out = Command::new(bin())
        .args(["check", "-c"])
        .arg(&bad)
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("pools.up.tls.ca_file"));
}

#[test]
fn an_h2c_listener_answers_short_http1_requests_and_times_out_silence() {
    let origin = Origin::start("o");
    let port = free_port();
    let uf = Ultrafast::start(&format!(
        "[[listeners]]\nname = \"h2c\"\naddress = \"127.0.0.1:{port}\"\nh2c = true\n\
         [limits]\nclient_header_timeout_ms = 800\nkeepalive_timeout_s = 1\n{}[[routes]]\npath = \"/\"\npool = \"p\"\n",
        pool_toml("p", &[&origin], "")
    ));
    let h2c: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    assert!(eventually(Duration::from_secs(5), || {
        std::net::TcpStream::connect(h2c).is_ok()
    }));
    // Shorter than the 24-byte preface: answered at once, not held.
    let mut c = Client::connect(h2c).unwrap();
    c.send_raw(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    assert_eq!(c.read_response(false).unwrap().status, 200);
    // HTTP/2 with prior knowledge still works there.
    let (rc, out) = sh(&format!("curl -s --http2-prior-knowledge -o /dev/null -w '%{{http_version}} %{{http_code}}' http://{h2c}/"), "");
    assert_eq!((rc, out.trim()), (0, "2 200"));
    // A connection that sends nothing is closed at the head deadline...
    let mut idle = Client::connect(h2c).unwrap();
    let t = Instant::now();
    assert!(
        idle.closed_within(Duration::from_secs(5)),
        "a silent connection was held"
    );
    assert!(
        t.elapsed() >= Duration::from_millis(600),
        "{:?}",
        t.elapsed()
    );
    // ...and a kept-alive one that goes quiet at the keepalive timeout.
    let mut kept = Client::connect(h2c).unwrap();
    let r = kept.request("GET", "/", &[], b"").unwrap();
    assert_eq!(r.status, 200);
    let t = Instant::now();
    assert!(
        kept.closed_within(Duration::from_secs(5)),
        "an idle keepalive was held"
    );
    assert!(
        t.elapsed() >= Duration::from_millis(700),
        "{:?}",
        t.elapsed()
    );
    let closed = uf.metric(
        "ultrafast_downstream_connections_closed_total",
        &["header_timeout"],
    );
    assert_eq!(closed, 1.0, "{}", uf.metrics());
}

#[test]
fn h2c_on_a_plain_listener_when_enabled() {
    let origin = Origin::start("o");
    let port = free_port();
    let uf = Ultrafast::start(&format!(
        "[[listeners]]\nname = \"h2c\"\naddress = \"127.0.0.1:{port}\"\nh2c = true\n{}[[routes]]\npath = \"/\"\npool = \"p\"\n",
        pool_toml("p", &[&origin], "")
    ));
    assert!(eventually(Duration::from_secs(5), || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    }));
    let (rc, out) = sh(&format!("curl -s --http2-prior-knowledge -o /dev/null -w '%{{http_version}} %{{http_code}}' http://127.0.0.1:{port}/"), "");
    assert_eq!((rc, out.trim()), (0, "2 200"));
    // Only there: the other plain listener speaks HTTP/1 and answers a
    // short HTTP/1.0 request at once instead of waiting for a preface.
    let (_, out) = sh(&format!("curl -s --max-time 3 --http2-prior-knowledge -o /dev/null -w '%{{http_version}}' http://{}/", uf.addr), "");
    assert_ne!(out.trim(), "2", "HTTP/2 on a listener without h2c");
    let mut c = Client::connect(uf.addr).unwrap();
    c.send_raw(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    let r = c.read_response(false).unwrap();
    assert_eq!(r.status, 200);
    drop(uf);
}

#[test]
fn tls_listener_survives_a_graceful_upgrade() {
    let (mut t, _dir) = localhost_tls("");
    let curl = |port: u16| {
        sh(
            &format!("curl -sk -o /dev/null -w '%{{http_code}}' https://127.0.0.1:{port}/"),
            "",
        )
        .1
    };
    assert_eq!(curl(t.port), "200");
    let new = Ultrafast::spawn(
        t.uf.dir.clone(),
        t.uf.config.clone(),
        t.uf.addr.port(),
        t.uf.admin.port(),
        true,
    );
    std::thread::sleep(Duration::from_millis(500));
    t.uf.signal(3);
    assert!(
        t.uf.wait_exit(Duration::from_secs(10)).is_some(),
        "old process did not exit"
    );
    assert!(
        eventually(Duration::from_secs(5), || curl(t.port) == "200"),
        "TLS listener not served after the upgrade"
    );
    drop(new);
}

#[test]
fn https_member_syntax_and_mixed_pools() {
    let dir = scratch("httpsmember");
    ca(&dir);
    leaf(&dir, "origin", "origin.test", true);
    let port = free_port();
    let _origin = SServer::start(&dir, port, "origin", false);
    let uf = Ultrafast::start(&format!(
        "[pools.up]\nmembers = [{{ addr = \"https://127.0.0.1:{port}/\" }}]\nretry = {{ attempts = 1 }}\n\
         tls = {{ sni = \"origin.test\", ca_file = \"{}/ca.pem\" }}\n[[routes]]\npath = \"/\"\npool = \"up\"\n",
        dir.display()
    ));
    let r = uf.get("/");
    assert_eq!(r.status, 200, "{}", r.text());
    // An https:// member with no `tls` section verifies against the system
    // roots, which do not know the test CA: a clean 502, not plaintext.
    let uf2 = Ultrafast::start(&format!(
        "[pools.up]\nmembers = [{{ addr = \"https://127.0.0.1:{port}\" }}]\nretry = {{ attempts = 1 }}\n[[routes]]\npath = \"/\"\npool = \"up\"\n"
    ));
    assert_eq!(uf2.get("/").status, 502);
    let bad = dir.join("mixed.toml");
    std::fs::write(
        &bad,
        format!("[[listeners]]\naddress = \"127.0.0.1:{}\"\n[pools.m]\nmembers = [{{ addr = \"https://127.0.0.1:1\" }}, {{ addr = \"127.0.0.1:2\" }}]\n", free_port()),
    )
    .unwrap();
    let out = Command::new(bin())
        .args(["check", "-c"])
        .arg(&bad)
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot mix https://"));
}
