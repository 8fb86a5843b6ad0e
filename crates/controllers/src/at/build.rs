//! Pure functions for `At`: when it is due, what its Pod looks like, and how a Pod ended.
use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, Pod, PodSecurityContext, PodSpec, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::Timestamp;
use kube::{Resource, ResourceExt};
use opkit_api::MANAGED_BY;

use opkit::security::{restricted_container, restricted_pod};
use opkit_api::at::{At, DEFAULT_IMAGE, Outcome, Phase};

/// The `app.kubernetes.io/name` of every Pod this controller starts.
pub const APP: &str = "at";
/// Name of the container that runs the command.
pub const CONTAINER: &str = "command";
/// Longest wait before the schedule is looked at again; bounds timer size and absorbs clock
/// jumps.
pub const MAX_WAIT: Duration = Duration::from_secs(3600);

/// Label selector for the Pods this controller starts.
pub fn selector() -> String {
    format!("app.kubernetes.io/name={APP},app.kubernetes.io/managed-by={MANAGED_BY}")
}

/// The one Pod an `At` may have. Deterministic, so a retry or an operator restart finds the Pod
/// it already started instead of starting a second one.
pub fn pod_name(at: &At) -> String {
    format!("{}-pod", at.name_any())
}

/// Parses `spec.schedule` (RFC 3339 with a zone).
pub fn parse_schedule(s: &str) -> Result<Timestamp, String> {
    s.trim().parse::<Timestamp>().map_err(|e| {
        format!("spec.schedule {s:?} is not an RFC 3339 time with a zone (such as 2019-04-12T10:12:00Z): {e}")
    })
}

/// How a Pod ended, as the `At` status records it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finished {
    pub outcome: Outcome,
    pub exit_code: Option<i32>,
    pub reason: String,
    pub message: Option<String>,
    pub at: Timestamp,
}

/// The next step for an `At`, decided from its phase, its Pod and the time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Next {
    /// The schedule cannot be parsed: nothing can happen until the spec changes.
    Invalid(String),
    /// Not due yet; look again after `after` (at most `MAX_WAIT`).
    Wait { due: Timestamp, after: Duration },
    /// Due or overdue: record the intent to run (phase RUNNING, reason `Starting`) before
    /// any Pod exists, so that whatever fails afterwards the command is started at most once.
    Start { due: Timestamp },
    /// The intent is recorded and no Pod exists: create it, once.
    Create { due: Timestamp },
    /// The Pod exists but its start is not recorded yet: record it.
    Started { due: Timestamp },
    /// The Pod runs; its watch brings the next change.
    Running,
    /// The Pod ended, or vanished while running.
    Finish(Finished),
    /// DONE is final.
    Done,
}

/// Decides the next step. `pod` is the `At`'s Pod as last seen (`None`: it does not exist).
pub fn next(at: &At, pod: Option<&Pod>, now: Timestamp) -> Next {
    let phase = at.status.as_ref().and_then(|s| s.phase).unwrap_or_default();
    let due = || parse_schedule(&at.spec.schedule).unwrap_or(now);
    match phase {
        Phase::Done => Next::Done,
        Phase::Running if starting(at) => match pod {
            None => Next::Create { due: due() },
            Some(p) => finished(p, now).map_or_else(|| Next::Started { due: due() }, Next::Finish),
        },
        Phase::Running => match pod {
            None => Next::Finish(Finished {
                outcome: Outcome::Failed,
                exit_code: None,
                reason: super::reason::POD_DELETED.into(),
                message: Some(format!(
                    "Pod {} was deleted before the command finished; it is not started again",
                    pod_name(at)
                )),
                at: now,
            }),
            Some(p) => finished(p, now).map_or(Next::Running, Next::Finish),
        },
        Phase::Pending => match parse_schedule(&at.spec.schedule) {
            Err(msg) => Next::Invalid(msg),
            Ok(due) if due <= now => match pod {
                // Started before its start was recorded (by an older opkit): record it.
                Some(_) => Next::Started { due },
                None => Next::Start { due },
            },
            Ok(due) => {
                let wait = now.duration_until(due);
                // Round up to the millisecond so a timer never fires just before the schedule.
                let nanos = u64::try_from(wait.as_nanos()).unwrap_or(u64::MAX);
                let millis = nanos.div_ceil(1_000_000).max(1);
                Next::Wait {
                    due,
                    after: Duration::from_millis(millis).min(MAX_WAIT),
                }
            }
        },
    }
}

/// Whether the At recorded the intent to start its Pod but not yet that the Pod exists.
pub fn starting(at: &At) -> bool {
    at.status.as_ref().is_some_and(|s| {
        opkit::conditions::find(&s.conditions, super::condition::SUCCEEDED)
            .is_some_and(|c| c.reason == super::reason::STARTING)
    })
}

/// The Pod status reason the kubelet sets when `activeDeadlineSeconds` ran out.
pub const DEADLINE_EXCEEDED: &str = "DeadlineExceeded";

/// How `pod` ended, or `None` while it has not.
pub fn finished(pod: &Pod, now: Timestamp) -> Option<Finished> {
    let status = pod.status.as_ref()?;
    let outcome = match status.phase.as_deref() {
        Some("Succeeded") => Outcome::Succeeded,
        Some("Failed") => Outcome::Failed,
        _ => return None,
    };
    let term = status
        .container_statuses
        .iter()
        .flatten()
        .find(|c| c.name == CONTAINER)
        .and_then(|c| c.state.as_ref()?.terminated.as_ref());
    let default_reason = match outcome {
        Outcome::Succeeded => "Completed",
        Outcome::Failed => "Failed",
    };
    // The kubelet stopped it at `activeDeadlineSeconds`: that, not the killed container's
    // exit, is why it ended.
    if status.reason.as_deref() == Some(DEADLINE_EXCEEDED) {
        return Some(Finished {
            outcome: Outcome::Failed,
            exit_code: term.map(|t| t.exit_code),
            reason: DEADLINE_EXCEEDED.into(),
            message: status.message.clone().filter(|m| !m.is_empty()),
            at: term.and_then(|t| t.finished_at.as_ref()).map_or(now, |t| t.0),
        });
    }
    Some(Finished {
        outcome,
        exit_code: term.map(|t| t.exit_code),
        reason: term
            .and_then(|t| t.reason.clone())
            .or_else(|| status.reason.clone())
            .unwrap_or_else(|| default_reason.into()),
        message: term
            .and_then(|t| t.message.clone())
            .or_else(|| status.message.clone())
            .filter(|m| !m.is_empty()),
        at: term.and_then(|t| t.finished_at.as_ref()).map_or(now, |t| t.0),
    })
}

/// Standard labels of an `At`'s Pod; `instance` only when the name fits in a label value.
pub fn labels(at: &At) -> BTreeMap<String, String> {
    let mut l = BTreeMap::from([
        ("app.kubernetes.io/name".to_string(), APP.to_string()),
        ("app.kubernetes.io/managed-by".to_string(), MANAGED_BY.to_string()),
    ]);
    let name = at.name_any();
    if name.len() <= 63 {
        l.insert("app.kubernetes.io/instance".into(), name);
    }
    l
}

/// The one-shot Pod that runs `spec.command` with `sh -c`, owned by the `At`, with the
/// restricted Pod Security profile and no API credentials (the command does not need them).
pub fn build_pod(at: &At) -> Result<Pod, String> {
    let name = pod_name(at);
    if name.len() > 253 {
        return Err(format!(
            "the Pod name {name:?} would be longer than 253 characters"
        ));
    }
    let owner = at
        .controller_owner_ref(&())
        .ok_or_else(|| format!("At {} has no uid yet", at.name_any()))?;
    let image = at.spec.image.clone().unwrap_or_else(|| DEFAULT_IMAGE.into());
    let q = |s: &str| Quantity(s.to_string());
    Ok(Pod {
        metadata: ObjectMeta {
            name: Some(name),
            namespace: at.namespace(),
            labels: Some(labels(at)),
            owner_references: Some(vec![owner]),
            ..Default::default()
        },
        spec: Some(PodSpec {
            restart_policy: Some("Never".into()),
            active_deadline_seconds: Some(
                at.spec
                    .active_deadline_seconds
                    .unwrap_or(opkit_api::at::DEFAULT_ACTIVE_DEADLINE_SECONDS),
            ),
            automount_service_account_token: Some(false),
            enable_service_links: Some(false),
            containers: vec![Container {
                name: CONTAINER.into(),
                image: Some(image),
                command: Some(vec!["sh".into(), "-c".into(), at.spec.command.clone()]),
                resources: Some(ResourceRequirements {
                    requests: Some(BTreeMap::from([
                        ("cpu".into(), q("10m")),
                        ("memory".into(), q("16Mi")),
                        ("ephemeral-storage".into(), q("16Mi")),
                    ])),
                    // A one-shot command gets a bounded share of its node.
                    limits: Some(BTreeMap::from([
                        ("cpu".into(), q("1")),
                        ("memory".into(), q("128Mi")),
                        ("ephemeral-storage".into(), q("1Gi")),
                    ])),
                    ..Default::default()
                }),
                security_context: Some(restricted_container()),
                ..Default::default()
            }],
            security_context: Some(PodSecurityContext {
                run_as_user: Some(65534),
                run_as_group: Some(65534),
                ..restricted_pod()
            }),
            ..Default::default()
        }),
        ..Default::default()
    })
}

/// Whether `pod` is controlled by `at` (same uid), so it is safe to treat as its Pod.
pub fn controlled_by(pod: &Pod, at: &At) -> bool {
    let uid = at.uid();
    pod.owner_references()
        .iter()
        .any(|o| o.controller == Some(true) && Some(&o.uid) == uid.as_ref())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{ContainerState, ContainerStateTerminated, ContainerStatus, PodStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use opkit_api::at::{AtSpec, AtStatus};

    fn ts(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    fn at(schedule: &str, phase: Option<Phase>) -> At {
        let mut a = At::new(
            "example-at",
            AtSpec {
                schedule: schedule.into(),
                command: "echo YAY".into(),
                image: None,
                active_deadline_seconds: None,
                ttl_seconds_after_finished: None,
            },
        );
        a.metadata.namespace = Some("cnat".into());
        a.metadata.uid = Some("uid-1".into());
        a.status = phase.map(|p| AtStatus {
            phase: Some(p),
            ..Default::default()
        });
        a
    }

    fn ended(phase: &str, code: Option<i32>) -> Pod {
        Pod {
            status: Some(PodStatus {
                phase: Some(phase.into()),
                container_statuses: code.map(|c| {
                    vec![ContainerStatus {
                        name: CONTAINER.into(),
                        state: Some(ContainerState {
                            terminated: Some(ContainerStateTerminated {
                                exit_code: c,
                                reason: Some(if c == 0 { "Completed" } else { "Error" }.into()),
                                finished_at: Some(Time(ts("2019-04-12T10:12:03Z"))),
                                ..Default::default()
                            }),
                            ..Default::default()
                        }),
                        ..Default::default()
                    }]
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_future_schedule_waits_exactly_until_it_is_due() {
        let now = ts("2019-04-12T10:11:37.500Z");
        let n = next(&at("2019-04-12T10:12:00Z", None), None, now);
        assert_eq!(
            n,
            Next::Wait {
                due: ts("2019-04-12T10:12:00Z"),
                after: Duration::from_millis(22_500)
            }
        );
    }

    #[test]
    fn sub_millisecond_waits_round_up_so_the_timer_never_fires_early() {
        let now = ts("2019-04-12T10:11:59.9999995Z");
        match next(&at("2019-04-12T10:12:00Z", None), None, now) {
            Next::Wait { after, .. } => assert_eq!(after, Duration::from_millis(1)),
            other => panic!("expected a wait, got {other:?}"),
        }
    }

    #[test]
    fn far_schedules_are_looked_at_again_within_an_hour() {
        let n = next(
            &at("2030-01-01T00:00:00Z", None),
            None,
            ts("2026-01-01T00:00:00Z"),
        );
        assert!(matches!(n, Next::Wait { after, .. } if after == MAX_WAIT));
    }

    #[test]
    fn a_due_or_past_schedule_starts_at_once() {
        let due = ts("2019-04-12T10:12:00Z");
        assert_eq!(
            next(&at("2019-04-12T10:12:00Z", None), None, due),
            Next::Start { due }
        );
        assert_eq!(
            next(
                &at("2019-04-12T10:12:00Z", Some(Phase::Pending)),
                None,
                ts("2026-11-22T00:00:00Z")
            ),
            Next::Start { due }
        );
    }

    #[test]
    fn offsets_are_honoured() {
        let n = next(
            &at("2019-04-12T12:12:00+02:00", None),
            None,
            ts("2019-04-12T10:11:00Z"),
        );
        assert!(matches!(n, Next::Wait { after, .. } if after == Duration::from_secs(60)));
    }

    #[test]
    fn an_unparseable_schedule_is_invalid_with_a_message_naming_the_field() {
        for bad in ["tomorrow", "2019-04-12T10:12:00", "2019-13-12T10:12:00Z", ""] {
            match next(&at(bad, None), None, ts("2019-04-12T10:12:00Z")) {
                Next::Invalid(msg) => assert!(msg.contains("spec.schedule"), "{msg}"),
                other => panic!("{bad:?} gave {other:?}"),
            }
        }
    }

    #[test]
    fn running_waits_for_the_pod_then_records_how_it_ended() {
        let now = ts("2019-04-12T10:12:05Z");
        let a = at("2019-04-12T10:12:00Z", Some(Phase::Running));
        assert_eq!(next(&a, Some(&ended("Running", None)), now), Next::Running);
        assert_eq!(
            next(&a, Some(&ended("Succeeded", Some(0))), now),
            Next::Finish(Finished {
                outcome: Outcome::Succeeded,
                exit_code: Some(0),
                reason: "Completed".into(),
                message: None,
                at: ts("2019-04-12T10:12:03Z"),
            })
        );
        match next(&a, Some(&ended("Failed", Some(3))), now) {
            Next::Finish(f) => {
                assert_eq!(
                    (f.outcome, f.exit_code, f.reason.as_str()),
                    (Outcome::Failed, Some(3), "Error")
                )
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_pod_gone_while_running_is_a_failure_not_a_restart() {
        let now = ts("2019-04-12T10:12:05Z");
        match next(&at("2019-04-12T10:12:00Z", Some(Phase::Running)), None, now) {
            Next::Finish(f) => {
                assert_eq!(
                    (f.outcome, f.reason.as_str(), f.at),
                    (Outcome::Failed, "PodDeleted", now)
                );
                assert!(f.message.unwrap().contains("example-at-pod"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn done_is_final() {
        let a = at("2019-04-12T10:12:00Z", Some(Phase::Done));
        assert_eq!(next(&a, None, ts("2030-01-01T00:00:00Z")), Next::Done);
    }

    #[test]
    fn the_pod_runs_the_command_in_a_shell_once_owned_and_restricted() {
        let pod = build_pod(&at("2019-04-12T10:12:00Z", None)).unwrap();
        assert_eq!(pod.name_any(), "example-at-pod");
        assert_eq!(pod.namespace().as_deref(), Some("cnat"));
        let spec = pod.spec.as_ref().unwrap();
        assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
        let c = &spec.containers[0];
        assert_eq!(c.command.as_ref().unwrap(), &["sh", "-c", "echo YAY"]);
        assert_eq!(c.image.as_deref(), Some(DEFAULT_IMAGE));
        assert_eq!(
            spec.security_context.as_ref().unwrap().run_as_non_root,
            Some(true)
        );
        assert_eq!(
            c.security_context.as_ref().unwrap().allow_privilege_escalation,
            Some(false)
        );
        let owner = &pod.owner_references()[0];
        assert_eq!((owner.kind.as_str(), owner.controller), ("At", Some(true)));
        assert!(controlled_by(&pod, &at("x", None)));
        assert_eq!(pod.labels()["app.kubernetes.io/instance"], "example-at");
    }

    #[test]
    fn an_at_without_uid_cannot_own_a_pod() {
        let mut a = at("2019-04-12T10:12:00Z", None);
        a.metadata.uid = None;
        assert!(build_pod(&a).is_err());
    }
}
