//! `/readyz` of `opkit run` with every controller turns 200 once the caches have listed, on
//! every start: a readiness that depends on which task a store wakes first shows up as a start
//! that never gets ready.
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, ensure};
use opkit_testenv::{ControlPlane, Options, http_get, shared, wait_for};

mod common;
use common::{
    Running, free_port, install_crds, install_crds_on, opkit, run_kubectl, run_kubectl_stdin, sigterm,
};

const STARTS: usize = 20;

#[tokio::test]
async fn every_start_with_all_controllers_becomes_ready() {
    shared()
        .in_namespace("readyz", |_client, ns| async move {
            install_crds()?;
            let mut times = Vec::new();
            for i in 0..STARTS {
                let health = free_port()?;
                let log = std::env::temp_dir().join(format!("opkit-readyz-{ns}-{i}.log"));
                let started = Instant::now();
                // Every controller, every namespace: the default an operator Deployment runs.
                let mut op = Running(
                    opkit(&["run", "--metrics-bind-address", "0"])
                        .args(["--health-probe-bind-address", &format!("127.0.0.1:{health}")])
                        .stdout(std::fs::File::create(&log)?)
                        .stderr(Stdio::null())
                        .spawn()?,
                );
                let addr = ([127, 0, 0, 1], health).into();
                wait_for(
                    &format!("start {i}: /readyz 200"),
                    Duration::from_secs(20),
                    || async {
                        let (code, body) = http_get(addr, "/readyz").await?;
                        if code == 200 {
                            Ok(())
                        } else {
                            Err(anyhow!("{code} {body}"))
                        }
                    },
                )
                .await
                .with_context(|| std::fs::read_to_string(&log).unwrap_or_default())?;
                times.push(started.elapsed());
                sigterm(op.0.id());
                let status = op.0.wait()?;
                ensure!(status.success(), "start {i}: exited with {status}");
            }
            let slowest = times.iter().max().copied().unwrap_or_default();
            println!("{STARTS} starts ready; slowest {slowest:?}, times {times:?}");
            Ok(())
        })
        .await;
}

/// `(soft, hard)` "Max open files" of the process `pid`.
fn open_files_limit(pid: u32) -> anyhow::Result<(String, String)> {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits"))?;
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .context("no open files line")?;
    let v: Vec<&str> = line.split_whitespace().collect();
    ensure!(v.len() >= 5, "{line}");
    Ok((v[3].to_string(), v[4].to_string()))
}

#[tokio::test]
async fn the_operator_raises_its_open_files_limit_to_the_hard_one() {
    shared()
        .in_namespace("nofile", |_client, _ns| async move {
            install_crds()?;
            let health = free_port()?;
            let bin = env!("CARGO_BIN_EXE_opkit");
            // Started with a soft limit of 256, below any hard limit.
            let mut op = Running(
                std::process::Command::new("sh")
                    .args(["-c", "ulimit -Sn 256 && exec \"$0\" \"$@\"", bin, "run"])
                    .args(["--metrics-bind-address", "0", "--controllers", "memcached"])
                    .args(["--health-probe-bind-address", &format!("127.0.0.1:{health}")])
                    .env("KUBECONFIG", shared().kubeconfig())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()?,
            );
            let addr = ([127, 0, 0, 1], health).into();
            wait_for("/readyz 200", Duration::from_secs(30), || async {
                let (code, body) = http_get(addr, "/readyz").await?;
                ensure!(code == 200, "{code} {body}");
                Ok(())
            })
            .await?;
            let (soft, hard) = open_files_limit(op.0.id())?;
            ensure!(soft == hard, "open files: soft {soft}, hard {hard}");
            ensure!(soft != "256", "the soft limit was not raised");
            sigterm(op.0.id());
            op.0.wait()?;
            Ok(())
        })
        .await;
}

/// A server that does not stream lists (before 1.27, or with the `WatchList` gate off) still
/// gets an operator that becomes ready and reconciles: each watch lists in pages instead.
#[tokio::test]
async fn a_server_without_streaming_lists_gets_lists_in_pages() -> anyhow::Result<()> {
    let cp = ControlPlane::start(Options {
        nodes: 1,
        apiserver_flags: vec!["--feature-gates=WatchList=false".into()],
        ..Default::default()
    })
    .await?;
    install_crds_on(&cp)?;
    let kubectl = || {
        let mut c = std::process::Command::new(cp.binaries().path("kubectl"));
        c.env("KUBECONFIG", cp.kubeconfig_path());
        c
    };
    let health = free_port()?;
    let log = std::env::temp_dir().join(format!("opkit-paged-lists-{}.log", std::process::id()));
    let mut op = Running(
        std::process::Command::new(env!("CARGO_BIN_EXE_opkit"))
            .args(["run", "--metrics-bind-address", "0", "--controllers", "memcached"])
            .args(["--health-probe-bind-address", &format!("127.0.0.1:{health}")])
            .env("KUBECONFIG", cp.kubeconfig_path())
            .stdout(std::fs::File::create(&log)?)
            .stderr(Stdio::null())
            .spawn()?,
    );
    let addr = ([127, 0, 0, 1], health).into();
    let logged = || std::fs::read_to_string(&log).unwrap_or_default();
    wait_for("/readyz 200", Duration::from_secs(30), || async {
        let (code, body) = http_get(addr, "/readyz").await?;
        ensure!(code == 200, "{code} {body}");
        Ok(())
    })
    .await
    .with_context(logged)?;
    ensure!(
        logged().contains("the API server does not stream lists: listing in pages"),
        "no watch fell back to pages:\n{}",
        logged()
    );
    let memcached = "apiVersion: cache.example.com/v1alpha1\nkind: Memcached\nmetadata:\n  name: paged\n  namespace: default\nspec:\n  size: 1\n";
    let (ok, out) = run_kubectl_stdin(kubectl(), &["apply", "-f", "-"], memcached.as_bytes())?;
    ensure!(ok, "creating the Memcached failed: {out}");
    wait_for("the Memcached's Deployment", Duration::from_secs(30), || async {
        run_kubectl(kubectl(), &["get", "deployment", "paged", "-n", "default"]).map(drop)
    })
    .await
    .with_context(logged)?;
    sigterm(op.0.id());
    let status = op.0.wait()?;
    ensure!(status.success(), "exited with {status}");
    Ok(())
}
