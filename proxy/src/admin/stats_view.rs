//! `/admin/stats`: the status page's JSON (its shape is written down in
//! the README), built from the sampler's snapshots and the live config.

use super::stats::{back, Buckets, Sampler, Snap};
use crate::inference::{Front, ModelBackend};
use crate::runtime::reload::Manager;
use crate::runtime::Snapshot as Config;
use serde_json::{json, Value};

/// The window of the lane table's percentiles and rates.
const WINDOW_S: f64 = 60.0;
/// The window of each plotted TTFT p99 point.
const PLOT_P99_S: f64 = 10.0;
/// The window of the tokens/s figures and points.
const RATE_S: f64 = 5.0;

fn percentiles(b: &Buckets) -> Value {
    json!({"p50": b.quantile(0.5), "p90": b.quantile(0.9), "p99": b.quantile(0.99),
        "count": b.count})
}

fn rate(now: f64, then: f64, dt: f64) -> f64 {
    if dt <= 0.0 {
        0.0
    } else {
        (now - then).max(0.0) / dt
    }
}

/// The whole `/admin/stats` document.
pub fn stats(sampler: &Sampler, manager: &Manager, front: Option<&Front>) -> Value {
    let cfg = manager.shared().load_full();
    let now = sampler.sample();
    let (snaps, base) = sampler.history();
    let old = back(&snaps, base.as_ref(), now.t, WINDOW_S);
    let dt = old.map_or(0.0, |o| now.t - o.t);
    let slo = slo_by_lane(&cfg, front);
    let lanes: Vec<Value> = now
        .lanes
        .iter()
        .map(|(k, l)| {
            let o = old.and_then(|o| o.lanes.get(k));
            json!({
                "model": k.0, "lane": k.1, "backend": l.backend,
                "ttft": percentiles(&l.ttft.since(o.map(|o| &o.ttft))),
                "itl": percentiles(&l.itl.since(o.map(|o| &o.itl))),
                "requests_per_s": rate(l.requests, o.map_or(0.0, |o| o.requests), dt),
                "requests_total": l.requests,
                "queue_depth": l.queue,
                "slo": slo.get(k),
            })
        })
        .collect();
    let shed: Vec<Value> = now
        .shed
        .iter()
        .map(|((lane, reason), total)| {
            let was = old.and_then(|o| o.shed.get(&(lane.clone(), reason.clone())));
            json!({"lane": lane, "reason": reason, "total": total,
                "per_s": rate(*total, was.copied().unwrap_or(0.0), dt)})
        })
        .collect();
    let recent = back(&snaps, base.as_ref(), now.t, RATE_S);
    let engines = engines(&cfg, front, &now, recent);
    json!({
        "now_unix": now.t,
        "config": config(manager, &cfg),
        "lanes": lanes,
        "shed": shed,
        "engines": engines,
        "pools": pools(&cfg),
        "history": history(&snaps, base.as_ref()),
    })
}

fn config(manager: &Manager, cfg: &Config) -> Value {
    let loaded = cfg
        .loaded_at
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let last = manager.last_reload().map(|r| {
        json!({"at_unix": r.at_unix, "result": if r.ok { "ok" } else { "error" },
            "errors": r.errors})
    });
    json!({"path": cfg.path.display().to_string(), "hash": cfg.hash,
        "loaded_at_unix": loaded, "last_reload": last})
}

/// The watchdog's state and targets of each watched (model, lane).
fn slo_by_lane(
    cfg: &Config,
    front: Option<&Front>,
) -> std::collections::BTreeMap<(String, String), Value> {
    let Some(front) = front else {
        return Default::default();
    };
    let report = front.watchdog.report(cfg);
    let rows = report["lanes"].as_array().cloned().unwrap_or_default();
    rows.into_iter()
        .filter_map(|r| {
            let key = (
                r["model"].as_str()?.to_string(),
                r["lane"].as_str()?.to_string(),
            );
            let v = json!({"state": r["state"], "ttft_target_ms": r["targets"]["ttft_ms"],
                "itl_target_ms": r["targets"]["itl_ms"], "fallback_active": r["fallback_active"]});
            Some((key, v))
        })
        .collect()
}

fn engines(cfg: &Config, front: Option<&Front>, now: &Snap, recent: Option<&Snap>) -> Vec<Value> {
    let Some(front) = front else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (name, m) in &cfg.models {
        if !matches!(m.backend, ModelBackend::Engine(_)) {
            continue;
        }
        let Some(svc) = front.engines.get(name) else {
            continue;
        };
        let ready = ultrafast_engine::api::Backend::readiness(&*svc)
            == ultrafast_engine::api::Readiness::Ready;
        let generated = now.generated.get(name).copied().unwrap_or(0.0);
        let before = recent
            .and_then(|r| r.generated.get(name))
            .copied()
            .unwrap_or(0.0);
        let dt = recent.map_or(0.0, |r| now.t - r.t);
        let (kv, running, waiting) = match svc.engine() {
            Some(e) => {
                let p = e.pool_stats();
                let s = e.stats();
                let load = |a: &std::sync::atomic::AtomicUsize| {
                    a.load(std::sync::atomic::Ordering::Relaxed)
                };
                (
                    json!({"used": p.used, "cached": p.cached, "free": p.free}),
                    json!(load(&s.running)),
                    json!(load(&s.waiting)),
                )
            }
            None => (Value::Null, Value::Null, Value::Null),
        };
        out.push(
            json!({"model": name, "ready": ready, "kv": kv, "running": running,
            "waiting": waiting, "tokens_per_s": rate(generated, before, dt),
            "generation_tokens_total": generated}),
        );
    }
    out
}

fn pools(cfg: &Config) -> Vec<Value> {
    let now_ms = crate::upstream::now_ms();
    cfg.pools
        .iter()
        .map(|(name, p)| {
            let members: Vec<Value> = p
                .members()
                .members
                .iter()
                .map(|m| {
                    json!({"addr": m.label, "healthy": m.available(now_ms),
                        "in_flight": m.outstanding(),
                        "ejections": m.state.metrics.ejections.get()})
                })
                .collect();
            json!({"name": name, "lb": p.def.lb, "members": members})
        })
        .collect()
}

/// One point a second: TTFT p99 over the last 10 s and queue depth per
/// (model, lane), tokens/s per model.
fn history(snaps: &[Snap], base: Option<&Snap>) -> Value {
    let t: Vec<f64> = snaps.iter().map(|s| s.t).collect();
    let mut series = Vec::new();
    let keys: std::collections::BTreeSet<_> =
        snaps.iter().flat_map(|s| s.lanes.keys().cloned()).collect();
    for key in &keys {
        let values: Vec<Option<f64>> = (0..snaps.len())
            .map(|i| {
                let s = &snaps[i];
                let old = back(&snaps[..i], base, s.t, PLOT_P99_S);
                let b = s.lanes.get(key)?;
                b.ttft
                    .since(old.and_then(|o| o.lanes.get(key)).map(|l| &l.ttft))
                    .quantile(0.99)
            })
            .collect();
        series.push(json!({"key": "ttft_p99", "model": key.0, "lane": key.1, "values": values}));
        let depth: Vec<Option<i64>> = snaps
            .iter()
            .map(|s| s.lanes.get(key).map(|l| l.queue))
            .collect();
        series.push(json!({"key": "queue_depth", "model": key.0, "lane": key.1, "values": depth}));
    }
    let models: std::collections::BTreeSet<_> = snaps
        .iter()
        .flat_map(|s| s.generated.keys().cloned())
        .collect();
    for model in &models {
        let values: Vec<f64> = (0..snaps.len())
            .map(|i| {
                let s = &snaps[i];
                let now = s.generated.get(model).copied().unwrap_or(0.0);
                let old = back(&snaps[..i], base, s.t, RATE_S);
                let was = old
                    .and_then(|o| o.generated.get(model))
                    .copied()
                    .unwrap_or(0.0);
                rate(now, was, old.map_or(0.0, |o| s.t - o.t))
            })
            .collect();
        series.push(json!({"key": "tokens_per_s", "model": model, "values": values}));
    }
    json!({"t": t, "series": series})
}
