//! The Foo controller (client-go's sample-controller contract) on the real local control plane.
use anyhow::{anyhow, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use opkit::ManagerOptions;
use opkit_api::foo::Foo;
use opkit_controllers::foo;
use opkit_testenv::{shared, wait_for};
use serde_json::json;

mod common;
use common::{Operator, T, sample};

async fn start(client: &Client, ns: &str) -> anyhow::Result<Operator> {
    common::start(client, ns, foo::NAME, ManagerOptions::default()).await
}

async fn available(foos: &Api<Foo>, name: &str, n: i32) -> anyhow::Result<()> {
    wait_for(&format!("{name} to show {n} available"), T, || async {
        let a = foos.get(name).await?.status.map(|s| s.available_replicas);
        if a == Some(n) {
            Ok(())
        } else {
            Err(anyhow!("available {a:?}"))
        }
    })
    .await
}

#[tokio::test]
async fn the_upstream_example_gets_its_deployment_and_follows_replicas() {
    shared()
        .in_namespace("foo-example", |client, ns| async move {
            let op = start(&client, &ns).await?;
            let foos: Api<Foo> = Api::namespaced(client.clone(), &ns);
            let deploys: Api<Deployment> = Api::namespaced(client.clone(), &ns);
            let example: Foo = serde_yaml::from_str(&sample("samplecontroller_v1alpha1_foo.yaml"))?;
            let created = foos.create(&PostParams::default(), &example).await?;
            available(&foos, "example-foo", 1).await?;
            let d = deploys.get("example-foo").await?;
            ensure!(
                d.owner_references()
                    .iter()
                    .any(|o| Some(&o.uid) == created.uid().as_ref())
            );
            let labels = d
                .spec
                .as_ref()
                .and_then(|s| s.selector.match_labels.clone())
                .unwrap_or_default();
            ensure!(labels.get("app").map(String::as_str) == Some("nginx"));
            ensure!(labels.get("controller").map(String::as_str) == Some("example-foo"));
            // Converging one Foo took one Deployment create and one status write, nothing else.
            ensure!(
                op.metrics().writes_total() == 2,
                "{} writes",
                op.metrics().writes_total()
            );

            foos.patch(
                "example-foo",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"replicas": 3}})),
            )
            .await?;
            available(&foos, "example-foo", 3).await?;
            ensure!(deploys.get("example-foo").await?.spec.and_then(|s| s.replicas) == Some(3));
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn a_deployment_the_foo_does_not_own_is_left_alone_and_reported() {
    shared()
        .in_namespace("foo-conflict", |client, ns| async move {
            let _op = start(&client, &ns).await?;
            let deploys: Api<Deployment> = Api::namespaced(client.clone(), &ns);
            let theirs: Deployment = serde_json::from_value(json!({
                "metadata": {"name": "taken"},
                "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "theirs"}},
                    "template": {"metadata": {"labels": {"app": "theirs"}},
                        "spec": {"containers": [{"name": "c", "image": "busybox"}]}}}
            }))?;
            deploys.create(&PostParams::default(), &theirs).await?;
            let foos: Api<Foo> = Api::namespaced(client.clone(), &ns);
            let f: Foo = serde_json::from_value(json!({
                "apiVersion": "samplecontroller.k8s.io/v1alpha1", "kind": "Foo",
                "metadata": {"name": "intruder"}, "spec": {"deploymentName": "taken", "replicas": 5}
            }))?;
            foos.create(&PostParams::default(), &f).await?;
            let events: Api<Event> = Api::namespaced(client.clone(), &ns);
            let note = wait_for("an ErrResourceExists Event", T, || async {
                events
                    .list(&ListParams::default())
                    .await?
                    .items
                    .into_iter()
                    .find(|e| e.reason.as_deref() == Some(foo::ERR_RESOURCE_EXISTS))
                    .and_then(|e| e.note)
                    .ok_or_else(|| anyhow!("no Event yet"))
            })
            .await?;
            ensure!(
                note.contains("\"taken\" already exists and is not managed by Foo"),
                "{note}"
            );
            let d = deploys.get("taken").await?;
            ensure!(d.owner_references().is_empty(), "the Deployment was taken over");
            ensure!(
                d.spec.and_then(|s| s.replicas) == Some(2),
                "the Deployment was scaled"
            );
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn a_renamed_deployment_replaces_the_old_one() {
    shared()
        .in_namespace("foo-rename", |client, ns| async move {
            let _op = start(&client, &ns).await?;
            let foos: Api<Foo> = Api::namespaced(client.clone(), &ns);
            let deploys: Api<Deployment> = Api::namespaced(client.clone(), &ns);
            let example: Foo = serde_yaml::from_str(&sample("samplecontroller_v1alpha1_foo.yaml"))?;
            foos.create(&PostParams::default(), &example).await?;
            available(&foos, "example-foo", 1).await?;
            foos.patch(
                "example-foo",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"deploymentName": "renamed"}})),
            )
            .await?;
            wait_for("the old Deployment to go and the new one to come", T, || async {
                let old = deploys.get_opt("example-foo").await?;
                let new = deploys.get_opt("renamed").await?;
                match (old, new) {
                    (None, Some(_)) => Ok(()),
                    (o, n) => Err(anyhow!("old {}, new {}", o.is_some(), n.is_some())),
                }
            })
            .await?;
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn pods_refused_in_a_restricted_namespace_are_reported_on_the_foo() {
    shared()
        .in_namespace("foo-restricted", |client, ns| async move {
            let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
            namespaces
                .patch(
                    &ns,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"metadata": {"labels": {
                        "pod-security.kubernetes.io/enforce": "restricted"}}})),
                )
                .await?;
            let _op = start(&client, &ns).await?;
            let foos: Api<Foo> = Api::namespaced(client.clone(), &ns);
            let f: Foo = serde_yaml::from_str(&sample("samplecontroller_v1alpha1_foo.yaml"))?;
            foos.create(&PostParams::default(), &f).await?;
            let events: Api<Event> = Api::namespaced(client.clone(), &ns);
            wait_for("a PodsRefused Event on the Foo", T, || async {
                let found = events
                    .list(&ListParams::default())
                    .await?
                    .items
                    .into_iter()
                    .find(|e| {
                        e.reason.as_deref() == Some(foo::PODS_REFUSED)
                            && e.regarding.as_ref().and_then(|r| r.kind.as_deref()) == Some("Foo")
                    });
                match found {
                    Some(e) => {
                        let note = e.note.unwrap_or_default();
                        ensure!(note.contains("PodSecurity"), "{note}");
                        Ok(())
                    }
                    None => Err(anyhow!("not yet")),
                }
            })
            .await?;
            Ok(())
        })
        .await;
}
