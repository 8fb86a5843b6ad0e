//! Admission webhooks on the real control plane: the apiserver calls the `opkit` binary's
//! webhook server (URL configuration, as for an operator run outside the cluster), and
//! `kubectl apply` shows what it says; a flood of slow senders (more than the server's
//! connection slots) and of 7 MiB bodies neither delays admissions nor takes the operator past
//! its memory limit (without the server's body budget it peaked at 316 MiB here).
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, ensure};
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use kube::Api;
use opkit_testenv::{shared, tls_connector, wait_for};

mod common;
use common::{Running, install_crds, kubectl, kubectl_stdin};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const T: Duration = Duration::from_secs(60);

/// The webhook configurations are cluster-wide and each `opkit` writes its own URL and CA
/// into them: the tests here take turns.
static ONE_OPERATOR: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

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
    let mut tls = connect(&tls_connector(ca)?, port).await?;
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    tls.write_all(req.as_bytes()).await?;
    tls.flush().await?;
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
            let _turn = ONE_OPERATOR.lock().await;
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
                // A 422 with the field, as the apiserver's own validation reports it.
                ensure!(
                    !ok && out.contains("is invalid: spec.schedule: ") && out.contains("more than 10 years in the past"),
                    "{out}"
                );
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
                    "/validate-cnat-programming-kubernetes-info-v1alpha1-at",
                    &ca,
                    "{not json"
                )
                .await?
                    == 400
            );
            ensure!(
                post(
                    port,
                    "/validate-cnat-programming-kubernetes-info-v1alpha1-at",
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
                !ok && out.contains("failed calling webhook") && out.contains("vat-v1alpha1.cnat.programming-kubernetes.info"),
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

type Tls = tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

async fn connect(c: &tokio_rustls::TlsConnector, port: u16) -> anyhow::Result<Tls> {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    Ok(c.connect("127.0.0.1".try_into()?, tcp).await?)
}

const AT_PATH: &str = "/validate-cnat-programming-kubernetes-info-v1alpha1-at";

/// Sends headers for a 1000-byte body, then one byte every half second, again and again.
async fn slow_sender(c: tokio_rustls::TlsConnector, port: u16, stop: tokio_util::sync::CancellationToken) {
    while !stop.is_cancelled() {
        let Ok(mut tls) = connect(&c, port).await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let head = format!("POST {AT_PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n");
        if tls.write_all(head.as_bytes()).await.is_err() || tls.flush().await.is_err() {
            continue;
        }
        while !stop.is_cancelled() && tls.write_all(b"x").await.is_ok() && tls.flush().await.is_ok() {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

/// Sends 7 MiB bodies (the largest the server takes) as fast as it can, again and again.
async fn large_sender(c: tokio_rustls::TlsConnector, port: u16, stop: tokio_util::sync::CancellationToken) {
    let chunk = vec![b'x'; 64 * 1024];
    while !stop.is_cancelled() {
        let Ok(mut tls) = connect(&c, port).await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let len = 7 * 1024 * 1024;
        let head = format!(
            "POST {AT_PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n"
        );
        let mut ok = tls.write_all(head.as_bytes()).await.is_ok();
        let mut sent = 0;
        while ok && sent < len && !stop.is_cancelled() {
            ok = tls.write_all(&chunk).await.is_ok();
            sent += chunk.len();
        }
        if ok {
            let _ = tls.flush().await;
        }
        let mut sink = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(40), tls.read_to_end(&mut sink)).await;
    }
}

/// The process's peak resident memory (VmHWM), in MiB.
fn peak_rss_mib(pid: u32) -> anyhow::Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .context("no VmHWM")?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()?;
    Ok(kb / 1024.0)
}

/// Opens connections to `addr` that never send a byte, `per_second` of them for as long as
/// `stop` is not cancelled, keeping the latest `keep` open.
async fn silent_flood(
    addr: std::net::SocketAddr,
    per_second: u64,
    keep: usize,
    stop: tokio_util::sync::CancellationToken,
) {
    let mut held = std::collections::VecDeque::new();
    let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / per_second));
    while !stop.is_cancelled() {
        tick.tick().await;
        if let Ok(s) = tokio::net::TcpStream::connect(addr).await {
            held.push_back(s);
        }
        if held.len() > keep {
            held.pop_front();
        }
    }
}

/// With `OPKIT_CHAOS=full`, the issue's sizes: 60 s of flood and 15000 idle probe connections.
fn full() -> bool {
    std::env::var("OPKIT_CHAOS").is_ok_and(|v| v == "full")
}

#[tokio::test]
async fn a_flood_of_slow_large_and_silent_connections_leaves_admissions_probes_and_the_lease_answered() {
    // This test's own connections: thousands at once.
    rlimit::increase_nofile_limit(u64::MAX).expect("raising the open files limit");
    shared()
        .in_namespace("flood", |client, ns| async move {
            let _turn = ONE_OPERATOR.lock().await;
            install_crds()?;
            let (port, probes) = (common::free_port()?, common::free_port()?);
            let log = std::env::temp_dir().join(format!("opkit-flood-{ns}.log"));
            let op = Running(
                Command::new(env!("CARGO_BIN_EXE_opkit"))
                    .args(["run", "--controllers", "memcached", "--namespace", &ns])
                    .args(["--leader-elect", "--leader-election-namespace", &ns])
                    .args(["--metrics-bind-address", "0"])
                    .args(["--health-probe-bind-address", &format!("127.0.0.1:{probes}")])
                    .args(["--webhook-bind-address", &format!("127.0.0.1:{port}")])
                    .args(["--webhook-url", &format!("https://127.0.0.1:{port}")])
                    .env("KUBECONFIG", shared().kubeconfig())
                    .stdout(Stdio::null())
                    .stderr(std::fs::File::create(&log)?)
                    .spawn()?,
            );
            let logs = || std::fs::read_to_string(&log).unwrap_or_default();
            let ats: Api<kube::core::DynamicObject> = Api::namespaced_with(
                client.clone(),
                &ns,
                &kube::core::ApiResource::from_gvk_with_plural(
                    &kube::core::GroupVersionKind::gvk("cnat.programming-kubernetes.info", "v1alpha1", "At"),
                    "ats",
                ),
            );
            let ancient: kube::core::DynamicObject =
                serde_json::from_str(&at("ancient", "2010-01-01T00:00:00Z"))?;
            let dry = kube::api::PostParams {
                dry_run: true,
                ..Default::default()
            };
            // One admission through the apiserver: the webhook's refusal, and how long it took.
            let admit = || async {
                let started = std::time::Instant::now();
                let out = tokio::time::timeout(Duration::from_secs(15), ats.create(&dry, &ancient)).await;
                let took = started.elapsed();
                match out {
                    Ok(Err(kube::Error::Api(s))) if s.message.contains("more than 10 years") => Ok(took),
                    other => Err(anyhow::anyhow!("after {took:?}: {other:?}")),
                }
            };
            wait_for("the At webhook to answer", T, admit)
                .await
                .with_context(logs)?;

            let vwc: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
            let cfg = vwc.get("opkit-validating-webhook-configuration").await?;
            let ca = cfg.webhooks.unwrap_or_default()[0]
                .client_config
                .ca_bundle
                .clone()
                .context("no caBundle")?
                .0;
            let c = tls_connector(&ca)?;
            let probe = connect(&c, port).await?;
            let alpn = probe.get_ref().1.alpn_protocol().map(|p| p.to_vec());
            ensure!(alpn.as_deref() != Some(b"h2".as_slice()), "HTTP/2 was negotiated");
            drop(probe);

            // The Lease it holds, and a readiness probe as the kubelet makes it.
            let leases: Api<k8s_openapi::api::coordination::v1::Lease> = Api::namespaced(client.clone(), &ns);
            let renewed = || async {
                let l = leases.get("opkit-leader").await?.spec.unwrap_or_default();
                anyhow::Ok((l.holder_identity.unwrap_or_default(), l.renew_time.map(|t| t.0)))
            };
            wait_for("the operator to lead", T, || async {
                ensure!(!renewed().await?.0.is_empty(), "no holder");
                Ok(())
            })
            .await
            .with_context(logs)?;
            let (holder, _) = renewed().await?;
            let probe_addr: std::net::SocketAddr = ([127, 0, 0, 1], probes).into();
            let ready = || async {
                let started = std::time::Instant::now();
                let out = tokio::time::timeout(Duration::from_secs(15), opkit_testenv::http_get(probe_addr, "/readyz")).await;
                let took = started.elapsed();
                match out {
                    Ok(Ok((200, _))) => Ok(took),
                    other => Err(anyhow::anyhow!("/readyz after {took:?}: {other:?}")),
                }
            };
            wait_for("/readyz", T, ready).await.with_context(logs)?;

            // More slow senders than the server has connection slots, large bodies, new
            // connections that never send a byte (60 a second: more than the TLS handshake
            // timeout frees), and idle connections to the probe port by the thousand.
            let stop = tokio_util::sync::CancellationToken::new();
            let _stop = stop.clone().drop_guard();
            for _ in 0..300 {
                tokio::spawn(slow_sender(c.clone(), port, stop.clone()));
            }
            for _ in 0..64 {
                tokio::spawn(large_sender(c.clone(), port, stop.clone()));
            }
            tokio::spawn(silent_flood(([127, 0, 0, 1], port).into(), 60, 400, stop.clone()));
            let idle_probes = if full() { 15_000 } else { 2_000 };
            let mut idle = Vec::new();
            for _ in 0..idle_probes {
                // Past the listen backlog, a connection may wait or fail: both are the flood.
                if let Ok(Ok(s)) = tokio::time::timeout(Duration::from_millis(200), tokio::net::TcpStream::connect(probe_addr)).await {
                    idle.push(s);
                }
            }
            let (mut worst, mut worst_probe) = (Duration::ZERO, Duration::ZERO);
            let mut renewals = std::collections::BTreeSet::new();
            let seconds = if full() { 60 } else { 15 };
            for _ in 0..seconds {
                tokio::time::sleep(Duration::from_secs(1)).await;
                worst = worst.max(admit().await.with_context(logs)?);
                worst_probe = worst_probe.max(ready().await.with_context(logs)?);
                let (now_holder, at) = renewed().await?;
                ensure!(now_holder == holder, "the Lease went from {holder} to {now_holder}");
                renewals.insert(at);
            }
            stop.cancel();
            let peak = peak_rss_mib(op.0.id())?;
            eprintln!(
                "flood: {} idle probe connections, slowest admission {worst:?}, slowest /readyz {worst_probe:?}, {} renewals seen in {seconds} s, operator peak RSS {peak:.1} MiB",
                idle.len(),
                renewals.len()
            );
            ensure!(worst < Duration::from_secs(2), "an admission took {worst:?}");
            ensure!(worst_probe < Duration::from_secs(1), "a probe took {worst_probe:?}");
            ensure!(renewals.len() >= seconds / 4, "the Lease was renewed {} times in {seconds} s", renewals.len());
            ensure!(peak < 128.0, "peak RSS {peak:.1} MiB, over the 128 MiB limit");
            Ok(())
        })
        .await;
}

/// `opkit run` of the CronTab conversion only, serving its webhook on a free port; its log
/// goes to `log`.
fn crontab_operator(ns: &str, log: &std::path::Path) -> anyhow::Result<Running> {
    let port = common::free_port()?;
    Ok(Running(
        Command::new(env!("CARGO_BIN_EXE_opkit"))
            .args(["run", "--controllers", "crontab", "--namespace", ns])
            .args(["--metrics-bind-address", "0", "--health-probe-bind-address", "0"])
            .args(["--webhook-bind-address", &format!("127.0.0.1:{port}")])
            .args(["--webhook-url", &format!("https://127.0.0.1:{port}")])
            .env("KUBECONFIG", shared().kubeconfig())
            // Its Secrets (webhook certificate, conversion signing key) in the test's namespace.
            .env("POD_NAMESPACE", ns)
            .stdout(std::fs::File::create(log)?)
            .stderr(Stdio::null())
            .spawn()?,
    ))
}

/// `kubectl get <resource> <name> -o json` in `ns`, parsed.
fn get_json(resource: &str, name: &str, ns: &str) -> anyhow::Result<serde_json::Value> {
    Ok(serde_json::from_str(&kubectl(&[
        "get", resource, name, "-n", ns, "-o", "json",
    ])?)?)
}

#[tokio::test]
async fn crontabs_written_in_either_version_read_back_the_same_in_both() {
    use serde_json::json;
    shared()
        .in_namespace("convert", |client, ns| async move {
            let _turn = ONE_OPERATOR.lock().await;
            install_crds()?;
            let log = std::env::temp_dir().join(format!("opkit-convert-{ns}.log"));
            let _op = crontab_operator(&ns, &log)?;
            let logs = || std::fs::read_to_string(&log).unwrap_or_default();
            let (v1, v2) = ("crontabs.v1.stable.example.com", "crontabs.v2.stable.example.com");
            let samples = format!("{}/../../config/samples", env!("CARGO_MANIFEST_DIR"));

            // The documentation's v1 object, once the operator has pointed the CRD at itself.
            wait_for("the v1 sample to be stored through the conversion", T, || async {
                kubectl(&["apply", "-n", &ns, "-f", &format!("{samples}/stable_v1_crontab.yaml")]).map(|_| ())
            })
            .await
            .with_context(logs)?;
            let as_v1 = get_json(v1, "my-new-cron-object", &ns)?;
            ensure!(
                as_v1["spec"] == json!({"cronSpec": "* * * * */5", "image": "my-awesome-cron-image"}),
                "{as_v1}"
            );
            let as_v2 = get_json(v2, "my-new-cron-object", &ns)?;
            ensure!(
                as_v2["spec"]
                    == json!({"schedule": {"minute": "*", "hour": "*", "dayOfMonth": "*", "month": "*", "dayOfWeek": "*/5"},
                              "image": "my-awesome-cron-image"}),
                "{as_v2}"
            );
            // Metadata is the same object's in both versions.
            ensure!(as_v1["metadata"]["uid"] == as_v2["metadata"]["uid"]);
            ensure!(as_v1["metadata"]["resourceVersion"] == as_v2["metadata"]["resourceVersion"]);

            // A v2 object with what v1 cannot say (the time zone), seen by a v1 watch.
            let as_v1 = kube::core::ApiResource {
                group: "stable.example.com".into(),
                version: "v1".into(),
                api_version: "stable.example.com/v1".into(),
                kind: "CronTab".into(),
                plural: "crontabs".into(),
            };
            let watched: kube::Api<kube::core::DynamicObject> = kube::Api::namespaced_with(client.clone(), &ns, &as_v1);
            let from = watched.list(&Default::default()).await?.metadata.resource_version.unwrap_or_default();
            let mut events = Box::pin(watched.watch(&kube::api::WatchParams::default(), &from).await?);
            kubectl(&["apply", "-n", &ns, "-f", &format!("{samples}/stable_v2_crontab.yaml")])?;
            let event = tokio::time::timeout(T, futures::StreamExt::next(&mut events))
                .await
                .context("no watch event for the v2 object")?
                .context("the watch ended")??;
            let kube::core::WatchEvent::Added(seen) = event else {
                anyhow::bail!("{event:?}");
            };
            ensure!(
                seen.types.as_ref().map(|t| t.api_version.as_str()) == Some("stable.example.com/v1")
                    && seen.data["spec"]["cronSpec"] == "0 3 * * 1-5",
                "{seen:?}"
            );
            let zoned = get_json(v1, "my-zoned-cron-object", &ns)?;
            ensure!(zoned["spec"]["cronSpec"] == "0 3 * * 1-5", "{zoned}");
            // Edited as v1 (what an older client would do): the edit lands, the zone stays.
            kubectl(&[
                "patch", v1, "my-zoned-cron-object", "-n", &ns, "--type", "merge",
                "-p", r#"{"spec":{"cronSpec":"30 3 * * 1-5","replicas":2}}"#,
            ])?;
            let stored = get_json(v2, "my-zoned-cron-object", &ns)?;
            ensure!(
                stored["spec"]
                    == json!({"schedule": {"minute": "30", "hour": "3", "dayOfMonth": "*", "month": "*", "dayOfWeek": "1-5"},
                              "timeZone": "Europe/Paris", "image": "my-awesome-cron-image", "replicas": 2}),
                "{stored}"
            );
            ensure!(stored["metadata"].get("annotations").is_none_or(|a| a.as_object().is_none_or(|a| !a.keys().any(|k| k.starts_with("conversion.opkit.dev/")))),
                "the stored v2 object kept a conversion annotation: {stored}");

            // The content kept for the way back is signed with the key every replica shares.
            let key = kubectl(&["get", "secret", "opkit-conversion-key", "-n", &ns, "-o", "jsonpath={.data.key}"])?;
            ensure!(key.len() >= 44, "no shared signing key: {key:?}");
            // Kept content written by hand, or copied from another object, is not restored:
            // neither reaches the stored v2 object.
            let copied = get_json(v1, "my-zoned-cron-object", &ns)?["metadata"]["annotations"]["conversion.opkit.dev/v2"].clone();
            ensure!(copied.as_str().is_some_and(|a| a.contains("Europe/Paris")), "{copied}");
            let forged = json!({"spec": {"schedule": {"minute": "0", "hour": "4", "dayOfMonth": "*", "month": "*", "dayOfWeek": "*"},
                                         "timeZone": "Forged/Zone", "image": "forged"}}).to_string();
            for (name, annotation) in [("forged", json!(forged)), ("copied", copied)] {
                let (ok, out) = apply(&ns, &json!({"apiVersion": "stable.example.com/v1", "kind": "CronTab",
                    "metadata": {"name": name, "annotations": {"conversion.opkit.dev/v2": annotation}},
                    "spec": {"cronSpec": "0 4 * * *", "image": "busybox"}}).to_string())?;
                ensure!(ok, "{out}");
                let stored = get_json(v2, name, &ns)?;
                ensure!(
                    stored["spec"] == json!({"schedule": {"minute": "0", "hour": "4", "dayOfMonth": "*", "month": "*", "dayOfWeek": "*"},
                                             "image": "busybox"})
                        && stored["metadata"]["annotations"].get("conversion.opkit.dev/v2").is_none(),
                    "{name}: {stored}"
                );
            }
            kubectl(&["delete", v2, "forged", "copied", "-n", &ns])?;

            // A v2 object whose time zone is too large to keep in a v1 annotation: lists in v1
            // still answer (the apiserver would refuse the annotation, failing them); writing
            // it back as v1, which would lose the zone, is refused, as v2 it is not.
            let big = json!({"apiVersion": "stable.example.com/v2", "kind": "CronTab", "metadata": {"name": "big"},
                "spec": {"schedule": {"minute": "0", "hour": "1", "dayOfMonth": "*", "month": "*", "dayOfWeek": "*"},
                         "timeZone": "x".repeat(300 * 1024), "image": "busybox"}});
            let (ok, out) = kubectl_stdin(&["create", "-n", &ns, "-f", "-"], big.to_string().as_bytes())?;
            ensure!(ok, "{out}");
            let listed = kubectl(&["get", v1, "-n", &ns, "-o", "name"])?;
            ensure!(listed.contains("/big"), "{listed}");
            let read = get_json(v1, "big", &ns)?;
            ensure!(read["metadata"]["annotations"]["conversion.opkit.dev/v2-too-large"].is_string(), "{}", read["metadata"]);
            let refused = kubectl(&["label", v1, "big", "-n", &ns, "edited=in-v1"]);
            ensure!(
                refused.as_ref().is_err_and(|e| e.to_string().contains("too large to keep in an annotation): write it as stable.example.com/v2")),
                "{refused:?}"
            );
            kubectl(&["label", v2, "big", "-n", &ns, "edited=in-v2"])?;
            kubectl(&["delete", v2, "big", "-n", &ns])?;

            // A list in either version converts every object.
            for (resource, want) in [(v1, "* * * * */5 30 3 * * 1-5"), (v2, "*/5 1-5")] {
                let path = if resource == v1 { "{.items[*].spec.cronSpec}" } else { "{.items[*].spec.schedule.dayOfWeek}" };
                let got = kubectl(&["get", resource, "-n", &ns, "-o", &format!("jsonpath={path}")])?;
                ensure!(got == want, "{resource}: {got:?}");
            }

            // What v2 cannot store is refused, naming the field, and nothing is stored.
            let (ok, out) = apply(
                &ns,
                r#"{"apiVersion":"stable.example.com/v1","kind":"CronTab","metadata":{"name":"hourly"},"spec":{"cronSpec":"@hourly","image":"busybox"}}"#,
            )?;
            ensure!(!ok && out.contains("spec.cronSpec: \"@hourly\" has 1 field;"), "{out}");
            let left = kubectl(&["get", v2, "-n", &ns, "-o", "name"])?;
            ensure!(!left.contains("hourly"), "{left}");
            Ok(())
        })
        .await;
}

/// Makes `version` the storage version of the CronTab CRD.
fn store_crontabs_as(version: &str) -> anyhow::Result<()> {
    let crd: serde_json::Value = serde_json::from_str(&kubectl(&[
        "get",
        "crd",
        "crontabs.stable.example.com",
        "-o",
        "json",
    ])?)?;
    let ops: Vec<serde_json::Value> = crd["spec"]["versions"]
        .as_array()
        .context("versions")?
        .iter()
        .enumerate()
        .map(|(i, v)| serde_json::json!({"op": "replace", "path": format!("/spec/versions/{i}/storage"), "value": v["name"] == version}))
        .collect();
    kubectl(&[
        "patch",
        "crd",
        "crontabs.stable.example.com",
        "--type",
        "json",
        "-p",
        &serde_json::to_string(&ops)?,
    ])?;
    Ok(())
}

#[tokio::test]
async fn migrating_the_storage_version_goes_past_refused_objects_and_trims_stored_versions_once_all_are_rewritten()
 {
    use serde_json::json;
    shared()
        .in_namespace("migrate", |_client, ns| async move {
            let _turn = ONE_OPERATOR.lock().await;
            install_crds()?;
            let log = std::env::temp_dir().join(format!("opkit-migrate-{ns}.log"));
            let _op = crontab_operator(&ns, &log)?;
            let logs = || std::fs::read_to_string(&log).unwrap_or_default();
            let (v1, v2) = ("crontabs.v1.stable.example.com", "crontabs.v2.stable.example.com");
            // Objects written while v1 was the storage version, some with what v1 cannot say.
            store_crontabs_as("v1")?;
            let result = async {
                let objects = |i: usize| {
                    if i.is_multiple_of(2) {
                        json!({"apiVersion": "stable.example.com/v1", "kind": "CronTab", "metadata": {"name": format!("old-{i}")},
                               "spec": {"cronSpec": format!("{} * * * *", i % 60), "image": "busybox"}})
                    } else {
                        json!({"apiVersion": "stable.example.com/v2", "kind": "CronTab", "metadata": {"name": format!("old-{i}")},
                               "spec": {"schedule": {"minute": "0", "hour": format!("{}", i % 24), "dayOfMonth": "*", "month": "*", "dayOfWeek": "*"},
                                        "timeZone": "Asia/Shanghai", "image": "busybox", "replicas": 3}})
                    }
                };
                wait_for("the conversion webhook", T, || async {
                    apply(&ns, &objects(0).to_string()).and_then(|(ok, out)| if ok { Ok(()) } else { Err(anyhow::anyhow!(out)) })
                })
                .await
                .with_context(logs)?;
                for i in 1..20 {
                    let (ok, out) = apply(&ns, &objects(i).to_string())?;
                    ensure!(ok, "{out}");
                }
                store_crontabs_as("v2")?;
                let stored = kubectl(&["get", "crd", "crontabs.stable.example.com", "-o", "jsonpath={.status.storedVersions}"])?;
                ensure!(stored.contains("v1") && stored.contains("v2"), "{stored}");
                // What every object means, in both versions, before.
                let specs = |resource: &'static str| {
                    let ns = ns.clone();
                    move || -> anyhow::Result<Vec<serde_json::Value>> {
                        let list: serde_json::Value =
                            serde_json::from_str(&kubectl(&["get", resource, "-n", &ns, "-o", "json"])?)?;
                        Ok(list["items"].as_array().context("items")?.iter().map(|o| json!([o["metadata"]["name"], o["spec"]])).collect())
                    }
                };
                let before = (specs(v1)()?, specs(v2)()?);
                ensure!(before.0.len() == 20, "{:?}", before.0);

                // A policy refuses any update of two of them: the migration goes past them,
                // names both, and leaves storedVersions as it was.
                let policy = format!("refuse-rewrites-{ns}");
                let refuse = json!({
                    "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
                    "metadata": {"name": policy},
                    "spec": {
                        "failurePolicy": "Fail",
                        "matchConstraints": {
                            "resourceRules": [{"apiGroups": ["stable.example.com"], "apiVersions": ["*"], "operations": ["UPDATE"], "resources": ["crontabs"]}],
                            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
                        },
                        "validations": [{"expression": "!(object.metadata.name in ['old-3', 'old-4'])", "message": "not these two"}],
                    },
                });
                let binding = json!({
                    "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
                    "metadata": {"name": policy},
                    "spec": {"policyName": policy, "validationActions": ["Deny"]},
                });
                for o in [&refuse, &binding] {
                    let (ok, out) = apply(&ns, &o.to_string())?;
                    ensure!(ok, "{out}");
                }
                wait_for("the policy to refuse updates of old-3", T, || async {
                    let r = kubectl(&["label", "crontab", "old-3", "-n", &ns, "probe=x", "--overwrite"]);
                    ensure!(r.as_ref().is_err_and(|e| e.to_string().contains("not these two")), "{r:?}");
                    Ok(())
                })
                .await?;
                let out = common::opkit(&["migrate-storage", "--crd", "crontabs.stable.example.com"]).output()?;
                let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
                ensure!(!out.status.success(), "{said}");
                // The migration covers every namespace: tests running beside this one may
                // have CronTabs of their own, so at least this namespace's 18 were rewritten.
                let counts = said.split_once(" objects could not be rewritten (").and_then(|(before, rest)| {
                    let failed = before.rsplit(' ').next()?.parse::<usize>().ok()?;
                    let rewritten = rest.split_once(" were)")?.0.parse::<usize>().ok()?;
                    Some((failed, rewritten))
                });
                ensure!(
                    counts.is_some_and(|(failed, rewritten)| failed == 2 && rewritten >= 18)
                        && said.contains(&format!("{ns}/old-3: "))
                        && said.contains(&format!("{ns}/old-4: ")),
                    "{said}"
                );
                let stored = kubectl(&["get", "crd", "crontabs.stable.example.com", "-o", "jsonpath={.status.storedVersions}"])?;
                ensure!(stored.contains("v1"), "storedVersions trimmed after a failure: {stored}");
                kubectl(&["delete", "validatingadmissionpolicybinding,validatingadmissionpolicy", &policy])?;
                wait_for("the policy to be gone", T, || async {
                    kubectl(&["label", "crontab", "old-3", "-n", &ns, "probe=y", "--overwrite"]).map(|_| ())
                })
                .await?;

                let out = common::opkit(&["migrate-storage", "--crd", "crontabs.stable.example.com"]).output()?;
                let said = String::from_utf8_lossy(&out.stdout).to_string();
                ensure!(out.status.success(), "{said}{}", String::from_utf8_lossy(&out.stderr));
                ensure!(said.contains("rewritten in v2"), "{said}");
                let stored = kubectl(&["get", "crd", "crontabs.stable.example.com", "-o", "jsonpath={.status.storedVersions}"])?;
                ensure!(stored == r#"["v2"]"#, "{stored}");
                let after = (specs(v1)()?, specs(v2)()?);
                ensure!(after == before, "changed in meaning:\nbefore {before:?}\nafter {after:?}");
                anyhow::Ok(())
            }
            .await;
            // Whatever happened, the CRD stores v2 again for the other tests.
            store_crontabs_as("v2")?;
            result
        })
        .await;
}
