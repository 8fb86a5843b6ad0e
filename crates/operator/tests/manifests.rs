//! The manifests committed under `config/` are what the code generates.
use std::process::Command;

use serde_json::Value;

#[test]
fn committed_manifests_are_fresh() {
    let dir = format!("{}/../../config", env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(env!("CARGO_BIN_EXE_opkit"))
        .args(["manifests", "--check", "--dir", &dir])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn a_changed_manifest_is_reported_stale() {
    let dir = std::env::temp_dir().join(format!("opkit-manifests-{}", std::process::id()));
    let run = |check: bool| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_opkit"));
        c.args(["manifests", "--dir"]).arg(&dir);
        if check {
            c.arg("--check");
        }
        c.output().unwrap()
    };
    assert!(run(false).status.success());
    assert!(run(true).status.success());
    let role = dir.join("rbac/role.yaml");
    std::fs::write(
        &role,
        std::fs::read_to_string(&role).unwrap().replace("watch", "wotch"),
    )
    .unwrap();
    let out = run(true);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("rbac/role.yaml"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// kube-score (built from its Go module with the control plane) on what `make deploy`
/// applies: nothing CRITICAL. The one warning left is the single replica: with self-signed
/// webhook certificates each replica would install its own CA. Its pull-policy check (it wants
/// `Always`) is left out: the tag is a version, and `IfNotPresent` lets a loaded image run
/// without a registry.
#[test]
fn kube_score_finds_nothing_critical_in_the_deployed_manifests() {
    let bin = opkit_testenv::Binaries::ensure().expect("the upstream binaries build");
    let config = format!("{}/../../config/default", env!("CARGO_MANIFEST_DIR"));
    let rendered = Command::new(bin.path("kubectl"))
        .args(["kustomize", &config])
        .output()
        .unwrap();
    assert!(
        rendered.status.success(),
        "{}",
        String::from_utf8_lossy(&rendered.stderr)
    );
    let file = std::env::temp_dir().join(format!("opkit-kube-score-{}.yaml", std::process::id()));
    std::fs::write(&file, &rendered.stdout).unwrap();
    let out = Command::new(bin.path("kube-score"))
        .args([
            "score",
            "--output-format",
            "ci",
            "--ignore-test",
            "container-image-pull-policy",
        ])
        .arg(&file)
        .output()
        .unwrap();
    std::fs::remove_file(&file).unwrap();
    let report = String::from_utf8_lossy(&out.stdout);
    let findings: Vec<&str> = report
        .lines()
        .filter(|l| l.starts_with("[CRITICAL]") || l.starts_with("[WARNING]"))
        .collect();
    println!("{}", findings.join("\n"));
    assert!(
        report.lines().any(|l| l.starts_with("[OK]")),
        "kube-score checked nothing: {report}"
    );
    let critical: Vec<&&str> = findings.iter().filter(|l| l.starts_with("[CRITICAL]")).collect();
    assert!(critical.is_empty(), "{critical:#?}");
    assert!(
        findings.iter().all(|l| l.contains("few replicas")),
        "new warnings: {findings:#?}"
    );
}

/// `kubectl kustomize config/<overlay>` as JSON values, one per object.
fn kustomized(overlay: &str) -> Vec<Value> {
    let bin = opkit_testenv::Binaries::ensure().expect("the upstream binaries build");
    let dir = format!("{}/../../config/{overlay}", env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(bin.path("kubectl"))
        .args(["kustomize", &dir])
        .output()
        .expect("kubectl runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_yaml::Deserializer::from_slice(&out.stdout)
        .map(|d| serde::Deserialize::deserialize(d).expect("valid YAML"))
        .collect()
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

/// The manager's replicas and arguments, and the verbs on Leases not named that Roles bound
/// to its ServiceAccount grant in its namespace (sorted, once each), in one overlay.
fn manager_and_unnamed_leases(objs: &[Value]) -> (Value, Vec<String>, Vec<String>) {
    let manager = objs
        .iter()
        .find(|o| o["kind"] == "Deployment" && o["metadata"]["name"] == "opkit-controller-manager")
        .expect("the manager Deployment");
    let args = strings(&manager["spec"]["template"]["spec"]["containers"][0]["args"]);
    let in_namespace =
        |o: &&Value, kind: &str| o["kind"] == kind && o["metadata"]["namespace"] == "opkit-system";
    let bound: Vec<&Value> = objs
        .iter()
        .filter(|o| in_namespace(o, "RoleBinding"))
        .filter(|o| {
            o["subjects"].as_array().into_iter().flatten().any(|s| {
                s["kind"] == "ServiceAccount"
                    && s["name"] == "opkit-controller-manager"
                    && s["namespace"] == "opkit-system"
            })
        })
        .map(|o| &o["roleRef"]["name"])
        .collect();
    let mut verbs: Vec<String> = objs
        .iter()
        .filter(|o| in_namespace(o, "Role") && bound.contains(&&o["metadata"]["name"]))
        .flat_map(|o| o["rules"].as_array().into_iter().flatten())
        .filter(|r| {
            strings(&r["apiGroups"]) == ["coordination.k8s.io"] && strings(&r["resources"]) == ["leases"]
        })
        .filter(|r| r.get("resourceNames").is_none())
        .flat_map(|r| strings(&r["verbs"]))
        .collect();
    verbs.sort();
    verbs.dedup();
    (manager["spec"]["replicas"].clone(), args, verbs)
}

/// `config/sharding` is `config/default` run as three replicas with `--sharding` (three
/// slots), allowed the member Leases; `config/default` stays one replica, the leader Lease by
/// name only.
#[test]
fn config_sharding_runs_three_sharded_replicas_and_config_default_one() {
    let (replicas, args, leases) = manager_and_unnamed_leases(&kustomized("default"));
    assert_eq!(replicas, 1);
    assert!(!args.iter().any(|a| a == "--sharding"), "{args:?}");
    assert_eq!(leases, ["create"], "the default grants Leases not named");

    let (replicas, args, leases) = manager_and_unnamed_leases(&kustomized("sharding"));
    assert_eq!(replicas, 3);
    let at = args
        .iter()
        .position(|a| a == "--leader-elect")
        .expect("--leader-elect");
    assert_eq!(
        args.get(at + 1).map(String::as_str),
        Some("--sharding"),
        "{args:?}"
    );
    assert_eq!(args.iter().filter(|a| *a == "--sharding").count(), 1, "{args:?}");
    assert_eq!(
        args.get(at + 2).map(String::as_str),
        Some("--sharding-slots=3"),
        "{args:?}"
    );
    assert_eq!(leases, ["create", "delete", "get", "list", "update", "watch"]);

    // The shard labels and adoption: patch on the served kinds and created children that the
    // controllers' own rules do not patch already, bound to the manager, only here.
    let patched = |objs: &[Value]| -> Vec<String> {
        let mut out: Vec<String> = objs
            .iter()
            .filter(|o| o["kind"] == "ClusterRole" && o["metadata"]["name"] == "opkit-sharding-manager-role")
            .flat_map(|o| o["rules"].as_array().cloned().unwrap_or_default())
            .filter(|r| strings(&r["verbs"]) == ["patch"])
            .flat_map(|r| strings(&r["resources"]))
            .collect();
        out.sort();
        out
    };
    assert_eq!(
        patched(&kustomized("sharding")),
        ["ats", "foos", "memcacheds", "pods"]
    );
    assert!(patched(&kustomized("default")).is_empty());
    let bound = kustomized("sharding")
        .iter()
        .any(|o| o["kind"] == "ClusterRoleBinding" && o["roleRef"]["name"] == "opkit-sharding-manager-role");
    assert!(bound, "the sharding ClusterRole is bound");
}
