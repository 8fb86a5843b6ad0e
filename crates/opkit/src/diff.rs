//! The comparison behind no-op skipping: does the cluster already have what we want?
//!
//! An apply of an unchanged object is a no-op for etcd but still a request the apiserver must
//! authenticate, decode and diff. Comparing the desired fields against the cached live object
//! first means a resync of a converged object costs no API call at all.
use serde_json::Value;

/// Whether every field set in `desired` has the same value in `live`.
///
/// Objects are compared key by key (extra keys in `live` — defaults, other managers' fields,
/// `managedFields` — are ignored); arrays must have the same length and match element-wise.
/// A field we stopped setting is not noticed here; it is dropped on the next real change.
pub fn is_subset(desired: &Value, live: &Value) -> bool {
    match (desired, live) {
        (Value::Object(d), Value::Object(l)) => {
            d.iter().all(|(k, dv)| match l.get(k) {
                Some(lv) => is_subset(dv, lv),
                // An empty map or list we ask for is the same as one the server omitted.
                None => is_empty(dv),
            })
        }
        (Value::Array(d), Value::Array(l)) => {
            d.len() == l.len() && d.iter().zip(l).all(|(a, b)| is_subset(a, b))
        }
        (Value::Null, _) => true,
        (d, l) => d == l,
    }
}

fn is_empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Object(m) => m.values().all(is_empty),
        Value::Array(a) => a.is_empty(),
        _ => false,
    }
}

/// Whether applying `desired` over `live` would change anything we manage.
pub fn needs_apply<K: serde::Serialize>(desired: &K, live: Option<&K>) -> bool {
    let Some(live) = live else { return true };
    match (serde_json::to_value(desired), serde_json::to_value(live)) {
        (Ok(d), Ok(l)) => !is_subset(&d, &l),
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn defaults_and_foreign_fields_in_live_do_not_count_as_drift() {
        let desired = json!({"spec": {"replicas": 3, "template": {"spec": {"containers": [{"name": "m", "ports": [{"containerPort": 11211}]}]}}}});
        let live = json!({"metadata": {"resourceVersion": "7"}, "spec": {"replicas": 3, "progressDeadlineSeconds": 600,
            "template": {"spec": {"containers": [{"name": "m", "terminationMessagePath": "/dev/termination-log",
            "ports": [{"containerPort": 11211, "protocol": "TCP"}]}]}}}});
        assert!(is_subset(&desired, &live));
    }

    #[test]
    fn changed_values_and_list_lengths_are_drift() {
        let desired = json!({"spec": {"replicas": 3, "args": ["-v"]}});
        assert!(!is_subset(
            &desired,
            &json!({"spec": {"replicas": 5, "args": ["-v"]}})
        ));
        assert!(!is_subset(
            &desired,
            &json!({"spec": {"replicas": 3, "args": ["-v", "-x"]}})
        ));
        assert!(
            !is_subset(&desired, &json!({"spec": {"args": ["-v"]}})),
            "a missing field is drift"
        );
        assert!(
            is_subset(&json!({"spec": {"nodes": []}}), &json!({"spec": {}})),
            "empty equals omitted"
        );
    }
}
