//! The Memcached of `docs/tutorial.md` as a reader ends up with it, compiled, with the unit test
//! of its plan: the tutorial's snippets are taken from this file (`crates/opkit/tests/docs.rs`
//! checks that they still are). This repository's own `crates/controllers/src/memcached` is the
//! complete version.

/// `crates/api/src/cache_v1alpha1/memcached.rs` in the tutorial's project.
mod types {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
    use kube::CustomResource;
    use schemars::JsonSchema;
    use serde::{Deserialize, Serialize};

    /// What a user asks of a Memcached.
    #[derive(CustomResource, Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
    #[kube(
        group = "cache.example.com",
        version = "v1alpha1",
        kind = "Memcached",
        plural = "memcacheds",
        namespaced,
        status = "MemcachedStatus"
    )]
    #[serde(rename_all = "camelCase")]
    pub struct MemcachedSpec {
        /// Number of memcached Pods.
        #[schemars(range(min = 0))]
        pub size: i32,
    }

    /// What the controller last observed.
    #[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
    #[serde(rename_all = "camelCase")]
    pub struct MemcachedStatus {
        /// Names of the memcached Pods.
        #[serde(default)]
        pub nodes: Vec<String>,
        /// `Available`, with the `observedGeneration` it describes.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub conditions: Vec<Condition>,
    }
}

/// `crates/controllers/src/memcached.rs` in the tutorial's project.
mod controller {
    use std::sync::Arc;

    use k8s_openapi::api::apps::v1::Deployment;
    use k8s_openapi::api::core::v1::Pod;
    use k8s_openapi::api::rbac::v1::PolicyRule;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use k8s_openapi::jiff::Timestamp;
    use kube::{Client, Resource, ResourceExt};
    use opkit::conditions::{Desired, merge};
    use opkit::rbac::{events, rule};
    use opkit::{Cache, Child, Invalid, Plan, Reconciler, Requeue, Watch, Watches};

    use super::types::{Memcached, MemcachedStatus};

    pub const AVAILABLE: &str = "Available";

    /// The Memcached reconciler.
    pub struct MemcachedController;

    /// The API access the controller uses.
    pub fn rbac_rules() -> Vec<PolicyRule> {
        vec![
            rule(&["cache.example.com"], &["memcacheds"], &["get", "list", "watch"]),
            rule(&["cache.example.com"], &["memcacheds/status"], &["get", "patch"]),
            rule(
                &["apps"],
                &["deployments"],
                &["get", "list", "watch", "create", "patch", "delete"],
            ),
            rule(&[""], &["pods"], &["get", "list", "watch"]),
            events(),
        ]
    }

    /// The Deployment of `m`'s Pods, owned by it.
    pub fn deployment_for(m: &Memcached) -> Deployment {
        let labels = serde_json::json!({"app": "memcached", "memcached_cr": m.name_any()});
        serde_json::from_value(serde_json::json!({
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {
                "name": m.name_any(),
                "namespace": m.namespace(),
                "ownerReferences": [m.controller_owner_ref(&())],
            },
            "spec": {
                "replicas": m.spec.size,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {"containers": [{
                        "name": "memcached",
                        "image": "memcached:1.4.36-alpine",
                        "command": ["memcached", "-m=64", "-o", "modern", "-v"],
                        "ports": [{"containerPort": 11211, "name": "memcached"}],
                    }]},
                },
            },
        }))
        .expect("a Deployment")
    }

    impl Reconciler for MemcachedController {
        type Object = Memcached;
        type Caches = (Cache<Deployment>, Cache<Pod>);
        type World = (Option<Arc<Deployment>>, Vec<String>); // the live Deployment, Pod names
        type Status = MemcachedStatus;

        fn name(&self) -> &'static str {
            "memcached"
        }

        fn watch(&self, w: &mut Watches<Memcached>) -> Self::Caches {
            (w.owns(Watch::all()), w.reads(Watch::labels("app=memcached")))
        }

        async fn observe(
            &self,
            m: &Memcached,
            (deployments, pods): &Self::Caches,
            _: &Client,
        ) -> kube::Result<Self::World> {
            let ns = m.namespace().unwrap_or_default();
            let live = deployments.get(&ns, &m.name_any());
            let mut names: Vec<String> = pods
                .filter(|p| {
                    p.namespace().as_deref() == Some(ns.as_str())
                        && p.labels().get("memcached_cr") == Some(&m.name_any())
                })
                .iter()
                .map(|p| p.name_any())
                .collect();
            names.sort();
            Ok((live, names))
        }

        fn plan(
            &self,
            m: &Memcached,
            (live, nodes): &Self::World,
            now: Timestamp,
        ) -> Result<Plan<MemcachedStatus>, Invalid> {
            // image memcached:1.4.36-alpine, `memcached -m=64 -o modern -v`, port 11211, and
            // `metadata.ownerReferences: m.controller_owner_ref(&())`
            let deployment = deployment_for(m);
            let existing = m
                .status
                .as_ref()
                .map(|s| s.conditions.as_slice())
                .unwrap_or_default();
            let available = Desired::yes(AVAILABLE, "Reconciled", format!("{} Pods", nodes.len()));
            let status = MemcachedStatus {
                nodes: nodes.clone(),
                conditions: merge(existing, &[available], m.metadata.generation, &Time(now)),
            };
            Ok(Plan::status(status, Requeue::OnChange).child(Child::apply(&deployment, live.as_deref())))
        }
    }
}

use std::sync::Arc;

use controller::{AVAILABLE, MemcachedController, deployment_for, rbac_rules};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::{Client, ResourceExt};
use opkit::{Cache, Reconciler, Watch};
use types::{Memcached, MemcachedSpec};

fn memcached(size: i32) -> Memcached {
    let mut m = Memcached::new("sample", MemcachedSpec { size });
    m.metadata.namespace = Some("ns".into());
    m.metadata.uid = Some("u1".into());
    m.metadata.generation = Some(2);
    m
}

fn pod(name: &str, of: &str) -> Pod {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "namespace": "ns", "labels": {"app": "memcached", "memcached_cr": of}},
    }))
    .expect("a Pod")
}

#[test]
fn the_tutorials_plan_applies_an_owned_deployment_and_reports_its_pods() {
    let m = memcached(3);
    let world = (None, vec!["sample-a".to_string(), "sample-b".to_string()]);
    let plan = MemcachedController
        .plan(&m, &world, Timestamp::UNIX_EPOCH)
        .expect("a plan");
    assert_eq!(plan.children.len(), 1);
    assert_eq!(plan.children[0].name(), "sample");
    assert!(plan.children[0].is_needed(), "no Deployment yet: it is applied");
    let status = plan.status.expect("a status");
    assert_eq!(status.nodes, ["sample-a", "sample-b"]);
    assert!(opkit::conditions::is_true(&status.conditions, AVAILABLE));
    assert_eq!(status.conditions[0].observed_generation, Some(2));

    // The Deployment it asks for is owned, so `owns` finds it and it is garbage-collected.
    let d = deployment_for(&m);
    assert_eq!(d.spec.as_ref().and_then(|s| s.replicas), Some(3));
    let owners = d.owner_references();
    assert_eq!((owners[0].uid.as_str(), owners[0].controller), ("u1", Some(true)));

    // Given the live Deployment as it asks for it, nothing is written.
    let plan = MemcachedController
        .plan(&m, &(Some(Arc::new(d)), vec![]), Timestamp::UNIX_EPOCH)
        .expect("a plan");
    assert!(!plan.children[0].is_needed());
    assert!(
        rbac_rules()
            .iter()
            .any(|r| r.resources == Some(vec!["deployments".into()]))
    );
}

#[tokio::test]
async fn the_tutorials_observe_finds_the_pods_of_its_memcached_only() {
    let caches: (Cache<Deployment>, Cache<Pod>) = (
        Cache::from_objects(&Watch::all(), [deployment_for(&memcached(1))]),
        Cache::from_objects(
            &Watch::all(),
            [
                pod("sample-b", "sample"),
                pod("sample-a", "sample"),
                pod("other-a", "other"),
            ],
        ),
    );
    let offline =
        Client::try_from(kube::Config::new("http://127.0.0.1:1".parse().expect("a url"))).expect("a client");
    let (live, names) = MemcachedController
        .observe(&memcached(1), &caches, &offline)
        .await
        .expect("observed");
    assert_eq!(live.map(|d| d.name_any()).as_deref(), Some("sample"));
    assert_eq!(names, ["sample-a", "sample-b"]);
}
