//! A bare Pingora reverse proxy (only `upstream_peer`): the baseline that
//! shows what ultrafast's own per-request work costs on top of Pingora.
//!
//! Usage: `bare-pingora LISTEN UPSTREAM THREADS [ACCESS_LOG]`. It uses the
//! same allocator as ultrafast's default build (jemalloc, see
//! `proxy/src/alloc.rs`) and the same keepalive defaults, so the difference
//! is routing, metrics, logging and header work.
//!
//! With `ACCESS_LOG`, it does the least that ultrafast's plain proxy path
//! must do, written the direct way on Pingora's API: `X-Forwarded-For`,
//! `X-Forwarded-Proto` and a new `X-Request-Id` on the upstream request, the
//! id on the response, and one JSON line per request into a per-thread
//! 32 KiB buffer written to the file when full. It measures what those
//! features cost on Pingora's filter API by themselves, with nothing else
//! of ultrafast's (benches/RESULTS.md section 13).

use async_trait::async_trait;
use pingora::prelude::*;
use pingora::server::configuration::{Opt, ServerConf};
use std::cell::{Cell, RefCell};
use std::fmt::Write as _;
use std::io::Write as _;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

struct Bare {
    upstream: SocketAddr,
    /// The access log, when the features are on.
    log: Option<Mutex<std::fs::File>>,
}

/// What the featured mode keeps per request.
struct Ctx {
    start: Instant,
    id: http::HeaderValue,
}

thread_local! {
    static SEED: Cell<u64> = Cell::new(0x9E37_79B9_7F4A_7C15 ^ std::process::id() as u64);
    static LINES: RefCell<String> = RefCell::new(String::with_capacity(32 * 1024));
}

/// 32 hex digits from a per-thread xorshift: the cheapest id that looks
/// like ultrafast's (a real one would be random; this is a floor).
fn request_id() -> http::HeaderValue {
    let mut x = SEED.with(Cell::get);
    let mut out = [0u8; 32];
    for half in out.chunks_mut(16) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        for (i, b) in half.iter_mut().enumerate() {
            *b = b"0123456789abcdef"[((x >> (i * 4)) & 15) as usize];
        }
    }
    SEED.with(|s| s.set(x));
    http::HeaderValue::from_bytes(&out).unwrap_or(http::HeaderValue::from_static("-"))
}

#[async_trait]
impl ProxyHttp for Bare {
    type CTX = Option<Ctx>;
    fn new_ctx(&self) -> Option<Ctx> {
        self.log.as_ref().map(|_| Ctx {
            start: Instant::now(),
            id: request_id(),
        })
    }
    async fn upstream_peer(&self, _s: &mut Session, _c: &mut Self::CTX) -> Result<Box<HttpPeer>> {
        Ok(Box::new(HttpPeer::new(self.upstream, false, String::new())))
    }
    async fn upstream_request_filter(
        &self,
        s: &mut Session,
        req: &mut RequestHeader,
        ctx: &mut Self::CTX,
    ) -> Result<()> {
        let Some(c) = ctx else { return Ok(()) };
        if let Some(ip) = s.client_addr().and_then(|a| a.as_inet()) {
            let v = http::HeaderValue::from_str(&ip.ip().to_string()).ok();
            if let Some(v) = v {
                req.insert_header("x-forwarded-for", v)?;
            }
        }
        req.insert_header("x-forwarded-proto", "http")?;
        req.insert_header("x-request-id", c.id.clone())
    }
    async fn response_filter(
        &self,
        _s: &mut Session,
        resp: &mut ResponseHeader,
        ctx: &mut Self::CTX,
    ) -> Result<()> {
        if let Some(c) = ctx {
            resp.insert_header("x-request-id", c.id.clone())?;
        }
        Ok(())
    }
    async fn logging(&self, s: &mut Session, _e: Option<&pingora::Error>, ctx: &mut Self::CTX) {
        let (Some(c), Some(file)) = (ctx, &self.log) else {
            return;
        };
        let req = s.req_header();
        let status = s.response_written().map_or(0, |r| r.status.as_u16());
        let client = s.client_addr().and_then(|a| a.as_inet()).map(|a| a.ip());
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        LINES.with(|l| {
            let mut l = l.borrow_mut();
            let _ = writeln!(
                l,
                "{{\"time\":{now},\"client\":\"{}\",\"method\":\"{}\",\"uri\":\"{}\",\
                 \"status\":{status},\"bytes\":{},\"total_us\":{},\"upstream\":\"{}\",\
                 \"request_id\":\"{}\"}}",
                client.map(|c| c.to_string()).unwrap_or_default(),
                req.method.as_str(),
                req.uri.path(),
                s.body_bytes_sent(),
                c.start.elapsed().as_micros(),
                self.upstream,
                c.id.to_str().unwrap_or("-"),
            );
            if l.len() >= 32 * 1024 - 512 {
                if let Ok(mut f) = file.lock() {
                    let _ = f.write_all(l.as_bytes());
                }
                l.clear();
            }
        });
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if !(4..=5).contains(&args.len()) {
        eprintln!("usage: bare-pingora LISTEN UPSTREAM THREADS [ACCESS_LOG]");
        std::process::exit(2);
    }
    let Ok(upstream) = args[2].parse::<SocketAddr>() else {
        eprintln!("bad upstream address {}", args[2]);
        std::process::exit(2);
    };
    let threads = args[3].parse().unwrap_or(1);
    let log = match args.get(4) {
        None => None,
        Some(path) => match std::fs::File::create(path) {
            Ok(f) => Some(Mutex::new(f)),
            Err(e) => {
                eprintln!("cannot open {path}: {e}");
                std::process::exit(2);
            }
        },
    };
    let conf = ServerConf {
        threads,
        pid_file: format!("/tmp/bare-pingora-{}.pid", std::process::id()),
        upgrade_sock: format!("/tmp/bare-pingora-{}.sock", std::process::id()),
        grace_period_seconds: Some(0),
        graceful_shutdown_timeout_seconds: Some(0),
        ..ServerConf::default()
    };
    let mut server = Server::new_with_opt_and_conf(Opt::default(), conf);
    server.bootstrap();
    let mut svc = http_proxy_service(&server.configuration, Bare { upstream, log });
    svc.add_tcp(&args[1]);
    server.add_service(svc);
    server.run_forever();
}
