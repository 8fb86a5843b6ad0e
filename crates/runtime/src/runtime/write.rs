//! The write path: every write a plan or a cleanup asks for — apply or create a child, prune an
//! orphan, delete an object, write a status or a condition, add or remove a finalizer — each
//! through the write gate (counted in the metrics), each remembered as an echo so that its
//! watch event triggers no reconcile.
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, DynamicObject};
use kube::{Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::Error;
use crate::client::namespace_terminating;
use crate::conditions::{self, Desired};
use crate::diff::{CREATED_SHAPE, fold_updates, reshaped, same, shape};
use crate::kind::Watchable;
use crate::kind::{api, namespaced};
use crate::plan::{Child, Deletion, Mode};
use crate::runtime::context::ControllerContext;
use crate::runtime::status::StatusBase;

/// Carries out the writes of one controller.
pub(crate) struct Writer {
    ctx: ControllerContext,
}

/// The API of a child's kind where it lives.
fn dynamic_api(
    ctx: &ControllerContext,
    resource: &ApiResource,
    namespace: Option<&str>,
) -> Api<DynamicObject> {
    match namespace {
        Some(ns) => Api::namespaced_with(ctx.client().clone(), ns, resource),
        None => Api::all_with(ctx.client().clone(), resource),
    }
}

/// A server-side apply as `manager`, without the API server's strict second parse of the body:
/// that parse is most of what an apply costs the server over an update (docs/benchmark.md,
/// "What a status write costs the API server"). Unknown fields are dropped either way; only
/// the `Warning` header naming them is lost, and nothing reads it.
fn apply_params(manager: &str) -> PatchParams {
    PatchParams::apply(manager).validation_ignore()
}

/// A patch other than an apply (a merge patch), as `manager`.
fn patch_params(manager: &str) -> PatchParams {
    PatchParams {
        field_manager: Some(manager.to_string()),
        ..Default::default()
    }
}

/// How often a fold is read and made again when other writes keep changing the child.
const FOLD_ATTEMPTS: usize = 3;

impl Writer {
    pub(crate) fn new(ctx: ControllerContext) -> Self {
        Writer { ctx }
    }

    fn echo(&self, resource: &ApiResource, namespace: Option<&str>, name: &str, written: &impl Resource) {
        if let Some(rv) = written.meta().resource_version.clone() {
            self.ctx.echoes().record(&resource.kind, namespace, name, rv);
        }
    }

    /// Writes `child`; a namespaced child without a namespace goes into `default_ns` (the
    /// primary's). A sharded controller's child carries its owner's shard label (so that only
    /// the owner caches it) and the owner's uid (so that a new owner finds it).
    #[tracing::instrument(level = "debug", name = "apply", skip_all, fields(kind = %child.resource.kind, child = %child.name))]
    pub(crate) async fn child(
        &self,
        default_ns: Option<&str>,
        child: &Child,
        owner_uid: Option<&str>,
    ) -> Result<(), Error> {
        let ns = child.namespace(default_ns);
        let labelled;
        // Not on `fields` writes: those set fields of an object someone else owns (Eru's
        // restart stamp on a user's Deployment), which must not become a child to prune.
        let body = match (self.ctx.shard(), owner_uid) {
            (Some(shard), Some(uid)) if !matches!(child.mode, Mode::Fields | Mode::Merge) => {
                labelled = shard_labelled(&child.body, shard, uid);
                &labelled
            }
            _ => &child.body,
        };
        let api = dynamic_api(&self.ctx, &child.resource, ns);
        let err = |source| match namespace_terminating(&source) {
            true => Error::NamespaceTerminating {
                child: child.describe(),
                namespace: ns.unwrap_or_default().to_string(),
            },
            false => Error::Write {
                child: child.describe(),
                source,
            },
        };
        let written = match child.mode {
            Mode::Apply | Mode::Fields => {
                // A sharded controller's cache lacks what is not its own: a child it did not
                // see may be another's (a hand-made Deployment of that name), which a forced
                // apply would take over. Unforced, fields another manager owns conflict.
                let unseen = self.ctx.shard().is_some() && !child.cached;
                let pp = apply_params(self.ctx.field_manager());
                let pp = if unseen { pp } else { pp.force() };
                // One the plan did not see: POSTed, which the API server answers in about half
                // the time of an apply that creates (docs/benchmark.md). There already (a
                // cache behind, or a sharded controller that does not cache it): applied.
                if matches!(child.mode, Mode::Apply) && !child.cached {
                    self.ctx.may_write("create")?;
                    match self.create(&api, child, body).await {
                        Ok(Some(created)) => {
                            self.echo(&child.resource, ns, &child.name, &created);
                            return Ok(());
                        }
                        Ok(None) => {}
                        Err(e) => return Err(err(e)),
                    }
                }
                let apply = || async {
                    self.ctx.may_write("apply")?;
                    match api.patch(&child.name, &pp, &Patch::Apply(body)).await {
                        Ok(o) => Ok(o),
                        Err(kube::Error::Api(s)) if s.code == 409 && unseen => Err(Error::Conflict {
                            child: child.describe(),
                        }),
                        Err(e) => Err(err(e)),
                    }
                };
                let applied = apply().await?;
                let folded = match child.mode {
                    Mode::Apply => self.fold_if_reshaped(&api, &applied, &child.body).await,
                    // A few fields of an object: never a shape of what was created.
                    _ => Ok(None),
                };
                match folded {
                    Ok(Some(folded)) => {
                        self.echo(&child.resource, ns, &child.name, &folded);
                        apply().await?
                    }
                    Ok(None) => applied,
                    Err(Error::Write { source, .. }) => return Err(err(source)),
                    Err(e) => return Err(e),
                }
            }
            Mode::Merge => {
                let pp = patch_params(self.ctx.field_manager());
                self.ctx.may_write("patch")?;
                match api.patch(&child.name, &pp, &Patch::Merge(body)).await {
                    Ok(o) => o,
                    // Gone: nothing left to change.
                    Err(kube::Error::Api(s)) if s.code == 404 => return Ok(()),
                    // Changed since it was seen: the next plan sees the newer version.
                    Err(kube::Error::Api(s)) if s.code == 409 => return Err(Error::Stale),
                    Err(e) => return Err(err(e)),
                }
            }
            Mode::Create => {
                let obj: DynamicObject = serde_json::from_value(body.clone())?;
                self.ctx.may_write("create")?;
                match api.create(&PostParams::default(), &obj).await {
                    Ok(o) => o,
                    Err(kube::Error::Api(s)) if s.code == 409 => {
                        return Err(Error::Conflict {
                            child: child.describe(),
                        });
                    }
                    Err(e) => return Err(err(e)),
                }
            }
        };
        self.echo(&child.resource, ns, &child.name, &written);
        Ok(())
    }

    /// POSTs `body` (`child` as written: with shard labels, say) with the [`CREATED_SHAPE`] of
    /// what the plan sets, the shape the plan compares ([`crate::diff::reshaped`]); `None` when
    /// an object of that name exists. The caller passed the write gate.
    async fn create(
        &self,
        api: &Api<DynamicObject>,
        child: &Child,
        body: &serde_json::Value,
    ) -> Result<Option<DynamicObject>, kube::Error> {
        let mut obj: DynamicObject = serde_json::from_value(body.clone()).map_err(kube::Error::SerdeError)?;
        obj.metadata.name = Some(child.name.clone());
        obj.annotations_mut()
            .insert(CREATED_SHAPE.into(), shape(&child.body));
        let pp = PostParams {
            field_manager: Some(self.ctx.field_manager().to_string()),
            ..Default::default()
        };
        match api.create(&pp, &obj).await {
            Ok(o) => Ok(Some(o)),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// After an apply to a child this controller POSTed: when the plan (`planned`, the body
    /// the plan made) now sets other fields than it created, opkit's `Update` entry, which
    /// still owns the created ones, is folded into its `Apply` entry ([`fold_updates`]), so
    /// that applying again drops what the plan no longer sets. The object folded, if it was
    /// (the apply must then be made again).
    ///
    /// The fold is made against the version it read. Someone else's write in between (the
    /// deployment controller's status, say) is read and folded again, up to
    /// [`FOLD_ATTEMPTS`] times; after that, or after a fold that failed otherwise, the next
    /// plan sees the annotation's other shape and applies again ([`crate::diff::reshaped`]).
    async fn fold_if_reshaped(
        &self,
        api: &Api<DynamicObject>,
        applied: &DynamicObject,
        planned: &serde_json::Value,
    ) -> Result<Option<DynamicObject>, Error> {
        let name = applied.name_any();
        let failed = |source| Error::Write {
            child: name.clone(),
            source,
        };
        let mut current = std::borrow::Cow::Borrowed(applied);
        for attempt in 1..=FOLD_ATTEMPTS {
            let created = current.annotations().get(CREATED_SHAPE).map(String::as_str);
            if !reshaped(created, planned) {
                return Ok(None);
            }
            let Some(folded) = fold_updates(current.managed_fields(), self.ctx.field_manager()) else {
                return Ok(None);
            };
            let patch = serde_json::json!({"metadata": {
                "resourceVersion": current.resource_version(),
                "managedFields": folded,
            }});
            let pp = patch_params(self.ctx.field_manager());
            self.ctx.may_write("patch")?;
            match api.patch(&name, &pp, &Patch::Merge(patch)).await {
                Ok(o) => return Ok(Some(o)),
                // Gone since the apply: nothing to fold; the watch sees the deletion.
                Err(kube::Error::Api(s)) if s.code == 404 => return Ok(None),
                Err(kube::Error::Api(s)) if s.code == 409 && attempt < FOLD_ATTEMPTS => {}
                // Written again and again meanwhile: the next plan, from the newer version,
                // still sees the other shape and folds.
                Err(kube::Error::Api(s)) if s.code == 409 => return Err(Error::Stale),
                Err(source) => return Err(failed(source)),
            }
            current = match api.get_opt(&name).await.map_err(failed)? {
                Some(o) => std::borrow::Cow::Owned(o),
                None => return Ok(None),
            };
        }
        // Not reached: the last attempt returns.
        Err(Error::Stale)
    }

    /// Deletes a child the plan no longer produces.
    #[tracing::instrument(level = "debug", name = "prune", skip_all, fields(kind = %child.resource.kind, child = %child.name))]
    pub(crate) async fn prune(&self, child: &Deletion) -> Result<(), Error> {
        tracing::info!(
            child = child.describe(),
            "deleting a child the plan no longer produces"
        );
        self.delete(child).await
    }

    /// Deletes an object (background propagation); one already gone, or replaced by another
    /// of the same name when a uid is given, counts as deleted.
    #[tracing::instrument(level = "debug", name = "delete", skip_all, fields(kind = %d.resource.kind, child = %d.name))]
    pub(crate) async fn delete(&self, d: &Deletion) -> Result<(), Error> {
        let api = dynamic_api(&self.ctx, &d.resource, d.namespace.as_deref());
        self.ctx.may_write("delete")?;
        let dp = DeleteParams {
            preconditions: d.uid.clone().map(|uid| kube::api::Preconditions {
                uid: Some(uid),
                resource_version: None,
            }),
            ..DeleteParams::background()
        };
        match api.delete(&d.name, &dp).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 || (s.code == 409 && d.uid.is_some()) => Ok(()),
            Err(source) => Err(Error::Prune {
                child: d.describe(),
                source,
            }),
        }
    }

    /// Deletes the primary object, only if it is still the one planned for (same uid).
    #[tracing::instrument(level = "debug", name = "delete", skip_all)]
    pub(crate) async fn delete_object<K: Watchable>(&self, obj: &K) -> Result<(), Error> {
        self.delete(&Deletion::of(obj)).await
    }

    /// Whether `desired` is what the object's status already is, as far as this replica
    /// knows (its own last write included): nothing to write.
    pub(crate) fn status_stored<K, S>(&self, obj: &K, desired: &serde_json::Value) -> Result<bool, Error>
    where
        K: Watchable,
        S: Serialize + DeserializeOwned + Default,
    {
        Ok(self.status_base::<K, S>(obj, desired)?.is_none())
    }

    /// The resourceVersion a write of `desired` is made against, or `None` when the status
    /// already is `desired`.
    fn status_base<K, S>(&self, obj: &K, desired: &serde_json::Value) -> Result<Option<String>, Error>
    where
        K: Watchable,
        S: Serialize + DeserializeOwned + Default,
    {
        let uid = obj.uid().unwrap_or_default();
        let cached = obj.resource_version().unwrap_or_default();
        Ok(match self.ctx.status_writes().base(&uid, &cached) {
            StatusBase::Written { version, status } => (status_hash(desired) != status).then_some(version),
            StatusBase::Cache => {
                // Read as `S`: fields of the status that `S` does not know are not the plan's.
                let live: S = serde_json::from_value(crate::diff::status_of(obj)).unwrap_or_default();
                (!same(desired, &serde_json::to_value(live)?)).then_some(cached)
            }
        })
    }

    /// Applies `desired` through the status subresource unless the live status (read as `S`)
    /// is the same: a field the plan no longer sets is written away too. Returns whether it
    /// wrote. With `echo`, its watch event triggers nothing.
    #[tracing::instrument(level = "debug", name = "status", skip_all)]
    pub(crate) async fn status<K, S>(
        &self,
        obj: &K,
        desired: serde_json::Value,
        echo: bool,
    ) -> Result<bool, Error>
    where
        K: Watchable,
        S: Serialize + DeserializeOwned + Default,
    {
        let uid = obj.uid().unwrap_or_default();
        let Some(precondition) = self.status_base::<K, S>(obj, &desired)? else {
            return Ok(false);
        };
        // The resourceVersion the plan saw is a precondition: a plan made from a stale cache
        // (another replica or reconcile wrote since) gets a conflict and is made again from
        // the newer object, so a status never goes backwards and its Events are not repeated.
        let body = serde_json::json!({
            "apiVersion": K::api_version(&()),
            "kind": K::kind(&()),
            "metadata": {"resourceVersion": precondition},
            "status": desired,
        });
        let api: Api<K> = api(self.ctx.client(), obj.namespace().as_deref());
        let pp = apply_params(self.ctx.field_manager()).force();
        self.ctx.may_write("apply_status")?;
        match api.patch_status(&obj.name_any(), &pp, &Patch::Apply(&body)).await {
            Ok(written) => {
                if let Some(to) = written.resource_version() {
                    if echo {
                        self.ctx.echoes().record(
                            &K::kind(&()),
                            obj.namespace().as_deref(),
                            &obj.name_any(),
                            to.clone(),
                        );
                    }
                    self.ctx
                        .status_writes()
                        .record(&uid, &precondition, to, status_hash(&body["status"]));
                }
                Ok(true)
            }
            Err(kube::Error::Api(s)) if s.code == 409 => Err(Error::Stale),
            Err(source) => Err(Error::Status { source }),
        }
    }

    /// Merges `desired` conditions into the live status (every other status field kept, so
    /// the apply removes nothing). Returns whether the first of them changed (a new reason,
    /// status or message), so the caller can warn once per change.
    #[tracing::instrument(level = "debug", name = "status", skip_all)]
    pub(crate) async fn conditions<K, S>(
        &self,
        obj: &K,
        desired: Vec<Desired<'static>>,
        now: Timestamp,
    ) -> Result<bool, Error>
    where
        K: Watchable,
        S: Serialize + DeserializeOwned + Default,
    {
        let mut status = crate::diff::status_of(obj);
        if !status.is_object() {
            status = serde_json::json!({});
        }
        let existing: Vec<Condition> =
            serde_json::from_value(status["conditions"].clone()).unwrap_or_default();
        let news = desired.first().is_some_and(|d| {
            conditions::find(&existing, d.type_).is_none_or(|c| {
                c.status != conditions::status_str(d.status) || c.reason != d.reason || c.message != d.message
            })
        });
        let generation = obj.meta().generation;
        let merged = conditions::merge(&existing, &desired, generation, &Time(now));
        status["conditions"] = serde_json::to_value(merged)?;
        status["observedGeneration"] = serde_json::to_value(generation)?;
        self.status::<K, S>(obj, status, true).await?;
        Ok(news)
    }

    /// Adds (`present`) or removes this controller's `finalizer` on `obj` with a server-side
    /// apply of that one entry: other finalizers and fields are untouched.
    #[tracing::instrument(level = "debug", name = "finalizer", skip_all)]
    pub(crate) async fn finalizer<K: Watchable>(
        &self,
        obj: &K,
        finalizer: &str,
        present: bool,
    ) -> Result<(), Error> {
        let mut metadata = serde_json::json!({"name": obj.name_any(), "finalizers": []});
        if let Some(ns) = obj.namespace().filter(|_| namespaced::<K>()) {
            metadata["namespace"] = ns.into();
        }
        // An apply creates what is missing: without the uid, an object deleted since it was
        // read would come back as a name and a finalizer. With it, the API server refuses
        // (409) unless the object is still the one read.
        if let Some(uid) = obj.uid() {
            metadata["uid"] = uid.into();
        }
        if present {
            metadata["finalizers"] = serde_json::json!([finalizer]);
        }
        let body = serde_json::json!({
            "apiVersion": K::api_version(&()),
            "kind": K::kind(&()),
            "metadata": metadata,
        });
        let api: Api<K> = api(self.ctx.client(), obj.namespace().as_deref());
        let pp = apply_params(&format!("{}-finalizer", self.ctx.field_manager())).force();
        self.ctx.may_write("finalizer")?;
        let after = match api.patch(&obj.name_any(), &pp, &Patch::Apply(&body)).await {
            Ok(after) => after,
            // Removing from an object that is already gone.
            Err(kube::Error::Api(s)) if s.code == 404 && !present => return Ok(()),
            // Not the object read: gone, or another of the same name (the forced apply has no
            // field conflicts). Nothing to remove; nothing to add to, as the watch will say.
            Err(kube::Error::Api(s)) if s.code == 409 => {
                return if present { Err(Error::Stale) } else { Ok(()) };
            }
            Err(source) => return Err(Error::Finalizer { source }),
        };
        let listed = after.finalizers().iter().position(|f| f == finalizer);
        match (present, listed) {
            // Applying the list without it only gives up opkit's ownership: another field
            // manager that also lists it (a manifest that carried it: an export, GitOps, a
            // restore) keeps it there. Take it out of the list itself, at the index read.
            (false, Some(i)) => self.remove_finalizer(&api, &obj.name_any(), finalizer, i).await,
            _ => Ok(()),
        }
    }

    /// Removes `finalizer` at index `i` of the object's finalizers, only if it is still there
    /// (a JSON Patch test): a list changed meanwhile fails and the reconcile tries again.
    async fn remove_finalizer<K: Watchable>(
        &self,
        api: &Api<K>,
        name: &str,
        finalizer: &str,
        i: usize,
    ) -> Result<(), Error> {
        let path = format!("/metadata/finalizers/{i}");
        let patch: json_patch::Patch = serde_json::from_value(serde_json::json!([
            {"op": "test", "path": path, "value": finalizer},
            {"op": "remove", "path": path},
        ]))?;
        tracing::info!(
            finalizer,
            "the finalizer is also listed by another field manager: removing it from the list"
        );
        self.ctx.may_write("finalizer")?;
        match api
            .patch(name, &PatchParams::default(), &Patch::<()>::Json(patch))
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(source) => Err(Error::Finalizer { source }),
        }
    }
}

impl Writer {
    /// Lets a sharded object go, as the sharder asked: its shard label comes off, on the
    /// version that was read (a newer one is decided again). The drain label stays, so that
    /// the sharder (even a new one) knows its children are still labelled for this member.
    /// Returns the version let go of.
    pub(crate) async fn release<K: Watchable>(
        &self,
        obj: &K,
        shard: &crate::runtime::context::Shard,
    ) -> Result<Option<String>, Error> {
        let mut labels = serde_json::Map::new();
        labels.insert(shard.label.clone(), serde_json::Value::Null);
        let body = serde_json::json!({
            "metadata": {"resourceVersion": obj.resource_version(), "labels": labels}
        });
        let api: Api<K> = api(self.ctx.client(), obj.namespace().as_deref());
        self.ctx.may_write("release")?;
        match api
            .patch_metadata(&obj.name_any(), &PatchParams::default(), &Patch::Merge(&body))
            .await
        {
            Ok(_) => Ok(obj.resource_version()),
            Err(kube::Error::Api(s)) if s.code == 409 => Err(Error::Stale),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(None),
            Err(source) => Err(Error::Write {
                child: "shard labels".into(),
                source,
            }),
        }
    }
}

impl Writer {
    /// Takes the sharder's adopt note off `obj` (its children are now this member's), on the
    /// version that was read. Returns the object written.
    pub(crate) async fn adopted<K: Watchable>(
        &self,
        obj: &K,
        shard: &crate::runtime::context::Shard,
    ) -> Result<K, Error> {
        let mut annotations = serde_json::Map::new();
        annotations.insert(shard.adopt.clone(), serde_json::Value::Null);
        let body = serde_json::json!({
            "metadata": {"resourceVersion": obj.resource_version(), "annotations": annotations}
        });
        let api: Api<K> = api(self.ctx.client(), obj.namespace().as_deref());
        self.ctx.may_write("adopt")?;
        match api
            .patch(&obj.name_any(), &PatchParams::default(), &Patch::Merge(&body))
            .await
        {
            Ok(written) => {
                if let Some(rv) = written.resource_version() {
                    self.ctx
                        .echoes()
                        .record(&K::kind(&()), obj.namespace().as_deref(), &obj.name_any(), rv);
                }
                Ok(written)
            }
            Err(kube::Error::Api(s)) if s.code == 409 => Err(Error::Stale),
            Err(source) => Err(Error::Write {
                child: "the adopt annotation".into(),
                source,
            }),
        }
    }
}

/// `body` with the labels that tie a child to its sharded owner.
fn shard_labelled(
    body: &serde_json::Value,
    shard: &crate::runtime::context::Shard,
    uid: &str,
) -> serde_json::Value {
    let mut body = body.clone();
    if let Some(meta) = body
        .as_object_mut()
        .map(|o| o.entry("metadata").or_insert_with(|| serde_json::json!({})))
        && let Some(meta) = meta.as_object_mut()
    {
        let labels = meta.entry("labels").or_insert_with(|| serde_json::json!({}));
        if !labels.is_object() {
            *labels = serde_json::json!({});
        }
        labels[&shard.label] = shard.member.clone().into();
        labels[crate::OWNER_LABEL] = uid.into();
    }
    body
}

/// The status to write for a plan that left parts of the spec out: the planned status (or,
/// without one, `live`) with the conditions of `degraded` merged in, and the indexes of those
/// whose condition is new or changed against `live` (each gets a Warning Event). A condition
/// the plan does not set keeps its live `lastTransitionTime` while its status holds, so a
/// repeated plan writes nothing.
pub(crate) fn degraded_status(
    planned: Option<serde_json::Value>,
    live: &serde_json::Value,
    degraded: &[crate::plan::Invalid],
    generation: Option<i64>,
    now: &Time,
) -> Result<(serde_json::Value, Vec<usize>), Error> {
    let conditions_of = |v: &serde_json::Value| -> Vec<Condition> {
        serde_json::from_value(v["conditions"].clone()).unwrap_or_default()
    };
    let live_conditions = conditions_of(live);
    let mut status = planned.unwrap_or_else(|| live.clone());
    if !status.is_object() {
        status = serde_json::json!({});
    }
    let desired: Vec<Desired<'static>> = degraded
        .iter()
        .flat_map(|i| {
            let own = Desired {
                type_: i.condition,
                status: Some(i.status),
                reason: i.reason,
                message: i.message.clone(),
            };
            std::iter::once(own).chain(i.also.iter().cloned())
        })
        .collect();
    // The merge starts from the live condition of each type reported here, even where the
    // plan set that type otherwise (a `Degraded=False` it always writes): the time of the
    // last transition is the live one's.
    let mut existing = conditions_of(&status);
    for d in &desired {
        let live = conditions::find(&live_conditions, d.type_).cloned();
        match (existing.iter_mut().find(|c| c.type_ == d.type_), live) {
            (Some(planned), Some(live)) => *planned = live,
            (None, Some(live)) => existing.push(live),
            (_, None) => {}
        }
    }
    let news = degraded
        .iter()
        .enumerate()
        .filter(|(_, i)| {
            conditions::find(&live_conditions, i.condition).is_none_or(|c| {
                c.status != conditions::status_str(Some(i.status))
                    || c.reason != i.reason
                    || c.message != i.message
            })
        })
        .map(|(n, _)| n)
        .collect();
    status["conditions"] = serde_json::to_value(conditions::merge(&existing, &desired, generation, now))?;
    Ok((status, news))
}

/// What a status write is known by in [`crate::runtime::status::StatusWrites`].
fn status_hash(v: &serde_json::Value) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    v.to_string().hash(&mut h);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sharded_child_is_labelled_for_its_owner_and_its_own_labels_stay() {
        let shard = crate::runtime::context::Shard {
            label: "shard.opkit.dev/memcached".into(),
            member: "m-1".into(),
            drain: String::new(),
            adopt: String::new(),
            released: Default::default(),
            adopted: Default::default(),
        };
        let body = serde_json::json!({"metadata": {"name": "x", "labels": {"app": "memcached"}}});
        let l = shard_labelled(&body, &shard, "u-1");
        assert_eq!(
            l["metadata"]["labels"],
            serde_json::json!({"app": "memcached", "shard.opkit.dev/memcached": "m-1", "opkit.dev/owner-uid": "u-1"})
        );
        let bare = shard_labelled(&serde_json::json!({"kind": "Pod"}), &shard, "u-2");
        assert_eq!(bare["metadata"]["labels"]["opkit.dev/owner-uid"], "u-2");
    }

    #[test]
    fn a_part_left_out_is_merged_into_the_status_and_warned_about_once() {
        use crate::plan::Invalid;
        use serde_json::json;
        let t = |s: i64| Time(Timestamp::from_second(s).expect("time"));
        let bad = || {
            vec![Invalid::new(
                "Degraded",
                true,
                "BadSchedule",
                "schedule \"x\" is not cron",
            )]
        };
        let planned = json!({"lastRun": "t1", "conditions": [
            {"type": "Available", "status": "True", "reason": "Ok", "message": "", "lastTransitionTime": "1970-01-01T00:00:05Z"}]});
        let (status, news) =
            degraded_status(Some(planned.clone()), &json!({}), &bad(), Some(3), &t(100)).expect("status");
        assert_eq!(status["lastRun"], "t1", "the planned status is kept");
        assert_eq!(status["conditions"][0]["type"], "Available");
        assert_eq!(status["conditions"][1]["reason"], "BadSchedule");
        assert_eq!(status["conditions"][1]["observedGeneration"], 3);
        assert_eq!(news, vec![0], "new: warned about");

        // Planned again later from the same spec: the live condition keeps its time, no news.
        let (again, news) =
            degraded_status(Some(planned), &status, &bad(), Some(3), &t(200)).expect("status");
        assert_eq!(again, status, "nothing to write");
        assert!(news.is_empty());

        // A plan that always sets the condition otherwise: the live time still holds.
        let says_fine = json!({"conditions": [
            {"type": "Degraded", "status": "False", "reason": "AsExpected", "message": "", "lastTransitionTime": "1970-01-01T00:03:20Z"}]});
        let (again, news) =
            degraded_status(Some(says_fine), &status, &bad(), Some(3), &t(300)).expect("status");
        let degraded = again["conditions"]
            .as_array()
            .expect("conditions")
            .iter()
            .find(|c| c["type"] == "Degraded")
            .cloned();
        assert_eq!(degraded.as_ref().map(|c| &c["status"]), Some(&json!("True")));
        assert_eq!(
            degraded.map(|c| c["lastTransitionTime"].clone()),
            Some(status["conditions"][1]["lastTransitionTime"].clone()),
            "the transition time of the live condition"
        );
        assert!(news.is_empty());

        // No planned status: the live one is the base.
        let live = json!({"phase": "Running"});
        let (status, _) = degraded_status(None, &live, &bad(), Some(3), &t(100)).expect("status");
        assert_eq!(status["phase"], "Running");
        assert_eq!(status["conditions"][0]["type"], "Degraded");
    }
}
