//! Admission webhooks served by the operator: an HTTPS server (self-signed certificate made at
//! start, or files mounted by cert-manager and reloaded when they change) routing
//! `AdmissionReview`s to typed defaulting and validating handlers.
//!
//! kube-rs ships the `AdmissionReview` types; this adds the serving, the certificates and the
//! plumbing, as Kubebuilder's `create webhook` does for Go.
mod install;
pub mod shared;

pub use crate::tls::{CertSource, Certificate, self_signed, self_signed_until};
pub use install::{
    Endpoint, WebhookOptions, configurations, crd_conversion, key_secret_rules, rbac_rules, secret_rules,
    service_name, start, with_conversions,
};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use futures::future::BoxFuture;
use kube::{Client, Resource};

use crate::conversion::{Conversion, SigningKey};
use crate::kind::Watchable;
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
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
    /// The invalid fields of a refusal made with [`Verdict::invalid`], as (field, message).
    pub invalid: Vec<(String, String)>,
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

    /// Admits `object` as `defaulted`, a copy of it with what the user left out filled in:
    /// opkit computes the JSON Patch between the two (none when nothing changed). Both are
    /// the typed object, so fields the type does not know are never touched.
    pub fn defaulted<K: serde::Serialize>(object: &K, defaulted: &K) -> Self {
        match (serde_json::to_value(object), serde_json::to_value(defaulted)) {
            (Ok(from), Ok(to)) => Verdict {
                patch: json_patch::diff(&from, &to).0,
                ..Verdict::default()
            },
            (Err(e), _) | (_, Err(e)) => Verdict::deny(format!("internal error encoding the object: {e}")),
        }
    }

    /// Refuses the request as invalid at `field` (`spec.schedule`), the way the apiserver's
    /// own validation does (and controller-runtime's `apierrors.NewInvalid`): HTTP 422, reason
    /// `Invalid`, one cause per field, so `kubectl` prints `The Kind "name" is invalid:
    /// spec.schedule: <message>` and clients can tell which field to fix. Chain
    /// [`Verdict::and_invalid`] for more fields.
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Verdict::default().and_invalid(field, message)
    }

    /// Adds an invalid field to a refusal (see [`Verdict::invalid`]).
    pub fn and_invalid(mut self, field: impl Into<String>, message: impl Into<String>) -> Self {
        self.invalid.push((field.into(), message.into()));
        let all: Vec<String> = self.invalid.iter().map(|(f, m)| format!("{f}: {m}")).collect();
        self.denied = Some(all.join("; "));
        self
    }

    /// Adds a warning.
    pub fn warn(mut self, message: impl Into<String>) -> Self {
        self.warnings.push(message.into());
        self
    }
}

/// The request as a handler sees it: operation, the new object and the old one (on updates),
/// and the operator's client for a handler that must read the cluster. Declaring webhooks
/// needs no client, so generating their configurations needs no cluster.
#[non_exhaustive]
pub struct Review<K> {
    /// `Create`, `Update`, `Delete` or `Connect`.
    pub operation: Operation,
    /// The object as it would be stored (absent on delete).
    pub object: Option<K>,
    /// The stored object (updates and deletes only).
    pub old_object: Option<K>,
    /// The request's namespace (absent for cluster-scoped kinds).
    pub namespace: Option<String>,
    client: Option<Client>,
}

impl<K> Review<K> {
    /// A request without a client, for a handler's unit test.
    pub fn new(
        operation: Operation,
        object: Option<K>,
        old_object: Option<K>,
        namespace: Option<&str>,
    ) -> Self {
        Review {
            operation,
            object,
            old_object,
            namespace: namespace.map(String::from),
            client: None,
        }
    }

    /// The operator's client, for a handler that reads the cluster. Every replica serves the
    /// webhooks, leading or not, so this client has no write gate: a handler reads, and
    /// leaves writing to the controllers. Always there when the operator serves the request;
    /// `None` in a [`Review::new`].
    pub fn client(&self) -> Option<&Client> {
        self.client.as_ref()
    }
}

type Handler = Arc<
    dyn Fn(AdmissionRequest<DynamicObject>, Option<Client>) -> BoxFuture<'static, AdmissionResponse>
        + Send
        + Sync,
>;

/// Which requests the apiserver sends to one webhook: the webhook configuration entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    /// Unique webhook name, e.g. `vat-v1alpha1.cnat.programming-kubernetes.info`.
    pub name: &'static str,
    /// HTTP path it is served at.
    pub path: &'static str,
    /// The API group, e.g. `cache.example.com`.
    pub group: &'static str,
    /// The versions sent to this webhook; list each one the handler can read.
    pub versions: &'static [&'static str],
    /// Plural resource name, e.g. `memcacheds`.
    pub resource: &'static str,
    /// `CREATE`, `UPDATE`, ...
    pub operations: &'static [&'static str],
    /// What the apiserver does with a request when the webhook cannot answer.
    pub failure_policy: FailurePolicy,
    /// Whether `resource` lives in namespaces or in the cluster.
    pub scope: RuleScope,
}

impl Rule {
    /// The rule of kind `K`'s validating webhook, all from the kind, as Kubebuilder names it:
    /// `v<kind>-<version>.<group>` served at `/validate-<group with dashes>-<version>-<kind>`, for
    /// `CREATE` and `UPDATE` of `K`'s version, failing closed. Change what differs with
    /// [`Rule::failure_policy`], [`Rule::operations`] or [`Rule::versions`].
    pub fn validating<K: Watchable>() -> Rule {
        Rule::of::<K>("v", "validate")
    }

    /// The rule of kind `K`'s defaulting webhook: as [`Rule::validating`], named
    /// `m<kind>-<version>.<group>` and served at `/mutate-<group with dashes>-<version>-<kind>`.
    pub fn mutating<K: Watchable>() -> Rule {
        Rule::of::<K>("m", "mutate")
    }

    fn of<K: Watchable>(prefix: &str, verb: &str) -> Rule {
        let (group, version) = (K::group(&()), K::version(&()));
        let kind = K::kind(&()).to_lowercase();
        // A webhook's name has at least three parts: built-in groups (`apps`, the core
        // group's "") have fewer, and take the `k8s.io` their API groups live under.
        let domain = match group.as_ref() {
            "" => "core.k8s.io".to_string(),
            g if !g.contains('.') => format!("{g}.k8s.io"),
            g => g.to_string(),
        };
        Rule {
            name: intern(format!("{prefix}{kind}-{version}.{domain}")),
            path: intern(format!("/{verb}-{}-{version}-{kind}", group.replace('.', "-"))),
            group: intern(group.into_owned()),
            versions: intern_list(vec![version.into_owned()]),
            resource: intern(K::plural(&()).into_owned()),
            operations: &["CREATE", "UPDATE"],
            failure_policy: FailurePolicy::Fail,
            scope: if crate::kind::namespaced::<K>() {
                RuleScope::Namespaced
            } else {
                RuleScope::Cluster
            },
        }
    }

    /// What the apiserver does when the webhook cannot answer.
    pub fn failure_policy(mut self, policy: FailurePolicy) -> Rule {
        self.failure_policy = policy;
        self
    }

    /// The operations sent to the webhook (`CREATE`, `UPDATE`, `DELETE`, `CONNECT`).
    pub fn operations(mut self, operations: &'static [&'static str]) -> Rule {
        self.operations = operations;
        self
    }

    /// The versions sent to the webhook: every one the handler can read (a hub's spokes
    /// are converted before they reach it only if listed here).
    pub fn versions(mut self, versions: &'static [&'static str]) -> Rule {
        self.versions = versions;
        self
    }
}

/// The one `&'static` copy of `s`: rules are made from a kind's names at start, possibly many
/// times in one process (tests), and kept as long as the server.
pub(crate) fn intern(s: String) -> &'static str {
    static SEEN: Interned<str> = Interned::new(std::collections::BTreeSet::new());
    interned(&SEEN, s.into_boxed_str())
}

fn intern_list(items: Vec<String>) -> &'static [&'static str] {
    static SEEN: Interned<[&'static str]> = Interned::new(std::collections::BTreeSet::new());
    let items: Vec<&'static str> = items.into_iter().map(intern).collect();
    interned(&SEEN, items.into_boxed_slice())
}

type Interned<T> = std::sync::Mutex<std::collections::BTreeSet<&'static T>>;

/// The copy of `value` in `seen`, leaked and added the first time.
fn interned<T: Ord + ?Sized>(seen: &Interned<T>, value: Box<T>) -> &'static T {
    let mut seen = seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(v) = seen.get(&*value) {
        return v;
    }
    let v: &'static T = Box::leak(value);
    seen.insert(v);
    v
}

/// What the apiserver does with a request when the webhook cannot answer (the operator is
/// down, the call times out, the answer is unreadable): the configuration's `failurePolicy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum FailurePolicy {
    /// Refuse the request, naming the webhook. Kubebuilder's default: what the webhook checks
    /// stays enforced while the operator is down, at the price of refusing those requests.
    #[default]
    Fail,
    /// Let the request through as if the webhook had allowed it unchanged. Only for webhooks
    /// whose checks also hold further down (the schema, the controller).
    Ignore,
}

impl FailurePolicy {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            FailurePolicy::Fail => "Fail",
            FailurePolicy::Ignore => "Ignore",
        }
    }
}

/// Where the objects of a rule's resource live: the rule's `scope`. The apiserver only calls
/// a webhook for objects of its scope, so a rule for a cluster-scoped kind must say `Cluster`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum RuleScope {
    /// Objects in a namespace.
    #[default]
    Namespaced,
    /// Cluster-scoped objects.
    Cluster,
}

impl RuleScope {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            RuleScope::Namespaced => "Namespaced",
            RuleScope::Cluster => "Cluster",
        }
    }
}

/// A set of webhook handlers, one HTTP path each, with the rules that route requests to them.
#[derive(Default, Clone)]
pub struct Webhooks {
    handlers: HashMap<String, Handler>,
    pub(crate) mutating: Vec<Rule>,
    pub(crate) validating: Vec<Rule>,
    pub(crate) conversions: Vec<Conversion>,
    /// Paths whose requests only come from some namespaces (a controller's scope).
    pub(crate) scoped: HashMap<String, Vec<String>>,
    metrics: Option<crate::metrics::Metrics>,
    client: Option<Client>,
    /// Signs what conversions keep in annotations.
    conversion_key: KeySource,
}

/// Where the conversions' [`SigningKey`] comes from.
#[derive(Clone, Default)]
enum KeySource {
    /// This process's ([`SigningKey::process`]): tests, a lone local run.
    #[default]
    Process,
    /// The replicas' shared key, once read; until then conversions that need it fail, naming
    /// `why`, rather than keep content no other replica could restore.
    Shared {
        key: Arc<std::sync::OnceLock<SigningKey>>,
        why: Arc<str>,
    },
}

/// Where the apiserver sends ConversionReviews (one path for every kind, as Kubebuilder does).
pub const CONVERT_PATH: &str = "/convert";

/// A refusal as the apiserver's own validation makes it: 422, `Invalid`, a cause per field.
fn invalid(
    base: AdmissionResponse,
    req: &AdmissionRequest<DynamicObject>,
    message: String,
    fields: Vec<(String, String)>,
) -> AdmissionResponse {
    use kube::core::response::{StatusCause, StatusDetails};
    let mut resp = base.deny(&message);
    resp.result = kube::core::Status::failure(&message, "Invalid")
        .with_code(422)
        .with_details(StatusDetails {
            name: req.name.clone(),
            group: req.kind.group.clone(),
            kind: req.kind.kind.clone(),
            causes: fields
                .into_iter()
                .map(|(field, message)| StatusCause {
                    reason: "FieldValueInvalid".into(),
                    message,
                    field,
                })
                .collect(),
            uid: String::new(),
            retry_after_seconds: 0,
        });
    resp
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

    /// A defaulting webhook for kind `K`: `handler` returns the JSON patch to apply. An object
    /// that does not read as `K` (a value the schema will refuse, such as an unknown enum
    /// value) is admitted unchanged, so that the apiserver's schema validation, which runs
    /// after the mutating webhooks, refuses it with its own message ("Unsupported value").
    pub fn mutating<K, F, Fut>(mut self, rule: Rule, handler: F) -> Self
    where
        K: Resource + DeserializeOwned + Send + 'static,
        F: Fn(Review<K>) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Verdict> + Send + 'static,
    {
        self = self.serve(rule.path, true, handler);
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
    /// apiserver is not told about it. An object that does not read as `K` is refused.
    pub fn handle<K, F, Fut>(self, path: &str, handler: F) -> Self
    where
        K: Resource + DeserializeOwned + Send + 'static,
        F: Fn(Review<K>) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Verdict> + Send + 'static,
    {
        self.serve(path, false, handler)
    }

    /// [`Webhooks::handle`]; with `mutating`, an object that does not read as `K` is admitted
    /// unchanged for the schema to refuse.
    fn serve<K, F, Fut>(mut self, path: &str, mutating: bool, handler: F) -> Self
    where
        K: Resource + DeserializeOwned + Send + 'static,
        F: Fn(Review<K>) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Verdict> + Send + 'static,
    {
        let handler = Arc::new(handler);
        let h: Handler = Arc::new(
            move |req: AdmissionRequest<DynamicObject>, client: Option<Client>| {
                let handler = handler.clone();
                Box::pin(async move {
                    let base = AdmissionResponse::from(&req);
                    let (object, old_object) = match (typed::<K>(&req.object), typed::<K>(&req.old_object)) {
                        (Ok(o), Ok(old)) => (o, old),
                        (Err(e), _) | (_, Err(e)) if mutating => {
                            tracing::debug!(error = %e, "not defaulted: the object does not read; the schema decides");
                            return base;
                        }
                        (Err(e), _) | (_, Err(e)) => {
                            return base.deny(format!("cannot read the object: {e}"));
                        }
                    };
                    let verdict = handler(Review {
                        operation: req.operation.clone(),
                        object,
                        old_object,
                        namespace: req.namespace.clone(),
                        client,
                    })
                    .await;
                    let mut resp = match verdict.denied {
                        Some(m) if !verdict.invalid.is_empty() => invalid(base, &req, m, verdict.invalid),
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
            },
        );
        self.handlers.insert(path.to_string(), h);
        self
    }

    /// Converts the versions of a kind (served at [`CONVERT_PATH`]); its CRD gets
    /// `strategy: Webhook` in the manifests and its `caBundle` kept current like the
    /// admission webhooks'.
    pub fn conversion(mut self, conversion: Conversion) -> Self {
        self.conversions.push(conversion);
        self
    }

    /// Counts every request in `metrics` (controller-runtime's `controller_runtime_webhook_*`
    /// families, by path; a path not served counts as `other`).
    pub fn with_metrics(mut self, metrics: crate::metrics::Metrics) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Hands `client` to every handler in its [`Review`] ([`start`] does this with the
    /// operator's client).
    pub fn with_client(mut self, client: Client) -> Self {
        self.client = Some(client);
        self
    }

    /// Signs what the conversions keep in annotations with the key `key` holds, which every
    /// replica shares ([`start`] reads it from the Secret [`shared::ensure_key`] keeps);
    /// conversions that need it fail, saying `why`, until it holds one.
    pub(crate) fn with_conversion_key(
        mut self,
        key: Arc<std::sync::OnceLock<SigningKey>>,
        why: String,
    ) -> Self {
        self.conversion_key = KeySource::Shared {
            key,
            why: Arc::from(why),
        };
        self
    }

    /// Adds every webhook of `other`.
    pub fn merge(mut self, other: Webhooks) -> Self {
        self.handlers.extend(other.handlers);
        self.mutating.extend(other.mutating);
        self.validating.extend(other.validating);
        self.conversions.extend(other.conversions);
        self.scoped.extend(other.scoped);
        self.client = self.client.or(other.client);
        if matches!(self.conversion_key, KeySource::Process) {
            self.conversion_key = other.conversion_key;
        }
        self
    }

    /// Has the apiserver send the webhook at `path` only the requests of `namespaces` (and
    /// of cluster-scoped objects).
    pub(crate) fn in_namespaces(mut self, path: &str, namespaces: Vec<String>) -> Self {
        self.scoped.insert(path.to_string(), namespaces);
        self
    }

    /// Whether there is nothing to serve.
    pub fn is_empty(&self) -> bool {
        self.handlers.is_empty() && self.conversions.is_empty()
    }

    /// The paths served, for the webhook configurations.
    pub fn paths(&self) -> Vec<String> {
        let mut p: Vec<String> = self.handlers.keys().cloned().collect();
        if !self.conversions.is_empty() {
            p.push(CONVERT_PATH.into());
        }
        p.sort();
        p
    }

    /// The names of the CRDs converted by this server.
    pub fn conversion_crds(&self) -> Vec<String> {
        self.conversions.iter().map(Conversion::crd_name).collect()
    }

    /// The HTTP routes (TLS is added by [`serve`]). Reading the body and answering must
    /// finish within [`limits::REQUEST`], well inside the apiserver's own call timeout.
    pub fn router(&self) -> Router {
        let mut r = Router::new();
        for (path, h) in &self.handlers {
            let (h, client) = (h.clone(), self.client.clone());
            r = r.route(
                path,
                post(move |body: Bytes| review(h.clone(), client.clone(), body))
                    .layer(axum::extract::DefaultBodyLimit::max(limits::BODY)),
            );
        }
        if !self.conversions.is_empty() {
            let conversions = Arc::new(self.conversions.clone());
            let key = self.conversion_key.clone();
            r = r.route(
                CONVERT_PATH,
                post(move |body: Bytes| convert(conversions.clone(), key.clone(), body))
                    .layer(axum::extract::DefaultBodyLimit::max(limits::BODY)),
            );
        }
        let budget = Arc::new(tokio::sync::Semaphore::new(limits::BODIES_IN_FLIGHT / 1024));
        let (metrics, paths) = (self.metrics.clone(), Arc::new(self.paths()));
        r.layer(axum::middleware::from_fn(
            move |req: axum::extract::Request, next: axum::middleware::Next| {
                let budget = budget.clone();
                async move {
                    // Its declared length (the apiserver always sends one), else the maximum.
                    let len = req
                        .headers()
                        .get(axum::http::header::CONTENT_LENGTH)
                        .and_then(|v| v.to_str().ok()?.parse::<usize>().ok())
                        .unwrap_or(limits::BODY);
                    if len > limits::BODY {
                        return (StatusCode::PAYLOAD_TOO_LARGE, "admission request too large")
                            .into_response();
                    }
                    // Small bodies (every real review) never wait: 256 connections of them
                    // are bounded anyway. Large ones take a share of the budget first.
                    let _share = if len > limits::SMALL_BODY {
                        let kib = u32::try_from(len.div_ceil(1024)).unwrap_or(u32::MAX);
                        match budget.acquire_many(kib).await {
                            Ok(p) => Some(p),
                            Err(_) => {
                                return (StatusCode::SERVICE_UNAVAILABLE, "shutting down").into_response();
                            }
                        }
                    } else {
                        None
                    };
                    let (parts, body) = req.into_parts();
                    let bytes = match tokio::time::timeout(
                        limits::BODY_READ,
                        axum::body::to_bytes(body, limits::BODY),
                    )
                    .await
                    {
                        Ok(Ok(b)) => b,
                        Ok(Err(e)) => {
                            return (StatusCode::BAD_REQUEST, format!("reading the request: {e}"))
                                .into_response();
                        }
                        Err(_) => {
                            return (StatusCode::REQUEST_TIMEOUT, "the request body came too slowly")
                                .into_response();
                        }
                    };
                    next.run(axum::extract::Request::from_parts(
                        parts,
                        axum::body::Body::from(bytes),
                    ))
                    .await
                }
            },
        ))
        .layer(axum::middleware::from_fn(
            |req: axum::extract::Request, next: axum::middleware::Next| async move {
                match tokio::time::timeout(limits::REQUEST, next.run(req)).await {
                    Ok(resp) => resp,
                    Err(_) => {
                        (StatusCode::REQUEST_TIMEOUT, "admission request took too long").into_response()
                    }
                }
            },
        ))
        .layer(axum::middleware::from_fn(
            move |req: axum::extract::Request, next: axum::middleware::Next| {
                let (metrics, paths) = (metrics.clone(), paths.clone());
                async move {
                    let Some(metrics) = metrics else {
                        return next.run(req).await;
                    };
                    // Known paths only: a label per arbitrary path would let any client grow
                    // the series without bound.
                    let path = req.uri().path();
                    let webhook = if paths.iter().any(|p| p == path) {
                        path
                    } else {
                        "other"
                    };
                    let timer = metrics.webhook_started(webhook);
                    let resp = next.run(req).await;
                    timer.finish(resp.status().as_u16());
                    resp
                }
            },
        ))
    }
}

/// Answers a `ConversionReview`: every object converted, or a failure naming the one that
/// could not be (the apiserver then refuses the request with that message).
async fn convert(conversions: Arc<Vec<Conversion>>, key: KeySource, body: Bytes) -> Response {
    use kube::core::conversion::{ConversionRequest, ConversionResponse, ConversionReview};
    let review: ConversionReview = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return (StatusCode::BAD_REQUEST, format!("not a ConversionReview: {e}")).into_response(),
    };
    let req = match ConversionRequest::from_review(review) {
        Ok(r) => r,
        Err(e) => return (StatusCode::BAD_REQUEST, e.to_string()).into_response(),
    };
    let (objects, desired) = (req.objects.clone(), req.desired_api_version.clone());
    let resp = ConversionResponse::for_request(req);
    let key = match key {
        KeySource::Process => Ok(SigningKey::process()),
        KeySource::Shared { key, why } => key.get().cloned().ok_or(why),
    };
    let converted = match key {
        Ok(key) => crate::conversion::convert_all(&conversions, &objects, &desired, &key),
        Err(why) => Err(crate::conversion::ConversionError(why.to_string())),
    };
    let resp = match converted {
        Ok(converted) => resp.success(converted),
        Err(e) => {
            tracing::info!(error = %e, "conversion refused");
            resp.failure(kube::core::Status::failure(&e.0, "ConversionFailed"))
        }
    };
    match serde_json::to_vec(&resp.into_review()) {
        Ok(body) => ([(axum::http::header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// Decodes an `AdmissionReview`; a body that is not one gets a 400 with the reason.
async fn review(h: Handler, client: Option<Client>, body: Bytes) -> Response {
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
    let resp = h(req, client).await;
    match serde_json::to_vec(&resp.into_review()) {
        Ok(body) => ([(axum::http::header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// What one client may cost the webhook server: it runs in the operator's process, whose
/// memory limit also covers the controllers, and any Pod in the cluster can connect to it.
pub mod limits {
    use std::time::Duration;

    /// A TLS handshake longer than this is dropped.
    pub const HANDSHAKE: Duration = Duration::from_secs(10);
    /// A request's headers must arrive within this of its first byte (HTTP/1), so a slow
    /// sender holds a connection slot only briefly. An idle keep-alive connection stays open
    /// longer (see [`IDLE`]).
    pub const HEADERS: Duration = Duration::from_secs(5);
    /// Reading a request and answering it; the apiserver itself waits at most 30 s.
    pub const REQUEST: Duration = Duration::from_secs(30);
    /// The largest request body: the apiserver's own limit on an object is 3 MiB, and a review
    /// carries the object and its old version.
    pub const BODY: usize = 7 * 1024 * 1024;
    /// Connections open at once; further ones wait in the listen backlog.
    pub const CONNECTIONS: usize = 256;
    /// Bytes of request bodies being read or decoded at once, over all connections: a
    /// request waits (within [`REQUEST`]) for its share, so a flood of large bodies cannot
    /// take the server past its memory limit. Real AdmissionReviews are a few KiB.
    pub const BODIES_IN_FLIGHT: usize = 8 * 1024 * 1024;
    /// Bodies up to this size (every real AdmissionReview) skip [`BODIES_IN_FLIGHT`]: all
    /// [`CONNECTIONS`] of them together stay small.
    pub const SMALL_BODY: usize = 64 * 1024;
    /// The whole body must arrive within this once the headers have (the apiserver sends it
    /// at once), so a slow sender holds a connection slot only briefly.
    pub const BODY_READ: Duration = Duration::from_secs(5);
    /// After SIGTERM the server still accepts and answers this long, each answer closing its
    /// connection, so the apiserver moves to another replica without a request failing (a
    /// conversion has no failure policy). The process waits for it before exiting.
    pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
    /// A connection with no request for this long is closed: longer than the 90 s after
    /// which the apiserver (a Go HTTP client) drops an idle connection itself, so it never
    /// writes a request into a connection closed under it.
    pub const IDLE: Duration = crate::https::IDLE;
    /// A connection this old answers its next request with `Connection: close`, so a client
    /// cannot keep a slot for ever by sending a request now and then.
    pub const CONNECTION_AGE: Duration = Duration::from_secs(120);
}

/// Errors starting the webhook server.
#[derive(Debug, thiserror::Error)]
#[allow(missing_docs)] // every variant says what failed in its message
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

/// Serves `webhooks` over HTTPS on `addr` until `shutdown`; returns once listening. HTTP/1.1
/// only unless `http2` (as Kubebuilder does: HTTP/2's streams multiply what one connection
/// can make the server hold, and the apiserver speaks HTTP/1.1 to webhooks anyway).
pub async fn serve(
    webhooks: &Webhooks,
    addr: SocketAddr,
    certs: CertSource,
    http2: bool,
    shutdown: CancellationToken,
) -> Result<tokio::task::JoinHandle<()>, WebhookError> {
    let acceptor =
        crate::tls::acceptor(&certs, http2, "webhook", &shutdown).map_err(WebhookError::Certificate)?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| WebhookError::Bind { addr, source })?;
    tracing::info!(%addr, paths = ?webhooks.paths(), "serving admission webhooks");
    let conns = crate::https::Limits {
        connections: limits::CONNECTIONS,
        handshake: limits::HANDSHAKE,
        headers: limits::HEADERS,
        idle: limits::IDLE,
        reclaim: crate::https::RECLAIM,
        age: limits::CONNECTION_AGE,
        drain: limits::REQUEST,
        grace: limits::SHUTDOWN_GRACE,
        http2,
    };
    Ok(crate::https::serve(
        "webhook",
        listener,
        Some(acceptor),
        webhooks.router(),
        conns,
        shutdown,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::https::tests::connect_tls;
    use crate::tls::certified_key;
    use kube::core::DynamicObject;
    use std::time::Duration;

    #[test]
    fn a_rule_is_made_from_its_kind_as_kubebuilder_names_it() {
        use k8s_openapi::api::apps::v1::Deployment;
        use k8s_openapi::api::core::v1::Namespace;
        let v = Rule::validating::<Deployment>();
        assert_eq!(
            (v.name, v.path, v.group, v.versions, v.resource),
            (
                "vdeployment-v1.apps.k8s.io",
                "/validate-apps-v1-deployment",
                "apps",
                &["v1"][..],
                "deployments"
            )
        );
        assert_eq!(
            (v.operations, v.failure_policy, v.scope),
            (
                &["CREATE", "UPDATE"][..],
                FailurePolicy::Fail,
                RuleScope::Namespaced
            )
        );
        let m = Rule::mutating::<Namespace>()
            .failure_policy(FailurePolicy::Ignore)
            .operations(&["CREATE"]);
        assert_eq!(
            (m.name, m.path, m.scope),
            (
                "mnamespace-v1.core.k8s.io",
                "/mutate--v1-namespace",
                RuleScope::Cluster
            )
        );
        assert_eq!(
            (m.operations, m.failure_policy),
            (&["CREATE"][..], FailurePolicy::Ignore)
        );
        // Made again, the same strings: nothing more is kept.
        assert!(std::ptr::eq(Rule::validating::<Deployment>().path, v.path));
    }

    #[test]
    fn a_key_that_does_not_match_its_certificate_is_refused() {
        let a = self_signed(&["a.example".into()]).unwrap();
        let b = self_signed(&["a.example".into()]).unwrap();
        assert!(certified_key(a.cert_pem.as_bytes(), a.key_pem.as_bytes()).is_ok());
        let err = certified_key(a.cert_pem.as_bytes(), b.key_pem.as_bytes())
            .expect_err("a mismatched key is refused");
        assert!(err.contains("does not match"), "{err}");
    }

    #[test]
    fn a_generated_certificate_loads() {
        let c = self_signed(&["localhost".into(), "127.0.0.1".into()]).unwrap();
        assert!(certified_key(c.cert_pem.as_bytes(), c.key_pem.as_bytes()).is_ok());
        assert!(c.ca_pem.contains("BEGIN CERTIFICATE"));
    }

    /// One request over TLS with a raw HTTP/1.1 body; the status line.
    async fn post(port: u16, ca: &str, body: &str) -> std::io::Result<String> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut tls = connect_tls(port, ca).await?;
        let req = format!(
            "POST /validate HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        tls.write_all(req.as_bytes()).await?;
        tls.flush().await?;
        let mut out = String::new();
        tls.read_to_string(&mut out).await?;
        Ok(out.lines().next().unwrap_or_default().to_string())
    }

    #[tokio::test]
    async fn an_object_that_does_not_read_is_left_to_the_schema_by_a_mutating_webhook_only() {
        use k8s_openapi::api::core::v1::ConfigMap;
        let rule = |path| Rule {
            name: "x.example.com",
            path,
            group: "",
            versions: &["v1"],
            resource: "configmaps",
            operations: &["CREATE"],
            failure_policy: FailurePolicy::Fail,
            scope: RuleScope::Namespaced,
        };
        let called = |_: Review<ConfigMap>| async { Verdict::deny("the handler ran") };
        let hooks = Webhooks::new()
            .mutating(rule("/m"), called)
            .validating(rule("/v"), called);
        // Not a ConfigMap: data values are strings.
        let review = || {
            creating(
                ("", "ConfigMap", "configmaps"),
                serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"a": 1}}),
            )
        };
        let m = (hooks.handlers["/m"])(review(), None).await;
        assert!(
            m.allowed && m.patch.is_none(),
            "admitted unchanged: {:?}",
            m.result
        );
        let v = (hooks.handlers["/v"])(review(), None).await;
        assert!(
            !v.allowed && v.result.message.contains("cannot read the object"),
            "{:?}",
            v.result
        );
    }

    #[test]
    fn a_defaulted_object_becomes_the_patch_of_what_changed() {
        use k8s_openapi::api::core::v1::ConfigMap;
        let mut cm = ConfigMap::default();
        cm.metadata.name = Some("c".into());
        assert!(
            Verdict::defaulted(&cm, &cm.clone()).patch.is_empty(),
            "nothing changed"
        );
        let mut defaulted = cm.clone();
        defaulted.data = Some([("colour".to_string(), "blue".to_string())].into());
        let v = Verdict::defaulted(&cm, &defaulted);
        assert!(v.denied.is_none());
        let mut patched = serde_json::to_value(&cm).unwrap();
        json_patch::patch(&mut patched, &v.patch).unwrap();
        assert_eq!(patched, serde_json::to_value(&defaulted).unwrap());
    }

    /// The request to create `object` (named by its metadata) of (group, kind, resource) v1 in
    /// namespace `ns`, as the apiserver sends it.
    fn creating(
        (group, kind, resource): (&str, &str, &str),
        object: serde_json::Value,
    ) -> AdmissionRequest<DynamicObject> {
        let review: AdmissionReview<DynamicObject> = serde_json::from_value(serde_json::json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {
                "uid": "u1", "name": object["metadata"]["name"], "namespace": "ns", "operation": "CREATE",
                "userInfo": {},
                "kind": {"group": group, "version": "v1", "kind": kind},
                "resource": {"group": group, "version": "v1", "resource": resource},
                "object": object
            }
        }))
        .unwrap();
        review.try_into().unwrap()
    }

    #[tokio::test]
    async fn an_invalid_verdict_is_a_422_with_a_cause_per_field() {
        let hooks = Webhooks::new().handle::<DynamicObject, _, _>("/v", |_| async {
            Verdict::invalid("spec.size", "must be at least 1").and_invalid("spec.image", "must not be empty")
        });
        let req = creating(
            ("cache.example.com", "Memcached", "memcacheds"),
            serde_json::json!({"apiVersion": "cache.example.com/v1", "kind": "Memcached", "metadata": {"name": "m"}}),
        );
        let resp = (hooks.handlers["/v"])(req, None).await;
        let v = serde_json::to_value(resp.into_review()).unwrap();
        let (r, status) = (&v["response"], &v["response"]["status"]);
        assert_eq!(r["allowed"], false, "{v}");
        assert_eq!(
            (status["code"].as_u64(), status["reason"].as_str()),
            (Some(422), Some("Invalid"))
        );
        let details = &status["details"];
        assert_eq!(
            (details["kind"].as_str(), details["name"].as_str()),
            (Some("Memcached"), Some("m"))
        );
        let causes: Vec<(&str, &str)> = details["causes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| (c["field"].as_str().unwrap(), c["message"].as_str().unwrap()))
            .collect();
        assert_eq!(
            causes,
            [
                ("spec.size", "must be at least 1"),
                ("spec.image", "must not be empty")
            ]
        );
        assert_eq!(
            status["message"],
            "spec.size: must be at least 1; spec.image: must not be empty"
        );
    }

    /// A webhook server with one validating webhook that allows everything, on a free port.
    async fn validating_server() -> (
        Certificate,
        SocketAddr,
        CancellationToken,
        tokio::task::JoinHandle<()>,
    ) {
        let cert = self_signed(&["127.0.0.1".into()]).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let shutdown = CancellationToken::new();
        let hooks = Webhooks::new().validating::<DynamicObject, _, _>(
            Rule {
                name: "v.example.com",
                path: "/validate",
                group: "example.com",
                versions: &["v1"],
                resource: "things",
                operations: &["CREATE"],
                failure_policy: FailurePolicy::Ignore,
                scope: RuleScope::Namespaced,
            },
            |_| async { Verdict::allow() },
        );
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        let server = serve(
            &hooks,
            addr,
            CertSource::Generated(cert.clone()),
            false,
            shutdown.clone(),
        )
        .await
        .unwrap();
        (cert, addr, shutdown, server)
    }

    #[tokio::test]
    async fn a_connection_made_late_in_the_grace_period_is_answered_after_it() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (cert, addr, shutdown, server) = validating_server().await;
        let port = addr.port();
        shutdown.cancel();
        // A client (the apiserver, through a Service that still lists this replica) connects
        // near the end of the grace period...
        tokio::time::sleep(limits::SHUTDOWN_GRACE - Duration::from_millis(800)).await;
        let mut tls = connect_tls(port, &cert.ca_pem).await.unwrap();
        // ...and its request arrives only once the server has stopped accepting.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while tokio::net::TcpStream::connect(addr).await.is_ok() {
            assert!(std::time::Instant::now() < deadline, "the server still accepts");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let req = "POST /validate HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}";
        tls.write_all(req.as_bytes()).await.unwrap();
        tls.flush().await.unwrap();
        let mut out = String::new();
        let _ = tls.read_to_string(&mut out).await;
        assert!(out.starts_with("HTTP/1.1 400"), "not answered: {out:?}");
        assert!(out.to_lowercase().contains("connection: close"), "{out}");
        tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .expect("the server ends once its connections have")
            .unwrap();
    }

    #[tokio::test]
    async fn idle_connections_are_dropped_and_cannot_starve_the_apiserver() {
        use tokio::io::AsyncReadExt;
        let (cert, addr, shutdown, _server) = validating_server().await;
        let port = addr.port();
        // More silent connections than the server takes at once: none sends a byte.
        let mut idle = Vec::new();
        for _ in 0..limits::CONNECTIONS + 20 {
            idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        let started = std::time::Instant::now();
        // A real client gets its answer as soon as the oldest silent connection has had its
        // second: it gives its slot up.
        let status = tokio::time::timeout(crate::https::UNPROVEN * 3, post(port, &cert.ca_pem, "{}"))
            .await
            .expect("answered while idle connections were held")
            .unwrap();
        assert!(status.starts_with("HTTP/1.1 400"), "{status}");
        // The first silent connection was closed by the server (EOF or reset), not kept.
        let mut buf = [0u8; 1];
        let read = tokio::time::timeout(limits::HANDSHAKE, idle[0].read(&mut buf))
            .await
            .expect("the server closed the idle connection");
        assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
        assert!(
            started.elapsed() < crate::https::UNPROVEN * 3,
            "{:?}",
            started.elapsed()
        );
        shutdown.cancel();
    }

    #[tokio::test]
    async fn a_sustained_flood_of_silent_connections_does_not_delay_a_real_client() {
        let (cert, addr, shutdown, _server) = validating_server().await;
        let port = addr.port();
        // 60 new connections a second that never send a byte, for 12 s: more than the slots
        // the handshake timeout frees (256 per 10 s), so without reclaiming the ones still
        // handshaking they queue up in front of every real client.
        let flood = tokio::spawn(async move {
            let mut held = std::collections::VecDeque::new();
            let mut tick = tokio::time::interval(Duration::from_millis(1000 / 60));
            let end = std::time::Instant::now() + Duration::from_secs(12);
            while std::time::Instant::now() < end {
                tick.tick().await;
                if let Ok(s) = tokio::net::TcpStream::connect(addr).await {
                    held.push_back(s);
                }
                // The flooder keeps its latest 400 open: within the test's open files limit.
                if held.len() > 400 {
                    held.pop_front();
                }
            }
            held
        });
        // A real client, once every slot has been taken, every 250 ms.
        tokio::time::sleep(Duration::from_secs(5)).await;
        let mut slowest = Duration::ZERO;
        while !flood.is_finished() {
            let t = std::time::Instant::now();
            let status = tokio::time::timeout(Duration::from_secs(20), post(port, &cert.ca_pem, "{}"))
                .await
                .expect("answered during the flood")
                .unwrap();
            assert!(status.starts_with("HTTP/1.1 400"), "{status}");
            slowest = slowest.max(t.elapsed());
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        assert!(
            slowest < crate::https::UNPROVEN + Duration::from_millis(700),
            "a real request took {slowest:?} during the flood"
        );
        drop(flood.await);
        shutdown.cancel();
    }

    #[test]
    fn garbage_is_not_a_certificate() {
        assert!(certified_key(b"nope", b"nope").is_err());
    }
}
