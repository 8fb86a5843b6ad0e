//! Runs a set of controllers together: shared client and metrics, `/metrics`, `/healthz` and
//! `/readyz`, and one graceful shutdown for all of them.
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use kube::Client;
use tokio_util::sync::CancellationToken;

use crate::leader::{LeaderElectionConfig, LeaderElector, LeaderError, WriteGate};
use crate::metrics::Metrics;
use crate::reconciler::Reconciler;
use crate::runtime::context::{Common, ControllerContext};
use crate::runtime::{self, SharedWatches, Synced};
use crate::scope::Scope;
use crate::server;
use crate::tuning::Tuning;

/// Where to serve the manager's HTTP endpoints and how long shutdown may take.
#[derive(Clone, Debug)]
pub struct ManagerOptions {
    /// `/metrics`; `None` disables it.
    pub metrics_addr: Option<SocketAddr>,
    /// `/healthz` and `/readyz`; `None` disables them.
    pub health_addr: Option<SocketAddr>,
    /// How long in-flight reconciles get to finish after SIGTERM.
    pub shutdown_timeout: Duration,
    /// Shut down on SIGTERM/SIGINT. Off for managers embedded in tests, where a Ctrl-C must
    /// still stop the whole test process.
    pub handle_signals: bool,
    /// Run controllers only while holding this Lease; `None` runs them at once.
    pub leader_election: Option<LeaderElectionConfig>,
    /// With leader election: a standby fills its caches while it waits for the Lease, so
    /// that after a takeover reconciles start without a relist (controller-runtime's warm
    /// replicas). Costs a standby the memory and watch traffic of the leader; off, a standby
    /// holds nothing until it leads.
    pub warm_standby: bool,
    /// With leader election: a replica that loses the Lease stands by for it again in the
    /// same process, its webhooks, probes and metrics still served, instead of stopping the
    /// manager with the error (controller-runtime's behaviour, and the default). Standing by
    /// keeps the webhooks up after a fault that costs every replica the Lease. Stopping
    /// closes the process's connections, which fences writes sent before the gate closed and
    /// still unread by an apiserver that was frozen; standing by does not (yet), so such a
    /// write can land after another replica took the Lease.
    pub stand_by_on_loss: bool,
    /// Serve `/metrics` over HTTPS, only to bearer tokens whose user may `get /metrics`
    /// (TokenReview and SubjectAccessReview; see [`crate::server::MetricsAuth`]).
    pub metrics_secure: bool,
    /// With `metrics_secure`: serve the certificate in this directory (`tls.crt`, `tls.key`,
    /// e.g. a cert-manager Secret), reloaded when it changes, so scrapers can verify the
    /// server; without it one is made at start.
    pub metrics_cert_dir: Option<std::path::PathBuf>,
}

impl Default for ManagerOptions {
    fn default() -> Self {
        ManagerOptions {
            metrics_addr: None,
            health_addr: None,
            shutdown_timeout: Duration::from_secs(30),
            handle_signals: true,
            leader_election: None,
            warm_standby: true,
            stand_by_on_loss: false,
            metrics_secure: false,
            metrics_cert_dir: None,
        }
    }
}

/// Errors that stop the manager.
#[derive(Debug, thiserror::Error)]
#[allow(missing_docs)] // every variant says what failed in its message
pub enum ManagerError {
    #[error(transparent)]
    Serve(#[from] server::ServeError),
    #[error("controller {0} stopped unexpectedly")]
    ControllerExited(&'static str),
    #[error("installing signal handlers: {0}")]
    Signals(std::io::Error),
    #[error(transparent)]
    Leader(#[from] LeaderError),
}

pub(crate) struct Registered {
    pub name: &'static str,
    /// The registration (`--controllers` name) that added it, when added through one.
    group: Option<&'static str>,
    pub ready: Arc<AtomicBool>,
    synced: Synced,
    run: BoxFuture<'static, ()>,
}

/// A set of controllers sharing one client, one metrics registry and one lifecycle.
pub struct Manager {
    client: Client,
    metrics: Metrics,
    shutdown: CancellationToken,
    scope: Scope,
    tuning: Tuning,
    overrides: Vec<(String, String, String)>,
    /// The registration whose reconcilers are being added: `--tune` by its name reaches them.
    group: Option<&'static str>,
    controllers: Vec<Registered>,
    gate: WriteGate,
    leading: tokio::sync::watch::Sender<bool>,
    shared: SharedWatches,
    election_client: Option<Client>,
    /// For reviews every replica answers (metrics tokens): not behind the write gate.
    ungated_client: Option<Client>,
    /// What [`Manager::from_config`] built the clients from, for the member client.
    config: Option<(kube::Config, Duration)>,
    sharding: Option<Sharding>,
    /// One per sharded controller, run by the leader while it leads.
    sharders: Vec<Sharder>,
    /// The placement webhooks of the sharded controllers ([`Manager::sharding_webhooks`]).
    placement: crate::webhook::Webhooks,
}

/// This replica as a member of its sharding group.
struct Sharding {
    cfg: crate::sharding::ShardingConfig,
    /// This replica's member name: known from the start without slots, else once a slot is
    /// claimed.
    claimed: tokio::sync::watch::Sender<Option<String>>,
    /// Open while the member Lease is certainly held; sharded controllers write through it.
    gate: WriteGate,
    leading: tokio::sync::watch::Sender<bool>,
    client: Client,
    /// The members as this replica sees them, for its placement webhooks; kept current
    /// only once they are served.
    view: crate::sharding::admit::View,
    view_wanted: bool,
}

/// Runs `task` in the background until it ends or `shutdown` is cancelled.
fn spawn_until(task: impl std::future::Future<Output = ()> + Send + 'static, shutdown: &CancellationToken) {
    let shutdown = shutdown.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = task => {},
            _ = shutdown.cancelled() => {},
        }
    });
}

/// Holds the member Lease (claims a slot first, with slots) until shutdown; ends with the
/// elector, if a Lease was had, to release it.
type MemberTask = tokio::task::JoinHandle<(Option<LeaderElector>, Result<(), LeaderError>)>;

/// Starts the sharder of one controller with the leader's client.
type Sharder = Box<dyn Fn(Client) -> BoxFuture<'static, ()> + Send + Sync>;

impl Manager {
    /// A manager whose controllers talk to the cluster through `client`, watching every
    /// namespace with [`crate::DEFAULT_CONCURRENCY`].
    pub fn new(client: Client) -> Self {
        Manager {
            client,
            metrics: Metrics::default(),
            shutdown: CancellationToken::new(),
            scope: Scope::all(),
            tuning: Tuning::default(),
            overrides: Vec::new(),
            group: None,
            controllers: Vec::new(),
            gate: WriteGate::new(),
            leading: tokio::sync::watch::channel(false).0,
            shared: SharedWatches::default(),
            election_client: None,
            ungated_client: None,
            config: None,
            sharding: None,
            sharders: Vec::new(),
            placement: crate::webhook::Webhooks::new(),
        }
    }

    /// A manager whose client is built from `config` by [`crate::client::build`]: every
    /// attempt of a write, retries included, passes this manager's write gate, and requests
    /// other than watches wait at most `request_timeout` for an answer. What `opkit run` uses.
    pub fn from_config(config: kube::Config, request_timeout: std::time::Duration) -> kube::Result<Self> {
        Self::from_config_with(config, request_timeout, Metrics::default())
    }

    /// [`Manager::from_config`], reporting to `metrics`.
    pub(crate) fn from_config_with(
        config: kube::Config,
        request_timeout: std::time::Duration,
        metrics: Metrics,
    ) -> kube::Result<Self> {
        let gate = WriteGate::new();
        // Never enforced: the same timeouts, no gate.
        let ungated = crate::client::build(config.clone(), &WriteGate::new(), request_timeout, &metrics)?;
        let config_for_members = config.clone();
        let client = crate::client::build(config, &gate, request_timeout, &metrics)?;
        let mut m = Manager::new(client);
        (m.gate, m.metrics, m.ungated_client) = (gate, metrics, Some(ungated));
        m.config = Some((config_for_members, request_timeout));
        Ok(m)
    }

    /// Shards the controllers added from now on (all but [`Reconciler::singleton`] ones)
    /// over the replicas that run with the same group: each replica holds a member Lease
    /// and reconciles only the objects the leader's sharder placed on it. Needs leader
    /// election (the sharder runs on the leader).
    pub fn with_sharding(mut self, cfg: crate::sharding::ShardingConfig) -> kube::Result<Self> {
        let gate = WriteGate::new();
        let client = match &self.config {
            Some((config, timeout)) => crate::client::build(config.clone(), &gate, *timeout, &self.metrics)?,
            None => self.client.clone(),
        };
        self.sharding = Some(Sharding {
            claimed: tokio::sync::watch::channel(cfg.member()).0,
            cfg,
            gate,
            leading: tokio::sync::watch::channel(false).0,
            client,
            view: Default::default(),
            view_wanted: false,
        });
        Ok(self)
    }

    /// The webhooks that place each new object of the sharded controllers added so far on
    /// its member as it is created (see [`crate::sharding::admit`]), to serve with the
    /// operator's own: the sharder then writes no label for it. Empty without sharding.
    pub fn sharding_webhooks(&mut self) -> crate::webhook::Webhooks {
        if let Some(s) = self.sharding.as_mut() {
            s.view_wanted = !self.placement.is_empty();
        }
        self.placement.clone()
    }

    /// The client for what every replica does whether it leads or not (waiting for CRDs, the
    /// webhook certificate, reviewing metrics tokens): not behind the write gate, with the
    /// same request timeout when built by [`Manager::from_config`].
    pub fn replica_client(&self) -> &Client {
        self.ungated_client.as_ref().unwrap_or(&self.client)
    }

    /// The client leader election uses (default: the controllers'). Build it from
    /// [`crate::leader::election_client_config`]: without retries and with socket timeouts.
    pub fn with_election_client(mut self, client: Client) -> Self {
        self.election_client = Some(client);
        self
    }

    /// The gate every write of the controllers passes; with leader election it is open only
    /// while this replica's lease is certainly valid.
    pub fn write_gate(&self) -> &WriteGate {
        &self.gate
    }

    /// Reports to `metrics` (shared with whoever reads them) instead of its own.
    pub(crate) fn with_metrics(mut self, metrics: Metrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// Stops when `shutdown` is cancelled.
    pub(crate) fn with_shutdown(mut self, shutdown: CancellationToken) -> Self {
        self.shutdown = shutdown;
        self
    }

    /// The namespaces controllers added from now on watch.
    pub fn with_scope(mut self, scope: Scope) -> Self {
        self.scope = scope;
        self
    }

    /// How many reconciles each controller added from now on runs at once, over all its
    /// namespaces (0: no limit).
    pub fn with_concurrency(mut self, concurrency: u16) -> Self {
        self.tuning.concurrency = concurrency;
        self
    }

    /// Overrides one setting of one controller, as `NAME.KEY=VALUE` (`memcached.timeout=30s`);
    /// applies to controllers added from now on, over their own [`Reconciler::tuning`]. `NAME`
    /// is a reconciler's name or, for an operator's registrations, the `--controllers` name,
    /// which reaches every reconciler it adds.
    pub fn tune(&mut self, setting: &str) -> Result<(), String> {
        let (target, value) = setting
            .split_once('=')
            .ok_or_else(|| format!("--tune {setting:?}: expected NAME.KEY=VALUE"))?;
        let (name, key) = target
            .split_once('.')
            .ok_or_else(|| format!("--tune {setting:?}: expected NAME.KEY=VALUE"))?;
        Tuning::default()
            .set(key, value)
            .map_err(|e| format!("--tune {setting:?}: {e}"))?;
        self.overrides.push((name.into(), key.into(), value.into()));
        Ok(())
    }

    /// Marks the reconcilers added from now on as added by the registration `name`.
    pub(crate) fn adding_for(&mut self, name: Option<&'static str>) {
        self.group = name;
    }

    /// Fails naming an override (`--tune`) that no added controller takes: a typo would
    /// otherwise be silently ignored.
    pub fn check_tuning(&self) -> Result<(), String> {
        let mut added: Vec<&str> = self.controllers.iter().map(|c| c.name).collect();
        for group in self.controllers.iter().filter_map(|c| c.group) {
            if !added.contains(&group) {
                added.push(group);
            }
        }
        match self
            .overrides
            .iter()
            .find(|(name, ..)| !added.contains(&name.as_str()))
        {
            Some((name, key, value)) => Err(format!(
                "--tune {name}.{key}={value}: no controller {name:?} runs here; running: {}",
                added.join(", ")
            )),
            None => Ok(()),
        }
    }

    /// The settings a controller runs with: the manager's, its own, then the overrides.
    fn tuning_of<R: Reconciler>(&self, reconciler: &R) -> Result<Tuning, String> {
        let mut t = reconciler.tuning(self.tuning.clone());
        for (name, key, value) in &self.overrides {
            if name == reconciler.name() || Some(name.as_str()) == self.group {
                t.set(key, value)
                    .map_err(|e| format!("--tune {name}.{key}={value}: {e}"))?;
            }
        }
        Ok(t)
    }

    /// The client controllers use.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The shared metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Cancelling this token shuts the manager down as SIGTERM would (useful in tests).
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Adds a controller. Its watches are built now and start with [`Manager::run`]; it counts
    /// as ready for `/readyz` once every one of them has listed.
    ///
    /// A [`Tuning`] that does not hold together (an override making the backoff base longer
    /// than its maximum) is reported and the manager's defaults are used instead.
    pub fn add<R: Reconciler>(&mut self, reconciler: R) -> &mut Self {
        let name = reconciler.name();
        let ready = Arc::new(AtomicBool::new(false));
        let tuning = self.tuning_of(&reconciler).unwrap_or_else(|e| {
            tracing::error!(controller = name, error = %e, "ignoring the controller's settings");
            self.tuning.clone()
        });
        // Every object of a built-in kind is other people's too: not sharded unless asked.
        let primary = reconciler.primary();
        let everyones = crate::kind::built_in::<R::Object>()
            && primary.labels.is_none()
            && primary.fields.is_none()
            && !reconciler.shards_all_of_a_built_in_kind();
        let sharded = self
            .sharding
            .as_ref()
            .filter(|_| !reconciler.singleton() && !everyones);
        if self.sharding.is_some() && everyones && !reconciler.singleton() {
            tracing::info!(
                controller = name,
                "not sharded: its primary is every object of a built-in kind (give it a selector, or opt in with Reconciler::shards_all_of_a_built_in_kind); it runs on the leader"
            );
        }
        let common = match sharded {
            Some(s) => Common {
                client: s.client.clone(),
                shutdown: self.shutdown.clone(),
                gate: s.gate.clone(),
                leading: s.leading.subscribe(),
                shared: self.shared.clone(),
                shard: Some(crate::runtime::context::Shard {
                    label: crate::sharding::shard_label(name),
                    member: s.claimed.borrow().clone().unwrap_or_default(),
                    drain: crate::sharding::drain_label(name),
                    adopt: crate::sharding::adopt_annotation(name),
                    released: Default::default(),
                    adopted: Default::default(),
                }),
            },
            None => Common {
                client: self.client.clone(),
                shutdown: self.shutdown.clone(),
                gate: self.gate.clone(),
                leading: self.leading.subscribe(),
                shared: self.shared.clone(),
                shard: None,
            },
        };
        // A spare (sharding slots, none claimed yet) builds the controller once it claims one:
        // its watches select that slot's objects.
        let spare = sharded
            .filter(|s| s.claimed.borrow().is_none())
            .map(|s| s.claimed.subscribe());
        let controller_metrics = self.metrics.for_controller(name);
        let namespaces = match self.scope.list() {
            None => vec![None],
            Some(list) => list.iter().cloned().map(Some).collect(),
        };
        if let Some(s) = sharded {
            let (group, lease_ns) = (s.cfg.group.clone(), s.cfg.lease.namespace.clone());
            let namespaces = namespaces.clone();
            let metrics = self.metrics.for_controller(name);
            let selectors = (primary.labels.clone(), primary.fields.clone());
            // Objects every member watches only: the sharder applies the selectors of one
            // that selects, and only in the namespaces in scope.
            if selectors.0.is_none() && selectors.1.is_none() {
                let mut hook = crate::sharding::admit::webhook::<R::Object>(name, s.view.clone());
                if let Some(list) = self.scope.list() {
                    hook = hook.in_namespaces(&crate::sharding::admit::path(name), list.to_vec());
                }
                self.placement = std::mem::take(&mut self.placement).merge(hook);
            }
            self.sharders.push(Box::new(move |client: Client| {
                let leases = kube::Api::namespaced(client.clone(), &lease_ns);
                crate::sharding::sharder::run::<R::Object>(
                    client,
                    leases,
                    group.clone(),
                    name,
                    namespaces.clone(),
                    selectors.clone(),
                    metrics.clone(),
                )
                .boxed()
            }));
        }
        let synced = Synced::new(ready.clone());
        let run = match spare {
            None => {
                let ctx = ControllerContext::new(name, controller_metrics, tuning, common);
                runtime::run(reconciler, ctx, namespaces, synced.clone())
            }
            Some(mut claimed) => {
                let (synced, shared, shutdown) = (synced.clone(), self.shared.clone(), self.shutdown.clone());
                synced.set_spare(true);
                let mut common = common;
                async move {
                    let Ok(member) = claimed
                        .wait_for(Option::is_some)
                        .await
                        .map(|m| m.clone().unwrap_or_default())
                    else {
                        return;
                    };
                    synced.set_spare(false);
                    if let Some(shard) = common.shard.as_mut() {
                        shard.member = member;
                    }
                    let ctx = ControllerContext::new(name, controller_metrics, tuning, common);
                    let run = runtime::run(reconciler, ctx, namespaces, synced);
                    // Its watches are new reflectors: they run from now on.
                    for driver in shared.take_drivers() {
                        spawn_until(driver, &shutdown);
                    }
                    run.await
                }
                .boxed()
            }
        };
        self.controllers.push(Registered {
            name,
            group: self.group,
            ready,
            synced,
            run,
        });
        self
    }

    /// Serves the HTTP endpoints and runs every controller until SIGTERM, SIGINT or the
    /// shutdown token; then lets in-flight reconciles finish (bounded by the timeout; with
    /// leader election, writes only until the gate closes, a renew deadline after the last
    /// renewal) and aborts what is left before the Lease is released. With
    /// leader election, controllers start only once the Lease is held and every write passes
    /// the [`WriteGate`] (with `warm_standby`, their caches fill before, and only the
    /// reconciles wait); if the Lease is lost, the reconciles under way are dropped at once (no
    /// drain: another replica may already lead) and the manager returns the error, or, with
    /// `stand_by_on_loss`, stands by for the Lease again, still serving its webhooks; on a
    /// normal stop the Lease is released.
    pub async fn run(self, opts: ManagerOptions) -> Result<(), ManagerError> {
        let Manager {
            client,
            metrics,
            shutdown,
            controllers,
            gate,
            election_client,
            ungated_client,
            leading,
            shared,
            sharding,
            sharders,
            ..
        } = self;
        let auth = opts
            .metrics_secure
            .then(|| server::MetricsAuth::new(ungated_client.unwrap_or(client.clone())));
        let readiness: Vec<(&'static str, Arc<AtomicBool>)> =
            controllers.iter().map(|c| (c.name, c.ready.clone())).collect();
        let http = server::serve(
            server::Endpoints {
                metrics: opts.metrics_addr,
                health: opts.health_addr,
                metrics_cert_dir: opts.metrics_cert_dir.as_deref(),
            },
            metrics.clone(),
            auth,
            readiness,
            shutdown.clone(),
        )
        .await?;

        let signals = if opts.handle_signals {
            let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                .map_err(ManagerError::Signals)?;
            let shutdown = shutdown.clone();
            Some(tokio::spawn(async move {
                tokio::select! {
                    _ = term.recv() => tracing::info!("SIGTERM received, shutting down"),
                    _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received, shutting down"),
                    _ = shutdown.cancelled() => {},
                }
                shutdown.cancel();
            }))
        } else {
            None
        };

        let elector = opts.leader_election.clone().map(|cfg| {
            LeaderElector::new(
                election_client.clone().unwrap_or(client.clone()),
                cfg,
                gate.clone(),
            )
        });
        // A member of a sharding group holds its member Lease whether it leads or not.
        let member = sharding.map(|s| {
            s.gate.enforce();
            if s.view_wanted {
                let leases = kube::Api::namespaced(client.clone(), &s.cfg.lease.namespace);
                let view = crate::sharding::admit::watch(leases, s.cfg.group.clone(), s.view.clone());
                spawn_until(view, &shutdown);
            }
            let client = election_client.clone().unwrap_or(client.clone());
            let (shutdown, metrics, leading) = (shutdown.clone(), metrics.clone(), s.leading.clone());
            let task = tokio::spawn(async move {
                let (cfg, claimed) = if s.cfg.slots == 0 {
                    (s.cfg.lease.clone(), None)
                } else {
                    // A spare until one of the slots is free: its webhooks, probes and metrics
                    // served, its sharded controllers not yet built.
                    let slots: Vec<_> = (0..s.cfg.slots).map(|i| s.cfg.slot_lease(i)).collect();
                    tracing::info!(slots = slots.len(), "waiting to claim a sharding slot");
                    match crate::leader::acquire_one(&client, &slots, &shutdown).await {
                        Ok(Some((i, deadline))) => (slots[i].clone(), Some(deadline)),
                        Ok(None) => return (None, Ok(())),
                        Err(e) => {
                            shutdown.cancel();
                            return (None, Err(e));
                        }
                    }
                };
                let e = LeaderElector::new(client, cfg.clone(), s.gate.clone());
                if let Some(deadline) = claimed {
                    s.gate.open_until(deadline);
                    let member = cfg.labels.get(crate::sharding::MEMBER_LABEL).cloned();
                    tracing::info!(
                        member = member.as_deref().unwrap_or_default(),
                        "claimed a sharding slot"
                    );
                    s.claimed.send_replace(member);
                }
                // A member never stands by after a loss: the sharder fenced it by clearing
                // its Lease, which a standby would take back at once and write from caches
                // that still hold the objects moved away. The process exits, and comes back
                // as a new member (or claims a slot again).
                let r = elect(
                    e.clone(),
                    "shard member",
                    claimed,
                    false,
                    shutdown,
                    leading,
                    Some((metrics, cfg.name.clone())),
                    Vec::new(),
                )
                .await;
                (Some(e), r)
            });
            (task, s.leading)
        });
        if !sharders.is_empty() {
            tokio::spawn(run_sharders(
                sharders,
                client.clone(),
                leading.subscribe(),
                shutdown.clone(),
            ));
        }
        let readiness: Vec<(Arc<AtomicBool>, Synced)> = controllers
            .iter()
            .map(|c| (c.ready.clone(), c.synced.clone()))
            .collect();
        let mut running = futures::stream::FuturesUnordered::new();
        let mut aborts = Vec::new();
        let mut pending = Some(controllers);
        let mut start = |controllers: Vec<Registered>| {
            // The watches first: the controllers' streams are fed by them.
            for driver in shared.take_drivers() {
                spawn_until(driver, &shutdown);
            }
            for c in controllers {
                tracing::info!(controller = c.name, "starting controller");
                let name = c.name;
                let task = tokio::spawn(c.run);
                aborts.push(task.abort_handle());
                running.push(task.map(move |r| (name, r)));
            }
        };
        let mut election = None;
        if let Some(e) = &elector {
            // The elector exists exactly when leader election is configured.
            let lease = opts
                .leader_election
                .as_ref()
                .map(|c| c.name.clone())
                .unwrap_or_default();
            metrics.leading(&lease, false);
            // A standby is healthy and ready (to take over); readiness then tracks the
            // controllers' caches once this replica leads.
            set_all(&readiness, true);
            gate.enforce();
            if opts.warm_standby || member.is_some() {
                // Caches fill now; every reconcile waits until this replica leads (or, for a
                // sharded controller, holds its member Lease).
                start(pending.take().unwrap_or_default());
            }
            let mut led = leading.subscribe();
            let task = tokio::spawn(elect(
                e.clone(),
                "leader",
                None,
                opts.stand_by_on_loss,
                shutdown.clone(),
                leading.clone(),
                Some((metrics.clone(), lease)),
                readiness.clone(),
            ));
            let led = tokio::select! {
                r = led.wait_for(|l| *l) => r.is_ok(),
                _ = shutdown.cancelled() => false,
            };
            if !led {
                tracing::info!("manager stopped before becoming the leader");
                shutdown.cancel();
                let r = task.await;
                // The Lease may have been won as the stop came; it goes at once.
                if let Err(err) = e.release().await {
                    tracing::warn!(error = %err, "releasing the leader Lease failed");
                }
                // Sharded controllers may have run: they stop before the member Lease goes.
                aborts.iter().for_each(|a| a.abort());
                while running.next().await.is_some() {}
                let member_result = match member {
                    Some((task, _)) => release_member(task).await,
                    None => Ok(()),
                };
                stop(signals, http);
                return election_result(r).and(member_result);
            }
            election = Some(task);
        } else {
            leading.send_replace(true);
        }
        if let Some(controllers) = pending.take() {
            start(controllers);
        }
        let mut result = Ok(());
        {
            let drain = async {
                while let Some((name, joined)) = running.next().await {
                    if !shutdown.is_cancelled() {
                        tracing::error!(controller = name, ?joined, "controller stopped before shutdown");
                        result = Err(ManagerError::ControllerExited(name));
                        shutdown.cancel();
                    }
                }
                // A manager without controllers (one that only serves webhooks, such as a
                // conversion) runs until it is told to stop.
                shutdown.cancelled().await;
            };
            tokio::pin!(drain);
            // A standby (never led, or lost the Lease) has nothing to finish: its reconciles
            // wait to lead, and may not write. A leader's drain is bounded by the timeout.
            let (leads, member_leads) = (leading.subscribe(), member.as_ref().map(|(_, l)| l.subscribe()));
            let leads = || *leads.borrow() || member_leads.as_ref().is_some_and(|m| *m.borrow());
            tokio::select! {
                _ = &mut drain => {},
                _ = async { shutdown.cancelled().await; if leads() { tokio::time::sleep(opts.shutdown_timeout).await } } => {
                    if leads() {
                        tracing::warn!(timeout = ?opts.shutdown_timeout, "controllers did not stop in time");
                    }
                }
            }
        }
        // Whatever is still running stops here, before the Lease is released: a standby takes
        // over at once after a release, and nothing of ours may still be writing then.
        aborts.iter().for_each(|a| a.abort());
        while running.next().await.is_some() {}
        // A Lease lost is not released: it may be another replica's already.
        let mut lost = false;
        if let Some(task) = election {
            let r = election_result(task.await);
            lost = r.is_err();
            result = result.and(r);
        }
        if let Some(e) = elector.as_ref().filter(|_| !lost) {
            match e.release().await {
                Ok(()) => tracing::info!("released the leader Lease"),
                Err(err) => tracing::warn!(error = %err, "releasing the leader Lease failed"),
            }
        }
        if let Some((task, _)) = member {
            result = result.and(release_member(task).await);
        }
        stop(signals, http);
        tracing::info!("manager stopped");
        result
    }
}

/// Leads whenever the Lease can be had, until shutdown. A replica that loses the Lease (its
/// renewals failed, or another replica holds it) stops reconciling at once. With `stand_by`
/// it then stands by for the Lease again in the same process: its write gate is already
/// closed, its caches stay warm, and what it serves without leading (webhooks, probes,
/// metrics) never stops. Without, the error stops the manager (see
/// [`ManagerOptions::stand_by_on_loss`] for the trade-off). `held`: the deadline of a Lease
/// already acquired, which the first term renews.
#[allow(clippy::too_many_arguments)]
async fn elect(
    e: LeaderElector,
    role: &'static str,
    mut held: Option<std::time::Instant>,
    stand_by: bool,
    shutdown: CancellationToken,
    leading: tokio::sync::watch::Sender<bool>,
    metrics: Option<(Metrics, String)>,
    readiness: Vec<(Arc<AtomicBool>, Synced)>,
) -> Result<(), LeaderError> {
    let report = |leads: bool| {
        if let Some((m, lease)) = &metrics {
            m.leading(lease, leads);
        }
    };
    // However this ends (shutdown, an error, a panic), the manager stops with it: a replica
    // that no longer seeks the Lease must not look like a healthy standby.
    let _stop = shutdown.clone().drop_guard();
    loop {
        let deadline = match held.take() {
            Some(deadline) => deadline,
            None => {
                tracing::info!(identity = e.identity(), "waiting to become the {role}");
                let Some(deadline) = e.acquire(&shutdown).await? else {
                    return Ok(());
                };
                deadline
            }
        };
        if shutdown.is_cancelled() {
            // Won as the stop came: nothing starts; `run` releases the Lease.
            return Ok(());
        }
        tracing::info!(identity = e.identity(), "became the {role}");
        report(true);
        for (ready, synced) in &readiness {
            ready.store(synced.is_ready(), std::sync::atomic::Ordering::SeqCst);
        }
        leading.send_replace(true);
        // Renewals stop at shutdown, so the gate closes at most a renew deadline later: the
        // drain may write until then, and a write still unanswered when the Lease is released
        // (a standby then takes over at once) was cut off by the gate long before.
        let renewed = e.renew(&shutdown, deadline).await;
        if let Err(err) = renewed {
            // The gate closed when the renewals ended; in-flight reconciles stop now.
            leading.send_replace(false);
            report(false);
            if !stand_by {
                tracing::error!(error = %err, "{role} election lost, stopping");
                return Err(err);
            }
            set_all(&readiness, true);
            tracing::error!(error = %err, "{role} election lost: reconciles stopped, standing by");
            continue;
        }
        report(false);
        return Ok(());
    }
}

/// Runs the sharders while this replica leads: started in each term, stopped at its end.
async fn run_sharders(
    sharders: Vec<Sharder>,
    client: Client,
    mut leading: tokio::sync::watch::Receiver<bool>,
    shutdown: CancellationToken,
) {
    loop {
        tokio::select! {
            r = leading.wait_for(|l| *l) => if r.is_err() { return },
            _ = shutdown.cancelled() => return,
        }
        let mut term = leading.clone();
        term.borrow_and_update();
        let all = futures::future::join_all(sharders.iter().map(|f| f(client.clone())));
        tokio::select! {
            _ = all => return,
            _ = crate::runtime::context::term_ended(term) => {},
            _ = shutdown.cancelled() => return,
        }
    }
}

/// Waits for the member election to end (at shutdown) and gives the member Lease up, so the
/// sharder moves this replica's objects at once instead of after the Lease runs out.
async fn release_member(task: MemberTask) -> Result<(), ManagerError> {
    let (e, r) = match task.await {
        Ok((e, r)) => (e, Ok(r)),
        Err(j) => (None, Err(j)),
    };
    let r = election_result(r);
    if let (Ok(()), Some(e)) = (&r, e) {
        match e.release().await {
            Ok(()) => tracing::info!("released the shard member Lease"),
            Err(err) => tracing::warn!(error = %err, "releasing the shard member Lease failed"),
        }
    }
    r
}

fn election_result(r: Result<Result<(), LeaderError>, tokio::task::JoinError>) -> Result<(), ManagerError> {
    match r {
        Ok(r) => r.map_err(ManagerError::from),
        Err(e) => {
            tracing::error!(error = %e, "leader election stopped unexpectedly");
            Err(ManagerError::ControllerExited("leader-election"))
        }
    }
}

fn set_all(readiness: &[(Arc<AtomicBool>, Synced)], ready: bool) {
    for (r, _) in readiness {
        r.store(ready, std::sync::atomic::Ordering::SeqCst);
    }
}

fn stop(signals: Option<tokio::task::JoinHandle<()>>, http: Vec<tokio::task::JoinHandle<()>>) {
    if let Some(s) = signals {
        s.abort();
    }
    for h in http {
        h.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A controller of ConfigMaps that plans nothing, known by its name.
    struct Named(&'static str);

    impl Reconciler for Named {
        type Object = k8s_openapi::api::core::v1::ConfigMap;
        type Caches = ();
        type World = ();
        type Status = ();

        fn name(&self) -> &'static str {
            self.0
        }

        fn watch(&self, _: &mut crate::Watches<Self::Object>) {}

        async fn observe(&self, _: &Self::Object, _: &(), _: &Client) -> kube::Result<()> {
            Ok(())
        }

        fn plan(
            &self,
            _: &Self::Object,
            _: &(),
            _: k8s_openapi::jiff::Timestamp,
        ) -> Result<crate::Plan<()>, crate::Invalid> {
            Ok(crate::Plan::nothing(crate::Requeue::OnChange))
        }
    }

    #[tokio::test]
    async fn tune_by_the_registration_name_reaches_each_of_its_reconcilers() {
        let client =
            kube::Client::try_from(kube::Config::new("http://127.0.0.1:1".parse().unwrap())).unwrap();
        let mut m = Manager::new(client);
        m.tune("eru.timeout=7s").unwrap();
        m.tune("eru-annotations.concurrency=2").unwrap();
        m.adding_for(Some("eru"));
        let both = m.tuning_of(&Named("eru-annotations")).unwrap();
        assert_eq!((both.timeout, both.concurrency), (Duration::from_secs(7), 2));
        m.add(Named("eru")).add(Named("eru-annotations"));
        m.adding_for(None);
        let other = m.tuning_of(&Named("other")).unwrap();
        assert_eq!(other, Tuning::default());
        m.add(Named("other"));
        assert!(m.check_tuning().is_ok());
        m.tune("memcached.timeout=1s").unwrap();
        assert!(
            m.check_tuning()
                .unwrap_err()
                .contains("no controller \"memcached\"")
        );
    }

    #[tokio::test]
    async fn tune_takes_name_key_value_only() {
        let client =
            kube::Client::try_from(kube::Config::new("http://127.0.0.1:1".parse().unwrap())).unwrap();
        let mut m = Manager::new(client);
        assert!(m.tune("memcached.timeout=30s").is_ok());
        assert!(m.tune("memcached=30s").unwrap_err().contains("NAME.KEY=VALUE"));
        assert!(
            m.tune("memcached.timeout=later")
                .unwrap_err()
                .contains("not a duration")
        );
        // No controller called memcached was added.
        assert!(
            m.check_tuning()
                .unwrap_err()
                .contains("no controller \"memcached\"")
        );
    }
}
