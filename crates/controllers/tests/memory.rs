//! Whole reconciles of the repository's controllers in memory (`opkit::testing`): the registry's
//! controllers on an API server inside the test, no control plane. What the cluster's own
//! controllers would do (the Deployment controller's status, its Pods) the test does itself.
use std::collections::BTreeMap;

use anyhow::{Context, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use opkit::testing::Harness;
use opkit_api::foo::Foo;
use opkit_api::memcached::Memcached;
use opkit_controllers::{Settings, memcached, operator};
use serde_json::json;

/// What the Deployment controller and the kubelet would report for a Deployment whose
/// `replicas` Pods all run: the Pods (`pod_labels`), then the Deployment's status.
async fn roll_out(
    client: &Client,
    name: &str,
    replicas: i32,
    pod_labels: BTreeMap<String, String>,
) -> anyhow::Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    for i in 0..replicas {
        let mut pod: Pod = serde_json::from_value(json!({"metadata": {"name": format!("{name}-{i}")}}))?;
        pod.metadata.labels = Some(pod_labels.clone());
        if pods
            .get_opt(&pod.metadata.name.clone().unwrap_or_default())
            .await?
            .is_none()
        {
            let created = pods.create(&PostParams::default(), &pod).await?;
            let running = json!({"status": {"phase": "Running"}});
            pods.patch_status(
                &created.metadata.name.unwrap_or_default(),
                &PatchParams::default(),
                &Patch::Merge(&running),
            )
            .await?;
        }
    }
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), "default");
    let d = deployments.get(name).await?;
    let status = json!({"status": {"observedGeneration": d.metadata.generation, "replicas": replicas,
        "updatedReplicas": replicas, "readyReplicas": replicas, "availableReplicas": replicas}});
    deployments
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await?;
    Ok(())
}

#[tokio::test]
async fn memcached_converges_then_writes_nothing_and_restores_its_deployment() -> anyhow::Result<()> {
    let mut h = Harness::start(operator(), &[memcached::NAME], Settings::default()).await?;
    let client = h.client();
    let mcs: Api<Memcached> = Api::namespaced(client.clone(), "default");
    let sample: Memcached =
        serde_yaml::from_str(include_str!("../../../config/samples/cache_v1_memcached.yaml"))?;
    mcs.create(&PostParams::default(), &sample).await?;

    // The Deployment is applied; the status of a rollout under way is held back.
    let writes = h.settle().await?;
    ensure!(writes.applied("Deployment").len() == 1, "{writes}");
    ensure!(writes.statuses().is_empty() && writes.len() == 1, "{writes}");
    let deployment: Api<Deployment> = Api::namespaced(client.clone(), "default");
    let d = deployment.get("example-memcached").await?;
    ensure!(d.spec.as_ref().and_then(|s| s.replicas) == Some(3));

    // Rolled out: one status write, with the Pods as nodes.
    roll_out(
        &client,
        "example-memcached",
        3,
        memcached::labels("example-memcached"),
    )
    .await?;
    let writes = h.settle().await?;
    ensure!(
        writes.statuses().len() == 1 && writes.len() == 1 && writes.failures() == 0,
        "{writes}"
    );
    // Once the cache shows it, the status write is no longer remembered.
    let unseen = h.metrics().for_controller(memcached::NAME).status_writes_unseen();
    ensure!(unseen == 0, "{unseen} status writes remembered at rest");
    let mc = mcs.get("example-memcached").await?;
    let status = mc.status.context("a status")?;
    ensure!(status.nodes.len() == 3, "{:?}", status.nodes);
    ensure!(opkit::conditions::is_true(
        &status.conditions,
        memcached::condition::AVAILABLE
    ));

    // Converged: nothing to write, neither now nor in the resync after a restart.
    ensure!(h.settle().await?.is_empty());
    let resync = h.resync().await?;
    ensure!(resync.reconciles() >= 1, "no resync after the restart");
    ensure!(
        resync.is_empty(),
        "the resync of a converged Memcached wrote: {resync}"
    );

    // Someone scales the Deployment by hand: it is put back, and the Event says so.
    let by_hand = json!({"spec": {"replicas": 5}});
    deployment
        .patch(
            "example-memcached",
            &PatchParams::default(),
            &Patch::Merge(&by_hand),
        )
        .await?;
    let writes = h.settle().await?;
    ensure!(writes.applied("Deployment").len() == 1, "{writes}");
    ensure!(
        writes.events() == [memcached::reason::DEPLOYMENT_RESTORED],
        "{writes}"
    );
    let d = deployment.get("example-memcached").await?;
    ensure!(d.spec.as_ref().and_then(|s| s.replicas) == Some(3));

    // Deleted: its Deployment goes with it (owner reference), with no write of the operator.
    mcs.delete("example-memcached", &DeleteParams::default()).await?;
    let writes = h.settle().await?;
    ensure!(writes.is_empty(), "{writes}");
    ensure!(deployment.get_opt("example-memcached").await?.is_none());
    Ok(())
}

#[tokio::test]
async fn foo_converges_then_writes_nothing() -> anyhow::Result<()> {
    let mut h = Harness::start(operator(), &["foo"], Settings::default()).await?;
    let client = h.client();
    let foos: Api<Foo> = Api::namespaced(client.clone(), "default");
    let sample: Foo = serde_yaml::from_str(include_str!(
        "../../../config/samples/samplecontroller_v1alpha1_foo.yaml"
    ))?;
    let foo = foos.create(&PostParams::default(), &sample).await?;
    let name = foo.spec.deployment_name.clone();

    let writes = h.settle().await?;
    ensure!(writes.created("Deployment").len() == 1, "{writes}");
    let replicas = foo.spec.replicas.unwrap_or(1);
    roll_out(&client, &name, replicas, BTreeMap::new()).await?;
    let writes = h.settle().await?;
    ensure!(writes.statuses().len() == 1, "{writes}");
    let foo = foos.get(&foo.metadata.name.unwrap_or_default()).await?;
    ensure!(
        foo.status.as_ref().map(|s| s.available_replicas) == Some(replicas),
        "{:?}",
        foo.status
    );

    ensure!(h.settle().await?.is_empty());
    let resync = h.resync().await?;
    ensure!(resync.reconciles() >= 1, "no resync after the restart");
    ensure!(resync.is_empty(), "the resync of a converged Foo wrote: {resync}");
    Ok(())
}

#[tokio::test]
async fn a_config_mirror_copies_into_matching_namespaces_and_cleans_up_before_it_goes() -> anyhow::Result<()>
{
    use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
    use opkit_api::config_mirror::ConfigMirror;
    use opkit_controllers::config_mirror;

    let mut h = Harness::start(operator(), &[config_mirror::NAME], Settings::default()).await?;
    let client = h.client();
    let namespaces: Api<Namespace> = Api::all(client.clone());
    for (name, labelled) in [
        ("default", false),
        ("team-a", true),
        ("team-b", true),
        ("other", false),
    ] {
        let mut ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}}))?;
        if labelled {
            ns.metadata.labels = Some(BTreeMap::from([(
                "mirror.opkit.dev/app-settings".into(),
                "true".into(),
            )]));
        }
        namespaces.create(&PostParams::default(), &ns).await?;
    }
    let sample = include_str!("../../../config/samples/mirror_v1alpha1_configmirror.yaml");
    let mut docs = sample.split("\n---\n");
    let source: ConfigMap = serde_yaml::from_str(docs.next().context("the ConfigMap")?)?;
    let mirror: ConfigMirror = serde_yaml::from_str(docs.next().context("the ConfigMirror")?)?;
    Api::<ConfigMap>::namespaced(client.clone(), "default")
        .create(&PostParams::default(), &source)
        .await?;
    let mirrors: Api<ConfigMirror> = Api::all(client.clone());
    mirrors.create(&PostParams::default(), &mirror).await?;

    // The finalizer first, then a copy in each labelled namespace and the status.
    let writes = h.settle().await?;
    ensure!(
        writes.applied("ConfigMap").len() == 2 && writes.failures() == 0,
        "{writes}"
    );
    let copy = |ns: &str| Api::<ConfigMap>::namespaced(client.clone(), ns);
    for ns in ["team-a", "team-b"] {
        let c = copy(ns).get("app-settings").await?;
        ensure!(c.data == source.data, "{ns}: {:?}", c.data);
    }
    ensure!(copy("other").get_opt("app-settings").await?.is_none());
    let resync = h.resync().await?;
    ensure!(resync.reconciles() >= 1 && resync.is_empty(), "{resync}");

    // Deleted: the copies go before the finalizer does, and then the mirror is gone.
    mirrors.delete("app-settings", &DeleteParams::default()).await?;
    let writes = h.settle().await?;
    ensure!(
        writes.deleted("ConfigMap").len() == 2 && writes.failures() == 0,
        "{writes}"
    );
    ensure!(
        mirrors.get_opt("app-settings").await?.is_none(),
        "the finalizer stayed"
    );
    for ns in ["team-a", "team-b"] {
        ensure!(
            copy(ns).get_opt("app-settings").await?.is_none(),
            "the copy in {ns} stayed"
        );
    }
    Ok(())
}

#[tokio::test]
async fn labels_are_propagated_to_a_kind_named_at_run_time_then_nothing_is_written() -> anyhow::Result<()> {
    use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
    use kube::ResourceExt;
    use opkit_controllers::label_propagation::{self, PROPAGATE, PROPAGATED};

    let settings = Settings {
        propagate: vec!["configmaps.v1".parse().map_err(anyhow::Error::msg)?],
        ..Settings::default()
    };
    let mut h = Harness::start(operator(), &[label_propagation::NAME], settings).await?;
    let client = h.client();
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": "team-a",
        "labels": {"team": "a"}, "annotations": {PROPAGATE: "team"}}}))?;
    namespaces.create(&PostParams::default(), &ns).await?;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "team-a");
    for name in ["one", "two"] {
        let cm: ConfigMap = serde_json::from_value(json!({"metadata": {"name": name}, "data": {"k": "v"}}))?;
        cms.create(&PostParams::default(), &cm).await?;
    }

    let writes = h.settle().await?;
    ensure!(writes.patched("ConfigMap").len() == 2, "{writes}");
    ensure!(writes.failures() == 0, "{writes}");
    for name in ["one", "two"] {
        let cm = cms.get(name).await?;
        ensure!(
            cm.labels().get("team").map(String::as_str) == Some("a"),
            "{:?}",
            cm.labels()
        );
        ensure!(cm.annotations().get(PROPAGATED).map(String::as_str) == Some("team"));
    }
    ensure!(h.settle().await?.is_empty());
    let resync = h.resync().await?;
    ensure!(resync.reconciles() >= 1, "no resync after the restart");
    ensure!(
        resync.is_empty(),
        "the resync of labelled objects wrote: {resync}"
    );

    // The key taken off the annotation: the copies go, and nothing else of the objects.
    namespaces
        .patch(
            "team-a",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {PROPAGATE: null}}})),
        )
        .await?;
    let writes = h.settle().await?;
    ensure!(writes.patched("ConfigMap").len() == 2, "{writes}");
    let cm = cms.get("one").await?;
    ensure!(
        cm.labels().get("team").is_none() && !cm.annotations().contains_key(PROPAGATED),
        "{cm:?}"
    );
    ensure!(cm.data.is_some_and(|d| d["k"] == "v"), "the data went");
    Ok(())
}
