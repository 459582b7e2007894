//! The admission families: lanes' queues and gates, refusals and the
//! lanes' targets, defined and registered here.

use super::gate::GateMetrics;
use super::queue::LaneSpec;
use crate::config::file::FileConfig;
use crate::prom::registered;
use prometheus::{
    GaugeVec, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry,
};

/// The admission families.
#[derive(Clone)]
pub struct AdmissionMetrics {
    admitted: IntCounterVec,
    shed: IntCounterVec,
    queue_depth: IntGaugeVec,
    queue_wait: HistogramVec,
    in_use: IntGaugeVec,
    /// Each lane's TTFT and inter-token targets (seconds), for dashboards.
    lane_ttft_target: GaugeVec,
    lane_itl_target: GaugeVec,
}

impl AdmissionMetrics {
    /// Create and register the families.
    pub fn new(r: &Registry) -> Self {
        let lane_target =
            |name: &str, help: &str| registered(r, GaugeVec::new(Opts::new(name, help), &["lane"]));
        AdmissionMetrics {
            lane_ttft_target: lane_target(
                "ultrafast_lane_ttft_target_seconds",
                "Each lane's time-to-first-token target (ttft_slo_ms).",
            ),
            lane_itl_target: lane_target(
                "ultrafast_lane_itl_target_seconds",
                "Each lane's inter-token target (itl_slo_ms).",
            ),
            admitted: registered(
                r,
                IntCounterVec::new(
                    Opts::new(
                        "ultrafast_admission_admitted_total",
                        "Requests admitted by a pool's lane queue.",
                    ),
                    &["lane"],
                ),
            ),
            shed: registered(
                r,
                IntCounterVec::new(
                    Opts::new(
                        "ultrafast_admission_shed_total",
                        "Requests refused by admission, by lane and reason.",
                    ),
                    &["lane", "reason"],
                ),
            ),
            queue_depth: registered(
                r,
                IntGaugeVec::new(
                    Opts::new(
                        "ultrafast_admission_queue_depth",
                        "Requests waiting, by pool and lane.",
                    ),
                    &["pool", "lane"],
                ),
            ),
            queue_wait: registered(
                r,
                HistogramVec::new(
                    HistogramOpts::new(
                        "ultrafast_admission_queue_wait_seconds",
                        "Time admitted requests waited for a slot.",
                    )
                    .buckets(vec![
                        0.0001, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                        10.0, 30.0,
                    ]),
                    &["lane"],
                ),
            ),
            in_use: registered(
                r,
                IntGaugeVec::new(
                    Opts::new(
                        "ultrafast_pool_concurrency_in_use",
                        "Admission slots in use per pool.",
                    ),
                    &["pool"],
                ),
            ),
        }
    }

    /// Count a refusal by admission.
    pub fn shed(&self, lane: &str, reason: &str) {
        self.shed.with_label_values(&[lane, reason]).inc();
    }

    /// Handles for one pool's admission gate, lanes in rank order.
    pub fn gate(&self, pool: &str, lanes: &[String]) -> GateMetrics {
        GateMetrics {
            depth: lanes
                .iter()
                .map(|l| self.queue_depth.with_label_values(&[pool, l]))
                .collect(),
            wait: lanes
                .iter()
                .map(|l| self.queue_wait.with_label_values(&[l]))
                .collect(),
            admitted: lanes
                .iter()
                .map(|l| self.admitted.with_label_values(&[l]))
                .collect(),
            in_use: self.in_use.with_label_values(&[pool]),
        }
    }

    /// Set the lane target gauges from a newly active config's lanes (and
    /// their file sections, for `itl_slo_ms`).
    pub fn set_lane_targets(&self, lanes: &[LaneSpec], file: &FileConfig) {
        self.lane_ttft_target.reset();
        self.lane_itl_target.reset();
        for lane in lanes {
            if let Some(t) = lane.ttft_slo {
                self.lane_ttft_target
                    .with_label_values(&[&lane.name])
                    .set(t.as_secs_f64());
            }
            let itl = file.lanes.get(&lane.name).map_or(0, |s| s.itl_slo_ms);
            if itl > 0 {
                self.lane_itl_target
                    .with_label_values(&[&lane.name])
                    .set(itl as f64 / 1000.0);
            }
        }
    }
}
