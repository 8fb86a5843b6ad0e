//! `opkit alpha update`: brings a scaffolded project to this opkit's templates. The project is
//! scaffolded twice from its `PROJECT` file, as the opkit it was made with and as this one, and
//! the difference between the two is merged into the user's files with git's three-way merge
//! (Kubebuilder's `alpha update`), so the user's edits stay and conflicts are marked.
use std::path::{Path, PathBuf};
use std::process::Command as Process;

use anyhow::{Context, bail, ensure};

use crate::{Command, Create, OPKIT_VERSION, Project, Report, ResourceEntry};

/// `opkit alpha ...`: commands whose form may still change.
#[derive(clap::Subcommand, Debug)]
pub enum Alpha {
    /// Bring the project to this opkit's templates: what changed between the opkit version the
    /// project records (PROJECT's cliVersion) and this one is merged into your files with git's
    /// three-way merge; your edits stay and conflicts are left marked. Run it in a clean git
    /// work tree.
    Update(UpdateArgs),
}

/// `opkit alpha update`.
#[derive(clap::Args, Debug)]
pub struct UpdateArgs {
    /// An `opkit` binary of the version the project was scaffolded with: it re-scaffolds the
    /// project as it was, the base of the merge.
    #[arg(long)]
    pub from_binary: Option<PathBuf>,
    /// The opkit version the project was scaffolded with (default: PROJECT's cliVersion; needed
    /// for projects made before it was recorded).
    #[arg(long)]
    pub from_version: Option<String>,
    /// The project directory.
    #[arg(long, default_value = ".")]
    pub dir: PathBuf,
}

/// What an update did: the report and the files left with conflict markers.
pub(crate) struct Updated {
    pub(crate) report: Report,
    pub(crate) conflicts: Vec<String>,
}

impl Updated {
    /// Fails, as `git merge` does, while files hold conflict markers, so scripts notice.
    pub(crate) fn conflicts_resolved(&self) -> anyhow::Result<()> {
        if self.conflicts.is_empty() {
            return Ok(());
        }
        bail!(
            "conflicts in:\n  {}\nresolve the conflict markers (<<<<<<< current ... >>>>>>> opkit {OPKIT_VERSION}) \
             in these files, then commit; `git diff` shows everything the update changed",
            self.conflicts.join("\n  ")
        )
    }
}

/// `opkit alpha update`.
pub(crate) fn update(args: &UpdateArgs) -> anyhow::Result<Updated> {
    let dir = args
        .dir
        .canonicalize()
        .with_context(|| format!("project directory {}", args.dir.display()))?;
    let project = Project::load(&dir)?;
    let Some(old_version) = args.from_version.clone().or_else(|| project.cli_version.clone()) else {
        bail!(
            "PROJECT records no cliVersion (the project was made by an opkit older than `alpha update`): \
             pass the version it was made with as --from-version <version>"
        );
    };
    let mut report = Report::default();
    if args.from_binary.is_none() && old_version == OPKIT_VERSION {
        report.lines.push(format!(
            "unchanged PROJECT (already at opkit {OPKIT_VERSION}, the version of this opkit)"
        ));
        return Ok(Updated {
            report,
            conflicts: Vec::new(),
        });
    }
    let Some(from_binary) = &args.from_binary else {
        bail!(
            "the project was scaffolded by opkit {old_version}; to see what you changed, `opkit alpha update` \
             re-scaffolds it with that version. Get one with\n  \
             cargo install opkit-operator --version {old_version} --root /tmp/opkit-{old_version}\n\
             (or build `opkit` from a checkout of {old_version}) and pass --from-binary /tmp/opkit-{old_version}/bin/opkit"
        );
    };
    let from_binary = from_binary
        .canonicalize()
        .with_context(|| format!("--from-binary {}", from_binary.display()))?;
    git_installed()?;
    committed(&dir)?;

    let scratch = Scratch::in_dir(&dir.join("target"))?;
    let lines = replay(&project);
    scaffold_with_binary(&from_binary, &old_version, &lines, &scratch.old)?;
    scaffold_here(&lines, &scratch.new)?;
    let labels = Labels {
        old: format!("opkit {old_version}"),
        new: format!("opkit {OPKIT_VERSION}"),
    };
    let mut updated = merge_trees(&dir, &scratch, &labels)?;

    let mut project = Project::load(&dir)?;
    project.cli_version = Some(OPKIT_VERSION.into());
    project.save(&dir)?;
    updated
        .report
        .lines
        .push(format!("updated   PROJECT (cliVersion {OPKIT_VERSION})"));
    if updated.conflicts.is_empty() {
        updated.report.notes.push(
            "next: review the update with `git diff`, then `make manifests`, `make test` and commit".into(),
        );
    }
    Ok(updated)
}

/// The opkit command lines that re-create the project from its `PROJECT` file, in an order
/// each command accepts: every entry's `create api` in the recorded order, its admission
/// webhooks right after it, and a conversion as soon as its hub and spokes exist.
fn replay(p: &Project) -> Vec<Vec<String>> {
    let strings = |words: &[&str]| words.iter().map(|w| w.to_string()).collect::<Vec<_>>();
    let mut lines = vec![strings(&[
        "init",
        "--domain",
        &p.domain,
        "--project-name",
        &p.project_name,
        "--opkit-path",
        "-",
    ])];
    let gvk = |e: &ResourceEntry| strings(&["--group", &e.group, "--version", &e.version, "--kind", &e.kind]);
    let mut converted = vec![false; p.resources.len()];
    for (i, e) in p.resources.iter().enumerate() {
        let mut api = strings(&["create", "api"]);
        api.extend(gvk(e));
        if e.builtin {
            api.push("--resource=false".into());
        } else {
            api.push(format!("--namespaced={}", e.namespaced));
            api.push(format!("--controller={}", e.controller));
        }
        lines.push(api);
        let made = &p.resources[..=i];
        for (j, hub) in made.iter().enumerate() {
            let admission = j == i && (hub.defaulting || hub.validation);
            let conversion = !hub.spokes.is_empty()
                && !converted[j]
                && hub.spokes.iter().all(|v| {
                    made.iter()
                        .any(|s| !s.builtin && s.group == hub.group && s.kind == hub.kind && &s.version == v)
                });
            if !(admission || conversion) {
                continue;
            }
            let mut webhook = strings(&["create", "webhook"]);
            webhook.extend(gvk(hub));
            if admission && hub.defaulting {
                webhook.push("--defaulting".into());
            }
            if admission && hub.validation {
                webhook.push("--programmatic-validation".into());
            }
            if conversion {
                converted[j] = true;
                webhook.push("--conversion".into());
                for v in &hub.spokes {
                    webhook.extend(strings(&["--spoke", v]));
                }
            }
            lines.push(webhook);
        }
    }
    lines
}

/// The command line as the operator binary parses it.
#[derive(clap::Parser)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

fn parse(line: &[String]) -> anyhow::Result<Command> {
    let cli: Cli =
        clap::Parser::try_parse_from(std::iter::once("opkit").chain(line.iter().map(String::as_str)))?;
    Ok(cli.command)
}

/// The new scaffold: this opkit's own commands, called directly.
fn scaffold_here(lines: &[Vec<String>], dir: &Path) -> anyhow::Result<()> {
    for line in lines {
        let done = match parse(line)? {
            Command::Init(mut a) => {
                a.dir = dir.to_path_buf();
                crate::init(&a)
            }
            Command::Create(Create::Api(mut a)) => {
                a.dir = dir.to_path_buf();
                crate::create_api(&a)
            }
            Command::Create(Create::Webhook(mut a)) => {
                a.dir = dir.to_path_buf();
                crate::create_webhook(&a)
            }
            Command::Alpha(_) => bail!("a replay has no alpha commands"),
        };
        done.with_context(|| {
            format!(
                "re-scaffolding with opkit {OPKIT_VERSION}: opkit {}",
                line.join(" ")
            )
        })?;
    }
    Ok(())
}

/// The old scaffold: the same command lines run by the old opkit binary, in `dir`.
fn scaffold_with_binary(
    binary: &Path,
    version: &str,
    lines: &[Vec<String>],
    dir: &Path,
) -> anyhow::Result<()> {
    for line in lines {
        let out = Process::new(binary)
            .args(line)
            .current_dir(dir)
            .output()
            .with_context(|| format!("running {}", binary.display()))?;
        ensure!(
            out.status.success(),
            "re-scaffolding with opkit {version}: `{} {}` failed:\n{}{}",
            binary.display(),
            line.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

fn git_installed() -> anyhow::Result<()> {
    match Process::new("git").arg("--version").output() {
        Ok(out) if out.status.success() => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => bail!(
            "git is not installed (or not on PATH): `opkit alpha update` merges with `git merge-file` \
             and works only in a git work tree"
        ),
        Ok(out) => bail!("`git --version` failed: {}", String::from_utf8_lossy(&out.stderr)),
        Err(e) => Err(e).context("running git"),
    }
}

/// Refuses a project outside git or with uncommitted changes: the update must show as a diff
/// of its own, to review or undo.
fn committed(dir: &Path) -> anyhow::Result<()> {
    let git = |args: &[&str]| {
        Process::new("git")
            .args(args)
            .current_dir(dir)
            .output()
            .context("running git")
    };
    let inside = git(&["rev-parse", "--is-inside-work-tree"])?;
    ensure!(
        inside.status.success() && String::from_utf8_lossy(&inside.stdout).trim() == "true",
        "{} is not in a git work tree: commit the project to git first, so that the update shows as a diff you can review or undo",
        dir.display()
    );
    let status = git(&["status", "--porcelain", "--", "."])?;
    ensure!(
        status.status.success(),
        "`git status` failed: {}",
        String::from_utf8_lossy(&status.stderr)
    );
    let changes = String::from_utf8_lossy(&status.stdout);
    ensure!(
        changes.trim().is_empty(),
        "the project has uncommitted changes:\n{}commit them (or stash them) first, so that the update shows as a diff of its own",
        changes
    );
    Ok(())
}

/// Two fresh scaffold directories and an empty file (the base of a file the old opkit did not
/// scaffold), removed when dropped.
struct Scratch {
    root: PathBuf,
    old: PathBuf,
    new: PathBuf,
    empty: PathBuf,
}

impl Scratch {
    #[cfg(test)]
    fn new() -> anyhow::Result<Scratch> {
        Scratch::in_dir(&std::env::temp_dir())
    }

    /// Scratch scaffolds under `dir`: below the project (in its ignored `target/`), rustfmt
    /// formats them with the configuration it finds for the project's own files (a
    /// `rustfmt.toml` in the project or a folder above it), so a file the user never touched
    /// reads the same as its old scaffold and merges without a conflict.
    fn in_dir(dir: &Path) -> anyhow::Result<Scratch> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        let root = dir.join(format!("opkit-alpha-update-{}-{nanos}", std::process::id()));
        let s = Scratch {
            old: root.join("old"),
            new: root.join("new"),
            empty: root.join("empty"),
            root,
        };
        std::fs::create_dir_all(&s.old)?;
        std::fs::create_dir_all(&s.new)?;
        std::fs::write(&s.empty, "")?;
        Ok(s)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// The conflict-marker names of the two scaffolds.
struct Labels {
    old: String,
    new: String,
}

/// Every file under `root` as a `/`-separated relative path, sorted; `.git`, `target` and the
/// root's `PROJECT` left out.
fn files(root: &Path) -> anyhow::Result<Vec<String>> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) -> anyhow::Result<()> {
        for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
            let entry = entry?;
            let path = entry.path();
            let name = entry.file_name();
            if entry.file_type()?.is_dir() {
                if name != ".git" && name != "target" {
                    walk(root, &path, out)?;
                }
                continue;
            }
            let rel = path.strip_prefix(root)?;
            let rel: Vec<_> = rel.iter().map(|c| c.to_string_lossy()).collect();
            let rel = rel.join("/");
            if rel != "PROJECT" {
                out.push(rel);
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    walk(root, root, &mut out)?;
    out.sort();
    Ok(out)
}

/// Brings the old→new difference of every scaffolded file into the user's tree at `user`.
fn merge_trees(user: &Path, scratch: &Scratch, labels: &Labels) -> anyhow::Result<Updated> {
    let mut report = Report::default();
    let mut conflicts = Vec::new();
    let mut same = 0;
    let new_files = files(&scratch.new)?;
    for rel in &new_files {
        let new = scratch.new.join(rel);
        let old = scratch.old.join(rel);
        let new_text = std::fs::read(&new)?;
        let old_text = std::fs::read(&old).ok();
        if old_text.as_deref() == Some(new_text.as_slice()) {
            same += 1;
            continue;
        }
        let mine = user.join(rel);
        if !mine.exists() {
            if old_text.is_none() {
                if let Some(parent) = mine.parent() {
                    std::fs::create_dir_all(parent)?;
                }
                std::fs::write(&mine, &new_text)?;
                report.lines.push(format!("added     {rel}"));
            } else {
                report.lines.push(format!(
                    "skipped   {rel} (deleted in your tree; left deleted, though {} changed it)",
                    labels.new
                ));
            }
            continue;
        }
        let base = if old_text.is_some() { &old } else { &scratch.empty };
        let out = Process::new("git")
            .arg("merge-file")
            .arg("-p")
            .args(["-L", "current", "-L", &labels.old, "-L", &labels.new])
            .arg(&mine)
            .arg(base)
            .arg(&new)
            .output()
            .context("running git merge-file")?;
        let conflicted = match out.status.code() {
            Some(0) => false,
            Some(1..=127) => true,
            _ => bail!(
                "git merge-file {rel} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            ),
        };
        let current = std::fs::read(&mine).with_context(|| format!("reading {}", mine.display()))?;
        if out.stdout == current {
            report.lines.push(format!(
                "unchanged {rel} (has the changes of {} already)",
                labels.new
            ));
            continue;
        }
        std::fs::write(&mine, &out.stdout).with_context(|| format!("writing {}", mine.display()))?;
        if conflicted {
            report.lines.push(format!("conflict  {rel}"));
            conflicts.push(rel.clone());
        } else {
            report.lines.push(format!("merged    {rel}"));
        }
    }
    for rel in files(&scratch.old)? {
        if new_files.binary_search(&rel).is_err() && user.join(&rel).exists() {
            report.lines.push(format!(
                "kept      {rel} ({} no longer scaffolds it; delete it if nothing uses it)",
                labels.new
            ));
        }
    }
    report.notes.push(format!(
        "note: {same} scaffolded files are the same in {} and {}; left as they are",
        labels.old, labels.new
    ));
    Ok(Updated { report, conflicts })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LAYOUT;

    fn entry(group: &str, version: &str, kind: &str) -> ResourceEntry {
        ResourceEntry {
            group: group.into(),
            version: version.into(),
            kind: kind.into(),
            namespaced: true,
            controller: false,
            defaulting: false,
            validation: false,
            spokes: Vec::new(),
            builtin: false,
        }
    }

    /// A project of every shape: a kind with webhooks and a conversion to a later version, a
    /// cluster-scoped kind without a controller and a controller of a built-in kind.
    fn project() -> Project {
        Project {
            layout: LAYOUT.into(),
            cli_version: Some("0.0.1".into()),
            domain: "my.domain".into(),
            project_name: "demo".into(),
            resources: vec![
                ResourceEntry {
                    controller: true,
                    defaulting: true,
                    validation: true,
                    spokes: vec!["v2".into()],
                    ..entry("webapp", "v1", "Guestbook")
                },
                entry("webapp", "v2", "Guestbook"),
                ResourceEntry {
                    namespaced: false,
                    ..entry("infra", "v1", "Tenant")
                },
                ResourceEntry {
                    controller: true,
                    builtin: true,
                    ..entry("apps", "v1", "Deployment")
                },
            ],
        }
    }

    #[test]
    fn the_replay_adds_webhooks_after_their_kind_and_a_conversion_after_its_spokes() {
        let lines: Vec<String> = replay(&project()).iter().map(|l| l.join(" ")).collect();
        let gb = "--group webapp --version v1 --kind Guestbook";
        assert_eq!(
            lines,
            [
                "init --domain my.domain --project-name demo --opkit-path -".to_string(),
                format!("create api {gb} --namespaced=true --controller=true"),
                format!("create webhook {gb} --defaulting --programmatic-validation"),
                "create api --group webapp --version v2 --kind Guestbook --namespaced=true --controller=false"
                    .into(),
                format!("create webhook {gb} --conversion --spoke v2"),
                "create api --group infra --version v1 --kind Tenant --namespaced=false --controller=false"
                    .into(),
                "create api --group apps --version v1 --kind Deployment --resource=false".into(),
            ]
        );
    }

    #[test]
    fn the_replay_scaffolds_the_project_its_project_file_records() {
        let d = std::env::temp_dir().join(format!("opkit-scaffold-unit-replay-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        let p = project();
        scaffold_here(&replay(&p), &d).unwrap();
        let again = Project::load(&d).unwrap();
        assert_eq!(again.resources, p.resources);
        assert_eq!(again.cli_version.as_deref(), Some(OPKIT_VERSION));
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_project_file_without_a_cli_version_still_loads() {
        let d = std::env::temp_dir().join(format!("opkit-scaffold-unit-noversion-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(
            d.join("PROJECT"),
            "layout: opkit.dev/v1\ndomain: my.domain\nprojectName: demo\nresources: []\n",
        )
        .unwrap();
        assert_eq!(Project::load(&d).unwrap().cli_version, None);
        let e = update(&UpdateArgs {
            from_binary: None,
            from_version: None,
            dir: d.clone(),
        })
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("--from-version"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn each_file_is_added_merged_or_left_as_the_user_has_it() {
        let s = Scratch::new().unwrap();
        let user = s.root.join("user");
        let put = |dir: &Path, rel: &str, text: &str| {
            let p = dir.join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        };
        for (dir, text) in [(&s.old, "a\nb\nc\nd\ne\n"), (&s.new, "a\nB\nc\nd\ne\n")] {
            put(dir, "clean.txt", text);
            put(dir, "conflict.txt", text);
            put(dir, "deleted.txt", text);
            put(dir, "same.txt", "same\n");
        }
        put(&s.new, "new/added.txt", "added\n");
        put(&s.old, "gone.txt", "gone\n");
        put(&user, "clean.txt", "a\nb\nc\nd\nE\n");
        put(&user, "conflict.txt", "a\nmine\nc\nd\ne\n");
        put(&user, "same.txt", "edited\n");
        put(&user, "gone.txt", "gone\n");
        put(&s.new, "target/debug/build.txt", "build output\n");
        let labels = Labels {
            old: "opkit 0.0.1".into(),
            new: "opkit 0.0.2".into(),
        };
        let u = merge_trees(&user, &s, &labels).unwrap();
        let read = |rel: &str| std::fs::read_to_string(user.join(rel)).unwrap();
        assert_eq!(read("clean.txt"), "a\nB\nc\nd\nE\n");
        let c = read("conflict.txt");
        assert!(
            c.contains("<<<<<<< current\nmine\n") && c.contains("B\n>>>>>>> opkit 0.0.2\n"),
            "{c}"
        );
        assert_eq!(u.conflicts, ["conflict.txt"]);
        assert!(!user.join("deleted.txt").exists());
        assert_eq!(read("same.txt"), "edited\n");
        assert_eq!(read("new/added.txt"), "added\n");
        assert!(!user.join("target").exists());
        assert_eq!(read("gone.txt"), "gone\n");
        let r = u.report.to_string();
        for line in [
            "merged    clean.txt",
            "conflict  conflict.txt",
            "skipped   deleted.txt (deleted in your tree",
            "added     new/added.txt",
            "kept      gone.txt",
            "note: 1 scaffolded files are the same",
        ] {
            assert!(r.contains(line), "{line}:\n{r}");
        }
        let e = u.conflicts_resolved().unwrap_err().to_string();
        assert!(e.contains("  conflict.txt\n"), "{e}");
    }
}
