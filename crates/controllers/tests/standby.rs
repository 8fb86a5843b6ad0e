//! Two replicas on one Lease, in one process: a warm standby fills its caches but neither
//! reconciles nor writes until it leads, and then starts from them; a Lease deleted under a
//! leader closes its gate, and a standby waits out the deleted Lease's duration; a leader that
//! loses the Lease stands by in the same process and leads again once it can; a renewal is one
//! write, so a leader whose reads fail goes on leading.

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
        stand_by_on_loss: true,
        ..Default::default()
    }
}

/// `opts` with a 6 s Lease, 4 s renew deadline and 1 s retry period: fast takeovers.
fn short(mut opts: ManagerOptions) -> ManagerOptions {
    if let Some(c) = opts.leader_election.as_mut() {
        (c.lease_duration, c.renew_deadline, c.retry_period) = (
            Duration::from_secs(6),
            Duration::from_secs(4),
            Duration::from_secs(1),
        );
    }
    opts
}

/// The replica's `leader_election_master_status` for the test's Lease.
const LEADS: &str = r#"leader_election_master_status{name="standby-test"}"#;

/// Waits until `op` reports [`LEADS`] as `want` (1: leading, 0: standing by).
async fn wait_status(op: &Operator, want: f64, what: &str) -> anyhow::Result<()> {
    wait_for(what, T, || async {
        match op.sample(LEADS) {
            s if s == want => Ok(()),
            s => Err(anyhow!("leader_election_master_status is {s}")),
        }
    })
    .await
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

#[tokio::test]
async fn a_leader_that_loses_the_lease_stands_by_and_leads_again_without_exiting() {
    use k8s_openapi::api::apps::v1::Deployment;
    use k8s_openapi::api::coordination::v1::Lease;
    shared()
        .in_namespace("lease-lost", |client, ns| async move {
            let opts = short(elected(&ns, "a", false));
            let op = common::start(&client, &ns, memcached::NAME, opts).await?;
            let mcs: Api<Memcached> = Api::namespaced(client.clone(), &ns);
            let deploys: Api<Deployment> = Api::namespaced(client.clone(), &ns);
            let memcached = |name: &str| -> anyhow::Result<Memcached> {
                Ok(serde_json::from_value(json!({
                    "apiVersion": "cache.example.com/v1", "kind": "Memcached",
                    "metadata": {"name": name}, "spec": {"size": 1}
                }))?)
            };
            mcs.create(&PostParams::default(), &memcached("before")?).await?;
            let exists = |name: &'static str| {
                let deploys = deploys.clone();
                move || {
                    let deploys = deploys.clone();
                    async move {
                        match deploys.get_opt(name).await? {
                            Some(_) => Ok(()),
                            None => Err(anyhow!("no Deployment {name}")),
                        }
                    }
                }
            };
            wait_for("the leader to create the first Deployment", T, exists("before")).await?;
            ensure!(op.sample(LEADS) == 1.0, "the leader does not report leading");

            // Another holder takes the Lease over and keeps renewing it.
            let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
            let intruder = tokio_util::sync::CancellationToken::new();
            let renewing = tokio::spawn(intrude(leases.clone(), intruder.clone()));
            let lost_at = Instant::now();
            wait_status(&op, 0.0, "the old leader to stop leading").await?;
            println!(
                "the old leader stood down {:?} after the takeover",
                lost_at.elapsed()
            );
            ensure!(op.running(), "the manager returned when it lost the Lease");

            // Standing by: an object created now is neither reconciled nor written for, over a
            // window after the last reconcile has finished.
            mcs.create(&PostParams::default(), &memcached("during")?).await?;
            let m = op.metrics();
            common::settled(&m).await?;
            let (reconciles, writes) = (m.reconciles_total(), m.writes_total());
            tokio::time::sleep(Duration::from_secs(4)).await;
            ensure!(
                (m.reconciles_total(), m.writes_total()) == (reconciles, writes),
                "the replica reconciled or wrote while standing by: {}",
                m.describe_writes()
            );
            ensure!(
                deploys.get_opt("during").await?.is_none(),
                "a Deployment was made by a standby"
            );
            ensure!(op.running(), "the manager returned while standing by");

            // The other holder goes away without releasing: once its Lease has run out, the
            // same process leads again and catches up.
            intruder.cancel();
            renewing.await?;
            let gone = Instant::now();
            wait_status(&op, 1.0, "the replica to lead again").await?;
            let again = gone.elapsed();
            println!("led again {again:?} after the other holder stopped renewing (lease 6 s)");
            ensure!(
                again >= Duration::from_secs(5),
                "took a Lease still held after {again:?}"
            );
            wait_for(
                "the Deployment of the object created while standing by",
                T,
                exists("during"),
            )
            .await?;
            let holder = leases
                .get("standby-test")
                .await?
                .spec
                .and_then(|s| s.holder_identity);
            ensure!(holder.as_deref() == Some("a"), "the Lease is held by {holder:?}");

            // Taken over again, then stopped while standing by: nothing to drain, so the stop
            // is prompt (well within the shutdown timeout).
            let intruder = tokio_util::sync::CancellationToken::new();
            let renewing = tokio::spawn(intrude(leases.clone(), intruder.clone()));
            wait_status(&op, 0.0, "the replica to stand by again").await?;
            let stopping = Instant::now();
            op.stop().await;
            let took = stopping.elapsed();
            ensure!(took < Duration::from_secs(5), "stopping a standby took {took:?}");
            intruder.cancel();
            renewing.await?;
            Ok(())
        })
        .await;
}

/// Writes itself into the Lease `standby-test` every half second until `stop`, as another
/// replica holding it would.
async fn intrude(
    leases: Api<k8s_openapi::api::coordination::v1::Lease>,
    stop: tokio_util::sync::CancellationToken,
) {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
    while !stop.is_cancelled() {
        match leases.get("standby-test").await {
            Ok(mut l) => {
                let spec = l.spec.get_or_insert_with(Default::default);
                spec.holder_identity = Some("intruder".into());
                spec.renew_time = Some(MicroTime(k8s_openapi::jiff::Timestamp::now()));
                // A conflict with a renewal of the old leader: taken on the next turn.
                let _ = leases.replace("standby-test", &PostParams::default(), &l).await;
            }
            Err(e) => eprintln!("intruder: reading the Lease: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::test]
async fn a_leader_whose_renewals_failed_waits_out_its_own_lease_like_any_standby() {
    use opkit_testenv::proxy::{Fault, FaultProxy};
    shared()
        .in_namespace("lease-missed", |client, ns| async move {
            let opts = short(elected(&ns, "a", false));
            // Every request of the replica goes through the proxy.
            let proxy = FaultProxy::start(client.clone()).await?;
            let through = Client::try_from(proxy.config())?;
            let op = common::start(&through, &ns, memcached::NAME, opts).await?;
            wait_status(&op, 1.0, "the replica to lead").await?;
            // A renewal is one write while nobody else changes the Lease: every read failing
            // for longer than the renew deadline (4 s) ends nothing, and renewals go on.
            let leases: Api<k8s_openapi::api::coordination::v1::Lease> = Api::namespaced(client.clone(), &ns);
            let stamp = || async {
                let l = leases.get("standby-test").await?;
                anyhow::Ok(l.spec.and_then(|s| s.renew_time).map(|t| t.0))
            };
            // Leads through a window of `secs` seconds, renewing at least `least` times.
            let leads_through = |secs: u64, least: u32, what: &'static str| {
                let stamp = &stamp;
                let op = &op;
                async move {
                    let since = Instant::now();
                    let (mut renewals, mut last) = (0, stamp().await?);
                    while since.elapsed() < Duration::from_secs(secs) {
                        ensure!(
                            op.sample(LEADS) == 1.0,
                            "stood down {:?} after {what}",
                            since.elapsed()
                        );
                        let now = stamp().await?;
                        if now != last {
                            (renewals, last) = (renewals + 1, now);
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    ensure!(renewals >= least, "{renewals} renewals in {secs} s after {what}");
                    anyhow::Ok(())
                }
            };
            proxy.set(Fault::Pass, Fault::Status(500));
            leads_through(6, 3, "its reads started failing").await?;
            // Each write answered 1.5 s late: the next renewal starts a period (1 s) after the
            // last one started, not after its answer, so each ends 3 s after the one before
            // began, within the 4 s deadline (counting from the answer, 4 s: lost).
            proxy.set(Fault::Delay(Duration::from_millis(1500)), Fault::Pass);
            leads_through(8, 3, "its writes became slow").await?;
            // Its writes fail too until it has given up.
            proxy.set(Fault::Status(500), Fault::Status(500));
            wait_status(&op, 0.0, "the replica to stand down").await?;
            let stood_down = Instant::now();
            proxy.set(Fault::Pass, Fault::Pass);
            ensure!(op.running(), "the manager returned when its renewals failed");
            // The Lease still names it, and nobody else wants it: it leads again, but only
            // once the record has stood unchanged for its duration, as for any standby.
            wait_status(&op, 1.0, "the replica to lead again").await?;
            let again = stood_down.elapsed();
            println!("led again {again:?} after standing down (lease 6 s)");
            ensure!(
                again >= Duration::from_secs(5),
                "took its own Lease back {again:?} after losing it"
            );
            op.stop().await;
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn a_standby_whose_first_list_of_the_lease_hung_still_takes_over() {
    use opkit_testenv::proxy::{Fault, FaultProxy};
    shared()
        .in_namespace("lease-hung", |client, ns| async move {
            let leader =
                common::start(&client, &ns, memcached::NAME, short(elected(&ns, "a", false))).await?;
            wait_status(&leader, 1.0, "a to lead").await?;
            // The standby's requests hang (a dead connection) from the start; then the
            // connection works again, but what was sent on it never gets an answer.
            let proxy = FaultProxy::start(client.clone()).await?;
            // (The CRDs, installed on start, are spared.)
            proxy.set_sparing(Fault::Hang, Fault::Hang, Some("customresourcedefinitions"));
            let through = Client::try_from(proxy.config())?;
            let standby =
                common::start(&through, &ns, memcached::NAME, short(elected(&ns, "b", false))).await?;
            wait_for("the standby's first requests to hang", T, || async {
                if proxy.faulted() > 0 {
                    Ok(())
                } else {
                    Err(anyhow!("no request yet"))
                }
            })
            .await?;
            proxy.set(Fault::Pass, Fault::Pass);
            let stopped = Instant::now();
            leader.stop().await;
            wait_status(&standby, 1.0, "the standby to take over").await?;
            println!("took over {:?} after the leader stopped", stopped.elapsed());
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
