//! h3-load: HTTP/3 load as h2load makes HTTP/2 load, so the two protocols
//! meet the server alike: one connection, `-m` requests in flight (a new
//! one as each ends), one thread, GETs of one URL. quinn and h3 (the
//! crates the server uses) with rustls trusting one CA.
//!
//! usage: h3-load --addr 127.0.0.1:8443 --ca ca.pem --name localhost
//!        --path /fixed -n 10000 -m 16
//! Prints `{"ok": N, "failed": N, "seconds": S}`.

#[path = "bench_util.rs"]
#[allow(dead_code)] // its summary() is the decision benches'
mod bench_util;
use bench_util::arg;
use bytes::Buf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

struct Args {
    addr: std::net::SocketAddr,
    ca: String,
    name: String,
    path: String,
    n: u64,
    m: u64,
}

fn args() -> Result<Args, String> {
    let get = |k: &str| arg(k).ok_or(format!("missing {k}"));
    Ok(Args {
        addr: get("--addr")?.parse().map_err(|e| format!("--addr: {e}"))?,
        ca: get("--ca")?,
        name: arg("--name").unwrap_or_else(|| "localhost".into()),
        path: arg("--path").unwrap_or_else(|| "/".into()),
        n: get("-n")?.parse().map_err(|e| format!("-n: {e}"))?,
        m: arg("-m")
            .unwrap_or_else(|| "16".into())
            .parse()
            .map_err(|e| format!("-m: {e}"))?,
    })
}

fn client_config(ca: &str) -> Result<quinn::ClientConfig, String> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls::pki_types::CertificateDer::pem_file_iter(ca).map_err(|e| e.to_string())? {
        roots
            .add(c.map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    tls.alpn_protocols = vec![b"h3".to_vec()];
    let quic = quinn::crypto::rustls::QuicClientConfig::try_from(tls).map_err(|e| e.to_string())?;
    Ok(quinn::ClientConfig::new(Arc::new(quic)))
}

async fn run(a: Args) -> Result<(u64, u64, f64), String> {
    let mut ep = quinn::Endpoint::client("0.0.0.0:0".parse().map_err(|e| format!("{e}"))?)
        .map_err(|e| e.to_string())?;
    ep.set_default_client_config(client_config(&a.ca)?);
    let conn = ep
        .connect(a.addr, &a.name)
        .map_err(|e| e.to_string())?
        .await
        .map_err(|e| e.to_string())?;
    let (mut driver, send) = h3::client::new(h3_quinn::Connection::new(conn))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        let _ = std::future::poll_fn(|cx| driver.poll_close(cx)).await;
    });
    let uri: http::Uri = format!("https://{}:{}{}", a.name, a.addr.port(), a.path)
        .parse()
        .map_err(|e| format!("{e}"))?;
    let left = Arc::new(AtomicU64::new(a.n));
    let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let t0 = Instant::now();
    let workers: Vec<_> = (0..a.m)
        .map(|_| {
            let (mut send, uri) = (send.clone(), uri.clone());
            let (left, ok, failed) = (left.clone(), ok.clone(), failed.clone());
            tokio::spawn(async move {
                while left
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                    .is_ok()
                {
                    let one = async {
                        let req = http::Request::get(uri.clone()).body(()).map_err(|_| ())?;
                        let mut s = send.send_request(req).await.map_err(|_| ())?;
                        s.finish().await.map_err(|_| ())?;
                        let resp = s.recv_response().await.map_err(|_| ())?;
                        while let Some(mut d) = s.recv_data().await.map_err(|_| ())? {
                            d.advance(d.remaining());
                        }
                        Ok::<_, ()>(resp.status().is_success())
                    };
                    match one.await {
                        Ok(true) => ok.fetch_add(1, Ordering::Relaxed),
                        _ => failed.fetch_add(1, Ordering::Relaxed),
                    };
                }
            })
        })
        .collect();
    for w in workers {
        let _ = w.await;
    }
    let secs = t0.elapsed().as_secs_f64();
    drop(send);
    ep.close(0u32.into(), b"done");
    ep.wait_idle().await;
    Ok((
        ok.load(Ordering::Relaxed),
        failed.load(Ordering::Relaxed),
        secs,
    ))
}

fn main() {
    let a = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("h3-load: {e}");
            std::process::exit(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("h3-load: {e}");
            std::process::exit(2);
        }
    };
    match rt.block_on(run(a)) {
        Ok((ok, failed, s)) => {
            println!("{{\"ok\": {ok}, \"failed\": {failed}, \"seconds\": {s:.3}}}")
        }
        Err(e) => {
            eprintln!("h3-load: {e}");
            std::process::exit(1);
        }
    }
}
