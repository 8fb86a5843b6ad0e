//! `make bench`: the same job — N `Foo`s, each needing a Deployment and a status — done by three
//! contenders on one local control plane, one after the other, each in a fresh namespace and
//! under its own ServiceAccount:
//! - `floor`: a small client making exactly the Deployment creates/updates and status writes
//!   directly, as fast as the apiserver takes them (no controller at all);
//! - `go`: the upstream `k8s.io/sample-controller` binary with its defaults;
//! - `opkit`: `opkit run --controllers foo` with its defaults.
//!
//! Per contender: time until (a) every Deployment exists with the right replicas and (b) every
//! Foo shows `status.availableReplicas == replicas`, after creating N Foos and after changing
//! all their replica counts; API requests by verb (from the apiserver audit log); writes per
//! Foo; peak and steady RSS; CPU seconds; writes and CPU during an idle minute.
//! Writes `target/bench/results.md` and `target/bench/convergence.svg`. It prints numbers and
//! never fails on a threshold.
use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, ServiceAccount};
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::wait::{await_condition, conditions};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use opkit_api::foo::Foo;
use opkit_testenv::{ControlPlane, Options};
use serde_json::json;

/// Requests in flight while the benchmark itself creates or patches Foos.
const PARALLEL: usize = 50;
const LANES: [&str; 3] = ["floor", "go", "opkit"];

#[derive(Default, Clone)]
struct Phase {
    deployments: Duration,
    statuses: Duration,
    /// (seconds since the phase started, Foos converged) at every change.
    timeline: Vec<(f64, usize)>,
}

#[derive(Default)]
struct Outcome {
    lane: &'static str,
    create: Phase,
    update: Phase,
    requests: BTreeMap<String, u64>,
    writes: u64,
    idle_writes: u64,
    peak_rss_kb: Option<u64>,
    steady_rss_kb: Option<u64>,
    cpu_s: Option<f64>,
    idle_cpu_s: Option<f64>,
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// CPU seconds (user + system) and current/peak RSS (KiB) of a process, from /proc.
fn proc_stats(pid: u32) -> Option<(f64, u64, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = after.split_whitespace().collect();
    // Fields 14 and 15 of the whole line are utime and stime; `after` starts at field 3.
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb = |key: &str| -> Option<u64> {
        status
            .lines()
            .find(|l| l.starts_with(key))?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    };
    Some((ticks / 100.0, kb("VmRSS:")?, kb("VmHWM:")?))
}

/// A kubeconfig file authenticating as `bench-<lane>` (cluster-admin, so RBAC is no factor).
async fn identity(
    cp: &ControlPlane,
    admin: &Client,
    lane: &str,
    ns: &str,
) -> anyhow::Result<(PathBuf, String)> {
    let sas: Api<ServiceAccount> = Api::namespaced(admin.clone(), ns);
    let sa = format!("bench-{lane}");
    sas.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": sa}}))?,
    )
    .await?;
    let crbs: Api<ClusterRoleBinding> = Api::all(admin.clone());
    crbs.patch(
        &format!("bench-{lane}"),
        &PatchParams::apply("opkit-bench").force(),
        &Patch::Apply(json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": format!("bench-{lane}")},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}],
        })),
    )
    .await?;
    let tr: TokenRequest =
        serde_json::from_value(json!({"spec": {"audiences": [], "expirationSeconds": 86400}}))?;
    let token = sas
        .create_token_request(&sa, &PostParams::default(), &tr)
        .await?
        .status
        .context("no token")?
        .token;
    let mut kc: serde_yaml::Value = serde_yaml::from_str(&std::fs::read_to_string(cp.kubeconfig_path())?)?;
    kc["users"][0]["user"] = serde_yaml::from_str(&format!("token: {token}"))?;
    let path = cp.dir().join(format!("bench-{lane}.kubeconfig"));
    std::fs::write(&path, serde_yaml::to_string(&kc)?)?;
    Ok((path, format!("system:serviceaccount:{ns}:{sa}")))
}

fn foo(i: usize, replicas: i32) -> anyhow::Result<Foo> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "samplecontroller.k8s.io/v1alpha1", "kind": "Foo",
        "metadata": {"name": format!("foo-{i}")},
        "spec": {"deploymentName": format!("foo-{i}"), "replicas": replicas},
    }))?)
}

/// Upstream's `newDeployment`, as the floor client writes it.
fn deployment_for(f: &Foo) -> anyhow::Result<Deployment> {
    let name = f.name_any();
    Ok(serde_json::from_value(json!({
        "metadata": {"name": f.spec.deployment_name, "labels": {"app": "nginx", "controller": name},
            "ownerReferences": [{"apiVersion": "samplecontroller.k8s.io/v1alpha1", "kind": "Foo",
                "name": name, "uid": f.uid(), "controller": true, "blockOwnerDeletion": true}]},
        "spec": {"replicas": f.spec.replicas,
            "selector": {"matchLabels": {"app": "nginx", "controller": name}},
            "template": {"metadata": {"labels": {"app": "nginx", "controller": name}},
                "spec": {"containers": [{"name": "nginx", "image": "nginx:latest"}]}}},
    }))?)
}

/// Watches Deployments and Foos in `ns` and reports when all N reach `replicas`.
struct Tracker {
    start: Instant,
    deployments: Arc<Mutex<BTreeMap<String, i32>>>,
    foos: Arc<Mutex<BTreeMap<String, i32>>>,
    timeline: Arc<Mutex<Vec<(f64, usize)>>>,
    target: Arc<Mutex<i32>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Tracker {
    fn new(admin: &Client, ns: &str) -> Tracker {
        let deployments = Arc::new(Mutex::new(BTreeMap::new()));
        let foos = Arc::new(Mutex::new(BTreeMap::new()));
        let timeline = Arc::new(Mutex::new(Vec::new()));
        let target = Arc::new(Mutex::new(1));
        let start = Instant::now();
        let d_api: Api<Deployment> = Api::namespaced(admin.clone(), ns);
        let f_api: Api<Foo> = Api::namespaced(admin.clone(), ns);
        let d = deployments.clone();
        let t1 = tokio::spawn(async move {
            let mut s = watcher(d_api, watcher::Config::default())
                .applied_objects()
                .boxed();
            while let Some(Ok(dep)) = s.next().await {
                let r = dep.spec.as_ref().and_then(|s| s.replicas).unwrap_or(0);
                d.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(dep.name_any(), r);
            }
        });
        let (f, tl, tg) = (foos.clone(), timeline.clone(), target.clone());
        let t2 = tokio::spawn(async move {
            let mut s = watcher(f_api, watcher::Config::default())
                .applied_objects()
                .boxed();
            while let Some(Ok(foo)) = s.next().await {
                let a = foo.status.as_ref().map(|s| s.available_replicas).unwrap_or(0);
                let mut m = f.lock().unwrap_or_else(|e| e.into_inner());
                m.insert(foo.name_any(), a);
                let want = *tg.lock().unwrap_or_else(|e| e.into_inner());
                let done = m.values().filter(|v| **v == want).count();
                tl.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push((start.elapsed().as_secs_f64(), done));
            }
        });
        Tracker {
            start,
            deployments,
            foos,
            timeline,
            target,
            tasks: vec![t1, t2],
        }
    }

    /// Waits for (a) and (b) at `replicas`; times are from `since`.
    async fn converge(
        &self,
        n: usize,
        replicas: i32,
        since: Instant,
        limit: Duration,
    ) -> anyhow::Result<Phase> {
        *self.target.lock().unwrap_or_else(|e| e.into_inner()) = replicas;
        let offset = since.duration_since(self.start).as_secs_f64();
        self.timeline.lock().unwrap_or_else(|e| e.into_inner()).clear();
        let count = |m: &Arc<Mutex<BTreeMap<String, i32>>>| {
            m.lock()
                .unwrap_or_else(|e| e.into_inner())
                .values()
                .filter(|v| **v == replicas)
                .count()
        };
        let mut phase = Phase::default();
        let mut deployments_done = None;
        loop {
            if deployments_done.is_none() && count(&self.deployments) >= n {
                deployments_done = Some(since.elapsed());
            }
            if let Some(d) = deployments_done
                && count(&self.foos) >= n
            {
                phase.deployments = d;
                phase.statuses = since.elapsed();
                break;
            }
            if since.elapsed() > limit {
                bail!(
                    "not converged after {limit:?}: {} Deployments, {} Foos at {replicas}",
                    count(&self.deployments),
                    count(&self.foos)
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        phase.timeline = self
            .timeline
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(t, c)| (t - offset, *c))
            .filter(|(t, _)| *t >= 0.0)
            .collect();
        Ok(phase)
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// One audit event, reduced to what the benchmark counts.
struct Request {
    user: String,
    verb: String,
    at: Timestamp,
}

/// Reads the audit log, one entry per request (watches log twice; counted once).
fn audit(path: &Path) -> anyhow::Result<Vec<Request>> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for line in std::fs::read_to_string(path)?.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let id = v["auditID"].as_str().unwrap_or_default().to_string();
        if !seen.insert(id) {
            continue;
        }
        let Some(at) = v["requestReceivedTimestamp"]
            .as_str()
            .and_then(|t| t.parse().ok())
        else {
            continue;
        };
        out.push(Request {
            user: v["user"]["username"].as_str().unwrap_or_default().to_string(),
            verb: v["verb"].as_str().unwrap_or_default().to_string(),
            at,
        });
    }
    Ok(out)
}

/// Waits until the audit log has caught up (it is written in batches): makes a marker request
/// and polls until it appears.
async fn flush_audit(admin: &Client, path: &Path, marker: &str) -> anyhow::Result<()> {
    let cms: Api<ConfigMap> = Api::namespaced(admin.clone(), "default");
    let _ = cms.get_opt(marker).await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if std::fs::read_to_string(path)?.contains(marker) {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    bail!("the audit log did not record {marker} within 30 s")
}

fn is_write(verb: &str) -> bool {
    matches!(
        verb,
        "create" | "update" | "patch" | "delete" | "deletecollection"
    )
}

/// Starts the contender process for `lane` (none for the floor).
fn start_contender(cp: &ControlPlane, lane: &str, kubeconfig: &Path) -> anyhow::Result<Option<Child>> {
    let log = std::fs::File::create(cp.dir().join(format!("bench-{lane}.log")))?;
    let child = match lane {
        "go" => Command::new(cp.binaries().path("sample-controller"))
            .arg(format!("-kubeconfig={}", kubeconfig.display()))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()?,
        "opkit" => Command::new(root().join("target/release/opkit"))
            .args(["run", "--controllers", "foo", "--metrics-bind-address", "0"])
            .args(["--health-probe-bind-address", "0", "--kubeconfig"])
            .arg(kubeconfig)
            // For experiments only (e.g. `--concurrency 1`); the published numbers use none.
            .args(
                std::env::var("BENCH_OPKIT_ARGS")
                    .unwrap_or_default()
                    .split_whitespace(),
            )
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()?,
        _ => return Ok(None),
    };
    Ok(Some(child))
}

async fn create_namespace(admin: &Client, ns: &str) -> anyhow::Result<()> {
    let nss: Api<Namespace> = Api::all(admin.clone());
    nss.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": ns}}))?,
    )
    .await?;
    Ok(())
}

async fn delete_namespace(admin: &Client, ns: &str) -> anyhow::Result<()> {
    let nss: Api<Namespace> = Api::all(admin.clone());
    let uid = nss.get(ns).await?.uid().unwrap_or_default();
    nss.delete(ns, &DeleteParams::background()).await?;
    // Gone for good: a terminating namespace still holds Foos a cluster-wide contender would see.
    let gone = await_condition(nss, ns, conditions::is_deleted(&uid));
    tokio::time::timeout(Duration::from_secs(600), gone).await??;
    Ok(())
}

/// Waits until the contender reconciles: a warm-up Foo in its own namespace gets a Deployment
/// (made by the floor client itself in the floor lane, which also warms up its connections).
async fn warm_up(admin: &Client, floor: &Client, lane: &str) -> anyhow::Result<()> {
    let ns = format!("bench-warmup-{lane}");
    create_namespace(admin, &ns).await?;
    let foos: Api<Foo> = Api::namespaced(admin.clone(), &ns);
    let f = foos.create(&PostParams::default(), &foo(0, 1)?).await?;
    if lane == "floor" {
        let d: Api<Deployment> = Api::namespaced(floor.clone(), &ns);
        d.create(&PostParams::default(), &deployment_for(&f)?).await?;
    }
    let deploys: Api<Deployment> = Api::namespaced(admin.clone(), &ns);
    let deadline = Instant::now() + Duration::from_secs(120);
    while deploys.get_opt("foo-0").await?.is_none() {
        if Instant::now() > deadline {
            bail!("{lane} did not create the warm-up Deployment within 120 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    delete_namespace(admin, &ns).await
}

async fn run_lane(
    cp: &ControlPlane,
    admin: &Client,
    lane: &'static str,
    n: usize,
    idle: Duration,
) -> anyhow::Result<Outcome> {
    let ns = format!("bench-{lane}");
    create_namespace(admin, &ns).await?;
    let (kubeconfig, user) = identity(cp, admin, lane, &ns).await?;
    let mut child = start_contender(cp, lane, &kubeconfig)?;
    let pid = child.as_ref().map(|c| c.id());
    let floor = Client::try_from(opkit_testenv::config_from_file(&kubeconfig).await?)?;
    warm_up(admin, &floor, lane).await?;
    let tracker = Tracker::new(admin, &ns);
    let foos: Api<Foo> = Api::namespaced(admin.clone(), &ns);
    let floor_deploys: Api<Deployment> = Api::namespaced(floor.clone(), &ns);
    let floor_foos: Api<Foo> = Api::namespaced(floor.clone(), &ns);
    let mut out = Outcome {
        lane,
        ..Default::default()
    };
    let limit = Duration::from_secs(env_or("BENCH_LIMIT_SECONDS", 1800));
    let window_start = Timestamp::now();

    // The floor's status writer: mirrors availableReplicas as soon as a Deployment reports it,
    // with as many writes in flight as the benchmark's own requests.
    let status_writer = (lane == "floor").then(|| {
        let (d_api, f_api) = (floor_deploys.clone(), floor_foos.clone());
        tokio::spawn(async move {
            let slots = Arc::new(tokio::sync::Semaphore::new(PARALLEL));
            let mut written: BTreeMap<String, i32> = BTreeMap::new();
            let mut s = watcher(d_api, watcher::Config::default()).applied_objects().boxed();
            while let Some(Ok(d)) = s.next().await {
                let a = d.status.as_ref().and_then(|s| s.available_replicas).unwrap_or(0);
                let Some(owner) = d.owner_references().first().map(|o| o.name.clone()) else { continue };
                if a == 0 || written.get(&owner) == Some(&a) {
                    continue;
                }
                written.insert(owner.clone(), a);
                let Ok(slot) = slots.clone().acquire_owned().await else { return };
                let f_api = f_api.clone();
                tokio::spawn(async move {
                    let _slot = slot;
                    let body = json!({"apiVersion": "samplecontroller.k8s.io/v1alpha1", "kind": "Foo", "status": {"availableReplicas": a}});
                    let _ = f_api
                        .patch_status(&owner, &PatchParams::apply("floor").force(), &Patch::Apply(&body))
                        .await;
                });
            }
        })
    });

    // Create N Foos (the floor also creates each Deployment right away).
    let cpu0 = pid.and_then(proc_stats);
    let t0 = Instant::now();
    stream::iter(0..n)
        .map(|i| {
            let (foos, fd) = (foos.clone(), floor_deploys.clone());
            async move {
                let f = foos.create(&PostParams::default(), &foo(i, 1)?).await?;
                if lane == "floor" {
                    fd.create(&PostParams::default(), &deployment_for(&f)?).await?;
                }
                anyhow::Ok(())
            }
        })
        .buffer_unordered(PARALLEL)
        .try_collect::<Vec<_>>()
        .await?;
    out.create = tracker.converge(n, 1, t0, limit).await?;
    println!(
        "{lane}: created {n}: Deployments {:.2}s, statuses {:.2}s",
        out.create.deployments.as_secs_f64(),
        out.create.statuses.as_secs_f64()
    );

    // Idle.
    flush_audit(
        admin,
        &cp.dir().join("audit.log"),
        &format!("bench-idle-start-{lane}"),
    )
    .await?;
    let idle_start = Timestamp::now();
    let idle_cpu0 = pid.and_then(proc_stats);
    tokio::time::sleep(idle).await;
    let idle_cpu1 = pid.and_then(proc_stats);
    let idle_end = Timestamp::now();
    out.steady_rss_kb = idle_cpu1.map(|s| s.1);
    if let (Some(a), Some(b)) = (idle_cpu0, idle_cpu1) {
        out.idle_cpu_s = Some(b.0 - a.0);
    }

    // Update every Foo's replicas to 2 (the floor also scales each Deployment itself).
    let t1 = Instant::now();
    stream::iter(0..n)
        .map(|i| {
            let (foos, fd) = (foos.clone(), floor_deploys.clone());
            async move {
                let name = format!("foo-{i}");
                foos.patch(
                    &name,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"replicas": 2}})),
                )
                .await?;
                if lane == "floor" {
                    fd.patch(
                        &name,
                        &PatchParams::default(),
                        &Patch::Merge(json!({"spec": {"replicas": 2}})),
                    )
                    .await?;
                }
                anyhow::Ok(())
            }
        })
        .buffer_unordered(PARALLEL)
        .try_collect::<Vec<_>>()
        .await?;
    out.update = tracker.converge(n, 2, t1, limit).await?;
    println!(
        "{lane}: updated {n}: Deployments {:.2}s, statuses {:.2}s",
        out.update.deployments.as_secs_f64(),
        out.update.statuses.as_secs_f64()
    );

    let end = pid.and_then(proc_stats);
    if let (Some(a), Some(b)) = (cpu0, end) {
        out.cpu_s = Some(b.0 - a.0);
        out.peak_rss_kb = Some(b.2);
    }
    if let Some(w) = status_writer {
        w.abort();
    }
    if let Some(c) = child.as_mut() {
        let _ = Command::new("kill").args(["-TERM", &c.id().to_string()]).status();
        let _ = c.wait();
    }
    flush_audit(admin, &cp.dir().join("audit.log"), &format!("bench-end-{lane}")).await?;
    for r in audit(&cp.dir().join("audit.log"))? {
        if r.user != user || r.at < window_start {
            continue;
        }
        *out.requests.entry(r.verb.clone()).or_default() += 1;
        if is_write(&r.verb) {
            out.writes += 1;
            if r.at >= idle_start && r.at <= idle_end {
                out.idle_writes += 1;
            }
        }
    }
    drop(tracker);
    delete_namespace(admin, &ns).await?;
    Ok(out)
}

fn fmt_opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map(|v| v.to_string()).unwrap_or_else(|| "–".into())
}

fn table(results: &[Outcome], n: usize, idle: Duration) -> String {
    let mut s = format!(
        "| N={n} | create: Deployments (a) | create: statuses (b) | update: Deployments (a) | update: statuses (b) | requests by verb | writes/Foo | peak RSS | steady RSS | CPU s | idle {}s: writes / CPU s |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
        idle.as_secs()
    );
    for r in results {
        let verbs = r
            .requests
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ");
        s.push_str(&format!(
            "| {} | {:.2}s | {:.2}s | {:.2}s | {:.2}s | {} | {:.2} | {} | {} | {} | {} / {} |\n",
            r.lane,
            r.create.deployments.as_secs_f64(),
            r.create.statuses.as_secs_f64(),
            r.update.deployments.as_secs_f64(),
            r.update.statuses.as_secs_f64(),
            verbs,
            r.writes as f64 / n as f64,
            fmt_opt(r.peak_rss_kb.map(|k| format!("{:.1} MiB", k as f64 / 1024.0))),
            fmt_opt(r.steady_rss_kb.map(|k| format!("{:.1} MiB", k as f64 / 1024.0))),
            fmt_opt(r.cpu_s.map(|c| format!("{c:.2}"))),
            r.idle_writes,
            fmt_opt(r.idle_cpu_s.map(|c| format!("{c:.2}"))),
        ));
    }
    s
}

/// Converged Foos over time in the create phase, one line per contender.
fn plot(results: &[Outcome], n: usize) -> String {
    let (w, h, pad) = (720.0, 400.0, 50.0);
    let tmax = results
        .iter()
        .map(|r| r.create.statuses.as_secs_f64())
        .fold(1.0_f64, f64::max);
    let colors = ["#888888", "#00add8", "#dea584"];
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    s.push_str(&format!(
        "<text x=\"{pad}\" y=\"20\">Foos with status.availableReplicas = replicas after creating {n} (x: seconds, 0–{tmax:.1})</text>\n<line x1=\"{pad}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n<line x1=\"{pad}\" y1=\"{pad}\" x2=\"{pad}\" y2=\"{}\" stroke=\"black\"/>\n",
        h - pad,
        w - pad,
        h - pad,
        h - pad
    ));
    for (i, r) in results.iter().enumerate() {
        let pts: Vec<String> = std::iter::once((0.0, 0))
            .chain(r.create.timeline.iter().copied())
            .map(|(t, c)| {
                let x = pad + (t / tmax) * (w - 2.0 * pad);
                let y = (h - pad) - (c as f64 / n as f64) * (h - 2.0 * pad);
                format!("{x:.1},{y:.1}")
            })
            .collect();
        let color = colors[i % colors.len()];
        s.push_str(&format!(
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" points=\"{}\"/>\n<text x=\"{}\" y=\"{}\" fill=\"{color}\">{}</text>\n",
            pts.join(" "),
            w - pad - 80.0,
            pad + 20.0 + 16.0 * i as f64,
            r.lane
        ));
    }
    s.push_str("</svg>\n");
    s
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let n: usize = env_or("N", 300);
    let idle = Duration::from_secs(env_or("BENCH_IDLE_SECONDS", 60));
    let opkit = root().join("target/release/opkit");
    if !opkit.exists() {
        bail!(
            "{} is missing: run `cargo build --release -p opkit-operator` (make bench does)",
            opkit.display()
        );
    }
    println!(
        "starting a local control plane with an audit log (N={n}, idle {}s)",
        idle.as_secs()
    );
    let cp = ControlPlane::start(Options {
        audit_log: true,
        nodes: 4,
        // Keep the audit log and the contenders' logs for a closer look.
        state_dir: std::env::var("BENCH_STATE_DIR").ok().map(PathBuf::from),
        ..Default::default()
    })
    .await?;
    let admin = cp.client().await?;
    let crds: Api<CustomResourceDefinition> = Api::all(admin.clone());
    crds.patch(
        "foos.samplecontroller.k8s.io",
        &PatchParams::apply("opkit-bench").force(),
        &Patch::Apply(opkit_api::foo::crd()),
    )
    .await?;
    tokio::time::timeout(
        Duration::from_secs(60),
        await_condition(
            crds,
            "foos.samplecontroller.k8s.io",
            conditions::is_crd_established(),
        ),
    )
    .await??;

    let only: Option<String> = std::env::var("BENCH_LANES").ok();
    let mut results = Vec::new();
    for lane in LANES {
        if only.as_deref().is_some_and(|o| !o.split(',').any(|l| l == lane)) {
            continue;
        }
        println!("== {lane}");
        results.push(
            run_lane(&cp, &admin, lane, n, idle)
                .await
                .with_context(|| format!("lane {lane}"))?,
        );
    }

    let md = table(&results, n, idle);
    let out = root().join("target/bench");
    std::fs::create_dir_all(&out)?;
    std::fs::write(out.join(format!("results-n{n}.md")), &md)?;
    std::fs::write(out.join(format!("convergence-n{n}.svg")), plot(&results, n))?;
    println!("\n{md}");
    let get = |l: &str| results.iter().find(|r| r.lane == l);
    if let (Some(o), Some(g), Some(f)) = (get("opkit"), get("go"), get("floor")) {
        let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64().max(1e-9);
        println!(
            "summary N={n}: opkit/go create (a) {:.2}x (b) {:.2}x, update (a) {:.2}x (b) {:.2}x; opkit/floor create (a) {:.2}x (b) {:.2}x; writes/Foo opkit {:.2} go {:.2}; peak RSS opkit/go {}",
            ratio(o.create.deployments, g.create.deployments),
            ratio(o.create.statuses, g.create.statuses),
            ratio(o.update.deployments, g.update.deployments),
            ratio(o.update.statuses, g.update.statuses),
            ratio(o.create.deployments, f.create.deployments),
            ratio(o.create.statuses, f.create.statuses),
            o.writes as f64 / n as f64,
            g.writes as f64 / n as f64,
            match (o.peak_rss_kb, g.peak_rss_kb) {
                (Some(a), Some(b)) => format!("{:.2}", a as f64 / b as f64),
                _ => "–".into(),
            }
        );
    }
    println!(
        "wrote {} and the plot next to it",
        out.join(format!("results-n{n}.md")).display()
    );
    if results.is_empty() {
        return Err(anyhow!("no lane ran (BENCH_LANES={only:?})"));
    }
    Ok(())
}
