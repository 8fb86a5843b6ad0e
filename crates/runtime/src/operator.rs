//! An operator as a whole: its name, version and [`Registry`]. The command line
//! (`opkit::cli`), the generated manifests (`opkit::manifests`) and the OLM bundle
//! (`opkit::bundle`) are all derived from it, so two operators built on opkit differ only in
//! this value and their controllers.
use std::time::Duration;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use tokio_util::sync::CancellationToken;

use crate::registry::Registry;

/// One operator. `S` carries its own settings (images, ...) from the command line to the
/// controllers.
pub struct Operator<S> {
    /// Prefix of every object the operator owns (`<name>-system`, `<name>-controller-manager`,
    /// `<name>-leader`, webhook configurations); a DNS label.
    pub name: &'static str,
    /// The operator's version (semver): the default image tag and bundle version.
    pub version: &'static str,
    /// One line for `--help`.
    pub about: &'static str,
    /// Its controllers.
    pub registry: Registry<S>,
}

impl<S> Operator<S> {
    /// The namespace `make deploy` puts the operator in.
    pub fn namespace(&self) -> String {
        format!("{}-system", self.name)
    }

    /// The name of the operator's Deployment and ServiceAccount.
    pub fn manager(&self) -> String {
        format!("{}-controller-manager", self.name)
    }

    /// The image the generated Deployment runs: a fixed tag, never `latest`.
    pub fn image(&self) -> String {
        self.image_for(self.version)
    }

    /// The image of `version`.
    pub fn image_for(&self, version: &str) -> String {
        format!("{}:v{version}", self.name)
    }

    /// The default leader-election Lease.
    pub fn lease(&self) -> String {
        format!("{}-leader", self.name)
    }
}

/// Where an operator's clients come from.
#[allow(clippy::large_enum_variant)] // built once per process
pub enum Connect {
    /// A kubeconfig or in-cluster configuration: opkit builds its clients from it, every write
    /// behind the write gate, with the leader election's own client. What `opkit run` uses.
    Config(kube::Config),
    /// A client built elsewhere (tests that share one): no write gate of its own, and leader
    /// election renews through the same client.
    Client(kube::Client),
}

/// How to run an operator: what `opkit run`'s flags set, the same for the binary, for an
/// operator built without the command line, and for tests.
#[non_exhaustive]
pub struct RunConfig {
    /// Registry names of the controllers to run; empty runs all.
    pub controllers: Vec<String>,
    /// The namespaces the controllers watch.
    pub scope: crate::Scope,
    /// Reconciles running at once, per controller (0: no limit).
    pub concurrency: u16,
    /// Settings of single controllers, as `NAME.KEY=VALUE` (see [`crate::Manager::tune`]).
    pub tune: Vec<String>,
    /// How long a request other than a watch may wait for its answer, per attempt (with
    /// [`Connect::Config`]).
    pub request_timeout: Duration,
    /// Probes, metrics, leader election, signals and shutdown.
    pub manager: crate::ManagerOptions,
    /// Spread the objects over the replicas (needs leader election).
    pub sharding: bool,
    /// With `sharding`: that many slots for the replicas to claim, so that a rolling restart
    /// hands each slot's objects over once instead of moving them between members (see
    /// [`crate::sharding`]); 0: each replica is a member of its own.
    pub sharding_slots: u16,
    /// Serve the admission and conversion webhooks; `None` serves none.
    pub webhooks: Option<WebhookServing>,
    /// How long to wait for the operator's CRDs to be Established before giving up.
    pub crd_wait: Duration,
    /// Cancelled to stop the operator gracefully (as SIGTERM does).
    pub shutdown: CancellationToken,
    /// Where the controllers report; shared with the caller so it can read them.
    pub metrics: crate::metrics::Metrics,
}

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig {
            controllers: Vec::new(),
            scope: crate::Scope::all(),
            concurrency: crate::DEFAULT_CONCURRENCY,
            tune: Vec::new(),
            request_timeout: crate::client::DEFAULT_REQUEST_TIMEOUT,
            manager: crate::ManagerOptions::default(),
            sharding: false,
            sharding_slots: 0,
            webhooks: None,
            crd_wait: Duration::from_secs(60),
            shutdown: CancellationToken::new(),
            metrics: crate::metrics::Metrics::default(),
        }
    }
}

/// Where and how the webhook server listens, and whether it writes its configurations.
#[non_exhaustive]
pub struct WebhookServing {
    /// Where to listen (HTTPS).
    pub bind: std::net::SocketAddr,
    /// `tls.crt`, `tls.key` (and `ca.crt`); `None` makes a self-signed certificate at start.
    pub cert_dir: Option<std::path::PathBuf>,
    /// Base URL the apiserver uses when the operator runs outside the cluster.
    pub url: Option<String>,
    /// The operator's namespace (default: the Pod's, else `<name>-system`).
    pub namespace: Option<String>,
    /// Write the webhook configurations (and their CA bundle) at start.
    pub configure: bool,
    /// Offer HTTP/2 as well as HTTP/1.1.
    pub http2: bool,
}

impl WebhookServing {
    /// Serving on `bind`, with a self-signed certificate, configurations written at start.
    pub fn on(bind: std::net::SocketAddr) -> Self {
        WebhookServing {
            bind,
            cert_dir: None,
            url: None,
            namespace: None,
            configure: true,
            http2: false,
        }
    }
}

/// Why an operator could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// The configuration cannot run (an unknown controller, a bad `tune`, sharding without
    /// leader election).
    #[error("{0}")]
    Config(String),
    /// A client could not be built.
    #[error("building the client: {0}")]
    Client(#[source] kube::Error),
    /// The operator's CRDs were not Established in time.
    #[error("{0}")]
    Crds(String),
    /// The webhook server did not start.
    #[error(transparent)]
    Webhook(#[from] crate::webhook::WebhookError),
    /// The manager stopped with an error.
    #[error(transparent)]
    Manager(#[from] crate::manager::ManagerError),
}

/// The namespace this process runs in, when it runs in a Pod.
pub fn own_namespace() -> Option<String> {
    std::env::var("POD_NAMESPACE").ok().or_else(|| {
        std::fs::read_to_string("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
            .ok()
            .map(|s| s.trim().to_string())
    })
}

/// An operator whose controllers have been added, its CRDs found and its webhooks served:
/// [`Started::wait`] runs it until it stops.
pub struct Started {
    manager: crate::Manager,
    opts: crate::ManagerOptions,
    webhook_server: Option<tokio::task::JoinHandle<()>>,
    controllers: Vec<String>,
    namespaces: Option<Vec<String>>,
    name: &'static str,
}

impl Started {
    /// The webhooks that place new objects of the sharded controllers on their members (empty
    /// without sharding), for an operator that serves its webhooks itself rather than with
    /// [`RunConfig::webhooks`].
    pub fn sharding_webhooks(&mut self) -> crate::webhook::Webhooks {
        self.manager.sharding_webhooks()
    }

    /// Runs the controllers until the shutdown token is cancelled (or a signal, or an error),
    /// then lets the webhook server serve its grace period.
    pub async fn wait(self) -> Result<(), RunError> {
        let Started {
            manager,
            opts,
            webhook_server,
            controllers,
            namespaces,
            name,
        } = self;
        tracing::info!(controllers = ?controllers, namespaces = ?namespaces, "{name} starting");
        let stop = manager.shutdown_token();
        let result = manager.run(opts).await;
        // Whatever ended the manager, the webhook server serves its grace period and ends.
        stop.cancel();
        if let Some(server) = webhook_server {
            let _ = server.await;
        }
        Ok(result?)
    }
}

impl<S> Operator<S> {
    /// Runs the operator until `config.shutdown` is cancelled (or SIGTERM, with
    /// `config.manager.handle_signals`): the one assembly behind `opkit run`, an operator
    /// without the command line, and the tests.
    ///
    /// ```no_run
    /// use opkit_runtime::leader::LeaderElectionConfig;
    /// use opkit_runtime::{Connect, Operator, Registry, RunConfig};
    ///
    /// # async fn main_() -> Result<(), Box<dyn std::error::Error>> {
    /// // Normally your registry of controllers; settings are `()` here.
    /// let operator: Operator<()> = Operator {
    ///     name: "demo",
    ///     version: "0.1.0",
    ///     about: "a demo operator",
    ///     registry: Registry::new(Vec::new()),
    /// };
    /// let mut config = RunConfig::default();
    /// config.manager.leader_election = Some(LeaderElectionConfig::new("demo-system", operator.lease()));
    /// let kube_config = kube::Config::infer().await?;
    /// operator.run(Connect::Config(kube_config), config, &()).await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn run(&self, connect: Connect, config: RunConfig, settings: &S) -> Result<(), RunError> {
        self.start(connect, config, settings).await?.wait().await
    }

    /// Everything [`Operator::run`] does before the controllers start: the clients, the
    /// controllers added, the CRDs waited for and the webhook server started. Borrows the
    /// operator only until it returns.
    pub async fn start(
        &self,
        connect: Connect,
        config: RunConfig,
        settings: &S,
    ) -> Result<Started, RunError> {
        let registry = &self.registry;
        let wanted = if config.controllers.is_empty() {
            registry.names().iter().map(|s| s.to_string()).collect()
        } else {
            config.controllers.clone()
        };
        let selected = registry.select(&wanted).map_err(RunError::Config)?;
        if config.request_timeout.is_zero() {
            return Err(RunError::Config(
                "--request-timeout must be at least 1 second".into(),
            ));
        }
        raise_open_files();
        let opts = config.manager;
        let mut manager = match connect {
            Connect::Config(mut kube_config) => {
                crate::client::honour_no_proxy(&mut kube_config, |k| std::env::var(k).ok());
                let mut m = crate::Manager::from_config_with(
                    kube_config.clone(),
                    config.request_timeout,
                    config.metrics.clone(),
                )
                .map_err(RunError::Client)?;
                if let Some(le) = &opts.leader_election {
                    let election = crate::leader::election_client_config(kube_config, le);
                    m = m.with_election_client(kube::Client::try_from(election).map_err(RunError::Client)?);
                }
                m
            }
            Connect::Client(client) => crate::Manager::new(client).with_metrics(config.metrics.clone()),
        }
        .with_shutdown(config.shutdown.clone())
        .with_scope(config.scope.clone())
        .with_concurrency(config.concurrency);
        for t in &config.tune {
            manager.tune(t).map_err(RunError::Config)?;
        }
        // For what every replica does whether it leads or not (waiting for the CRDs, the
        // webhook certificate and configurations); the controllers write through the gated
        // client.
        let client = manager.replica_client().clone();
        if config.sharding {
            let le = opts.leader_election.as_ref().ok_or_else(|| {
                RunError::Config(
                    "--sharding needs --leader-elect: the leader places the objects on the members".into(),
                )
            })?;
            let cfg = crate::sharding::ShardingConfig::new(le).with_slots(config.sharding_slots);
            tracing::info!(
                member = cfg.member(),
                slots = cfg.slots,
                group = cfg.group,
                "sharding on"
            );
            manager = manager.with_sharding(cfg).map_err(RunError::Client)?;
        }
        for r in &selected {
            manager.adding_for(Some(r.name));
            (r.add)(&mut manager, settings);
        }
        manager.adding_for(None);
        manager.check_tuning().map_err(RunError::Config)?;
        let crds: Vec<String> = crate::registry::crds(&selected)
            .iter()
            .map(kube::ResourceExt::name_any)
            .collect();
        wait_for_crds(&client, &crds, config.crd_wait).await?;
        let mut webhook_server = None;
        if let Some(serving) = config.webhooks {
            // Every kind's admission rules, whichever controllers run here: the configurations
            // are shared by all replicas and must not depend on one process's `controllers`.
            // With sharding, also the webhooks that place new objects on their members.
            let hooks = registry
                .webhooks()
                .merge(manager.sharding_webhooks())
                .with_metrics(manager.metrics().clone());
            let webhook_opts = crate::webhook::WebhookOptions {
                project: self.name,
                bind: serving.bind,
                cert_dir: serving.cert_dir,
                url: serving.url,
                namespace: serving
                    .namespace
                    .or_else(own_namespace)
                    .unwrap_or_else(|| self.namespace()),
                configure: serving.configure,
                http2: serving.http2,
            };
            webhook_server =
                Some(crate::webhook::start(&client, &hooks, &webhook_opts, manager.shutdown_token()).await?);
        }
        Ok(Started {
            manager,
            opts,
            webhook_server,
            controllers: wanted,
            namespaces: config.scope.list().map(<[String]>::to_vec),
            name: self.name,
        })
    }

    /// Starts every controller in this process, confined to `scope`, without leader election
    /// or signal handling, through [`Operator::run`]'s assembly: what a controller test needs.
    /// Install the CRDs first.
    pub async fn spawn(
        &self,
        client: kube::Client,
        scope: crate::Scope,
        settings: &S,
    ) -> Result<Running, RunError> {
        let mut config = RunConfig {
            scope,
            ..Default::default()
        };
        config.manager.handle_signals = false;
        let (stop, metrics) = (config.shutdown.clone(), config.metrics.clone());
        let started = self.start(Connect::Client(client), config, settings).await?;
        Ok(Running {
            stop,
            metrics,
            handle: Some(tokio::spawn(started.wait())),
        })
    }
}

/// Waits until the CRDs `names` are Established, so the controllers' first list does not
/// fail. An apiserver that cannot be reached yet (restarting, or the Pod network not up) is
/// retried until `within` instead of ending the process. Polled rather than watched: each read
/// is bounded by the request timeout, so a connection that stopped answering does not hold the
/// start for the watch's idle timeout.
async fn wait_for_crds(client: &kube::Client, names: &[String], within: Duration) -> Result<(), RunError> {
    use kube::runtime::wait::{Condition, conditions};
    let crds: kube::Api<CustomResourceDefinition> = kube::Api::all(client.clone());
    let deadline = tokio::time::Instant::now() + within;
    for name in names {
        loop {
            let established = crds.get_opt(name).await.map(|c| {
                c.as_ref()
                    .is_some_and(|c| conditions::is_crd_established().matches_object(Some(c)))
            });
            match established {
                Ok(true) => break,
                _ if tokio::time::Instant::now() >= deadline => {
                    return Err(RunError::Crds(format!(
                        "CRD {name} is not installed or not established (run `make install`, or `crd` piped to `kubectl apply -f -`)"
                    )));
                }
                Ok(false) => {}
                Err(e) => tracing::warn!(crd = %name, error = %e, "waiting for the CRD; retrying"),
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    Ok(())
}

/// The operator's controllers running inside this process (what a controller test starts);
/// they stop when this is dropped.
pub struct Running {
    stop: CancellationToken,
    metrics: crate::metrics::Metrics,
    handle: Option<tokio::task::JoinHandle<Result<(), RunError>>>,
}

impl Running {
    /// The metrics every controller of this run reports to.
    pub fn metrics(&self) -> &crate::metrics::Metrics {
        &self.metrics
    }

    /// Whether the operator still runs (it ends only when told to stop, or on an error).
    pub fn running(&self) -> bool {
        self.handle.as_ref().is_some_and(|h| !h.is_finished())
    }

    /// Stops the controllers gracefully and returns how the operator ended.
    pub async fn stop(mut self) -> Result<(), RunError> {
        self.stop.cancel();
        match self.handle.take() {
            Some(h) => match h.await {
                Ok(r) => r,
                Err(e) => Err(RunError::Config(format!("the operator's task failed: {e}"))),
            },
            None => Ok(()),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(h) = self.handle.take() {
            h.abort();
        }
    }
}

impl<S> Operator<S> {
    /// Applies every CRD of the operator (server-side, forced) and waits until each is
    /// Established, so objects of them can be created right after.
    pub async fn install_crds(&self, client: &kube::Client) -> Result<(), CrdError> {
        for crd in self.registry.crds() {
            install_crd(client, &crd, &format!("{}-install", self.name)).await?;
        }
        Ok(())
    }
}

/// Why a CRD could not be installed.
#[derive(Debug, thiserror::Error)]
#[allow(missing_docs)] // every variant says what failed in its message
pub enum CrdError {
    #[error("applying CRD {name}: {source}")]
    Apply { name: String, source: kube::Error },
    #[error("waiting for CRD {name}: {source}")]
    Wait {
        name: String,
        source: kube::runtime::wait::Error,
    },
    #[error("CRD {name} was not Established within 60 s")]
    NotEstablished { name: String },
}

/// Applies one CRD (server-side, forced, as `field_manager`) and waits up to 60 s until it is
/// Established, so objects of it can be created right after.
pub async fn install_crd(
    client: &kube::Client,
    crd: &k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
    field_manager: &str,
) -> Result<(), CrdError> {
    use kube::api::{Api, Patch, PatchParams};
    use kube::runtime::wait::{await_condition, conditions};
    let api: Api<_> = Api::all(client.clone());
    let name = kube::ResourceExt::name_any(crd);
    api.patch(
        &name,
        &PatchParams::apply(field_manager).force(),
        &Patch::Apply(crd),
    )
    .await
    .map_err(|source| CrdError::Apply {
        name: name.clone(),
        source,
    })?;
    let established = await_condition(api, &name, conditions::is_crd_established());
    match tokio::time::timeout(std::time::Duration::from_secs(60), established).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(source)) => Err(CrdError::Wait { name, source }),
        Err(_) => Err(CrdError::NotEstablished { name }),
    }
}

/// Raises the soft limit on open files to the hard one, as every Go program (so every
/// controller-runtime operator) does at start: each connection, watch and webhook client holds
/// a descriptor, and the common soft limit of 1024 is a few hundred idle connections away from
/// failing Lease renewals. Done once per process.
fn raise_open_files() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| match rlimit::Resource::NOFILE.get() {
        Ok((soft, hard)) if soft < hard => match rlimit::increase_nofile_limit(hard) {
            Ok(now) => tracing::debug!(from = soft, to = now, "raised the open files limit"),
            Err(e) => tracing::warn!(error = %e, soft, hard, "cannot raise the open files limit"),
        },
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "cannot read the open files limit"),
    });
}
