//! The Rust shown in the README and in `docs/` is code that compiles: every ` ```rust ` block
//! is preceded by `<!-- compiled: FILE... -->` naming the compiled files it is taken from, and
//! its lines appear in them, in order. Between the lines shown, the files may have more (a
//! snippet shows the part that matters); within a line, `/* ... */` stands for the text left
//! out. Lines that are only a comment or `...` are prose, not code, and are not looked up, and
//! so is a comment at the end of a line. Rust in a doc comment (a doctest) counts as code.
//!
//! A template of the scaffold (`crates/scaffold/templates/*.tmpl`) counts as compiled: the
//! scaffold test builds a project from it. `{{name}}=Value` after the files fills in its
//! placeholders.
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every markdown file whose Rust is checked.
fn markdown() -> Vec<PathBuf> {
    let mut files = vec![root().join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .expect("docs/")
        .map(|e| e.expect("docs/ entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

/// A snippet's line: the pieces it must contain in this order (more than one where
/// `/* ... */` leaves text out), or `None` for a line that is prose.
fn pieces(line: &str) -> Option<Vec<String>> {
    let line = code(line);
    if line.is_empty() || line == "..." || line.starts_with("//") {
        return None;
    }
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(start) = rest.find("/*") {
        let end = rest[start..]
            .find("*/")
            .map(|e| start + e + 2)
            .unwrap_or(rest.len());
        out.push(rest[..start].trim().to_string());
        rest = &rest[end..];
    }
    out.push(rest.trim().to_string());
    // A line that is only an elision is prose too.
    (!out.iter().all(String::is_empty)).then_some(out)
}

/// A line without its indentation, a trailing comment, or the `///`/`//!` of a doctest.
fn code(line: &str) -> &str {
    let line = line.trim();
    let line = ["/// ", "//! "]
        .iter()
        .find_map(|p| line.strip_prefix(p))
        .unwrap_or(line);
    match line.find(" // ") {
        Some(i) => line[..i].trim_end(),
        None => line,
    }
}

/// Whether the source line `src` is the snippet line made of `pieces`.
fn matches(src: &str, pieces: &[String]) -> bool {
    let src = code(src);
    if let [only] = pieces {
        return src == only;
    }
    let (first, last) = (&pieces[0], &pieces[pieces.len() - 1]);
    if !src.starts_with(first.as_str())
        || !src.ends_with(last.as_str())
        || src.len() < first.len() + last.len()
    {
        return false;
    }
    let mut middle = &src[first.len()..src.len() - last.len()];
    for p in &pieces[1..pieces.len() - 1] {
        match middle.find(p.as_str()) {
            Some(i) => middle = &middle[i + p.len()..],
            None => return false,
        }
    }
    true
}

/// The first line of `snippet` not found, in order, in `source`.
fn missing<'a>(snippet: &'a str, source: &str) -> Option<&'a str> {
    let mut lines = source.lines();
    for line in snippet.lines() {
        let Some(pieces) = pieces(line) else { continue };
        if !lines.any(|src| matches(src, &pieces)) {
            return Some(line);
        }
    }
    None
}

/// The compiled source a marker names: its files one after the other, placeholders filled.
fn source(marker: &str, doc: &Path) -> String {
    let mut text = String::new();
    let mut fills = Vec::new();
    for word in marker.split_whitespace() {
        match word.split_once('=') {
            Some((name, value)) => fills.push((name.to_string(), value.to_string())),
            None => {
                assert!(
                    word.ends_with(".rs") || word.ends_with(".rs.tmpl"),
                    "{}: {word} named in a compiled marker is not Rust source or a scaffold template",
                    doc.display()
                );
                let path = root().join(word);
                text += &std::fs::read_to_string(&path)
                    .unwrap_or_else(|e| panic!("{}: {word} named in a compiled marker: {e}", doc.display()));
                text.push('\n');
            }
        }
    }
    for (name, value) in fills {
        text = text.replace(&name, &value);
    }
    text
}

#[test]
fn every_rust_snippet_in_the_docs_is_taken_from_compiled_code() {
    let mut failures = Vec::new();
    let mut checked = 0;
    for doc in markdown() {
        let text = std::fs::read_to_string(&doc).expect("markdown");
        let lines: Vec<&str> = text.lines().collect();
        let mut i = 0;
        while i < lines.len() {
            // Every Rust block: ```rust, ```rust,ignore, ```rs, ...
            let fence = lines[i].trim();
            let rust = fence
                .strip_prefix("```")
                .is_some_and(|info| info.starts_with("rust") || info.split([',', ' ']).next() == Some("rs"));
            if !rust {
                i += 1;
                continue;
            }
            let at = format!("{}:{}", doc.strip_prefix(root()).unwrap_or(&doc).display(), i + 1);
            let end = (i + 1..lines.len())
                .find(|&j| lines[j].trim() == "```")
                .unwrap_or_else(|| panic!("{at}: a rust block that is not closed"));
            let snippet = lines[i + 1..end].join("\n");
            let marker = lines[..i]
                .iter()
                .rev()
                .take_while(|l| !l.trim_start().starts_with("```"))
                .take(4)
                .find_map(|l| {
                    l.trim()
                        .strip_prefix("<!-- compiled:")
                        .and_then(|m| m.strip_suffix("-->"))
                });
            match marker {
                None => failures.push(format!(
                    "{at}: no `<!-- compiled: FILE -->` before this rust block"
                )),
                Some(m) => {
                    if let Some(line) = missing(&snippet, &source(m, &doc)) {
                        failures.push(format!(
                            "{at}: not in {}, in this order: {}",
                            m.trim(),
                            line.trim()
                        ));
                    }
                    checked += 1;
                }
            }
            i = end + 1;
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(
        checked >= 10,
        "only {checked} snippets found: is the markdown still read?"
    );
}

#[test]
fn a_snippet_line_matches_only_the_code_it_shows() {
    let src = "fn a() {\n    let x = f(1, 2);\n    Ok(Plan::status(s, Requeue::OnChange).child(c))\n}\n";
    assert_eq!(
        missing(
            "let x = f(1, 2);\n// prose\n...\nOk(Plan::status(s, /* ... */).child(c))",
            src
        ),
        None
    );
    assert_eq!(missing("let x = f(1, 3);", src), Some("let x = f(1, 3);"));
    // Out of order.
    assert!(
        missing(
            "Ok(Plan::status(s, Requeue::OnChange).child(c))\nlet x = f(1, 2);",
            src
        )
        .is_some()
    );
    // An elision does not stand for a line break.
    assert!(missing("fn a() { /* ... */ }", src).is_some());
    // Comments at the end of a line are prose; a doctest's lines are code.
    assert_eq!(missing("let x = f(1, 2); // two", src), None);
    assert_eq!(missing("let y = 1;", "/// let y = 1;\n"), None);
}
