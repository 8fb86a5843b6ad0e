//! Admission webhooks served by the operator: an HTTPS server (self-signed certificate made at
//! start, or files mounted by cert-manager and reloaded when they change) routing
//! `AdmissionReview`s to typed defaulting and validating handlers.
//!
//! kube-rs ships the `AdmissionReview` types; this adds the serving, the certificates and the
//! plumbing, as Kubebuilder's `create webhook` does for Go.
mod install;

pub use install::{Endpoint, WebhookOptions, configurations, rbac_rules, service_name, start};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::body::Bytes;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use futures::future::BoxFuture;
use kube::Resource;
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;

/// What a handler decides about one request.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Verdict {
    /// `Some(message)` refuses the request; the message is what `kubectl` prints.
    pub denied: Option<String>,
    /// JSON Patch operations (mutating handlers only).
    pub patch: Vec<json_patch::PatchOperation>,
    /// Admission warnings, shown by `kubectl` as `Warning: ...`.
    pub warnings: Vec<String>,
}

impl Verdict {
    /// Allow, unchanged.
    pub fn allow() -> Self {
        Verdict::default()
    }

    /// Refuse with a message a person understands.
    pub fn deny(message: impl Into<String>) -> Self {
        Verdict {
            denied: Some(message.into()),
            ..Default::default()
        }
    }

    /// Adds a warning.
    pub fn warn(mut self, message: impl Into<String>) -> Self {
        self.warnings.push(message.into());
        self
    }
}

/// The request as a handler sees it: operation, the new object and the old one (on updates).
pub struct Review<K> {
    pub operation: Operation,
    pub object: Option<K>,
    pub old_object: Option<K>,
    pub namespace: Option<String>,
}

type Handler =
    Arc<dyn Fn(AdmissionRequest<DynamicObject>) -> BoxFuture<'static, AdmissionResponse> + Send + Sync>;

/// Which requests the apiserver sends to one webhook: the webhook configuration entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    /// Unique webhook name, e.g. `mmemcached.opkit.dev`.
    pub name: &'static str,
    /// HTTP path it is served at.
    pub path: &'static str,
    pub group: &'static str,
    pub versions: &'static [&'static str],
    /// Plural resource name, e.g. `memcacheds`.
    pub resource: &'static str,
    /// `CREATE`, `UPDATE`, ...
    pub operations: &'static [&'static str],
}

/// A set of webhook handlers, one HTTP path each, with the rules that route requests to them.
#[derive(Default, Clone)]
pub struct Webhooks {
    handlers: HashMap<String, Handler>,
    pub(crate) mutating: Vec<Rule>,
    pub(crate) validating: Vec<Rule>,
}

fn typed<K: DeserializeOwned>(o: &Option<DynamicObject>) -> Result<Option<K>, String> {
    o.as_ref()
        .map(|d| serde_json::to_value(d).and_then(serde_json::from_value::<K>))
        .transpose()
        .map_err(|e| e.to_string())
}

impl Webhooks {
    /// An empty set.
    pub fn new() -> Self {
        Webhooks::default()
    }

    /// A defaulting webhook for kind `K`: `handler` returns the JSON patch to apply.
    pub fn mutating<K, F, Fut>(mut self, rule: Rule, handler: F) -> Self
    where
        K: Resource + DeserializeOwned + Send + 'static,
        F: Fn(Review<K>) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Verdict> + Send + 'static,
    {
        self = self.handle(rule.path, handler);
        self.mutating.push(rule);
        self
    }

    /// A validating webhook for kind `K`.
    pub fn validating<K, F, Fut>(mut self, rule: Rule, handler: F) -> Self
    where
        K: Resource + DeserializeOwned + Send + 'static,
        F: Fn(Review<K>) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Verdict> + Send + 'static,
    {
        self = self.handle(rule.path, handler);
        self.validating.push(rule);
        self
    }

    /// Serves `handler` for kind `K` at `path` (e.g. `/mutate-memcached`), with no rule: the
    /// apiserver is not told about it.
    pub fn handle<K, F, Fut>(mut self, path: &str, handler: F) -> Self
    where
        K: Resource + DeserializeOwned + Send + 'static,
        F: Fn(Review<K>) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Verdict> + Send + 'static,
    {
        let handler = Arc::new(handler);
        let h: Handler = Arc::new(move |req: AdmissionRequest<DynamicObject>| {
            let handler = handler.clone();
            Box::pin(async move {
                let base = AdmissionResponse::from(&req);
                let (object, old_object) = match (typed::<K>(&req.object), typed::<K>(&req.old_object)) {
                    (Ok(o), Ok(old)) => (o, old),
                    (Err(e), _) | (_, Err(e)) => return base.deny(format!("cannot read the object: {e}")),
                };
                let verdict = handler(Review {
                    operation: req.operation.clone(),
                    object,
                    old_object,
                    namespace: req.namespace.clone(),
                })
                .await;
                let mut resp = match verdict.denied {
                    Some(m) => base.deny(m),
                    None if verdict.patch.is_empty() => base,
                    None => match base.clone().with_patch(json_patch::Patch(verdict.patch)) {
                        Ok(r) => r,
                        Err(e) => base.deny(format!("internal error encoding the patch: {e}")),
                    },
                };
                if !verdict.warnings.is_empty() {
                    resp.warnings = Some(verdict.warnings);
                }
                resp
            })
        });
        self.handlers.insert(path.to_string(), h);
        self
    }

    /// Adds every webhook of `other`.
    pub fn merge(mut self, other: Webhooks) -> Self {
        self.handlers.extend(other.handlers);
        self.mutating.extend(other.mutating);
        self.validating.extend(other.validating);
        self
    }

    /// Whether there is nothing to serve.
    pub fn is_empty(&self) -> bool {
        self.handlers.is_empty()
    }

    /// The paths served, for the webhook configurations.
    pub fn paths(&self) -> Vec<String> {
        let mut p: Vec<String> = self.handlers.keys().cloned().collect();
        p.sort();
        p
    }

    /// The HTTP routes (TLS is added by [`serve`]).
    pub fn router(&self) -> Router {
        let mut r = Router::new();
        for (path, h) in &self.handlers {
            let h = h.clone();
            r = r.route(path, post(move |body: Bytes| review(h.clone(), body)));
        }
        r
    }
}

/// Decodes an `AdmissionReview`; a body that is not one gets a 400 with the reason.
async fn review(h: Handler, body: Bytes) -> Response {
    let review: AdmissionReview<DynamicObject> = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return (StatusCode::BAD_REQUEST, format!("not an AdmissionReview: {e}")).into_response(),
    };
    let req: AdmissionRequest<DynamicObject> = match review.try_into() {
        Ok(r) => r,
        Err(e) => {
            return (
                StatusCode::BAD_REQUEST,
                format!("AdmissionReview without a request: {e}"),
            )
                .into_response();
        }
    };
    let resp = h(req).await;
    match serde_json::to_vec(&resp.into_review()) {
        Ok(body) => ([(axum::http::header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// A serving certificate: PEM chain and key.
#[derive(Clone)]
pub struct Certificate {
    pub cert_pem: String,
    pub key_pem: String,
    /// The CA that signed it, for the configurations' `caBundle`.
    pub ca_pem: String,
}

/// Makes a CA and a serving certificate for `hosts` (DNS names or IP addresses), valid a year.
pub fn self_signed(hosts: &[String]) -> Result<Certificate, rcgen::Error> {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
    let ca_key = KeyPair::generate()?;
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.distinguished_name.push(DnType::CommonName, "opkit-webhook-ca");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_cert = ca.self_signed(&ca_key)?;
    let issuer = rcgen::Issuer::new(ca, ca_key);
    let key = KeyPair::generate()?;
    let mut leaf = CertificateParams::new(hosts.to_vec())?;
    leaf.distinguished_name.push(DnType::CommonName, "opkit-webhook");
    let cert = leaf.signed_by(&key, &issuer)?;
    Ok(Certificate {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
        ca_pem: ca_cert.pem(),
    })
}

/// Where the serving certificate comes from.
#[derive(Clone)]
pub enum CertSource {
    /// Made in memory at start.
    Generated(Certificate),
    /// `tls.crt` and `tls.key` in a directory (a cert-manager Secret mount), reloaded when they
    /// change, so a renewed certificate is served without a restart.
    Dir(PathBuf),
}

fn certified_key(cert_pem: &[u8], key_pem: &[u8]) -> Result<CertifiedKey, String> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("reading the certificate: {e}"))?;
    if chain.is_empty() {
        return Err("no certificate in the PEM".into());
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| format!("reading the key: {e}"))?;
    let key =
        rustls::crypto::ring::sign::any_supported_type(&key).map_err(|e| format!("unsupported key: {e}"))?;
    Ok(CertifiedKey::new(chain, key))
}

#[derive(Debug)]
struct Resolver(RwLock<Arc<CertifiedKey>>);

impl ResolvesServerCert for Resolver {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.read().unwrap_or_else(|e| e.into_inner()).clone())
    }
}

fn read_dir_cert(dir: &Path) -> Result<(CertifiedKey, SystemTime), String> {
    let (c, k) = (dir.join("tls.crt"), dir.join("tls.key"));
    let read = |p: &Path| std::fs::read(p).map_err(|e| format!("reading {}: {e}", p.display()));
    let mtime = |p: &Path| {
        std::fs::metadata(p)
            .and_then(|m| m.modified())
            .unwrap_or(SystemTime::UNIX_EPOCH)
    };
    Ok((certified_key(&read(&c)?, &read(&k)?)?, mtime(&c).max(mtime(&k))))
}

/// Errors starting the webhook server.
#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    #[error("webhook certificate: {0}")]
    Certificate(String),
    #[error("configuring the {what} webhooks: {source}")]
    Configure { what: &'static str, source: kube::Error },
    #[error("binding the webhook server on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// Serves `webhooks` over HTTPS on `addr` until `shutdown`; returns once listening.
pub async fn serve(
    webhooks: &Webhooks,
    addr: SocketAddr,
    certs: CertSource,
    shutdown: CancellationToken,
) -> Result<tokio::task::JoinHandle<()>, WebhookError> {
    let (initial, dir) = match &certs {
        CertSource::Generated(c) => (
            certified_key(c.cert_pem.as_bytes(), c.key_pem.as_bytes()).map_err(WebhookError::Certificate)?,
            None,
        ),
        CertSource::Dir(d) => {
            let (k, t) = read_dir_cert(d).map_err(WebhookError::Certificate)?;
            (k, Some((d.clone(), t)))
        }
    };
    let resolver = Arc::new(Resolver(RwLock::new(Arc::new(initial))));
    if let Some((dir, mut seen)) = dir {
        let (resolver, shutdown) = (resolver.clone(), shutdown.clone());
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_secs(10)) => {}
                }
                match read_dir_cert(&dir) {
                    Ok((k, t)) if t > seen => {
                        *resolver.0.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(k);
                        seen = t;
                        tracing::info!(dir = %dir.display(), "reloaded the webhook certificate");
                    }
                    Ok(_) => {}
                    Err(e) => tracing::warn!(error = %e, "webhook certificate not reloaded"),
                }
            }
        });
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| WebhookError::Certificate(e.to_string()))?
        .with_no_client_auth()
        .with_cert_resolver(resolver);
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| WebhookError::Bind { addr, source })?;
    tracing::info!(%addr, paths = ?webhooks.paths(), "serving admission webhooks");
    let app = webhooks.router();
    Ok(tokio::spawn(async move {
        loop {
            let (stream, _) = tokio::select! {
                _ = shutdown.cancelled() => return,
                r = listener.accept() => match r {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::warn!(error = %e, "accepting a webhook connection failed");
                        continue;
                    }
                },
            };
            let (acceptor, app) = (acceptor.clone(), app.clone());
            tokio::spawn(async move {
                let tls = match acceptor.accept(stream).await {
                    Ok(t) => t,
                    Err(e) => {
                        tracing::debug!(error = %e, "TLS handshake failed");
                        return;
                    }
                };
                let svc = hyper_util::service::TowerToHyperService::new(app);
                let builder =
                    hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new());
                if let Err(e) = builder
                    .serve_connection(hyper_util::rt::TokioIo::new(tls), svc)
                    .await
                {
                    tracing::debug!(error = %e, "webhook connection ended with an error");
                }
            });
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generated_certificate_loads() {
        let c = self_signed(&["localhost".into(), "127.0.0.1".into()]).unwrap();
        assert!(certified_key(c.cert_pem.as_bytes(), c.key_pem.as_bytes()).is_ok());
        assert!(c.ca_pem.contains("BEGIN CERTIFICATE"));
    }

    #[test]
    fn garbage_is_not_a_certificate() {
        assert!(certified_key(b"nope", b"nope").is_err());
    }
}
