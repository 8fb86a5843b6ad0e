//! The Helm chart under `dist/chart/` (`make helm`): the objects of `config/`, built by the
//! same functions of [`crate::manifests`], with what a user sets at install time made values.
//!
//! - **CRDs** are templates (`templates/crd/`), not Helm's `crds/` directory: Helm installs
//!   `crds/` once and never upgrades it, so a new version of the operator would run against
//!   old schemas. They carry `helm.sh/resource-policy: keep` unless `crd.keep=false`:
//!   `helm uninstall` leaves them, and with them every custom object, in place.
//! - **Names** are the operator's, not the release's: the operator finds its Lease, webhook
//!   configurations, Service and certificate Secret by those names. One release per cluster.
//! - **The namespace** is the release's; Helm does not label it, so `pod-security.kubernetes.io/
//!   enforce: restricted` (which `config/` sets) is the user's to add.
//! - **Sharding** (`sharding.enable`) is `config/sharding` with `manager.replicas` replicas:
//!   `--sharding`, `--sharding-slots=<manager.replicas>` and the member-Lease Role. Without leader election the render fails, as
//!   `opkit run` would.
use anyhow::{Context, bail, ensure};
use kube::ResourceExt;

use crate::manifests::{self, to_yaml};
use opkit_runtime::Operator;

/// Where `make helm` writes the chart.
pub const DIR: &str = "dist/chart";

/// `$` so that it also reads inside a `range`.
const RELEASE_NAMESPACE: &str = "{{ $.Release.Namespace }}";

/// Every file of the chart, relative to its directory.
pub fn chart<S>(op: &Operator<S>) -> anyhow::Result<Vec<(String, String)>> {
    let ns = op.namespace();
    let mut files = vec![
        ("Chart.yaml".to_string(), chart_yaml(op)),
        ("values.yaml".to_string(), values_yaml(op)?),
        (
            ".helmignore".to_string(),
            "# Patterns to ignore when packaging.\n.git/\n*.orig\n*.rej\n".to_string(),
        ),
        ("templates/NOTES.txt".to_string(), notes(op)),
    ];

    let webhooks = manifests::webhooks(op)?;
    for mut crd in manifests::crds(op)? {
        let converted = crd
            .spec
            .conversion
            .as_ref()
            .is_some_and(|c| c.strategy == "Webhook");
        crd.annotations_mut()
            .insert("helm.sh/resource-policy".into(), "__KEEP__".into());
        let mut body = template(&ns, &crd)?;
        body = replace_line(&body, "helm.sh/resource-policy: __KEEP__", |indent| {
            format!(
                "{indent}{{{{- if .Values.crd.keep }}}}\n{indent}helm.sh/resource-policy: keep\n{indent}{{{{- end }}}}"
            )
        })?;
        let guard = if converted {
            format!(
                "{{{{- if not .Values.webhook.enable }}}}\n{{{{- fail \"{} is served in several versions converted by the operator's webhook: webhook.enable must stay true\" }}}}\n{{{{- end }}}}\n",
                crd.name_any()
            )
        } else {
            String::new()
        };
        files.push((
            format!("templates/crd/{}.yaml", crd.name_any()),
            format!("{guard}{{{{- if .Values.crd.enable }}}}\n{body}{{{{- end }}}}\n"),
        ));
    }

    // RBAC: the ClusterRole holds every controller's rules, or (confined to namespaces) only
    // what stays cluster-wide, with a Role in each namespace.
    let yaml_rules = |rules: &[k8s_openapi::api::rbac::v1::PolicyRule]| -> anyhow::Result<String> {
        if rules.is_empty() {
            return Ok(String::new());
        }
        Ok(crate::yaml::to_string(&rules)?)
    };
    let controllers = yaml_rules(&op.registry.rbac())? + &run_time_rules(op);
    let webhook_rules = yaml_rules(&opkit_runtime::webhook::rbac_rules(op.name, &webhooks))?;
    let crd_rule = yaml_rules(&[manifests::crd_read_rule(op)])?;
    let metrics_rules = yaml_rules(&manifests::metrics_auth_rules())?;
    let labels = labels_yaml(op, "    ")?;
    let role_name = format!("{}-manager-role", op.name);
    files.push((
        "templates/rbac/role.yaml".into(),
        format!(
            "apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRole\nmetadata:\n  name: {role_name}\nrules:\n\
             {{{{- if not .Values.manager.namespaces }}}}\n{controllers}{{{{- end }}}}\n\
             {{{{- if .Values.webhook.enable }}}}\n{webhook_rules}{{{{- end }}}}\n\
             {crd_rule}\
             {{{{- if and .Values.metrics.enable .Values.metrics.secure }}}}\n{metrics_rules}{{{{- end }}}}\n\
             {{{{- range .Values.manager.namespaces }}}}\n---\napiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata:\n  name: {role_name}\n  namespace: {{{{ . }}}}\n  labels:\n{labels}rules:\n{controllers}{{{{- end }}}}\n"
        ),
    ));
    let binding = template(&ns, &manifests::manager_cluster_role_binding(op))?;
    let ns_binding = template(&ns, &manifests::manager_role_binding(op, "__EACH__"))?
        .replace("namespace: __EACH__", "namespace: {{ . }}");
    files.push((
        "templates/rbac/role_binding.yaml".into(),
        format!("{binding}{{{{- range .Values.manager.namespaces }}}}\n---\n{ns_binding}{{{{- end }}}}\n"),
    ));
    let (leader_role, leader_binding) = manifests::own_namespace_role(op);
    files.push((
        "templates/rbac/leader_election_role.yaml".into(),
        pair(&ns, &leader_role, &leader_binding)?,
    ));
    let (sharding_role, sharding_binding) = manifests::sharding_role(op);
    files.push((
        "templates/rbac/sharding_role.yaml".into(),
        enabled("sharding.enable", &pair(&ns, &sharding_role, &sharding_binding)?),
    ));
    let (sharding_cluster_role, sharding_cluster_binding) = manifests::sharding_cluster_role(op);
    files.push((
        "templates/rbac/sharding_cluster_role.yaml".into(),
        enabled(
            "sharding.enable",
            &pair(&ns, &sharding_cluster_role, &sharding_cluster_binding)?,
        ),
    ));
    let (policy, policy_binding) = manifests::shard_label_policy(op);
    files.push((
        "templates/sharding/shard_label_policy.yaml".into(),
        enabled("sharding.enable", &pair(&ns, &policy, &policy_binding)?),
    ));
    files.push((
        "templates/rbac/service_account.yaml".into(),
        template(&ns, &manifests::service_account(op))?,
    ));
    files.push((
        "templates/rbac/metrics_reader_role.yaml".into(),
        enabled("metrics.enable", &template(&ns, &manifests::metrics_reader(op))?),
    ));

    for (file, role) in manifests::user_roles(op) {
        files.push((
            format!("templates/rbac/{file}"),
            enabled("rbacHelpers.enable", &template(&ns, &role)?),
        ));
    }

    files.push(("templates/manager/manager.yaml".into(), deployment(op)?));

    let (mutating, validating) = manifests::webhook_configurations(op)?;
    // Both, even one without webhooks, as in `config/`: the operator keeps them current.
    let hooks = pair(&ns, &mutating, &validating)?;
    files.push((
        "templates/webhook/manifests.yaml".into(),
        enabled("webhook.enable", &hooks),
    ));
    files.push((
        "templates/webhook/service.yaml".into(),
        enabled("webhook.enable", &template(&ns, &manifests::webhook_service(op))?),
    ));
    files.push((
        "templates/metrics/metrics_service.yaml".into(),
        enabled("metrics.enable", &template(&ns, &manifests::metrics_service(op))?),
    ));
    // Without the file's header, with the note on what the policy cannot say.
    let policy = manifests::network_policy_yaml(op)?;
    let policy = policy.split_once('\n').map(|(_, p)| p).unwrap_or(&policy);
    files.push((
        "templates/network-policy/network_policy.yaml".into(),
        enabled("networkPolicy.enable", &namespaced(&ns, policy)?),
    ));
    files.push((
        "templates/prometheus/monitor.yaml".into(),
        format!(
            "{{{{- if and .Values.prometheus.enable .Values.metrics.enable }}}}\n{}{{{{- end }}}}\n",
            template(&ns, &manifests::service_monitor(op))?
        ),
    ));
    // Alert texts keep Prometheus's own `{{ $labels.x }}`: Helm must print them as they are.
    let rules = template(&ns, &crate::monitoring::prometheus_rule(op))?;
    let rules = helm_literal(&rules);
    files.push((
        "templates/prometheus/rules.yaml".into(),
        format!(
            "{{{{- if and .Values.prometheus.enable .Values.metrics.enable }}}}\n{rules}{{{{- end }}}}\n"
        ),
    ));
    files.push((
        "templates/grafana/dashboards.yaml".into(),
        enabled(
            "grafana.enable",
            &format!(
                "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {}-dashboards\n  namespace: {RELEASE_NAMESPACE}\n  labels:\n{}    # Picked up by Grafana's dashboard sidecar (kube-prometheus-stack's default label).\n    grafana_dashboard: \"1\"\ndata:\n{{{{ (.Files.Glob \"dashboards/*.json\").AsConfig | indent 2 }}}}\n",
                op.manager(),
                labels_yaml(op, "    ")?,
            ),
        ),
    ));

    for (path, content) in &mut files {
        if path.ends_with(".yaml") && path != "Chart.yaml" && path != "values.yaml" {
            *content = format!("# Generated by `make helm` (opkit helm). DO NOT EDIT.\n{content}");
        }
        ensure!(
            !content.contains(&ns),
            "{path}: the namespace {ns} is left in the chart (it must be the release's)"
        );
        ensure!(
            !content.contains("__"),
            "{path}: a placeholder is left:\n{content}"
        );
    }
    // Read by the dashboards ConfigMap with .Files; Grafana's own `{{legend}}` and
    // `$__rate_interval` stay as they are.
    for (file, text) in crate::monitoring::dashboard_files(op)? {
        files.push((format!("dashboards/{file}"), text));
    }
    Ok(files)
}

/// Prometheus's `{{ $labels.x }}` and `{{ $value }}` in `text` printed literally by Helm
/// (Helm's own `{{ $.Release… }}` stays).
fn helm_literal(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(start) = ["{{ $labels.", "{{ $value"]
        .iter()
        .filter_map(|p| rest.find(p))
        .min()
    {
        let Some(len) = rest[start..].find("}}") else {
            break;
        };
        let action = &rest[start..start + len + 2];
        out.push_str(&rest[..start]);
        out.push_str(&format!(
            "{{{{ {} }}}}",
            serde_json::to_string(action).unwrap_or_default()
        ));
        rest = &rest[start + len + 2..];
    }
    out.push_str(rest);
    out
}

fn chart_yaml<S>(op: &Operator<S>) -> String {
    format!(
        "# Generated by `make helm` (opkit helm). DO NOT EDIT.\napiVersion: v2\nname: {}\ndescription: {}\ntype: application\nversion: {}\nappVersion: \"{}\"\n",
        op.name,
        serde_json::to_string(op.about).unwrap_or_default(),
        op.version,
        op.version
    )
}

fn values_yaml<S>(op: &Operator<S>) -> anyhow::Result<String> {
    let d = manifests::deployment(op);
    let container = manager_container(&d)?;
    let resources = crate::yaml::to_string(&container.resources)?;
    let pull = container.image_pull_policy.clone().unwrap_or_default();
    let (repository, tag) = container
        .image
        .as_deref()
        .and_then(|i| i.rsplit_once(':'))
        .map(|(r, t)| (r.to_string(), t.to_string()))
        .context("image without a tag")?;
    let indented = |s: &str, by: &str| s.lines().map(|l| format!("{by}{l}\n")).collect::<String>();
    Ok(format!(
        "# Generated by `make helm` (opkit helm). DO NOT EDIT: set these with --set or -f.\n\
manager:
  # Replicas share the work by leader election: one reconciles, the others stand by and serve
  # the webhooks. With sharding.enable, each of N replicas reconciles about 1/N of the objects.
  replicas: 1
  image:
    repository: {repository}
    tag: {tag}
    pullPolicy: {pull}
  # Off only for a single replica that must not wait for a Lease.
  leaderElection: true
  # Namespaces to confine the controllers to (a Role in each instead of a ClusterRole);
  # empty: the whole cluster.
  namespaces: []
  # More arguments of `opkit run`, e.g. [\"--controllers=memcached,at\"].
  args: []
  resources:
{resources}  nodeSelector: {{}}
  tolerations: []
  affinity: {{}}

sharding:
  # Spread the objects over all manager.replicas (`opkit run --sharding`, with as many
  # slots, so a rolling restart hands each replica's objects to its successor once): each of
  # N replicas watches, caches and reconciles about 1/N of them, placed by the leader, so it needs
  # manager.leaderElection. Grants the manager every Lease of the release's namespace: the
  # replicas' member Leases are found by a label, and RBAC cannot select by label.
  enable: false

crd:
  # Install and upgrade the CRDs with the chart.
  enable: true
  # Leave the CRDs (and every object of theirs) in place on `helm uninstall`.
  keep: true

metrics:
  # Serve /metrics on 8443 with its Service.
  enable: true
  # HTTPS, and only for tokens allowed to `get` /metrics (bind the {name}-metrics-reader
  # ClusterRole); false: plain HTTP for anyone who reaches the port.
  secure: true

rbacHelpers:
  # Per kind admin, editor and viewer ClusterRoles, aggregated into Kubernetes' admin, edit
  # and view roles.
  enable: true

webhook:
  # Admission and conversion webhooks. Kinds served in several versions need it.
  enable: true

prometheus:
  # A ServiceMonitor for the metrics Service and a PrometheusRule with the operator's alerts
  # (needs the Prometheus Operator's CRDs).
  enable: false

grafana:
  # A ConfigMap with the Grafana dashboards (controllers; webhooks and API), labelled for
  # Grafana's dashboard sidecar.
  enable: false

networkPolicy:
  # Ingress only to the webhook, metrics (from namespaces labelled metrics: enabled) and
  # probe ports.
  enable: true
",
        resources = indented(&resources, "    "),
        name = op.name,
    ) + &run_time_values(op))
}

/// The values naming the kinds controllers are given when the operator runs, if any.
fn run_time_values<S>(op: &Operator<S>) -> String {
    let kinds = op.registry.run_time_kinds();
    if kinds.is_empty() {
        return String::new();
    }
    let mut out = String::from(
        "\nrunTimeKinds:\n  # Kinds named when the operator runs, as kubectl names resources: PLURAL.VERSION.GROUP\n  \
         # (deployments.v1.apps), or PLURAL.VERSION for the core group (configmaps.v1). Each list\n  \
         # is passed as its flag, and the manager's role grants the controller's verbs on each kind.\n",
    );
    for k in kinds {
        out += &format!(
            "  # The {} controller (--{}; {} on each).\n  {}: []\n",
            k.controller,
            k.flag,
            k.verbs.join(", "),
            k.value()
        );
    }
    out
}

/// The rules granting the run-time kinds' verbs, one per kind listed in the values.
fn run_time_rules<S>(op: &Operator<S>) -> String {
    op.registry
        .run_time_kinds()
        .iter()
        .map(|k| {
            let verbs: String = k.verbs.iter().map(|v| format!("  - {v}\n")).collect();
            format!(
                "{{{{- range $.Values.runTimeKinds.{value} }}}}\n{{{{- $p := splitList \".\" . }}}}\n\
                 - apiGroups:\n  - {{{{ join \".\" (slice $p 2) | quote }}}}\n  resources:\n  - {{{{ index $p 0 | quote }}}}\n  verbs:\n{verbs}\
                 {{{{- end }}}}\n",
                value = k.value()
            )
        })
        .collect()
}

/// The flags passing the run-time kinds, indented by `i`.
fn run_time_args<S>(op: &Operator<S>, i: &str) -> String {
    op.registry
        .run_time_kinds()
        .iter()
        .map(|k| {
            format!(
                "\n{i}{{{{- with $.Values.runTimeKinds.{value} }}}}\n{i}- --{flag}={{{{ join \",\" . }}}}\n{i}{{{{- end }}}}",
                value = k.value(),
                flag = k.flag
            )
        })
        .collect()
}

fn notes<S>(op: &Operator<S>) -> String {
    format!(
        "{} {{{{ .Chart.AppVersion }}}} is installed in {{{{ .Release.Namespace }}}}.\n\n\
         Its Pods meet the restricted Pod Security Standard; to enforce it:\n  \
         kubectl label namespace {{{{ .Release.Namespace }}}} pod-security.kubernetes.io/enforce=restricted\n\n\
         Watch it start:\n  kubectl -n {{{{ .Release.Namespace }}}} rollout status deploy/{}\n\
         {{{{- if .Values.crd.keep }}}}\n\n\
         `helm uninstall` keeps the CRDs and their objects; delete the CRDs yourself to remove them.\n\
         {{{{- end }}}}\n",
        op.name,
        op.manager()
    )
}

/// The manager's container in `d`.
fn manager_container(
    d: &k8s_openapi::api::apps::v1::Deployment,
) -> anyhow::Result<&k8s_openapi::api::core::v1::Container> {
    d.spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|p| p.containers.first())
        .context("the manager Deployment has no container")
}

/// The manager Deployment of [`manifests::deployment`] with its settings made values.
fn deployment<S>(op: &Operator<S>) -> anyhow::Result<String> {
    let ns = op.namespace();
    let d = manifests::deployment(op);
    let container = manager_container(&d)?;
    let image = container.image.clone().unwrap_or_default();
    let pull = container.image_pull_policy.clone().unwrap_or_default();
    let mut y = template(&ns, &d)?;
    y = replace_line(&y, "replicas: 1", |i| {
        format!("{i}replicas: {{{{ .Values.manager.replicas }}}}")
    })?;
    y = replace_line(&y, &format!("image: {image}"), |i| {
        format!(
            "{i}image: \"{{{{ .Values.manager.image.repository }}}}:{{{{ .Values.manager.image.tag }}}}\""
        )
    })?;
    y = replace_line(&y, &format!("imagePullPolicy: {pull}"), |i| {
        format!("{i}imagePullPolicy: {{{{ .Values.manager.image.pullPolicy }}}}")
    })?;
    let when = |cond: &'static str, line: &'static str| {
        move |i: &str| format!("{i}{{{{- if {cond} }}}}\n{i}{line}\n{i}{{{{- end }}}}")
    };
    // `opkit run` refuses --sharding without --leader-elect; the render says so first.
    y = replace_line(&y, "- --leader-elect", |i| {
        format!(
            "{i}{{{{- if .Values.manager.leaderElection }}}}\n{i}- --leader-elect\n\
             {i}{{{{- if .Values.sharding.enable }}}}\n{i}- --sharding\n\
             {i}- --sharding-slots={{{{ .Values.manager.replicas }}}}\n{i}{{{{- end }}}}\n\
             {i}{{{{- else if .Values.sharding.enable }}}}\n\
             {i}{{{{- fail \"sharding.enable needs manager.leaderElection: the leader places the objects on the replicas\" }}}}\n\
             {i}{{{{- end }}}}"
        )
    })?;
    y = replace_line(&y, "- --metrics-bind-address=:8443", |i| {
        format!(
            "{i}{{{{- if .Values.metrics.enable }}}}\n{i}- --metrics-bind-address=:8443\n{i}{{{{- else }}}}\n{i}- --metrics-bind-address=0\n{i}{{{{- end }}}}"
        )
    })?;
    y = replace_line(
        &y,
        "- --metrics-secure",
        when(
            "and .Values.metrics.enable .Values.metrics.secure",
            "- --metrics-secure",
        ),
    )?;
    y = replace_line(&y, "- --webhook-bind-address=:9443", |i| {
        format!(
            "{i}{{{{- if .Values.webhook.enable }}}}\n{i}- --webhook-bind-address=:9443\n{i}{{{{- end }}}}\n\
             {i}{{{{- range .Values.manager.namespaces }}}}\n{i}- --namespace={{{{ . }}}}\n{i}{{{{- end }}}}\n\
             {i}{{{{- with .Values.manager.args }}}}\n{i}{{{{- toYaml . | nindent {n} }}}}\n{i}{{{{- end }}}}{run_time}",
            n = i.len(),
            run_time = run_time_args(op, i),
        )
    })?;
    y = replace_block(&y, "resources:", |i| {
        format!(
            "{i}resources:\n{i}  {{{{- toYaml .Values.manager.resources | nindent {} }}}}",
            i.len() + 2
        )
    })?;
    y = replace_line(&y, &format!("serviceAccountName: {}", op.manager()), |i| {
        let mut out = format!("{i}serviceAccountName: {}", op.manager());
        for (key, value) in [
            ("nodeSelector", "nodeSelector"),
            ("tolerations", "tolerations"),
            ("affinity", "affinity"),
        ] {
            out.push_str(&format!(
                "\n{i}{{{{- with .Values.manager.{value} }}}}\n{i}{key}:\n{i}  {{{{- toYaml . | nindent {} }}}}\n{i}{{{{- end }}}}",
                i.len() + 2
            ));
        }
        out
    })?;
    Ok(y)
}

/// Two objects as one template file, as [`template`] makes each.
fn pair<A: serde::Serialize, B: serde::Serialize>(ns: &str, a: &A, b: &B) -> anyhow::Result<String> {
    Ok(format!("{}---\n{}", template(ns, a)?, template(ns, b)?))
}

/// `obj` as YAML with the operator's namespace made the release's and Helm as its manager.
fn template<T: serde::Serialize>(ns: &str, obj: &T) -> anyhow::Result<String> {
    let y = to_yaml(&[obj])?;
    let y = y.split_once("---\n").map(|(_, y)| y).unwrap_or(&y);
    namespaced(ns, y)
}

fn namespaced(ns: &str, y: &str) -> anyhow::Result<String> {
    Ok(y.lines()
        .map(|l| {
            let trimmed = l.trim_start();
            let indent = &l[..l.len() - trimmed.len()];
            if trimmed == format!("namespace: {ns}") {
                format!("{indent}namespace: {RELEASE_NAMESPACE}\n")
            } else if trimmed == format!("- {ns}") {
                // The webhooks' namespaceSelector leaves the operator's namespace out.
                format!("{indent}- {RELEASE_NAMESPACE}\n")
            } else if trimmed == "app.kubernetes.io/managed-by: kustomize" {
                format!("{indent}app.kubernetes.io/managed-by: {{{{ $.Release.Service }}}}\n")
            } else {
                format!("{l}\n")
            }
        })
        .collect())
}

fn enabled(value: &str, body: &str) -> String {
    format!("{{{{- if .Values.{value} }}}}\n{body}{{{{- end }}}}\n")
}

fn labels_yaml<S>(op: &Operator<S>, indent: &str) -> anyhow::Result<String> {
    let y = crate::yaml::to_string(&manifests::labels(op))?;
    Ok(y.lines()
        .map(|l| {
            if l == "app.kubernetes.io/managed-by: kustomize" {
                format!("{indent}app.kubernetes.io/managed-by: {{{{ $.Release.Service }}}}\n")
            } else {
                format!("{indent}{l}\n")
            }
        })
        .collect())
}

/// Replaces the one line whose content (indentation aside) is `content` by `with(indent)`.
fn replace_line(y: &str, content: &str, with: impl Fn(&str) -> String) -> anyhow::Result<String> {
    let mut found = 0;
    let out: String = y
        .lines()
        .map(|l| {
            let trimmed = l.trim_start();
            if trimmed == content {
                found += 1;
                format!("{}\n", with(&l[..l.len() - trimmed.len()]))
            } else {
                format!("{l}\n")
            }
        })
        .collect();
    if found != 1 {
        bail!("the chart expects one line `{content}`, found {found}");
    }
    Ok(out)
}

/// Replaces the one mapping key `key` (a line of its own) and everything indented under it.
fn replace_block(y: &str, key: &str, with: impl Fn(&str) -> String) -> anyhow::Result<String> {
    let lines: Vec<&str> = y.lines().collect();
    let starts: Vec<usize> = (0..lines.len())
        .filter(|&i| lines[i].trim_start() == key)
        .collect();
    let [start] = starts[..] else {
        bail!("the chart expects one block `{key}`, found {}", starts.len());
    };
    let indent = lines[start].len() - lines[start].trim_start().len();
    let end = (start + 1..lines.len())
        .find(|&i| lines[i].len() - lines[i].trim_start().len() <= indent)
        .unwrap_or(lines.len());
    let mut out: Vec<String> = lines[..start].iter().map(|l| l.to_string()).collect();
    out.push(with(&lines[start][..indent]));
    out.extend(lines[end..].iter().map(|l| l.to_string()));
    Ok(out.join("\n") + "\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_and_a_block_are_replaced_once_or_refused() {
        let y = "a:\n  b: 1\n  c:\n    d: 2\n  e: 3\n";
        let out = replace_block(y, "c:", |i| format!("{i}c: x")).unwrap();
        assert_eq!(out, "a:\n  b: 1\n  c: x\n  e: 3\n");
        let out = replace_line(y, "b: 1", |i| format!("{i}b: {{{{ .Values.b }}}}")).unwrap();
        assert!(out.contains("  b: {{ .Values.b }}\n"));
        assert!(replace_line(y, "z: 1", |i| i.to_string()).is_err());
        assert!(replace_line("x: 1\nx: 1\n", "x: 1", |i| i.to_string()).is_err());
    }

    #[test]
    fn the_release_namespace_replaces_the_operators() {
        let out = namespaced(
            "op-system",
            "metadata:\n  namespace: op-system\n  name: op-system-x\n",
        )
        .unwrap();
        assert_eq!(
            out,
            "metadata:\n  namespace: {{ $.Release.Namespace }}\n  name: op-system-x\n"
        );
    }
}
