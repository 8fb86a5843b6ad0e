//! `opkit init`, `opkit create api` and `opkit create webhook`: a new operator on opkit in a few
//! commands, laid out like opkit's own repository (types crate, controllers crate, operator
//! binary, `config/`, the same Makefile targets).
//!
//! Commands are safe to re-run: a file that exists is never overwritten (it is reported as
//! skipped), code is added to existing files only at `// +opkit:scaffold:` markers and only
//! once, and the `PROJECT` file records what was scaffolded so a repeated `create api` is
//! refused with a clear message.
#![deny(missing_docs)]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail, ensure};
use serde::{Deserialize, Serialize};

mod builtin;
mod names;
mod update;
pub use builtin::{BUILTINS, Builtin};
pub use names::{Resource, plural};
pub use update::{Alpha, UpdateArgs};

/// The version of the opkit crates a new project depends on.
pub const OPKIT_VERSION: &str = env!("CARGO_PKG_VERSION");

/// The scaffolding commands, for an operator binary to offer next to its own.
#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Start a new operator project in the current (empty) directory.
    Init(InitArgs),
    /// Add an API (types, controller, sample, test) or a webhook to the project.
    #[command(subcommand)]
    Create(Create),
    /// Commands whose form may still change: `alpha update` brings a project to this opkit's
    /// templates.
    #[command(subcommand)]
    Alpha(Alpha),
}

/// `opkit init`.
#[derive(clap::Args, Debug)]
pub struct InitArgs {
    /// The domain of the project's API groups (`--group webapp` → `webapp.<domain>`).
    #[arg(long)]
    pub domain: String,
    /// The project's name, a DNS label (default: the directory's name).
    #[arg(long)]
    pub project_name: Option<String>,
    /// An opkit checkout to build against instead of the crate registry (default: the checkout
    /// this binary was built from, when it still exists; `-` for none).
    #[arg(long)]
    pub opkit_path: Option<PathBuf>,
    /// The project directory.
    #[arg(long, default_value = ".")]
    pub dir: PathBuf,
}

/// `opkit create ...`.
#[derive(clap::Subcommand, Debug)]
pub enum Create {
    /// Add a kind (or a version of one): types, CRD, controller, registry entry, RBAC, sample
    /// and a controller test; with `--resource=false`, a controller of a built-in kind.
    Api(ApiArgs),
    /// Add admission webhooks for a kind: handlers wired into the operator and its webhook
    /// configurations.
    Webhook(WebhookArgs),
}

/// `opkit create api`. The flags take Kubebuilder's forms: `--namespaced=false`,
/// `--resource false`, `--controller` (true).
#[derive(clap::Args, Debug)]
pub struct ApiArgs {
    /// The group, version and kind.
    #[command(flatten)]
    pub gvk: Gvk,
    /// Objects of the kind live in namespaces (false: cluster-scoped). Default: true for a new
    /// kind; a built-in kind has the scope Kubernetes gives it.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub namespaced: Option<bool>,
    /// Generate the types and the CRD. false: a controller for a built-in kind (`--group apps
    /// --version v1 --kind Deployment`, `--group core --version v1 --kind ConfigMap`, ...).
    #[arg(long, default_value_t = true, num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub resource: bool,
    /// Generate a controller.
    #[arg(long, default_value_t = true, num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub controller: bool,
    /// The project directory.
    #[arg(long, default_value = ".")]
    pub dir: PathBuf,
}

/// `opkit create webhook`.
#[derive(clap::Args, Debug)]
pub struct WebhookArgs {
    /// The group, version and kind (created with `create api` before).
    #[command(flatten)]
    pub gvk: Gvk,
    /// A mutating webhook that fills in defaults.
    #[arg(long)]
    pub defaulting: bool,
    /// A validating webhook with checks written in Rust.
    #[arg(long)]
    pub programmatic_validation: bool,
    /// A conversion webhook: `--version` is the hub, each `--spoke` version converts to it
    /// and back (Kubebuilder's `--conversion --spoke v2`).
    #[arg(long)]
    pub conversion: bool,
    /// A version converted to and from the hub (repeatable or comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub spoke: Vec<String>,
    /// The project directory.
    #[arg(long, default_value = ".")]
    pub dir: PathBuf,
}

/// Group, version and kind, as Kubebuilder takes them.
#[derive(clap::Args, Debug, Clone)]
pub struct Gvk {
    /// The API group without the domain, e.g. `webapp`; for a built-in kind `core`, `apps`,
    /// `batch` or `networking`.
    #[arg(long)]
    pub group: String,
    /// The version, e.g. `v1`, `v1alpha1`.
    #[arg(long)]
    pub version: String,
    /// The kind, in UpperCamelCase, e.g. `Guestbook`.
    #[arg(long)]
    pub kind: String,
}

/// Runs one scaffolding command and prints what it did.
pub fn run(command: Command) -> anyhow::Result<()> {
    let report = match command {
        Command::Init(args) => init(&args)?,
        Command::Create(Create::Api(args)) => create_api(&args)?,
        Command::Create(Create::Webhook(args)) => create_webhook(&args)?,
        Command::Alpha(Alpha::Update(args)) => {
            let updated = update::update(&args)?;
            print!("{}", updated.report);
            return updated.conflicts_resolved();
        }
    };
    print!("{report}");
    Ok(())
}

/// The `PROJECT` file: what was scaffolded, read by every later command.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Project {
    /// The scaffold layout, so a future opkit can tell old projects apart.
    pub layout: String,
    /// The opkit version whose templates the project is at, so `opkit alpha update` can
    /// re-scaffold them to see what the user changed (absent in projects made before it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cli_version: Option<String>,
    /// Added to every `--group`.
    pub domain: String,
    /// The DNS label every generated name starts with.
    pub project_name: String,
    /// What `create api` added, in order.
    #[serde(default)]
    pub resources: Vec<ResourceEntry>,
}

/// One scaffolded group/version/kind.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ResourceEntry {
    /// The group without the domain.
    pub group: String,
    /// The version, e.g. `v1`.
    pub version: String,
    /// The kind, e.g. `Guestbook`.
    pub kind: String,
    /// Namespaced (true) or cluster-scoped.
    pub namespaced: bool,
    /// Whether this entry created the kind's controller.
    pub controller: bool,
    /// A defaulting webhook exists.
    #[serde(default)]
    pub defaulting: bool,
    /// A validating webhook exists.
    #[serde(default)]
    pub validation: bool,
    /// The versions converted to and from this one, the hub (empty: no conversion webhook).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub spokes: Vec<String>,
    /// A kind built into Kubernetes (`--resource=false`): a controller, no types or CRD.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub builtin: bool,
}

const LAYOUT: &str = "opkit.dev/v1";
const PROJECT_HEADER: &str =
    "# Written by `opkit init` and `opkit create`, read by them to know the layout. Edit with care.\n";

impl Project {
    fn load(dir: &Path) -> anyhow::Result<Project> {
        let path = dir.join("PROJECT");
        let text = std::fs::read_to_string(&path).with_context(|| {
            format!(
                "{} has no PROJECT file: run `opkit init --domain <domain>` there first",
                dir.display()
            )
        })?;
        let p: Project =
            serde_yaml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        ensure!(
            p.layout == LAYOUT,
            "{}: layout {:?} is not {LAYOUT:?}, which this opkit scaffolds",
            path.display(),
            p.layout
        );
        Ok(p)
    }

    fn save(&self, dir: &Path) -> anyhow::Result<()> {
        std::fs::write(
            dir.join("PROJECT"),
            format!("{PROJECT_HEADER}{}", serde_yaml::to_string(self)?),
        )?;
        Ok(())
    }

    /// The entry of a kind of the project (not a built-in one).
    fn find(&self, r: &Resource) -> Option<usize> {
        self.resources
            .iter()
            .position(|e| !e.builtin && e.group == r.group && e.version == r.version && e.kind == r.kind)
    }

    /// The entry whose controller lives in `crates/controllers/src/<kind_snake>.rs`, if any.
    fn controller_of(&self, kind: &str) -> Option<&ResourceEntry> {
        self.resources.iter().find(|e| e.controller && e.kind == kind)
    }
}

/// What a command did to each file, printed for the user.
#[derive(Debug, Default)]
pub struct Report {
    lines: Vec<String>,
    /// Files created or changed (and so formatted).
    touched: Vec<PathBuf>,
    notes: Vec<String>,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for l in self.lines.iter().chain(&self.notes) {
            writeln!(f, "{l}")?;
        }
        Ok(())
    }
}

impl Report {
    /// Every line, for tests and callers.
    pub fn lines(&self) -> &[String] {
        &self.lines
    }

    /// Creates `rel` with `content` unless it exists; an existing file is left alone.
    fn create(&mut self, root: &Path, rel: &str, content: &str) -> anyhow::Result<()> {
        let path = root.join(rel);
        match std::fs::read_to_string(&path) {
            Ok(old) if old == content => self.lines.push(format!("unchanged {rel}")),
            Ok(_) => self
                .lines
                .push(format!("skipped   {rel} (exists and differs; left as it is)")),
            Err(_) if path.exists() => bail!("{} exists but cannot be read", path.display()),
            Err(_) => {
                if let Some(parent) = path.parent() {
                    std::fs::create_dir_all(parent)?;
                }
                std::fs::write(&path, content)?;
                self.lines.push(format!("created   {rel}"));
                self.touched.push(path);
            }
        }
        Ok(())
    }

    /// Inserts `snippet` before the line holding `marker` in `rel`, unless `already` (a string
    /// unique to the snippet) is there. A missing marker is reported with what to add by hand.
    fn insert(
        &mut self,
        root: &Path,
        rel: &str,
        marker: &str,
        snippet: &str,
        already: &str,
    ) -> anyhow::Result<()> {
        let by_hand = format!("add this yourself:\n{snippet}");
        self.edit_at(root, rel, marker, already, &by_hand, |lines, i| {
            lines.insert(i, snippet.to_string());
        })
    }

    /// Replaces the line after `marker` in `rel` with `line` (indented like the marker),
    /// unless `already` is in the file.
    fn replace_after(
        &mut self,
        root: &Path,
        rel: &str,
        marker: &str,
        line: &str,
        already: &str,
    ) -> anyhow::Result<()> {
        let by_hand = format!("set `{line}` yourself");
        self.edit_at(
            root,
            rel,
            &format!("{marker}\n"),
            already,
            &by_hand,
            |lines, i| {
                let indent: String = lines[i].chars().take_while(|c| c.is_whitespace()).collect();
                let new = format!("{indent}{line}\n");
                match lines.get_mut(i + 1) {
                    Some(next) => *next = new,
                    None => lines.push(new),
                }
            },
        )
    }

    /// The skeleton of every edit of an existing file: nothing when `already` is there, a note
    /// with `by_hand` when the line holding `marker` is gone, else `change` on the file's lines
    /// (each with its newline) at the marker's index.
    fn edit_at(
        &mut self,
        root: &Path,
        rel: &str,
        marker: &str,
        already: &str,
        by_hand: &str,
        change: impl FnOnce(&mut Vec<String>, usize),
    ) -> anyhow::Result<()> {
        let path = root.join(rel);
        let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        if text.contains(already) {
            self.lines
                .push(format!("unchanged {rel} ({} is there)", already.trim()));
            return Ok(());
        }
        let mut lines: Vec<String> = text.split_inclusive('\n').map(String::from).collect();
        let Some(i) = lines.iter().position(|l| l.contains(marker)) else {
            self.notes.push(format!(
                "note: {rel} has no `{}` line any more; {by_hand}",
                marker.trim_end()
            ));
            self.lines.push(format!("skipped   {rel} (marker removed)"));
            return Ok(());
        };
        change(&mut lines, i);
        std::fs::write(&path, lines.concat())?;
        self.lines.push(format!("updated   {rel}"));
        self.touched.push(path);
        Ok(())
    }

    /// Formats the Rust files this command wrote, so the project stays `cargo fmt` clean. Done
    /// with rustfmt itself, file by file: files the command did not touch are not reformatted.
    fn format(&mut self) {
        let files: Vec<&PathBuf> = self
            .touched
            .iter()
            .filter(|p| p.extension().is_some_and(|e| e == "rs"))
            .collect();
        if files.is_empty() {
            return;
        }
        let status = std::process::Command::new("rustfmt")
            .args(["--edition", "2024"])
            .args(&files)
            .status();
        if !status.is_ok_and(|s| s.success()) {
            self.notes
                .push("note: rustfmt did not run; `cargo fmt --all` formats the new code".into());
        }
    }
}

/// Fills `{{name}}` placeholders; a placeholder left unfilled is a bug in the template.
fn render(template: &str, vars: &BTreeMap<&str, String>) -> String {
    let mut out = template.to_string();
    for (k, v) in vars {
        out = out.replace(&format!("{{{{{k}}}}}"), v);
    }
    debug_assert!(
        !out.contains("{{project") && !out.contains("{{kind"),
        "unfilled: {out}"
    );
    out
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
        && s.as_bytes()[0].is_ascii_lowercase()
}

/// Where this binary's opkit checkout is, if it is still there (a build from a clone).
fn own_checkout() -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent()?.parent()?;
    (root.join("crates/opkit/Cargo.toml").exists() && root.join("crates/testenv/Cargo.toml").exists())
        .then(|| root.to_path_buf())
}

/// `opkit init`: a new workspace in `args.dir`.
pub fn init(args: &InitArgs) -> anyhow::Result<Report> {
    let dir = &args.dir;
    std::fs::create_dir_all(dir)?;
    let dir = dir.canonicalize()?;
    if dir.join("PROJECT").exists() {
        bail!(
            "{} already has a PROJECT file: it is a project already",
            dir.display()
        );
    }
    let name = match &args.project_name {
        Some(n) => n.clone(),
        None => dir
            .file_name()
            .and_then(|n| n.to_str())
            .context("the directory has no name; pass --project-name")?
            .to_string(),
    };
    ensure!(
        is_dns_label(&name),
        "project name {name:?} must be a DNS label (lowercase letters, digits and '-', starting with a letter); pass --project-name"
    );
    ensure!(
        names::is_domain(&args.domain),
        "--domain {:?} must be a DNS subdomain such as my.domain",
        args.domain
    );
    let opkit_path = match &args.opkit_path {
        Some(p) if p.as_os_str() == "-" => None,
        Some(p) => Some(
            p.canonicalize()
                .with_context(|| format!("--opkit-path {}", p.display()))?,
        ),
        None => own_checkout(),
    };
    let patch = match &opkit_path {
        Some(p) => format!(
            "\n# opkit is not published yet: build against a local checkout.\n[patch.crates-io]\nopkit = {{ path = \"{0}/crates/opkit\" }}\nopkit-testenv = {{ path = \"{0}/crates/testenv\" }}\n",
            p.display()
        ),
        None => String::new(),
    };
    let vars = BTreeMap::from([
        ("project", name.clone()),
        ("project_snake", name.replace('-', "_")),
        ("domain", args.domain.clone()),
        ("opkit_version", OPKIT_VERSION.to_string()),
        ("patch", patch),
    ]);
    let mut r = Report::default();
    let files: [(&str, &str); 16] = [
        ("Cargo.toml", include_str!("../templates/Cargo.toml.tmpl")),
        ("Makefile", include_str!("../templates/Makefile.tmpl")),
        ("Dockerfile", include_str!("../templates/Dockerfile.tmpl")),
        ("README.md", include_str!("../templates/README.md.tmpl")),
        (".gitignore", include_str!("../templates/gitignore.tmpl")),
        (".dockerignore", include_str!("../templates/dockerignore.tmpl")),
        (
            ".github/workflows/lint.yml",
            include_str!("../templates/github-lint.yml.tmpl"),
        ),
        (
            ".github/workflows/test.yml",
            include_str!("../templates/github-test.yml.tmpl"),
        ),
        (
            ".github/workflows/test-e2e.yml",
            include_str!("../templates/github-test-e2e.yml.tmpl"),
        ),
        (
            "crates/api/Cargo.toml",
            include_str!("../templates/api.Cargo.toml.tmpl"),
        ),
        (
            "crates/api/src/lib.rs",
            include_str!("../templates/api.lib.rs.tmpl"),
        ),
        (
            "crates/controllers/Cargo.toml",
            include_str!("../templates/controllers.Cargo.toml.tmpl"),
        ),
        (
            "crates/controllers/src/lib.rs",
            include_str!("../templates/controllers.lib.rs.tmpl"),
        ),
        (
            "crates/operator/Cargo.toml",
            include_str!("../templates/operator.Cargo.toml.tmpl"),
        ),
        (
            "crates/operator/src/main.rs",
            include_str!("../templates/operator.main.rs.tmpl"),
        ),
        (
            "crates/testenv/Cargo.toml",
            include_str!("../templates/testenv.Cargo.toml.tmpl"),
        ),
    ];
    for (rel, t) in files {
        r.create(&dir, rel, &render(t, &vars))?;
    }
    r.create(
        &dir,
        "crates/testenv/src/main.rs",
        &render(include_str!("../templates/testenv.main.rs.tmpl"), &vars),
    )?;
    // The versions opkit is tested with, when building against a checkout.
    if let Some(lock) = opkit_path.map(|p| p.join("Cargo.lock")).filter(|l| l.exists()) {
        r.create(&dir, "Cargo.lock", &std::fs::read_to_string(lock)?)?;
    }
    Project {
        layout: LAYOUT.into(),
        cli_version: Some(OPKIT_VERSION.into()),
        domain: args.domain.clone(),
        project_name: name.clone(),
        resources: Vec::new(),
    }
    .save(&dir)?;
    r.lines.push("created   PROJECT".into());
    // The config directory `make manifests` fills.
    r.create(&dir, "config/samples/.gitkeep", "")?;
    r.format();
    r.notes.push(format!(
        "next: opkit create api --group <group> --version <version> --kind <Kind>   (in {})",
        dir.display()
    ));
    Ok(r)
}

fn vars_of(p: &Project, r: &Resource) -> BTreeMap<&'static str, String> {
    BTreeMap::from([
        ("project", p.project_name.clone()),
        ("project_snake", p.project_name.replace('-', "_")),
        ("domain", p.domain.clone()),
        ("group", r.group.clone()),
        ("group_domain", r.group_domain.clone()),
        ("group_dashed", r.group_domain.replace('.', "-")),
        ("version", r.version.clone()),
        ("kind", r.kind.clone()),
        ("kind_lower", r.kind.to_lowercase()),
        ("kind_snake", r.kind_snake.clone()),
        ("plural", r.plural.clone()),
        ("module", r.module.clone()),
    ])
}

/// `opkit create api`.
pub fn create_api(args: &ApiArgs) -> anyhow::Result<Report> {
    let dir = &args.dir;
    let mut project = Project::load(dir)?;
    if !args.resource {
        return create_builtin_controller(args, &mut project);
    }
    let res = Resource::new(
        &args.gvk.group,
        &args.gvk.version,
        &args.gvk.kind,
        &project.domain,
    )?;
    if project.find(&res).is_some() {
        bail!(
            "{} {}/{} already exists in this project (see PROJECT); nothing was changed",
            res.kind,
            res.group_domain,
            res.version
        );
    }
    let existing = project
        .resources
        .iter()
        .find(|e| !e.builtin && e.group == res.group && e.kind == res.kind)
        .cloned();
    // A new version of a kind has the kind's scope unless the flag says otherwise.
    let namespaced = args
        .namespaced
        .or(existing.as_ref().map(|e| e.namespaced))
        .unwrap_or(true);
    if let Some(e) = &existing {
        ensure!(
            e.namespaced == namespaced,
            "{} is {} in {}; every version of a kind has the same scope",
            res.kind,
            if e.namespaced {
                "namespaced"
            } else {
                "cluster-scoped"
            },
            e.version
        );
    }
    if args.controller && existing.is_none() {
        no_controller_yet(&project, &res.kind, &res.kind_snake)?;
    }
    let mut vars = vars_of(&project, &res);
    vars.insert(
        "namespaced_attr",
        if namespaced {
            "\n    namespaced,".into()
        } else {
            String::new()
        },
    );
    let mut r = Report::default();
    let module_dir = format!("crates/api/src/{}", res.module);
    r.create(
        dir,
        &format!("{module_dir}/mod.rs"),
        &render(include_str!("../templates/api.version.rs.tmpl"), &vars),
    )?;
    r.insert(
        dir,
        "crates/api/src/lib.rs",
        "// +opkit:scaffold:modules",
        &format!("pub mod {};\n", res.module),
        &format!("pub mod {};", res.module),
    )?;
    r.create(
        dir,
        &format!("{module_dir}/{}.rs", res.kind_snake),
        &render(include_str!("../templates/api.types.rs.tmpl"), &vars),
    )?;
    r.insert(
        dir,
        &format!("{module_dir}/mod.rs"),
        "// +opkit:scaffold:kinds",
        &format!("mod {0};\npub use {0}::*;\n", res.kind_snake),
        &format!("mod {};", res.kind_snake),
    )?;
    match &existing {
        // A new version of a known kind: served next to the others; the first stays stored.
        Some(_) => r.insert(
            dir,
            "crates/api/src/lib.rs",
            &format!("// +opkit:scaffold:versions:{}:{}", res.group, res.kind),
            &format!("        {}::{}::crd(),\n", res.module, res.kind),
            &format!("{}::{}::crd()", res.module, res.kind),
        )?,
        None => {
            r.insert(
                dir,
                "crates/api/src/lib.rs",
                "// +opkit:scaffold:kinds",
                &render(include_str!("../templates/api.kind-crd.rs.tmpl"), &vars),
                &format!("fn {}_crd()", res.kind_snake),
            )?;
            r.insert(
                dir,
                "crates/api/src/lib.rs",
                "// +opkit:scaffold:crds",
                &format!("        {}_crd(),\n", res.kind_snake),
                &format!("{}_crd(),", res.kind_snake),
            )?;
            let (module, registration) = if args.controller {
                r.create(
                    dir,
                    &format!("crates/controllers/src/{}.rs", res.kind_snake),
                    &render(include_str!("../templates/controller.rs.tmpl"), &vars),
                )?;
                let test = if namespaced {
                    include_str!("../templates/controller-test.rs.tmpl")
                } else {
                    include_str!("../templates/controller-test-cluster.rs.tmpl")
                };
                r.create(
                    dir,
                    &format!("crates/controllers/tests/{}.rs", res.kind_snake),
                    &render(test, &vars),
                )?;
                (
                    Some(format!("pub mod {};\n", res.kind_snake)),
                    include_str!("../templates/registration.rs.tmpl"),
                )
            } else {
                (None, include_str!("../templates/registration-crd-only.rs.tmpl"))
            };
            if let Some(m) = module {
                r.insert(
                    dir,
                    "crates/controllers/src/lib.rs",
                    "// +opkit:scaffold:modules",
                    &m,
                    m.trim(),
                )?;
            }
            r.insert(
                dir,
                "crates/controllers/src/lib.rs",
                "// +opkit:scaffold:registrations",
                &render(registration, &vars),
                &format!("{}_crd()]", res.kind_snake),
            )?;
        }
    }
    r.create(
        dir,
        &format!(
            "config/samples/{}_{}_{}.yaml",
            res.group,
            res.version,
            res.kind.to_lowercase()
        ),
        &render(include_str!("../templates/sample.yaml.tmpl"), &vars),
    )?;
    if args.controller && existing.is_none() {
        let line = format!(
            "E2E_SAMPLES += config/samples/{}_{}_{}.yaml",
            res.group,
            res.version,
            res.kind.to_lowercase()
        );
        r.insert(
            dir,
            "Makefile",
            "# +opkit:scaffold:e2e-samples",
            &format!("{line}\n"),
            &line,
        )?;
    }
    project.resources.push(ResourceEntry {
        group: res.group.clone(),
        version: res.version.clone(),
        kind: res.kind.clone(),
        namespaced,
        controller: args.controller && existing.is_none(),
        defaulting: false,
        validation: false,
        spokes: Vec::new(),
        builtin: false,
    });
    project.save(dir)?;
    r.lines.push("updated   PROJECT".into());
    r.format();
    let mut next = String::from("next: edit the types");
    if args.controller && existing.is_none() {
        let _ = write!(next, " and crates/controllers/src/{}.rs", res.kind_snake);
    }
    next.push_str(", then `make manifests` and `make test`");
    r.notes.push(next);
    Ok(r)
}

/// Refuses a second controller module named `kind_snake` (the same kind in another group, or
/// built in and in this project).
fn no_controller_yet(project: &Project, kind: &str, kind_snake: &str) -> anyhow::Result<()> {
    match project.controller_of(kind) {
        Some(e) => bail!(
            "crates/controllers/src/{kind_snake}.rs is the controller of {kind} in group {:?} already (see PROJECT); nothing was changed. Scaffold this one with --controller false and write its controller by hand under another name",
            e.group
        ),
        None => Ok(()),
    }
}

/// `opkit create api --resource=false --controller`: a controller for a kind Kubernetes
/// serves (Kubebuilder's `--resource=false` for `--group apps --kind Deployment`): no types,
/// no CRD; the controller, its registry entry and RBAC, a sample and a test.
fn create_builtin_controller(args: &ApiArgs, project: &mut Project) -> anyhow::Result<Report> {
    let dir = &args.dir;
    ensure!(
        args.controller,
        "--resource=false --controller=false scaffolds nothing: --resource=false makes a controller for a built-in kind"
    );
    let b = builtin::find(&args.gvk.group, &args.gvk.version, &args.gvk.kind)?;
    if let Some(n) = args.namespaced {
        let scope = if b.namespaced {
            "namespaced"
        } else {
            "cluster-scoped"
        };
        ensure!(
            n == b.namespaced,
            "{} is {scope} in Kubernetes; drop --namespaced",
            b.kind
        );
    }
    if project
        .resources
        .iter()
        .any(|e| e.builtin && e.group == b.flag && e.kind == b.kind)
    {
        bail!(
            "a controller for the built-in {} ({}) already exists in this project (see PROJECT); nothing was changed",
            b.kind,
            b.api_version()
        );
    }
    let kind_snake = names::snake(b.kind);
    no_controller_yet(project, b.kind, &kind_snake)?;
    let vars = BTreeMap::from([
        ("project", project.project_name.clone()),
        ("project_snake", project.project_name.replace('-', "_")),
        ("group", b.flag.to_string()),
        ("group_domain", b.group.to_string()),
        ("version", b.version.to_string()),
        ("api_version", b.api_version()),
        ("kind", b.kind.to_string()),
        ("kind_lower", b.kind.to_lowercase()),
        ("kind_snake", kind_snake.clone()),
        ("plural", b.plural.to_string()),
        ("rust_path", b.rust_path()),
    ]);
    let mut r = Report::default();
    r.create(
        dir,
        &format!("crates/controllers/src/{kind_snake}.rs"),
        &render(include_str!("../templates/controller-builtin.rs.tmpl"), &vars),
    )?;
    let test = if b.namespaced {
        include_str!("../templates/controller-builtin-test.rs.tmpl")
    } else {
        include_str!("../templates/controller-builtin-test-cluster.rs.tmpl")
    };
    r.create(
        dir,
        &format!("crates/controllers/tests/{kind_snake}.rs"),
        &render(test, &vars),
    )?;
    r.insert(
        dir,
        "crates/controllers/src/lib.rs",
        "// +opkit:scaffold:modules",
        &format!("pub mod {kind_snake};\n"),
        &format!("pub mod {kind_snake};"),
    )?;
    r.insert(
        dir,
        "crates/controllers/src/lib.rs",
        "// +opkit:scaffold:registrations",
        &render(include_str!("../templates/registration-builtin.rs.tmpl"), &vars),
        &format!("m.add({kind_snake}::{}Controller)", b.kind),
    )?;
    r.create(
        dir,
        &format!(
            "config/samples/{}_{}_{}.yaml",
            b.flag,
            b.version,
            b.kind.to_lowercase()
        ),
        &b.sample(),
    )?;
    project.resources.push(ResourceEntry {
        group: b.flag.to_string(),
        version: b.version.to_string(),
        kind: b.kind.to_string(),
        namespaced: b.namespaced,
        controller: true,
        defaulting: false,
        validation: false,
        spokes: Vec::new(),
        builtin: true,
    });
    project.save(dir)?;
    r.lines.push("updated   PROJECT".into());
    r.format();
    r.notes.push(format!(
        "next: edit crates/controllers/src/{kind_snake}.rs (its plan writes nothing yet), then `make manifests` and `make test`"
    ));
    Ok(r)
}

/// `opkit create webhook`.
pub fn create_webhook(args: &WebhookArgs) -> anyhow::Result<Report> {
    let dir = &args.dir;
    let mut project = Project::load(dir)?;
    let res = Resource::new(
        &args.gvk.group,
        &args.gvk.version,
        &args.gvk.kind,
        &project.domain,
    )?;
    let admission = args.defaulting || args.programmatic_validation;
    ensure!(
        admission || args.conversion,
        "say which webhooks: --defaulting, --programmatic-validation and/or --conversion --spoke <version>"
    );
    ensure!(
        args.conversion != args.spoke.is_empty(),
        "--conversion takes the versions converted to and from --version (the hub) as --spoke <version>, and --spoke goes only with --conversion"
    );
    ensure!(
        !project
            .resources
            .iter()
            .any(|e| e.builtin && e.group == res.group && e.version == res.version && e.kind == res.kind),
        "{} is built into Kubernetes: webhooks for it are not scaffolded (the handlers would read a spec of this project's types); write them by hand with `Webhooks::mutating` / `validating`",
        res.kind
    );
    let Some(i) = project.find(&res) else {
        bail!(
            "{} {}/{} is not in this project: run `opkit create api` for it first",
            res.kind,
            res.group_domain,
            res.version
        );
    };
    let entry = project.resources[i].clone();
    if admission {
        if (entry.defaulting || !args.defaulting) && (entry.validation || !args.programmatic_validation) {
            bail!(
                "{} {}/{} already has these webhooks (see PROJECT); nothing was changed",
                res.kind,
                res.group_domain,
                res.version
            );
        }
        ensure!(
            !(entry.defaulting || entry.validation),
            "{} already has webhooks in crates/controllers/src/{}_webhook.rs; add the others there by hand",
            res.kind,
            res.kind_snake
        );
    }
    let mut spokes = Vec::new();
    if args.conversion {
        ensure!(
            !project
                .resources
                .iter()
                .any(|e| e.group == res.group && e.kind == res.kind && !e.spokes.is_empty()),
            "{} already has a conversion in crates/controllers/src/{}_conversion.rs; add versions there by hand",
            res.kind,
            res.kind_snake
        );
        for v in &args.spoke {
            let spoke = Resource::new(&res.group, v, &res.kind, &project.domain)?;
            ensure!(v != &res.version, "--spoke {v} is the hub (--version) itself");
            ensure!(
                project.find(&spoke).is_some(),
                "{} {}/{v} is not in this project: run `opkit create api --group {} --version {v} --kind {}` first",
                res.kind,
                res.group_domain,
                res.group,
                res.kind
            );
            spokes.push(spoke);
        }
    }
    let mut vars = vars_of(&project, &res);
    let mut r = Report::default();
    if admission {
        let (mut chain, mut handlers) = (String::new(), String::new());
        if args.defaulting {
            chain.push_str(&render(
                include_str!("../templates/webhook-chain-defaulting.rs.tmpl"),
                &vars,
            ));
            handlers.push_str(&render(
                include_str!("../templates/webhook-defaulting.rs.tmpl"),
                &vars,
            ));
        }
        if args.programmatic_validation {
            chain.push_str(&render(
                include_str!("../templates/webhook-chain-validation.rs.tmpl"),
                &vars,
            ));
            handlers.push_str(&render(
                include_str!("../templates/webhook-validation.rs.tmpl"),
                &vars,
            ));
        }
        vars.insert("webhook_chain", chain.trim_end().to_string());
        vars.insert("webhook_handlers", handlers);
        let module = format!("{}_webhook", res.kind_snake);
        r.create(
            dir,
            &format!("crates/controllers/src/{module}.rs"),
            &render(include_str!("../templates/webhook.rs.tmpl"), &vars),
        )?;
        r.insert(
            dir,
            "crates/controllers/src/lib.rs",
            "// +opkit:scaffold:modules",
            &format!("pub mod {module};\n"),
            &format!("pub mod {module};"),
        )?;
    }
    if args.conversion {
        let (mut chain, mut fns) = (String::new(), String::new());
        let mut all = vec![format!("\"{}/{}\"", res.group_domain, res.version)];
        for spoke in &spokes {
            let mut v = vars.clone();
            v.insert("spoke", spoke.version.clone());
            v.insert("spoke_module", spoke.module.clone());
            let _ = write!(chain, "\n        .spoke({0}_to_hub, {0}_from_hub)", spoke.version);
            fns.push_str(&render(include_str!("../templates/conversion-spoke.rs.tmpl"), &v));
            all.push(format!("\"{}/{}\"", spoke.group_domain, spoke.version));
        }
        let mut v = vars.clone();
        v.insert("spoke_chain", chain);
        v.insert("spoke_fns", fns);
        v.insert("all_versions", all.join(", "));
        let module = format!("{}_conversion", res.kind_snake);
        r.create(
            dir,
            &format!("crates/controllers/src/{module}.rs"),
            &render(include_str!("../templates/conversion.rs.tmpl"), &v),
        )?;
        r.insert(
            dir,
            "crates/controllers/src/lib.rs",
            "// +opkit:scaffold:modules",
            &format!("pub mod {module};\n"),
            &format!("pub mod {module};"),
        )?;
    }
    let entry = &mut project.resources[i];
    entry.defaulting |= args.defaulting;
    entry.validation |= args.programmatic_validation;
    entry.spokes.extend(spokes.iter().map(|s| s.version.clone()));
    // The registration's one `webhooks:` line serves every webhook of the kind.
    let kind_entries = || {
        project
            .resources
            .iter()
            .filter(|e| !e.builtin && e.group == res.group && e.kind == res.kind)
    };
    let has_admission = kind_entries().any(|e| e.defaulting || e.validation);
    let has_conversion = kind_entries().any(|e| !e.spokes.is_empty());
    let line = match (has_admission, has_conversion) {
        (true, false) => format!("webhooks: {}_webhook::webhooks,", res.kind_snake),
        (false, true) => format!(
            "webhooks: |w| w.conversion({}_conversion::conversion()),",
            res.kind_snake
        ),
        _ => format!(
            "webhooks: |w| {0}_webhook::webhooks(w).conversion({0}_conversion::conversion()),",
            res.kind_snake
        ),
    };
    r.replace_after(
        dir,
        "crates/controllers/src/lib.rs",
        &format!("// +opkit:scaffold:webhooks:{}", res.kind),
        &line,
        &line,
    )?;
    project.save(dir)?;
    r.lines.push("updated   PROJECT".into());
    r.format();
    r.notes.push(if args.conversion {
        "next: map the fields in the conversion when a version's schema changes; `make manifests` gives the CRD its conversion webhook; `make test`".into()
    } else {
        "next: `make manifests` writes config/webhook; `make test`".into()
    });
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("opkit-scaffold-unit-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("a scratch directory");
        d
    }

    #[test]
    fn an_edited_file_is_never_overwritten() {
        let d = scratch("create");
        let mut r = Report::default();
        r.create(&d, "a/b.txt", "generated\n").unwrap();
        std::fs::write(d.join("a/b.txt"), "edited\n").unwrap();
        r.create(&d, "a/b.txt", "generated\n").unwrap();
        assert_eq!(std::fs::read_to_string(d.join("a/b.txt")).unwrap(), "edited\n");
        assert!(r.lines()[1].starts_with("skipped"), "{:?}", r.lines());
        std::fs::write(d.join("a/b.txt"), "generated\n").unwrap();
        r.create(&d, "a/b.txt", "generated\n").unwrap();
        assert!(r.lines()[2].starts_with("unchanged"), "{:?}", r.lines());
    }

    #[test]
    fn insertions_happen_once_and_a_removed_marker_is_reported() {
        let d = scratch("insert");
        std::fs::write(d.join("lib.rs"), "a\n    // +m\nb\n").unwrap();
        let mut r = Report::default();
        r.insert(&d, "lib.rs", "// +m", "    x;\n", "x;").unwrap();
        r.insert(&d, "lib.rs", "// +m", "    x;\n", "x;").unwrap();
        assert_eq!(
            std::fs::read_to_string(d.join("lib.rs")).unwrap(),
            "a\n    x;\n    // +m\nb\n"
        );
        std::fs::write(d.join("lib.rs"), "a\n").unwrap();
        r.insert(&d, "lib.rs", "// +m", "    y;\n", "y;").unwrap();
        assert_eq!(std::fs::read_to_string(d.join("lib.rs")).unwrap(), "a\n");
        assert!(r.to_string().contains("add this yourself"), "{r}");
    }

    #[test]
    fn the_line_after_a_marker_is_replaced_once_with_its_indent() {
        let d = scratch("replace");
        std::fs::write(d.join("lib.rs"), "a\n    // +w\n    old,\nb\n").unwrap();
        let mut r = Report::default();
        r.replace_after(&d, "lib.rs", "// +w", "new,", "new").unwrap();
        r.replace_after(&d, "lib.rs", "// +w", "new,", "new").unwrap();
        assert_eq!(
            std::fs::read_to_string(d.join("lib.rs")).unwrap(),
            "a\n    // +w\n    new,\nb\n"
        );
        assert!(r.lines()[1].starts_with("unchanged"), "{:?}", r.lines());
        std::fs::write(d.join("lib.rs"), "a\n").unwrap();
        r.replace_after(&d, "lib.rs", "// +w", "new,", "new").unwrap();
        assert!(r.to_string().contains("set `new,` yourself"), "{r}");
    }

    /// `opkit <args>` as the operator binary parses it.
    fn parse(args: &str) -> Command {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(subcommand)]
            command: Command,
        }
        let cli: Cli = clap::Parser::try_parse_from(std::iter::once("opkit").chain(args.split_whitespace()))
            .unwrap_or_else(|e| panic!("{args}: {e}"));
        cli.command
    }

    fn api_args(args: &str) -> ApiArgs {
        match parse(&format!("create api {args}")) {
            Command::Create(Create::Api(a)) => a,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn api_flags_take_kubebuilders_forms() {
        let gvk = "--group apps --version v1 --kind Deployment";
        let a = api_args(&format!("{gvk} --resource=false --controller"));
        assert_eq!((a.resource, a.controller, a.namespaced), (false, true, None));
        let a = api_args(&format!("{gvk} --namespaced=false --controller=true"));
        assert_eq!(
            (a.resource, a.controller, a.namespaced),
            (true, true, Some(false))
        );
        let a = api_args(&format!("{gvk} --controller false --namespaced"));
        assert_eq!(
            (a.resource, a.controller, a.namespaced),
            (true, false, Some(true))
        );
        let a = api_args(&format!("{gvk} --resource false"));
        assert_eq!((a.resource, a.controller, a.namespaced), (false, true, None));
    }

    /// A fresh project in a scratch directory; `commands` are `create api` argument lines.
    fn scaffolded(name: &str, commands: &[&str]) -> PathBuf {
        let d = scratch(name);
        init(&InitArgs {
            domain: "my.domain".into(),
            project_name: Some("demo".into()),
            opkit_path: Some("-".into()),
            dir: d.clone(),
        })
        .unwrap();
        for c in commands {
            let mut a = api_args(c);
            a.dir = d.clone();
            create_api(&a).unwrap_or_else(|e| panic!("{c}: {e:#}"));
        }
        d
    }

    fn read(d: &Path, rel: &str) -> String {
        std::fs::read_to_string(d.join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
    }

    #[test]
    fn a_cluster_scoped_kind_gets_a_controller_a_cluster_wide_test_and_cluster_webhooks() {
        let d = scaffolded(
            "cluster",
            &["--group infra --version v1 --kind Tenant --namespaced=false"],
        );
        let types = read(&d, "crates/api/src/infra_v1/tenant.rs");
        assert!(!types.contains("namespaced"), "{types}");
        assert!(read(&d, "crates/controllers/src/lib.rs").contains("m.add(tenant::TenantController)"));
        let test = read(&d, "crates/controllers/tests/tenant.rs");
        assert!(
            test.contains("Api::all(") && !test.contains("Api::namespaced("),
            "{test}"
        );
        let sample = read(&d, "config/samples/infra_v1_tenant.yaml");
        assert!(!sample.contains("namespace"), "{sample}");
        create_webhook(&WebhookArgs {
            gvk: Gvk {
                group: "infra".into(),
                version: "v1".into(),
                kind: "Tenant".into(),
            },
            defaulting: true,
            programmatic_validation: true,
            conversion: false,
            spoke: Vec::new(),
            dir: d.clone(),
        })
        .unwrap();
        let hooks = read(&d, "crates/controllers/src/tenant_webhook.rs");
        assert_eq!(hooks.matches("Rule::").count(), 2, "{hooks}");
        // A second version keeps the kind's scope without the flag; a contradiction is refused.
        let mut a = api_args("--group infra --version v2 --kind Tenant");
        a.dir = d.clone();
        create_api(&a).unwrap();
        assert!(!read(&d, "crates/api/src/infra_v2/tenant.rs").contains("namespaced"));
        let mut a = api_args("--group infra --version v3 --kind Tenant --namespaced");
        a.dir = d.clone();
        let e = create_api(&a).unwrap_err().to_string();
        assert!(e.contains("cluster-scoped in v1"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }

    fn webhook_args(d: &Path, args: &str) -> WebhookArgs {
        match parse(&format!("create webhook {args}")) {
            Command::Create(Create::Webhook(mut a)) => {
                a.dir = d.to_path_buf();
                a
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_conversion_joins_the_admission_webhooks_of_its_kind() {
        let d = scaffolded(
            "conversion",
            &[
                "--group webapp --version v1 --kind Guestbook",
                "--group webapp --version v2 --kind Guestbook",
            ],
        );
        let gvk = "--group webapp --version v1 --kind Guestbook";
        let refused = |args: &str| create_webhook(&webhook_args(&d, args)).unwrap_err().to_string();
        assert!(refused(&format!("{gvk} --conversion")).contains("--spoke <version>"));
        assert!(refused(&format!("{gvk} --conversion --spoke v3")).contains("v3 is not in this project"));
        assert!(refused(&format!("{gvk} --conversion --spoke v1")).contains("is the hub"));
        create_webhook(&webhook_args(&d, &format!("{gvk} --conversion --spoke v2"))).unwrap();
        let conv = read(&d, "crates/controllers/src/guestbook_conversion.rs");
        assert!(
            conv.contains("Conversion::hub::<hub::Guestbook>()")
                && conv.contains(".spoke(v2_to_hub, v2_from_hub)"),
            "{conv}"
        );
        assert!(
            conv.contains("[\"webapp.my.domain/v1\", \"webapp.my.domain/v2\"]"),
            "{conv}"
        );
        let lib = read(&d, "crates/controllers/src/lib.rs");
        assert!(
            lib.contains("webhooks: |w| w.conversion(guestbook_conversion::conversion()),"),
            "{lib}"
        );
        assert!(read(&d, "PROJECT").contains("spokes:\n  - v2"));
        assert!(refused(&format!("{gvk} --conversion --spoke v2")).contains("already has a conversion"));
        // Admission webhooks afterwards: one line serves both.
        create_webhook(&webhook_args(&d, &format!("{gvk} --defaulting"))).unwrap();
        let lib = read(&d, "crates/controllers/src/lib.rs");
        assert!(
            lib.contains("webhooks: |w| {")
                && lib.contains(
                    "guestbook_webhook::webhooks(w).conversion(guestbook_conversion::conversion())"
                ),
            "{lib}"
        );
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_builtin_kind_gets_a_controller_without_types_or_crd() {
        let d = scaffolded(
            "builtin",
            &[
                "--group apps --version v1 --kind Deployment --resource=false --controller",
                "--group core --version v1 --kind Namespace --resource=false",
            ],
        );
        let controller = read(&d, "crates/controllers/src/deployment.rs");
        assert!(
            controller.contains("use k8s_openapi::api::apps::v1::Deployment;"),
            "{controller}"
        );
        assert!(
            controller.contains("&[\"apps\"]") && controller.contains("&[\"deployments\"]"),
            "{controller}"
        );
        let lib = read(&d, "crates/controllers/src/lib.rs");
        assert!(
            lib.contains("crds: Vec::new,") && lib.contains("m.add(namespace::NamespaceController)"),
            "{lib}"
        );
        assert!(!d.join("crates/api/src/apps_v1").exists());
        assert!(read(&d, "crates/controllers/src/namespace.rs").contains("&[\"namespaces\"]"));
        assert!(read(&d, "crates/controllers/tests/namespace.rs").contains("Api::all("));
        assert!(read(&d, "config/samples/apps_v1_deployment.yaml").contains("kind: Deployment\n"));
        let project = read(&d, "PROJECT");
        assert_eq!(project.matches("builtin: true").count(), 2, "{project}");

        let refused = |args: &str| {
            let mut a = api_args(args);
            a.dir = d.clone();
            create_api(&a).unwrap_err().to_string()
        };
        let e = refused("--group apps --version v1 --kind Deployment --resource=false");
        assert!(e.contains("already exists"), "{e}");
        let e = refused("--group apps --version v1 --kind Deploymnet --resource=false");
        assert!(e.contains("Deployment, StatefulSet"), "{e}");
        let e = refused("--group core --version v1 --kind Namespace --resource=false --namespaced");
        assert!(e.contains("cluster-scoped in Kubernetes"), "{e}");
        let e = refused("--group web --version v1 --kind Deployment");
        assert!(e.contains("deployment.rs is the controller of Deployment"), "{e}");
        let e = create_webhook(&WebhookArgs {
            gvk: Gvk {
                group: "apps".into(),
                version: "v1".into(),
                kind: "Deployment".into(),
            },
            defaulting: true,
            programmatic_validation: false,
            conversion: false,
            spoke: Vec::new(),
            dir: d.clone(),
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("built into Kubernetes"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn every_placeholder_of_every_template_is_filled() {
        let res = Resource::new("webapp", "v1", "Guestbook", "my.domain").unwrap();
        let p = Project {
            layout: LAYOUT.into(),
            cli_version: None,
            domain: "my.domain".into(),
            project_name: "guestbook".into(),
            resources: Vec::new(),
        };
        let mut vars = vars_of(&p, &res);
        for k in [
            "namespaced_attr",
            "webhook_chain",
            "webhook_handlers",
            "opkit_version",
            "patch",
            "rust_path",
            "api_version",
            "spoke",
            "spoke_module",
            "spoke_chain",
            "spoke_fns",
            "all_versions",
        ] {
            vars.insert(k, String::new());
        }
        for t in [
            include_str!("../templates/Cargo.toml.tmpl"),
            include_str!("../templates/Makefile.tmpl"),
            include_str!("../templates/README.md.tmpl"),
            include_str!("../templates/api.types.rs.tmpl"),
            include_str!("../templates/api.kind-crd.rs.tmpl"),
            include_str!("../templates/controller.rs.tmpl"),
            include_str!("../templates/controller-test.rs.tmpl"),
            include_str!("../templates/controller-test-cluster.rs.tmpl"),
            include_str!("../templates/controller-builtin.rs.tmpl"),
            include_str!("../templates/controller-builtin-test.rs.tmpl"),
            include_str!("../templates/controller-builtin-test-cluster.rs.tmpl"),
            include_str!("../templates/registration.rs.tmpl"),
            include_str!("../templates/registration-builtin.rs.tmpl"),
            include_str!("../templates/registration-crd-only.rs.tmpl"),
            include_str!("../templates/sample.yaml.tmpl"),
            include_str!("../templates/webhook.rs.tmpl"),
            include_str!("../templates/webhook-chain-defaulting.rs.tmpl"),
            include_str!("../templates/webhook-chain-validation.rs.tmpl"),
            include_str!("../templates/webhook-defaulting.rs.tmpl"),
            include_str!("../templates/webhook-validation.rs.tmpl"),
            include_str!("../templates/conversion.rs.tmpl"),
            include_str!("../templates/conversion-spoke.rs.tmpl"),
        ] {
            let out = render(t, &vars);
            // `{{` stays only where Rust's format strings escape a brace.
            assert!(!out.contains("{{") || out.contains("format!("), "{out}");
        }
    }

    #[test]
    fn the_generated_dependencies_are_the_ones_opkit_is_built_with() {
        let ours = include_str!("../../../Cargo.toml");
        let theirs = include_str!("../templates/Cargo.toml.tmpl");
        for dep in [
            "kube",
            "k8s-openapi",
            "schemars",
            "serde",
            "serde_json",
            "serde-saphyr",
            "json-patch",
            "anyhow",
            "clap",
        ] {
            let line = |text: &str| {
                text.lines()
                    .find(|l| l.starts_with(&format!("{dep} = ")))
                    .map(String::from)
                    .unwrap_or_else(|| panic!("{dep} missing"))
            };
            // The project is a binary: it picks the Kubernetes version that opkit leaves open.
            let theirs = line(theirs).replace("\"v1_35\", ", "");
            assert_eq!(line(ours), theirs, "{dep}");
        }
    }
}
