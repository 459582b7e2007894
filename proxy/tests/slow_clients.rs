//! Slow clients (`slowhttptest`: slowloris, slow body, slow read) against a
//! proxy route in front of a real origin. During each attack a normal client
//! sends a request every 50 ms on a fresh connection; its p99 must stay
//! under 100 ms. The connections the edge holds for the attacker are
//! counted from `/proc/net/tcp` (server side of the listener port): they
//! stay bounded by the attack, and the head, body and send deadlines close them
//! while the attack still runs.
//!
//! The attacks run one at a time (a lock), so one does not time the other.

#![allow(clippy::unwrap_used)]
mod common;
use common::*;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// A running `slowhttptest`, killed by its PID when dropped.
struct Attack {
    child: Child,
}

impl Attack {
    fn start(dir: &std::path::Path, args: &[&str]) -> Attack {
        let out = std::fs::File::create(dir.join("slowhttptest.log")).unwrap();
        let child = Command::new("slowhttptest")
            .args(args)
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| {
                panic!("slowhttptest is not installed ({e}): run `bash .ci/run`, which installs it")
            });
        Attack { child }
    }

    /// Wait for it to end on its own (its `-l`), up to `limit`.
    fn wait(&mut self, limit: Duration) -> bool {
        eventually(limit, || matches!(self.child.try_wait(), Ok(Some(_))))
    }
}

impl Drop for Attack {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Held connections at one moment: time since the watch began, count.
type Sample = (Duration, usize);

/// What the normal client saw: latencies, failures, held-connection
/// samples of the edge and of the origin.
type Seen = (Vec<Duration>, Vec<String>, Vec<Sample>, Vec<usize>);

/// A normal client: a GET every 50 ms on a fresh connection, with its
/// latency, plus a sample of held connections every 100 ms.
struct Watch {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Seen>>,
}

impl Watch {
    fn start(uf: &Ultrafast, origin: u16) -> Watch {
        let (stop, addr, port) = (Arc::new(AtomicBool::new(false)), uf.addr, uf.addr.port());
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            let began = Instant::now();
            let (mut lat, mut errors, mut counts) = (Vec::new(), Vec::new(), Vec::new());
            let mut upstream = Vec::new();
            // A probe every 50 ms (about 240 in a 12 s attack, so one
            // moment of this shared VM's noise is not the p99 alone); the
            // held connections every 100 ms, one read of /proc/net/tcp.
            for i in 0u64.. {
                if s.load(Ordering::SeqCst) {
                    break;
                }
                let t = Instant::now();
                match Client::connect(addr).and_then(|mut c| c.request("GET", "/", &[], b"")) {
                    Ok(r) if r.status == 200 => lat.push(t.elapsed()),
                    Ok(r) => errors.push(format!("status {}", r.status)),
                    Err(e) => errors.push(e.to_string()),
                }
                if i % 2 == 0 {
                    let n = held_by(&[port, origin]);
                    counts.push((began.elapsed(), n[0]));
                    upstream.push(n[1]);
                }
                std::thread::sleep(Duration::from_millis(50).saturating_sub(t.elapsed()));
            }
            (lat, errors, counts, upstream)
        });
        Watch {
            stop,
            thread: Some(thread),
        }
    }

    fn finish(mut self) -> Seen {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.take().unwrap().join().unwrap()
    }
}

fn p99(mut v: Vec<Duration>) -> Duration {
    assert!(!v.is_empty(), "no successful probe");
    v.sort();
    v[(v.len() * 99).div_ceil(100) - 1]
}

fn edge(limits: &str) -> (Origin, Ultrafast) {
    let a = Origin::start("a");
    let uf = Ultrafast::start(&format!(
        "[limits]\n{limits}\n{}[[routes]]\npath = \"/\"\npool = \"a\"\n",
        pool_toml("a", &[&a], "")
    ));
    (a, uf)
}

/// Run `args` against `uf` for its `-l` (at most `length`), with the
/// normal client watching; returns the held-connection samples (about
/// every 100 ms, timed; the edge's, then the origin's) and how long the
/// attacker ran (`slowhttptest` leaves early once the server has closed
/// all its connections). Fails on any failed probe, or on a probe p99 over
/// 100 ms in each of three attacks: on this 2-core VM, where the attacker,
/// the origin, the edge and the probe share the cores, one attack in three
/// or four missed it on a quiet machine with the code before #18 as well
/// (p99 153, 10, 42, 54 ms in four runs), so one slow attack is noise, and
/// three are the edge.
fn attack(
    edge: &(Origin, Ultrafast),
    args: &[&str],
    length: Duration,
) -> (Vec<Sample>, Vec<usize>, Duration) {
    let mut seen = Vec::new();
    for _ in 0..3 {
        let (p, out) = attack_once(edge, args, length);
        if p < Duration::from_millis(100) {
            return out;
        }
        seen.push(p);
    }
    panic!("p99 {seen:?} under attack, in each of three attacks");
}

/// One attack: the probe p99 and what `attack` returns.
fn attack_once(
    (origin, uf): &(Origin, Ultrafast),
    args: &[&str],
    length: Duration,
) -> (Duration, (Vec<Sample>, Vec<usize>, Duration)) {
    let watch = Watch::start(uf, origin.addr.port());
    let started = Instant::now();
    let mut atk = Attack::start(&uf.dir, args);
    let ended = atk.wait(length + Duration::from_secs(10));
    let ran = started.elapsed();
    let (lat, errors, counts, upstream) = watch.finish();
    let log = std::fs::read_to_string(uf.dir.join("slowhttptest.log")).unwrap_or_default();
    assert!(ended, "slowhttptest ran past its length: {log}");
    assert!(errors.is_empty(), "normal client failed: {errors:?}");
    let n = lat.len();
    let mut worst = lat.clone();
    worst.sort();
    let worst: Vec<_> = worst.iter().rev().take(3).collect();
    let p = p99(lat);
    eprintln!(
        "{args:?}: ran {ran:?}, {n} probes, p99 {p:?}, worst {worst:?}, held max {:?}",
        counts.iter().map(|c| c.1).max()
    );
    (p, (counts, upstream, ran))
}

#[test]
fn slowloris_is_closed_by_the_head_deadline_and_does_not_slow_normal_clients() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let e = edge("client_header_timeout_ms = 3000");
    let uf = &e.1;
    let url = format!("http://{}/", uf.addr);
    // A header line every 2 s: each read is quick, the whole head is not.
    let (counts, _upstream, ran) = attack(
        &e,
        &[
            "-H", "-c", "200", "-r", "200", "-i", "2", "-x", "8", "-l", "20", "-p", "3", "-u", &url,
        ],
        Duration::from_secs(20),
    );
    let max = counts.iter().map(|c| c.1).max().unwrap_or(0);
    assert!(max >= 100, "the attack held only {max} connections");
    assert!(max <= 210, "held {max} for 200 attack connections");
    // slowhttptest stops once every connection it opened is closed: the
    // head deadline closed them all long before the attack's 20 s.
    assert!(
        ran < Duration::from_secs(12),
        "the attack ran {ran:?} of 20 s"
    );
    assert!(
        uf.metric(
            "ultrafast_downstream_connections_closed_total",
            &["header_timeout"]
        ) >= 100.0
    );
    assert!(
        eventually(Duration::from_secs(5), || held(uf.addr.port()) <= 2),
        "still held after the attack: {}",
        held(uf.addr.port())
    );
}

#[test]
fn a_trickled_body_is_closed_by_client_body_timeout() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let e = edge("client_body_timeout_ms = 1500");
    let uf = &e.1;
    let url = format!("http://{}/", uf.addr);
    // A body byte group every 4 s: over the 1.5 s deadline.
    let (counts, upstream, ran) = attack(
        &e,
        &[
            "-B", "-c", "200", "-r", "200", "-i", "4", "-s", "8192", "-x", "8", "-l", "12", "-p",
            "3", "-u", &url,
        ],
        Duration::from_secs(12),
    );
    let max = counts.iter().map(|c| c.1).max().unwrap_or(0);
    assert!(max >= 100, "the attack held only {max} connections");
    assert!(max <= 210, "held {max} for 200 attack connections");
    // Request buffering: a body still arriving holds no origin connection.
    // The normal client's requests keep one or two in the pool, a few more
    // when the machine is loaded (6 seen once on two busy cores, where a
    // reused connection came back to the pool after the next probe had
    // opened another); 200 slow bodies holding theirs would be ~200.
    let up = upstream.iter().copied().max().unwrap_or(0);
    assert!(up <= 10, "the origin held {up} connections for slow bodies");
    let closed = uf.metric(
        "ultrafast_downstream_connections_closed_total",
        &["body_timeout"],
    );
    assert!(closed >= 100.0, "{closed} counted at the body deadline");
    // slowhttptest stops once every connection it opened is closed: the
    // deadline closed them all long before the attack's 12 s.
    assert!(
        ran < Duration::from_secs(8),
        "the attack ran {ran:?} of 12 s"
    );
    assert!(
        held(uf.addr.port()) <= 2,
        "held after: {}",
        held(uf.addr.port())
    );
}

#[test]
fn a_client_that_stops_reading_is_closed_by_send_timeout() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let e = edge("send_timeout_ms = 1500");
    let uf = &e.1;
    // 4 MB each, read through a window of a few bytes.
    let url = format!("http://{}/big/4000000", uf.addr);
    let (counts, _upstream, ran) = attack(
        &e,
        &[
            "-X", "-c", "100", "-r", "100", "-w", "1", "-y", "16", "-n", "2", "-z", "8", "-l",
            "12", "-p", "3", "-u", &url,
        ],
        Duration::from_secs(12),
    );
    let max = counts.iter().map(|c| c.1).max().unwrap_or(0);
    assert!(max >= 50, "the attack held only {max} connections");
    assert!(max <= 110, "held {max} for 100 attack connections");
    // Each stalled write is cut 1.5 s after it stalls: from 5 s into the
    // attack until it ends (12 s) the edge holds none of them. The attacker
    // itself runs its whole length: the edge's close (a FIN) waits in the
    // kernel behind the unsent bytes, in a socket no process holds any more.
    // Chosen by time, not index: on a loaded machine a probe takes longer
    // than its 50 ms and samples come further apart.
    let late: Vec<usize> = counts
        .iter()
        .filter(|(t, _)| (Duration::from_secs(5)..Duration::from_secs(11)).contains(t))
        .map(|c| c.1)
        .collect();
    assert!(
        late.len() >= 15,
        "only {} samples from 5 s to 11 s",
        late.len()
    );
    assert!(
        late.iter().all(|&c| c <= 5),
        "held from 5 s into the attack: {late:?}"
    );
    assert!(
        ran >= Duration::from_secs(11),
        "the attack ended after {ran:?}"
    );
    let closed = uf.metric(
        "ultrafast_downstream_connections_closed_total",
        &["send_timeout"],
    );
    assert!(closed >= 50.0, "{closed} counted at the send deadline");
}
