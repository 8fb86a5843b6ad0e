//! controller-runtime's metric families, under controller-runtime's own names and labels, so
//! that the dashboards and alerts an SRE already runs for Kubebuilder operators work on opkit
//! unchanged. They count what opkit does (no family is faked): the work queue is observed at
//! its edges (see [`Queue`]).
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Buckets from 1 ms to about a minute (1 ms · 2^16 = 65.5 s): a reconcile, a queue wait, an
/// API request or a webhook call all fall inside.
pub(crate) fn seconds_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

fn histograms<L: Clone + std::hash::Hash + Eq>() -> Histograms<L> {
    Family::new_with_constructor(seconds_histogram as fn() -> Histogram)
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct Controller {
    pub controller: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ControllerResult {
    pub controller: String,
    pub result: String,
}

/// client-go's work-queue labels: the queue's name, and (controller-runtime) its controller.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct QueueLabels {
    pub controller: String,
    pub name: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RequestLabels {
    pub code: String,
    pub host: String,
    pub method: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RequestLatencyLabels {
    pub host: String,
    pub verb: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct WebhookLabels {
    pub webhook: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct WebhookCodeLabels {
    pub webhook: String,
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct LeaseLabels {
    pub name: String,
}

/// The families, registered on the root registry (no `opkit_` prefix).
#[derive(Clone)]
pub(crate) struct Standard {
    pub reconciles: Family<ControllerResult, Counter>,
    pub errors: Family<Controller, Counter>,
    pub terminal: Family<Controller, Counter>,
    pub panics: Family<Controller, Counter>,
    pub time: Histograms<Controller>,
    pub workers: Family<Controller, Gauge>,
    pub max_workers: Family<Controller, Gauge>,
    pub depth: Family<QueueLabels, Gauge>,
    pub adds: Family<QueueLabels, Counter>,
    pub queue_duration: Histograms<QueueLabels>,
    pub work_duration: Histograms<QueueLabels>,
    pub unfinished: Family<QueueLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    pub longest: Family<QueueLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    pub retries: Family<QueueLabels, Counter>,
    pub requests: Family<RequestLabels, Counter>,
    pub request_duration: Histograms<RequestLatencyLabels>,
    pub webhook_requests: Family<WebhookCodeLabels, Counter>,
    pub webhook_in_flight: Family<WebhookLabels, Gauge>,
    pub webhook_latency: Histograms<WebhookLabels>,
    pub leader: Family<LeaseLabels, Gauge>,
    pub queues: Arc<Mutex<Vec<Queue>>>,
}

impl Standard {
    pub(crate) fn register(registry: &mut Registry) -> Self {
        let s = Standard {
            reconciles: Family::default(),
            errors: Family::default(),
            terminal: Family::default(),
            panics: Family::default(),
            time: histograms(),
            workers: Family::default(),
            max_workers: Family::default(),
            depth: Family::default(),
            adds: Family::default(),
            queue_duration: histograms(),
            work_duration: histograms(),
            unfinished: Family::default(),
            longest: Family::default(),
            retries: Family::default(),
            requests: Family::default(),
            request_duration: histograms(),
            webhook_requests: Family::default(),
            webhook_in_flight: Family::default(),
            webhook_latency: histograms(),
            leader: Family::default(),
            queues: Arc::default(),
        };
        let r = registry;
        r.register(
            "controller_runtime_reconcile",
            "Total number of reconciliations per controller, by result (success, error)",
            s.reconciles.clone(),
        );
        r.register(
            "controller_runtime_reconcile_errors",
            "Total number of reconciliation errors per controller (invalid specs included)",
            s.errors.clone(),
        );
        r.register(
            "controller_runtime_terminal_reconcile_errors",
            "Total number of terminal reconciliation errors per controller: invalid specs, not retried until the object changes",
            s.terminal.clone(),
        );
        r.register(
            "controller_runtime_reconcile_panics",
            "Total number of reconciliation panics per controller",
            s.panics.clone(),
        );
        r.register(
            "controller_runtime_reconcile_time_seconds",
            "Length of time per reconciliation per controller",
            s.time.clone(),
        );
        r.register(
            "controller_runtime_active_workers",
            "Number of currently used workers per controller",
            s.workers.clone(),
        );
        r.register(
            "controller_runtime_max_concurrent_reconciles",
            "Maximum number of concurrent reconciles per controller (0: unbounded)",
            s.max_workers.clone(),
        );
        r.register(
            "workqueue_depth",
            "Current depth of the work queue: objects waiting for a reconcile",
            s.depth.clone(),
        );
        r.register(
            "workqueue_adds",
            "Total number of adds handled by the work queue",
            s.adds.clone(),
        );
        r.register(
            "workqueue_queue_duration_seconds",
            "How long in seconds an object stays in the work queue before being reconciled",
            s.queue_duration.clone(),
        );
        r.register(
            "workqueue_work_duration_seconds",
            "How long in seconds reconciling an object from the work queue takes",
            s.work_duration.clone(),
        );
        r.register(
            "workqueue_unfinished_work_seconds",
            "How many seconds of work has been done that is in progress (summed over running reconciles)",
            s.unfinished.clone(),
        );
        r.register(
            "workqueue_longest_running_processor_seconds",
            "How many seconds the longest running reconcile has been running",
            s.longest.clone(),
        );
        r.register(
            "workqueue_retries",
            "Total number of retries (failed reconciles requeued with backoff)",
            s.retries.clone(),
        );
        r.register(
            "rest_client_requests",
            "Number of HTTP requests to the Kubernetes API, partitioned by status code, method, and host",
            s.requests.clone(),
        );
        r.register(
            "rest_client_request_duration_seconds",
            "Request latency in seconds (until the response headers), by verb and host",
            s.request_duration.clone(),
        );
        r.register(
            "controller_runtime_webhook_requests",
            "Total number of admission and conversion requests by HTTP status code",
            s.webhook_requests.clone(),
        );
        r.register(
            "controller_runtime_webhook_requests_in_flight",
            "Current number of admission and conversion requests being served",
            s.webhook_in_flight.clone(),
        );
        r.register(
            "controller_runtime_webhook_latency_seconds",
            "Histogram of the latency of processing admission and conversion requests",
            s.webhook_latency.clone(),
        );
        r.register(
            "leader_election_master_status",
            "1 while this replica holds the Lease (the leader Lease, or with sharding its member Lease), 0 while it does not",
            s.leader.clone(),
        );
        s
    }

    /// Creates the series of `controller` at 0.
    pub(crate) fn zero(&self, controller: &str) {
        let c = Controller {
            controller: controller.to_string(),
        };
        for result in ["success", "error"] {
            let _ = self.reconciles.get_or_create(&ControllerResult {
                controller: controller.to_string(),
                result: result.to_string(),
            });
        }
        let _ = self.errors.get_or_create(&c);
        let _ = self.terminal.get_or_create(&c);
        let _ = self.panics.get_or_create(&c);
        let _ = self.time.get_or_create(&c);
        let _ = self.workers.get_or_create(&c);
        let _ = self.max_workers.get_or_create(&c);
        let q = self.queue(controller).labels();
        let _ = self.adds.get_or_create(&q);
        let _ = self.retries.get_or_create(&q);
        let _ = self.queue_duration.get_or_create(&q);
        let _ = self.work_duration.get_or_create(&q);
    }

    /// The scrape-time gauges of every queue.
    pub(crate) fn refresh(&self) {
        let now = Instant::now();
        for q in self.queues.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            let mut inner = q.inner.lock().unwrap_or_else(|p| p.into_inner());
            // An object deleted while it waited is never reconciled (the work queue drops it).
            inner.pending.retain(|_, (_, exists)| exists());
            let depth = inner.pending.len();
            let running: Vec<f64> = inner
                .running
                .values()
                .map(|s| now.duration_since(*s).as_secs_f64())
                .collect();
            drop(inner);
            let l = q.labels();
            self.depth
                .get_or_create(&l)
                .set(i64::try_from(depth).unwrap_or(i64::MAX));
            self.unfinished.get_or_create(&l).set(running.iter().sum());
            self.longest
                .get_or_create(&l)
                .set(running.iter().copied().fold(0.0, f64::max));
        }
    }

    /// The queue of `controller`, created on first use.
    pub(crate) fn queue(&self, controller: &str) -> Queue {
        let mut queues = self.queues.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(q) = queues.iter().find(|q| q.controller == controller) {
            return q.clone();
        }
        let q = Queue {
            controller: controller.to_string(),
            standard: Arc::new(self.clone_families()),
            inner: Arc::default(),
        };
        queues.push(q.clone());
        q
    }

    /// Empties every controller's queue (pending entries; running reconciles end by
    /// themselves).
    pub(crate) fn clear_queues(&self) {
        for q in self.queues.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            q.inner.lock().unwrap_or_else(|p| p.into_inner()).pending.clear();
        }
    }

    /// The families without the queue list (a queue holds them; the list holds the queues).
    fn clone_families(&self) -> Standard {
        Standard {
            queues: Arc::default(),
            ..self.clone()
        }
    }
}

/// Whether a queued object still exists (its primary is in the cache).
pub(crate) type Exists = Box<dyn Fn() -> bool + Send + Sync>;

#[derive(Default)]
struct QueueInner {
    /// Objects waiting, by key: since when, and how to tell the object still exists.
    pending: HashMap<String, (Instant, Exists)>,
    /// Reconciles running, by a number of their own: since when.
    running: HashMap<u64, Instant>,
    next: u64,
    /// Pending entries past which deleted objects are dropped on the next add, so the map
    /// stays bounded when nothing scrapes.
    purge_at: usize,
}

/// A controller's work queue as client-go's metrics see one, observed at its edges: an object
/// is added when a watch event (of the primary kind, or mapped from a child or related object)
/// asks for its reconcile, and leaves when a worker starts reconciling it. As in client-go, an
/// object already waiting is not added twice, and a reconcile requeued after a delay is added
/// when the queue hands it over (it has fallen due and a slot of its watch scope is free).
#[derive(Clone)]
pub(crate) struct Queue {
    controller: String,
    standard: Arc<Standard>,
    inner: Arc<Mutex<QueueInner>>,
}

impl Queue {
    fn labels(&self) -> QueueLabels {
        QueueLabels {
            controller: self.controller.clone(),
            name: self.controller.clone(),
        }
    }

    /// A reconcile of `key` was asked for; `exists` tells later whether it still can happen.
    pub(crate) fn add(&self, key: String, exists: Exists) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if inner.pending.contains_key(&key) {
            return;
        }
        if inner.pending.len() >= inner.purge_at {
            inner.pending.retain(|_, (_, exists)| exists());
            inner.purge_at = (inner.pending.len() * 2).max(1024);
        }
        inner.pending.insert(key, (Instant::now(), exists));
        drop(inner);
        self.standard.adds.get_or_create(&self.labels()).inc();
    }

    /// A worker starts reconciling `key`: it leaves the queue (added now if nothing announced
    /// it).
    pub(crate) fn start(&self, key: &str) -> Work {
        let now = Instant::now();
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let since = match inner.pending.remove(key) {
            Some((since, _)) => since,
            None => {
                self.standard.adds.get_or_create(&self.labels()).inc();
                now
            }
        };
        let id = inner.next;
        inner.next += 1;
        inner.running.insert(id, now);
        drop(inner);
        self.standard
            .queue_duration
            .get_or_create(&self.labels())
            .observe(now.duration_since(since).as_secs_f64());
        Work {
            queue: self.clone(),
            id,
            start: now,
        }
    }

    /// The request for `key` was dropped (its object is gone): it no longer waits.
    pub(crate) fn dropped(&self, key: &str) {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pending
            .remove(key);
    }

    /// Whether `key` waits already (adding it again would change nothing).
    pub(crate) fn is_pending(&self, key: &str) -> bool {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pending
            .contains_key(key)
    }

    /// A failed reconcile, requeued with backoff.
    pub(crate) fn retry(&self) {
        self.standard.retries.get_or_create(&self.labels()).inc();
    }

    /// Objects waiting now (for tests, and the in-memory harness's idle check). As at a
    /// scrape, an object deleted while it waited is not counted: the work queue dropped its
    /// request, so no worker will ever take it off.
    pub(crate) fn depth(&self) -> usize {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.pending.retain(|_, (_, exists)| exists());
        inner.pending.len()
    }
}

/// One reconcile taken from a [`Queue`]; its work duration is recorded when it is dropped.
pub(crate) struct Work {
    queue: Queue,
    id: u64,
    start: Instant,
}

impl Drop for Work {
    fn drop(&mut self) {
        self.queue
            .inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .running
            .remove(&self.id);
        self.queue
            .standard
            .work_duration
            .get_or_create(&self.queue.labels())
            .observe(self.start.elapsed().as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::super::Metrics;
    use std::sync::atomic::{AtomicBool, Ordering};

    fn has(text: &str, line: &str) {
        assert!(text.lines().any(|l| l == line), "no `{line}` in\n{text}");
    }

    #[test]
    fn the_queue_counts_adds_once_per_waiting_object_and_forgets_deleted_ones() {
        let m = Metrics::default();
        let q = m.for_controller("memcached").queue();
        let gone = std::sync::Arc::new(AtomicBool::new(false));
        let g = gone.clone();
        q.add("ns/a".into(), Box::new(|| true));
        q.add("ns/a".into(), Box::new(|| true));
        q.add("ns/b".into(), Box::new(move || !g.load(Ordering::SeqCst)));
        assert_eq!(q.depth(), 2);
        let text = m.encode();
        has(
            &text,
            r#"workqueue_adds_total{controller="memcached",name="memcached"} 2"#,
        );
        has(
            &text,
            r#"workqueue_depth{controller="memcached",name="memcached"} 2"#,
        );
        let work = q.start("ns/a");
        let text = m.encode();
        has(
            &text,
            r#"workqueue_depth{controller="memcached",name="memcached"} 1"#,
        );
        has(
            &text,
            r#"workqueue_queue_duration_seconds_count{controller="memcached",name="memcached"} 1"#,
        );
        let longest: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix(r#"workqueue_longest_running_processor_seconds{controller="memcached",name="memcached"} "#))
            .and_then(|v| v.parse().ok())
            .expect("the longest running reconcile");
        assert!(longest > 0.0, "a reconcile is running: {text}");
        drop(work);
        // b was deleted while it waited: it will never be reconciled.
        gone.store(true, Ordering::SeqCst);
        let text = m.encode();
        has(
            &text,
            r#"workqueue_depth{controller="memcached",name="memcached"} 0"#,
        );
        has(
            &text,
            r#"workqueue_work_duration_seconds_count{controller="memcached",name="memcached"} 1"#,
        );
        has(
            &text,
            r#"workqueue_longest_running_processor_seconds{controller="memcached",name="memcached"} 0.0"#,
        );
        // A requeue that fell due reaches a worker without a watch event: added then.
        drop(q.start("ns/c"));
        has(
            &m.encode(),
            r#"workqueue_adds_total{controller="memcached",name="memcached"} 3"#,
        );
    }

    #[test]
    fn an_object_deleted_while_it_waits_is_not_counted_as_waiting() {
        let m = Metrics::default();
        let q = m.for_controller("configmirror").queue();
        let gone = std::sync::Arc::new(AtomicBool::new(false));
        let g = gone.clone();
        q.add(
            "/app-settings".into(),
            Box::new(move || !g.load(Ordering::SeqCst)),
        );
        assert_eq!(q.depth(), 1);
        // Deleted before a worker took it: the work queue forgets the request, and nothing
        // takes it off here; the in-memory harness would wait for it forever.
        gone.store(true, Ordering::SeqCst);
        assert_eq!(q.depth(), 0);
    }

    #[test]
    fn objects_deleted_while_waiting_are_forgotten_without_scrapes_too() {
        let m = Metrics::default();
        let q = m.for_controller("memcached").queue();
        let held = |q: &super::Queue| q.inner.lock().unwrap().pending.len();
        for i in 0..1024 {
            q.add(format!("ns/gone-{i}"), Box::new(|| false));
        }
        assert_eq!(held(&q), 1024);
        q.add("ns/here".into(), Box::new(|| true));
        assert_eq!(
            held(&q),
            1,
            "the deleted ones are dropped once the map is this large"
        );
    }

    #[test]
    fn reconciles_are_counted_as_controller_runtime_counts_them() {
        let m = Metrics::default();
        let c = m.for_controller("at");
        c.max_concurrent(4);
        c.reconcile_started().finish("success");
        c.reconcile_started().finish("invalid");
        let t = c.reconcile_started();
        has(
            &m.encode(),
            r#"controller_runtime_active_workers{controller="at"} 1"#,
        );
        t.finish("error");
        c.reconcile_failed("apply");
        let text = m.encode();
        has(
            &text,
            r#"controller_runtime_reconcile_total{controller="at",result="success"} 1"#,
        );
        has(
            &text,
            r#"controller_runtime_reconcile_total{controller="at",result="error"} 2"#,
        );
        has(
            &text,
            r#"controller_runtime_reconcile_errors_total{controller="at"} 2"#,
        );
        has(
            &text,
            r#"controller_runtime_terminal_reconcile_errors_total{controller="at"} 1"#,
        );
        has(&text, r#"controller_runtime_active_workers{controller="at"} 0"#);
        has(
            &text,
            r#"controller_runtime_max_concurrent_reconciles{controller="at"} 4"#,
        );
        has(
            &text,
            r#"controller_runtime_reconcile_time_seconds_count{controller="at"} 3"#,
        );
        has(&text, r#"workqueue_retries_total{controller="at",name="at"} 1"#);
        // Buckets from 1 ms to past a minute (how many took under 1 ms depends on the load).
        assert!(
            text.lines().any(|l| l.starts_with(
                r#"controller_runtime_reconcile_time_seconds_bucket{le="0.001",controller="at"} "#
            )),
            "no 1 ms bucket in\n{text}"
        );
        has(
            &text,
            r#"controller_runtime_reconcile_time_seconds_bucket{le="65.536",controller="at"} 3"#,
        );
        // opkit's own families keep their prefix beside them.
        has(
            &text,
            r#"opkit_reconcile_total{controller="at",result="invalid"} 1"#,
        );
    }

    #[test]
    fn requests_webhooks_and_leadership_use_client_go_and_controller_runtime_names() {
        let m = Metrics::default();
        m.request("GET", "10.0.0.1:6443", "200", 0.004);
        m.request("PATCH", "10.0.0.1:6443", "<error>", 0.5);
        let w = m.webhook_started("/convert");
        has(
            &m.encode(),
            r#"controller_runtime_webhook_requests_in_flight{webhook="/convert"} 1"#,
        );
        w.finish(200);
        m.leading("opkit-leader", true);
        let text = m.encode();
        has(
            &text,
            r#"rest_client_requests_total{code="200",host="10.0.0.1:6443",method="GET"} 1"#,
        );
        has(
            &text,
            r#"rest_client_requests_total{code="<error>",host="10.0.0.1:6443",method="PATCH"} 1"#,
        );
        has(
            &text,
            r#"rest_client_request_duration_seconds_count{host="10.0.0.1:6443",verb="GET"} 1"#,
        );
        has(
            &text,
            r#"controller_runtime_webhook_requests_total{webhook="/convert",code="200"} 1"#,
        );
        has(
            &text,
            r#"controller_runtime_webhook_requests_in_flight{webhook="/convert"} 0"#,
        );
        has(
            &text,
            r#"controller_runtime_webhook_latency_seconds_count{webhook="/convert"} 1"#,
        );
        has(&text, r#"leader_election_master_status{name="opkit-leader"} 1"#);
    }
}
