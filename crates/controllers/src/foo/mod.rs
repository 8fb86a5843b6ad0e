//! The Foo controller: client-go's sample-controller contract on opkit. A Deployment named
//! `spec.deploymentName` (nginx, labels `app=nginx`, `controller=<foo>`), owned by the Foo, with
//! `spec.replicas`; `status.availableReplicas` mirrors it. A Deployment of that name the Foo
//! does not control is left alone and reported (upstream's `ErrResourceExists`); when
//! `spec.deploymentName` changes, the Deployment under the old name is deleted.
//!
//! Unlike upstream, nothing is written when nothing changed: no status update and no `Synced`
//! Event per sync, so a converged Foo costs no API requests.
//!
//! observe (cache; a read when the Deployment is not cached) → plan (pure); opkit creates or
//! applies the Deployment, prunes the old one and writes the status.
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{Container, PodSpec, PodTemplateSpec};
use k8s_openapi::api::rbac::v1::PolicyRule;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::{Api, Client, Resource, ResourceExt};
use opkit::rbac::{events, rule};
use opkit::{Cache, Child, Event, Invalid, Plan, Reconciler, Requeue, Watch, Watches};
use opkit_api::foo::{Foo, FooStatus};

/// The controller's name (`--controllers foo`) and metrics label.
pub const NAME: &str = "foo";
/// Upstream's image.
pub const IMAGE: &str = "nginx:latest";
/// Upstream's Event reason for a Deployment the Foo does not control.
pub const ERR_RESOURCE_EXISTS: &str = "ErrResourceExists";
/// Event reason when the Deployment's Pods cannot be created (admission refused them, a quota
/// is exhausted): upstream's nginx runs as root, which a `restricted` namespace refuses.
pub const PODS_REFUSED: &str = "PodsRefused";
/// Condition type and reason for a Foo that cannot own a Deployment.
const READY: &str = "Ready";
const INVALID_SPEC: &str = "InvalidSpec";

/// The API access this controller uses, for the generated ClusterRole.
pub fn rbac_rules() -> Vec<PolicyRule> {
    vec![
        rule(&["samplecontroller.k8s.io"], &["foos"], &["list", "watch"]),
        rule(&["samplecontroller.k8s.io"], &["foos/status"], &["patch"]),
        // `get`: a Deployment of that name not in the cache (see `observe`); `delete` prunes
        // the old one when `deploymentName` changes.
        rule(
            &["apps"],
            &["deployments"],
            &["get", "list", "watch", "create", "patch", "delete"],
        ),
        events(),
    ]
}

/// Upstream's labels (also put on the Deployment itself, so the cache can select by them).
pub fn labels(foo: &Foo) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app".to_string(), "nginx".to_string()),
        ("controller".to_string(), foo.name_any()),
    ])
}

/// The Deployment a Foo should have (upstream's `newDeployment`), owned by it.
pub fn build_deployment(foo: &Foo) -> Result<Deployment, String> {
    if foo.name_any().len() > opkit_api::MAX_LABEL_VALUE {
        // Stored before the CRD refused such names: every create would fail on the labels.
        return Err(opkit_api::name_too_long(
            opkit_api::MAX_LABEL_VALUE,
            opkit_api::foo::NAME_LIMIT_REASON,
        ));
    }
    let owner = foo
        .controller_owner_ref(&())
        .ok_or_else(|| format!("Foo {} has no uid yet", foo.name_any()))?;
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

/// The Foo reconciler.
#[derive(Clone, Copy, Debug, Default)]
pub struct FooController;

/// What the plan reads: the Deployment named by the Foo, cached or read.
#[derive(Clone, Debug, Default)]
pub struct World {
    pub deployment: Option<Arc<Deployment>>,
}

/// Only ownership, replicas, availability and a failure to create Pods matter here.
fn trim_deployment(d: &mut Deployment) {
    if let Some(s) = d.spec.as_mut() {
        s.template.spec = None;
    }
    if let Some(s) = d.status.as_mut()
        && let Some(c) = s.conditions.as_mut()
    {
        c.retain(|c| c.type_ == "ReplicaFailure");
    }
}

/// Why the Deployment's Pods cannot be created, from its `ReplicaFailure` condition.
fn pods_refused(d: &Deployment) -> Option<String> {
    let c = d
        .status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "ReplicaFailure" && c.status == "True")?;
    Some(
        c.message
            .clone()
            .unwrap_or_else(|| c.reason.clone().unwrap_or_default()),
    )
}

impl Reconciler for FooController {
    type Object = Foo;
    type Caches = Cache<Deployment>;
    type World = World;
    type Status = FooStatus;

    fn name(&self) -> &'static str {
        NAME
    }

    /// Compact: a reconcile reads its own Foo only, decoded for it.
    fn primary(&self) -> Watch<Foo> {
        Watch::all().compact()
    }

    fn watch(&self, w: &mut Watches<Foo>) -> Cache<Deployment> {
        // Upstream's Deployments carry `app=nginx` and `controller`; so do ours, on the object too.
        w.owns(
            Watch::labels("app=nginx,controller")
                .trim(trim_deployment)
                .prune(),
        )
    }

    async fn observe(&self, foo: &Foo, cache: &Cache<Deployment>, client: &Client) -> kube::Result<World> {
        let ns = foo.namespace().unwrap_or_default();
        let name = &foo.spec.deployment_name;
        let deployment = match cache.get(&ns, name) {
            Some(d) => Some(d),
            // Not ours (or not created yet): someone else's Deployment of that name has none of
            // our labels, so only a read tells it apart from a missing one.
            None => Api::<Deployment>::namespaced(client.clone(), &ns)
                .get_opt(name)
                .await?
                .map(Arc::new),
        };
        Ok(World { deployment })
    }

    fn plan(&self, foo: &Foo, world: &World, _: Timestamp) -> Result<Plan<FooStatus>, Invalid> {
        let desired =
            build_deployment(foo).map_err(|message| Invalid::new(READY, false, INVALID_SPEC, message))?;
        let hourly = Requeue::After(Duration::from_secs(3600));
        let Some(live) = &world.deployment else {
            // Create, which (unlike an apply) cannot take over a Deployment of that name someone
            // else made in the meantime: it fails with a conflict, and the retry reads it.
            // No status yet: the new Deployment's own status brings the first one.
            return Ok(Plan::nothing(hourly).child(Child::create(&desired, None)));
        };
        if !controlled_by(live, foo) {
            // Nothing to do until the Deployment or the Foo changes; the hourly look is a safety net.
            let note = format!(
                "Resource {:?} already exists and is not managed by Foo",
                foo.spec.deployment_name
            );
            return Ok(Plan::nothing(hourly).event(Event::warning(ERR_RESOURCE_EXISTS, "Reconcile", note)));
        }
        // The cache drops the pod template, so compare what upstream compares: replicas.
        let same =
            live.spec.as_ref().and_then(|s| s.replicas) == desired.spec.as_ref().and_then(|s| s.replicas);
        let status = FooStatus {
            available_replicas: live
                .status
                .as_ref()
                .and_then(|s| s.available_replicas)
                .unwrap_or(0),
        };
        let mut plan = Plan::status(status, hourly).child(Child::apply(&desired, Some(live)).needed(!same));
        if let Some(why) = pods_refused(live) {
            // Shown on the Foo, where its owner looks; repeated only when the Deployment changes.
            plan = plan.event(Event::warning(
                PODS_REFUSED,
                "Reconcile",
                format!(
                    "Pods of Deployment {} cannot be created: {why}",
                    foo.spec.deployment_name
                ),
            ));
        }
        Ok(plan)
    }
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

    fn now() -> Timestamp {
        Timestamp::from_second(1_000).unwrap()
    }

    #[test]
    fn a_missing_deployment_is_created_never_applied() {
        let p = FooController
            .plan(&foo(Some(2)), &World::default(), now())
            .unwrap();
        assert_eq!(p.children.len(), 1);
        assert!(p.children[0].is_needed());
        assert!(format!("{:?}", p.children[0]).contains("Create"));
    }

    #[test]
    fn a_foreign_deployment_is_reported_and_left_alone() {
        let mut theirs = build_deployment(&foo(None)).unwrap();
        theirs.metadata.owner_references = None;
        let world = World {
            deployment: Some(Arc::new(theirs)),
        };
        let p = FooController.plan(&foo(Some(5)), &world, now()).unwrap();
        assert!(p.children.is_empty() && p.status.is_none());
        assert_eq!(p.events[0].reason, ERR_RESOURCE_EXISTS);
        assert!(
            p.events[0]
                .note
                .contains("\"example-foo\" already exists and is not managed by Foo")
        );
    }

    #[test]
    fn replicas_drift_is_applied_and_availability_mirrored() {
        let mut live = build_deployment(&foo(Some(1))).unwrap();
        live.status = Some(k8s_openapi::api::apps::v1::DeploymentStatus {
            available_replicas: Some(1),
            ..Default::default()
        });
        let world = World {
            deployment: Some(Arc::new(live)),
        };
        let p = FooController.plan(&foo(Some(1)), &world, now()).unwrap();
        assert!(!p.children[0].is_needed(), "same replicas: no write");
        assert_eq!(p.status.unwrap().available_replicas, 1);
        let p = FooController.plan(&foo(Some(3)), &world, now()).unwrap();
        assert!(p.children[0].is_needed());
    }

    #[test]
    fn a_foo_without_uid_cannot_own_a_deployment() {
        let mut f = foo(None);
        f.metadata.uid = None;
        assert!(build_deployment(&f).unwrap_err().contains("no uid"));
    }

    #[test]
    fn a_name_too_long_for_a_label_is_invalid_not_retried() {
        let mut f = foo(Some(1));
        f.metadata.name = Some("f".repeat(64));
        let err = FooController
            .plan(&f, &World::default(), Timestamp::UNIX_EPOCH)
            .unwrap_err();
        assert!(
            err.message
                .contains("metadata.name must be at most 63 characters"),
            "{}",
            err.message
        );
        f.metadata.name = Some("f".repeat(63));
        assert!(
            FooController
                .plan(&f, &World::default(), Timestamp::UNIX_EPOCH)
                .is_ok()
        );
    }

    #[test]
    fn pods_refused_by_admission_are_reported_on_the_foo() {
        let f = foo(Some(1));
        let mut d = build_deployment(&f).unwrap();
        d.status = Some(k8s_openapi::api::apps::v1::DeploymentStatus {
            conditions: Some(vec![k8s_openapi::api::apps::v1::DeploymentCondition {
                type_: "ReplicaFailure".into(),
                status: "True".into(),
                reason: Some("FailedCreate".into()),
                message: Some("pods \"x\" is forbidden: violates PodSecurity \"restricted:latest\"".into()),
                ..Default::default()
            }]),
            ..Default::default()
        });
        let world = World {
            deployment: Some(Arc::new(d)),
        };
        let p = FooController.plan(&f, &world, Timestamp::UNIX_EPOCH).unwrap();
        assert_eq!(p.events.len(), 1);
        assert_eq!(p.events[0].reason, PODS_REFUSED);
        assert!(
            p.events[0].note.contains("violates PodSecurity"),
            "{}",
            p.events[0].note
        );
    }
}
