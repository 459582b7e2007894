//! Helpers for the metric families each subsystem defines and registers
//! itself (`metrics` only assembles them into one registry).

use prometheus::core::Collector;
use prometheus::Registry;

/// A metric built from static arguments: a failure here is a programming
/// error caught by the first test run, never something input can cause.
#[allow(clippy::expect_used)]
pub fn must<T>(r: prometheus::Result<T>) -> T {
    r.expect("static metric definition")
}

/// `family`, registered with `r` (a handle kept by the caller).
pub fn registered<C: Collector + Clone + 'static>(
    r: &Registry,
    family: prometheus::Result<C>,
) -> C {
    let c = must(family);
    must(r.register(Box::new(c.clone())));
    c
}
