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

/// Combines the tables of several controllers into one rule list: rules for the same groups and
/// resources become one rule with the union of their verbs, in first-seen order.
pub fn merge(tables: impl IntoIterator<Item = Vec<PolicyRule>>) -> Vec<PolicyRule> {
    let mut out: Vec<PolicyRule> = Vec::new();
    for r in tables.into_iter().flatten() {
        match out.iter_mut().find(|o| {
            o.api_groups == r.api_groups && o.resources == r.resources && o.resource_names == r.resource_names
        }) {
            Some(o) => {
                for v in r.verbs {
                    if !o.verbs.contains(&v) {
                        o.verbs.push(v);
                    }
                }
            }
            None => out.push(r),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_for_the_same_resources_are_merged_with_the_union_of_verbs() {
        let merged = merge([
            vec![rule(&[""], &["pods"], &["get", "list"]), events()],
            vec![rule(&[""], &["pods"], &["list", "create"]), events()],
        ]);
        assert_eq!(merged.len(), 2);
        assert_eq!(merged[0].verbs, vec!["get", "list", "create"]);
        assert_eq!(merged[1], events());
    }
}
