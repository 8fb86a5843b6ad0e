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
