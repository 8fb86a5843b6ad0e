//! Label and field selectors as the API server reads them from a list or watch request.
use serde_json::Value;

/// One requirement of a label selector.
#[derive(Debug, Clone, PartialEq)]
enum Label {
    Eq(String, String),
    Ne(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    Missing(String),
}

/// A parsed `labelSelector`/`fieldSelector` pair; an empty selector matches everything.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Selector {
    labels: Vec<Label>,
    /// `path=value` (`true`) or `path!=value` (`false`), the path dotted (`status.phase`).
    fields: Vec<(String, String, bool)>,
}

/// Splits at commas that are not inside parentheses (`a in (x,y),b`).
fn split_top(s: &str) -> Vec<&str> {
    let (mut out, mut depth, mut start) = (Vec::new(), 0i32, 0);
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out.into_iter().map(str::trim).filter(|p| !p.is_empty()).collect()
}

fn values(set: &str) -> Result<Vec<String>, String> {
    let inner = set
        .trim()
        .strip_prefix('(')
        .and_then(|s| s.strip_suffix(')'))
        .ok_or_else(|| format!("expected a set in parentheses, got {set:?}"))?;
    Ok(inner.split(',').map(|v| v.trim().to_string()).collect())
}

impl Selector {
    /// Parses the two query parameters; a clear message for what it cannot read.
    pub(crate) fn parse(labels: Option<&str>, fields: Option<&str>) -> Result<Self, String> {
        let mut sel = Selector::default();
        for req in split_top(labels.unwrap_or_default()) {
            let label = if let Some((k, v)) = req.split_once("!=") {
                Label::Ne(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = req.split_once("==").or_else(|| req.split_once('=')) {
                Label::Eq(k.trim().into(), v.trim().into())
            } else if let Some((k, set)) = req.split_once(" notin ") {
                Label::NotIn(k.trim().into(), values(set)?)
            } else if let Some((k, set)) = req.split_once(" in ") {
                Label::In(k.trim().into(), values(set)?)
            } else if let Some(k) = req.strip_prefix('!') {
                Label::Missing(k.trim().into())
            } else if req.chars().all(|c| c.is_alphanumeric() || "-_./".contains(c)) {
                Label::Exists(req.into())
            } else {
                return Err(format!("unable to parse requirement: {req:?}"));
            };
            sel.labels.push(label);
        }
        for req in split_top(fields.unwrap_or_default()) {
            let field = if let Some((k, v)) = req.split_once("!=") {
                (k.trim().to_string(), v.trim().to_string(), false)
            } else if let Some((k, v)) = req.split_once("==").or_else(|| req.split_once('=')) {
                (k.trim().to_string(), v.trim().to_string(), true)
            } else {
                return Err(format!("invalid field selector: {req:?}"));
            };
            sel.fields.push(field);
        }
        Ok(sel)
    }

    /// Whether `obj` (a whole object as JSON) is selected.
    pub(crate) fn matches(&self, obj: &Value) -> bool {
        let labels = &obj["metadata"]["labels"];
        let label = |k: &str| labels.get(k).and_then(Value::as_str);
        let labels_ok = self.labels.iter().all(|l| match l {
            Label::Eq(k, v) => label(k) == Some(v.as_str()),
            Label::Ne(k, v) => label(k) != Some(v.as_str()),
            Label::In(k, vs) => label(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            Label::NotIn(k, vs) => label(k).is_none_or(|x| vs.iter().all(|v| v != x)),
            Label::Exists(k) => label(k).is_some(),
            Label::Missing(k) => label(k).is_none(),
        });
        labels_ok
            && self.fields.iter().all(|(path, want, eq)| {
                let found = path.split('.').try_fold(obj, |v, key| v.get(key));
                let text = match found {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Null) | None => String::new(),
                    Some(other) => other.to_string(),
                };
                (text == *want) == *eq
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn label_and_field_selectors_select_as_the_api_server_does() {
        let pod = json!({"metadata": {"name": "p", "labels": {"app": "web", "tier": "a"}}, "status": {"phase": "Running"}});
        let sel = |l: &str, f: &str| Selector::parse(Some(l), Some(f)).unwrap().matches(&pod);
        assert!(sel("", ""));
        assert!(sel("app=web", ""));
        assert!(sel("app==web,tier", ""));
        assert!(!sel("app!=web", ""));
        assert!(sel("tier in (a,b)", ""));
        assert!(!sel("tier notin (a,b)", ""));
        assert!(sel("!missing", ""));
        assert!(!sel("missing", ""));
        assert!(sel("", "status.phase!=Succeeded,status.phase!=Failed"));
        assert!(!sel("", "status.phase=Succeeded"));
        assert!(sel("", "metadata.name=p"));
        assert!(Selector::parse(Some("a b c"), None).is_err());
    }
}
