//! Assembles the process: Pingora server settings from the config, the
//! traffic service, the admin service, background services, and the drain
//! watcher that ends the process as soon as a graceful shutdown or upgrade
//! has no request left in flight.

use crate::accesslog::AccessLog;
use crate::admin::{AdminApp, Readiness};
use crate::config;
use crate::edge::acme::Issuer;
use crate::edge::certs::{CertStore, CertWatcher, FullHandshakes, SniResolver};
use crate::edge::conn::Guarded;
use crate::edge::listener::{self, Endpoint, Handshake, ListenerService, TlsHandshake};
use crate::edge::ticket::RotatingTicketer;
use crate::edge::tls::{server_config, TlsBuild};
use crate::metrics::Metrics;
use crate::proxy::EdgeProxy;
use crate::runtime::reload::{DnsRefresher, Manager, SighupService, WatchService};
use crate::runtime::{self, Shared, Snapshot as Config};
use arc_swap::ArcSwap;
use pingora::apps::http_app::HttpServer;
use pingora::apps::HttpServerOptions;
use pingora::listeners::tls::Acceptor;
use pingora::server::configuration::{Opt, ServerConf};
use pingora::server::{ExecutionPhase, Server};
use pingora::services::background::background_service;
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Most decoded bytes of an HTTP/2 header list (as Pingora's HTTP/1
/// parser reads at most 1 MiB of a head).
const H2_HEADER_LIST_MAX: u32 = 1 << 20;

/// Options of `ultrafast serve`.
#[derive(Debug, Clone, Default)]
pub struct ServeOptions {
    /// Take the listening sockets over from a running instance.
    pub upgrade: bool,
}

fn server_conf(cfg: &Config) -> ServerConf {
    let s = &cfg.server;
    ServerConf {
        threads: s.threads,
        work_stealing: s.work_stealing,
        pid_file: s.pid_file.clone(),
        upgrade_sock: s.upgrade_sock.clone(),
        // One second past ours: the drain watcher ends the process at the
        // configured grace period and logs what it abandons, before
        // Pingora's own exit can race it.
        grace_period_seconds: Some(s.grace_period_s + 1),
        graceful_shutdown_timeout_seconds: Some(s.shutdown_timeout_s),
        upstream_keepalive_pool_size: s.keepalive_pool_size,
        // Our own retry policy caps tries per pool (at most 10).
        max_retries: 10,
        // Pingora's fast timers live until their deadline even when the
        // read they guarded ended long before (a 60 s body or send timeout
        // per request); under load they pile up and pin allocator pages
        // well after it. Tokio's timer frees a cancelled entry at once, so
        // every timeout of a second or more goes there. It also keeps
        // Pingora's timer thread from starting (the first upstream
        // connect's 1 s timeout started it): once started, it woke every
        // 10 ms for the life of the process, and such a ticker costs a
        // request sharing its CPU tens of microseconds on these VMs
        // (benches/RESULTS.md section 15). Only a timeout set below a
        // second still uses the fast timer.
        fast_timeout_to_tokio_threshold_seconds: Some(0),
        ..ServerConf::default()
    }
}

/// Load the config and run until shut down. Returns only on a startup error.
pub fn serve(path: &Path, opts: ServeOptions) -> anyhow::Result<()> {
    let metrics = Arc::new(Metrics::new());
    let cfg = match runtime::load(path, &metrics) {
        Ok(c) => c,
        Err(errs) => {
            for e in &errs {
                eprintln!("{e}");
            }
            anyhow::bail!("{} error(s) in {}", errs.len(), path.display());
        }
    };
    let t = &cfg.file.tracing;
    if !t.otlp_endpoint.is_empty() {
        crate::otel::init(&t.otlp_endpoint, &t.service_name).map_err(anyhow::Error::msg)?;
    }
    if let Some(c) = &cfg.file.cluster {
        crate::cluster::init(c, &metrics.cluster).map_err(anyhow::Error::msg)?;
    }
    let conf = server_conf(&cfg);
    let pingora_opt = Opt {
        upgrade: opts.upgrade,
        ..Opt::default()
    };
    let log = AccessLog::start(
        &cfg.log_target,
        cfg.log_format,
        metrics.access_log_dropped.clone(),
    )?;
    let front = Arc::new(crate::proxy::Front {
        engines: crate::inference::Engines::start(&cfg.models, &metrics.inference),
        jobs: crate::inference::jobs::Store::new(
            cfg.file.inference.async_max_entries,
            cfg.file.inference.async_max_bytes,
            Duration::from_secs(cfg.file.inference.async_ttl_s),
        ),
        watchdog: Default::default(),
        tokenizing: Default::default(),
    });
    if let Some(c) = crate::cluster::get() {
        // A `DELETE` taken by another instance reaches the job here.
        let weak = Arc::downgrade(&front);
        c.on_cancel(Box::new(move |id| {
            if let Some(job) = weak.upgrade().and_then(|f| f.jobs.get(id)) {
                job.cancel();
            }
        }));
    }
    let listeners = cfg.listeners.clone();
    let threads = cfg.server.threads;
    let admin_listen = cfg.admin_listen.clone();
    let shared: Shared = Arc::new(ArcSwap::from_pointee(cfg));
    let readiness = Arc::new(Readiness::new("starting"));
    readiness.watch_models(front.clone());
    let inflight = Arc::new(AtomicUsize::new(0));

    crate::runtime::reload::catch_early_sighup();
    let mut sockets = bind_listeners(&listeners, admin_listen.as_deref(), opts.upgrade)?;

    let pid_file = conf.pid_file.clone();
    let mut server = Server::new_with_opt_and_conf(pingora_opt, conf);
    server.bootstrap();
    // Written once the listening sockets are ours (an upgrade has received
    // them), so the old process's pid stays readable until it is told to go.
    write_pid_file(&pid_file);

    let edge = || {
        EdgeProxy::new(
            shared.clone(),
            metrics.clone(),
            log.clone(),
            inflight.clone(),
            front.clone(),
        )
    };
    // Every traffic listener's connections pass one guard (one cap for all).
    let open = Arc::new(AtomicUsize::new(0));
    let mut endpoints = Vec::new();
    let mut watched = Vec::new();
    let mut issuers = Vec::new();
    let mut h3_endpoints = Vec::new();
    let mut udp = bind_udp(&listeners)?;
    for l in &listeners {
        let mut app = pingora::proxy::http_proxy(&server.configuration, edge());
        let mut options = HttpServerOptions::default();
        // h2c only where configured: elsewhere an HTTP/1 request is never
        // held waiting for a preface.
        options.h2c = l.h2c;
        // CONNECT reaches our request filter, which refuses it through the
        // response policy (Pingora's own 405 would bypass it).
        options.allow_connect_method_proxying = true;
        app.server_options = Some(options);
        // Pingora's HTTP/2 list limit (64 KiB) answers a larger head with a
        // connection error, or a bare 431 past our policy: decode up to the
        // 1 MiB its HTTP/1 parser reads, so that our filter refuses it
        // (`max_header_bytes`) with the 431 every other oversized head gets.
        let mut h2 = pingora::protocols::http::v2::server::default_h2_options();
        h2.max_header_list_size(H2_HEADER_LIST_MAX);
        app.h2_options = Some(h2);
        let app = Arc::new(
            Guarded::new(
                app,
                shared.clone(),
                open.clone(),
                metrics.edge.conns.clone(),
            )
            .with_h2c(l.h2c),
        );
        let handshake = match &l.tls {
            None => Handshake::Plain,
            Some(tls) => {
                let store =
                    CertStore::load(&tls.certs, &metrics.edge.certs).map_err(anyhow::Error::msg)?;
                let full = FullHandshakes(metrics.edge.tls.handshakes.with_label_values(&["full"]));
                let resolver = Arc::new(SniResolver::new(
                    store,
                    metrics.edge.certs.clone(),
                    Some(full),
                ));
                let ticketer = match tls.tickets {
                    true => Some(Arc::new(
                        RotatingTicketer::new(
                            tls.ticket_secret.clone(),
                            tls.rotation,
                            metrics.edge.tickets(),
                        )
                        .map_err(anyhow::Error::msg)?,
                    )),
                    false => None,
                };
                let build_ticketer = ticketer.clone();
                let build = TlsBuild {
                    resolver: resolver.clone(),
                    ticketer,
                    cache_size: tls.cache_size,
                    h2: tls.h2,
                    acme_alpn: tls
                        .acme
                        .as_ref()
                        .is_some_and(|a| a.challenge == config::AcmeChallenge::TlsAlpn01),
                };
                match &tls.acme {
                    Some(spec) => issuers.push(Issuer::new(
                        l.name.clone(),
                        spec.clone(),
                        resolver.clone(),
                        tls.certs.clone(),
                        metrics.edge.acme.clone(),
                    )),
                    None => crate::edge::acme::register(&l.name, &tls.certs, None),
                }
                if let Some(h3) = &tls.http3 {
                    let config = crate::edge::h3::server_config(
                        resolver.clone(),
                        build_ticketer.clone(),
                        tls.cache_size,
                        h3,
                    )
                    .map_err(anyhow::Error::msg)?;
                    let socket = udp.remove(&l.address).ok_or_else(|| {
                        anyhow::anyhow!("listener `{}`: UDP socket not bound", l.name)
                    })?;
                    h3_endpoints.push(crate::edge::h3::H3Endpoint {
                        name: l.name.clone(),
                        socket,
                        config,
                        settings: h3.clone(),
                        handshake_timeout: tls.handshake_timeout,
                        header_timeout: match l.deadlines.client_header_timeout_ms {
                            0 => None,
                            ms => Some(std::time::Duration::from_millis(ms)),
                        },
                        app: app.inner().clone(),
                    });
                }
                watched.push((resolver, tls.certs.clone()));
                Handshake::Tls(TlsHandshake {
                    acceptor: Acceptor::from_server_config(server_config(build, &metrics.edge.tls)),
                    timeout: tls.handshake_timeout,
                    metrics: metrics.edge.tls.clone(),
                })
            }
        };
        let proxy_protocol = l.proxy_protocol.clone().map(|spec| {
            Arc::new(crate::edge::proxy_protocol::Policy {
                spec,
                results: metrics.edge.proxy_protocol.clone(),
            })
        });
        endpoints.push(Endpoint {
            name: l.name.clone(),
            address: l.address.clone(),
            socket: sockets.remove(&l.address).flatten(),
            handshake,
            proxy_protocol,
            app,
        });
    }
    server.add_service(ListenerService::new(
        "ultrafast".to_string(),
        endpoints,
        threads,
    ));
    if !h3_endpoints.is_empty() {
        server.add_service(crate::edge::h3::H3Service::new(
            h3_endpoints,
            threads,
            metrics.edge.h3.clone(),
        ));
    }
    if !watched.is_empty() {
        let watcher = CertWatcher::new(watched, metrics.edge.cert_reloads.clone());
        server.add_service(background_service("cert watch", watcher));
    }
    for issuer in issuers {
        server.add_service(background_service("acme", issuer));
    }

    let manager = Arc::new(
        Manager::new(path.to_path_buf(), metrics.clone(), shared.clone()).with_front(front.clone()),
    );
    if let Some(addr) = admin_listen {
        let app = AdminApp::new(metrics.clone(), readiness.clone(), manager.clone())
            .with_front(front.clone())
            .with_status_page();
        let admin = Endpoint {
            name: "admin".to_string(),
            socket: sockets.remove(&addr).flatten(),
            address: addr,
            handshake: Handshake::Plain,
            proxy_protocol: None,
            app: Arc::new(HttpServer::new_app(app)),
        };
        server.add_service(ListenerService::new("admin".to_string(), vec![admin], 1));
    }
    server.add_service(background_service(
        "health checks",
        crate::runtime::loops::HealthChecker::new(shared.clone()),
    ));
    server.add_service(background_service(
        "load scrapes",
        crate::runtime::loops::LoadScraper::new(shared.clone()),
    ));
    server.add_service(background_service("sighup", SighupService(manager.clone())));
    server.add_service(background_service(
        "config watch",
        WatchService(manager.clone()),
    ));
    server.add_service(background_service(
        "api key watch",
        crate::runtime::loops::KeyWatchService(shared.clone()),
    ));
    let refresher = DnsRefresher {
        shared: shared.clone(),
        metrics: metrics.clone(),
    };
    server.add_service(background_service("dns refresh", refresher));
    server.add_service(background_service(
        "slo watchdog",
        crate::runtime::loops::WatchdogService {
            shared: shared.clone(),
            front: front.clone(),
            metrics: metrics.clone(),
        },
    ));

    let quiet = {
        use crate::drain::{running, Kind};
        let inflight = inflight.clone();
        move || {
            inflight.load(Ordering::Relaxed) == 0
                && running(Kind::AsyncJob) == 0
                && running(Kind::UpstreamStream) == 0
        }
    };
    server.add_service(background_service(
        "memory release",
        crate::alloc::Releaser::new(quiet),
    ));
    let grace = Duration::from_secs(shared.load().server.grace_period_s);
    spawn_drain_watcher(&server, inflight, log, pid_file, grace);
    readiness.set_ready();
    log::info!(
        "ultrafast {} serving {} listener(s) from {}",
        env!("CARGO_PKG_VERSION"),
        listeners.len(),
        path.display()
    );
    server.run_forever()
}

/// Bind the UDP socket of every HTTP/3 listener before serving (a port
/// that cannot be bound fails `serve` with its address, as for TCP).
fn bind_udp(
    listeners: &[config::Listener],
) -> anyhow::Result<HashMap<String, std::net::UdpSocket>> {
    let mut out = HashMap::new();
    for l in listeners {
        if l.tls.as_ref().is_some_and(|t| t.http3.is_some()) {
            let s = crate::edge::h3::bind(&l.address).map_err(|e| {
                anyhow::anyhow!("listener `{}` cannot bind UDP {}: {e}", l.name, l.address)
            })?;
            out.insert(l.address.clone(), s);
        }
    }
    Ok(out)
}

/// Bind every listener (traffic and admin) before serving, so one that
/// cannot be bound fails `serve` with its address and cause instead of
/// leaving a process that looks ready without it. Under `--upgrade` an
/// address in use is taken to be the old process's, which hands its socket
/// over (`None` here); any other error fails at once, before the old
/// process is told to go. An address in use that the old process then does
/// not hand over ends the new process with the address (the listener
/// service's start).
fn bind_listeners(
    listeners: &[config::Listener],
    admin: Option<&str>,
    upgrade: bool,
) -> anyhow::Result<HashMap<String, Option<std::net::TcpListener>>> {
    let mut sockets = HashMap::new();
    let all = listeners
        .iter()
        .map(|l| (l.name.as_str(), l.address.as_str()))
        .chain(admin.map(|a| ("admin", a)));
    for (name, addr) in all {
        let sock = match listener::bind(addr) {
            Ok(s) => Some(s),
            Err(e) if upgrade && e.kind() == std::io::ErrorKind::AddrInUse => None,
            Err(e) => anyhow::bail!("listener `{name}` cannot bind {addr}: {e}"),
        };
        sockets.insert(addr.to_string(), sock);
    }
    Ok(sockets)
}

/// Pingora sleeps the whole grace period even when nothing is in flight;
/// end the process as soon as the drain is actually complete.
fn write_pid_file(path: &str) {
    if path.is_empty() {
        return;
    }
    if let Err(e) = std::fs::write(path, format!("{}\n", std::process::id())) {
        log::error!("cannot write the pid file {path}: {e}");
    }
}

/// Remove the pid file if it is still ours (after an upgrade it names the
/// new process).
fn remove_pid_file(path: &str) {
    let mine =
        std::fs::read_to_string(path).is_ok_and(|s| s.trim() == std::process::id().to_string());
    if mine {
        let _ = std::fs::remove_file(path);
    }
}

fn spawn_drain_watcher(
    server: &Server,
    inflight: Arc<AtomicUsize>,
    log: AccessLog,
    pid_file: String,
    grace: Duration,
) {
    use crate::drain::{running, Kind};
    let mut phases = server.watch_execution_phase();
    let _ = std::thread::Builder::new()
        .name("drain-watch".into())
        .spawn(move || {
            while let Ok(p) = phases.blocking_recv() {
                if matches!(p, ExecutionPhase::ShutdownGracePeriod) {
                    break;
                }
            }
            // Leaving: the pid no longer names a serving process.
            remove_pid_file(&pid_file);
            // Require a short quiet period so a request that was just accepted
            // (but has not reached the proxy yet) is not cut. Async jobs and
            // upstream streams are waited for too, up to the grace period.
            let deadline = std::time::Instant::now() + grace;
            let busy = || {
                let w = (
                    inflight.load(Ordering::Relaxed),
                    running(Kind::AsyncJob),
                    running(Kind::UpstreamStream),
                );
                (w != (0, 0, 0)).then_some(w)
            };
            let mut quiet = 0;
            while quiet < 10 {
                // Pingora ends the grace period itself (then stops the
                // runtimes and exits): whichever comes first, say what is
                // left behind.
                let over = matches!(
                    phases.try_recv(),
                    Ok(ExecutionPhase::ShutdownRuntimes | ExecutionPhase::Terminated)
                );
                if over || std::time::Instant::now() >= deadline {
                    if let Some((r, j, s)) = busy() {
                        log::warn!(
                            "grace period of {}s over: abandoning {r} request(s), {j} async job(s) and {s} upstream stream(s) in flight",
                            grace.as_secs()
                        );
                    }
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
                quiet = if busy().is_none() { quiet + 1 } else { 0 };
            }
            log::info!("drained: nothing in flight, exiting");
            log.flush();
            std::process::exit(0);
        });
}
