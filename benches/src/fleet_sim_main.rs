//! `fleet-sim`: the fleet simulator (`ultrafast_benches::fleet_sim`).
//!
//! ```text
//! fleet-sim serve --speeds 1,1,0.5,2 [model flags]
//!     N replicas on loopback; prints `listening on A,B,...`.
//! fleet-sim load --edge ADDR --speeds ... --load 0.8 [--seconds 60]
//!     [--ttft-ms 1000] [--model NAME] [--header K:V] [--seed N] [trace flags]
//!     replays the trace at that share of the fleet's capacity against an
//!     edge; prints one JSON line of figures.
//! fleet-sim des (--replicas N | --speeds ...) --load 0.8 [--seconds 30]
//!     [--policies all|a,b] [--k 4] [--ttft-ms 1000] [--slow I@T:SPEED]...
//!     [--drain I@T]... [--baseline-admission none|pool] [--windows SECONDS]
//!     [--shares 1] [--judge-ms MS] [trace and model flags]
//!     the discrete-event run: a table per policy, and the decision cost.
//! model flags: --slots 16 --chunk 512 --kv-tokens 65536 --step-ms 10
//!     --per-seq-ms 0.5 --prefill-tps 10000
//! trace flags: --tenants 8 --system-tokens 1000 --user-tokens 200
//!     --output-tokens 160 --burst-every 10
//! ```
//! A `--replicas N` fleet cycles the speeds 1, 1, 0.5, 2.

use std::time::Duration;
use ultrafast_benches::fleet_sim::{des, live, replica::StepModel, stats, trace};

struct Args(Vec<String>);

impl Args {
    fn get(&self, flag: &str) -> Option<&str> {
        self.0
            .iter()
            .position(|a| a == flag)
            .and_then(|i| self.0.get(i + 1))
            .map(String::as_str)
    }

    fn all(&self, flag: &str) -> Vec<&str> {
        self.0
            .windows(2)
            .filter(|w| w[0] == flag)
            .map(|w| w[1].as_str())
            .collect()
    }

    fn num<T: std::str::FromStr>(&self, flag: &str, default: T) -> T {
        match self.get(flag) {
            None => default,
            Some(v) => v
                .parse()
                .unwrap_or_else(|_| die(&format!("{flag}: cannot read {v:?}"))),
        }
    }
}

fn die(msg: &str) -> ! {
    eprintln!("fleet-sim: {msg}");
    std::process::exit(2)
}

fn speeds(a: &Args) -> Vec<f64> {
    if let Some(s) = a.get("--speeds") {
        return s
            .split(',')
            .map(|x| {
                x.parse()
                    .unwrap_or_else(|_| die(&format!("--speeds: {x:?}")))
            })
            .collect();
    }
    let n: usize = a.num("--replicas", 4);
    (0..n).map(|i| [1.0, 1.0, 0.5, 2.0][i % 4]).collect()
}

fn model(a: &Args) -> StepModel {
    let d = StepModel::default();
    StepModel {
        fixed_s: a.num("--step-ms", d.fixed_s * 1e3) / 1e3,
        per_seq_s: a.num("--per-seq-ms", d.per_seq_s * 1e3) / 1e3,
        per_prompt_token_s: 1.0 / a.num("--prefill-tps", 1.0 / d.per_prompt_token_s),
        slots: a.num("--slots", d.slots),
        chunk: a.num("--chunk", d.chunk),
        kv_tokens: a.num("--kv-tokens", d.kv_tokens),
        block_tokens: a.num("--block-tokens", d.block_tokens),
    }
}

/// The trace at `--load` of the fleet's capacity.
fn shape(a: &Args, speeds: &[f64], m: &StepModel) -> trace::Shape {
    let d = trace::Shape::default();
    let mut s = trace::Shape {
        seconds: a.num("--seconds", d.seconds),
        tenants: a.num("--tenants", d.tenants),
        system_tokens: a.num("--system-tokens", d.system_tokens),
        user_tokens: a.num("--user-tokens", d.user_tokens),
        output_tokens: a.num("--output-tokens", d.output_tokens),
        burst_every: a.num("--burst-every", d.burst_every),
        seed: a.num("--seed", d.seed),
        ..d
    };
    // Capacity as an ideal router finds it: every slot busy and every
    // system prompt already in its replica's cache (only the user turn
    // is prefilled), so a stated load is what a good policy must carry.
    let (p, o) = s.means();
    let cached = s.system_tokens as f64;
    let capacity: f64 = speeds.iter().sum::<f64>() * m.capacity(p - cached, o);
    s.rate = a.num("--load", 0.8) * capacity;
    s
}

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let Some(cmd) = argv.first().cloned() else {
        die("usage: fleet-sim serve|load|des [flags] (see the source's header)")
    };
    let a = Args(argv);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap_or_else(|e| die(&format!("runtime: {e}")));
    match cmd.as_str() {
        "serve" => rt.block_on(async {
            let addrs = live::serve(&speeds(&a), model(&a))
                .await
                .unwrap_or_else(|e| die(&format!("bind: {e}")));
            let list: Vec<String> = addrs.iter().map(ToString::to_string).collect();
            println!("listening on {}", list.join(","));
            // Runs until killed (its caller stops it by PID).
            std::future::pending::<()>().await;
        }),
        "load" => rt.block_on(async {
            let edge = a
                .get("--edge")
                .and_then(|e| e.parse().ok())
                .unwrap_or_else(|| die("--edge ADDR"));
            let sp = speeds(&a);
            let m = model(&a);
            let s = shape(&a, &sp, &m);
            let t = trace::generate(&s);
            let headers: Vec<(String, String)> = a
                .all("--header")
                .iter()
                .filter_map(|h| h.split_once(':'))
                .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
                .collect();
            let name = a.get("--model").unwrap_or("sim");
            let done = live::load(edge, name, &t, &headers, Duration::from_secs(120)).await;
            let target = a.num("--ttft-ms", 1000.0) / 1e3;
            let sum = stats::summarize(&done, target, s.seconds);
            println!(
                "{}",
                serde_json::json!({
                    "rate": s.rate, "sent": sum.sent, "admitted": sum.admitted,
                    "ttft_p50_ms": sum.ttft_p50, "ttft_p99_ms": sum.ttft_p99,
                    "e2e_p50_ms": sum.e2e_p50, "within": sum.within,
                    "goodput": sum.goodput, "refused_p99_ms": sum.refused_p99,
                    "row": stats::row(a.get("--label").unwrap_or("edge"), &sum),
                })
            );
        }),
        "des" => {
            let sp = speeds(&a);
            let m = model(&a);
            let s = shape(&a, &sp, &m);
            let t = trace::generate(&s);
            let changes = changes(&a);
            let setup = des::Setup {
                speeds: sp.clone(),
                model: m,
                ttft: Duration::from_millis(a.num("--ttft-ms", 1000)),
                k: a.num("--k", 4),
                scrape_every: a.num("--scrape-ms", 200.0) / 1e3,
                changes,
                pool_admission: a.get("--baseline-admission") == Some("pool"),
            };
            let policies: Vec<des::Policy> = match a.get("--policies").unwrap_or("all") {
                "all" => des::Policy::ALL.to_vec(),
                list => list
                    .split(',')
                    .map(|p| des::Policy::parse(p).unwrap_or_else(|| die(&format!("policy {p:?}"))))
                    .collect(),
            };
            println!(
                "{} replicas, {:.1} req/s ({} requests over {} s), target {} ms",
                sp.len(),
                s.rate,
                t.len(),
                s.seconds,
                setup.ttft.as_millis()
            );
            println!("{}", stats::HEAD);
            for p in policies {
                let run = des::run(&setup, &t, p);
                let done: Vec<stats::Done> = run
                    .outcomes
                    .iter()
                    .map(|o| stats::Done {
                        at: o.at,
                        admitted: o.admitted,
                        ttft: o.ttft,
                        e2e: o.e2e,
                        tokens: o.tokens,
                        refused_in: (!o.admitted).then_some(0.0),
                    })
                    .collect();
                let sum = stats::summarize(&done, a.num("--judge-ms", setup.ttft.as_millis() as f64) / 1e3, s.seconds);
                let mut d = run.decide_us.clone();
                if let Some(every) = a.get("--windows").and_then(|w| w.parse::<f64>().ok()) {
                    // Per window of arrivals: the admitted TTFT p99 and the
                    // share that went to each replica.
                    let nw = (s.seconds / every).ceil() as usize;
                    for w in 0..nw {
                        let (lo, hi) = (w as f64 * every, (w + 1) as f64 * every);
                        let inw: Vec<_> = run.outcomes.iter().filter(|o| o.admitted && o.at >= lo && o.at < hi).collect();
                        let mut t: Vec<f64> = inw.iter().map(|o| o.ttft.unwrap_or(f64::INFINITY) * 1e3).collect();
                        let share: Vec<String> = (0..sp.len().min(16))
                            .map(|i| format!("{:.0}%", 100.0 * inw.iter().filter(|o| o.replica == i).count() as f64 / inw.len().max(1) as f64))
                            .collect();
                        eprintln!(
                            "  {} {lo:.0}-{hi:.0} s: admitted TTFT p99 {:.0} ms, shares {}",
                            p.name(),
                            stats::quantile(&mut t, 0.99).unwrap_or(0.0),
                            share.join(" ")
                        );
                    }
                }
                if a.get("--shares").is_some() {
                    let mut w = vec![(0usize, 0usize); (s.seconds / 5.0).ceil() as usize + 1];
                    for o in &run.outcomes {
                        let b = &mut w[(o.at / 5.0) as usize];
                        b.0 += 1;
                        b.1 += usize::from(!o.admitted);
                    }
                    let line: Vec<String> = w.iter().map(|(n, r)| format!("{r}/{n}")).collect();
                    eprintln!("  {} refused per 5 s: {}", p.name(), line.join(" "));
                }
                if a.get("--shares").is_some() && sp.len() <= 16 {
                    let mut per = vec![(0usize, Vec::new()); sp.len()];
                    for o in run.outcomes.iter().filter(|o| o.admitted) {
                        per[o.replica].0 += 1;
                        per[o.replica].1.push(o.e2e.unwrap_or(f64::INFINITY));
                    }
                    for (i, (n, mut e)) in per.into_iter().enumerate() {
                        let p50 = stats::quantile(&mut e, 0.5).unwrap_or(0.0);
                        eprintln!(
                            "  {} replica {i} (speed {}): {n} requests, e2e p50 {:.0} ms",
                            p.name(),
                            sp[i],
                            p50 * 1e3
                        );
                    }
                }
                println!(
                    "{} decision p50 {:.1} us p99 {:.1} us, cache saved {:.0}%",
                    stats::row(p.name(), &sum),
                    stats::quantile(&mut d, 0.5).unwrap_or(0.0),
                    stats::quantile(&mut d, 0.99).unwrap_or(0.0),
                    100.0 * run.cache_share
                );
            }
        }
        other => die(&format!("unknown command {other:?}")),
    }
}

/// `--slow I@T:SPEED` and `--drain I@T`.
fn changes(a: &Args) -> Vec<(f64, des::Change)> {
    let mut out = Vec::new();
    for s in a.all("--slow") {
        let parsed = s.split_once('@').and_then(|(i, rest)| {
            let (t, sp) = rest.split_once(':')?;
            Some((
                t.parse().ok()?,
                des::Change::Speed(i.parse().ok()?, sp.parse().ok()?),
            ))
        });
        out.push(parsed.unwrap_or_else(|| die(&format!("--slow {s:?}: want I@T:SPEED"))));
    }
    for s in a.all("--drain") {
        let parsed = s
            .split_once('@')
            .and_then(|(i, t)| Some((t.parse().ok()?, des::Change::Drain(i.parse().ok()?))));
        out.push(parsed.unwrap_or_else(|| die(&format!("--drain {s:?}: want I@T"))));
    }
    out
}
