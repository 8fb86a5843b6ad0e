//! At admission: a schedule more than [`AT_HORIZON_YEARS`] years in the past is refused
//! (almost certainly a typo), one merely in the past gets a warning (it runs at once); the spec
//! cannot change once the At has started. CEL in the CRD already checks the schedule's shape.
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::core::admission::Operation;
use opkit::webhook::{FailurePolicy, Review, Rule, Verdict, Webhooks};
use opkit_api::at::{At, Phase};

/// How far in the past an At may be scheduled when created. Generous on purpose: the book's
/// sample is scheduled for 2019 and must keep working.
pub const AT_HORIZON_YEARS: i64 = 10;

/// Checks an At on create (schedule horizon) and update (immutable once started).
pub fn validate_at(review: &Review<At>, now: Timestamp) -> Verdict {
    let Some(at) = &review.object else {
        return Verdict::allow();
    };
    match review.operation {
        Operation::Create => {
            let Ok(when) = super::parse_schedule(&at.spec.schedule) else {
                // The CRD's CEL rule explains a malformed schedule better.
                return Verdict::allow();
            };
            let horizon = SignedDuration::from_hours(24 * 365 * AT_HORIZON_YEARS);
            let ago = now.duration_since(when);
            if ago > horizon {
                return Verdict::invalid(
                    "spec.schedule",
                    format!(
                        "{} is more than {AT_HORIZON_YEARS} years in the past; check the year",
                        at.spec.schedule
                    ),
                );
            }
            if ago > SignedDuration::ZERO {
                return Verdict::allow().warn(format!(
                    "spec.schedule {} is in the past: the command runs at once",
                    at.spec.schedule
                ));
            }
            Verdict::allow()
        }
        Operation::Update => {
            let Some(old) = &review.old_object else {
                return Verdict::allow();
            };
            let phase = old.status.as_ref().and_then(|s| s.phase).unwrap_or_default();
            if phase != Phase::Pending && old.spec != at.spec {
                let phase = serde_json::to_value(phase).unwrap_or_default();
                return Verdict::deny(format!(
                    "spec is immutable once the At has started (phase {}); create a new At to run another command",
                    phase.as_str().unwrap_or("?")
                ));
            }
            Verdict::allow()
        }
        _ => Verdict::allow(),
    }
}

/// Adds the At webhooks.
pub fn webhooks(w: Webhooks) -> Webhooks {
    let rule = Rule::validating::<At>()
        // Fail: what this refuses cannot be put right afterwards. An At scheduled years in the
        // past (a mistyped year) runs its command at once, and a spec changed after the run no
        // longer says what ran. No At runs while the operator is down anyway, so refusing
        // meanwhile costs a retry; deletes are not sent here.
        .failure_policy(FailurePolicy::Fail);
    w.validating::<At, _, _>(
        rule,
        |r: Review<At>| async move { validate_at(&r, Timestamp::now()) },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use opkit_api::at::{AtSpec, AtStatus};

    fn at(schedule: &str, phase: Option<Phase>) -> At {
        let mut a = At::new(
            "a",
            AtSpec {
                schedule: schedule.into(),
                command: "echo YAY".into(),
                image: None,
                active_deadline_seconds: None,
                ttl_seconds_after_finished: None,
            },
        );
        a.status = phase.map(|p| AtStatus {
            phase: Some(p),
            ..Default::default()
        });
        a
    }

    fn review(op: Operation, new: At, old: Option<At>) -> Review<At> {
        Review::new(op, Some(new), old, Some("ns"))
    }

    #[test]
    fn at_schedules_far_in_the_past_are_refused_and_recent_ones_warned() {
        let now: Timestamp = "2026-11-22T00:00:00Z".parse().unwrap();
        let v = validate_at(
            &review(Operation::Create, at("2015-01-01T00:00:00Z", None), None),
            now,
        );
        assert!(v.denied.unwrap().contains("more than 10 years"));
        assert_eq!(v.invalid[0].0, "spec.schedule", "a 422 naming the field");
        let v = validate_at(
            &review(Operation::Create, at("2019-04-12T10:12:00Z", None), None),
            now,
        );
        assert!(v.denied.is_none());
        assert!(v.warnings[0].contains("runs at once"));
        let v = validate_at(
            &review(Operation::Create, at("2027-01-01T00:00:00Z", None), None),
            now,
        );
        assert_eq!(v, Verdict::allow());
    }

    #[test]
    fn an_at_that_has_started_cannot_change() {
        let now = Timestamp::now();
        let old = at("2019-04-12T10:12:00Z", Some(Phase::Done));
        let mut new = old.clone();
        new.spec.command = "echo NAY".into();
        let v = validate_at(&review(Operation::Update, new, Some(old.clone())), now);
        assert!(v.denied.unwrap().contains("phase DONE"));
        let mut pending = old.clone();
        pending.status = None;
        let mut new = pending.clone();
        new.spec.command = "echo NAY".into();
        assert!(
            validate_at(&review(Operation::Update, new, Some(pending)), now)
                .denied
                .is_none()
        );
        // A label change on a DONE At is fine.
        let mut labelled = old.clone();
        labelled.metadata.labels = Some([("a".to_string(), "b".to_string())].into());
        assert!(
            validate_at(&review(Operation::Update, labelled, Some(old)), now)
                .denied
                .is_none()
        );
    }
}
