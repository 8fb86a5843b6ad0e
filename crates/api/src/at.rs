//! `At` (`cnat.programming-kubernetes.info/v1alpha1`): run a shell command once, in a Pod, at a
//! given time — the cnat example of *Programming Kubernetes*.
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, CustomResourceExt};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Image used when `spec.image` is not set: small, with a POSIX shell.
pub const DEFAULT_IMAGE: &str = "busybox:1.37";

/// Longest accepted `spec.command`; it ends up in a Pod spec, which etcd stores whole.
pub const MAX_COMMAND_LEN: usize = 4096;

/// Desired state: what to run and when.
// Printer columns repeat `type_ = "string"`, which clippy mistakes for duplicated attributes.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "cnat.programming-kubernetes.info",
    version = "v1alpha1",
    kind = "At",
    doc = "Runs a command in a Pod once, at `spec.schedule`: PENDING until then, RUNNING while the Pod runs, DONE with its outcome.",
    namespaced,
    status = "AtStatus",
    category = "opkit",
    printcolumn(name = "Schedule", type_ = "string", json_path = ".spec.schedule"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Outcome", type_ = "string", json_path = ".status.outcome"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
pub struct AtSpec {
    /// When to run, as an RFC 3339 time with a zone, e.g. `2019-04-12T10:12:00Z`. A time in
    /// the past runs at once.
    #[schemars(extend(
        "maxLength" = 64,
        "x-kubernetes-validations" = [{
            "rule": "self.matches('^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\\\\.[0-9]+)?(Z|[+-][0-9]{2}:[0-9]{2})$') && timestamp(self) > timestamp('0001-01-01T00:00:00Z')",
            "message": "must be an RFC 3339 time with a zone, such as 2019-04-12T10:12:00Z"
        }]
    ))]
    pub schedule: String,
    /// The command, run by `sh -c` in a one-shot Pod.
    #[schemars(length(min = 1, max = 4096))]
    pub command: String,
    /// Container image with a shell (default `busybox:1.37`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512))]
    pub image: Option<String>,
    /// How long the command may run before its Pod is stopped and the At ends `Failed` with
    /// reason `DeadlineExceeded` (default 3600, at most a week).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 604800))]
    pub active_deadline_seconds: Option<i64>,
    /// Delete the At (and its Pod) this many seconds after it is DONE, as Jobs do; kept
    /// forever when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub ttl_seconds_after_finished: Option<i32>,
}

/// How long a command runs at most when `spec.activeDeadlineSeconds` is not set.
pub const DEFAULT_ACTIVE_DEADLINE_SECONDS: i64 = 3600;

/// Where an `At` is in its life: PENDING → RUNNING → DONE, as in the book.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "UPPERCASE")]
pub enum Phase {
    /// Waiting for the scheduled time.
    #[default]
    Pending,
    /// The Pod has been started.
    Running,
    /// The Pod has ended (or was lost); final.
    Done,
}

/// How the command ended.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum Outcome {
    Succeeded,
    Failed,
}

/// Observed state, written only by the operator through the status subresource.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AtStatus {
    /// `PENDING`, `RUNNING` or `DONE`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    /// The Pod that runs (or ran) the command.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_name: Option<String>,
    /// When the Pod was started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<Time>,
    /// When the command ended (or the Pod was found gone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_time: Option<Time>,
    /// `Succeeded` or `Failed`, once DONE.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<Outcome>,
    /// The command's exit code, when the container reported one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// Why it ended that way, e.g. `Completed`, `Error`, `PodDeleted`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Details from the container or the Pod, when there are any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Scheduled` (the schedule is valid) and `Succeeded` (Unknown until the command ends).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// The longest At name: its Pod is `<name>-pod`, and object names stop at 253 characters.
pub const MAX_NAME: usize = 249;
/// Why an At's name is limited.
pub const NAME_LIMIT_REASON: &str = "its Pod is named <name>-pod (253 characters at most)";

/// The CRD, with the name limit.
pub fn crd() -> k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition {
    crate::limit_name(At::crd(), MAX_NAME, NAME_LIMIT_REASON)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::CustomResourceExt;

    #[test]
    fn schedule_is_checked_by_the_apiserver() {
        let crd = At::crd();
        let schema = serde_json::to_value(&crd.spec.versions[0].schema).unwrap();
        let spec = &schema["openAPIV3Schema"]["properties"]["spec"];
        let schedule = &spec["properties"]["schedule"];
        assert!(
            schedule["x-kubernetes-validations"][0]["rule"]
                .as_str()
                .unwrap()
                .contains("matches")
        );
        let mut required: Vec<_> = spec["required"].as_array().unwrap().iter().collect();
        required.sort_by_key(|v| v.as_str());
        assert_eq!(required, vec!["command", "schedule"]);
        assert_eq!(
            spec["properties"]["command"]["maxLength"],
            serde_json::json!(MAX_COMMAND_LEN)
        );
    }

    #[test]
    fn phases_are_spelled_as_in_the_book() {
        let s = serde_json::to_value(AtStatus {
            phase: Some(Phase::Running),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(s["phase"], "RUNNING");
    }
}
