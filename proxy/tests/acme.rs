//! Certificates from ACME, against a real directory: Debian's Pebble,
//! started and stopped by PID, serving HTTPS with a CA this test makes, and
//! resolving every name to 127.0.0.1 through the tests' DNS server. Pebble
//! validates for real: it fetches HTTP-01 tokens from ultrafast's plain
//! listener and makes TLS-ALPN-01 handshakes with its TLS listener.
//! `curl` then verifies the served chain up to Pebble's own root.

#![allow(clippy::unwrap_used)]
mod common;
use common::*;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A Pebble directory (its HTTPS port, management port, files).
struct Pebble {
    child: Child,
    port: u16,
    mgmt: u16,
    dir: PathBuf,
}

impl Pebble {
    /// Start Pebble validating HTTP-01 on `http_port` and TLS-ALPN-01 on
    /// `tls_port`, issuing certificates valid `validity_s` seconds,
    /// refusing orders for `blocked` names; on `port` (0: a free one).
    fn start(
        dir: &Path,
        port: u16,
        http_port: u16,
        tls_port: u16,
        dns: SocketAddr,
        validity_s: u64,
        blocked: &[&str],
    ) -> Pebble {
        assert!(
            Command::new("pebble").arg("-h").output().is_ok(),
            "pebble is not installed (Debian package `pebble`; .ci/run installs it)"
        );
        if !dir.join("ca.pem").exists() {
            dev_certs(dir);
        }
        let port = if port == 0 { free_port() } else { port };
        let mgmt = free_port();
        let config = serde_json::json!({"pebble": {
            "listenAddress": format!("127.0.0.1:{port}"),
            "managementListenAddress": format!("127.0.0.1:{mgmt}"),
            "certificate": dir.join("localhost.pem"),
            "privateKey": dir.join("localhost.key"),
            "httpPort": http_port,
            "tlsPort": tls_port,
            "ocspResponderURL": "",
            "externalAccountBindingRequired": false,
            "domainBlocklist": blocked,
            "certificateValidityPeriod": validity_s,
        }});
        let path = dir.join(format!("pebble-{port}-{}.json", blocked.len()));
        std::fs::write(&path, config.to_string()).unwrap();
        let log = std::fs::File::create(dir.join(format!("pebble-{port}.log"))).unwrap();
        let child = Command::new("pebble")
            .arg("-config")
            .arg(&path)
            .arg("-dnsserver")
            .arg(dns.to_string())
            // No random sleeps before validating; every order validates
            // afresh (no reuse of an earlier authorization).
            .env("PEBBLE_VA_NOSLEEP", "1")
            .env("PEBBLE_AUTHZREUSE", "0")
            .env("PEBBLE_WFE_NONCEREJECT", "0")
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        let p = Pebble {
            child,
            port,
            mgmt,
            dir: dir.to_path_buf(),
        };
        assert!(
            eventually(Duration::from_secs(15), || {
                std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
            }),
            "pebble did not start: {}",
            p.log()
        );
        p
    }

    fn directory(&self) -> String {
        format!("https://127.0.0.1:{}/dir", self.port)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join(format!("pebble-{}.log", self.port)))
            .unwrap_or_default()
    }

    /// Pebble's root (it makes a new one at each start), as a PEM file.
    fn root(&self) -> PathBuf {
        let path = self.dir.join(format!("pebble-root-{}.pem", self.port));
        let out = Command::new("curl")
            .args(["-sS", "--max-time", "10", "--cacert"])
            .arg(self.dir.join("ca.pem"))
            .arg(format!("https://127.0.0.1:{}/roots/0", self.mgmt))
            .arg("-o")
            .arg(&path)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        path
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Pebble {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The names Pebble's validator and curl look up, all at 127.0.0.1.
fn dns(names: &[&str]) -> DnsServer {
    let d = DnsServer::start();
    for n in names {
        d.set(n, &["127.0.0.1"], 60);
    }
    d
}

/// An ultrafast whose plain listener is on `http_port` (where Pebble
/// validates HTTP-01) and whose TLS listener on `tls_port` gets its
/// certificate for `domain` from `directory`, kept in `state`; `ca` signs
/// the directory's HTTPS certificate.
fn ultrafast_on(
    http_port: u16,
    tls_port: u16,
    directory: &str,
    domain: &str,
    challenge: &str,
    state: &Path,
    ca_dir: &Path,
) -> Ultrafast {
    ultrafast_in(
        http_port, tls_port, directory, domain, challenge, state, ca_dir, "", "",
    )
}

/// `ultrafast_on` with `extra` sections (a `[cluster]`) and `acme_extra`
/// settings of the order.
#[allow(clippy::too_many_arguments)]
fn ultrafast_in(
    http_port: u16,
    tls_port: u16,
    directory: &str,
    domain: &str,
    challenge: &str,
    state: &Path,
    ca_dir: &Path,
    extra: &str,
    acme_extra: &str,
) -> Ultrafast {
    let dir = scratch("uf-acme");
    let admin = free_port();
    let text = format!(
        "[server]\nthreads = 1\npid_file = \"{d}/uf.pid\"\nupgrade_sock = \"{d}/uf.sock\"\n\n\
         [admin]\nlisten = \"127.0.0.1:{admin}\"\n\n[log]\naccess_log = \"{d}/access.log\"\n\n\
         [[listeners]]\nname = \"http\"\naddress = \"127.0.0.1:{http_port}\"\n\n\
         [[listeners]]\nname = \"https\"\naddress = \"127.0.0.1:{tls_port}\"\n\
         tls = {{ acme = {{ directory = \"{directory}\", domains = [\"{domain}\"], \
         contact = [\"mailto:ops@example.com\"], challenge = \"{challenge}\", \
         trust_roots = \"{ca}\", state_dir = \"{state}\"{acme_extra} }} }}\n\n\
         [[routes]]\npath = \"/\"\nreturn = {{ status = 200, body = \"hello over acme\\n\" }}\n\n{extra}",
        d = dir.display(),
        ca = ca_dir.join("ca.pem").display(),
        state = state.display()
    );
    let config = dir.join("ultrafast.toml");
    std::fs::write(&config, text).unwrap();
    Ultrafast::spawn(dir, config, http_port, admin, false)
}

/// `GET /` over HTTPS to `domain` at the listener, verified against
/// `root`: (status code or 0, stderr).
fn curl(domain: &str, port: u16, root: &Path) -> (u16, String) {
    let out = Command::new("curl")
        .args([
            "-sS",
            "--max-time",
            "5",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
        ])
        .arg("--cacert")
        .arg(root)
        .arg("--resolve")
        .arg(format!("{domain}:{port}:127.0.0.1"))
        .arg(format!("https://{domain}:{port}/"))
        .output()
        .unwrap();
    let code = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or(0);
    (code, String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The served certificate's serial and issuer (`openssl s_client`).
fn served(domain: &str, port: u16) -> (String, String) {
    let out = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "timeout 10 openssl s_client -connect 127.0.0.1:{port} -servername {domain} </dev/null 2>/dev/null \
             | openssl x509 -noout -serial -issuer"
        ))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let field = |k: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(k))
            .unwrap_or_default()
            .trim()
            .to_string()
    };
    (field("serial="), field("issuer="))
}

fn certs_view(uf: &Ultrafast) -> serde_json::Value {
    get(uf.admin, "/admin/certs", &[]).json()["listeners"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["listener"] == "https")
        .unwrap()["certificates"][0]
        .clone()
}

fn wait_issued(uf: &Ultrafast, pebble: &Pebble, n: f64, limit: Duration) {
    let ok = eventually(limit, || {
        uf.metric("ultrafast_acme_orders_total", &["result=\"issued\""]) >= n
    });
    assert!(
        ok,
        "no certificate issued: {}\n{}\nultrafast: {}\npebble: {}",
        certs_view(uf),
        uf.metrics(),
        uf.stderr(),
        pebble.log()
    );
}

#[test]
fn http_01_issues_serves_and_survives_a_restart_without_a_new_order() {
    let dir = scratch("acme-http");
    let domain = "http01.example.com";
    let names = dns(&[domain]);
    let tls_port = free_port();
    let http_port = free_port();
    let state = dir.join("state");
    let pebble = Pebble::start(&dir, 0, http_port, free_port(), names.addr, 3600, &[]);
    let directory = pebble.directory();
    let mut uf = ultrafast_on(
        http_port, tls_port, &directory, domain, "http-01", &state, &dir,
    );
    wait_issued(&uf, &pebble, 1.0, Duration::from_secs(90));
    let root = pebble.root();
    let (code, err) = curl(domain, tls_port, &root);
    assert_eq!(code, 200, "{err}");
    let (serial, issuer) = served(domain, tls_port);
    assert!(issuer.contains("Pebble"), "issuer {issuer}");
    let view = certs_view(&uf);
    assert_eq!(view["source"], "acme");
    assert_eq!(view["challenge"], "http-01");
    assert!(
        view["issuer"].as_str().unwrap().contains("Pebble"),
        "{view}"
    );
    let left = view["days_left"].as_f64().unwrap();
    assert!(left > 0.0 && left < 0.05, "{view}");
    assert!(view["next_renewal"].as_i64().unwrap() > 0, "{view}");
    assert!(
        uf.metric(
            "ultrafast_acme_certificate_expiry_days",
            &["listener=\"https\""]
        ) > 0.0
    );
    // The account key and the certificate are the owner's alone.
    use std::os::unix::fs::PermissionsExt;
    for f in ["account.json", "certificate.pem"] {
        let mode = std::fs::metadata(state.join(f))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o077, 0, "{f}: {mode:o}");
    }
    // A token of no open order is not answered: the request goes to the
    // routes like any other.
    let r = get(uf.addr, "/.well-known/acme-challenge/not-a-token", &[]);
    assert_eq!(r.text(), "hello over acme\n");

    // A restart serves the stored certificate at once, with the stored
    // account, and orders nothing.
    uf.signal(15);
    uf.wait_exit(Duration::from_secs(15));
    let uf = ultrafast_on(
        http_port, tls_port, &directory, domain, "http-01", &state, &dir,
    );
    let (again, _) = served(domain, tls_port);
    assert_eq!(again, serial);
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        uf.metric("ultrafast_acme_orders_total", &["result=\"issued\""]),
        0.0
    );
    assert!(!uf.stderr().contains("ACME account"), "{}", uf.stderr());
    let (code, err) = curl(domain, tls_port, &root);
    assert_eq!(code, 200, "{err}");
}

#[test]
fn tls_alpn_01_issues_on_the_tls_listener_itself() {
    let dir = scratch("acme-alpn");
    let domain = "alpn.example.com";
    let names = dns(&[domain]);
    let tls_port = free_port();
    // HTTP-01 would be validated on a port nothing listens on: only the
    // TLS-ALPN-01 answer can pass.
    let dead_http = free_port();
    let pebble = Pebble::start(&dir, 0, dead_http, tls_port, names.addr, 3600, &[]);
    let uf = ultrafast_on(
        free_port(),
        tls_port,
        &pebble.directory(),
        domain,
        "tls-alpn-01",
        &dir.join("state"),
        &dir,
    );
    wait_issued(&uf, &pebble, 1.0, Duration::from_secs(90));
    let (code, err) = curl(domain, tls_port, &pebble.root());
    assert_eq!(code, 200, "{err}");
    let (_, issuer) = served(domain, tls_port);
    assert!(issuer.contains("Pebble"), "issuer {issuer}");
    assert_eq!(certs_view(&uf)["challenge"], "tls-alpn-01");
    // Once the order is over, a validator's handshake gets no certificate.
    let out = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "timeout 10 openssl s_client -connect 127.0.0.1:{tls_port} -servername {domain} -alpn acme-tls/1 </dev/null 2>&1"
        ))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains("BEGIN CERTIFICATE"), "{text}");
}

#[test]
fn short_lived_certificates_renew_under_load_and_a_refused_order_keeps_the_old_one() {
    let dir = scratch("acme-renew");
    let domain = "renew.example.com";
    let names = dns(&[domain]);
    let (http_port, tls_port) = (free_port(), free_port());
    // 24 s certificates: renewed at two thirds, 16 s after issuance.
    let mut pebble = Pebble::start(&dir, 0, http_port, tls_port, names.addr, 24, &[]);
    let pebble_port = pebble.port;
    let uf = ultrafast_on(
        http_port,
        tls_port,
        &pebble.directory(),
        domain,
        "http-01",
        &dir.join("state"),
        &dir,
    );
    wait_issued(&uf, &pebble, 1.0, Duration::from_secs(60));
    let root = pebble.root();
    let (first, _) = served(domain, tls_port);

    // Requests in a loop (bounded: at most 60 s) across the renewal.
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let load = {
        let (stop, ok, failed, root) = (stop.clone(), ok.clone(), failed.clone(), root.clone());
        std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(60);
            let mut errors = Vec::new();
            while !stop.load(Ordering::SeqCst) && Instant::now() < deadline {
                match curl(domain, tls_port, &root) {
                    (200, _) => ok.fetch_add(1, Ordering::SeqCst),
                    (code, err) => {
                        errors.push(format!("{code} {err}"));
                        failed.fetch_add(1, Ordering::SeqCst)
                    }
                };
                std::thread::sleep(Duration::from_millis(100));
            }
            errors
        })
    };
    wait_issued(&uf, &pebble, 2.0, Duration::from_secs(40));
    std::thread::sleep(Duration::from_secs(1));
    stop.store(true, Ordering::SeqCst);
    let errors = load.join().unwrap();
    let (second, issuer) = served(domain, tls_port);
    assert_ne!(second, first, "the certificate was not replaced");
    assert!(issuer.contains("Pebble"));
    assert_eq!(failed.load(Ordering::SeqCst), 0, "{errors:?}");
    assert!(
        ok.load(Ordering::SeqCst) > 20,
        "{}",
        ok.load(Ordering::SeqCst)
    );

    // The directory now refuses the name (and has forgotten the account):
    // the next renewal fails, is counted and retried, and the certificate
    // in hand keeps serving.
    pebble.stop();
    let pebble = Pebble::start(
        &dir,
        pebble_port,
        http_port,
        tls_port,
        names.addr,
        24,
        &[domain],
    );
    let refused = eventually(Duration::from_secs(40), || {
        uf.metric("ultrafast_acme_orders_total", &["result=\"failed\""]) >= 1.0
    });
    assert!(refused, "{}\n{}", uf.stderr(), pebble.log());
    let view = certs_view(&uf);
    let err = view["last_error"].as_str().unwrap_or_default().to_string();
    assert!(
        err.contains("rejectedIdentifier") || err.contains("blocked"),
        "{view}"
    );
    assert!(view["failures"].as_u64().unwrap() >= 1, "{view}");
    let (still, _) = served(domain, tls_port);
    assert_eq!(still, second, "a refused order replaced the certificate");
    let (code, err) = curl(domain, tls_port, &root);
    assert_eq!(code, 200, "{err}");
    assert!(uf.stderr().contains("keeping the current certificate"));
}

#[test]
fn check_refuses_bad_acme_settings_with_their_fields() {
    let dir = scratch("acme-check");
    let text = check_refused(
        &dir,
        "[[listeners]]\naddress = \"127.0.0.1:1\"\n\
         tls = { acme = { directory = \"http://ca.example/dir\", domains = [\"*.example.com\", \"nodot\"], \
         contact = [\"ops@example.com\"], challenge = \"dns-01\", trust_roots = \"/nonexistent.pem\" } }\n\
         [[routes]]\npath = \"/\"\nreturn = { status = 200 }\n",
    );
    for field in [
        "listeners[0].tls.acme.directory",
        "listeners[0].tls.acme.domains[0]",
        "listeners[0].tls.acme.domains[1]",
        "listeners[0].tls.acme.contact[0]",
        "listeners[0].tls.acme.challenge",
        "listeners[0].tls.acme.trust_roots",
        "listeners[0].tls.acme.state_dir",
    ] {
        assert!(text.contains(field), "{field} not named:\n{text}");
    }
    assert!(text.contains("bad.toml:"), "{text}");
    // HTTP-01 needs a plain listener to be answered on.
    let text = check_refused(
        &dir,
        "[[listeners]]\naddress = \"127.0.0.1:1\"\n\
         tls = { acme = { directory = \"https://ca.example/dir\", domains = [\"a.example.com\"], state_dir = \"/tmp/x\" } }\n\
         [[routes]]\npath = \"/\"\nreturn = { status = 200 }\n",
    );
    assert!(
        text.contains("listeners[0].tls.acme.challenge") && text.contains("plain listener"),
        "{text}"
    );
}

#[test]
fn a_cluster_orders_once_and_every_instance_serves_the_result() {
    let dir = scratch("acme-cluster");
    let domain = "cluster.example.com";
    let names = dns(&[domain]);
    let redis = common::redis::Redis::start();
    let cluster = format!(
        "[cluster]\nredis = \"{}\"\nprefix = \"acme-test:\"\ntimeout_ms = 500\nheartbeat_ms = 100\n",
        redis.url()
    );
    // Pebble validates HTTP-01 on the first instance's plain listener
    // only: an order the second places is answered there through the
    // store.
    let (http_a, tls_a, http_b, tls_b) = (free_port(), free_port(), free_port(), free_port());
    let pebble = Pebble::start(&dir, 0, http_a, free_port(), names.addr, 3600, &[]);
    // The instances' shared secret: what goes through the store is sealed.
    let key_file = dir.join("acme-shared.key");
    std::fs::write(&key_file, "ab".repeat(32)).unwrap();
    std::fs::set_permissions(
        &key_file,
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    // And the roots Pebble issues under: a shared certificate must chain
    // to them.
    let issuer = pebble.root();
    let sealed = format!(
        ", shared_key_file = \"{}\", issuer_roots = \"{}\"",
        key_file.display(),
        issuer.display()
    );
    let start = |http, tls, state: &str| {
        ultrafast_in(
            http,
            tls,
            &pebble.directory(),
            domain,
            "http-01",
            &dir.join(state),
            &dir,
            &cluster,
            &sealed,
        )
    };
    let a = start(http_a, tls_a, "state-a");
    let b = start(http_b, tls_b, "state-b");
    let both = |result: &str| {
        let filter = format!("result=\"{result}\"");
        a.metric("ultrafast_acme_orders_total", &[&filter])
            + b.metric("ultrafast_acme_orders_total", &[&filter])
    };
    let settled = eventually(Duration::from_secs(90), || {
        both("issued") >= 1.0 && both("shared") >= 1.0
    });
    assert!(
        settled,
        "issued {} shared {}\na: {}\nb: {}\npebble: {}",
        both("issued"),
        both("shared"),
        a.stderr(),
        b.stderr(),
        pebble.log()
    );
    assert_eq!(both("issued"), 1.0, "one instance orders");
    assert_eq!(both("failed"), 0.0);
    let (sa, issuer) = served(domain, tls_a);
    let (sb, _) = served(domain, tls_b);
    assert_eq!(sa, sb, "both serve the one certificate");
    assert!(issuer.contains("Pebble"));
    let root = pebble.root();
    for port in [tls_a, tls_b] {
        let (code, err) = curl(domain, port, &root);
        assert_eq!(code, 200, "{err}");
    }
    // A token another instance put in the store is answered here.
    let set = Command::new("redis-cli")
        .args(["-p", &redis.port.to_string(), "SET"])
        .args([
            "acme-test:kv:acme:http01:shared-token_1",
            "shared-token_1.thumb",
        ])
        .output()
        .unwrap();
    assert!(set.status.success(), "{set:?}");
    let r = get(
        b.addr,
        "/.well-known/acme-challenge/shared-token_1",
        &[("Host", domain)],
    );
    assert_eq!((r.status, r.text().as_str()), (200, "shared-token_1.thumb"));
    // Only for a name some listener orders by HTTP-01: another Host is an
    // ordinary request (the route's answer), and asks nothing of the store.
    let r = get(
        b.addr,
        "/.well-known/acme-challenge/shared-token_1",
        &[("Host", "other.example")],
    );
    assert_eq!(r.text(), "hello over acme\n");
    // The store holds the chain and key sealed: neither is readable there.
    let stored = Command::new("redis-cli")
        .args(["-p", &redis.port.to_string(), "GET"])
        .arg(format!("acme-test:kv:acme:cert:{domain}"))
        .output()
        .unwrap();
    let stored = String::from_utf8_lossy(&stored.stdout).into_owned();
    assert!(stored.len() > 1000, "{stored}");
    assert!(
        !stored.contains("PRIVATE KEY") && !stored.contains("BEGIN"),
        "{stored}"
    );
}
