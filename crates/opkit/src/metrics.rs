//! Prometheus metrics shared by every controller of a manager.
use std::sync::Arc;
use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ControllerLabel {
    controller: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    controller: String,
    category: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WriteLabels {
    controller: String,
    verb: String,
}

fn duration_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 15))
}

/// The metric families; one instance per manager, registered once.
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    reconciles: Family<ControllerLabel, Counter>,
    failures: Family<ErrorLabels, Counter>,
    duration: Family<ControllerLabel, Histogram, fn() -> Histogram>,
    writes: Family<WriteLabels, Counter>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("opkit");
        let reconciles = Family::<ControllerLabel, Counter>::default();
        let failures = Family::<ErrorLabels, Counter>::default();
        let duration = Family::<ControllerLabel, Histogram, fn() -> Histogram>::new_with_constructor(
            duration_histogram as fn() -> Histogram,
        );
        let writes = Family::<WriteLabels, Counter>::default();
        registry.register("reconcile", "Reconciles started", reconciles.clone());
        registry.register(
            "reconcile_errors",
            "Reconciles that failed, by error category",
            failures.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "How long reconciles took",
            duration.clone(),
        );
        registry.register(
            "api_writes",
            "Writes sent to the Kubernetes API, by verb",
            writes.clone(),
        );
        Metrics {
            registry: Arc::new(registry),
            reconciles,
            failures,
            duration,
            writes,
        }
    }
}

impl Metrics {
    /// The Prometheus text exposition of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Encoding into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// The handle one controller records through.
    pub fn for_controller(&self, controller: &str) -> ControllerMetrics {
        ControllerMetrics {
            metrics: self.clone(),
            controller: controller.to_string(),
        }
    }
}

/// Metrics of one controller.
#[derive(Clone, Debug)]
pub struct ControllerMetrics {
    metrics: Metrics,
    controller: String,
}

impl ControllerMetrics {
    /// Counts a reconcile and returns a guard that records its duration when dropped, so
    /// early returns and errors are measured too.
    pub fn reconcile_started(&self) -> ReconcileTimer {
        self.metrics.reconciles.get_or_create(&self.label()).inc();
        ReconcileTimer {
            metrics: self.clone(),
            start: Instant::now(),
        }
    }

    /// Counts a failed reconcile under its error category.
    pub fn reconcile_failed(&self, category: &str) {
        let l = ErrorLabels {
            controller: self.controller.clone(),
            category: category.to_string(),
        };
        self.metrics.failures.get_or_create(&l).inc();
    }

    /// Counts one write to the API (`apply`, `apply_status`, `create`, `delete`, `event`).
    pub fn write(&self, verb: &str) {
        let l = WriteLabels {
            controller: self.controller.clone(),
            verb: verb.to_string(),
        };
        self.metrics.writes.get_or_create(&l).inc();
    }

    /// Writes made so far by this controller, over all verbs (for tests and benchmarks).
    pub fn writes_total(&self) -> u64 {
        ["apply", "apply_status", "create", "delete", "event"]
            .iter()
            .map(|v| {
                let l = WriteLabels {
                    controller: self.controller.clone(),
                    verb: v.to_string(),
                };
                self.metrics.writes.get_or_create(&l).get()
            })
            .sum()
    }

    /// Reconciles started so far by this controller (for tests and benchmarks).
    pub fn reconciles_total(&self) -> u64 {
        self.metrics.reconciles.get_or_create(&self.label()).get()
    }

    fn label(&self) -> ControllerLabel {
        ControllerLabel {
            controller: self.controller.clone(),
        }
    }
}

/// Records a reconcile's duration on drop.
pub struct ReconcileTimer {
    metrics: ControllerMetrics,
    start: Instant,
}

impl Drop for ReconcileTimer {
    fn drop(&mut self) {
        let l = self.metrics.label();
        self.metrics
            .metrics
            .duration
            .get_or_create(&l)
            .observe(self.start.elapsed().as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encoded_metrics_carry_controller_and_verb_labels() {
        let m = Metrics::default();
        let c = m.for_controller("memcached");
        drop(c.reconcile_started());
        c.reconcile_failed("apply");
        c.write("apply");
        c.write("apply");
        let text = m.encode();
        assert!(
            text.contains("opkit_reconcile_total{controller=\"memcached\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("opkit_reconcile_errors_total{controller=\"memcached\",category=\"apply\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("opkit_api_writes_total{controller=\"memcached\",verb=\"apply\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("opkit_reconcile_duration_seconds_count{controller=\"memcached\"} 1"),
            "{text}"
        );
        assert_eq!(c.writes_total(), 2);
    }
}
