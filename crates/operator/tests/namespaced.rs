//! `opkit manifests --namespace NS`: the controllers get a Role in NS and no cluster-wide
//! access; the operator, run as the generated ServiceAccount with the generated arguments,
//! reconciles in NS and can read nothing outside it.
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, anyhow, ensure};
use opkit_testenv::{shared, wait_for};

mod common;
use common::{Running, install_crds, kubectl, kubectl_stdin, service_account_kubeconfig};

const T: Duration = Duration::from_secs(60);

#[tokio::test]
async fn manifests_for_one_namespace_confine_the_operator_to_it() {
    shared()
        .in_namespace("confined", |client, ns| async move {
            install_crds()?;
            let dir = std::env::temp_dir().join(format!("opkit-namespaced-{ns}"));
            let out = Command::new(env!("CARGO_BIN_EXE_opkit"))
                .args(["manifests", "--namespace", &ns, "--dir"])
                .arg(&dir)
                .output()?;
            ensure!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            let role = std::fs::read_to_string(dir.join("rbac/role.yaml"))?;
            ensure!(role.contains("kind: Role") && role.contains(&format!("namespace: {ns}")), "{role}");
            let manager = std::fs::read_to_string(dir.join("manager/manager.yaml"))?;
            let arg = format!("--namespace={ns}");
            ensure!(manager.contains(&arg), "the Deployment does not get {arg}");

            kubectl(&["create", "namespace", "opkit-system"])?;
            kubectl(&["apply", "--server-side", "-k", &dir.join("rbac").to_string_lossy()])?;
            let kubeconfig = service_account_kubeconfig(&client, "opkit-system", "opkit-controller-manager").await?;
            let as_operator = |args: &[&str]| -> anyhow::Result<std::process::Output> {
                Ok(shared().kubectl().env("KUBECONFIG", &kubeconfig).args(args).output()?)
            };
            for args in [
                vec!["get", "deployments", "-n", "default"],
                vec!["get", "deployments", "--all-namespaces"],
                vec!["get", "memcacheds", "--all-namespaces"],
            ] {
                let out = as_operator(&args)?;
                ensure!(
                    !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("forbidden"),
                    "{args:?} was allowed"
                );
            }
            ensure!(as_operator(&["get", "deployments", "-n", &ns])?.status.success());

            let log = std::env::temp_dir().join(format!("opkit-namespaced-{ns}.log"));
            let _op = Running(
                Command::new(env!("CARGO_BIN_EXE_opkit"))
                    .args(["run", &arg, "--leader-elect", "--leader-election-namespace", "opkit-system"])
                    .args(["--metrics-bind-address", "0", "--health-probe-bind-address", "0"])
                    .arg("--kubeconfig")
                    .arg(&kubeconfig)
                    .stdout(Stdio::null())
                    .stderr(std::fs::File::create(&log)?)
                    .spawn()?,
            );
            let (ok, out) = kubectl_stdin(
                &["apply", "-n", &ns, "-f", "-"],
                b"apiVersion: cache.example.com/v1\nkind: Memcached\nmetadata:\n  name: m\nspec:\n  size: 2\n",
            )?;
            ensure!(ok, "{out}");
            wait_for("the Memcached to converge", T, || async {
                let ready = kubectl(&["get", "memcached", "m", "-n", &ns, "-o", "jsonpath={.status.readyReplicas}"])?;
                if ready == "2" { Ok(()) } else { Err(anyhow!("ready {ready:?}")) }
            })
            .await
            .with_context(|| std::fs::read_to_string(&log).unwrap_or_default())?;
            std::fs::remove_dir_all(&dir)?;
            Ok(())
        })
        .await;
}
