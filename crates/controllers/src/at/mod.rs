//! The At controller (cnat): run `spec.command` once, in a Pod, at `spec.schedule`.
//!
//! PENDING waits on a timer set exactly to the schedule (no polling); at the time the Pod
//! `<name>-pod` is started and the phase turns RUNNING; when the Pod ends the outcome is recorded
//! and the phase turns DONE, for good. The Pod's name is fixed, so a retry or a restarted
//! operator finds the Pod it started instead of starting another.
//!
//! reconcile = fetch (cache, client on a cache miss) → decide (pure) → build (pure) → apply
//! (client) → status (client).
mod build;

use std::sync::Arc;

use futures::{FutureExt, StreamExt, future};
use k8s_openapi::api::core::v1::Pod;
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
use opkit_api::at::{At, AtStatus, Outcome, Phase};

pub use build::{
    CONTAINER, Finished, MAX_WAIT, Next, build_pod, controlled_by, finished, next, parse_schedule, pod_name,
    selector,
};

use crate::Scope;
use crate::rbac::{events, rule};

/// The controller's name (`--controllers at`) and metrics label.
pub const NAME: &str = "at";

/// Condition types and reasons (what `kubectl describe` shows).
pub mod reason {
    pub const SCHEDULED: &str = "Scheduled";
    pub const SUCCEEDED: &str = "Succeeded";
    pub const VALID: &str = "ScheduleValid";
    pub const INVALID_SCHEDULE: &str = "InvalidSchedule";
    pub const INVALID_SPEC: &str = "InvalidSpec";
    pub const WAITING: &str = "Waiting";
    pub const RUNNING: &str = "Running";
    pub const STARTED: &str = "Started";
    pub const COMMAND_SUCCEEDED: &str = "CommandSucceeded";
    pub const COMMAND_FAILED: &str = "CommandFailed";
    pub const POD_DELETED: &str = "PodDeleted";
    pub const POD_CONFLICT: &str = "PodConflict";
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
            &["cnat.programming-kubernetes.info"],
            &["ats"],
            &["get", "list", "watch"],
        ),
        rule(
            &["cnat.programming-kubernetes.info"],
            &["ats/status"],
            &["get", "patch"],
        ),
        // Server-side apply that creates an object needs `create` as well as `patch`.
        rule(&[""], &["pods"], &["get", "list", "watch", "create", "patch"]),
        events(),
    ]
}

/// Errors, one variant per reconcile step that can fail.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("reading Pod {name}: {source}")]
    Fetch { name: String, source: kube::Error },
    #[error("Pod {name} exists but is not controlled by this At; waiting for it to go away")]
    Conflict { name: String },
    #[error("starting Pod {name}: {source}")]
    Apply { name: String, source: kube::Error },
    #[error("writing status: {source}")]
    Status { source: kube::Error },
    #[error("encoding status: {0}")]
    Encode(#[from] serde_json::Error),
}

/// `Result` of a reconcile step.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl ReconcileError for Error {
    fn category(&self) -> &'static str {
        match self {
            Error::Fetch { .. } => "fetch",
            Error::Conflict { .. } => "conflict",
            Error::Apply { .. } => "apply",
            Error::Status { .. } => "status",
            Error::Encode(_) => "build",
        }
    }
}

struct State {
    ctx: ControllerContext,
    clock: Arc<dyn Clock>,
    pods: Store<Pod>,
}

/// Runs the controller until the manager shuts down.
pub async fn run(ctx: ControllerContext, cfg: Config) {
    let client = ctx.client().clone();
    let owned = watcher::Config::default().labels(&selector());
    let mut runs = Vec::new();
    let mut ready = Vec::new();
    for (ats, pods) in cfg
        .scope
        .apis::<At>(&client)
        .into_iter()
        .zip(cfg.scope.apis::<Pod>(&client))
    {
        let (pod_store, pod_writer) = reflector::store();
        // Only ownership and how the Pod ended matter here: drop the spec before caching.
        let pod_stream = reflector::reflector(
            pod_writer,
            watcher(pods, owned.clone()).default_backoff().modify(|p| {
                p.managed_fields_mut().clear();
                p.spec = None;
            }),
        )
        .touched_objects();
        let controller = Controller::new(ats, watcher::Config::default())
            .with_config(ControllerConfig::default().concurrency(cfg.concurrency))
            .owns_stream(pod_stream)
            .graceful_shutdown_on(ctx.shutdown_signal());
        let (c, p) = (controller.store(), pod_store.clone());
        ready.push(async move { c.wait_until_ready().await }.boxed());
        ready.push(async move { p.wait_until_ready().await }.boxed());
        let state = Arc::new(State {
            ctx: ctx.clone(),
            clock: cfg.clock.clone(),
            pods: pod_store,
        });
        runs.push(
            controller
                .run(
                    reconcile,
                    |at, err, st| st.ctx.error_policy(at.as_ref(), err),
                    state,
                )
                .for_each(|_| future::ready(())),
        );
    }
    ctx.ready_when(future::join_all(ready));
    future::join_all(runs).await;
}

fn fmt_time(t: Timestamp) -> String {
    t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

#[tracing::instrument(skip(at, st), fields(namespace = at.namespace(), name = at.name_any()))]
async fn reconcile(at: Arc<At>, st: Arc<State>) -> Result<Action> {
    let _timer = st.ctx.reconcile_started();
    let ctx = &st.ctx;
    let ns = at.namespace().unwrap_or_default();
    let now = st.clock.now();
    let live = at.status.clone().unwrap_or_default();
    let phase = live.phase.unwrap_or_default();
    let pod_name = pod_name(&at);
    let pods: Api<Pod> = Api::namespaced(ctx.client().clone(), &ns);

    // fetch (cache; the client only when a running Pod is missing from the cache, which may lag)
    let mut pod = match phase {
        Phase::Done => None,
        _ => st.pods.get(&ObjectRef::new(&pod_name).within(&ns)),
    };
    if phase == Phase::Running && pod.is_none() {
        pod = pods
            .get_opt(&pod_name)
            .await
            .map_err(|source| Error::Fetch {
                name: pod_name.clone(),
                source,
            })?
            .map(Arc::new);
    }
    if let Some(p) = &pod
        && !controlled_by(p, &at)
    {
        ctx.event(
            at.as_ref(),
            EventType::Warning,
            reason::POD_CONFLICT,
            "Start",
            format!("Pod {pod_name} exists but belongs to something else"),
        )
        .await;
        return Err(Error::Conflict { name: pod_name });
    }

    // decide (pure)
    let step = next(&at, pod.as_deref(), now);
    tracing::debug!(?phase, ?step, "decided");
    let t = Time(now);
    let cond = |d: &[Desired<'_>]| conditions::merge(&live.conditions, d, at.metadata.generation, &t);
    let base = AtStatus {
        observed_generation: at.metadata.generation,
        ..live.clone()
    };
    match step {
        Next::Done => Ok(Action::await_change()),
        Next::Invalid(msg) => {
            invalid(&st, &at, &live, reason::INVALID_SCHEDULE, msg).await?;
            Ok(Action::await_change())
        }
        Next::Wait { due, after } => {
            let status = AtStatus {
                phase: Some(Phase::Pending),
                conditions: cond(&[
                    Desired::yes(
                        reason::SCHEDULED,
                        reason::VALID,
                        format!("runs at {}", fmt_time(due)),
                    ),
                    Desired::unknown(
                        reason::SUCCEEDED,
                        reason::WAITING,
                        format!("waiting until {}", fmt_time(due)),
                    ),
                ]),
                ..base
            };
            write_status(ctx, &at, &status, &live).await?;
            ctx.reconcile_succeeded(at.as_ref());
            Ok(Action::requeue(after))
        }
        Next::Start { due } => {
            // build (pure)
            let desired = match build_pod(&at) {
                Ok(p) => p,
                Err(msg) => {
                    invalid(&st, &at, &live, reason::INVALID_SPEC, msg).await?;
                    return Ok(Action::await_change());
                }
            };
            // apply (client): a Pod already there is the one this At started before a restart.
            if pod.is_none() {
                ctx.apply(&pods, &desired, None)
                    .await
                    .map_err(|source| Error::Apply {
                        name: pod_name.clone(),
                        source,
                    })?;
            }
            // status (client)
            let status = AtStatus {
                phase: Some(Phase::Running),
                pod_name: Some(pod_name.clone()),
                start_time: Some(Time(now)),
                conditions: cond(&[
                    Desired::yes(
                        reason::SCHEDULED,
                        reason::VALID,
                        format!("ran at {}", fmt_time(due)),
                    ),
                    Desired::unknown(
                        reason::SUCCEEDED,
                        reason::RUNNING,
                        format!("Pod {pod_name} is running the command"),
                    ),
                ]),
                ..base
            };
            write_status(ctx, &at, &status, &live).await?;
            let late = now.duration_since(due).as_secs_f64();
            ctx.event(
                at.as_ref(),
                EventType::Normal,
                reason::STARTED,
                "Start",
                format!(
                    "Started Pod {pod_name} for {} ({late:.1}s after the schedule)",
                    fmt_time(due)
                ),
            )
            .await;
            ctx.reconcile_succeeded(at.as_ref());
            Ok(Action::requeue(MAX_WAIT))
        }
        Next::Running => {
            ctx.reconcile_succeeded(at.as_ref());
            // The Pod watch brings the end; the hourly look is a safety net.
            Ok(Action::requeue(MAX_WAIT))
        }
        Next::Finish(f) => {
            let (succeeded, cond_reason, note) = match (f.outcome, f.reason.as_str()) {
                (Outcome::Succeeded, _) => (
                    true,
                    reason::COMMAND_SUCCEEDED,
                    format!("Command succeeded in Pod {pod_name}"),
                ),
                (Outcome::Failed, reason::POD_DELETED) => {
                    (false, reason::POD_DELETED, f.message.clone().unwrap_or_default())
                }
                (Outcome::Failed, r) => (
                    false,
                    reason::COMMAND_FAILED,
                    format!(
                        "Command failed in Pod {pod_name}: {r}{}{}",
                        f.exit_code
                            .map(|c| format!(", exit code {c}"))
                            .unwrap_or_default(),
                        f.message.as_ref().map(|m| format!(": {m}")).unwrap_or_default()
                    ),
                ),
            };
            let condition = Desired {
                type_: reason::SUCCEEDED,
                status: Some(succeeded),
                reason: cond_reason,
                message: note.clone(),
            };
            let event_type = if succeeded {
                EventType::Normal
            } else {
                EventType::Warning
            };
            let status = AtStatus {
                phase: Some(Phase::Done),
                pod_name: Some(pod_name.clone()),
                completion_time: Some(Time(f.at)),
                outcome: Some(f.outcome),
                exit_code: f.exit_code,
                reason: Some(f.reason.clone()),
                message: f.message.clone(),
                conditions: cond(&[condition]),
                ..base
            };
            write_status(ctx, &at, &status, &live).await?;
            ctx.event(at.as_ref(), event_type, cond_reason, "Finish", note)
                .await;
            ctx.reconcile_succeeded(at.as_ref());
            Ok(Action::await_change())
        }
    }
}

/// Records a spec the controller cannot act on: `Scheduled=False`, and a Warning Event when
/// that is news. Nothing is retried until the spec changes.
async fn invalid(st: &State, at: &At, live: &AtStatus, why: &str, msg: String) -> Result<()> {
    let now = Time(st.clock.now());
    let was_invalid =
        conditions::find(&live.conditions, reason::SCHEDULED).is_some_and(|c| c.status == "False");
    let status = AtStatus {
        phase: Some(live.phase.unwrap_or_default()),
        observed_generation: at.metadata.generation,
        conditions: conditions::merge(
            &live.conditions,
            &[Desired::no(reason::SCHEDULED, why, msg.clone())],
            at.metadata.generation,
            &now,
        ),
        ..live.clone()
    };
    write_status(&st.ctx, at, &status, live).await?;
    if !was_invalid {
        st.ctx.event(at, EventType::Warning, why, "Validate", msg).await;
    }
    Ok(())
}

async fn write_status(ctx: &ControllerContext, at: &At, desired: &AtStatus, live: &AtStatus) -> Result<()> {
    let api: Api<At> = Api::namespaced(ctx.client().clone(), &at.namespace().unwrap_or_default());
    ctx.apply_status(
        &api,
        &at.name_any(),
        serde_json::to_value(desired)?,
        Some(serde_json::to_value(live)?),
    )
    .await
    .map_err(|source| Error::Status { source })?;
    Ok(())
}
