//! The Memcached controller: one Deployment of `spec.size` memcached Pods per `Memcached`, with
//! `status.nodes` following the Pods.
//!
//! reconcile = fetch (cache) → validate (pure) → build (pure) → apply (client) → status (client).
mod build;

use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt, StreamExt, future};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::rbac::v1::PolicyRule;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::runtime::controller::{Action, Config as ControllerConfig, Controller};
use kube::runtime::events::EventType;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, ResourceExt};
use opkit::conditions::{self, Desired};
use opkit::{ControllerContext, ReconcileError};
use opkit_api::memcached::{MAX_SIZE, Memcached, MemcachedStatus};

pub use build::{build_deployment, labels, pod_labels, selector};

use crate::Scope;
use crate::rbac::{events, rule};

/// The controller's name (`--controllers memcached`) and metrics label.
pub const NAME: &str = "memcached";
/// Image used when `--memcached-image` is not given.
pub const DEFAULT_IMAGE: &str = "memcached:1.6";
/// Label on every Pod naming its `Memcached` (as in the Operator SDK tutorial).
pub const CR_LABEL: &str = "memcached_cr";

/// Condition types and reasons (what `kubectl describe` shows).
pub mod reason {
    pub const AVAILABLE: &str = "Available";
    pub const PROGRESSING: &str = "Progressing";
    pub const DEGRADED: &str = "Degraded";
    pub const READY: &str = "AllReplicasReady";
    pub const NOT_READY: &str = "ReplicasNotReady";
    pub const SCALING: &str = "Scaling";
    pub const COMPLETE: &str = "Complete";
    pub const AS_EXPECTED: &str = "AsExpected";
    pub const INVALID_SPEC: &str = "InvalidSpec";
}

/// Settings from the command line.
#[derive(Clone, Debug)]
pub struct Config {
    pub image: String,
    pub scope: Scope,
    pub concurrency: u16,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            image: DEFAULT_IMAGE.into(),
            scope: Scope::all(),
            concurrency: crate::DEFAULT_CONCURRENCY,
        }
    }
}

/// The API access this controller uses, for the generated ClusterRole.
pub fn rbac_rules() -> Vec<PolicyRule> {
    vec![
        rule(&["cache.example.com"], &["memcacheds"], &["get", "list", "watch"]),
        rule(&["cache.example.com"], &["memcacheds/status"], &["get", "patch"]),
        rule(
            &["apps"],
            &["deployments"],
            &["get", "list", "watch", "create", "patch"],
        ),
        rule(&[""], &["pods"], &["get", "list", "watch"]),
        events(),
    ]
}

/// Errors, one variant per reconcile step that can fail.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("building the Deployment: {0}")]
    Build(String),
    #[error("applying Deployment {name}: {source}")]
    Apply { name: String, source: kube::Error },
    #[error("writing status: {source}")]
    Status { source: kube::Error },
}

impl ReconcileError for Error {
    fn category(&self) -> &'static str {
        match self {
            Error::Build(_) => "build",
            Error::Apply { .. } => "apply",
            Error::Status { .. } => "status",
        }
    }
}

/// A spec the controller cannot act on (the CRD schema normally refuses these first).
#[derive(Debug, PartialEq, Eq)]
pub struct Invalid(pub String);

/// Checks what the schema should already have refused, for objects stored before it did.
pub fn validate(mc: &Memcached) -> Result<i32, Invalid> {
    let size = mc.spec.size;
    if !(0..=MAX_SIZE).contains(&size) {
        return Err(Invalid(format!(
            "spec.size must be between 0 and {MAX_SIZE}, got {size}"
        )));
    }
    Ok(size)
}

struct State {
    ctx: ControllerContext,
    image: String,
    deployments: Store<Deployment>,
    pods: Store<Pod>,
}

/// Runs the controller until the manager shuts down.
pub async fn run(ctx: ControllerContext, cfg: Config) {
    let client = ctx.client().clone();
    let owned = watcher::Config::default().labels(&selector());
    let mut runs = Vec::new();
    let mut ready = Vec::new();
    for ((mcs, deploys), pods) in cfg
        .scope
        .apis::<Memcached>(&client)
        .into_iter()
        .zip(cfg.scope.apis::<Deployment>(&client))
        .zip(cfg.scope.apis::<Pod>(&client))
    {
        let (deploy_store, deploy_writer) = reflector::store();
        let deploy_stream = reflector::reflector(
            deploy_writer,
            watcher(deploys, owned.clone())
                .default_backoff()
                .modify(|d| d.managed_fields_mut().clear()),
        )
        .touched_objects();
        let (pod_store, pod_writer) = reflector::store();
        // Only names, labels and phase matter here: drop the rest before it reaches the cache.
        let pod_stream = reflector::reflector(
            pod_writer,
            watcher(pods, owned.clone()).default_backoff().modify(|p| {
                p.managed_fields_mut().clear();
                p.spec = None;
                if let Some(s) = p.status.as_mut() {
                    *s = k8s_openapi::api::core::v1::PodStatus {
                        phase: s.phase.take(),
                        ..Default::default()
                    };
                }
            }),
        )
        .touched_objects();
        let controller = Controller::new(mcs, watcher::Config::default())
            .with_config(ControllerConfig::default().concurrency(cfg.concurrency))
            .owns_stream(deploy_stream)
            .watches_stream(pod_stream, |pod: Pod| {
                let name = pod.labels().get(CR_LABEL)?.clone();
                Some(ObjectRef::<Memcached>::new(&name).within(&pod.namespace()?))
            })
            .graceful_shutdown_on(ctx.shutdown_signal());
        let (c, d, p) = (controller.store(), deploy_store.clone(), pod_store.clone());
        ready.push(async move { c.wait_until_ready().await }.boxed());
        ready.push(async move { d.wait_until_ready().await }.boxed());
        ready.push(async move { p.wait_until_ready().await }.boxed());
        let state = Arc::new(State {
            ctx: ctx.clone(),
            image: cfg.image.clone(),
            deployments: deploy_store,
            pods: pod_store,
        });
        runs.push(
            controller
                .run(
                    reconcile,
                    |mc, err, st| st.ctx.error_policy(mc.as_ref(), err),
                    state,
                )
                .for_each(|_| future::ready(())),
        );
    }
    ctx.ready_when(future::join_all(ready));
    future::join_all(runs).await;
}

#[tracing::instrument(skip(mc, st), fields(namespace = mc.namespace(), name = mc.name_any()))]
async fn reconcile(mc: Arc<Memcached>, st: Arc<State>) -> Result<Action, Error> {
    let _timer = st.ctx.reconcile_started();
    let ns = mc.namespace().unwrap_or_default();
    let name = mc.name_any();
    let ctx = &st.ctx;
    let mcs: Api<Memcached> = Api::namespaced(ctx.client().clone(), &ns);
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    let live_status = mc.status.clone().unwrap_or_default();

    // validate (pure)
    let size = match validate(&mc) {
        Ok(size) => size,
        Err(Invalid(msg)) => {
            let was_degraded = conditions::is_true(&live_status.conditions, reason::DEGRADED);
            let conds = conditions::merge(
                &live_status.conditions,
                &[Desired::yes(reason::DEGRADED, reason::INVALID_SPEC, msg.clone())],
                mc.metadata.generation,
                &now,
            );
            let status = MemcachedStatus {
                conditions: conds,
                observed_generation: mc.metadata.generation,
                ..live_status.clone()
            };
            write_status(ctx, &mcs, &name, &status, &live_status).await?;
            if !was_degraded {
                ctx.event(
                    mc.as_ref(),
                    EventType::Warning,
                    reason::INVALID_SPEC,
                    "Validate",
                    msg,
                )
                .await;
            }
            // Nothing to retry until the spec changes.
            return Ok(Action::await_change());
        }
    };

    // build (pure)
    let desired = build_deployment(&mc, size, &st.image).map_err(Error::Build)?;

    // apply (client) — skipped when the cached Deployment already matches
    let deploys: Api<Deployment> = Api::namespaced(ctx.client().clone(), &ns);
    let live = st.deployments.get(&ObjectRef::new(&name).within(&ns));
    let live_replicas = live.as_ref().and_then(|d| d.spec.as_ref()?.replicas);
    if ctx
        .apply(&deploys, &desired, live.as_deref())
        .await
        .map_err(|source| Error::Apply {
            name: name.clone(),
            source,
        })?
    {
        let note = match live_replicas {
            None => format!("Created Deployment {name} with {size} replicas"),
            Some(r) if r != size => format!("Scaled Deployment {name} from {r} to {size} replicas"),
            Some(_) => format!("Restored Deployment {name} to its desired state"),
        };
        ctx.event(mc.as_ref(), EventType::Normal, "DeploymentApplied", "Apply", note)
            .await;
    }

    // status (client) — written only when it changed
    let pods: Vec<Arc<Pod>> = st
        .pods
        .state()
        .into_iter()
        .filter(|p| p.namespace().as_deref() == Some(ns.as_str()) && p.labels().get(CR_LABEL) == Some(&name))
        .collect();
    let status = build::status(&mc, size, live.as_deref(), &pods, &now);
    write_status(ctx, &mcs, &name, &status, &live_status).await?;
    ctx.reconcile_succeeded(mc.as_ref());
    // Watches on the Deployment and its Pods bring us back; the hourly resync is a safety net.
    Ok(Action::requeue(Duration::from_secs(3600)))
}

async fn write_status(
    ctx: &ControllerContext,
    api: &Api<Memcached>,
    name: &str,
    desired: &MemcachedStatus,
    live: &MemcachedStatus,
) -> Result<(), Error> {
    let d = serde_json::to_value(desired).map_err(|e| Error::Build(e.to_string()))?;
    let l = serde_json::to_value(live).map_err(|e| Error::Build(e.to_string()))?;
    ctx.apply_status(api, name, d, Some(l))
        .await
        .map_err(|source| Error::Status { source })?;
    Ok(())
}
