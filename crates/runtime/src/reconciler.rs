//! The controller skeleton: a controller declares what it watches and turns what it observed
//! into a [`Plan`] with a pure function; opkit's runtime carries the plan out.
//!
//! ```text
//! watch (declared once) → observe (caches, rarely a read) → plan (pure) → opkit: apply children,
//! prune orphans, write status, publish Events, requeue
//! ```
//!
//! Because `plan` sees neither a client nor the clock, every decision of a controller is a unit
//! test away; because opkit does all the writing, every controller gets no-op skipping, status
//! through the subresource, Events, metrics, per-object backoff and synced caches for free.
use std::future::Future;

use k8s_openapi::jiff::Timestamp;
use kube::Client;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::kind::Watchable;
use crate::plan::{Cleanup, Invalid, Plan};
use crate::runtime::watches::Watches;

/// One controller: what it reconciles, what it watches and how it decides.
///
/// Implement it in the controller's own folder and list it in the registry; nothing else is
/// needed to run it, generate its RBAC or select it with `--controllers`.
///
/// A controller that keeps a copy `<name>-copy` of every ConfigMap labelled `mirror`, and
/// the unit test of its plan (no cluster needed: the plan sees neither a client nor the
/// clock):
///
/// ```
/// use std::collections::BTreeMap;
/// use std::sync::Arc;
///
/// use opkit_runtime::k8s_openapi::api::core::v1::ConfigMap;
/// use opkit_runtime::k8s_openapi::jiff::Timestamp;
/// use opkit_runtime::kube::{Client, Resource, ResourceExt};
/// use opkit_runtime::{Cache, Child, Invalid, Plan, Reconciler, Requeue, Watch, Watches};
///
/// struct Mirror;
///
/// impl Reconciler for Mirror {
///     type Object = ConfigMap;
///     type Caches = Cache<ConfigMap>;
///     type World = Option<Arc<ConfigMap>>;
///     type Status = (); // a ConfigMap has no status: the plan writes none
///
///     fn name(&self) -> &'static str {
///         "mirror"
///     }
///
///     fn primary(&self) -> Watch<ConfigMap> {
///         Watch::labels("mirror")
///     }
///
///     fn watch(&self, w: &mut Watches<ConfigMap>) -> Cache<ConfigMap> {
///         // The copies: a change to one reconciles the ConfigMap that owns it.
///         w.owns(Watch::labels("mirror-of"))
///     }
///
///     async fn observe(&self, cm: &ConfigMap, copies: &Self::Caches, _: &Client) -> opkit_runtime::kube::Result<Self::World> {
///         Ok(copies.get(&cm.namespace().unwrap_or_default(), &format!("{}-copy", cm.name_any())))
///     }
///
///     fn plan(&self, cm: &ConfigMap, live: &Self::World, _: Timestamp) -> Result<Plan<()>, Invalid> {
///         let mut copy = ConfigMap {
///             data: cm.data.clone(),
///             ..Default::default()
///         };
///         copy.metadata.name = Some(format!("{}-copy", cm.name_any()));
///         copy.metadata.namespace = cm.namespace();
///         copy.metadata.labels = Some(BTreeMap::from([("mirror-of".into(), cm.name_any())]));
///         // Owned: garbage-collected with the original, and its changes are watched.
///         copy.metadata.owner_references = cm.controller_owner_ref(&()).map(|o| vec![o]);
///         // Written only when the live copy differs from this one.
///         Ok(Plan::nothing(Requeue::OnChange).child(Child::apply(&copy, live.as_deref())))
///     }
/// }
///
/// let mut original = ConfigMap {
///     data: Some(BTreeMap::from([("colour".into(), "blue".into())])),
///     ..Default::default()
/// };
/// original.metadata.name = Some("settings".into());
/// original.metadata.namespace = Some("default".into());
/// original.metadata.uid = Some("0b2e".into());
/// let plan = Mirror.plan(&original, &None, Timestamp::UNIX_EPOCH).unwrap();
/// assert!(plan.children[0].is_needed(), "no copy yet: it is written");
/// ```
pub trait Reconciler: Send + Sync + 'static {
    /// The primary kind; one reconcile per object of it.
    type Object: Watchable + Serialize;
    /// The caches [`Reconciler::watch`] builds, read by [`Reconciler::observe`].
    type Caches: Send + Sync + 'static;
    /// Everything [`Reconciler::plan`] needs about the world besides the object itself.
    type World: Send + 'static;
    /// The status written through the status subresource. A missing live status counts as
    /// `Default`, so a plan that asks for the defaults writes nothing.
    type Status: Serialize + DeserializeOwned + Default + Send + 'static;

    /// Name for `--controllers`, metrics labels, logs and the field manager `opkit-<name>`.
    fn name(&self) -> &'static str;

    /// The controller's own settings (concurrency, backoff, timeout), starting from the
    /// manager's `defaults`; `opkit run --tune NAME.KEY=VALUE` still overrides them.
    fn tuning(&self, defaults: crate::tuning::Tuning) -> crate::tuning::Tuning {
        defaults
    }

    /// How the primary kind is watched: every object in scope by default; a label selector,
    /// a trim of what the plan never reads (memory scales with the number of objects), an
    /// event filter ([`crate::Watch::on_change`]) or indexes narrow it. A controller whose
    /// primary watch equals another controller's watch of that kind shares its cache.
    fn primary(&self) -> crate::Watch<Self::Object> {
        crate::Watch::all()
    }

    /// Declares the secondary watches and returns the caches they fill. Called once per
    /// watched namespace; no reconcile starts before every cache declared here has synced.
    fn watch(&self, w: &mut Watches<Self::Object>) -> Self::Caches;

    /// Collects what the plan needs. Normally cache lookups only; the client is there for the
    /// rare read a cache cannot answer (an object that may just not have reached the cache).
    fn observe(
        &self,
        obj: &Self::Object,
        cache: &Self::Caches,
        client: &Client,
    ) -> impl Future<Output = kube::Result<Self::World>> + Send;

    /// Decides, without side effects, what should be true of the cluster for `obj` at `now`.
    /// Not called for an object that is being deleted.
    fn plan(
        &self,
        obj: &Self::Object,
        world: &Self::World,
        now: Timestamp,
    ) -> Result<Plan<Self::Status>, Invalid>;

    /// Whether objects of the primary kind need [`Reconciler::cleanup`] before they go. opkit
    /// then keeps its finalizer ([`crate::finalizer_name`]) on each of them, added before any other write
    /// for the object, and removes it only once the cleanup reports done. Only for what owner
    /// references cannot clean up: children in other namespaces, cluster-scoped children,
    /// anything outside the cluster.
    fn cleans_up(&self) -> bool {
        false
    }

    /// Whether this controller must see every object at once in one replica (a plan that
    /// compares objects with each other, a quota over all of them). With `opkit run
    /// --sharding` it then runs on the leader only, as without sharding; every other
    /// controller is sharded: each replica reconciles only the objects placed on it.
    fn singleton(&self) -> bool {
        false
    }

    /// Whether to shard this controller although its primary is a built-in kind watched
    /// without a selector (every Deployment of the cluster, `kube-system`'s included). Off by
    /// default: sharding labels every object of the primary kind and sends each new one
    /// through a placement webhook, which a controller that only looks at some of them must
    /// not do to everyone's; such a controller runs on the leader only, as a
    /// [`Reconciler::singleton`] does. Give the primary a selector, or return `true`.
    fn shards_all_of_a_built_in_kind(&self) -> bool {
        false
    }

    /// Decides, without side effects, what deleting `obj` still requires, from the same
    /// observed world as [`Reconciler::plan`] (the object and the caches are still readable).
    /// Called on every reconcile while the object is being deleted and carries the finalizer,
    /// so it must be safe to repeat: it lists what is still there, and reports done when
    /// nothing is.
    fn cleanup(&self, _obj: &Self::Object, _world: &Self::World, _now: Timestamp) -> Cleanup<Self::Status> {
        Cleanup::done()
    }
}
