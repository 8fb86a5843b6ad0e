//! RBAC rule tables: each controller lists exactly the API access it uses (opkit's version of
//! Kubebuilder's `+kubebuilder:rbac` markers), and the manifests are generated from them.
use k8s_openapi::api::rbac::v1::PolicyRule;

/// One rule: API groups, resources, verbs.
pub fn rule(groups: &[&str], resources: &[&str], verbs: &[&str]) -> PolicyRule {
    let s = |v: &[&str]| Some(v.iter().map(|s| s.to_string()).collect());
    PolicyRule {
        api_groups: s(groups),
        resources: s(resources),
        verbs: verbs.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

/// Rules every controller needs to publish Events.
pub fn events() -> PolicyRule {
    rule(&["events.k8s.io"], &["events"], &["create", "patch"])
}
