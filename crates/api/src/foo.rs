//! `Foo` (`samplecontroller.k8s.io/v1alpha1`): client-go's sample-controller API — a Deployment
//! of `spec.replicas` nginx Pods named `spec.deploymentName`, with `status.availableReplicas`.
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::{CustomResource, CustomResourceExt};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Desired state, as upstream's `crd-status-subresource.yaml` defines it.
// Printer columns repeat `type_ = "integer"`, which clippy mistakes for duplicated attributes.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "samplecontroller.k8s.io",
    version = "v1alpha1",
    kind = "Foo",
    doc = "client-go's sample-controller: a Deployment named `spec.deploymentName` running `spec.replicas` nginx Pods.",
    namespaced,
    status = "FooStatus",
    category = "opkit",
    // `*.k8s.io` groups are protected; upstream's CRD carries the same annotation.
    annotation(
        "api-approved.kubernetes.io",
        "unapproved, experimental-only; please get an approval from Kubernetes API reviewers if you're trying to develop a CRD in the *.k8s.io or *.kubernetes.io groups"
    ),
    printcolumn(name = "Deployment", type_ = "string", json_path = ".spec.deploymentName"),
    printcolumn(name = "Replicas", type_ = "integer", json_path = ".spec.replicas"),
    printcolumn(name = "Available", type_ = "integer", json_path = ".status.availableReplicas")
)]
#[serde(rename_all = "camelCase")]
pub struct FooSpec {
    /// Name of the Deployment to run, in the Foo's namespace.
    #[schemars(schema_with = "crate::deployment_name")]
    pub deployment_name: String,
    /// Number of nginx Pods, 1 to 10 (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 10))]
    pub replicas: Option<i32>,
}

/// Observed state, written only by the operator through the status subresource.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FooStatus {
    /// The Deployment's available replicas.
    #[serde(default)]
    pub available_replicas: i32,
}

/// Why a Foo's name is limited: its Deployment's Pods carry it as a label value.
pub const NAME_LIMIT_REASON: &str = "it labels the Deployment's Pods (controller=<name>)";

/// The CRD, with the name limit.
pub fn crd() -> CustomResourceDefinition {
    crate::limit_name(Foo::crd(), crate::MAX_LABEL_VALUE, NAME_LIMIT_REASON)
}
