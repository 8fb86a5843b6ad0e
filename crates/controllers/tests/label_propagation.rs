//! The label-propagation controller on the real local control plane: kinds named when the
//! operator runs, one built in (ConfigMaps) and one a CRD installed after the operator started
//! and deleted while it runs.

use std::time::Duration;

use anyhow::ensure;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams};
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
use kube::{Client, ResourceExt};
use opkit::ManagerOptions;
use opkit_controllers::label_propagation::{self, PROPAGATE, PROPAGATED, reason};
use opkit_controllers::{Settings, operator};
use opkit_testenv::{free_port, shared, wait_for};
use serde_json::json;

mod common;
use common::{Run, T, assert_quiescent};

const GROUP: &str = "propagation.opkit.dev";
const CRD: &str = "widgets.propagation.opkit.dev";

fn widget_crd() -> anyhow::Result<CustomResourceDefinition> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD},
        "spec": {
            "group": GROUP,
            "names": {"kind": "Widget", "plural": "widgets", "singular": "widget", "listKind": "WidgetList"},
            "scope": "Namespaced",
            "versions": [{
                "name": "v1", "served": true, "storage": true,
                "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}
            }]
        }
    }))?)
}

/// Sets the Namespace's `team` label and the keys it propagates (`None`: none).
async fn label_namespace(
    client: &Client,
    ns: &str,
    team: &str,
    propagate: Option<&str>,
) -> anyhow::Result<()> {
    let api: Api<Namespace> = Api::all(client.clone());
    let body = json!({"metadata": {"labels": {"team": team}, "annotations": {PROPAGATE: propagate}}});
    api.patch(ns, &PatchParams::default(), &Patch::Merge(body))
        .await?;
    Ok(())
}

/// Waits until the object's labels and the controller's annotation are `want` (`None`: no
/// copied labels and no annotation), besides `app=web`, which the test set.
async fn labelled(
    what: &str,
    get: impl AsyncFn() -> anyhow::Result<DynamicObject>,
    want: Option<&str>,
) -> anyhow::Result<()> {
    wait_for(what, T, || async {
        let o = get().await?;
        ensure!(
            o.labels().get("app").map(String::as_str) == Some("web"),
            "the test's label went: {:?}",
            o.labels()
        );
        ensure!(
            o.labels().get("team").map(String::as_str) == want,
            "labels {:?}",
            o.labels()
        );
        let copied = o.annotations().get(PROPAGATED).map(String::as_str);
        ensure!(copied == want.map(|_| "team"), "annotation {copied:?}");
        Ok(())
    })
    .await
}

#[tokio::test]
async fn labels_reach_objects_of_kinds_named_at_run_time_including_one_installed_later() {
    shared()
        .in_namespace("label-propagation", |client, ns| async move {
            common::remove_crd(&client, CRD).await?;
            let health = std::net::SocketAddr::from(([127, 0, 0, 1], free_port()?));
            let settings = Settings {
                // Bindings can be created only: never listed, never watched.
                propagate: ["configmaps.v1".to_string(), format!("widgets.v1.{GROUP}"), "bindings.v1".into()]
                    .iter()
                    .map(|k| k.parse())
                    .collect::<Result<_, _>>()
                    .map_err(anyhow::Error::msg)?,
                ..Settings::default()
            };
            let run = Run {
                opts: ManagerOptions {
                    health_addr: Some(health),
                    ..Default::default()
                },
                ..Run::new(&[label_propagation::NAME])
            };
            let op = common::start_op(&operator(), &client, &ns, run, &settings, |_| {}).await?;
            let active = format!(r#"opkit_optional_watch_active{{controller="labelpropagation",kind="widgets.v1.{GROUP}"}}"#);
            let readyz = || async {
                let (code, body) = opkit_testenv::http_get(health, "/readyz").await?;
                ensure!(code == 200, "{code} {body}");
                anyhow::Ok(body)
            };
            wait_for("ready, naming the kind that is not installed", T, || async {
                let body = readyz().await?;
                ensure!(body.contains(&format!("labelpropagation/widgets.v1.{GROUP}")), "{body}");
                ensure!(body.contains("labelpropagation/bindings.v1"), "{body}");
                ensure!(op.encoded().contains(&format!("{active} 0")), "no inactive gauge");
                Ok(())
            })
            .await?;

            // A ConfigMap of the Namespace gets the label it lists.
            let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
            let cm = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "settings", "labels": {"app": "web"}}, "data": {"k": "v"}});
            cms.patch("settings", &PatchParams::apply("test"), &Patch::Apply(cm)).await?;
            label_namespace(&client, &ns, "a", Some("team")).await?;
            let cm_api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &ApiResource::erase::<ConfigMap>(&()));
            let configmap = async || anyhow::Ok(cm_api.get("settings").await?);
            labelled("the ConfigMap labelled team=a", configmap, Some("a")).await?;
            common::event(&client, None, &ns, reason::PROPAGATED).await?;
            // Someone else's team label with another value stays theirs.
            let theirs = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "theirs", "labels": {"team": "z"}}});
            cms.patch("theirs", &PatchParams::apply("someone"), &Patch::Apply(theirs)).await?;
            common::event(&client, None, &ns, reason::CONFLICT).await?;
            let held = cms.get("theirs").await?;
            ensure!(held.labels().get("team").map(String::as_str) == Some("z"), "{:?}", held.labels());
            ensure!(!held.annotations().contains_key(PROPAGATED), "{:?}", held.annotations());
            // What keeps the controller from making again an object deleted since it was
            // seen: a merge patch of a version is refused for an object that is not there (an
            // apply would make it).
            let stale = json!({"metadata": {"resourceVersion": "1", "labels": {"team": "a"}}});
            let refused = cms.patch("gone", &PatchParams::default(), &Patch::Merge(stale)).await;
            ensure!(
                matches!(&refused, Err(kube::Error::Api(s)) if s.code == 404),
                "a merge patch of a missing object: {:?}",
                refused.map(|c| c.metadata)
            );
            ensure!(cms.get_opt("gone").await?.is_none(), "made");

            // The CRD installed now: its objects are found and labelled too.
            common::install_crd(&client, widget_crd()?).await?;
            let widget_kind = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, "v1", "Widget"), "widgets");
            let widgets: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &widget_kind);
            let w = json!({"apiVersion": format!("{GROUP}/v1"), "kind": "Widget", "metadata": {"name": "w", "labels": {"app": "web"}}, "spec": {"size": 1}});
            widgets.patch("w", &PatchParams::apply("test"), &Patch::Apply(w)).await?;
            let widget = async || anyhow::Ok(widgets.get("w").await?);
            let installed = std::time::Instant::now();
            labelled("the Widget labelled team=a", widget, Some("a")).await?;
            let took = installed.elapsed();
            ensure!(took < Duration::from_secs(15), "the Widget took {took:?}");
            wait_for("the watch of Widgets active, and no longer named", T, || async {
                ensure!(op.sample(&active) == 1.0, "gauge {}", op.sample(&active));
                let body = readyz().await?;
                ensure!(!body.contains("widgets"), "{body}");
                Ok(())
            })
            .await?;

            // The Namespace's label changes: both follow; then, once settled, nothing more
            // is written.
            label_namespace(&client, &ns, "b", Some("team")).await?;
            labelled("the ConfigMap relabelled team=b", configmap, Some("b")).await?;
            labelled("the Widget relabelled team=b", widget, Some("b")).await?;
            assert_quiescent(&op.metrics(), &cm_api, "settings", Duration::from_secs(3)).await?;

            // No longer asked for: what was copied goes, and only that.
            label_namespace(&client, &ns, "b", None).await?;
            labelled("the ConfigMap's copied label gone", configmap, None).await?;
            labelled("the Widget's copied label gone", widget, None).await?;

            // The kind goes: its watch waits again, and the rest carries on.
            common::remove_crd(&client, CRD).await?;
            wait_for("the watch of Widgets waiting again", T, || async {
                ensure!(op.sample(&active) == 0.0, "gauge {}", op.sample(&active));
                ensure!(readyz().await?.contains("labelpropagation/widgets"), "not named");
                Ok(())
            })
            .await?;
            label_namespace(&client, &ns, "c", Some("team")).await?;
            labelled("the ConfigMap labelled team=c with Widgets gone", configmap, Some("c")).await?;

            // Installed again: found again.
            common::install_crd(&client, widget_crd()?).await?;
            let w = json!({"apiVersion": format!("{GROUP}/v1"), "kind": "Widget", "metadata": {"name": "w2", "labels": {"app": "web"}}});
            widgets.patch("w2", &PatchParams::apply("test"), &Patch::Apply(w)).await?;
            let widget2 = async || anyhow::Ok(widgets.get("w2").await?);
            labelled("the Widget of the CRD installed again labelled team=c", widget2, Some("c")).await?;
            common::remove_crd(&client, CRD).await?;
            ensure!(op.running(), "the manager stopped");
            // A plan from a version the patch found changed is retried ("stale"); nothing else
            // may fail.
            let stale = op.sample(r#"opkit_reconcile_errors_total{controller="labelpropagation",category="stale"}"#);
            let failed = op.metrics().reconciles_failed() as f64 - stale;
            ensure!(failed == 0.0, "{failed} failed reconciles: {}", op.metrics().describe_errors());
            ensure!(op.sample(r#"opkit_optional_watch_active{controller="labelpropagation",kind="bindings.v1"}"#) == 0.0, "bindings watched");
            // Leave the Namespace as it was found.
            label_namespace(&client, &ns, "c", None).await?;
            Ok(())
        })
        .await;
}
