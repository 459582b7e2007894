//! Validation of `[models.*]`, `[inference]` and lane pacing. Unchanged
//! models are reused on reload, so their admission queues carry over.

use super::*;
use crate::inference::fleet::{Fleet, FleetSpec, Policy};
use crate::inference::pacer::{PaceMode, PaceSpec};
use crate::inference::predict::Latency;
use crate::inference::tenant::TenantSource;
use crate::inference::upstream::{
    HedgeAfter, HedgeSpec, PriorityField, UpstreamBackend, UpstreamSpec,
};
use crate::inference::{Model, ModelBackend};
use ultrafast_engine::backend::{Device, KvDtype};
use ultrafast_engine::fair::Costs;
use ultrafast_engine::fetch::Source;
use ultrafast_engine::scheduler::EngineConfig;
use ultrafast_engine::service::ServiceSpec;

pub(super) fn pacing(f: &FileConfig, lanes: &[LaneSpec], errs: &mut Errors) -> Vec<PaceSpec> {
    lanes
        .iter()
        .map(|l| {
            let (sec, at) = match f.lanes.get(&l.name) {
                Some(s) => (s.clone(), FieldPath::key("lanes").k(&l.name)),
                None => (LaneSection::default(), FieldPath::key("lanes")),
            };
            let mode = match sec.pace.as_str() {
                "" if l.name == "ultra" => "adaptive",
                "" => "off",
                m => m,
            };
            let interval = Duration::from_millis(sec.pace_interval_ms);
            let mode = match mode {
                "off" => PaceMode::Off,
                "fixed" => {
                    if sec.pace_interval_ms == 0 {
                        errs.push(
                            at.k("pace_interval_ms"),
                            "fixed pacing needs an interval > 0",
                        );
                    }
                    PaceMode::Fixed(interval)
                }
                "adaptive" => PaceMode::Adaptive { min: interval },
                other => {
                    errs.push(
                        at.k("pace"),
                        format!("`{other}` is not one of off, fixed, adaptive"),
                    );
                    PaceMode::Off
                }
            };
            PaceSpec {
                mode,
                max_lead: sec.pace_max_lead.max(1),
            }
        })
        .collect()
}

/// Validate `[inference]`; returns its tenant source.
pub(super) fn inference(f: &FileConfig, errs: &mut Errors) -> TenantSource {
    let at = FieldPath::key("inference");
    let i = &f.inference;
    if i.heartbeat_ms == 0 {
        errs.push(at.k("heartbeat_ms"), "must be > 0");
    }
    if !(1_000..=600_000).contains(&i.keepalive_ms) {
        errs.push(at.k("keepalive_ms"), "must be between 1000 and 600000");
    }
    if i.async_max_entries == 0 {
        errs.push(at.k("async_max_entries"), "must be at least 1");
    }
    if i.async_ttl_s == 0 {
        errs.push(at.k("async_ttl_s"), "must be > 0");
    }
    if i.tokenize_max_bytes < 4096 {
        errs.push(at.k("tokenize_max_bytes"), "must be at least 4096");
    }
    let tenant = TenantSource::parse(&i.tenant);
    if tenant.is_none() {
        errs.push(at.k("tenant"), "must be client_ip, user or header:NAME");
    }
    for (k, v) in [
        ("fair_input_cost", i.fair_input_cost),
        ("fair_output_cost", i.fair_output_cost),
    ] {
        if !(v.is_finite() && v > 0.0 && v <= 1000.0) {
            errs.push(at.k(k), "must be a number above 0, at most 1000");
        }
    }
    tenant.unwrap_or(TenantSource::ClientIp)
}

fn sha256(v: &str, at: &FieldPath, errs: &mut Errors) -> Option<String> {
    if v.is_empty() {
        return None;
    }
    if v.len() != 64 || !v.bytes().all(|b| b.is_ascii_hexdigit()) {
        errs.push(at.k("sha256"), "must be 64 hex digits");
    }
    Some(v.to_ascii_lowercase())
}

/// What tokens cost a tenant, as `[inference]` says.
fn fair_costs(f: &FileConfig) -> Costs {
    Costs {
        input: f.inference.fair_input_cost,
        output: f.inference.fair_output_cost,
    }
}

fn engine_spec(
    name: &str,
    m: &ModelSection,
    fair: Costs,
    at: &FieldPath,
    errs: &mut Errors,
) -> Option<ServiceSpec> {
    if !m.pool.is_empty() {
        errs.push(at.k("pool"), "only an `upstream` model has a pool");
    }
    let source = match Source::parse(if m.source.is_empty() { name } else { &m.source }) {
        Ok(s) => s,
        Err(e) => {
            errs.push(at.k("source"), e);
            return None;
        }
    };
    for (k, v) in [
        ("kv_blocks", m.kv_blocks),
        ("block_size", m.block_size),
        ("max_num_seqs", m.max_num_seqs),
    ] {
        if v == 0 {
            errs.push(at.k(k), "must be at least 1");
        }
    }
    let kv_dtype = KvDtype::parse(&m.kv_cache).unwrap_or_else(|| {
        errs.push(at.k("kv_cache"), "must be \"f16\" or \"f32\"");
        KvDtype::default()
    });
    let device = Device::parse(&m.device).unwrap_or_else(|| {
        errs.push(
            at.k("device"),
            "must be \"auto\", \"cpu\", \"cuda\" or \"cuda:N\"",
        );
        Device::default()
    });
    if m.max_batched_tokens < m.max_num_seqs {
        errs.push(at.k("max_batched_tokens"), "must be at least max_num_seqs");
    }
    Some(ServiceSpec {
        name: name.to_string(),
        source,
        sha256: sha256(&m.sha256, at, errs),
        engine: EngineConfig {
            num_blocks: m.kv_blocks.max(1),
            block_size: m.block_size.max(1),
            max_num_seqs: m.max_num_seqs.max(1),
            max_batched_tokens: m.max_batched_tokens.max(1),
            kv_dtype,
            device,
            fair,
            ..EngineConfig::default()
        },
        warmup: m.warmup_prompt_lens.clone(),
        default_max_tokens: (m.default_max_tokens > 0).then_some(m.default_max_tokens),
    })
}

fn hedge(
    h: &crate::config::file::HedgeSection,
    at: &FieldPath,
    errs: &mut Errors,
) -> Option<HedgeSpec> {
    let at = at.k("hedge");
    let after = match (h.after_ms, h.after.as_str()) {
        (0, "") => {
            errs.push(at.k("after_ms"), "set after_ms or after");
            return None;
        }
        (ms, "") => HedgeAfter::Fixed(Duration::from_millis(ms)),
        (0, p) => match crate::inference::watchdog::percentile(p) {
            Some(q) => HedgeAfter::Quantile(q),
            None => {
                errs.push(at.k("after"), format!("`{p}` is not a percentile like p90"));
                return None;
            }
        },
        _ => {
            errs.push(at.k("after"), "set either after_ms or after, not both");
            return None;
        }
    };
    if !(h.max_ratio > 0.0 && h.max_ratio <= 1.0) {
        errs.push(at.k("max_ratio"), "must be in (0, 1]");
        return None;
    }
    Some(HedgeSpec {
        after,
        max_ratio: h.max_ratio,
    })
}

fn watchdog(name: &str, m: &ModelSection, f: &FileConfig, at: &FieldPath, errs: &mut Errors) {
    if !m.fallback.is_empty() {
        if m.fallback == name {
            errs.push(at.k("fallback"), "a model cannot fall back to itself");
        } else if !f.models.contains_key(&m.fallback) {
            errs.push(at.k("fallback"), format!("unknown model `{}`", m.fallback));
        }
        if m.watchdog.is_none() {
            errs.push(
                at.k("fallback"),
                "a fallback needs a watchdog (`watchdog = { ... }`) to decide when",
            );
        }
    }
    let Some(w) = &m.watchdog else { return };
    let at = at.k("watchdog");
    if w.window_ms == 0 {
        errs.push(at.k("window_ms"), "must be > 0");
    }
    if w.probe_interval_ms == 0 {
        errs.push(at.k("probe_interval_ms"), "must be > 0");
    }
    for (k, v) in [
        ("enter_after", w.enter_after),
        ("leave_after", w.leave_after),
    ] {
        if v == 0 {
            errs.push(at.k(k), "must be at least 1");
        }
    }
    if w.probe_max_tokens == 0 {
        errs.push(at.k("probe_max_tokens"), "must be at least 1");
    }
    if crate::inference::watchdog::percentile(&w.percentile).is_none() {
        errs.push(
            at.k("percentile"),
            format!("`{}` is not a percentile like p99", w.percentile),
        );
    }
}

fn upstream_spec(
    name: &str,
    m: &ModelSection,
    at: &FieldPath,
    pools: &BTreeMap<String, Arc<Pool>>,
    f: &FileConfig,
    ctx: &BuildCtx,
    errs: &mut Errors,
) -> Option<UpstreamSpec> {
    if !m.source.is_empty() {
        errs.push(at.k("source"), "only an `engine` model has a source");
    }
    let pool = match pools.get(&m.pool) {
        Some(p) => p.clone(),
        None => {
            if m.pool.is_empty() {
                errs.push(at.k("pool"), "an upstream model needs a pool");
            } else if !f.pools.contains_key(&m.pool) {
                errs.push(at.k("pool"), format!("unknown pool `{}`", m.pool));
            }
            return None;
        }
    };
    let affinity = match m.lb.as_str() {
        "least_outstanding" => None,
        "prefix_affinity" => {
            if m.affinity_load_factor < 1.0 {
                errs.push(at.k("affinity_load_factor"), "must be at least 1.0");
            }
            Some(m.affinity_load_factor.max(1.0))
        }
        other => {
            errs.push(
                at.k("lb"),
                format!("`{other}` is not one of least_outstanding, prefix_affinity"),
            );
            None
        }
    };
    let priority = match m.priority_field.as_str() {
        "none" | "" => PriorityField::None,
        "vllm" => PriorityField::Vllm,
        other => {
            errs.push(
                at.k("priority_field"),
                format!("`{other}` is not one of none, vllm"),
            );
            PriorityField::None
        }
    };
    if !(1..=10).contains(&m.attempts) {
        errs.push(at.k("attempts"), "must be between 1 and 10");
    }
    if m.stall_timeout_ms == 0 {
        errs.push(at.k("stall_timeout_ms"), "must be > 0");
    }
    let hedge = m.hedge.as_ref().and_then(|h| hedge(h, at, errs));
    let caps = pool.settings.server_kind.caps();
    let resume_chat = match f.pools.get(&m.pool).map(|p| p.resume.as_str()) {
        Some("vllm") => true,
        Some("") => caps.continue_final_message,
        _ => false,
    };
    if priority == PriorityField::Vllm && !caps.priority {
        errs.push(
            at.k("priority_field"),
            format!(
                "pool `{}` does not take a priority field (its dialect is not vllm)",
                m.pool
            ),
        );
    }
    let fleet = fleet_of(name, m, &pool, ctx);
    Some(UpstreamSpec {
        pool,
        upstream_model: if m.upstream_model.is_empty() {
            name.to_string()
        } else {
            m.upstream_model.clone()
        },
        affinity,
        priority,
        attempts: m.attempts.clamp(1, 10),
        stall: Duration::from_millis(m.stall_timeout_ms.max(1)),
        hedge,
        resume_chat,
        max_model_len: (m.max_model_len > 0).then_some(m.max_model_len),
        counters: ctx.metrics.inference.upstream_counters(name),
        fleet,
    })
}

/// The per-member models of a pool placed by predicted latency (or by
/// llm-d's scores): kept across a reload that leaves them alike, since the
/// members' ledgers hold the requests admitted before it.
fn fleet_of(name: &str, m: &ModelSection, pool: &Pool, ctx: &BuildCtx) -> Option<Arc<Fleet>> {
    let crate::upstream::LbSpec::Fleet(lb) = &pool.lb else {
        return None;
    };
    let spec = FleetSpec {
        policy: if lb.load_prefix {
            Policy::LoadPrefix
        } else {
            Policy::PredictedLatency
        },
        k: lb.k,
        block_tokens: lb.block_tokens,
        capacity_tokens: lb.capacity_tokens,
        slots: lb.slots,
        chunk: lb.chunk,
        prefill_tps: m.prefill_tokens_per_s,
        decode_tps: m.decode_tokens_per_s,
        window: Duration::from_secs(m.calibration_window_s.max(1)),
    };
    let old = ctx
        .prev
        .and_then(|c| c.models.get(name))
        .and_then(|o| match &o.backend {
            ModelBackend::Upstream(u) => u.spec().fleet.clone(),
            ModelBackend::Engine(_) => None,
        });
    match old {
        Some(f) if f.spec() == &spec => Some(f),
        _ => Some(Arc::new(Fleet::new(spec))),
    }
}

/// The latency model of a model: the engine measures its own steps; an
/// upstream is learned from its streams, starting from the priors.
fn latency_model(backend: &ModelBackend, m: &ModelSection) -> Latency {
    let gate = if m.max_concurrency == 0 {
        usize::MAX
    } else {
        m.max_concurrency
    };
    let window = Duration::from_secs(m.calibration_window_s.max(1));
    match backend {
        ModelBackend::Engine(_) => Latency::new(
            false,
            m.max_num_seqs.min(gate).max(1),
            Some(m.max_batched_tokens.max(1)),
            m.prefill_tokens_per_s,
            m.decode_tokens_per_s,
        ),
        ModelBackend::Upstream(_) => Latency::new(
            true,
            gate.min(1 << 20),
            None,
            m.prefill_tokens_per_s,
            m.decode_tokens_per_s,
        ),
    }
    .calibrated_over(window)
}

pub(super) fn models(
    f: &FileConfig,
    pools: &BTreeMap<String, Arc<Pool>>,
    lanes: &[LaneSpec],
    ctx: &BuildCtx,
    errs: &mut Errors,
) -> BTreeMap<String, Arc<Model>> {
    let mut out = BTreeMap::new();
    for (name, m) in &f.models {
        let at = FieldPath::key("models").k(name);
        let before = errs.0.len();
        let backend = match m.backend.as_str() {
            "engine" => engine_spec(name, m, fair_costs(f), &at, errs)
                .map(|s| ModelBackend::Engine(Box::new(s))),
            "upstream" => upstream_spec(name, m, &at, pools, f, ctx, errs)
                .map(|s| ModelBackend::Upstream(Arc::new(UpstreamBackend::new(s)))),
            other => {
                errs.push(
                    at.k("backend"),
                    format!("`{other}` is not one of engine, upstream"),
                );
                None
            }
        };
        watchdog(name, m, f, &at, errs);
        crate::config::validate::sampling(&m.sampling, &at, errs);
        if let Some(ModelBackend::Upstream(u)) = &backend {
            let (s, kind) = (&m.sampling, u.spec().pool.settings.server_kind);
            let (min_p, rep) = (s.min_p.unwrap_or(0.0), s.repetition_penalty.unwrap_or(1.0));
            for field in kind.refused_sampling(min_p as f32, rep as f32) {
                errs.push(
                    at.k("sampling").k(field),
                    format!("the pool's dialect `{}` does not take it", kind.name()),
                );
            }
        }
        if m.hedge.is_some() && m.backend != "upstream" {
            errs.push(at.k("hedge"), "only an `upstream` model is hedged");
        }
        let Some(backend) = backend else { continue };
        if errs.0.len() != before {
            continue;
        }
        // An unchanged model (same section, same pool object) is kept whole.
        if let Some(old) = ctx.prev.and_then(|c| c.models.get(name)) {
            let same_pool = match (&old.backend, &backend) {
                (ModelBackend::Upstream(a), ModelBackend::Upstream(b)) => {
                    Arc::ptr_eq(&a.spec().pool, &b.spec().pool)
                }
                _ => true,
            };
            let same_lanes = ctx.prev.is_some_and(|c| c.file.lanes == f.lanes);
            if old.def == *m && same_pool && same_lanes {
                out.insert(name.clone(), old.clone());
                continue;
            }
        }
        if !(m.prefill_tokens_per_s > 0.0 && m.prefill_tokens_per_s.is_finite()) {
            errs.push(at.k("prefill_tokens_per_s"), "must be > 0");
            continue;
        }
        if !(m.decode_tokens_per_s > 0.0 && m.decode_tokens_per_s.is_finite()) {
            errs.push(at.k("decode_tokens_per_s"), "must be > 0");
            continue;
        }
        let gate_name = format!("model:{name}");
        let gate = super::gate(
            &gate_name,
            lanes,
            m.max_concurrency,
            m.max_queued,
            ctx.metrics,
            fair_costs(f),
        );
        if let Some(g) = &gate {
            // Shared with the other instances when `[cluster]` is set.
            let weak = Arc::downgrade(g);
            crate::cluster::fair::register(name, weak);
        }
        // The ledger of admitted work outlives a changed section: requests
        // admitted before the reload still occupy the same backend.
        let latency = match ctx.prev.and_then(|c| c.models.get(name)) {
            Some(old)
                if old.def.backend == m.backend && old.def.max_concurrency == m.max_concurrency =>
            {
                old.latency.clone()
            }
            _ => Arc::new(latency_model(&backend, m)),
        };
        out.insert(
            name.clone(),
            Arc::new(Model {
                name: name.clone(),
                backend,
                gate,
                latency,
                def: m.clone(),
            }),
        );
    }
    out
}
