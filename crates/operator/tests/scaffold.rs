//! `opkit init` / `create api` / `create webhook` end to end: seed 001's Guestbook scaffolded in
//! a temporary directory with, in the same project, a cluster-scoped kind with a controller and
//! a webhook (`--namespaced=false`) and a controller of the built-in Deployment
//! (`--resource=false`); then, inside the generated project, `make manifests`, `cargo fmt
//! --check`, `cargo clippy -D warnings` and its own `make test` (its controller tests converge
//! the Guestbook and cluster-scoped samples to `Available=True` and see the Deployment sample
//! reconciled with nothing written, on the local control plane); its operator binary then
//! serves the scaffolded webhooks to the apiserver, for the namespaced and the cluster-scoped
//! kind, and seed 000's CronTab (no controller) answers `kubectl get ct`. One project for every
//! shape, so its dependencies are compiled once.
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, ensure};
use opkit_testenv::{shared, wait_for};

mod common;
use common::{
    Running, discard_build, free_port, index_platforms, kubectl, kubectl_stdin, outcome, registry_manifest,
};

/// Runs `opkit <command line>` (split at spaces) in `dir`; (succeeded, stdout + stderr).
fn opkit_in(dir: &Path, command: &str) -> anyhow::Result<(bool, String)> {
    let out = Command::new(env!("CARGO_BIN_EXE_opkit"))
        .args(command.split_whitespace())
        .current_dir(dir)
        .env("RUST_BACKTRACE", "0")
        .output()?;
    Ok(outcome(&out))
}

fn opkit_ok(dir: &Path, command: &str) -> anyhow::Result<String> {
    let (ok, out) = opkit_in(dir, command)?;
    ensure!(ok, "opkit {command} failed:\n{out}");
    Ok(out)
}

/// `opkit <command line>` fails and its output says `why`.
fn opkit_refused(dir: &Path, command: &str, why: &str) -> anyhow::Result<()> {
    let (ok, out) = opkit_in(dir, command)?;
    ensure!(
        !ok && out.contains(why),
        "opkit {command}: expected a refusal saying {why:?}, got (ok={ok}):\n{out}"
    );
    Ok(())
}

/// The generated project's builds share one target directory across runs, outside this
/// workspace's own (a nested cargo would wait for this one's lock).
fn target_dir() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("scaffold-target")
}

/// Runs a command of the generated project (`make ...`, `cargo ...`) in `dir`.
fn project(dir: &Path, program: &str, args: &[&str]) -> anyhow::Result<String> {
    project_with(dir, program, args, &[])
}

/// [`project`] with more environment variables.
fn project_with(dir: &Path, program: &str, args: &[&str], env: &[(&str, &str)]) -> anyhow::Result<String> {
    let started = Instant::now();
    let out = Command::new(program)
        .args(args)
        .current_dir(dir)
        .env("CARGO_TARGET_DIR", target_dir())
        // The generated project's dependencies need no debug info here; it saves disk and links.
        .env("CARGO_PROFILE_DEV_DEBUG", "line-tables-only")
        .env("OPKIT_TESTENV_KUBECONFIG", shared().kubeconfig())
        .env("KUBECONFIG", shared().kubeconfig())
        .envs(env.iter().copied())
        .env_remove("CARGO_MANIFEST_DIR")
        .env_remove("RUSTFLAGS")
        .stdin(Stdio::null())
        .output()?;
    let (ok, text) = outcome(&out);
    ensure!(
        ok,
        "`{program} {}` failed in the generated project:\n{text}",
        args.join(" ")
    );
    eprintln!(
        "`{program} {}`: {:.1} s",
        args.join(" "),
        started.elapsed().as_secs_f64()
    );
    Ok(text)
}

/// Lines of Rust in the generated project.
fn rust_lines(dir: &Path) -> usize {
    let mut n = 0;
    let mut stack = vec![dir.join("crates")];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                n += std::fs::read_to_string(&p)
                    .map(|s| s.lines().count())
                    .unwrap_or(0);
            }
        }
    }
    n
}

const CRONTAB_FIELDS: &str = r#"pub struct CronTabSpec {
    /// The schedule, in cron format.
    pub cron_spec: String,
    /// The image to run.
    pub image: String,
    /// How many to run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<i32>,
}"#;

#[tokio::test]
async fn a_scaffolded_guestbook_builds_lints_and_passes_its_own_tests() -> anyhow::Result<()> {
    // With the real node (as `make test` runs), the project's `make test-e2e` runs on it too.
    let real_node = opkit_testenv::shared_real_node();
    let started = Instant::now();
    let base = tempdir()?;
    let dir = base.join("guestbook");
    std::fs::create_dir_all(&dir)?;

    // The project depends on opkit as crates.io would serve it: the `.crate` files `cargo
    // package` makes, unpacked, patched in for the registry's (not the checkout).
    let packaged = packaged_crates(&base)?;
    let guestbook = "--group webapp --version v1 --kind Guestbook";
    opkit_ok(&dir, "init --domain my.domain --opkit-path -")?;
    let manifest = dir.join("Cargo.toml");
    let mut cargo_toml = std::fs::read_to_string(&manifest)?;
    ensure!(
        !cargo_toml.contains("[patch"),
        "init --opkit-path - patched:\n{cargo_toml}"
    );
    cargo_toml.push_str("\n[patch.crates-io]\n");
    for (name, path) in &packaged {
        cargo_toml.push_str(&format!(
            "{name} = {{ path = {:?} }}\n",
            path.display().to_string()
        ));
    }
    std::fs::write(&manifest, cargo_toml)?;
    // The versions opkit is tested with (what `init` copies from a checkout).
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../Cargo.lock"),
        dir.join("Cargo.lock"),
    )?;
    opkit_ok(&dir, &format!("create api {guestbook}"))?;
    opkit_ok(
        &dir,
        &format!("create webhook {guestbook} --defaulting --programmatic-validation"),
    )?;
    // A second served version of the same kind, converted to and from v1 (the hub).
    opkit_ok(&dir, "create api --group webapp --version v2 --kind Guestbook")?;
    opkit_ok(
        &dir,
        &format!("create webhook {guestbook} --conversion --spoke v2"),
    )?;
    // Seed 000's CronTab: a CRD without a controller.
    opkit_ok(
        &dir,
        "create api --group stable --version v1 --kind CronTab --controller false",
    )?;
    // A cluster-scoped kind with a controller and a validating webhook.
    let tenant = "--group infra --version v1 --kind Tenant";
    opkit_ok(&dir, &format!("create api {tenant} --namespaced=false"))?;
    opkit_ok(
        &dir,
        &format!("create webhook {tenant} --programmatic-validation"),
    )?;
    // A controller of a built-in kind, in Kubebuilder's words.
    opkit_ok(
        &dir,
        "create api --group apps --version v1 --kind Deployment --resource=false --controller",
    )?;

    // Re-running is safe: refused with a reason, nothing changed.
    let snapshot = |d: &Path| -> anyhow::Result<String> {
        Ok(std::fs::read_to_string(d.join("PROJECT"))?
            + &std::fs::read_to_string(d.join("crates/controllers/src/lib.rs"))?)
    };
    let before = snapshot(&dir)?;
    opkit_refused(&dir, &format!("create api {guestbook}"), "already exists")?;
    opkit_refused(
        &dir,
        &format!("create webhook {guestbook} --defaulting"),
        "already has",
    )?;
    opkit_refused(&dir, "init --domain my.domain", "already has a PROJECT")?;
    opkit_refused(
        &dir,
        "create api --group webapp --version v1 --kind guest-book",
        "--kind",
    )?;
    opkit_refused(
        &dir,
        "create api --group apps --version v1 --kind Deploymnet --resource=false",
        "--group apps --version v1: Deployment, StatefulSet",
    )?;
    opkit_refused(
        &dir,
        "create webhook --group apps --version v1 --kind Deployment --defaulting",
        "built into Kubernetes",
    )?;
    ensure!(snapshot(&dir)? == before, "a refused command changed the project");

    // The tutorial's edit: CronTab's fields and short name.
    let types = dir.join("crates/api/src/stable_v1/cron_tab.rs");
    let text = std::fs::read_to_string(&types)?;
    let start = text.find("pub struct CronTabSpec {").context("CronTabSpec")?;
    let end = start + text[start..].find("\n}").context("end of CronTabSpec")? + 2;
    let text = format!("{}{CRONTAB_FIELDS}{}", &text[..start], &text[end..]).replace(
        "plural = \"crontabs\",",
        "plural = \"crontabs\",\n    shortname = \"ct\",",
    );
    std::fs::write(&types, text)?;
    std::fs::write(
        dir.join("config/samples/stable_v1_crontab.yaml"),
        "apiVersion: stable.my.domain/v1\nkind: CronTab\nmetadata:\n  name: my-new-cron-object\nspec:\n  cronSpec: \"* * * * */5\"\n  image: my-awesome-cron-image\n",
    )?;

    project(&dir, "make", &["manifests"])?;
    let crd = std::fs::read_to_string(dir.join("config/crd/guestbooks.webapp.my.domain.yaml"))?;
    ensure!(
        crd.contains("name: v1\n") && crd.contains("name: v2\n"),
        "both versions served:\n{crd}"
    );
    ensure!(
        crd.contains("strategy: Webhook") && crd.contains("path: /convert"),
        "the CRD is not converted by the webhook:\n{crd}"
    );
    let hooks = std::fs::read_to_string(dir.join("config/webhook/manifests.yaml"))?;
    for path in [
        "/mutate-webapp-my-domain-v1-guestbook",
        "/validate-webapp-my-domain-v1-guestbook",
    ] {
        ensure!(hooks.contains(path), "{path} not in config/webhook:\n{hooks}");
    }
    ensure!(
        hooks.contains("/validate-infra-my-domain-v1-tenant") && hooks.contains("scope: Cluster"),
        "the Tenant webhook, for cluster-scoped objects, not in config/webhook:\n{hooks}"
    );
    let role = std::fs::read_to_string(dir.join("config/rbac/role.yaml"))?;
    for rule in [
        "guestbooks/status",
        "tenants/status",
        "  - apps\n  resources:\n  - deployments\n  verbs:\n  - get\n  - list\n  - watch\n  - patch\n",
    ] {
        ensure!(
            role.contains(rule),
            "{rule:?} not in config/rbac/role.yaml:\n{role}"
        );
    }
    // Monitoring as Kubebuilder scaffolds it (ServiceMonitor, opt-in), with the alerts and
    // dashboards: for this project's metrics Service.
    let rules = std::fs::read_to_string(dir.join("config/prometheus/rules.yaml"))?;
    let job = format!(
        "job=\"{}-controller-manager-metrics-service\"",
        project_name(&dir)?
    );
    ensure!(
        rules.contains(&job),
        "{job} not in config/prometheus/rules.yaml:\n{rules}"
    );
    let dashboard = std::fs::read_to_string(dir.join("config/grafana/controllers.json"))?;
    ensure!(
        dashboard.contains("controller_runtime_reconcile_total"),
        "{dashboard}"
    );
    let default = std::fs::read_to_string(dir.join("config/default/kustomization.yaml"))?;
    ensure!(default.contains("#- ../prometheus"), "{default}");
    project(&dir, "cargo", &["fmt", "--all", "--check"])?;
    project(
        &dir,
        "cargo",
        &["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"],
    )?;
    let tests = project(&dir, "make", &["test"])?;
    ensure!(
        tests.matches("test the_sample_becomes_available ... ok").count() == 2
            && tests
                .matches("test the_sample_converges_in_memory ... ok")
                .count()
                == 2
            && tests.contains("test the_sample_is_reconciled_and_left_as_it_is ... ok")
            && tests.contains("test the_sample_is_reconciled_in_memory ... ok")
            && tests.contains(
                "test guestbook_conversion::tests::every_version_round_trips_through_the_others ... ok"
            ),
        "the generated controller tests (Guestbook, Tenant, Deployment; in memory and on the control plane) did not all run:\n{tests}"
    );
    // The in-memory tests need no control plane: with none to be found, they still pass.
    let nowhere = base.join("no-control-plane");
    let nowhere = nowhere.to_str().context("a UTF-8 path")?;
    let in_memory = project_with(
        &dir,
        "cargo",
        &["test", "--workspace", "in_memory"],
        &[
            ("OPKIT_TESTENV_KUBECONFIG", nowhere),
            ("KUBECONFIG", nowhere),
            ("OPKIT_TESTENV_BIN_DIR", nowhere),
        ],
    )?;
    ensure!(
        in_memory.matches("_in_memory ... ok").count() == 3,
        "the three in-memory tests (Guestbook, Tenant, Deployment) did not all pass without a control plane:\n{in_memory}"
    );
    eprintln!(
        "opkit init → green `make test` in the generated project: {:.0} s; {} lines of Rust",
        started.elapsed().as_secs_f64(),
        rust_lines(&dir)
    );
    // The chart and the single-file installer, from the same code as config/.
    project(
        &dir,
        "make",
        &["helm", "build-installer", "IMG=127.0.0.1:5000/guestbook:v9"],
    )?;
    let chart = std::fs::read_to_string(dir.join("dist/chart/Chart.yaml"))?;
    ensure!(chart.contains("name: guestbook"), "{chart}");
    let installer = std::fs::read_to_string(dir.join("dist/install.yaml"))?;
    for expected in [
        "image: 127.0.0.1:5000/guestbook:v9",
        "name: guestbooks.webapp.my.domain",
        "name: guestbook-guestbook-editor-role",
        "rbac.authorization.k8s.io/aggregate-to-edit: \"true\"",
    ] {
        ensure!(
            installer.contains(expected),
            "{expected:?} not in dist/install.yaml"
        );
    }

    // The generated operator itself: CRDs installed with `make install`, webhooks served.
    project(&dir, "make", &["install"])?;
    let ns = format!("scaffold-{}", std::process::id());
    kubectl(&["create", "namespace", &ns])?;
    let port = free_port()?;
    let binary = target_dir().join("debug/guestbook");
    let child = Command::new(&binary)
        .args([
            "run",
            "--metrics-bind-address",
            "0",
            "--health-probe-bind-address",
            "0",
        ])
        .args(["--webhook-bind-address", &format!("127.0.0.1:{port}")])
        .args(["--webhook-url", &format!("https://127.0.0.1:{port}")])
        .env("KUBECONFIG", shared().kubeconfig())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", binary.display()))?;
    let _operator = Running(child);
    let unnamed = |name: &str, spec: &str| {
        format!(
            "{{\"apiVersion\":\"webapp.my.domain/v1\",\"kind\":\"Guestbook\",\"metadata\":{{\"name\":\"{name}\"}},\"spec\":{spec}}}"
        )
    };
    // Defaulting: `spec.foo` filled in by the webhook (retried until the server is up).
    wait_for("the defaulting webhook", Duration::from_secs(60), || async {
        let _ = kubectl(&[
            "delete",
            "guestbook",
            "-n",
            &ns,
            "defaulted",
            "--ignore-not-found",
        ]);
        let (ok, out) = kubectl_stdin(
            &["apply", "-n", &ns, "-f", "-"],
            unnamed("defaulted", "{}").as_bytes(),
        )?;
        ensure!(ok, "{out}");
        let foo = kubectl(&[
            "get",
            "guestbook",
            "-n",
            &ns,
            "defaulted",
            "-o",
            "jsonpath={.spec.foo}",
        ])?;
        ensure!(foo == "default", "spec.foo is {foo:?}");
        Ok::<_, anyhow::Error>(())
    })
    .await?;
    let (ok, out) = kubectl_stdin(
        &["apply", "-n", &ns, "-f", "-"],
        unnamed("empty", "{\"foo\":\"\"}").as_bytes(),
    )?;
    ensure!(!ok && out.contains("spec.foo: must not be empty"), "{out}");
    // The operator reconciles what it admitted.
    wait_for(
        "the defaulted Guestbook to be Available",
        Duration::from_secs(60),
        || async {
            let s = kubectl(&[
                "get",
                "guestbook",
                "-n",
                &ns,
                "defaulted",
                "-o",
                "jsonpath={.status.conditions[?(@.type==\"Available\")].status}",
            ])?;
            if s == "True" {
                Ok(())
            } else {
                Err(anyhow!("Available={s:?}"))
            }
        },
    )
    .await?;
    // The same Guestbook read as v2, through the generated conversion webhook.
    let v2 = kubectl(&[
        "get",
        "guestbooks.v2.webapp.my.domain",
        "-n",
        &ns,
        "defaulted",
        "-o",
        "jsonpath={.apiVersion} {.spec.foo}",
    ])?;
    ensure!(v2 == "webapp.my.domain/v2 default", "{v2}");
    // CronTab: served without a controller, reachable by its short name.
    let (ok, out) = kubectl_stdin(
        &["apply", "-n", &ns, "-f", "-"],
        &std::fs::read(dir.join("config/samples/stable_v1_crontab.yaml"))?,
    )?;
    ensure!(ok, "{out}");
    let ct = kubectl(&["get", "ct", "-n", &ns, "-o", "name"])?;
    ensure!(ct.trim() == "crontab.stable.my.domain/my-new-cron-object", "{ct}");
    // The cluster-scoped Tenant: its webhook is called for it, and the operator reconciles it.
    let tenant = |name: &str, foo: &str| {
        format!(
            "{{\"apiVersion\":\"infra.my.domain/v1\",\"kind\":\"Tenant\",\"metadata\":{{\"name\":\"{name}\"}},\"spec\":{{\"foo\":\"{foo}\"}}}}"
        )
    };
    let (ok, out) = kubectl_stdin(
        &["apply", "-f", "-"],
        tenant(&format!("{ns}-empty"), "").as_bytes(),
    )?;
    ensure!(!ok && out.contains("spec.foo: must not be empty"), "{out}");
    let name = format!("{ns}-tenant");
    let (ok, out) = kubectl_stdin(&["apply", "-f", "-"], tenant(&name, "bar").as_bytes())?;
    ensure!(ok, "{out}");
    let available = wait_for("the Tenant to be Available", Duration::from_secs(60), || async {
        let s = kubectl(&[
            "get",
            "tenant",
            &name,
            "-o",
            "jsonpath={.status.conditions[?(@.type==\"Available\")].status}",
        ])?;
        if s == "True" {
            Ok(())
        } else {
            Err(anyhow!("Available={s:?}"))
        }
    })
    .await;
    kubectl(&["delete", "tenant", &name, "--wait=false"])?;
    available?;

    drop(_operator);
    kubectl(&["delete", "namespace", &ns, "--wait=false"])?;
    for kind in ["mutating", "validating"] {
        let name = format!("guestbook-{kind}-webhook-configuration");
        kubectl(&[
            "delete",
            &format!("{kind}webhookconfiguration"),
            &name,
            "--ignore-not-found",
        ])?;
    }

    // `make test-e2e` on the real node: `make docker-build` with the path patch (the image
    // build cannot see the patched crates, so the binary is built here: the debug build `make
    // test` compiled), pushed to the control plane's registry, `make deploy`, and the
    // Guestbook and Tenant samples made Available by the operator's Pod.
    if let Some(registry) = real_node.and_then(|n| n.registry()) {
        // The local run above pointed the CRDs' conversion at its URL; a deploy adds the
        // Service beside it (the apiserver refuses both), so start from no CRDs, as a user
        // going from `make run` to `make deploy` is told to.
        project(&dir, "make", &["uninstall"])?;
        let e2e = project_with(
            &dir,
            "make",
            &["test-e2e", "PROFILE=dev"],
            &[("OPKIT_TESTENV_REGISTRY", registry)],
        );
        let undeployed = project(&dir, "make", &["undeploy"]);
        let _ = kubectl(&["delete", "namespace", "guestbook-e2e", "--wait=false"]);
        let e2e = e2e?;
        undeployed?;
        ensure!(
            e2e.contains("building the binary on this machine")
                && e2e.contains(&format!(
                    "the manager runs on node {}",
                    opkit_testenv::node::NODE_NAME
                ))
                && e2e.contains("made 2 sample(s) Available"),
            "make test-e2e:\n{e2e}"
        );
        let img = format!("{registry}/guestbook:e2e");
        ensure!(
            image_file_is(&img, "manager", &target_dir().join("debug/guestbook"))?,
            "{img}'s /manager is not the project's binary"
        );
        // `make docker-buildx`: one image for amd64 and arm64 (cross-compiled here).
        let multiarch = format!("{registry}/guestbook:multiarch");
        project(
            &dir,
            "make",
            &["docker-buildx", &format!("IMG={multiarch}"), "PROFILE=dev"],
        )?;
        let mut platforms: Vec<String> =
            index_platforms(&registry_manifest(registry, "guestbook", "multiarch")?)?
                .into_iter()
                .map(|(p, _)| p)
                .collect();
        platforms.sort();
        ensure!(
            platforms == ["linux/amd64", "linux/arm64"],
            "{multiarch} holds {platforms:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&base);
    discard_build(&target_dir());
    Ok(())
}

/// `cargo package` of the crates a scaffolded project depends on, unpacked under `base`:
/// (crate name, unpacked directory). `--no-verify`: the generated project builds them, which is
/// their verification (`make lint` only packages them).
fn packaged_crates(base: &Path) -> anyhow::Result<Vec<(String, PathBuf)>> {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let target = base.join("package-target");
    let out = Command::new("cargo")
        .args(["package", "--no-verify", "--allow-dirty", "--locked", "-q"])
        .args([
            "-p",
            "opkit",
            "-p",
            "opkit-runtime",
            "-p",
            "opkit-gen",
            "-p",
            "opkit-testenv",
        ])
        .arg("--target-dir")
        .arg(&target)
        .current_dir(&repo)
        .env_remove("CARGO_MANIFEST_DIR")
        .output()?;
    ensure!(
        out.status.success(),
        "cargo package: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let unpacked = base.join("crates");
    std::fs::create_dir_all(&unpacked)?;
    let version = env!("CARGO_PKG_VERSION");
    let mut crates = Vec::new();
    for name in ["opkit", "opkit-runtime", "opkit-gen", "opkit-testenv"] {
        let file = target.join(format!("package/{name}-{version}.crate"));
        let out = Command::new("tar")
            .arg("xzf")
            .arg(&file)
            .arg("-C")
            .arg(&unpacked)
            .output()?;
        ensure!(
            out.status.success(),
            "unpacking {}: {}",
            file.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        crates.push((name.to_string(), unpacked.join(format!("{name}-{version}"))));
    }
    Ok(crates)
}

/// Whether the file `path` in image `img` has the bytes of `expected` (read through a
/// created, never started, container).
fn image_file_is(img: &str, path: &str, expected: &Path) -> anyhow::Result<bool> {
    let tool = String::from_utf8(
        Command::new("bash")
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../hack/container-tool.sh"))
            .output()?
            .stdout,
    )?;
    let tool = tool.trim();
    let name = format!("opkit-scaffold-probe-{}", std::process::id());
    let created = Command::new(tool)
        .args(["create", "--name", &name, img])
        .output()?;
    ensure!(
        created.status.success(),
        "{tool} create {img}: {}",
        String::from_utf8_lossy(&created.stderr)
    );
    let copy = std::env::temp_dir().join(&name);
    let copied = Command::new(tool)
        .args(["cp", &format!("{name}:/{path}")])
        .arg(&copy)
        .output();
    let _ = Command::new(tool).args(["rm", &name]).output();
    let _ = Command::new(tool).args(["rmi", img]).output();
    let copied = copied?;
    ensure!(
        copied.status.success(),
        "{tool} cp {name}:/{path}: {}",
        String::from_utf8_lossy(&copied.stderr)
    );
    let same = std::fs::read(&copy)? == std::fs::read(expected)?;
    std::fs::remove_file(&copy)?;
    Ok(same)
}

/// A fresh directory under the system temporary directory.
fn tempdir() -> anyhow::Result<PathBuf> {
    let d = std::env::temp_dir().join(format!("opkit-scaffold-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d)?;
    Ok(d)
}

/// The generated project's name: the prefix of its manager Deployment in config/manager.
fn project_name(dir: &Path) -> anyhow::Result<String> {
    let manager = std::fs::read_to_string(dir.join("config/manager/manager.yaml"))?;
    manager
        .lines()
        .find_map(|l| {
            l.trim()
                .strip_prefix("name: ")?
                .strip_suffix("-controller-manager")
        })
        .map(String::from)
        .context("no <name>-controller-manager in config/manager/manager.yaml")
}
