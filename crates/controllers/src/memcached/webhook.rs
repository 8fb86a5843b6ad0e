//! Memcached admission: a missing `spec.size` is defaulted to [`DEFAULT_SIZE`] (mutating). The
//! schema still requires `size`, so nothing is stored without one while the webhook is down.
use kube::Client;
use kube::core::DynamicObject;
use kube::core::admission::Operation;
use opkit::webhook::{FailurePolicy, Review, Rule, RuleScope, Verdict, Webhooks};

/// `spec.size` given to a Memcached created without one.
pub const DEFAULT_SIZE: i32 = 1;

/// Defaults `spec.size` of a Memcached that has none.
pub fn default_memcached(obj: &DynamicObject) -> Verdict {
    let spec = &obj.data["spec"];
    if !spec["size"].is_null() {
        return Verdict::allow();
    }
    let (path, value) = if spec.is_object() {
        (vec!["spec", "size"], serde_json::json!(DEFAULT_SIZE))
    } else {
        (vec!["spec"], serde_json::json!({"size": DEFAULT_SIZE}))
    };
    Verdict {
        patch: vec![json_patch::PatchOperation::Add(json_patch::AddOperation {
            path: json_patch::jsonptr::PointerBuf::from_tokens(path),
            value,
        })],
        ..Default::default()
    }
}

/// Adds the Memcached webhooks.
pub fn webhooks(w: Webhooks, _: &Client) -> Webhooks {
    let rule = Rule {
        name: "mmemcached.opkit.dev",
        path: "/mutate-cache-example-com-memcached",
        group: "cache.example.com",
        versions: &["v1", "v1alpha1"],
        resource: "memcacheds",
        operations: &["CREATE"],
        // Ignore: this webhook only fills in a `spec.size` the schema requires. While it cannot
        // answer, a Memcached without a size is refused anyway (by the schema: `spec.size:
        // Required value`) and one with a size needs nothing from it; Fail would refuse those too.
        failure_policy: FailurePolicy::Ignore,
        scope: RuleScope::Namespaced,
    };
    // Read untyped: both served versions come through here.
    w.mutating::<DynamicObject, _, _>(rule, |r: Review<DynamicObject>| async move {
        match (&r.operation, &r.object) {
            (Operation::Create, Some(o)) => default_memcached(o),
            _ => Verdict::allow(),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_memcached_without_size_is_defaulted() {
        let o: DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "cache.example.com/v1", "kind": "Memcached", "metadata": {"name": "m"}, "spec": {}
        }))
        .unwrap();
        let v = default_memcached(&o);
        assert_eq!(v.patch.len(), 1);
        let mut doc = serde_json::to_value(&o).unwrap();
        json_patch::patch(&mut doc, &v.patch).unwrap();
        assert_eq!(doc["spec"]["size"], DEFAULT_SIZE);
        let with_size: DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "cache.example.com/v1", "kind": "Memcached", "metadata": {"name": "m"}, "spec": {"size": 3}
        }))
        .unwrap();
        assert!(default_memcached(&with_size).patch.is_empty());
    }
}
