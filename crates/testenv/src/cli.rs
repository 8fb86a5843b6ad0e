//! The `opkit-testenv` command line: build, start and stop the long-lived local control plane.
//! A project built on opkit gets the same command from a one-line binary calling [`main`].
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::{Binaries, ControlPlane, Options, Versions};
use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use std::os::unix::process::CommandExt;

#[derive(Parser)]
#[command(
    about = "A real local Kubernetes control plane (etcd, apiserver, controller-manager, scheduler, kwok)"
)]
struct Cli {
    /// Where the long-lived cluster keeps its state, logs and kubeconfig.
    #[arg(long, env = "OPKIT_TESTENV_STATE", global = true)]
    state_dir: Option<PathBuf>,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Build (or find in the cache) the pinned binaries and print their directory.
    Build,
    /// Start the long-lived cluster in the background (idempotent) and print how to use it.
    Up {
        /// Also write an apiserver audit log (state dir `audit.log`).
        #[arg(long)]
        audit_log: bool,
    },
    /// Stop the long-lived cluster and remove its state.
    Down,
    /// Print `export KUBECONFIG=...` for the long-lived cluster.
    Env,
    /// Load an image archive (`docker save` / `podman save`) into the real node of the
    /// long-lived cluster, as `kind load image-archive` does.
    Load {
        /// The archive.
        archive: PathBuf,
    },
    /// Start a throwaway PostgreSQL server (Debian's package; installed first as root) and
    /// print a Secret with its address and superuser, labelled for `PostgresDatabase`
    /// (`kubectl apply -f -`); runs until stopped, and the server goes with it.
    Postgres {
        /// The Secret's name.
        #[arg(long, default_value = "postgres-server")]
        secret: String,
    },
    /// Print a Namespace whose Pods the scheduler puts on the real node (kwok's fake nodes run no
    /// container), for `kubectl apply --server-side --field-manager=opkit-testenv -f -`: a
    /// manager of its own, so a later apply of the namespace from `config/` keeps the annotations.
    RealNodeNamespace {
        /// The namespace.
        name: String,
    },
    /// Build and push an operator image for several platforms as one (an image index), each
    /// binary compiled on this machine (cross-compiled for arm64); run in the project's
    /// directory, whose Dockerfile has a `host-cross` stage.
    DockerBuildx {
        /// The image, e.g. 127.0.0.1:5000/guestbook:v0.1.0.
        #[arg(long)]
        img: String,
        /// The cargo package of the operator binary.
        #[arg(long)]
        package: String,
        /// The binary's name (default: the package's).
        #[arg(long)]
        binary: Option<String>,
        /// Comma-separated platforms.
        #[arg(long, default_value = "linux/amd64,linux/arm64")]
        platforms: String,
        /// The cargo profile (dev: a quick debug image).
        #[arg(long, default_value = "release")]
        profile: String,
        /// The runtime base image (`local`: assembled from this machine's libraries).
        #[arg(long, default_value = "gcr.io/distroless/cc-debian12:nonroot")]
        base: String,
    },
    /// Assemble an operator image's runtime base from this machine's Debian libraries (glibc
    /// and libgcc as `binary` links them, the nonroot user, `/tmp`) where the distroless base
    /// cannot be pulled, and print the image's name.
    LocalBase {
        /// The container engine (docker or podman).
        #[arg(long, default_value = "podman")]
        tool: String,
        /// The architecture: amd64, or arm64 from Debian's cross toolchain.
        #[arg(long, default_value = "amd64")]
        arch: String,
        /// The operator binary whose libraries the base holds.
        binary: PathBuf,
    },
    /// Run the cluster in the foreground until SIGTERM or Ctrl-C (what `up` starts).
    Serve {
        #[arg(long)]
        audit_log: bool,
    },
}

fn default_state_dir() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/tmp".into())).join(".cache")
        });
    base.join("opkit-testenv").join("cluster")
}

fn pid_alive(pid: i32) -> bool {
    kill(Pid::from_raw(pid), None).is_ok()
}

fn running_pid(state: &Path) -> Option<i32> {
    let pid: i32 = std::fs::read_to_string(state.join("serve.pid"))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    (pid_alive(pid) && state.join("ready").exists()).then_some(pid)
}

fn print_env(state: &Path, bins: &Binaries) {
    println!("export KUBECONFIG={}", state.join("kubeconfig").display());
    println!(
        "export OPKIT_TESTENV_KUBECONFIG={}",
        state.join("kubeconfig").display()
    );
    println!(
        "# kubectl {}: {}",
        Versions::pinned().kubernetes,
        bins.path("kubectl").display()
    );
    println!("export PATH={}:$PATH", bins.dir().display());
    if let Ok(r) = std::fs::read_to_string(state.join("registry-address")) {
        println!(
            "# the real node pulls from this registry (plain HTTP): make docker-push IMG=$OPKIT_TESTENV_REGISTRY/opkit:v1"
        );
        println!("export OPKIT_TESTENV_REGISTRY={}", r.trim());
    }
}

/// Parses the command line and runs the command (`build`, `up`, `down`, `env`, `serve`).
pub fn main() -> anyhow::Result<()> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(run(Cli::parse()))
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let state = cli.state_dir.unwrap_or_else(default_state_dir);
    match cli.command {
        Cmd::Build => {
            let b = Binaries::ensure()?;
            println!("{}", b.dir().display());
        }
        Cmd::Env => {
            if running_pid(&state).is_none() {
                bail!(
                    "no local control plane is running at {} (run `make testenv-up`)",
                    state.display()
                );
            }
            print_env(&state, &Binaries::ensure()?);
        }
        Cmd::Postgres { secret } => {
            let pg = crate::postgres::Postgres::start()?;
            let s = serde_json::json!({
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": secret, "labels": {"db.opkit.dev/server": "true"}},
                "stringData": {"host": pg.host, "port": pg.port.to_string(),
                               "username": pg.user, "password": pg.password},
            });
            print!("{}", serde_saphyr::to_string(&s)?);
            std::io::Write::flush(&mut std::io::stdout())?;
            eprintln!(
                "PostgreSQL listens on {}:{}; stop with Ctrl-C or SIGTERM",
                pg.host, pg.port
            );
            let mut signals = nix::sys::signal::SigSet::empty();
            signals.add(Signal::SIGINT);
            signals.add(Signal::SIGTERM);
            signals.thread_block()?;
            signals.wait()?;
            drop(pg);
        }
        Cmd::RealNodeNamespace { name } => {
            let ns = serde_json::json!({
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {"name": name, "annotations": crate::node::namespace_annotations()},
            });
            print!("{}", serde_saphyr::to_string(&ns)?);
        }
        Cmd::DockerBuildx {
            img,
            package,
            binary,
            platforms,
            profile,
            base,
        } => {
            let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/docker-buildx.sh");
            let status = Command::new("bash")
                .arg(&script)
                .env("IMG", img)
                .env("BINARY", binary.as_deref().unwrap_or(&package))
                .env("PACKAGE", &package)
                .env("PLATFORMS", platforms)
                .env("PROFILE", profile)
                .env("BASE", base)
                .status()?;
            if !status.success() {
                bail!("{} failed ({status})", script.display());
            }
        }
        Cmd::LocalBase { tool, arch, binary } => {
            let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/local-base.sh");
            let status = Command::new("bash")
                .arg(&script)
                .arg(&tool)
                .arg(&binary)
                .arg(&arch)
                .status()?;
            if !status.success() {
                bail!("{} failed ({status})", script.display());
            }
        }
        Cmd::Load { archive } => {
            let socket = state.join("node/containerd.sock");
            if running_pid(&state).is_none() || !socket.exists() {
                bail!(
                    "no local control plane with a real node is running at {} (run `OPKIT_TESTENV_REAL_NODE=1 make testenv-up`)",
                    state.display()
                );
            }
            crate::node::load_image(&socket, &archive)?;
            eprintln!("loaded {} into the real node", archive.display());
        }
        Cmd::Up { audit_log } => {
            let bins = Binaries::ensure()?;
            if running_pid(&state).is_some() {
                eprintln!("local control plane already running ({})", state.display());
                print_env(&state, &bins);
                return Ok(());
            }
            let start = Instant::now();
            std::fs::create_dir_all(state.parent().unwrap_or(Path::new("/")))?;
            let log_path = state.with_extension("serve.log");
            let log = std::fs::File::create(&log_path)?;
            let mut cmd = Command::new(std::env::current_exe()?);
            cmd.arg("--state-dir").arg(&state).arg("serve");
            if audit_log {
                cmd.arg("--audit-log");
            }
            // Own process group: a Ctrl-C in the calling terminal must not stop the cluster.
            cmd.process_group(0)
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log);
            let mut child = cmd.spawn().context("starting opkit-testenv serve")?;
            let deadline = Instant::now() + Duration::from_secs(120);
            loop {
                if let Some(status) = child.try_wait()? {
                    let tail = std::fs::read_to_string(&log_path).unwrap_or_default();
                    bail!("the local control plane failed to start ({status}):\n{tail}");
                }
                if state.join("ready").exists() {
                    break;
                }
                if Instant::now() > deadline {
                    let _ = kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM);
                    bail!(
                        "the local control plane did not become ready in time; see {}",
                        log_path.display()
                    );
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            eprintln!(
                "local control plane ready in {:.1}s (state: {})",
                start.elapsed().as_secs_f64(),
                state.display()
            );
            print_env(&state, &bins);
        }
        Cmd::Down => {
            if let Some(pid) = std::fs::read_to_string(state.join("serve.pid"))
                .ok()
                .and_then(|p| p.trim().parse::<i32>().ok())
            {
                let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
                let deadline = Instant::now() + Duration::from_secs(20);
                while pid_alive(pid) && Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                if pid_alive(pid) {
                    let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
                }
            }
            if state.exists() {
                std::fs::remove_dir_all(&state)?;
            }
            let _ = std::fs::remove_file(state.with_extension("serve.log"));
            eprintln!("local control plane stopped");
        }
        Cmd::Serve { audit_log } => {
            let opts = Options {
                state_dir: Some(state.clone()),
                audit_log,
                real_node: crate::node::requested(),
                // Where seed 001 pushes its image, if it is free.
                registry_port: std::net::TcpListener::bind(("127.0.0.1", 5000))
                    .is_ok()
                    .then_some(5000),
                ..Options::default()
            };
            let cp = ControlPlane::start(opts).await?;
            if let Some(r) = cp.registry() {
                std::fs::write(state.join("registry-address"), r)?;
            }
            std::fs::write(state.join("serve.pid"), std::process::id().to_string())?;
            std::fs::write(state.join("ready"), cp.server())?;
            eprintln!("serving {} with {:?}", cp.server(), cp.pids());
            let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
            tokio::select! {
                _ = term.recv() => {},
                _ = tokio::signal::ctrl_c() => {},
            }
            let _ = std::fs::remove_file(state.join("ready"));
            drop(cp);
        }
    }
    Ok(())
}
