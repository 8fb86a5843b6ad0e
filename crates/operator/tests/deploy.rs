//! The generated `config/` on the real control plane: every manifest is accepted, the manager
//! Pod passes the restricted Pod Security level, and the operator running as the generated
//! ServiceAccount (only the generated RBAC applies) runs every sample — and nothing more.
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{anyhow, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use kube::Api;
use opkit_testenv::{shared, wait_for};

mod common;
use common::{Running, jsonpath_is, kubectl, service_account_kubeconfig};

const T: Duration = Duration::from_secs(60);

fn kubectl_with(kubeconfig: Option<&std::path::Path>, args: &[&str]) -> anyhow::Result<std::process::Output> {
    let mut c = shared().kubectl();
    if let Some(k) = kubeconfig {
        c.env("KUBECONFIG", k);
    }
    Ok(c.args(args).output()?)
}

fn config_dir() -> String {
    format!("{}/../../config", env!("CARGO_MANIFEST_DIR"))
}

#[tokio::test]
async fn the_generated_deployment_and_rbac_run_every_sample_and_nothing_more() {
    shared()
        .in_namespace("deploy", |client, ns| async move {
            let config = config_dir();
            kubectl(&["apply", "--server-side", "-k", &format!("{config}/default")])?;
            // The manager Pod is admitted in the restricted namespace (kwok runs no container).
            let deploys: Api<Deployment> = Api::namespaced(client.clone(), "opkit-system");
            wait_for("the manager Deployment to be available", T, || async {
                let d = deploys.get("opkit-controller-manager").await?;
                match d.status.and_then(|s| s.available_replicas) {
                    Some(1) => Ok(()),
                    other => Err(anyhow!("available {other:?}")),
                }
            })
            .await?;

            // kwok runs no container, so nothing answers behind the webhook Service, and At's and
            // ConfigMirror's webhooks fail closed: this test is about RBAC, so they go. The
            // webhooks are served in-cluster in in_cluster.rs (real node) and from a local URL
            // in webhooks.rs.
            kubectl(&[
                "delete",
                "validatingwebhookconfiguration/opkit-validating-webhook-configuration",
                "mutatingwebhookconfiguration/opkit-mutating-webhook-configuration",
            ])?;
            let kubeconfig = service_account_kubeconfig(&client, "opkit-system", "opkit-controller-manager").await?;

            // Outside the rules: refused.
            for args in [
                vec!["get", "persistentvolumeclaims", "-n", ns.as_str()],
                vec!["delete", "pod", "anything", "-n", ns.as_str()],
                // ConfigMaps are ConfigMirror's children; Services belong to no controller.
                vec!["create", "service", "clusterip", "x", "--tcp", "80", "-n", ns.as_str()],
            ] {
                let out = kubectl_with(Some(&kubeconfig), &args)?;
                let err = String::from_utf8_lossy(&out.stderr);
                ensure!(!out.status.success() && err.contains("forbidden"), "{args:?} was allowed: {err}");
            }

            let log = std::env::temp_dir().join(format!("opkit-deploy-{ns}.log"));
            let _op = Running(
                Command::new(env!("CARGO_BIN_EXE_opkit"))
                    .args(["run", "--namespace", &ns, "--leader-elect"])
                    .args(["--leader-election-namespace", "opkit-system"])
                    .args(["--metrics-bind-address", "0", "--health-probe-bind-address", "0"])
                    .arg("--kubeconfig")
                    .arg(&kubeconfig)
                    .stdout(Stdio::null())
                    .stderr(std::fs::File::create(&log)?)
                    .spawn()?,
            );
            let result = async {
                for f in std::fs::read_dir(format!("{config}/samples"))? {
                    let f = f?.path();
                    // A v1 CronTab needs the conversion webhook, which this operator (no
                    // webhook server, outside the cluster) does not serve; the in-cluster
                    // test applies it through the webhook Service.
                    if f.ends_with("stable_v1_crontab.yaml") {
                        continue;
                    }
                    kubectl(&["apply", "-n", &ns, "-f", &f.to_string_lossy()])?;
                }
                jsonpath_is(&["memcached", "memcached-sample"], &ns, "{.status.readyReplicas}", "3").await?;
                jsonpath_is(&["memcached", "example-memcached"], &ns, "{.status.readyReplicas}", "3").await?;
                jsonpath_is(&["at", "example-at"], &ns, "{.status.phase}", "DONE").await?;
                jsonpath_is(&["eru", "web"], &ns, "{.spec.schedule}", "0 */6 * * *").await?;
                jsonpath_is(
                    &["eru", "eru-sample"],
                    &ns,
                    "{.status.conditions[?(@.type==\"TargetFound\")].status}",
                    "True",
                )
                .await?;
                // The cluster-scoped mirror: its finalizer and status need the generated rules
                // (its source is in `default`, the samples went into the test namespace).
                jsonpath_is(
                    &["configmirror", "app-settings"],
                    &ns,
                    "{.status.conditions[?(@.type==\"Ready\")].reason}",
                    "SourceNotFound",
                )
                .await?;
                jsonpath_is(&["configmirror", "app-settings"], &ns, "{.metadata.finalizers[0]}", "opkit.dev/configmirror")
                    .await?;
                kubectl(&["delete", "configmirror", "app-settings", "--wait=true", "--timeout=60s"])?;
                // PostgresDatabase reads its server's Secret (here one that points at a closed
                // port) through the generated rules and says why it cannot go on.
                kubectl(&[
                    "create", "secret", "generic", "postgres-server", "-n", &ns,
                    "--from-literal=host=127.0.0.1", "--from-literal=port=1",
                    "--from-literal=username=postgres", "--from-literal=password=unused",
                ])?;
                kubectl(&["label", "secret", "postgres-server", "-n", &ns, "db.opkit.dev/server=true"])?;
                jsonpath_is(
                    &["postgresdatabase", "app"],
                    &ns,
                    "{.status.conditions[?(@.type==\"Ready\")].reason}",
                    "ServerUnavailable",
                )
                .await?;
                // A restart needs `patch` on Deployments: make one happen.
                kubectl(&[
                    "annotate", "deployment", "web", "-n", &ns, "--overwrite",
                    "mtsre.meitu.com/eru-schedule=*/2 * * * * *",
                ])?;
                wait_for("web to be restarted", T, || async {
                    let at = kubectl(&[
                        "get", "deployment", "web", "-n", &ns, "-o",
                        "jsonpath={.spec.template.metadata.annotations.kubectl\\.kubernetes\\.io/restartedAt}",
                    ])?;
                    if at.is_empty() { Err(anyhow!("not restarted yet")) } else { Ok(()) }
                })
                .await?;
                anyhow::Ok(())
            }
            .await;
            result.map_err(|e| anyhow!("{e:#}\n--- opkit log ---\n{}", std::fs::read_to_string(&log).unwrap_or_default()))?;
            let lease = kubectl(&["get", "lease", "opkit-leader", "-n", "opkit-system", "-o", "jsonpath={.spec.holderIdentity}"])?;
            ensure!(!lease.is_empty(), "the operator did not take the Lease");
            Ok(())
        })
        .await;
}
