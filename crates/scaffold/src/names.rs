//! The names one group/version/kind gets in code, manifests and URLs, checked up front so a bad
//! `--kind` fails with a message instead of as generated code that does not compile.
use anyhow::ensure;

/// A group/version/kind of the project and every name derived from it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resource {
    /// `webapp`.
    pub group: String,
    /// `webapp.my.domain`.
    pub group_domain: String,
    /// `v1`.
    pub version: String,
    /// `Guestbook`.
    pub kind: String,
    /// `guestbook` (`CronTab` → `cron_tab`): file and module names.
    pub kind_snake: String,
    /// `guestbooks`: the resource in URLs and RBAC.
    pub plural: String,
    /// `webapp_v1`: the types module of the group and version.
    pub module: String,
}

fn is_version(v: &str) -> bool {
    let Some(rest) = v.strip_prefix('v') else {
        return false;
    };
    let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 || rest.starts_with('0') {
        return false;
    }
    match &rest[digits..] {
        "" => true,
        tail => ["alpha", "beta"].iter().any(|s| {
            tail.strip_prefix(s).is_some_and(|n| {
                !n.is_empty() && !n.starts_with('0') && n.bytes().all(|b| b.is_ascii_digit())
            })
        }),
    }
}

/// A DNS subdomain of lowercase labels, e.g. `my.domain`.
pub(crate) fn is_domain(d: &str) -> bool {
    d.len() <= 253
        && d.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        })
}

/// Kubebuilder's pluralisation for the usual cases: `policy` → `policies`, `ingress` →
/// `ingresses`, `memcached` → `memcacheds`.
pub fn plural(lower: &str) -> String {
    let vowel = |c: Option<char>| matches!(c, Some('a' | 'e' | 'i' | 'o' | 'u'));
    if let Some(stem) = lower.strip_suffix('y')
        && !vowel(stem.chars().last())
        && !stem.is_empty()
    {
        return format!("{stem}ies");
    }
    if ["s", "x", "z", "ch", "sh"].iter().any(|s| lower.ends_with(s)) {
        return format!("{lower}es");
    }
    format!("{lower}s")
}

pub(crate) fn snake(kind: &str) -> String {
    let mut out = String::new();
    let chars: Vec<char> = kind.chars().collect();
    for (i, c) in chars.iter().enumerate() {
        if c.is_ascii_uppercase() {
            let prev_lower = i > 0 && (chars[i - 1].is_ascii_lowercase() || chars[i - 1].is_ascii_digit());
            let next_lower = chars.get(i + 1).is_some_and(|n| n.is_ascii_lowercase());
            if i > 0 && (prev_lower || (next_lower && chars[i - 1].is_ascii_uppercase())) {
                out.push('_');
            }
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(*c);
        }
    }
    out
}

impl Resource {
    /// Checks the names and derives the rest; errors say which flag is wrong and why.
    pub fn new(group: &str, version: &str, kind: &str, domain: &str) -> anyhow::Result<Resource> {
        ensure!(
            !group.is_empty() && is_domain(group) && !group.contains('.'),
            "--group {group:?} must be one DNS label (lowercase letters, digits, '-'), e.g. webapp; the domain is added to it"
        );
        ensure!(
            group.as_bytes()[0].is_ascii_lowercase(),
            "--group {group:?} must start with a letter"
        );
        ensure!(
            is_version(version),
            "--version {version:?} must look like v1, v2beta1 or v1alpha1"
        );
        ensure!(
            kind.len() <= 63
                && kind.chars().next().is_some_and(|c| c.is_ascii_uppercase())
                && kind.chars().all(|c| c.is_ascii_alphanumeric()),
            "--kind {kind:?} must be UpperCamelCase letters and digits, e.g. Guestbook"
        );
        let kind_snake = snake(kind);
        ensure!(
            ![
                "self", "super", "crate", "mod", "type", "impl", "struct", "fn", "use"
            ]
            .contains(&kind_snake.as_str()),
            "--kind {kind:?} makes the Rust module name {kind_snake:?}, a keyword; pick another kind"
        );
        Ok(Resource {
            group: group.into(),
            group_domain: format!("{group}.{domain}"),
            version: version.into(),
            kind: kind.into(),
            plural: plural(&kind.to_lowercase()),
            module: format!("{}_{version}", group.replace('-', "_")),
            kind_snake,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_kubebuilder() {
        let r = Resource::new("webapp", "v1", "Guestbook", "my.domain").unwrap();
        assert_eq!(
            (
                r.group_domain.as_str(),
                r.plural.as_str(),
                r.module.as_str(),
                r.kind_snake.as_str()
            ),
            ("webapp.my.domain", "guestbooks", "webapp_v1", "guestbook")
        );
        let r = Resource::new("stable", "v1", "CronTab", "example.com").unwrap();
        assert_eq!(
            (r.plural.as_str(), r.kind_snake.as_str()),
            ("crontabs", "cron_tab")
        );
        assert_eq!(snake("HTTPRoute"), "http_route");
        assert_eq!(plural("policy"), "policies");
        assert_eq!(plural("gateway"), "gateways");
        assert_eq!(plural("ingress"), "ingresses");
        assert_eq!(plural("memcached"), "memcacheds");
    }

    #[test]
    fn bad_names_are_refused_with_the_flag_named() {
        for (g, v, k, flag) in [
            ("Web", "v1", "Guestbook", "--group"),
            ("web.app", "v1", "Guestbook", "--group"),
            ("", "v1", "Guestbook", "--group"),
            ("webapp", "1", "Guestbook", "--version"),
            ("webapp", "v1beta", "Guestbook", "--version"),
            ("webapp", "v01", "Guestbook", "--version"),
            ("webapp", "v1", "guestbook", "--kind"),
            ("webapp", "v1", "Guest-book", "--kind"),
            ("webapp", "v1", "Type", "--kind"),
        ] {
            let e = Resource::new(g, v, k, "my.domain").unwrap_err().to_string();
            assert!(e.starts_with(flag), "{g} {v} {k}: {e}");
        }
        assert!(is_version("v2beta3") && is_version("v1alpha1") && is_version("v10"));
    }
}
