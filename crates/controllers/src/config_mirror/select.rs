//! `metav1.LabelSelector`, as the apiserver reads it: checked once (the webhook and the plan
//! give the same message), then matched against a namespace's labels.
use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

/// What is wrong with a selector, naming the field, or nothing.
pub fn validate(s: &LabelSelector, field: &str) -> Result<(), String> {
    for (k, v) in s.match_labels.iter().flatten() {
        key(k).map_err(|e| format!("{field}.matchLabels: key {k:?} {e}"))?;
        value(v).map_err(|e| format!("{field}.matchLabels[{k:?}]: value {v:?} {e}"))?;
    }
    for (i, r) in s.match_expressions.iter().flatten().enumerate() {
        let at = format!("{field}.matchExpressions[{i}]");
        key(&r.key).map_err(|e| format!("{at}.key: {:?} {e}", r.key))?;
        let values = r.values.as_deref().unwrap_or_default();
        match r.operator.as_str() {
            "In" | "NotIn" if values.is_empty() => {
                return Err(format!(
                    "{at}.values: must be non-empty for operator {}",
                    r.operator
                ));
            }
            "Exists" | "DoesNotExist" if !values.is_empty() => {
                return Err(format!("{at}.values: must be empty for operator {}", r.operator));
            }
            "In" | "NotIn" | "Exists" | "DoesNotExist" => {}
            other => {
                return Err(format!(
                    "{at}.operator: {other:?} is not one of In, NotIn, Exists, DoesNotExist"
                ));
            }
        }
        for v in values {
            value(v).map_err(|e| format!("{at}.values: {v:?} {e}"))?;
        }
    }
    Ok(())
}

/// Whether `labels` match `s` (an empty selector matches everything). Only for a selector
/// [`validate`] accepted.
pub fn matches(s: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    let exact = s
        .match_labels
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v));
    exact
        && s.match_expressions.iter().flatten().all(|r| {
            let values = r.values.as_deref().unwrap_or_default();
            let got = labels.get(&r.key);
            match r.operator.as_str() {
                "In" => got.is_some_and(|g| values.contains(g)),
                "NotIn" => got.is_none_or(|g| !values.contains(g)),
                "Exists" => got.is_some(),
                "DoesNotExist" => got.is_none(),
                _ => false,
            }
        })
}

/// A label value: at most 63 characters, alphanumerics with `-`, `_` and `.` inside.
fn value(v: &str) -> Result<(), &'static str> {
    if v.is_empty() {
        return Ok(());
    }
    name(v)
}

/// A label key: an optional DNS-subdomain prefix and `/`, then a name.
fn key(k: &str) -> Result<(), &'static str> {
    let n = match k.split_once('/') {
        Some((prefix, n)) => {
            let dns = |p: &str| {
                !p.is_empty()
                    && p.len() <= 253
                    && p.split('.').all(|l| {
                        !l.is_empty()
                            && l.bytes()
                                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                            && !l.starts_with('-')
                            && !l.ends_with('-')
                    })
            };
            if !dns(prefix) {
                return Err("has a prefix that is not a DNS subdomain");
            }
            n
        }
        None => k,
    };
    if n.is_empty() {
        return Err("is empty");
    }
    name(n)
}

fn name(n: &str) -> Result<(), &'static str> {
    let inner = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.');
    if n.len() > 63 {
        Err("is longer than 63 characters")
    } else if !n.bytes().all(inner)
        || !n.as_bytes()[0].is_ascii_alphanumeric()
        || !n.as_bytes()[n.len() - 1].is_ascii_alphanumeric()
    {
        Err("must be alphanumeric, with '-', '_' or '.' only between alphanumerics")
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    fn sel(json: serde_json::Value) -> LabelSelector {
        serde_json::from_value(json).unwrap()
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn selectors_match_as_the_apiserver_does() {
        let s = sel(serde_json::json!({
            "matchLabels": {"team": "a"},
            "matchExpressions": [
                {"key": "env", "operator": "In", "values": ["dev", "qa"]},
                {"key": "frozen", "operator": "DoesNotExist"},
                {"key": "tier", "operator": "NotIn", "values": ["db"]},
                {"key": "mirror", "operator": "Exists"},
            ]
        }));
        assert!(matches(
            &s,
            &labels(&[("team", "a"), ("env", "qa"), ("mirror", "")])
        ));
        assert!(!matches(
            &s,
            &labels(&[("team", "b"), ("env", "qa"), ("mirror", "")])
        ));
        assert!(!matches(
            &s,
            &labels(&[("team", "a"), ("env", "prod"), ("mirror", "")])
        ));
        assert!(!matches(
            &s,
            &labels(&[("team", "a"), ("env", "qa"), ("mirror", ""), ("frozen", "y")])
        ));
        assert!(!matches(
            &s,
            &labels(&[("team", "a"), ("env", "qa"), ("mirror", ""), ("tier", "db")])
        ));
        assert!(!matches(&s, &labels(&[("team", "a"), ("env", "qa")])));
        assert!(
            matches(&LabelSelector::default(), &labels(&[])),
            "empty matches all"
        );
    }

    #[test]
    fn invalid_selectors_are_refused_naming_the_field() {
        let req = |key: &str, op: &str, values: Option<Vec<&str>>| LabelSelector {
            match_expressions: Some(vec![LabelSelectorRequirement {
                key: key.into(),
                operator: op.into(),
                values: values.map(|v| v.into_iter().map(String::from).collect()),
            }]),
            ..Default::default()
        };
        let err = |s: LabelSelector| validate(&s, "spec.namespaceSelector").unwrap_err();
        assert!(err(req("env", "In", None)).contains("matchExpressions[0].values: must be non-empty"));
        assert!(err(req("env", "Exists", Some(vec!["x"]))).contains("must be empty for operator Exists"));
        assert!(err(req("env", "Equals", Some(vec!["x"]))).contains("\"Equals\" is not one of In"));
        assert!(err(req("bad key!", "Exists", None)).contains("matchExpressions[0].key"));
        assert!(err(req("env", "In", Some(vec!["-x"]))).contains("values: \"-x\""));
        let labels = sel(serde_json::json!({"matchLabels": {"Example.com/x": "y"}}));
        assert!(err(labels).contains("prefix that is not a DNS subdomain"));
        let long = sel(serde_json::json!({"matchLabels": {"x": "v".repeat(64)}}));
        assert!(err(long).contains("longer than 63"));
        let ok = sel(serde_json::json!({"matchLabels": {"example.com/team": "a_b.c-d", "e": ""}}));
        assert_eq!(validate(&ok, "s"), Ok(()));
    }
}
