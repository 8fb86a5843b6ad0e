//! The Eru controller: graceful rolling restarts of Deployments on a cron schedule.
//!
//! Two reconcilers, selected together as `eru`:
//! - [`EruController`]: each `Eru` restarts its Deployment at every schedule slot by applying
//!   the pod-template annotation `kubectl.kubernetes.io/restartedAt` (what `kubectl rollout
//!   restart` sets), with its own field manager and nothing else, so the Deployment's rolling
//!   strategy does the rest. A slot is acted on once (recorded in status), postponed while a
//!   rollout is in progress, made up at most once after downtime, and dropped when later than
//!   `startingDeadlineSeconds`.
//! - [`AnnotationController`]: Deployments annotated `mtsre.meitu.com/eru: "true"` get an `Eru`
//!   of the same name, owned by the Deployment; removing the annotation deletes it (only one
//!   opkit created — a hand-written Eru of that name wins and is never touched).
//!
//! observe (caches) → plan (pure: [`decide`], then status, conditions and Events); opkit writes.
mod plan;
mod webhook;

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::rbac::v1::PolicyRule;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::reflector::ObjectRef;
use kube::{Client, ResourceExt};
use opkit::conditions::{self, Desired};
use opkit::rbac::{events, rule};
use opkit::{Cache, Child, Event, Invalid, Plan, Reconciler, Requeue, Watch, Watches};
use opkit_api::eru::{Eru, EruStatus, FROM_ANNOTATION_LABEL};

pub use opkit::schedule::{Schedule, time_zone};
pub use plan::{
    Decision, MAX_WAIT, RESTART_COUNT, RESTARTED_AT, RESTARTED_BY, Step, build_eru_for, check_spec,
    created_from, decide, restart_patch, restart_stamp, restarted_at, restarts_made, rollout_in_progress,
    wait_for, wants_eru,
};
pub use webhook::{validate_eru, webhooks};

/// The name `--controllers` selects both loops by.
pub const NAME: &str = "eru";
/// The annotation loop's name (metrics label, field manager `opkit-eru-annotations`).
pub const ANNOTATIONS: &str = "eru-annotations";

/// Condition types (what `kubectl describe` shows).
pub mod condition {
    pub const SCHEDULED: &str = "Scheduled";
    pub const TARGET_FOUND: &str = "TargetFound";
    pub const POSTPONED: &str = "Postponed";
}

/// Condition and Event reasons.
pub mod reason {
    pub const WAITING: &str = "WaitingForSlot";
    pub const SUSPENDED: &str = "Suspended";
    pub const INVALID_SCHEDULE: &str = "InvalidSchedule";
    pub const INVALID_TIME_ZONE: &str = "InvalidTimeZone";
    pub const DEPLOYMENT_FOUND: &str = "DeploymentFound";
    pub const DEPLOYMENT_NOT_FOUND: &str = "DeploymentNotFound";
    pub const ROLLOUT_IN_PROGRESS: &str = "RolloutInProgress";
    pub const AS_EXPECTED: &str = "AsExpected";
    pub const RESTARTED: &str = "Restarted";
    pub const POSTPONED: &str = "Postponed";
    pub const MISSED_SCHEDULE: &str = "MissedSchedule";
    pub const ERU_CREATED: &str = "EruCreated";
    pub const ERU_DELETED: &str = "EruDeleted";
    pub const BUILD_FAILED: &str = "BuildFailed";
}

/// The API access both loops use, for the generated ClusterRole.
pub fn rbac_rules() -> Vec<PolicyRule> {
    vec![
        // The annotation loop applies an Eru (an apply that makes it is authorized as a create
        // too) and prunes it when the annotation goes.
        rule(
            &["mtsre.meitu.com"],
            &["erus"],
            &["list", "watch", "create", "patch", "delete"],
        ),
        rule(&["mtsre.meitu.com"], &["erus/status"], &["patch"]),
        // `patch` sets the restart annotation; the Deployments themselves are never created.
        // `get`: the webhook asks whether an Eru's Deployment exists, and a restart reads it
        // first.
        rule(&["apps"], &["deployments"], &["get", "list", "watch", "patch"]),
        events(),
    ]
}

/// Keeps only what the two loops read: names, uid, generation, our annotations, replicas, the
/// restart annotation and the rollout status. Every Deployment in scope is cached, so this
/// matters for memory.
fn trim(d: &mut Deployment) {
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

fn fmt_time(t: Timestamp) -> String {
    restart_stamp(t)
}

/// The schedule loop.
#[derive(Clone, Copy, Debug, Default)]
pub struct EruController;

/// What the schedule plan reads: the target Deployment as last seen.
#[derive(Clone, Debug, Default)]
pub struct World {
    pub deployment: Option<Arc<Deployment>>,
}

impl Reconciler for EruController {
    type Object = Eru;
    type Caches = Cache<Deployment>;
    type World = World;
    type Status = EruStatus;

    fn name(&self) -> &'static str {
        NAME
    }

    fn watch(&self, w: &mut Watches<Eru>) -> Cache<Deployment> {
        let erus = w.primary();
        w.watches(Watch::all().trim(trim), move |d: Deployment| {
            let (ns, name) = (d.namespace(), d.name_any());
            erus.filter(|e| e.namespace() == ns && e.spec.deployment_name == name)
                .iter()
                .map(|e| ObjectRef::from_obj(e.as_ref()))
                .collect::<Vec<_>>()
        })
    }

    async fn observe(&self, eru: &Eru, cache: &Cache<Deployment>, client: &Client) -> kube::Result<World> {
        let ns = eru.namespace().unwrap_or_default();
        let cached = cache.get(&ns, &eru.spec.deployment_name);
        // About to restart: read the Deployment itself, not the cache, which can lag (a watch
        // reconnecting after a takeover). The stamp of a restart made just before (by a
        // replica that lost the Lease before recording it) is then seen: recorded instead of
        // repeated, or counted when a later slot is due.
        let restart = matches!(
            decide(eru, cached.as_deref(), Timestamp::now()).step,
            Step::Restart { .. }
        );
        if !restart {
            return Ok(World { deployment: cached });
        }
        let live = kube::Api::<Deployment>::namespaced(client.clone(), &ns)
            .get_opt(&eru.spec.deployment_name)
            .await?;
        Ok(World {
            deployment: live.map(Arc::new),
        })
    }

    fn plan(&self, eru: &Eru, world: &World, now: Timestamp) -> Result<Plan<EruStatus>, Invalid> {
        plan(eru, world.deployment.as_deref(), now)
    }
}

/// Whether condition `type_` is not already at `status` (so an Event is news).
fn flips(live: &EruStatus, type_: &str, status: &str) -> bool {
    conditions::find(&live.conditions, type_).is_none_or(|c| c.status != status)
}

/// Everything the schedule loop decides for `eru` at `now`: the [`Step`], and for it the
/// status, conditions, Events, restart patch and next look.
pub fn plan(eru: &Eru, deployment: Option<&Deployment>, now: Timestamp) -> Result<Plan<EruStatus>, Invalid> {
    let ns = eru.namespace().unwrap_or_default();
    let target = eru.spec.deployment_name.clone();
    let live = eru.status.clone().unwrap_or_default();
    let d = decide(eru, deployment, now);
    let mut status = EruStatus {
        next_restart_time: d.next.map(Time),
        observed_generation: eru.metadata.generation,
        suspended: false,
        ..live.clone()
    };
    let next_msg = d
        .next
        .map(|n| format!("next restart at {}", fmt_time(n)))
        .unwrap_or_default();
    let missing = format!("Deployment {target} not found in namespace {ns}");
    let target_found = if d.target_found {
        Desired::yes(
            condition::TARGET_FOUND,
            reason::DEPLOYMENT_FOUND,
            format!("Deployment {target} exists"),
        )
    } else {
        Desired::no(
            condition::TARGET_FOUND,
            reason::DEPLOYMENT_NOT_FOUND,
            missing.clone(),
        )
    };
    let mut want = vec![target_found.clone()];
    let not_postponed = Desired::no(condition::POSTPONED, reason::AS_EXPECTED, "");
    let scheduled = Desired::yes(condition::SCHEDULED, reason::WAITING, next_msg.clone());
    let mut events = Vec::new();
    if !d.target_found && flips(&live, condition::TARGET_FOUND, "False") {
        events.push(Event::warning(reason::DEPLOYMENT_NOT_FOUND, "Reconcile", missing));
    }
    let mut children = Vec::new();
    let mut requeue = d.next.map(|n| Requeue::After(wait_for(n, now)));
    // Restarts made but never recorded (status writes lost): the Deployment's own count says
    // how many; without one (a Deployment restarted before it was counted there), its stamp
    // tells of the last one.
    let made = deployment.and_then(|dep| restarts_made(dep, eru));
    let lost = match (made, d.uncounted) {
        (Some(n), _) => (n - live.restart_count).max(0),
        (None, Some(_)) => 1,
        (None, None) => 0,
    };
    status.restart_count += lost;

    match &d.step {
        Step::Invalid(why, msg) => {
            return Err(Invalid::new(condition::SCHEDULED, false, why, msg.clone()).with(target_found));
        }
        Step::Suspended { slot } => {
            want.push(Desired::no(
                condition::SCHEDULED,
                reason::SUSPENDED,
                "spec.suspend is true",
            ));
            want.push(not_postponed);
            status.suspended = true;
            if let Some(s) = slot {
                status.last_schedule_time = Some(Time(*s));
            }
            requeue = Some(Requeue::OnChange);
        }
        Step::Wait => want.extend([scheduled, not_postponed]),
        Step::Resumed { slot } | Step::Edited { slot } => {
            if let Some(s) = slot {
                status.last_schedule_time = Some(Time(*s));
            }
            want.extend([scheduled, not_postponed]);
        }
        Step::Predates { slot } => {
            status.last_schedule_time = Some(Time(*slot));
            want.extend([scheduled, not_postponed]);
        }
        Step::TargetMissing => {
            // One Warning when it goes missing (above); no write per slot while it stays so.
            want.extend([
                Desired::no(
                    condition::SCHEDULED,
                    reason::DEPLOYMENT_NOT_FOUND,
                    format!("no restart is scheduled until Deployment {target} exists"),
                ),
                not_postponed,
            ]);
            requeue = Some(Requeue::After(MAX_WAIT));
        }
        Step::Postpone { slot, why } => {
            let msg = format!("restart for {} waits: {why}", fmt_time(*slot));
            if flips(&live, condition::POSTPONED, "True") {
                events.push(Event::normal(
                    reason::POSTPONED,
                    "Reconcile",
                    format!("Postponed the {msg}"),
                ));
            }
            want.extend([
                scheduled,
                Desired::yes(condition::POSTPONED, reason::ROLLOUT_IN_PROGRESS, msg),
            ]);
        }
        Step::TooLate { slot, late } => {
            status.last_schedule_time = Some(Time(*slot));
            want.extend([scheduled, not_postponed]);
            events.push(Event::warning(
                reason::MISSED_SCHEDULE,
                "Reconcile",
                format!(
                    "Skipped the {} restart: {}s late, startingDeadlineSeconds is {}",
                    fmt_time(*slot),
                    late.as_secs(),
                    eru.spec.starting_deadline_seconds.unwrap_or_default()
                ),
            ));
        }
        Step::Restart { slot } | Step::AlreadyRestarted { slot } => {
            if matches!(d.step, Step::Restart { .. }) {
                status.restart_count += 1;
                // Only the restart annotation and the count, under opkit's field manager.
                children.push(Child::fields::<Deployment>(
                    &ns,
                    &target,
                    restart_patch(&target, *slot, status.restart_count, eru),
                    None,
                ));
            } else if made.is_none() {
                // Made for this slot and not recorded; a count on the Deployment has it already.
                status.restart_count += 1;
            }
            status.last_schedule_time = Some(Time(*slot));
            status.last_restart_time = Some(Time(now));
            want.extend([scheduled, not_postponed]);
            events.push(Event::normal(
                reason::RESTARTED,
                "Reconcile",
                format!(
                    "Restarted Deployment {target} for the {} slot; {next_msg}",
                    fmt_time(*slot)
                ),
            ));
        }
    }
    if let Some(slot) = d.uncounted
        && status.last_schedule_time.as_ref().is_none_or(|t| t.0 < slot)
    {
        status.last_schedule_time = Some(Time(slot));
    }
    if lost > 0 {
        let what = match d.uncounted {
            Some(slot) if lost == 1 => format!("the restart for the {} slot", fmt_time(slot)),
            _ if lost == 1 => "1 restart".to_string(),
            _ => format!("{lost} restarts"),
        };
        events.push(Event::normal(
            reason::RESTARTED,
            "Reconcile",
            format!("Counted {what} of Deployment {target}, made before its record was lost"),
        ));
    }
    status.conditions = conditions::merge(&live.conditions, &want, eru.metadata.generation, &Time(now));
    let mut plan = Plan::status(status, requeue.unwrap_or(Requeue::OnChange));
    plan.children = children;
    plan.events = events;
    Ok(plan)
}

/// The annotation loop: one reconcile per Deployment.
#[derive(Clone, Copy, Debug, Default)]
pub struct AnnotationController;

/// What the annotation plan reads: the Eru of the Deployment's name, if any.
#[derive(Clone, Debug, Default)]
pub struct AnnotationWorld {
    pub eru: Option<Arc<Eru>>,
}

/// How long to wait for garbage collection to remove an Eru left by an earlier Deployment of
/// the same name.
const LEFTOVER_RETRY: Duration = Duration::from_secs(5);

impl Reconciler for AnnotationController {
    type Object = Deployment;
    type Caches = Cache<Eru>;
    type World = AnnotationWorld;
    type Status = serde_json::Value;

    fn name(&self) -> &'static str {
        ANNOTATIONS
    }

    // The same watch as the schedule loop's: the two controllers share one Deployment cache.
    fn primary(&self) -> Watch<Deployment> {
        Watch::all().trim(trim)
    }

    fn watch(&self, w: &mut Watches<Deployment>) -> Cache<Eru> {
        // Every Eru (a hand-written one of the same name must be seen to be left alone); a
        // change to one opkit made reconciles its Deployment, so a deleted one comes back.
        w.owns(Watch::all().prune())
    }

    async fn observe(&self, d: &Deployment, erus: &Cache<Eru>, _: &Client) -> kube::Result<AnnotationWorld> {
        Ok(AnnotationWorld {
            eru: erus.get(&d.namespace().unwrap_or_default(), &d.name_any()),
        })
    }

    fn plan(
        &self,
        d: &Deployment,
        world: &AnnotationWorld,
        _: Timestamp,
    ) -> Result<Plan<serde_json::Value>, Invalid> {
        Ok(plan_annotation(d, world.eru.as_deref()))
    }
}

/// Keeps the `Eru` of an annotated Deployment in line with its annotations. An Eru opkit made
/// and the plan no longer produces is deleted by opkit's pruning.
pub fn plan_annotation(d: &Deployment, existing: Option<&Eru>) -> Plan<serde_json::Value> {
    let name = d.name_any();
    let mut plan = Plan::nothing(Requeue::OnChange);
    if wants_eru(d) {
        if let Some(e) = existing
            && !created_from(e, d)
        {
            if e.labels().contains_key(FROM_ANNOTATION_LABEL) {
                // Left over from an earlier Deployment of this name; garbage collection removes
                // it shortly, then this one gets its own.
                plan.requeue = Requeue::After(LEFTOVER_RETRY);
            }
            // Otherwise written by hand: it wins, opkit does not touch it.
            return plan;
        }
        match build_eru_for(d) {
            Ok(desired) => {
                let child = Child::apply(&desired, existing);
                if child.is_needed() && existing.is_none() {
                    plan.events.push(Event::normal(
                        reason::ERU_CREATED,
                        "Reconcile",
                        format!(
                            "Created Eru {name} (schedule {:?}) from the annotation",
                            desired.spec.schedule
                        ),
                    ));
                }
                plan.children.push(child);
            }
            Err(message) => plan
                .events
                .push(Event::warning(reason::BUILD_FAILED, "Reconcile", message)),
        }
    } else if let Some(e) = existing
        && created_from(e, d)
    {
        plan.events.push(Event::normal(
            reason::ERU_DELETED,
            "Reconcile",
            format!("Deleted Eru {name}: the annotation was removed"),
        ));
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::apps::v1::{DeploymentSpec, DeploymentStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use kube::runtime::events::EventType;
    use opkit_api::eru::{ANNOTATION, EruSpec};

    fn ts(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    /// An Eru created at 10:00:00 restarting `web` every 20 s.
    fn eru(status: Option<EruStatus>) -> Eru {
        let mut e = Eru::new(
            "web",
            EruSpec {
                deployment_name: "web".into(),
                schedule: "*/20 * * * * *".into(),
                time_zone: None,
                suspend: None,
                starting_deadline_seconds: None,
            },
        );
        e.metadata.namespace = Some("ns".into());
        e.metadata.generation = Some(1);
        e.metadata.creation_timestamp = Some(Time(ts("2026-01-01T10:00:00Z")));
        e.status = status;
        e
    }

    fn web(ready: bool) -> Deployment {
        Deployment {
            metadata: ObjectMeta {
                name: Some("web".into()),
                namespace: Some("ns".into()),
                uid: Some("d-uid".into()),
                generation: Some(1),
                ..Default::default()
            },
            spec: Some(DeploymentSpec {
                replicas: Some(2),
                ..Default::default()
            }),
            status: Some(DeploymentStatus {
                observed_generation: Some(1),
                replicas: Some(2),
                updated_replicas: Some(2),
                available_replicas: Some(if ready { 2 } else { 1 }),
                ..Default::default()
            }),
        }
    }

    fn cond(p: &Plan<EruStatus>, t: &str) -> (String, String) {
        let c = conditions::find(&p.status.as_ref().unwrap().conditions, t).unwrap();
        (c.status.clone(), c.reason.clone())
    }

    fn reasons(p: &Plan<EruStatus>) -> Vec<&'static str> {
        p.events.iter().map(|e| e.reason).collect()
    }

    #[test]
    fn waiting_sets_scheduled_and_target_found_and_wakes_at_the_next_slot() {
        let p = plan(&eru(None), Some(&web(true)), ts("2026-01-01T10:00:05Z")).unwrap();
        assert!(p.children.is_empty() && p.events.is_empty());
        assert_eq!(
            cond(&p, condition::SCHEDULED),
            ("True".into(), reason::WAITING.into())
        );
        assert_eq!(
            cond(&p, condition::TARGET_FOUND),
            ("True".into(), reason::DEPLOYMENT_FOUND.into())
        );
        assert_eq!(cond(&p, condition::POSTPONED).0, "False");
        assert_eq!(p.requeue, Requeue::After(Duration::from_secs(15)));
    }

    #[test]
    fn a_due_slot_patches_only_the_restart_annotation_counts_and_says_so() {
        let p = plan(&eru(None), Some(&web(true)), ts("2026-01-01T10:00:20Z")).unwrap();
        assert_eq!(p.children.len(), 1);
        assert_eq!(p.children[0].describe(), "Deployment web");
        let s = p.status.as_ref().unwrap();
        assert_eq!(s.restart_count, 1);
        assert_eq!(s.last_schedule_time, Some(Time(ts("2026-01-01T10:00:20Z"))));
        assert_eq!(reasons(&p), vec![reason::RESTARTED]);
    }

    #[test]
    fn a_restart_already_made_is_recorded_without_a_second_patch() {
        let mut d = web(true);
        d.spec.as_mut().unwrap().template.metadata = Some(ObjectMeta {
            annotations: Some([(RESTARTED_AT.to_string(), "2026-01-01T10:00:20Z".to_string())].into()),
            ..Default::default()
        });
        let p = plan(&eru(None), Some(&d), ts("2026-01-01T10:00:21Z")).unwrap();
        assert!(p.children.is_empty());
        assert_eq!(p.status.unwrap().restart_count, 1);
    }

    #[test]
    fn a_restart_whose_record_was_lost_is_counted_once() {
        // 10:00:20 restarted and not recorded; 10:00:40 due but that rollout still runs.
        let mut d = web(false);
        d.spec.as_mut().unwrap().template.metadata = Some(ObjectMeta {
            annotations: Some([(RESTARTED_AT.to_string(), "2026-01-01T10:00:20Z".to_string())].into()),
            ..Default::default()
        });
        let p = plan(&eru(None), Some(&d), ts("2026-01-01T10:00:41Z")).unwrap();
        assert!(p.children.is_empty());
        let s = p.status.clone().unwrap();
        assert_eq!(s.restart_count, 1);
        assert_eq!(s.last_schedule_time, Some(Time(ts("2026-01-01T10:00:20Z"))));
        assert_eq!(reasons(&p), vec![reason::POSTPONED, reason::RESTARTED]);
        let again = plan(&eru(p.status), Some(&d), ts("2026-01-01T10:00:42Z")).unwrap();
        assert_eq!(again.status.unwrap().restart_count, 1);
    }

    #[test]
    fn restarts_whose_records_were_lost_in_a_row_are_all_counted_from_the_deployment() {
        // Recorded: 1 restart. Made since, each status write lost: restarts 2 and 3 (the
        // Deployment counts them; its stamp only tells of the last one, 10:00:40).
        let mut e = eru(Some(EruStatus {
            restart_count: 1,
            last_schedule_time: Some(Time(ts("2026-01-01T10:00:00Z"))),
            ..Default::default()
        }));
        e.metadata.uid = Some("eru-uid".into());
        let mut d = web(true);
        d.metadata.annotations = Some(
            [
                (RESTART_COUNT.to_string(), "3".to_string()),
                (RESTARTED_BY.to_string(), "eru-uid".to_string()),
            ]
            .into(),
        );
        d.spec.as_mut().unwrap().template.metadata = Some(ObjectMeta {
            annotations: Some([(RESTARTED_AT.to_string(), "2026-01-01T10:00:40Z".to_string())].into()),
            ..Default::default()
        });
        let p = plan(&e, Some(&d), ts("2026-01-01T10:01:00Z")).unwrap();
        let s = p.status.clone().unwrap();
        assert_eq!(s.restart_count, 4, "1 recorded + 2 lost + the 10:01:00 one");
        assert_eq!(p.children.len(), 1);
        assert_eq!(reasons(&p), vec![reason::RESTARTED, reason::RESTARTED]);
        assert!(
            p.events.iter().any(|ev| ev.note.contains("Counted 2 restarts")),
            "{:?}",
            p.events
        );

        // The count on the Deployment is another Eru's (same name, recreated): not ours.
        let mut other = d.clone();
        other
            .metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(RESTARTED_BY.into(), "older-eru".into());
        let p = plan(&e, Some(&other), ts("2026-01-01T10:01:00Z")).unwrap();
        assert_eq!(
            p.status.unwrap().restart_count,
            3,
            "1 + the stamp's + the 10:01:00 one"
        );
    }

    #[test]
    fn a_rollout_in_progress_postpones_with_one_event_per_change() {
        let p = plan(&eru(None), Some(&web(false)), ts("2026-01-01T10:00:21Z")).unwrap();
        assert!(p.children.is_empty());
        assert_eq!(
            cond(&p, condition::POSTPONED),
            ("True".into(), reason::ROLLOUT_IN_PROGRESS.into())
        );
        assert_eq!(reasons(&p), vec![reason::POSTPONED]);
        let again = plan(&eru(p.status), Some(&web(false)), ts("2026-01-01T10:00:22Z")).unwrap();
        assert!(again.events.is_empty(), "{:?}", again.events);
    }

    #[test]
    fn a_missing_target_is_warned_once_and_nothing_is_written_per_slot() {
        let p = plan(&eru(None), None, ts("2026-01-01T10:00:05Z")).unwrap();
        assert_eq!(
            cond(&p, condition::TARGET_FOUND),
            ("False".into(), reason::DEPLOYMENT_NOT_FOUND.into())
        );
        assert_eq!(
            cond(&p, condition::SCHEDULED),
            ("False".into(), reason::DEPLOYMENT_NOT_FOUND.into())
        );
        assert_eq!(reasons(&p), vec![reason::DEPLOYMENT_NOT_FOUND]);
        let status = p.status.clone().unwrap();
        assert_eq!(status.next_restart_time, None);
        // Slots pass while it stays missing: no Event, and the same status (so no write).
        for at in ["2026-01-01T10:00:21Z", "2026-01-01T10:05:41Z"] {
            let again = plan(&eru(p.status.clone()), None, ts(at)).unwrap();
            assert!(again.events.is_empty(), "{:?}", again.events);
            assert_eq!(again.status.unwrap(), status);
            assert_eq!(again.requeue, Requeue::After(MAX_WAIT));
        }
    }

    #[test]
    fn a_slot_past_the_starting_deadline_is_skipped_with_a_warning() {
        let mut e = eru(None);
        e.spec.starting_deadline_seconds = Some(5);
        let p = plan(&e, Some(&web(true)), ts("2026-01-01T10:00:27Z")).unwrap();
        assert!(p.children.is_empty());
        assert_eq!(reasons(&p), vec![reason::MISSED_SCHEDULE]);
        assert_eq!(p.events[0].type_, EventType::Warning);
    }

    #[test]
    fn suspended_records_it_and_waits_for_a_change() {
        let mut e = eru(None);
        e.spec.suspend = Some(true);
        let p = plan(&e, Some(&web(true)), ts("2026-01-01T10:00:41Z")).unwrap();
        assert!(p.children.is_empty());
        assert_eq!(
            cond(&p, condition::SCHEDULED),
            ("False".into(), reason::SUSPENDED.into())
        );
        let s = p.status.as_ref().unwrap();
        assert!(s.suspended && s.next_restart_time.is_none());
        assert_eq!(p.requeue, Requeue::OnChange);
        // Resumed: the slot that passed while suspended is consumed, not made up.
        e.spec.suspend = None;
        e.status = p.status;
        let r = plan(&e, Some(&web(true)), ts("2026-01-01T10:01:05Z")).unwrap();
        assert!(r.children.is_empty());
        let s = r.status.unwrap();
        assert!(!s.suspended);
        assert_eq!(s.last_schedule_time, Some(Time(ts("2026-01-01T10:01:00Z"))));
    }

    #[test]
    fn an_invalid_schedule_is_invalid_with_the_target_condition_too() {
        let mut e = eru(None);
        e.spec.schedule = "61 * * * *".into();
        let i = plan(&e, None, ts("2026-01-01T10:00:05Z")).unwrap_err();
        assert_eq!(
            (i.condition, i.status, i.reason),
            (condition::SCHEDULED, false, reason::INVALID_SCHEDULE)
        );
        assert!(i.message.contains("minute: 61"));
        assert_eq!(i.also[0].type_, condition::TARGET_FOUND);
    }

    fn annotated(value: &str) -> Deployment {
        let mut d = web(true);
        d.metadata.annotations = Some([(ANNOTATION.to_string(), value.to_string())].into());
        d
    }

    #[test]
    fn an_annotated_deployment_gets_its_eru_once() {
        let d = annotated("true");
        let p = plan_annotation(&d, None);
        assert_eq!(p.children.len(), 1);
        assert_eq!(p.events[0].reason, reason::ERU_CREATED);
        let made = build_eru_for(&d).unwrap();
        let again = plan_annotation(&d, Some(&made));
        assert!(!again.children[0].is_needed() && again.events.is_empty());
    }

    #[test]
    fn a_hand_written_eru_of_that_name_wins() {
        let mine = eru(None);
        let p = plan_annotation(&annotated("true"), Some(&mine));
        assert!(p.children.is_empty() && p.events.is_empty());
        assert_eq!(p.requeue, Requeue::OnChange);
    }

    #[test]
    fn a_leftover_from_an_earlier_deployment_waits_for_garbage_collection() {
        let mut old = build_eru_for(&annotated("true")).unwrap();
        old.metadata.owner_references.as_mut().unwrap()[0].uid = "old-uid".into();
        let p = plan_annotation(&annotated("true"), Some(&old));
        assert!(p.children.is_empty());
        assert_eq!(p.requeue, Requeue::After(LEFTOVER_RETRY));
    }

    #[test]
    fn removing_the_annotation_drops_opkits_eru_from_the_plan() {
        let made = build_eru_for(&annotated("true")).unwrap();
        let p = plan_annotation(&annotated("false"), Some(&made));
        // Not produced any more: opkit's pruning deletes it.
        assert!(p.children.is_empty());
        assert_eq!(p.events[0].reason, reason::ERU_DELETED);
        let untouched = plan_annotation(&annotated("false"), Some(&eru(None)));
        assert!(untouched.events.is_empty());
    }
}
