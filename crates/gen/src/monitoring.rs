//! What a Prometheus Operator and Grafana need to watch an opkit operator, generated from one
//! list of alerts and one of panels: the ServiceMonitor Kubebuilder scaffolds, a
//! PrometheusRule, and two Grafana dashboards (controllers, webhooks and API). Every
//! expression is written on controller-runtime's metric names, so the same alerts and
//! dashboards also work for the Go operators an SRE already runs.
use serde_json::{Value, json};

use opkit_runtime::Operator;

/// The `job` label Prometheus gives the operator's metrics when a ServiceMonitor selects its
/// metrics Service: the Service's name.
pub fn job<S>(op: &Operator<S>) -> String {
    crate::manifests::metrics_service_name(op)
}

/// One alerting rule. `expr` is what is measured and `threshold` the comparison that makes it
/// fire, kept apart so a test can check that what is measured returns data.
#[derive(Debug, Clone)]
pub struct Alert {
    /// Rule name, `Opkit…`.
    pub name: &'static str,
    /// PromQL of the measured value; `$job` stands for the operator's job label.
    pub expr: &'static str,
    /// Appended to `expr`: e.g. `> 0`.
    pub threshold: &'static str,
    /// How long the condition must hold before the alert fires.
    pub for_: &'static str,
    /// `warning` or `critical`.
    pub severity: &'static str,
    /// One line, with `{{ $labels.x }}` placeholders.
    pub summary: &'static str,
    /// What to do about it.
    pub action: &'static str,
}

impl Alert {
    /// The full rule expression for `job`. In parentheses: a comparison binds tighter than
    /// `or`, so `a or b > 1` would fire on any `a`.
    pub fn rule(&self, job: &str) -> String {
        format!("({}) {}", self.expr.replace("$job", job), self.threshold)
    }
}

/// The alerts a maintainer of an opkit operator wants, in `config/prometheus/rules.yaml`.
pub fn alerts() -> Vec<Alert> {
    vec![
        Alert {
            name: "OpkitReconcileErrors",
            expr: r#"sum by (namespace, controller) (rate(controller_runtime_reconcile_errors_total{job="$job"}[5m]))"#,
            threshold: "> 0.1",
            for_: "15m",
            severity: "warning",
            summary: "Controller {{ $labels.controller }} fails more than one reconcile in ten seconds",
            action: "kubectl describe the objects of that kind: the Ready condition and Warning Events name the failing step; the operator's log has each error.",
        },
        Alert {
            name: "OpkitReconcilePanics",
            expr: r#"sum by (namespace, controller) (increase(controller_runtime_reconcile_panics_total{job="$job"}[10m]))"#,
            threshold: "> 0",
            for_: "0m",
            severity: "critical",
            summary: "Controller {{ $labels.controller }} panicked while reconciling",
            action: "A bug in the controller's plan or observe: the log line `the reconcile panicked` names the object; it is retried with backoff meanwhile.",
        },
        Alert {
            name: "OpkitWorkQueueGrowing",
            expr: r#"sum by (namespace, controller) (workqueue_depth{job="$job"})"#,
            threshold: "> 100",
            for_: "10m",
            severity: "warning",
            summary: "{{ $value }} objects of controller {{ $labels.controller }} have waited for a reconcile for ten minutes",
            action: "Reconciles are slower than changes arrive: check workqueue_work_duration_seconds and API errors; raise --tune <controller>.concurrency or fix what makes them slow.",
        },
        Alert {
            name: "OpkitSlowReconciles",
            expr: r#"histogram_quantile(0.99, sum by (namespace, controller, le) (rate(controller_runtime_reconcile_time_seconds_bucket{job="$job"}[10m])))"#,
            threshold: "> 30",
            for_: "15m",
            severity: "warning",
            summary: "The slowest reconciles of controller {{ $labels.controller }} take over 30 s",
            action: "A reconcile waits on a slow API call or an outside step: see rest_client_request_duration_seconds and the controller's timeout (--tune <controller>.timeout).",
        },
        Alert {
            name: "OpkitNoLeader",
            // Member Leases of sharded replicas (`<leader Lease>-member-<member>`) aside.
            expr: r#"max by (namespace) (leader_election_master_status{job="$job",name!~".+-member-.+"})"#,
            threshold: "< 1",
            for_: "5m",
            severity: "critical",
            summary: "No replica of the operator in {{ $labels.namespace }} has held the leader Lease for five minutes",
            action: "Nothing is reconciled. kubectl get lease -n <namespace>: a holder that does not renew, or replicas that cannot reach the apiserver (their log says why).",
        },
        Alert {
            name: "OpkitDown",
            // `or vector(0)`: a job gone from Prometheus altogether (no target left) is down too.
            expr: r#"max(up{job="$job"}) or vector(0)"#,
            threshold: "< 1",
            for_: "10m",
            severity: "critical",
            summary: "Prometheus has not scraped the operator for ten minutes",
            action: "kubectl get pods of the operator's Deployment: crash loop, pending, or a metrics Service or NetworkPolicy that no longer lets Prometheus in.",
        },
        Alert {
            name: "OpkitWebhookSlow",
            expr: r#"histogram_quantile(0.99, sum by (namespace, webhook, le) (rate(controller_runtime_webhook_latency_seconds_bucket{job="$job"}[5m])))"#,
            threshold: "> 2.5",
            for_: "10m",
            severity: "warning",
            summary: "Webhook {{ $labels.webhook }} answers in over half the apiserver's 5 s timeout",
            action: "Past the timeout the apiserver refuses the request (failurePolicy Fail): check the operator's CPU limit and controller_runtime_webhook_requests_in_flight.",
        },
        Alert {
            name: "OpkitWebhookErrors",
            // `or … * 0`: no server error at all is a rate of 0, not no data.
            expr: r#"sum by (namespace, webhook) (rate(controller_runtime_webhook_requests_total{job="$job",code=~"5.."}[5m])) or sum by (namespace, webhook) (rate(controller_runtime_webhook_requests_total{job="$job"}[5m])) * 0"#,
            threshold: "> 0",
            for_: "10m",
            severity: "warning",
            summary: "Webhook {{ $labels.webhook }} answers with server errors",
            action: "The operator's log has the failing reviews; a refused conversion or admission reaches the client as the apiserver's error.",
        },
        Alert {
            name: "OpkitWritesRefused",
            expr: r#"sum by (namespace, controller) (increase(opkit_api_writes_refused_total{job="$job"}[5m]))"#,
            threshold: "> 0",
            for_: "5m",
            severity: "warning",
            summary: "Writes of controller {{ $labels.controller }} are refused by the leader-election gate",
            action: "This replica may no longer lead but keeps trying to write: its Lease renewals fail. Check its connection to the apiserver and the Lease holder.",
        },
        Alert {
            name: "OpkitUndecodableObjects",
            expr: r#"sum by (namespace, controller, kind) (increase(opkit_watch_objects_undecodable_total{job="$job"}[10m]))"#,
            threshold: "> 0",
            for_: "0m",
            severity: "warning",
            summary: "Controller {{ $labels.controller }} cannot read some {{ $labels.kind }} objects and acts on the copies it had",
            action: "The log line `a watched object does not decode` names the field (and the object, where the watch knows it). The server sends what the operator's types do not read: a newer version of the kind, or an object its schema let through. Upgrade the operator or fix the object.",
        },
        Alert {
            name: "OpkitAPIErrors",
            expr: r#"sum by (namespace) (rate(rest_client_requests_total{job="$job",code=~"5..|<error>"}[5m])) or sum by (namespace) (rate(rest_client_requests_total{job="$job"}[5m])) * 0"#,
            threshold: "> 0.5",
            for_: "10m",
            severity: "warning",
            summary: "The operator's requests to the Kubernetes API fail (5xx or no answer)",
            action: "An overloaded or unreachable apiserver: the operator retries with backoff; check the apiserver and the network between them.",
        },
    ]
}

/// The PrometheusRule holding [`alerts`] for the operator's job.
pub fn prometheus_rule<S>(op: &Operator<S>) -> Value {
    let job = job(op);
    let rules: Vec<Value> = alerts()
        .iter()
        .map(|a| {
            json!({
                "alert": a.name,
                "expr": a.rule(&job),
                "for": a.for_,
                "labels": {"severity": a.severity},
                "annotations": {"summary": a.summary, "description": a.action},
            })
        })
        .collect();
    json!({
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": format!("{}-alerts", op.manager()),
            "namespace": op.namespace(),
            "labels": crate::manifests::labels(op),
        },
        "spec": {"groups": [{"name": op.name, "rules": rules}]},
    })
}

/// One dashboard panel: a time series of one or more queries.
#[derive(Debug, Clone)]
pub struct Panel {
    /// Shown above the panel.
    pub title: &'static str,
    /// What the panel shows and how to read it (Grafana shows it as the panel's tooltip).
    pub description: &'static str,
    /// Grafana unit (`ops`, `s`, `bytes`, `short`, `percentunit`).
    pub unit: &'static str,
    /// (PromQL, legend); `$job` is the dashboard's job variable.
    pub queries: Vec<(&'static str, &'static str)>,
}

/// A dashboard: file name, title, rows of panels.
#[derive(Debug, Clone)]
pub struct Dashboard {
    /// File name under `grafana/`.
    pub file: &'static str,
    /// Title and uid stem.
    pub title: &'static str,
    /// Rows: a title and its panels.
    pub rows: Vec<(&'static str, Vec<Panel>)>,
}

fn panel(
    title: &'static str,
    unit: &'static str,
    description: &'static str,
    queries: &[(&'static str, &'static str)],
) -> Panel {
    Panel {
        title,
        description,
        unit,
        queries: queries.to_vec(),
    }
}

/// The two dashboards: controllers (reconciles, work queue, resources) and webhooks and API.
pub fn dashboards() -> Vec<Dashboard> {
    vec![
        Dashboard {
            file: "controllers.json",
            title: "Controllers",
            rows: vec![
                (
                    "Reconciles",
                    vec![
                        panel(
                            "Reconciles per second",
                            "ops",
                            "Finished reconciles by controller and result (success, error).",
                            &[(
                                r#"sum by (controller, result) (rate(controller_runtime_reconcile_total{job=~"$job"}[$__rate_interval]))"#,
                                "{{controller}} {{result}}",
                            )],
                        ),
                        panel(
                            "Reconcile errors per second",
                            "ops",
                            "Failed reconciles by controller; terminal ones are invalid specs, shown on the objects as a condition.",
                            &[
                                (
                                    r#"sum by (controller) (rate(controller_runtime_reconcile_errors_total{job=~"$job"}[$__rate_interval]))"#,
                                    "{{controller}}",
                                ),
                                (
                                    r#"sum by (controller) (rate(controller_runtime_terminal_reconcile_errors_total{job=~"$job"}[$__rate_interval]))"#,
                                    "{{controller}} terminal",
                                ),
                            ],
                        ),
                        panel(
                            "Reconcile time (p50, p99)",
                            "s",
                            "How long reconciles take, from the start of the work to its end.",
                            &[
                                (
                                    r#"histogram_quantile(0.5, sum by (controller, le) (rate(controller_runtime_reconcile_time_seconds_bucket{job=~"$job"}[$__rate_interval])))"#,
                                    "{{controller}} p50",
                                ),
                                (
                                    r#"histogram_quantile(0.99, sum by (controller, le) (rate(controller_runtime_reconcile_time_seconds_bucket{job=~"$job"}[$__rate_interval])))"#,
                                    "{{controller}} p99",
                                ),
                            ],
                        ),
                        panel(
                            "Workers in use",
                            "short",
                            "Reconciles running now against the most that may run at once (0: unbounded).",
                            &[
                                (
                                    r#"sum by (controller) (controller_runtime_active_workers{job=~"$job"})"#,
                                    "{{controller}} active",
                                ),
                                (
                                    r#"max by (controller) (controller_runtime_max_concurrent_reconciles{job=~"$job"})"#,
                                    "{{controller}} max",
                                ),
                            ],
                        ),
                    ],
                ),
                (
                    "Work queue",
                    vec![
                        panel(
                            "Queue depth",
                            "short",
                            "Objects waiting for a reconcile. Growing for minutes: reconciles are slower than changes arrive.",
                            &[(
                                r#"sum by (controller) (workqueue_depth{job=~"$job"})"#,
                                "{{controller}}",
                            )],
                        ),
                        panel(
                            "Adds and retries per second",
                            "ops",
                            "Reconciles asked for (by watch events or requeues) and failed ones retried with backoff.",
                            &[
                                (
                                    r#"sum by (controller) (rate(workqueue_adds_total{job=~"$job"}[$__rate_interval]))"#,
                                    "{{controller}} adds",
                                ),
                                (
                                    r#"sum by (controller) (rate(workqueue_retries_total{job=~"$job"}[$__rate_interval]))"#,
                                    "{{controller}} retries",
                                ),
                            ],
                        ),
                        panel(
                            "Time in queue (p99)",
                            "s",
                            "How long an object waits between being asked for and a worker starting on it.",
                            &[(
                                r#"histogram_quantile(0.99, sum by (controller, le) (rate(workqueue_queue_duration_seconds_bucket{job=~"$job"}[$__rate_interval])))"#,
                                "{{controller}}",
                            )],
                        ),
                        panel(
                            "Longest running and unfinished work",
                            "s",
                            "The oldest reconcile still running, and the seconds of all running ones: a stuck reconcile shows as a line that keeps rising.",
                            &[
                                (
                                    r#"max by (controller) (workqueue_longest_running_processor_seconds{job=~"$job"})"#,
                                    "{{controller}} longest",
                                ),
                                (
                                    r#"sum by (controller) (workqueue_unfinished_work_seconds{job=~"$job"})"#,
                                    "{{controller}} unfinished",
                                ),
                            ],
                        ),
                    ],
                ),
                (
                    "Writes and caches",
                    vec![
                        panel(
                            "API writes per second",
                            "ops",
                            "What the controllers wrote, by verb; no-op writes are skipped before they are sent.",
                            &[(
                                r#"sum by (controller, verb) (rate(opkit_api_writes_total{job=~"$job"}[$__rate_interval]))"#,
                                "{{controller}} {{verb}}",
                            )],
                        ),
                        panel(
                            "Cached objects",
                            "short",
                            "Objects held in each controller's caches, by kind.",
                            &[(
                                r#"sum by (controller, kind) (opkit_cache_objects{job=~"$job"})"#,
                                "{{controller}} {{kind}}",
                            )],
                        ),
                    ],
                ),
                (
                    "Leadership and resources",
                    vec![
                        panel(
                            "Leader",
                            "short",
                            "1 on the replica that holds the Lease; exactly one line at 1 is healthy.",
                            &[(
                                r#"max by (pod, name) (leader_election_master_status{job=~"$job"})"#,
                                "{{pod}} {{name}}",
                            )],
                        ),
                        panel(
                            "CPU",
                            "short",
                            "CPU used per replica, in cores.",
                            &[(
                                r#"sum by (pod) (rate(process_cpu_seconds_total{job=~"$job"}[$__rate_interval]))"#,
                                "{{pod}}",
                            )],
                        ),
                        panel(
                            "Resident memory",
                            "bytes",
                            "Memory per replica; the caches are most of it.",
                            &[(
                                r#"sum by (pod) (process_resident_memory_bytes{job=~"$job"})"#,
                                "{{pod}}",
                            )],
                        ),
                        panel(
                            "Open file descriptors",
                            "short",
                            "Sockets and files open per replica, against the limit.",
                            &[
                                (r#"sum by (pod) (process_open_fds{job=~"$job"})"#, "{{pod}} open"),
                                (r#"max by (pod) (process_max_fds{job=~"$job"})"#, "{{pod}} max"),
                            ],
                        ),
                    ],
                ),
            ],
        },
        Dashboard {
            file: "webhooks.json",
            title: "Webhooks and API",
            rows: vec![
                (
                    "Webhooks",
                    vec![
                        panel(
                            "Webhook requests per second",
                            "ops",
                            "Admission and conversion reviews answered, by path and HTTP code.",
                            &[(
                                r#"sum by (webhook, code) (rate(controller_runtime_webhook_requests_total{job=~"$job"}[$__rate_interval]))"#,
                                "{{webhook}} {{code}}",
                            )],
                        ),
                        panel(
                            "Webhook latency (p50, p99)",
                            "s",
                            "Time to answer a review; the apiserver gives up after 5 s.",
                            &[
                                (
                                    r#"histogram_quantile(0.5, sum by (webhook, le) (rate(controller_runtime_webhook_latency_seconds_bucket{job=~"$job"}[$__rate_interval])))"#,
                                    "{{webhook}} p50",
                                ),
                                (
                                    r#"histogram_quantile(0.99, sum by (webhook, le) (rate(controller_runtime_webhook_latency_seconds_bucket{job=~"$job"}[$__rate_interval])))"#,
                                    "{{webhook}} p99",
                                ),
                            ],
                        ),
                        panel(
                            "Webhook requests in flight",
                            "short",
                            "Reviews being answered now.",
                            &[(
                                r#"sum by (webhook) (controller_runtime_webhook_requests_in_flight{job=~"$job"})"#,
                                "{{webhook}}",
                            )],
                        ),
                    ],
                ),
                (
                    "Kubernetes API",
                    vec![
                        panel(
                            "API requests per second",
                            "ops",
                            "Requests to the apiserver by method and status code (`<error>`: no answer).",
                            &[(
                                r#"sum by (method, code) (rate(rest_client_requests_total{job=~"$job"}[$__rate_interval]))"#,
                                "{{method}} {{code}}",
                            )],
                        ),
                        panel(
                            "API latency (p99)",
                            "s",
                            "Time until the apiserver's answer starts, by verb.",
                            &[(
                                r#"histogram_quantile(0.99, sum by (verb, le) (rate(rest_client_request_duration_seconds_bucket{job=~"$job"}[$__rate_interval])))"#,
                                "{{verb}}",
                            )],
                        ),
                        panel(
                            "Requests without an answer in time",
                            "ops",
                            "Requests cut at their deadline, by reason (request timeout, write gate closing).",
                            &[(
                                r#"sum by (reason) (rate(opkit_api_request_timeouts_total{job=~"$job"}[$__rate_interval]))"#,
                                "{{reason}}",
                            )],
                        ),
                    ],
                ),
            ],
        },
    ]
}

/// A dashboard as Grafana's JSON model, with a data source and a job variable.
pub fn dashboard_json<S>(op: &Operator<S>, d: &Dashboard) -> Value {
    let mut panels = Vec::new();
    let (mut id, mut y) = (1, 0);
    for (row, row_panels) in &d.rows {
        panels.push(json!({
            "id": id, "type": "row", "title": row, "collapsed": false,
            "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
        }));
        id += 1;
        y += 1;
        for (i, p) in row_panels.iter().enumerate() {
            let targets: Vec<Value> = p
                .queries
                .iter()
                .enumerate()
                .map(|(k, (expr, legend))| {
                    json!({
                        "datasource": {"type": "prometheus", "uid": "${datasource}"},
                        "expr": expr,
                        "legendFormat": legend,
                        "refId": ((b'A' + k as u8) as char).to_string(),
                    })
                })
                .collect();
            panels.push(json!({
                "id": id,
                "type": "timeseries",
                "title": p.title,
                "description": p.description,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
                "gridPos": {"h": 8, "w": 12, "x": (i % 2) * 12, "y": y + (i / 2) as i32 * 8},
                "targets": targets,
            }));
            id += 1;
        }
        y += (row_panels.len().div_ceil(2) * 8) as i32;
    }
    json!({
        "title": format!("{} / {}", op.name, d.title),
        "uid": format!("{}-{}", op.name, d.file.trim_end_matches(".json")),
        "tags": [op.name, "opkit", "controller-runtime"],
        "editable": true,
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "templating": {"list": [
            {
                "name": "datasource", "label": "Data source", "type": "datasource",
                "query": "prometheus", "current": {},
            },
            {
                "name": "job", "label": "Job", "type": "query",
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "query": "label_values(controller_runtime_reconcile_total, job)",
                "definition": "label_values(controller_runtime_reconcile_total, job)",
                "refresh": 2, "includeAll": true, "multi": true,
                "current": {"text": job(op), "value": job(op)},
            },
        ]},
        "panels": panels,
    })
}

/// The dashboards as (file name, JSON text).
pub fn dashboard_files<S>(op: &Operator<S>) -> anyhow::Result<Vec<(String, String)>> {
    dashboards()
        .iter()
        .map(|d| {
            let mut text = serde_json::to_string_pretty(&dashboard_json(op, d))?;
            text.push('\n');
            Ok((d.file.to_string(), text))
        })
        .collect()
}

/// `config/prometheus/` and `config/grafana/`: (relative path, content).
pub fn files<S>(op: &Operator<S>) -> anyhow::Result<Vec<(String, String)>> {
    let mut files = vec![
        (
            "prometheus/monitor.yaml".to_string(),
            crate::manifests::to_yaml(&[crate::manifests::service_monitor(op)])?,
        ),
        (
            "prometheus/rules.yaml".to_string(),
            crate::manifests::to_yaml(&[prometheus_rule(op)])?,
        ),
        (
            "prometheus/kustomization.yaml".to_string(),
            crate::manifests::to_yaml(&[json!({
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": ["monitor.yaml", "rules.yaml"],
            })])?,
        ),
    ];
    for (file, text) in dashboard_files(op)? {
        files.push((format!("grafana/{file}"), text));
    }
    Ok(files)
}

/// Every PromQL expression of the dashboards and alerts, with `$job` (and Grafana's
/// `$__rate_interval`) replaced: what a test runs against a real Prometheus.
pub fn expressions<S>(op: &Operator<S>, rate_interval: &str) -> Vec<(String, String)> {
    let job = job(op);
    let mut out: Vec<(String, String)> = alerts()
        .iter()
        .map(|a| (format!("alert {}", a.name), a.expr.replace("$job", &job)))
        .collect();
    for d in dashboards() {
        for (_, panels) in &d.rows {
            for p in panels {
                for (expr, _) in &p.queries {
                    out.push((
                        format!("{} / {}", d.title, p.title),
                        expr.replace("$__rate_interval", rate_interval)
                            .replace("$job", &job),
                    ));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_expression_names_the_job_and_no_placeholder_is_left() {
        let op: Operator<()> = Operator {
            name: "demo",
            version: "0.1.0",
            about: "",
            registry: opkit_runtime::Registry::new(Vec::new()),
        };
        let exprs = expressions(&op, "1m");
        assert!(exprs.len() > 30, "{}", exprs.len());
        for (what, e) in &exprs {
            assert!(
                e.contains(r#"job="demo-controller-manager-metrics-service""#)
                    || e.contains(r#"job=~"demo-controller-manager-metrics-service""#),
                "{what}: {e}"
            );
            assert!(!e.contains('$'), "{what}: {e}");
        }
        let rule = prometheus_rule(&op);
        let rules = rule["spec"]["groups"][0]["rules"].as_array().unwrap();
        assert_eq!(rules.len(), alerts().len());
        assert!(rules.iter().all(|r| r["expr"].as_str().unwrap().contains(" > ")
            || r["expr"].as_str().unwrap().contains(" < ")
            || r["expr"].as_str().unwrap().contains(" == ")));
    }
}
