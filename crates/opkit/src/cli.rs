//! The operator's command line, the same for every operator built on opkit: `run` starts the
//! manager with the selected controllers; `crd`, `manifests` and `bundle` print or write what
//! is generated from the [`Operator`]. An operator's `main` is one call to [`main`]; its own
//! flags come in through `A` (`NoArgs` when it has none).
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::telemetry::LogFormat;
use anyhow::{Context, bail};
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Config, ResourceExt};

use crate::Operator;
use crate::{Connect, ManagerOptions, RunConfig, Scope, WebhookServing, bundle, manifests};

#[derive(Parser)]
struct Cli<A: Args, X: Subcommand> {
    #[command(subcommand)]
    command: Command<A, X>,
}

/// Flags for an operator that has none of its own.
#[derive(Args, Clone, Debug, Default)]
pub struct NoArgs {}

/// Commands for an operator that adds none of its own.
#[derive(Clone, Copy, Debug)]
pub enum NoCommands {}

impl FromArgMatches for NoCommands {
    fn from_arg_matches(_: &clap::ArgMatches) -> Result<Self, clap::Error> {
        Err(clap::Error::new(clap::error::ErrorKind::InvalidSubcommand))
    }

    fn update_from_arg_matches(&mut self, _: &clap::ArgMatches) -> Result<(), clap::Error> {
        match *self {}
    }
}

impl Subcommand for NoCommands {
    fn augment_subcommands(cmd: clap::Command) -> clap::Command {
        cmd
    }

    fn augment_subcommands_for_update(cmd: clap::Command) -> clap::Command {
        cmd
    }

    fn has_subcommand(_: &str) -> bool {
        false
    }
}

#[derive(Subcommand)]
enum Command<A: Args, X: Subcommand> {
    /// Run the controllers (the manager).
    Run(Box<RunArgs<A>>),
    /// Print every CRD as YAML (what `make install` applies).
    Crd,
    /// Write the generated manifests (CRDs, RBAC, manager, kustomizations) under a directory,
    /// or check they are fresh.
    Manifests {
        /// The config directory.
        #[arg(long, default_value = "config")]
        dir: PathBuf,
        /// Fail if a file would change instead of writing it.
        #[arg(long)]
        check: bool,
        /// Confine the operator to these namespaces: `--namespace` in its Deployment and a
        /// Role per namespace instead of a ClusterRole for the controllers (repeatable).
        #[arg(long = "namespace", short = 'n')]
        namespaces: Vec<String>,
    },
    /// Write the Helm chart (the objects of the manifests, with values for what is set at
    /// install time), or check it is fresh.
    Helm {
        /// The chart directory.
        #[arg(long, default_value = crate::helm::DIR)]
        dir: PathBuf,
        /// Fail if a file would change instead of writing it.
        #[arg(long)]
        check: bool,
    },
    /// Write the OLM bundle (`bundle/`, `bundle.Dockerfile`) from the generated manifests,
    /// `config/manifests/metadata.yaml` and `config/samples`, or check it is fresh.
    Bundle(BundleArgs),
    /// Rewrite every object of the operator's CRDs (or those named) in their storage version
    /// and trim `status.storedVersions` to it, after the storage version changed. Objects of a
    /// converted version need the operator (its conversion webhook) running.
    MigrateStorage {
        /// Only this CRD (`<plural>.<group>`; repeatable).
        #[arg(long = "crd")]
        crds: Vec<String>,
        /// Path to a kubeconfig (default: $KUBECONFIG, then in-cluster).
        #[arg(long)]
        kubeconfig: Option<PathBuf>,
    },
    #[command(flatten)]
    Extra(X),
}

#[derive(clap::Args)]
struct BundleArgs {
    /// The operator's version (semver; default: the operator's own).
    #[arg(long)]
    version: Option<String>,
    /// Channels, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "candidate")]
    channels: Vec<String>,
    /// Default channel (default: the first of --channels).
    #[arg(long)]
    default_channel: Option<String>,
    /// Operator image (default: <name>:v<version>).
    #[arg(long)]
    image: Option<String>,
    /// Repository root: reads `config/`, writes `bundle/` and `bundle.Dockerfile`.
    #[arg(long, default_value = ".")]
    root: PathBuf,
    /// Regenerate the existing bundle with its own version, channels and image and fail if a
    /// file would change, instead of writing.
    #[arg(long)]
    check: bool,
}

#[derive(clap::Args)]
struct RunArgs<A: Args> {
    /// Controllers to run, comma-separated (default: all).
    #[arg(long, value_delimiter = ',')]
    controllers: Vec<String>,
    /// Watch only this namespace (repeatable); all namespaces when absent.
    #[arg(long = "namespace", short = 'n')]
    namespaces: Vec<String>,
    /// Where to serve Prometheus metrics; "0" disables.
    #[arg(long, default_value = "0.0.0.0:8080")]
    metrics_bind_address: String,
    /// Where to serve /healthz and /readyz; "0" disables.
    #[arg(long, default_value = "0.0.0.0:8081")]
    health_probe_bind_address: String,
    /// Reconciles running at once, per controller over all its namespaces (0: no limit).
    #[arg(long, default_value_t = crate::DEFAULT_CONCURRENCY)]
    concurrency: u16,
    /// One controller's setting, as `NAME.KEY=VALUE` (repeatable): `concurrency`,
    /// `backoff-base`, `backoff-max`, `timeout`, `progress-delay` and `progress-budget`, e.g. `--tune
    /// memcached.timeout=30s`. NAME is a `--controllers` name (every reconciler it runs) or
    /// one reconciler's name.
    #[arg(long = "tune", value_name = "NAME.KEY=VALUE")]
    tune: Vec<String>,
    /// Kubeconfig file (in-cluster config, then $KUBECONFIG, when absent).
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// Kubeconfig context.
    #[arg(long)]
    context: Option<String>,
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// Serve `/metrics` over HTTPS, only to bearer tokens allowed to `get /metrics` (the
    /// generated manifests turn it on, with the `metrics-reader` ClusterRole).
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    metrics_secure: bool,
    /// With `--metrics-secure`: directory with `tls.crt` and `tls.key` (e.g. a cert-manager
    /// Secret), reloaded when they change. Without it a self-signed certificate is made at
    /// start.
    #[arg(long)]
    metrics_cert_dir: Option<PathBuf>,
    /// Seconds in-flight reconciles get to finish after SIGTERM.
    #[arg(long, default_value_t = 30)]
    shutdown_timeout: u64,
    /// Seconds a request to the apiserver (not a watch) may wait for its answer, per attempt;
    /// a write also gives up when the leader's write gate closes.
    #[arg(long, default_value_t = crate::client::DEFAULT_REQUEST_TIMEOUT.as_secs())]
    request_timeout: u64,
    /// Run controllers only while holding a Lease, so that one of several replicas reconciles.
    #[arg(long)]
    leader_elect: bool,
    /// Name of the leader-election Lease (default: `<name>-leader`).
    #[arg(long)]
    leader_election_id: Option<String>,
    /// Namespace of the Lease (default: the Pod's namespace in a cluster, else `default`).
    #[arg(long)]
    leader_election_namespace: Option<String>,
    /// Seconds a Lease stays valid without renewal (a standby takes over after a crash).
    #[arg(long, default_value_t = 15)]
    leader_elect_lease_duration: u64,
    /// Seconds a leader keeps trying to renew before it gives up (and exits, or stands by).
    #[arg(long, default_value_t = 10)]
    leader_elect_renew_deadline: u64,
    /// Seconds between renewals.
    #[arg(long, default_value_t = 2)]
    leader_elect_retry_period: u64,
    /// A standby fills its caches while it waits, so a takeover starts reconciling without a
    /// relist; `false` keeps a standby's memory and watch traffic near zero.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    leader_elect_warm_standby: bool,
    /// A replica that loses the Lease stands by for it again, its webhooks still served,
    /// instead of exiting (see docs/reliability.md for what each choice guarantees).
    #[arg(long)]
    leader_elect_stand_by: bool,
    /// Spread the objects of every controller (but those that must see all at once) over the
    /// replicas: each holds a member Lease and watches, caches and reconciles only the objects
    /// the leader places on it. Needs --leader-elect.
    #[arg(long)]
    sharding: bool,
    /// With --sharding: the replicas claim this many slots (set it to the replica count), so a
    /// rolling restart hands each slot's objects to the new replica once, unlabelled, instead
    /// of moving them between members; a replica that finds every slot held stands by as a
    /// spare. 0: each replica is a member of its own.
    #[arg(long, default_value_t = 0, requires = "sharding")]
    sharding_slots: u16,
    /// Where to serve the admission webhooks (HTTPS); "0" disables them.
    #[arg(long, default_value = "0")]
    webhook_bind_address: String,
    /// Directory with `tls.crt`, `tls.key` (and `ca.crt`), e.g. a cert-manager Secret; reloaded
    /// when they change. Without it a self-signed certificate is made at start.
    #[arg(long)]
    webhook_cert_dir: Option<PathBuf>,
    /// Base URL the apiserver uses to reach the webhooks when opkit runs outside the cluster
    /// (e.g. `https://127.0.0.1:9443`); in a cluster, the Service `<name>-webhook-service`.
    #[arg(long)]
    webhook_url: Option<String>,
    /// Write the webhook configurations (and their CA bundle) at start; `false` when OLM or
    /// another tool owns them.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    manage_webhook_configurations: bool,
    /// Offer HTTP/2 on the webhook server as well as HTTP/1.1 (off: see `webhook::serve`).
    #[arg(long)]
    webhook_http2: bool,
    #[command(flatten)]
    operator: A,
}

fn leader_election<A: Args>(
    args: &RunArgs<A>,
    default_id: String,
) -> anyhow::Result<Option<crate::leader::LeaderElectionConfig>> {
    if !args.leader_elect {
        return Ok(None);
    }
    let (lease, renew, retry) = (
        args.leader_elect_lease_duration,
        args.leader_elect_renew_deadline,
        args.leader_elect_retry_period,
    );
    if !(retry < renew && renew < lease) {
        bail!(
            "leader election needs retry period < renew deadline < lease duration, got {retry}s, {renew}s, {lease}s"
        );
    }
    let ns = args
        .leader_election_namespace
        .clone()
        .or_else(crate::own_namespace)
        .unwrap_or_else(|| "default".into());
    let id = args.leader_election_id.clone().unwrap_or(default_id);
    let mut cfg = crate::leader::LeaderElectionConfig::new(ns, id);
    cfg.lease_duration = Duration::from_secs(lease);
    cfg.renew_deadline = Duration::from_secs(renew);
    cfg.retry_period = Duration::from_secs(retry);
    Ok(Some(cfg))
}

fn addr(s: &str, what: &str) -> anyhow::Result<Option<SocketAddr>> {
    if s == "0" || s.is_empty() {
        return Ok(None);
    }
    let s = if s.starts_with(':') {
        format!("0.0.0.0{s}")
    } else {
        s.to_string()
    };
    Ok(Some(
        s.parse()
            .with_context(|| format!("--{what}: not an address: {s}"))?,
    ))
}

async fn client_config<A: Args>(args: &RunArgs<A>) -> anyhow::Result<Config> {
    let opts = KubeConfigOptions {
        context: args.context.clone(),
        ..Default::default()
    };
    Ok(match &args.kubeconfig {
        Some(path) => Config::from_custom_kubeconfig(Kubeconfig::read_from(path)?, &opts).await?,
        None if args.context.is_some() => Config::from_kubeconfig(&opts).await?,
        None => Config::infer().await?,
    })
}

async fn run<S, A: Args>(
    op: &Operator<S>,
    args: RunArgs<A>,
    settings: impl FnOnce(&A) -> S,
) -> anyhow::Result<()> {
    let telemetry = crate::telemetry::init(args.log_format, op.name);
    let result = run_operator(op, args, settings).await;
    telemetry.flush().await;
    result
}

async fn run_operator<S, A: Args>(
    op: &Operator<S>,
    args: RunArgs<A>,
    settings: impl FnOnce(&A) -> S,
) -> anyhow::Result<()> {
    let mut config = RunConfig::default();
    config.controllers = args.controllers.clone();
    config.scope = Scope::namespaces(args.namespaces.clone());
    config.concurrency = args.concurrency;
    config.tune = args.tune.clone();
    config.request_timeout = Duration::from_secs(args.request_timeout);
    config.sharding = args.sharding;
    config.sharding_slots = args.sharding_slots;
    config.manager = ManagerOptions {
        metrics_addr: addr(&args.metrics_bind_address, "metrics-bind-address")?,
        health_addr: addr(&args.health_probe_bind_address, "health-probe-bind-address")?,
        shutdown_timeout: Duration::from_secs(args.shutdown_timeout),
        handle_signals: true,
        leader_election: leader_election(&args, op.lease())?,
        warm_standby: args.leader_elect_warm_standby,
        stand_by_on_loss: args.leader_elect_stand_by,
        metrics_secure: args.metrics_secure,
        metrics_cert_dir: args.metrics_cert_dir.clone(),
    };
    if let Some(bind) = addr(&args.webhook_bind_address, "webhook-bind-address")? {
        let mut serving = WebhookServing::on(bind);
        serving.cert_dir = args.webhook_cert_dir.clone();
        serving.url = args.webhook_url.clone();
        serving.configure = args.manage_webhook_configurations;
        serving.http2 = args.webhook_http2;
        config.webhooks = Some(serving);
    }
    let settings = settings(&args.operator);
    let kube_config = client_config(&args).await?;
    Ok(op.run(Connect::Config(kube_config), config, &settings).await?)
}

fn write_manifests<S>(
    op: &Operator<S>,
    dir: &Path,
    check: bool,
    namespaces: &[String],
) -> anyhow::Result<()> {
    write_files(manifests::all(op, namespaces)?, dir, check, "make manifests")
}

/// Writes `files` under `dir`, or with `check` fails naming those that would change.
fn write_files(files: Vec<(String, String)>, dir: &Path, check: bool, make: &str) -> anyhow::Result<()> {
    let mut stale = Vec::new();
    for (rel, content) in files {
        let path = dir.join(&rel);
        if std::fs::read_to_string(&path).ok().as_deref() == Some(content.as_str()) {
            continue;
        }
        if check {
            stale.push(rel);
        } else {
            std::fs::create_dir_all(path.parent().unwrap_or(dir))?;
            std::fs::write(&path, content)?;
            println!("wrote {}", path.display());
        }
    }
    if !stale.is_empty() {
        bail!("generated files are stale (run `{make}`): {}", stale.join(", "));
    }
    Ok(())
}

fn write_bundle<S>(op: &Operator<S>, args: BundleArgs) -> anyhow::Result<()> {
    let opts = if args.check {
        bundle::Options::of_bundle(op.name, &args.root.join("bundle"))?
    } else {
        let version = args.version.unwrap_or_else(|| op.version.to_string());
        bundle::Options {
            default_channel: args
                .default_channel
                .unwrap_or_else(|| args.channels.first().cloned().unwrap_or_default()),
            image: args.image.unwrap_or_else(|| op.image_for(&version)),
            version,
            channels: args.channels,
        }
    };
    let mut stale = Vec::new();
    let files = bundle::all(op, &args.root, &opts)?;
    for (rel, content) in &files {
        let path = args.root.join(rel);
        if std::fs::read_to_string(&path).ok().as_deref() == Some(content.as_str()) {
            continue;
        }
        if args.check {
            stale.push(rel.display().to_string());
        } else {
            std::fs::create_dir_all(path.parent().unwrap_or(&args.root))?;
            std::fs::write(&path, content)?;
            println!("wrote {}", path.display());
        }
    }
    // A kind removed from the registry must not leave its CRD behind in the bundle.
    let manifests_dir = args.root.join("bundle/manifests");
    for entry in std::fs::read_dir(&manifests_dir).into_iter().flatten().flatten() {
        let rel = Path::new("bundle/manifests").join(entry.file_name());
        if files.iter().any(|(r, _)| *r == rel) {
            continue;
        }
        if args.check {
            stale.push(rel.display().to_string());
        } else {
            std::fs::remove_file(entry.path())?;
            println!("removed {}", entry.path().display());
        }
    }
    if !stale.is_empty() {
        bail!("the bundle is stale (run `make bundle`): {}", stale.join(", "));
    }
    Ok(())
}

/// Parses the command line and runs the command: the whole `main` of an operator. `settings`
/// turns the operator's own flags (`A`) into what its controllers are added with.
pub fn main<S, A: Args>(op: Operator<S>, settings: impl FnOnce(&A) -> S) -> anyhow::Result<()> {
    main_with::<S, A, NoCommands>(op, settings, |never| match never {})
}

/// [`main`] with the operator's own subcommands `X`, run by `extra`.
pub fn main_with<S, A: Args, X: Subcommand>(
    op: Operator<S>,
    settings: impl FnOnce(&A) -> S,
    extra: impl FnOnce(X) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let command = Cli::<A, X>::command()
        .name(op.name)
        .bin_name(op.name)
        .version(op.version)
        .about(op.about);
    let cli = Cli::<A, X>::from_arg_matches(&command.get_matches()).map_err(|e| e.exit())?;
    // `run`, `migrate-storage` and an operator's own commands may need the async runtime;
    // generating files needs no client and no cluster.
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let _guard = runtime.enter();
    match cli.command {
        Command::Run(args) => runtime.block_on(run(&op, *args, settings)),
        Command::Crd => {
            for crd in op.registry.crds() {
                print!("---\n{}", crate::yaml::to_string(&crd)?);
            }
            Ok(())
        }
        Command::Manifests {
            dir,
            check,
            namespaces,
        } => write_manifests(&op, &dir, check, &namespaces),
        Command::Helm { dir, check } => write_files(crate::helm::chart(&op)?, &dir, check, "make helm"),
        Command::Bundle(args) => write_bundle(&op, args),
        Command::MigrateStorage { crds, kubeconfig } => runtime.block_on(async {
            let config = match kubeconfig {
                Some(path) => {
                    Config::from_custom_kubeconfig(
                        Kubeconfig::read_from(path)?,
                        &KubeConfigOptions::default(),
                    )
                    .await?
                }
                None => Config::infer().await?,
            };
            let client = kube::Client::try_from(config)?;
            let names = match crds.is_empty() {
                true => op.registry.crds().iter().map(|c| c.name_any()).collect(),
                false => crds,
            };
            // Every CRD is tried; what failed is reported at the end.
            let mut failed = Vec::new();
            for name in names {
                match crate::migrate::migrate_storage(&client, &name).await {
                    Ok(done) => println!("{done}"),
                    Err(e) if e.to_string().starts_with(&name) => failed.push(e.to_string()),
                    Err(e) => failed.push(format!("{name}: {e}")),
                }
            }
            match failed.is_empty() {
                true => anyhow::Ok(()),
                false => Err(anyhow::anyhow!("{}", failed.join("\n"))),
            }
        }),
        Command::Extra(x) => extra(x),
    }
}
