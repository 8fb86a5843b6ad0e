//! The Memcached controller: one Deployment of `spec.size` memcached Pods per `Memcached`, with
//! `status.nodes` following the Pods.
//!
//! observe (caches) → plan (pure: validate → build → status); opkit applies the Deployment,
//! writes the status and publishes the Events.
mod build;

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::rbac::v1::PolicyRule;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::ObjectRef;
use kube::{Client, ResourceExt};
use opkit::rbac::{events, rule};
use opkit::{Cache, Child, Event, Invalid, Plan, Reconciler, Requeue, Watch, Watches};
use opkit_api::memcached::{MAX_SIZE, Memcached, MemcachedStatus};

pub use build::{build_deployment, labels, pod_labels, selector};

/// The controller's name (`--controllers memcached`) and metrics label.
pub const NAME: &str = "memcached";
/// Image used when `--memcached-image` is not given.
pub const DEFAULT_IMAGE: &str = "memcached:1.6";
/// Label on every Pod naming its `Memcached` (as in the Operator SDK tutorial).
pub const CR_LABEL: &str = "memcached_cr";

/// Condition types (what `kubectl describe` shows).
pub mod condition {
    pub const AVAILABLE: &str = "Available";
    pub const PROGRESSING: &str = "Progressing";
    pub const DEGRADED: &str = "Degraded";
}

/// Condition and Event reasons.
pub mod reason {
    pub const READY: &str = "AllReplicasReady";
    pub const NOT_READY: &str = "ReplicasNotReady";
    pub const SCALING: &str = "Scaling";
    pub const COMPLETE: &str = "Complete";
    pub const AS_EXPECTED: &str = "AsExpected";
    pub const INVALID_SPEC: &str = "InvalidSpec";
    pub const DEPLOYMENT_RESTORED: &str = "DeploymentRestored";
}

/// The Memcached reconciler.
#[derive(Clone, Debug)]
pub struct MemcachedController {
    /// Image of the memcached containers.
    pub image: String,
}

impl Default for MemcachedController {
    fn default() -> Self {
        MemcachedController {
            image: DEFAULT_IMAGE.into(),
        }
    }
}

/// The API access this controller uses, for the generated ClusterRole.
pub fn rbac_rules() -> Vec<PolicyRule> {
    vec![
        rule(&["cache.example.com"], &["memcacheds"], &["list", "watch"]),
        rule(&["cache.example.com"], &["memcacheds/status"], &["patch"]),
        // Read from caches only. `create`: an apply that makes the Deployment is authorized as
        // a create too; `delete` prunes a Deployment the plan no longer produces.
        rule(
            &["apps"],
            &["deployments"],
            &["list", "watch", "create", "patch", "delete"],
        ),
        rule(&[""], &["pods"], &["list", "watch"]),
        events(),
    ]
}

/// Checks what the schema should already have refused, for objects stored before it did.
pub fn validate(mc: &Memcached) -> Result<i32, Invalid> {
    let size = mc.spec.size;
    if !(0..=MAX_SIZE).contains(&size) {
        return Err(Invalid::new(
            condition::DEGRADED,
            true,
            reason::INVALID_SPEC,
            format!("spec.size must be between 0 and {MAX_SIZE}, got {size}"),
        ));
    }
    Ok(size)
}

/// The caches: owned Deployments and their Pods, both selected by opkit's labels.
pub struct Caches {
    deployments: Cache<Deployment>,
    pods: Cache<PodMeta>,
}

/// What the plan reads about one Memcached.
#[derive(Clone, Debug, Default)]
pub struct World {
    pub deployment: Option<Arc<Deployment>>,
    pub pods: Vec<Arc<PodMeta>>,
}

/// A memcached Pod as cached: its metadata only (the apiserver sends nothing else).
pub type PodMeta = PartialObjectMeta<Pod>;

/// The Pods that can be nodes: the apiserver leaves out those that finished (they leave the
/// watch as deletions), so metadata is all the status needs.
pub const LIVE_PODS: &str = "status.phase!=Succeeded,status.phase!=Failed";

/// Only names, labels and deletion of the Pods matter here.
fn trim_pod(p: &mut PodMeta) {
    p.metadata.annotations = None;
    p.metadata.owner_references = None;
    p.metadata.generate_name = None;
}

/// The index of the Pods by the Memcached they belong to.
const BY_OWNER: &str = "memcached";

/// The Memcached a Pod belongs to, as `namespace/name`.
fn pod_owner(p: &PodMeta) -> Option<String> {
    Some(format!("{}/{}", p.namespace()?, p.labels().get(CR_LABEL)?))
}

/// The plan reads replica counts of a Deployment's status, not its conditions.
fn trim_deployment(d: &mut Deployment) {
    if let Some(s) = d.status.as_mut() {
        s.conditions = None;
    }
}

impl Reconciler for MemcachedController {
    type Object = Memcached;
    type Caches = Caches;
    type World = World;
    type Status = MemcachedStatus;

    fn name(&self) -> &'static str {
        NAME
    }

    /// Compact: a reconcile reads its own Memcached only, decoded for it.
    fn primary(&self) -> Watch<Memcached> {
        Watch::all().compact()
    }

    fn watch(&self, w: &mut Watches<Memcached>) -> Caches {
        Caches {
            // Compact: each reconcile reads one Deployment and one Memcached's Pods.
            deployments: w.owns(
                Watch::labels(&selector())
                    .applied()
                    .trim(trim_deployment)
                    .prune()
                    .compact(),
            ),
            pods: w.watches(
                Watch::labels(&selector())
                    .fields(LIVE_PODS)
                    .trim(trim_pod)
                    .index(BY_OWNER, pod_owner)
                    .compact(),
                |pod: PodMeta| {
                    let name = pod.labels().get(CR_LABEL)?.clone();
                    Some(ObjectRef::<Memcached>::new(&name).within(&pod.namespace()?))
                },
            ),
        }
    }

    async fn observe(&self, mc: &Memcached, cache: &Caches, _: &Client) -> kube::Result<World> {
        let (ns, name) = (mc.namespace().unwrap_or_default(), mc.name_any());
        Ok(World {
            deployment: cache.deployments.get(&ns, &name),
            pods: cache.pods.indexed(BY_OWNER, &format!("{ns}/{name}")),
        })
    }

    fn plan(&self, mc: &Memcached, world: &World, now: Timestamp) -> Result<Plan<MemcachedStatus>, Invalid> {
        let size = validate(mc)?;
        let desired = build_deployment(mc, size, &self.image)
            .map_err(|message| Invalid::new(condition::DEGRADED, true, reason::INVALID_SPEC, message))?;
        let live = world.deployment.as_deref();
        let child = Child::apply(&desired, live);
        let status = build::status(mc, size, live, &world.pods, &Time(now));
        // Until the rollout completes the status is progress: held back, so a change that
        // settles quickly costs one status write (observedGeneration says it is under way).
        let rolling = opkit::conditions::is_true(&status.conditions, condition::PROGRESSING);
        // Watches on the Deployment and its Pods bring us back; the hourly resync is a safety net.
        let mut plan = Plan::status(status, Requeue::After(Duration::from_secs(3600))).in_progress(rolling);
        // Creating and scaling for a new spec are routine (the Deployment controller records
        // its own scaling); undoing someone's change to the Deployment of a settled spec is
        // worth telling.
        let settled_spec = mc.status.as_ref().and_then(|s| s.observed_generation) == mc.metadata.generation;
        if child.is_needed() && live.is_some() && settled_spec {
            let note = format!("Restored Deployment {} to its desired state", mc.name_any());
            plan = plan.event(Event::normal(reason::DEPLOYMENT_RESTORED, "Apply", note));
        }
        Ok(plan.child(child))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opkit_api::memcached::MemcachedSpec;

    fn mc(size: i32) -> Memcached {
        let mut m = Memcached::new("m", MemcachedSpec { size });
        m.metadata.namespace = Some("ns".into());
        m.metadata.uid = Some("uid-1".into());
        m.metadata.generation = Some(1);
        m
    }

    fn now() -> Timestamp {
        Timestamp::from_second(1_000).unwrap()
    }

    #[test]
    fn a_new_memcached_gets_its_deployment_and_a_status_held_as_progress() {
        let p = MemcachedController::default()
            .plan(&mc(3), &World::default(), now())
            .unwrap();
        assert_eq!(p.children.len(), 1);
        assert!(p.children[0].is_needed());
        // Creating is routine: no Event.
        assert!(p.events.is_empty(), "{:?}", p.events);
        assert!(p.in_progress);
        assert_eq!(p.status.unwrap().ready_replicas, Some(0));
    }

    #[test]
    fn a_converged_memcached_plans_no_write_and_no_event() {
        let c = MemcachedController::default();
        let d = build_deployment(&mc(2), 2, DEFAULT_IMAGE).unwrap();
        let world = World {
            deployment: Some(Arc::new(d)),
            pods: Vec::new(),
        };
        let p = c.plan(&mc(2), &world, now()).unwrap();
        assert!(!p.children[0].is_needed());
        assert!(p.events.is_empty());
    }

    #[test]
    fn scaling_is_routine_and_undoing_a_change_is_told() {
        let c = MemcachedController::default();
        let d = build_deployment(&mc(2), 2, DEFAULT_IMAGE).unwrap();
        let world = World {
            deployment: Some(Arc::new(d.clone())),
            pods: Vec::new(),
        };
        let settled = |size| {
            let mut m = mc(size);
            m.status = Some(MemcachedStatus {
                observed_generation: m.metadata.generation,
                ..Default::default()
            });
            m
        };
        // A new size (generation not yet observed): routine.
        let mut rescaled = settled(5);
        rescaled.metadata.generation = Some(2);
        let p = c.plan(&rescaled, &world, now()).unwrap();
        assert!(p.children[0].is_needed());
        assert!(p.events.is_empty(), "{:?}", p.events);
        // Someone scaled the Deployment of a settled Memcached: put back, with an Event.
        let mut changed = d;
        changed.spec.as_mut().unwrap().replicas = Some(7);
        let world = World {
            deployment: Some(Arc::new(changed)),
            pods: Vec::new(),
        };
        let p = c.plan(&settled(2), &world, now()).unwrap();
        assert!(p.children[0].is_needed());
        assert!(
            p.events[0].note.contains("Restored Deployment m"),
            "{:?}",
            p.events
        );
    }

    #[test]
    fn an_out_of_range_size_is_invalid_with_the_field_named() {
        let e = MemcachedController::default()
            .plan(&mc(-1), &World::default(), now())
            .unwrap_err();
        assert_eq!(
            (e.condition, e.status, e.reason),
            (condition::DEGRADED, true, reason::INVALID_SPEC)
        );
        assert!(e.message.contains("spec.size"));
    }

    #[test]
    fn a_name_too_long_for_a_label_is_invalid_not_retried() {
        let mut m = mc(1);
        m.metadata.name = Some("m".repeat(64));
        let err = MemcachedController::default()
            .plan(&m, &World::default(), now())
            .unwrap_err();
        assert_eq!(err.reason, reason::INVALID_SPEC);
        assert!(
            err.message
                .contains("metadata.name must be at most 63 characters"),
            "{}",
            err.message
        );
        m.metadata.name = Some("m".repeat(63));
        assert!(
            MemcachedController::default()
                .plan(&m, &World::default(), now())
                .is_ok()
        );
    }
}
