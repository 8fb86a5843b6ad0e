//! End to end: the `opkit` binary run as users run it, with `kubectl` applying the samples.
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{anyhow, ensure};
use opkit_testenv::{shared, wait_for};

mod common;
use common::{install_crds, kubectl, sigterm};

#[tokio::test]
async fn the_binary_runs_the_samples_and_stops_cleanly_on_sigterm() {
    shared()
        .in_namespace("e2e", |_client, ns| async move {
            let samples = format!("{}/../../config/samples", env!("CARGO_MANIFEST_DIR"));
            install_crds()?;

            let log = std::env::temp_dir().join(format!("opkit-e2e-{ns}.log"));
            let mut op = Command::new(env!("CARGO_BIN_EXE_opkit"))
                .args([
                    "run",
                    "--namespace",
                    &ns,
                    "--metrics-bind-address",
                    "0",
                    "--health-probe-bind-address",
                    "0",
                ])
                .env("KUBECONFIG", shared().kubeconfig())
                .stdout(std::fs::File::create(&log)?)
                .stderr(std::fs::File::create(log.with_extension("err"))?)
                .spawn()?;
            let result = async {
                for f in [
                    "cache_v1alpha1_memcached.yaml",
                    "cache_v1_memcached.yaml",
                    "cnat_v1alpha1_at.yaml",
                    "mtsre_v1_eru.yaml",
                    "apps_v1_deployment_eru.yaml",
                ] {
                    kubectl(&["apply", "-n", &ns, "-f", &format!("{samples}/{f}")])?;
                }
                for name in ["memcached-sample", "example-memcached"] {
                    wait_for(
                        &format!("{name} status.nodes"),
                        Duration::from_secs(60),
                        || async {
                            let n = kubectl(&[
                                "get",
                                "memcached",
                                name,
                                "-n",
                                &ns,
                                "-o",
                                "jsonpath={.status.nodes[*]}",
                            ])?;
                            let count = n.split_whitespace().count();
                            if count == 3 {
                                Ok(())
                            } else {
                                Err(anyhow!("nodes: {n:?}"))
                            }
                        },
                    )
                    .await?;
                }
                // The book's At is scheduled in 2019: it runs at once and ends DONE.
                wait_for("example-at to be DONE", Duration::from_secs(60), || async {
                    let phase = kubectl(&[
                        "get",
                        "at",
                        "example-at",
                        "-n",
                        &ns,
                        "-o",
                        "jsonpath={.status.phase}",
                    ])?;
                    if phase == "DONE" {
                        Ok(())
                    } else {
                        Err(anyhow!("phase {phase:?}"))
                    }
                })
                .await?;
                let pod = kubectl(&[
                    "get",
                    "pod",
                    "example-at-pod",
                    "-n",
                    &ns,
                    "-o",
                    "jsonpath={.status.phase}",
                ])?;
                ensure!(pod == "Succeeded", "example-at-pod is {pod:?}");
                // The annotated Deployment gets its Eru; the hand-written one finds its target.
                wait_for(
                    "the Eru of the annotated Deployment",
                    Duration::from_secs(60),
                    || async {
                        let schedule =
                            kubectl(&["get", "eru", "web", "-n", &ns, "-o", "jsonpath={.spec.schedule}"])?;
                        if schedule == "0 */6 * * *" {
                            Ok(())
                        } else {
                            Err(anyhow!("schedule {schedule:?}"))
                        }
                    },
                )
                .await?;
                wait_for(
                    "eru-sample to find memcached-sample",
                    Duration::from_secs(60),
                    || async {
                        let found = kubectl(&[
                            "get",
                            "eru",
                            "eru-sample",
                            "-n",
                            &ns,
                            "-o",
                            "jsonpath={.status.conditions[?(@.type==\"TargetFound\")].status}",
                        ])?;
                        if found == "True" {
                            Ok(())
                        } else {
                            Err(anyhow!("TargetFound={found:?}"))
                        }
                    },
                )
                .await?;
                let columns = kubectl(&["get", "mc", "-n", &ns])?;
                ensure!(
                    columns.contains("SIZE") && columns.contains("READY"),
                    "printer columns missing:\n{columns}"
                );
                anyhow::Ok(())
            }
            .await;
            sigterm(op.id());
            let start = Instant::now();
            let status = loop {
                if let Some(s) = op.try_wait()? {
                    break s;
                }
                if start.elapsed() > Duration::from_secs(20) {
                    op.kill()?;
                    anyhow::bail!("opkit did not stop within 20 s of SIGTERM");
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            };
            result.map_err(|e| {
                anyhow!(
                    "{e:#}\n--- opkit log ---\n{}",
                    std::fs::read_to_string(log.with_extension("err")).unwrap_or_default()
                )
            })?;
            ensure!(status.success(), "opkit exited with {status} after SIGTERM");
            eprintln!("opkit stopped {:?} after SIGTERM", start.elapsed());
            Ok(())
        })
        .await;
}
