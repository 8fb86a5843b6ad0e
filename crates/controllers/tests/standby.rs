//! Two replicas on one Lease, in one process: a warm standby fills its caches but neither
//! reconciles nor writes until it leads, and then starts from them; a Lease deleted under a
//! leader closes its gate, and a standby waits out the deleted Lease's duration.

use std::time::{Duration, Instant};

use anyhow::{anyhow, ensure};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Client;
use kube::api::{Api, PostParams};
use opkit::ManagerOptions;
use opkit::leader::LeaderElectionConfig;
use opkit_api::memcached::Memcached;
use opkit_controllers::{config_mirror, memcached};
use opkit_testenv::{shared, wait_for};
use serde_json::json;

mod common;
use common::{Operator, T};

fn elected(ns: &str, identity: &str, warm: bool) -> ManagerOptions {
    let mut cfg = LeaderElectionConfig::new(ns, "standby-test");
    cfg.identity = identity.into();
    ManagerOptions {
        leader_election: Some(cfg),
        warm_standby: warm,
        ..Default::default()
    }
}

async fn wait_leading(op: &Operator, what: &str) -> anyhow::Result<()> {
    let m = op.metrics();
    wait_for(what, T, || async {
        if m.reconciles_total() > 0 {
            Ok(())
        } else {
            Err(anyhow!("no reconcile yet"))
        }
    })
    .await
}

#[tokio::test]
async fn a_warm_standby_caches_but_neither_reconciles_nor_writes_until_it_leads() {
    shared()
        .in_namespace("standby", |client, ns| async move {
            let leader = common::start(&client, &ns, memcached::NAME, elected(&ns, "a", true)).await?;
            let api: Api<Memcached> = Api::namespaced(client.clone(), &ns);
            for i in 0..3 {
                let m: Memcached = serde_json::from_value(json!({
                    "apiVersion": "cache.example.com/v1", "kind": "Memcached",
                    "metadata": {"name": format!("m{i}")}, "spec": {"size": 1}
                }))?;
                api.create(&PostParams::default(), &m).await?;
            }
            wait_leading(&leader, "the first replica to lead").await?;
            let standby = common::start(&client, &ns, memcached::NAME, elected(&ns, "b", true)).await?;
            let cached = r#"opkit_cache_objects{controller="memcached",kind="Memcached"}"#;
            wait_for("the standby's cache to fill", T, || async {
                let n = standby.sample(cached);
                if n == 3.0 {
                    Ok(())
                } else {
                    Err(anyhow!("{n} cached"))
                }
            })
            .await?;
            // The work the leader had has finished; the standby stays idle through a window.
            common::settled(&leader.metrics()).await?;
            tokio::time::sleep(Duration::from_secs(2)).await;
            let m = standby.metrics();
            ensure!(
                (m.reconciles_total(), m.writes_total(), m.reconciles_active()) == (0, 0, 0),
                "the standby reconciled {} times and wrote {} times",
                m.reconciles_total(),
                m.writes_total()
            );
            leader.stop().await;
            wait_leading(&standby, "the standby to take over").await?;
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn a_deleted_lease_closes_the_leaders_gate_before_a_standby_takes_it() {
    use k8s_openapi::api::coordination::v1::Lease;
    use opkit::leader::{LeaderElector, LeaderError, WriteGate};
    use tokio_util::sync::CancellationToken;
    shared()
        .in_namespace("lease-deleted", |client, ns| async move {
            let cfg = |identity: &str| {
                let mut c = LeaderElectionConfig::new(&ns, "deleted-test");
                c.identity = identity.into();
                (c.lease_duration, c.renew_deadline, c.retry_period) = (
                    Duration::from_secs(6),
                    Duration::from_secs(4),
                    Duration::from_secs(1),
                );
                c
            };
            let (gate_a, gate_b) = (WriteGate::new(), WriteGate::new());
            gate_a.enforce();
            gate_b.enforce();
            let a = LeaderElector::new(client.clone(), cfg("a"), gate_a.clone());
            let b = LeaderElector::new(client.clone(), cfg("b"), gate_b.clone());
            let cancel = CancellationToken::new();
            let _cancel = cancel.clone().drop_guard();
            let deadline = a
                .acquire(&cancel)
                .await?
                .ok_or_else(|| anyhow!("a did not acquire"))?;
            let (c, c2) = (cancel.clone(), cancel.clone());
            let renewing = tokio::spawn(async move { a.renew(&c, deadline).await });
            let b2 = b.clone();
            let taking = tokio::spawn(async move {
                let got = b2.acquire(&c2).await;
                (got, Instant::now())
            });
            wait_for("the standby to see the leader", T, || async {
                match b.holder_seen() {
                    Some(h) if h == "a" => Ok(()),
                    h => Err(anyhow!("holder seen {h:?}")),
                }
            })
            .await?;
            ensure!(gate_a.check().is_ok() && gate_b.check().is_err());
            let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
            leases.delete("deleted-test", &Default::default()).await?;
            let deleted = Instant::now();
            let ended = tokio::time::timeout(Duration::from_secs(5), renewing).await??;
            let gate_closed = Instant::now();
            ensure!(
                matches!(&ended, Err(LeaderError::TakenOver { holder, .. }) if holder.is_empty()),
                "the leader's renewals ended with {ended:?}"
            );
            ensure!(gate_a.check().is_err(), "the old leader's gate is still open");
            let (got, took_at) = tokio::time::timeout(T, taking).await??;
            ensure!(got?.is_some(), "the standby did not acquire");
            ensure!(gate_b.check().is_ok());
            ensure!(
                took_at > gate_closed && took_at.duration_since(deleted) >= Duration::from_secs(5),
                "the standby took the Lease {:?} after its deletion, {:?} after the old gate closed",
                took_at.duration_since(deleted),
                took_at.saturating_duration_since(gate_closed)
            );
            Ok(())
        })
        .await;
}

/// Creates `n` small ConfigMaps in `ns`, 50 requests in flight.
async fn configmaps(client: &Client, ns: &str, n: usize) -> anyhow::Result<()> {
    use futures::StreamExt;
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let results: Vec<kube::Result<ConfigMap>> = futures::stream::iter(0..n)
        .map(|i| {
            let api = api.clone();
            async move {
                let cm: ConfigMap = serde_json::from_value(json!({
                    "metadata": {"name": format!("cm-{i}")}, "data": {"k": "v"}
                }))
                .expect("configmap");
                api.create(&PostParams::default(), &cm).await
            }
        })
        .buffer_unordered(50)
        .collect()
        .await;
    results.into_iter().collect::<kube::Result<Vec<_>>>()?;
    Ok(())
}

/// The time from the leader's stop to the standby's first finished reconcile, with
/// `OPKIT_TAKEOVER_N` (default 10000) ConfigMaps in the ConfigMirror controller's cache, for a
/// cold and a warm standby. A measurement, not a check: run it with
/// `cargo test -p opkit-controllers --test standby -- --ignored --nocapture`.
#[tokio::test]
#[ignore]
async fn takeover_to_first_reconcile() {
    shared()
        .in_namespace("takeover", |client, ns| async move {
            let n: usize = std::env::var("OPKIT_TAKEOVER_N")
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(10_000);
            let started = Instant::now();
            configmaps(&client, &ns, n).await?;
            eprintln!("created {n} ConfigMaps in {:?}", started.elapsed());
            let mirrors: Api<opkit_api::config_mirror::ConfigMirror> = Api::all(client.clone());
            let name = format!("{ns}-m");
            let m = serde_json::from_value(json!({
                "apiVersion": "mirror.opkit.dev/v1alpha1", "kind": "ConfigMirror",
                "metadata": {"name": name},
                "spec": {"source": {"namespace": ns, "name": "cm-0"},
                         "namespaceSelector": {"matchLabels": {"no-such-label": "x"}}}
            }))?;
            let name_ = config_mirror::NAME;
            for round in 0..3 {
                for warm in [false, true] {
                    let leader = common::start(&client, &ns, name_, elected(&ns, "a", warm)).await?;
                    if round == 0 && !warm {
                        mirrors.create(&PostParams::default(), &m).await?;
                    }
                    wait_leading(&leader, "the first replica to lead").await?;
                    let standby = common::start(&client, &ns, name_, elected(&ns, "b", warm)).await?;
                    let cached = r#"opkit_cache_objects{controller="configmirror",kind="ConfigMap"}"#;
                    if warm {
                        wait_for("the standby's cache to fill", T, || async {
                            let c = standby.sample(cached);
                            if c >= n as f64 {
                                Ok(())
                            } else {
                                Err(anyhow!("{c} cached"))
                            }
                        })
                        .await?;
                    } else {
                        tokio::time::sleep(Duration::from_secs(2)).await;
                    }
                    let t0 = Instant::now();
                    leader.stop().await;
                    wait_leading(&standby, "the standby to take over").await?;
                    eprintln!(
                        "round {round} warm={warm}: takeover to first reconcile {:?} ({} ConfigMaps cached)",
                        t0.elapsed(),
                        standby.sample(cached)
                    );
                    standby.stop().await;
                }
            }
            // The mirror's finalizer needs a running controller to go.
            let _op = common::start(&client, &ns, name_, ManagerOptions::default()).await?;
            mirrors.delete(&name, &Default::default()).await?;
            wait_for("the mirror to be gone", T, || async {
                match mirrors.get_opt(&name).await? {
                    None => Ok(()),
                    Some(_) => Err(anyhow!("still there")),
                }
            })
            .await?;
            Ok(())
        })
        .await;
}
