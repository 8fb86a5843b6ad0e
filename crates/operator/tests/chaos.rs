//! Two `opkit run --leader-elect` replicas on a control plane of their own, while objects are
//! created and faults are injected: the leader frozen for longer than its lease, the leader
//! killed, the apiserver and etcd restarted, etcd compacted (watches get `410 Gone`), the
//! apiserver frozen past the renew deadline, the replicas rolled one by one, the leader's
//! connection answering 429 to every write, its connections made half-open, and the leader
//! frozen while it waits out a 429's Retry-After (each replica goes through a fault-injecting
//! proxy of its own). A supervisor restarts a replica that exits, as
//! the kubelet would. Checked afterwards, from the apiserver's audit log and a Pod watch kept open all
//! along: every At's Pod was created exactly once, every Memcached converged, and no replica
//! wrote anything while another one held the Lease.
//!
//! `make test` runs the small version; `make chaos` (`OPKIT_CHAOS=full`) the full one.
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, ensure};
use futures::StreamExt;
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use opkit_api::at::{At, Outcome, Phase};
use opkit_api::eru::Eru;
use opkit_api::memcached::Memcached;
use opkit_testenv::proxy::{Fault, FaultProxy};
use opkit_testenv::{Component, ControlPlane, Options, Signal, wait_for};

mod common;
use common::{Audited, read_audit};

const NS: &str = "chaos";
/// The operator's own namespace (its Lease, the shared webhook certificate), which its
/// webhooks leave out.
const OWN_NS: &str = "chaos-system";
const LEASE: &str = "opkit-leader";
const LEASE_SECONDS: u64 = 4;

struct Scale {
    memcacheds: usize,
    ats: usize,
    erus: usize,
    /// How many times the sequence of faults runs.
    rounds: usize,
    /// Seconds over which the Ats fall due.
    spread: u64,
}

fn scale() -> Scale {
    if std::env::var("OPKIT_CHAOS").as_deref() == Ok("full") {
        Scale {
            memcacheds: 300,
            ats: 100,
            erus: 50,
            rounds: 3,
            spread: 150,
        }
    } else {
        Scale {
            memcacheds: 30,
            ats: 12,
            erus: 4,
            rounds: 1,
            spread: 70,
        }
    }
}

/// The replicas, restarted by the supervisor when they exit (as a kubelet would).
type Replicas = Arc<Mutex<Vec<Component>>>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn user(replica: &str) -> String {
    format!("system:serviceaccount:{NS}:{replica}")
}

fn log(start: Instant, what: &str) {
    println!("[{:6.1}s] {what}", start.elapsed().as_secs_f64());
}

async fn holder(leases: &Api<Lease>) -> String {
    leases
        .get_opt(LEASE)
        .await
        .ok()
        .flatten()
        .and_then(|l| l.spec?.holder_identity)
        .unwrap_or_default()
}

/// Waits until the Lease is held by `replica` (identities are `<replica>_<pid>`), or by
/// anyone when `replica` is empty; returns the holder's replica name.
async fn wait_holder(leases: &Api<Lease>, replica: &str, timeout: Duration) -> anyhow::Result<String> {
    wait_for(
        &format!("the Lease to be held by {replica:?}"),
        timeout,
        || async {
            let h = holder(leases).await;
            let name = h.split('_').next().unwrap_or("").to_string();
            if !name.is_empty() && (replica.is_empty() || name == replica) {
                Ok(name)
            } else {
                Err(anyhow!("holder {h:?}"))
            }
        },
    )
    .await
}

fn replica_index(replicas: &Replicas, name: &str) -> usize {
    let r = lock(replicas);
    r.iter()
        .position(|c| c.name == name)
        .expect("a replica of that name")
}

/// Waits until `replica` has exited more than `exits_before` times (and been restarted by
/// the supervisor).
async fn wait_restarted(
    restarts: &Mutex<Vec<String>>,
    replica: &str,
    exits_before: usize,
) -> anyhow::Result<()> {
    wait_for(
        &format!("{replica} to give up and be restarted"),
        Duration::from_secs(20),
        || async {
            if lock(restarts).iter().filter(|r| r.starts_with(replica)).count() > exits_before {
                Ok(())
            } else {
                Err(anyhow!("{replica} still running"))
            }
        },
    )
    .await
}

/// Waits until `replica`'s webhook server accepts connections on `port` (it binds only once
/// it has its certificate): what a Service's readiness would wait for.
async fn wait_serving(replica: &str, port: u16) -> anyhow::Result<()> {
    wait_for(
        &format!("{replica} to serve its webhooks"),
        Duration::from_secs(30),
        || async move {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .map(drop)
                .map_err(anyhow::Error::from)
        },
    )
    .await
}

/// `kubeconfig` (a token user) pointed at `proxy` instead of the apiserver.
fn through(kubeconfig: &Path, proxy: &FaultProxy) -> anyhow::Result<std::path::PathBuf> {
    let mut kc: serde_yaml::Value = serde_yaml::from_str(&std::fs::read_to_string(kubeconfig)?)?;
    let url = proxy.config().cluster_url.to_string();
    kc["clusters"][0]["cluster"] =
        serde_yaml::to_value(BTreeMap::from([("server", url.trim_end_matches('/'))]))?;
    let path = kubeconfig.with_extension("proxied.kubeconfig");
    std::fs::write(&path, serde_yaml::to_string(&kc)?)?;
    Ok(path)
}

fn start_replica(
    cp: &ControlPlane,
    name: &str,
    kubeconfig: &Path,
    webhook: u16,
    proxy: u16,
) -> anyhow::Result<Component> {
    let args: Vec<String> = [
        "run",
        "--controllers",
        "memcached,at,eru",
        "--namespace",
        NS,
        "--leader-elect",
        "--leader-election-namespace",
        OWN_NS,
        "--leader-elect-lease-duration",
        &LEASE_SECONDS.to_string(),
        "--leader-elect-renew-deadline",
        "3",
        "--leader-elect-retry-period",
        "1",
        "--shutdown-timeout",
        "5",
        "--metrics-bind-address",
        "0",
        "--health-probe-bind-address",
        "0",
        "--kubeconfig",
        &kubeconfig.display().to_string(),
        "--webhook-bind-address",
        &format!("127.0.0.1:{webhook}"),
        "--webhook-url",
        &format!("https://127.0.0.1:{proxy}"),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let env = vec![
        ("POD_NAME".to_string(), name.to_string()),
        // The shared webhook certificate's Secret goes here.
        ("POD_NAMESPACE".to_string(), OWN_NS.to_string()),
        (
            "RUST_LOG".to_string(),
            "info,opkit=debug,kube_runtime=warn".to_string(),
        ),
        ("RUST_BACKTRACE".to_string(), "0".to_string()),
        ("NO_COLOR".to_string(), "1".to_string()),
    ];
    Ok(Component::start_with_env(
        name,
        Path::new(env!("CARGO_BIN_EXE_opkit")),
        &args,
        &env,
        cp.dir(),
    )?)
}

/// Creates v1 CronTabs (each converted by the webhook to the stored v2 and back) until `stop`:
/// how many were created, and every error.
async fn convert_until(
    client: kube::Client,
    round: usize,
    stop: tokio_util::sync::CancellationToken,
    start: Instant,
) -> (usize, Vec<String>) {
    let resource = kube::core::ApiResource {
        group: "stable.example.com".into(),
        version: "v1".into(),
        api_version: "stable.example.com/v1".into(),
        kind: "CronTab".into(),
        plural: "crontabs".into(),
    };
    let api: Api<kube::core::DynamicObject> = Api::namespaced_with(client, NS, &resource);
    let (mut converted, mut failed) = (0, Vec::new());
    let mut i = 0;
    while !stop.is_cancelled() {
        let ct = serde_json::json!({
            "apiVersion": "stable.example.com/v1", "kind": "CronTab",
            "metadata": {"name": format!("roll-{round}-{i}")},
            "spec": {"cronSpec": format!("{} * * * *", i % 60), "image": "busybox"},
        });
        match serde_json::from_value(ct) {
            Ok(ct) => match api.create(&PostParams::default(), &ct).await {
                Ok(_) => converted += 1,
                // When, to set it against the replicas' logs.
                Err(e) => failed.push(format!("[{:6.1}s] {e}", start.elapsed().as_secs_f64())),
            },
            Err(e) => failed.push(e.to_string()),
        }
        i += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    (converted, failed)
}

fn is_write(verb: &str) -> bool {
    matches!(
        verb,
        "create" | "update" | "patch" | "delete" | "deletecollection"
    )
}

/// A time the apiserver was frozen (SIGSTOP), from pause to resume, by the wall clock.
#[derive(Clone, Copy)]
struct Freeze {
    paused: k8s_openapi::jiff::Timestamp,
    resumed: k8s_openapi::jiff::Timestamp,
}

/// How long after a resume the apiserver may still be reading what was sent before it froze.
const READ_LATE: k8s_openapi::jiff::SignedDuration = k8s_openapi::jiff::SignedDuration::from_secs(3);

/// Writes (other than to the Lease) by a replica received after another replica's successful
/// Lease write and before its own next one: writes by a replica that was not the leader.
/// RFC 3339 timestamps with the same precision and zone compare as strings.
///
/// Returned apart (second): writes of the replica that led when the apiserver froze, read
/// within [`READ_LATE`] of its resume. Those were sent before the freeze, acknowledged by the
/// apiserver's kernel, and read only when it ran again; no client can take them back (see
/// docs/reliability.md), so they are reported, not failed.
fn writes_while_not_leader(
    audit: &[Audited],
    replicas: &[&str],
    freezes: &[Freeze],
) -> (Vec<String>, Vec<String>) {
    let users: Vec<String> = replicas.iter().map(|r| user(r)).collect();
    let mut lease_writes: Vec<(&str, &str)> = audit
        .iter()
        .filter(|a| a.resource == "leases" && a.name == LEASE && is_write(&a.verb) && a.code < 300)
        .map(|a| (a.done.as_str(), a.user.as_str()))
        .collect();
    lease_writes.sort();
    let (mut bad, mut late) = (Vec::new(), Vec::new());
    for a in audit {
        // Every replica keeps the shared webhook certificate and configurations current.
        let shared = matches!(
            a.resource.as_str(),
            "leases"
                | "secrets"
                | "mutatingwebhookconfigurations"
                | "validatingwebhookconfigurations"
                | "customresourcedefinitions"
        );
        // The replica had given up on the request (its gate closed, the connection with it)
        // before the apiserver read it: a frozen apiserver reads what was sent before it froze
        // only when it runs again, finds the request's context cancelled and stores nothing.
        let abandoned = a.code == 504 && a.message.ends_with("context canceled");
        if !users.contains(&a.user) || !is_write(&a.verb) || shared || abandoned {
            continue;
        }
        let leader_at = |t: &str| lease_writes.iter().rev().find(|(w, _)| *w <= t).map(|(_, u)| *u);
        let leader = leader_at(a.received.as_str());
        if leader != Some(a.user.as_str()) {
            let what = format!(
                "{} {} {} {} at {} ({}; last Lease write by {leader:?})",
                a.user, a.verb, a.resource, a.name, a.received, a.code
            );
            let received: Option<k8s_openapi::jiff::Timestamp> = a.received.parse().ok();
            let read_late = received.is_some_and(|r| {
                freezes.iter().any(|f| {
                    let paused = f.paused.strftime("%Y-%m-%dT%H:%M:%S%.6fZ").to_string();
                    r >= f.resumed
                        && r <= f.resumed + READ_LATE
                        && leader_at(&paused) == Some(a.user.as_str())
                })
            });
            if read_late {
                late.push(what);
            } else {
                bad.push(what);
            }
        }
    }
    (bad, late)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_under_faults_lose_nothing_and_double_nothing() -> anyhow::Result<()> {
    let scale = scale();
    let start = Instant::now();
    let mut cp = ControlPlane::start(Options {
        audit_log: true,
        state_dir: std::env::var("CHAOS_STATE").ok().map(Into::into),
        ..Default::default()
    })
    .await?;
    let client = cp.client().await?;
    log(start, &format!("control plane up at {}", cp.server()));
    let mut freezes: Vec<Freeze> = Vec::new();

    common::install_crds_on(&cp)?;
    common::create_namespaces(&client, &[NS, OWN_NS]).await?;

    // Every Pod UID ever seen, by name, from one watch kept open all along.
    let uids: Arc<Mutex<BTreeMap<String, BTreeSet<String>>>> = Arc::default();
    let pods_watch = {
        let uids = uids.clone();
        let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
        tokio::spawn(async move {
            let mut w = watcher(pods, watcher::Config::default())
                .default_backoff()
                .touched_objects()
                .boxed();
            while let Some(ev) = w.next().await {
                if let Ok(p) = ev {
                    let name = p.metadata.name.clone().unwrap_or_default();
                    let uid = p.metadata.uid.clone().unwrap_or_default();
                    lock(&uids).entry(name).or_default().insert(uid);
                }
            }
        })
    };

    let names = ["opkit-a", "opkit-b"];
    // Each replica talks to the apiserver through a fault-injecting proxy of its own, which
    // forwards the replica's token (the audit log still tells them apart).
    let mut anonymous = opkit_testenv::config_from_file(&cp.kubeconfig_path()).await?;
    anonymous.auth_info = Default::default();
    // The proxy must not retry on its own: a retry would reach the apiserver after the
    // replica had given the write up.
    anonymous.default_retry = false;
    let mut kubeconfigs = Vec::new();
    let mut api_proxies = Vec::new();
    for n in names {
        let direct = common::kubeconfig_for(&cp, &client, NS, n).await?;
        let p = FaultProxy::start(kube::Client::try_from(anonymous.clone())?).await?;
        kubeconfigs.push(through(&direct, &p)?);
        api_proxies.push(p);
    }
    // In front of both webhook servers, as a Service would be: round robin over the replicas
    // that accept connections.
    let ports = [opkit_testenv::free_port()?, opkit_testenv::free_port()?];
    let proxy_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let proxy = proxy_listener.local_addr()?.port();
    let draining: Draining = Arc::new(Mutex::new(std::collections::HashSet::new()));
    let proxy_task = tokio::spawn(balance(proxy_listener, ports.to_vec(), draining.clone(), start));
    let replicas: Replicas = Arc::new(Mutex::new(Vec::new()));
    lock(&replicas).push(start_replica(&cp, names[0], &kubeconfigs[0], ports[0], proxy)?);
    let leases: Api<Lease> = Api::namespaced(client.clone(), OWN_NS);
    wait_holder(&leases, "opkit-a", Duration::from_secs(30)).await?;
    lock(&replicas).push(start_replica(&cp, names[1], &kubeconfigs[1], ports[1], proxy)?);
    log(start, "opkit-a leads, opkit-b stands by");

    // The supervisor: a replica that exits (leadership lost) is started again after 1 s.
    let restarts = Arc::new(Mutex::new(Vec::<String>::new()));
    let supervisor = {
        let (replicas, restarts) = (replicas.clone(), restarts.clone());
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                // A replica being rolled holds the lock while it stops: skip this tick rather
                // than block a runtime thread the balancer and the proxies need.
                let mut rs = match replicas.try_lock() {
                    Ok(rs) => rs,
                    Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                    Err(std::sync::TryLockError::WouldBlock) => continue,
                };
                for r in rs.iter_mut() {
                    if let Some(status) = r.exited() {
                        let tail = opkit_testenv_tail(&r.log, 3);
                        lock(&restarts).push(format!("{} exited with {status}: {tail}", r.name));
                        let _ = r.restart(Duration::from_secs(1));
                    }
                }
            }
        })
    };

    // Erus restarting their Deployments every 10 s, all along.
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
    let erus: Api<Eru> = Api::namespaced(client.clone(), NS);
    for i in 0..scale.erus {
        deployments
            .create(
                &PostParams::default(),
                &serde_json::from_value(serde_json::json!({
                    "metadata": {"name": format!("eru-target-{i}")},
                    "spec": {
                        "replicas": 1,
                        // Every restart's ReplicaSet is kept, to count the restarts.
                        "revisionHistoryLimit": 1000,
                        "selector": {"matchLabels": {"app": format!("eru-target-{i}")}},
                        "template": {
                            "metadata": {"labels": {"app": format!("eru-target-{i}")}},
                            "spec": {"containers": [{"name": "c", "image": "busybox"}]},
                        },
                    },
                }))?,
            )
            .await?;
        erus.create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({
                "apiVersion": "mtsre.meitu.com/v1", "kind": "Eru",
                "metadata": {"name": format!("eru-{i}")},
                "spec": {"deploymentName": format!("eru-target-{i}"), "schedule": "*/10 * * * * *"},
            }))?,
        )
        .await?;
    }

    // The workload: Ats falling due across the run, Memcacheds created all along. The Ats are
    // all created before the first fault: their webhook fails closed (failurePolicy Fail), so
    // a create sent to a frozen replica would be refused; what is checked here is that each
    // created At runs exactly once.
    let ats: Api<At> = Api::namespaced(client.clone(), NS);
    let first_due = k8s_openapi::jiff::Timestamp::now() + k8s_openapi::jiff::SignedDuration::from_secs(10);
    common::create_ats(&client, NS, scale.ats, first_due, scale.spread).await?;
    // Memcacheds created all along without `spec.size`: the schema's default makes them valid
    // whatever the operator's state, so any refused create (with its time) is a regression.
    let mcs: Api<Memcached> = Api::namespaced(client.clone(), NS);
    let refused: Arc<Mutex<Vec<(Instant, String)>>> = Arc::default();
    let creator = {
        // Untyped: the typed Memcached cannot leave `size` out.
        let resource = kube::core::ApiResource::erase::<Memcached>(&());
        let mcs: Api<kube::core::DynamicObject> = Api::namespaced_with(client.clone(), NS, &resource);
        let refused = refused.clone();
        let n = scale.memcacheds;
        let every = Duration::from_millis(scale.spread * 1000 / n as u64);
        tokio::spawn(async move {
            let mut i = 0;
            let mut last_error = Instant::now() - Duration::from_secs(60);
            while i < n {
                let mc = serde_json::from_value(serde_json::json!({
                    "apiVersion": "cache.example.com/v1", "kind": "Memcached",
                    "metadata": {"name": format!("mc-{i}")}, "spec": {},
                }))
                .expect("a Memcached");
                match mcs.create(&PostParams::default(), &mc).await {
                    Ok(_) => i += 1,
                    Err(kube::Error::Api(s)) if s.code == 409 => i += 1,
                    Err(kube::Error::Api(s)) if s.code == 422 => {
                        lock(&refused).push((Instant::now(), s.message));
                    }
                    // The apiserver is restarting: try again.
                    Err(e) => {
                        if last_error.elapsed() > Duration::from_secs(5) {
                            println!("creating mc-{i}: {e:?}");
                            last_error = Instant::now();
                        }
                    }
                }
                tokio::time::sleep(every).await;
            }
        })
    };
    log(start, "workload started");

    let mut conversion_failures = Vec::new();
    for round in 1..=scale.rounds {
        log(start, &format!("fault round {round}"));
        // 1. The leader frozen for longer than its lease: the standby takes over, and the old
        //    leader, once it runs again, writes nothing and leaves.
        tokio::time::sleep(Duration::from_secs(5)).await;
        let leader = wait_holder(&leases, "", Duration::from_secs(30)).await?;
        let standby = if leader == names[0] { names[1] } else { names[0] };
        let exits_before = lock(&restarts).iter().filter(|r| r.starts_with(&leader)).count();
        let l = replica_index(&replicas, &leader);
        lock(&replicas)[l].signal(Signal::SIGSTOP)?;
        log(start, &format!("SIGSTOP {leader} (leader)"));
        wait_holder(&leases, standby, Duration::from_secs(LEASE_SECONDS + 10)).await?;
        log(start, &format!("{standby} took over"));
        tokio::time::sleep(Duration::from_secs(2)).await;
        lock(&replicas)[l].signal(Signal::SIGCONT)?;
        log(start, &format!("SIGCONT {leader}"));
        wait_restarted(&restarts, &leader, exits_before).await?;

        // 2. The leader killed: the restarted one takes over within the lease.
        let s = replica_index(&replicas, standby);
        lock(&replicas)[s].signal(Signal::SIGKILL)?;
        log(start, &format!("SIGKILL {standby} (leader)"));
        wait_holder(&leases, &leader, Duration::from_secs(LEASE_SECONDS + 10)).await?;
        log(start, &format!("{leader} took over"));

        // 3-5. The apiserver restarted, etcd restarted, etcd compacted.
        tokio::time::sleep(Duration::from_secs(3)).await;
        cp.restart("kube-apiserver").await?;
        log(start, "kube-apiserver restarted");
        wait_holder(&leases, "", Duration::from_secs(30)).await?;
        tokio::time::sleep(Duration::from_secs(3)).await;
        cp.restart("etcd").await?;
        log(start, "etcd restarted");
        wait_holder(&leases, "", Duration::from_secs(30)).await?;
        tokio::time::sleep(Duration::from_secs(3)).await;
        let rev = cp.compact_etcd().await?;
        log(start, &format!("etcd compacted at revision {rev}"));

        // The apiserver frozen for longer than the renew deadline: connections stay open,
        // nothing is answered; the leader must stop writing and give up.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let paused = k8s_openapi::jiff::Timestamp::now();
        cp.pause("kube-apiserver")?;
        log(start, "kube-apiserver paused");
        tokio::time::sleep(Duration::from_secs(LEASE_SECONDS + 4)).await;
        cp.resume("kube-apiserver")?;
        freezes.push(Freeze {
            paused,
            resumed: k8s_openapi::jiff::Timestamp::now(),
        });
        log(start, "kube-apiserver resumed");
        wait_holder(&leases, "", Duration::from_secs(30)).await?;

        // 6. A rolling restart: each replica stopped gracefully and started again, one by one,
        //    while v1 CronTabs are created: each goes through the conversion webhook (to the
        //    stored v2 and back), which must keep answering through the roll.
        //    The CronTabs start once both replicas serve again: after a freeze that cost every
        //    replica the Lease, a replica restarted by the supervisor serves its webhooks only
        //    once it has read the shared certificate, and conversions fail until then (a
        //    limit of exiting on a lost Lease, in docs/reliability.md), which is not the roll.
        for (k, port) in ports.iter().enumerate() {
            wait_serving(names[k], *port).await?;
        }
        let rolled = tokio_util::sync::CancellationToken::new();
        let converter = tokio::spawn(convert_until(client.clone(), round, rolled.clone(), start));
        for name in names {
            tokio::time::sleep(Duration::from_secs(3)).await;
            let i = replica_index(&replicas, name);
            // As a Deployment does (maxUnavailable 1 of 2): a replica is stopped only while
            // the other serves. The other may have just been restarted by the supervisor
            // (leadership lost in the apiserver freeze), and serves only once it has read the
            // shared certificate.
            for (k, port) in ports.iter().enumerate().filter(|(k, _)| *k != i) {
                wait_serving(names[k], *port).await?;
            }
            log(
                start,
                &format!("every other replica serves its webhooks: rolling {name}"),
            );
            // Stopping waits (blocking) for the replica's grace period: off the runtime, whose
            // threads carry the webhook balancer and the apiserver proxies meanwhile (blocked,
            // they would hold the apiserver's requests until the replica is gone).
            let rs = replicas.clone();
            let stopping = tokio::task::spawn_blocking(move || lock(&rs)[i].restart(Duration::from_secs(10)));
            // As a Service does for a terminating Pod: new connections stop going to it once
            // the endpoints controller and kube-proxy have seen it (here after 0.5 s, well
            // within the replica's 5 s grace); it serves the ones it has.
            tokio::time::sleep(Duration::from_millis(500)).await;
            lock(&draining).insert(ports[i]);
            stopping.await??;
            lock(&draining).remove(&ports[i]);
            log(start, &format!("{name} rolled"));
            wait_holder(&leases, "", Duration::from_secs(30)).await?;
        }
        rolled.cancel();
        let (converted, failed) = converter.await?;
        log(
            start,
            &format!(
                "round {round}: {converted} CronTabs converted through the roll, {} failed {:?}",
                failed.len(),
                failed.first()
            ),
        );
        if converted == 0 {
            conversion_failures.push(format!("round {round}: no CronTab was converted during the roll"));
        }
        conversion_failures.extend(
            failed
                .into_iter()
                .map(|e| format!("round {round}: conversion during the roll: {e}")),
        );

        // 7-8. The leader's apiserver connection answers every write with 429 (Retry-After
        //      longer than its renew deadline), then never answers a request on the connections
        //      it had (half-open; new connections work): each time its renewals fail, its gate closes, the other replica
        //      takes over, and no write of the old leader lands after that (audit log).
        for (fault, writes, reads) in [
            (
                "429 on writes",
                Fault::TooManyRequests { retry_after_secs: 5 },
                Fault::Pass,
            ),
            ("half-open connections", Fault::HalfOpen, Fault::HalfOpen),
        ] {
            tokio::time::sleep(Duration::from_secs(3)).await;
            let leader = wait_holder(&leases, "", Duration::from_secs(30)).await?;
            let other = if leader == names[0] { names[1] } else { names[0] };
            let p = &api_proxies[replica_index(&replicas, &leader)];
            let seen = p.faulted();
            p.set(writes, reads);
            log(start, &format!("{fault} for {leader} (leader)"));
            wait_holder(&leases, other, Duration::from_secs(LEASE_SECONDS + 15)).await?;
            log(start, &format!("{other} took over"));
            ensure!(p.faulted() > seen, "the fault never met a request");
            p.set(Fault::Pass, Fault::Pass);
        }

        // 9. The leader's writes (not its renewals) answered 429 with a Retry-After of 8 s, and
        //    the leader frozen in that wait for longer than the Retry-After and its lease: when
        //    it runs again its retries are due at once, but its gate closed meanwhile, so
        //    none may reach the apiserver (audit log) while the other replica leads.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let leader = wait_holder(&leases, "", Duration::from_secs(30)).await?;
        let other = if leader == names[0] { names[1] } else { names[0] };
        let l = replica_index(&replicas, &leader);
        let p = &api_proxies[l];
        let exits_before = lock(&restarts).iter().filter(|r| r.starts_with(&leader)).count();
        let seen = p.faulted();
        p.set_sparing(
            Fault::TooManyRequests { retry_after_secs: 8 },
            Fault::Pass,
            Some("/leases/"),
        );
        wait_for(
            "a write of the leader to be answered 429",
            Duration::from_secs(20),
            || async {
                if p.faulted() > seen {
                    Ok(())
                } else {
                    Err(anyhow!("no write yet"))
                }
            },
        )
        .await?;
        lock(&replicas)[l].signal(Signal::SIGSTOP)?;
        log(start, &format!("SIGSTOP {leader} (leader) waiting out a 429"));
        wait_holder(&leases, other, Duration::from_secs(LEASE_SECONDS + 10)).await?;
        log(start, &format!("{other} took over"));
        p.set(Fault::Pass, Fault::Pass);
        tokio::time::sleep(Duration::from_secs(5)).await;
        lock(&replicas)[l].signal(Signal::SIGCONT)?;
        log(start, &format!("SIGCONT {leader}: its retries are due"));
        wait_restarted(&restarts, &leader, exits_before).await?;
    }

    tokio::time::timeout(Duration::from_secs(scale.spread + 60), creator)
        .await
        .context("creating the Memcacheds did not finish")??;
    log(start, "all objects created");

    // Everything converges: each At ran, each Memcached has its Deployment and Pod.
    let deadline = Duration::from_secs(scale.spread + 120);
    wait_for("every At to be DONE", deadline, || async {
        let list = ats.list(&Default::default()).await?;
        let open: Vec<String> = list
            .items
            .iter()
            .filter(|a| a.status.as_ref().and_then(|s| s.phase) != Some(Phase::Done))
            .map(|a| a.metadata.name.clone().unwrap_or_default())
            .collect();
        if open.is_empty() {
            Ok(())
        } else {
            Err(anyhow!("not DONE: {open:?}"))
        }
    })
    .await?;
    wait_for("every Memcached to converge", deadline, || async {
        let list = mcs.list(&Default::default()).await?;
        ensure!(
            list.items.len() == scale.memcacheds,
            "{} Memcacheds",
            list.items.len()
        );
        let mut open = Vec::new();
        for mc in &list.items {
            let name = mc.metadata.name.clone().unwrap_or_default();
            let nodes = mc.status.as_ref().map_or(0, |s| s.nodes.len());
            let deployed = deployments.get_opt(&name).await?.is_some();
            if !deployed || nodes != 1 {
                open.push(name);
            }
        }
        if open.is_empty() {
            Ok(())
        } else {
            Err(anyhow!("{} not converged: {open:?}", open.len()))
        }
    })
    .await?;
    log(start, "converged");
    // The last fault may have kept every leader from writing for a while: each Eru acts on
    // a slot of its schedule again (checked again below, with the rest).
    wait_for(
        "every Eru to act on a recent slot",
        Duration::from_secs(60),
        || async {
            let recent =
                k8s_openapi::jiff::Timestamp::now() - k8s_openapi::jiff::SignedDuration::from_secs(30);
            let behind: Vec<String> = erus
                .list(&Default::default())
                .await?
                .items
                .into_iter()
                .filter(|e| {
                    e.status
                        .as_ref()
                        .and_then(|s| s.last_schedule_time.as_ref())
                        .is_none_or(|t| t.0 < recent)
                })
                .filter_map(|e| e.metadata.name)
                .collect();
            if behind.is_empty() {
                Ok(())
            } else {
                Err(anyhow!("{} behind: {behind:?}", behind.len()))
            }
        },
    )
    .await?;
    log(start, "every Eru keeps its schedule");
    // Every change of an Eru's Deployment template is one of its restarts (nothing else edits
    // these Deployments), so the Deployment's generation counts the rollouts the Eru caused,
    // collapsed into one ReplicaSet or not: restartCount equals them, lost status writes
    // included. Read while the Erus go on restarting, so a restart between the two reads is
    // retried rather than failed.
    wait_for(
        "every Eru's restartCount to equal its Deployment's template changes",
        Duration::from_secs(30),
        || async {
            let mut off = Vec::new();
            for e in erus.list(&Default::default()).await?.items {
                let status = e.status.clone().unwrap_or_default();
                let count = status.restart_count;
                let d = deployments.get(&e.spec.deployment_name).await?;
                let generation = d.metadata.generation.unwrap_or(1);
                if count != generation - 1 {
                    let stamp = d
                        .spec
                        .as_ref()
                        .and_then(|s| s.template.metadata.as_ref())
                        .and_then(|m| m.annotations.as_ref())
                        .and_then(|a| a.get("kubectl.kubernetes.io/restartedAt").cloned());
                    off.push(format!(
                        "{}: {count} counted, {} made (last slot recorded {:?}, stamp on the Deployment {stamp:?})",
                        e.metadata.name.unwrap_or_default(),
                        generation - 1,
                        status.last_schedule_time.map(|t| t.0.to_string()),
                    ));
                }
            }
            if off.is_empty() {
                Ok(())
            } else {
                Err(anyhow!("{} off: {off:?}", off.len()))
            }
        },
    )
    .await?;
    log(start, "every Eru's restartCount equals its rollouts");

    // The audit log is written before each request is answered (blocking mode): complete.
    supervisor.abort();
    pods_watch.abort();
    proxy_task.abort();
    let audit = read_audit(&cp.dir().join("audit.log"))?;

    let mut failures = conversion_failures;
    for a in ats.list(&Default::default()).await?.items {
        let name = a.metadata.name.clone().unwrap_or_default();
        let pod = format!("{name}-pod");
        let outcome = a.status.as_ref().and_then(|s| s.outcome);
        if outcome != Some(Outcome::Succeeded) {
            failures.push(format!("At {name} ended {outcome:?}: {:?}", a.status));
        }
        // One Pod, ever (one UID in the watch kept open all along), made by at most one create
        // the apiserver answered 201. A create can take effect and still be answered with an
        // error (etcd or the apiserver restarted before the answer): the retry then finds the
        // Pod, so a create answered 201 may be missing, but some create must be in the log.
        let created = common::pod_creates(&audit, &pod, 201);
        let asked = audit
            .iter()
            .filter(|e| {
                e.resource == "pods" && e.subresource.is_empty() && e.verb == "create" && e.name == pod
            })
            .count();
        let seen = lock(&uids).get(&pod).map_or(0, |u| u.len());
        if created > 1 || asked == 0 || seen != 1 {
            failures.push(format!(
                "At {name}: its Pod created {created} times ({asked} creates asked), {seen} UIDs seen"
            ));
        }
    }
    // Erus: each restart is one rollout (one ReplicaSet per slot's stamp), counted once, and
    // the schedule is still kept at the end.
    let replicasets: Api<ReplicaSet> = Api::namespaced(client.clone(), NS);
    let all_rs = replicasets.list(&Default::default()).await?.items;
    let mut eru_restarts = 0;
    let mut redundant = 0;
    // Erus whose ReplicaSets differ from their restartCount: two template changes while
    // the Deployment controller was cut off are one ReplicaSet. Reported, not failed.
    let mut rs_mismatch = 0;
    for e in erus.list(&Default::default()).await?.items {
        let name = e.metadata.name.clone().unwrap_or_default();
        let target = e.spec.deployment_name.clone();
        let status = e.status.clone().unwrap_or_default();
        let stamps: BTreeSet<String> = all_rs
            .iter()
            .filter(|rs| {
                rs.metadata
                    .owner_references
                    .iter()
                    .flatten()
                    .any(|o| o.name == target)
            })
            .filter_map(|rs| {
                rs.spec
                    .as_ref()?
                    .template
                    .as_ref()?
                    .metadata
                    .as_ref()?
                    .annotations
                    .as_ref()?
                    .get("kubectl.kubernetes.io/restartedAt")
                    .cloned()
            })
            .collect();
        let patches = audit
            .iter()
            .filter(|a| {
                a.resource == "deployments"
                    && a.name == target
                    && a.verb == "patch"
                    && a.code == 200
                    && names.iter().any(|n| a.user == user(n))
            })
            .count();
        eru_restarts += status.restart_count;
        redundant += patches.saturating_sub(stamps.len());
        // A restart's stamp is its slot, so one slot can only ever be one rollout; what can go
        // wrong is a count or a restart beyond the schedule.
        let created = e
            .metadata
            .creation_timestamp
            .as_ref()
            .map_or(0, |t| t.0.as_second());
        let slots = (k8s_openapi::jiff::Timestamp::now().as_second() - created) / 10 + 1;
        if status.restart_count > slots {
            failures.push(format!(
                "Eru {name}: restartCount {} but only {slots} slots since it was created",
                status.restart_count
            ));
        }
        if stamps.len() as i64 != status.restart_count {
            rs_mismatch += 1;
        }
        for stamp in &stamps {
            let on_slot = stamp
                .parse::<k8s_openapi::jiff::Timestamp>()
                .is_ok_and(|t| t.as_second() % 10 == 0 && t.subsec_nanosecond() == 0);
            if !on_slot {
                failures.push(format!("Eru {name}: restarted off its schedule ({stamp})"));
            }
        }
        let last = status.last_schedule_time.map(|t| t.0);
        let recent = k8s_openapi::jiff::Timestamp::now() - k8s_openapi::jiff::SignedDuration::from_secs(40);
        if last.is_none_or(|t| t < recent) {
            failures.push(format!(
                "Eru {name}: last slot acted on {last:?}, schedule not kept"
            ));
        }
    }
    log(
        start,
        &format!(
            "Eru restarts: {eru_restarts} over {} Erus, {redundant} redundant same-slot patches, {rs_mismatch} Erus whose restartCount differs from their ReplicaSets",
            scale.erus
        ),
    );
    // No freeze window is excused: no webhook stands between a Memcached and its default.
    let refused = lock(&refused).clone();
    log(start, &format!("admissions failed: {}", refused.len()));
    failures.extend(refused.iter().map(|(t, m)| {
        format!(
            "admission failed at {:.1}s: {m}",
            t.duration_since(start).as_secs_f64()
        )
    }));
    let (bad, late) = writes_while_not_leader(&audit, &names, &freezes);
    log(
        start,
        &format!(
            "writes sent before the apiserver froze and read within {READ_LATE:?} of its resume, after the Lease had passed (no client can take these back): {late:?}"
        ),
    );
    let abandoned: Vec<String> = audit
        .iter()
        .filter(|a| a.code == 504 && a.message.ends_with("context canceled") && is_write(&a.verb))
        .map(|a| {
            format!(
                "{} {} {} {} at {}",
                a.user, a.verb, a.resource, a.name, a.received
            )
        })
        .collect();
    log(
        start,
        &format!(
            "writes the apiserver read only after the replica had given up on them (cancelled, not stored): {abandoned:?}"
        ),
    );
    failures.extend(bad.iter().map(|b| format!("write while not the leader: {b}")));
    let writes: BTreeMap<&str, usize> = names
        .iter()
        .map(|n| {
            let u = user(n);
            (
                *n,
                audit.iter().filter(|a| a.user == u && is_write(&a.verb)).count(),
            )
        })
        .collect();
    log(start, &format!("writes per replica (audit log): {writes:?}"));
    log(start, &format!("replica exits: {:?}", lock(&restarts)));
    ensure!(
        writes.values().all(|w| *w > 0),
        "both replicas should have led at some point: {writes:?}"
    );
    if !failures.is_empty() {
        for r in lock(&replicas).iter() {
            println!("--- {} ---\n{}", r.name, opkit_testenv_tail(&r.log, 40));
        }
    }
    ensure!(failures.is_empty(), "{}", failures.join("\n"));
    Ok(())
}

/// Backends a [`balance`]r sends no new connection to (a Service's terminating endpoints).
type Draining = Arc<Mutex<std::collections::HashSet<u16>>>;

/// A TCP load balancer: each connection goes to the next backend that accepts it and is not
/// draining (any that accepts when all are). A connection no backend accepts is closed, and
/// logged: its client sees `EOF`, as through a Service without a ready endpoint.
async fn balance(listener: tokio::net::TcpListener, backends: Vec<u16>, draining: Draining, start: Instant) {
    let mut next = 0usize;
    loop {
        let Ok((mut inbound, _)) = listener.accept().await else {
            return;
        };
        let first = next;
        next = next.wrapping_add(1);
        let mut order: Vec<u16> = (0..backends.len())
            .map(|k| backends[(first + k) % backends.len()])
            .collect();
        {
            let draining = lock(&draining);
            order.sort_by_key(|p| draining.contains(p));
        }
        tokio::spawn(async move {
            for port in order {
                if let Ok(mut out) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut out).await;
                    return;
                }
            }
            log(start, "webhook balancer: no replica accepted a connection");
        });
    }
}

fn opkit_testenv_tail(path: &Path, n: usize) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = s.lines().filter(|l| !l.contains("DEBUG")).collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

#[test]
fn the_audit_check_finds_a_write_by_a_replica_that_lost_the_lease() {
    let e = |user: &str, verb: &str, resource: &str, received: &str, done: &str| Audited {
        user: format!("system:serviceaccount:{NS}:{user}"),
        verb: verb.into(),
        resource: resource.into(),
        subresource: String::new(),
        group: String::new(),
        name: if resource == "leases" {
            LEASE.into()
        } else {
            "x".into()
        },
        code: 200,
        message: String::new(),
        decision: "allow".into(),
        received: received.into(),
        done: done.into(),
        streams_list: false,
    };
    let mut audit = vec![
        e(
            "opkit-a",
            "create",
            "leases",
            "2026-01-01T00:00:00.000000Z",
            "2026-01-01T00:00:00.100000Z",
        ),
        e(
            "opkit-a",
            "patch",
            "deployments",
            "2026-01-01T00:00:01.000000Z",
            "2026-01-01T00:00:01.100000Z",
        ),
        e(
            "opkit-b",
            "update",
            "leases",
            "2026-01-01T00:00:05.000000Z",
            "2026-01-01T00:00:05.100000Z",
        ),
        e(
            "opkit-b",
            "patch",
            "memcacheds",
            "2026-01-01T00:00:06.000000Z",
            "2026-01-01T00:00:06.100000Z",
        ),
    ];
    assert!(
        writes_while_not_leader(&audit, &["opkit-a", "opkit-b"], &[])
            .0
            .is_empty()
    );
    // opkit-a wakes up after opkit-b took the Lease and writes: found.
    audit.push(e(
        "opkit-a",
        "patch",
        "memcacheds",
        "2026-01-01T00:00:07.000000Z",
        "2026-01-01T00:00:07.100000Z",
    ));
    let (bad, _) = writes_while_not_leader(&audit, &["opkit-a", "opkit-b"], &[]);
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert!(bad[0].contains("opkit-a patch memcacheds"), "{bad:?}");
    // A write sent before the Lease passed, read by the apiserver only after (it was frozen),
    // and abandoned by the replica meanwhile: cancelled, not stored, not counted. A timeout
    // of the apiserver's own may have been stored: counted.
    let mut abandoned = e(
        "opkit-a",
        "patch",
        "ats",
        "2026-01-01T00:00:07.500000Z",
        "2026-01-01T00:00:07.530000Z",
    );
    abandoned.code = 504;
    abandoned.message =
        "Timeout: request did not complete within requested timeout - context canceled".into();
    audit.push(abandoned.clone());
    assert_eq!(
        writes_while_not_leader(&audit, &["opkit-a", "opkit-b"], &[])
            .0
            .len(),
        1
    );
    abandoned.message =
        "Timeout: request did not complete within requested timeout - context deadline exceeded".into();
    audit.push(abandoned);
    assert_eq!(
        writes_while_not_leader(&audit, &["opkit-a", "opkit-b"], &[])
            .0
            .len(),
        2
    );
    audit.pop();
    // Reads and failed Lease writes do not count as leadership or as writes.
    audit.push(e(
        "opkit-a",
        "get",
        "memcacheds",
        "2026-01-01T00:00:08.000000Z",
        "2026-01-01T00:00:08.100000Z",
    ));
    let mut failed = e(
        "opkit-a",
        "update",
        "leases",
        "2026-01-01T00:00:09.000000Z",
        "2026-01-01T00:00:09.100000Z",
    );
    failed.code = 409;
    audit.push(failed);
    audit.push(e(
        "opkit-a",
        "delete",
        "pods",
        "2026-01-01T00:00:10.000000Z",
        "2026-01-01T00:00:10.100000Z",
    ));
    assert_eq!(
        writes_while_not_leader(&audit, &["opkit-a", "opkit-b"], &[])
            .0
            .len(),
        2
    );
    // The apiserver frozen from 00:00:06.5 to 00:00:11 while opkit-b led, and opkit-a took
    // the Lease right as it resumed: opkit-b's writes read within 3 s of the resume were sent
    // before the freeze (reported apart); one read later is not excused, nor is one of
    // opkit-a's (it did not lead when the apiserver froze).
    let freeze = Freeze {
        paused: "2026-01-01T00:00:06.5Z".parse().unwrap(),
        resumed: "2026-01-01T00:00:11Z".parse().unwrap(),
    };
    let mut after = vec![e(
        "opkit-a",
        "update",
        "leases",
        "2026-01-01T00:00:11.000000Z",
        "2026-01-01T00:00:11.010000Z",
    )];
    for (user, at) in [("opkit-b", "11.200000"), ("opkit-b", "14.500000")] {
        after.push(e(
            user,
            "patch",
            "erus",
            &format!("2026-01-01T00:00:{at}Z"),
            &format!("2026-01-01T00:00:{at}Z"),
        ));
    }
    let base = writes_while_not_leader(&audit, &["opkit-a", "opkit-b"], &[freeze]);
    audit.extend(after);
    let (bad, late) = writes_while_not_leader(&audit, &["opkit-a", "opkit-b"], &[freeze]);
    assert_eq!(late.len(), 1, "{late:?}");
    assert!(
        late[0].contains("opkit-b patch erus") && late[0].contains("11.2"),
        "{late:?}"
    );
    assert_eq!(bad.len(), base.0.len() + 1, "{bad:?}");
    assert!(bad.last().unwrap().contains("14.5"), "{bad:?}");
}
