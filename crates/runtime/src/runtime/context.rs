//! What the runtime keeps per controller: client, field manager, metrics, Events, backoff.
use std::fmt::Debug;

use crate::runtime::queue::Action;
use kube::runtime::events::{Event as KubeEvent, Recorder, Reporter};
use kube::{Client, Resource};
use tokio_util::sync::CancellationToken;

use super::Error;
use super::shared::{Echoes, SharedWatches};
use super::status::StatusWrites;
use crate::backoff::Backoff;
use crate::expiring::Expiring;
use crate::leader::WriteGate;
use crate::metrics::ControllerMetrics;
use crate::plan::Event;
use crate::tuning::Tuning;

/// Everything one controller's runtime needs from its manager. Cheap to clone.
#[derive(Clone)]
pub(crate) struct ControllerContext {
    name: &'static str,
    field_manager: String,
    client: Client,
    recorder: Recorder,
    metrics: ControllerMetrics,
    backoff: Backoff,
    shutdown: CancellationToken,
    gate: WriteGate,
    tuning: Tuning,
    echoes: Echoes,
    status: std::sync::Arc<StatusWrites>,
    leading: tokio::sync::watch::Receiver<bool>,
    shared: SharedWatches,
    shard: Option<Shard>,
}

/// A sharded controller's place in its group: which objects are this replica's.
#[derive(Clone, Debug)]
pub(crate) struct Shard {
    /// The label naming an object's owner, and this replica's value of it.
    pub label: String,
    pub member: String,
    /// The label by which the sharder asks for an object back.
    pub drain: String,
    /// The annotation by which the sharder says an object's children may be another's.
    pub adopt: String,
    /// Objects let go of, by UID, with the resourceVersion they were let go from: a copy of
    /// that version still in the cache (its removal not yet seen) is not reconciled.
    pub released: Versions,
    /// Objects adopted, by UID, with the resourceVersion they were adopted from: a copy of
    /// that version still in the cache (the adoption's own write not yet seen) is not planned
    /// from.
    pub adopted: Versions,
}

/// Versions of objects a member has replaced by a write of its own, until its cache has seen
/// the write (seconds); entries are dropped after [`Versions::KEEP`] so that the map stays
/// small whatever the churn.
#[derive(Clone, Debug, Default)]
pub(crate) struct Versions {
    inner: std::sync::Arc<std::sync::Mutex<Expiring<String, (String, std::time::Instant), 1024>>>,
}

impl Versions {
    /// Long past the time a watch event takes to arrive.
    const KEEP: std::time::Duration = std::time::Duration::from_secs(600);

    /// Whether the version `rv` of `uid` is the one recorded; any other version is newer, and
    /// the entry is forgotten.
    pub fn is_replaced(&self, uid: &str, rv: Option<&str>) -> bool {
        let mut m = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        match m.get(uid) {
            Some((v, _)) if Some(v.as_str()) == rv => true,
            Some(_) => {
                m.remove(uid);
                false
            }
            None => false,
        }
    }

    pub fn insert(&self, uid: String, rv: String) {
        let mut m = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        m.sweep(|_, (_, at)| at.elapsed() < Self::KEEP);
        m.insert(uid, (rv, std::time::Instant::now()));
    }
}

impl Debug for ControllerContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControllerContext")
            .field("name", &self.name)
            .finish()
    }
}

/// What every controller of one manager shares.
#[derive(Clone)]
pub(crate) struct Common {
    pub client: Client,
    pub shutdown: CancellationToken,
    pub gate: WriteGate,
    /// True once this replica leads (at once without leader election).
    pub leading: tokio::sync::watch::Receiver<bool>,
    pub shared: SharedWatches,
    /// Set for a sharded controller: `leading` and `gate` are then this replica's member
    /// Lease's.
    pub shard: Option<Shard>,
}

/// Backoff and log key: kind, namespace and name, so two controllers (or two kinds with
/// objects of the same name) never share a failure count.
fn key<K: Resource<DynamicType = ()>>(obj: &K) -> String {
    format!(
        "{}/{}/{}",
        K::kind(&()),
        obj.meta().namespace.as_deref().unwrap_or(""),
        obj.meta().name.as_deref().unwrap_or("")
    )
}

impl ControllerContext {
    pub(crate) fn new(
        name: &'static str,
        metrics: ControllerMetrics,
        tuning: Tuning,
        common: Common,
    ) -> Self {
        let Common {
            client,
            shutdown,
            gate,
            leading,
            shared,
            shard,
        } = common;
        let reporter = Reporter {
            controller: format!("opkit-{name}"),
            instance: std::env::var("POD_NAME").ok(),
        };
        let status = std::sync::Arc::new(StatusWrites::new(metrics.status_unseen_gauge()));
        ControllerContext {
            name,
            field_manager: format!("opkit-{name}"),
            recorder: Recorder::new(client.clone(), reporter),
            client,
            metrics,
            backoff: Backoff::new(tuning.backoff_base, tuning.backoff_max),
            shutdown,
            gate,
            tuning,
            echoes: Echoes::default(),
            status,
            leading,
            shared,
            shard,
        }
    }

    /// Counts a write of `verb` if this process may write now; every write of the runtime
    /// goes through here first.
    pub(crate) fn may_write(&self, verb: &'static str) -> Result<(), Error> {
        self.gate.check().map_err(|_| {
            self.metrics.write_refused();
            Error::NotLeader
        })?;
        self.metrics.write(verb);
        Ok(())
    }

    /// Whether this process may act now (leader, lease certainly valid), for a step outside
    /// the cluster: the same gate as writes, counted as a refused write when closed.
    pub(crate) fn may_call(&self) -> Result<(), Error> {
        self.gate.check().map_err(|_| {
            self.metrics.write_refused();
            Error::NotLeader
        })
    }

    /// Resolves once this replica leads (at once without leader election).
    pub(crate) async fn leading(&self) {
        let mut leading = self.leading.clone();
        let _ = leading.wait_for(|l| *l).await;
    }

    /// The current term of leadership, for [`term_ended`].
    pub(crate) fn term(&self) -> tokio::sync::watch::Receiver<bool> {
        let mut term = self.leading.clone();
        term.borrow_and_update();
        term
    }

    /// Whether this replica leads now (always without leader election).
    pub(crate) fn is_leading(&self) -> bool {
        *self.leading.borrow()
    }

    /// This replica's place among the members, for a sharded controller.
    pub(crate) fn shard(&self) -> Option<&Shard> {
        self.shard.as_ref()
    }

    pub(crate) fn shared(&self) -> &SharedWatches {
        &self.shared
    }

    pub(crate) fn tuning(&self) -> &Tuning {
        &self.tuning
    }

    pub(crate) fn echoes(&self) -> &Echoes {
        &self.echoes
    }

    /// The status writes whose watch events the primary cache has not delivered yet.
    pub(crate) fn status_writes(&self) -> &std::sync::Arc<StatusWrites> {
        &self.status
    }

    /// How long a cleanup that is not done yet waits before looking again: the object's
    /// backoff, so a cleanup waiting on something slow does not spin.
    pub(crate) fn pending_delay<K: Resource<DynamicType = ()>>(&self, obj: &K) -> std::time::Duration {
        self.backoff.next_delay(&key(obj))
    }

    pub(crate) fn field_manager(&self) -> &str {
        &self.field_manager
    }

    pub(crate) fn client(&self) -> &Client {
        &self.client
    }

    pub(crate) fn metrics(&self) -> &ControllerMetrics {
        &self.metrics
    }

    /// Resolves when the manager shuts down.
    pub(crate) fn shutdown_signal(&self) -> impl std::future::Future<Output = ()> + Send + Sync + 'static {
        let token = self.shutdown.clone();
        async move { token.cancelled().await }
    }

    /// After a successful reconcile the object's backoff starts over.
    pub(crate) fn reconcile_succeeded<K: Resource<DynamicType = ()>>(&self, obj: &K) {
        self.backoff.reset(&key(obj));
    }

    /// Counts the failure (a child refused as its namespace goes is none) and retries with
    /// per-object exponential backoff.
    pub(crate) fn error_policy<K: Resource<DynamicType = ()>>(&self, obj: &K, err: &Error) -> Action {
        let delay = self.backoff.next_delay(&key(obj));
        match err {
            Error::NamespaceTerminating { .. } => {
                // Not a failure: a child in the object's own namespace goes with the object
                // (the retry finds it gone); one elsewhere is written again once that
                // namespace is gone and made anew.
                self.metrics.queue().retry();
                tracing::info!(controller = self.name, object = %key(obj), error = %err, ?delay, "waiting for a namespace to go");
            }
            Error::Stale => {
                // Routine with several writers; the newer version is on its way through the watch.
                self.metrics.reconcile_failed(err.category());
                tracing::debug!(controller = self.name, object = %key(obj), ?delay, "stale plan, retrying");
            }
            _ => {
                self.metrics.reconcile_failed(err.category());
                tracing::warn!(controller = self.name, object = %key(obj), error = %err, ?delay, "reconcile failed");
            }
        }
        Action::requeue(delay)
    }

    /// Publishes an Event about `obj`. Failing to publish is logged, never fatal: an Event is
    /// a courtesy, not state.
    pub(crate) async fn event<K: Resource<DynamicType = ()>>(&self, obj: &K, e: &Event) {
        let ev = KubeEvent {
            type_: e.type_,
            reason: e.reason.into(),
            note: Some(e.note.clone()),
            action: e.action.into(),
            secondary: None,
        };
        if self.may_write("event").is_err() {
            return;
        }
        match self.recorder.publish(&ev, &obj.object_ref(&())).await {
            Ok(()) => {}
            // The object goes with its namespace; so would the Event.
            Err(err) if crate::client::namespace_terminating(&err) => {
                tracing::debug!(controller = self.name, object = %key(obj), reason = e.reason, "no Event: the namespace is being deleted");
            }
            Err(err) => {
                tracing::warn!(controller = self.name, object = %key(obj), error = %err, reason = e.reason, "publishing an Event failed")
            }
        }
    }
}

/// Resolves once the term `term` was taken in has ended: the Lease lost, even if it was won
/// back since (never without leader election, where leadership does not change).
pub(crate) async fn term_ended(mut term: tokio::sync::watch::Receiver<bool>) {
    if term.changed().await.is_err() {
        // The manager is gone, and with it the term's end: nothing will announce it.
        std::future::pending::<()>().await;
    }
}

#[cfg(test)]
mod tests {
    use super::Versions;

    #[test]
    fn a_released_version_is_skipped_until_a_newer_one_is_seen() {
        let r = Versions::default();
        r.insert("u1".into(), "10".into());
        assert!(r.is_replaced("u1", Some("10")));
        assert!(r.is_replaced("u1", Some("10")));
        assert!(!r.is_replaced("u2", Some("10")));
        // Placed here again: a newer version is reconciled, and the entry is gone.
        assert!(!r.is_replaced("u1", Some("12")));
        assert!(!r.is_replaced("u1", Some("10")));
    }
}
