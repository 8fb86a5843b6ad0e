//! The manifests committed under `config/` are what the code generates.
use std::process::Command;

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
