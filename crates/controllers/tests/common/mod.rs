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
use opkit::{Connect, ManagerOptions, RunConfig, Scope};
use opkit_controllers::{Settings, operator};
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
    Ok(opkit::install_crd(client, &crd, "opkit-tests").await?)
}

/// Deletes the CRD `name` (if there) and waits until the apiserver no longer has it.
pub async fn remove_crd(client: &Client, name: &str) -> anyhow::Result<()> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    if crds.get_opt(name).await?.is_some() {
        crds.delete(name, &kube::api::DeleteParams::default()).await?;
    }
    wait_for(&format!("the CRD {name} gone"), T, || async {
        ensure!(crds.get_opt(name).await?.is_none(), "still there");
        Ok(())
    })
    .await
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

/// [`start`] with settings as `opkit run --tune` takes them (`NAME.KEY=VALUE`).
pub async fn start_tuned(
    client: &Client,
    ns: &str,
    name: &'static str,
    opts: ManagerOptions,
    tune: &[&str],
) -> anyhow::Result<Operator> {
    let names = [name];
    let run = Run {
        opts,
        tune,
        ..Run::new(&names)
    };
    start_op(&operator(), client, ns, run, &Settings::default(), |_| {}).await
}

/// What [`start_op`] runs: registry entries and how.
pub struct Run<'a> {
    /// The `--controllers`; the first names [`Operator::metrics`].
    pub controllers: &'a [&'static str],
    pub opts: ManagerOptions,
    /// As `opkit run --tune` takes them.
    pub tune: &'a [&'a str],
    /// `opkit run --sharding` (with `opts.leader_election`).
    pub sharding: bool,
    /// `opkit run --sharding-slots`.
    pub sharding_slots: u16,
}

impl<'a> Run<'a> {
    pub fn new(controllers: &'a [&'static str]) -> Self {
        Run {
            controllers,
            opts: ManagerOptions::default(),
            tune: &[],
            sharding: false,
            sharding_slots: 0,
        }
    }
}

/// Installs the CRDs of the registry entries `run.controllers` of `op` and runs them through
/// [`opkit::Operator::start`], the assembly `opkit run` uses, watching only `ns`, without
/// signal handling. `started` sees the operator once its controllers are added, before they
/// run (for what depends on them, such as the sharding webhooks).
pub async fn start_op<S>(
    op: &opkit::Operator<S>,
    client: &Client,
    ns: &str,
    run: Run<'_>,
    settings: &S,
    started: impl FnOnce(&mut opkit::Started),
) -> anyhow::Result<Operator> {
    let controllers: Vec<String> = run.controllers.iter().map(|c| c.to_string()).collect();
    for entry in op.registry.select(&controllers).map_err(anyhow::Error::msg)? {
        for crd in (entry.crds)() {
            install_crd(client, crd).await?;
        }
    }
    let mut config = RunConfig::default();
    config.controllers = controllers;
    config.scope = Scope::namespaces(vec![ns.to_string()]);
    config.tune = run.tune.iter().map(|t| t.to_string()).collect();
    config.sharding = run.sharding;
    config.sharding_slots = run.sharding_slots;
    config.manager = ManagerOptions {
        handle_signals: false,
        ..run.opts
    };
    let (metrics, stop) = (config.metrics.clone(), config.shutdown.clone());
    let mut s = op
        .start(Connect::Client(client.clone()), config, settings)
        .await?;
    started(&mut s);
    let handle = tokio::spawn(async move {
        s.wait().await.expect("operator failed");
    });
    Ok(Operator {
        name: run.controllers[0],
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
