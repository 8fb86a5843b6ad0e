//! The GitHub Actions workflows, opkit's and those `opkit init` writes, pass actionlint (built
//! from its Go module with the control plane): syntax, expressions, action inputs, job keys.
use std::path::{Path, PathBuf};
use std::process::Command;

fn actionlint(dir: &Path) -> Result<(), String> {
    let bin = opkit_testenv::Binaries::ensure().map_err(|e| e.to_string())?;
    let workflows: Vec<PathBuf> = std::fs::read_dir(dir.join(".github/workflows"))
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "yml"))
        .collect();
    if workflows.is_empty() {
        return Err(format!("no workflow in {}", dir.display()));
    }
    let out = Command::new(bin.path("actionlint"))
        .args(["-no-color", "-shellcheck=", "-pyflakes="])
        .args(&workflows)
        .current_dir(dir)
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

#[test]
fn opkits_own_workflows_pass_actionlint() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    actionlint(&repo).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn a_scaffolded_projects_workflows_pass_actionlint() {
    let dir = std::env::temp_dir().join(format!("opkit-workflows-{}/demo", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let out = Command::new(env!("CARGO_BIN_EXE_opkit"))
        .args(["init", "--domain", "my.domain", "--opkit-path", "-"])
        .current_dir(&dir)
        .output()
        .expect("opkit runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for name in ["lint.yml", "test.yml", "test-e2e.yml"] {
        assert!(
            dir.join(".github/workflows").join(name).exists(),
            "opkit init wrote no {name}"
        );
    }
    let checked = actionlint(&dir);
    std::fs::remove_dir_all(dir.parent().expect("a parent")).expect("removed");
    checked.unwrap_or_else(|e| panic!("{e}"));
}

/// actionlint finds what is wrong: a job without `runs-on`.
#[test]
fn actionlint_refuses_a_broken_workflow() {
    let dir = std::env::temp_dir().join(format!("opkit-workflows-broken-{}", std::process::id()));
    std::fs::create_dir_all(dir.join(".github/workflows")).expect("a temporary directory");
    std::fs::write(
        dir.join(".github/workflows/broken.yml"),
        "on: push\njobs:\n  test:\n    steps:\n      - run: make test\n",
    )
    .expect("written");
    let checked = actionlint(&dir);
    std::fs::remove_dir_all(&dir).expect("removed");
    let err = checked.expect_err("a job without runs-on passes actionlint");
    assert!(err.contains("runs-on"), "{err}");
}
