//! `opkit alpha update` end to end, without a cluster or a build of the generated project: a
//! Guestbook project scaffolded by an "older opkit" (a script running this `opkit`, then putting
//! a few template lines back as they were), committed, edited by its user and committed again,
//! is updated: the user's edits stay, the newer template lines arrive, and the one line both
//! changed is left with conflict markers and a failing exit status.
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, ensure};

mod common;
use common::outcome;

const OLD_VERSION: &str = "0.0.1";
const CONTROLLER: &str = "crates/controllers/src/guestbook.rs";
const TYPES: &str = "crates/api/src/webapp_v1/guestbook.rs";

/// An `opkit` of an older template set: this binary, then after `init` the Makefile without its
/// `lint` target, an older README sentence and PROJECT's cliVersion of the old version; after
/// `create api` an older status message in the controller and an older doc line in the types.
fn old_opkit(dir: &Path) -> anyhow::Result<PathBuf> {
    let script = dir.join("opkit-0.0.1");
    std::fs::write(
        &script,
        format!(
            r#"#!/bin/sh
set -e
'{opkit}' "$@"
edit() {{ f=$1; shift; sed "$@" "$f" > "$f.old" && mv "$f.old" "$f"; }}
case "$1 $2" in
"init "*)
    edit Makefile -e '/^\.PHONY: lint$/,/^$/d'
    edit README.md -e 's/^A Kubernetes operator in Rust, scaffolded/An operator, scaffolded/'
    edit PROJECT -e 's/^cliVersion: .*/cliVersion: {OLD_VERSION}/'
    ;;
"create api")
    edit {CONTROLLER} -e 's/"the spec is reconciled"/"the spec was reconciled"/'
    edit {TYPES} -e 's/What a user asks of a/What a user wants of a/'
    ;;
esac
"#,
            opkit = env!("CARGO_BIN_EXE_opkit")
        ),
    )?;
    let status = Command::new("chmod").arg("+x").arg(&script).status()?;
    ensure!(status.success(), "chmod +x {}", script.display());
    Ok(script)
}

/// Runs `program args` in `dir` with no user or system git configuration; (succeeded, stdout +
/// stderr).
fn run(dir: &Path, program: &Path, args: &[&str]) -> anyhow::Result<(bool, String)> {
    let out = Command::new(program)
        .args(args)
        .current_dir(dir)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_AUTHOR_NAME", "Test")
        .env("GIT_AUTHOR_EMAIL", "test@example.com")
        .env("GIT_COMMITTER_NAME", "Test")
        .env("GIT_COMMITTER_EMAIL", "test@example.com")
        .env("RUST_BACKTRACE", "0")
        .output()
        .with_context(|| format!("running {}", program.display()))?;
    Ok(outcome(&out))
}

fn run_ok(dir: &Path, program: &Path, args: &[&str]) -> anyhow::Result<String> {
    let (ok, out) = run(dir, program, args)?;
    ensure!(ok, "{} {} failed:\n{out}", program.display(), args.join(" "));
    Ok(out)
}

fn git(dir: &Path, args: &[&str]) -> anyhow::Result<String> {
    run_ok(dir, Path::new("git"), args)
}

fn opkit(dir: &Path, args: &[&str]) -> anyhow::Result<(bool, String)> {
    run(dir, Path::new(env!("CARGO_BIN_EXE_opkit")), args)
}

fn read(dir: &Path, rel: &str) -> anyhow::Result<String> {
    std::fs::read_to_string(dir.join(rel)).with_context(|| rel.to_string())
}

/// Replaces `from` (which must be there) with `to` in `rel`.
fn edit(dir: &Path, rel: &str, from: &str, to: &str) -> anyhow::Result<()> {
    let text = read(dir, rel)?;
    ensure!(text.contains(from), "{rel} has no {from:?}:\n{text}");
    std::fs::write(dir.join(rel), text.replacen(from, to, 1))?;
    Ok(())
}

#[test]
fn an_update_keeps_the_users_edits_brings_the_new_templates_and_marks_the_conflict() -> anyhow::Result<()> {
    let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("alpha-update");
    let _ = std::fs::remove_dir_all(&root);
    let dir = root.join("guestbook");
    std::fs::create_dir_all(&dir)?;
    // A rustfmt configuration above the project (a monorepo's, say) formats its files: the
    // scaffolds the update compares with must be formatted the same way.
    std::fs::write(root.join("rustfmt.toml"), "max_width = 60\n")?;
    let old = old_opkit(&root)?;
    let gvk = ["--group", "webapp", "--version", "v1", "--kind", "Guestbook"];
    run_ok(
        &dir,
        &old,
        &[
            "init",
            "--domain",
            "my.domain",
            "--project-name",
            "guestbook",
            "--opkit-path",
            "-",
        ],
    )?;
    run_ok(&dir, &old, &[&["create", "api"][..], &gvk].concat())?;
    run_ok(
        &dir,
        &old,
        &[
            &["create", "webhook"][..],
            &gvk,
            &["--defaulting", "--programmatic-validation"],
        ]
        .concat(),
    )?;
    // The older template set is what the project starts from.
    ensure!(!read(&dir, "Makefile")?.contains("\nlint:"));
    ensure!(read(&dir, "README.md")?.contains("An operator, scaffolded"));
    ensure!(read(&dir, CONTROLLER)?.contains("\"the spec was reconciled\""));
    ensure!(read(&dir, TYPES)?.contains("What a user wants of a Guestbook"));
    ensure!(read(&dir, "PROJECT")?.contains(&format!("cliVersion: {OLD_VERSION}\n")));
    git(&dir, &["init", "-q"])?;
    git(&dir, &["add", "."])?;
    git(&dir, &["commit", "-q", "-m", "scaffolded by opkit 0.0.1"])?;

    // Without an old binary the command says how to get one.
    let (ok, out) = opkit(&dir, &["alpha", "update"])?;
    ensure!(
        !ok && out.contains("--version 0.0.1") && out.contains("--from-binary"),
        "{out}"
    );

    // The user's work: a field, a constant and another status message.
    edit(
        &dir,
        TYPES,
        "    pub foo: Option<String>,\n",
        "    pub foo: Option<String>,\n    /// Entries shown per page.\n    #[serde(default)]\n    pub page_size: u32,\n",
    )?;
    edit(
        &dir,
        CONTROLLER,
        "pub const AVAILABLE: &str = \"Available\";\n",
        "pub const AVAILABLE: &str = \"Available\";\n/// Entries per page when the spec says none.\npub const DEFAULT_PAGE_SIZE: u32 = 20;\n",
    )?;
    edit(
        &dir,
        CONTROLLER,
        "\"the spec was reconciled\"",
        "\"the guestbook is served\"",
    )?;

    // Uncommitted work is never mixed with an update.
    let old_arg = old.to_str().context("a UTF-8 path")?;
    let (ok, out) = opkit(&dir, &["alpha", "update", "--from-binary", old_arg])?;
    ensure!(!ok && out.contains("uncommitted changes"), "{out}");
    ensure!(
        !read(&dir, "Makefile")?.contains("\nlint:"),
        "a refused update changed files"
    );
    git(&dir, &["commit", "-q", "-am", "page size"])?;

    let (ok, out) = opkit(&dir, &["alpha", "update", "--from-binary", old_arg])?;
    println!("{out}");
    ensure!(!ok, "an update with a conflict must fail:\n{out}");
    for line in [
        "merged    Makefile",
        "merged    README.md",
        &format!("merged    {TYPES}"),
        &format!("conflict  {CONTROLLER}"),
        &format!("updated   PROJECT (cliVersion {})", env!("CARGO_PKG_VERSION")),
        &format!("conflicts in:\n  {CONTROLLER}\n"),
    ] {
        ensure!(out.contains(line), "no {line:?} in:\n{out}");
    }

    // The new templates arrived where the user did not edit.
    ensure!(read(&dir, "Makefile")?.contains("\n.PHONY: lint\nlint: ## "));
    ensure!(read(&dir, "README.md")?.contains("A Kubernetes operator in Rust, scaffolded"));
    let types = read(&dir, TYPES)?;
    ensure!(
        types.contains("What a user asks of a Guestbook")
            && types.contains("pub page_size: u32,")
            && !types.contains("<<<<<<<"),
        "{types}"
    );
    // In the controller, the clean edit stays and the line both changed is marked.
    let controller = read(&dir, CONTROLLER)?;
    ensure!(
        controller.contains("pub const DEFAULT_PAGE_SIZE: u32 = 20;"),
        "{controller}"
    );
    let conflict = controller
        .split("<<<<<<< current\n")
        .nth(1)
        .and_then(|rest| {
            rest.split(&format!(">>>>>>> opkit {}\n", env!("CARGO_PKG_VERSION")))
                .next()
        })
        .with_context(|| format!("no conflict markers:\n{controller}"))?;
    ensure!(
        conflict.contains("\"the guestbook is served\"")
            && conflict.contains("=======\n")
            && conflict.contains("\"the spec is reconciled\""),
        "{conflict}"
    );
    let project = read(&dir, "PROJECT")?;
    ensure!(
        project.contains(&format!("cliVersion: {}\n", env!("CARGO_PKG_VERSION")))
            && project.contains("kind: Guestbook")
            && project.contains("defaulting: true"),
        "{project}"
    );
    // Nothing else was touched.
    let changed = git(&dir, &["status", "--porcelain"])?;
    let expected = format!(" M Makefile\n M PROJECT\n M README.md\n M {TYPES}\n M {CONTROLLER}\n");
    ensure!(changed == expected, "changed:\n{changed}");
    let _ = std::fs::remove_dir_all(&root);
    Ok(())
}
