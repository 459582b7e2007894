//! What the benchmarks share: the fleet simulator (`fleet_sim`), used by
//! the `fleet-sim` binary and by the fleet tests.

pub mod fleet_sim;
