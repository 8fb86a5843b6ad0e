//! Pure functions from a `Memcached` to the objects and status it should have.
use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    Container, ContainerPort, PodSpec, PodTemplateSpec, Probe, ResourceRequirements, SecurityContext,
    TCPSocketAction,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, Time};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{Resource, ResourceExt};
use opkit::conditions::{self, Desired};
use opkit_api::MANAGED_BY;

use opkit::security::{restricted_container, restricted_pod};
use opkit_api::memcached::{Memcached, MemcachedStatus};

use super::{CR_LABEL, condition, reason};

/// Label selector for everything this controller manages (Deployments and their Pods).
pub fn selector() -> String {
    format!("app=memcached,app.kubernetes.io/managed-by={MANAGED_BY}")
}

/// Labels that select the Pods of one `Memcached` (the tutorial's `app` + `memcached_cr`).
pub fn pod_labels(name: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app".to_string(), "memcached".to_string()),
        (CR_LABEL.to_string(), name.to_string()),
    ])
}

/// `pod_labels` plus the standard `app.kubernetes.io/*` set.
pub fn labels(name: &str) -> BTreeMap<String, String> {
    let mut l = pod_labels(name);
    l.insert("app.kubernetes.io/name".into(), "memcached".into());
    l.insert("app.kubernetes.io/instance".into(), name.into());
    l.insert("app.kubernetes.io/managed-by".into(), MANAGED_BY.into());
    l
}

/// The Deployment a `Memcached` of `size` Pods should have, owned by it.
pub fn build_deployment(mc: &Memcached, size: i32, image: &str) -> Result<Deployment, String> {
    let name = mc.name_any();
    if name.len() > opkit_api::MAX_LABEL_VALUE {
        // Stored before the CRD refused such names: every apply would fail on the labels.
        return Err(opkit_api::name_too_long(
            opkit_api::MAX_LABEL_VALUE,
            opkit_api::memcached::NAME_LIMIT_REASON,
        ));
    }
    let owner = mc
        .controller_owner_ref(&())
        .ok_or_else(|| format!("Memcached {name} has no uid yet"))?;
    let q = |s: &str| Quantity(s.to_string());
    let container = Container {
        name: "memcached".into(),
        image: Some(image.into()),
        command: Some(
            ["memcached", "-m", "64", "-o", "modern", "-v"]
                .map(String::from)
                .to_vec(),
        ),
        ports: Some(vec![ContainerPort {
            container_port: 11211,
            name: Some("memcached".into()),
            protocol: Some("TCP".into()),
            ..Default::default()
        }]),
        resources: Some(ResourceRequirements {
            requests: Some(BTreeMap::from([
                ("cpu".into(), q("100m")),
                ("memory".into(), q("64Mi")),
            ])),
            limits: Some(BTreeMap::from([("memory".into(), q("128Mi"))])),
            ..Default::default()
        }),
        liveness_probe: Some(Probe {
            tcp_socket: Some(TCPSocketAction {
                port: IntOrString::Int(11211),
                ..Default::default()
            }),
            initial_delay_seconds: Some(15),
            period_seconds: Some(20),
            ..Default::default()
        }),
        security_context: Some(SecurityContext {
            run_as_non_root: Some(true),
            run_as_user: Some(1001),
            read_only_root_filesystem: Some(true),
            ..restricted_container()
        }),
        ..Default::default()
    };
    Ok(Deployment {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            namespace: mc.namespace(),
            labels: Some(labels(&name)),
            owner_references: Some(vec![owner]),
            ..Default::default()
        },
        spec: Some(DeploymentSpec {
            replicas: Some(size),
            selector: LabelSelector {
                match_labels: Some(pod_labels(&name)),
                ..Default::default()
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels(&name)),
                    ..Default::default()
                }),
                spec: Some(PodSpec {
                    containers: vec![container],
                    security_context: Some(restricted_pod()),
                    ..Default::default()
                }),
            },
            ..Default::default()
        }),
        ..Default::default()
    })
}

/// A Pod being deleted is no longer a node (finished ones never reach the cache:
/// [`super::LIVE_PODS`]).
fn counts_as_node(p: &super::PodMeta) -> bool {
    p.metadata.deletion_timestamp.is_none()
}

/// The status a `Memcached` should show, given its Deployment and Pods.
pub fn status(
    mc: &Memcached,
    size: i32,
    deployment: Option<&Deployment>,
    pods: &[Arc<super::PodMeta>],
    now: &Time,
) -> MemcachedStatus {
    let live = mc.status.clone().unwrap_or_default();
    let mut nodes: Vec<String> = pods
        .iter()
        .filter(|p| counts_as_node(p))
        .map(|p| p.name_any())
        .collect();
    nodes.sort();
    let ds = deployment.and_then(|d| d.status.clone()).unwrap_or_default();
    let ready = ds.ready_replicas.unwrap_or(0);
    let updated = ds.updated_replicas.unwrap_or(0);
    let total = ds.replicas.unwrap_or(0);
    let deployment_rolled_out = deployment.is_some_and(|d| {
        d.status.as_ref().and_then(|s| s.observed_generation) >= d.metadata.generation
            && d.spec.as_ref().and_then(|s| s.replicas) == Some(size)
    }) && updated == size
        && total == size
        && ready == size;
    // Size 0 with no Pod left, none reported and none asked of the cached Deployment: there is
    // nothing to roll out, so the status need not wait for the Deployment controller to
    // observe it (at thousands of new Deployments that is minutes). The Deployment is applied
    // before this status is written.
    let nothing_to_roll_out = size == 0
        && pods.is_empty()
        && total == 0
        && deployment.is_none_or(|d| d.spec.as_ref().and_then(|s| s.replicas) == Some(0));
    let rolled_out = deployment_rolled_out || nothing_to_roll_out;
    let progress = format!("{ready}/{size} replicas ready");
    let desired = [
        if ready >= size {
            Desired::yes(condition::AVAILABLE, reason::READY, progress.clone())
        } else {
            Desired::no(condition::AVAILABLE, reason::NOT_READY, progress.clone())
        },
        if rolled_out {
            Desired::no(condition::PROGRESSING, reason::COMPLETE, progress)
        } else {
            Desired::yes(condition::PROGRESSING, reason::SCALING, progress)
        },
        Desired::no(condition::DEGRADED, reason::AS_EXPECTED, "spec is valid"),
    ];
    MemcachedStatus {
        nodes,
        ready_replicas: Some(ready),
        observed_generation: mc.metadata.generation,
        conditions: conditions::merge(&live.conditions, &desired, mc.metadata.generation, now),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::apps::v1::DeploymentStatus;
    use opkit_api::memcached::MemcachedSpec;

    fn memcached(name: &str, size: i32) -> Memcached {
        let mut mc = Memcached::new(name, MemcachedSpec { size });
        mc.metadata.namespace = Some("ns".into());
        mc.metadata.uid = Some("uid-1".into());
        mc.metadata.generation = Some(2);
        mc
    }

    fn pod(name: &str, deleting: bool) -> Arc<crate::memcached::PodMeta> {
        let mut p = crate::memcached::PodMeta::default();
        p.metadata.name = Some(name.into());
        if deleting {
            p.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
        }
        Arc::new(p)
    }

    fn now() -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(1_000).unwrap())
    }

    #[test]
    fn deployment_runs_size_memcached_pods_owned_by_the_cr() {
        let d = build_deployment(&memcached("memcached-sample", 3), 3, "memcached:1.6").unwrap();
        assert_eq!(d.metadata.name.as_deref(), Some("memcached-sample"));
        assert_eq!(d.metadata.namespace.as_deref(), Some("ns"));
        let owner = &d.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str(), owner.controller),
            ("Memcached", "uid-1", Some(true))
        );
        let spec = d.spec.unwrap();
        assert_eq!(spec.replicas, Some(3));
        assert_eq!(spec.selector.match_labels, Some(pod_labels("memcached-sample")));
        let tpl = spec.template;
        let tl = tpl.metadata.unwrap().labels.unwrap();
        assert_eq!(
            tl.get("memcached_cr").map(String::as_str),
            Some("memcached-sample")
        );
        assert_eq!(
            tl.get("app.kubernetes.io/managed-by").map(String::as_str),
            Some("opkit")
        );
        let c = &tpl.spec.as_ref().unwrap().containers[0];
        assert_eq!(c.image.as_deref(), Some("memcached:1.6"));
        assert_eq!(
            c.command.as_ref().unwrap().join(" "),
            "memcached -m 64 -o modern -v"
        );
        assert_eq!(c.ports.as_ref().unwrap()[0].container_port, 11211);
        assert_eq!(c.ports.as_ref().unwrap()[0].name.as_deref(), Some("memcached"));
        assert!(c.liveness_probe.as_ref().unwrap().tcp_socket.is_some());
        let sc = c.security_context.as_ref().unwrap();
        assert_eq!(
            (sc.allow_privilege_escalation, sc.run_as_non_root),
            (Some(false), Some(true))
        );
    }

    #[test]
    fn a_cr_without_uid_cannot_own_a_deployment() {
        let mut mc = memcached("m", 1);
        mc.metadata.uid = None;
        assert!(build_deployment(&mc, 1, "img").unwrap_err().contains("no uid"));
    }

    #[test]
    fn nodes_are_sorted_live_pods_only() {
        let mc = memcached("m", 3);
        let pods = vec![pod("m-c", false), pod("m-a", false), pod("m-x", true)];
        let s = status(&mc, 3, None, &pods, &now());
        assert_eq!(s.nodes, vec!["m-a", "m-c"]);
    }

    #[test]
    fn conditions_follow_the_deployment() {
        let mc = memcached("m", 3);
        let mut d = build_deployment(&mc, 3, "img").unwrap();
        d.metadata.generation = Some(1);
        d.status = Some(DeploymentStatus {
            observed_generation: Some(1),
            replicas: Some(3),
            updated_replicas: Some(3),
            ready_replicas: Some(1),
            ..Default::default()
        });
        let s = status(&mc, 3, Some(&d), &[], &now());
        assert!(!conditions::is_true(&s.conditions, condition::AVAILABLE));
        assert!(conditions::is_true(&s.conditions, condition::PROGRESSING));
        assert_eq!(s.ready_replicas, Some(1));
        d.status.as_mut().unwrap().ready_replicas = Some(3);
        let s = status(&mc, 3, Some(&d), &[], &now());
        assert!(conditions::is_true(&s.conditions, condition::AVAILABLE));
        assert!(!conditions::is_true(&s.conditions, condition::PROGRESSING));
        assert!(!conditions::is_true(&s.conditions, condition::DEGRADED));
        assert_eq!(s.observed_generation, Some(2));
    }

    #[test]
    fn size_zero_is_complete_once_no_pod_is_left_without_waiting_for_the_deployment_controller() {
        let mc = memcached("m", 0);
        let complete = |s: &MemcachedStatus| {
            conditions::is_true(&s.conditions, condition::AVAILABLE)
                && !conditions::is_true(&s.conditions, condition::PROGRESSING)
        };
        // A new Memcached: its Deployment is not even cached yet.
        assert!(complete(&status(&mc, 0, None, &[], &now())));
        // Applied, not yet observed by the Deployment controller.
        let mut d = build_deployment(&mc, 0, "img").unwrap();
        d.metadata.generation = Some(1);
        assert!(complete(&status(&mc, 0, Some(&d), &[], &now())));
        // Scaling down to 0: a Pod is still there (even one being deleted).
        assert!(!complete(&status(&mc, 0, Some(&d), &[pod("m-a", true)], &now())));
        // The Pod is gone but the Deployment's last status still counts one replica.
        d.status = Some(DeploymentStatus {
            observed_generation: Some(1),
            replicas: Some(1),
            ..Default::default()
        });
        assert!(!complete(&status(&mc, 0, Some(&d), &[], &now())));
        // The cached Deployment still asks for a Pod (the apply has not reached the cache).
        let mut old = build_deployment(&mc, 1, "img").unwrap();
        old.metadata.generation = Some(1);
        assert!(!complete(&status(&mc, 0, Some(&old), &[], &now())));
        // Size 1 always waits for the Deployment controller's counts.
        let one = memcached("m", 1);
        assert!(!complete(&status(&one, 1, None, &[], &now())));
    }

    #[test]
    fn validation_refuses_sizes_outside_the_documented_range() {
        assert_eq!(super::super::validate(&memcached("m", 0)), Ok(0));
        assert!(
            super::super::validate(&memcached("m", -1))
                .unwrap_err()
                .message
                .contains("between 0 and 100")
        );
        assert!(super::super::validate(&memcached("m", 101)).is_err());
    }
}
