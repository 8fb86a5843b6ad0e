//! The Memcached controller on the real local control plane.

use std::time::Duration;

use anyhow::{Context, anyhow, bail, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use opkit::ManagerOptions;
use opkit_api::memcached::Memcached;
use opkit_controllers::memcached;
use opkit_testenv::{http_get, shared, wait_for};
use serde_json::json;

mod common;
use common::{Operator, T, assert_quiescent, install_crd, sample};

async fn start(client: &Client, ns: &str, opts: ManagerOptions) -> anyhow::Result<Operator> {
    common::start(client, ns, memcached::NAME, opts).await
}

async fn apply_yaml(client: &Client, ns: &str, yaml: &str) -> anyhow::Result<Memcached> {
    let mc: Memcached = serde_yaml::from_str(yaml)?;
    let api: Api<Memcached> = Api::namespaced(client.clone(), ns);
    Ok(api.create(&PostParams::default(), &mc).await?)
}

/// Waits until the Memcached shows `n` Pod names and its Deployment has `n` ready replicas.
async fn wait_for_size(client: &Client, ns: &str, name: &str, n: usize) -> anyhow::Result<Vec<String>> {
    let mcs: Api<Memcached> = Api::namespaced(client.clone(), ns);
    let deploys: Api<Deployment> = Api::namespaced(client.clone(), ns);
    wait_for(&format!("{name} to have {n} nodes"), T, || async {
        let d = deploys.get(name).await?;
        let ready = d.status.and_then(|s| s.ready_replicas).unwrap_or(0) as usize;
        let nodes = mcs.get(name).await?.status.map(|s| s.nodes).unwrap_or_default();
        if ready == n && nodes.len() == n {
            Ok(nodes)
        } else {
            Err(anyhow!("{ready} ready, nodes {nodes:?}"))
        }
    })
    .await
}

/// A Memcached of `size` named `name`, as a user would write it.
fn new_memcached(name: &str, size: i32) -> anyhow::Result<Memcached> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "cache.example.com/v1", "kind": "Memcached",
        "metadata": {"name": name}, "spec": {"size": size},
    }))?)
}

/// A ResourceQuota that allows `pods` Pods in `ns`: a rollout that cannot finish.
async fn pod_quota(client: &Client, ns: &str, pods: u32) -> anyhow::Result<()> {
    let quotas: Api<k8s_openapi::api::core::v1::ResourceQuota> = Api::namespaced(client.clone(), ns);
    let quota = json!({"metadata": {"name": "pods"}, "spec": {"hard": {"pods": pods.to_string()}}});
    quotas
        .create(&PostParams::default(), &serde_json::from_value(quota)?)
        .await?;
    Ok(())
}

/// An operator watching `ns`, with the seed's v1alpha1 sample applied and converged to 3 Pods.
async fn start_with_sample(client: &Client, ns: &str) -> anyhow::Result<Operator> {
    let op = start(client, ns, ManagerOptions::default()).await?;
    apply_yaml(client, ns, &sample("cache_v1alpha1_memcached.yaml")).await?;
    wait_for_size(client, ns, "memcached-sample", 3).await?;
    Ok(op)
}

#[tokio::test]
async fn the_seed_sample_gets_its_pods_and_follows_size_changes() {
    shared()
        .in_namespace("mc-sample", |client, ns| async move {
            let _op = start(&client, &ns, ManagerOptions::default()).await?;
            apply_yaml(&client, &ns, &sample("cache_v1alpha1_memcached.yaml")).await?;
            let nodes = wait_for_size(&client, &ns, "memcached-sample", 3).await?;
            ensure!(
                nodes.iter().all(|n| n.starts_with("memcached-sample-")),
                "{nodes:?}"
            );
            let mut sorted = nodes.clone();
            sorted.sort();
            ensure!(sorted == nodes, "nodes are not sorted: {nodes:?}");

            let mcs: Api<Memcached> = Api::namespaced(client.clone(), &ns);
            mcs.patch(
                "memcached-sample",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"size": 5}})),
            )
            .await?;
            wait_for_size(&client, &ns, "memcached-sample", 5).await?;

            // The v1 sample (with a status block the apiserver drops) works too.
            apply_yaml(&client, &ns, &sample("cache_v1_memcached.yaml")).await?;
            let nodes = wait_for_size(&client, &ns, "example-memcached", 3).await?;
            ensure!(
                !nodes.contains(&"pod1".to_string()),
                "status came from the sample, not the pods: {nodes:?}"
            );
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn manual_scaling_is_reverted_and_a_deleted_deployment_is_recreated() {
    shared()
        .in_namespace("mc-drift", |client, ns| async move {
            let _op = start_with_sample(&client, &ns).await?;
            let deploys: Api<Deployment> = Api::namespaced(client.clone(), &ns);

            // `kubectl scale deployment memcached-sample --replicas=7`
            deploys
                .patch(
                    "memcached-sample",
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"replicas": 7}})),
                )
                .await?;
            wait_for("the scale-up to be reverted", T, || async {
                let r = deploys
                    .get("memcached-sample")
                    .await?
                    .spec
                    .and_then(|s| s.replicas);
                if r == Some(3) {
                    Ok(())
                } else {
                    Err(anyhow!("replicas {r:?}"))
                }
            })
            .await?;
            wait_for_size(&client, &ns, "memcached-sample", 3).await?;

            let old_uid = deploys.get("memcached-sample").await?.uid();
            deploys
                .delete("memcached-sample", &DeleteParams::background())
                .await?;
            wait_for("the Deployment to be recreated", T, || async {
                let d = deploys.get_opt("memcached-sample").await?.context("not there")?;
                if d.uid() != old_uid {
                    Ok(())
                } else {
                    bail!("still the old one")
                }
            })
            .await?;
            wait_for_size(&client, &ns, "memcached-sample", 3).await?;
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn deleting_the_memcached_garbage_collects_its_deployment() {
    shared()
        .in_namespace("mc-gc", |client, ns| async move {
            let _op = start_with_sample(&client, &ns).await?;
            let mcs: Api<Memcached> = Api::namespaced(client.clone(), &ns);
            mcs.delete("memcached-sample", &DeleteParams::background())
                .await?;
            let deploys: Api<Deployment> = Api::namespaced(client.clone(), &ns);
            wait_for("the Deployment to be collected", T, || async {
                match deploys.get_opt("memcached-sample").await? {
                    None => Ok(()),
                    Some(_) => Err(anyhow!("Deployment still exists")),
                }
            })
            .await
        })
        .await;
}

#[tokio::test]
async fn sizes_are_checked_and_defaulted_by_the_apiserver() {
    shared()
        .in_namespace("mc-invalid", |client, ns| async move {
            install_crd(&client, opkit_api::memcached::crd()).await?;
            // Untyped, so the request carries exactly what a user might write.
            let ar = kube::discovery::ApiResource::erase::<Memcached>(&());
            let api: Api<kube::api::DynamicObject> = Api::namespaced_with(client.clone(), &ns, &ar);
            for (spec, expected) in [
                (json!({"size": -1}), "should be greater than or equal to 0"),
                (json!({"size": 101}), "should be less than or equal to 100"),
                (json!({"size": 1.5}), "must be of type integer"),
                (json!({"size": "three"}), "must be of type integer"),
            ] {
                let obj = json!({"apiVersion": "cache.example.com/v1", "kind": "Memcached",
                    "metadata": {"name": "bad"}, "spec": spec});
                let r = api
                    .create(&PostParams::default(), &serde_json::from_value(obj)?)
                    .await;
                match r {
                    Err(kube::Error::Api(s)) if s.code == 422 && s.message.contains(expected) => {}
                    other => bail!("spec {spec}: expected a 422 mentioning {expected:?}, got {other:?}"),
                }
            }
            // A missing size, or spec, is the apiserver's own default: no webhook runs here.
            for (name, obj) in [("no-size", json!({"spec": {}})), ("no-spec", json!({}))] {
                let mut obj = obj;
                obj["apiVersion"] = json!("cache.example.com/v1");
                obj["kind"] = json!("Memcached");
                obj["metadata"] = json!({"name": name});
                let stored = api
                    .create(&PostParams::default(), &serde_json::from_value(obj)?)
                    .await?;
                ensure!(
                    stored.data["spec"]["size"] == json!(opkit_api::memcached::DEFAULT_SIZE),
                    "{name}: stored as {}",
                    stored.data
                );
            }
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn a_converged_resync_writes_nothing() {
    shared()
        .in_namespace("mc-idle", |client, ns| async move {
            let op = start_with_sample(&client, &ns).await?;
            let mcs: Api<Memcached> = Api::namespaced(client.clone(), &ns);
            let deploys: Api<Deployment> = Api::namespaced(client.clone(), &ns);
            // Converged: Available and not Progressing.
            wait_for("Available", T, || async {
                let s = mcs.get("memcached-sample").await?.status.unwrap_or_default();
                let ok = opkit::conditions::is_true(&s.conditions, "Available")
                    && !opkit::conditions::is_true(&s.conditions, "Progressing");
                if ok {
                    Ok(())
                } else {
                    Err(anyhow!("{:?}", s.conditions))
                }
            })
            .await?;
            let deploy_rv = deploys.get("memcached-sample").await?.resource_version();
            assert_quiescent(
                &op.metrics(),
                &mcs,
                "memcached-sample",
                std::time::Duration::from_secs(5),
            )
            .await?;

            // An annotation changes nothing the controller cares about but triggers a reconcile.
            let reconciles = op.metrics().reconciles_total();
            mcs.patch(
                "memcached-sample",
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"annotations": {"touch": "1"}}})),
            )
            .await?;
            wait_for("a finished reconcile after the touch", T, || async {
                let r = op.metrics().reconciles_total();
                if r > reconciles {
                    Ok(())
                } else {
                    Err(anyhow!("{r} reconciles"))
                }
            })
            .await?;
            assert_quiescent(
                &op.metrics(),
                &mcs,
                "memcached-sample",
                std::time::Duration::from_secs(5),
            )
            .await?;
            ensure!(
                deploys.get("memcached-sample").await?.resource_version() == deploy_rv,
                "the Deployment was rewritten"
            );
            Ok(())
        })
        .await;
}

fn free_addr() -> std::net::SocketAddr {
    let port = opkit_testenv::free_port().expect("a free loopback port");
    std::net::SocketAddr::from(([127, 0, 0, 1], port))
}

#[tokio::test]
async fn metrics_and_probes_answer() {
    shared()
        .in_namespace("mc-http", |client, ns| async move {
            let (m, h) = (free_addr(), free_addr());
            let opts = ManagerOptions {
                metrics_addr: Some(m),
                health_addr: Some(h),
                ..Default::default()
            };
            let _op = start(&client, &ns, opts).await?;
            wait_for("/readyz", T, || http_get(h, "/readyz")).await?;
            wait_for("/readyz to be ok", T, || async {
                let (code, body) = http_get(h, "/readyz").await?;
                if code == 200 {
                    Ok(())
                } else {
                    Err(anyhow!("{code} {body}"))
                }
            })
            .await?;
            ensure!(http_get(h, "/healthz").await?.0 == 200);
            apply_yaml(&client, &ns, &sample("cache_v1alpha1_memcached.yaml")).await?;
            wait_for_size(&client, &ns, "memcached-sample", 3).await?;
            let (code, body) = http_get(m, "/metrics").await?;
            ensure!(code == 200, "/metrics answered {code}");
            for needle in [
                "opkit_reconcile_total{controller=\"memcached\",result=\"success\"}",
                "opkit_reconcile_duration_seconds_bucket{le=",
                // The Deployment, created with a POST: the plan has not changed it since.
                "opkit_api_writes_total{controller=\"memcached\",verb=\"create\"} 1",
            ] {
                ensure!(body.contains(needle), "/metrics lacks {needle}:\n{body}");
            }
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn an_operator_restart_leaves_a_converged_memcached_untouched() {
    shared()
        .in_namespace("mc-restart", |client, ns| async move {
            let op = start_with_sample(&client, &ns).await?;
            let mcs: Api<Memcached> = Api::namespaced(client.clone(), &ns);
            wait_for("Available and not Progressing", T, || async {
                let s = mcs.get("memcached-sample").await?.status.unwrap_or_default();
                if opkit::conditions::is_true(&s.conditions, "Available")
                    && !opkit::conditions::is_true(&s.conditions, "Progressing")
                {
                    Ok(())
                } else {
                    Err(anyhow!("{:?}", s.conditions))
                }
            })
            .await?;
            assert_quiescent(
                &op.metrics(),
                &mcs,
                "memcached-sample",
                std::time::Duration::from_secs(2),
            )
            .await?;
            let before = mcs.get("memcached-sample").await?;
            let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), &ns);
            let event_versions = || async {
                let mut v: Vec<(String, Option<String>)> = events
                    .list(&Default::default())
                    .await?
                    .items
                    .into_iter()
                    .map(|e| (e.name_any(), e.resource_version()))
                    .collect();
                v.sort();
                anyhow::Ok(v)
            };
            let events_before = event_versions().await?;
            op.stop().await;

            let op = start(&client, &ns, ManagerOptions::default()).await?;
            // Its first reconcile (the Memcached and its children may arrive in one or more
            // batches: one reconcile or several); `assert_quiescent` then waits for all of them.
            wait_for("the new operator to reconcile", T, || async {
                if op.metrics().reconciles_total() >= 1 {
                    Ok(())
                } else {
                    Err(anyhow!("{} reconciles", op.metrics().reconciles_total()))
                }
            })
            .await?;
            assert_quiescent(
                &op.metrics(),
                &mcs,
                "memcached-sample",
                std::time::Duration::from_secs(2),
            )
            .await?;
            ensure!(
                op.metrics().writes_total() == 0,
                "{} writes after the restart",
                op.metrics().writes_total()
            );
            let after = mcs.get("memcached-sample").await?;
            ensure!(
                after.resource_version() == before.resource_version(),
                "status rewritten: {:?} -> {:?}",
                before.status,
                after.status
            );
            ensure!(
                event_versions().await? == events_before,
                "Events changed after the restart"
            );
            Ok(())
        })
        .await;
}

/// A status of a rollout under way is held back: a Memcached that settles within the
/// progress delay costs one status write, and one whose rollout cannot finish (a quota stops
/// its Pods) still shows its progress once the delay has passed.
#[tokio::test]
async fn progress_is_written_once_settled_or_once_it_takes_long() {
    shared()
        .in_namespace("mc-progress", |client, ns| async move {
            const DELAY: Duration = Duration::from_secs(15);
            let tune = format!("memcached.progress-delay={}s", DELAY.as_secs());
            let op = common::start_tuned(&client, &ns, memcached::NAME, ManagerOptions::default(), &[&tune])
                .await?;
            let status_writes =
                || op.sample(r#"opkit_api_writes_total{controller="memcached",verb="apply_status"}"#);
            let mcs: Api<Memcached> = Api::namespaced(client.clone(), &ns);
            let deploys: Api<Deployment> = Api::namespaced(client.clone(), &ns);

            // Settles quickly (kwok Pods are Ready at once): one status write, the settled one.
            mcs.create(&PostParams::default(), &new_memcached("quick", 2)?)
                .await?;
            wait_for("quick to settle", T, || async {
                let mc = mcs.get("quick").await?;
                let s = mc.status.clone().unwrap_or_default();
                let done = s.observed_generation == mc.metadata.generation
                    && opkit::conditions::is_true(&s.conditions, "Available")
                    && !opkit::conditions::is_true(&s.conditions, "Progressing");
                if done { Ok(()) } else { Err(anyhow!("{s:?}")) }
            })
            .await?;
            common::settled(&op.metrics()).await?;
            ensure!(
                status_writes() == 1.0,
                "{} status writes for one settled change",
                status_writes()
            );

            // Stuck: the quota leaves room for one of its three Pods.
            pod_quota(&client, &ns, 3).await?;
            let created = std::time::Instant::now();
            mcs.create(&PostParams::default(), &new_memcached("stuck", 3)?)
                .await?;
            wait_for("the one Pod the quota allows to be Ready", T, || async {
                let ready = deploys
                    .get_opt("stuck")
                    .await?
                    .and_then(|d| d.status?.ready_replicas)
                    .unwrap_or(0);
                if ready == 1 {
                    Ok(())
                } else {
                    Err(anyhow!("{ready} ready"))
                }
            })
            .await?;
            common::settled(&op.metrics()).await?;
            if created.elapsed() < DELAY - Duration::from_secs(2) {
                let s = mcs.get("stuck").await?.status;
                ensure!(s.is_none(), "progress written before the delay: {s:?}");
            }
            let shown = wait_for("the progress to be shown", T, || async {
                let s = mcs.get("stuck").await?.status.unwrap_or_default();
                let progressing = opkit::conditions::is_true(&s.conditions, "Progressing");
                if progressing && s.ready_replicas == Some(1) {
                    Ok(created.elapsed())
                } else {
                    Err(anyhow!("{s:?}"))
                }
            })
            .await?;
            ensure!(
                shown >= DELAY,
                "progress shown after {shown:?}, before the {DELAY:?} delay"
            );
            Ok(())
        })
        .await;
}

/// Progress writes share a budget per rollout: of many Memcacheds that cannot finish (a quota
/// leaves no room for their Pods), the budget's worth show their progress once the delay has
/// passed, then one more per delay, never faster, until every one of them has been shown.
#[tokio::test]
async fn progress_writes_of_a_slow_rollout_share_a_budget_and_none_is_left_out() {
    shared()
        .in_namespace("mc-budget", |client, ns| async move {
            const DELAY: Duration = Duration::from_secs(4);
            const BUDGET: usize = 3;
            const OBJECTS: usize = 8;
            pod_quota(&client, &ns, 0).await?;
            let tune = [
                format!("memcached.progress-delay={}s", DELAY.as_secs()),
                format!("memcached.progress-budget={BUDGET}"),
            ];
            let tune: Vec<&str> = tune.iter().map(String::as_str).collect();
            let _op =
                common::start_tuned(&client, &ns, memcached::NAME, ManagerOptions::default(), &tune).await?;
            let mcs: Api<Memcached> = Api::namespaced(client.clone(), &ns);
            for i in 0..OBJECTS {
                mcs.create(&PostParams::default(), &new_memcached(&format!("slow-{i}"), 1)?)
                    .await?;
            }
            let created = std::time::Instant::now();
            let deadline = created + DELAY * (OBJECTS as u32 + 2) + T;
            loop {
                let shown = mcs
                    .list(&Default::default())
                    .await?
                    .items
                    .iter()
                    .filter(|m| {
                        m.status
                            .as_ref()
                            .is_some_and(|s| opkit::conditions::is_true(&s.conditions, "Progressing"))
                    })
                    .count();
                // Writes start after one delay with the budget, and one more comes per delay.
                let delays = created.elapsed().saturating_sub(DELAY).as_secs_f64() / DELAY.as_secs_f64();
                let most = BUDGET + delays.floor() as usize + 1;
                ensure!(
                    shown <= most,
                    "{shown} Memcacheds show their progress {:?} after the create, at most {most} expected",
                    created.elapsed()
                );
                if shown == OBJECTS {
                    break;
                }
                ensure!(
                    std::time::Instant::now() < deadline,
                    "only {shown} of {OBJECTS} Memcacheds show their progress after {:?}",
                    created.elapsed()
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Ok(())
        })
        .await;
}
