//! Admission webhooks on the real control plane: the apiserver calls the `opkit` binary's
//! webhook server (URL configuration, as for an operator run outside the cluster), and
//! `kubectl apply` shows what it says.
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, ensure};
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use kube::Api;
use opkit_testenv::{shared, wait_for};

mod common;
use common::{Running, install_crds, kubectl, kubectl_stdin};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const T: Duration = Duration::from_secs(60);

/// `kubectl apply -f -` of `yaml`: (succeeded, stdout + stderr).
fn apply(ns: &str, yaml: &str) -> anyhow::Result<(bool, String)> {
    kubectl_stdin(&["apply", "-n", ns, "-f", "-"], yaml.as_bytes())
}

fn at(name: &str, schedule: &str) -> String {
    format!(
        "{{\"apiVersion\":\"cnat.programming-kubernetes.info/v1alpha1\",\"kind\":\"At\",\"metadata\":{{\"name\":\"{name}\"}},\"spec\":{{\"schedule\":\"{schedule}\",\"command\":\"echo YAY\"}}}}"
    )
}

fn eru(name: &str, schedule: &str, target: &str) -> String {
    format!(
        "{{\"apiVersion\":\"mtsre.meitu.com/v1\",\"kind\":\"Eru\",\"metadata\":{{\"name\":\"{name}\"}},\"spec\":{{\"deploymentName\":\"{target}\",\"schedule\":\"{schedule}\"}}}}"
    )
}

const MEMCACHED_WITHOUT_SIZE: &str = "{\"apiVersion\":\"cache.example.com/v1\",\"kind\":\"Memcached\",\"metadata\":{\"name\":\"nosize\"},\"spec\":{}}";

/// POSTs `body` to the webhook server over TLS, trusting `ca`; returns the HTTP status.
async fn post(port: u16, path: &str, ca: &[u8], body: &str) -> anyhow::Result<u16> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca) {
        roots.add(c?)?;
    }
    let config =
        rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    let mut tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect("127.0.0.1".try_into()?, tcp)
        .await?;
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    tls.write_all(req.as_bytes()).await?;
    let mut resp = Vec::new();
    let _ = tls.read_to_end(&mut resp).await;
    let text = String::from_utf8_lossy(&resp);
    Ok(text
        .split_whitespace()
        .nth(1)
        .context("no status line")?
        .parse()?)
}

#[tokio::test]
async fn the_apiserver_calls_the_webhooks_and_kubectl_shows_their_answers() {
    shared()
        .in_namespace("webhooks", |client, ns| async move {
            install_crds()?;

            let port = common::free_port()?;
            let log = std::env::temp_dir().join(format!("opkit-webhooks-{ns}.log"));
            let mut op = Running(
                Command::new(env!("CARGO_BIN_EXE_opkit"))
                    .args(["run", "--controllers", "memcached", "--namespace", &ns])
                    .args(["--metrics-bind-address", "0", "--health-probe-bind-address", "0"])
                    .args(["--webhook-bind-address", &format!("127.0.0.1:{port}")])
                    .args(["--webhook-url", &format!("https://127.0.0.1:{port}")])
                    .env("KUBECONFIG", shared().kubeconfig())
                    .stdout(Stdio::null())
                    .stderr(std::fs::File::create(&log)?)
                    .spawn()?,
            );
            let logs = || std::fs::read_to_string(&log).unwrap_or_default();

            // Refusals and warnings come back in kubectl's output (retried until the apiserver
            // has loaded the new configuration; an At admitted before that is taken back).
            wait_for("the At webhook to refuse an ancient At", T, || async {
                let (ok, out) = apply(&ns, &at("ancient", "2010-01-01T00:00:00Z"))?;
                if ok {
                    kubectl(&["delete", "at", "ancient", "-n", &ns])?;
                }
                ensure!(!ok && out.contains("more than 10 years in the past"), "{out}");
                Ok(())
            })
            .await
            .with_context(logs)?;
            let (ok, out) = apply(&ns, &at("book", "2019-04-12T10:12:00Z"))?;
            ensure!(
                ok && out.contains("Warning:") && out.contains("runs at once"),
                "{out}"
            );
            let (ok, out) = apply(&ns, &eru("range", "61 * * * *", "web"))?;
            ensure!(!ok && out.contains("minute: 61 is outside 0-59"), "{out}");
            let (ok, out) = apply(&ns, &eru("orphan", "@daily", "nope"))?;
            ensure!(
                ok && out.contains("Warning:") && out.contains("Deployment nope does not exist"),
                "{out}"
            );
            // A cluster-scoped kind: the ConfigMirror webhook refuses a selector the apiserver
            // would not accept, naming the field, and admits a valid one.
            let mirror = |name: &str, selector: &str| {
                format!(
                    "{{\"apiVersion\":\"mirror.opkit.dev/v1alpha1\",\"kind\":\"ConfigMirror\",\"metadata\":{{\"name\":\"{name}\"}},\"spec\":{{\"source\":{{\"namespace\":\"{ns}\",\"name\":\"s\"}},\"namespaceSelector\":{selector}}}}}"
                )
            };
            let bad = mirror(&format!("{ns}-bad"), r#"{"matchExpressions":[{"key":"env","operator":"In"}]}"#);
            let (ok, out) = apply(&ns, &bad)?;
            ensure!(
                !ok && out.contains("spec.namespaceSelector.matchExpressions[0].values: must be non-empty"),
                "{out}"
            );
            let good = mirror(&format!("{ns}-good"), r#"{"matchLabels":{"team":"a"}}"#);
            let (ok, out) = apply(&ns, &good)?;
            ensure!(ok, "{out}");
            // Only the memcached controller runs here: nothing put a finalizer on it.
            kubectl(&["delete", "configmirror", &format!("{ns}-good")])?;

            // Immutable once started: pretend the At ran (status is the operator's to write).
            kubectl(&[
                "patch",
                "at",
                "book",
                "-n",
                &ns,
                "--subresource=status",
                "--type=merge",
                "-p",
                "{\"status\":{\"phase\":\"DONE\"}}",
            ])?;
            let (ok, out) = apply(&ns, &at("book", "2030-01-01T00:00:00Z"))?;
            ensure!(!ok && out.contains("immutable once the At has started"), "{out}");

            // A malformed body is a 400, and the server keeps serving.
            let vwc: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
            let cfg = vwc.get("opkit-validating-webhook-configuration").await?;
            let ca = cfg.webhooks.unwrap_or_default()[0]
                .client_config
                .ca_bundle
                .clone()
                .context("no caBundle")?
                .0;
            ensure!(
                post(
                    port,
                    "/validate-cnat-programming-kubernetes-info-at",
                    &ca,
                    "{not json"
                )
                .await?
                    == 400
            );
            ensure!(
                post(
                    port,
                    "/validate-cnat-programming-kubernetes-info-at",
                    &ca,
                    "{\"kind\":\"AdmissionReview\"}"
                )
                .await?
                    == 400
            );
            let (ok, out) = apply(&ns, &at("ancient2", "2010-01-01T00:00:00Z"))?;
            ensure!(!ok && out.contains("more than 10 years"), "{out}");

            // With the operator stopped, each webhook's failurePolicy decides. The At webhook
            // (Fail) refuses, naming itself, even an At it would admit; the Eru webhook (Ignore)
            // admits an impossible schedule, left to the controller. A Memcached without a size
            // needs no webhook: the schema's default fills it in.
            let _ = Command::new("kill")
                .args(["-TERM", &op.0.id().to_string()])
                .status();
            op.0.wait()?;
            let (ok, out) = apply(&ns, &at("later", "2030-01-01T00:00:00Z"))?;
            ensure!(
                !ok && out.contains("failed calling webhook") && out.contains("vat.opkit.dev"),
                "admitted with the webhook down, or refused for another reason: {out}"
            );
            let (ok, out) = apply(&ns, &eru("range2", "61 * * * *", "web"))?;
            ensure!(ok, "refused with the webhook down: {out}");
            let (ok, out) = apply(&ns, MEMCACHED_WITHOUT_SIZE)?;
            ensure!(ok, "refused with the webhook down: {out}");
            let size = kubectl(&["get", "memcached", "nosize", "-n", &ns, "-o", "jsonpath={.spec.size}"])?;
            ensure!(size == "1", "size {size:?}");
            Ok(())
        })
        .await;
}
