//! `make bench`: the same job done by several contenders (lanes), one after the other, each on
//! a local control plane started for it (`BENCH_SHARED_CONTROL_PLANE=1`: all on one), in a
//! namespace of its own and under its own ServiceAccount.
//!
//! Two scenarios (`BENCH=foo`, the default, or `BENCH=memcached`):
//! - `foo`: N `Foo`s of client-go's sample-controller, each needing a Deployment and
//!   `status.availableReplicas`; lanes `floor`, `go` (the upstream sample-controller with
//!   its defaults) and `opkit` (`opkit run --controllers foo`).
//! - `memcached`: N `Memcached`s of the Operator SDK tutorial, each needing a Deployment of
//!   `spec.size` Pods, `status.nodes` and `Available=True`; lanes `floor`,
//!   `controller-runtime` (the tutorial's operator in Go, `crates/bench/peer-memcached`, as
//!   scaffolded), `controller-runtime-tuned` (the same binary with `--tuned`: 16 concurrent
//!   reconciles, managedFields stripped from its cache) and `opkit`
//!   (`opkit run --controllers memcached`). Every lane writes the Deployment opkit builds.
//!   One more lane runs only when `BENCH_LANES` names it (`BENCH_LANES=opkit,opkit-sharded`):
//!   `opkit-sharded`, the `opkit` lane's binary and flags as `BENCH_SHARDS` (default 3)
//!   processes with `--leader-elect --sharding` (Leases in the lane's namespace, opkit's
//!   default timings), each with its own `POD_NAME` (`shard-<i>`) and ports, the first also
//!   serving the webhooks (among them the one that places new objects as they are created;
//!   their configurations are deleted when the lane ends), all under the lane's one
//!   ServiceAccount, so that its requests and writes are theirs together, Lease
//!   renewals included. Its peak and steady RSS are the largest process's (each one's too:
//!   `peak_rss_per_replica_kib`, `steady_rss_per_replica_kib`), its CPU seconds (busy and
//!   idle) the sum over them. The restart stops all (SIGTERM at once) and starts all at once;
//!   ready is when the last one's `/readyz` answers, which with leader election is as soon as
//!   it serves (a standby is ready), so there its time to react is the number to read.
//!   `opkit-b`, also only when named, runs another build of opkit (the binary
//!   `BENCH_OPKIT_B` names, e.g. a copy of `target/release/opkit` from before a change) as the
//!   `opkit` lane does: a change compared with the code before it in one run, lanes rotated.
//!
//! `floor` is no controller: a small client making exactly the writes the job needs, as fast as
//! the apiserver takes them. Per contender: create N objects → idle → change every size →
//! restart the contender with N converged objects. Measured: time until (a) every Deployment
//! has the right replicas and (b) every object shows a converged status; API requests by verb
//! (apiserver audit log); writes per object; peak and steady RSS; CPU seconds; writes during
//! the idle window; time to ready, time to react and writes after the restart, and the floor
//! under that ready: the lists the restart's caches hold, received by a client that does not
//! decode them (as JSON, and with protobuf for the built-in kinds). Writes
//! `target/bench/<scenario>-n<N>.{md,json,svg}`. It prints numbers and never fails on a
//! threshold.
//!
//! `BENCH=fairness` is a third job, of opkit alone: a burst in one namespace against single
//! objects in ten others, with the fair queue and without (see `fairness.rs`).
//!
//! `BENCH_CREATE_ONLY=1` stops each lane after the idle window (no update, no restart): CPU
//! and peak RSS then cover create and idle only.
//!
//! `BENCH_LANES=a,b` runs some lanes only (the others are kept from an earlier JSON of the same
//! job). `BENCH_REPEAT=K` runs every lane K times, repetition r starting at lane r mod lanes so
//! that no lane always goes first; the table shows medians and (min–max), the JSON every run.
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicI32, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::wait::{await_condition, conditions};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use opkit_testenv::{ControlPlane, Options};
use serde_json::{Value, json};

mod fairness;

/// Requests in flight while the benchmark itself creates or patches objects.
const PARALLEL: usize = 50;

/// Which job the contenders race.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scenario {
    Foo,
    Memcached,
}

impl Scenario {
    fn name(self) -> &'static str {
        match self {
            Scenario::Foo => "foo",
            Scenario::Memcached => "memcached",
        }
    }

    /// Every lane `BENCH_LANES` may name, in the order of the table and the plots.
    fn lanes(self) -> &'static [&'static str] {
        match self {
            Scenario::Foo => &["floor", "go", "opkit"],
            Scenario::Memcached => &[
                "floor",
                "controller-runtime",
                "controller-runtime-tuned",
                "opkit",
                "opkit-sharded",
                "opkit-b",
            ],
        }
    }

    /// The lanes a run without `BENCH_LANES` races: all but `opkit-sharded` and `opkit-b`, so
    /// that `make bench` and the results it wrote before those lanes existed stay as they were.
    fn default_lanes(self) -> impl Iterator<Item = &'static str> {
        self.lanes()
            .iter()
            .copied()
            .filter(|l| !matches!(*l, "opkit-sharded" | "opkit-b"))
    }

    /// The lanes opkit's summary compares with: all but the floor and opkit itself (another
    /// build of opkit, `opkit-b`, is one of them).
    fn peers(self) -> impl Iterator<Item = &'static str> {
        self.lanes()
            .iter()
            .copied()
            .filter(|l| !matches!(*l, "floor" | "opkit" | "opkit-sharded"))
    }

    fn resource(self) -> ApiResource {
        match self {
            Scenario::Foo => ApiResource::from_gvk_with_plural(
                &GroupVersionKind::gvk("samplecontroller.k8s.io", "v1alpha1", "Foo"),
                "foos",
            ),
            Scenario::Memcached => ApiResource::from_gvk_with_plural(
                &GroupVersionKind::gvk("cache.example.com", "v1", "Memcached"),
                "memcacheds",
            ),
        }
    }

    fn crd(self) -> CustomResourceDefinition {
        match self {
            Scenario::Foo => opkit_api::foo::crd(),
            Scenario::Memcached => opkit_api::memcached::crd(),
        }
    }

    fn crd_name(self) -> String {
        let r = self.resource();
        format!("{}.{}", r.plural, r.group)
    }

    fn object(self, name: &str, size: i32) -> anyhow::Result<DynamicObject> {
        let r = self.resource();
        let spec = match self {
            Scenario::Foo => json!({"deploymentName": name, "replicas": size}),
            Scenario::Memcached => json!({"size": size}),
        };
        Ok(serde_json::from_value(json!({
            "apiVersion": r.api_version, "kind": r.kind,
            "metadata": {"name": name}, "spec": spec,
        }))?)
    }

    fn size_patch(self, size: i32) -> Value {
        match self {
            Scenario::Foo => json!({"spec": {"replicas": size}}),
            Scenario::Memcached => json!({"spec": {"size": size}}),
        }
    }

    /// The size an object's status reports as converged to, or -1 while it reports none.
    fn converged_size(self, obj: &DynamicObject) -> i32 {
        let status = &obj.data["status"];
        match self {
            Scenario::Foo => status["availableReplicas"].as_i64().map_or(0, |v| v as i32),
            Scenario::Memcached => {
                let generation = obj.metadata.generation;
                let available = status["conditions"].as_array().is_some_and(|cs| {
                    cs.iter().any(|c| {
                        c["type"] == "Available"
                            && c["status"] == "True"
                            && c["observedGeneration"].as_i64() == generation
                    })
                });
                if available {
                    status["nodes"].as_array().map_or(0, |n| n.len() as i32)
                } else {
                    -1
                }
            }
        }
    }

    /// The Deployment the floor client writes: sample-controller's for a Foo; for a Memcached
    /// the one opkit's controller builds (`opkit_controllers::memcached::build_deployment`,
    /// which `peer-memcached` copies too), so that every lane writes and caches the same child.
    fn deployment_for(self, obj: &DynamicObject) -> anyhow::Result<Deployment> {
        let name = obj.name_any();
        let r = self.resource();
        let mut owner = json!({"apiVersion": r.api_version, "kind": r.kind, "name": name,
            "uid": obj.uid(), "controller": true});
        let (selector, labels, replicas, pod) = match self {
            Scenario::Foo => {
                // sample-controller's `metav1.NewControllerRef`; opkit's owner references omit it.
                owner["blockOwnerDeletion"] = json!(true);
                let labels = json!({"app": "nginx", "controller": name});
                let pod = json!({"containers": [{"name": "nginx", "image": "nginx:latest"}]});
                (labels.clone(), labels, obj.data["spec"]["replicas"].clone(), pod)
            }
            Scenario::Memcached => {
                let selector = json!({"app": "memcached", "memcached_cr": name});
                let labels = json!({"app": "memcached", "memcached_cr": name,
                    "app.kubernetes.io/name": "memcached", "app.kubernetes.io/instance": name,
                    "app.kubernetes.io/managed-by": "floor"});
                let pod = json!({
                    "securityContext": {"runAsNonRoot": true, "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [{"name": "memcached", "image": "memcached:1.6",
                        "command": ["memcached", "-m", "64", "-o", "modern", "-v"],
                        "ports": [{"containerPort": 11211, "name": "memcached", "protocol": "TCP"}],
                        "resources": {"requests": {"cpu": "100m", "memory": "64Mi"},
                            "limits": {"memory": "128Mi"}},
                        "livenessProbe": {"tcpSocket": {"port": 11211},
                            "initialDelaySeconds": 15, "periodSeconds": 20},
                        "securityContext": {"allowPrivilegeEscalation": false,
                            "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": true,
                            "runAsUser": 1001, "readOnlyRootFilesystem": true}}],
                });
                (selector, labels, obj.data["spec"]["size"].clone(), pod)
            }
        };
        Ok(serde_json::from_value(json!({
            "metadata": {"name": name, "labels": labels, "ownerReferences": [owner]},
            "spec": {"replicas": replicas, "selector": {"matchLabels": selector},
                "template": {"metadata": {"labels": labels}, "spec": pod}},
        }))?)
    }

    /// The status the floor writes once `nodes` (Memcached) or `available` (Foo) are there.
    fn floor_status(self, available: i32, nodes: &[String], generation: i64) -> Value {
        let r = self.resource();
        let status = match self {
            Scenario::Foo => json!({"availableReplicas": available}),
            Scenario::Memcached => json!({"nodes": nodes, "conditions": [{
                "type": "Available", "status": "True", "reason": "AllReplicasReady",
                "message": format!("{available}/{available} replicas ready"),
                "observedGeneration": generation,
                "lastTransitionTime": Timestamp::now().to_string(),
            }]}),
        };
        json!({"apiVersion": r.api_version, "kind": r.kind, "status": status})
    }

    /// Starts the contender's processes for `lane`, the i-th serving on `ports[i]` (one port
    /// pair per process: none for the floor, see [`replicas`]).
    fn start(
        self,
        cp: &ControlPlane,
        lane: &str,
        ns: &str,
        kubeconfig: &Path,
        ports: &[Ports],
    ) -> anyhow::Result<Vec<Child>> {
        ports
            .iter()
            .enumerate()
            .map(|(i, p)| self.start_one(cp, lane, ns, kubeconfig, *p, i))
            .collect()
    }

    /// Starts process `i` of the contender for `lane`.
    fn start_one(
        self,
        cp: &ControlPlane,
        lane: &str,
        ns: &str,
        kubeconfig: &Path,
        ports: Ports,
        i: usize,
    ) -> anyhow::Result<Child> {
        let log = if lane == "opkit-sharded" {
            format!("bench-{}-{lane}-{i}.log", self.name())
        } else {
            format!("bench-{}-{lane}.log", self.name())
        };
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(cp.dir().join(log))?;
        let mut cmd = match lane {
            "go" => {
                let mut c = Command::new(cp.binaries().path("sample-controller"));
                c.arg(format!("-kubeconfig={}", kubeconfig.display()));
                c
            }
            "controller-runtime" | "controller-runtime-tuned" => {
                let mut c = Command::new(cp.binaries().path("memcached-peer"));
                c.arg(format!("--kubeconfig={}", kubeconfig.display()));
                c.arg(format!("--health-probe-bind-address={}", ports.health));
                if lane == "controller-runtime-tuned" {
                    c.arg("--tuned");
                }
                c
            }
            "opkit" | "opkit-sharded" | "opkit-fifo" | "opkit-b" => {
                let binary = match lane {
                    "opkit-b" => PathBuf::from(
                        std::env::var("BENCH_OPKIT_B")
                            .context("the opkit-b lane runs the binary BENCH_OPKIT_B names")?,
                    ),
                    _ => root().join("target/release/opkit"),
                };
                let mut c = Command::new(binary);
                c.args(["run", "--controllers", self.name()])
                    .arg("--metrics-bind-address")
                    .arg(ports.metrics.to_string())
                    .arg("--health-probe-bind-address")
                    .arg(ports.health.to_string())
                    .arg("--kubeconfig")
                    .arg(kubeconfig)
                    // For experiments only (e.g. `--concurrency 1`); the published numbers use none.
                    .args(
                        std::env::var("BENCH_OPKIT_ARGS")
                            .unwrap_or_default()
                            .split_whitespace(),
                    );
                if lane == "opkit-fifo" {
                    // The fairness run's baseline: the work queue alone, first come, first served.
                    c.args(["--tune", "memcached.fair-queue=false"]);
                }
                if lane == "opkit-sharded" {
                    // The Lease timings stay opkit's defaults; a replica's member name starts
                    // with its POD_NAME.
                    c.args(["--leader-elect", "--sharding", "--leader-election-namespace", ns])
                        .env("POD_NAME", format!("shard-{i}"));
                    if i == 0 {
                        // The first serves the webhooks, among them the one placing new
                        // objects as they are created (in a cluster, a Service spreads
                        // them over every replica).
                        let url = format!("https://{}", ports.webhook);
                        c.arg("--webhook-bind-address")
                            .arg(ports.webhook.to_string())
                            .args(["--webhook-url", &url]);
                    }
                }
                c
            }
            _ => bail!("lane {lane} runs no process"),
        };
        Ok(cmd.stdout(Stdio::null()).stderr(log).spawn()?)
    }
}

/// How many processes run the contender of `lane`: none for the floor, `BENCH_SHARDS`
/// (default 3) for `opkit-sharded`, else one.
fn replicas(lane: &str) -> usize {
    match lane {
        "floor" => 0,
        "opkit-sharded" => env_or("BENCH_SHARDS", 3).max(1),
        _ => 1,
    }
}

/// Where a contender serves its probes and metrics (if it does).
#[derive(Clone, Copy)]
struct Ports {
    health: SocketAddr,
    metrics: SocketAddr,
    webhook: SocketAddr,
}

#[derive(Default, Clone)]
struct Phase {
    deployments: Duration,
    statuses: Duration,
    /// Until the Deployment controller had observed every Deployment at the size (its
    /// `status.observedGeneration`), whatever the contender waits for.
    observed: Option<Duration>,
    /// (seconds since the phase started, objects converged) at every change.
    timeline: Vec<(f64, usize)>,
}

impl Phase {
    fn report(&self, lane: &str, what: &str, n: usize) {
        println!(
            "{lane}: {what} {n}: Deployments {:.2}s, statuses {:.2}s, observed by the controller-manager {}",
            self.deployments.as_secs_f64(),
            self.statuses.as_secs_f64(),
            self.observed
                .map_or("-".to_string(), |d| format!("{:.2}s", d.as_secs_f64()))
        );
    }
}

#[derive(Default)]
struct Outcome {
    lane: &'static str,
    /// Which repetition (from 1) and where in its order (from 1) this run was.
    repetition: usize,
    position: usize,
    create: Phase,
    update: Phase,
    requests: BTreeMap<String, u64>,
    writes: u64,
    idle_writes: u64,
    /// Of a contender of several processes: the largest process's (each one's below), and the
    /// sum of their CPU seconds.
    peak_rss_kb: Option<u64>,
    steady_rss_kb: Option<u64>,
    cpu_s: Option<f64>,
    idle_cpu_s: Option<f64>,
    /// Each process's peak and steady RSS, when the contender runs more than one.
    peak_rss_per_replica_kb: Vec<u64>,
    steady_rss_per_replica_kb: Vec<u64>,
    /// From the update until the controller-manager had no Deployment or ReplicaSet work left
    /// (the restart waits for it).
    update_caught_up: Option<Duration>,
    /// From the restart until the readiness probe answers 200 (contenders that have one; of
    /// several processes, the last to answer).
    restart_ready: Option<Duration>,
    /// From the restart until an object created at that moment has converged.
    restart_reacts: Option<Duration>,
    restart_writes: Option<u64>,
    restart_requests: BTreeMap<String, u64>,
    /// `BENCH_RESTARTS`: (ready, reacts) of the restarts after the first.
    more_restarts: Vec<(Option<Duration>, Duration)>,
    /// What the restart's caches list, received by a client that only receives, all at once
    /// (the fastest of three tries): as JSON, and with the built-in kinds as protobuf.
    restart_floor: Option<(Duration, Duration)>,
    /// opkit's own view of its caches (`opkit_cache_*` at the end of the idle window; of
    /// several processes, each line after `shard-<i>: `).
    cache_metrics: Vec<String>,
    /// opkit's count of its writes and failed reconciles at the end of its last phase
    /// ([`write_metrics`]).
    write_metrics: Vec<String>,
    /// CPU seconds of each control-plane component (kube-apiserver, etcd, the
    /// controller-manager, ...) from the first create until the controller-manager caught up
    /// with the update: what the contender costs the cluster, not only itself.
    control_plane_cpu_s: BTreeMap<String, f64>,
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

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
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

/// CPU seconds of each control-plane component, by name.
fn cluster_cpu(cp: &ControlPlane) -> BTreeMap<String, f64> {
    cp.pids()
        .into_iter()
        .filter_map(|(name, pid)| Some((name, proc_stats(pid)?.0)))
        .collect()
}

/// [`proc_stats`] of all the processes of a contender: their CPU seconds summed, and each
/// one's current and peak RSS (KiB).
struct Stats {
    cpu_s: f64,
    rss_kb: Vec<u64>,
    peak_kb: Vec<u64>,
}

impl Stats {
    /// None without processes (the floor) or when one of them cannot be read.
    fn of(pids: &[u32]) -> Option<Stats> {
        if pids.is_empty() {
            return None;
        }
        let mut s = Stats {
            cpu_s: 0.0,
            rss_kb: Vec::new(),
            peak_kb: Vec::new(),
        };
        for pid in pids {
            let (cpu, rss, peak) = proc_stats(*pid)?;
            s.cpu_s += cpu;
            s.rss_kb.push(rss);
            s.peak_kb.push(peak);
        }
        Some(s)
    }
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
    let path = cp.dir().join(format!("bench-{lane}.kubeconfig"));
    std::fs::write(
        &path,
        opkit_testenv::kubeconfig_with_token(&cp.kubeconfig_path(), &token)?,
    )?;
    Ok((path, format!("system:serviceaccount:{ns}:{sa}")))
}

type Counts = Arc<Mutex<BTreeMap<String, i32>>>;

/// Watches Deployments and primaries in `ns` and reports when all N reach a size.
struct Tracker {
    start: Instant,
    deployments: Counts,
    /// Each Deployment's replicas once the Deployment controller observed its spec, else -1.
    observed: Counts,
    objects: Counts,
    timeline: Arc<Mutex<Vec<(f64, usize)>>>,
    target: Arc<AtomicI32>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Tracker {
    fn new(admin: &Client, scenario: Scenario, ns: &str) -> Tracker {
        let deployments = Counts::default();
        let observed = Counts::default();
        let objects = Counts::default();
        let timeline = Arc::new(Mutex::new(Vec::new()));
        let target = Arc::new(AtomicI32::new(1));
        let start = Instant::now();
        let d_api: Api<Deployment> = Api::namespaced(admin.clone(), ns);
        let o_api: Api<DynamicObject> = Api::namespaced_with(admin.clone(), ns, &scenario.resource());
        let (d, ob) = (deployments.clone(), observed.clone());
        let t1 = tokio::spawn(async move {
            let mut s = watcher(d_api, watcher::Config::default())
                .applied_objects()
                .boxed();
            while let Some(Ok(dep)) = s.next().await {
                let r = dep.spec.as_ref().and_then(|s| s.replicas).unwrap_or(0);
                let seen = dep.status.as_ref().and_then(|s| s.observed_generation);
                let o = if seen >= dep.metadata.generation { r } else { -1 };
                lock(&d).insert(dep.name_any(), r);
                lock(&ob).insert(dep.name_any(), o);
            }
        });
        let (o, tl, tg) = (objects.clone(), timeline.clone(), target.clone());
        let t2 = tokio::spawn(async move {
            let mut s = watcher(o_api, watcher::Config::default())
                .applied_objects()
                .boxed();
            while let Some(Ok(obj)) = s.next().await {
                let mut m = lock(&o);
                m.insert(obj.name_any(), scenario.converged_size(&obj));
                let want = tg.load(Ordering::SeqCst);
                let done = m.values().filter(|v| **v == want).count();
                lock(&tl).push((start.elapsed().as_secs_f64(), done));
            }
        });
        Tracker {
            start,
            deployments,
            observed,
            objects,
            timeline,
            target,
            tasks: vec![t1, t2],
        }
    }

    /// How many Deployments have `size` replicas now.
    fn deployments_at(&self, size: i32) -> usize {
        lock(&self.deployments).values().filter(|v| **v == size).count()
    }

    /// Waits for (a) and (b) at `size`; times are from `since`.
    async fn converge(&self, n: usize, size: i32, since: Instant, limit: Duration) -> anyhow::Result<Phase> {
        self.target.store(size, Ordering::SeqCst);
        let offset = since.duration_since(self.start).as_secs_f64();
        lock(&self.timeline).clear();
        let count = |m: &Counts| lock(m).values().filter(|v| **v == size).count();
        let mut phase = Phase::default();
        let mut deployments_done = None;
        let mut statuses_done = None;
        loop {
            if deployments_done.is_none() && count(&self.deployments) >= n {
                deployments_done = Some(since.elapsed());
            }
            if phase.observed.is_none() && count(&self.observed) >= n {
                phase.observed = Some(since.elapsed());
            }
            if deployments_done.is_some() && statuses_done.is_none() && count(&self.objects) >= n {
                statuses_done = Some(since.elapsed());
            }
            // The phase ends when the controller-manager has caught up too, so that the next
            // one starts from a quiet cluster whatever the contender waits for.
            if let (Some(d), Some(s), Some(_)) = (deployments_done, statuses_done, phase.observed) {
                phase.deployments = d;
                phase.statuses = s;
                break;
            }
            if since.elapsed() > limit {
                bail!(
                    "not converged after {limit:?}: {} Deployments, {} observed, {} objects at {size}",
                    count(&self.deployments),
                    count(&self.observed),
                    count(&self.objects)
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        phase.timeline = lock(&self.timeline)
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
    namespace: String,
    at: Timestamp,
}

/// Reads the audit log, one entry per request (watches log twice; counted once).
fn audit(path: &Path) -> anyhow::Result<Vec<Request>> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for line in std::fs::read_to_string(path)?.lines() {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
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
            namespace: v["objectRef"]["namespace"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
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

/// The floor under "restart ready": how long a client that decodes nothing takes to receive,
/// all at once, the lists opkit's caches of the lane hold after a restart (the objects, their
/// Deployments and, for Memcached, their Pods' metadata), from the apiserver's watch cache
/// as its streamed lists are. Returns (as JSON, with the built-in kinds as protobuf), each
/// the fastest of three tries; a custom resource is JSON either way.
async fn list_floor(admin: &Client, scenario: Scenario, ns: &str) -> anyhow::Result<(Duration, Duration)> {
    const PB: &str = "application/vnd.kubernetes.protobuf";
    const META: &str = ";as=PartialObjectMetadataList;g=meta.k8s.io;v=v1";
    let r = scenario.resource();
    let primary = format!(
        "/apis/{}/namespaces/{ns}/{}?resourceVersion=0",
        r.api_version, r.plural
    );
    let deployments = format!("/apis/apps/v1/namespaces/{ns}/deployments?resourceVersion=0");
    let pods = format!("/api/v1/namespaces/{ns}/pods?resourceVersion=0");
    let receive = |path: String, accept: String| async move {
        let req = http::Request::get(path)
            .header(http::header::ACCEPT, accept)
            // Uncompressed, as kube's watches ask for them.
            .header(http::header::ACCEPT_ENCODING, "identity")
            .body(kube::client::Body::empty())?;
        let res = admin.send(req).await?;
        anyhow::ensure!(
            res.status().is_success(),
            "listing for the floor: {}",
            res.status()
        );
        anyhow::Ok(res.into_body().collect_bytes().await?.len())
    };
    let mut best = [Duration::MAX; 2];
    for _ in 0..3 {
        for (i, built_in) in ["application/json", PB].into_iter().enumerate() {
            let mut lists = vec![
                receive(primary.clone(), "application/json".into()),
                receive(deployments.clone(), built_in.into()),
            ];
            if scenario == Scenario::Memcached {
                lists.push(receive(pods.clone(), format!("{built_in}{META}")));
            }
            let t = Instant::now();
            futures::future::try_join_all(lists).await?;
            best[i] = best[i].min(t.elapsed());
        }
    }
    Ok((best[0], best[1]))
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

/// Deletes the webhook configurations a contender made (the sharded lane's first replica
/// serves webhooks), so that no later lane's requests are sent to a webhook that is gone.
async fn delete_webhook_configurations(admin: &Client) -> anyhow::Result<()> {
    use k8s_openapi::api::admissionregistration::v1::{
        MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
    };
    let m: Api<MutatingWebhookConfiguration> = Api::all(admin.clone());
    let v: Api<ValidatingWebhookConfiguration> = Api::all(admin.clone());
    let gone = |r: Result<_, kube::Error>| match r {
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Ok(_) => Ok(()),
        Err(e) => Err(e),
    };
    gone(
        m.delete("opkit-mutating-webhook-configuration", &DeleteParams::default())
            .await
            .map(|_| ()),
    )?;
    gone(
        v.delete("opkit-validating-webhook-configuration", &DeleteParams::default())
            .await
            .map(|_| ()),
    )?;
    Ok(())
}

async fn delete_namespace(admin: &Client, ns: &str) -> anyhow::Result<()> {
    let nss: Api<Namespace> = Api::all(admin.clone());
    let uid = nss.get(ns).await?.uid().unwrap_or_default();
    nss.delete(ns, &DeleteParams::background()).await?;
    // Gone for good: a terminating namespace still holds objects a cluster-wide contender sees.
    let gone = await_condition(nss, ns, conditions::is_deleted(&uid));
    tokio::time::timeout(Duration::from_secs(1800), gone).await??;
    Ok(())
}

/// Polls until the object `name` in `ns` and its Deployment have converged to `size`.
async fn wait_converged(
    admin: &Client,
    scenario: Scenario,
    ns: &str,
    name: &str,
    size: i32,
    limit: Duration,
) -> anyhow::Result<Duration> {
    let start = Instant::now();
    let objects: Api<DynamicObject> = Api::namespaced_with(admin.clone(), ns, &scenario.resource());
    let deploys: Api<Deployment> = Api::namespaced(admin.clone(), ns);
    loop {
        let obj = objects.get_opt(name).await?;
        let dep = deploys.get_opt(name).await?;
        let replicas = dep.and_then(|d| d.spec?.replicas);
        if obj.is_some_and(|o| scenario.converged_size(&o) == size) && replicas == Some(size) {
            return Ok(start.elapsed());
        }
        if start.elapsed() > limit {
            bail!("{ns}/{name} did not converge to {size} within {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the contender reconciles: a warm-up object in its own namespace converges
/// (made by the floor client itself in the floor lane, which also warms up its connections).
async fn warm_up(admin: &Client, floor: &Client, scenario: Scenario, lane: &str) -> anyhow::Result<()> {
    let ns = format!("bench-warmup-{lane}");
    create_namespace(admin, &ns).await?;
    let objects: Api<DynamicObject> = Api::namespaced_with(admin.clone(), &ns, &scenario.resource());
    let o = objects
        .create(&PostParams::default(), &scenario.object("warm-up", 1)?)
        .await?;
    if lane == "floor" {
        let d: Api<Deployment> = Api::namespaced(floor.clone(), &ns);
        d.create(&PostParams::default(), &scenario.deployment_for(&o)?)
            .await?;
    } else {
        wait_converged(admin, scenario, &ns, "warm-up", 1, Duration::from_secs(120))
            .await
            .with_context(|| format!("{lane} did not reconcile the warm-up object"))?;
    }
    delete_namespace(admin, &ns).await
}

/// The floor's status writer: writes each object's status as soon as what it reports is there,
/// with as many writes in flight as the benchmark's own requests. Foo: `availableReplicas` from
/// its Deployment; Memcached: the names of its Running Pods once there are `size` of them.
fn floor_status_writer(
    scenario: Scenario,
    floor: &Client,
    ns: &str,
    target: Arc<AtomicI32>,
    generation: Arc<AtomicI64>,
) -> tokio::task::JoinHandle<()> {
    let objects: Api<DynamicObject> = Api::namespaced_with(floor.clone(), ns, &scenario.resource());
    let slots = Arc::new(tokio::sync::Semaphore::new(PARALLEL));
    let write = move |name: String, available: i32, nodes: Vec<String>| {
        let (slots, objects) = (slots.clone(), objects.clone());
        let body = scenario.floor_status(available, &nodes, generation.load(Ordering::SeqCst));
        async move {
            let Ok(slot) = slots.acquire_owned().await else {
                return;
            };
            tokio::spawn(async move {
                let _slot = slot;
                let _ = objects
                    .patch_status(&name, &PatchParams::apply("floor").force(), &Patch::Apply(&body))
                    .await;
            });
        }
    };
    let mut written: BTreeMap<String, i32> = BTreeMap::new();
    match scenario {
        Scenario::Foo => {
            let d_api: Api<Deployment> = Api::namespaced(floor.clone(), ns);
            tokio::spawn(async move {
                let mut s = watcher(d_api, watcher::Config::default())
                    .applied_objects()
                    .boxed();
                while let Some(Ok(d)) = s.next().await {
                    let a = d.status.as_ref().and_then(|s| s.available_replicas).unwrap_or(0);
                    let Some(owner) = d.owner_references().first().map(|o| o.name.clone()) else {
                        continue;
                    };
                    if a == 0 || written.get(&owner) == Some(&a) {
                        continue;
                    }
                    written.insert(owner.clone(), a);
                    write(owner, a, Vec::new()).await;
                }
            })
        }
        Scenario::Memcached => {
            let p_api: Api<Pod> = Api::namespaced(floor.clone(), ns);
            tokio::spawn(async move {
                let mut running: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
                let cfg = watcher::Config::default().labels("app=memcached");
                let mut s = watcher(p_api, cfg).applied_objects().boxed();
                while let Some(Ok(p)) = s.next().await {
                    let Some(owner) = p.labels().get("memcached_cr").cloned() else {
                        continue;
                    };
                    let up = p.metadata.deletion_timestamp.is_none()
                        && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
                    let set = running.entry(owner.clone()).or_default();
                    if up {
                        set.insert(p.name_any());
                    } else {
                        set.remove(&p.name_any());
                    }
                    let count = set.len() as i32;
                    if count != target.load(Ordering::SeqCst) || written.get(&owner) == Some(&count) {
                        continue;
                    }
                    written.insert(owner.clone(), count);
                    let nodes = set.iter().cloned().collect();
                    write(owner, count, nodes).await;
                }
            })
        }
    }
}

/// Sums the requests (by verb) and writes of `user` between `from` and `to`, leaving out the
/// namespaces in `skip`.
fn count_requests(
    requests: &[Request],
    user: &str,
    from: Timestamp,
    to: Timestamp,
    skip: &[&str],
) -> (BTreeMap<String, u64>, u64) {
    let mut by_verb = BTreeMap::new();
    let mut writes = 0;
    for r in requests {
        if r.user != user || r.at < from || r.at > to || skip.contains(&r.namespace.as_str()) {
            continue;
        }
        *by_verb.entry(r.verb.clone()).or_default() += 1;
        if is_write(&r.verb) {
            writes += 1;
        }
    }
    (by_verb, writes)
}

/// Stops a contender's processes the way Kubernetes does (SIGTERM), all at once, and waits
/// for them.
fn stop(children: &mut [Child]) {
    for child in children.iter() {
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
    }
    for child in children {
        let _ = child.wait();
    }
}

/// Probe and metrics addresses for `count` processes, all distinct.
fn free_ports(count: usize) -> anyhow::Result<Vec<Ports>> {
    let mut taken = BTreeSet::new();
    let mut port = || loop {
        let p = opkit_testenv::free_port()?;
        if taken.insert(p) {
            return anyhow::Ok(SocketAddr::from(([127, 0, 0, 1], p)));
        }
    };
    (0..count)
        .map(|_| {
            Ok(Ports {
                health: port()?,
                metrics: port()?,
                webhook: port()?,
            })
        })
        .collect()
}

/// Waits until the controller-manager's Deployment and ReplicaSet queues have been empty, with
/// nothing in progress, on two reads 200 ms apart; returns the time since `since`.
async fn controller_manager_caught_up(
    cp: &ControlPlane,
    since: Instant,
    limit: Duration,
) -> anyhow::Result<Duration> {
    let start = Instant::now();
    let client = cp.controller_manager_client().await?;
    let mut quiet = 0;
    while quiet < 2 {
        quiet = if ControlPlane::controller_manager_backlog(&client).await? <= 0.0 {
            quiet + 1
        } else {
            0
        };
        if start.elapsed() > limit {
            bail!("the controller-manager still had Deployment or ReplicaSet work after {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(since.elapsed())
}

/// Polls a readiness endpoint until it answers 200.
async fn wait_ready(addr: SocketAddr, limit: Duration) -> anyhow::Result<Duration> {
    let start = Instant::now();
    loop {
        if let Ok((200, _)) = opkit_testenv::http_get(addr, "/readyz").await {
            return Ok(start.elapsed());
        }
        if start.elapsed() > limit {
            bail!("{addr}/readyz did not answer 200 within {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The cache lines of opkit's metrics (`opkit_cache_objects`, `opkit_cache_bytes_estimate`).
async fn cache_metrics(addr: SocketAddr) -> Vec<String> {
    opkit_metrics(addr, &["opkit_cache_"]).await
}

/// The lines of opkit's metrics that start with one of `prefixes` (none if it does not answer).
async fn opkit_metrics(addr: SocketAddr, prefixes: &[&str]) -> Vec<String> {
    match opkit_testenv::http_get(addr, "/metrics").await {
        Ok((200, body)) => body
            .lines()
            .filter(|l| prefixes.iter().any(|p| l.starts_with(p)))
            .map(String::from)
            .collect(),
        _ => Vec::new(),
    }
}

/// The lines of every process's metrics that start with one of `prefixes`; of several
/// processes, each line after `shard-<i>: `.
async fn metrics_of(ports: &[Ports], prefixes: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    for (i, p) in ports.iter().enumerate() {
        let lines = opkit_metrics(p.metrics, prefixes).await;
        match ports.len() {
            1 => out.extend(lines),
            _ => out.extend(lines.into_iter().map(|l| format!("shard-{i}: {l}"))),
        }
    }
    out
}

/// What opkit says of its writes at the end of a lane's last phase: those it sent by verb, and
/// its failed reconciles by category (`stale`: a write refused because the plan was made from
/// an older version, which the audit log counts as a write too).
async fn write_metrics(ports: &[Ports]) -> Vec<String> {
    metrics_of(ports, &["opkit_api_writes_total", "opkit_reconcile_errors_total"]).await
}

/// Runs `request(i)` for every i in 0..n, `PARALLEL` at a time, stopping at the first error.
async fn in_parallel<F, Fut>(n: usize, request: F) -> anyhow::Result<()>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    stream::iter(0..n)
        .map(request)
        .buffer_unordered(PARALLEL)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(())
}

struct Run<'a> {
    cp: &'a ControlPlane,
    admin: &'a Client,
    scenario: Scenario,
    n: usize,
    size: i32,
    idle: Duration,
    limit: Duration,
    /// The next lane runs on this control plane too.
    shared: bool,
}

impl Run<'_> {
    async fn lane(&self, lane: &'static str) -> anyhow::Result<Outcome> {
        let (cp, admin, scenario, n, size) = (self.cp, self.admin, self.scenario, self.n, self.size);
        let ns = format!("bench-{lane}");
        delete_webhook_configurations(admin).await?;
        create_namespace(admin, &ns).await?;
        let (kubeconfig, user) = identity(cp, admin, lane, &ns).await?;
        let ports = free_ports(replicas(lane))?;
        let mut children = scenario.start(cp, lane, &ns, &kubeconfig, &ports)?;
        let pids: Vec<u32> = children.iter().map(Child::id).collect();
        let stats = || Stats::of(&pids);
        let per_replica = |v: &[u64]| if v.len() > 1 { v.to_vec() } else { Vec::new() };
        let floor = Client::try_from(opkit_testenv::config_from_file(&kubeconfig).await?)?;
        warm_up(admin, &floor, scenario, lane).await?;
        let tracker = Tracker::new(admin, scenario, &ns);
        let objects: Api<DynamicObject> = Api::namespaced_with(admin.clone(), &ns, &scenario.resource());
        let floor_deploys: Api<Deployment> = Api::namespaced(floor.clone(), &ns);
        let floor_objects: Api<DynamicObject> =
            Api::namespaced_with(floor.clone(), &ns, &scenario.resource());
        let mut out = Outcome {
            lane,
            ..Default::default()
        };
        let window_start = Timestamp::now();
        let audit_log = cp.dir().join("audit.log");
        let name = |i: usize| format!("{}-{i}", scenario.name());

        let target = Arc::new(AtomicI32::new(size));
        let generation = Arc::new(AtomicI64::new(1));
        let status_writer = (lane == "floor")
            .then(|| floor_status_writer(scenario, &floor, &ns, target.clone(), generation.clone()));

        // Create N objects (the floor also creates each Deployment right away, and writes the
        // status of a Memcached of size 0 at once: there is no Pod to wait for).
        let cpu0 = stats();
        let cluster0 = cluster_cpu(cp);
        let t0 = Instant::now();
        in_parallel(n, |i| {
            let (objects, fd, fo) = (objects.clone(), floor_deploys.clone(), floor_objects.clone());
            let name = name(i);
            async move {
                let o = objects
                    .create(&PostParams::default(), &scenario.object(&name, size)?)
                    .await?;
                if lane == "floor" {
                    fd.create(&PostParams::default(), &scenario.deployment_for(&o)?)
                        .await?;
                    if scenario == Scenario::Memcached && size == 0 {
                        let body = scenario.floor_status(0, &[], 1);
                        fo.patch_status(&name, &PatchParams::apply("floor").force(), &Patch::Apply(&body))
                            .await?;
                    }
                }
                anyhow::Ok(())
            }
        })
        .await?;
        out.create = tracker.converge(n, size, t0, self.limit).await?;
        out.create.report(lane, "created", n);
        if ports.len() > 1 {
            // How evenly the objects are spread: each process's cache of them.
            for (i, p) in ports.iter().enumerate() {
                let kind = format!("kind=\"{}\"}}", scenario.resource().kind);
                let line = cache_metrics(p.metrics)
                    .await
                    .into_iter()
                    .find(|l| l.starts_with("opkit_cache_objects{") && l.contains(&kind));
                println!("{lane}: shard-{i} after create: {}", fmt_opt(line));
            }
        }

        // Idle.
        flush_audit(admin, &audit_log, &format!("bench-idle-start-{lane}")).await?;
        let idle_start = Timestamp::now();
        let idle_cpu0 = stats();
        tokio::time::sleep(self.idle).await;
        let idle_cpu1 = stats();
        let idle_end = Timestamp::now();
        if let Some(b) = &idle_cpu1 {
            out.steady_rss_kb = b.rss_kb.iter().copied().max();
            out.steady_rss_per_replica_kb = per_replica(&b.rss_kb);
        }
        if let (Some(a), Some(b)) = (&idle_cpu0, &idle_cpu1) {
            out.idle_cpu_s = Some(b.cpu_s - a.cpu_s);
        }
        if lane.starts_with("opkit") {
            out.cache_metrics = metrics_of(&ports, &["opkit_cache_"]).await;
        }

        if env_or("BENCH_CREATE_ONLY", 0) == 1 {
            // Create and idle only (no update, no restart): for sizes where the update's Pods
            // would take the machine longer than the comparison is worth.
            if let (Some(a), Some(b)) = (cpu0, stats()) {
                out.cpu_s = Some(b.cpu_s - a.cpu_s);
                out.peak_rss_kb = b.peak_kb.iter().copied().max();
                out.peak_rss_per_replica_kb = per_replica(&b.peak_kb);
            }
            if let Some(w) = status_writer {
                w.abort();
            }
            if lane.starts_with("opkit") {
                out.write_metrics = write_metrics(&ports).await;
            }
            stop(&mut children);
            delete_webhook_configurations(admin).await?;
            flush_audit(admin, &audit_log, &format!("bench-end-{lane}")).await?;
            let requests = audit(&audit_log)?;
            (out.requests, out.writes) =
                count_requests(&requests, &user, window_start, Timestamp::now(), &[]);
            let (_, idle_writes) = count_requests(&requests, &user, idle_start, idle_end, &[]);
            out.idle_writes = idle_writes;
            drop(tracker);
            self.clean_up(&[&ns]).await?;
            return Ok(out);
        }
        // Update every object's size by one (the floor also scales each Deployment itself).
        let bigger = size + 1;
        target.store(bigger, Ordering::SeqCst);
        generation.store(2, Ordering::SeqCst);
        let t1 = Instant::now();
        in_parallel(n, |i| {
            let (objects, fd) = (objects.clone(), floor_deploys.clone());
            let name = name(i);
            async move {
                let p = PatchParams::default();
                objects
                    .patch(&name, &p, &Patch::Merge(scenario.size_patch(bigger)))
                    .await?;
                if lane == "floor" {
                    fd.patch(&name, &p, &Patch::Merge(json!({"spec": {"replicas": bigger}})))
                        .await?;
                }
                anyhow::Ok(())
            }
        })
        .await?;
        out.update = tracker.converge(n, bigger, t1, self.limit).await?;
        out.update.report(lane, "updated", n);
        let end = stats();
        if let (Some(a), Some(b)) = (cpu0, end) {
            out.cpu_s = Some(b.cpu_s - a.cpu_s);
            out.peak_rss_kb = b.peak_kb.iter().copied().max();
            out.peak_rss_per_replica_kb = per_replica(&b.peak_kb);
        }
        if let Some(w) = status_writer {
            w.abort();
        }
        if children.is_empty() {
            flush_audit(admin, &audit_log, &format!("bench-end-{lane}")).await?;
            let requests = audit(&audit_log)?;
            (out.requests, out.writes) =
                count_requests(&requests, &user, window_start, Timestamp::now(), &[]);
            drop(tracker);
            self.clean_up(&[&ns]).await?;
            return Ok(out);
        }
        // The controller-manager goes on after the last Deployment's status (each status it
        // writes queues that Deployment once more, and a sync lists the namespace's ReplicaSets
        // and Pods): a Memcached created at the restart would wait behind that, for every lane.
        out.update_caught_up = Some(controller_manager_caught_up(cp, t1, self.limit).await?);
        out.control_plane_cpu_s = cluster_cpu(cp)
            .into_iter()
            .filter_map(|(name, b)| {
                let a = *cluster0.get(&name)?;
                Some((name, b - a))
            })
            .collect();
        println!("{lane}: control-plane CPU s {:?}", out.control_plane_cpu_s);
        println!(
            "{lane}: the controller-manager caught up {:.2}s into the update",
            out.update_caught_up.unwrap_or_default().as_secs_f64()
        );
        if lane.starts_with("opkit") {
            out.write_metrics = write_metrics(&ports).await;
            println!(
                "{lane}: its writes and failed reconciles: {:?}",
                out.write_metrics
            );
        }
        stop(&mut children);
        let stopped = Timestamp::now();
        out.restart_floor = Some(list_floor(admin, scenario, &ns).await?);
        if let Some((json, pb)) = out.restart_floor {
            println!(
                "{lane}: the restart's lists at once, received only: {:.2}s as JSON, {:.2}s with protobuf for the built-in kinds",
                json.as_secs_f64(),
                pb.as_secs_f64()
            );
        }

        // Restart with N converged objects: time to ready, time until a new object (created
        // the moment it starts, in a namespace of its own) converges, and what the resync
        // writes. The restarted process is measured until SETTLE seconds after that. A contender
        // of several processes stops them all at once and starts them all at once again.
        let probe_ns = format!("bench-restart-{lane}");
        create_namespace(admin, &probe_ns).await?;
        flush_audit(admin, &audit_log, &format!("bench-restart-{lane}")).await?;
        let restart_start = Timestamp::now();
        let t2 = Instant::now();
        let mut children = scenario.start(cp, lane, &ns, &kubeconfig, &ports)?;
        let probes: Api<DynamicObject> = Api::namespaced_with(admin.clone(), &probe_ns, &scenario.resource());
        probes
            .create(&PostParams::default(), &scenario.object("probe", bigger)?)
            .await?;
        if lane != "go" {
            let each = ports.iter().map(|p| wait_ready(p.health, self.limit));
            out.restart_ready = futures::future::try_join_all(each).await?.into_iter().max();
        }
        wait_converged(admin, scenario, &probe_ns, "probe", bigger, self.limit).await?;
        out.restart_reacts = Some(t2.elapsed());
        let settle = Duration::from_secs(env_or("BENCH_RESTART_SETTLE_SECONDS", 30));
        tokio::time::sleep(settle).await;
        let restart_end = Timestamp::now();
        // `BENCH_RESTARTS=K`: K-1 more restarts, timed the same way (each with a probe of its
        // own), for the spread of ready / reacts; their requests are not counted.
        for k in 1..env_or("BENCH_RESTARTS", 1usize) {
            stop(&mut children);
            let probe_ns = format!("bench-restart-{lane}-{k}");
            create_namespace(admin, &probe_ns).await?;
            let t = Instant::now();
            children = scenario.start(cp, lane, &ns, &kubeconfig, &ports)?;
            Api::<DynamicObject>::namespaced_with(admin.clone(), &probe_ns, &scenario.resource())
                .create(&PostParams::default(), &scenario.object("probe", bigger)?)
                .await?;
            let mut ready = None;
            if lane != "go" {
                let each = ports.iter().map(|p| wait_ready(p.health, self.limit));
                ready = futures::future::try_join_all(each).await?.into_iter().max();
            }
            wait_converged(admin, scenario, &probe_ns, "probe", bigger, self.limit).await?;
            let reacts = t.elapsed();
            println!(
                "{lane}: restart {}: ready {}, reacted {:.2}s",
                k + 1,
                fmt_opt(ready.map(|d| format!("{:.2}s", d.as_secs_f64()))),
                reacts.as_secs_f64()
            );
            out.more_restarts.push((ready, reacts));
            tokio::time::sleep(settle).await;
            delete_namespace(admin, &probe_ns).await?;
        }
        stop(&mut children);
        delete_webhook_configurations(admin).await?;
        println!(
            "{lane}: restarted with {n}: ready {}, reacted {}",
            fmt_opt(out.restart_ready.map(|d| format!("{:.2}s", d.as_secs_f64()))),
            fmt_opt(out.restart_reacts.map(|d| format!("{:.2}s", d.as_secs_f64())))
        );

        flush_audit(admin, &audit_log, &format!("bench-end-{lane}")).await?;
        let requests = audit(&audit_log)?;
        (out.requests, out.writes) = count_requests(&requests, &user, window_start, stopped, &[]);
        let (_, idle_writes) = count_requests(&requests, &user, idle_start, idle_end, &[]);
        out.idle_writes = idle_writes;
        let (restart_requests, restart_writes) =
            count_requests(&requests, &user, restart_start, restart_end, &[&probe_ns]);
        out.restart_requests = restart_requests;
        out.restart_writes = Some(restart_writes);
        drop(tracker);
        self.clean_up(&[&probe_ns, &ns]).await?;
        Ok(out)
    }

    /// Deletes a lane's namespaces when the next lane runs on the same control plane (else
    /// the control plane goes, and waiting for the garbage collector to delete its tens of
    /// thousands of objects would only take minutes).
    async fn clean_up(&self, namespaces: &[&str]) -> anyhow::Result<()> {
        if self.shared {
            for ns in namespaces {
                delete_namespace(self.admin, ns).await?;
            }
        }
        Ok(())
    }
}

fn fmt_opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map(|v| v.to_string()).unwrap_or_else(|| "–".into())
}

fn mib(kb: Option<u64>) -> Option<f64> {
    kb.map(|k| k as f64 / 1024.0)
}

fn num(v: &Value, fmt: impl Fn(f64) -> String) -> String {
    v.as_f64().map(fmt).unwrap_or_else(|| "–".into())
}

fn verbs_of(v: &Value) -> String {
    v.as_object()
        .map(|m| {
            m.iter()
                .map(|(k, n)| format!("{k} {n}"))
                .collect::<Vec<_>>()
                .join(", ")
        })
        .unwrap_or_default()
}

/// The lanes of a results document, in the scenario's order.
fn lanes_of(doc: &Value, scenario: Scenario) -> Vec<(&'static str, &Value)> {
    scenario
        .lanes()
        .iter()
        .filter_map(|l| Some((*l, doc["lanes"].get(*l)?)))
        .collect()
}

/// ` (min–max)` of `key` over a lane's runs, when they differ at the table's precision.
fn spread(lane: &Value, key: &str, precision: usize) -> String {
    let values: Vec<f64> = lane["runs"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|run| run[key].as_f64())
        .collect();
    if values.len() < 2 {
        return String::new();
    }
    let lo = format!(
        "{:.precision$}",
        values.iter().copied().fold(f64::INFINITY, f64::min)
    );
    let hi = format!(
        "{:.precision$}",
        values.iter().copied().fold(f64::NEG_INFINITY, f64::max)
    );
    if lo == hi {
        return String::new();
    }
    format!(" ({lo}–{hi})")
}

fn runs_of(lane: &Value) -> usize {
    lane["runs"].as_array().map_or(1, Vec::len)
}

fn table(doc: &Value, scenario: Scenario, idle: Duration) -> String {
    let (n, size) = (doc["n"].as_u64().unwrap_or(0), doc["size"].as_i64().unwrap_or(0));
    let mut s = format!(
        "| {} N={n} size {size}→{} | create (a) | create (b) | update (a) | update (b) | requests by verb | writes/object | peak RSS | steady RSS | CPU s | idle {}s: writes / CPU s | restart: ready / reacts | restart: requests by verb |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        scenario.name(),
        size + 1,
        idle.as_secs()
    );
    let lanes = lanes_of(doc, scenario);
    // A lane's median seconds, with the runs' (min–max).
    let secs_of = |r: &Value, k: &str| format!("{}{}", num(&r[k], |x| format!("{x:.2}s")), spread(r, k, 2));
    for (lane, r) in &lanes {
        let secs = |k: &str| secs_of(r, k);
        let mb = |k: &str| num(&r[k], |x| format!("{x:.1} MiB"));
        // A contender of several processes: the largest, then each one's in parentheses.
        let each = |k: &str| match r[k].as_array() {
            Some(v) => format!(
                " (each {})",
                v.iter()
                    .map(|kib| num(kib, |x| format!("{:.1}", x / 1024.0)))
                    .collect::<Vec<_>>()
                    .join(" / ")
            ),
            None => String::new(),
        };
        s.push_str(&format!(
            "| {lane} | {} | {} | {} | {} | {} | {}{} | {}{}{} | {}{} | {}{} | {} / {} | {} / {} | {} |\n",
            secs("create_a_s"),
            secs("create_b_s"),
            secs("update_a_s"),
            secs("update_b_s"),
            verbs_of(&r["requests"]),
            num(&r["writes_per_object"], |x| format!("{x:.2}")),
            spread(r, "writes_per_object", 2),
            mb("peak_rss_mib"),
            spread(r, "peak_rss_mib", 1),
            each("peak_rss_per_replica_kib"),
            mb("steady_rss_mib"),
            each("steady_rss_per_replica_kib"),
            num(&r["cpu_s"], |x| format!("{x:.2}")),
            spread(r, "cpu_s", 2),
            r["idle_writes"],
            num(&r["idle_cpu_s"], |x| format!("{x:.2}")),
            secs("restart_ready_s"),
            secs("restart_reacts_s"),
            if r["restart_writes"].is_null() {
                "–".to_string()
            } else {
                verbs_of(&r["restart_requests"])
            },
        ));
    }
    for (lane, r) in &lanes {
        if let Some(each) = r["peak_rss_per_replica_kib"].as_array() {
            s.push_str(&format!(
                "\n{lane}: {} processes. RSS: the largest process's, each one's in parentheses; CPU s and idle CPU s: their sum; requests and writes: all of them (Lease renewals too).\n",
                each.len()
            ));
        }
    }
    for (lane, r) in &lanes {
        if !r["restart_floor_json_s"].is_null() {
            s.push_str(&format!(
                "\n{lane}: the restart's lists, received only and all at once (no decoding): {} as JSON, {} with protobuf for the built-in kinds.\n",
                secs_of(r, "restart_floor_json_s"),
                secs_of(r, "restart_floor_protobuf_s"),
            ));
        }
    }
    if lanes.iter().any(|(_, r)| runs_of(r) > 1) {
        let runs: Vec<String> = lanes
            .iter()
            .map(|(lane, r)| format!("{lane} {}", runs_of(r)))
            .collect();
        s.push_str(&format!(
            "\nMedians over each lane's runs ({}), the lanes' order rotated between runs; (min–max) of the runs in parentheses.\n",
            runs.join(", ")
        ));
    }
    s
}

/// The numbers of a run; a lane reports the median of each over its runs.
const NUMBERS: [&str; 17] = [
    "create_a_s",
    "create_b_s",
    "create_observed_s",
    "update_a_s",
    "update_b_s",
    "update_observed_s",
    "writes_per_object",
    "peak_rss_mib",
    "steady_rss_mib",
    "cpu_s",
    "idle_writes",
    "idle_cpu_s",
    "restart_ready_s",
    "restart_reacts_s",
    "restart_writes",
    "restart_floor_json_s",
    "restart_floor_protobuf_s",
];

/// The raw numbers of one run of a lane.
fn run_json(r: &Outcome, n: usize) -> Value {
    let secs = |d: Duration| (d.as_secs_f64() * 1000.0).round() / 1000.0;
    let mut run = json!({
        "repetition": r.repetition,
        "position": r.position,
        "create_a_s": secs(r.create.deployments),
        "create_b_s": secs(r.create.statuses),
        "update_a_s": secs(r.update.deployments),
        "update_b_s": secs(r.update.statuses),
        "create_observed_s": r.create.observed.map(secs),
        "update_observed_s": r.update.observed.map(secs),
        "update_caught_up_s": r.update_caught_up.map(secs),
        "writes_per_object": r.writes as f64 / n as f64,
        "peak_rss_mib": mib(r.peak_rss_kb),
        "steady_rss_mib": mib(r.steady_rss_kb),
        "cpu_s": r.cpu_s,
        "idle_writes": r.idle_writes,
        "idle_cpu_s": r.idle_cpu_s,
        "restart_ready_s": r.restart_ready.map(secs),
        "restart_reacts_s": r.restart_reacts.map(secs),
        "restart_writes": r.restart_writes,
        "requests": r.requests,
        "restart_requests": r.restart_requests,
        "restart_floor_json_s": r.restart_floor.map(|(j, _)| secs(j)),
        "restart_floor_protobuf_s": r.restart_floor.map(|(_, p)| secs(p)),
        "more_restarts": r.more_restarts.iter().map(|(ready, reacts)| json!({"ready_s": ready.map(secs), "reacts_s": secs(*reacts)})).collect::<Vec<_>>(),
        "cache_metrics": r.cache_metrics,
        "write_metrics": r.write_metrics,
        "control_plane_cpu_s": r.control_plane_cpu_s,
        "create_timeline": r.create.timeline,
        "update_timeline": r.update.timeline,
    });
    for (key, each) in [
        ("peak_rss_per_replica_kib", &r.peak_rss_per_replica_kb),
        ("steady_rss_per_replica_kib", &r.steady_rss_per_replica_kb),
    ] {
        if !each.is_empty() {
            run[key] = json!(each);
        }
    }
    run
}

/// The median (of an even count, the mean of the middle two).
fn median(mut values: Vec<f64>) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    let m = values.len() / 2;
    match values.len() {
        0 => None,
        l if l % 2 == 1 => Some(values[m]),
        _ => Some((values[m - 1] + values[m]) / 2.0),
    }
}

/// A count as an integer when it is one (the median of two runs may fall between).
fn count_json(x: f64) -> Value {
    if x.fract() == 0.0 && x >= 0.0 {
        json!(x as u64)
    } else {
        json!(x)
    }
}

/// One lane of a results document: the median of every number over its runs (requests per
/// verb too), and the runs themselves.
fn lane_json(runs: Vec<Value>) -> Value {
    let mut lane = serde_json::Map::new();
    for key in NUMBERS {
        let m = median(runs.iter().filter_map(|r| r[key].as_f64()).collect());
        let v = match m {
            None => Value::Null,
            Some(x) if key.ends_with("_writes") => count_json(x),
            // The mean of two middle runs: no more digits than the runs have.
            Some(x) => json!((x * 1000.0).round() / 1000.0),
        };
        lane.insert(key.into(), v);
    }
    for key in ["requests", "restart_requests"] {
        let verbs: BTreeSet<String> = runs
            .iter()
            .filter_map(|r| r[key].as_object())
            .flat_map(|m| m.keys().cloned())
            .collect();
        let by_verb: serde_json::Map<String, Value> = verbs
            .into_iter()
            .map(|verb| {
                let counts = runs.iter().map(|r| r[key][&verb].as_f64().unwrap_or(0.0));
                let m = median(counts.collect()).unwrap_or(0.0);
                (verb, count_json(m))
            })
            .collect();
        lane.insert(key.into(), Value::Object(by_verb));
    }
    // Each process's RSS: of the run whose largest process is nearest the lane's median.
    for (key, of) in [
        ("peak_rss_per_replica_kib", "peak_rss_mib"),
        ("steady_rss_per_replica_kib", "steady_rss_mib"),
    ] {
        let Some(m) = lane[of].as_f64() else { continue };
        let off = |r: &&Value| (r[of].as_f64().unwrap_or(f64::INFINITY) - m).abs();
        let nearest = runs
            .iter()
            .filter(|r| r[key].is_array())
            .min_by(|a, b| off(a).total_cmp(&off(b)));
        if let Some(r) = nearest {
            lane.insert(key.into(), r[key].clone());
        }
    }
    let last = runs.last().map_or(Value::Null, |r| r["cache_metrics"].clone());
    lane.insert("cache_metrics".into(), last);
    lane.insert("runs".into(), Value::Array(runs));
    Value::Object(lane)
}

/// One JSON object per lane, keyed by lane: medians, and every run's raw numbers in `runs`.
fn json_results(results: &[Outcome], scenario: Scenario, n: usize, size: i32) -> Value {
    let lanes: serde_json::Map<String, Value> = scenario
        .lanes()
        .iter()
        .filter_map(|lane| {
            let runs: Vec<Value> = results
                .iter()
                .filter(|r| r.lane == *lane)
                .map(|r| run_json(r, n))
                .collect();
            (!runs.is_empty()).then(|| (lane.to_string(), lane_json(runs)))
        })
        .collect();
    json!({
        "scenario": scenario.name(),
        "n": n,
        "size": size,
        // What every contender must cache at least: the objects, their Deployments and Pods.
        "cached_objects": n * (2 + size as usize),
        "lanes": lanes,
    })
}

/// Axis ticks: about `count` round steps (1, 2 or 5 × 10^k) from 0 to at least `max`.
fn ticks(max: f64, count: usize) -> Vec<f64> {
    let raw = (max / count as f64).max(1e-9);
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    (0..)
        .map(|i| i as f64 * step)
        .take_while(|t| *t <= max * 1.0001)
        .collect()
}

fn tick_label(v: f64) -> String {
    // Steps are 1, 2 or 5 × 10^k: three decimals cover every step down to 0.001.
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// Objects converged over time in one phase, one line per contender: axes with ticks and
/// labels, the legend to the right of the plot area.
fn plot(doc: &Value, scenario: Scenario, phase: &str, title: &str) -> String {
    let n = doc["n"].as_u64().unwrap_or(1) as usize;
    let lanes = lanes_of(doc, scenario);
    let key = format!("{phase}_b_s");
    let done = |r: &Value| r[&key].as_f64().unwrap_or(0.0);
    // Of several runs, the one whose time is nearest the lane's median (JSON written before
    // there were runs keeps its timeline in the lane).
    let timeline = |r: &Value| -> Vec<(f64, usize)> {
        let off = |run: &Value| (run[&key].as_f64().unwrap_or(f64::INFINITY) - done(r)).abs();
        let run = r["runs"]
            .as_array()
            .and_then(|runs| runs.iter().min_by(|a, b| off(a).total_cmp(&off(b))))
            .unwrap_or(r);
        serde_json::from_value(run[format!("{phase}_timeline")].clone()).unwrap_or_default()
    };
    let (w, h) = (900.0, 420.0);
    let (left, right, top, bottom) = (70.0, 240.0, 40.0, 50.0);
    let (pw, ph) = (w - left - right, h - top - bottom);
    let last_t = |r: &Value| timeline(r).last().map_or(0.0, |p| p.0);
    let tmax = lanes
        .iter()
        .map(|(_, r)| done(r).max(last_t(r)))
        .fold(1.0_f64, f64::max)
        * 1.02;
    let xt = ticks(tmax, 8);
    let yt = ticks(n as f64, 5);
    let xmax = *xt.last().unwrap_or(&tmax);
    let xmax = if xmax < tmax { tmax } else { xmax };
    let ymax = (*yt.last().unwrap_or(&(n as f64))).max(n as f64);
    let x = |t: f64| left + t / xmax * pw;
    let y = |c: f64| top + ph - c / ymax * ph;
    let colors = ["#555555", "#00add8", "#dea584", "#9b59b6", "#27ae60"];
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{left}\" y=\"22\" font-size=\"14\">{title}</text>\n"
    );
    for t in &xt {
        s.push_str(&format!(
            "<line x1=\"{0:.1}\" y1=\"{1:.1}\" x2=\"{0:.1}\" y2=\"{2:.1}\" stroke=\"#e5e5e5\"/><line x1=\"{0:.1}\" y1=\"{2:.1}\" x2=\"{0:.1}\" y2=\"{3:.1}\" stroke=\"black\"/><text x=\"{0:.1}\" y=\"{4:.1}\" text-anchor=\"middle\">{5}</text>\n",
            x(*t),
            top,
            top + ph,
            top + ph + 5.0,
            top + ph + 18.0,
            tick_label(*t)
        ));
    }
    for c in &yt {
        s.push_str(&format!(
            "<line x1=\"{0:.1}\" y1=\"{1:.1}\" x2=\"{2:.1}\" y2=\"{1:.1}\" stroke=\"#e5e5e5\"/><line x1=\"{3:.1}\" y1=\"{1:.1}\" x2=\"{0:.1}\" y2=\"{1:.1}\" stroke=\"black\"/><text x=\"{4:.1}\" y=\"{5:.1}\" text-anchor=\"end\">{6}</text>\n",
            left,
            y(*c),
            left + pw,
            left - 5.0,
            left - 8.0,
            y(*c) + 4.0,
            tick_label(*c)
        ));
    }
    s.push_str(&format!(
        "<line x1=\"{left}\" y1=\"{0}\" x2=\"{1}\" y2=\"{0}\" stroke=\"black\"/><line x1=\"{left}\" y1=\"{top}\" x2=\"{left}\" y2=\"{0}\" stroke=\"black\"/>\n<text x=\"{2:.1}\" y=\"{3:.1}\" text-anchor=\"middle\">seconds since the first request of the phase</text>\n<text transform=\"translate(16 {4:.1}) rotate(-90)\" text-anchor=\"middle\">objects converged (of {n})</text>\n",
        top + ph,
        left + pw,
        left + pw / 2.0,
        h - 12.0,
        top + ph / 2.0
    ));
    for (i, (lane, r)) in lanes.iter().enumerate() {
        // At most ~1500 points a line: enough for the eye, small enough to commit.
        let tl = timeline(r);
        let step = tl.len() / 1500 + 1;
        let last = tl.last().copied();
        let pts: Vec<String> = std::iter::once((0.0, 0))
            .chain(tl.into_iter().step_by(step))
            .chain(last)
            .map(|(t, c)| format!("{:.1},{:.1}", x(t), y(c as f64)))
            .collect();
        let color = colors[i % colors.len()];
        let ly = top + 10.0 + 20.0 * i as f64;
        s.push_str(&format!(
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" points=\"{}\"/>\n<line x1=\"{2:.1}\" y1=\"{3:.1}\" x2=\"{4:.1}\" y2=\"{3:.1}\" stroke=\"{color}\" stroke-width=\"3\"/><text x=\"{5:.1}\" y=\"{6:.1}\">{1} ({7:.1} s)</text>\n",
            pts.join(" "),
            lane,
            left + pw + 15.0,
            ly,
            left + pw + 40.0,
            left + pw + 46.0,
            ly + 4.0,
            done(r)
        ));
    }
    s.push_str("</svg>\n");
    s
}

/// RSS per additional cached object, per lane, from this run and another size's JSON.
fn rss_slopes(this: &Value, other: &Value) -> Vec<String> {
    let (Some(a), Some(b)) = (this["cached_objects"].as_f64(), other["cached_objects"].as_f64()) else {
        return Vec::new();
    };
    let Some(lanes) = this["lanes"].as_object() else {
        return Vec::new();
    };
    lanes
        .iter()
        .filter_map(|(lane, v)| {
            let ra = v["steady_rss_mib"].as_f64()?;
            let rb = other["lanes"][lane]["steady_rss_mib"].as_f64()?;
            let per = (ra - rb) * 1024.0 / (a - b);
            Some(format!(
                "{lane}: {per:.2} KiB of steady RSS per cached object ({rb:.1} MiB at {b} objects, {ra:.1} MiB at {a})"
            ))
        })
        .collect()
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let fairness = std::env::var("BENCH").as_deref() == Ok("fairness");
    let scenario = match std::env::var("BENCH").as_deref() {
        Ok("memcached" | "fairness") => Scenario::Memcached,
        Ok("foo") | Err(_) => Scenario::Foo,
        Ok(other) => bail!("BENCH={other}: expected foo, memcached or fairness"),
    };
    let n: usize = env_or("N", if fairness { 10000 } else { 300 });
    // The Memcached scenario: size 1 (a Pod each) up to 1000 objects, size 0 beyond.
    let default_size = if scenario == Scenario::Memcached && n > 1000 {
        0
    } else {
        1
    };
    let size: i32 = env_or("SIZE", default_size);
    let idle = Duration::from_secs(env_or("BENCH_IDLE_SECONDS", 60));
    let opkit = root().join("target/release/opkit");
    if !opkit.exists() {
        bail!(
            "{} is missing: run `cargo build --release -p opkit-operator` (make bench does)",
            opkit.display()
        );
    }
    if std::env::var_os("BENCH_REPLOT").is_some() {
        // Tables and plots again from the JSON of an earlier run (no control plane).
        let stem = format!("{}-n{n}", scenario.name());
        let out = root().join("target/bench");
        let doc: Value = serde_json::from_str(&std::fs::read_to_string(out.join(format!("{stem}.json")))?)?;
        return write_outputs(&doc, scenario, idle, &out, &stem);
    }
    println!("{} N={n} size {size}, idle {}s", scenario.name(), idle.as_secs());
    if scenario == Scenario::Memcached
        && !fairness
        && !opkit_testenv::Binaries::ensure()?.path("memcached-peer").exists()
    {
        bail!(
            "memcached-peer is missing: run `bash crates/testenv/scripts/build-binaries.sh --with-bench` (make bench does)"
        );
    }
    let state_dir = std::env::var("BENCH_STATE_DIR").ok().map(PathBuf::from);
    if fairness {
        let (cp, admin) = control_plane(scenario, state_dir).await?;
        return fairness::run(&cp, &admin, n).await;
    }
    let limit = Duration::from_secs(env_or("BENCH_LIMIT_SECONDS", 1800));
    let only: Option<String> = std::env::var("BENCH_LANES").ok();
    if let Some(unknown) = only
        .iter()
        .flat_map(|o| o.split(','))
        .find(|l| !scenario.lanes().contains(l))
    {
        bail!(
            "BENCH_LANES: no lane {unknown} in {} (lanes: {})",
            scenario.name(),
            scenario.lanes().join(", ")
        );
    }
    let lanes: Vec<&'static str> = match only.as_deref() {
        None => scenario.default_lanes().collect(),
        Some(o) => scenario
            .lanes()
            .iter()
            .copied()
            .filter(|lane| o.split(',').any(|l| l == *lane))
            .collect(),
    };
    if lanes.is_empty() {
        return Err(anyhow!("no lane to run (BENCH_LANES={only:?})"));
    }
    let repeat: usize = env_or("BENCH_REPEAT", 1).max(1);
    let mut results = Vec::new();
    // Each lane gets a control plane of its own, started for it: a lane run after others
    // meets an etcd and an apiserver grown by their objects and was slower for it (5–8 s of a
    // 70 s create at N=10000, whichever build ran second). `BENCH_SHARED_CONTROL_PLANE=1`
    // runs every lane on the first one.
    let shared = std::env::var_os("BENCH_SHARED_CONTROL_PLANE").is_some();
    let mut current = None;
    for r in 0..repeat {
        // Each repetition starts one lane further, so that no lane always runs first or last.
        for i in 0..lanes.len() {
            let lane = lanes[(r + i) % lanes.len()];
            if repeat == 1 {
                println!("== {lane}");
            } else {
                println!("== {lane} (run {} of {repeat})", r + 1);
            }
            let (cp, admin) = match current.take() {
                Some(c) => c,
                None if shared => control_plane(scenario, state_dir.clone()).await?,
                None => {
                    let dir = state_dir.as_ref().map(|d| d.join(format!("{lane}-{}", r + 1)));
                    control_plane(scenario, dir).await?
                }
            };
            let run = Run {
                cp: &cp,
                admin: &admin,
                scenario,
                n,
                size,
                idle,
                limit,
                shared,
            };
            let mut out = run.lane(lane).await.with_context(|| format!("lane {lane}"))?;
            // Kept for the next lane, or stopped here, before the next one starts.
            if shared {
                current = Some((cp, admin));
            }
            (out.repetition, out.position) = (r + 1, i + 1);
            results.push(out);
        }
    }

    let stem = format!("{}-n{n}", scenario.name());
    let out = root().join("target/bench");
    std::fs::create_dir_all(&out)?;
    let json_path = out.join(format!("{stem}.json"));
    let mut doc = json_results(&results, scenario, n, size);
    // A run of some lanes (BENCH_LANES) replaces just those in an earlier run of the same job.
    if only.is_some()
        && let Ok(text) = std::fs::read_to_string(&json_path)
        && let Ok(earlier) = serde_json::from_str::<Value>(&text)
        && earlier["size"] == doc["size"]
        && let Some(lanes) = earlier["lanes"].as_object()
    {
        for (lane, v) in lanes {
            if doc["lanes"].get(lane).is_none() {
                println!(
                    "keeping lane {lane} of the earlier run in {}",
                    json_path.display()
                );
                doc["lanes"][lane] = v.clone();
            }
        }
    }
    std::fs::write(&json_path, serde_json::to_string_pretty(&doc)?)?;
    for r in results.iter().filter(|r| r.repetition == repeat) {
        for l in &r.cache_metrics {
            println!("{}: {l}", r.lane);
        }
    }
    write_outputs(&doc, scenario, idle, &out, &stem)
}

/// A local control plane with an audit log and the scenario's CRD established, and its admin
/// client.
async fn control_plane(
    scenario: Scenario,
    state_dir: Option<PathBuf>,
) -> anyhow::Result<(ControlPlane, Client)> {
    println!("starting a local control plane with an audit log");
    let cp = ControlPlane::start(Options {
        audit_log: true,
        nodes: 4,
        // Keep the audit log and the contenders' logs for a closer look.
        state_dir,
        ..Default::default()
    })
    .await?;
    let admin = cp.client().await?;
    let crds: Api<CustomResourceDefinition> = Api::all(admin.clone());
    crds.patch(
        &scenario.crd_name(),
        &PatchParams::apply("opkit-bench").force(),
        &Patch::Apply(scenario.crd()),
    )
    .await?;
    tokio::time::timeout(
        Duration::from_secs(60),
        await_condition(crds, &scenario.crd_name(), conditions::is_crd_established()),
    )
    .await??;
    Ok((cp, admin))
}

/// The Markdown table, the two plots and the summary lines of a results document.
fn write_outputs(
    doc: &Value,
    scenario: Scenario,
    idle: Duration,
    out: &Path,
    stem: &str,
) -> anyhow::Result<()> {
    let (n, size) = (doc["n"].as_u64().unwrap_or(0), doc["size"].as_i64().unwrap_or(0));
    let md = table(doc, scenario, idle);
    std::fs::write(out.join(format!("{stem}.md")), &md)?;
    let what = match scenario {
        Scenario::Foo => "Foos with status.availableReplicas = replicas",
        Scenario::Memcached => "Memcacheds converged (size nodes, Available=True)",
    };
    for (phase, title) in [
        ("create", format!("{what} after creating {n} of size {size}")),
        (
            "update",
            format!("{what} after changing every size to {}", size + 1),
        ),
    ] {
        std::fs::write(
            out.join(format!("{stem}-{phase}.svg")),
            plot(doc, scenario, phase, &title),
        )?;
    }
    println!("\n{md}");
    let lane = |l: &str| &doc["lanes"][l];
    let ratio = |a: &Value, b: &Value| match (a.as_f64(), b.as_f64()) {
        (Some(a), Some(b)) => format!("{:.2}x", a / b.max(1e-9)),
        _ => "–".into(),
    };
    let ratios = |x: &Value, y: &Value| {
        ["create_a_s", "create_b_s", "update_a_s", "update_b_s"]
            .map(|k| ratio(&x[k], &y[k]))
            .join(" ")
    };
    let (o, f) = (lane("opkit"), lane("floor"));
    let peers: Vec<&str> = scenario.peers().filter(|p| !lane(p).is_null()).collect();
    let per_peer = |what: &dyn Fn(&str) -> String| peers.iter().map(|p| what(p)).collect::<Vec<_>>();
    // Sharded against one replica: the largest replica's peak RSS, the replicas' CPU summed.
    let sh = lane("opkit-sharded");
    let sharded = if sh.is_null() || o.is_null() {
        String::new()
    } else {
        format!(
            "; peak RSS per replica opkit-sharded/opkit {}; CPU opkit-sharded/opkit {}; create (a)/(b) opkit-sharded/opkit {} {}; writes/object opkit-sharded {}",
            ratio(&sh["peak_rss_mib"], &o["peak_rss_mib"]),
            ratio(&sh["cpu_s"], &o["cpu_s"]),
            ratio(&sh["create_a_s"], &o["create_a_s"]),
            ratio(&sh["create_b_s"], &o["create_b_s"]),
            sh["writes_per_object"],
        )
    };
    println!(
        "summary {stem} (create a, b, update a, b): {}; opkit/floor {}; writes/object opkit {} {}; peak RSS {}{sharded}",
        per_peer(&|p| format!("opkit/{p} {}", ratios(o, lane(p)))).join("; "),
        ratios(o, f),
        o["writes_per_object"],
        per_peer(&|p| format!("{p} {}", lane(p)["writes_per_object"])).join(" "),
        per_peer(&|p| format!(
            "opkit/{p} {}",
            ratio(&o["peak_rss_mib"], &lane(p)["peak_rss_mib"])
        ))
        .join(" "),
    );
    // With the other scenario size on record, the cost of one more cached object.
    for other_n in [1000, 10000] {
        let other = out.join(format!("{}-n{other_n}.json", scenario.name()));
        if other_n == n as usize || !other.exists() {
            continue;
        }
        let other: Value = serde_json::from_str(&std::fs::read_to_string(&other)?)?;
        for l in rss_slopes(doc, &other) {
            println!("{l}");
        }
    }
    println!(
        "wrote {} (and .json, -create.svg, -update.svg)",
        out.join(format!("{stem}.md")).display()
    );
    Ok(())
}
