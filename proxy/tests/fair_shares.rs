//! Fair shares between tenants inside a lane, through the proxy to a fake
//! OpenAI upstream (the real protocol) behind a gate of one slot: a tenant
//! offering ten times the load of another gets about the same service
//! while both are backlogged (tenants by header, no keys), a key of weight
//! 3 gets three times a key of weight 1, and the counters and tokens
//! served show per tenant in `/metrics`.
#![allow(clippy::unwrap_used)]

mod common;
use common::infer::*;
use common::*;

const TOKENS: usize = 6;

#[test]
fn ten_times_the_load_gets_the_same_service_and_weights_divide_it() {
    // 6 tokens 25 ms apart: about 150 ms a request, one at a time.
    let fake = Fake::start(&["--tokens", "6", "--itl-ms", "25"]);
    let model = upstream_model("m", &[&fake], "max_concurrency = 1");
    let uf = Ultrafast::start(&format!(
        "[inference]\ntenant = \"header:x-tenant\"\n\n{INFERENCE_ROUTE}{model}"
    ));
    // 10 clients of "heavy" against 1 of "light", both always waiting.
    let got = closed_loops(
        uf.addr,
        &[
            (header("x-tenant", "heavy"), 10),
            (header("x-tenant", "light"), 1),
        ],
        5,
    );
    eprintln!("served heavy, light: {got:?}");
    let (heavy, light) = (got[0] as f64, got[1] as f64);
    assert!(heavy + light >= 20.0, "too little served: {got:?}");
    // First come first served would give light 1/11 of the slots.
    assert!(
        (light / heavy - 1.0).abs() <= 0.25,
        "heavy {heavy}, light {light}: not about 1:1"
    );
    let m = uf.metrics();
    for t in ["header:heavy", "header:light"] {
        let line = m
            .lines()
            .find(|l| {
                l.starts_with("ultrafast_inference_fair_served_tokens{")
                    && l.contains(&format!("tenant=\"{t}\""))
            })
            .unwrap_or_else(|| panic!("no served tokens for {t}:\n{m}"));
        let served: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
        assert!(served >= TOKENS as f64 * 5.0, "{line}");
    }
    assert!(
        m.contains("ultrafast_inference_fair_virtual_tokens{"),
        "{m}"
    );

    // Keys of weight 3 and 1, both with ten clients: 3:1.
    let dir = scratch("fair");
    let keys = dir.join("keys.toml");
    std::fs::write(
        &keys,
        "[[keys]]\nname = \"three\"\nkey = \"sk-three\"\nweight = 3\n\n\
         [[keys]]\nname = \"one\"\nkey = \"sk-one\"\n",
    )
    .unwrap();
    let uf = Ultrafast::start(&format!(
        "[api_keys]\nfile = \"{}\"\n\n{INFERENCE_ROUTE}{model}",
        keys.display()
    ));
    let got = closed_loops(
        uf.addr,
        &[
            (header("Authorization", "Bearer sk-three"), 10),
            (header("Authorization", "Bearer sk-one"), 10),
        ],
        5,
    );
    eprintln!("served weight 3, weight 1: {got:?}");
    let ratio = got[0] as f64 / got[1].max(1) as f64;
    assert!((2.3..=3.9).contains(&ratio), "weights 3:1 served {got:?}");
}
