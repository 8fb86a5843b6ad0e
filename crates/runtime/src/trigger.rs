//! Reconciles asked for by something the apiserver never hears of: a file that changed, an
//! HTTP callback, a message from an outside system.
use std::sync::{Arc, Mutex};

use futures::channel::mpsc::{UnboundedReceiver, UnboundedSender, unbounded};
use kube::Resource;
use kube::runtime::reflector::ObjectRef;

/// Asks the controllers subscribed to it ([`crate::Watches::triggered_by`]) to reconcile one
/// object, or all of theirs, as a watch event would: soon, once per burst (requests for an
/// object already queued merge), behind the same sync gate, concurrency limit and backoff.
///
/// Made once (in the reconciler, or where the outside source is read) and cloned freely;
/// asking costs a message per subscribed watch scope and never blocks. A controller that has
/// not subscribed yet misses what was asked before.
pub struct Trigger<K: Resource<DynamicType = ()>> {
    subscribers: Arc<Mutex<Vec<Subscriber<K>>>>,
}

struct Subscriber<K: Resource<DynamicType = ()>> {
    /// The namespace the subscribed scope watches (`None`: all, or a cluster-scoped kind).
    namespace: Option<String>,
    one: UnboundedSender<ObjectRef<K>>,
    all: UnboundedSender<()>,
}

impl<K: Resource<DynamicType = ()>> Clone for Trigger<K> {
    fn clone(&self) -> Self {
        Trigger {
            subscribers: self.subscribers.clone(),
        }
    }
}

impl<K: Resource<DynamicType = ()>> Default for Trigger<K> {
    fn default() -> Self {
        Trigger {
            subscribers: Arc::default(),
        }
    }
}

impl<K: Resource<DynamicType = ()>> std::fmt::Debug for Trigger<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trigger").finish_non_exhaustive()
    }
}

impl<K: Resource<DynamicType = ()>> Trigger<K> {
    /// A trigger no controller listens to yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reconciles the object `name` in `namespace` (`None` for a cluster-scoped kind). An
    /// object no subscribed controller caches is ignored, as the work queue ignores a request
    /// for an object that is gone.
    pub fn reconcile(&self, namespace: Option<&str>, name: &str) {
        let r = match namespace {
            Some(ns) => ObjectRef::new(name).within(ns),
            None => ObjectRef::new(name),
        };
        self.send(|s| {
            let mine = s.namespace.is_none() || s.namespace.as_deref() == namespace;
            !mine || s.one.unbounded_send(r.clone()).is_ok()
        });
    }

    /// Reconciles every object the subscribed controllers cache (a setting all of them read
    /// has changed).
    pub fn reconcile_all(&self) {
        self.send(|s| s.all.unbounded_send(()).is_ok());
    }

    /// Sends through `f` to every subscriber, dropping those whose controller has stopped.
    fn send(&self, f: impl Fn(&Subscriber<K>) -> bool) {
        self.subscribers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|s| !s.one.is_closed() && f(s));
    }

    /// The requests for one watch scope: of single objects, and of all.
    pub(crate) fn subscribe(
        &self,
        namespace: Option<String>,
    ) -> (UnboundedReceiver<ObjectRef<K>>, UnboundedReceiver<()>) {
        let (one, one_rx) = unbounded();
        let (all, all_rx) = unbounded();
        self.subscribers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Subscriber { namespace, one, all });
        (one_rx, all_rx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use k8s_openapi::api::core::v1::ConfigMap;

    #[tokio::test]
    async fn a_request_reaches_the_scopes_that_watch_its_namespace() {
        let t: Trigger<ConfigMap> = Trigger::new();
        let (mut a, mut a_all) = t.subscribe(Some("a".into()));
        let (mut any, _any_all) = t.subscribe(None);
        t.reconcile(Some("b"), "x");
        t.reconcile(Some("a"), "y");
        t.reconcile_all();
        assert_eq!(a.next().await.unwrap().name, "y", "not b's x");
        assert_eq!(any.next().await.unwrap().name, "x");
        assert_eq!(any.next().await.unwrap().name, "y");
        assert_eq!(a_all.next().await, Some(()));
        drop((a, a_all));
        t.reconcile(Some("a"), "z");
        assert_eq!(
            t.subscribers.lock().unwrap().len(),
            1,
            "the stopped scope is dropped"
        );
    }
}
