//! An API server in memory: the REST interface of Kubernetes for the kinds it is told of (its
//! built-ins and the CRDs it is given), with resource versions, generations, watches, label
//! and field selectors, the status subresource, server-side apply (see [`super::apply`]),
//! merge and JSON patches, finalizers, deletion preconditions and garbage collection of
//! owned objects. Every request is recorded with the identity of the client that sent it.
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, StreamBody, combinators::BoxBody};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use serde_json::{Map, Value, json};

use super::apply;
use super::select::Selector;

pub(crate) type Body = BoxBody<Bytes, Infallible>;

/// A kind the server serves.
#[derive(Debug, Clone, PartialEq)]
struct Kind {
    group: String,
    version: String,
    plural: String,
    kind: String,
    namespaced: bool,
    /// Served with a status subresource: writes to the object keep its status, writes to
    /// `/status` change nothing else.
    status: bool,
}

impl Kind {
    fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }
}

/// The built-in kinds a controller's test is likely to touch.
const BUILT_IN: &[(&str, &str, &str, &str, bool, bool)] = &[
    ("", "v1", "pods", "Pod", true, true),
    ("", "v1", "services", "Service", true, true),
    ("", "v1", "configmaps", "ConfigMap", true, false),
    ("", "v1", "secrets", "Secret", true, false),
    ("", "v1", "serviceaccounts", "ServiceAccount", true, false),
    (
        "",
        "v1",
        "persistentvolumeclaims",
        "PersistentVolumeClaim",
        true,
        true,
    ),
    ("", "v1", "events", "Event", true, false),
    ("", "v1", "namespaces", "Namespace", false, true),
    ("", "v1", "nodes", "Node", false, true),
    ("apps", "v1", "deployments", "Deployment", true, true),
    ("apps", "v1", "statefulsets", "StatefulSet", true, true),
    ("apps", "v1", "daemonsets", "DaemonSet", true, true),
    ("apps", "v1", "replicasets", "ReplicaSet", true, true),
    ("batch", "v1", "jobs", "Job", true, true),
    ("batch", "v1", "cronjobs", "CronJob", true, true),
    ("events.k8s.io", "v1", "events", "Event", true, false),
    ("coordination.k8s.io", "v1", "leases", "Lease", true, false),
    ("networking.k8s.io", "v1", "ingresses", "Ingress", true, true),
    (
        "networking.k8s.io",
        "v1",
        "networkpolicies",
        "NetworkPolicy",
        true,
        false,
    ),
    (
        "policy",
        "v1",
        "poddisruptionbudgets",
        "PodDisruptionBudget",
        true,
        true,
    ),
    ("rbac.authorization.k8s.io", "v1", "roles", "Role", true, false),
    (
        "rbac.authorization.k8s.io",
        "v1",
        "rolebindings",
        "RoleBinding",
        true,
        false,
    ),
    (
        "rbac.authorization.k8s.io",
        "v1",
        "clusterroles",
        "ClusterRole",
        false,
        false,
    ),
    (
        "rbac.authorization.k8s.io",
        "v1",
        "clusterrolebindings",
        "ClusterRoleBinding",
        false,
        false,
    ),
    (
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        false,
        true,
    ),
];

/// Where an object is kept: its kind, namespace (empty for a cluster-scoped kind) and name.
type Key = (usize, String, String);

/// An error answer: its code and `Status` body.
type Failure = (StatusCode, Value);

/// One object and who wrote what of it.
#[derive(Debug, Clone)]
struct Stored {
    value: Value,
    /// The last configuration each field manager applied, to the object (`false`) or its
    /// status (`true`).
    applied: BTreeMap<(String, bool), Value>,
    /// What each field manager of writes other than apply (create, update, patch) set last,
    /// to the object or its status: the fields it owns.
    updated: BTreeMap<(String, bool), Value>,
}

/// A change, as watches send it.
#[derive(Debug)]
struct Change {
    kind: usize,
    namespace: String,
    event: &'static str,
    object: Arc<Value>,
    /// The object before, for a watch whose selector it stopped (or started) matching.
    before: Option<Arc<Value>>,
}

/// A request the server answered.
#[derive(Debug, Clone)]
pub struct Recorded {
    /// The client that sent it ([`ApiServer::client_as`]).
    pub who: String,
    /// `get`, `list`, `watch`, `create`, `update`, `patch`, `apply` or `delete`.
    pub verb: &'static str,
    /// The kind, e.g. `Deployment`; the path for a request of no known kind.
    pub kind: String,
    /// Where the object is, for a namespaced kind.
    pub namespace: Option<String>,
    /// The object's name; `None` for a list, a watch or a create with `generateName`.
    pub name: Option<String>,
    /// `status` for a request to the status subresource.
    pub subresource: Option<String>,
    /// The body sent (`Null` for none).
    pub body: Value,
    /// The HTTP status of the answer.
    pub code: u16,
}

impl Recorded {
    /// Whether the request asked for a change (the server may still have found nothing to
    /// change: an apply of what is there already is a write all the same).
    pub fn is_write(&self) -> bool {
        matches!(self.verb, "create" | "update" | "patch" | "apply" | "delete")
    }
}

impl std::fmt::Display for Recorded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.verb, self.kind)?;
        if let Some(s) = &self.subresource {
            write!(f, "/{s}")?;
        }
        match (&self.namespace, &self.name) {
            (Some(ns), Some(n)) => write!(f, " {ns}/{n}")?,
            (None, Some(n)) => write!(f, " {n}")?,
            (Some(ns), None) => write!(f, " in {ns}")?,
            (None, None) => {}
        }
        write!(f, " ({})", self.code)
    }
}

#[derive(Default)]
struct State {
    kinds: Vec<Kind>,
    objects: BTreeMap<Key, Stored>,
    rv: u64,
    uids: u64,
    changes: Vec<Change>,
    requests: Vec<Recorded>,
    /// How far each open watch has sent the changes, and whose it is.
    watches: Vec<(Weak<AtomicUsize>, Arc<str>)>,
}

/// An API server in memory, shared by every client made from it.
#[derive(Clone)]
pub struct ApiServer {
    state: Arc<Mutex<State>>,
    changed: Arc<tokio::sync::watch::Sender<u64>>,
}

impl Default for ApiServer {
    fn default() -> Self {
        Self::new()
    }
}

/// An answer with a `Status` body, as the API server gives for errors.
fn status(code: StatusCode, reason: &str, message: impl Into<String>) -> Failure {
    let message = message.into();
    (
        code,
        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
               "message": message, "reason": reason, "code": code.as_u16()}),
    )
}

fn not_found(what: &str) -> Failure {
    status(StatusCode::NOT_FOUND, "NotFound", format!("{what} not found"))
}

fn full(code: StatusCode, body: &Value) -> Response<Body> {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(
            http_body_util::Full::new(Bytes::from(body.to_string()))
                .map_err(|e| match e {})
                .boxed(),
        )
        .expect("a valid response")
}

/// The object as `PartialObjectMetadata`, for a request that asks for metadata only.
fn partial(obj: &Value) -> Value {
    json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata", "metadata": obj["metadata"]})
}

fn query(uri: &http::Uri) -> BTreeMap<String, String> {
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(&s.replace('+', " "))
            .decode_utf8_lossy()
            .into_owned()
    };
    uri.query()
        .unwrap_or_default()
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (decode(k), decode(v)),
            None => (decode(p), String::new()),
        })
        .collect()
}

/// What a request is about, from its path.
struct Target {
    kind: usize,
    namespace: Option<String>,
    name: Option<String>,
    subresource: Option<String>,
}

/// Everything but `metadata` (and `status`, when it has a subresource of its own): a change
/// to it is a new generation.
fn spec_of(obj: &Value, status: bool) -> Value {
    let mut v = obj.clone();
    if let Some(o) = v.as_object_mut() {
        o.remove("metadata");
        if status {
            o.remove("status");
        }
    }
    v
}

impl State {
    fn kind_of(&self, group: &str, version: &str, plural: &str) -> Option<usize> {
        self.kinds
            .iter()
            .position(|k| k.group == group && k.version == version && k.plural == plural)
    }

    /// The discovery document of `/api/v1` or `/apis/GROUP/VERSION` (what `kube::discovery`
    /// reads to resolve a kind named at run time); `None` for any other path.
    fn discovery(&self, path: &str) -> Option<(StatusCode, Value)> {
        let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
        let (group, version) = match segs.as_slice() {
            ["api", v] => ("", *v),
            ["apis", g, v] => (*g, *v),
            _ => return None,
        };
        let kinds: Vec<&Kind> = self
            .kinds
            .iter()
            .filter(|k| k.group == group && k.version == version)
            .collect();
        let Some(first) = kinds.first() else {
            return Some(not_found(&format!("the path {path}")));
        };
        let mut resources = Vec::new();
        for k in &kinds {
            resources.push(
                json!({"name": k.plural, "singularName": "", "namespaced": k.namespaced, "kind": k.kind,
                "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"]}),
            );
            if k.status {
                resources.push(json!({"name": format!("{}/status", k.plural), "singularName": "",
                    "namespaced": k.namespaced, "kind": k.kind, "verbs": ["get", "patch", "update"]}));
            }
        }
        Some((
            StatusCode::OK,
            json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": first.api_version(), "resources": resources}),
        ))
    }

    fn target(&self, path: &str) -> Result<Target, Failure> {
        let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
        let (group, version, rest) = match segs.as_slice() {
            ["api", v, rest @ ..] => ("", *v, rest),
            ["apis", g, v, rest @ ..] => (*g, *v, rest),
            _ => return Err(not_found(&format!("the path {path}"))),
        };
        let (namespace, rest) = match rest {
            // A Namespace's own subresource, not a collection in it.
            ["namespaces", _, "status" | "finalize"] if group.is_empty() => (None, rest),
            ["namespaces", ns, rest @ ..] if !rest.is_empty() => (Some(ns.to_string()), rest),
            _ => (None, rest),
        };
        let (plural, name, sub) = match rest {
            [p] => (*p, None, None),
            [p, n] => (*p, Some(n.to_string()), None),
            [p, n, s] => (*p, Some(n.to_string()), Some(s.to_string())),
            _ => return Err(not_found(&format!("the path {path}"))),
        };
        let kind = self.kind_of(group, version, plural).ok_or_else(|| {
            not_found(&format!(
                "the server could not find the requested resource ({path})"
            ))
        })?;
        if namespace.is_some() && !self.kinds[kind].namespaced {
            return Err(not_found(&format!("the path {path}")));
        }
        if let Some(s) = &sub
            && !(s == "status" && self.kinds[kind].status)
        {
            return Err(not_found(&format!("the subresource {s} of {plural}")));
        }
        Ok(Target {
            kind,
            namespace,
            name,
            subresource: sub,
        })
    }

    fn next_rv(&mut self) -> String {
        self.rv += 1;
        self.rv.to_string()
    }

    /// Stores `value` (or removes the object, with `None`) and records the change.
    fn commit(&mut self, key: Key, stored: Option<Stored>) -> Option<Value> {
        let before = self.objects.get(&key).map(|s| Arc::new(s.value.clone()));
        let (event, object) = match stored {
            Some(mut s) => {
                let rv = self.next_rv();
                s.value["metadata"]["resourceVersion"] = rv.into();
                s.value["metadata"]["managedFields"] = managed_fields(&s, &self.kinds[key.0]);
                let obj = Arc::new(s.value.clone());
                let event = if before.is_some() { "MODIFIED" } else { "ADDED" };
                self.objects.insert(key.clone(), s);
                (event, obj)
            }
            None => {
                let mut gone = self.objects.remove(&key)?;
                gone.value["metadata"]["resourceVersion"] = self.next_rv().into();
                ("DELETED", Arc::new(gone.value))
            }
        };
        self.changes.push(Change {
            kind: key.0,
            namespace: key.1,
            event,
            object: object.clone(),
            before,
        });
        Some((*object).clone())
    }

    /// Writes `next` over the stored object if anything but its bookkeeping changed, with a
    /// new generation if its spec changed; an object being deleted whose last finalizer went
    /// is removed. Returns the object as it now is.
    fn write(&mut self, key: Key, mut next: Stored) -> Value {
        let status = self.kinds[key.0].status;
        if let Some(old) = self.objects.get(&key) {
            let strip = |v: &Value| {
                let mut v = v.clone();
                v["metadata"]["managedFields"] = Value::Null;
                v["metadata"]["resourceVersion"] = Value::Null;
                v
            };
            if strip(&old.value) == strip(&next.value) && old.applied == next.applied {
                return old.value.clone();
            }
            if spec_of(&old.value, status) != spec_of(&next.value, status) {
                let generation = old.value["metadata"]["generation"].as_i64().unwrap_or(1);
                next.value["metadata"]["generation"] = (generation + 1).into();
            }
        }
        let deleting = !next.value["metadata"]["deletionTimestamp"].is_null();
        let finalizers = next.value["metadata"]["finalizers"]
            .as_array()
            .is_some_and(|f| !f.is_empty());
        if deleting && !finalizers {
            let gone = self.commit(key.clone(), None).unwrap_or(next.value);
            self.collect(&gone);
            return gone;
        }
        self.commit(key, Some(next)).expect("stored")
    }

    /// Deletes what `gone` owned, as the garbage collector does in the background.
    fn collect(&mut self, gone: &Value) {
        let Some(uid) = gone["metadata"]["uid"].as_str() else {
            return;
        };
        let owned: Vec<_> = self
            .objects
            .iter()
            .filter(|(_, s)| {
                s.value["metadata"]["ownerReferences"]
                    .as_array()
                    .is_some_and(|refs| refs.iter().any(|r| r["uid"] == uid))
            })
            .map(|(k, _)| k.clone())
            .collect();
        for key in owned {
            // One deleted meanwhile (through an owner collected earlier) is gone already.
            let _ = self.delete(key, None);
        }
    }

    /// Deletes an object: marked for deletion while it has finalizers, gone otherwise.
    fn delete(&mut self, key: Key, uid: Option<&str>) -> Result<Value, Failure> {
        let Some(stored) = self.objects.get(&key).cloned() else {
            return Err(not_found(&format!("{} {:?}", self.kinds[key.0].plural, key.2)));
        };
        if let Some(uid) = uid
            && stored.value["metadata"]["uid"] != uid
        {
            return Err(status(
                StatusCode::CONFLICT,
                "Conflict",
                format!(
                    "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                    stored.value["metadata"]["uid"]
                ),
            ));
        }
        let finalizers = stored.value["metadata"]["finalizers"]
            .as_array()
            .is_some_and(|f| !f.is_empty());
        if finalizers {
            if !stored.value["metadata"]["deletionTimestamp"].is_null() {
                return Ok(stored.value);
            }
            let mut next = stored;
            next.value["metadata"]["deletionTimestamp"] = now().into();
            next.value["metadata"]["deletionGracePeriodSeconds"] = 0.into();
            // As the API server marks an object for deletion: a new generation.
            if let Some(g) = next.value["metadata"]["generation"].as_i64().filter(|g| *g > 0) {
                next.value["metadata"]["generation"] = (g + 1).into();
            }
            return Ok(self.write(key, next));
        }
        let gone = self.commit(key, None).unwrap_or(stored.value);
        self.collect(&gone);
        Ok(gone)
    }

    /// A new object of `kind` from `obj`, not stored yet: its name (or one generated), its
    /// namespace, uid and timestamps set, a status dropped where the kind has a subresource.
    fn fresh(
        &mut self,
        kind: usize,
        namespace: Option<String>,
        mut obj: Value,
        manager: Option<String>,
    ) -> Result<(Key, Stored), Failure> {
        let k = self.kinds[kind].clone();
        if !obj["metadata"].is_object() {
            obj["metadata"] = json!({});
        }
        let name = match (
            obj["metadata"]["name"].as_str(),
            obj["metadata"]["generateName"].as_str(),
        ) {
            (Some(n), _) if !n.is_empty() => n.to_string(),
            (_, Some(prefix)) => {
                self.uids += 1;
                format!("{prefix}{:05x}", self.uids)
            }
            _ => {
                return Err(status(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "Invalid",
                    format!("{} \"\": name or generateName is required", k.kind),
                ));
            }
        };
        let ns = if k.namespaced {
            namespace
                .or_else(|| obj["metadata"]["namespace"].as_str().map(String::from))
                .unwrap_or_else(|| "default".into())
        } else {
            String::new()
        };
        let key = (kind, ns.clone(), name.clone());
        if self.objects.contains_key(&key) {
            return Err(status(
                StatusCode::CONFLICT,
                "AlreadyExists",
                format!("{}.{} \"{name}\" already exists", k.plural, k.group),
            ));
        }
        self.uids += 1;
        let meta = &mut obj["metadata"];
        meta["name"] = name.into();
        if k.namespaced {
            meta["namespace"] = ns.into();
        } else if let Some(m) = meta.as_object_mut() {
            m.remove("namespace");
        }
        meta["uid"] = format!("00000000-0000-4000-8000-{:012x}", self.uids).into();
        meta["creationTimestamp"] = now().into();
        meta["generation"] = 1.into();
        obj["apiVersion"] = k.api_version().into();
        obj["kind"] = k.kind.clone().into();
        if k.status
            && let Some(o) = obj.as_object_mut()
        {
            o.remove("status");
        }
        let owned = apply::ownable(&obj);
        let stored = Stored {
            value: obj,
            applied: BTreeMap::new(),
            updated: manager.map(|m| ((m, false), owned)).into_iter().collect(),
        };
        Ok((key, stored))
    }

    fn create(
        &mut self,
        kind: usize,
        namespace: Option<String>,
        obj: Value,
        manager: Option<String>,
    ) -> Result<Value, Failure> {
        let (key, stored) = self.fresh(kind, namespace, obj, manager)?;
        Ok(self.commit(key, Some(stored)).expect("stored"))
    }
}

fn now() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .round(k8s_openapi::jiff::Unit::Second)
        .map(|t| t.to_string())
        .unwrap_or_default()
}

/// Who owns what of `value` by `entries` (its `managedFields` as a client wrote them): the
/// fields of each manager's `Apply` and other entries, as applied configurations.
#[allow(clippy::type_complexity)]
fn owners(
    entries: &Value,
    value: &Value,
) -> (BTreeMap<(String, bool), Value>, BTreeMap<(String, bool), Value>) {
    let (mut applied, mut updated) = (BTreeMap::new(), BTreeMap::new());
    for e in entries.as_array().into_iter().flatten() {
        let fields = &e["fieldsV1"];
        let owned = match fields.as_object() {
            Some(set) if !set.is_empty() => crate::diff::project(value, fields).unwrap_or_else(|| json!({})),
            _ => json!({}),
        };
        let key = (
            e["manager"].as_str().unwrap_or_default().to_string(),
            e["subresource"] == "status",
        );
        match e["operation"].as_str() {
            Some("Apply") => applied.insert(key, apply::ownable(&owned)),
            _ => updated.insert(key, apply::ownable(&owned)),
        };
    }
    (applied, updated)
}

fn managed_fields(s: &Stored, kind: &Kind) -> Value {
    let mut entries: Vec<Value> = s
        .applied
        .iter()
        .map(|((manager, status), applied)| {
            let mut e = json!({"manager": manager, "operation": "Apply", "apiVersion": kind.api_version(),
                               "fieldsType": "FieldsV1", "fieldsV1": apply::fields_v1(applied)});
            if *status {
                e["subresource"] = "status".into();
            }
            e
        })
        .collect();
    for ((manager, status), fields) in &s.updated {
        let mut e = json!({"manager": manager, "operation": "Update", "apiVersion": kind.api_version(),
                           "fieldsType": "FieldsV1", "fieldsV1": apply::fields_v1(fields)});
        if *status {
            e["subresource"] = "status".into();
        }
        entries.push(e);
    }
    Value::Array(entries)
}

/// How an apply, update or patch changes an object.
enum Edit {
    Apply {
        manager: String,
        force: bool,
        body: Value,
    },
    Replace(Value),
    Merge(Value),
    Json(json_patch::Patch),
}

impl ApiServer {
    /// An empty server that knows the built-in kinds.
    pub fn new() -> Self {
        let kinds = BUILT_IN
            .iter()
            .map(|(g, v, p, k, n, s)| Kind {
                group: g.to_string(),
                version: v.to_string(),
                plural: p.to_string(),
                kind: k.to_string(),
                namespaced: *n,
                status: *s,
            })
            .collect();
        ApiServer {
            state: Arc::new(Mutex::new(State {
                kinds,
                ..Default::default()
            })),
            changed: Arc::new(tokio::sync::watch::channel(0).0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Serves the kinds of `crd` from now on (every version it serves), and stores the CRD
    /// itself as Established.
    pub fn install_crd(&self, crd: &CustomResourceDefinition) {
        let mut value = serde_json::to_value(crd).unwrap_or_default();
        value["status"] = json!({"conditions": [
            {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts", "message": "", "lastTransitionTime": now()},
            {"type": "Established", "status": "True", "reason": "InitialNamesAccepted", "message": "", "lastTransitionTime": now()},
        ], "acceptedNames": value["spec"]["names"].clone(), "storedVersions": []});
        let mut state = self.lock();
        for v in crd.spec.versions.iter().filter(|v| v.served) {
            let kind = Kind {
                group: crd.spec.group.clone(),
                version: v.name.clone(),
                plural: crd.spec.names.plural.clone(),
                kind: crd.spec.names.kind.clone(),
                namespaced: crd.spec.scope == "Namespaced",
                status: v.subresources.as_ref().is_some_and(|s| s.status.is_some()),
            };
            if !state.kinds.contains(&kind) {
                state.kinds.push(kind);
            }
        }
        let crds = state
            .kind_of("apiextensions.k8s.io", "v1", "customresourcedefinitions")
            .expect("a built-in kind");
        let key = (crds, String::new(), kube::ResourceExt::name_any(crd));
        let mut stored = state.objects.get(&key).cloned().unwrap_or(Stored {
            value: Value::Null,
            applied: BTreeMap::new(),
            updated: BTreeMap::new(),
        });
        let uid = stored.value["metadata"]["uid"].clone();
        stored.value = value;
        stored.value["metadata"]["uid"] = if uid.is_null() {
            format!("crd-{}", key.2).into()
        } else {
            uid
        };
        stored.value["metadata"]["generation"] = 1.into();
        state.write(key, stored);
        drop(state);
        self.changed.send_modify(|n| *n += 1);
    }

    /// A client of this server, its requests recorded as `who`'s.
    pub fn client_as(&self, who: &str) -> kube::Client {
        kube::Client::new(
            Endpoint {
                server: self.clone(),
                who: who.into(),
            },
            "default",
        )
    }

    /// Every request answered so far.
    pub fn requests(&self) -> Vec<Recorded> {
        self.lock().requests.clone()
    }

    /// How many requests were answered so far.
    pub fn request_count(&self) -> usize {
        self.lock().requests.len()
    }

    /// Whether every open watch of `who` has sent every change so far.
    pub fn watches_caught_up(&self, who: &str) -> bool {
        let mut state = self.lock();
        let total = state.changes.len();
        state.watches.retain(|(w, _)| w.strong_count() > 0);
        state
            .watches
            .iter()
            .filter(|(_, whose)| &**whose == who)
            .filter_map(|(w, _)| w.upgrade())
            .all(|p| p.load(Ordering::SeqCst) >= total)
    }

    /// The stored object of a kind (`apiVersion` and `kind`, as in a manifest), if any.
    pub fn get(&self, api_version: &str, kind: &str, namespace: Option<&str>, name: &str) -> Option<Value> {
        let state = self.lock();
        let k = state
            .kinds
            .iter()
            .position(|k| k.api_version() == api_version && k.kind == kind)?;
        state
            .objects
            .get(&(k, namespace.unwrap_or_default().to_string(), name.to_string()))
            .map(|s| s.value.clone())
    }

    pub(crate) async fn handle(&self, who: &str, req: Request<kube::client::Body>) -> Response<Body> {
        let (parts, body) = req.into_parts();
        let body = match body.collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) => {
                let (code, v) = status(StatusCode::BAD_REQUEST, "BadRequest", e.to_string());
                return full(code, &v);
            }
        };
        let body: Value = if body.is_empty() {
            Value::Null
        } else {
            match serde_json::from_slice(&body) {
                Ok(v) => v,
                Err(e) => {
                    let (code, v) = status(
                        StatusCode::BAD_REQUEST,
                        "BadRequest",
                        format!("the body is not JSON: {e}"),
                    );
                    return full(code, &v);
                }
            }
        };
        let q = query(&parts.uri);
        let metadata_only = parts
            .headers
            .get(http::header::ACCEPT)
            .and_then(|a| a.to_str().ok())
            .is_some_and(|a| a.contains("as=PartialObjectMetadata"));
        let content_type = parts
            .headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|a| a.to_str().ok())
            .unwrap_or_default()
            .to_string();
        let path = parts.uri.path().to_string();
        let mut state = self.lock();
        if parts.method == Method::GET
            && let Some((code, v)) = state.discovery(&path)
        {
            return full(code, &v);
        }
        let target = state.target(&path);
        let verb = match (&parts.method, &target) {
            (&Method::GET, Ok(t))
                if t.name.is_none() && q.get("watch").is_some_and(|w| w == "true" || w == "1") =>
            {
                "watch"
            }
            (&Method::GET, Ok(t)) if t.name.is_none() => "list",
            (&Method::GET, _) => "get",
            (&Method::POST, _) => "create",
            (&Method::PUT, _) => "update",
            (&Method::PATCH, _) if content_type.starts_with("application/apply-patch") => "apply",
            (&Method::PATCH, _) => "patch",
            (&Method::DELETE, _) => "delete",
            _ => "unknown",
        };
        let mut record = Recorded {
            who: who.to_string(),
            verb,
            kind: path.clone(),
            namespace: None,
            name: None,
            subresource: None,
            body: body.clone(),
            code: 0,
        };
        let t = match target {
            Ok(t) => t,
            Err((code, v)) => {
                record.code = code.as_u16();
                state.requests.push(record);
                return full(code, &v);
            }
        };
        record.kind = state.kinds[t.kind].kind.clone();
        record.namespace = t.namespace.clone();
        record.name = t.name.clone();
        record.subresource = t.subresource.clone();
        if verb == "watch" {
            record.code = 200;
            state.requests.push(record);
            return match Selector::parse(
                q.get("labelSelector").map(String::as_str),
                q.get("fieldSelector").map(String::as_str),
            ) {
                Ok(sel) => self.watch(&mut state, who, t, sel, &q, metadata_only),
                Err(e) => {
                    let (code, v) = status(StatusCode::BAD_REQUEST, "BadRequest", e);
                    full(code, &v)
                }
            };
        }
        let answer = self.answer(&mut state, verb, &t, &q, body, &content_type);
        let changed = state.changes.len();
        let (code, mut value) = match answer {
            Ok(v) => (
                if verb == "create" {
                    StatusCode::CREATED
                } else {
                    StatusCode::OK
                },
                v,
            ),
            Err(e) => e,
        };
        record.code = code.as_u16();
        if record.name.is_none() && verb == "create" {
            record.name = value["metadata"]["name"].as_str().map(String::from);
        }
        state.requests.push(record);
        drop(state);
        self.changed.send_modify(|n| *n = changed as u64);
        if metadata_only && code.is_success() {
            value = match value.get("items").and_then(Value::as_array) {
                Some(items) => json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadataList",
                                      "metadata": value["metadata"], "items": items.iter().map(partial).collect::<Vec<_>>()}),
                None => partial(&value),
            };
        }
        full(code, &value)
    }

    fn answer(
        &self,
        state: &mut State,
        verb: &str,
        t: &Target,
        q: &BTreeMap<String, String>,
        body: Value,
        content_type: &str,
    ) -> Result<Value, Failure> {
        let kind = state.kinds[t.kind].clone();
        let ns = t.namespace.clone().unwrap_or_default();
        let manager = q.get("fieldManager").cloned();
        if q.contains_key("dryRun") {
            return Err(status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                "dryRun is not supported by the API server in memory",
            ));
        }
        match verb {
            "list" => {
                let sel = Selector::parse(
                    q.get("labelSelector").map(String::as_str),
                    q.get("fieldSelector").map(String::as_str),
                )
                .map_err(|e| status(StatusCode::BAD_REQUEST, "BadRequest", e))?;
                let items: Vec<Value> = state
                    .objects
                    .iter()
                    .filter(|((k, n, _), s)| {
                        *k == t.kind && (t.namespace.is_none() || *n == ns) && sel.matches(&s.value)
                    })
                    .map(|(_, s)| s.value.clone())
                    .collect();
                Ok(
                    json!({"apiVersion": kind.api_version(), "kind": format!("{}List", kind.kind),
                          "metadata": {"resourceVersion": state.rv.to_string()}, "items": items}),
                )
            }
            "get" => {
                let name = t.name.clone().unwrap_or_default();
                state
                    .objects
                    .get(&(t.kind, ns, name.clone()))
                    .map(|s| s.value.clone())
                    .ok_or_else(|| not_found(&format!("{}.{} \"{name}\"", kind.plural, kind.group)))
            }
            "create" => {
                let manager = manager.or_else(|| Some("unknown".into()));
                state.create(t.kind, t.namespace.clone(), body, manager)
            }
            "delete" => {
                let name = t.name.clone().unwrap_or_default();
                let uid = body["preconditions"]["uid"].as_str();
                state.delete((t.kind, ns, name), uid)
            }
            "update" | "patch" | "apply" => {
                let name = t.name.clone().unwrap_or_default();
                let edit = match verb {
                    "update" => Edit::Replace(body),
                    "apply" => Edit::Apply {
                        manager: manager.clone().ok_or_else(|| {
                            status(
                                StatusCode::BAD_REQUEST,
                                "BadRequest",
                                "PATCH with apply requires fieldManager",
                            )
                        })?,
                        force: q.get("force").is_some_and(|f| f == "true"),
                        body,
                    },
                    _ if content_type.starts_with("application/json-patch") => Edit::Json(
                        serde_json::from_value(body)
                            .map_err(|e| status(StatusCode::BAD_REQUEST, "BadRequest", e.to_string()))?,
                    ),
                    _ => Edit::Merge(body),
                };
                let updater = manager.unwrap_or_else(|| "unknown".into());
                self.edit(state, t, &name, edit, updater)
            }
            _ => Err(status(
                StatusCode::METHOD_NOT_ALLOWED,
                "MethodNotAllowed",
                format!("{verb} is not supported"),
            )),
        }
    }

    fn edit(
        &self,
        state: &mut State,
        t: &Target,
        name: &str,
        edit: Edit,
        updater: String,
    ) -> Result<Value, Failure> {
        let kind = state.kinds[t.kind].clone();
        let ns = t.namespace.clone().unwrap_or_default();
        let key = (t.kind, ns.clone(), name.to_string());
        let on_status = t.subresource.as_deref() == Some("status");
        let mut next = match (state.objects.get(&key).cloned(), &edit) {
            (Some(s), _) => s,
            // An apply that names a uid is for that object only (kube-apiserver's answer).
            (None, Edit::Apply { body, .. }) if !on_status && body["metadata"]["uid"].is_string() => {
                return Err(status(
                    StatusCode::CONFLICT,
                    "Conflict",
                    format!(
                        "Operation cannot be fulfilled on {}.{} \"{name}\": uid mismatch: the provided object specified uid {}, and no existing object was found",
                        kind.plural, kind.group, body["metadata"]["uid"]
                    ),
                ));
            }
            // An apply creates what is not there yet.
            (None, Edit::Apply { .. }) if !on_status => {
                let obj = json!({"metadata": {"name": name}});
                state.fresh(t.kind, t.namespace.clone(), obj, None)?.1
            }
            (None, _) => return Err(not_found(&format!("{}.{} \"{name}\"", kind.plural, kind.group))),
        };
        let old = next.value.clone();
        let precondition = |sent: &Value| -> Result<(), Failure> {
            match sent["metadata"]["resourceVersion"].as_str() {
                Some(rv) if !rv.is_empty() && old["metadata"]["resourceVersion"] != rv => Err(status(
                    StatusCode::CONFLICT,
                    "Conflict",
                    format!(
                        "Operation cannot be fulfilled on {}.{} \"{name}\": the object has been modified; please apply your changes to the latest version and try again",
                        kind.plural, kind.group
                    ),
                )),
                _ => Ok(()),
            }
        };
        match edit {
            Edit::Apply { manager, force, body } => {
                precondition(&body)?;
                let mut applied = apply::ownable(&body);
                if kind.status {
                    let part = applied.get("status").cloned().unwrap_or(Value::Null);
                    if on_status {
                        applied = json!({"status": part});
                    } else if let Some(o) = applied.as_object_mut() {
                        o.remove("status");
                    }
                }
                let slot = (manager.clone(), on_status);
                if !force
                    && let Some((other, _)) = next.applied.iter().chain(&next.updated).find(|(k, theirs)| {
                        **k != slot && k.1 == on_status && apply::conflicts(&applied, theirs)
                    })
                {
                    return Err(status(
                        StatusCode::CONFLICT,
                        "Conflict",
                        format!("Apply failed with 1 conflict: conflict with \"{}\"", other.0),
                    ));
                }
                if force {
                    for (k, theirs) in next.applied.iter_mut().chain(next.updated.iter_mut()) {
                        if *k != slot && k.1 == on_status {
                            apply::take_over(theirs, &applied);
                        }
                    }
                }
                let previous = next.applied.get(&slot).cloned().unwrap_or(Value::Null);
                let others: Vec<Value> = next
                    .applied
                    .iter()
                    .chain(&next.updated)
                    .filter(|(k, _)| **k != slot && k.1 == on_status)
                    .map(|(_, v)| v.clone())
                    .collect();
                let others: Vec<&Value> = others.iter().collect();
                apply::prune(&mut next.value, &previous, &applied, &others);
                apply::merge(&mut next.value, &applied);
                next.applied.insert(slot, applied);
            }
            Edit::Replace(body) => {
                precondition(&body)?;
                let mut value = body;
                for k in [
                    "uid",
                    "creationTimestamp",
                    "deletionTimestamp",
                    "generation",
                    "namespace",
                    "name",
                ] {
                    value["metadata"][k] = old["metadata"].get(k).cloned().unwrap_or(Value::Null);
                }
                Self::keep_parts(&kind, on_status, &old, &mut value);
                next.value = value;
                Self::written_by(&mut next, &old, (updater.clone(), on_status));
            }
            Edit::Merge(body) => {
                precondition(&body)?;
                let mut value = old.clone();
                json_patch::merge(&mut value, &body);
                Self::keep_parts(&kind, on_status, &old, &mut value);
                next.value = value;
                Self::written_by(&mut next, &old, (updater.clone(), on_status));
            }
            Edit::Json(patch) => {
                let mut value = old.clone();
                json_patch::patch(&mut value, &patch).map_err(|e| {
                    status(
                        StatusCode::UNPROCESSABLE_ENTITY,
                        "Invalid",
                        format!("the JSON patch failed: {e}"),
                    )
                })?;
                Self::keep_parts(&kind, on_status, &old, &mut value);
                next.value = value;
                Self::written_by(&mut next, &old, (updater.clone(), on_status));
            }
        }
        // Identity is the server's.
        for k in ["uid", "name", "namespace", "creationTimestamp"] {
            match old["metadata"].get(k) {
                Some(v) => next.value["metadata"][k] = v.clone(),
                None => {
                    if let Some(m) = next.value["metadata"].as_object_mut() {
                        m.remove(k);
                    }
                }
            }
        }
        next.value["apiVersion"] = kind.api_version().into();
        next.value["kind"] = kind.kind.clone().into();
        if !old["metadata"]["deletionTimestamp"].is_null() {
            let had = old["metadata"]["finalizers"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            let has = next.value["metadata"]["finalizers"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            if has.iter().any(|f| !had.contains(f)) {
                return Err(status(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "Invalid",
                    format!(
                        "{} \"{name}\" is invalid: metadata.finalizers: Forbidden: no new finalizers can be added if the object is being deleted",
                        kind.kind
                    ),
                ));
            }
        }
        // Only a delete marks an object for deletion, and the mark stays.
        match old["metadata"].get("deletionTimestamp") {
            Some(v) if !v.is_null() => next.value["metadata"]["deletionTimestamp"] = v.clone(),
            _ => {
                if let Some(m) = next.value["metadata"].as_object_mut() {
                    m.remove("deletionTimestamp");
                }
            }
        }
        Ok(state.write(key, next))
    }

    /// Gives `updater` the fields its write changed, taken from whoever owned them.
    /// A write other than an apply by `updater`: managed fields it sets (a list of entries
    /// other than the stored ones) become who owns what, as kube-apiserver takes them; then
    /// it owns what it changed.
    fn written_by(next: &mut Stored, old: &Value, updater: (String, bool)) {
        let entries = &next.value["metadata"]["managedFields"];
        if entries.as_array().is_some_and(|e| !e.is_empty()) && *entries != old["metadata"]["managedFields"] {
            let (applied, updated) = owners(entries, &next.value);
            next.applied = applied;
            next.updated = updated;
        }
        Self::updated_by(next, old, updater)
    }

    fn updated_by(next: &mut Stored, old: &Value, updater: (String, bool)) {
        let changed = apply::changed(&apply::ownable(old), &apply::ownable(&next.value));
        if changed.as_object().is_none_or(Map::is_empty) {
            return;
        }
        for (k, theirs) in next.applied.iter_mut().chain(next.updated.iter_mut()) {
            if *k != updater && k.1 == updater.1 {
                apply::take_over(theirs, &changed);
            }
        }
        let mine = next.updated.entry(updater).or_insert_with(|| json!({}));
        apply::merge(mine, &apply::without_nulls(&changed));
    }

    /// A write to the object keeps its status; a write to the status keeps everything else.
    fn keep_parts(kind: &Kind, on_status: bool, old: &Value, value: &mut Value) {
        if !kind.status {
            return;
        }
        if on_status {
            let status = value.get("status").cloned();
            *value = old.clone();
            match status {
                Some(s) => value["status"] = s,
                None => {
                    if let Some(o) = value.as_object_mut() {
                        o.remove("status");
                    }
                }
            }
        } else {
            match old.get("status") {
                Some(s) => value["status"] = s.clone(),
                None => {
                    if let Some(o) = value.as_object_mut() {
                        o.remove("status");
                    }
                }
            }
        }
    }

    fn watch(
        &self,
        state: &mut State,
        who: &str,
        t: Target,
        sel: Selector,
        q: &BTreeMap<String, String>,
        metadata_only: bool,
    ) -> Response<Body> {
        let initial_events = q.get("sendInitialEvents").is_some_and(|v| v == "true");
        let position = Arc::new(AtomicUsize::new(0));
        state.watches.push((Arc::downgrade(&position), who.into()));
        let since: u64 = q.get("resourceVersion").and_then(|r| r.parse().ok()).unwrap_or(0);
        let mut initial = Vec::new();
        let start = if since == 0 {
            // No version: the objects there are now, then what changes.
            for ((k, n, _), s) in &state.objects {
                if *k == t.kind && t.namespace.as_ref().is_none_or(|ns| ns == n) && sel.matches(&s.value) {
                    initial.push(json!({"type": "ADDED", "object": s.value}));
                }
            }
            if initial_events {
                // A streamed list ends with a bookmark that says so, as the API server's.
                let kind = &state.kinds[t.kind];
                initial.push(json!({"type": "BOOKMARK", "object": {
                    "apiVersion": kind.api_version(), "kind": kind.kind,
                    "metadata": {"resourceVersion": state.rv.to_string(),
                                 "annotations": {"k8s.io/initial-events-end": "true"}}}}));
            }
            state.changes.len()
        } else {
            state.changes.partition_point(|c| {
                c.object["metadata"]["resourceVersion"]
                    .as_str()
                    .and_then(|r| r.parse::<u64>().ok())
                    .is_some_and(|r| r <= since)
            })
        };
        position.store(start, Ordering::SeqCst);
        let filter = Arc::new((t.kind, t.namespace, sel, metadata_only));
        let server = self.clone();
        let rx = self.changed.subscribe();
        let first = (!initial.is_empty()).then(|| lines(&initial, metadata_only));
        let stream = futures::stream::unfold(
            (server, position, filter, rx, first),
            |(server, position, filter, mut rx, first)| async move {
                if let Some(chunk) = first {
                    return Some((
                        Ok(http_body::Frame::data(chunk)),
                        (server, position, filter, rx, None),
                    ));
                }
                loop {
                    let batch = {
                        let state = server.lock();
                        let from = position.load(Ordering::SeqCst);
                        let (kind, ns, sel, _) = &*filter;
                        let events: Vec<Value> = state.changes[from..]
                            .iter()
                            .filter(|c| c.kind == *kind && ns.as_ref().is_none_or(|n| *n == c.namespace))
                            .filter_map(|c| {
                                let now = sel.matches(&c.object);
                                let was = c.before.as_ref().is_some_and(|b| sel.matches(b));
                                let event = match (c.event, was, now) {
                                    ("DELETED", _, true) => "DELETED",
                                    ("ADDED", _, true) => "ADDED",
                                    ("MODIFIED", true, true) => "MODIFIED",
                                    ("MODIFIED", false, true) => "ADDED",
                                    ("MODIFIED", true, false) => "DELETED",
                                    _ => return None,
                                };
                                Some(json!({"type": event, "object": *c.object}))
                            })
                            .collect();
                        position.store(state.changes.len(), Ordering::SeqCst);
                        events
                    };
                    if !batch.is_empty() {
                        let chunk = lines(&batch, filter.3);
                        return Some((
                            Ok(http_body::Frame::data(chunk)),
                            (server, position, filter, rx, None),
                        ));
                    }
                    if rx.changed().await.is_err() {
                        return None;
                    }
                }
            },
        );
        Response::builder()
            .status(StatusCode::OK)
            .header("content-type", "application/json")
            .body(BodyExt::boxed(StreamBody::new(stream)))
            .expect("a valid response")
    }
}

/// Watch events, one JSON document per line.
fn lines(events: &[Value], metadata_only: bool) -> Bytes {
    let mut out = Vec::new();
    for e in events {
        let e = if metadata_only {
            json!({"type": e["type"], "object": partial(&e["object"])})
        } else {
            e.clone()
        };
        out.extend_from_slice(e.to_string().as_bytes());
        out.push(b'\n');
    }
    Bytes::from(out)
}

/// The server as a tower service for kube's client.
#[derive(Clone)]
struct Endpoint {
    server: ApiServer,
    who: Arc<str>,
}

impl tower::Service<Request<kube::client::Body>> for Endpoint {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn std::future::Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<kube::client::Body>) -> Self::Future {
        let (server, who) = (self.server.clone(), self.who.clone());
        Box::pin(async move { Ok(server.handle(&who, req).await) })
    }
}
