//! Watches of kinds named when the operator runs ([`DynamicKind`]): found by discovery, and
//! watched as optional watches are, since such a kind may be installed later or go.
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use futures::StreamExt;
use futures::stream::BoxStream;
use kube::core::{ApiResource, DynamicObject, GroupVersion};
use kube::discovery::{Scope, verbs};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};

use super::{Watches, optional, streamed, triggers};
use crate::cache::{DynamicCache, Watch, keep_applied, measure};
use crate::kind::{DynamicKind, ResolvedKind, Watchable};

impl<K: Watchable> Watches<K> {
    /// Watches a kind named when the operator runs (a flag, a configuration file): a change
    /// to one of its objects reconciles the primary objects `map` names. Discovery finds the
    /// kind's scope and `kind` ([`DynamicCache::kind`], what [`crate::Child::apply_dynamic`]
    /// and [`crate::Deletion::of_dynamic`] need). The watch is always optional
    /// ([`Watch::optional`]): while the apiserver does not serve the kind, the cache is empty
    /// and the controller ready without it; once it is served (within about 5 s) it is
    /// listed and watched, and when it goes its objects leave the cache as deletions. The
    /// watch's selectors, trim, [`Watch::on_change`] and [`Watch::applied`] apply; indexes,
    /// pruning and `fair_by` are for kinds known when the operator is built.
    pub fn dynamic<I>(
        &mut self,
        kind: &DynamicKind,
        w: Watch<DynamicObject>,
        map: impl Fn(&DynamicObject) -> I + Send + Sync + 'static,
    ) -> DynamicCache
    where
        I: IntoIterator<Item = ObjectRef<K>>,
    {
        assert!(
            w.indexes.is_empty() && !w.prune && w.fair_by.is_none(),
            "the dynamic watch of {kind} declares indexes, pruning or fair_by: those are for kinds known when the operator is built"
        );
        // The store's key of every object: the kind's own name is not known yet.
        let keyed = ApiResource {
            group: kind.group.clone(),
            version: kind.version.clone(),
            api_version: kind.api_version(),
            kind: String::new(),
            plural: kind.plural.clone(),
        };
        let writer = reflector::store::Writer::new(keyed.clone());
        let cache = DynamicCache::new(writer.as_reader(), keyed);
        let mut cfg = watcher::Config::default();
        if let Some(l) = &w.labels {
            cfg = cfg.labels(l);
        }
        if let Some(f) = &w.fields {
            cfg = cfg.fields(f);
        }
        let active = Arc::new(AtomicBool::new(false));
        let connect = {
            let (client, namespace, cache, kind) = (
                self.client.clone(),
                self.namespace.clone(),
                cache.clone(),
                kind.clone(),
            );
            move || {
                connect(
                    client.clone(),
                    namespace.clone(),
                    cfg.clone(),
                    cache.clone(),
                    kind.clone(),
                )
            }
        };
        let name = kind.to_string();
        let cached = cache.clone();
        let events = optional(connect, move || cached.all(), active.clone(), name.clone(), true);
        let applied = w.applied.as_ref().map(|_| self.field_manager.clone());
        let trim = w.trim.clone();
        let typed = cache.clone();
        let events = events.modify(move |o| {
            // Listed objects of built-in kinds come without them; a plan compares with them.
            if o.types.is_none()
                && let Some(k) = typed.kind()
            {
                o.types = Some(kube::core::TypeMeta {
                    api_version: k.resource.api_version,
                    kind: k.resource.kind,
                });
            }
            if let Some(manager) = &applied {
                keep_applied(o, manager);
            }
            o.managed_fields_mut().clear();
            if let Some(t) = &trim {
                (t.apply)(o);
            }
        });
        let known = cache.clone();
        let named = name.clone();
        let stream = reflector::reflector(writer, events)
            .inspect(move |ev| {
                if let Err(e) = ev {
                    tracing::warn!(kind = %named, error = %e, "watch failed; retrying with backoff");
                }
            })
            .inspect(self.synced.track())
            .filter(triggers(w.filter, self.echoes.clone(), move || {
                known.kind().map(|k| k.resource.kind)
            }));
        let measured = cache.store();
        self.metrics.cache(&name, move || measure(&measured));
        self.metrics.optional_watch(&name, active);
        self.trigger(stream, move |o: DynamicObject| map(&o).into_iter().collect());
        cache
    }
}

/// A new watch of `kind`: discovery, then the watcher in `namespace` (ignored for a
/// cluster-scoped kind); a kind not served ends it with a 404, as a watch of a CRD that is
/// not installed would.
fn connect(
    client: Client,
    namespace: Option<String>,
    cfg: watcher::Config,
    cache: DynamicCache,
    kind: DynamicKind,
) -> BoxStream<'static, watcher::Result<watcher::Event<DynamicObject>>> {
    futures::stream::once(async move { discover(&client, &kind).await.map(|found| (client, found)) })
        .flat_map(move |found| -> BoxStream<'static, _> {
            match found {
                Ok((client, found)) => {
                    let api = match (&namespace, found.namespaced) {
                        (Some(ns), true) => Api::namespaced_with(client, ns, &found.resource),
                        _ => Api::all_with(client, &found.resource),
                    };
                    cache.resolve(found);
                    streamed(api, cfg.clone())
                }
                Err(e) => {
                    if matches!(&e, kube::Error::Api(s) if s.code == 404) {
                        cache.unresolve();
                    }
                    futures::stream::iter([Err(watcher::Error::InitialListFailed(e))]).boxed()
                }
            }
        })
        .boxed()
}

/// The kind, plural and scope the apiserver serves `kind` with; a 404 when it does not, a 405
/// when it cannot be listed and watched.
async fn discover(client: &Client, kind: &DynamicKind) -> kube::Result<ResolvedKind> {
    let refused = |code: u16, reason: &str, message: String| {
        kube::Error::Api(
            kube::core::Status::failure(&message, reason)
                .with_code(code)
                .boxed(),
        )
    };
    let group = kube::discovery::pinned_group(client, &GroupVersion::gv(&kind.group, &kind.version)).await?;
    let (resource, caps) = group
        .versioned_resources(&kind.version)
        .into_iter()
        .find(|(r, _)| r.plural == kind.plural)
        .ok_or_else(|| refused(404, "NotFound", format!("{kind} is not served")))?;
    for verb in [verbs::LIST, verbs::WATCH] {
        if !caps.supports_operation(verb) {
            return Err(refused(
                405,
                "MethodNotAllowed",
                format!("{kind} does not support {verb}"),
            ));
        }
    }
    Ok(ResolvedKind::new(resource, caps.scope == Scope::Namespaced))
}
