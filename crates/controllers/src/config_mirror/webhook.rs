//! ConfigMirror admission: a selector the apiserver would not accept, or an empty source, is
//! refused at `kubectl apply` with the field named — the same check the plan repeats for
//! objects stored while the webhook was not there.
use kube::core::admission::Operation;
use opkit::webhook::{FailurePolicy, Review, Rule, Verdict, Webhooks};
use opkit_api::config_mirror::{ConfigMirror, ConfigMirrorSpec};

use super::select;

/// What is wrong with a spec, naming the field.
pub fn validate_spec(spec: &ConfigMirrorSpec) -> Result<(), String> {
    if spec.source.namespace.is_empty() || spec.source.name.is_empty() {
        return Err("spec.source: namespace and name are both required".into());
    }
    select::validate(&spec.namespace_selector, "spec.namespaceSelector")
}

/// Adds the ConfigMirror webhook.
pub fn webhooks(w: Webhooks) -> Webhooks {
    let rule = Rule::validating::<ConfigMirror>()
        // Fail: an invalid selector stored while the operator is down would only be reported
        // later, as a condition; refusing it then costs nothing but a retry.
        .failure_policy(FailurePolicy::Fail);
    w.validating(rule, |r: Review<ConfigMirror>| async move {
        match (&r.operation, &r.object, &r.old_object) {
            // An update that leaves the spec alone (the finalizer coming off, a label) is never
            // refused: a mirror stored with a bad selector must still be deletable.
            (Operation::Update, Some(new), Some(old)) if new.spec == old.spec => Verdict::allow(),
            (Operation::Create | Operation::Update, Some(m), _) => match validate_spec(&m.spec) {
                Ok(()) => Verdict::allow(),
                Err(message) => Verdict::deny(message),
            },
            _ => Verdict::allow(),
        }
    })
}
