//! Standard status conditions (`metav1.Condition`) with Kubernetes' transition semantics.
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

/// The desired state of one condition; `set` turns it into a `metav1.Condition`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Desired<'a> {
    /// The condition type, e.g. `Available`.
    pub type_: &'a str,
    /// `Some(true)` is `True`, `Some(false)` is `False`, `None` is `Unknown`.
    pub status: Option<bool>,
    /// A CamelCase reason a program can match on.
    pub reason: &'a str,
    /// What a person reads in `kubectl describe`.
    pub message: String,
}

impl<'a> Desired<'a> {
    /// A condition that holds (`status: "True"`).
    pub fn yes(type_: &'a str, reason: &'a str, message: impl Into<String>) -> Self {
        Desired {
            type_,
            status: Some(true),
            reason,
            message: message.into(),
        }
    }

    /// A condition that does not hold (`status: "False"`).
    pub fn no(type_: &'a str, reason: &'a str, message: impl Into<String>) -> Self {
        Desired {
            type_,
            status: Some(false),
            reason,
            message: message.into(),
        }
    }

    /// A condition that cannot be decided yet (`status: "Unknown"`), e.g. a result not in.
    pub fn unknown(type_: &'a str, reason: &'a str, message: impl Into<String>) -> Self {
        Desired {
            type_,
            status: None,
            reason,
            message: message.into(),
        }
    }
}

/// Returns `existing` updated with `desired`: `lastTransitionTime` moves only when a condition's
/// status flips (or it is new), `observedGeneration` is set on every condition, and conditions
/// not mentioned are kept as they are.
pub fn merge(
    existing: &[Condition],
    desired: &[Desired<'_>],
    generation: Option<i64>,
    now: &Time,
) -> Vec<Condition> {
    let mut out: Vec<Condition> = existing.to_vec();
    for d in desired {
        let status = status_str(d.status).to_string();
        match out.iter_mut().find(|c| c.type_ == d.type_) {
            Some(c) => {
                if c.status != status {
                    c.last_transition_time = now.clone();
                }
                c.status = status;
                c.reason = d.reason.to_string();
                c.message = d.message.clone();
                c.observed_generation = generation;
            }
            None => out.push(Condition {
                type_: d.type_.to_string(),
                status,
                reason: d.reason.to_string(),
                message: d.message.clone(),
                observed_generation: generation,
                last_transition_time: now.clone(),
            }),
        }
    }
    out
}

/// How a condition's status is written: `True`, `False` or `Unknown`.
pub fn status_str(status: Option<bool>) -> &'static str {
    match status {
        Some(true) => "True",
        Some(false) => "False",
        None => "Unknown",
    }
}

/// Whether the named condition is currently `True`.
pub fn is_true(conditions: &[Condition], type_: &str) -> bool {
    conditions.iter().any(|c| c.type_ == type_ && c.status == "True")
}

/// Finds a condition by type.
pub fn find<'c>(conditions: &'c [Condition], type_: &str) -> Option<&'c Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

/// Condition a failing cleanup shows (`True`, reason [`CLEANUP_FAILED`]) on an object that is
/// being deleted.
pub const DELETING: &str = "Deleting";
/// Reason of the [`DELETING`] condition and of the Warning Event when a cleanup step fails.
pub const CLEANUP_FAILED: &str = "CleanupFailed";

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::Timestamp;

    fn t(s: i64) -> Time {
        Time(Timestamp::from_second(s).unwrap())
    }

    #[test]
    fn transition_time_moves_only_when_status_flips() {
        let c1 = merge(
            &[],
            &[Desired::yes("Available", "Ready", "3/3")],
            Some(1),
            &t(100),
        );
        assert_eq!(c1[0].last_transition_time, t(100));
        let c2 = merge(
            &c1,
            &[Desired::yes("Available", "Ready", "5/5")],
            Some(2),
            &t(200),
        );
        assert_eq!(c2[0].last_transition_time, t(100), "same status keeps the time");
        assert_eq!(c2[0].message, "5/5");
        assert_eq!(c2[0].observed_generation, Some(2));
        let c3 = merge(
            &c2,
            &[Desired::no("Available", "Scaling", "2/5")],
            Some(2),
            &t(300),
        );
        assert_eq!(c3[0].last_transition_time, t(300), "a flip moves the time");
        assert!(!is_true(&c3, "Available"));
    }

    #[test]
    fn unmentioned_conditions_are_kept() {
        let c1 = merge(
            &[],
            &[Desired::yes("A", "R", ""), Desired::no("B", "R", "")],
            None,
            &t(1),
        );
        let c2 = merge(&c1, &[Desired::no("A", "R", "")], None, &t(2));
        assert_eq!(c2.len(), 2);
        assert_eq!(find(&c2, "B").map(|c| c.status.as_str()), Some("False"));
    }
}
