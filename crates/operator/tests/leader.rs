//! Leader election with real `opkit` processes: one leads, a standby takes over after a crash
//! within the lease duration, and at once after a graceful stop; a leader frozen past its
//! Lease with work queued starts no act on a PostgreSQL server once it runs again (counted in
//! the server's log, by connection).
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
    replica_of(name, ns, "memcached", &[])
}

/// A replica running `controllers`, with `extra` flags.
fn replica_of(name: &'static str, ns: &str, controllers: &str, extra: &[&str]) -> anyhow::Result<Replica> {
    let (metrics, health) = (free_port()?, free_port()?);
    let log = std::env::temp_dir().join(format!("opkit-leader-{ns}-{name}.log"));
    let child = Command::new(env!("CARGO_BIN_EXE_opkit"))
        .args([
            "run",
            "--controllers",
            controllers,
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
        .args(extra)
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

/// Installs every CRD `opkit crd` prints, as `make install` does.
fn install_crds() -> anyhow::Result<()> {
    let crds = Command::new(env!("CARGO_BIN_EXE_opkit")).arg("crd").output()?;
    let mut apply = shared()
        .kubectl()
        .args(["apply", "--server-side", "-f", "-"])
        .stdin(Stdio::piped())
        .spawn()?;
    std::io::Write::write_all(apply.stdin.as_mut().context("stdin")?, &crds.stdout)?;
    ensure!(apply.wait()?.success(), "installing the CRDs failed");
    Ok(())
}

#[tokio::test]
async fn one_replica_leads_and_a_standby_takes_over() {
    shared()
        .in_namespace("leader", |client, ns| async move {
            install_crds()?;
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

/// Sends `signal` (`STOP`, `CONT`) to a replica.
fn signal(r: &Replica, signal: &str) -> anyhow::Result<()> {
    let ok = Command::new("kill")
        .args([&format!("-{signal}"), &r.child.id().to_string()])
        .status()?
        .success();
    ensure!(ok, "kill -{signal} {}", r.name);
    Ok(())
}

/// The statements (DDL) of the server's log from byte `from` on, with the backend process
/// (one per connection) that ran each: `(pid, statement)`.
fn statements(log: &str, from: usize) -> Vec<(String, String)> {
    log.get(from..)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let (head, statement) = l.split_once("statement: ")?;
            let pid = head.split_once('[')?.1.split_once(']')?.0;
            Some((pid.to_string(), statement.to_string()))
        })
        .collect()
}

#[tokio::test]
async fn a_leader_frozen_past_its_lease_starts_no_act_on_the_server_when_it_runs_again() {
    if !opkit_testenv::postgres::available() {
        eprintln!("skipped: PostgreSQL is not installed (crates/testenv/scripts/postgres.sh install)");
        return;
    }
    let pg = std::sync::Arc::new(opkit_testenv::postgres::Postgres::start().expect("a PostgreSQL server"));
    shared()
        .in_namespace("leader-pg", |client, ns| async move {
            install_crds()?;
            let server: k8s_openapi::api::core::v1::Secret = serde_json::from_value(serde_json::json!({
                "apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": "pg", "labels": {"db.opkit.dev/server": "true"}},
                "stringData": {"host": pg.host, "port": pg.port.to_string(),
                               "username": pg.user, "password": pg.password}}))?;
            Api::namespaced(client.clone(), &ns)
                .create(&PostParams::default(), &server)
                .await?;
            let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
            let t = Duration::from_secs(60);
            // One reconcile at a time: the leader still has work queued when it freezes.
            let flags = [
                "--postgres-poll-interval",
                "300ms",
                "--tune",
                "postgres.concurrency=1",
            ];
            let a = replica_of("opkit-a", &ns, "postgres", &flags)?;
            wait_leader(&leases, &a, t).await?;
            let b = replica_of("opkit-b", &ns, "postgres", &flags)?;
            wait_ready(&b).await?;

            let dbs: Api<opkit_api::postgres::PostgresDatabase> = Api::namespaced(client.clone(), &ns);
            let names: Vec<String> = (1..=12).map(|i| format!("pg-{i}")).collect();
            for name in &names {
                dbs.create(
                    &PostParams::default(),
                    &serde_json::from_value(serde_json::json!({
                        "apiVersion": "db.opkit.dev/v1alpha1", "kind": "PostgresDatabase",
                        "metadata": {"name": name}, "spec": {"serverSecret": "pg"}}))?,
                )
                .await?;
            }
            // Frozen as soon as it acted once, with the rest of its work still queued.
            let a_pid = wait_for("opkit-a to act", t, || async {
                statements(&pg.log(), 0)
                    .into_iter()
                    .next()
                    .map(|(pid, _)| pid)
                    .ok_or_else(|| anyhow!("no statement yet"))
            })
            .await?;
            signal(&a, "STOP")?;
            wait_leader(&leases, &b, t).await?;
            wait_for("every database made by the new leader", t, || async {
                for name in &names {
                    let st = dbs.get(name).await?.status.unwrap_or_default();
                    ensure!(
                        st.conditions
                            .iter()
                            .any(|c| c.type_ == "Ready" && c.status == "True"),
                        "{name}: {st:?}"
                    );
                }
                Ok(())
            })
            .await
            .with_context(|| std::fs::read_to_string(&b.log).unwrap_or_default())?;

            // Running again with stale caches and a queue of work, the old leader finds its
            // Lease gone before it starts any act: at most the one it was in when it froze
            // reaches the server.
            let resumed = pg.log().len();
            signal(&a, "CONT")?;
            // Once it logged the loss its gate is shut: whatever it did is in the server's log.
            wait_for("opkit-a to notice it lost the Lease", t, || async {
                let log = std::fs::read_to_string(&a.log).unwrap_or_default();
                // "leadership lost: Lease … not renewed" as it exits, or "election lost" if
                // it stands by.
                ensure!(log.contains("lost"), "not yet");
                Ok::<_, anyhow::Error>(())
            })
            .await?;
            let log = pg.log();
            let late: Vec<String> = statements(&log, resumed)
                .into_iter()
                .filter(|(pid, _)| *pid == a_pid)
                .map(|(_, s)| s)
                .collect();
            ensure!(
                late.len() <= 1,
                "the old leader acted after it ran again: {late:#?}"
            );
            let roles = pg.psql("SELECT count(*) FROM pg_roles WHERE rolname LIKE 'pg-%'")?;
            ensure!(roles == names.len().to_string(), "{roles} roles\n{log}");
            drop((a, b));
            Ok(())
        })
        .await;
}
