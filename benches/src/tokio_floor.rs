//! The least a Tokio program can do to pass an SSE completion through: the
//! floor under any proxy built on Tokio, for `sse_ttft_split.py --floor`.
//!
//! Usage: `tokio-floor LISTEN UPSTREAM`. One worker thread (as the
//! benchmarks run ultrafast and the bare Pingora proxy). Per connection: read
//! a head and its `Content-Length` body, write them unchanged on an idle
//! upstream connection (or a new one), copy the response back as it comes
//! until the chunked body's last chunk, and keep the upstream connection. No
//! header is parsed beyond that, nothing is checked: it is a measuring
//! stick, not a proxy.
//!
//! With `FLOOR_TICK_MS=N` a thread beside it sleeps N ms in a loop, the
//! shape of Pingora's timer thread (benches/RESULTS.md section 15).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

type Idle = Arc<Mutex<Vec<TcpStream>>>;

/// The value of `Content-Length` in `head`, 0 without one.
fn content_length(head: &[u8]) -> usize {
    let text = String::from_utf8_lossy(head);
    text.lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())
                .flatten()
        })
        .unwrap_or(0)
}

/// Append what `s` has to `buf`; false at its end.
async fn read_more(s: &mut TcpStream, buf: &mut Vec<u8>) -> std::io::Result<bool> {
    let mut chunk = [0u8; 4096];
    let n = s.read(&mut chunk).await?;
    buf.extend_from_slice(&chunk[..n]);
    Ok(n > 0)
}

async fn serve(mut client: TcpStream, upstream: SocketAddr, idle: Idle) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(16 * 1024);
    loop {
        buf.clear();
        let end = loop {
            if let Some(i) = memchr::memmem::find(&buf, b"\r\n\r\n") {
                break i + 4;
            }
            if !read_more(&mut client, &mut buf).await? {
                return Ok(());
            }
        };
        let want = end + content_length(&buf[..end]);
        while buf.len() < want {
            if !read_more(&mut client, &mut buf).await? {
                return Ok(());
            }
        }
        let pooled = idle.lock().ok().and_then(|mut v| v.pop());
        let mut up = match pooled {
            Some(s) => s,
            None => {
                let s = TcpStream::connect(upstream).await?;
                s.set_nodelay(true)?;
                s
            }
        };
        up.write_all(&buf[..want]).await?;
        let mut chunk = vec![0u8; 16 * 1024];
        let mut tail = Vec::new();
        loop {
            let n = up.read(&mut chunk).await?;
            if n == 0 {
                return Ok(());
            }
            client.write_all(&chunk[..n]).await?;
            tail.extend_from_slice(&chunk[..n]);
            if tail.len() > 16 {
                tail.drain(..tail.len() - 16);
            }
            if tail.ends_with(b"0\r\n\r\n") {
                break;
            }
        }
        if let Ok(mut v) = idle.lock() {
            v.push(up);
        }
        let close = memchr::memmem::find(&buf[..end], b"Connection: close").is_some();
        if close {
            return Ok(());
        }
    }
}

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (Some(listen), Some(Ok(upstream))) = (args.get(1), args.get(2).map(|a| a.parse())) else {
        eprintln!("usage: tokio-floor LISTEN UPSTREAM");
        std::process::exit(2);
    };
    if let Some(ms) = std::env::var("FLOOR_TICK_MS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        std::thread::spawn(move || loop {
            std::thread::sleep(std::time::Duration::from_millis(ms));
        });
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = TcpListener::bind(listen).await?;
        let idle: Idle = Arc::default();
        loop {
            let (s, _) = listener.accept().await?;
            s.set_nodelay(true)?;
            let idle = idle.clone();
            tokio::spawn(async move {
                let _ = serve(s, upstream, idle).await;
            });
        }
    })
}
