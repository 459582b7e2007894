//! A bare Pingora reverse proxy (only `upstream_peer`): the baseline that
//! shows what ultrafast's own per-request work costs on top of Pingora.
//!
//! Usage: `bare-pingora LISTEN UPSTREAM THREADS`. It uses the same allocator
//! as ultrafast's default build (jemalloc, see `proxy/src/alloc.rs`) and the
//! same keepalive defaults, so the difference is routing, metrics, logging
//! and header work.

use async_trait::async_trait;
use pingora::prelude::*;
use pingora::server::configuration::{Opt, ServerConf};
use std::net::SocketAddr;

#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

struct Bare {
    upstream: SocketAddr,
}

#[async_trait]
impl ProxyHttp for Bare {
    type CTX = ();
    fn new_ctx(&self) {}
    async fn upstream_peer(&self, _s: &mut Session, _c: &mut ()) -> Result<Box<HttpPeer>> {
        Ok(Box::new(HttpPeer::new(self.upstream, false, String::new())))
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 4 {
        eprintln!("usage: bare-pingora LISTEN UPSTREAM THREADS");
        std::process::exit(2);
    }
    let Ok(upstream) = args[2].parse::<SocketAddr>() else {
        eprintln!("bad upstream address {}", args[2]);
        std::process::exit(2);
    };
    let threads = args[3].parse().unwrap_or(1);
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
    let mut svc = http_proxy_service(&server.configuration, Bare { upstream });
    svc.add_tcp(&args[1]);
    server.add_service(svc);
    server.run_forever();
}
