//! On the real node (containerd, kubelet, kube-proxy; `OPKIT_TESTENV_REAL_NODE=1`, as
//! `make test` sets): what kwok can only emulate. The seed's At prints `YAY` from a real
//! container, a failing command's exit code comes from the process, and a Memcached's Pods are
//! real memcached servers answering on port 11211.
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, anyhow, ensure};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::ListParams;
use opkit_testenv::{shared_real_node, wait_for};

mod common;
use common::{Running, install_crds, jsonpath, jsonpath_is, kubectl, kubectl_stdin};

const T: Duration = Duration::from_secs(90);

/// The operator on this machine, scoped to `ns`, running the named controllers.
fn operator(ns: &str, controllers: &str) -> anyhow::Result<Running> {
    let log = std::env::temp_dir().join(format!("opkit-real-node-{ns}.log"));
    let kubeconfig = shared_real_node()
        .context("the real node")?
        .kubeconfig()
        .to_path_buf();
    Ok(Running(
        Command::new(env!("CARGO_BIN_EXE_opkit"))
            .args([
                "run",
                "--namespace",
                ns,
                "--controllers",
                controllers,
                "--metrics-bind-address",
                "0",
                "--health-probe-bind-address",
                "0",
            ])
            .env("KUBECONFIG", kubeconfig)
            .stdout(std::fs::File::create(&log)?)
            .stderr(std::fs::File::create(log.with_extension("err"))?)
            .spawn()?,
    ))
}

async fn at_done(ns: &str, name: &str) -> anyhow::Result<()> {
    jsonpath_is(&["at", name], ns, "{.status.phase}", "DONE").await
}

#[tokio::test]
async fn the_seed_at_prints_yay_from_a_real_container_and_a_failure_keeps_its_exit_code() {
    let Some(cluster) = shared_real_node() else {
        return;
    };
    cluster
        .in_namespace("real-at", |client, ns| async move {
            install_crds()?;
            let _op = operator(&ns, "at")?;
            let sample = format!(
                "{}/../../config/samples/cnat_v1alpha1_at.yaml",
                env!("CARGO_MANIFEST_DIR")
            );
            kubectl(&["apply", "-n", &ns, "-f", &sample])?;
            // The exit code is computed by the shell in the container: nothing can read it off
            // the script, as kwok's emulation does.
            let failing = r#"{"apiVersion":"cnat.programming-kubernetes.info/v1alpha1","kind":"At",
                "metadata":{"name":"failing-at"},
                "spec":{"schedule":"2019-04-12T10:12:00Z","command":"echo NAY >&2; exit $((6 * 7))"}}"#;
            let (ok, out) = kubectl_stdin(&["apply", "-n", &ns, "-f", "-"], failing.as_bytes())?;
            ensure!(ok, "{out}");

            at_done(&ns, "example-at").await?;
            let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
            let pod = pods.get("example-at-pod").await?;
            let node = pod.spec.as_ref().and_then(|s| s.node_name.clone());
            ensure!(
                node.as_deref() == Some(opkit_testenv::node::NODE_NAME),
                "example-at-pod ran on {node:?}"
            );
            let runtime_id = pod
                .status
                .as_ref()
                .and_then(|s| s.container_statuses.as_ref())
                .and_then(|c| c.first())
                .and_then(|c| c.container_id.clone())
                .unwrap_or_default();
            ensure!(
                runtime_id.starts_with("containerd://"),
                "no container ran: {runtime_id:?}"
            );
            let logs = kubectl(&["logs", "example-at-pod", "-n", &ns])?;
            ensure!(logs == "YAY\n", "kubectl logs example-at-pod printed {logs:?}");
            let outcome = jsonpath(&["at", "example-at"], &ns, "{.status.outcome}")?;
            ensure!(outcome == "Succeeded", "example-at outcome {outcome:?}");

            at_done(&ns, "failing-at").await?;
            let status = jsonpath(&["at", "failing-at"], &ns, "{.status.outcome} {.status.exitCode}")?;
            ensure!(status == "Failed 42", "failing-at status {status:?}");
            let logs = kubectl(&["logs", "failing-at-pod", "-n", &ns])?;
            ensure!(logs == "NAY\n", "kubectl logs failing-at-pod printed {logs:?}");
            let events = kubectl(&[
                "get",
                "events",
                "-n",
                &ns,
                "--field-selector",
                "involvedObject.name=failing-at",
            ])?;
            ensure!(
                events.contains("CommandFailed") && events.contains("exit code 42"),
                "no CommandFailed event with the exit code:\n{events}"
            );
            Ok(())
        })
        .await;
}

/// One `stats` exchange with a memcached server; returns what it answered.
async fn memcached_stats(addr: std::net::SocketAddr) -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::time::timeout(Duration::from_secs(3), tokio::net::TcpStream::connect(addr)).await??;
    s.write_all(b"stats\r\n").await?;
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    while !answer.ends_with(b"END\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(3), s.read(&mut buf)).await??;
        ensure!(n > 0, "connection closed after {answer:?}");
        answer.extend_from_slice(&buf[..n]);
    }
    Ok(String::from_utf8(answer)?)
}

#[tokio::test]
async fn a_memcached_of_size_two_runs_two_servers_that_answer_stats_from_the_host() {
    let Some(cluster) = shared_real_node() else {
        return;
    };
    cluster
        .in_namespace("real-mc", |client, ns| async move {
            install_crds()?;
            let _op = operator(&ns, "memcached")?;
            let mc = r#"{"apiVersion":"cache.example.com/v1","kind":"Memcached",
                "metadata":{"name":"real"},"spec":{"size":2}}"#;
            let (ok, out) = kubectl_stdin(&["apply", "-n", &ns, "-f", "-"], mc.as_bytes())?;
            ensure!(ok, "{out}");
            // Ready comes from the kubelet's TCP probe on a real process, not from kwok.
            let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
            let ips = wait_for("2 Ready memcached Pods", T, || async {
                let list = pods
                    .list(&ListParams::default().labels("app=memcached,memcached_cr=real"))
                    .await?;
                let ips: Vec<String> = list
                    .items
                    .iter()
                    .filter(|p| {
                        p.status
                            .as_ref()
                            .and_then(|s| s.conditions.as_ref())
                            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
                    })
                    .filter_map(|p| p.status.as_ref()?.pod_ip.clone())
                    .collect();
                if ips.len() == 2 {
                    Ok(ips)
                } else {
                    Err(anyhow!(
                        "{} Pods, Ready with addresses: {ips:?}",
                        list.items.len()
                    ))
                }
            })
            .await?;
            for ip in &ips {
                let addr: std::net::SocketAddr = format!("{ip}:11211").parse()?;
                let stats = memcached_stats(addr).await?;
                ensure!(
                    stats.contains("STAT pid 1\r\n") && stats.contains("STAT limit_maxbytes 67108864\r\n"),
                    "{addr} answered {stats:?}"
                );
            }
            wait_for("status.nodes to list both Pods", T, || async {
                let nodes = jsonpath(&["memcached", "real"], &ns, "{.status.nodes[*]}")?;
                if nodes.split_whitespace().count() == 2 {
                    Ok(())
                } else {
                    Err(anyhow!("nodes {nodes:?}"))
                }
            })
            .await?;
            Ok(())
        })
        .await;
}
