//! The At controller (cnat): run `spec.command` once, in a Pod, at `spec.schedule`.
//!
//! PENDING waits on a timer set exactly to the schedule (no polling); at the time the Pod
//! `<name>-pod` is started and the phase turns RUNNING; when the Pod ends the outcome is recorded
//! and the phase turns DONE, for good. The Pod's name is fixed, so a retry or a restarted
//! operator finds the Pod it started instead of starting another.
//!
//! observe (cache; a read when a running Pod is missing from it) → plan (pure, [`next`] then
//! status, conditions and Events per step); opkit starts the Pod and writes the rest.
mod build;
mod webhook;

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::rbac::v1::PolicyRule;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::{Api, Client, ResourceExt};
use opkit::conditions::{self, Desired};
use opkit::rbac::{events, rule};
use opkit::{Cache, Child, Event, Invalid, Plan, Reconciler, Requeue, Watch, Watches};
use opkit_api::at::{At, AtStatus, Outcome, Phase};

pub use build::{
    CONTAINER, Finished, MAX_WAIT, Next, build_pod, controlled_by, finished, next, parse_schedule, pod_name,
    selector, starting,
};
pub use webhook::{AT_HORIZON_YEARS, validate_at, webhooks};

/// The controller's name (`--controllers at`) and metrics label.
pub const NAME: &str = "at";

/// Condition types (what `kubectl describe` shows).
pub mod condition {
    pub const SCHEDULED: &str = "Scheduled";
    pub const SUCCEEDED: &str = "Succeeded";
}

/// Condition and Event reasons.
pub mod reason {
    pub const VALID: &str = "ScheduleValid";
    pub const INVALID_SCHEDULE: &str = "InvalidSchedule";
    pub const INVALID_SPEC: &str = "InvalidSpec";
    pub const WAITING: &str = "Waiting";
    pub const STARTING: &str = "Starting";
    pub const RUNNING: &str = "Running";
    pub const STARTED: &str = "Started";
    pub const COMMAND_SUCCEEDED: &str = "CommandSucceeded";
    pub const COMMAND_FAILED: &str = "CommandFailed";
    pub const POD_DELETED: &str = "PodDeleted";
    pub const POD_CONFLICT: &str = "PodConflict";
}

/// How often a Pod of the At's name that belongs to something else is looked at again.
const CONFLICT_RETRY: Duration = Duration::from_secs(60);

/// The API access this controller uses, for the generated ClusterRole.
pub fn rbac_rules() -> Vec<PolicyRule> {
    vec![
        // `delete`: a finished At past `spec.ttlSecondsAfterFinished`.
        rule(
            &["cnat.programming-kubernetes.info"],
            &["ats"],
            &["list", "watch", "delete"],
        ),
        rule(&["cnat.programming-kubernetes.info"], &["ats/status"], &["patch"]),
        // The Pod is created (never applied: a second apply could start the command twice)
        // and never changed afterwards; `get` reads it when the cache may lag (see `observe`).
        rule(&[""], &["pods"], &["get", "list", "watch", "create"]),
        events(),
    ]
}

/// The At reconciler.
#[derive(Clone, Copy, Debug, Default)]
pub struct AtController;

/// What the plan reads: the At's Pod as last seen (`None`: it does not exist).
#[derive(Clone, Debug, Default)]
pub struct World {
    pub pod: Option<Arc<Pod>>,
}

fn fmt_time(t: Timestamp) -> String {
    t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// Only ownership and how the Pod ended matter here.
fn trim_pod(p: &mut Pod) {
    p.spec = None;
}

impl Reconciler for AtController {
    type Object = At;
    type Caches = Cache<Pod>;
    type World = World;
    type Status = AtStatus;

    fn name(&self) -> &'static str {
        NAME
    }

    /// Compact: a reconcile reads its own At only, decoded for it.
    fn primary(&self) -> Watch<At> {
        Watch::all().compact()
    }

    fn watch(&self, w: &mut Watches<At>) -> Cache<Pod> {
        w.owns(Watch::labels(&selector()).trim(trim_pod))
    }

    async fn observe(&self, at: &At, pods: &Cache<Pod>, client: &Client) -> kube::Result<World> {
        let ns = at.namespace().unwrap_or_default();
        let phase = at.status.as_ref().and_then(|s| s.phase).unwrap_or_default();
        let name = pod_name(at);
        let mut pod = match phase {
            Phase::Done => None,
            _ => pods.get(&ns, &name),
        };
        // The Pod watch can lag the At's: a running At whose Pod is not cached yet must not
        // be taken for one whose Pod was deleted.
        if phase == Phase::Running && pod.is_none() {
            pod = Api::<Pod>::namespaced(client.clone(), &ns)
                .get_opt(&name)
                .await?
                .map(Arc::new);
        }
        Ok(World { pod })
    }

    fn plan(&self, at: &At, world: &World, now: Timestamp) -> Result<Plan<AtStatus>, Invalid> {
        plan(at, world.pod.as_deref(), now)
    }
}

/// DONE is final; with `spec.ttlSecondsAfterFinished` the At (and its Pod, by garbage
/// collection) is deleted that long after it finished.
fn expire(at: &At, now: Timestamp) -> Plan<AtStatus> {
    let (Some(ttl), Some(done)) = (
        at.spec.ttl_seconds_after_finished,
        at.status.as_ref().and_then(|s| s.completion_time.as_ref()),
    ) else {
        return Plan::nothing(Requeue::OnChange);
    };
    let expires = done
        .0
        .saturating_add(SignedDuration::from_secs(i64::from(ttl)))
        .unwrap_or(done.0);
    if expires <= now {
        return Plan::delete();
    }
    let wait = now.duration_until(expires).unsigned_abs();
    Plan::nothing(Requeue::After(wait.min(MAX_WAIT) + Duration::from_millis(1)))
}

/// Everything the At controller decides: the step from [`next`], and for it the status,
/// conditions, Events, Pod and next look.
pub fn plan(at: &At, pod: Option<&Pod>, now: Timestamp) -> Result<Plan<AtStatus>, Invalid> {
    let live = at.status.clone().unwrap_or_default();
    let name = pod_name(at);
    let t = Time(now);
    let cond = |d: &[Desired<'_>]| conditions::merge(&live.conditions, d, at.metadata.generation, &t);
    let base = AtStatus {
        observed_generation: at.metadata.generation,
        ..live.clone()
    };
    if let Some(p) = pod
        && !controlled_by(p, at)
    {
        let msg = format!("Pod {name} exists but belongs to something else; waiting for it to go away");
        let news = conditions::find(&live.conditions, condition::SUCCEEDED)
            .is_none_or(|c| c.reason != reason::POD_CONFLICT);
        let status = AtStatus {
            conditions: cond(&[Desired::unknown(
                condition::SUCCEEDED,
                reason::POD_CONFLICT,
                msg.clone(),
            )]),
            ..base
        };
        let mut p = Plan::status(status, Requeue::After(CONFLICT_RETRY));
        if news {
            p = p.event(Event::warning(reason::POD_CONFLICT, "Start", msg));
        }
        return Ok(p);
    }
    let invalid =
        |reason: &'static str, message: String| Invalid::new(condition::SCHEDULED, false, reason, message);
    let pending = at.status.as_ref().and_then(|s| s.phase).unwrap_or_default() == Phase::Pending;
    if pending && at.name_any().len() > opkit_api::at::MAX_NAME {
        // Stored before the CRD refused such names: say so now, not at the scheduled time.
        let message = opkit_api::name_too_long(opkit_api::at::MAX_NAME, opkit_api::at::NAME_LIMIT_REASON);
        return Err(invalid(reason::INVALID_SPEC, message));
    }
    // RUNNING, as the intent to start (`Starting`) and once the Pod exists (`Running`).
    let running = |due: Timestamp, start_time: Time, why: &'static str, message: String| AtStatus {
        phase: Some(Phase::Running),
        pod_name: Some(name.clone()),
        start_time: Some(start_time),
        conditions: cond(&[
            Desired::yes(
                condition::SCHEDULED,
                reason::VALID,
                format!("ran at {}", fmt_time(due)),
            ),
            Desired::unknown(condition::SUCCEEDED, why, message),
        ]),
        ..base.clone()
    };
    let step = next(at, pod, now);
    Ok(match step {
        Next::Done => expire(at, now),
        Next::Invalid(msg) => return Err(invalid(reason::INVALID_SCHEDULE, msg)),
        Next::Wait { due, after } => Plan::status(
            AtStatus {
                phase: Some(Phase::Pending),
                conditions: cond(&[
                    Desired::yes(
                        condition::SCHEDULED,
                        reason::VALID,
                        format!("runs at {}", fmt_time(due)),
                    ),
                    Desired::unknown(
                        condition::SUCCEEDED,
                        reason::WAITING,
                        format!("waiting until {}", fmt_time(due)),
                    ),
                ]),
                ..base
            },
            Requeue::After(after),
        ),
        // The intent is stored first; planning again from it creates the Pod.
        Next::Start { due } => Plan::status(
            running(due, Time(now), reason::STARTING, format!("starting Pod {name}")),
            Requeue::Again,
        ),
        Next::Create { due } | Next::Started { due } => {
            let started = live.start_time.clone().unwrap_or(Time(now));
            let status = running(
                due,
                started,
                reason::RUNNING,
                format!("Pod {name} is running the command"),
            );
            let late = now.duration_since(due).as_secs_f64();
            let note = format!(
                "Started Pod {name} for {} ({late:.1}s after the schedule)",
                fmt_time(due)
            );
            let mut p = Plan::status(status, Requeue::After(MAX_WAIT)).event(Event::normal(
                reason::STARTED,
                "Start",
                note,
            ));
            if matches!(step, Next::Create { .. }) {
                // Create, not apply: a Pod of that name that appeared meanwhile fails the
                // write (a retry then finds it) instead of being written over.
                let desired = build_pod(at).map_err(|m| invalid(reason::INVALID_SPEC, m))?;
                p = p.child(Child::create(&desired, None));
            }
            p
        }
        // The Pod watch brings the end; the hourly look is a safety net.
        Next::Running => Plan::nothing(Requeue::After(MAX_WAIT)),
        Next::Finish(f) => {
            let (succeeded, why, note) = match (f.outcome, f.reason.as_str()) {
                (Outcome::Succeeded, _) => (
                    true,
                    reason::COMMAND_SUCCEEDED,
                    format!("Command succeeded in Pod {name}"),
                ),
                (Outcome::Failed, reason::POD_DELETED) => {
                    (false, reason::POD_DELETED, f.message.clone().unwrap_or_default())
                }
                (Outcome::Failed, r) => (
                    false,
                    reason::COMMAND_FAILED,
                    format!(
                        "Command failed in Pod {name}: {r}{}{}",
                        f.exit_code
                            .map(|c| format!(", exit code {c}"))
                            .unwrap_or_default(),
                        f.message.as_ref().map(|m| format!(": {m}")).unwrap_or_default()
                    ),
                ),
            };
            let status = AtStatus {
                phase: Some(Phase::Done),
                pod_name: Some(name.clone()),
                completion_time: Some(Time(f.at)),
                outcome: Some(f.outcome),
                exit_code: f.exit_code,
                reason: Some(f.reason.clone()),
                message: f.message.clone(),
                conditions: cond(&[Desired {
                    type_: condition::SUCCEEDED,
                    status: Some(succeeded),
                    reason: why,
                    message: note.clone(),
                }]),
                ..base
            };
            let event = if succeeded {
                Event::normal(why, "Finish", note)
            } else {
                Event::warning(why, "Finish", note)
            };
            // With a TTL the stored DONE status starts its clock: its watch event must bring
            // the At back (opkit's own writes trigger nothing otherwise) to plan the expiry.
            let requeue = match at.spec.ttl_seconds_after_finished {
                Some(_) => Requeue::Again,
                None => Requeue::OnChange,
            };
            Plan::status(status, requeue).event(event)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{ContainerState, ContainerStateTerminated, ContainerStatus, PodStatus};
    use opkit_api::at::AtSpec;

    fn ts(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    fn at(phase: Option<Phase>) -> At {
        let mut a = At::new(
            "example-at",
            AtSpec {
                schedule: "2026-01-01T10:00:00Z".into(),
                command: "echo YAY".into(),
                image: None,
                active_deadline_seconds: None,
                ttl_seconds_after_finished: None,
            },
        );
        a.metadata.namespace = Some("ns".into());
        a.metadata.uid = Some("uid-1".into());
        a.metadata.generation = Some(1);
        a.status = phase.map(|p| AtStatus {
            phase: Some(p),
            ..Default::default()
        });
        a
    }

    fn pod(a: &At, phase: &str, code: Option<i32>) -> Pod {
        let mut p = build_pod(a).unwrap();
        p.status = Some(PodStatus {
            phase: Some(phase.into()),
            container_statuses: code.map(|c| {
                vec![ContainerStatus {
                    name: CONTAINER.into(),
                    state: Some(ContainerState {
                        terminated: Some(ContainerStateTerminated {
                            exit_code: c,
                            reason: Some("Error".into()),
                            ..Default::default()
                        }),
                        ..Default::default()
                    }),
                    ..Default::default()
                }]
            }),
            ..Default::default()
        });
        p
    }

    fn cond<'a>(s: &'a AtStatus, t: &str) -> &'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
        conditions::find(&s.conditions, t).unwrap()
    }

    #[test]
    fn pending_waits_with_scheduled_true_and_no_pod() {
        let p = plan(&at(None), None, ts("2026-01-01T09:59:50Z")).unwrap();
        assert!(p.children.is_empty() && p.events.is_empty());
        assert_eq!(p.requeue, Requeue::After(Duration::from_secs(10)));
        let s = p.status.unwrap();
        assert_eq!(s.phase, Some(Phase::Pending));
        assert_eq!(cond(&s, condition::SCHEDULED).status, "True");
        assert_eq!(cond(&s, condition::SUCCEEDED).reason, reason::WAITING);
    }

    /// The At after `p`'s status was written.
    fn after(a: &At, p: &Plan<AtStatus>) -> At {
        let mut next = a.clone();
        next.status = p.status.clone().or(next.status);
        next
    }

    #[test]
    fn due_records_the_intent_first_then_creates_the_pod_once_and_says_so() {
        let a = at(None);
        let now = ts("2026-01-01T10:00:00.5Z");
        let intent = plan(&a, None, now).unwrap();
        assert!(
            intent.children.is_empty() && intent.events.is_empty(),
            "no Pod before the intent is stored"
        );
        let s = intent.status.as_ref().unwrap();
        assert_eq!(
            (s.phase, s.pod_name.as_deref()),
            (Some(Phase::Running), Some("example-at-pod"))
        );
        assert_eq!(cond(s, condition::SUCCEEDED).reason, reason::STARTING);

        let a = after(&a, &intent);
        let create = plan(&a, None, ts("2026-01-01T10:00:00.7Z")).unwrap();
        assert_eq!(create.children.len(), 1);
        assert_eq!(create.children[0].name(), "example-at-pod");
        let s = create.status.as_ref().unwrap();
        assert_eq!(cond(s, condition::SUCCEEDED).reason, reason::RUNNING);
        assert_eq!(
            s.start_time,
            Some(Time(now)),
            "startTime is when the intent was recorded"
        );
        assert_eq!(create.events[0].reason, reason::STARTED);
        assert!(
            create.events[0].note.contains("0.7s after the schedule"),
            "{:?}",
            create.events
        );

        // Once the start is recorded, a missing Pod was deleted: never created again.
        let a = after(&a, &create);
        let gone = plan(&a, None, ts("2026-01-01T10:00:02Z")).unwrap();
        assert!(gone.children.is_empty());
        assert_eq!(gone.status.unwrap().reason.as_deref(), Some(reason::POD_DELETED));
    }

    #[test]
    fn a_pod_found_after_the_intent_is_recorded_not_created_again() {
        let a = at(None);
        let a = after(&a, &plan(&a, None, ts("2026-01-01T10:00:01Z")).unwrap());
        let running = plan(&a, Some(&pod(&a, "Running", None)), ts("2026-01-01T10:00:02Z")).unwrap();
        assert!(running.children.is_empty());
        assert_eq!(
            cond(running.status.as_ref().unwrap(), condition::SUCCEEDED).reason,
            reason::RUNNING
        );
        assert_eq!(running.events[0].reason, reason::STARTED);
        let done = plan(
            &a,
            Some(&pod(&a, "Succeeded", Some(0))),
            ts("2026-01-01T10:00:02Z"),
        )
        .unwrap();
        assert!(done.children.is_empty());
        assert_eq!(done.requeue, Requeue::OnChange, "nothing follows without a TTL");
        assert_eq!(done.status.unwrap().phase, Some(Phase::Done));
        // With a TTL the stored DONE status must come back to plan the expiry.
        let mut ttl = a.clone();
        ttl.spec.ttl_seconds_after_finished = Some(2);
        let done = plan(
            &ttl,
            Some(&pod(&ttl, "Succeeded", Some(0))),
            ts("2026-01-01T10:00:02Z"),
        )
        .unwrap();
        assert_eq!(done.requeue, Requeue::Again);
    }

    #[test]
    fn a_pod_already_there_is_not_started_again() {
        let a = at(None);
        let existing = pod(&a, "Running", None);
        let p = plan(&a, Some(&existing), ts("2026-01-01T10:00:01Z")).unwrap();
        assert!(p.children.is_empty());
        assert_eq!(p.status.unwrap().phase, Some(Phase::Running));
    }

    #[test]
    fn running_writes_nothing_until_the_pod_ends() {
        let a = at(Some(Phase::Running));
        let p = plan(&a, Some(&pod(&a, "Running", None)), ts("2026-01-01T10:00:05Z")).unwrap();
        assert!(p.status.is_none() && p.children.is_empty() && p.events.is_empty());
        assert_eq!(p.requeue, Requeue::After(MAX_WAIT));
    }

    #[test]
    fn success_and_failure_end_done_with_matching_conditions_and_events() {
        let a = at(Some(Phase::Running));
        let now = ts("2026-01-01T10:00:05Z");
        let ok = plan(&a, Some(&pod(&a, "Succeeded", Some(0))), now).unwrap();
        let s = ok.status.unwrap();
        assert_eq!(
            (s.phase, s.outcome),
            (Some(Phase::Done), Some(Outcome::Succeeded))
        );
        assert_eq!(cond(&s, condition::SUCCEEDED).status, "True");
        assert_eq!(ok.events[0].type_, kube::runtime::events::EventType::Normal);
        assert_eq!(ok.requeue, Requeue::OnChange);

        let bad = plan(&a, Some(&pod(&a, "Failed", Some(3))), now).unwrap();
        let s = bad.status.unwrap();
        assert_eq!((s.outcome, s.exit_code), (Some(Outcome::Failed), Some(3)));
        assert_eq!(cond(&s, condition::SUCCEEDED).reason, reason::COMMAND_FAILED);
        assert_eq!(bad.events[0].type_, kube::runtime::events::EventType::Warning);
        assert!(bad.events[0].note.contains("exit code 3"), "{:?}", bad.events);
    }

    #[test]
    fn a_pod_deleted_while_running_ends_done_with_pod_deleted() {
        let p = plan(&at(Some(Phase::Running)), None, ts("2026-01-01T10:00:05Z")).unwrap();
        let s = p.status.unwrap();
        assert_eq!(s.reason.as_deref(), Some(reason::POD_DELETED));
        assert_eq!(cond(&s, condition::SUCCEEDED).reason, reason::POD_DELETED);
        assert!(p.children.is_empty(), "never started again");
    }

    #[test]
    fn done_is_final_and_writes_nothing() {
        let p = plan(&at(Some(Phase::Done)), None, ts("2030-01-01T00:00:00Z")).unwrap();
        assert!(p.status.is_none() && p.children.is_empty() && p.events.is_empty());
        assert_eq!(p.requeue, Requeue::OnChange);
    }

    #[test]
    fn a_foreign_pod_of_that_name_is_reported_once_and_never_taken_over() {
        let a = at(None);
        let mut theirs = pod(&a, "Running", None);
        theirs.metadata.owner_references = None;
        let now = ts("2026-01-01T10:00:01Z");
        let p = plan(&a, Some(&theirs), now).unwrap();
        assert!(p.children.is_empty());
        assert_eq!(p.events[0].reason, reason::POD_CONFLICT);
        assert_eq!(p.requeue, Requeue::After(CONFLICT_RETRY));
        let mut reported = a.clone();
        reported.status = p.status;
        let again = plan(&reported, Some(&theirs), now).unwrap();
        assert!(again.events.is_empty(), "reported once");
    }

    #[test]
    fn an_unparseable_schedule_is_invalid_on_scheduled() {
        let mut a = at(None);
        a.spec.schedule = "tomorrow".into();
        let e = plan(&a, None, ts("2026-01-01T10:00:00Z")).unwrap_err();
        assert_eq!(
            (e.condition, e.status, e.reason),
            (condition::SCHEDULED, false, reason::INVALID_SCHEDULE)
        );
        assert!(e.message.contains("spec.schedule"));
    }

    #[test]
    fn a_name_too_long_for_its_pod_is_invalid_while_pending() {
        let mut a = at(None);
        a.metadata.name = Some("a".repeat(250));
        let err = plan(&a, None, ts("2026-01-01T09:00:00Z")).unwrap_err();
        assert_eq!(err.reason, reason::INVALID_SPEC);
        assert!(
            err.message
                .contains("metadata.name must be at most 249 characters"),
            "{}",
            err.message
        );
        a.metadata.name = Some("a".repeat(249));
        assert!(plan(&a, None, ts("2026-01-01T09:00:00Z")).is_ok());
    }

    #[test]
    fn the_pod_has_a_run_deadline_and_limits() {
        let mut a = at(None);
        let pod = build_pod(&a).unwrap();
        let spec = pod.spec.unwrap();
        assert_eq!(
            spec.active_deadline_seconds,
            Some(opkit_api::at::DEFAULT_ACTIVE_DEADLINE_SECONDS)
        );
        let limits = spec.containers[0]
            .resources
            .as_ref()
            .unwrap()
            .limits
            .clone()
            .unwrap();
        for r in ["cpu", "memory", "ephemeral-storage"] {
            assert!(limits.contains_key(r), "no {r} limit");
        }
        a.spec.active_deadline_seconds = Some(30);
        assert_eq!(
            build_pod(&a).unwrap().spec.unwrap().active_deadline_seconds,
            Some(30)
        );
    }

    #[test]
    fn a_deadline_hit_is_the_outcome_not_the_killed_containers_exit() {
        let a = at(Some(Phase::Running));
        let mut p = pod(&a, "Failed", Some(137));
        let st = p.status.as_mut().unwrap();
        st.reason = Some("DeadlineExceeded".into());
        st.message = Some("Pod was active on the node longer than the specified deadline".into());
        let plan = plan(&a, Some(&p), ts("2026-01-01T11:00:00Z")).unwrap();
        let status = plan.status.unwrap();
        assert_eq!(status.outcome, Some(Outcome::Failed));
        assert_eq!(status.reason.as_deref(), Some("DeadlineExceeded"));
        assert!(status.message.unwrap().contains("deadline"));
    }

    #[test]
    fn a_finished_at_is_deleted_after_its_ttl_and_kept_without_one() {
        let mut a = at(Some(Phase::Done));
        a.status.as_mut().unwrap().completion_time = Some(Time(ts("2026-01-01T10:00:00Z")));
        let kept = plan(&a, None, ts("2026-01-02T10:00:00Z")).unwrap();
        assert!(!kept.delete);
        assert_eq!(kept.requeue, Requeue::OnChange);
        a.spec.ttl_seconds_after_finished = Some(60);
        let soon = plan(&a, None, ts("2026-01-01T10:00:30Z")).unwrap();
        assert!(!soon.delete && soon.status.is_none() && soon.children.is_empty());
        assert_eq!(soon.requeue, Requeue::After(Duration::from_millis(30_001)));
        assert!(plan(&a, None, ts("2026-01-01T10:01:00Z")).unwrap().delete);
        a.spec.ttl_seconds_after_finished = Some(0);
        assert!(plan(&a, None, ts("2026-01-01T10:00:00Z")).unwrap().delete);
    }
}
