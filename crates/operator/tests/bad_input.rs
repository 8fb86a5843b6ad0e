//! Input the API would store but opkit could not use is refused at admission by the CRD
//! itself, with a message naming the field and the limit.
use anyhow::ensure;
use opkit_testenv::shared;

mod common;
use common::{install_crds, kubectl_stdin};

fn apply(ns: &str, yaml: &str) -> anyhow::Result<(bool, String)> {
    kubectl_stdin(&["apply", "-n", ns, "-f", "-"], yaml.as_bytes())
}

#[tokio::test]
async fn names_too_long_for_labels_or_pod_names_are_refused_by_the_crd() {
    shared()
        .in_namespace("names", |_, ns| async move {
            install_crds()?;
            let memcached = "apiVersion: cache.example.com/v1alpha1\nkind: Memcached\nmetadata:\n  name: NAME\nspec:\n  size: 0\n";
            let foo = "apiVersion: samplecontroller.k8s.io/v1alpha1\nkind: Foo\nmetadata:\n  name: NAME\nspec:\n  deploymentName: d\n  replicas: 1\n";
            let at = "apiVersion: cnat.programming-kubernetes.info/v1alpha1\nkind: At\nmetadata:\n  name: NAME\nspec:\n  schedule: \"2030-01-01T00:00:00Z\"\n  command: \"true\"\n";
            let cases = [
                (memcached, 63, "metadata.name must be at most 63 characters: it labels the memcached Pods"),
                (foo, 63, "metadata.name must be at most 63 characters: it labels the Deployment's Pods"),
                (at, 249, "metadata.name must be at most 249 characters: its Pod is named <name>-pod"),
            ];
            for (yaml, max, message) in cases {
                let (ok, out) = apply(&ns, &yaml.replace("NAME", &"a".repeat(max + 1)))?;
                ensure!(!ok && out.contains(message), "a name of {} characters: {out}", max + 1);
                let (ok, out) = apply(&ns, &yaml.replace("NAME", &"a".repeat(max)))?;
                ensure!(ok, "a name of {max} characters was refused: {out}");
            }
            Ok(())
        })
        .await;
}
