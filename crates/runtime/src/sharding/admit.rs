//! Placing new objects when they are created: a mutating webhook sets the shard label on the
//! create itself, so a new object costs no label write of the sharder's, and its owner sees
//! it with its first watch event.
//!
//! Every replica that serves webhooks keeps its own view of the members (a watch of the
//! member Leases) and labels with the ring of the members it sees holding their Leases, as
//! the sharder does. The sharder stays the authority: an object labelled against its own
//! ring moves by the usual drain handshake, and an object labelled for a member it has not
//! seen yet (this replica's watch was ahead of the sharder's) waits until the sharder has
//! read that member's Lease. The webhook's failure policy is `Ignore`: while no replica
//! answers, the sharder labels new objects as it always does.
//!
//! A controller whose primary watch selects by label or field gets no placement webhook
//! (the sharder applies its selectors), and the webhook of a controller watching some
//! namespaces is sent only their requests.
use std::sync::{Arc, RwLock};

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;
use kube::core::PartialObjectMeta;
use kube::core::admission::Operation;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Resource, ResourceExt};

use super::{GROUP_LABEL, Members, Ring, member_of, ring, shard_label};
use crate::kind::Watchable;
use crate::webhook::{FailurePolicy, Review, Rule, Verdict, Webhooks, intern};

/// The ring of the members this replica sees, shared by its placement webhooks.
#[derive(Clone, Debug, Default)]
pub struct View(Arc<RwLock<Ring>>);

impl View {
    /// The member the ring places `key` on, if any member is known yet.
    pub fn owner(&self, key: &str) -> Option<String> {
        self.0
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .owner(key)
            .map(str::to_string)
    }

    fn set(&self, ring: Ring) {
        *self.0.write().unwrap_or_else(std::sync::PoisonError::into_inner) = ring;
    }

    /// Whether the ring is of exactly `members` (sorted).
    fn is_of(&self, members: &[String]) -> bool {
        self.0
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .members()
            == members
    }
}

/// Keeps `view` on the members of `group` whose Leases (in `leases`) name a holder, until
/// the future is dropped.
pub(crate) async fn watch(leases: Api<Lease>, group: String, view: View) {
    let selector = format!("{GROUP_LABEL}={group}");
    let mut events = watcher(leases, watcher::Config::default().labels(&selector))
        .default_backoff()
        .boxed();
    let mut members = Members::default();
    let mut listing = Members::default();
    while let Some(ev) = events.next().await {
        let now = std::time::Instant::now();
        match ev {
            Ok(watcher::Event::Apply(l)) => {
                if let (Some(m), Some(spec)) = (member_of(&l), l.spec.clone()) {
                    members.observe(&m, spec, super::rejoin(&l), now);
                }
            }
            Ok(watcher::Event::Delete(l)) => {
                if let Some(m) = member_of(&l) {
                    // Placement is a first guess the sharder corrects: a member whose
                    // Lease is deleted gets no new objects, whatever its grace.
                    members.forget(&m);
                }
            }
            // A relist replaces what was known once it is complete.
            Ok(watcher::Event::Init) => listing = Members::default(),
            Ok(watcher::Event::InitApply(l)) => {
                if let (Some(m), Some(spec)) = (member_of(&l), l.spec.clone()) {
                    listing.observe(&m, spec, super::rejoin(&l), now);
                }
                continue;
            }
            Ok(watcher::Event::InitDone) => members = std::mem::take(&mut listing),
            Err(e) => {
                tracing::warn!(error = %e, "placement: watching the member Leases failed; retrying");
                continue;
            }
        }
        members.settle(now);
        let held = members.held();
        if !view.is_of(&held) {
            tracing::debug!(members = ?held, "placement: members changed");
            view.set(Ring::new(&held));
        }
    }
}

/// The webhook that places new objects of `controller` (kind `K`) by `view`. Only for a
/// controller whose primary watch has no label or field selector: the webhook would be
/// sent objects the controller does not watch.
pub(crate) fn webhook<K: Watchable>(controller: &'static str, view: View) -> Webhooks {
    let rule = Rule {
        name: intern(format!("{controller}.shard.opkit.dev")),
        path: intern(path(controller)),
        ..Rule::mutating::<K>()
    }
    .versions(&["*"])
    .operations(&["CREATE"])
    .failure_policy(FailurePolicy::Ignore);
    let label = shard_label(controller);
    Webhooks::new().mutating(rule, move |review: Review<PartialObjectMeta<K>>| {
        std::future::ready(place(&review, &label, &view))
    })
}

/// The path the placement webhook of `controller` is served at.
pub fn path(controller: &str) -> String {
    format!("/shard-{controller}")
}

/// The label to add to a new object, if it has none and a member is known.
fn place<K: Resource<DynamicType = ()>>(
    review: &Review<PartialObjectMeta<K>>,
    label: &str,
    view: &View,
) -> Verdict {
    let Some(o) = review
        .object
        .as_ref()
        .filter(|_| review.operation == Operation::Create)
    else {
        return Verdict::allow();
    };
    // Placed by hand (the sharder checks it), or named by generateName after admission.
    let Some(name) = o.metadata.name.as_deref().filter(|n| !n.is_empty()) else {
        return Verdict::allow();
    };
    if o.labels().contains_key(label) {
        return Verdict::allow();
    }
    let namespace = review.namespace.as_deref().or(o.metadata.namespace.as_deref());
    let Some(owner) = view.owner(&ring::key(namespace, name)) else {
        return Verdict::allow();
    };
    use json_patch::jsonptr::PointerBuf;
    use json_patch::{AddOperation, PatchOperation};
    let op = if o.metadata.labels.is_some() {
        AddOperation {
            path: PointerBuf::from_tokens(["metadata", "labels", label]),
            value: owner.into(),
        }
    } else {
        AddOperation {
            path: PointerBuf::from_tokens(["metadata", "labels"]),
            value: serde_json::json!({ label: owner }),
        }
    };
    Verdict {
        patch: vec![PatchOperation::Add(op)],
        ..Verdict::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;

    fn review(
        name: Option<&str>,
        labels: Option<&[(&str, &str)]>,
        op: Operation,
    ) -> Review<PartialObjectMeta<ConfigMap>> {
        let mut o = PartialObjectMeta::<ConfigMap>::default();
        o.metadata.name = name.map(String::from);
        o.metadata.labels = labels.map(|l| l.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
        Review::new(op, Some(o), None, Some("ns"))
    }

    fn applied(r: &Review<PartialObjectMeta<ConfigMap>>, v: &Verdict) -> serde_json::Value {
        let mut doc = serde_json::to_value(r.object.as_ref().unwrap()).unwrap();
        json_patch::patch(&mut doc, &v.patch).unwrap();
        doc["metadata"]["labels"].clone()
    }

    #[test]
    fn a_new_object_gets_the_label_of_the_member_the_ring_places_it_on() {
        let view = View::default();
        let label = shard_label("probe");
        // No member known yet: left to the sharder.
        assert_eq!(
            place(&review(Some("a"), None, Operation::Create), &label, &view),
            Verdict::allow()
        );
        view.set(Ring::new(["m0", "m1", "m2"]));
        let want = Ring::new(["m0", "m1", "m2"])
            .owner(&ring::key(Some("ns"), "a"))
            .unwrap()
            .to_string();
        let r = review(Some("a"), None, Operation::Create);
        assert_eq!(
            applied(&r, &place(&r, &label, &view)),
            serde_json::json!({ &label: want })
        );
        let r = review(Some("a"), Some(&[("app", "x")]), Operation::Create);
        assert_eq!(
            applied(&r, &place(&r, &label, &view)),
            serde_json::json!({ "app": "x", &label: want })
        );
    }

    #[test]
    fn labelled_unnamed_and_updated_objects_are_left_alone() {
        let view = View::default();
        view.set(Ring::new(["m0"]));
        let label = shard_label("probe");
        for r in [
            review(Some("a"), Some(&[(label.as_str(), "m9")]), Operation::Create),
            review(None, None, Operation::Create),
            review(Some("a"), None, Operation::Update),
        ] {
            assert_eq!(place(&r, &label, &view), Verdict::allow());
        }
    }
}
