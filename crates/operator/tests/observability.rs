//! The operator as an SRE sees it.
//!
//! Metrics: the real Prometheus (built with the control
//! plane) scrapes `opkit run --metrics-secure` the way the generated ServiceMonitor does
//! (HTTPS, a ServiceAccount token bound to the metrics-reader ClusterRole) while the operator
//! reconciles the samples, admits and converts objects and fails on objects it cannot own.
//! Checked: `promtool check rules` passes on the generated PrometheusRule; the scrape parses
//! (Prometheus's own OpenMetrics parser); every expression of the generated dashboards and
//! alerts returns data through the Prometheus HTTP API; and the reconcile-errors alert fires.
//!
//! Traces: with `OTEL_EXPORTER_OTLP_ENDPOINT` set, the operator sends its spans over OTLP/HTTP
//! to a receiver here that decodes them with the OpenTelemetry protocol's own message types:
//! each reconcile is a trace whose spans are its observe, plan and writes, under the
//! operator's service name, and its JSON log lines carry that trace's id.
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, anyhow, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use opkit_testenv::{http_get, shared, wait_for};

mod common;
use common::{Running, install_crds, kubectl, kubectl_stdin};

const JOB: &str = "opkit-controller-manager-metrics-service";
/// Objects the Memcached controller cannot own (a Deployment of their name exists): each
/// fails its reconciles, with a backoff of at most 2 s.
const CLASHES: usize = 5;

/// A tool built with the control plane.
fn tool(name: &str) -> anyhow::Result<PathBuf> {
    Ok(opkit_testenv::Binaries::ensure()?.path(name))
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Percent-encodes a query parameter.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// `GET /api/v1/<path>` of Prometheus: its `data`.
async fn api(prom: SocketAddr, path: &str) -> anyhow::Result<serde_json::Value> {
    let (code, body) = http_get(prom, &format!("/api/v1/{path}")).await?;
    let v: serde_json::Value =
        serde_json::from_str(&body).with_context(|| format!("{path}: HTTP {code}: {body}"))?;
    ensure!(v["status"] == "success", "{path}: {body}");
    Ok(v["data"].clone())
}

/// The series an instant query returns.
async fn query(prom: SocketAddr, expr: &str) -> anyhow::Result<Vec<serde_json::Value>> {
    let data = api(prom, &format!("query?query={}", encode(expr))).await?;
    Ok(data["result"].as_array().cloned().unwrap_or_default())
}

/// The generated PrometheusRule's groups as a Prometheus rule file, the `for` of `fast`
/// shortened to 5 s (the test cannot wait fifteen minutes; the expression is the same).
fn rule_file(fast: &str) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(repo().join("config/prometheus/rules.yaml"))?;
    let doc = serde_yaml::Deserializer::from_str(&text)
        .map(serde_yaml::Value::deserialize)
        .find_map(Result::ok)
        .context("no document in rules.yaml")?;
    let mut spec = doc.get("spec").cloned().context("no spec")?;
    for group in spec["groups"].as_sequence_mut().context("groups")? {
        for rule in group["rules"].as_sequence_mut().context("rules")? {
            if rule["alert"].as_str() == Some(fast) {
                rule["for"] = "5s".into();
            }
        }
    }
    Ok(serde_yaml::to_string(&spec)?)
}

use serde::Deserialize;

#[tokio::test]
async fn prometheus_scrapes_the_operator_and_every_panel_and_alert_has_data() {
    shared()
        .in_namespace("prometheus", |client, ns| async move {
            install_crds()?;
            let dir = tempdir(&ns)?;

            // promtool on the generated rules (the PrometheusRule's spec is a rule file).
            let rules = dir.join("rules.yaml");
            std::fs::write(&rules, rule_file("OpkitReconcileErrors")?)?;
            let check = Command::new(tool("promtool")?)
                .args(["check", "rules"])
                .arg(&rules)
                .output()?;
            ensure!(
                check.status.success(),
                "promtool check rules: {}{}",
                String::from_utf8_lossy(&check.stdout),
                String::from_utf8_lossy(&check.stderr)
            );

            // Who scrapes: a ServiceAccount bound to the generated metrics-reader ClusterRole,
            // as the Prometheus Operator's own would be.
            let role = std::fs::read(repo().join("config/rbac/metrics_reader_role.yaml"))?;
            let (ok, out) = kubectl_stdin(&["apply", "--server-side", "-f", "-"], &role)?;
            ensure!(ok, "{out}");
            let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), &ns);
            sas.create(
                &PostParams::default(),
                &serde_json::from_value(serde_json::json!({"metadata": {"name": "prometheus"}}))?,
            )
            .await?;
            let crbs: Api<ClusterRoleBinding> = Api::all(client.clone());
            let binding = format!("{ns}-prometheus");
            crbs.create(
                &PostParams::default(),
                &serde_json::from_value(serde_json::json!({
                    "metadata": {"name": binding},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "opkit-metrics-reader"},
                    "subjects": [{"kind": "ServiceAccount", "name": "prometheus", "namespace": ns}],
                }))?,
            )
            .await?;
            let token = common::service_account_token(&client, &ns, "prometheus").await?;
            std::fs::write(dir.join("token"), token)?;

            let (metrics, webhook, prom_port) =
                (common::free_port()?, common::free_port()?, common::free_port()?);
            let log = dir.join("opkit.log");
            let _op = Running(
                Command::new(env!("CARGO_BIN_EXE_opkit"))
                    .args(["run", "--controllers", "memcached,at,crontab", "--namespace", &ns])
                    .args(["--leader-elect", "--leader-election-namespace", &ns])
                    .args(["--metrics-bind-address", &format!("127.0.0.1:{metrics}"), "--metrics-secure"])
                    .args(["--health-probe-bind-address", "0"])
                    .args(["--webhook-bind-address", &format!("127.0.0.1:{webhook}")])
                    .args(["--webhook-url", &format!("https://127.0.0.1:{webhook}")])
                    .args(["--tune", "memcached.backoff-max=2s"])
                    .env("KUBECONFIG", shared().kubeconfig())
                    .env("POD_NAMESPACE", &ns)
                    .stdout(std::fs::File::create(&log)?)
                    .stderr(Stdio::null())
                    .spawn()?,
            );
            let logs = || std::fs::read_to_string(&log).unwrap_or_default();

            let config = format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n- {rules}\nscrape_configs:\n- job_name: {JOB}\n  scheme: https\n  tls_config:\n    insecure_skip_verify: true\n  authorization:\n    credentials_file: {token}\n  static_configs:\n  - targets: ['127.0.0.1:{metrics}']\n",
                rules = rules.display(),
                token = dir.join("token").display(),
            );
            std::fs::write(dir.join("prometheus.yml"), config)?;
            let prom_log = dir.join("prometheus.log");
            let _prom = Running(
                Command::new(tool("prometheus")?)
                    .arg(format!("--config.file={}", dir.join("prometheus.yml").display()))
                    .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
                    .arg(format!("--web.listen-address=127.0.0.1:{prom_port}"))
                    .stdout(Stdio::null())
                    .stderr(std::fs::File::create(&prom_log)?)
                    .spawn()?,
            );
            let prom: SocketAddr = ([127, 0, 0, 1], prom_port).into();

            // The workload: the samples, CronTabs written in v1 (stored as v2: each goes
            // through the conversion webhook), and Memcacheds whose Deployment name is taken.
            for sample in ["cache_v1_memcached.yaml", "cnat_v1alpha1_at.yaml", "stable_v1_crontab.yaml"] {
                let y = std::fs::read(repo().join("config/samples").join(sample))?;
                wait_for(&format!("{sample} to be admitted"), Duration::from_secs(60), || async {
                    let (ok, out) = kubectl_stdin(&["apply", "-n", &ns, "-f", "-"], &y)?;
                    if ok { Ok(()) } else { Err(anyhow!("{out}")) }
                })
                .await?;
            }
            let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
            for i in 0..CLASHES {
                let name = format!("clash-{i}");
                deployments
                    .create(
                        &PostParams::default(),
                        &serde_json::from_value(serde_json::json!({
                            "metadata": {"name": name},
                            "spec": {
                                "replicas": 0,
                                "selector": {"matchLabels": {"app": name}},
                                "template": {
                                    "metadata": {"labels": {"app": name}},
                                    "spec": {"containers": [{"name": "c", "image": "busybox"}]},
                                },
                            },
                        }))?,
                    )
                    .await?;
                let mc = format!(
                    "{{\"apiVersion\":\"cache.example.com/v1\",\"kind\":\"Memcached\",\"metadata\":{{\"name\":\"{name}\"}},\"spec\":{{\"size\":1}}}}"
                );
                let (ok, out) = kubectl_stdin(&["apply", "-n", &ns, "-f", "-"], mc.as_bytes())?;
                ensure!(ok, "{out}");
            }
            // Read back in the other version: converted by the webhook again.
            kubectl(&["get", "crontabs.v2.stable.example.com", "-n", &ns, "-o", "name"])?;

            // Scraped, and parsed: Prometheus reports the target up with no error.
            wait_for("Prometheus to scrape the operator", Duration::from_secs(60), || async {
                let targets = api(prom, "targets").await?;
                let t = targets["activeTargets"]
                    .as_array()
                    .and_then(|a| a.first().cloned())
                    .context("no target yet")?;
                ensure!(
                    t["health"] == "up" && t["lastError"] == "",
                    "target {}: {}",
                    t["health"],
                    t["lastError"]
                );
                Ok(())
            })
            .await
            .with_context(|| format!("--- prometheus log ---\n{}", std::fs::read_to_string(&prom_log).unwrap_or_default()))?;

            // Every expression returns data (rates need two scrapes in their window).
            let op = opkit_controllers::operator();
            let exprs = opkit::monitoring::expressions(&op, "1m");
            let mut empty = Vec::new();
            let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
            for (what, expr) in &exprs {
                loop {
                    let found = query(prom, expr).await?;
                    if !found.is_empty() {
                        break;
                    }
                    if tokio::time::Instant::now() > deadline {
                        empty.push(format!("{what}: {expr}"));
                        break;
                    }
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
            ensure!(
                empty.is_empty(),
                "{} of {} expressions return no data:\n{}\n--- opkit log (tail) ---\n{}",
                empty.len(),
                exprs.len(),
                empty.join("\n"),
                tail(&logs(), 20)
            );

            // The alert on failing reconciles fires, labelled with its controller.
            wait_for("OpkitReconcileErrors to fire", Duration::from_secs(120), || async {
                let alerts = api(prom, "alerts").await?;
                let firing: Vec<&serde_json::Value> = alerts["alerts"]
                    .as_array()
                    .map(|a| a.iter().filter(|a| a["state"] == "firing").collect())
                    .unwrap_or_default();
                ensure!(
                    firing.iter().any(|a| a["labels"]["alertname"] == "OpkitReconcileErrors"
                        && a["labels"]["controller"] == "memcached"),
                    "firing: {firing:?}"
                );
                Ok(())
            })
            .await?;
            // And only that one: a healthy operator raises none of the others.
            let alerts = api(prom, "alerts").await?;
            let others: Vec<String> = alerts["alerts"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter(|a| a["labels"]["alertname"] != "OpkitReconcileErrors")
                        .map(|a| format!("{} {}", a["labels"]["alertname"], a["state"]))
                        .collect()
                })
                .unwrap_or_default();
            ensure!(others.is_empty(), "unexpected alerts: {others:?}");

            crbs.delete(&binding, &DeleteParams::default()).await?;
            Ok(())
        })
        .await;
}

fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// A directory of this test's files, kept after the run for a post-mortem.
fn tempdir(ns: &str) -> anyhow::Result<PathBuf> {
    let d = std::env::temp_dir().join(format!("opkit-{ns}"));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d)?;
    Ok(d)
}

/// One span as received: (trace id, span id, parent span id, name), ids in hex.
type Received = (String, String, String, String);

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// An OTLP/HTTP trace receiver (`POST /v1/traces`, protobuf): every span it was sent, and the
/// service names of their resources.
async fn receive_traces(
    listener: tokio::net::TcpListener,
    spans: std::sync::Arc<std::sync::Mutex<(Vec<Received>, Vec<String>)>>,
) {
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use prost::Message;
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            return;
        };
        let spans = spans.clone();
        tokio::spawn(async move {
            let mut conn = BufReader::new(stream);
            loop {
                // Headers, then a body of Content-Length bytes (the exporter sends whole bodies).
                let mut len = 0usize;
                let mut line = String::new();
                loop {
                    line.clear();
                    if conn.read_line(&mut line).await.unwrap_or(0) == 0 {
                        return;
                    }
                    if line == "\r\n" {
                        break;
                    }
                    if let Some((k, v)) = line.split_once(':')
                        && k.eq_ignore_ascii_case("content-length")
                    {
                        len = v.trim().parse().unwrap_or(0);
                    }
                }
                let mut body = vec![0; len];
                if conn.read_exact(&mut body).await.is_err() {
                    return;
                }
                if let Ok(req) = ExportTraceServiceRequest::decode(body.as_slice()) {
                    let mut got = spans.lock().unwrap_or_else(|p| p.into_inner());
                    for rs in req.resource_spans {
                        for kv in rs.resource.iter().flat_map(|r| r.attributes.iter()) {
                            if kv.key == "service.name"
                                && let Some(
                                    opentelemetry_proto::tonic::common::v1::any_value::Value::StringValue(v),
                                ) = kv.value.as_ref().and_then(|v| v.value.clone())
                            {
                                got.1.push(v);
                            }
                        }
                        for ss in rs.scope_spans {
                            for sp in ss.spans {
                                got.0.push((
                                    hex(&sp.trace_id),
                                    hex(&sp.span_id),
                                    hex(&sp.parent_span_id),
                                    sp.name,
                                ));
                            }
                        }
                    }
                }
                let ok =
                    "HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\n\r\n";
                if conn.get_mut().write_all(ok.as_bytes()).await.is_err() {
                    return;
                }
            }
        });
    }
}

#[tokio::test]
async fn reconciles_are_traced_over_otlp_and_their_logs_carry_the_trace_id() {
    shared()
        .in_namespace("tracing", |_client, ns| async move {
            install_crds()?;
            let dir = tempdir(&ns)?;
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            let port = listener.local_addr()?.port();
            let spans: std::sync::Arc<std::sync::Mutex<(Vec<Received>, Vec<String>)>> = Default::default();
            let receiver = tokio::spawn(receive_traces(listener, spans.clone()));

            let log = dir.join("opkit.log");
            let _op = Running(
                Command::new(env!("CARGO_BIN_EXE_opkit"))
                    .args([
                        "run",
                        "--controllers",
                        "memcached",
                        "--namespace",
                        &ns,
                        "--log-format",
                        "json",
                    ])
                    .args(["--metrics-bind-address", "0", "--health-probe-bind-address", "0"])
                    .args(["--webhook-bind-address", "0"])
                    .env("KUBECONFIG", shared().kubeconfig())
                    .env("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://127.0.0.1:{port}"))
                    .env("OTEL_BSP_SCHEDULE_DELAY", "500")
                    .env("RUST_LOG", "info,opkit=debug")
                    .stdout(std::fs::File::create(&log)?)
                    .stderr(Stdio::null())
                    .spawn()?,
            );
            let y = std::fs::read(repo().join("config/samples/cache_v1_memcached.yaml"))?;
            let (ok, out) = kubectl_stdin(&["apply", "-n", &ns, "-f", "-"], &y)?;
            ensure!(ok, "{out}");

            // A reconcile that wrote: its trace holds observe, plan and the child's apply.
            let trace = wait_for(
                "a reconcile traced with its steps",
                Duration::from_secs(60),
                || async {
                    let got = spans.lock().unwrap_or_else(|p| p.into_inner()).0.clone();
                    let reconciles: Vec<&Received> = got.iter().filter(|s| s.3 == "reconcile").collect();
                    for r in &reconciles {
                        let children: Vec<&str> = got
                            .iter()
                            .filter(|s| s.0 == r.0 && s.2 == r.1)
                            .map(|s| s.3.as_str())
                            .collect();
                        if ["observe", "plan", "apply"].iter().all(|n| children.contains(n)) {
                            return Ok(r.0.clone());
                        }
                    }
                    Err(anyhow!(
                        "{} spans, {} reconciles: {:?}",
                        got.len(),
                        reconciles.len(),
                        got.iter()
                            .map(|s| s.3.as_str())
                            .collect::<std::collections::BTreeSet<_>>()
                    ))
                },
            )
            .await
            .with_context(|| {
                format!(
                    "--- opkit log (tail) ---\n{}",
                    tail(&std::fs::read_to_string(&log).unwrap_or_default(), 20)
                )
            })?;
            let services = spans.lock().unwrap_or_else(|p| p.into_inner()).1.clone();
            ensure!(
                services.iter().all(|s| s == "opkit") && !services.is_empty(),
                "service names {services:?}"
            );

            // The reconcile's JSON log lines carry the same trace id.
            wait_for(
                "a log line with the trace id",
                Duration::from_secs(10),
                || async {
                    let text = std::fs::read_to_string(&log)?;
                    let found = text
                        .lines()
                        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                        // The object's name under its own key: `name` is the span's.
                        .any(|v| {
                            v["span"]["trace_id"] == trace.as_str()
                                && v["span"]["object"] == "example-memcached"
                        });
                    if found {
                        Ok(())
                    } else {
                        Err(anyhow!("no log line in trace {trace}"))
                    }
                },
            )
            .await?;
            receiver.abort();
            Ok(())
        })
        .await;
}
