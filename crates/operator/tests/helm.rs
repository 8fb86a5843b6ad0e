//! The Helm chart under `dist/chart/`: fresh, clean for `helm lint`, and with default values
//! exactly the objects of `config/default` (confined to namespaces, those of `make manifests
//! NAMESPACES=...`; with `sharding.enable`, those of `config/sharding`), rendered by the real
//! Helm. Installing it is in `in_cluster.rs`.
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn repo() -> PathBuf {
    PathBuf::from(format!("{}/../..", env!("CARGO_MANIFEST_DIR")))
}

fn run(cmd: &mut Command) -> Result<String, String> {
    let out = cmd.output().map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    if out.status.success() {
        Ok(text)
    } else {
        Err(format!("{text}{}", String::from_utf8_lossy(&out.stderr)))
    }
}

fn bin() -> opkit_testenv::Binaries {
    opkit_testenv::Binaries::ensure().expect("the upstream binaries build")
}

/// Every object of a multi-document YAML stream, keyed by kind, namespace and name, with
/// what differs by design between Helm and kustomize taken out: the `managed-by` label and
/// the CRDs' `helm.sh/resource-policy`.
fn objects(yaml: &str) -> std::collections::BTreeMap<String, Value> {
    // Helm writes a schema's `minimum: 1` as `1.0`: the same number.
    fn whole_numbers(v: &mut Value) {
        match v {
            Value::Number(n) => {
                if let Some(f) = n.as_f64().filter(|f| f.fract() == 0.0 && f.abs() < 1e15) {
                    *v = Value::from(f as i64);
                }
            }
            Value::Array(a) => a.iter_mut().for_each(whole_numbers),
            Value::Object(o) => o.values_mut().for_each(whole_numbers),
            _ => {}
        }
    }
    let mut out = std::collections::BTreeMap::new();
    for doc in serde_yaml::Deserializer::from_str(yaml) {
        let mut v: Value = serde::Deserialize::deserialize(doc).expect("valid YAML");
        if v.is_null() {
            continue;
        }
        whole_numbers(&mut v);
        for labels in ["/metadata/labels", "/spec/template/metadata/labels"] {
            if let Some(Value::Object(l)) = v.pointer_mut(labels) {
                l.remove("app.kubernetes.io/managed-by");
            }
        }
        if let Some(Value::Object(a)) = v.pointer_mut("/metadata/annotations") {
            a.remove("helm.sh/resource-policy");
            if a.is_empty()
                && let Some(m) = v["metadata"].as_object_mut()
            {
                m.remove("annotations");
            }
        }
        let key = format!(
            "{} {}/{}",
            v["kind"].as_str().unwrap_or_default(),
            v["metadata"]["namespace"].as_str().unwrap_or_default(),
            v["metadata"]["name"].as_str().unwrap_or_default()
        );
        out.insert(key, v);
    }
    out
}

fn helm_template(args: &[&str]) -> Result<String, String> {
    run(Command::new(bin().path("helm"))
        .args(["template", "opkit"])
        .arg(repo().join("dist/chart"))
        .args(["--namespace", "opkit-system"])
        .args(args))
}

fn kustomize(dir: &Path) -> String {
    run(Command::new(bin().path("kubectl")).arg("kustomize").arg(dir)).expect("kubectl kustomize")
}

fn assert_same(chart: &str, config: &str) {
    let (chart, mut config) = (objects(chart), objects(config));
    config.retain(|k, _| !k.starts_with("Namespace "));
    let names = |m: &std::collections::BTreeMap<String, Value>| m.keys().cloned().collect::<Vec<_>>();
    assert_eq!(
        names(&chart),
        names(&config),
        "the chart and config/ hold different objects"
    );
    for (k, v) in &config {
        assert_eq!(
            &chart[k],
            v,
            "{k} differs:\n--- chart ---\n{}\n--- config ---\n{}",
            serde_yaml::to_string(&chart[k]).unwrap_or_default(),
            serde_yaml::to_string(v).unwrap_or_default()
        );
    }
}

#[test]
fn committed_chart_is_fresh() {
    let out = Command::new(env!("CARGO_BIN_EXE_opkit"))
        .args(["helm", "--check", "--dir"])
        .arg(repo().join("dist/chart"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn helm_lint_finds_nothing() {
    let out = run(Command::new(bin().path("helm"))
        .args(["lint", "--strict"])
        .arg(repo().join("dist/chart")))
    .unwrap_or_else(|e| panic!("helm lint: {e}"));
    assert!(out.contains("0 chart(s) failed"), "{out}");
}

#[test]
fn the_default_chart_is_config() {
    let chart = helm_template(&[]).unwrap_or_else(|e| panic!("helm template: {e}"));
    assert_same(&chart, &kustomize(&repo().join("config/default")));
}

#[test]
fn confined_to_namespaces_the_chart_is_make_manifests_namespaces() {
    let dir = std::env::temp_dir().join(format!("opkit-helm-manifests-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_opkit"))
        .args(["manifests", "--namespace", "apps", "--namespace", "web", "--dir"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let config = kustomize(&dir.join("default"));
    std::fs::remove_dir_all(&dir).unwrap();
    let chart = helm_template(&["--set", "manager.namespaces={apps,web}"])
        .unwrap_or_else(|e| panic!("helm template: {e}"));
    assert_same(&chart, &config);
}

#[test]
fn values_switch_parts_off_and_on() {
    let chart = helm_template(&[
        "--set",
        "metrics.enable=false,networkPolicy.enable=false,manager.leaderElection=false,manager.replicas=3",
        "--set",
        "manager.image.repository=127.0.0.1:5000/opkit,manager.image.tag=v9,manager.args={--controllers=memcached}",
    ])
    .unwrap_or_else(|e| panic!("helm template: {e}"));
    let objs = objects(&chart);
    assert!(
        !objs.keys().any(|k| k.starts_with("NetworkPolicy ")),
        "{:?}",
        objs.keys()
    );
    assert!(!objs.keys().any(|k| k.contains("metrics")), "{:?}", objs.keys());
    let d = &objs["Deployment opkit-system/opkit-controller-manager"];
    assert_eq!(d["spec"]["replicas"], 3);
    let c = &d["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(c["image"], "127.0.0.1:5000/opkit:v9");
    let args: Vec<&str> = c["args"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(args.contains(&"--metrics-bind-address=0"), "{args:?}");
    assert!(
        !args.contains(&"--metrics-secure") && !args.contains(&"--leader-elect"),
        "{args:?}"
    );
    assert_eq!(args.last(), Some(&"--controllers=memcached"), "{args:?}");
    let role = &objs["ClusterRole /opkit-manager-role"];
    assert!(
        !role.to_string().contains("tokenreviews"),
        "metrics off, yet the role may review tokens: {role}"
    );

    let prometheus = helm_template(&["--set", "prometheus.enable=true"]).unwrap();
    let monitor =
        &objects(&prometheus)["ServiceMonitor opkit-system/opkit-controller-manager-metrics-monitor"];
    assert_eq!(monitor["spec"]["endpoints"][0]["scheme"], "https");

    // The CronTab CRD is converted by the webhook: turning webhooks off is refused, named.
    let err = helm_template(&["--set", "webhook.enable=false"]).unwrap_err();
    assert!(
        err.contains("crontabs.stable.example.com") && err.contains("webhook.enable"),
        "{err}"
    );
    // The per-kind admin/editor/viewer roles go with rbacHelpers.enable.
    let helpers = |objs: &std::collections::BTreeMap<String, Value>| {
        objs.keys()
            .filter(|k| k.starts_with("ClusterRole /opkit-memcached-"))
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(helpers(&objs).len(), 3, "{:?}", objs.keys());
    let off = helm_template(&["--set", "rbacHelpers.enable=false"]).unwrap();
    assert_eq!(helpers(&objects(&off)), Vec::<String>::new());
    // Without the CRDs, nothing of the chart needs them.
    let no_crds = helm_template(&["--set", "crd.enable=false"]).unwrap();
    assert!(
        !objects(&no_crds)
            .keys()
            .any(|k| k.starts_with("CustomResourceDefinition "))
    );
}

/// The strings of a YAML list (none when it is not one).
fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .map(String::from)
        .collect()
}

/// The manager's arguments, and the verbs on Leases not named that Roles bound to its
/// ServiceAccount grant in its namespace (sorted, once each).
fn manager_args_and_unnamed_leases(
    objs: &std::collections::BTreeMap<String, Value>,
) -> (Vec<String>, Vec<String>) {
    let manager = &objs["Deployment opkit-system/opkit-controller-manager"];
    let args = strings(&manager["spec"]["template"]["spec"]["containers"][0]["args"]);
    let bound: Vec<String> = objs
        .iter()
        .filter(|(k, _)| k.starts_with("RoleBinding opkit-system/"))
        .filter(|(_, b)| {
            b["subjects"].as_array().into_iter().flatten().any(|s| {
                s["kind"] == "ServiceAccount"
                    && s["name"] == "opkit-controller-manager"
                    && s["namespace"] == "opkit-system"
            })
        })
        .filter_map(|(_, b)| b["roleRef"]["name"].as_str())
        .map(|r| format!("Role opkit-system/{r}"))
        .collect();
    let mut verbs: Vec<String> = bound
        .iter()
        .filter_map(|r| objs.get(r))
        .flat_map(|r| r["rules"].as_array().into_iter().flatten())
        .filter(|r| {
            strings(&r["apiGroups"]) == ["coordination.k8s.io"] && strings(&r["resources"]) == ["leases"]
        })
        .filter(|r| r.get("resourceNames").is_none())
        .flat_map(|r| strings(&r["verbs"]))
        .collect();
    verbs.sort();
    verbs.dedup();
    (args, verbs)
}

#[test]
fn sharding_is_off_by_default_and_on_with_sharding_enable() {
    let default = objects(&helm_template(&[]).unwrap_or_else(|e| panic!("helm template: {e}")));
    let (args, leases) = manager_args_and_unnamed_leases(&default);
    assert!(!args.iter().any(|a| a == "--sharding"), "{args:?}");
    // A create cannot be limited by name; the default grants nothing else not named.
    assert_eq!(leases, ["create"]);

    let sharded = objects(
        &helm_template(&["--set", "sharding.enable=true"]).unwrap_or_else(|e| panic!("helm template: {e}")),
    );
    let (args, leases) = manager_args_and_unnamed_leases(&sharded);
    let at = args
        .iter()
        .position(|a| a == "--leader-elect")
        .expect("--leader-elect");
    assert_eq!(
        args.get(at + 1).map(String::as_str),
        Some("--sharding"),
        "{args:?}"
    );
    // As many slots as replicas: a rolling restart hands each replica's objects over once.
    assert_eq!(
        args.get(at + 2).map(String::as_str),
        Some("--sharding-slots=1"),
        "{args:?}"
    );
    assert_eq!(leases, ["create", "delete", "get", "list", "update", "watch"]);
    // The replicas stay manager.replicas.
    assert_eq!(
        sharded["Deployment opkit-system/opkit-controller-manager"]["spec"]["replicas"],
        1
    );

    // `opkit run` would refuse it: the render does, named.
    let err = helm_template(&["--set", "sharding.enable=true,manager.leaderElection=false"]).unwrap_err();
    assert!(
        err.contains("sharding.enable needs manager.leaderElection"),
        "{err}"
    );
}

#[test]
fn the_sharded_chart_is_config_sharding() {
    let replicas = opkit::manifests::SHARDED_REPLICAS;
    let chart = helm_template(&[
        "--set",
        &format!("sharding.enable=true,manager.replicas={replicas}"),
    ])
    .unwrap_or_else(|e| panic!("helm template: {e}"));
    assert_same(&chart, &kustomize(&repo().join("config/sharding")));
}

/// `make build-installer IMG=...`: every object of `config/default` in one file, the manager
/// running IMG (a registry with a port, so the tag is after the last colon).
#[test]
fn build_installer_writes_config_default_with_the_image() {
    let file = std::env::temp_dir().join(format!("opkit-install-{}.yaml", std::process::id()));
    let img = "127.0.0.1:5000/opkit:v9.9.9";
    run(Command::new("make")
        .arg("-C")
        .arg(repo())
        .args(["build-installer", &format!("IMG={img}")])
        .arg(format!("INSTALLER={}", file.display()))
        .arg(format!("KUBECTL={}", bin().path("kubectl").display())))
    .unwrap_or_else(|e| panic!("make build-installer: {e}"));
    let installer = std::fs::read_to_string(&file).expect("the installer is written");
    std::fs::remove_file(&file).expect("removed");
    let (installer, mut config) = (
        objects(&installer),
        objects(&kustomize(&repo().join("config/default"))),
    );
    let manager = "Deployment opkit-system/opkit-controller-manager";
    let image = "/spec/template/spec/containers/0/image";
    assert_eq!(installer[manager].pointer(image), Some(&Value::from(img)));
    *config
        .get_mut(manager)
        .and_then(|d| d.pointer_mut(image))
        .expect("the manager has an image") = Value::from(img);
    assert_eq!(installer, config);
    // Per-kind roles for people, aggregated into Kubernetes' own roles.
    let viewer = &installer["ClusterRole /opkit-memcached-viewer-role"];
    assert_eq!(
        viewer["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"],
        "true"
    );
}

/// `make helm-package`: the chart as one archive, which renders what the directory does.
#[test]
fn helm_package_archives_the_chart() {
    let dir = std::env::temp_dir().join(format!("opkit-helm-package-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    run(Command::new("make")
        .arg("-C")
        .arg(repo())
        .arg("helm-package")
        .arg(format!("HELM_PACKAGE_DIR={}", dir.display())))
    .unwrap_or_else(|e| panic!("make helm-package: {e}"));
    let archive = dir.join(format!("opkit-{}.tgz", env!("CARGO_PKG_VERSION")));
    let rendered = run(Command::new(bin().path("helm"))
        .args(["template", "opkit"])
        .arg(&archive)
        .args(["--namespace", "opkit-system"]));
    std::fs::remove_dir_all(&dir).expect("removed");
    let rendered = rendered.unwrap_or_else(|e| panic!("helm template {}: {e}", archive.display()));
    assert_eq!(
        objects(&rendered),
        objects(&helm_template(&[]).expect("helm template dist/chart"))
    );
}

#[test]
fn kinds_named_in_the_values_are_passed_to_the_manager_and_granted() {
    let default = objects(&helm_template(&[]).unwrap_or_else(|e| panic!("helm template: {e}")));
    let (args, _) = manager_args_and_unnamed_leases(&default);
    assert!(
        !args
            .iter()
            .any(|a| a.starts_with("--label-propagation-resources")),
        "{args:?}"
    );
    let set = "runTimeKinds.labelPropagationResources={services.v1,widgets.v1alpha1.example.opkit.dev}";
    {
        let objs = objects(&helm_template(&["--set", set]).unwrap_or_else(|e| panic!("helm template: {e}")));
        let (args, _) = manager_args_and_unnamed_leases(&objs);
        assert!(
            args.contains(
                &"--label-propagation-resources=services.v1,widgets.v1alpha1.example.opkit.dev".to_string()
            ),
            "{args:?}"
        );
        let role = &objs["ClusterRole /opkit-manager-role"];
        let granted = |group: &str, resource: &str| -> Vec<String> {
            role["rules"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|r| strings(&r["apiGroups"]) == [group] && strings(&r["resources"]) == [resource])
                .flat_map(|r| strings(&r["verbs"]))
                .collect()
        };
        assert_eq!(granted("", "services"), ["list", "watch", "patch"]);
        assert_eq!(
            granted("example.opkit.dev", "widgets"),
            ["list", "watch", "patch"]
        );
    }
}
