//! One webhook CA and serving certificate for every replica, without cert-manager: kept in a
//! Secret in the operator's namespace, created once under optimistic concurrency (the first
//! replica's create wins, the others read it) and rotated before it expires.
//!
//! Rotation never leaves the apiserver without a CA for the certificate being served: the
//! replica that rotates writes the new pair next to the old one with a time to switch; until
//! then every replica serves the old certificate while the `caBundle` trusts both CAs, and
//! replicas re-read the Secret far more often than that delay.
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Api;
use kube::api::{ObjectMeta, PostParams};

use crate::tls::{Certificate, VALIDITY, self_signed_until};

/// A certificate with less than this left is replaced.
pub const RENEW_BEFORE: SignedDuration = SignedDuration::from_hours(30 * 24);
/// After a rotation, how long replicas keep serving the previous certificate while the
/// `caBundle` (both CAs) reaches the apiserver.
pub const SWITCH_AFTER: SignedDuration = SignedDuration::from_secs(120);
/// How often replicas re-read the Secret (well under [`SWITCH_AFTER`]).
pub const RELOAD_EVERY: std::time::Duration = std::time::Duration::from_secs(30);

const NOT_AFTER: &str = "opkit.dev/not-after";
const HOSTS: &str = "opkit.dev/hosts";
const SERVE_FROM: &str = "opkit.dev/serve-new-from";

/// The Secret's name: `<project>-webhook-server-cert`.
pub fn secret_name(project: &str) -> String {
    format!("{project}-webhook-server-cert")
}

/// What a replica serves and what the apiserver must trust.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shared {
    /// The certificate to serve now (its `ca_pem` is unused).
    pub serving: (String, String),
    /// PEM of every CA to trust: the current one, and the previous one during a rotation.
    pub ca_bundle: String,
}

fn get(s: &Secret, key: &str) -> Option<String> {
    let v = s.data.as_ref()?.get(key)?;
    String::from_utf8(v.0.clone()).ok()
}

fn annotation(s: &Secret, key: &str) -> Option<String> {
    s.metadata.annotations.as_ref()?.get(key).cloned()
}

/// What `secret` says to serve at `now`; `None` if it must be (re)made: missing fields, other
/// hosts, or close to expiry.
pub fn read(secret: &Secret, hosts: &str, now: Timestamp) -> Option<Shared> {
    let (cert, key, ca) = (
        get(secret, "tls.crt")?,
        get(secret, "tls.key")?,
        get(secret, "ca.crt")?,
    );
    if annotation(secret, HOSTS).as_deref() != Some(hosts) {
        return None;
    }
    let not_after: Timestamp = annotation(secret, NOT_AFTER)?.parse().ok()?;
    if not_after.checked_sub(RENEW_BEFORE).ok()? <= now {
        return None;
    }
    let previous = (
        get(secret, "previous-tls.crt"),
        get(secret, "previous-tls.key"),
        get(secret, "previous-ca.crt"),
    );
    let switch: Option<Timestamp> = annotation(secret, SERVE_FROM).and_then(|t| t.parse().ok());
    match (previous, switch) {
        ((Some(pc), Some(pk), Some(pca)), Some(from)) => Some(Shared {
            serving: if now < from { (pc, pk) } else { (cert, key) },
            ca_bundle: format!("{ca}{pca}"),
        }),
        _ => Some(Shared {
            serving: (cert, key),
            ca_bundle: ca,
        }),
    }
}

/// A Secret holding a fresh pair for `hosts`, keeping `old`'s pair (if it is still usable)
/// as the previous one until [`SWITCH_AFTER`].
fn make(name: &str, hosts: &[String], old: Option<&Secret>, now: Timestamp) -> Result<Secret, String> {
    let not_after = now.checked_add(VALIDITY).map_err(|e| e.to_string())?;
    let Certificate {
        cert_pem,
        key_pem,
        ca_pem,
    } = self_signed_until(hosts, not_after).map_err(|e| e.to_string())?;
    let mut data = std::collections::BTreeMap::new();
    let mut put = |k: &str, v: String| data.insert(k.to_string(), ByteString(v.into_bytes()));
    put("tls.crt", cert_pem);
    put("tls.key", key_pem);
    put("ca.crt", ca_pem);
    let mut annotations = std::collections::BTreeMap::from([
        (NOT_AFTER.to_string(), not_after.to_string()),
        (HOSTS.to_string(), hosts.join(",")),
    ]);
    // The old pair stays in use until the new CA has reached the apiserver, unless it is
    // already expired or for other hosts (then nobody can use it anyway).
    let old_usable = old.and_then(|o| {
        let expired = annotation(o, NOT_AFTER)
            .and_then(|t| t.parse::<Timestamp>().ok())
            .is_none_or(|t| t <= now);
        let same_hosts = annotation(o, HOSTS).as_deref() == Some(hosts.join(",").as_str());
        (!expired && same_hosts).then_some(o)
    });
    if let Some(o) = old_usable
        && let (Some(c), Some(k), Some(ca)) = (get(o, "tls.crt"), get(o, "tls.key"), get(o, "ca.crt"))
    {
        put("previous-tls.crt", c);
        put("previous-tls.key", k);
        put("previous-ca.crt", ca);
        let from = now.checked_add(SWITCH_AFTER).map_err(|e| e.to_string())?;
        annotations.insert(SERVE_FROM.to_string(), from.to_string());
    }
    Ok(Secret {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            annotations: Some(annotations),
            resource_version: old.and_then(|o| o.metadata.resource_version.clone()),
            ..Default::default()
        },
        type_: Some("kubernetes.io/tls".into()),
        data: Some(data),
        ..Default::default()
    })
}

/// Why the shared certificate could not be used, and whether trying again soon may help.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct EnsureError {
    /// What failed.
    pub message: String,
    /// A server error, throttling or a connection problem; not a missing namespace, a refusal
    /// or an invalid object, which the same request will meet again.
    pub transient: bool,
}

fn api_error(what: String, e: &kube::Error) -> EnsureError {
    EnsureError {
        message: format!("{what}: {e}"),
        transient: match e {
            kube::Error::Api(s) => s.code >= 500 || s.code == 429,
            _ => true,
        },
    }
}

/// Reads the shared certificate, creating the Secret if it is missing and rotating it if it is
/// due. Concurrent replicas settle on one Secret: a create or update that loses the race (409)
/// reads again.
pub async fn ensure(secrets: &Api<Secret>, name: &str, hosts: &[String]) -> Result<Shared, EnsureError> {
    let fixed = |message: String| EnsureError {
        message,
        transient: false,
    };
    let joined = hosts.join(",");
    for _ in 0..5 {
        let now = Timestamp::now();
        let live = secrets
            .get_opt(name)
            .await
            .map_err(|e| api_error(format!("reading Secret {name}"), &e))?;
        if let Some(s) = live.as_ref().and_then(|s| read(s, &joined, now)) {
            return Ok(s);
        }
        let fresh = make(name, hosts, live.as_ref(), now).map_err(fixed)?;
        let pp = PostParams::default();
        let written = match &live {
            None => secrets.create(&pp, &fresh).await,
            Some(_) => secrets.replace(name, &pp, &fresh).await,
        };
        match written {
            Ok(s) => {
                tracing::info!(
                    secret = name,
                    rotated = live.is_some(),
                    "wrote the shared webhook certificate"
                );
                return read(&s, &joined, now)
                    .ok_or_else(|| fixed(format!("Secret {name} unusable right after writing it")));
            }
            Err(kube::Error::Api(e)) if e.code == 409 => continue,
            Err(e) => return Err(api_error(format!("writing Secret {name}"), &e)),
        }
    }
    Err(EnsureError {
        message: format!("Secret {name} kept changing while being written"),
        transient: true,
    })
}

/// The Secret of the key that signs conversion annotations: `<project>-conversion-key`. Kept
/// apart from the certificate, which rotates: a new key would drop what was kept before.
pub fn key_secret_name(project: &str) -> String {
    format!("{project}-conversion-key")
}

/// The data field of the key in its Secret.
const KEY: &str = "key";

/// Reads the conversion signing key from the Secret `name`, creating it with a random key if
/// it is missing (the first replica's create wins, the others read it).
pub async fn ensure_key(secrets: &Api<Secret>, name: &str) -> Result<Vec<u8>, EnsureError> {
    let fixed = |message: String| EnsureError {
        message,
        transient: false,
    };
    let key_of = |s: &Secret| {
        s.data
            .as_ref()
            .and_then(|d| d.get(KEY))
            .map(|k| k.0.clone())
            .filter(|k| k.len() >= 32)
            .ok_or_else(|| fixed(format!("Secret {name} has no {KEY} of at least 32 bytes")))
    };
    for _ in 0..3 {
        if let Some(s) = secrets
            .get_opt(name)
            .await
            .map_err(|e| api_error(format!("reading Secret {name}"), &e))?
        {
            return key_of(&s);
        }
        let key = crate::conversion::SigningKey::generate().map_err(|e| fixed(e.0))?;
        let fresh = Secret {
            metadata: ObjectMeta {
                name: Some(name.to_string()),
                ..Default::default()
            },
            data: Some([(KEY.to_string(), ByteString(key))].into()),
            ..Default::default()
        };
        match secrets.create(&PostParams::default(), &fresh).await {
            Ok(s) => {
                tracing::info!(secret = name, "made the conversion signing key");
                return key_of(&s);
            }
            Err(kube::Error::Api(e)) if e.code == 409 => continue,
            Err(e) => return Err(api_error(format!("creating Secret {name}"), &e)),
        }
    }
    Err(EnsureError {
        message: format!("Secret {name} kept changing while being read"),
        transient: true,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ts(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    #[test]
    fn only_server_errors_throttling_and_connection_problems_are_worth_a_retry() {
        let status =
            |code: u16| kube::Error::Api(kube::core::Status::failure("x", "y").with_code(code).boxed());
        for (code, transient) in [
            (404, false),
            (403, false),
            (422, false),
            (429, true),
            (500, true),
            (503, true),
        ] {
            assert_eq!(
                api_error("reading".into(), &status(code)).transient,
                transient,
                "{code}"
            );
        }
        let refused = kube::Error::Service("connection refused".into());
        assert!(api_error("reading".into(), &refused).transient);
    }

    #[test]
    fn a_fresh_secret_serves_its_pair_and_trusts_its_ca() {
        let hosts = vec!["svc.ns.svc".to_string()];
        let now = ts("2026-01-01T00:00:00Z");
        let s = make("x", &hosts, None, now).unwrap();
        let shared = read(&s, "svc.ns.svc", now).unwrap();
        assert_eq!(shared.serving.0, get(&s, "tls.crt").unwrap());
        assert_eq!(shared.ca_bundle, get(&s, "ca.crt").unwrap());
        // Other hosts, or close to the end of its validity: made again.
        assert!(read(&s, "other.ns.svc", now).is_none());
        assert!(read(&s, "svc.ns.svc", ts("2026-12-05T00:00:00Z")).is_none());
        assert!(read(&s, "svc.ns.svc", ts("2026-11-15T00:00:00Z")).is_some());
    }

    #[test]
    fn a_rotation_trusts_both_cas_and_switches_only_after_the_delay() {
        let hosts = vec!["svc.ns.svc".to_string()];
        let t0 = ts("2026-01-01T00:00:00Z");
        let old = make("x", &hosts, None, t0).unwrap();
        let due = ts("2026-12-10T00:00:00Z");
        assert!(read(&old, "svc.ns.svc", due).is_none(), "due for rotation");
        let new = make("x", &hosts, Some(&old), due).unwrap();
        let during = read(&new, "svc.ns.svc", due).unwrap();
        assert_eq!(
            during.serving.0,
            get(&old, "tls.crt").unwrap(),
            "old pair until the switch"
        );
        assert!(during.ca_bundle.contains(&get(&old, "ca.crt").unwrap()));
        assert!(during.ca_bundle.contains(&get(&new, "ca.crt").unwrap()));
        let after = read(&new, "svc.ns.svc", due.checked_add(SWITCH_AFTER).unwrap()).unwrap();
        assert_eq!(after.serving.0, get(&new, "tls.crt").unwrap());
        assert!(
            after.ca_bundle.contains(&get(&old, "ca.crt").unwrap()),
            "both CAs kept until the next rotation"
        );
    }

    #[test]
    fn an_expired_or_foreign_old_pair_is_not_kept() {
        let t0 = ts("2026-01-01T00:00:00Z");
        let old = make("x", &["a.ns.svc".to_string()], None, t0).unwrap();
        let new = make("x", &["b.ns.svc".to_string()], Some(&old), t0).unwrap();
        assert!(get(&new, "previous-tls.crt").is_none());
        let later = ts("2028-01-01T00:00:00Z");
        let new = make("x", &["a.ns.svc".to_string()], Some(&old), later).unwrap();
        assert!(get(&new, "previous-tls.crt").is_none());
    }
}
