//! Reading Headway's versioned JSON files strictly: a key this version does not read is an error,
//! so a file written by a newer format is refused by name instead of being half understood.
//!
//! serde's `deny_unknown_fields` does the same for plain structs but cannot be combined with
//! `#[serde(flatten)]`, which the features manifest uses to record `prepare`'s options as
//! declared. So the check compares the file's keys with those the parsed value writes back; the
//! types read this way must write every field they read (no `skip_serializing_if`).

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

/// Parses `text` as `T`, refusing any key `T` does not hold; the error names the key's path.
pub fn from_str_strict<T: DeserializeOwned + Serialize>(text: &str) -> Result<T, String> {
    let given: Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
    let parsed: T = serde_path_to_error::deserialize(&given).map_err(|e| {
        match e.path().to_string().as_str() {
            "." => e.inner().to_string(),
            path => format!("{path}: {}", e.inner()),
        }
    })?;
    let known = serde_json::to_value(&parsed).map_err(|e| e.to_string())?;
    match unknown_key(&given, &known, "") {
        Some(path) => Err(format!(
            "unknown key `{path}` (written by a newer version of Headway?)"
        )),
        None => Ok(parsed),
    }
}

/// The first key path in `given` that `known` (the parsed value written back) lacks.
fn unknown_key(given: &Value, known: &Value, path: &str) -> Option<String> {
    match (given, known) {
        (Value::Object(given), Value::Object(known)) => given.iter().find_map(|(key, value)| {
            let child = if path.is_empty() {
                key.clone()
            } else {
                format!("{path}.{key}")
            };
            match known.get(key) {
                None => Some(child),
                Some(known) => unknown_key(value, known, &child),
            }
        }),
        (Value::Array(given), Value::Array(known)) => given
            .iter()
            .zip(known)
            .enumerate()
            .find_map(|(i, (g, k))| unknown_key(g, k, &format!("{path}[{i}]"))),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Inner {
        a: u32,
        #[serde(default)]
        b: Option<u32>,
    }

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Outer {
        name: String,
        #[serde(flatten)]
        inner: Inner,
        list: Vec<Inner>,
    }

    #[test]
    fn keys_the_type_does_not_hold_are_named_even_under_flatten() {
        let ok = r#"{"name": "x", "a": 1, "list": [{"a": 2, "b": 3}]}"#;
        let parsed: Outer = from_str_strict(ok).unwrap();
        assert_eq!(parsed.inner, Inner { a: 1, b: None });
        let err =
            from_str_strict::<Outer>(r#"{"name": "x", "a": 1, "c": 0, "list": []}"#).unwrap_err();
        assert!(err.contains("unknown key `c`"), "{err}");
        let err = from_str_strict::<Outer>(r#"{"name": "x", "a": 1, "list": [{"a": 2, "z": 1}]}"#)
            .unwrap_err();
        assert!(err.contains("unknown key `list[0].z`"), "{err}");
        let err = from_str_strict::<Outer>(r#"{"name": "x", "list": []}"#).unwrap_err();
        assert!(err.contains("missing field `a`"), "{err}");
    }
}
