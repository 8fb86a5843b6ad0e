//! YAML as opkit writes it: on serde-saphyr (what kube-client reads kubeconfigs with), block
//! style, strings on one line unless they hold newlines, so a generated file diffs line by line.

/// `value` as one YAML document (no `---`).
pub fn to_string<T: serde::Serialize>(value: &T) -> Result<String, serde_saphyr::ser::Error> {
    let options = serde_saphyr::ser_options! {
        // Never fold a long description over several lines.
        folded_wrap_chars: usize::MAX,
    };
    serde_saphyr::to_string_with_options(value, options)
}

#[cfg(test)]
mod tests {
    #[test]
    fn long_strings_stay_on_one_line_and_multi_line_strings_read_back() {
        let long = "word ".repeat(40);
        let v = serde_json::json!({"a": long.trim(), "b": "one\ntwo\n", "c": ""});
        let y = super::to_string(&v).expect("serializes");
        assert!(
            y.lines().any(|l| l.starts_with("a: word") && l.ends_with("word")),
            "{y}"
        );
        let back: serde_json::Value = serde_saphyr::from_str(&y).expect("parses");
        assert_eq!(back, v);
    }
}
