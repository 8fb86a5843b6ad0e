//! `CronTab` (`stable.example.com`): the custom resource of the Kubernetes documentation on
//! CRDs, served in two versions with different schemas. `v1` is the documentation's
//! (`cronSpec` as one string); `v2` stores the schedule as its five fields and adds a time
//! zone, and is the storage version. The operator converts between them (its `/convert`
//! webhook); the conversions live with the controllers.
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;

/// The documentation's version.
pub mod v1 {
    use kube::CustomResource;
    use schemars::JsonSchema;
    use serde::{Deserialize, Serialize};

    /// What to run and when, as the documentation's example has it.
    #[allow(clippy::duplicated_attributes)]
    #[derive(CustomResource, Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
    #[kube(
        group = "stable.example.com",
        version = "v1",
        kind = "CronTab",
        shortname = "ct",
        doc = "A command run on a cron schedule (the CRD example of the Kubernetes documentation).",
        namespaced,
        category = "opkit",
        printcolumn(name = "Spec", type_ = "string", json_path = ".spec.cronSpec"),
        printcolumn(name = "Replicas", type_ = "integer", json_path = ".spec.replicas")
    )]
    #[serde(rename_all = "camelCase")]
    pub struct CronTabSpec {
        /// The schedule, in cron format (`minute hour day-of-month month day-of-week`).
        pub cron_spec: String,
        /// The image to run.
        pub image: String,
        /// How many copies to run.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub replicas: Option<i32>,
    }
}

/// The stored version: the schedule as its fields, and a time zone.
pub mod v2 {
    use kube::CustomResource;
    use schemars::JsonSchema;
    use serde::{Deserialize, Serialize};

    /// What to run and when.
    #[allow(clippy::duplicated_attributes)]
    #[derive(CustomResource, Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
    #[kube(
        group = "stable.example.com",
        version = "v2",
        kind = "CronTab",
        shortname = "ct",
        doc = "A command run on a cron schedule (the CRD example of the Kubernetes documentation).",
        namespaced,
        category = "opkit",
        printcolumn(name = "Minute", type_ = "string", json_path = ".spec.schedule.minute"),
        printcolumn(name = "Hour", type_ = "string", json_path = ".spec.schedule.hour"),
        printcolumn(name = "Time zone", type_ = "string", json_path = ".spec.timeZone"),
        printcolumn(name = "Replicas", type_ = "integer", json_path = ".spec.replicas")
    )]
    #[serde(rename_all = "camelCase")]
    pub struct CronTabSpec {
        /// When to run.
        pub schedule: Schedule,
        /// IANA time zone of the schedule (`Europe/Paris`); UTC when left out.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub time_zone: Option<String>,
        /// The image to run.
        pub image: String,
        /// How many copies to run.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub replicas: Option<i32>,
    }

    /// The five fields of a cron schedule.
    #[derive(Deserialize, Serialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
    #[serde(rename_all = "camelCase")]
    pub struct Schedule {
        /// Minute (`0-59`, `*/5`, ...).
        pub minute: String,
        /// Hour (`0-23`).
        pub hour: String,
        /// Day of the month (`1-31`).
        pub day_of_month: String,
        /// Month (`1-12`).
        pub month: String,
        /// Day of the week (`0-6`, Sunday is 0).
        pub day_of_week: String,
    }
}

/// The CRD with both versions; `v2` is stored. Its `conversion` (the operator's webhook) is
/// added by the manifests, which know where the webhook is served.
pub fn crd() -> CustomResourceDefinition {
    kube::core::crd::merge_crds(vec![v1::CronTab::crd(), v2::CronTab::crd()], "v2")
        .expect("both CronTab versions share group, kind and scope")
}
