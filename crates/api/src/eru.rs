//! `Eru` (`mtsre.meitu.com/v1`, "elegant rolling updates"): restart a Deployment gracefully on a
//! cron schedule, the way `kubectl rollout restart` does.
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Put `"true"` on a Deployment to have opkit create an `Eru` for it.
pub const ANNOTATION: &str = "mtsre.meitu.com/eru";
/// The cron schedule of the `Eru` created from the annotation.
pub const SCHEDULE_ANNOTATION: &str = "mtsre.meitu.com/eru-schedule";
/// The time zone of the `Eru` created from the annotation.
pub const TIME_ZONE_ANNOTATION: &str = "mtsre.meitu.com/eru-timezone";
/// Schedule used when the Deployment has no `mtsre.meitu.com/eru-schedule`: 03:00 every day.
pub const DEFAULT_SCHEDULE: &str = "0 3 * * *";
/// Label on every `Eru` opkit created from an annotation (and so may delete).
pub const FROM_ANNOTATION_LABEL: &str = "mtsre.meitu.com/eru-from-annotation";

/// Desired state: which Deployment to restart, and when.
// Printer columns repeat `type_ = "string"`, which clippy mistakes for duplicated attributes.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "mtsre.meitu.com",
    version = "v1",
    kind = "Eru",
    doc = "Restarts a Deployment gracefully (a rolling restart, as `kubectl rollout restart` does) on a cron schedule.",
    namespaced,
    status = "EruStatus",
    category = "opkit",
    printcolumn(name = "Deployment", type_ = "string", json_path = ".spec.deploymentName"),
    printcolumn(name = "Schedule", type_ = "string", json_path = ".spec.schedule"),
    printcolumn(name = "Suspend", type_ = "boolean", json_path = ".spec.suspend"),
    printcolumn(name = "Last Restart", type_ = "date", json_path = ".status.lastRestartTime"),
    printcolumn(
        name = "Next Restart",
        type_ = "string",
        json_path = ".status.nextRestartTime"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct EruSpec {
    /// The Deployment to restart, in the same namespace.
    #[schemars(schema_with = "crate::deployment_name")]
    pub deployment_name: String,
    /// Cron schedule: 5 fields (`minute hour day-of-month month day-of-week`), 6 fields with
    /// seconds first, or a macro (`@hourly`, `@daily`, `@weekly`, `@monthly`, `@yearly`).
    #[schemars(extend(
        "maxLength" = 128,
        "x-kubernetes-validations" = [{
            "rule": "self.matches('^(@(yearly|annually|monthly|weekly|daily|midnight|hourly)|[0-9A-Za-z*?,/-]+([ \\t]+[0-9A-Za-z*?,/-]+){4,5})$')",
            "message": "must be a cron expression: 5 fields (minute hour day-of-month month day-of-week), 6 fields with seconds first, or a macro such as @daily"
        }]
    ))]
    pub schedule: String,
    /// IANA time zone the schedule is read in (default UTC), e.g. `Europe/Berlin`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend(
        "maxLength" = 64,
        "x-kubernetes-validations" = [{
            "rule": "self.matches('^[A-Za-z][A-Za-z0-9_+-]*(/[A-Za-z0-9_+-]+)*$') && timestamp('2000-01-01T00:00:00Z').getHours(self) >= 0",
            "message": "must be an IANA time zone name such as Europe/Berlin"
        }]
    ))]
    pub time_zone: Option<String>,
    /// Stop restarting while true; missed slots are not made up when it turns false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suspend: Option<bool>,
    /// A slot missed (operator down, rollout in progress) is still restarted if no more than
    /// this many seconds late; unset means no limit (at most one catch-up restart either way).
    /// At least 1: with 0 every slot would already be too late when it is looked at.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub starting_deadline_seconds: Option<i64>,
}

/// Observed state, written only by the operator through the status subresource.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EruStatus {
    /// The last schedule slot acted on (restarted, or skipped as too late); never acted on twice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_schedule_time: Option<Time>,
    /// When the Deployment was last restarted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_restart_time: Option<Time>,
    /// The next slot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_restart_time: Option<Time>,
    /// Restarts made by this Eru.
    #[serde(default)]
    pub restart_count: i64,
    /// Whether `spec.suspend` was in force at the last reconcile, so slots that passed while
    /// suspended are consumed on resume instead of made up.
    #[serde(default)]
    pub suspended: bool,
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Scheduled`, `TargetFound` and `Postponed`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}
