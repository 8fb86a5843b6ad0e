//! Three `opkit run --leader-elect --sharding` processes on a control plane of their own,
//! sharing Memcacheds and Ats, while replicas are killed (SIGKILL), frozen past their Lease
//! (SIGSTOP, then SIGCONT), added, and have their member Lease deleted by hand. After each fault every object converges again on the
//! live replicas, each placed on one of them with its children; the time from the fault to
//! the last object placed and converged is reported. Checked at the end, from the apiserver's
//! audit log: no object nor its children was written by two replicas in turns (once another
//! replica has written for it, the one before never writes for it again), and every At's Pod
//! was created exactly once.
//!
//! A second run with `--sharding-slots 3` (as `config/sharding` deploys) restarts the
//! replicas one by one and kills a slot holder while a spare waits: no object is relabelled,
//! and the audit log judges it the same way.
//!
//! `make test` runs the small version; `make chaos` (`OPKIT_CHAOS=full`) the full one.
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{anyhow, ensure};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use opkit::sharding::{MEMBER_LABEL, Ring, adopt_annotation, drain_label, ring, shard_label};
use opkit_api::at::{At, Outcome, Phase};
use opkit_api::memcached::Memcached;
use opkit_testenv::{Component, ControlPlane, Options, Signal, wait_for};

mod common;
use common::{Audited, read_audit};

const NS: &str = "shards";
const OWN_NS: &str = "shards-system";

struct Scale {
    memcacheds: usize,
    ats: usize,
    /// `spec.size` of the Memcacheds (0: no Pods, for the large run on two cores).
    size: i32,
    /// Seconds over which the Ats fall due.
    spread: u64,
    /// Lease duration, renew deadline and retry period of the leader and member Leases, in
    /// seconds: short for the small run, but with a 4 s renew deadline, because 3 s was not
    /// always met on two cores with both runs of this file going at once (a replica that
    /// misses it exits, and nothing here restarts it); for the large one Kubernetes'
    /// defaults, because a 3 s renew deadline is not met on two cores with 3000 objects
    /// arriving at once.
    lease: [u64; 3],
}

fn scale() -> Scale {
    if std::env::var("OPKIT_CHAOS").as_deref() == Ok("full") {
        Scale {
            memcacheds: 3000,
            ats: 300,
            size: 0,
            spread: 120,
            lease: [15, 10, 2],
        }
    } else {
        Scale {
            memcacheds: 60,
            ats: 12,
            size: 1,
            spread: 15,
            lease: [6, 4, 1],
        }
    }
}

fn log(start: Instant, what: &str) {
    println!("[{:6.1}s] {what}", start.elapsed().as_secs_f64());
}

fn user(replica: &str) -> String {
    format!("system:serviceaccount:{NS}:{replica}")
}

/// A replica: a process of its own name (its POD_NAME, its member name's start) and
/// ServiceAccount, serving its metrics on `port`.
struct Replica {
    name: String,
    port: u16,
    process: Component,
}

async fn start_replica(
    cp: &ControlPlane,
    client: &Client,
    scale: &Scale,
    name: &str,
) -> anyhow::Result<Replica> {
    start_replica_with(cp, client, scale, name, &[]).await
}

/// [`start_replica`] with more arguments to `opkit run`.
async fn start_replica_with(
    cp: &ControlPlane,
    client: &Client,
    scale: &Scale,
    name: &str,
    more: &[&str],
) -> anyhow::Result<Replica> {
    let kubeconfig = common::kubeconfig_for(cp, client, NS, name).await?;
    let port = common::free_port()?;
    let args: Vec<String> = [
        "run",
        "--controllers",
        "memcached,at",
        "--namespace",
        NS,
        "--leader-elect",
        "--sharding",
        "--leader-election-namespace",
        OWN_NS,
        "--leader-elect-lease-duration",
        &scale.lease[0].to_string(),
        "--leader-elect-renew-deadline",
        &scale.lease[1].to_string(),
        "--leader-elect-retry-period",
        &scale.lease[2].to_string(),
        "--shutdown-timeout",
        "5",
        "--metrics-bind-address",
        &format!("127.0.0.1:{port}"),
        "--health-probe-bind-address",
        "0",
        "--webhook-bind-address",
        "0",
        "--kubeconfig",
        &kubeconfig.display().to_string(),
    ]
    .iter()
    .chain(more)
    .map(|s| s.to_string())
    .collect();
    let env = vec![
        ("POD_NAME".to_string(), name.to_string()),
        ("RUST_LOG".to_string(), "info,kube_runtime=warn".to_string()),
        ("RUST_BACKTRACE".to_string(), "0".to_string()),
        ("NO_COLOR".to_string(), "1".to_string()),
    ];
    let process = Component::start_with_env(
        name,
        Path::new(env!("CARGO_BIN_EXE_opkit")),
        &args,
        &env,
        cp.dir(),
    )?;
    Ok(Replica {
        name: name.to_string(),
        port,
        process,
    })
}

/// One series of a replica's metrics (0 when absent).
async fn metric(port: u16, series: &str) -> anyhow::Result<f64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .await?;
    let mut body = String::new();
    s.read_to_string(&mut body).await?;
    Ok(body
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0.0))
}

/// Whether the member name `member` is one of `replicas`' (a member name starts with its
/// process's POD_NAME, then a hash), or one of those slots (`slot-<i>`).
fn on_one_of(member: Option<&String>, replicas: &[&str]) -> bool {
    member.is_some_and(|m| {
        replicas.iter().any(|r| {
            m == r
                || m.strip_prefix(r)
                    .is_some_and(|rest| rest.starts_with('-') && !rest[1..].contains('-'))
        })
    })
}

/// The ring of `replicas`' members: those of their member Leases that are held.
async fn ring_of(client: &Client, replicas: &[&str]) -> anyhow::Result<Ring> {
    let leases: Api<Lease> = Api::namespaced(client.clone(), OWN_NS);
    let mut members = Vec::new();
    for l in leases.list(&Default::default()).await?.items {
        let member = l.labels().get(MEMBER_LABEL).cloned();
        let held = l
            .spec
            .and_then(|s| s.holder_identity)
            .is_some_and(|h| !h.is_empty());
        if held && on_one_of(member.as_ref(), replicas) {
            members.extend(member);
        }
    }
    ensure!(
        members.len() == replicas.len(),
        "members of {replicas:?}: {members:?}"
    );
    Ok(Ring::new(members))
}

/// Every object placed where the ring of `replicas` puts it, none being moved, each with its
/// children placed alongside and converged: a Memcached's Deployment (and its Pods in its
/// status), an At's Pod once it ran. Returns the count placed on each replica.
async fn converged(
    client: &Client,
    scale: &Scale,
    replicas: &[&str],
) -> anyhow::Result<BTreeMap<String, usize>> {
    let ring = ring_of(client, replicas).await?;
    let placed = |name: &str, owner: Option<&String>| {
        owner.is_some_and(|o| ring.owner(&ring::key(Some(NS), name)) == Some(o.as_str()))
    };
    let mcs: Api<Memcached> = Api::namespaced(client.clone(), NS);
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
    let ats: Api<At> = Api::namespaced(client.clone(), NS);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let (m_shard, m_drain, m_adopt) = (
        shard_label("memcached"),
        drain_label("memcached"),
        adopt_annotation("memcached"),
    );
    let (a_shard, a_drain, a_adopt) = (shard_label("at"), drain_label("at"), adopt_annotation("at"));
    let deployed: BTreeMap<String, Deployment> = deployments
        .list(&Default::default())
        .await?
        .items
        .into_iter()
        .map(|d| (d.name_any(), d))
        .collect();
    let pods: BTreeMap<String, Pod> = pods
        .list(&Default::default())
        .await?
        .items
        .into_iter()
        .map(|p| (p.name_any(), p))
        .collect();
    let mut by: BTreeMap<String, usize> = BTreeMap::new();
    let mut open = Vec::new();
    let list = mcs.list(&Default::default()).await?.items;
    ensure!(list.len() == scale.memcacheds, "{} Memcacheds", list.len());
    for m in &list {
        let name = m.name_any();
        let owner = m.labels().get(&m_shard);
        let child = deployed.get(&name).and_then(|d| d.labels().get(&m_shard));
        let nodes = m.status.as_ref().map_or(0, |s| s.nodes.len());
        if !placed(&name, owner)
            || m.labels().contains_key(&m_drain)
            || m.annotations().contains_key(&m_adopt)
            || child != owner
            || nodes != scale.size as usize
        {
            open.push(format!(
                "{name} on {owner:?}, its Deployment on {child:?}, {nodes} nodes"
            ));
        }
        *by.entry(owner.cloned().unwrap_or_default()).or_default() += 1;
    }
    for a in ats.list(&Default::default()).await?.items {
        let name = a.name_any();
        let owner = a.labels().get(&a_shard);
        let pod = pods.get(&format!("{name}-pod")).map(|p| p.labels().get(&a_shard));
        if !placed(&name, owner)
            || a.labels().contains_key(&a_drain)
            || a.annotations().contains_key(&a_adopt)
            || pod.is_some_and(|p| p != owner)
        {
            open.push(format!("{name} on {owner:?}, its Pod on {pod:?}"));
        }
    }
    if open.is_empty() {
        Ok(by)
    } else {
        Err(anyhow!(
            "{} not placed or converged: {:?}",
            open.len(),
            &open[..open.len().min(5)]
        ))
    }
}

async fn wait_converged(
    processes: &mut [Replica],
    client: &Client,
    scale: &Scale,
    replicas: &[&str],
    start: Instant,
    since: Instant,
    what: &str,
) -> anyhow::Result<BTreeMap<String, usize>> {
    let by = wait_for(
        &format!("every object placed on {replicas:?} and converged ({what})"),
        Duration::from_secs(120),
        || converged(client, scale, replicas),
    )
    .await
    .map_err(|e| e.context(exits(processes)))?;
    log(
        start,
        &format!(
            "{what}: converged on {replicas:?} {:.1}s after: {by:?}",
            since.elapsed().as_secs_f64()
        ),
    );
    Ok(by)
}

/// Which of `processes` have exited, and the errors each logged last: a replica that could
/// not renew its member Lease in time exits (a Pod of it would be restarted), and the objects
/// on it wait.
fn exits(processes: &mut [Replica]) -> String {
    let mut out = Vec::new();
    for r in processes.iter_mut() {
        if let Some(status) = r.process.exited() {
            let log = std::fs::read_to_string(&r.process.log).unwrap_or_default();
            let errors: Vec<&str> = log.lines().filter(|l| l.contains("ERROR")).collect();
            out.push(format!(
                "{} exited ({status}), its last errors: {:?}",
                r.name,
                &errors[errors.len().saturating_sub(3)..]
            ));
        }
    }
    if out.is_empty() {
        "no replica has exited".into()
    } else {
        out.join("; ")
    }
}

/// A member that left (its member Lease deleted): its objects go back to the members they
/// came from, which then write for them again; allowed only after it left, and only if it
/// never writes for them again.
struct Left<'a> {
    user: &'a str,
    at: k8s_openapi::jiff::Timestamp,
    /// The objects it held when it left: only those go back.
    objects: std::collections::BTreeSet<String>,
}

/// The writes that do an object's work (its status, its children), by replica, in the order
/// the apiserver received them: `(object, user)` runs where one user comes back after another
/// wrote for the same object (but for objects given back by a member that `left`).
fn written_in_turns(audit: &[Audited], users: &[String], left: Option<&Left>) -> Vec<String> {
    let mut by_object: BTreeMap<String, Vec<(&str, &str)>> = BTreeMap::new();
    let mut sorted: Vec<&Audited> = audit.iter().collect();
    sorted.sort_by(|a, b| a.received.cmp(&b.received));
    for a in sorted {
        let write = matches!(a.verb.as_str(), "create" | "update" | "patch" | "delete");
        if !write || a.code >= 400 || !users.contains(&a.user) {
            continue;
        }
        let object = match (a.resource.as_str(), a.subresource.as_str()) {
            ("memcacheds" | "ats", "status") => a.name.clone(),
            ("deployments", "") => a.name.clone(),
            ("pods", "") => a.name.trim_end_matches("-pod").to_string(),
            _ => continue,
        };
        let writers = by_object.entry(object).or_default();
        if writers.last().map(|(u, _)| *u) != Some(a.user.as_str()) {
            writers.push((a.user.as_str(), a.received.as_str()));
        }
    }
    let mut bad = Vec::new();
    let given_back = |object: &str, writers: &[(&str, &str)], i: usize| {
        left.is_some_and(|l| {
            let after = writers[i]
                .1
                .parse::<k8s_openapi::jiff::Timestamp>()
                .is_ok_and(|t| t >= l.at);
            i >= 2
                && l.objects.contains(object)
                && writers[i - 1].0 == l.user
                && writers[i - 2].0 == writers[i].0
                && after
                && !writers[i..].iter().any(|(u, _)| *u == l.user)
        })
    };
    for (object, writers) in by_object {
        for (i, (u, at)) in writers.iter().enumerate() {
            if writers[..i].iter().any(|(v, _)| v == u) && !given_back(&object, &writers, i) {
                bad.push(format!("{object}: {u} wrote again at {at} after {writers:?}"));
                break;
            }
        }
    }
    bad
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharded_replicas_share_the_objects_through_kills_freezes_and_joins() -> anyhow::Result<()> {
    let scale = scale();
    let start = Instant::now();
    let cp = ControlPlane::start(Options {
        audit_log: true,
        // Kept (logs, audit log) when set, as for the chaos test.
        state_dir: std::env::var("CHAOS_STATE").ok().map(Into::into),
        ..Default::default()
    })
    .await?;
    let client = cp.client().await?;
    common::install_crds_on(&cp)?;
    common::create_namespaces(&client, &[NS, OWN_NS]).await?;
    log(start, "control plane up");

    let mut replicas = Vec::new();
    for name in ["opkit-a", "opkit-b", "opkit-c"] {
        replicas.push(start_replica(&cp, &client, &scale, name).await?);
    }

    // As a Deployment's replicas would be, all three are members before the objects come.
    wait_for(
        "the three replicas to be members",
        Duration::from_secs(60),
        || ring_of(&client, &["opkit-a", "opkit-b", "opkit-c"]),
    )
    .await?;
    // The objects: Memcacheds created at once (50 requests in flight), then Ats falling due
    // from then on, over the faults, so that Ats move while their Pods run.
    let mcs: Api<Memcached> = Api::namespaced(client.clone(), NS);
    futures::stream::iter(0..scale.memcacheds)
        .map(|i| {
            let mcs = mcs.clone();
            async move {
                let m: Memcached = serde_json::from_value(serde_json::json!({
                    "apiVersion": "cache.example.com/v1", "kind": "Memcached",
                    "metadata": {"name": format!("mc-{i}")}, "spec": {"size": scale.size},
                }))?;
                mcs.create(&PostParams::default(), &m).await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(50)
        .try_collect::<Vec<()>>()
        .await?;
    let ats: Api<At> = Api::namespaced(client.clone(), NS);
    let first_due = k8s_openapi::jiff::Timestamp::now() + k8s_openapi::jiff::SignedDuration::from_secs(1);
    common::create_ats(&client, NS, scale.ats, first_due, scale.spread).await?;
    log(
        start,
        &format!("{} Memcacheds and {} Ats created", scale.memcacheds, scale.ats),
    );
    let created = Instant::now();
    let by = wait_converged(
        &mut replicas,
        &client,
        &scale,
        &["opkit-a", "opkit-b", "opkit-c"],
        start,
        created,
        "created",
    )
    .await?;
    // Each replica holds about a third, and caches what it holds (and no more).
    for r in &replicas {
        let placed = by
            .iter()
            .filter(|(m, _)| on_one_of(Some(m), &[&r.name]))
            .map(|(_, n)| *n)
            .sum::<usize>() as f64;
        let cached = metric(
            r.port,
            r#"opkit_cache_objects{controller="memcached",kind="Memcached"}"#,
        )
        .await?;
        let children = metric(
            r.port,
            r#"opkit_cache_objects{controller="memcached",kind="Deployment"}"#,
        )
        .await?;
        let third = scale.memcacheds as f64 / 3.0;
        log(
            start,
            &format!(
                "{} holds {placed} Memcacheds, caches {cached} and {children} Deployments",
                r.name
            ),
        );
        ensure!(
            cached == placed && children == placed && placed > third * 0.4 && placed < third * 1.7,
            "{} holds {placed} of {} Memcacheds and caches {cached} of them and {children} Deployments",
            r.name,
            scale.memcacheds
        );
    }

    // A replica killed: its objects move once its member Lease has run out.
    let killed = Instant::now();
    replicas[1].process.signal(Signal::SIGKILL)?;
    log(start, "SIGKILL opkit-b");
    wait_converged(
        &mut replicas,
        &client,
        &scale,
        &["opkit-a", "opkit-c"],
        start,
        killed,
        "opkit-b killed",
    )
    .await?;
    let joined = Instant::now();
    replicas.push(start_replica(&cp, &client, &scale, "opkit-b2").await?);
    wait_converged(
        &mut replicas,
        &client,
        &scale,
        &["opkit-a", "opkit-c", "opkit-b2"],
        start,
        joined,
        "opkit-b2 joined",
    )
    .await?;

    // A replica frozen past its Lease: its objects move; running again, it finds its Lease
    // lost and exits (it is restarted under a new name, as a new member).
    let frozen = Instant::now();
    replicas[2].process.signal(Signal::SIGSTOP)?;
    log(start, "SIGSTOP opkit-c");
    wait_converged(
        &mut replicas,
        &client,
        &scale,
        &["opkit-a", "opkit-b2"],
        start,
        frozen,
        "opkit-c frozen",
    )
    .await?;
    replicas[2].process.signal(Signal::SIGCONT)?;
    log(start, "SIGCONT opkit-c");
    wait_for("opkit-c to exit", Duration::from_secs(30), || {
        let exited = replicas[2].process.exited();
        async move { exited.map(drop).ok_or_else(|| anyhow!("still running")) }
    })
    .await?;
    let joined = Instant::now();
    replicas.push(start_replica(&cp, &client, &scale, "opkit-c2").await?);
    replicas.push(start_replica(&cp, &client, &scale, "opkit-d").await?);
    let live = ["opkit-a", "opkit-b2", "opkit-c2", "opkit-d"];
    wait_converged(
        &mut replicas,
        &client,
        &scale,
        &live,
        start,
        joined,
        "opkit-c2 and opkit-d joined",
    )
    .await?;

    // A member Lease deleted by hand right after its holder renewed it, while that member
    // has work in flight (its Deployments deleted, to be made again): it writes on until its
    // next renewal finds the Lease gone, so its objects may move only after that (the audit
    // below finds any write of it after another replica's); then it exits.
    let leases: Api<Lease> = Api::namespaced(client.clone(), OWN_NS);
    let d_lease = leases
        .list(&Default::default())
        .await?
        .items
        .into_iter()
        .find(|l| on_one_of(l.labels().get(MEMBER_LABEL), &["opkit-d"]))
        .ok_or_else(|| anyhow!("no member Lease of opkit-d"))?;
    let (d_lease, d_member) = (d_lease.name_any(), d_lease.labels()[MEMBER_LABEL].clone());
    let renewed = |l: Lease| l.spec.and_then(|s| s.renew_time).map(|t| t.0);
    let before = renewed(leases.get(&d_lease).await?);
    wait_for(
        "opkit-d to renew its member Lease",
        Duration::from_secs(30),
        || async {
            let now = renewed(leases.get(&d_lease).await?);
            ensure!(now != before, "not yet");
            Ok(())
        },
    )
    .await?;
    // What it holds: only these may go back to where they came from.
    let mut d_objects = std::collections::BTreeSet::new();
    for m in mcs.list(&Default::default()).await?.items {
        if m.labels().get(&shard_label("memcached")) == Some(&d_member) {
            d_objects.insert(m.name_any());
        }
    }
    for a in ats.list(&Default::default()).await?.items {
        if a.labels().get(&shard_label("at")) == Some(&d_member) {
            d_objects.insert(a.name_any());
        }
    }
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
    let on_d = format!("{}={d_member}", shard_label("memcached"));
    deployments
        .delete_collection(
            &Default::default(),
            &kube::api::ListParams::default().labels(&on_d),
        )
        .await?;
    let d_left = k8s_openapi::jiff::Timestamp::now();
    leases.delete(&d_lease, &Default::default()).await?;
    let deleted = Instant::now();
    log(start, "opkit-d's Deployments and member Lease deleted");
    let live = ["opkit-a", "opkit-b2", "opkit-c2"];
    ensure!(replicas[5].name == "opkit-d", "{}", replicas[5].name);
    wait_converged(
        &mut replicas,
        &client,
        &scale,
        &live,
        start,
        deleted,
        "opkit-d's member Lease deleted",
    )
    .await?;
    wait_for("opkit-d to exit", Duration::from_secs(30), || {
        let exited = replicas[5].process.exited();
        async move { exited.map(drop).ok_or_else(|| anyhow!("still running")) }
    })
    .await?;

    // Every At ran, once.
    wait_for(
        "every At to be DONE",
        Duration::from_secs(scale.spread + 120),
        || async {
            let open: Vec<String> = ats
                .list(&Default::default())
                .await?
                .items
                .into_iter()
                .filter(|a| a.status.as_ref().and_then(|s| s.phase) != Some(Phase::Done))
                .map(|a| a.name_any())
                .collect();
            if open.is_empty() {
                Ok(())
            } else {
                Err(anyhow!("not DONE: {open:?}"))
            }
        },
    )
    .await?;
    wait_converged(
        &mut replicas,
        &client,
        &scale,
        &live,
        start,
        joined,
        "every At done",
    )
    .await?;

    let audit = read_audit(&cp.dir().join("audit.log"))?;
    let mut failures = Vec::new();
    for a in ats.list(&Default::default()).await?.items {
        let name = a.name_any();
        let outcome = a.status.as_ref().and_then(|s| s.outcome);
        if outcome != Some(Outcome::Succeeded) {
            failures.push(format!("At {name} ended {outcome:?}"));
        }
        let pod = format!("{name}-pod");
        let creates = common::pod_creates(&audit, &pod, 201);
        // A create refused because the Pod exists: its owner did not see it (a missed
        // adoption), which no fault in this test explains.
        let refused = common::pod_creates(&audit, &pod, 409);
        if creates != 1 || refused != 0 {
            failures.push(format!(
                "At {name}: its Pod created {creates} times, {refused} more refused"
            ));
        }
    }
    let users: Vec<String> = ["opkit-a", "opkit-b", "opkit-c", "opkit-b2", "opkit-c2", "opkit-d"]
        .iter()
        .map(|r| user(r))
        .collect();
    let d_user = user("opkit-d");
    let left = Left {
        user: &d_user,
        at: d_left,
        objects: d_objects,
    };
    let turns = written_in_turns(&audit, &users, Some(&left));
    let writes = audit
        .iter()
        .filter(|a| users.contains(&a.user) && a.verb != "get" && a.verb != "list" && a.verb != "watch")
        .count();
    // An At's Pod is only ever created; a patch of one is its adoption by the At's new owner.
    let adopted = audit
        .iter()
        .filter(|a| users.contains(&a.user) && a.resource == "pods" && a.verb == "patch" && a.code < 300)
        .count();
    log(
        start,
        &format!(
            "{writes} writes audited, {} written in turns; {adopted} At Pods taken over by a new owner",
            turns.len()
        ),
    );
    if scale.ats >= 100 {
        ensure!(
            adopted > 0,
            "no At moved while it had a Pod: the run proves nothing about them"
        );
    }
    failures.extend(turns);
    for r in &mut replicas {
        r.process.stop(Duration::from_secs(5));
    }
    ensure!(failures.is_empty(), "{} failures: {failures:#?}", failures.len());
    Ok(())
}

#[test]
fn the_audit_check_finds_an_object_written_by_a_replica_after_another() {
    let w = |user: &str, resource: &str, sub: &str, name: &str, at: &str| Audited {
        user: user.into(),
        verb: "patch".into(),
        group: String::new(),
        resource: resource.into(),
        subresource: sub.into(),
        name: name.into(),
        code: 200,
        message: String::new(),
        decision: "allow".into(),
        received: at.into(),
        done: at.into(),
        streams_list: false,
    };
    let users = vec![user("a"), user("b")];
    let handed_over = vec![
        w(
            &user("a"),
            "deployments",
            "",
            "mc-1",
            "2026-01-01T00:00:01.000000Z",
        ),
        w(
            &user("a"),
            "memcacheds",
            "status",
            "mc-1",
            "2026-01-01T00:00:02.000000Z",
        ),
        w(
            &user("b"),
            "deployments",
            "",
            "mc-1",
            "2026-01-01T00:00:03.000000Z",
        ),
        // Another object, and the sharder's label write on the object itself: not counted.
        w(
            &user("a"),
            "deployments",
            "",
            "mc-2",
            "2026-01-01T00:00:04.000000Z",
        ),
        w(
            &user("a"),
            "memcacheds",
            "",
            "mc-1",
            "2026-01-01T00:00:05.000000Z",
        ),
    ];
    assert!(written_in_turns(&handed_over, &users, None).is_empty());
    let mut twice = handed_over.clone();
    twice.push(w(
        &user("a"),
        "memcacheds",
        "status",
        "mc-1",
        "2026-01-01T00:00:06.000000Z",
    ));
    let bad = written_in_turns(&twice, &users, None);
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert!(bad[0].starts_with("mc-1: "), "{bad:?}");
    // Given back by "b" once it left (its member Lease deleted at 00:00:05.5): allowed, but
    // not before it left, nor with "b" writing again after.
    let (b_user, c_user) = (user("b"), user("c"));
    let left = |at: &str| Left {
        user: &b_user,
        at: at.parse().unwrap(),
        objects: ["mc-1".to_string()].into(),
    };
    assert!(written_in_turns(&twice, &users, Some(&left("2026-01-01T00:00:05.5Z"))).is_empty());
    assert_eq!(
        written_in_turns(&twice, &users, Some(&left("2026-01-01T00:00:06.5Z"))).len(),
        1
    );
    let mut again = twice.clone();
    again.push(w(
        &b_user,
        "deployments",
        "",
        "mc-1",
        "2026-01-01T00:00:07.000000Z",
    ));
    assert_eq!(
        written_in_turns(&again, &users, Some(&left("2026-01-01T00:00:05.5Z"))).len(),
        1
    );
    // Not an object it held when it left (it wrote for another member's object).
    let not_held = Left {
        objects: Default::default(),
        ..left("2026-01-01T00:00:05.5Z")
    };
    assert_eq!(written_in_turns(&twice, &users, Some(&not_held)).len(), 1);
    // Only to the member it came from.
    let mut elsewhere = handed_over.clone();
    elsewhere.push(w(
        &c_user,
        "deployments",
        "",
        "mc-1",
        "2026-01-01T00:00:06.000000Z",
    ));
    elsewhere.push(w(
        &user("a"),
        "deployments",
        "",
        "mc-1",
        "2026-01-01T00:00:07.000000Z",
    ));
    let users3 = vec![user("a"), b_user.clone(), c_user.clone()];
    assert_eq!(
        written_in_turns(&elsewhere, &users3, Some(&left("2026-01-01T00:00:05.5Z"))).len(),
        1
    );
    // A Pod counts for its At.
    let pods = vec![
        w(&user("b"), "ats", "status", "at-1", "2026-01-01T00:00:01.000000Z"),
        w(&user("a"), "pods", "", "at-1-pod", "2026-01-01T00:00:02.000000Z"),
        w(&user("b"), "ats", "status", "at-1", "2026-01-01T00:00:03.000000Z"),
    ];
    assert_eq!(written_in_turns(&pods, &users, None).len(), 1);
}

/// The slot (its member name) whose Lease names `replica`'s process as holder, once one does.
async fn slot_of(client: &Client, replica: &str) -> anyhow::Result<String> {
    let leases: Api<Lease> = Api::namespaced(client.clone(), OWN_NS);
    wait_for(
        &format!("{replica} to hold a slot"),
        Duration::from_secs(60),
        || async {
            leases
                .list(&Default::default())
                .await?
                .items
                .into_iter()
                .find(|l| {
                    let holder = l.spec.as_ref().and_then(|s| s.holder_identity.as_deref());
                    holder.is_some_and(|h| h.starts_with(&format!("{replica}_")))
                        && l.labels().contains_key(opkit::sharding::SLOT_LABEL)
                })
                .and_then(|l| l.labels().get(MEMBER_LABEL).cloned())
                .ok_or_else(|| anyhow!("{replica} holds no slot"))
        },
    )
    .await
}

/// The shard labels of every Memcached and At.
async fn shard_labels(client: &Client) -> anyhow::Result<BTreeMap<String, Option<String>>> {
    let mcs: Api<Memcached> = Api::namespaced(client.clone(), NS);
    let ats: Api<At> = Api::namespaced(client.clone(), NS);
    let mut out = BTreeMap::new();
    for m in mcs.list(&Default::default()).await?.items {
        out.insert(
            format!("Memcached {}", m.name_any()),
            m.labels().get(&shard_label("memcached")).cloned(),
        );
    }
    for a in ats.list(&Default::default()).await?.items {
        out.insert(
            format!("At {}", a.name_any()),
            a.labels().get(&shard_label("at")).cloned(),
        );
    }
    Ok(out)
}

/// `--sharding-slots 3`, as `config/sharding` runs: a rolling restart (each new process
/// starts as a spare, then an old one gets SIGTERM) hands every slot over with its objects,
/// relabelling none; a slot holder killed while a spare waits is replaced by the spare. The
/// audit log judges as above: no object written by two processes in turns, every At's Pod
/// created once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_are_handed_over_in_a_rolling_restart_and_after_a_kill() -> anyhow::Result<()> {
    let scale = scale();
    let start = Instant::now();
    let cp = ControlPlane::start(Options {
        audit_log: true,
        ..Default::default()
    })
    .await?;
    let client = cp.client().await?;
    common::install_crds_on(&cp)?;
    common::create_namespaces(&client, &[NS, OWN_NS]).await?;
    let slots = ["slot-0", "slot-1", "slot-2"];
    let with_slots = ["--sharding-slots", "3"];
    let mut replicas = Vec::new();
    for name in ["opkit-a", "opkit-b", "opkit-c"] {
        replicas.push(start_replica_with(&cp, &client, &scale, name, &with_slots).await?);
    }
    wait_for("the three slots to be held", Duration::from_secs(60), || {
        ring_of(&client, &slots)
    })
    .await?;
    let mcs: Api<Memcached> = Api::namespaced(client.clone(), NS);
    for i in 0..scale.memcacheds {
        let m: Memcached = serde_json::from_value(serde_json::json!({
            "apiVersion": "cache.example.com/v1", "kind": "Memcached",
            "metadata": {"name": format!("mc-{i}")}, "spec": {"size": scale.size},
        }))?;
        mcs.create(&PostParams::default(), &m).await?;
    }
    let first_due = k8s_openapi::jiff::Timestamp::now() + k8s_openapi::jiff::SignedDuration::from_secs(1);
    common::create_ats(&client, NS, scale.ats, first_due, scale.spread).await?;
    let created = Instant::now();
    wait_converged(
        &mut replicas,
        &client,
        &scale,
        &slots,
        start,
        created,
        "created on slots",
    )
    .await?;
    let before = shard_labels(&client).await?;

    // The rolling restart, one process at a time.
    for (old, new) in [
        ("opkit-a", "opkit-d"),
        ("opkit-b", "opkit-e"),
        ("opkit-c", "opkit-f"),
    ] {
        let slot = slot_of(&client, old).await?;
        replicas.push(start_replica_with(&cp, &client, &scale, new, &with_slots).await?);
        let stopped = Instant::now();
        let i = replicas.iter().position(|r| r.name == old).unwrap_or_default();
        replicas[i].process.signal(Signal::SIGTERM)?;
        let took = slot_of(&client, new).await?;
        ensure!(took == slot, "{new} took {took}; {old} left {slot}");
        wait_converged(
            &mut replicas,
            &client,
            &scale,
            &slots,
            start,
            stopped,
            &format!("{new} took {slot} from {old}"),
        )
        .await?;
    }
    let after = shard_labels(&client).await?;
    let moved: Vec<&String> = before
        .keys()
        .filter(|k| before.get(*k) != after.get(*k))
        .collect();
    log(
        start,
        &format!(
            "rolling restart: {} of {} objects relabelled",
            moved.len(),
            before.len()
        ),
    );
    ensure!(moved.is_empty(), "relabelled in the rolling restart: {moved:?}");

    // A slot holder killed while a spare waits: the spare has its slot once its Lease ran out.
    replicas.push(start_replica_with(&cp, &client, &scale, "opkit-g", &with_slots).await?);
    let slot = slot_of(&client, "opkit-e").await?;
    let i = replicas
        .iter()
        .position(|r| r.name == "opkit-e")
        .unwrap_or_default();
    let killed = Instant::now();
    replicas[i].process.signal(Signal::SIGKILL)?;
    log(start, &format!("SIGKILL opkit-e ({slot})"));
    let took = slot_of(&client, "opkit-g").await?;
    ensure!(took == slot, "opkit-g took {took}; opkit-e held {slot}");
    wait_converged(
        &mut replicas,
        &client,
        &scale,
        &slots,
        start,
        killed,
        "opkit-g took the killed one's slot",
    )
    .await?;

    let ats: Api<At> = Api::namespaced(client.clone(), NS);
    wait_for(
        "every At to be DONE",
        Duration::from_secs(scale.spread + 120),
        || async {
            let open = ats
                .list(&Default::default())
                .await?
                .items
                .into_iter()
                .filter(|a| a.status.as_ref().and_then(|s| s.phase) != Some(Phase::Done))
                .count();
            ensure!(open == 0, "{open} not DONE");
            Ok(())
        },
    )
    .await?;
    let audit = read_audit(&cp.dir().join("audit.log"))?;
    let names = [
        "opkit-a", "opkit-b", "opkit-c", "opkit-d", "opkit-e", "opkit-f", "opkit-g",
    ];
    let users: Vec<String> = names.iter().map(|r| user(r)).collect();
    let mut failures = written_in_turns(&audit, &users, None);
    for a in ats.list(&Default::default()).await?.items {
        let pod = format!("{}-pod", a.name_any());
        let (creates, refused) = (
            common::pod_creates(&audit, &pod, 201),
            common::pod_creates(&audit, &pod, 409),
        );
        if creates != 1 || refused != 0 {
            failures.push(format!("{pod} created {creates} times, {refused} more refused"));
        }
    }
    log(start, &format!("{} failures in the audit", failures.len()));
    for r in &mut replicas {
        r.process.stop(Duration::from_secs(5));
    }
    ensure!(failures.is_empty(), "{} failures: {failures:#?}", failures.len());
    Ok(())
}
