//! What the runtime keeps per controller: client, field manager, metrics, Events, backoff.
use std::fmt::Debug;

use kube::runtime::controller::Action;
use kube::runtime::events::{Event as KubeEvent, Recorder, Reporter};
use kube::{Client, Resource};
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::metrics::ControllerMetrics;
use crate::reconciler::Event;
use crate::runtime::Error;

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
}

impl Debug for ControllerContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControllerContext")
            .field("name", &self.name)
            .finish()
    }
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
        client: Client,
        metrics: ControllerMetrics,
        shutdown: CancellationToken,
    ) -> Self {
        let reporter = Reporter {
            controller: format!("opkit-{name}"),
            instance: std::env::var("POD_NAME").ok(),
        };
        ControllerContext {
            name,
            field_manager: format!("opkit-{name}"),
            recorder: Recorder::new(client.clone(), reporter),
            client,
            metrics,
            backoff: Backoff::default(),
            shutdown,
        }
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

    /// Counts the failure and retries with per-object exponential backoff.
    pub(crate) fn error_policy<K: Resource<DynamicType = ()>>(&self, obj: &K, err: &Error) -> Action {
        self.metrics.reconcile_failed(err.category());
        let delay = self.backoff.next_delay(&key(obj));
        tracing::warn!(controller = self.name, object = %key(obj), error = %err, ?delay, "reconcile failed");
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
        self.metrics.write("event");
        if let Err(err) = self.recorder.publish(&ev, &obj.object_ref(&())).await {
            tracing::warn!(controller = self.name, object = %key(obj), error = %err, reason = e.reason, "publishing an Event failed");
        }
    }
}
