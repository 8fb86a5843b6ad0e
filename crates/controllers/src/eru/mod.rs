//! The Eru controller: graceful rolling restarts of Deployments on a cron schedule.
//!
//! Two loops share one Deployment cache:
//! - Deployments annotated `mtsre.meitu.com/eru: "true"` get an `Eru` of the same name, owned by
//!   the Deployment; removing the annotation deletes it (only one opkit created).
//! - Each `Eru` restarts its Deployment at every schedule slot by applying the pod-template
//!   annotation `kubectl.kubernetes.io/restartedAt` (what `kubectl rollout restart` sets), with
//!   its own field manager and nothing else, so the Deployment's rolling strategy does the rest.
//!   A slot is acted on once (recorded in status), postponed while a rollout is in progress,
//!   made up at most once after downtime, and dropped when later than
//!   `startingDeadlineSeconds`.
//!
//! reconcile = fetch (cache) → plan (pure) → apply (client) → status (client).
mod cron;
mod plan;

use std::sync::Arc;

use futures::{FutureExt, StreamExt, future};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::rbac::v1::PolicyRule;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::controller::{Action, Config as ControllerConfig, Controller};
use kube::runtime::events::EventType;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, ResourceExt};
use opkit::conditions::{self, Desired};
use opkit::{Clock, ControllerContext, ReconcileError};
use opkit_api::eru::{Eru, EruStatus, FROM_ANNOTATION_LABEL};

pub use cron::{Schedule, time_zone};
pub use plan::{
    MAX_WAIT, Plan, RESTARTED_AT, Step, build_eru_for, check_spec, created_from, plan, restart_patch,
    restart_stamp, restarted_at, rollout_in_progress, wait_for, wants_eru,
};

use crate::Scope;
use crate::rbac::{events, rule};

/// The controller's name (`--controllers eru`) and metrics label.
pub const NAME: &str = "eru";

/// Condition types and reasons (what `kubectl describe` shows).
pub mod reason {
    pub const SCHEDULED: &str = "Scheduled";
    pub const TARGET_FOUND: &str = "TargetFound";
    pub const POSTPONED: &str = "Postponed";
    pub const WAITING: &str = "WaitingForSlot";
    pub const SUSPENDED: &str = "Suspended";
    pub const INVALID_SCHEDULE: &str = "InvalidSchedule";
    pub const INVALID_TIME_ZONE: &str = "InvalidTimeZone";
    pub const DEPLOYMENT_FOUND: &str = "DeploymentFound";
    pub const DEPLOYMENT_NOT_FOUND: &str = "DeploymentNotFound";
    pub const ROLLOUT_IN_PROGRESS: &str = "RolloutInProgress";
    pub const AS_EXPECTED: &str = "AsExpected";
    pub const RESTARTED: &str = "Restarted";
    pub const MISSED_SCHEDULE: &str = "MissedSchedule";
    pub const ERU_CREATED: &str = "EruCreated";
    pub const ERU_DELETED: &str = "EruDeleted";
}

/// Settings from the command line.
#[derive(Clone, Debug)]
pub struct Config {
    pub scope: Scope,
    pub concurrency: u16,
    /// Where "now" comes from; the system clock outside tests.
    pub clock: Arc<dyn Clock>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            scope: Scope::all(),
            concurrency: crate::DEFAULT_CONCURRENCY,
            clock: opkit::clock::system(),
        }
    }
}

/// The API access this controller uses, for the generated ClusterRole.
pub fn rbac_rules() -> Vec<PolicyRule> {
    vec![
        rule(
            &["mtsre.meitu.com"],
            &["erus"],
            &["get", "list", "watch", "create", "patch", "delete"],
        ),
        rule(&["mtsre.meitu.com"], &["erus/status"], &["get", "patch"]),
        // `patch` sets the restart annotation; the Deployments themselves are never created.
        rule(&["apps"], &["deployments"], &["get", "list", "watch", "patch"]),
        events(),
    ]
}

/// Errors, one variant per reconcile step that can fail.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("restarting Deployment {name}: {source}")]
    Restart { name: String, source: kube::Error },
    #[error("writing status: {source}")]
    Status { source: kube::Error },
    #[error("encoding status: {0}")]
    Encode(#[from] serde_json::Error),
    #[error("building the Eru for Deployment {name}: {message}")]
    Build { name: String, message: String },
    #[error("applying Eru {name}: {source}")]
    ApplyEru { name: String, source: kube::Error },
    #[error("deleting Eru {name}: {source}")]
    DeleteEru { name: String, source: kube::Error },
}

/// `Result` of a reconcile step.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl ReconcileError for Error {
    fn category(&self) -> &'static str {
        match self {
            Error::Restart { .. } => "restart",
            Error::Status { .. } => "status",
            Error::Encode(_) | Error::Build { .. } => "build",
            Error::ApplyEru { .. } => "apply",
            Error::DeleteEru { .. } => "delete",
        }
    }
}

struct State {
    ctx: ControllerContext,
    clock: Arc<dyn Clock>,
    deployments: Store<Deployment>,
    erus: Store<Eru>,
}

/// Keeps only what the two loops read: names, uid, generation, our annotations, replicas, the
/// restart annotation and the rollout status. Every Deployment in scope is cached, so this
/// matters for memory.
fn trim(d: &mut Deployment) {
    d.managed_fields_mut().clear();
    d.metadata.labels = None;
    if let Some(a) = d.metadata.annotations.as_mut() {
        a.retain(|k, _| k.starts_with("mtsre.meitu.com/"));
    }
    if let Some(spec) = d.spec.as_mut() {
        spec.selector = Default::default();
        spec.strategy = None;
        spec.template.spec = None;
        if let Some(m) = spec.template.metadata.as_mut() {
            m.labels = None;
            if let Some(a) = m.annotations.as_mut() {
                a.retain(|k, _| k == RESTARTED_AT);
            }
        }
    }
    if let Some(s) = d.status.as_mut() {
        s.conditions = None;
    }
}

/// Runs both loops until the manager shuts down.
pub async fn run(ctx: ControllerContext, cfg: Config) {
    let client = ctx.client().clone();
    let mut runs = Vec::new();
    let mut ready = Vec::new();
    for (erus, deploys) in cfg
        .scope
        .apis::<Eru>(&client)
        .into_iter()
        .zip(cfg.scope.apis::<Deployment>(&client))
    {
        let (deploy_store, writer) = reflector::store_shared(1024);
        let (Some(for_erus), Some(for_annotations)) = (writer.subscribe(), writer.subscribe()) else {
            tracing::error!("a shared store refused a subscriber");
            return;
        };
        let deploy_cache = watcher(deploys, watcher::Config::default())
            .default_backoff()
            .modify(trim)
            .reflect_shared(writer)
            .for_each(|_| future::ready(()));

        let eru_controller = Controller::new(erus, watcher::Config::default())
            .with_config(ControllerConfig::default().concurrency(cfg.concurrency));
        let eru_store = eru_controller.store();
        let index = eru_store.clone();
        let eru_controller = eru_controller
            .watches_shared_stream(for_erus, move |d: Arc<Deployment>| {
                let (ns, name) = (d.namespace(), d.name_any());
                index
                    .state()
                    .into_iter()
                    .filter(|e| e.namespace() == ns && e.spec.deployment_name == name)
                    .map(|e| ObjectRef::from_obj(e.as_ref()))
                    .collect::<Vec<_>>()
            })
            .graceful_shutdown_on(ctx.shutdown_signal());
        let annotation_controller = Controller::for_shared_stream(for_annotations, deploy_store.clone())
            .with_config(ControllerConfig::default().concurrency(cfg.concurrency))
            .graceful_shutdown_on(ctx.shutdown_signal());

        let (e, d) = (eru_store.clone(), deploy_store.clone());
        ready.push(async move { e.wait_until_ready().await }.boxed());
        ready.push(async move { d.wait_until_ready().await }.boxed());
        let state = Arc::new(State {
            ctx: ctx.clone(),
            clock: cfg.clock.clone(),
            deployments: deploy_store,
            erus: eru_store,
        });
        let shutdown = ctx.shutdown_signal();
        runs.push(
            async move {
                tokio::select! {
                    _ = deploy_cache => {},
                    _ = shutdown => {},
                }
            }
            .boxed(),
        );
        runs.push(
            eru_controller
                .run(
                    reconcile,
                    |e, err, st| st.ctx.error_policy(e.as_ref(), err),
                    state.clone(),
                )
                .for_each(|_| future::ready(()))
                .boxed(),
        );
        runs.push(
            annotation_controller
                .run(
                    reconcile_deployment,
                    |d, err, st| st.ctx.error_policy(d.as_ref(), err),
                    state,
                )
                .for_each(|_| future::ready(()))
                .boxed(),
        );
    }
    ctx.ready_when(future::join_all(ready));
    future::join_all(runs).await;
}

fn fmt_time(t: Timestamp) -> String {
    restart_stamp(t)
}

/// Whether condition `type_` is not already at `status` (so an Event is news).
fn flips(live: &EruStatus, type_: &str, status: &str) -> bool {
    conditions::find(&live.conditions, type_).is_none_or(|c| c.status != status)
}

#[tracing::instrument(skip(eru, st), fields(namespace = eru.namespace(), name = eru.name_any()))]
async fn reconcile(eru: Arc<Eru>, st: Arc<State>) -> Result<Action> {
    let _timer = st.ctx.reconcile_started();
    let ctx = &st.ctx;
    let ns = eru.namespace().unwrap_or_default();
    let target = eru.spec.deployment_name.clone();
    let now = st.clock.now();
    let live = eru.status.clone().unwrap_or_default();

    // fetch (cache)
    let deployment = st.deployments.get(&ObjectRef::new(&target).within(&ns));

    // plan (pure)
    let p = plan(&eru, deployment.as_deref(), now);
    tracing::debug!(?p, "planned");
    let mut status = EruStatus {
        next_restart_time: p.next.map(Time),
        observed_generation: eru.metadata.generation,
        ..live.clone()
    };
    let next_msg = p
        .next
        .map(|n| format!("next restart at {}", fmt_time(n)))
        .unwrap_or_default();
    let mut want = vec![if p.target_found {
        Desired::yes(
            reason::TARGET_FOUND,
            reason::DEPLOYMENT_FOUND,
            format!("Deployment {target} exists"),
        )
    } else {
        Desired::no(
            reason::TARGET_FOUND,
            reason::DEPLOYMENT_NOT_FOUND,
            format!("Deployment {target} not found in namespace {ns}"),
        )
    }];
    let not_postponed = Desired::no(reason::POSTPONED, reason::AS_EXPECTED, "");
    let scheduled = Desired::yes(reason::SCHEDULED, reason::WAITING, next_msg.clone());
    let mut events: Vec<(EventType, &str, String)> = Vec::new();
    if !p.target_found && flips(&live, reason::TARGET_FOUND, "False") {
        events.push((
            EventType::Warning,
            reason::DEPLOYMENT_NOT_FOUND,
            format!("Deployment {target} not found in namespace {ns}"),
        ));
    }
    let mut action = p.next.map(|n| Action::requeue(wait_for(n, now)));

    match &p.step {
        Step::Invalid(why, msg) => {
            want.push(Desired::no(reason::SCHEDULED, why, msg.clone()));
            if flips(&live, reason::SCHEDULED, "False")
                || conditions::find(&live.conditions, reason::SCHEDULED).is_some_and(|c| c.reason != *why)
            {
                events.push((EventType::Warning, why, msg.clone()));
            }
            action = Some(Action::await_change());
        }
        Step::Suspended { slot } => {
            want.push(Desired::no(
                reason::SCHEDULED,
                reason::SUSPENDED,
                "spec.suspend is true",
            ));
            want.push(not_postponed);
            if let Some(s) = slot {
                status.last_schedule_time = Some(Time(*s));
            }
            action = Some(Action::await_change());
        }
        Step::Wait => want.extend([scheduled, not_postponed]),
        Step::Resumed { slot } => {
            if let Some(s) = slot {
                status.last_schedule_time = Some(Time(*s));
            }
            want.extend([scheduled, not_postponed]);
        }
        Step::TargetMissing { slot } => {
            status.last_schedule_time = Some(Time(*slot));
            want.extend([scheduled, not_postponed]);
            events.push((
                EventType::Warning,
                reason::DEPLOYMENT_NOT_FOUND,
                format!(
                    "Skipped the {} restart: Deployment {target} not found",
                    fmt_time(*slot)
                ),
            ));
        }
        Step::Postpone { slot, why } => {
            let msg = format!("restart for {} waits: {why}", fmt_time(*slot));
            want.extend([
                scheduled,
                Desired::yes(reason::POSTPONED, reason::ROLLOUT_IN_PROGRESS, msg.clone()),
            ]);
            if flips(&live, reason::POSTPONED, "True") {
                events.push((
                    EventType::Normal,
                    reason::POSTPONED,
                    format!("Postponed the {msg}"),
                ));
            }
        }
        Step::TooLate { slot, late } => {
            status.last_schedule_time = Some(Time(*slot));
            want.extend([scheduled, not_postponed]);
            events.push((
                EventType::Warning,
                reason::MISSED_SCHEDULE,
                format!(
                    "Skipped the {} restart: {}s late, startingDeadlineSeconds is {}",
                    fmt_time(*slot),
                    late.as_secs(),
                    eru.spec.starting_deadline_seconds.unwrap_or_default()
                ),
            ));
        }
        Step::Restart { slot } | Step::AlreadyRestarted { slot } => {
            if matches!(p.step, Step::Restart { .. }) {
                // apply (client): only the restart annotation, under opkit's field manager.
                let deploys: Api<Deployment> = Api::namespaced(ctx.client().clone(), &ns);
                ctx.apply_fields(&deploys, &target, &restart_patch(&target, *slot))
                    .await
                    .map_err(|source| Error::Restart {
                        name: target.clone(),
                        source,
                    })?;
            }
            status.last_schedule_time = Some(Time(*slot));
            status.last_restart_time = Some(Time(now));
            status.restart_count += 1;
            want.extend([scheduled, not_postponed]);
            events.push((
                EventType::Normal,
                reason::RESTARTED,
                format!(
                    "Restarted Deployment {target} for the {} slot; {next_msg}",
                    fmt_time(*slot)
                ),
            ));
        }
    }

    // status (client)
    status.conditions = conditions::merge(&live.conditions, &want, eru.metadata.generation, &Time(now));
    let api: Api<Eru> = Api::namespaced(ctx.client().clone(), &ns);
    ctx.apply_status(
        &api,
        &eru.name_any(),
        serde_json::to_value(&status)?,
        Some(serde_json::to_value(&live)?),
    )
    .await
    .map_err(|source| Error::Status { source })?;
    for (type_, why, note) in events {
        ctx.event(eru.as_ref(), type_, why, "Reconcile", note).await;
    }
    ctx.reconcile_succeeded(eru.as_ref());
    Ok(action.unwrap_or_else(Action::await_change))
}

/// Keeps the `Eru` of an annotated Deployment in line with its annotations.
#[tracing::instrument(skip(d, st), fields(namespace = d.namespace(), name = d.name_any()))]
async fn reconcile_deployment(d: Arc<Deployment>, st: Arc<State>) -> Result<Action> {
    let ctx = &st.ctx;
    let ns = d.namespace().unwrap_or_default();
    let name = d.name_any();
    let existing = st.erus.get(&ObjectRef::new(&name).within(&ns));
    let api: Api<Eru> = Api::namespaced(ctx.client().clone(), &ns);
    if wants_eru(&d) {
        if let Some(e) = &existing
            && !created_from(e, &d)
        {
            if e.labels().contains_key(FROM_ANNOTATION_LABEL) {
                // Left over from an earlier Deployment of this name; garbage collection removes
                // it shortly, then this one gets its own.
                return Ok(Action::requeue(std::time::Duration::from_secs(5)));
            }
            // Written by hand: it wins, opkit does not touch it.
            return Ok(Action::await_change());
        }
        let _timer = ctx.reconcile_started();
        let desired = build_eru_for(&d).map_err(|message| Error::Build {
            name: name.clone(),
            message,
        })?;
        let wrote = ctx
            .apply(&api, &desired, existing.as_deref())
            .await
            .map_err(|source| Error::ApplyEru {
                name: name.clone(),
                source,
            })?;
        if wrote && existing.is_none() {
            ctx.event(
                d.as_ref(),
                EventType::Normal,
                reason::ERU_CREATED,
                "Reconcile",
                format!(
                    "Created Eru {name} (schedule {:?}) from the annotation",
                    desired.spec.schedule
                ),
            )
            .await;
        }
    } else if let Some(e) = &existing
        && created_from(e, &d)
    {
        let _timer = ctx.reconcile_started();
        ctx.delete(&api, &name).await.map_err(|source| Error::DeleteEru {
            name: name.clone(),
            source,
        })?;
        ctx.event(
            d.as_ref(),
            EventType::Normal,
            reason::ERU_DELETED,
            "Reconcile",
            format!("Deleted Eru {name}: the annotation was removed"),
        )
        .await;
    }
    Ok(Action::await_change())
}
