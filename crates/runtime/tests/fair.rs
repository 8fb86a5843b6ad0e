//! The work queue is fair across namespaces: a burst of changes in one namespace does not
//! hold up a change in another. One worker, a reconcile that takes a few milliseconds and a
//! log of the order in which objects were reconciled. The first reconcile waits until a burst
//! of 200 ConfigMaps in one namespace and then one in each of ten quiet namespaces are all
//! queued: with `fair-queue` (the default) the quiet ones are reconciled within the first
//! rounds; without it they are spread through the burst (the work queue serves requests
//! first come, first served).
mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::ensure;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use opkit_runtime::testing::Harness;
use opkit_runtime::{Invalid, Operator, Plan, Reconciler, Registry, Requeue, Tuning, Watch, Watches};

/// The objects reconciled, `namespace/name`, in order.
type Log = Arc<Mutex<Vec<String>>>;

/// What the test shares with the controller: the log, and the gate reconciles wait at.
#[derive(Clone)]
struct Shared {
    log: Log,
    gate: tokio::sync::watch::Receiver<bool>,
}

struct Slow {
    name: &'static str,
    fair: bool,
    /// Lines by the `team` label instead of the namespace.
    by_team: bool,
    shared: Shared,
}

impl Reconciler for Slow {
    type Object = ConfigMap;
    type Caches = ();
    type World = ();
    type Status = ();

    fn name(&self) -> &'static str {
        self.name
    }

    fn tuning(&self, defaults: Tuning) -> Tuning {
        Tuning {
            concurrency: 1,
            fair_queue: self.fair,
            ..defaults
        }
    }

    fn primary(&self) -> Watch<ConfigMap> {
        if !self.by_team {
            return Watch::labels("work");
        }
        Watch::labels("work").fair_by(|cm: &ConfigMap| cm.labels().get("team").cloned().unwrap_or_default())
    }

    fn watch(&self, _: &mut Watches<ConfigMap>) {}

    async fn observe(&self, cm: &ConfigMap, _: &(), _: &Client) -> kube::Result<()> {
        self.shared.log.lock().expect("log lock").push(format!(
            "{}/{}",
            cm.namespace().unwrap_or_default(),
            cm.name_any()
        ));
        let _ = self.shared.gate.clone().wait_for(|open| *open).await;
        // The work a reconcile waits on (an apiserver round trip, say).
        tokio::time::sleep(Duration::from_millis(5)).await;
        Ok(())
    }

    fn plan(&self, _: &ConfigMap, _: &(), _: Timestamp) -> Result<Plan<()>, Invalid> {
        Ok(Plan::nothing(Requeue::OnChange))
    }
}

fn operator() -> Operator<Shared> {
    Operator {
        name: "slow",
        version: "0.1.0",
        about: "Reconciles ConfigMaps slowly",
        registry: Registry::new(vec![
            common::entry("fair", |m, shared| {
                m.add(Slow {
                    name: "fair",
                    fair: true,
                    by_team: false,
                    shared: shared.clone(),
                });
            }),
            common::entry("fifo", |m, shared| {
                m.add(Slow {
                    name: "fifo",
                    fair: false,
                    by_team: false,
                    shared: shared.clone(),
                });
            }),
            common::entry("team", |m, shared| {
                m.add(Slow {
                    name: "team",
                    fair: true,
                    by_team: true,
                    shared: shared.clone(),
                });
            }),
        ]),
    }
}

fn labelled(ns: &str, name: &str, team: &str) -> ConfigMap {
    let mut cm = ConfigMap::default();
    cm.metadata.name = Some(name.into());
    cm.metadata.namespace = Some(ns.into());
    cm.metadata.labels = Some(
        [
            ("work".to_string(), "yes".to_string()),
            ("team".to_string(), team.to_string()),
        ]
        .into(),
    );
    cm
}

/// The burst's ConfigMaps.
const BURST: usize = 200;

/// The quiet namespaces, one ConfigMap each.
const QUIET: usize = 10;

/// The last place a quiet object may take when lines take turns: place 0 held the worker and 1
/// was handed on at once; then one of the burst, each quiet line, the burst again.
const FIRST_ROUNDS: usize = 3 + QUIET;

/// Runs `controller` through a burst of [`BURST`] ConfigMaps of one team in one namespace and one
/// more of each of [`QUIET`] other teams, each in a namespace of its own or (`one_namespace`)
/// in the burst's, and returns the quiet ones' places in the order of reconciles, with the
/// order.
async fn places_of_the_quiet_ones(
    controller: &str,
    one_namespace: bool,
) -> anyhow::Result<(Vec<usize>, Vec<String>)> {
    let (open, gate) = tokio::sync::watch::channel(false);
    let log = Log::default();
    let shared = Shared {
        log: log.clone(),
        gate,
    };
    let mut h = Harness::start(operator(), &[controller], shared).await?;
    let burst: Api<ConfigMap> = Api::namespaced(h.client(), "burst");
    for i in 0..BURST {
        burst
            .create(
                &PostParams::default(),
                &labelled("burst", &format!("b{i}"), "big"),
            )
            .await?;
    }
    for i in 0..QUIET {
        let ns = match one_namespace {
            true => "burst".to_string(),
            false => format!("quiet{i}"),
        };
        Api::<ConfigMap>::namespaced(h.client(), &ns)
            .create(
                &PostParams::default(),
                &labelled(&ns, &format!("q{i}"), &format!("q{i}")),
            )
            .await?;
    }
    // The first reconcile holds the worker until all the others are queued.
    let queued = (BURST + QUIET - 1) as f64;
    let depth = format!("workqueue_depth{{controller=\"{controller}\",name=\"{controller}\"}}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while h.metrics().sample(&depth) < queued {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "not all queued: {depth} is {}",
            h.metrics().sample(&depth)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    open.send_replace(true);
    let writes = h.settle().await?;
    ensure!(writes.failures() == 0, "{writes}");
    let log = log.lock().expect("log lock").clone();
    ensure!(
        log.len() == BURST + QUIET,
        "each object once: {} reconciles",
        log.len()
    );
    let places = (0..log.len())
        .filter(|&i| log[i].split('/').nth(1).is_some_and(|n| n.starts_with('q')))
        .collect();
    Ok((places, log))
}

#[tokio::test]
async fn a_burst_in_one_namespace_does_not_hold_up_the_others() -> anyhow::Result<()> {
    let (places, log) = places_of_the_quiet_ones("fair", false).await?;
    ensure!(
        places.iter().all(|&p| p <= FIRST_ROUNDS),
        "quiet objects at {places:?}: {log:?}"
    );
    Ok(())
}

#[tokio::test]
async fn without_the_fair_queue_the_others_wait_among_the_burst() -> anyhow::Result<()> {
    let (places, log) = places_of_the_quiet_ones("fifo", false).await?;
    ensure!(
        places.iter().any(|&p| p > FIRST_ROUNDS),
        "quiet objects at {places:?}: {log:?}"
    );
    Ok(())
}

#[tokio::test]
async fn lines_can_be_keyed_by_a_label_instead_of_the_namespace() -> anyhow::Result<()> {
    let (places, log) = places_of_the_quiet_ones("team", true).await?;
    ensure!(
        places.iter().all(|&p| p <= FIRST_ROUNDS),
        "quiet teams' objects at {places:?}: {log:?}"
    );
    // Keyed by namespace, the same objects share the burst's line.
    let (places, log) = places_of_the_quiet_ones("fair", true).await?;
    ensure!(
        places.iter().all(|&p| p > FIRST_ROUNDS),
        "quiet teams' objects at {places:?}: {log:?}"
    );
    Ok(())
}
