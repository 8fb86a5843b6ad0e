//! What a controller gets from the manager: client, field manager, metrics, Events, backoff.
use std::fmt::Debug;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;

use crate::apply::needs_apply;
use crate::backoff::Backoff;
use crate::metrics::{ControllerMetrics, ReconcileTimer};

/// Errors a reconcile can return, sorted for metrics and retry decisions.
pub trait ReconcileError: std::error::Error {
    /// A short stable label (`apply`, `build`, ...) for metrics and logs.
    fn category(&self) -> &'static str;
}

/// Everything one controller needs from its manager. Cheap to clone.
#[derive(Clone)]
pub struct ControllerContext {
    name: &'static str,
    field_manager: String,
    client: Client,
    recorder: Recorder,
    metrics: ControllerMetrics,
    backoff: Backoff,
    ready: Arc<AtomicBool>,
    shutdown: CancellationToken,
}

impl Debug for ControllerContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControllerContext")
            .field("name", &self.name)
            .finish()
    }
}

fn key<K: Resource>(obj: &K) -> String {
    format!(
        "{}/{}",
        obj.meta().namespace.as_deref().unwrap_or(""),
        obj.meta().name.as_deref().unwrap_or("")
    )
}

impl ControllerContext {
    pub(crate) fn new(
        name: &'static str,
        client: Client,
        metrics: ControllerMetrics,
        ready: Arc<AtomicBool>,
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
            ready,
            shutdown,
        }
    }

    /// The controller's name (`memcached`, `at`, ...).
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The server-side-apply field manager, `opkit-<controller>`.
    pub fn field_manager(&self) -> &str {
        &self.field_manager
    }

    /// The API client.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// This controller's metrics.
    pub fn metrics(&self) -> &ControllerMetrics {
        &self.metrics
    }

    /// Marks the controller ready for `/readyz` once `fut` (usually a store's
    /// `wait_until_ready`) completes.
    pub fn ready_when<F>(&self, fut: F)
    where
        F: std::future::Future + Send + 'static,
    {
        let ready = self.ready.clone();
        tokio::spawn(async move {
            fut.await;
            ready.store(true, Ordering::SeqCst);
        });
    }

    /// Resolves when the manager shuts down; pass it to `Controller::graceful_shutdown_on` so
    /// in-flight reconciles finish and no new ones start.
    pub fn shutdown_signal(&self) -> impl std::future::Future<Output = ()> + Send + Sync + 'static {
        let token = self.shutdown.clone();
        async move { token.cancelled().await }
    }

    /// Starts measuring one reconcile of `obj`.
    pub fn reconcile_started(&self) -> ReconcileTimer {
        self.metrics.reconcile_started()
    }

    /// Call after a successful reconcile: the object's backoff starts over.
    pub fn reconcile_succeeded<K: Resource>(&self, obj: &K) {
        self.backoff.reset(&key(obj));
    }

    /// The shared `error_policy`: count the failure and retry with per-object exponential
    /// backoff.
    pub fn error_policy<K: Resource, E: ReconcileError>(&self, obj: &K, err: &E) -> Action {
        self.metrics.reconcile_failed(err.category());
        let delay = self.backoff.next_delay(&key(obj));
        tracing::warn!(controller = self.name, object = %key(obj), error = %err, ?delay, "reconcile failed");
        Action::requeue(delay)
    }

    /// Server-side applies `desired` (forcing ownership of the fields it sets) unless `live`
    /// already has all of them; returns whether a write was made.
    pub async fn apply<K>(&self, api: &Api<K>, desired: &K, live: Option<&K>) -> kube::Result<bool>
    where
        K: Resource + Serialize + DeserializeOwned + Clone + Debug,
    {
        if !needs_apply(desired, live) {
            return Ok(false);
        }
        let pp = PatchParams::apply(&self.field_manager).force();
        self.metrics.write("apply");
        api.patch(&desired.name_any(), &pp, &Patch::Apply(desired))
            .await?;
        Ok(true)
    }

    /// Server-side applies a partial object given as JSON (`apiVersion`, `kind`, `metadata.name`
    /// and only the fields this controller owns), e.g. one annotation on someone else's
    /// Deployment. Other managers' fields are left alone.
    pub async fn apply_fields<K>(
        &self,
        api: &Api<K>,
        name: &str,
        fields: &serde_json::Value,
    ) -> kube::Result<K>
    where
        K: Resource + DeserializeOwned + Clone + Debug,
    {
        let pp = PatchParams::apply(&self.field_manager).force();
        self.metrics.write("apply");
        api.patch(name, &pp, &Patch::Apply(fields)).await
    }

    /// Server-side applies a status (`{"apiVersion", "kind", "status"}`) through the status
    /// subresource unless the live status already matches; returns whether a write was made.
    pub async fn apply_status<K>(
        &self,
        api: &Api<K>,
        name: &str,
        desired_status: serde_json::Value,
        live_status: Option<serde_json::Value>,
    ) -> kube::Result<bool>
    where
        K: Resource<DynamicType = ()> + DeserializeOwned + Clone + Debug,
    {
        if let Some(live) = &live_status
            && crate::apply::is_subset(&desired_status, live)
        {
            return Ok(false);
        }
        let body = serde_json::json!({
            "apiVersion": K::api_version(&()),
            "kind": K::kind(&()),
            "status": desired_status,
        });
        let pp = PatchParams::apply(&self.field_manager).force();
        self.metrics.write("apply_status");
        api.patch_status(name, &pp, &Patch::Apply(&body)).await?;
        Ok(true)
    }

    /// Deletes an object (background propagation); a missing object is not an error.
    pub async fn delete<K>(&self, api: &Api<K>, name: &str) -> kube::Result<()>
    where
        K: Resource + DeserializeOwned + Clone + Debug,
    {
        self.metrics.write("delete");
        match api.delete(name, &DeleteParams::background()).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Publishes an Event about `obj` (shown by `kubectl describe`). Failing to publish is
    /// logged, never fatal: an Event is a courtesy, not state.
    pub async fn event<K: Resource<DynamicType = ()>>(
        &self,
        obj: &K,
        type_: EventType,
        reason: &str,
        action: &str,
        note: impl Into<String>,
    ) {
        let ev = Event {
            type_,
            reason: reason.into(),
            note: Some(note.into()),
            action: action.into(),
            secondary: None,
        };
        self.metrics.write("event");
        if let Err(e) = self.recorder.publish(&ev, &obj.object_ref(&())).await {
            tracing::warn!(controller = self.name, object = %key(obj), error = %e, reason, "publishing an Event failed");
        }
    }
}
