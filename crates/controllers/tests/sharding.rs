//! Sharded controllers: replicas started as `opkit run --sharding` starts them, in one process. Every object is
//! placed on one member, each member caches only its own objects and their children, and
//! objects move when a member leaves or joins, each handled by one member at a time, their
//! children taken over by the new owner rather than written again.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{anyhow, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use opkit::leader::LeaderElectionConfig;
use opkit::sharding::{MEMBER_LABEL, drain_label, member_name, shard_label};
use opkit::{Invalid, ManagerOptions, Plan, Reconciler, Registration, Registry, Requeue, Watch, Watches};
use opkit_api::memcached::Memcached;
use opkit_controllers::{Settings, memcached, operator};
use opkit_testenv::{shared, wait_for};
use serde_json::json;
use std::sync::{Arc, Mutex};

mod common;
use common::{Operator, Run, T};

/// What the probes of one replica are made with.
struct Probes {
    replica: &'static str,
    planned: Planned,
}

/// Memcached and the probes (a singleton and a sharded one), as an operator of their own.
fn probe_operator() -> opkit::Operator<Probes> {
    opkit::Operator {
        name: "opkit",
        version: "0.0.0",
        about: "sharding probes",
        registry: Registry::new(vec![
            Registration {
                name: "probes",
                crds: Vec::new,
                rbac: Vec::new,
                webhooks: |w| w,
                add: |m, p| {
                    for singleton in [true, false] {
                        m.add(Probe {
                            replica: p.replica,
                            singleton,
                            planned: p.planned.clone(),
                        });
                    }
                },
            },
            Registration {
                name: memcached::NAME,
                crds: || vec![opkit_api::memcached::crd()],
                rbac: memcached::rbac_rules,
                webhooks: |w| w,
                add: |m, _| {
                    m.add(memcached::MemcachedController {
                        image: Settings::default().memcached_image,
                    });
                },
            },
        ]),
    }
}

/// Plans ConfigMaps labelled `opkit-shard-probe`, recording which replica planned which;
/// a singleton or not.
#[derive(Clone)]
struct Probe {
    replica: &'static str,
    singleton: bool,
    planned: Planned,
}

/// (controller, ConfigMap, replica) for every plan made.
type Planned = Arc<Mutex<Vec<(&'static str, String, &'static str)>>>;

impl Reconciler for Probe {
    type Object = ConfigMap;
    type Caches = ();
    type World = ();
    type Status = serde_json::Value;

    fn name(&self) -> &'static str {
        if self.singleton {
            "probe-singleton"
        } else {
            "probe-sharded"
        }
    }

    fn singleton(&self) -> bool {
        self.singleton
    }

    fn primary(&self) -> Watch<ConfigMap> {
        Watch::labels("opkit-shard-probe")
    }

    fn watch(&self, _: &mut Watches<ConfigMap>) {}

    async fn observe(&self, _: &ConfigMap, _: &(), _: &Client) -> kube::Result<()> {
        Ok(())
    }

    fn plan(&self, cm: &ConfigMap, _: &(), _: Timestamp) -> Result<Plan<serde_json::Value>, Invalid> {
        self.planned.lock().unwrap_or_else(|p| p.into_inner()).push((
            self.name(),
            cm.name_any(),
            self.replica,
        ));
        Ok(Plan::nothing(Requeue::OnChange))
    }
}

const CACHED: &str = r#"opkit_cache_objects{controller="memcached",kind="Memcached"}"#;
const ADOPT: &str = r#"opkit_api_writes_total{controller="memcached",verb="adopt"}"#;
const APPLY: &str = r#"opkit_api_writes_total{controller="memcached",verb="apply"}"#;
const MEMBERS: &str = r#"opkit_shard_members{controller="memcached"}"#;
const DRAINED: &str = r#"opkit_shard_moves_total{controller="memcached",move="drained"}"#;
const HANDOVERS: &str = r#"opkit_shard_handover_seconds_count{controller="memcached"}"#;
const CACHED_CHILDREN: &str = r#"opkit_cache_objects{controller="memcached",kind="Deployment"}"#;

fn election(ns: &str, identity: &str) -> LeaderElectionConfig {
    let mut cfg = LeaderElectionConfig::new(ns, "shard-test");
    cfg.identity = identity.into();
    (cfg.lease_duration, cfg.renew_deadline, cfg.retry_period) = (
        Duration::from_secs(6),
        Duration::from_secs(4),
        Duration::from_secs(1),
    );
    cfg
}

async fn member(client: &Client, ns: &str, identity: &str) -> anyhow::Result<Operator> {
    member_elected(client, election(ns, identity)).await
}

async fn member_elected(client: &Client, election: LeaderElectionConfig) -> anyhow::Result<Operator> {
    let ns = election.namespace.clone();
    let names = [memcached::NAME];
    let run = sharded(&names, election);
    common::start_op(&operator(), client, &ns, run, &Settings::default(), |_| {}).await
}

/// `controllers` run as `opkit run --leader-elect --sharding` runs them, elected by `election`.
fn sharded<'a>(controllers: &'a [&'static str], election: LeaderElectionConfig) -> Run<'a> {
    Run {
        opts: ManagerOptions {
            leader_election: Some(election),
            ..Default::default()
        },
        sharding: true,
        ..Run::new(controllers)
    }
}

/// A Memcached of size 0 called `name`, with `labels`.
fn memcached(name: &str, labels: serde_json::Value) -> anyhow::Result<Memcached> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "cache.example.com/v1", "kind": "Memcached",
        "metadata": {"name": name, "labels": labels}, "spec": {"size": 0}
    }))?)
}

/// Memcacheds by the member they are placed on (`""`: none yet), and how many are draining.
async fn placement(mcs: &Api<Memcached>) -> anyhow::Result<(BTreeMap<String, usize>, usize)> {
    let (shard, drain) = (shard_label(memcached::NAME), drain_label(memcached::NAME));
    let mut by = BTreeMap::new();
    let mut draining = 0;
    for m in mcs.list(&Default::default()).await?.items {
        *by.entry(m.labels().get(&shard).cloned().unwrap_or_default())
            .or_default() += 1;
        draining += usize::from(m.labels().contains_key(&drain));
    }
    Ok((by, draining))
}

/// Waits until every Memcached is placed on one of `members`, none is draining, each member
/// caches exactly the ones placed on it, and each has its Deployment, labelled for the same
/// member (who caches it) and for its owner's uid.
async fn settled_on(
    mcs: &Api<Memcached>,
    deploys: &Api<Deployment>,
    members: &[(&str, &Operator)],
    total: usize,
) -> anyhow::Result<BTreeMap<String, usize>> {
    let named: Vec<(String, &Operator)> = members.iter().map(|(id, op)| (member_name(id), *op)).collect();
    settled_as(mcs, deploys, &named, total).await
}

/// [`settled_on`] for replicas known by their member names (a slot's, with slots).
async fn settled_as(
    mcs: &Api<Memcached>,
    deploys: &Api<Deployment>,
    members: &[(String, &Operator)],
    total: usize,
) -> anyhow::Result<BTreeMap<String, usize>> {
    wait_for(
        "every Memcached placed, cached by its member and converged",
        T,
        || async {
            let (by, draining) = placement(mcs).await?;
            let placed: usize = members.iter().map(|(n, _)| by.get(n).copied().unwrap_or(0)).sum();
            ensure!(
                placed == total && draining == 0,
                "placed {by:?}, {draining} draining"
            );
            for (id, op) in members {
                let want = by.get(id).copied().unwrap_or(0) as f64;
                let (cached, children) = (op.sample(CACHED), op.sample(CACHED_CHILDREN));
                ensure!(
                    cached == want && children == want,
                    "{id} caches {cached} Memcacheds and {children} Deployments, placed on it {want}"
                );
            }
            let shard = shard_label(memcached::NAME);
            let owners: BTreeMap<String, (Option<String>, Option<String>)> = mcs
                .list(&Default::default())
                .await?
                .items
                .into_iter()
                .map(|m| (m.name_any(), (m.labels().get(&shard).cloned(), m.uid())))
                .collect();
            let made = deploys.list(&Default::default()).await?.items;
            ensure!(made.len() == total, "{} of {total} Deployments", made.len());
            for d in &made {
                let (owner, uid) = owners.get(&d.name_any()).cloned().unwrap_or_default();
                let (label, owned_by) = (d.labels().get(&shard), d.labels().get(opkit::OWNER_LABEL));
                ensure!(
                    label == owner.as_ref() && owned_by == uid.as_ref(),
                    "Deployment {} is labelled {label:?} (owner uid {owned_by:?}); its Memcached is on {owner:?} ({uid:?})",
                    d.name_any()
                );
            }
            Ok(by)
        },
    )
    .await
}

#[tokio::test]
async fn objects_are_spread_over_the_members_and_move_when_members_leave_and_join() {
    shared()
        .in_namespace("sharding", |client, ns| async move {
            let mcs: Api<Memcached> = Api::namespaced(client.clone(), &ns);
            let deploys: Api<Deployment> = Api::namespaced(client.clone(), &ns);
            let a = member(&client, &ns, "a_1").await?;
            let b = member(&client, &ns, "b_1").await?;
            let c = member(&client, &ns, "c_1").await?;
            let mut n = 30;
            for i in 0..n {
                mcs.create(&PostParams::default(), &memcached(&format!("mc-{i}"), json!({}))?)
                    .await?;
            }
            let by = settled_on(&mcs, &deploys, &[("a_1", &a), ("b_1", &b), ("c_1", &c)], n).await?;
            println!("placed on three members: {by:?}");
            for (m, count) in &by {
                ensure!((2..=20).contains(count), "{m} has {count} of {n}");
            }

            // A member leaves (a graceful stop releases its member Lease): its objects move
            // to the others at once. Their Deployments are taken over (relabelled), not
            // written again: two adopting writes per object (the child, and the sharder's
            // note on the object), no apply.
            let on_b = by[&member_name("b_1")];
            let count = |series: &str| a.sample(series) + c.sample(series);
            let (adopted, applied) = (count(ADOPT), count(APPLY));
            b.stop().await;
            let by = settled_on(&mcs, &deploys, &[("a_1", &a), ("c_1", &c)], n).await?;
            println!("after b left: {by:?}");
            common::settled(&a.metrics_of(memcached::NAME)).await?;
            common::settled(&c.metrics_of(memcached::NAME)).await?;
            let (adopted, reapplied) = (count(ADOPT) - adopted, count(APPLY) - applied);
            ensure!(
                adopted == 2.0 * on_b as f64 && reapplied == 0.0,
                "{on_b} objects moved: {adopted} adopting writes (want {}), {reapplied} applies (want 0); errors: {} / {}",
                2 * on_b,
                a.metrics_of(memcached::NAME).describe_errors(),
                c.metrics_of(memcached::NAME).describe_errors(),
            );
            mcs.create(&PostParams::default(), &memcached("mc-late", json!({}))?)
                .await?;
            n += 1;
            settled_on(&mcs, &deploys, &[("a_1", &a), ("c_1", &c)], n).await?;

            // A member joins: about a third moves to it, each drained from its old owner
            // first; nothing moves between the two others.
            let before = placement(&mcs).await?.0;
            let drained_before = a.sample(DRAINED) + c.sample(DRAINED);
            let handovers_before = a.sample(HANDOVERS) + c.sample(HANDOVERS);
            let d = member(&client, &ns, "d_1").await?;
            wait_for("objects to move to the new member", T, || async {
                let (by, _) = placement(&mcs).await?;
                let on_d = by.get(&member_name("d_1")).copied().unwrap_or(0);
                ensure!(on_d > 0, "none on d yet: {by:?}");
                Ok(())
            })
            .await?;
            let by = settled_on(&mcs, &deploys, &[("a_1", &a), ("c_1", &c), ("d_1", &d)], n).await?;
            println!("after d joined: {by:?} (before {before:?})");
            let to_d = by.get(&member_name("d_1")).copied().unwrap_or(0);
            ensure!((2..=20).contains(&to_d), "{to_d} of {n} moved to d");
            // The leader's sharder counted the moves to d and how long each took.
            let drained = a.sample(DRAINED) + c.sample(DRAINED) - drained_before;
            let handovers = a.sample(HANDOVERS) + c.sample(HANDOVERS) - handovers_before;
            ensure!(
                drained >= to_d as f64 && handovers >= to_d as f64,
                "{to_d} moved to d: {drained} drains and {handovers} handovers counted"
            );
            common::settled(&d.metrics_of(memcached::NAME)).await?;
            let (adopted, applied) = (d.sample(ADOPT), d.sample(APPLY));
            ensure!(
                adopted == 2.0 * to_d as f64 && applied == 0.0,
                "{to_d} objects drained to d: {adopted} adopting writes (want {}), {applied} applies (want 0); errors: {}",
                2 * to_d,
                d.metrics_of(memcached::NAME).describe_errors(),
            );
            for id in ["a_1", "c_1"] {
                let (was, is) = (before[&member_name(id)], by[&member_name(id)]);
                ensure!(is <= was, "{id} gained objects when d joined: {was} -> {is}");
            }
            Ok(())
        })
        .await;
}

/// A member started with `--sharding-slots 3`.
async fn slot_member(client: &Client, ns: &str, identity: &str) -> anyhow::Result<Operator> {
    let names = [memcached::NAME];
    let run = Run {
        sharding_slots: 3,
        ..sharded(&names, election(ns, identity))
    };
    common::start_op(&operator(), client, ns, run, &Settings::default(), |_| {}).await
}

/// The slot (its member name) the replica `identity` holds the Lease of, once it holds one.
async fn slot_of(leases: &Api<Lease>, identity: &str) -> anyhow::Result<String> {
    wait_for(&format!("{identity} to hold a slot"), T, || async {
        let held = leases
            .list(&Default::default())
            .await?
            .items
            .into_iter()
            .find(|l| {
                l.spec.as_ref().and_then(|s| s.holder_identity.as_deref()) == Some(identity)
                    && l.labels().contains_key(opkit::sharding::SLOT_LABEL)
            });
        held.and_then(|l| l.labels().get(MEMBER_LABEL).cloned())
            .ok_or_else(|| anyhow!("{identity} holds no slot"))
    })
    .await
}

/// The shard label of every Memcached and Deployment, by kind and name.
async fn shard_labels(
    mcs: &Api<Memcached>,
    deploys: &Api<Deployment>,
) -> anyhow::Result<BTreeMap<String, String>> {
    let shard = shard_label(memcached::NAME);
    let mut out = BTreeMap::new();
    for m in mcs.list(&Default::default()).await?.items {
        out.insert(
            format!("Memcached {}", m.name_any()),
            m.labels().get(&shard).cloned().unwrap_or_default(),
        );
    }
    for d in deploys.list(&Default::default()).await?.items {
        out.insert(
            format!("Deployment {}", d.name_any()),
            d.labels().get(&shard).cloned().unwrap_or_default(),
        );
    }
    Ok(out)
}

#[tokio::test]
async fn a_rolling_restart_hands_each_slot_over_once_and_relabels_nothing() {
    shared()
        .in_namespace("slots", |client, ns| async move {
            use futures::StreamExt;
            let mcs: Api<Memcached> = Api::namespaced(client.clone(), &ns);
            let deploys: Api<Deployment> = Api::namespaced(client.clone(), &ns);
            let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
            // Every (slot, holder) and renewal the slot Leases show while the group starts, and
            // whether the watch listed again (a list shows only the latest of each).
            let named = Arc::new(Mutex::new(Vec::<(String, String, String)>::new()));
            let relisted = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let (listed, was_listed) = tokio::sync::oneshot::channel();
            let watch_named = {
                let (named, leases, relisted) = (named.clone(), leases.clone(), relisted.clone());
                async move {
                    use kube::runtime::watcher::{Event, watcher};
                    let mut slots = watcher(leases, Default::default()).boxed();
                    let mut listed = Some(listed);
                    while let Some(ev) = slots.next().await {
                        let l = match ev {
                            Ok(Event::Apply(l) | Event::InitApply(l)) => l,
                            Ok(Event::Init) if listed.is_none() => {
                                relisted.store(true, std::sync::atomic::Ordering::SeqCst);
                                continue;
                            }
                            Ok(Event::InitDone) => {
                                if let Some(listed) = listed.take() {
                                    let _ = listed.send(());
                                }
                                continue;
                            }
                            _ => continue,
                        };
                        let (Some(slot), Some(spec)) = (l.labels().get(MEMBER_LABEL), l.spec.as_ref()) else {
                            continue;
                        };
                        if l.labels().contains_key(opkit::sharding::SLOT_LABEL) {
                            let holder = spec.holder_identity.clone().unwrap_or_default();
                            let renewed = format!("{:?}", spec.renew_time);
                            named.lock().unwrap().push((slot.clone(), holder, renewed));
                        }
                    }
                }
            };
            let watching_named = tokio::spawn(watch_named);
            tokio::time::timeout(T, was_listed).await??;
            let mut started = Vec::new();
            for id in ["a_1", "b_1", "c_1"] {
                let op = slot_member(&client, &ns, id).await?;
                slot_of(&leases, id).await?;
                started.push((id, op));
            }
            let held = wait_for("three replicas on three slots", T, || async {
                let mut held = Vec::new();
                for (id, _) in &started {
                    held.push(slot_of(&leases, id).await?);
                }
                let mut slots = held.clone();
                slots.sort();
                ensure!(slots == ["slot-0", "slot-1", "slot-2"], "slots held: {slots:?}");
                Ok(held)
            })
            .await?;
            // Each replica names itself in the one slot it keeps, and in no other even for a
            // moment (the sharder would keep such a released slot on its ring with nobody
            // holding it). Read once the watch shows each kept slot renewed after its claim:
            // a replica's claims are all written before it renews.
            let ids: Vec<&str> = started.iter().map(|(id, _)| *id).collect();
            let named = wait_for("each kept slot renewed", T, || async {
                let named = named.lock().unwrap().clone();
                for (id, slot) in ids.iter().zip(&held) {
                    let renewals = named
                        .iter()
                        .filter(|(s, h, _)| s == slot && h == id)
                        .map(|(_, _, r)| r)
                        .collect::<BTreeSet<_>>();
                    ensure!(
                        renewals.len() >= 2,
                        "{id} seen {} times on {slot}",
                        renewals.len()
                    );
                }
                Ok(named)
            })
            .await?;
            watching_named.abort();
            ensure!(
                !relisted.load(std::sync::atomic::Ordering::SeqCst),
                "the watch of the slot Leases listed again: a claim may have gone unseen"
            );
            for id in &ids {
                let slots: BTreeSet<&String> = named
                    .iter()
                    .filter(|(_, h, _)| h == id)
                    .map(|(s, _, _)| s)
                    .collect();
                ensure!(slots.len() == 1, "{id} named itself in {slots:?}");
            }
            let replicas: Vec<(String, &'static str, Operator)> = held
                .into_iter()
                .zip(started)
                .map(|(slot, (id, op))| (slot, id, op))
                .collect();
            let n = 30;
            for i in 0..n {
                mcs.create(&PostParams::default(), &memcached(&format!("mc-{i}"), json!({}))?)
                    .await?;
            }
            let pairs: Vec<(String, &Operator)> = replicas.iter().map(|(s, _, op)| (s.clone(), op)).collect();
            let by = settled_as(&mcs, &deploys, &pairs, n).await?;
            println!("placed on three slots: {by:?}");
            for (m, count) in &by {
                ensure!((2..=20).contains(count), "{m} has {count} of {n}");
            }
            drop(pairs);
            let before = shard_labels(&mcs, &deploys).await?;

            // Every change of a shard label from here on, as the watches deliver them.
            let relabelled = Arc::new(Mutex::new(Vec::<String>::new()));
            let shard = shard_label(memcached::NAME);
            let watch_labels = {
                let (relabelled, before, shard) = (relabelled.clone(), before.clone(), shard.clone());
                let (mcs, deploys) = (mcs.clone(), deploys.clone());
                async move {
                    use kube::runtime::{WatchStreamExt, watcher};
                    let m = watcher(mcs, Default::default()).applied_objects().map(|r| {
                        r.map(|o| {
                            (
                                format!("Memcached {}", o.name_any()),
                                o.labels().get(&shard).cloned(),
                            )
                        })
                    });
                    let shard2 = shard.clone();
                    let d = watcher(deploys, Default::default())
                        .applied_objects()
                        .map(move |r| {
                            r.map(|o| {
                                (
                                    format!("Deployment {}", o.name_any()),
                                    o.labels().get(&shard2).cloned(),
                                )
                            })
                        });
                    let mut all = futures::stream::select(m.boxed(), d.boxed());
                    while let Some(ev) = all.next().await {
                        if let Ok((key, label)) = ev {
                            let was = before.get(&key).cloned().unwrap_or_default();
                            if label.unwrap_or_default() != was {
                                relabelled.lock().unwrap().push(key);
                            }
                        }
                    }
                }
            };
            let watching = tokio::spawn(watch_labels);

            // The rolling restart: each new replica starts (a spare: every slot is held), then
            // an old one stops and the spare takes over its slot.
            let mut adopted = 0.0;
            let mut applied = 0.0;
            let mut current: Vec<(String, &'static str, Operator)> = Vec::new();
            let mut old = replicas;
            for new in ["d_1", "e_1", "f_1"] {
                let spare = slot_member(&client, &ns, new).await?;
                let (slot, id, op) = old.remove(0);
                op.stop().await;
                let took = slot_of(&leases, new).await?;
                ensure!(took == slot, "{new} took {took}, {id} left {slot}");
                println!("{new} took {slot} over from {id}");
                current.push((slot, new, spare));
                let pairs: Vec<(String, &Operator)> = current
                    .iter()
                    .chain(old.iter())
                    .map(|(s, _, op)| (s.clone(), op))
                    .collect();
                settled_as(&mcs, &deploys, &pairs, n).await?;
            }
            for (_, _, op) in &current {
                common::settled(&op.metrics_of(memcached::NAME)).await?;
                adopted += op.sample(ADOPT);
                applied += op.sample(APPLY);
            }
            let after = shard_labels(&mcs, &deploys).await?;
            watching.abort();
            let relabelled = relabelled.lock().unwrap().clone();
            println!(
                "after the rolling restart: {adopted} adopting writes, {applied} applies, {} label changes",
                relabelled.len()
            );
            ensure!(
                after == before,
                "shard labels changed: before {before:?}, after {after:?}"
            );
            ensure!(
                relabelled.is_empty(),
                "relabelled during the restart: {relabelled:?}"
            );
            ensure!(
                adopted == 0.0,
                "{adopted} adopting writes: children were relabelled"
            );
            Ok(())
        })
        .await;
}

const ASSIGNED: &str = r#"opkit_shard_moves_total{controller="memcached",move="assigned"}"#;

/// Serves `hooks` on a port of its own until `stop`, and points a mutating webhook
/// configuration named after `ns` at it; returns the configuration's name. The webhooks of a
/// manager watching `ns` only are sent the requests of `ns` only.
async fn serve_placement(
    client: &Client,
    ns: &str,
    hooks: &opkit::webhook::Webhooks,
    stop: tokio_util::sync::CancellationToken,
) -> anyhow::Result<String> {
    use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
    let cert = opkit::webhook::self_signed(&["127.0.0.1".to_string()])?;
    let port = opkit_testenv::free_port()?;
    opkit::webhook::serve(
        hooks,
        ([127, 0, 0, 1], port).into(),
        opkit::webhook::CertSource::Generated(cert.clone()),
        false,
        stop,
    )
    .await?;
    let endpoint = opkit::webhook::Endpoint::Url(format!("https://127.0.0.1:{port}"));
    let (mut mutating, _) = opkit::webhook::configurations(ns, hooks, &endpoint, "none", Some(&cert.ca_pem));
    let name = format!("{ns}-placement");
    mutating.metadata.name = Some(name.clone());
    let scoped = |w: &k8s_openapi::api::admissionregistration::v1::MutatingWebhook| {
        w.namespace_selector
            .as_ref()
            .and_then(|s| s.match_expressions.as_ref())
            .is_some_and(|e| {
                e.iter()
                    .any(|e| e.operator == "In" && e.values.as_deref() == Some(&[ns.to_string()][..]))
            })
    };
    ensure!(
        mutating
            .webhooks
            .as_ref()
            .is_some_and(|w| w.len() == 1 && scoped(&w[0])),
        "one placement webhook, for {ns} only, wanted: {mutating:?}"
    );
    Api::<MutatingWebhookConfiguration>::all(client.clone())
        .create(&PostParams::default(), &mutating)
        .await?;
    Ok(name)
}

#[tokio::test]
async fn new_objects_are_placed_as_they_are_created_and_a_stranger_s_label_is_replaced() {
    shared()
        .in_namespace("sharding-admit", |client, ns| async move {
            use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
            let mcs: Api<Memcached> = Api::namespaced(client.clone(), &ns);
            let deploys: Api<Deployment> = Api::namespaced(client.clone(), &ns);
            // Member a serves the placement webhook, as every replica of an operator serving
            // webhooks does.
            let names = [memcached::NAME];
            let run = sharded(&names, election(&ns, "pa_1"));
            let mut hooks = None;
            let a = common::start_op(&operator(), &client, &ns, run, &Settings::default(), |s| {
                hooks = Some(s.sharding_webhooks())
            })
            .await?;
            let hooks = hooks.ok_or_else(|| anyhow::anyhow!("no webhooks"))?;
            let stop = tokio_util::sync::CancellationToken::new();
            let _stop_serving = stop.clone().drop_guard();
            let configuration = serve_placement(&client, &ns, &hooks, stop).await?;
            let b = member(&client, &ns, "pb_1").await?;
            let members = [("pa_1", &a), ("pb_1", &b)];
            wait_for("the sharder to see both members", T, || async {
                let seen = a.sample(MEMBERS) + b.sample(MEMBERS);
                ensure!(seen == 2.0, "{seen}");
                Ok(())
            })
            .await?;
            let shard = shard_label(memcached::NAME);
            let names: Vec<String> = members.iter().map(|(id, _)| member_name(id)).collect();
            // a's webhook has its own watch of the members: until it sees b, it places every
            // object on a. Objects are made until one is placed on b.
            let mut n = 0;
            wait_for("the webhook to place an object on b", T, || {
                n += 1;
                let (mcs, name, b_name) = (mcs.clone(), format!("probe-{n}"), &names[1]);
                async move {
                    let made = mcs
                        .create(&PostParams::default(), &memcached(&name, json!({}))?)
                        .await?;
                    let label = made.labels().get(&shard_label(memcached::NAME)).cloned();
                    ensure!(label.as_ref() == Some(b_name), "placed on {label:?}");
                    Ok(())
                }
            })
            .await?;

            // Each new object carries its member's label as it is created: no label write of
            // the sharder's follows. An object the webhook placed against the sharder's ring
            // (their views of the members differing for a moment) is drained, then assigned.
            for i in 0..20 {
                let made = mcs
                    .create(&PostParams::default(), &memcached(&format!("mc-{i}"), json!({}))?)
                    .await?;
                n += 1;
                let label = made.labels().get(&shard);
                ensure!(
                    label.is_some_and(|l| names.contains(l)),
                    "mc-{i} was created labelled {label:?}, not for one of {names:?}"
                );
            }
            // One labelled for a member that never was: the sharder reads its Lease (there is
            // none), and then places the object on a live member.
            let m = memcached("mc-stranger", json!({&shard: "stranger-0000000000"}))?;
            mcs.create(&PostParams::default(), &m).await?;
            let by = settled_on(&mcs, &deploys, &members, n + 1).await?;
            println!("placed at creation: {by:?}");
            // Counted once each drained object has been assigned too.
            wait_for("the sharder's moves", T, || async {
                let (assigned, drained) = (
                    a.sample(ASSIGNED) + b.sample(ASSIGNED),
                    a.sample(DRAINED) + b.sample(DRAINED),
                );
                ensure!(
                    assigned == drained + 1.0,
                    "the sharder assigned {assigned} objects and drained {drained}: want one \
                     assignment (the stranger's object) beyond the drained ones"
                );
                Ok(())
            })
            .await?;

            Api::<MutatingWebhookConfiguration>::all(client.clone())
                .delete(&configuration, &Default::default())
                .await?;
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn a_member_lease_deleted_by_hand_moves_nothing_until_its_member_stopped_writing() {
    shared()
        .in_namespace("sharding-deleted", |client, ns| async move {
            let mcs: Api<Memcached> = Api::namespaced(client.clone(), &ns);
            let deploys: Api<Deployment> = Api::namespaced(client.clone(), &ns);
            let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
            // "a" leads (it runs the sharder). "b" renews every 3 s: after its Lease is
            // deleted, it writes for up to 3 s before its renewal finds out and closes its
            // gate, within its 6 s Lease.
            let a = member(&client, &ns, "a_1").await?;
            wait_for("a to lead", T, || async {
                let leads = a.sample(r#"leader_election_master_status{name="shard-test"}"#);
                ensure!(leads == 1.0, "not yet");
                Ok(())
            })
            .await?;
            let mut slow = election(&ns, "b_1");
            slow.retry_period = Duration::from_secs(3);
            let b = member_elected(&client, slow).await?;
            let c = member(&client, &ns, "c_1").await?;
            let n = 15;
            for i in 0..n {
                mcs.create(&PostParams::default(), &memcached(&format!("mc-{i}"), json!({}))?)
                    .await?;
            }
            let by = settled_on(&mcs, &deploys, &[("a_1", &a), ("b_1", &b), ("c_1", &c)], n).await?;
            let b_name = member_name("b_1");
            let on_b = by.get(&b_name).copied().unwrap_or(0);
            ensure!(on_b > 0, "nothing placed on b: {by:?}");
            let lease_name = format!("shard-test-member-{b_name}");
            let b_holds = format!(r#"leader_election_master_status{{name="{lease_name}"}}"#);
            ensure!(b.sample(&b_holds) == 1.0, "b does not report holding its member Lease");
            let assigned = a.sample(ASSIGNED);

            // Deleted by hand right after a renewal of b's: b keeps writing for 3 s.
            let renewed = |l: Lease| l.spec.and_then(|s| s.renew_time).map(|t| t.0);
            let before = renewed(leases.get(&lease_name).await?);
            wait_for("b to renew its member Lease", T, || async {
                let now = renewed(leases.get(&lease_name).await?);
                ensure!(now != before, "not yet");
                Ok(())
            })
            .await?;
            leases.delete(&lease_name, &Default::default()).await?;
            let deleted = std::time::Instant::now();
            let shard = shard_label(memcached::NAME);
            // Until b reports its gate closed, none of its objects may move.
            loop {
                let left = mcs
                    .list(&Default::default())
                    .await?
                    .items
                    .iter()
                    .filter(|m| m.labels().get(&shard) == Some(&b_name))
                    .count();
                let open = b.sample(&b_holds) == 1.0;
                ensure!(
                    !open || (a.sample(ASSIGNED) == assigned && left == on_b),
                    "objects moved off b while it could still write, {:?} after the deletion: {left} of {on_b} left on b",
                    deleted.elapsed()
                );
                if !open {
                    break;
                }
                ensure!(deleted.elapsed() < T, "b still holds its gate after {T:?}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            println!("b closed its gate {:?} after its Lease was deleted", deleted.elapsed());

            // Then its objects move to the others, once its grace has run out.
            let by = settled_on(&mcs, &deploys, &[("a_1", &a), ("c_1", &c)], n).await?;
            println!("after b's Lease was deleted ({:?}): {by:?}", deleted.elapsed());
            ensure!(
                a.sample(ASSIGNED) - assigned >= on_b as f64,
                "{on_b} objects of b: {} assigned",
                a.sample(ASSIGNED) - assigned
            );
            ensure!(!b.running(), "b still runs without its member Lease");
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn a_label_write_refused_for_good_is_retried_less_and_less_often() {
    use opkit_testenv::proxy::{Fault, FaultProxy};
    shared()
        .in_namespace("sharding-refused", |client, ns| async move {
            // The member reaches the apiserver through a proxy that refuses every write but
            // its Leases' with 403, as a missing permission or a policy engine would, for good.
            let proxy = FaultProxy::start(client.clone()).await?;
            let through = kube::Client::try_from(proxy.config())?;
            let a = member(&through, &ns, "r_1").await?;
            proxy.set_sparing(Fault::Status(403), Fault::Pass, Some("/leases"));
            let mcs: Api<Memcached> = Api::namespaced(client.clone(), &ns);
            mcs.create(&PostParams::default(), &memcached("refused", json!({}))?)
                .await?;
            let first = wait_for("the sharder's first refused label write", T, || async {
                ensure!(proxy.faulted() >= 1, "none yet");
                Ok(std::time::Instant::now())
            })
            .await?;
            let at_first = proxy.faulted();
            // Refused for good: retried after 1, 2, 4 and 8 s (5 attempts in 16 s), where a
            // retry every second would make 16.
            tokio::time::sleep(Duration::from_secs(16).saturating_sub(first.elapsed())).await;
            let attempts = proxy.faulted() - at_first + 1;
            println!("{attempts} refused label writes in 16 s");
            ensure!(
                (3..=7).contains(&attempts),
                "{attempts} refused label writes in 16 s (want 5: a backoff of 1, 2, 4, 8 s)"
            );
            let shard = shard_label(memcached::NAME);
            ensure!(
                mcs.get("refused").await?.labels().get(&shard).is_none(),
                "the refusal held"
            );
            proxy.set(Fault::Pass, Fault::Pass);
            a.stop().await;
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn a_singleton_runs_on_the_leader_only_while_the_others_are_sharded() {
    shared()
        .in_namespace("sharding-singleton", |client, ns| async move {
            let planned: Planned = Arc::default();
            let mut ops = Vec::new();
            for (replica, identity) in [("a", "sa_1"), ("b", "sb_1")] {
                let names = ["probes", memcached::NAME];
                let run = sharded(&names, election(&ns, identity));
                let probes = Probes {
                    replica,
                    planned: planned.clone(),
                };
                ops.push(common::start_op(&probe_operator(), &client, &ns, run, &probes, |_| {}).await?);
            }
            let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
            let n = 20;
            for i in 0..n {
                let cm: ConfigMap = serde_json::from_value(json!({
                    "metadata": {"name": format!("probe-{i}"), "labels": {"opkit-shard-probe": "x"}}
                }))?;
                cms.create(&PostParams::default(), &cm).await?;
            }
            // The singleton plans every probe on the leader only, and places none; the sharded
            // one plans each probe last on the replica it is placed on, and both replicas work.
            let members = [(member_name("sa_1"), "a"), (member_name("sb_1"), "b")];
            let shard = shard_label("probe-sharded");
            let placed: BTreeMap<String, &str> = wait_for("every probe placed", T, || async {
                let mut placed = BTreeMap::new();
                let probes = kube::api::ListParams::default().labels("opkit-shard-probe");
                for cm in cms.list(&probes).await?.items {
                    ensure!(
                        !cm.labels().contains_key(&shard_label("probe-singleton")),
                        "{} placed for the singleton",
                        cm.name_any()
                    );
                    let on = cm.labels().get(&shard).cloned().unwrap_or_default();
                    let replica = members.iter().find(|(m, _)| *m == on).map(|(_, r)| *r);
                    ensure!(replica.is_some(), "{} placed on {on:?}", cm.name_any());
                    placed.insert(cm.name_any(), replica.unwrap_or_default());
                }
                ensure!(placed.len() == n, "{} probes", placed.len());
                Ok(placed)
            })
            .await?;
            wait_for("every probe planned by both controllers", T, || async {
                let planned = planned.lock().unwrap_or_else(|p| p.into_inner()).clone();
                for ctl in ["probe-singleton", "probe-sharded"] {
                    let names: std::collections::BTreeSet<&String> =
                        planned.iter().filter(|p| p.0 == ctl).map(|p| &p.1).collect();
                    ensure!(names.len() == n, "{ctl} planned {} of {n}", names.len());
                }
                Ok(())
            })
            .await?;
            for op in &ops {
                common::settled(&op.metrics_of("probe-singleton")).await?;
                common::settled(&op.metrics_of("probe-sharded")).await?;
            }
            let planned = planned.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let singleton_on: std::collections::BTreeSet<&str> = planned
                .iter()
                .filter(|p| p.0 == "probe-singleton")
                .map(|p| p.2)
                .collect();
            ensure!(
                singleton_on.len() == 1,
                "the singleton planned on {singleton_on:?}"
            );
            // A probe placed before the second member joined moved once: its last plan is
            // the one on the member it is placed on now.
            let mut last: BTreeMap<&String, &str> = BTreeMap::new();
            for p in planned.iter().filter(|p| p.0 == "probe-sharded") {
                last.insert(&p.1, p.2);
            }
            let elsewhere: Vec<_> = last
                .iter()
                .filter(|(name, on)| placed.get(**name) != Some(*on))
                .collect();
            ensure!(
                elsewhere.is_empty(),
                "last planned off their replica: {elsewhere:?}"
            );
            // The sharder places only what the controller watches: not the namespace's other
            // ConfigMaps (placement is done: every probe is placed).
            let root = cms.get("kube-root-ca.crt").await?;
            ensure!(
                !root.labels().contains_key(&shard),
                "a ConfigMap the controller does not watch was placed: {:?}",
                root.labels()
            );
            let sharded_on: std::collections::BTreeSet<&str> = planned
                .iter()
                .filter(|p| p.0 == "probe-sharded")
                .map(|p| p.2)
                .collect();
            ensure!(
                sharded_on.len() == 2,
                "the sharded controller planned on {sharded_on:?} only"
            );
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn every_object_of_a_built_in_kind_is_left_unsharded_unless_the_controller_opts_in() {
    shared()
        .in_namespace("sharding-built-in", |client, ns| async move {
            // Eru's controllers: `eru` (its own kind) and `eru-annotations` (every Deployment).
            let names = [opkit_controllers::eru::NAME];
            let run = sharded(&names, election(&ns, "e_1"));
            let paths = Arc::new(Mutex::new(Vec::new()));
            let seen = paths.clone();
            let op = common::start_op(&operator(), &client, &ns, run, &Settings::default(), move |s| {
                *seen.lock().unwrap_or_else(|p| p.into_inner()) = s.sharding_webhooks().paths();
            })
            .await?;
            let paths = paths.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let path = opkit::sharding::admit::path;
            ensure!(
                paths.contains(&path(opkit_controllers::eru::NAME)),
                "the Eru controller is not sharded: {paths:?}"
            );
            ensure!(
                !paths.contains(&path(opkit_controllers::eru::ANNOTATIONS)),
                "every Deployment is placed by a webhook: {paths:?}"
            );
            // Nor does the sharder label them: a Deployment stays without a shard label
            // once the Eru controller has placed an Eru.
            let deploys: Api<Deployment> = Api::namespaced(client.clone(), &ns);
            deploys
                .create(&PostParams::default(), &common::eru::idle_deployment("web")?)
                .await?;
            let erus: Api<opkit_api::eru::Eru> = Api::namespaced(client.clone(), &ns);
            erus.create(
                &PostParams::default(),
                &common::eru::hand_written("nightly", "web", "0 3 * * *"),
            )
            .await?;
            let eru_shard = shard_label(opkit_controllers::eru::NAME);
            wait_for("the Eru placed", T, || async {
                ensure!(
                    erus.get("nightly").await?.labels().contains_key(&eru_shard),
                    "not yet"
                );
                Ok(())
            })
            .await?;
            common::settled(&op.metrics()).await?;
            let labels = deploys.get("web").await?.labels().clone();
            ensure!(
                !labels.contains_key(&shard_label(opkit_controllers::eru::ANNOTATIONS)),
                "the Deployment was placed: {labels:?}"
            );
            Ok(())
        })
        .await;
}
