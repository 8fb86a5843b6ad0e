//! Leader election with real `opkit` processes: one leads, a standby takes over after a crash
//! within the lease duration, and at once after a graceful stop.
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, ensure};
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use kube::api::PostParams;
use opkit_api::memcached::Memcached;
use opkit_testenv::{http_get, shared, wait_for};

mod common;
use common::free_port;

const LEASE_SECONDS: u64 = 4;

/// A child `opkit run --leader-elect`; killed on drop.
struct Replica {
    name: &'static str,
    child: Child,
    metrics: u16,
    health: u16,
    log: std::path::PathBuf,
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn replica(name: &'static str, ns: &str) -> anyhow::Result<Replica> {
    let (metrics, health) = (free_port()?, free_port()?);
    let log = std::env::temp_dir().join(format!("opkit-leader-{ns}-{name}.log"));
    let child = Command::new(env!("CARGO_BIN_EXE_opkit"))
        .args([
            "run",
            "--controllers",
            "memcached",
            "--namespace",
            ns,
            "--leader-elect",
        ])
        .args(["--leader-election-namespace", ns])
        .args(["--leader-elect-lease-duration", &LEASE_SECONDS.to_string()])
        .args([
            "--leader-elect-renew-deadline",
            "3",
            "--leader-elect-retry-period",
            "1",
        ])
        .args(["--metrics-bind-address", &format!("127.0.0.1:{metrics}")])
        .args(["--health-probe-bind-address", &format!("127.0.0.1:{health}")])
        .env("KUBECONFIG", shared().kubeconfig())
        .env("POD_NAME", name)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?)
        .spawn()?;
    Ok(Replica {
        name,
        child,
        metrics,
        health,
        log,
    })
}

async fn get(port: u16, path: &str) -> anyhow::Result<(u16, String)> {
    Ok(http_get(([127, 0, 0, 1], port).into(), path).await?)
}

/// Sum of `opkit_reconcile_total` over all controllers of a replica.
async fn reconciles(r: &Replica) -> anyhow::Result<f64> {
    let (_, body) = get(r.metrics, "/metrics").await?;
    Ok(body
        .lines()
        .filter(|l| l.starts_with("opkit_reconcile_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum())
}

async fn holder(leases: &Api<Lease>) -> anyhow::Result<String> {
    Ok(leases
        .get_opt("opkit-leader")
        .await?
        .and_then(|l| l.spec?.holder_identity)
        .unwrap_or_default())
}

async fn wait_leader(leases: &Api<Lease>, r: &Replica, timeout: Duration) -> anyhow::Result<Duration> {
    let start = Instant::now();
    wait_for(&format!("{} to lead", r.name), timeout, || async {
        let h = holder(leases).await?;
        if h.starts_with(&format!("{}_", r.name)) {
            Ok(())
        } else {
            Err(anyhow!("holder {h:?}"))
        }
    })
    .await
    .with_context(|| std::fs::read_to_string(&r.log).unwrap_or_default())?;
    Ok(start.elapsed())
}

async fn wait_ready(r: &Replica) -> anyhow::Result<()> {
    wait_for(
        &format!("{} /readyz", r.name),
        Duration::from_secs(30),
        || async {
            match get(r.health, "/readyz").await? {
                (200, _) => Ok(()),
                (code, body) => Err(anyhow!("{code} {body}")),
            }
        },
    )
    .await
}

#[tokio::test]
async fn one_replica_leads_and_a_standby_takes_over() {
    shared()
        .in_namespace("leader", |client, ns| async move {
            let crds = Command::new(env!("CARGO_BIN_EXE_opkit")).arg("crd").output()?;
            let mut apply = shared()
                .kubectl()
                .args(["apply", "--server-side", "-f", "-"])
                .stdin(Stdio::piped())
                .spawn()?;
            std::io::Write::write_all(apply.stdin.as_mut().context("stdin")?, &crds.stdout)?;
            ensure!(apply.wait()?.success(), "installing the CRDs failed");
            let mcs: Api<Memcached> = Api::namespaced(client.clone(), &ns);
            mcs.create(
                &PostParams::default(),
                &serde_json::from_value(serde_json::json!({
                "apiVersion": "cache.example.com/v1", "kind": "Memcached",
                "metadata": {"name": "mc"}, "spec": {"size": 1}}))?,
            )
            .await?;
            let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
            let t = Duration::from_secs(60);

            let mut a = replica("opkit-a", &ns)?;
            wait_leader(&leases, &a, t).await?;
            wait_for("opkit-a to reconcile", t, || async {
                if reconciles(&a).await? > 0.0 {
                    Ok(())
                } else {
                    Err(anyhow!("no reconcile yet"))
                }
            })
            .await?;
            let b = replica("opkit-b", &ns)?;
            wait_ready(&b).await?;
            ensure!(reconciles(&b).await? == 0.0, "the standby reconciled");
            ensure!(holder(&leases).await?.starts_with("opkit-a_"));

            // A crash: the standby waits for the lease to expire.
            a.child.kill()?;
            let after_kill = wait_leader(&leases, &b, t).await?;
            println!("takeover after SIGKILL: {after_kill:?} (lease duration {LEASE_SECONDS}s)");
            ensure!(
                after_kill <= Duration::from_secs(LEASE_SECONDS + 2),
                "takeover after SIGKILL took {after_kill:?}"
            );
            wait_for("opkit-b to reconcile", t, || async {
                if reconciles(&b).await? > 0.0 {
                    Ok(())
                } else {
                    Err(anyhow!("no reconcile yet"))
                }
            })
            .await?;

            // A graceful stop: the leader releases the Lease and the standby takes it at once.
            let c = replica("opkit-c", &ns)?;
            wait_ready(&c).await?;
            let mut b = b;
            let _ = Command::new("kill")
                .args(["-TERM", &b.child.id().to_string()])
                .status();
            let after_term = wait_leader(&leases, &c, t).await?;
            println!("takeover after SIGTERM: {after_term:?}");
            ensure!(
                after_term < Duration::from_secs(2),
                "takeover after SIGTERM took {after_term:?}"
            );
            let status = b.child.wait()?;
            ensure!(status.success(), "opkit-b exited with {status}");
            drop(c);
            Ok(())
        })
        .await;
}
