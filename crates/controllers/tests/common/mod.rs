//! Shared by the controller tests: run registry entries in-process on the local control
//! plane, and check that a converged object stays untouched.
#![allow(dead_code)]
use std::fmt::Debug;
use std::time::Duration;

use anyhow::{anyhow, ensure};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::Api;
use kube::{Client, Resource, ResourceExt};
use opkit::metrics::{ControllerMetrics, Metrics};
use opkit::{Connect, Manager, ManagerOptions, RunConfig, Scope};
use opkit_controllers::{Settings, operator, registry};
use opkit_testenv::wait_for;
use serde::de::DeserializeOwned;

pub mod eru;
use tokio_util::sync::CancellationToken;

/// How long any single condition in a test may take.
pub const T: Duration = Duration::from_secs(60);

/// A running manager; stops on drop (or `stop().await`).
pub struct Operator {
    name: &'static str,
    metrics: Metrics,
    stop: CancellationToken,
    handle: Option<tokio::task::JoinHandle<()>>,
}

impl Operator {
    /// The metrics of the registry entry's (first) reconciler.
    pub fn metrics(&self) -> ControllerMetrics {
        self.metrics.for_controller(self.name)
    }

    /// The Prometheus exposition of every controller of this run.
    pub fn encoded(&self) -> String {
        self.metrics.encode()
    }

    /// One sample of the Prometheus exposition, e.g.
    /// `opkit_cache_objects{controller="memcached",kind="Memcached"}` (0 when absent).
    pub fn sample(&self, series: &str) -> f64 {
        self.metrics.sample(series)
    }

    /// The metrics of the reconciler called `name`.
    pub fn metrics_of(&self, name: &str) -> ControllerMetrics {
        self.metrics.for_controller(name)
    }

    /// Whether the manager still runs (it returns only when told to stop, or on an error).
    pub fn running(&self) -> bool {
        self.handle.as_ref().is_some_and(|h| !h.is_finished())
    }

    /// Shuts down gracefully and waits until the manager has stopped.
    pub async fn stop(mut self) {
        self.stop.cancel();
        if let Some(h) = self.handle.take() {
            let _ = h.await;
        }
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(h) = self.handle.take() {
            h.abort();
        }
    }
}

/// Applies a CRD and waits until it is Established.
pub async fn install_crd(client: &Client, crd: CustomResourceDefinition) -> anyhow::Result<()> {
    opkit::install_crd(client, &crd, "opkit-tests").await
}

/// Installs the CRDs of the registry entry `name` and runs it, watching only `ns`, without
/// signal handling.
pub async fn start(
    client: &Client,
    ns: &str,
    name: &'static str,
    opts: ManagerOptions,
) -> anyhow::Result<Operator> {
    start_tuned(client, ns, name, opts, &[]).await
}

/// [`start`] with settings as `opkit run --tune` takes them (`NAME.KEY=VALUE`): through
/// [`opkit::Operator::start`], the assembly `opkit run` uses.
pub async fn start_tuned(
    client: &Client,
    ns: &str,
    name: &'static str,
    opts: ManagerOptions,
    tune: &[&str],
) -> anyhow::Result<Operator> {
    let op = operator();
    let entry = op
        .registry
        .select(&[name.to_string()])
        .map_err(anyhow::Error::msg)?
        .remove(0);
    for crd in (entry.crds)() {
        install_crd(client, crd).await?;
    }
    let mut config = RunConfig::default();
    config.controllers = vec![name.to_string()];
    config.scope = Scope::namespaces(vec![ns.to_string()]);
    config.tune = tune.iter().map(|t| t.to_string()).collect();
    config.manager = ManagerOptions {
        handle_signals: false,
        ..opts
    };
    let (metrics, stop) = (config.metrics.clone(), config.shutdown.clone());
    let started = op
        .start(Connect::Client(client.clone()), config, &Settings::default())
        .await?;
    let handle = tokio::spawn(async move {
        started.wait().await.expect("operator failed");
    });
    Ok(Operator {
        name,
        metrics,
        stop,
        handle: Some(handle),
    })
}

/// [`start`] with the manager set up by `configure` before the controller is added.
pub async fn start_with(
    client: &Client,
    ns: &str,
    name: &'static str,
    opts: ManagerOptions,
    configure: impl FnOnce(Manager) -> anyhow::Result<Manager>,
) -> anyhow::Result<Operator> {
    start_with_after(client, ns, name, opts, configure, |_| {}).await
}

/// [`start_with`], handing the manager to `added` once the controller is added (for what
/// depends on the controllers, such as their webhooks).
pub async fn start_with_after(
    client: &Client,
    ns: &str,
    name: &'static str,
    opts: ManagerOptions,
    configure: impl FnOnce(Manager) -> anyhow::Result<Manager>,
    added: impl FnOnce(&mut Manager),
) -> anyhow::Result<Operator> {
    let registry = registry();
    let entry = registry
        .select(&[name.to_string()])
        .map_err(anyhow::Error::msg)?
        .remove(0);
    for crd in (entry.crds)() {
        install_crd(client, crd).await?;
    }
    let mut manager =
        configure(Manager::new(client.clone()).with_scope(Scope::namespaces(vec![ns.to_string()])))?;
    (entry.add)(&mut manager, &Settings::default());
    added(&mut manager);
    let metrics = manager.metrics().clone();
    let stop = manager.shutdown_token();
    let opts = ManagerOptions {
        handle_signals: false,
        ..opts
    };
    let handle = tokio::spawn(async move {
        manager.run(opts).await.expect("manager failed");
    });
    Ok(Operator {
        name,
        metrics,
        stop,
        handle: Some(handle),
    })
}

/// Waits until `m` has no reconcile running and its counts of finished reconciles and writes
/// have stood still for a second: the work that was due has finished, not just started.
pub async fn settled(m: &ControllerMetrics) -> anyhow::Result<()> {
    let mut last = (u64::MAX, u64::MAX);
    wait_for("the controller to settle", T, || {
        let now = (m.reconciles_total(), m.writes_total());
        let idle = m.reconciles_active() == 0;
        let same = now == last;
        last = now;
        async move {
            tokio::time::sleep(Duration::from_millis(500)).await;
            if idle && same && m.reconciles_active() == 0 {
                Ok(())
            } else {
                Err(anyhow!("reconciles/writes {now:?}, idle {idle}"))
            }
        }
    })
    .await
}

/// Asserts that, once `m` has settled, nothing writes for `window`: no write by the
/// controller and an unchanged `resourceVersion` of `name`.
pub async fn assert_quiescent<K>(
    m: &ControllerMetrics,
    api: &Api<K>,
    name: &str,
    window: Duration,
) -> anyhow::Result<()>
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    settled(m).await?;
    let (writes, rv) = (m.writes_total(), api.get(name).await?.resource_version());
    tokio::time::sleep(window).await;
    let (writes_after, rv_after) = (m.writes_total(), api.get(name).await?.resource_version());
    ensure!(
        writes_after == writes,
        "{} writes during the quiet window: {}",
        writes_after - writes,
        m.describe_writes()
    );
    ensure!(
        rv_after == rv,
        "{name} changed: resourceVersion {rv:?} -> {rv_after:?}"
    );
    Ok(())
}

/// Waits for an Event with `reason` about the object `name` (in `namespace`; `None`: any,
/// as the Events about a cluster-scoped object land in `default`) and returns it.
pub async fn event(
    client: &Client,
    namespace: Option<&str>,
    name: &str,
    reason: &str,
) -> anyhow::Result<k8s_openapi::api::events::v1::Event> {
    let events: Api<k8s_openapi::api::events::v1::Event> = match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    wait_for(&format!("a {reason} Event about {name}"), T, || async {
        events
            .list(&kube::api::ListParams::default())
            .await?
            .items
            .into_iter()
            .find(|e| {
                e.reason.as_deref() == Some(reason)
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
            })
            .ok_or_else(|| anyhow!("no such Event yet"))
    })
    .await
}

/// A file under `config/samples/`.
pub fn sample(file: &str) -> String {
    std::fs::read_to_string(format!(
        "{}/../../config/samples/{file}",
        env!("CARGO_MANIFEST_DIR")
    ))
    .expect("sample")
}
