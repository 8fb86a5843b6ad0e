//! opkit's runtime with a controller written here, of a built-in kind (ConfigMaps labelled
//! `opkit-probe`): a hung reconcile is cancelled, counted and retried; a reconcile that panics
//! is counted and retried while the manager carries on; a cleanup step outside the cluster that
//! fails keeps the finalizer and warns, and the object goes once it succeeds. `/metrics` over
//! HTTPS serves a mounted certificate and the renewed one when it changes. A status field the
//! plan stops setting is gone from the stored status. After a restart, objects created or
//! changed while the operator was down are reconciled ahead of the resync of the others. A
//! trigger from outside the cluster reconciles the object it names, or all of them. A `Retry`
//! from `observe` is shown as a condition and an Event, and honoured until the service is back.
//! Things outside the cluster are made, kept against drift and dropped through plans' acts. A
//! plan reports the part of a spec it left out and still carries out the rest. A watch of a
//! kind that may not be installed waits for it without holding readiness, follows it once it
//! is installed, and lets its objects go when it is deleted. A child refused because its
//! namespace is being deleted is retried with backoff, not failed, and written once the
//! namespace is back. A finalizer write for an object deleted meanwhile brings nothing back.
//! A field the plan stops setting leaves a child that was created with a POST.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, ensure};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::{Client, Resource, ResourceExt};
use opkit::{
    Cleanup, Deletion, Invalid, ManagerOptions, Plan, Reconciler, Registration, Registry, Requeue, Tuning,
    Watch, Watches,
};
use opkit_testenv::{consistently, free_port, https_get, shared, tls_trusted, wait_for};
use serde_json::json;

mod common;
use common::{Operator, Run, T};

/// Hangs in `observe` once for a ConfigMap annotated `hang`; panics in `plan` once for one
/// annotated `panic`; its cleanup releases the ConfigMap's claim on an outside service, which
/// refuses while `claims.refusing` is set. `planned` lists the ConfigMaps planned without a
/// panic.
#[derive(Clone, Default)]
struct Probe {
    hung: Arc<AtomicBool>,
    panicked: Arc<AtomicBool>,
    planned: Arc<Mutex<BTreeSet<String>>>,
    claims: Claims,
}

/// An outside service that holds a claim per ConfigMap, released when the ConfigMap goes.
#[derive(Clone, Default)]
struct Claims {
    refusing: Arc<AtomicBool>,
}

struct Release;

impl opkit::Outside for Claims {
    type Key = String;
    type State = ();
    type Action = Release;

    fn name(&self) -> &'static str {
        "claims"
    }

    async fn list(&self) -> Result<std::collections::BTreeMap<String, ()>, opkit::Retry> {
        Ok(Default::default())
    }

    async fn read(&self, _: &String) -> Result<Option<()>, opkit::Retry> {
        Ok(None)
    }

    async fn act(&self, _: &String, _: &Release) -> Result<(), opkit::Retry> {
        if self.refusing.load(Ordering::SeqCst) {
            let no = "the outside service said no";
            return Err(opkit::Retry::new(
                Duration::from_secs(1),
                "Ready",
                false,
                "Refused",
                no,
            ));
        }
        Ok(())
    }

    fn action_name(_: &Release) -> &'static str {
        "release"
    }
}

impl Reconciler for Probe {
    type Object = ConfigMap;
    type Caches = opkit::OutsideCache<Claims>;
    /// The ConfigMap an annotation `delete` names.
    type World = Option<ConfigMap>;
    type Status = serde_json::Value;

    fn name(&self) -> &'static str {
        "probe"
    }

    fn tuning(&self, defaults: Tuning) -> Tuning {
        Tuning {
            timeout: Duration::from_secs(1),
            backoff_base: Duration::from_millis(100),
            ..defaults
        }
    }

    fn primary(&self) -> Watch<ConfigMap> {
        Watch::labels("opkit-probe")
    }

    fn watch(&self, w: &mut Watches<ConfigMap>) -> Self::Caches {
        w.outside(self.claims.clone(), Duration::from_secs(3600), |_: &String| None)
    }

    async fn observe(
        &self,
        cm: &ConfigMap,
        _: &Self::Caches,
        client: &Client,
    ) -> kube::Result<Option<ConfigMap>> {
        if cm.annotations().contains_key("hang") && !self.hung.swap(true, Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        match (cm.annotations().get("delete"), cm.namespace()) {
            (Some(name), Some(ns)) => {
                Api::<ConfigMap>::namespaced(client.clone(), &ns)
                    .get_opt(name)
                    .await
            }
            _ => Ok(None),
        }
    }

    fn plan(
        &self,
        cm: &ConfigMap,
        doomed: &Option<ConfigMap>,
        _: Timestamp,
    ) -> Result<Plan<serde_json::Value>, Invalid> {
        if cm.annotations().contains_key("panic") && !self.panicked.swap(true, Ordering::SeqCst) {
            panic!("probe {} asked to panic", cm.name_any());
        }
        self.planned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(cm.name_any());
        Ok(match doomed {
            Some(d) => Plan::nothing(Requeue::OnChange).delete_child(Deletion::of(d)),
            None => Plan::nothing(Requeue::OnChange),
        })
    }

    fn cleans_up(&self) -> bool {
        true
    }

    fn cleanup(&self, cm: &ConfigMap, _: &Option<ConfigMap>, _: Timestamp) -> Cleanup<serde_json::Value> {
        Cleanup::done().act(opkit::Act::new::<Claims>(cm.name_any(), Release))
    }
}

/// An operator of one registry entry `name` (no CRDs, RBAC or webhooks) that `add`s its
/// controllers from the settings.
fn operator_of<S>(name: &'static str, add: fn(&mut opkit::Manager, &S)) -> opkit::Operator<S> {
    opkit::Operator {
        name: "opkit",
        version: "0.0.0",
        about: "a framework test",
        registry: Registry::new(vec![Registration {
            name,
            crds: Vec::new,
            rbac: Vec::new,
            webhooks: |w| w,
            add,
        }]),
    }
}

/// The probe as an operator of its own.
fn probe_operator() -> opkit::Operator<Probe> {
    operator_of("probe", |m, probe| {
        m.add(probe.clone());
    })
}

/// Runs `probe` in `ns` through `opkit run`'s assembly, with the manager's `opts`.
async fn start(client: &Client, ns: &str, probe: Probe, opts: ManagerOptions) -> anyhow::Result<Operator> {
    let run = Run {
        opts,
        ..Run::new(&["probe"])
    };
    common::start_op(&probe_operator(), client, ns, run, &probe, |_| {}).await
}

async fn probe(client: &Client, ns: &str, name: &str, annotations: serde_json::Value) -> anyhow::Result<()> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let cm =
        json!({"metadata": {"name": name, "labels": {"opkit-probe": "yes"}, "annotations": annotations}});
    api.create(&PostParams::default(), &serde_json::from_value(cm)?)
        .await?;
    Ok(())
}

#[tokio::test]
async fn a_hung_reconcile_is_cancelled_counted_and_retried() {
    shared()
        .in_namespace("hung", |client, ns| async move {
            let metrics = start(&client, &ns, Probe::default(), ManagerOptions::default()).await?;
            probe(&client, &ns, "stuck", json!({"hang": ""})).await?;
            let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
            // The first reconcile adds the finalizer; the next (its watch event) hangs in observe
            // and is cancelled after the controller's 1 s timeout; the retry plans to the end.
            let timeouts = r#"opkit_reconcile_errors_total{controller="probe",category="timeout"}"#;
            let planned = r#"opkit_reconcile_total{controller="probe",result="success"}"#;
            wait_for("a timeout, then a plan to the end", T, || async {
                let (t, p) = (metrics.sample(timeouts), metrics.sample(planned));
                if t == 1.0 && p >= 1.0 {
                    Ok(())
                } else {
                    Err(anyhow!("timeouts {t}, planned {p}"))
                }
            })
            .await?;
            ensure!(api.get("stuck").await?.finalizers() == ["opkit.dev/probe"]);
            api.delete("stuck", &DeleteParams::default()).await?;
            wait_for("the probe to be gone", T, || async {
                match api.get_opt("stuck").await? {
                    None => Ok(()),
                    Some(cm) => Err(anyhow!("finalizers {:?}", cm.finalizers())),
                }
            })
            .await
        })
        .await;
}

#[tokio::test]
async fn a_finalizer_another_manager_also_lists_is_still_removed() {
    shared()
        .in_namespace("shared-finalizer", |client, ns| async move {
            let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
            // Created from a manifest that already lists opkit's finalizer (an export, a
            // GitOps repository, a restore): that field manager owns the entry too.
            let manifest = json!({
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "exported", "labels": {"opkit-probe": "yes"}, "finalizers": ["opkit.dev/probe"]}
            });
            api.patch("exported", &PatchParams::apply("gitops"), &Patch::Apply(&manifest))
                .await?;
            let metrics = start(&client, &ns, Probe::default(), ManagerOptions::default()).await?;
            wait_for("the probe to be planned", T, || async {
                let planned = r#"opkit_reconcile_total{controller="probe",result="success"}"#;
                ensure!(metrics.sample(planned) >= 1.0, "not yet");
                Ok(())
            })
            .await?;
            api.delete("exported", &DeleteParams::default()).await?;
            wait_for("the object to be gone", T, || async {
                match api.get_opt("exported").await? {
                    None => Ok(()),
                    Some(cm) => Err(anyhow!("finalizers {:?}", cm.finalizers())),
                }
            })
            .await
        })
        .await;
}

#[tokio::test]
async fn a_plan_deletes_the_object_it_names_and_only_that_one() {
    shared()
        .in_namespace("plan-delete", |client, ns| async move {
            let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
            let plain = |name: &str| serde_json::from_value::<ConfigMap>(json!({"metadata": {"name": name}}));
            api.create(&PostParams::default(), &plain("doomed")?).await?;
            api.create(&PostParams::default(), &plain("bystander")?).await?;
            let metrics = start(&client, &ns, Probe::default(), ManagerOptions::default()).await?;
            probe(&client, &ns, "janitor", json!({"delete": "doomed"})).await?;
            wait_for("the planned deletion", T, || async {
                match api.get_opt("doomed").await? {
                    None => Ok(()),
                    Some(_) => Err(anyhow!("still there")),
                }
            })
            .await?;
            common::settled(&metrics.metrics_of("probe")).await?;
            ensure!(
                api.get_opt("bystander").await?.is_some(),
                "only the named object goes"
            );
            ensure!(api.get_opt("janitor").await?.is_some(), "the primary stays");
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn a_reconcile_that_panics_is_counted_and_retried_and_the_manager_carries_on() {
    shared()
        .in_namespace("panic", |client, ns| async move {
            let reconciler = Probe::default();
            let planned = reconciler.planned.clone();
            let metrics = start(&client, &ns, reconciler, ManagerOptions::default()).await?;
            probe(&client, &ns, "boom", json!({"panic": ""})).await?;
            probe(&client, &ns, "calm", json!({})).await?;
            let panics = r#"opkit_reconcile_panics_total{controller="probe"}"#;
            let errors = r#"opkit_reconcile_errors_total{controller="probe",category="panic"}"#;
            let all = |names: &[&str]| {
                let p = planned.lock().unwrap_or_else(|p| p.into_inner());
                names.iter().all(|n| p.contains(*n))
            };
            wait_for(
                "boom planned on its retry after the panic, calm planned",
                T,
                || async {
                    let (p, e) = (metrics.sample(panics), metrics.sample(errors));
                    if p == 1.0 && e == 1.0 && all(&["boom", "calm"]) {
                        Ok(())
                    } else {
                        Err(anyhow!(
                            "panics {p}, errors {e}, planned {:?}",
                            planned.lock().unwrap_or_else(|p| p.into_inner())
                        ))
                    }
                },
            )
            .await?;
            // The manager is still running: an object created after the panic is reconciled.
            probe(&client, &ns, "late", json!({})).await?;
            wait_for("late planned", T, || async {
                if all(&["late"]) {
                    Ok(())
                } else {
                    Err(anyhow!("{:?}", planned.lock().unwrap_or_else(|p| p.into_inner())))
                }
            })
            .await?;
            ensure!(metrics.sample(panics) == 1.0, "one panic only");
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn a_failing_act_outside_the_cluster_keeps_the_finalizer_warns_and_is_retried() {
    shared()
        .in_namespace("release", |client, ns| async move {
            let p = Probe::default();
            let refusing = p.claims.refusing.clone();
            let metrics = start(&client, &ns, p, ManagerOptions::default()).await?;
            probe(&client, &ns, "held", json!({})).await?;
            let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
            wait_for("the finalizer", T, || async {
                let cm = api.get("held").await?;
                if cm.finalizers().is_empty() {
                    Err(anyhow!("none yet"))
                } else {
                    Ok(())
                }
            })
            .await?;
            refusing.store(true, Ordering::SeqCst);
            api.delete("held", &DeleteParams::default()).await?;
            let warning = common::event(&client, Some(&ns), "held", "CleanupFailed").await?;
            let note = warning.note.unwrap_or_default();
            ensure!(
                note.contains("release \"held\" failed: the outside service said no"),
                "{note}"
            );
            let failed = r#"opkit_calls_total{controller="probe",step="claims.release",result="retry"}"#;
            wait_for("retries", T, || async {
                let n = metrics.sample(failed);
                if n >= 2.0 { Ok(()) } else { Err(anyhow!("{n}")) }
            })
            .await?;
            ensure!(
                api.get_opt("held").await?.is_some(),
                "deleted although its cleanup failed"
            );
            // The outside service agrees: the next retry releases and the object goes.
            refusing.store(false, Ordering::SeqCst);
            wait_for("the object to go", T, || async {
                match api.get_opt("held").await? {
                    None => Ok(()),
                    Some(_) => Err(anyhow!("still there")),
                }
            })
            .await?;
            let ok =
                metrics.sample(r#"opkit_calls_total{controller="probe",step="claims.release",result="ok"}"#);
            ensure!(ok == 1.0, "{ok} successful releases");
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn secure_metrics_serve_the_mounted_certificate_and_its_renewal() {
    shared()
        .in_namespace("metrics-cert", |client, ns| async move {
            let dir = std::env::temp_dir().join(format!("opkit-metrics-cert-{ns}"));
            std::fs::create_dir_all(&dir)?;
            let write = |c: &opkit::webhook::Certificate| -> std::io::Result<()> {
                std::fs::write(dir.join("tls.crt"), &c.cert_pem)?;
                std::fs::write(dir.join("tls.key"), &c.key_pem)
            };
            let first = opkit::webhook::self_signed(&["127.0.0.1".into()])?;
            write(&first)?;
            let port = free_port()?;
            let opts = ManagerOptions {
                metrics_addr: Some(([127, 0, 0, 1], port).into()),
                metrics_secure: true,
                metrics_cert_dir: Some(dir.clone()),
                ..Default::default()
            };
            let _running = start(&client, &ns, Probe::default(), opts).await?;
            wait_for("the mounted certificate", Duration::from_secs(20), || async {
                ensure!(
                    tls_trusted(port, first.ca_pem.as_bytes()).await?,
                    "not trusted yet"
                );
                Ok(())
            })
            .await?;
            // Still authenticated: no token, no metrics.
            let (code, _) = https_get(([127, 0, 0, 1], port).into(), "/metrics", None).await?;
            ensure!(code == 401, "{code}");
            // A renewal (cert-manager rewriting the Secret) is served without a restart.
            let second = opkit::webhook::self_signed(&["127.0.0.1".into()])?;
            ensure!(!tls_trusted(port, second.ca_pem.as_bytes()).await?);
            write(&second)?;
            wait_for("the renewed certificate", Duration::from_secs(30), || async {
                ensure!(
                    tls_trusted(port, second.ca_pem.as_bytes()).await?,
                    "not served yet"
                );
                Ok(())
            })
            .await?;
            std::fs::remove_dir_all(&dir)?;
            Ok(())
        })
        .await;
}

/// A kind of this test's own, with a status: `spec.on` makes the plan set `status.note` and
/// `status.items`; off, it sets neither.
#[derive(kube::CustomResource, Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq)]
#[kube(
    group = "probe.opkit.dev",
    version = "v1",
    kind = "Flag",
    namespaced,
    status = "FlagStatus",
    schema = "disabled"
)]
struct FlagSpec {
    on: bool,
}

#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize, PartialEq)]
struct FlagStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    note: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    items: Vec<String>,
}

struct Flags;

impl Reconciler for Flags {
    type Object = Flag;
    type Caches = ();
    type World = ();
    type Status = FlagStatus;

    fn name(&self) -> &'static str {
        "flags"
    }

    fn watch(&self, _: &mut Watches<Flag>) {}

    async fn observe(&self, _: &Flag, _: &(), _: &Client) -> kube::Result<()> {
        Ok(())
    }

    fn plan(&self, f: &Flag, _: &(), _: Timestamp) -> Result<Plan<FlagStatus>, Invalid> {
        let status = match f.spec.on {
            true => FlagStatus {
                note: Some("on".into()),
                items: vec!["a".into()],
            },
            false => FlagStatus::default(),
        };
        Ok(Plan::status(status, Requeue::OnChange))
    }
}

/// The Flag CRD: no schema of its own (any fields kept), a status subresource.
fn flag_crd() -> anyhow::Result<CustomResourceDefinition> {
    test_crd("probe.opkit.dev", "Flag", "flags", true)
}

/// A namespaced CRD of this test's own in `group`, version v1, with no schema (any fields
/// kept).
fn test_crd(group: &str, kind: &str, plural: &str, status: bool) -> anyhow::Result<CustomResourceDefinition> {
    let subresources = if status { json!({"status": {}}) } else { json!({}) };
    Ok(serde_json::from_value(json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": format!("{plural}.{group}")},
        "spec": {
            "group": group,
            "names": {
                "kind": kind, "plural": plural, "singular": kind.to_lowercase(),
                "listKind": format!("{kind}List"),
            },
            "scope": "Namespaced",
            "versions": [{
                "name": "v1", "served": true, "storage": true,
                "subresources": subresources,
                "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}
            }]
        }
    }))?)
}

#[tokio::test]
async fn a_status_field_the_plan_stops_setting_is_gone_from_the_stored_status() {
    shared()
        .in_namespace("framework-status", |client, ns| async move {
            common::install_crd(&client, flag_crd()?).await?;
            let op = operator_of("flags", |m, _: &()| {
                m.add(Flags);
            });
            let _op = common::start_op(&op, &client, &ns, Run::new(&["flags"]), &(), |_| {}).await?;
            let flags: Api<Flag> = Api::namespaced(client.clone(), &ns);
            let flag = Flag::new("f", FlagSpec { on: true });
            flags.create(&PostParams::default(), &flag).await?;
            wait_for("the plan's status stored", T, || async {
                let s = flags.get("f").await?.status.unwrap_or_default();
                ensure!(s.note.as_deref() == Some("on") && s.items == ["a"], "{s:?}");
                Ok(())
            })
            .await?;
            flags
                .patch(
                    "f",
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"on": false}})),
                )
                .await?;
            wait_for("the fields the plan no longer sets gone", T, || async {
                let s = flags.get("f").await?.status.unwrap_or_default();
                ensure!(s == FlagStatus::default(), "{s:?}");
                Ok(())
            })
            .await?;
            Ok(())
        })
        .await;
}

/// Keeps every owned ConfigMap (labelled `opkit-kept`) it observed, and prunes the others. On
/// its first reconcile of a primary annotated `inject`, `observe` creates a child of it and
/// waits until the cache holds it, then returns what it saw before: a child that reached the
/// cache between observe and the writes.
#[derive(Clone, Default)]
struct Keeper {
    injected: Arc<Mutex<Option<String>>>,
    planned: Arc<std::sync::atomic::AtomicUsize>,
}

impl Reconciler for Keeper {
    type Object = ConfigMap;
    type Caches = opkit::Cache<ConfigMap>;
    type World = Vec<Arc<ConfigMap>>;
    type Status = ();

    fn name(&self) -> &'static str {
        "keeper"
    }

    fn primary(&self) -> Watch<ConfigMap> {
        Watch::labels("opkit-keeper")
    }

    fn watch(&self, w: &mut Watches<ConfigMap>) -> opkit::Cache<ConfigMap> {
        w.owns(Watch::labels("opkit-kept").prune())
    }

    async fn observe(
        &self,
        cm: &ConfigMap,
        children: &opkit::Cache<ConfigMap>,
        client: &Client,
    ) -> kube::Result<Vec<Arc<ConfigMap>>> {
        let uid = cm.uid().unwrap_or_default();
        let owned = || {
            children.filter(|c| {
                c.owner_references()
                    .iter()
                    .any(|o| o.uid == uid && o.controller == Some(true))
            })
        };
        let seen = owned();
        let first = self.injected.lock().unwrap_or_else(|p| p.into_inner()).is_none();
        if first && cm.annotations().contains_key("inject") {
            let ns = cm.namespace().unwrap_or_default();
            let mut late = ConfigMap::default();
            late.metadata.name = Some("late".into());
            late.metadata.labels = Some([("opkit-kept".to_string(), "yes".to_string())].into());
            late.metadata.owner_references = kube::Resource::controller_owner_ref(cm, &()).map(|o| vec![o]);
            let made = Api::<ConfigMap>::namespaced(client.clone(), &ns)
                .create(&PostParams::default(), &late)
                .await?;
            *self.injected.lock().unwrap_or_else(|p| p.into_inner()) = made.uid();
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while owned().len() == seen.len() && std::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        Ok(seen)
    }

    fn plan(&self, _: &ConfigMap, seen: &Vec<Arc<ConfigMap>>, _: Timestamp) -> Result<Plan<()>, Invalid> {
        self.planned.fetch_add(1, Ordering::SeqCst);
        let keep = seen.iter().fold(Plan::nothing(Requeue::OnChange), |p, c| {
            let mut same = ConfigMap::default();
            same.metadata.name = c.metadata.name.clone();
            same.metadata.labels = c.metadata.labels.clone();
            same.metadata.owner_references = c.metadata.owner_references.clone();
            p.child(opkit::Child::apply(&same, Some(c.as_ref())))
        });
        Ok(keep)
    }
}

#[tokio::test]
async fn a_child_that_reaches_the_cache_after_observe_is_not_pruned_unseen() {
    shared()
        .in_namespace("framework-prune", |client, ns| async move {
            let keeper = Keeper::default();
            let op = operator_of("keeper", |m, keeper: &Keeper| {
                m.add(keeper.clone());
            });
            let op = common::start_op(&op, &client, &ns, Run::new(&["keeper"]), &keeper, |_| {}).await?;
            let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
            let primary = json!({"metadata": {"name": "keeper", "labels": {"opkit-keeper": "yes"}, "annotations": {"inject": ""}}});
            api.create(&PostParams::default(), &serde_json::from_value(primary)?)
                .await?;
            // The first reconcile injects the child; its watch event brings a second one,
            // which sees it.
            wait_for("two plans of the primary", T, || async {
                let n = keeper.planned.load(Ordering::SeqCst);
                ensure!(n >= 2, "{n} plans");
                Ok(())
            })
            .await?;
            common::settled(&op.metrics()).await?;
            let injected = keeper.injected.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let late = api.get_opt("late").await?;
            ensure!(
                injected.is_some() && late.as_ref().and_then(|l| l.uid()) == injected,
                "the child created after observe was deleted by the reconcile that never saw it (injected {injected:?}, now {:?}); errors: {}",
                late.and_then(|l| l.uid()),
                op.metrics().describe_errors()
            );
            Ok(())
        })
        .await;
}

/// A kind of this test's own whose status records the generation it has seen.
#[derive(kube::CustomResource, Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq)]
#[kube(
    group = "probe.opkit.dev",
    version = "v1",
    kind = "Tick",
    namespaced,
    status = "TickStatus",
    schema = "disabled"
)]
struct TickSpec {
    n: u32,
}

#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
struct TickStatus {
    observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    conditions: Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition>,
}

/// Writes the generation it saw; `planned` lists the Ticks in the order they were planned.
#[derive(Clone, Default)]
struct Ticks {
    planned: Arc<Mutex<Vec<String>>>,
}

impl Reconciler for Ticks {
    type Object = Tick;
    type Caches = ();
    type World = ();
    type Status = TickStatus;

    fn name(&self) -> &'static str {
        "ticks"
    }

    fn watch(&self, _: &mut Watches<Tick>) {}

    async fn observe(&self, _: &Tick, _: &(), _: &Client) -> kube::Result<()> {
        Ok(())
    }

    fn plan(&self, t: &Tick, _: &(), _: Timestamp) -> Result<Plan<TickStatus>, Invalid> {
        self.planned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(t.name_any());
        let status = TickStatus {
            observed_generation: t.metadata.generation,
            ..Default::default()
        };
        Ok(Plan::status(status, Requeue::OnChange))
    }
}

fn tick_crd() -> anyhow::Result<CustomResourceDefinition> {
    test_crd("probe.opkit.dev", "Tick", "ticks", true)
}

#[tokio::test]
async fn after_a_restart_new_and_changed_objects_are_reconciled_before_the_resync() {
    shared()
        .in_namespace("framework-resync", |client, ns| async move {
            common::install_crd(&client, tick_crd()?).await?;
            let op = operator_of("ticks", |m, t: &Ticks| {
                m.add(t.clone());
            });
            let ticks: Api<Tick> = Api::namespaced(client.clone(), &ns);
            const N: usize = 300;
            let first = Ticks::default();
            let running = common::start_op(&op, &client, &ns, Run::new(&["ticks"]), &first, |_| {}).await?;
            futures::future::try_join_all((0..N).map(|i| {
                let ticks = ticks.clone();
                async move {
                    let t = Tick::new(&format!("t{i:03}"), TickSpec { n: 0 });
                    ticks.create(&PostParams::default(), &t).await
                }
            }))
            .await?;
            let seen =
                |t: &Tick| t.status.as_ref().and_then(|s| s.observed_generation) == t.metadata.generation;
            wait_for("every Tick settled", T, || async {
                let list = ticks.list(&Default::default()).await?;
                let open = list.items.iter().filter(|t| !seen(t)).count();
                ensure!(
                    list.items.len() == N && open == 0,
                    "{open} of {} not settled",
                    list.items.len()
                );
                Ok(())
            })
            .await?;
            running.stop().await;
            // While the operator is down: one created (listed last), one changed.
            ticks
                .create(&PostParams::default(), &Tick::new("z-new", TickSpec { n: 0 }))
                .await?;
            ticks
                .patch(
                    "t250",
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"n": 1}})),
                )
                .await?;
            let second = Ticks::default();
            let running = common::start_op(&op, &client, &ns, Run::new(&["ticks"]), &second, |_| {}).await?;
            // The resync still reaches every object.
            wait_for("every Tick planned after the restart", T, || async {
                let planned: BTreeSet<String> = second.planned.lock().unwrap().iter().cloned().collect();
                ensure!(planned.len() == N + 1, "{} of {} planned", planned.len(), N + 1);
                Ok(())
            })
            .await?;
            let order = second.planned.lock().unwrap().clone();
            let at = |name: &str| order.iter().position(|n| n == name);
            // Ahead of all but at most one batch (16 reconciles at once) of the resync.
            for name in ["z-new", "t250"] {
                let i = at(name).ok_or_else(|| anyhow!("{name} not planned"))?;
                ensure!(
                    i < 2 * 16,
                    "{name} planned {}th of {}: {order:?}",
                    i + 1,
                    order.len()
                );
            }
            let t = ticks.get("z-new").await?;
            ensure!(seen(&t), "the new Tick's status: {:?}", t.status);
            // Every object of the resync started: none is reported pending.
            let metrics = running.metrics();
            wait_for("opkit_resync_pending to fall to 0", T, || async {
                let pending = metrics.resync_pending();
                ensure!(pending == 0, "{pending} pending");
                Ok(())
            })
            .await?;
            Ok(())
        })
        .await;
}

/// Counts its plans per ConfigMap (labelled `opkit-ping`); reconciles what `trigger` asks for.
#[derive(Clone, Default)]
struct Pinged {
    trigger: opkit::Trigger<ConfigMap>,
    planned: Arc<Mutex<std::collections::BTreeMap<String, usize>>>,
}

impl Pinged {
    fn count(&self, name: &str) -> usize {
        self.planned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .copied()
            .unwrap_or(0)
    }
}

impl Reconciler for Pinged {
    type Object = ConfigMap;
    type Caches = ();
    type World = ();
    type Status = ();

    fn name(&self) -> &'static str {
        "pinged"
    }

    fn primary(&self) -> Watch<ConfigMap> {
        Watch::labels("opkit-ping")
    }

    fn watch(&self, w: &mut Watches<ConfigMap>) {
        w.triggered_by(&self.trigger);
    }

    async fn observe(&self, _: &ConfigMap, _: &(), _: &Client) -> kube::Result<()> {
        Ok(())
    }

    fn plan(&self, cm: &ConfigMap, _: &(), _: Timestamp) -> Result<Plan<()>, Invalid> {
        *self
            .planned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(cm.name_any())
            .or_default() += 1;
        Ok(Plan::nothing(Requeue::OnChange))
    }
}

#[tokio::test]
async fn a_trigger_from_outside_reconciles_the_object_it_names_or_all() {
    shared()
        .in_namespace("framework-trigger", |client, ns| async move {
            let pinged = Pinged::default();
            let op = operator_of("pinged", |m, p: &Pinged| {
                m.add(p.clone());
            });
            let _op = common::start_op(&op, &client, &ns, Run::new(&["pinged"]), &pinged, |_| {}).await?;
            let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
            for name in ["a", "b"] {
                let cm = json!({"metadata": {"name": name, "labels": {"opkit-ping": "yes"}}});
                api.create(&PostParams::default(), &serde_json::from_value(cm)?)
                    .await?;
            }
            wait_for("both planned once", T, || async {
                ensure!(
                    pinged.count("a") == 1 && pinged.count("b") == 1,
                    "{:?}",
                    pinged.planned
                );
                Ok(())
            })
            .await?;
            // Another namespace's object of that name is not this scope's.
            pinged.trigger.reconcile(Some("elsewhere"), "a");
            pinged.trigger.reconcile(Some(&ns), "b");
            wait_for("b planned again", T, || async {
                ensure!(pinged.count("b") == 2, "{:?}", pinged.planned);
                Ok(())
            })
            .await?;
            consistently(
                "a not reconciled: it was not asked for",
                Duration::from_secs(1),
                || async {
                    ensure!(pinged.count("a") == 1, "{:?}", pinged.planned);
                    Ok(())
                },
            )
            .await?;
            pinged.trigger.reconcile_all();
            wait_for("both planned again", T, || async {
                ensure!(
                    pinged.count("a") == 2 && pinged.count("b") == 3,
                    "{:?}",
                    pinged.planned
                );
                Ok(())
            })
            .await?;
            Ok(())
        })
        .await;
}

/// Its outside service is down while `down` is set: `observe` then says when to try again
/// (`Retry`, 2 s). `observed` keeps when each observe ran.
#[derive(Clone, Default)]
struct Flaky {
    down: Arc<AtomicBool>,
    observed: Arc<Mutex<Vec<std::time::Instant>>>,
}

const FLAKY_RETRY: Duration = Duration::from_secs(2);

impl Reconciler for Flaky {
    type Object = Tick;
    type Caches = ();
    type World = ();
    type Status = TickStatus;

    fn name(&self) -> &'static str {
        "flaky"
    }

    fn tuning(&self, defaults: Tuning) -> Tuning {
        // A backoff far quicker than the retry's own delay.
        Tuning {
            backoff_base: Duration::from_millis(50),
            ..defaults
        }
    }

    fn watch(&self, _: &mut Watches<Tick>) {}

    async fn observe(&self, _: &Tick, _: &(), _: &Client) -> kube::Result<()> {
        self.observed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(std::time::Instant::now());
        if self.down.load(Ordering::SeqCst) {
            let down = "the inventory service refused the connection";
            return Err(opkit::Retry::new(FLAKY_RETRY, "Ready", false, "ServiceUnavailable", down).into());
        }
        Ok(())
    }

    fn plan(&self, t: &Tick, _: &(), _: Timestamp) -> Result<Plan<TickStatus>, Invalid> {
        let status = TickStatus {
            observed_generation: t.metadata.generation,
            ..Default::default()
        };
        Ok(Plan::status(status, Requeue::OnChange))
    }
}

#[tokio::test]
async fn a_retry_is_shown_as_a_condition_and_honoured_until_the_outside_service_is_back() {
    shared()
        .in_namespace("framework-retry", |client, ns| async move {
            common::install_crd(&client, tick_crd()?).await?;
            let flaky = Flaky::default();
            flaky.down.store(true, Ordering::SeqCst);
            let op = operator_of("flaky", |m, f: &Flaky| {
                m.add(f.clone());
            });
            let op = common::start_op(&op, &client, &ns, Run::new(&["flaky"]), &flaky, |_| {}).await?;
            let ticks: Api<Tick> = Api::namespaced(client.clone(), &ns);
            ticks
                .create(&PostParams::default(), &Tick::new("f", TickSpec { n: 0 }))
                .await?;
            wait_for("the condition and its Event", T, || async {
                let status = ticks.get("f").await?.status.unwrap_or_default();
                let c = status.conditions.first();
                ensure!(
                    c.is_some_and(|c| c.type_ == "Ready"
                        && c.status == "False"
                        && c.reason == "ServiceUnavailable"),
                    "{status:?}"
                );
                let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), &ns);
                let listed = events.list(&Default::default()).await?;
                ensure!(
                    listed
                        .items
                        .iter()
                        .any(|e| e.reason.as_deref() == Some("ServiceUnavailable")
                            && e.type_.as_deref() == Some("Warning")),
                    "no Warning Event yet"
                );
                Ok(())
            })
            .await?;
            wait_for("four observes", T, || async {
                let n = flaky.observed.lock().unwrap().len();
                ensure!(n >= 4, "{n} observes");
                Ok(())
            })
            .await?;
            let times = flaky.observed.lock().unwrap().clone();
            // Only the retry's delay brings the object back (the backoff would be 50 ms). The
            // condition is written once, by the first; that write's watch event may arrive
            // before opkit has noted the write as its own, and reconcile once more at once.
            let gaps: Vec<Duration> = times.windows(2).map(|w| w[1] - w[0]).collect();
            ensure!(
                gaps.iter()
                    .skip(1)
                    .all(|g| *g >= FLAKY_RETRY - Duration::from_millis(100) && *g < 3 * FLAKY_RETRY),
                "gaps between observes: {gaps:?}"
            );
            let retries = op.sample(r#"opkit_reconcile_total{controller="flaky",result="retry"}"#);
            ensure!(retries >= 3.0, "{retries} reconciles counted as retry");
            flaky.down.store(false, Ordering::SeqCst);
            wait_for("converged once the service is back", T, || async {
                let status = ticks.get("f").await?.status.unwrap_or_default();
                ensure!(
                    status.observed_generation == Some(1) && status.conditions.is_empty(),
                    "{status:?}"
                );
                Ok(())
            })
            .await?;
            Ok(())
        })
        .await;
}

/// An outside system of this test's own: named numbers, shared with the test, which changes
/// them by hand and takes the system down (every call then fails with a `Retry`).
#[derive(Clone, Default)]
struct Ledger {
    numbers: Arc<Mutex<std::collections::BTreeMap<String, u32>>>,
    down: Arc<AtomicBool>,
    /// The acts carried out: (action, key).
    acts: Arc<Mutex<Vec<(&'static str, String)>>>,
}

/// What a plan may ask of the ledger.
enum Entry {
    Set(u32),
    Drop,
}

const LEDGER_RETRY: Duration = Duration::from_secs(1);

impl Ledger {
    fn numbers(&self) -> std::sync::MutexGuard<'_, std::collections::BTreeMap<String, u32>> {
        self.numbers.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn up(&self) -> Result<(), opkit::Retry> {
        if self.down.load(Ordering::SeqCst) {
            let down = "the ledger refused the connection";
            return Err(opkit::Retry::new(
                LEDGER_RETRY,
                "Ready",
                false,
                "LedgerUnavailable",
                down,
            ));
        }
        Ok(())
    }
}

impl opkit::Outside for Ledger {
    type Key = String;
    type State = u32;
    type Action = Entry;

    fn name(&self) -> &'static str {
        "ledger"
    }

    async fn list(&self) -> Result<std::collections::BTreeMap<String, u32>, opkit::Retry> {
        self.up()?;
        Ok(self.numbers().clone())
    }

    async fn read(&self, key: &String) -> Result<Option<u32>, opkit::Retry> {
        self.up()?;
        Ok(self.numbers().get(key).copied())
    }

    async fn act(&self, key: &String, action: &Entry) -> Result<(), opkit::Retry> {
        self.up()?;
        match action {
            Entry::Set(n) => self.numbers().insert(key.clone(), *n),
            Entry::Drop => self.numbers().remove(key),
        };
        self.acts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((Self::action_name(action), key.clone()));
        Ok(())
    }

    fn action_name(action: &Entry) -> &'static str {
        match action {
            Entry::Set(_) => "set",
            Entry::Drop => "drop",
        }
    }
}

/// Keeps the ledger's number `<namespace>/<name>` at each Tick's `n`, and drops it when the
/// Tick goes.
#[derive(Clone, Default)]
struct Booked {
    ledger: Ledger,
}

fn ledger_key(t: &Tick) -> String {
    format!("{}/{}", t.namespace().unwrap_or_default(), t.name_any())
}

impl Reconciler for Booked {
    type Object = Tick;
    type Caches = opkit::OutsideCache<Ledger>;
    type World = Option<u32>;
    type Status = TickStatus;

    fn name(&self) -> &'static str {
        "booked"
    }

    fn cleans_up(&self) -> bool {
        true
    }

    fn watch(&self, w: &mut Watches<Tick>) -> Self::Caches {
        w.outside(self.ledger.clone(), Duration::from_millis(200), |key: &String| {
            let (ns, name) = key.split_once('/')?;
            Some(kube::runtime::reflector::ObjectRef::new(name).within(ns))
        })
    }

    async fn observe(&self, t: &Tick, ledger: &Self::Caches, _: &Client) -> kube::Result<Option<u32>> {
        Ok(ledger.get(&ledger_key(t))?)
    }

    fn plan(&self, t: &Tick, booked: &Option<u32>, _: Timestamp) -> Result<Plan<TickStatus>, Invalid> {
        let status = TickStatus {
            observed_generation: t.metadata.generation,
            ..Default::default()
        };
        let plan = Plan::status(status, Requeue::OnChange);
        Ok(match booked {
            Some(n) if *n == t.spec.n => plan,
            _ => plan.act(opkit::Act::new::<Ledger>(ledger_key(t), Entry::Set(t.spec.n))),
        })
    }

    fn cleanup(&self, t: &Tick, booked: &Option<u32>, _: Timestamp) -> Cleanup<TickStatus> {
        match booked {
            Some(_) => Cleanup::done().act(opkit::Act::new::<Ledger>(ledger_key(t), Entry::Drop)),
            None => Cleanup::done(),
        }
    }
}

#[tokio::test]
async fn outside_things_are_made_kept_against_drift_and_dropped_through_the_plans_acts() {
    shared()
        .in_namespace("framework-outside", |client, ns| async move {
            common::install_crd(&client, tick_crd()?).await?;
            let booked = Booked::default();
            booked.ledger.numbers().insert("elsewhere/x".into(), 9);
            let op = operator_of("booked", |m, b: &Booked| {
                m.add(b.clone());
            });
            let op = common::start_op(&op, &client, &ns, Run::new(&["booked"]), &booked, |_| {}).await?;
            let ticks: Api<Tick> = Api::namespaced(client.clone(), &ns);
            ticks
                .create(&PostParams::default(), &Tick::new("a", TickSpec { n: 1 }))
                .await?;
            let key = format!("{ns}/a");
            let number = |want: Option<u32>| {
                let (ledger, key) = (booked.ledger.clone(), key.clone());
                move || {
                    let (ledger, key) = (ledger.clone(), key.clone());
                    async move {
                        let n = ledger.numbers().get(&key).copied();
                        ensure!(n == want, "the ledger has {n:?} for {key}");
                        Ok(())
                    }
                }
            };
            wait_for("the number made", T, number(Some(1))).await?;
            wait_for("the status written", T, || async {
                let status = ticks.get("a").await?.status.unwrap_or_default();
                ensure!(status.observed_generation == Some(1), "{status:?}");
                Ok(())
            })
            .await?;
            let sets = |ledger: &Ledger| {
                ledger
                    .acts
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .iter()
                    .filter(|(a, _)| *a == "set")
                    .count()
            };
            // Settled: no act repeats while nothing changes (several polls long).
            consistently("one set for one Tick", Duration::from_secs(2), || async {
                ensure!(sets(&booked.ledger) == 1, "{:?}", booked.ledger.acts);
                Ok(())
            })
            .await?;

            // Changed by hand outside the cluster: a poll notices, the plan puts it back.
            booked.ledger.numbers().insert(key.clone(), 5);
            wait_for("the drift put right", T, number(Some(1))).await?;
            ensure!(sets(&booked.ledger) == 2, "{:?}", booked.ledger.acts);

            // The ledger down: a new spec waits, shown as a condition, until it is back.
            booked.ledger.down.store(true, Ordering::SeqCst);
            ticks
                .patch(
                    "a",
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"n": 3}})),
                )
                .await?;
            wait_for("the condition", T, || async {
                let status = ticks.get("a").await?.status.unwrap_or_default();
                ensure!(
                    status
                        .conditions
                        .first()
                        .is_some_and(|c| c.reason == "LedgerUnavailable"
                            && c.status == "False"
                            && c.message.contains("refused")),
                    "{status:?}"
                );
                Ok(())
            })
            .await?;
            ensure!(
                booked.ledger.numbers().get(&key) == Some(&1),
                "nothing changed while down"
            );
            booked.ledger.down.store(false, Ordering::SeqCst);
            wait_for("the new number once the ledger is back", T, number(Some(3))).await?;
            wait_for("the condition gone", T, || async {
                let status = ticks.get("a").await?.status.unwrap_or_default();
                ensure!(
                    status.observed_generation == Some(2) && status.conditions.is_empty(),
                    "{status:?}"
                );
                Ok(())
            })
            .await?;

            // Deleted: the number goes, then the Tick; what the controller did not make stays.
            ticks.delete("a", &DeleteParams::default()).await?;
            wait_for("the number dropped", T, number(None)).await?;
            wait_for("the Tick gone", T, || async {
                ensure!(ticks.get_opt("a").await?.is_none(), "still there");
                Ok(())
            })
            .await?;
            ensure!(booked.ledger.numbers().get("elsewhere/x") == Some(&9));
            let ok = op.sample(r#"opkit_calls_total{controller="booked",step="ledger.set",result="ok"}"#);
            ensure!(ok >= 3.0, "{ok} sets counted");
            let dropped =
                op.sample(r#"opkit_calls_total{controller="booked",step="ledger.drop",result="ok"}"#);
            ensure!(dropped == 1.0, "{dropped} drops counted");
            Ok(())
        })
        .await;
}

/// Copies each Tick's `n` into a ConfigMap `tick-<name>`, but leaves an `n` above 100 out of
/// its status: that part of the spec is reported, the rest is still carried out.
#[derive(Clone, Default)]
struct Partial;

impl Reconciler for Partial {
    type Object = Tick;
    type Caches = ();
    type World = ();
    type Status = TickStatus;

    fn name(&self) -> &'static str {
        "partial"
    }

    fn watch(&self, _: &mut Watches<Tick>) {}

    async fn observe(&self, _: &Tick, _: &(), _: &Client) -> kube::Result<()> {
        Ok(())
    }

    fn plan(&self, t: &Tick, _: &(), now: Timestamp) -> Result<Plan<TickStatus>, Invalid> {
        let mut copy = ConfigMap {
            data: Some([("n".to_string(), t.spec.n.to_string())].into()),
            ..Default::default()
        };
        copy.metadata.name = Some(format!("tick-{}", t.name_any()));
        copy.metadata.namespace = t.namespace();
        copy.metadata.owner_references = t.controller_owner_ref(&()).map(|o| vec![o]);
        // The plan always says `Degraded=False`; a part left out overrides it.
        let live = t.status.clone().unwrap_or_default().conditions;
        let fine = opkit::conditions::Desired::no("Degraded", "AsExpected", "spec is counted in full");
        let status = TickStatus {
            observed_generation: t.metadata.generation,
            conditions: opkit::conditions::merge(
                &live,
                &[fine],
                t.metadata.generation,
                &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(now),
            ),
        };
        let plan = Plan::status(status, Requeue::OnChange).child(opkit::Child::apply(&copy, None));
        Ok(if t.spec.n > 100 {
            let too_big = format!("spec.n is {}, at most 100 is counted", t.spec.n);
            plan.degraded(Invalid::new("Degraded", true, "TooBig", too_big))
        } else {
            plan
        })
    }
}

#[tokio::test]
async fn a_plan_reports_the_part_of_the_spec_it_left_out_and_carries_out_the_rest() {
    shared()
        .in_namespace("framework-partial", |client, ns| async move {
            common::install_crd(&client, tick_crd()?).await?;
            let op = operator_of("partial", |m, p: &Partial| {
                m.add(p.clone());
            });
            let _op = common::start_op(&op, &client, &ns, Run::new(&["partial"]), &Partial, |_| {}).await?;
            let ticks: Api<Tick> = Api::namespaced(client.clone(), &ns);
            let maps: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
            let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), &ns);
            let warnings = || async {
                let listed = events.list(&Default::default()).await?;
                anyhow::Ok(
                    listed
                        .items
                        .iter()
                        .filter(|e| e.reason.as_deref() == Some("TooBig"))
                        .map(|e| {
                            e.deprecated_count
                                .unwrap_or(1)
                                .max(e.series.as_ref().map_or(1, |s| s.count))
                        })
                        .sum::<i32>(),
                )
            };
            ticks
                .create(&PostParams::default(), &Tick::new("p", TickSpec { n: 500 }))
                .await?;
            wait_for("the copy, the status and the condition", T, || async {
                let copy = maps.get_opt("tick-p").await?;
                ensure!(
                    copy.and_then(|c| c.data)
                        .and_then(|d| d.get("n").cloned())
                        .as_deref()
                        == Some("500"),
                    "no copy yet"
                );
                let status = ticks.get("p").await?.status.unwrap_or_default();
                ensure!(status.observed_generation == Some(1), "{status:?}");
                ensure!(
                    status.conditions.iter().any(|c| c.type_ == "Degraded"
                        && c.status == "True"
                        && c.reason == "TooBig"
                        && c.observed_generation == Some(1)),
                    "{status:?}"
                );
                ensure!(warnings().await? == 1, "no Warning Event yet");
                Ok(())
            })
            .await?;
            // Reconciled again (a label) from the same spec: no status write, no second Event.
            // Once the clock has passed the condition's transition (times are in seconds), a
            // transition time made anew would show as a write.
            let written = ticks.get("p").await?.status.unwrap_or_default();
            let since = written
                .conditions
                .iter()
                .map(|c| c.last_transition_time.0.as_second())
                .max()
                .unwrap_or_default();
            wait_for("the clock past the condition's transition", T, || async {
                ensure!(Timestamp::now().as_second() > since, "still in the same second");
                Ok(())
            })
            .await?;
            let labelled = ticks
                .patch(
                    "p",
                    &PatchParams::default(),
                    &Patch::Merge(json!({"metadata": {"labels": {"again": "yes"}}})),
                )
                .await?;
            consistently(
                "one Warning Event, the status as it was",
                Duration::from_secs(3),
                || async {
                    ensure!(warnings().await? == 1, "{} TooBig Events", warnings().await?);
                    let now = ticks.get("p").await?;
                    ensure!(
                        now.resource_version() == labelled.resource_version(),
                        "written again: {:?}",
                        now.status
                    );
                    Ok(())
                },
            )
            .await?;
            ticks
                .patch(
                    "p",
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"n": 5}})),
                )
                .await?;
            wait_for(
                "the condition back to the plan's once the spec is fixed",
                T,
                || async {
                    let status = ticks.get("p").await?.status.unwrap_or_default();
                    ensure!(
                        status.observed_generation == Some(2)
                            && status.conditions.len() == 1
                            && status.conditions[0].status == "False"
                            && status.conditions[0].reason == "AsExpected",
                        "{status:?}"
                    );
                    let copy = maps.get("tick-p").await?;
                    ensure!(copy.data.and_then(|d| d.get("n").cloned()).as_deref() == Some("5"));
                    Ok(())
                },
            )
            .await?;
            Ok(())
        })
        .await;
}

/// A kind installed and removed while the operator runs: only [`Lit`]'s test uses it.
#[derive(kube::CustomResource, Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq)]
#[kube(
    group = "lamps.opkit.dev",
    version = "v1",
    kind = "Lamp",
    namespaced,
    schema = "disabled"
)]
struct LampSpec {
    #[serde(default)]
    on: bool,
}

const LAMP_CRD: &str = "lamps.lamps.opkit.dev";

fn lamp_crd() -> anyhow::Result<CustomResourceDefinition> {
    test_crd("lamps.opkit.dev", "Lamp", "lamps", false)
}

/// Counts the Lamps of the namespace into every Flag's `status.note`, through an optional
/// watch: Lamps are another operator's kind, which may not be installed.
struct Lit;

impl Reconciler for Lit {
    type Object = Flag;
    type Caches = opkit::Cache<Lamp>;
    type World = usize;
    type Status = FlagStatus;

    fn name(&self) -> &'static str {
        "lit"
    }

    fn watch(&self, w: &mut Watches<Flag>) -> opkit::Cache<Lamp> {
        let flags = w.primary();
        w.watches(Watch::all().optional(), move |_: Lamp| {
            flags
                .all()
                .iter()
                .map(|f| kube::runtime::reflector::ObjectRef::from_obj(f.as_ref()))
                .collect::<Vec<_>>()
        })
    }

    async fn observe(&self, _: &Flag, lamps: &opkit::Cache<Lamp>, _: &Client) -> kube::Result<usize> {
        Ok(lamps.all().len())
    }

    fn plan(&self, _: &Flag, lamps: &usize, _: Timestamp) -> Result<Plan<FlagStatus>, Invalid> {
        let status = FlagStatus {
            note: Some(format!("{lamps} lamps")),
            items: Vec::new(),
        };
        Ok(Plan::status(status, Requeue::OnChange))
    }
}

/// `client`, counting the requests for Lamps the apiserver answered 404: how often a watch
/// asks for its kind while it is missing.
fn counting_lamp_misses(client: &Client) -> (Client, Arc<std::sync::atomic::AtomicUsize>) {
    let misses = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (inner, counted) = (client.clone(), misses.clone());
    let service = tower::service_fn(move |req: http::Request<kube::client::Body>| {
        let (inner, counted) = (inner.clone(), counted.clone());
        let lamps = req.uri().path().contains("/lamps.opkit.dev/");
        async move {
            let resp = inner.send(req).await;
            if lamps
                && resp
                    .as_ref()
                    .is_ok_and(|r| r.status() == http::StatusCode::NOT_FOUND)
            {
                counted.fetch_add(1, Ordering::SeqCst);
            }
            resp
        }
    });
    (Client::new(service, client.default_namespace()), misses)
}

#[tokio::test]
async fn an_optional_watch_waits_for_its_kind_without_holding_readiness_and_follows_it() {
    shared()
        .in_namespace("framework-optional", |client, ns| async move {
            common::remove_crd(&client, LAMP_CRD).await?;
            common::install_crd(&client, flag_crd()?).await?;
            let health = std::net::SocketAddr::from(([127, 0, 0, 1], free_port()?));
            let run = Run {
                opts: ManagerOptions {
                    health_addr: Some(health),
                    ..Default::default()
                },
                ..Run::new(&["lit"])
            };
            let op = operator_of("lit", |m, _: &()| {
                m.add(Lit);
            });
            let (counting, misses) = counting_lamp_misses(&client);
            let op = common::start_op(&op, &counting, &ns, run, &(), |_| {}).await?;
            let not_found = || misses.load(Ordering::SeqCst);
            let active = r#"opkit_optional_watch_active{controller="lit",kind="Lamp"}"#;
            let readyz = || async {
                let (code, body) = opkit_testenv::http_get(health, "/readyz").await?;
                ensure!(code == 200, "{code} {body}");
                anyhow::Ok(body)
            };
            wait_for("ready, naming the watch that waits", T, || async {
                let body = readyz().await?;
                ensure!(body.contains("waiting for their kind: lit/Lamp"), "{body}");
                ensure!(op.encoded().contains(&format!("{active} 0")), "no inactive gauge");
                Ok(())
            })
            .await?;
            let flags: Api<Flag> = Api::namespaced(client.clone(), &ns);
            flags
                .create(&PostParams::default(), &Flag::new("f", FlagSpec { on: true }))
                .await?;
            let note = |want: &'static str| {
                let flags = flags.clone();
                move || {
                    let flags = flags.clone();
                    async move {
                        let s = flags.get("f").await?.status.unwrap_or_default();
                        ensure!(s.note.as_deref() == Some(want), "{s:?}");
                        Ok(())
                    }
                }
            };
            wait_for("the Flag reconciled without the Lamps", T, note("0 lamps")).await?;
            // While the kind is missing the watch asks every few seconds, not in a loop.
            let before = not_found();
            consistently(
                "few requests for the missing kind",
                Duration::from_secs(10),
                || async {
                    let asked = not_found() - before;
                    ensure!(asked <= 4, "{asked} requests for the missing kind in 10 s");
                    anyhow::Ok(())
                },
            )
            .await?;
            ensure!(not_found() > before, "the watch stopped asking for its kind");

            common::install_crd(&client, lamp_crd()?).await?;
            let lamps: Api<Lamp> = Api::namespaced(client.clone(), &ns);
            for name in ["a", "b"] {
                lamps
                    .create(&PostParams::default(), &Lamp::new(name, LampSpec { on: true }))
                    .await?;
            }
            let installed = std::time::Instant::now();
            wait_for("the Lamps seen once their kind is installed", T, note("2 lamps")).await?;
            let took = installed.elapsed();
            ensure!(took < Duration::from_secs(15), "the Lamps took {took:?}");
            wait_for("the watch active", T, || async {
                ensure!(op.sample(active) == 1.0, "gauge {}", op.sample(active));
                let body = readyz().await?;
                ensure!(body == "ok", "{body}");
                Ok(())
            })
            .await?;

            common::remove_crd(&client, LAMP_CRD).await?;
            wait_for("the Lamps gone with their kind", T, note("0 lamps")).await?;
            wait_for("the watch waiting again", T, || async {
                ensure!(op.sample(active) == 0.0, "gauge {}", op.sample(active));
                ensure!(readyz().await?.contains("lit/Lamp"), "not named");
                Ok(())
            })
            .await?;

            // Installed again: followed again.
            common::install_crd(&client, lamp_crd()?).await?;
            lamps
                .create(&PostParams::default(), &Lamp::new("c", LampSpec { on: false }))
                .await?;
            let installed = std::time::Instant::now();
            wait_for("the Lamp seen once its kind is back", T, note("1 lamps")).await?;
            let took = installed.elapsed();
            ensure!(took < Duration::from_secs(15), "the Lamp took {took:?}");
            ensure!(op.running(), "the manager stopped");
            common::remove_crd(&client, LAMP_CRD).await?;
            Ok(())
        })
        .await;
}

/// Copies a ConfigMap labelled `opkit-spill` into the namespace its annotation `into` names: a
/// child outside the object's namespace, as a controller of several namespaces writes.
struct Spill;

impl Reconciler for Spill {
    type Object = ConfigMap;
    type Caches = ();
    type World = ();
    type Status = ();

    fn name(&self) -> &'static str {
        "spill"
    }

    fn tuning(&self, defaults: Tuning) -> Tuning {
        Tuning {
            backoff_base: Duration::from_millis(200),
            backoff_max: Duration::from_secs(2),
            ..defaults
        }
    }

    fn primary(&self) -> Watch<ConfigMap> {
        Watch::labels("opkit-spill")
    }

    fn watch(&self, _: &mut Watches<ConfigMap>) {}

    async fn observe(&self, _: &ConfigMap, _: &(), _: &Client) -> kube::Result<()> {
        Ok(())
    }

    fn plan(&self, cm: &ConfigMap, _: &(), _: Timestamp) -> Result<Plan<()>, Invalid> {
        let mut copy = ConfigMap {
            data: cm.data.clone(),
            ..Default::default()
        };
        copy.metadata.name = Some(cm.name_any());
        copy.metadata.namespace = cm.annotations().get("into").cloned();
        Ok(Plan::nothing(Requeue::OnChange).child(opkit::Child::apply(&copy, None)))
    }
}

/// A write into a namespace being deleted is refused by the API server (403,
/// `NamespaceTerminating`). That is no failure of the controller: it is not counted as one nor
/// warned about, it is retried with backoff (not in a loop), and the child is written once the
/// namespace is there again.
#[tokio::test]
async fn a_child_whose_namespace_is_being_deleted_is_waited_for_not_failed() {
    shared()
        .in_namespace("framework-spill", |client, ns| async move {
            let away = format!("{ns}-away");
            let nss: Api<Namespace> = Api::all(client.clone());
            let held: Api<ConfigMap> = Api::namespaced(client.clone(), &away);
            let release = || async {
                let patch = Patch::Merge(json!({"metadata": {"finalizers": null}}));
                held.patch("hold", &PatchParams::default(), &patch).await
            };
            let result = async {
                let mut space = Namespace::default();
                space.metadata.name = Some(away.clone());
                nss.create(&PostParams::default(), &space).await?;
                // Holds the namespace in Terminating until its finalizer is taken off.
                let hold = json!({"metadata": {"name": "hold", "finalizers": ["opkit.dev/test-hold"]}});
                held.create(&PostParams::default(), &serde_json::from_value(hold)?)
                    .await?;
                nss.delete(&away, &DeleteParams::default()).await?;
                // Until the API server's admission (which reads a namespace cache) refuses new
                // objects there, as it will refuse the controller's.
                let dry_run = PostParams {
                    dry_run: true,
                    ..PostParams::default()
                };
                let probe: ConfigMap = serde_json::from_value(json!({"metadata": {"name": "probe"}}))?;
                wait_for("new objects refused in the namespace", T, || async {
                    match held.create(&dry_run, &probe).await {
                        Err(kube::Error::Api(s))
                            if s.code == 403
                                && s.details.as_ref().is_some_and(|d| {
                                    d.causes.iter().any(|c| c.reason == "NamespaceTerminating")
                                }) =>
                        {
                            anyhow::Ok(())
                        }
                        other => Err(anyhow!("{other:?}")),
                    }
                })
                .await?;

                let op = operator_of("spill", |m, _: &()| {
                    m.add(Spill);
                });
                let op = common::start_op(&op, &client, &ns, Run::new(&["spill"]), &(), |_| {}).await?;
                let cm = json!({"metadata": {
                    "name": "settings", "labels": {"opkit-spill": "yes"}, "annotations": {"into": away},
                }, "data": {"colour": "blue"}});
                Api::<ConfigMap>::namespaced(client.clone(), &ns)
                    .create(&PostParams::default(), &serde_json::from_value(cm)?)
                    .await?;
                let waited = r#"opkit_reconcile_total{controller="spill",result="namespace_terminating"}"#;
                let failed = r#"controller_runtime_reconcile_errors_total{controller="spill"}"#;
                wait_for("writes refused while the namespace goes", T, || async {
                    ensure!(op.sample(waited) >= 2.0, "{}", op.sample(waited));
                    anyhow::Ok(())
                })
                .await?;
                let before = op.sample(waited);
                consistently(
                    "retried with backoff, not counted as failed",
                    Duration::from_secs(4),
                    || async {
                        let tries = op.sample(waited) - before;
                        ensure!(tries <= 4.0, "{tries} tries in 4 s");
                        ensure!(op.sample(failed) == 0.0, "{}", op.encoded());
                        anyhow::Ok(())
                    },
                )
                .await?;
                ensure!(op.sample(waited) > before, "no longer retried");

                release().await?;
                wait_for("the namespace gone", T, || async {
                    ensure!(nss.get_opt(&away).await?.is_none(), "still there");
                    anyhow::Ok(())
                })
                .await?;
                nss.create(&PostParams::default(), &space).await?;
                wait_for("the copy written into the namespace made anew", T, || async {
                    let copy = held.get_opt("settings").await?;
                    let colour = copy.and_then(|c| c.data).and_then(|d| d.get("colour").cloned());
                    ensure!(colour.as_deref() == Some("blue"), "{colour:?}");
                    anyhow::Ok(())
                })
                .await?;
                ensure!(op.running(), "the manager stopped");
                anyhow::Ok(())
            }
            .await;
            let _ = release().await;
            let _ = nss.delete(&away, &DeleteParams::default()).await;
            result
        })
        .await;
}

/// `client`, deleting the ConfigMap `doomed` of `ns` just before its first finalizer write
/// goes out (an object deleted between the cache's copy and the write), and recording the
/// API server's answer to that write.
fn deleting_before_the_finalizer(
    client: &Client,
    ns: &str,
    doomed: &str,
) -> (Client, Arc<Mutex<Option<u16>>>) {
    let answer = Arc::new(Mutex::new(None));
    let (inner, seen) = (client.clone(), answer.clone());
    let path = format!("/api/v1/namespaces/{ns}/configmaps/{doomed}");
    let service = tower::service_fn(move |req: http::Request<kube::client::Body>| {
        let (inner, seen) = (inner.clone(), seen.clone());
        let first = req.method() == http::Method::PATCH
            && req.uri().path() == path
            && req.uri().query().is_some_and(|q| q.contains("-finalizer"))
            && seen.lock().unwrap_or_else(|p| p.into_inner()).is_none();
        let delete = http::Request::delete(path.clone())
            .body(kube::client::Body::empty())
            .expect("a DELETE request");
        async move {
            if !first {
                return inner.send(req).await;
            }
            inner.send(delete).await?;
            let resp = inner.send(req).await;
            if let Ok(r) = &resp {
                *seen.lock().unwrap_or_else(|p| p.into_inner()) = Some(r.status().as_u16());
            }
            resp
        }
    });
    (Client::new(service, client.default_namespace()), answer)
}

/// The finalizer goes on with a server-side apply, which creates what is missing. An object
/// deleted after the cache's copy was read must not come back as a name and a finalizer.
#[tokio::test]
async fn a_finalizer_for_an_object_deleted_meanwhile_brings_nothing_back() {
    shared()
        .in_namespace("framework-gone", |client, ns| async move {
            let (deleting, answer) = deleting_before_the_finalizer(&client, &ns, "brief");
            let run = Run::new(&["probe"]);
            let metrics =
                common::start_op(&probe_operator(), &deleting, &ns, run, &Probe::default(), |_| {}).await?;
            probe(&client, &ns, "brief", json!({})).await?;
            let code = wait_for("the finalizer write, once its object is gone", T, || async {
                let code = *answer.lock().unwrap_or_else(|p| p.into_inner());
                code.ok_or_else(|| anyhow!("not yet"))
            })
            .await?;
            ensure!(code == 409, "the API server answered {code}");
            let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
            let left = api.get_opt("brief").await?;
            ensure!(left.is_none(), "the object came back: {left:?}");
            ensure!(metrics.running(), "the manager stopped");
            Ok(())
        })
        .await;
}

/// Copies a ConfigMap labelled `opkit-reshape` into `<name>-copy`: the keys of its data that
/// its annotation `keys` lists (comma-separated).
struct Reshape;

impl Reconciler for Reshape {
    type Object = ConfigMap;
    type Caches = opkit::Cache<ConfigMap>;
    type World = Option<Arc<ConfigMap>>;
    type Status = ();

    fn name(&self) -> &'static str {
        "reshape"
    }

    fn primary(&self) -> Watch<ConfigMap> {
        Watch::labels("opkit-reshape")
    }

    fn watch(&self, w: &mut Watches<ConfigMap>) -> opkit::Cache<ConfigMap> {
        w.owns(Watch::labels("opkit-reshaped").applied())
    }

    async fn observe(
        &self,
        cm: &ConfigMap,
        copies: &opkit::Cache<ConfigMap>,
        _: &Client,
    ) -> kube::Result<Option<Arc<ConfigMap>>> {
        let ns = cm.namespace().unwrap_or_default();
        Ok(copies.get(&ns, &format!("{}-copy", cm.name_any())))
    }

    fn plan(&self, cm: &ConfigMap, live: &Option<Arc<ConfigMap>>, _: Timestamp) -> Result<Plan<()>, Invalid> {
        let keys = cm.annotations().get("keys").cloned().unwrap_or_default();
        let data = cm.data.clone().unwrap_or_default();
        let mut copy = ConfigMap {
            data: Some(
                keys.split(',')
                    .filter_map(|k| data.get(k).map(|v| (k.to_string(), v.clone())))
                    .collect(),
            ),
            ..Default::default()
        };
        copy.metadata.name = Some(format!("{}-copy", cm.name_any()));
        copy.metadata.labels = Some([("opkit-reshaped".to_string(), "yes".to_string())].into());
        copy.metadata.owner_references = cm.controller_owner_ref(&()).map(|o| vec![o]);
        Ok(Plan::nothing(Requeue::OnChange).child(opkit::Child::apply(&copy, live.as_deref())))
    }
}

/// Whether `cm`'s managed fields hold an entry of `manager` with `operation` on the object itself.
fn entry_of(cm: &ConfigMap, manager: &str, operation: &str) -> bool {
    cm.managed_fields().iter().any(|e| {
        e.manager.as_deref() == Some(manager)
            && e.operation.as_deref() == Some(operation)
            && e.subresource.as_deref().unwrap_or_default().is_empty()
    })
}

/// A child the plan did not see is created with a POST, so its fields are the controller's
/// `Update` entry, not its `Apply` entry. Applied with the same fields, other values, it
/// changes; once the plan stops setting a field, the field goes, as with a child made by an
/// apply, and the child is the controller's `Apply` entry alone.
#[tokio::test]
async fn a_field_the_plan_stops_setting_leaves_a_child_that_was_created_by_a_post() {
    shared()
        .in_namespace("framework-reshape", |client, ns| async move {
            let op = operator_of("reshape", |m, _: &()| {
                m.add(Reshape);
            });
            let op = common::start_op(&op, &client, &ns, Run::new(&["reshape"]), &(), |_| {}).await?;
            let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
            let primary = json!({"metadata": {
                "name": "source", "labels": {"opkit-reshape": "yes"}, "annotations": {"keys": "a,b"},
            }, "data": {"a": "1", "b": "1"}});
            api.create(&PostParams::default(), &serde_json::from_value(primary)?)
                .await?;
            let manager = "opkit-reshape";
            let copy_is = |want: serde_json::Value| {
                let api = api.clone();
                async move {
                    let copy = api.get_opt("source-copy").await?;
                    let data = copy.as_ref().map(|c| json!(c.data));
                    ensure!(data.as_ref() == Some(&want), "{data:?}");
                    anyhow::Ok(copy.expect("just read"))
                }
            };
            let created = wait_for("the copy", T, || copy_is(json!({"a": "1", "b": "1"}))).await?;
            ensure!(
                created.annotations().contains_key(opkit::diff::CREATED_SHAPE)
                    && entry_of(&created, manager, "Update"),
                "not created by a POST: {:?}",
                created.metadata
            );

            let pp = PatchParams::default();
            api.patch("source", &pp, &Patch::Merge(json!({"data": {"a": "2"}})))
                .await?;
            let changed =
                wait_for("the new value copied", T, || copy_is(json!({"a": "2", "b": "1"}))).await?;
            ensure!(
                changed.annotations().contains_key(opkit::diff::CREATED_SHAPE),
                "same fields, yet the created ones were handed over: {:?}",
                changed.metadata
            );

            // With another change: a key dropped alone is noticed at the next change.
            let fewer = json!({"metadata": {"annotations": {"keys": "a"}}, "data": {"a": "3"}});
            api.patch("source", &pp, &Patch::Merge(fewer)).await?;
            let reshaped =
                wait_for("the key no longer copied gone", T, || copy_is(json!({"a": "3"}))).await?;
            ensure!(
                !reshaped.annotations().contains_key(opkit::diff::CREATED_SHAPE)
                    && !entry_of(&reshaped, manager, "Update")
                    && entry_of(&reshaped, manager, "Apply"),
                "{:?}",
                reshaped.metadata
            );
            common::settled(&op.metrics()).await?;
            ensure!(
                op.metrics().reconciles_failed() == 0,
                "{}",
                op.metrics().describe_errors()
            );
            Ok(())
        })
        .await;
}

/// A fold that does not happen right after the apply. Refused because another write came
/// between (the deployment controller's status, here a label): opkit reads the child and folds
/// again within the same reconcile. Failed (the API server answers 500): the reconcile fails,
/// and the next plan sees the created shape differ from what it applies, so it applies and
/// folds. Otherwise the plans that follow find every field they set present and the dropped
/// key stays.
#[tokio::test]
async fn a_fold_that_did_not_happen_after_the_apply_is_made_again() {
    use opkit_testenv::proxy::{Fault, FaultProxy};
    shared()
        .in_namespace("framework-refold", |client, ns| async move {
            let proxy = FaultProxy::start(client.clone()).await?;
            let through = Client::try_from(proxy.config())?;
            let op = operator_of("reshape", |m, _: &()| {
                m.add(Reshape);
            });
            let op = common::start_op(&op, &through, &ns, Run::new(&["reshape"]), &(), |_| {}).await?;
            let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
            let pp = PatchParams::default();
            let copy_is = |name: &'static str, want: serde_json::Value| {
                let api = api.clone();
                async move {
                    let data = api.get_opt(&format!("{name}-copy")).await?.map(|c| json!(c.data));
                    ensure!(data.as_ref() == Some(&want), "{data:?}");
                    anyhow::Ok(())
                }
            };
            // A POSTed copy of keys a and b, then b dropped while opkit's next merge patch
            // (the fold: its only one here) meets `fault`.
            let drop_b_meeting = |name: &'static str, fault: Fault| {
                let (api, pp, proxy) = (&api, &pp, &proxy);
                async move {
                    let primary = json!({"metadata": {
                        "name": name, "labels": {"opkit-reshape": "yes"}, "annotations": {"keys": "a,b"},
                    }, "data": {"a": "1", "b": "1"}});
                    api.create(&PostParams::default(), &serde_json::from_value(primary)?)
                        .await?;
                    wait_for("the copy", T, || copy_is(name, json!({"a": "1", "b": "1"}))).await?;
                    let faulted = proxy.faulted();
                    proxy.once("application/merge-patch+json", fault);
                    let fewer = json!({"metadata": {"annotations": {"keys": "a"}}, "data": {"a": "3"}});
                    api.patch(name, pp, &Patch::Merge(fewer)).await?;
                    wait_for("the fold to meet its fault", T, || async {
                        ensure!(proxy.faulted() == faulted + 1, "{} faulted", proxy.faulted());
                        Ok(())
                    })
                    .await?;
                    anyhow::Ok(())
                }
            };

            // Refused: held 5 s by the proxy while the copy changes.
            drop_b_meeting("refused", Fault::Delay(Duration::from_secs(5))).await?;
            let touched = json!({"metadata": {"labels": {"touched": "yes"}}});
            api.patch("refused-copy", &pp, &Patch::Merge(touched)).await?;
            wait_for("the key no longer copied gone", T, || {
                copy_is("refused", json!({"a": "3"}))
            })
            .await?;
            let copy = api.get("refused-copy").await?;
            ensure!(
                copy.labels().get("touched").map(String::as_str) == Some("yes")
                    && !copy.annotations().contains_key(opkit::diff::CREATED_SHAPE),
                "{:?}",
                copy.metadata
            );
            common::settled(&op.metrics()).await?;
            ensure!(
                op.metrics().reconciles_failed() == 0,
                "folded again only after a failed reconcile: {}",
                op.metrics().describe_errors()
            );

            // Failed: the next plan folds.
            drop_b_meeting("failed", Fault::Status(500)).await?;
            wait_for("the key no longer copied gone", T, || {
                copy_is("failed", json!({"a": "3"}))
            })
            .await?;
            let copy = api.get("failed-copy").await?;
            ensure!(
                !copy.annotations().contains_key(opkit::diff::CREATED_SHAPE),
                "{:?}",
                copy.metadata
            );
            common::settled(&op.metrics()).await?;
            ensure!(
                op.metrics().reconciles_failed() >= 1,
                "the fold's 500 failed no reconcile"
            );
            Ok(())
        })
        .await;
}
