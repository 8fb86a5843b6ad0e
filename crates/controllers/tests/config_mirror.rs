//! The ConfigMirror controller on the real local control plane: a cluster-scoped primary,
//! children in many namespaces, a finalizer, and a cleanup that fails and resumes.
//!
//! Each test runs its own operator, and an operator reconciles every ConfigMirror of the
//! cluster: the tests take turns ([`TURN`]) so that one test's stopped operator is not
//! covered for by another's.

use std::collections::BTreeMap;

use anyhow::{anyhow, bail, ensure};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use opkit::ManagerOptions;
use opkit_api::config_mirror::ConfigMirror;
use opkit_controllers::config_mirror::{self, MIRROR_LABEL};
use opkit_testenv::{shared, wait_for};
use serde_json::json;

mod common;
use common::{Operator, T, assert_quiescent};

static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn start(client: &Client, ns: &str) -> anyhow::Result<Operator> {
    common::start(client, ns, config_mirror::NAME, ManagerOptions::default()).await
}

/// Namespaces `<ns>-<suffix>` labelled for this test; removed when dropped.
struct Namespaces {
    client: Client,
    names: Vec<String>,
}

impl Namespaces {
    fn new(client: &Client) -> Self {
        Namespaces {
            client: client.clone(),
            names: Vec::new(),
        }
    }

    async fn create(&mut self, name: &str, labels: BTreeMap<String, String>) -> anyhow::Result<()> {
        let api: Api<Namespace> = Api::all(self.client.clone());
        let mut n = Namespace::default();
        n.metadata.name = Some(name.into());
        n.metadata.labels = Some(labels);
        api.create(&PostParams::default(), &n).await?;
        self.names.push(name.into());
        Ok(())
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        let (client, names) = (self.client.clone(), std::mem::take(&mut self.names));
        tokio::spawn(async move {
            let api: Api<Namespace> = Api::all(client);
            for n in names {
                let _ = api.delete(&n, &DeleteParams::default()).await;
            }
        });
    }
}

fn team(ns: &str) -> BTreeMap<String, String> {
    BTreeMap::from([("mirror-test".to_string(), ns.to_string())])
}

async fn source(client: &Client, ns: &str, value: &str) -> anyhow::Result<()> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let cm = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "settings"}, "data": {"level": value}});
    api.patch("settings", &PatchParams::apply("test").force(), &Patch::Apply(cm))
        .await?;
    Ok(())
}

/// A mirror `name` of `<ns>/settings` into the namespaces labelled `mirror-test=<ns>`.
async fn mirror(client: &Client, name: &str, ns: &str) -> anyhow::Result<()> {
    let api: Api<ConfigMirror> = Api::all(client.clone());
    let m: ConfigMirror = serde_json::from_value(json!({
        "apiVersion": "mirror.opkit.dev/v1alpha1", "kind": "ConfigMirror",
        "metadata": {"name": name},
        "spec": {"source": {"namespace": ns, "name": "settings"},
                 "namespaceSelector": {"matchLabels": {"mirror-test": ns}}}
    }))?;
    api.create(&PostParams::default(), &m).await?;
    Ok(())
}

/// The namespaces holding a copy by `mirror`, with the copies' `level`, sorted.
async fn copies(client: &Client, mirror: &str) -> anyhow::Result<Vec<(String, String)>> {
    let api: Api<ConfigMap> = Api::all(client.clone());
    let lp = ListParams::default().labels(&format!("{MIRROR_LABEL}={mirror}"));
    let mut out: Vec<(String, String)> = api
        .list(&lp)
        .await?
        .into_iter()
        .map(|c| {
            let level = c
                .data
                .as_ref()
                .and_then(|d| d.get("level").cloned())
                .unwrap_or_default();
            (c.namespace().unwrap_or_default(), level)
        })
        .collect();
    out.sort();
    Ok(out)
}

async fn wait_copies(client: &Client, mirror: &str, want: &[(&str, &str)]) -> anyhow::Result<()> {
    let want: Vec<(String, String)> = want.iter().map(|(n, l)| (n.to_string(), l.to_string())).collect();
    wait_for(&format!("copies {want:?}"), T, || async {
        let got = copies(client, mirror).await?;
        if got == want {
            Ok(())
        } else {
            Err(anyhow!("{got:?}"))
        }
    })
    .await
}

async fn status_namespaces(client: &Client, mirror: &str) -> anyhow::Result<Vec<String>> {
    let api: Api<ConfigMirror> = Api::all(client.clone());
    Ok(api
        .get(mirror)
        .await?
        .status
        .map(|s| s.namespaces)
        .unwrap_or_default())
}

async fn delete_mirror(client: &Client, name: &str) -> anyhow::Result<()> {
    let api: Api<ConfigMirror> = Api::all(client.clone());
    api.delete(name, &DeleteParams::default()).await?;
    Ok(())
}

/// Waits until the mirror is gone; fails at once if it goes while a copy is still there.
async fn wait_gone_after_its_copies(client: &Client, name: &str) -> anyhow::Result<()> {
    let api: Api<ConfigMirror> = Api::all(client.clone());
    wait_for(&format!("ConfigMirror {name} to be gone"), T, || async {
        let left = copies(client, name).await?;
        match api.get_opt(name).await? {
            Some(m) => Err(anyhow!(
                "still there, finalizers {:?}, copies {left:?}",
                m.finalizers()
            )),
            None if left.is_empty() => Ok(Ok(())),
            // Gone, copies left: the finalizer did not hold it; stop waiting and fail.
            None => Ok(Err(anyhow!("the mirror went before its copies {left:?}"))),
        }
    })
    .await?
}

#[tokio::test]
async fn copies_follow_selected_namespaces_the_source_and_hand_edits() {
    let _turn = TURN.lock().await;
    shared()
        .in_namespace("mirror-follow", |client, ns| async move {
            let mut spaces = Namespaces::new(&client);
            let (a, b, c) = (format!("{ns}-a"), format!("{ns}-b"), format!("{ns}-c"));
            spaces.create(&a, team(&ns)).await?;
            spaces.create(&b, BTreeMap::new()).await?;
            source(&client, &ns, "debug").await?;
            let op = start(&client, &ns).await?;
            let name = format!("{ns}-mirror");
            mirror(&client, &name, &ns).await?;
            wait_copies(&client, &name, &[(&a, "debug")]).await?;
            // Converged means quiet: the echoes of its own writes wake nothing up.
            let mirrors: Api<ConfigMirror> = Api::all(client.clone());
            assert_quiescent(&op.metrics(), &mirrors, &name, std::time::Duration::from_secs(3)).await?;
            let finalizers = Api::<ConfigMirror>::all(client.clone()).get(&name).await?.finalizers().to_vec();
            ensure!(finalizers == ["opkit.dev/configmirror"], "{finalizers:?}");

            // A namespace created later, and one relabelled in and another out.
            spaces.create(&c, team(&ns)).await?;
            wait_copies(&client, &name, &[(&a, "debug"), (&c, "debug")]).await?;
            let nss: Api<Namespace> = Api::all(client.clone());
            let relabel = |n: &str, v: serde_json::Value| {
                let nss = nss.clone();
                let n = n.to_string();
                async move {
                    nss.patch(&n, &PatchParams::default(), &Patch::Merge(json!({"metadata": {"labels": {"mirror-test": v}}})))
                        .await
                }
            };
            relabel(&a, serde_json::Value::Null).await?;
            relabel(&b, json!(ns)).await?;
            wait_copies(&client, &name, &[(&b, "debug"), (&c, "debug")]).await?;
            wait_for("status.namespaces to follow", T, || async {
                let got = status_namespaces(&client, &name).await?;
                if got == [b.clone(), c.clone()] { Ok(()) } else { Err(anyhow!("{got:?}")) }
            })
            .await?;

            // A hand edit is repaired; a change of the source reaches every copy.
            let in_c: Api<ConfigMap> = Api::namespaced(client.clone(), &c);
            in_c.patch("settings", &PatchParams::default(), &Patch::Merge(json!({"data": {"level": "edited"}})))
                .await?;
            wait_copies(&client, &name, &[(&b, "debug"), (&c, "debug")]).await?;
            source(&client, &ns, "info").await?;
            wait_copies(&client, &name, &[(&b, "info"), (&c, "info")]).await?;

            // Someone else's ConfigMap of the same name is left alone and reported.
            let d = format!("{ns}-d");
            spaces.create(&d, BTreeMap::new()).await?;
            let in_d: Api<ConfigMap> = Api::namespaced(client.clone(), &d);
            let theirs = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "settings"}, "data": {"level": "theirs"}});
            in_d.create(&PostParams::default(), &serde_json::from_value(theirs)?).await?;
            relabel(&d, json!(ns)).await?;
            wait_for("the conflict to be reported", T, || async {
                let m = Api::<ConfigMirror>::all(client.clone()).get(&name).await?;
                let ready = m.status.and_then(|s| s.conditions.into_iter().find(|c| c.type_ == "Ready"));
                match ready {
                    Some(r) if r.reason == "NameTaken" && r.message.contains(&d) => Ok(()),
                    other => Err(anyhow!("{other:?}")),
                }
            })
            .await?;
            let level = in_d.get("settings").await?.data.and_then(|d| d.get("level").cloned());
            ensure!(level.as_deref() == Some("theirs"), "taken over: {level:?}");

            delete_mirror(&client, &name).await?;
            wait_gone_after_its_copies(&client, &name).await?;
            let level = in_d.get("settings").await?.data.and_then(|d| d.get("level").cloned());
            ensure!(level.as_deref() == Some("theirs"), "someone else's ConfigMap was deleted: {level:?}");
            Ok(())
        })
        .await;
}

/// A ValidatingAdmissionPolicy refusing every ConfigMap deletion in namespace `ns`: a cleanup
/// step that fails for as long as it exists.
async fn protect(client: &Client, ns: &str) -> anyhow::Result<()> {
    let policies: Api<kube::core::DynamicObject> = Api::all_with(
        client.clone(),
        &kube::core::ApiResource::from_gvk(&kube::core::GroupVersionKind::gvk(
            "admissionregistration.k8s.io",
            "v1",
            "ValidatingAdmissionPolicy",
        )),
    );
    let bindings: Api<kube::core::DynamicObject> = Api::all_with(
        client.clone(),
        &kube::core::ApiResource::from_gvk(&kube::core::GroupVersionKind::gvk(
            "admissionregistration.k8s.io",
            "v1",
            "ValidatingAdmissionPolicyBinding",
        )),
    );
    let pp = PatchParams::apply("test").force();
    let policy = json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": ns},
        "spec": {"failurePolicy": "Fail",
                 "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["DELETE"], "resources": ["configmaps"]}]},
                 "validations": [{"expression": "false", "message": "ConfigMaps here are protected"}]}
    });
    policies.patch(ns, &pp, &Patch::Apply(policy)).await?;
    let binding = json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": ns},
        "spec": {"policyName": ns, "validationActions": ["Deny"],
                 "matchResources": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}}}
    });
    bindings.patch(ns, &pp, &Patch::Apply(binding)).await?;
    // The apiserver loads policies asynchronously: wait until a dry-run deletion is refused.
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let probe = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "probe"}});
    api.patch("probe", &pp, &Patch::Apply(probe)).await?;
    wait_for("the policy to refuse deletions", T, || async {
        let dp = DeleteParams {
            dry_run: true,
            ..Default::default()
        };
        match api.delete("probe", &dp).await {
            Err(kube::Error::Api(s)) if s.message.contains("protected") => Ok(()),
            other => Err(anyhow!("{:?}", other.map(|_| "deleted"))),
        }
    })
    .await?;
    Ok(())
}

async fn unprotect(client: &Client, ns: &str) -> anyhow::Result<()> {
    for kind in ["ValidatingAdmissionPolicyBinding", "ValidatingAdmissionPolicy"] {
        let api: Api<kube::core::DynamicObject> = Api::all_with(
            client.clone(),
            &kube::core::ApiResource::from_gvk(&kube::core::GroupVersionKind::gvk(
                "admissionregistration.k8s.io",
                "v1",
                kind,
            )),
        );
        api.delete(ns, &DeleteParams::default()).await?;
    }
    Ok(())
}

#[tokio::test]
async fn a_failing_cleanup_keeps_the_finalizer_says_why_and_finishes_after_a_restart() {
    let _turn = TURN.lock().await;
    shared()
        .in_namespace("mirror-cleanup", |client, ns| async move {
            let mut spaces = Namespaces::new(&client);
            let (a, b) = (format!("{ns}-a"), format!("{ns}-b"));
            spaces.create(&a, team(&ns)).await?;
            spaces.create(&b, team(&ns)).await?;
            source(&client, &ns, "debug").await?;
            let op = start(&client, &ns).await?;
            let name = format!("{ns}-mirror");
            mirror(&client, &name, &ns).await?;
            wait_copies(&client, &name, &[(&a, "debug"), (&b, "debug")]).await?;

            protect(&client, &b).await?;
            delete_mirror(&client, &name).await?;
            let mirrors: Api<ConfigMirror> = Api::all(client.clone());
            let deleting = wait_for("the cleanup failure to show", T, || async {
                let m = mirrors.get(&name).await?;
                let c = m
                    .status
                    .iter()
                    .flat_map(|s| s.conditions.clone())
                    .find(|c| c.type_ == "Deleting");
                match c {
                    Some(c) if c.status == "True" && c.reason == "CleanupFailed" => Ok(c),
                    other => Err(anyhow!("{other:?}")),
                }
            })
            .await?;
            ensure!(
                deleting.message.contains("protected") && deleting.message.contains(&b),
                "{}",
                deleting.message
            );
            let warning = common::event(&client, None, &name, "CleanupFailed").await?;
            ensure!(warning.type_.as_deref() == Some("Warning"), "{warning:?}");
            // The copy that could be deleted is gone, the protected one stays, and so does the
            // mirror, with its finalizer.
            wait_copies(&client, &name, &[(&b, "debug")]).await?;
            let m = mirrors.get(&name).await?;
            ensure!(
                m.finalizers() == ["opkit.dev/configmirror"],
                "{:?}",
                m.finalizers()
            );
            // No hot loop: retries back off.
            let metrics = op.metrics();
            let before = metrics.reconciles_total();
            tokio::time::sleep(std::time::Duration::from_secs(3)).await;
            let tries = metrics.reconciles_total() - before;
            ensure!(
                tries <= 4,
                "{tries} reconciles in 3 s while the cleanup keeps failing"
            );

            // The operator dies mid-cleanup; the next one finishes it once deletion works.
            drop(op);
            unprotect(&client, &b).await?;
            ensure!(
                mirrors.get_opt(&name).await?.is_some(),
                "went without its operator"
            );
            let _op = start(&client, &ns).await?;
            wait_gone_after_its_copies(&client, &name).await?;
            if !copies(&client, &name).await?.is_empty() {
                bail!("copies left behind");
            }
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn an_invalid_selector_is_refused_by_the_schema_or_the_controller() {
    let _turn = TURN.lock().await;
    shared()
        .in_namespace("mirror-invalid", |client, ns| async move {
            let _op = start(&client, &ns).await?;
            // Without the webhook (the operator runs in-process here), the controller reports it.
            let api: Api<ConfigMirror> = Api::all(client.clone());
            let name = format!("{ns}-bad");
            let m: ConfigMirror = serde_json::from_value(json!({
                "apiVersion": "mirror.opkit.dev/v1alpha1", "kind": "ConfigMirror",
                "metadata": {"name": name},
                "spec": {"source": {"namespace": ns, "name": "settings"},
                         "namespaceSelector": {"matchExpressions": [{"key": "env", "operator": "In"}]}}
            }))?;
            api.create(&PostParams::default(), &m).await?;
            wait_for("the invalid selector to be reported", T, || async {
                let m = api.get(&name).await?;
                let ready = m
                    .status
                    .and_then(|s| s.conditions.into_iter().find(|c| c.type_ == "Ready"));
                match ready {
                    Some(r)
                        if r.reason == "InvalidSpec" && r.message.contains("matchExpressions[0].values") =>
                    {
                        Ok(())
                    }
                    other => Err(anyhow!("{other:?}")),
                }
            })
            .await?;
            // It can still be deleted: the cleanup needs no valid selector.
            delete_mirror(&client, &name).await?;
            wait_gone_after_its_copies(&client, &name).await?;
            Ok(())
        })
        .await;
}
