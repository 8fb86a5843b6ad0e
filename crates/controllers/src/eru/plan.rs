//! Pure decisions for `Eru`: which slot is due, whether the Deployment may be restarted now,
//! and the objects opkit builds (the restart patch, the `Eru` for an annotated Deployment).
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::jiff::tz::TimeZone;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::{Resource, ResourceExt};
use opkit_api::MANAGED_BY;
use opkit_api::eru::{
    ANNOTATION, DEFAULT_SCHEDULE, Eru, EruSpec, FROM_ANNOTATION_LABEL, SCHEDULE_ANNOTATION,
    TIME_ZONE_ANNOTATION,
};
use serde_json::json;

use opkit::schedule::{Schedule, time_zone};

/// The pod-template annotation `kubectl rollout restart` sets; changing it rolls the Pods.
pub const RESTARTED_AT: &str = "kubectl.kubernetes.io/restartedAt";
/// The Deployment's count of the restarts its `Eru` made, written by the restart patch itself:
/// a restart whose status write was lost (say with the Lease) is still counted, however many
/// were lost in a row.
pub const RESTART_COUNT: &str = "mtsre.meitu.com/restart-count";
/// The UID of the `Eru` that [`RESTART_COUNT`] counts for: a new `Eru` of the same name
/// starts from its own count.
pub const RESTARTED_BY: &str = "mtsre.meitu.com/restarted-by";
/// Longest wait before the schedule is looked at again; bounds timers and absorbs clock jumps.
pub const MAX_WAIT: Duration = Duration::from_secs(3600);

/// What to do for one `Eru` now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// The spec cannot be acted on (reason, message); nothing happens until it changes.
    Invalid(&'static str, String),
    /// Suspended; `slot` (if any) is consumed so it is not made up on resume.
    Suspended { slot: Option<Timestamp> },
    /// Nothing due.
    Wait,
    /// Just resumed from suspension: slots that passed while suspended are consumed, not made up.
    Resumed { slot: Option<Timestamp> },
    /// The spec changed since the last reconcile: slots before the change (of the new schedule
    /// too) are consumed, so an edit never restarts at once; counting starts from the edit.
    Edited { slot: Option<Timestamp> },
    /// The Deployment does not exist: nothing is scheduled (and nothing written) until it does.
    TargetMissing,
    /// The slot is older than the Deployment (it did not exist then): consumed, no restart.
    Predates { slot: Timestamp },
    /// A slot is due but the previous rollout is still running; try again when it ends.
    Postpone { slot: Timestamp, why: String },
    /// The slot is more than `startingDeadlineSeconds` late; it is consumed without a restart.
    TooLate { slot: Timestamp, late: SignedDuration },
    /// Restart the Deployment for `slot`.
    Restart { slot: Timestamp },
    /// The Deployment already carries this slot's restart (made just before an operator
    /// restart); only the status is missing.
    AlreadyRestarted { slot: Timestamp },
}

/// The decision, with the next slot after now (none when suspended or invalid).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    pub step: Step,
    pub next: Option<Timestamp>,
    pub target_found: bool,
    /// A restart opkit made for this earlier slot but never recorded (its status write was
    /// lost, say with the Lease): still to be counted, so `restartCount` matches the rollouts.
    pub uncounted: Option<Timestamp>,
}

/// The `restartedAt` value written for a slot: the slot itself, so that writing it twice for
/// one slot is a no-op rather than a second rollout.
pub fn restart_stamp(slot: Timestamp) -> String {
    slot.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// The Deployment's current `restartedAt`.
pub fn restarted_at(d: &Deployment) -> Option<&str> {
    d.spec
        .as_ref()?
        .template
        .metadata
        .as_ref()?
        .annotations
        .as_ref()?
        .get(RESTARTED_AT)
        .map(String::as_str)
}

/// Why a rollout of `d` is still in progress (as `kubectl rollout status` sees it), or `None`.
pub fn rollout_in_progress(d: &Deployment) -> Option<String> {
    let status = d.status.clone().unwrap_or_default();
    let generation = d.metadata.generation.unwrap_or(0);
    if status.observed_generation.unwrap_or(0) < generation {
        return Some("the Deployment controller has not seen the latest change yet".into());
    }
    let want = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
    let updated = status.updated_replicas.unwrap_or(0);
    let total = status.replicas.unwrap_or(0);
    let available = status.available_replicas.unwrap_or(0);
    if updated < want {
        return Some(format!("{updated} of {want} replicas updated"));
    }
    if total > updated {
        return Some(format!(
            "{} old replicas are pending termination",
            total - updated
        ));
    }
    if available < updated {
        return Some(format!("{available} of {updated} updated replicas available"));
    }
    None
}

/// Parses the schedule and time zone and finds the next slot after `now`; on failure, the
/// condition reason and a message naming the field. Shared by the controller and the webhook.
pub fn check_spec(
    spec: &EruSpec,
    now: Timestamp,
) -> Result<(Schedule, TimeZone, Timestamp), (&'static str, String)> {
    if let Some(d) = spec.starting_deadline_seconds.filter(|d| *d < 1) {
        // Stored before the schema asked for at least 1.
        return Err((
            super::reason::INVALID_SCHEDULE,
            format!("spec.startingDeadlineSeconds must be at least 1, got {d}: every slot would be too late"),
        ));
    }
    let schedule: Schedule = spec
        .schedule
        .parse()
        .map_err(|e| (super::reason::INVALID_SCHEDULE, format!("spec.schedule: {e}")))?;
    let tz = time_zone(spec.time_zone.as_deref())
        .map_err(|e| (super::reason::INVALID_TIME_ZONE, format!("spec.timeZone: {e}")))?;
    let next = schedule.next_after(now, &tz).ok_or_else(|| {
        (
            super::reason::INVALID_SCHEDULE,
            format!("spec.schedule: {:?} never fires", spec.schedule),
        )
    })?;
    Ok((schedule, tz, next))
}

/// Decides what to do for `eru` at `now`, given its Deployment as last seen.
pub fn decide(eru: &Eru, deployment: Option<&Deployment>, now: Timestamp) -> Decision {
    let spec = &eru.spec;
    let (schedule, tz, next) = match check_spec(spec, now) {
        Ok(v) => v,
        Err((reason, msg)) => {
            return Decision {
                step: Step::Invalid(reason, msg),
                next: None,
                target_found: deployment.is_some(),
                uncounted: None,
            };
        }
    };
    let status = eru.status.clone().unwrap_or_default();
    let earliest = status
        .last_schedule_time
        .map(|t| t.0)
        .or_else(|| eru.metadata.creation_timestamp.as_ref().map(|t| t.0))
        .unwrap_or(now);
    let slot = schedule.latest_in(earliest, now, &tz);
    // The Deployment carries the stamp of a slot after the last one recorded and before the
    // one due now: a restart of ours whose record was lost.
    let uncounted = deployment
        .and_then(restarted_at)
        .and_then(|stamp| {
            stamp
                .parse::<Timestamp>()
                .ok()
                .filter(|t| restart_stamp(*t) == stamp)
        })
        .filter(|s| *s > earliest && slot.is_some_and(|due| *s < due))
        .filter(|s| {
            let before = s.checked_sub(SignedDuration::from_secs(1)).unwrap_or(*s);
            schedule.latest_in(before, *s, &tz) == Some(*s)
        });
    let done = |step| Decision {
        step,
        next: Some(next),
        target_found: deployment.is_some(),
        uncounted,
    };
    if spec.suspend == Some(true) {
        return Decision {
            step: Step::Suspended { slot },
            next: None,
            target_found: deployment.is_some(),
            uncounted,
        };
    }
    if status.suspended {
        return done(Step::Resumed { slot });
    }
    if status.observed_generation.is_some() && status.observed_generation != eru.metadata.generation {
        return done(Step::Edited { slot });
    }
    let Some(d) = deployment else {
        // The Deployment's watch brings it back when it appears.
        return Decision {
            step: Step::TargetMissing,
            next: None,
            target_found: false,
            uncounted: None,
        };
    };
    let Some(slot) = slot else {
        return done(Step::Wait);
    };
    if d.metadata.creation_timestamp.as_ref().is_some_and(|c| c.0 > slot) {
        return done(Step::Predates { slot });
    }
    let late = now.duration_since(slot);
    if let Some(limit) = spec.starting_deadline_seconds
        && late > SignedDuration::from_secs(limit)
    {
        return done(Step::TooLate { slot, late });
    }
    if restarted_at(d) == Some(restart_stamp(slot).as_str()) {
        return done(Step::AlreadyRestarted { slot });
    }
    if let Some(why) = rollout_in_progress(d) {
        return done(Step::Postpone { slot, why });
    }
    done(Step::Restart { slot })
}

/// How long to wait for `next`, rounded up to the millisecond and capped at `MAX_WAIT`.
pub fn wait_for(next: Timestamp, now: Timestamp) -> Duration {
    let nanos = u64::try_from(now.duration_until(next).as_nanos()).unwrap_or(0);
    Duration::from_millis(nanos.div_ceil(1_000_000).max(1)).min(MAX_WAIT)
}

/// The server-side-apply body that restarts `deployment` as restart number `count` of `eru`:
/// the pod-template annotation and the count, so opkit owns those fields and nothing else of
/// the Deployment.
pub fn restart_patch(deployment: &str, slot: Timestamp, count: i64, eru: &Eru) -> serde_json::Value {
    let mut annotations = json!({RESTART_COUNT: count.to_string()});
    if let Some(uid) = &eru.metadata.uid {
        annotations[RESTARTED_BY] = json!(uid);
    }
    json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": deployment, "annotations": annotations},
        "spec": {"template": {"metadata": {"annotations": {RESTARTED_AT: restart_stamp(slot)}}}},
    })
}

/// How many restarts of `d` `eru` made, as the Deployment counts them (none: not counted there,
/// or counted for another `Eru`).
pub fn restarts_made(d: &Deployment, eru: &Eru) -> Option<i64> {
    let a = d.metadata.annotations.as_ref()?;
    if a.get(RESTARTED_BY) != eru.metadata.uid.as_ref() {
        return None;
    }
    a.get(RESTART_COUNT)?.parse().ok()
}

/// Whether the Deployment asks for an `Eru` (`mtsre.meitu.com/eru: "true"`).
pub fn wants_eru(d: &Deployment) -> bool {
    d.annotations().get(ANNOTATION).map(|v| v.trim()) == Some("true")
}

/// Whether `eru` was created by opkit from `d`'s annotation (so opkit may change or delete it).
pub fn created_from(eru: &Eru, d: &Deployment) -> bool {
    eru.labels().get(FROM_ANNOTATION_LABEL).map(String::as_str) == Some("true")
        && eru
            .owner_references()
            .iter()
            .any(|o| Some(&o.uid) == d.metadata.uid.as_ref())
}

/// The `Eru` an annotated Deployment gets: same name, schedule and time zone from the
/// companion annotations, owned by the Deployment so it goes away with it.
pub fn build_eru_for(d: &Deployment) -> Result<Eru, String> {
    let name = d.name_any();
    let owner = d
        .controller_owner_ref(&())
        .ok_or_else(|| format!("Deployment {name} has no uid yet"))?;
    let a = d.annotations();
    let mut eru = Eru::new(
        &name,
        EruSpec {
            deployment_name: name.clone(),
            schedule: a
                .get(SCHEDULE_ANNOTATION)
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| DEFAULT_SCHEDULE.into()),
            time_zone: a
                .get(TIME_ZONE_ANNOTATION)
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty()),
            suspend: None,
            starting_deadline_seconds: None,
        },
    );
    eru.metadata.namespace = d.namespace();
    eru.metadata.labels = Some(
        [
            (FROM_ANNOTATION_LABEL.to_string(), "true".to_string()),
            ("app.kubernetes.io/managed-by".to_string(), MANAGED_BY.to_string()),
        ]
        .into(),
    );
    eru.metadata.owner_references = Some(vec![owner]);
    Ok(eru)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::apps::v1::{DeploymentSpec, DeploymentStatus};
    use k8s_openapi::api::core::v1::PodTemplateSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
    use opkit_api::eru::EruStatus;

    fn ts(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    /// An Eru created at 10:00:00 restarting `web` every 20 s.
    fn eru(last: Option<&str>) -> Eru {
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
        e.metadata.creation_timestamp = Some(Time(ts("2026-01-01T10:00:00Z")));
        e.status = last.map(|l| EruStatus {
            last_schedule_time: Some(Time(ts(l))),
            ..Default::default()
        });
        e
    }

    fn deployment(replicas: i32, updated: i32, total: i32, available: i32) -> Deployment {
        Deployment {
            metadata: ObjectMeta {
                name: Some("web".into()),
                namespace: Some("ns".into()),
                uid: Some("d-uid".into()),
                generation: Some(2),
                ..Default::default()
            },
            spec: Some(DeploymentSpec {
                replicas: Some(replicas),
                template: PodTemplateSpec::default(),
                ..Default::default()
            }),
            status: Some(DeploymentStatus {
                observed_generation: Some(2),
                replicas: Some(total),
                updated_replicas: Some(updated),
                available_replicas: Some(available),
                ..Default::default()
            }),
        }
    }

    fn settled() -> Deployment {
        deployment(3, 3, 3, 3)
    }

    #[test]
    fn nothing_is_due_right_after_creation() {
        let p = decide(&eru(None), Some(&settled()), ts("2026-01-01T10:00:05Z"));
        assert_eq!(p.step, Step::Wait);
        assert_eq!(p.next, Some(ts("2026-01-01T10:00:20Z")));
    }

    #[test]
    fn a_due_slot_restarts_a_settled_deployment() {
        let p = decide(&eru(None), Some(&settled()), ts("2026-01-01T10:00:20.300Z"));
        assert_eq!(
            p.step,
            Step::Restart {
                slot: ts("2026-01-01T10:00:20Z")
            }
        );
        assert_eq!(p.next, Some(ts("2026-01-01T10:00:40Z")));
    }

    #[test]
    fn a_slot_is_acted_on_once() {
        let p = decide(
            &eru(Some("2026-01-01T10:00:20Z")),
            Some(&settled()),
            ts("2026-01-01T10:00:25Z"),
        );
        assert_eq!(p.step, Step::Wait);
    }

    #[test]
    fn many_missed_slots_give_one_catch_up_restart_for_the_latest() {
        let p = decide(
            &eru(Some("2026-01-01T10:00:20Z")),
            Some(&settled()),
            ts("2026-01-01T13:07:05Z"),
        );
        assert_eq!(
            p.step,
            Step::Restart {
                slot: ts("2026-01-01T13:07:00Z")
            }
        );
    }

    #[test]
    fn a_slot_later_than_the_starting_deadline_is_skipped() {
        let mut e = eru(Some("2026-01-01T10:00:20Z"));
        e.spec.starting_deadline_seconds = Some(5);
        let p = decide(&e, Some(&settled()), ts("2026-01-01T10:00:47Z"));
        assert!(matches!(p.step, Step::TooLate { slot, .. } if slot == ts("2026-01-01T10:00:40Z")));
        let p = decide(&e, Some(&settled()), ts("2026-01-01T10:00:44Z"));
        assert_eq!(
            p.step,
            Step::Restart {
                slot: ts("2026-01-01T10:00:40Z")
            }
        );
    }

    #[test]
    fn a_rollout_in_progress_postpones_the_restart() {
        let now = ts("2026-01-01T10:00:21Z");
        for d in [
            deployment(3, 2, 3, 3),
            deployment(3, 3, 4, 3),
            deployment(3, 3, 3, 2),
        ] {
            match decide(&eru(None), Some(&d), now).step {
                Step::Postpone { slot, why } => {
                    assert_eq!(slot, ts("2026-01-01T10:00:20Z"));
                    assert!(!why.is_empty());
                }
                other => panic!("{other:?}"),
            }
        }
        let mut unobserved = settled();
        unobserved.metadata.generation = Some(3);
        assert!(matches!(
            decide(&eru(None), Some(&unobserved), now).step,
            Step::Postpone { .. }
        ));
    }

    #[test]
    fn a_restart_already_on_the_deployment_is_not_made_again() {
        let mut d = settled();
        d.spec.as_mut().unwrap().template.metadata = Some(ObjectMeta {
            annotations: Some([(RESTARTED_AT.to_string(), "2026-01-01T10:00:20Z".to_string())].into()),
            ..Default::default()
        });
        // Even though that restart's rollout is still running.
        d.status.as_mut().unwrap().updated_replicas = Some(1);
        let p = decide(&eru(None), Some(&d), ts("2026-01-01T10:00:21Z"));
        assert_eq!(
            p.step,
            Step::AlreadyRestarted {
                slot: ts("2026-01-01T10:00:20Z")
            }
        );
    }

    fn stamped(stamp: &str) -> Deployment {
        let mut d = settled();
        d.spec.as_mut().unwrap().template.metadata = Some(ObjectMeta {
            annotations: Some([(RESTARTED_AT.to_string(), stamp.to_string())].into()),
            ..Default::default()
        });
        d
    }

    #[test]
    fn a_restart_made_but_not_recorded_is_counted_with_the_next() {
        // Slot 10:00:20 was restarted, its status write lost; 10:00:40 is due now.
        let now = ts("2026-01-01T10:00:41Z");
        let p = decide(&eru(None), Some(&stamped("2026-01-01T10:00:20Z")), now);
        assert_eq!(p.uncounted, Some(ts("2026-01-01T10:00:20Z")));
        assert_eq!(
            p.step,
            Step::Restart {
                slot: ts("2026-01-01T10:00:40Z")
            }
        );
        // Already recorded, not a slot of the schedule (a `kubectl rollout restart`), or the
        // slot due now (counted by `AlreadyRestarted`): nothing more to count.
        for (last, stamp) in [
            (Some("2026-01-01T10:00:20Z"), "2026-01-01T10:00:20Z"),
            (None, "2026-01-01T10:00:33Z"),
            (None, "2026-01-01T10:00:40Z"),
            (None, "2026-01-01T10:00:20.5Z"),
        ] {
            let p = decide(&eru(last), Some(&stamped(stamp)), now);
            assert_eq!(p.uncounted, None, "{last:?} {stamp}");
        }
    }

    #[test]
    fn suspended_consumes_slots_and_has_no_next_restart() {
        let mut e = eru(None);
        e.spec.suspend = Some(true);
        let p = decide(&e, Some(&settled()), ts("2026-01-01T10:00:41Z"));
        assert_eq!(
            p.step,
            Step::Suspended {
                slot: Some(ts("2026-01-01T10:00:40Z"))
            }
        );
        assert_eq!(p.next, None);
    }

    #[test]
    fn slots_missed_while_suspended_are_not_made_up() {
        let mut e = eru(Some("2026-01-01T10:00:20Z"));
        e.status.as_mut().unwrap().suspended = true;
        let p = decide(&e, Some(&settled()), ts("2026-01-01T10:01:05Z"));
        assert_eq!(
            p.step,
            Step::Resumed {
                slot: Some(ts("2026-01-01T10:01:00Z"))
            }
        );
        assert_eq!(p.next, Some(ts("2026-01-01T10:01:20Z")));
    }

    #[test]
    fn a_missing_deployment_schedules_nothing() {
        let p = decide(&eru(None), None, ts("2026-01-01T10:00:21Z"));
        assert_eq!(p.step, Step::TargetMissing);
        assert_eq!(p.next, None);
        assert!(!p.target_found);
    }

    #[test]
    fn a_deployment_created_after_a_slot_is_not_restarted_for_it() {
        let mut d = settled();
        d.metadata.creation_timestamp = Some(Time(ts("2026-01-01T10:00:30Z")));
        // Missing since 10:00:00; it appears at 10:00:30, the operator looks at 10:00:35.
        let p = decide(&eru(None), Some(&d), ts("2026-01-01T10:00:35Z"));
        assert_eq!(
            p.step,
            Step::Predates {
                slot: ts("2026-01-01T10:00:20Z")
            }
        );
        // The next slot after its creation is restarted as usual.
        let p = decide(
            &eru(Some("2026-01-01T10:00:20Z")),
            Some(&d),
            ts("2026-01-01T10:00:41Z"),
        );
        assert_eq!(
            p.step,
            Step::Restart {
                slot: ts("2026-01-01T10:00:40Z")
            }
        );
    }

    #[test]
    fn an_edit_counts_slots_from_the_edit() {
        let mut e = eru(Some("2026-01-01T10:00:00Z"));
        e.metadata.generation = Some(2);
        e.status.as_mut().unwrap().observed_generation = Some(1);
        // The new schedule's slot at 10:00:20 lies before the edit seen at 10:00:25.
        let p = decide(&e, Some(&settled()), ts("2026-01-01T10:00:25Z"));
        assert_eq!(
            p.step,
            Step::Edited {
                slot: Some(ts("2026-01-01T10:00:20Z"))
            }
        );
        assert_eq!(p.next, Some(ts("2026-01-01T10:00:40Z")));
        // Once seen, the next slot restarts.
        e.status.as_mut().unwrap().observed_generation = Some(2);
        e.status.as_mut().unwrap().last_schedule_time = Some(Time(ts("2026-01-01T10:00:20Z")));
        let p = decide(&e, Some(&settled()), ts("2026-01-01T10:00:41Z"));
        assert_eq!(
            p.step,
            Step::Restart {
                slot: ts("2026-01-01T10:00:40Z")
            }
        );
    }

    #[test]
    fn bad_schedules_and_time_zones_are_invalid_with_the_field_named() {
        let mut e = eru(None);
        e.spec.schedule = "61 * * * *".into();
        assert!(matches!(decide(&e, None, ts("2026-01-01T10:00:21Z")).step,
            Step::Invalid(r, m) if r == "InvalidSchedule" && m.contains("minute: 61")));
        e.spec.schedule = "0 0 30 2 *".into();
        assert!(matches!(decide(&e, None, ts("2026-01-01T10:00:21Z")).step,
            Step::Invalid(_, m) if m.contains("never fires")));
        let mut e = eru(None);
        e.spec.time_zone = Some("Mars/Olympus".into());
        assert!(matches!(decide(&e, None, ts("2026-01-01T10:00:21Z")).step,
            Step::Invalid(r, m) if r == "InvalidTimeZone" && m.contains("spec.timeZone")));
    }

    #[test]
    fn the_restart_patch_touches_only_the_annotation_and_the_count() {
        let mut e = eru(None);
        e.metadata.uid = Some("eru-uid".into());
        let p = restart_patch("web", ts("2026-01-01T10:00:20Z"), 7, &e);
        assert_eq!(
            p["spec"],
            json!({"template": {"metadata": {"annotations": {RESTARTED_AT: "2026-01-01T10:00:20Z"}}}})
        );
        assert_eq!(
            p["metadata"],
            json!({"name": "web", "annotations": {RESTART_COUNT: "7", RESTARTED_BY: "eru-uid"}})
        );
        let mut d = settled();
        d.metadata.annotations = serde_json::from_value(p["metadata"]["annotations"].clone()).unwrap();
        assert_eq!(restarts_made(&d, &e), Some(7));
        e.metadata.uid = Some("another".into());
        assert_eq!(restarts_made(&d, &e), None);
    }

    #[test]
    fn an_annotated_deployment_gets_an_owned_eru_with_its_schedule() {
        let mut d = settled();
        d.metadata.annotations = Some(
            [
                (ANNOTATION.to_string(), "true".to_string()),
                (TIME_ZONE_ANNOTATION.to_string(), "Asia/Shanghai".to_string()),
            ]
            .into(),
        );
        assert!(wants_eru(&d));
        let e = build_eru_for(&d).unwrap();
        assert_eq!(e.spec.schedule, DEFAULT_SCHEDULE);
        assert_eq!(e.spec.time_zone.as_deref(), Some("Asia/Shanghai"));
        assert_eq!(
            (e.name_any(), e.spec.deployment_name.as_str()),
            ("web".into(), "web")
        );
        assert!(created_from(&e, &d));
        d.metadata.annotations = Some([(ANNOTATION.to_string(), "false".to_string())].into());
        assert!(!wants_eru(&d));
    }

    #[test]
    fn waits_round_up_and_are_capped() {
        let now = ts("2026-01-01T10:00:00Z");
        assert_eq!(
            wait_for(ts("2026-01-01T10:00:00.0000001Z"), now),
            Duration::from_millis(1)
        );
        assert_eq!(wait_for(ts("2026-01-01T10:00:20Z"), now), Duration::from_secs(20));
        assert_eq!(wait_for(ts("2027-01-01T10:00:20Z"), now), MAX_WAIT);
    }

    #[test]
    fn a_zero_starting_deadline_is_invalid_not_a_skip_every_slot() {
        let mut e = eru(None);
        e.spec.starting_deadline_seconds = Some(0);
        let err = check_spec(&e.spec, ts("2026-01-01T10:00:05Z")).unwrap_err();
        assert!(
            err.1.contains("spec.startingDeadlineSeconds must be at least 1"),
            "{}",
            err.1
        );
        e.spec.starting_deadline_seconds = Some(1);
        assert!(check_spec(&e.spec, ts("2026-01-01T10:00:05Z")).is_ok());
    }
}
