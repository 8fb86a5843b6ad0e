//! Whole reconciles in memory, for tests that need no control plane: an [`ApiServer`] in the
//! test process, and a [`Harness`] that runs an operator's controllers on it through
//! [`crate::Operator::start`] — the same watches, caches, plans and write path as in a
//! cluster — and reports the writes each step made.
//!
//! What it catches that a unit test of a plan does not: a plan whose output the write path
//! cannot skip (it writes on every reconcile), a status that never settles, a child that is
//! pruned or never made, a missing Event. What it does not replace: anything that needs the
//! cluster's other controllers (a Deployment's Pods, its status), admission, defaulting or
//! schema validation — for those, test on a real control plane (`opkit-testenv`).
//!
//! ```no_run
//! # async fn doc(op: opkit_runtime::Operator<()>) -> Result<(), Box<dyn std::error::Error>> {
//! use opkit_runtime::kube::api::{Api, PostParams};
//! use opkit_runtime::k8s_openapi::api::core::v1::ConfigMap;
//! use opkit_runtime::testing::Harness;
//!
//! let mut h = Harness::start(op, &["mirror"], ()).await?;
//! let cms: Api<ConfigMap> = Api::namespaced(h.client(), "default");
//! let mut cm = ConfigMap::default();
//! cm.metadata.name = Some("settings".into());
//! cms.create(&PostParams::default(), &cm).await?;
//! let writes = h.settle().await?;
//! assert_eq!(writes.applied("ConfigMap").len(), 1, "{writes}");
//! // Converged: a reconcile now (the resync after a restart) writes nothing.
//! let resync = h.resync().await?;
//! assert!(resync.is_empty() && resync.reconciles() > 0, "{resync}");
//! # Ok(())
//! # }
//! ```
mod apply;
mod select;
pub(crate) mod server;

use std::time::Duration;

pub use server::{ApiServer, Recorded};
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::{Connect, Operator, RunConfig, RunError};

/// Who the operator's requests are recorded as.
pub const OPERATOR: &str = "operator";

/// How long a step that had a failed reconcile waits for its retries: past the first two of
/// the default backoff (0.5 s, then 1 s, each with jitter).
const RETRIES: Duration = Duration::from_secs(3);

/// Who the test's own requests ([`Harness::client`]) are recorded as.
pub const TEST: &str = "test";

/// Why a [`Harness`] step failed.
#[derive(Debug, thiserror::Error)]
#[allow(missing_docs)] // every variant says what failed in its message
pub enum HarnessError {
    #[error(transparent)]
    Run(#[from] RunError),
    #[error("the operator stopped: {0}")]
    Stopped(String),
    #[error("the controllers did not settle within {within:?}: {state}")]
    Busy { within: Duration, state: String },
}

/// The writes the operator made in one step, in order.
#[derive(Debug, Clone, Default)]
pub struct Writes {
    writes: Vec<Recorded>,
    reconciles: u64,
    failures: u64,
}

/// Whether a create is the POST of a child a plan applies ([`crate::diff::CREATED_SHAPE`]).
fn created_to_apply(r: &Recorded) -> bool {
    r.body["metadata"]["annotations"]
        .get(crate::diff::CREATED_SHAPE)
        .is_some()
}

impl Writes {
    /// How many reconciles finished during the step: that a step which wrote nothing did
    /// reconcile (a resync that looked at every object and found nothing to do).
    pub fn reconciles(&self) -> u64 {
        self.reconciles
    }

    /// How many reconciles failed during the step (each is retried with backoff; a step
    /// that ends with failures has not converged).
    pub fn failures(&self) -> u64 {
        self.failures
    }

    /// Every write, in order.
    pub fn all(&self) -> &[Recorded] {
        &self.writes
    }

    /// Whether the step wrote nothing: what a converged object must give.
    pub fn is_empty(&self) -> bool {
        self.writes.is_empty()
    }

    /// How many writes the step made.
    pub fn len(&self) -> usize {
        self.writes.len()
    }

    /// The writes of children of `kind` a plan applies ([`crate::Child::apply`]): server-side
    /// applies (not to a status), and the POSTs that create such children.
    pub fn applied(&self, kind: &str) -> Vec<&Recorded> {
        self.writes
            .iter()
            .filter(|r| r.kind == kind && r.subresource.is_none())
            .filter(|r| r.verb == "apply" || (r.verb == "create" && created_to_apply(r)))
            .collect()
    }

    /// The patches (not applies) of objects of `kind` (a [`crate::Child::merge_dynamic`]).
    pub fn patched(&self, kind: &str) -> Vec<&Recorded> {
        self.writes
            .iter()
            .filter(|r| r.verb == "patch" && r.kind == kind && r.subresource.is_none())
            .collect()
    }

    /// The creates of objects of `kind` (a child made with [`crate::Child::create`]; those of
    /// a [`crate::Child::apply`] are in [`Writes::applied`]).
    pub fn created(&self, kind: &str) -> Vec<&Recorded> {
        self.writes
            .iter()
            .filter(|r| r.verb == "create" && r.kind == kind && !created_to_apply(r))
            .collect()
    }

    /// The writes to the status subresource, of any kind.
    pub fn statuses(&self) -> Vec<&Recorded> {
        self.writes
            .iter()
            .filter(|r| r.subresource.as_deref() == Some("status"))
            .collect()
    }

    /// The deletions of objects of `kind`.
    pub fn deleted(&self, kind: &str) -> Vec<&Recorded> {
        self.writes
            .iter()
            .filter(|r| r.verb == "delete" && r.kind == kind)
            .collect()
    }

    /// The reasons of the Events published, in order.
    pub fn events(&self) -> Vec<String> {
        self.writes
            .iter()
            .filter(|r| r.kind == "Event" && r.verb == "create")
            .filter_map(|r| r.body["reason"].as_str().map(String::from))
            .collect()
    }
}

impl std::fmt::Display for Writes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.writes.is_empty() {
            write!(f, "no writes")?;
        } else {
            let lines: Vec<String> = self.writes.iter().map(|r| r.to_string()).collect();
            write!(f, "{} writes: {}", lines.len(), lines.join("; "))?;
        }
        if self.failures > 0 {
            write!(f, "; {} reconciles failed", self.failures)?;
        }
        Ok(())
    }
}

/// An operator's controllers running on an [`ApiServer`] in memory.
pub struct Harness {
    server: ApiServer,
    controllers: Vec<String>,
    metrics: Metrics,
    stop: CancellationToken,
    handle: Option<tokio::task::JoinHandle<Result<(), RunError>>>,
    /// Requests reported by earlier steps.
    seen: usize,
    /// Reconciles reported by earlier steps of this run.
    reconciled: u64,
    window: Duration,
    within: Duration,
    run: Box<
        dyn Fn(ApiServer) -> futures::future::BoxFuture<'static, Result<Started, RunError>> + Send + Sync,
    >,
}

/// A running operator: what stops it and what it returns.
type Started = (
    CancellationToken,
    Metrics,
    tokio::task::JoinHandle<Result<(), RunError>>,
);

impl Harness {
    /// Starts the registry entries `controllers` of `op` (all, when empty) with `settings` on
    /// a new, empty server that serves the operator's CRDs, as `opkit run --controllers`
    /// would in a cluster; no leader election, probes or webhooks.
    pub async fn start<S>(op: Operator<S>, controllers: &[&str], settings: S) -> Result<Harness, HarnessError>
    where
        S: Send + Sync + 'static,
    {
        let server = ApiServer::new();
        for crd in op.registry.crds() {
            server.install_crd(&crd);
        }
        let names: Vec<String> = if controllers.is_empty() {
            op.registry.names().iter().map(|s| s.to_string()).collect()
        } else {
            controllers.iter().map(|s| s.to_string()).collect()
        };
        let shared = std::sync::Arc::new((op, settings, names.clone()));
        let run = Box::new(move |server: ApiServer| {
            let shared = shared.clone();
            Box::pin(async move {
                let (op, settings, wanted) = &*shared;
                let mut config = RunConfig {
                    controllers: wanted.clone(),
                    crd_wait: Duration::from_secs(5),
                    ..Default::default()
                };
                config.manager.handle_signals = false;
                config.manager.shutdown_timeout = Duration::from_secs(5);
                let (stop, metrics) = (config.shutdown.clone(), config.metrics.clone());
                let started = op
                    .start(Connect::Client(server.client_as(OPERATOR)), config, settings)
                    .await?;
                Ok((stop, metrics, tokio::spawn(started.wait())))
            }) as futures::future::BoxFuture<'static, Result<Started, RunError>>
        });
        let (stop, metrics, handle) = run(server.clone()).await?;
        Ok(Harness {
            server,
            controllers: names,
            metrics,
            stop,
            handle: Some(handle),
            seen: 0,
            reconciled: 0,
            window: Duration::from_millis(400),
            within: Duration::from_secs(30),
            run,
        })
    }

    /// How long nothing may happen for the controllers to count as settled (400 ms by
    /// default): longer than any short requeue the controllers under test ask for.
    pub fn with_window(mut self, window: Duration) -> Self {
        self.window = window;
        self
    }

    /// A client for the test's own reads and writes (recorded as [`TEST`]'s, never reported
    /// as the operator's).
    pub fn client(&self) -> kube::Client {
        self.server.client_as(TEST)
    }

    /// The server, for what the test wants to look at directly.
    pub fn server(&self) -> &ApiServer {
        &self.server
    }

    /// The metrics the controllers report to.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    fn idle(&self) -> bool {
        self.server.watches_caught_up(OPERATOR)
            && self.controllers.iter().all(|c| {
                let m = self.metrics.for_controller(c);
                m.reconciles_active() == 0 && m.resync_pending() == 0 && m.queue().depth() == 0
            })
    }

    /// The reconciles of the controllers under test that failed so far in this run.
    fn failures(&self) -> u64 {
        self.controllers
            .iter()
            .map(|c| self.metrics.for_controller(c).reconciles_failed())
            .sum()
    }

    async fn running(&mut self) -> Result<(), HarnessError> {
        match &self.handle {
            Some(h) if !h.is_finished() => Ok(()),
            _ => match self.handle.take() {
                Some(h) => match h.await {
                    Ok(Ok(())) => Err(HarnessError::Stopped("it returned".into())),
                    Ok(Err(e)) => Err(HarnessError::Run(e)),
                    Err(e) => Err(HarnessError::Stopped(e.to_string())),
                },
                None => Err(HarnessError::Stopped("it is not running".into())),
            },
        }
    }

    /// Waits until the work that is due has finished — every watch event delivered, no
    /// reconcile running, queued or waiting in the resync, and then no request for the window — and returns the
    /// writes the operator made since the last step. After a failed reconcile the window is
    /// longer than its first retries' backoff, so that they belong to this step.
    pub async fn settle(&mut self) -> Result<Writes, HarnessError> {
        let deadline = tokio::time::Instant::now() + self.within;
        let failed_before = self.failures();
        loop {
            self.running().await?;
            if self.idle() {
                let before = (self.server.request_count(), self.failures());
                let window = if before.1 > failed_before {
                    self.window.max(RETRIES)
                } else {
                    self.window
                };
                tokio::time::sleep(window).await;
                if self.idle() && (self.server.request_count(), self.failures()) == before {
                    break;
                }
            } else {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            if tokio::time::Instant::now() > deadline {
                let last: Vec<String> = self
                    .server
                    .requests()
                    .iter()
                    .rev()
                    .take(5)
                    .map(|r| format!("{} by {}", r, r.who))
                    .collect();
                return Err(HarnessError::Busy {
                    within: self.within,
                    state: format!(
                        "watches caught up: {}, last requests: {}",
                        self.server.watches_caught_up(OPERATOR),
                        last.join("; ")
                    ),
                });
            }
        }
        let requests = self.server.requests();
        let writes = requests[self.seen..]
            .iter()
            .filter(|r| r.who == OPERATOR && r.is_write())
            .cloned()
            .collect();
        self.seen = requests.len();
        let reconciled: u64 = self
            .controllers
            .iter()
            .map(|c| self.metrics.for_controller(c).reconciles_total())
            .sum();
        let reconciles = reconciled - self.reconciled;
        self.reconciled = reconciled;
        let failures = self.failures().saturating_sub(failed_before);
        Ok(Writes {
            writes,
            reconciles,
            failures,
        })
    }

    /// Stops the operator and starts it again on the same server, with new caches and no
    /// memory of its writes: its first reconcile of every object is the resync after a
    /// restart, which must write nothing for an object that has converged.
    pub async fn restart(&mut self) -> Result<(), HarnessError> {
        self.shutdown().await?;
        let (stop, metrics, handle) = (self.run)(self.server.clone()).await?;
        (self.stop, self.metrics, self.handle) = (stop, metrics, Some(handle));
        self.reconciled = 0;
        Ok(())
    }

    /// Restarts the operator and settles: the writes of the resync, which for objects that
    /// have converged must be none. A plan that writes on every reconcile (a timestamp in a
    /// child, a list in a new order each time) shows here.
    pub async fn resync(&mut self) -> Result<Writes, HarnessError> {
        self.settle().await?;
        self.restart().await?;
        self.settle().await
    }

    async fn shutdown(&mut self) -> Result<(), HarnessError> {
        self.stop.cancel();
        match self.handle.take() {
            Some(h) => match h.await {
                Ok(r) => Ok(r?),
                Err(e) => Err(HarnessError::Stopped(e.to_string())),
            },
            None => Ok(()),
        }
    }

    /// Stops the operator gracefully and returns how it ended.
    pub async fn stop(mut self) -> Result<(), HarnessError> {
        self.shutdown().await
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(h) = self.handle.take() {
            h.abort();
        }
    }
}
