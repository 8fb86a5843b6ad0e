//! Versions of one kind with different schemas, converted by the operator's webhook
//! (`/convert`, ConversionReview v1), as Kubebuilder's hub and spokes do for Go.
//!
//! Each served version is its own Rust type. One is the **hub** (by default the storage
//! version); an author writes, for every other version (a **spoke**), one function to the hub
//! and one from it. opkit composes spoke → hub → spoke, keeps `metadata` as it was but for
//! its own annotation below (the apiserver allows only labels and annotations to change), and
//! makes conversions lossless: when the target version cannot
//! express something of the source (a field it lacks), the source's content is kept in the
//! annotation `conversion.opkit.dev/<version>` of the result, and restored when the object
//! comes back to that version, with whatever was changed meanwhile in the other version
//! applied on top (a JSON merge patch). So v1 → v2 → v1 returns the original object.
//!
//! The annotation is signed (HMAC-SHA256 with a [`SigningKey`] every replica shares, over
//! the kind, namespace, name, version and content) and restored only if its signature holds:
//! content kept there was valid in its version when it was kept, whereas an annotation written
//! by hand could set fields, status included, past that version's validation and the status
//! RBAC (an annotation the same object carried earlier can still be put back). An
//! annotation that does not verify (written by hand, copied from another object, from
//! before signing, or signed with another key) is dropped with a warning. Content kept
//! there that no longer reads is ignored.
//!
//! The annotation counts against the 256 KiB of annotations an object may carry, and the
//! apiserver checks that limit on converted objects too, reads included: one object too large
//! would fail every list of the version. So content too large to keep is refused when the
//! object would be stored so (converted to the storage version, which the operator reads from
//! the CRD at start and then every few seconds; the hub until then), and
//! otherwise left out of the answer with the mark `conversion.opkit.dev/<version>-too-large`
//! (its size), which makes writing the object back in that version a refusal instead of a
//! loss.
use std::collections::BTreeMap;
use std::sync::Arc;

use kube::Resource;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

/// Prefix of the annotations that keep what a version could not express.
pub const ANNOTATION_PREFIX: &str = "conversion.opkit.dev/";

/// The key that signs the content kept in conversion annotations. Every replica must use the
/// same one (the operator reads it from a Secret it shares, see
/// [`crate::webhook::shared::ensure_key`]): content kept by one is restored by any other.
#[derive(Clone)]
pub struct SigningKey(ring::hmac::Key);

impl SigningKey {
    /// The key of `secret` (at least 32 bytes, as made by [`SigningKey::generate`]).
    pub(crate) fn new(secret: &[u8]) -> Self {
        SigningKey(ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret))
    }

    /// 32 random bytes, for a new key.
    pub(crate) fn generate() -> Result<Vec<u8>, ConversionError> {
        use ring::rand::SecureRandom;
        let mut bytes = vec![0u8; 32];
        ring::rand::SystemRandom::new()
            .fill(&mut bytes)
            .map_err(|_| ConversionError("no random bytes for a signing key".into()))?;
        Ok(bytes)
    }

    /// A key of this process alone: for tests, and for a lone replica that cannot read the
    /// shared one (what it keeps does not survive its restart).
    pub fn process() -> Self {
        static KEY: std::sync::OnceLock<SigningKey> = std::sync::OnceLock::new();
        KEY.get_or_init(|| {
            let bytes = SigningKey::generate().unwrap_or_else(|_| {
                // No system randomness: at least not a constant.
                format!("{:?}{}", std::time::SystemTime::now(), std::process::id()).into_bytes()
            });
            SigningKey::new(&bytes)
        })
        .clone()
    }

    /// What is signed: the object's identity (group, kind, namespace, name), the annotation
    /// and the kept content, each preceded by its length.
    fn message(obj: &Value, annotation: &str, kept: &str) -> Vec<u8> {
        let field = |p: &str| obj.pointer(p).and_then(Value::as_str).unwrap_or_default();
        let group = field("/apiVersion").rsplit_once('/').map_or("", |(g, _)| g);
        let mut m = Vec::with_capacity(kept.len() + 128);
        for part in [
            "opkit.dev/conversion",
            group,
            field("/kind"),
            field("/metadata/namespace"),
            field("/metadata/name"),
            annotation,
            kept,
        ] {
            m.extend_from_slice(&(part.len() as u64).to_be_bytes());
            m.extend_from_slice(part.as_bytes());
        }
        m
    }

    /// The annotation's value for `kept` on `obj`.
    fn sign(&self, obj: &Value, annotation: &str, kept: &str) -> String {
        let tag = ring::hmac::sign(&self.0, &Self::message(obj, annotation, kept));
        let hex: String = tag.as_ref().iter().map(|b| format!("{b:02x}")).collect();
        serde_json::json!({ SIGNATURE: hex, KEPT: kept }).to_string()
    }

    /// The content kept in the annotation's `value` on `obj`, if its signature holds.
    fn verify(&self, obj: &Value, annotation: &str, value: &str) -> Result<Value, &'static str> {
        let wrapped: Value = serde_json::from_str(value).map_err(|_| "not JSON")?;
        let (Some(signature), Some(kept)) = (
            wrapped.get(SIGNATURE).and_then(Value::as_str),
            wrapped.get(KEPT).and_then(Value::as_str),
        ) else {
            return Err("not signed");
        };
        let tag: Option<Vec<u8>> = (signature.len() % 2 == 0)
            .then(|| {
                (0..signature.len())
                    .step_by(2)
                    .map(|i| u8::from_str_radix(signature.get(i..i + 2)?, 16).ok())
                    .collect()
            })
            .flatten();
        let tag = tag.ok_or("signature is not hex")?;
        // Compared in constant time.
        ring::hmac::verify(&self.0, &Self::message(obj, annotation, kept), &tag)
            .map_err(|_| "signature does not match")?;
        serde_json::from_str(kept).map_err(|_| "kept content is not JSON")
    }
}

/// What the apiserver allows of an object's annotations, keys and values together.
const ANNOTATIONS_LIMIT: usize = 256 * 1024;

/// Suffix of the annotation that marks content too large to keep (its size in bytes).
const TOO_LARGE: &str = "-too-large";

/// The fields of a signed annotation's value: the signature (hex) and the content (JSON).
const SIGNATURE: &str = "hmacSHA256";
const KEPT: &str = "kept";

/// Why an object could not be converted: the apiserver shows the message to the user, so it
/// names the field and what the other version accepts.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConversionError(pub String);

impl ConversionError {
    /// An error about `field` (a path such as `spec.cronSpec`).
    pub fn field(field: &str, why: impl std::fmt::Display) -> Self {
        ConversionError(format!("{field}: {why}"))
    }
}

type Step = Arc<dyn Fn(Value) -> Result<Value, ConversionError> + Send + Sync>;

/// One served version: how to go to the hub and back, on JSON.
#[derive(Clone)]
struct Version {
    up: Step,
    down: Step,
}

/// The versions of one kind and how they convert: the hub and its spokes.
#[derive(Clone)]
pub struct Conversion {
    group: String,
    kind: String,
    plural: String,
    hub: String,
    versions: BTreeMap<String, Version>,
    /// The version objects are stored in (`group/version`), as read from the CRD; the hub
    /// until then. Shared by the clones the webhook server holds.
    storage: Arc<std::sync::RwLock<Option<String>>>,
}

fn typed<K: DeserializeOwned>(v: Value) -> Result<K, ConversionError> {
    let api_version = v
        .get("apiVersion")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    serde_json::from_value(v).map_err(|e| ConversionError(format!("reading the {api_version} object: {e}")))
}

fn json<K: Serialize>(k: &K) -> Result<Value, ConversionError> {
    serde_json::to_value(k).map_err(|e| ConversionError(format!("writing the converted object: {e}")))
}

impl Conversion {
    /// A kind whose hub is `H`: every spoke converts to and from it.
    pub fn hub<H>() -> Self
    where
        H: Resource<DynamicType = ()>,
    {
        let identity: Step = Arc::new(Ok);
        let hub = H::api_version(&()).to_string();
        Conversion {
            group: H::group(&()).to_string(),
            kind: H::kind(&()).to_string(),
            plural: H::plural(&()).to_string(),
            versions: BTreeMap::from([(
                hub.clone(),
                Version {
                    up: identity.clone(),
                    down: identity,
                },
            )]),
            hub,
            storage: Default::default(),
        }
    }

    /// Adds the spoke `S`, converted to the hub `H` by `to_hub` and back by `from_hub`. Both
    /// may copy `metadata` or leave it default: it is put back as it was either way.
    pub fn spoke<S, H>(
        mut self,
        to_hub: fn(&S) -> Result<H, ConversionError>,
        from_hub: fn(&H) -> Result<S, ConversionError>,
    ) -> Self
    where
        S: Resource<DynamicType = ()> + Serialize + DeserializeOwned + 'static,
        H: Resource<DynamicType = ()> + Serialize + DeserializeOwned + 'static,
    {
        assert_eq!(
            H::api_version(&()),
            self.hub.as_str(),
            "a spoke of {} converts to its hub",
            self.kind
        );
        let up: Step = Arc::new(move |v| json(&to_hub(&typed::<S>(v)?)?));
        let down: Step = Arc::new(move |v| json(&from_hub(&typed::<H>(v)?)?));
        self.versions
            .insert(S::api_version(&()).to_string(), Version { up, down });
        self
    }

    /// The version objects are stored in: a conversion to it is (nearly always) a write.
    fn storage(&self) -> String {
        let known = self.storage.read().unwrap_or_else(|p| p.into_inner()).clone();
        known.unwrap_or_else(|| self.hub.clone())
    }

    /// Records the CRD's storage version (`v1`), which the operator reads from the CRD.
    pub(crate) fn set_storage(&self, version: &str) {
        let api_version = format!("{}/{version}", self.group);
        *self.storage.write().unwrap_or_else(|p| p.into_inner()) = Some(api_version);
    }

    /// The CRD this conversion serves: `<plural>.<group>`.
    pub fn crd_name(&self) -> String {
        format!("{}.{}", self.plural, self.group)
    }

    /// Whether `api_version` and `kind` are objects of this conversion.
    pub fn handles(&self, api_version: &str, kind: &str) -> bool {
        kind == self.kind && self.versions.contains_key(api_version)
    }

    fn version(&self, api_version: &str) -> Result<&Version, ConversionError> {
        self.versions.get(api_version).ok_or_else(|| {
            ConversionError(format!(
                "{} has no version {api_version}; served: {}",
                self.kind,
                self.versions.keys().cloned().collect::<Vec<_>>().join(", ")
            ))
        })
    }

    /// The typed path alone: `from` → hub → `to`, with `metadata` and `kind` kept.
    fn typed_path(&self, obj: &Value, to: &str) -> Result<Value, ConversionError> {
        let from = api_version(obj);
        if from == to {
            return Ok(obj.clone());
        }
        let mut hub = (self.version(&from)?.up)(obj.clone())?;
        set_type(&mut hub, &self.hub, &self.kind);
        let mut out = (self.version(to)?.down)(hub)?;
        set_type(&mut out, to, &self.kind);
        if let (Some(o), Some(m)) = (out.as_object_mut(), obj.get("metadata")) {
            o.insert("metadata".into(), m.clone());
        }
        Ok(out)
    }

    /// Converts `obj` to `to` (an `apiVersion` such as `stable.example.com/v2`) as the
    /// operator's webhook does, signing with a key of this process ([`SigningKey::process`]):
    /// for an author's tests of a conversion.
    pub fn convert(&self, obj: &Value, to: &str) -> Result<Value, ConversionError> {
        self.convert_signed(obj, to, &SigningKey::process())
    }

    /// Converts `obj` to `to`: the typed path, then what `to` kept in an annotation restored
    /// (if signed with `key`), and what `to` cannot express of the source kept in one.
    pub(crate) fn convert_signed(
        &self,
        obj: &Value,
        to: &str,
        key: &SigningKey,
    ) -> Result<Value, ConversionError> {
        let from = api_version(obj);
        if from == to {
            return Ok(obj.clone());
        }
        self.version(to)?;
        let saved_key = annotation(to);
        let saved = annotations(obj)
            .and_then(|a| a.get(&saved_key))
            .and_then(Value::as_str)
            .and_then(|value| match key.verify(obj, &saved_key, value) {
                Ok(saved) => Some(saved),
                Err(why) => {
                    let name = obj.pointer("/metadata/name").and_then(|n| n.as_str());
                    tracing::warn!(
                        annotation = %saved_key,
                        object = name.unwrap_or_default(),
                        why,
                        "dropping a conversion annotation that opkit did not sign for this object"
                    );
                    None
                }
            });
        // Read as `from` without what only `to` can say (too large to keep): writing it back
        // in the storage version would lose that.
        let too_large_key = format!("{saved_key}{TOO_LARGE}");
        let stored = to == self.storage();
        if let Some(size) = annotations(obj).and_then(|a| a.get(&too_large_key))
            && stored
        {
            return Err(ConversionError(format!(
                "this object was read as {from} without what only {to} can express ({} bytes, too large to keep in an annotation): write it as {to}",
                size.as_str().unwrap_or_default()
            )));
        }
        // The source without the content kept for `to` (it is consumed here).
        let mut src = obj.clone();
        remove_annotation(&mut src, &saved_key);
        remove_annotation(&mut src, &too_large_key);
        let mut out = self.typed_path(&src, to)?;
        if let Some(saved) = saved.filter(Value::is_object) {
            // Kept content that no longer reads as `to` (edited by hand, or from before a
            // schema change) is ignored: one bad object must not fail a whole list.
            match self.restore(&out, &src, &saved, &from, to) {
                Ok(restored) => out = with_content(&out, &restored),
                Err(e) => tracing::warn!(
                    error = %e,
                    annotation = %saved_key,
                    "ignoring the content kept for the way back"
                ),
            }
        }
        // What `to` cannot express of the source is kept for the way back.
        let back = self.typed_path(&out, &from)?;
        let name = annotation(&from);
        remove_annotation(&mut out, &name);
        remove_annotation(&mut out, &format!("{name}{TOO_LARGE}"));
        if content(&back) != content(&src) {
            let kept = serde_json::to_string(&content(&src))
                .map_err(|e| ConversionError(format!("keeping the {from} fields: {e}")))?;
            let signed = key.sign(&out, &name, &kept);
            let others: usize = annotations(&out)
                .map(|a| {
                    a.iter()
                        .map(|(k, v)| k.len() + v.as_str().map_or(0, str::len))
                        .sum()
                })
                .unwrap_or(0);
            let size = others + name.len() + signed.len();
            if size <= ANNOTATIONS_LIMIT {
                set_annotation(&mut out, &name, signed);
            } else if stored {
                // Stored so, the object would lose it: refused, as the apiserver would refuse
                // the annotation, but saying why.
                return Err(ConversionError(format!(
                    "what {to} cannot express of this {from} object takes {} bytes in the annotation {name}, past the {ANNOTATIONS_LIMIT} bytes an object's annotations may hold: write it as {to}, or make it smaller",
                    signed.len()
                )));
            } else {
                // Read as `to` (not stored so): answered without it rather than failing every
                // list of `to`; marked, so that writing it back as `to` is refused above.
                tracing::warn!(
                    annotation = %name,
                    bytes = signed.len(),
                    "content too large to keep for the way back; writes of this object as {to} are refused"
                );
                set_annotation(&mut out, &format!("{name}{TOO_LARGE}"), signed.len().to_string());
            }
        }
        Ok(out)
    }
}

impl Conversion {
    /// What `out` (the typed conversion of `src` to `to`) becomes with the content `saved`
    /// when the object left `to`: exactly `saved` if `src` is what that became in `from`,
    /// else `saved` with the changes made since (a JSON merge patch, arrays whole).
    fn restore(
        &self,
        out: &Value,
        src: &Value,
        saved: &Value,
        from: &str,
        to: &str,
    ) -> Result<Value, ConversionError> {
        let left_as = self.typed_path(&with_content(out, saved), from)?;
        if content(&left_as) == content(src) {
            return Ok(saved.clone());
        }
        let base = content(&self.typed_path(&left_as, to)?);
        let mut merged = saved.clone();
        json_patch::merge(&mut merged, &merge_patch(&base, &content(out)));
        Ok(merged)
    }
}

/// The JSON merge patch (RFC 7396) that turns `from` into `to`.
fn merge_patch(from: &Value, to: &Value) -> Value {
    match (from, to) {
        (Value::Object(f), Value::Object(t)) => {
            let mut patch = Map::new();
            for (k, v) in t {
                match f.get(k) {
                    Some(old) if old == v => {}
                    Some(old) => {
                        patch.insert(k.clone(), merge_patch(old, v));
                    }
                    None => {
                        patch.insert(k.clone(), v.clone());
                    }
                }
            }
            for k in f.keys().filter(|k| !t.contains_key(*k)) {
                patch.insert(k.clone(), Value::Null);
            }
            Value::Object(patch)
        }
        _ => to.clone(),
    }
}

/// The annotation that keeps an object's content in `api_version` (`group/version`).
fn annotation(api_version: &str) -> String {
    let version = api_version.rsplit('/').next().unwrap_or(api_version);
    format!("{ANNOTATION_PREFIX}{version}")
}

fn api_version(obj: &Value) -> String {
    obj.get("apiVersion")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string()
}

fn set_type(obj: &mut Value, api_version: &str, kind: &str) {
    if let Some(o) = obj.as_object_mut() {
        o.insert("apiVersion".into(), api_version.into());
        o.insert("kind".into(), kind.into());
    }
}

/// Everything but `apiVersion`, `kind` and `metadata`: what a conversion changes.
fn content(obj: &Value) -> Value {
    let mut m: Map<String, Value> = obj.as_object().cloned().unwrap_or_default();
    for k in ["apiVersion", "kind", "metadata"] {
        m.remove(k);
    }
    Value::Object(m)
}

/// `obj`'s type and metadata with `content`.
fn with_content(obj: &Value, content: &Value) -> Value {
    let mut m: Map<String, Value> = content.as_object().cloned().unwrap_or_default();
    for k in ["apiVersion", "kind", "metadata"] {
        if let Some(v) = obj.get(k) {
            m.insert(k.into(), v.clone());
        }
    }
    Value::Object(m)
}

fn annotations(obj: &Value) -> Option<&Map<String, Value>> {
    obj.get("metadata")?.get("annotations")?.as_object()
}

fn remove_annotation(obj: &mut Value, key: &str) {
    let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut) else {
        return;
    };
    let empty = match meta.get_mut("annotations").and_then(Value::as_object_mut) {
        Some(a) => {
            a.remove(key);
            a.is_empty()
        }
        None => false,
    };
    if empty {
        meta.remove("annotations");
    }
}

fn set_annotation(obj: &mut Value, key: &str, value: String) {
    let Some(o) = obj.as_object_mut() else {
        return;
    };
    let meta = o.entry("metadata").or_insert_with(|| Value::Object(Map::new()));
    if let Some(meta) = meta.as_object_mut() {
        let a = meta
            .entry("annotations")
            .or_insert_with(|| Value::Object(Map::new()));
        if let Some(a) = a.as_object_mut() {
            a.insert(key.into(), value.into());
        }
    }
}

/// Converts every object of a ConversionReview request to `desired`, in order: all of them or
/// an error naming the object that could not be.
pub fn convert_all(
    conversions: &[Conversion],
    objects: &[Value],
    desired: &str,
    key: &SigningKey,
) -> Result<Vec<Value>, ConversionError> {
    objects
        .iter()
        .map(|o| {
            let (version, kind) = (
                api_version(o),
                o.get("kind").and_then(Value::as_str).unwrap_or_default(),
            );
            let name = o
                .pointer("/metadata/name")
                .and_then(Value::as_str)
                .unwrap_or_default();
            let c = conversions
                .iter()
                .find(|c| c.handles(&version, kind) && c.handles(desired, kind))
                .ok_or_else(|| {
                    ConversionError(format!("no conversion of {kind} from {version} to {desired}"))
                })?;
            c.convert_signed(o, desired, key).map_err(|e| {
                ConversionError(format!(
                    "converting {kind} {name} from {version} to {desired}: {e}"
                ))
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A hub without `spec.extra`, a spoke without `spec.zone`.
    fn conversion() -> Conversion {
        let identity: Step = Arc::new(Ok);
        let dropping = |field: &'static str| -> Step {
            Arc::new(move |mut v: Value| {
                if let Some(spec) = v.get_mut("spec").and_then(Value::as_object_mut) {
                    spec.remove(field);
                }
                Ok(v)
            })
        };
        Conversion {
            group: "example.com".into(),
            kind: "Thing".into(),
            plural: "things".into(),
            hub: "example.com/v2".into(),
            versions: BTreeMap::from([
                (
                    "example.com/v2".into(),
                    Version {
                        up: identity.clone(),
                        down: identity.clone(),
                    },
                ),
                (
                    "example.com/v1".into(),
                    Version {
                        up: dropping("extra"),
                        down: dropping("zone"),
                    },
                ),
            ]),
            storage: Default::default(),
        }
    }

    fn v1(name: &str, extra: &str) -> Value {
        json!({"apiVersion": "example.com/v1", "kind": "Thing",
               "metadata": {"name": name, "namespace": "ns"},
               "spec": {"size": 1, "extra": extra}})
    }

    #[test]
    fn kept_content_comes_back_only_with_a_signature_of_the_same_key_for_the_same_object() {
        let (c, key) = (conversion(), SigningKey::new(&[7; 32]));
        let one = v1("a", "kept");
        let two = c.convert_signed(&one, "example.com/v2", &key).unwrap();
        assert!(two["spec"].get("extra").is_none(), "{two}");
        assert_eq!(c.convert_signed(&two, "example.com/v1", &key).unwrap(), one);

        // Another key (another cluster, a lost Secret): dropped.
        let other = SigningKey::new(&[8; 32]);
        let back = c.convert_signed(&two, "example.com/v1", &other).unwrap();
        assert!(back["spec"].get("extra").is_none(), "{back}");
        assert!(back["metadata"].get("annotations").is_none(), "{back}");

        // Copied onto another object: dropped.
        let mut copied = c
            .convert_signed(&v1("b", "nothing"), "example.com/v2", &key)
            .unwrap();
        copied["metadata"]["annotations"] = two["metadata"]["annotations"].clone();
        let back = c.convert_signed(&copied, "example.com/v1", &key).unwrap();
        assert_eq!(back["spec"], json!({"size": 1}), "{back}");

        // Written by hand, unsigned (as before signing) or with the content changed: dropped.
        let value = two["metadata"]["annotations"]["conversion.opkit.dev/v1"]
            .as_str()
            .unwrap()
            .to_string();
        let mut wrapped: Value = serde_json::from_str(&value).unwrap();
        wrapped[KEPT] = json!(r#"{"spec":{"size":1,"extra":"forged"}}"#);
        for forged in [
            r#"{"spec":{"size":1,"extra":"forged"}}"#.to_string(),
            wrapped.to_string(),
            r#"{"hmacSHA256":"zz","kept":"{}"}"#.to_string(),
        ] {
            let mut hand = two.clone();
            hand["metadata"]["annotations"]["conversion.opkit.dev/v1"] = json!(forged);
            let back = c.convert_signed(&hand, "example.com/v1", &key).unwrap();
            assert_eq!(back["spec"], json!({"size": 1}), "{forged}: {back}");
        }
    }

    #[test]
    fn content_too_large_to_keep_is_refused_when_stored_and_marked_when_read() {
        let (c, key) = (conversion(), SigningKey::new(&[7; 32]));
        let big = "x".repeat(ANNOTATIONS_LIMIT);
        // Written as v1, stored as the hub: refused, naming the limit.
        let err = c
            .convert_signed(&v1("a", &big), "example.com/v2", &key)
            .unwrap_err();
        assert!(
            err.0.contains(
                "past the 262144 bytes an object's annotations may hold: write it as example.com/v2"
            ),
            "{err}"
        );
        // Stored as the hub, read as v1: answered without it, marked.
        let two = json!({"apiVersion": "example.com/v2", "kind": "Thing",
                         "metadata": {"name": "b", "namespace": "ns"},
                         "spec": {"size": 1, "zone": big}});
        let one = c.convert_signed(&two, "example.com/v1", &key).unwrap();
        assert_eq!(one["spec"], json!({"size": 1}));
        let marks = &one["metadata"]["annotations"];
        assert!(marks.get("conversion.opkit.dev/v2").is_none(), "{marks}");
        assert!(
            marks["conversion.opkit.dev/v2-too-large"]
                .as_str()
                .is_some_and(|n| n.parse::<usize>().unwrap() > ANNOTATIONS_LIMIT)
        );
        // Written back as v1: refused rather than stored without the zone.
        let err = c.convert_signed(&one, "example.com/v2", &key).unwrap_err();
        assert!(
            err.0
                .contains("read as example.com/v1 without what only example.com/v2 can express"),
            "{err}"
        );
        // Small again: kept, and no mark.
        let small = json!({"apiVersion": "example.com/v2", "kind": "Thing",
                           "metadata": {"name": "b", "namespace": "ns"},
                           "spec": {"size": 1, "zone": "z"}});
        let one = c.convert_signed(&small, "example.com/v1", &key).unwrap();
        assert!(
            one["metadata"]["annotations"]
                .get("conversion.opkit.dev/v2-too-large")
                .is_none()
        );
        assert_eq!(c.convert_signed(&one, "example.com/v2", &key).unwrap(), small);
        // With the spoke as the storage version (read from the CRD), a write of the hub
        // converts to it: refused, not stored without the zone.
        c.set_storage("v1");
        let err = c.convert_signed(&two, "example.com/v1", &key).unwrap_err();
        assert!(err.0.contains("past the 262144 bytes"), "{err}");
    }
}
