//! `/readyz` of `opkit run` with every controller turns 200 once the caches have listed, on
//! every start: a readiness that depends on which task a store wakes first shows up as a start
//! that never gets ready.
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, ensure};
use opkit_testenv::{http_get, shared, wait_for};

mod common;
use common::{Running, free_port, install_crds, opkit, sigterm};

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
