//! `make bench BENCH=fairness`: how long one namespace's burst holds up the others.
//!
//! Per lane: `opkit run --controllers memcached`, then N Memcacheds of size 0 created in one
//! namespace as fast as the apiserver takes them, then — with most of the burst still queued
//! — one Memcached in each of ten other namespaces. Measured for each of the ten, from its
//! creation: until its Deployment exists (opkit's first reconcile: its wait in opkit's queue)
//! and until its status says Available (which also waits for the Deployment controller of
//! kube-controller-manager, whose own queue holds the burst's Deployments); for the burst,
//! until all N Deployments exist and all N statuses are Available (not starved). Lanes:
//! `opkit` (the fair queue, the default) and `opkit-fifo` (`--tune memcached.fair-queue=false`:
//! the work queue alone, first come, first served). `BENCH_REPEAT=K` runs each lane K times, alternating.
//! Writes `target/bench/fairness-n<N>.{md,json}`.
use std::time::{Duration, Instant};

use anyhow::bail;
use futures::future::try_join_all;
use k8s_openapi::api::apps::v1::Deployment;
use kube::Client;
use kube::api::{Api, PostParams};
use kube::core::DynamicObject;
use opkit_testenv::ControlPlane;
use serde_json::{Value, json};

use super::{
    Child, Scenario, Tracker, create_namespace, delete_namespace, env_or, free_ports, identity, in_parallel,
    median, root, stop, wait_ready,
};

/// The namespaces that each get one object during the burst.
const QUIET: usize = 10;

/// The lanes, in the order of the table.
pub(crate) const LANES: [&str; 2] = ["opkit", "opkit-fifo"];

/// One lane's run: seconds per quiet object, and the burst's totals.
struct Outcome {
    lane: &'static str,
    quiet_deployment_s: Vec<f64>,
    quiet_available_s: Vec<f64>,
    burst_deployments_s: f64,
    burst_available_s: f64,
    /// Burst objects whose Deployment existed when the quiet ones were created.
    burst_done_at_quiet: usize,
}

/// Polls the quiet object `name` in `ns`: seconds from `since` until its Deployment exists, and
/// until its status says Available.
async fn follow(admin: Client, ns: String, since: Instant, limit: Duration) -> anyhow::Result<(f64, f64)> {
    let objects: Api<DynamicObject> =
        Api::namespaced_with(admin.clone(), &ns, &Scenario::Memcached.resource());
    let deploys: Api<Deployment> = Api::namespaced(admin, &ns);
    let mut deployment = None;
    loop {
        if deployment.is_none() && deploys.get_opt("quiet").await?.is_some() {
            deployment = Some(since.elapsed().as_secs_f64());
        }
        if let Some(d) = deployment
            && objects
                .get_opt("quiet")
                .await?
                .is_some_and(|o| Scenario::Memcached.converged_size(&o) == 0)
        {
            return Ok((d, since.elapsed().as_secs_f64()));
        }
        if since.elapsed() > limit {
            bail!("{ns}/quiet did not converge within {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn lane(
    cp: &ControlPlane,
    admin: &Client,
    lane: &'static str,
    run: usize,
    n: usize,
) -> anyhow::Result<Outcome> {
    let scenario = Scenario::Memcached;
    let limit = Duration::from_secs(env_or("BENCH_LIMIT_SECONDS", 1800));
    let home = format!("fair-{lane}-{run}");
    create_namespace(admin, &home).await?;
    let (kubeconfig, _) = identity(cp, admin, &format!("{lane}-{run}"), &home).await?;
    let ports = free_ports(1)?;
    let mut children: Vec<Child> = scenario.start(cp, lane, &home, &kubeconfig, &ports)?;
    wait_ready(ports[0].health, Duration::from_secs(60)).await?;
    let burst = format!("burst-{lane}-{run}");
    create_namespace(admin, &burst).await?;
    let quiet: Vec<String> = (0..QUIET).map(|i| format!("quiet-{lane}-{run}-{i}")).collect();
    for ns in &quiet {
        create_namespace(admin, ns).await?;
    }
    let tracker = Tracker::new(admin, scenario, &burst);
    let objects: Api<DynamicObject> = Api::namespaced_with(admin.clone(), &burst, &scenario.resource());
    let t0 = Instant::now();
    in_parallel(n, |i| {
        let objects = objects.clone();
        async move {
            objects
                .create(
                    &PostParams::default(),
                    &scenario.object(&format!("burst-{i}"), 0)?,
                )
                .await?;
            anyhow::Ok(())
        }
    })
    .await?;
    let burst_done_at_quiet = tracker.deployments_at(0);
    let t1 = Instant::now();
    let followed = quiet.iter().map(|ns| {
        let admin = admin.clone();
        let ns = ns.clone();
        async move {
            let api: Api<DynamicObject> = Api::namespaced_with(admin.clone(), &ns, &scenario.resource());
            api.create(&PostParams::default(), &scenario.object("quiet", 0)?)
                .await?;
            follow(admin, ns, t1, limit).await
        }
    });
    let (times, phase) = tokio::try_join!(try_join_all(followed), tracker.converge(n, 0, t0, limit))?;
    stop(&mut children);
    drop(tracker);
    for ns in quiet.iter().chain([&burst, &home]) {
        delete_namespace(admin, ns).await?;
    }
    let out = Outcome {
        lane,
        quiet_deployment_s: times.iter().map(|t| t.0).collect(),
        quiet_available_s: times.iter().map(|t| t.1).collect(),
        burst_deployments_s: phase.deployments.as_secs_f64(),
        burst_available_s: phase.statuses.as_secs_f64(),
        burst_done_at_quiet,
    };
    println!(
        "{lane}: quiet Deployments {:?} s, Available {:?} s; burst {:.1} s / {:.1} s ({} of {n} Deployments when the quiet ones came)",
        rounded(&out.quiet_deployment_s),
        rounded(&out.quiet_available_s),
        out.burst_deployments_s,
        out.burst_available_s,
        out.burst_done_at_quiet,
    );
    Ok(out)
}

fn rounded(v: &[f64]) -> Vec<f64> {
    v.iter().map(|x| (x * 100.0).round() / 100.0).collect()
}

fn max(v: &[f64]) -> f64 {
    v.iter().copied().fold(0.0, f64::max)
}

/// Runs every lane `BENCH_REPEAT` times and writes the table and the JSON.
pub(crate) async fn run(cp: &ControlPlane, admin: &Client, n: usize) -> anyhow::Result<()> {
    let repeat: usize = env_or("BENCH_REPEAT", 1).max(1);
    let mut results = Vec::new();
    for r in 0..repeat {
        for i in 0..LANES.len() {
            let name = LANES[(r + i) % LANES.len()];
            println!("== {name} (run {} of {repeat})", r + 1);
            results.push(lane(cp, admin, name, r, n).await?);
        }
    }
    let mut doc = json!({"n": n, "quiet": QUIET, "lanes": {}});
    let mut table = format!(
        "A burst of {n} Memcacheds in one namespace, then one in each of {QUIET} others; seconds from each quiet object's creation (median and max over them, then over runs).\n\n| lane | quiet: Deployment created | quiet: Available | burst: all Deployments | burst: all Available |\n|---|---|---|---|---|\n"
    );
    for name in LANES {
        let runs: Vec<&Outcome> = results.iter().filter(|o| o.lane == name).collect();
        doc["lanes"][name] = Value::Array(
            runs.iter()
                .map(|o| {
                    json!({
                        "quiet_deployment_s": o.quiet_deployment_s,
                        "quiet_available_s": o.quiet_available_s,
                        "burst_deployments_s": o.burst_deployments_s,
                        "burst_available_s": o.burst_available_s,
                        "burst_done_at_quiet": o.burst_done_at_quiet,
                    })
                })
                .collect(),
        );
        let all = |f: fn(&Outcome) -> &Vec<f64>| runs.iter().flat_map(|o| f(o).clone()).collect::<Vec<f64>>();
        let (dep, avail) = (all(|o| &o.quiet_deployment_s), all(|o| &o.quiet_available_s));
        let burst = |f: fn(&Outcome) -> f64| median(runs.iter().map(|o| f(o)).collect()).unwrap_or(f64::NAN);
        table.push_str(&format!(
            "| {name} | {:.2} (max {:.2}) | {:.2} (max {:.2}) | {:.1} | {:.1} |\n",
            median(dep.clone()).unwrap_or(f64::NAN),
            max(&dep),
            median(avail.clone()).unwrap_or(f64::NAN),
            max(&avail),
            burst(|o| o.burst_deployments_s),
            burst(|o| o.burst_available_s),
        ));
    }
    let out = root().join("target/bench");
    std::fs::create_dir_all(&out)?;
    std::fs::write(
        out.join(format!("fairness-n{n}.json")),
        serde_json::to_string_pretty(&doc)?,
    )?;
    std::fs::write(out.join(format!("fairness-n{n}.md")), &table)?;
    println!("{table}");
    Ok(())
}
