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
