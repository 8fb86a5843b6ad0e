//! The Foo controller: client-go's sample-controller contract on opkit. A Deployment named
//! `spec.deploymentName` (nginx, labels `app=nginx`, `controller=<foo>`), owned by the Foo, with
//! `spec.replicas`; `status.availableReplicas` mirrors it. A Deployment of that name the Foo
//! does not control is left alone and reported (upstream's `ErrResourceExists`).
//!
//! Unlike upstream, nothing is written when nothing changed: no status update and no `Synced`
//! Event per sync, so a converged Foo costs no API requests.
//!
//! reconcile = fetch (cache) → build (pure) → create or apply (client) → status (client).
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt, StreamExt, future};
use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{Container, PodSpec, PodTemplateSpec};
use k8s_openapi::api::rbac::v1::PolicyRule;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use kube::api::PostParams;
use kube::runtime::controller::{Action, Config as ControllerConfig, Controller};
use kube::runtime::events::EventType;
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Resource, ResourceExt};
use opkit::{ControllerContext, ReconcileError};
use opkit_api::foo::{Foo, FooStatus};

use crate::Scope;
use crate::rbac::{events, rule};

/// The controller's name (`--controllers foo`) and metrics label.
pub const NAME: &str = "foo";
/// Upstream's image.
pub const IMAGE: &str = "nginx:latest";
/// Upstream's Event reason for a Deployment the Foo does not control.
pub const ERR_RESOURCE_EXISTS: &str = "ErrResourceExists";

/// Settings from the command line.
#[derive(Clone, Debug)]
pub struct Config {
    pub scope: Scope,
    pub concurrency: u16,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            scope: Scope::all(),
            concurrency: crate::DEFAULT_CONCURRENCY,
        }
    }
}

/// The API access this controller uses, for the generated ClusterRole.
pub fn rbac_rules() -> Vec<PolicyRule> {
    vec![
        rule(&["samplecontroller.k8s.io"], &["foos"], &["get", "list", "watch"]),
        rule(&["samplecontroller.k8s.io"], &["foos/status"], &["get", "patch"]),
        rule(
            &["apps"],
            &["deployments"],
            &["get", "list", "watch", "create", "patch"],
        ),
        events(),
    ]
}

/// Errors, one variant per reconcile step that can fail.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Foo {0} has no uid yet")]
    Build(String),
    #[error("Resource {0:?} already exists and is not managed by Foo")]
    Exists(String),
    #[error("creating Deployment {name}: {source}")]
    Create { name: String, source: kube::Error },
    #[error("updating Deployment {name}: {source}")]
    Apply { name: String, source: kube::Error },
    #[error("writing status: {source}")]
    Status { source: kube::Error },
    #[error("encoding status: {0}")]
    Encode(#[from] serde_json::Error),
}

/// `Result` of a reconcile step.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl ReconcileError for Error {
    fn category(&self) -> &'static str {
        match self {
            Error::Build(_) | Error::Encode(_) => "build",
            Error::Exists(_) => "conflict",
            Error::Create { .. } => "create",
            Error::Apply { .. } => "apply",
            Error::Status { .. } => "status",
        }
    }
}

/// Upstream's labels (also put on the Deployment itself, so the cache can select by them).
pub fn labels(foo: &Foo) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app".to_string(), "nginx".to_string()),
        ("controller".to_string(), foo.name_any()),
    ])
}

/// The Deployment a Foo should have (upstream's `newDeployment`), owned by it.
pub fn build_deployment(foo: &Foo) -> Result<Deployment> {
    let owner = foo
        .controller_owner_ref(&())
        .ok_or_else(|| Error::Build(foo.name_any()))?;
    Ok(Deployment {
        metadata: ObjectMeta {
            name: Some(foo.spec.deployment_name.clone()),
            namespace: foo.namespace(),
            labels: Some(labels(foo)),
            owner_references: Some(vec![owner]),
            ..Default::default()
        },
        spec: Some(DeploymentSpec {
            replicas: Some(foo.spec.replicas.unwrap_or(1)),
            selector: LabelSelector {
                match_labels: Some(labels(foo)),
                ..Default::default()
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels(foo)),
                    ..Default::default()
                }),
                spec: Some(PodSpec {
                    containers: vec![Container {
                        name: "nginx".into(),
                        image: Some(IMAGE.into()),
                        ..Default::default()
                    }],
                    ..Default::default()
                }),
            },
            ..Default::default()
        }),
        ..Default::default()
    })
}

/// Whether `d` is controlled by `foo` (same uid).
pub fn controlled_by(d: &Deployment, foo: &Foo) -> bool {
    d.owner_references()
        .iter()
        .any(|o| o.controller == Some(true) && Some(&o.uid) == foo.uid().as_ref())
}

struct State {
    ctx: ControllerContext,
    deployments: reflector::Store<Deployment>,
}

/// Runs the controller until the manager shuts down.
pub async fn run(ctx: ControllerContext, cfg: Config) {
    let client = ctx.client().clone();
    // Upstream's Deployments carry `app=nginx` and `controller`; so do ours, on the object too.
    let owned = watcher::Config::default().labels("app=nginx,controller");
    let mut runs = Vec::new();
    let mut ready = Vec::new();
    for (foos, deploys) in cfg
        .scope
        .apis::<Foo>(&client)
        .into_iter()
        .zip(cfg.scope.apis::<Deployment>(&client))
    {
        let (store, writer) = reflector::store();
        // Only ownership, replicas and availability matter here.
        let stream = reflector::reflector(
            writer,
            watcher(deploys, owned.clone()).default_backoff().modify(|d| {
                d.managed_fields_mut().clear();
                if let Some(s) = d.spec.as_mut() {
                    s.template.spec = None;
                }
                if let Some(s) = d.status.as_mut() {
                    s.conditions = None;
                }
            }),
        )
        .touched_objects();
        // The Foos themselves, without managed fields (a good part of each object, never read).
        let (foo_store, foo_writer) = reflector::store();
        let foo_stream = reflector::reflector(
            foo_writer,
            watcher(foos, watcher::Config::default())
                .default_backoff()
                .modify(|f| f.managed_fields_mut().clear()),
        )
        .applied_objects();
        let controller = Controller::for_stream(foo_stream, foo_store)
            .with_config(ControllerConfig::default().concurrency(cfg.concurrency))
            .owns_stream(stream)
            .graceful_shutdown_on(ctx.shutdown_signal());
        let (c, d) = (controller.store(), store.clone());
        ready.push(async move { c.wait_until_ready().await }.boxed());
        ready.push(async move { d.wait_until_ready().await }.boxed());
        let state = Arc::new(State {
            ctx: ctx.clone(),
            deployments: store,
        });
        runs.push(
            controller
                .run(
                    reconcile,
                    |f, err, st| st.ctx.error_policy(f.as_ref(), err),
                    state,
                )
                .for_each(|_| future::ready(())),
        );
    }
    ctx.ready_when(future::join_all(ready));
    future::join_all(runs).await;
}

#[tracing::instrument(skip(foo, st), fields(namespace = foo.namespace(), name = foo.name_any()))]
async fn reconcile(foo: Arc<Foo>, st: Arc<State>) -> Result<Action> {
    let _timer = st.ctx.reconcile_started();
    let ctx = &st.ctx;
    let ns = foo.namespace().unwrap_or_default();
    let name = foo.spec.deployment_name.clone();
    let deploys: Api<Deployment> = Api::namespaced(ctx.client().clone(), &ns);

    // fetch (cache)
    let cached = st.deployments.get(&ObjectRef::new(&name).within(&ns));
    // build (pure)
    let desired = build_deployment(&foo)?;

    // create or apply (client)
    let live: Arc<Deployment> = match cached {
        Some(d) => d,
        // Not in the cache: create, which (unlike an apply) cannot take over a Deployment of
        // that name someone else made — it fails with 409 instead.
        None => match deploys.create(&PostParams::default(), &desired).await {
            Ok(d) => {
                ctx.metrics().write("create");
                Arc::new(d)
            }
            Err(kube::Error::Api(s)) if s.code == 409 => {
                ctx.metrics().write("create");
                let d = deploys.get(&name).await.map_err(|source| Error::Create {
                    name: name.clone(),
                    source,
                })?;
                Arc::new(d)
            }
            Err(source) => return Err(Error::Create { name, source }),
        },
    };
    if !controlled_by(&live, &foo) {
        let e = Error::Exists(name);
        ctx.event(
            foo.as_ref(),
            EventType::Warning,
            ERR_RESOURCE_EXISTS,
            "Reconcile",
            e.to_string(),
        )
        .await;
        // Nothing to do until the Deployment or the Foo changes; the hourly look is a safety net.
        tracing::warn!(error = %e, "not reconciling");
        return Ok(Action::requeue(Duration::from_secs(3600)));
    }
    if live.spec.as_ref().and_then(|s| s.replicas) != desired.spec.as_ref().and_then(|s| s.replicas) {
        ctx.apply(&deploys, &desired, None)
            .await
            .map_err(|source| Error::Apply {
                name: name.clone(),
                source,
            })?;
    }

    // status (client)
    let status = FooStatus {
        available_replicas: live
            .status
            .as_ref()
            .and_then(|s| s.available_replicas)
            .unwrap_or(0),
    };
    let live_status = foo.status.clone().unwrap_or_default();
    let api: Api<Foo> = Api::namespaced(ctx.client().clone(), &ns);
    ctx.apply_status(
        &api,
        &foo.name_any(),
        serde_json::to_value(&status)?,
        Some(serde_json::to_value(&live_status)?),
    )
    .await
    .map_err(|source| Error::Status { source })?;
    ctx.reconcile_succeeded(foo.as_ref());
    Ok(Action::requeue(Duration::from_secs(3600)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use opkit_api::foo::FooSpec;

    fn foo(replicas: Option<i32>) -> Foo {
        let mut f = Foo::new(
            "example-foo",
            FooSpec {
                deployment_name: "example-foo".into(),
                replicas,
            },
        );
        f.metadata.namespace = Some("ns".into());
        f.metadata.uid = Some("uid-1".into());
        f
    }

    #[test]
    fn the_deployment_matches_upstreams_new_deployment() {
        let d = build_deployment(&foo(Some(3))).unwrap();
        let spec = d.spec.as_ref().unwrap();
        assert_eq!(spec.replicas, Some(3));
        let want = BTreeMap::from([
            ("app".to_string(), "nginx".to_string()),
            ("controller".to_string(), "example-foo".to_string()),
        ]);
        assert_eq!(spec.selector.match_labels.as_ref(), Some(&want));
        let pod = spec.template.spec.as_ref().unwrap();
        assert_eq!(pod.containers[0].image.as_deref(), Some(IMAGE));
        assert_eq!(pod.containers[0].name, "nginx");
        assert!(controlled_by(&d, &foo(None)));
        assert_eq!(
            build_deployment(&foo(None)).unwrap().spec.unwrap().replicas,
            Some(1)
        );
    }

    #[test]
    fn a_foo_without_uid_cannot_own_a_deployment() {
        let mut f = foo(None);
        f.metadata.uid = None;
        assert!(matches!(build_deployment(&f), Err(Error::Build(_))));
    }
}
