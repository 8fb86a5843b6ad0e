//! Prometheus metrics shared by every controller of a manager: controller-runtime's families
//! under their own names (`metrics/standard.rs`), the `process_*` families
//! (`metrics/process.rs`), and opkit's own under the `opkit_` prefix (writes, refused writes,
//! caches), which controller-runtime has no equivalent for.
mod process;
mod standard;

/// The Prometheus client opkit's metrics are made with: an operator's own metrics
/// ([`Metrics::register`]) use the same version.
pub use prometheus_client;

pub(crate) use standard::{Exists, Queue};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ControllerLabel {
    controller: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    controller: String,
    result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    controller: String,
    category: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
struct CacheLabels {
    controller: String,
    kind: String,
}

/// Whether an optional watch's kind is served now.
type Active = Arc<AtomicBool>;

/// Measures one cache when metrics are scraped: (objects, estimated bytes).
type CacheProbe = Box<dyn Fn() -> (usize, usize) + Send + Sync>;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WriteLabels {
    controller: String,
    verb: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MoveLabels {
    controller: String,
    /// `assigned` (labelled for a member) or `drained` (its owner asked to let it go).
    r#move: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    controller: String,
    step: String,
    result: String,
}

/// The metric families; one instance per manager, registered once.
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    /// The operator's own metrics ([`Metrics::register`]).
    custom: Arc<Mutex<Registry>>,
    reconciles: Family<ResultLabels, Counter>,
    active: Family<ControllerLabel, Gauge>,
    resync_pending: Family<ControllerLabel, Gauge>,
    status_unseen: Family<ControllerLabel, Gauge>,
    failures: Family<ErrorLabels, Counter>,
    duration: Family<ControllerLabel, Histogram, fn() -> Histogram>,
    writes: Family<WriteLabels, Counter>,
    refused: Family<ControllerLabel, Counter>,
    panics: Family<ControllerLabel, Counter>,
    attempts_refused: Counter,
    timeouts: Family<ReasonLabel, Counter>,
    cache_objects: Family<CacheLabels, Gauge>,
    cache_bytes: Family<CacheLabels, Gauge>,
    calls: Family<CallLabels, Counter>,
    shard_moves: Family<MoveLabels, Counter>,
    shard_handover: Family<ControllerLabel, Histogram, fn() -> Histogram>,
    shard_members: Family<ControllerLabel, Gauge>,
    caches: Arc<Mutex<Vec<(CacheLabels, CacheProbe)>>>,
    optional_active: Family<CacheLabels, Gauge>,
    undecodable: Family<CacheLabels, Counter>,
    /// The optional watches (one per namespace watched) and whether each has its kind.
    optional: Arc<Mutex<Vec<(CacheLabels, Active)>>>,
    totals: Arc<Mutex<HashMap<String, Arc<Totals>>>>,
    standard: standard::Standard,
    process: process::Process,
}

/// Running totals per controller, for tests and benchmarks that wait on them.
#[derive(Debug, Default)]
struct Totals {
    finished: AtomicU64,
    failed: AtomicU64,
    writes: AtomicU64,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        let mut root = Registry::default();
        let standard = standard::Standard::register(&mut root);
        let process = process::Process::register(&mut root);
        let registry = root.sub_registry_with_prefix("opkit");
        let reconciles = Family::<ResultLabels, Counter>::default();
        let active = Family::<ControllerLabel, Gauge>::default();
        let failures = Family::<ErrorLabels, Counter>::default();
        let duration = Family::<ControllerLabel, Histogram, fn() -> Histogram>::new_with_constructor(
            standard::seconds_histogram as fn() -> Histogram,
        );
        let writes = Family::<WriteLabels, Counter>::default();
        let refused = Family::<ControllerLabel, Counter>::default();
        let panics = Family::<ControllerLabel, Counter>::default();
        let attempts_refused = Counter::default();
        let timeouts = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "api_attempts_refused",
            "Attempts of writes (retries included) not sent because the write gate was closed",
            attempts_refused.clone(),
        );
        registry.register(
            "api_request_timeouts",
            "Requests that got no answer in time, by reason (request timeout, write gate closing)",
            timeouts.clone(),
        );
        // Both reasons exist from the start: a rate of 0 rather than no series.
        for reason in ["request_timeout", "write_gate_closing"] {
            let _ = timeouts.get_or_create(&ReasonLabel {
                reason: reason.to_string(),
            });
        }
        let cache_objects = Family::<CacheLabels, Gauge>::default();
        let cache_bytes = Family::<CacheLabels, Gauge>::default();
        let calls = Family::<CallLabels, Counter>::default();
        registry.register(
            "calls",
            "Acts outside the cluster, in plans and cleanups, by step (`source.action`) and result (ok, retry)",
            calls.clone(),
        );
        registry.register(
            "reconcile",
            "Reconciles finished, by result (success, invalid, error)",
            reconciles.clone(),
        );
        registry.register(
            "reconcile_panics",
            "Reconciles that panicked (caught; the object is retried with backoff)",
            panics.clone(),
        );
        registry.register("reconcile_active", "Reconciles running now", active.clone());
        let resync_pending = Family::<ControllerLabel, Gauge>::default();
        registry.register(
            "resync_pending",
            "Listed objects whose resync has not started yet: they wait behind new work after a (re)list",
            resync_pending.clone(),
        );
        let status_unseen = Family::<ControllerLabel, Gauge>::default();
        registry.register(
            "status_writes_unseen",
            "Status writes of opkit's whose watch events the primary cache has not delivered yet (or whose reconcile is still under way): near 0 at rest",
            status_unseen.clone(),
        );
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
        registry.register(
            "api_writes_refused",
            "Writes not sent because this replica may no longer be the leader",
            refused.clone(),
        );
        registry.register(
            "cache_objects",
            "Objects held in the controller's caches (all watched namespaces), by kind",
            cache_objects.clone(),
        );
        registry.register(
            "cache_bytes_estimate",
            "Estimated size of the cached objects, by kind: their JSON size, from a sample (a compact cache: the bytes it stores, compressed)",
            cache_bytes.clone(),
        );
        let optional_active = Family::<CacheLabels, Gauge>::default();
        registry.register(
            "optional_watch_active",
            "Optional watches, by kind: 1 while their kind is served and watched, 0 while they wait for it to be installed",
            optional_active.clone(),
        );
        let undecodable = Family::<CacheLabels, Counter>::default();
        registry.register(
            "watch_objects_undecodable",
            "Watched objects that did not decode as their kind, by kind: left out, the cache keeps the copy it held (a changed object stays as it was)",
            undecodable.clone(),
        );
        let shard_moves = Family::<MoveLabels, Counter>::default();
        let shard_handover = Family::<ControllerLabel, Histogram, fn() -> Histogram>::new_with_constructor(
            standard::seconds_histogram as fn() -> Histogram,
        );
        let shard_members = Family::<ControllerLabel, Gauge>::default();
        registry.register(
            "shard_moves",
            "Objects the sharder (on the leader) labelled for a member (assigned) or asked their owner to let go of (drained)",
            shard_moves.clone(),
        );
        registry.register(
            "shard_handover_seconds",
            "From the moment an object had to move (its owner asked to let go, or the owner's Lease last seen renewed) to its assignment to the new owner",
            shard_handover.clone(),
        );
        registry.register(
            "shard_members",
            "Live members the sharder (on the leader) places objects on",
            shard_members.clone(),
        );
        Metrics {
            registry: Arc::new(root),
            custom: Arc::default(),
            reconciles,
            active,
            resync_pending,
            status_unseen,
            failures,
            duration,
            writes,
            refused,
            panics,
            attempts_refused,
            timeouts,
            cache_objects,
            cache_bytes,
            calls,
            shard_moves,
            shard_handover,
            shard_members,
            caches: Arc::default(),
            optional_active,
            undecodable,
            optional: Arc::default(),
            totals: Arc::default(),
            standard,
            process,
        }
    }
}

impl Metrics {
    /// Counts a write attempt the client's gate refused.
    pub(crate) fn attempt_refused(&self) {
        self.attempts_refused.inc();
    }

    /// Counts a request that got no answer before its deadline.
    pub(crate) fn request_timed_out(&self, reason: &str) {
        self.timeouts
            .get_or_create(&ReasonLabel {
                reason: reason.replace(' ', "_"),
            })
            .inc();
    }

    /// Counts one request to the Kubernetes API (`code`: the HTTP status, or `<error>` when
    /// none came) and how long its answer took to start.
    pub(crate) fn request(&self, method: &str, host: &str, code: &str, seconds: f64) {
        let l = standard::RequestLabels {
            code: code.to_string(),
            host: host.to_string(),
            method: method.to_string(),
        };
        self.standard.requests.get_or_create(&l).inc();
        let l = standard::RequestLatencyLabels {
            host: host.to_string(),
            verb: method.to_string(),
        };
        self.standard.request_duration.get_or_create(&l).observe(seconds);
    }

    /// Marks a webhook request (by path) as being served; the guard records its code and
    /// latency.
    pub(crate) fn webhook_started(&self, webhook: &str) -> WebhookTimer {
        let l = standard::WebhookLabels {
            webhook: webhook.to_string(),
        };
        self.standard.webhook_in_flight.get_or_create(&l).inc();
        WebhookTimer {
            metrics: self.clone(),
            labels: l,
            start: Instant::now(),
        }
    }

    /// Sets `leader_election_master_status` for the Lease `name`. A replica that stops
    /// leading empties its work queues: what waited there waits for the Lease now.
    pub(crate) fn leading(&self, name: &str, leading: bool) {
        let l = standard::LeaseLabels {
            name: name.to_string(),
        };
        self.standard.leader.get_or_create(&l).set(i64::from(leading));
        if !leading {
            self.standard.clear_queues();
        }
    }

    /// The Prometheus text exposition of every metric.
    pub fn encode(&self) -> String {
        self.measure_caches();
        for (labels, active) in self.optional_watches() {
            self.optional_active.get_or_create(&labels).set(i64::from(active));
        }
        self.standard.refresh();
        self.process.refresh();
        let mut out = String::new();
        // Encoding into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode_registry(&mut out, &self.registry);
        let custom = self.custom.lock().unwrap_or_else(|p| p.into_inner());
        let _ = prometheus_client::encoding::text::encode_registry(&mut out, &custom);
        let _ = prometheus_client::encoding::text::encode_eof(&mut out);
        out
    }

    /// Serves an operator's own metric on `/metrics` beside opkit's, under `name` as given (no
    /// prefix; a counter gets `_total`): a [`prometheus_client`] `Counter`, `Gauge`,
    /// `Histogram` or `Family`. Register it where the controller is added (the registration's
    /// `add` has the manager, and [`crate::Manager::metrics`]) and keep a clone in the
    /// controller to update, e.g. from `observe` or a cleanup step; a plan stays pure.
    pub fn register(&self, name: &str, help: &str, metric: impl prometheus_client::registry::Metric) {
        self.custom
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .register(name, help, metric);
    }

    /// Sets the cache gauges from the caches themselves (a controller watching several
    /// namespaces has one cache per namespace and kind; they are summed).
    fn measure_caches(&self) {
        let mut sums: HashMap<CacheLabels, (usize, usize)> = HashMap::new();
        for (labels, probe) in self.caches.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            let (objects, bytes) = probe();
            let sum = sums.entry(labels.clone()).or_default();
            sum.0 += objects;
            sum.1 += bytes;
        }
        for (labels, (objects, bytes)) in sums {
            self.cache_objects
                .get_or_create(&labels)
                .set(i64::try_from(objects).unwrap_or(i64::MAX));
            self.cache_bytes
                .get_or_create(&labels)
                .set(i64::try_from(bytes).unwrap_or(i64::MAX));
        }
    }

    /// Each optional watch by (controller, kind): active only when it is in every namespace
    /// watched.
    fn optional_watches(&self) -> std::collections::BTreeMap<CacheLabels, bool> {
        let mut all = std::collections::BTreeMap::new();
        for (labels, active) in self.optional.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            let a = all.entry(labels.clone()).or_insert(true);
            *a &= active.load(Ordering::SeqCst);
        }
        all
    }

    /// The optional watches waiting for their kind to be installed, as `controller/Kind`: what
    /// `/readyz` mentions, without counting them as unready.
    pub(crate) fn inactive_watches(&self) -> Vec<String> {
        self.optional_watches()
            .into_iter()
            .filter(|(_, active)| !active)
            .map(|(l, _)| format!("{}/{}", l.controller, l.kind))
            .collect()
    }

    /// The value of one series of the exposition, e.g.
    /// `opkit_cache_objects{controller="memcached",kind="Memcached"}` (0 when absent): for
    /// tests and benchmarks that wait on a metric.
    pub fn sample(&self, series: &str) -> f64 {
        self.encode()
            .lines()
            .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
            .unwrap_or(0.0)
    }

    /// The handle one controller records through.
    pub fn for_controller(&self, controller: &str) -> ControllerMetrics {
        let totals = self
            .totals
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(controller.to_string())
            .or_default()
            .clone();
        let c = ControllerMetrics {
            metrics: self.clone(),
            controller: controller.to_string(),
            totals,
        };
        c.zero();
        c
    }
}

/// Metrics of one controller.
#[derive(Clone, Debug)]
pub struct ControllerMetrics {
    metrics: Metrics,
    controller: String,
    totals: Arc<Totals>,
}

impl ControllerMetrics {
    /// Marks a reconcile as running and returns the guard that records how it finished (and
    /// how long it took) — counted at the end, so a test waiting on the count waits for the
    /// work, not its start.
    pub(crate) fn reconcile_started(&self) -> ReconcileTimer {
        self.metrics.active.get_or_create(&self.label()).inc();
        self.metrics
            .standard
            .workers
            .get_or_create(&self.cr_label())
            .inc();
        ReconcileTimer {
            metrics: self.clone(),
            start: Instant::now(),
        }
    }

    /// Counts objects the sharder moved (`move_`: `assigned` or `drained`).
    pub(crate) fn shard_moved(&self, move_: &str, n: usize) {
        let l = MoveLabels {
            controller: self.controller.clone(),
            r#move: move_.to_string(),
        };
        self.metrics.shard_moves.get_or_create(&l).inc_by(n as u64);
    }

    /// Records how long an object took to reach its new owner.
    pub(crate) fn shard_handover(&self, seconds: f64) {
        let l = ControllerLabel {
            controller: self.controller.clone(),
        };
        self.metrics.shard_handover.get_or_create(&l).observe(seconds);
    }

    /// Sets the number of live members the sharder places objects on.
    pub(crate) fn shard_members(&self, n: usize) {
        let l = ControllerLabel {
            controller: self.controller.clone(),
        };
        self.metrics.shard_members.get_or_create(&l).set(n as i64);
    }

    /// Counts a failed reconcile under its error category.
    pub fn reconcile_failed(&self, category: &str) {
        let l = ErrorLabels {
            controller: self.controller.clone(),
            category: category.to_string(),
        };
        self.metrics.failures.get_or_create(&l).inc();
        self.totals.failed.fetch_add(1, Ordering::SeqCst);
        self.metrics.standard.errors.get_or_create(&self.cr_label()).inc();
        self.queue().retry();
    }

    /// This controller's work queue, as client-go's `workqueue_*` families see it.
    pub(crate) fn queue(&self) -> Queue {
        self.metrics.standard.queue(&self.controller)
    }

    /// Publishes how many reconciles may run at once (0: unbounded).
    pub(crate) fn max_concurrent(&self, n: u16) {
        self.metrics
            .standard
            .max_workers
            .get_or_create(&self.cr_label())
            .set(i64::from(n));
    }

    /// Reports a cache of `kind` in `opkit_cache_objects` and `opkit_cache_bytes_estimate`;
    /// `probe` is called at every scrape and returns (objects, estimated bytes).
    pub(crate) fn cache(&self, kind: &str, probe: impl Fn() -> (usize, usize) + Send + Sync + 'static) {
        let labels = self.kind_label(kind);
        self.metrics
            .caches
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((labels, Box::new(probe)));
    }

    /// Counts the watched objects of `kind` that did not decode; its series is there, at 0,
    /// from the start, so that an alert on it has data before the first.
    pub(crate) fn undecodable(&self, kind: &str) -> Counter {
        let labels = self.kind_label(kind);
        self.metrics.undecodable.get_or_create(&labels).clone()
    }

    /// Reports an optional watch of `kind` in `opkit_optional_watch_active` and `/readyz`;
    /// `active` says whether its kind is served now.
    pub(crate) fn optional_watch(&self, kind: &str, active: Arc<AtomicBool>) {
        let labels = self.kind_label(kind);
        self.metrics
            .optional
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((labels, active));
    }

    /// Counts one act outside the cluster that ended with `result`.
    pub(crate) fn call_ended(&self, step: &str, result: &str) {
        let l = CallLabels {
            controller: self.controller.clone(),
            step: step.to_string(),
            result: result.to_string(),
        };
        self.metrics.calls.get_or_create(&l).inc();
    }

    /// Counts a reconcile that panicked; the caller also counts it as failed.
    pub(crate) fn reconcile_panicked(&self) {
        self.metrics.panics.get_or_create(&self.label()).inc();
        self.metrics.standard.panics.get_or_create(&self.cr_label()).inc();
    }

    /// Counts a write the leader-election gate refused.
    pub fn write_refused(&self) {
        self.metrics.refused.get_or_create(&self.label()).inc();
    }

    /// Counts one write to the API (`apply`, `apply_status`, `create`, `delete`, `event`).
    pub fn write(&self, verb: &str) {
        let l = WriteLabels {
            controller: self.controller.clone(),
            verb: verb.to_string(),
        };
        self.metrics.writes.get_or_create(&l).inc();
        self.totals.writes.fetch_add(1, Ordering::SeqCst);
    }

    /// This controller's writes so far by verb (`apply 3, event 1`), for test failures.
    pub fn describe_writes(&self) -> String {
        self.describe("opkit_api_writes_total{")
    }

    /// This controller's failed reconciles so far by category, for test failures.
    pub fn describe_errors(&self) -> String {
        self.describe("opkit_reconcile_errors_total{")
    }

    fn describe(&self, family: &str) -> String {
        let mut out: Vec<String> = self
            .metrics
            .encode()
            .lines()
            .filter(|l| l.starts_with(family))
            .filter(|l| l.contains(&format!("controller=\"{}\"", self.controller)))
            .map(|l| l.to_string())
            .collect();
        out.sort();
        out.join(", ")
    }

    /// Writes made so far by this controller, over all verbs (for tests and benchmarks).
    pub fn writes_total(&self) -> u64 {
        self.totals.writes.load(Ordering::SeqCst)
    }

    /// Reconciles finished so far by this controller, whatever the result.
    pub fn reconciles_total(&self) -> u64 {
        self.totals.finished.load(Ordering::SeqCst)
    }

    /// Reconciles of this controller that failed so far, whatever the category.
    pub fn reconciles_failed(&self) -> u64 {
        self.totals.failed.load(Ordering::SeqCst)
    }

    /// Reconciles running right now.
    pub fn reconciles_active(&self) -> i64 {
        self.metrics.active.get_or_create(&self.label()).get()
    }

    /// Listed objects of this controller waiting for their resync, or handed to the work
    /// queue for it and not started yet.
    pub fn resync_pending(&self) -> i64 {
        self.metrics.resync_pending.get_or_create(&self.label()).get()
    }

    /// The gauge behind [`ControllerMetrics::resync_pending`], which the resync of each
    /// watched namespace moves by its own count.
    pub(crate) fn resync_gauge(&self) -> Gauge {
        self.metrics.resync_pending.get_or_create(&self.label()).clone()
    }

    /// Status writes of this controller that its primary cache does not show yet, or whose
    /// reconcile is still under way: 0 when nothing is in flight.
    pub fn status_writes_unseen(&self) -> i64 {
        self.metrics.status_unseen.get_or_create(&self.label()).get()
    }

    /// The gauge behind [`ControllerMetrics::status_writes_unseen`].
    pub(crate) fn status_unseen_gauge(&self) -> Gauge {
        self.metrics.status_unseen.get_or_create(&self.label()).clone()
    }

    fn kind_label(&self, kind: &str) -> CacheLabels {
        CacheLabels {
            controller: self.controller.clone(),
            kind: kind.to_string(),
        }
    }

    fn label(&self) -> ControllerLabel {
        ControllerLabel {
            controller: self.controller.clone(),
        }
    }

    /// Creates this controller's series at 0, as controller-runtime does: a rate or an
    /// alert on a counter then has data before the first event it counts.
    fn zero(&self) {
        let m = &self.metrics;
        let _ = m.refused.get_or_create(&self.label());
        let _ = m.panics.get_or_create(&self.label());
        let _ = m.active.get_or_create(&self.label());
        let _ = m.resync_pending.get_or_create(&self.label());
        let _ = m.status_unseen.get_or_create(&self.label());
        let _ = m.duration.get_or_create(&self.label());
        self.metrics.standard.zero(&self.controller);
    }

    fn cr_label(&self) -> standard::Controller {
        standard::Controller {
            controller: self.controller.clone(),
        }
    }
}

/// Records how a reconcile finished; dropped unfinished (cancelled), it still leaves the
/// active count.
pub(crate) struct ReconcileTimer {
    metrics: ControllerMetrics,
    start: Instant,
}

impl ReconcileTimer {
    /// Counts the reconcile under `result` and records its duration.
    pub(crate) fn finish(self, result: &str) {
        let m = &self.metrics;
        let l = ResultLabels {
            controller: m.controller.clone(),
            result: result.to_string(),
        };
        m.metrics.reconciles.get_or_create(&l).inc();
        let seconds = self.start.elapsed().as_secs_f64();
        m.metrics.duration.get_or_create(&m.label()).observe(seconds);
        // controller-runtime's results: an invalid spec is its terminal error (not retried
        // until the object changes), a `Retry` an error; every other outcome succeeded.
        let standard = &m.metrics.standard;
        let cr = match result {
            "error" => "error",
            "retry" => {
                standard.errors.get_or_create(&m.cr_label()).inc();
                "error"
            }
            "invalid" => {
                standard.errors.get_or_create(&m.cr_label()).inc();
                standard.terminal.get_or_create(&m.cr_label()).inc();
                "error"
            }
            _ => "success",
        };
        let l = standard::ControllerResult {
            controller: m.controller.clone(),
            result: cr.to_string(),
        };
        standard.reconciles.get_or_create(&l).inc();
        standard.time.get_or_create(&m.cr_label()).observe(seconds);
        m.totals.finished.fetch_add(1, Ordering::SeqCst);
    }
}

impl Drop for ReconcileTimer {
    fn drop(&mut self) {
        let m = &self.metrics;
        m.metrics.active.get_or_create(&m.label()).dec();
        m.metrics.standard.workers.get_or_create(&m.cr_label()).dec();
    }
}

/// Records how a webhook request ended (see [`Metrics::webhook_started`]).
pub(crate) struct WebhookTimer {
    metrics: Metrics,
    labels: standard::WebhookLabels,
    start: Instant,
}

impl WebhookTimer {
    /// Counts the request under its HTTP status code.
    pub(crate) fn finish(self, code: u16) {
        let s = &self.metrics.standard;
        s.webhook_latency
            .get_or_create(&self.labels)
            .observe(self.start.elapsed().as_secs_f64());
        let l = standard::WebhookCodeLabels {
            webhook: self.labels.webhook.clone(),
            code: code.to_string(),
        };
        s.webhook_requests.get_or_create(&l).inc();
    }
}

impl Drop for WebhookTimer {
    fn drop(&mut self) {
        self.metrics
            .standard
            .webhook_in_flight
            .get_or_create(&self.labels)
            .dec();
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_operators_own_metric_is_served_beside_opkits() {
        let m = super::Metrics::default();
        let lookups = prometheus_client::metrics::counter::Counter::<u64>::default();
        m.register("dns_lookups", "Lookups of the outside DNS", lookups.clone());
        lookups.inc_by(3);
        let text = m.encode();
        assert_eq!(m.sample("dns_lookups_total"), 3.0, "{text}");
        assert!(
            text.contains("opkit_reconcile_total") || text.contains("# HELP opkit_"),
            "{text}"
        );
        assert_eq!(text.matches("# EOF").count(), 1, "one exposition: {text}");
        assert!(text.trim_end().ends_with("# EOF"));
    }

    use super::*;

    #[test]
    fn encoded_metrics_carry_controller_and_verb_labels() {
        let m = Metrics::default();
        let c = m.for_controller("memcached");
        let t = c.reconcile_started();
        assert_eq!(c.reconciles_active(), 1);
        t.finish("success");
        assert_eq!(c.reconciles_active(), 0);
        c.reconcile_failed("apply");
        c.write("apply");
        c.write("apply");
        let text = m.encode();
        assert!(
            text.contains("opkit_reconcile_total{controller=\"memcached\",result=\"success\"} 1"),
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
        assert_eq!((c.writes_total(), c.reconciles_total()), (2, 1));
    }

    #[test]
    fn an_optional_watch_is_active_only_in_every_namespace_and_named_while_it_waits() {
        let m = Metrics::default();
        let (a, b) = (Arc::new(AtomicBool::new(true)), Arc::new(AtomicBool::new(false)));
        // One watch per namespace watched, and a second controller sharing the first's.
        m.for_controller("lit").optional_watch("Lamp", a.clone());
        m.for_controller("lit").optional_watch("Lamp", b.clone());
        m.for_controller("dim").optional_watch("Lamp", a.clone());
        let gauge = |c: &str| format!("opkit_optional_watch_active{{controller=\"{c}\",kind=\"Lamp\"}}");
        assert_eq!(m.inactive_watches(), ["lit/Lamp"]);
        assert!(m.encode().contains(&format!("{} 0", gauge("lit"))));
        assert_eq!(m.sample(&gauge("dim")), 1.0);
        b.store(true, Ordering::SeqCst);
        assert!(m.inactive_watches().is_empty());
        assert_eq!(m.sample(&gauge("lit")), 1.0);
        a.store(false, Ordering::SeqCst);
        assert_eq!(m.inactive_watches(), ["dim/Lamp", "lit/Lamp"]);
    }

    #[test]
    fn caches_are_measured_at_scrape_and_summed_over_namespaces() {
        let m = Metrics::default();
        let c = m.for_controller("memcached");
        let n = Arc::new(AtomicU64::new(3));
        let n2 = n.clone();
        c.cache("Pod", move || (n2.load(Ordering::SeqCst) as usize, 300));
        c.cache("Pod", || (2, 200));
        c.cache("Deployment", || (1, 1000));
        let text = m.encode();
        assert!(
            text.contains("opkit_cache_objects{controller=\"memcached\",kind=\"Pod\"} 5"),
            "{text}"
        );
        assert!(
            text.contains("opkit_cache_bytes_estimate{controller=\"memcached\",kind=\"Pod\"} 500"),
            "{text}"
        );
        assert!(
            text.contains("opkit_cache_objects{controller=\"memcached\",kind=\"Deployment\"} 1"),
            "{text}"
        );
        n.store(10, Ordering::SeqCst);
        assert!(
            m.encode()
                .contains("opkit_cache_objects{controller=\"memcached\",kind=\"Pod\"} 12")
        );
    }
}
