//! The runtime's modules in layers that only import downward: each module may use the modules
//! listed before it and none after it, so there is no circle of imports and each layer reads
//! without the ones above. A new module must be given its place here.
//!
//! Read from the source (`crate::…` and `super::…` paths outside comments and test modules),
//! as `make lint` runs it; re-exports of a parent module (`pub use child::…`) are not imports.
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Bottom to top; within a layer, too, a module uses only those before it.
const LAYERS: &[(&str, &[&str])] = &[
    (
        "kinds and small helpers",
        &[
            "scope",
            "security",
            "changed",
            "conditions",
            "diff",
            "expiring",
            "backoff",
            "rbac",
            "trace",
            "migrate",
            "conversion",
            "schedule",
            "kind",
            "tuning",
        ],
    ),
    (
        "what an author declares and plans",
        &["cache", "plan", "trigger", "outside"],
    ),
    (
        "client, leader election, metrics, TLS",
        &[
            "metrics/process",
            "metrics/standard",
            "metrics",
            "leader",
            "client",
            "tls",
            "https",
        ],
    ),
    (
        "webhooks, sharding",
        &[
            "webhook/shared",
            "webhook",
            "webhook/install",
            "sharding/ring",
            "sharding/members",
            "sharding",
            "sharding/admit",
            "sharding/sharder",
        ],
    ),
    (
        "the runtime: caches and echoes, watches, the controller trait, write path, driver",
        &[
            "runtime",
            "runtime/hold",
            "runtime/shared",
            "runtime/status",
            "runtime/queue",
            "runtime/context",
            "runtime/admission",
            "runtime/resync",
            "runtime/watches",
            "runtime/watches/dynamic",
            "runtime/watches/listed",
            "reconciler",
            "runtime/write",
            "runtime/driver",
        ],
    ),
    (
        "manager and Operator",
        &["server", "manager", "registry", "operator"],
    ),
    (
        "tests in memory: an API server, and the operator run on it",
        &["testing/select", "testing/apply", "testing/server", "testing"],
    ),
];

/// Module name (`runtime/watches`) → source with comments and test modules removed.
fn modules(src: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("reading src/") {
            let path = entry.expect("reading src/").path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(src).expect("under src/").with_extension("");
            let mut name = rel.to_string_lossy().replace('\\', "/");
            if let Some(parent) = name.strip_suffix("/mod") {
                name = parent.to_string();
            }
            let text = std::fs::read_to_string(&path).expect("reading a source file");
            out.insert(name, code_of(&text));
        }
    }
    out
}

/// The non-test code of a file, without comments.
fn code_of(text: &str) -> String {
    let mut code = String::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let t = line.trim_start();
        if t == "#[cfg(test)]"
            && lines
                .peek()
                .is_some_and(|next| next.trim_start().starts_with("mod ") || next.contains(" mod "))
        {
            break;
        }
        if t.starts_with("//") {
            continue;
        }
        code.push_str(line.split(" // ").next().unwrap_or(line));
        code.push('\n');
    }
    code
}

/// The paths a piece of code names after `prefix` (`crate::` or `super::`), groups expanded:
/// `crate::{a::X, b}` gives `a::X` and `b`.
fn paths_after(code: &str, prefix: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find(prefix) {
        let before = rest[..i].chars().next_back();
        rest = &rest[i + prefix.len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
            continue;
        }
        expand(rest, &mut out);
    }
    out
}

fn expand(text: &str, out: &mut Vec<String>) {
    if let Some(inner) = text.strip_prefix('{') {
        let mut depth = 0;
        let mut item = String::new();
        for c in inner.chars() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => break,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    expand(item.trim(), out);
                    item.clear();
                    continue;
                }
                _ => {}
            }
            item.push(c);
        }
        if !item.trim().is_empty() {
            expand(item.trim(), out);
        }
        return;
    }
    let path: String = text
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
        .collect();
    match text[path.len()..].strip_prefix('{') {
        Some(group) if path.ends_with("::") => {
            let mut inner = Vec::new();
            expand(&format!("{{{group}"), &mut inner);
            out.extend(inner.into_iter().map(|i| format!("{path}{i}")));
        }
        _ => out.push(path.trim_end_matches(':').to_string()),
    }
}

/// The module a path from the crate root leads to: its longest prefix that is a module, or
/// the module a name is re-exported from at the root (`crate::Plan`).
fn resolve(path: &str, known: &BTreeSet<String>, root: &BTreeMap<String, String>) -> Option<String> {
    let segments: Vec<&str> = path.split("::").filter(|s| !s.is_empty()).collect();
    for n in (1..=segments.len()).rev() {
        let candidate = segments[..n].join("/");
        if known.contains(&candidate) {
            return Some(candidate);
        }
    }
    root.get(*segments.first()?).cloned()
}

/// Names re-exported at the root by `pub use module::{…}` in lib.rs → their module.
fn root_exports(lib: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for stmt in lib.split(';') {
        let Some(rest) = stmt.trim().strip_prefix("pub use ") else {
            continue;
        };
        let mut items = Vec::new();
        expand(rest.trim(), &mut items);
        for item in items {
            let segments: Vec<&str> = item.split("::").collect();
            if let (Some(first), Some(last)) = (segments.first(), segments.last()) {
                out.insert(last.to_string(), first.to_string());
            }
        }
    }
    out
}

#[test]
fn the_runtime_imports_only_downward() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut mods = modules(&src);
    let lib = mods.remove("lib").expect("lib.rs");
    let rank: BTreeMap<&str, usize> = LAYERS
        .iter()
        .flat_map(|(_, m)| m.iter().copied())
        .enumerate()
        .map(|(i, m)| (m, i))
        .collect();
    let layer_of = |m: &str| {
        LAYERS
            .iter()
            .find(|(_, ms)| ms.contains(&m))
            .map_or("?", |(l, _)| *l)
    };
    let known: BTreeSet<String> = mods.keys().cloned().collect();
    let root = root_exports(&lib);
    let mut problems = Vec::new();
    for m in &known {
        if !rank.contains_key(m.as_str()) {
            problems.push(format!("{m}: not placed in a layer of tests/layers.rs"));
        }
    }
    for m in rank.keys() {
        if !known.contains(*m) {
            problems.push(format!("{m}: placed in a layer but there is no such module"));
        }
    }
    for (m, code) in &mods {
        let Some(&mine) = rank.get(m.as_str()) else {
            continue;
        };
        let parent = m.rsplit_once('/').map(|(p, _)| p);
        let mut used = BTreeSet::new();
        for p in paths_after(code, "crate::") {
            used.extend(resolve(&p, &known, &root));
        }
        for p in paths_after(code, "super::") {
            let full = match parent {
                Some(parent) => format!("{}::{p}", parent.replace('/', "::")),
                None => p,
            };
            used.extend(resolve(&full, &known, &root));
        }
        for u in used {
            if u == *m {
                continue;
            }
            match rank.get(u.as_str()) {
                Some(&theirs) if theirs > mine => problems.push(format!(
                    "{m} ({}) imports {u} ({}), which comes after it",
                    layer_of(m),
                    layer_of(&u)
                )),
                _ => {}
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_check_sees_imports_in_groups_and_through_root_re_exports() {
    let code = code_of(
        "use crate::{a::X, b::{c::Y, Z}};\n// crate::hidden\nfn f() { crate::Plan::new(); super::sib::g(); }\n#[cfg(test)]\nmod tests { use crate::late; }\n",
    );
    let mut crate_paths = paths_after(&code, "crate::");
    crate_paths.sort();
    assert_eq!(crate_paths, ["Plan::new", "a::X", "b::Z", "b::c::Y"]);
    assert_eq!(paths_after(&code, "super::"), ["sib::g"]);
    let known: BTreeSet<String> = ["a", "b", "b/c", "plan"].map(String::from).into();
    let root = root_exports("pub use plan::{Plan, Child};\npub use b::c::Y;");
    assert_eq!(resolve("b::c::Y", &known, &root).as_deref(), Some("b/c"));
    assert_eq!(resolve("b::Z", &known, &root).as_deref(), Some("b"));
    assert_eq!(resolve("Plan::new", &known, &root).as_deref(), Some("plan"));
}
