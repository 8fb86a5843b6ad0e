//! The status writes whose watch events the primary cache has not delivered yet.
//!
//! Right after a status write, a reconcile triggered by a child still reads the primary as it
//! was before it. Planned from that, the status looks out of date, and its write — with the
//! stale resourceVersion as precondition — only earns a conflict and a second round. So each
//! write is remembered (per uid: the resourceVersions the write came from and produced, and a
//! hash of what it wrote) until the cache shows the last of them: a plan made from a version
//! this replica has since replaced compares against what it wrote, and writes with the
//! resourceVersion it got back. A version not in the chain means someone else wrote: the
//! entry is dropped and the cache decides, as before.
//!
//! A chain goes as soon as the primary watch delivers its last version, unless a reconcile of
//! the object is under way (it may hold the copy from before): then it goes when that
//! reconcile ends. So the chains are the writes in flight, not one per object written.
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::Resource;
use kube::runtime::watcher;
use prometheus_client::metrics::gauge::Gauge;

use crate::expiring::Expiring;

/// Chains untouched for this long are dropped (their watch events were lost or the object is
/// gone); the next plan then trusts the cache.
const CHAIN_TTL: Duration = Duration::from_secs(120);

/// The status writes of one controller, shared by its write path and its primary watch.
#[derive(Default)]
pub(crate) struct StatusWrites {
    chains: Mutex<Chains>,
    /// `opkit_status_writes_unseen`: the chains held.
    unseen: Gauge,
}

#[derive(Default)]
struct Chains {
    by_uid: Expiring<String, StatusChain, 1025>,
    /// The objects (by uid) a reconcile is under way for.
    busy: HashMap<String, Reconciling>,
}

/// The reconciles under way for one object.
#[derive(Default)]
struct Reconciling {
    count: u32,
    /// The last version the watch delivered meanwhile, and whether it delivered the deletion:
    /// a write's event can come before the write's answer has been recorded.
    delivered: Option<String>,
    deleted: bool,
}

/// Whether the cached version `cached` is `wanted` or a later one. resourceVersions are
/// opaque, but etcd's are integers that only grow; anything else must match exactly.
pub(crate) fn not_older(cached: Option<&str>, wanted: &str) -> bool {
    match (cached.and_then(|c| c.parse::<u64>().ok()), wanted.parse::<u64>()) {
        (Some(c), Ok(w)) => c >= w,
        _ => cached == Some(wanted),
    }
}

/// Whether resourceVersion `a` comes before `b`. They are opaque, but etcd's are integers
/// that only grow; of others, none is known to come before another.
fn before(a: &str, b: &str) -> bool {
    matches!((a.parse::<u64>(), b.parse::<u64>()), (Ok(a), Ok(b)) if a < b)
}

struct StatusChain {
    /// resourceVersions, oldest first; the last is what the latest write returned.
    versions: Vec<String>,
    /// Hash of the status the latest write applied.
    status: u64,
    at: Instant,
    /// The watch delivered the last version (or someone else's) while a reconcile was under
    /// way: the chain goes when the reconciles end.
    seen: bool,
}

/// What a status write should compare against and send as its precondition.
pub(crate) enum StatusBase {
    /// The cached object is current (as far as this replica knows).
    Cache,
    /// The cached object is older than this replica's own last write.
    Written { version: String, status: u64 },
}

/// A reconcile under way for an object; dropping it ends it (see [`StatusWrites::busy`]).
pub(crate) struct Busy {
    writes: Arc<StatusWrites>,
    uid: String,
}

impl Drop for Busy {
    fn drop(&mut self) {
        let mut chains = self.writes.lock();
        let left = match chains.busy.get_mut(&self.uid) {
            Some(r) if r.count > 1 => {
                r.count -= 1;
                true
            }
            _ => {
                chains.busy.remove(&self.uid);
                false
            }
        };
        if !left && chains.by_uid.get(&self.uid).is_some_and(|c| c.seen) {
            chains.by_uid.remove(&self.uid);
        }
    }
}

/// The chains, locked; the gauge follows their number as the lock is let go.
struct Locked<'a> {
    chains: std::sync::MutexGuard<'a, Chains>,
    unseen: &'a Gauge,
}

impl std::ops::Deref for Locked<'_> {
    type Target = Chains;
    fn deref(&self) -> &Chains {
        &self.chains
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut Chains {
        &mut self.chains
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        // A burst's tables are not kept at rest.
        if self.chains.by_uid.is_empty() && self.chains.by_uid.capacity() > 1024 {
            self.chains.by_uid.shrink_to_fit();
        }
        if self.chains.busy.is_empty() && self.chains.busy.capacity() > 1024 {
            self.chains.busy.shrink_to_fit();
        }
        self.unseen
            .set(i64::try_from(self.chains.by_uid.len()).unwrap_or(i64::MAX));
    }
}

impl StatusWrites {
    /// Reported in `unseen`.
    pub(crate) fn new(unseen: Gauge) -> Self {
        StatusWrites {
            chains: Mutex::default(),
            unseen,
        }
    }

    fn lock(&self) -> Locked<'_> {
        Locked {
            chains: self.chains.lock().unwrap_or_else(|p| p.into_inner()),
            unseen: &self.unseen,
        }
    }

    /// What a status write for the object `uid`, planned from its `cached` resourceVersion,
    /// compares against.
    pub(crate) fn base(&self, uid: &str, cached: &str) -> StatusBase {
        let mut chains = self.lock();
        let chains = &mut chains.by_uid;
        let Some(chain) = chains.get(uid) else {
            return StatusBase::Cache;
        };
        let stale = chain.at.elapsed() > CHAIN_TTL;
        match chain.versions.iter().position(|v| v == cached) {
            Some(i) if !stale && i + 1 < chain.versions.len() => StatusBase::Written {
                version: chain.versions[chain.versions.len() - 1].clone(),
                status: chain.status,
            },
            // Caught up with the last write, replaced by someone else's, or too old.
            _ => {
                chains.remove(uid);
                StatusBase::Cache
            }
        }
    }

    /// A status write of `uid` from resourceVersion `from` produced `to`, writing a status
    /// that hashes to `status`.
    pub(crate) fn record(&self, uid: &str, from: &str, to: String, status: u64) {
        let mut guard = self.lock();
        // Nothing changed (the server made the write a no-op): no event comes. The cache shows
        // it already, or a chain of the object still waits for its last write's event; that
        // write is what this one asked for, too.
        if to == from {
            if let Some(chain) = guard.by_uid.get_mut(uid) {
                chain.status = status;
            }
            return;
        }
        let chains = &mut *guard;
        chains.by_uid.sweep(|_, c| c.at.elapsed() <= CHAIN_TTL);
        // Its event may have come already, while the reconcile that wrote waited for the
        // answer: then the chain goes as that reconcile ends.
        let seen = chains
            .busy
            .get(uid)
            .is_some_and(|r| r.deleted || not_older(r.delivered.as_deref(), &to));
        let chain = chains
            .by_uid
            .entry(uid.to_string())
            .or_insert_with(|| StatusChain {
                versions: vec![from.to_string()],
                status,
                at: Instant::now(),
                seen: false,
            });
        chain.versions.push(to);
        chain.status = status;
        chain.at = Instant::now();
        chain.seen = seen;
    }

    /// The primary watch delivered `version` of `uid` (the cache holds it now); `None`: the
    /// object was deleted. A chain it catches up with goes, or once the reconciles under way
    /// for the object have ended.
    pub(crate) fn seen(&self, uid: &str, version: Option<&str>) {
        let mut guard = self.lock();
        let chains = &mut *guard;
        let busy = match chains.busy.get_mut(uid) {
            Some(r) => {
                match version {
                    Some(v) => r.delivered = Some(v.to_string()),
                    None => r.deleted = true,
                }
                true
            }
            None => false,
        };
        let Some(chain) = chains.by_uid.get_mut(uid) else {
            return;
        };
        let caught_up = match version {
            // An event from before the first write, still on its way (the cache is ahead of
            // the events handed here): not someone else's write.
            Some(v) if before(v, &chain.versions[0]) => false,
            Some(v) => {
                chain.versions.last().is_some_and(|l| l == v) || !chain.versions.iter().any(|c| c == v)
            }
            None => true,
        };
        match (caught_up, busy) {
            (false, _) => {}
            (true, true) => chain.seen = true,
            (true, false) => {
                chains.by_uid.remove(uid);
            }
        }
    }

    /// Whether a status write of `uid` is remembered.
    pub(crate) fn holds(&self, uid: &str) -> bool {
        self.lock().by_uid.contains_key(uid)
    }

    /// Marks a reconcile of `uid` under way until the guard is dropped: a chain the watch
    /// catches up with meanwhile stays for it, as it may have planned from the copy before.
    /// Taken as the work queue hands the object's copy out, before any later event is seen.
    pub(crate) fn busy(self: &Arc<Self>, uid: &str) -> Busy {
        self.lock().busy.entry(uid.to_string()).or_default().count += 1;
        Busy {
            writes: self.clone(),
            uid: uid.to_string(),
        }
    }

    /// Chains held now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().by_uid.len()
    }
}

/// Follows the primary watch's events (after the cache took them in) for `writes`: an
/// object's version tells which of its status writes the cache shows. A list is swapped into
/// the cache whole at its end, so what it brings counts from then.
pub(crate) fn follow<K: Resource, E>(writes: Arc<StatusWrites>) -> impl FnMut(&Result<watcher::Event<K>, E>) {
    let mut listed: Vec<(String, String)> = Vec::new();
    move |ev| {
        let version = |o: &K| {
            let m = o.meta();
            m.uid.clone().zip(m.resource_version.clone())
        };
        match ev {
            Ok(watcher::Event::Apply(o)) => {
                if let Some((uid, rv)) = version(o) {
                    writes.seen(&uid, Some(&rv));
                }
            }
            Ok(watcher::Event::InitApply(o)) => {
                listed.extend(version(o).filter(|(uid, _)| writes.holds(uid)));
            }
            Ok(watcher::Event::InitDone) => {
                for (uid, rv) in listed.drain(..) {
                    writes.seen(&uid, Some(&rv));
                }
                listed.shrink_to_fit();
            }
            Ok(watcher::Event::Delete(o)) => {
                if let Some(uid) = o.meta().uid.as_deref() {
                    writes.seen(uid, None);
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_from_before_the_write_compares_against_it_until_the_cache_shows_it() {
        let writes = Arc::new(StatusWrites::default());
        writes.record("u", "1", "2".into(), 7);
        assert!(matches!(
            writes.base("u", "1"),
            StatusBase::Written { ref version, status: 7 } if version == "2"
        ));
        assert!(matches!(writes.base("u", "2"), StatusBase::Cache));
        assert_eq!(writes.len(), 0, "caught up: the chain went");
    }

    #[test]
    fn a_chain_goes_when_the_watch_delivers_its_last_version_or_a_reconcile_under_way_ends() {
        let writes = Arc::new(StatusWrites::default());
        writes.record("idle", "1", "2".into(), 0);
        writes.record("idle", "2", "3".into(), 0);
        writes.seen("idle", Some("2"));
        assert_eq!(
            writes.len(),
            1,
            "the first write's event: the second is still to come"
        );
        writes.seen("idle", Some("3"));
        assert_eq!(writes.len(), 0, "nothing reconciles it: gone at once");

        writes.record("busy", "1", "2".into(), 0);
        let reconcile = writes.busy("busy");
        writes.seen("busy", Some("2"));
        assert!(
            matches!(writes.base("busy", "1"), StatusBase::Written { .. }),
            "the reconcile under way planned from version 1"
        );
        drop(reconcile);
        assert_eq!(writes.len(), 0, "gone as the reconcile ended");

        writes.record("other", "1", "2".into(), 0);
        writes.seen("other", Some("5"));
        assert_eq!(writes.len(), 0, "someone else wrote: the cache decides");
        writes.record("deleted", "1", "2".into(), 0);
        writes.seen("deleted", None);
        assert_eq!(writes.len(), 0);
    }

    #[test]
    fn a_write_after_the_watch_caught_up_keeps_the_chain_past_the_reconcile() {
        let writes = Arc::new(StatusWrites::default());
        let reconcile = writes.busy("u");
        writes.record("u", "1", "2".into(), 0);
        writes.seen("u", Some("2"));
        writes.record("u", "2", "3".into(), 0);
        drop(reconcile);
        assert_eq!(writes.len(), 1, "version 3 is not in the cache yet");
        writes.seen("u", Some("3"));
        assert_eq!(writes.len(), 0);
    }

    #[test]
    fn a_write_whose_event_came_before_its_answer_goes_as_its_reconcile_ends() {
        let writes = Arc::new(StatusWrites::default());
        let reconcile = writes.busy("u");
        writes.seen("u", Some("2"));
        writes.record("u", "1", "2".into(), 0);
        assert!(
            matches!(writes.base("u", "1"), StatusBase::Written { .. }),
            "the reconcile planned from version 1"
        );
        drop(reconcile);
        assert_eq!(writes.len(), 0, "the cache shows version 2 already");
    }

    #[test]
    fn an_event_from_before_the_write_is_not_taken_for_someone_elses() {
        let writes = Arc::new(StatusWrites::default());
        writes.record("u", "10", "12".into(), 0);
        writes.seen("u", Some("9"));
        assert!(
            matches!(writes.base("u", "10"), StatusBase::Written { .. }),
            "version 9 was on its way when the cache already showed 10"
        );
        writes.seen("u", Some("12"));
        assert_eq!(writes.len(), 0);
    }

    #[test]
    fn a_write_that_changed_nothing_is_not_remembered_and_one_whose_object_went_goes_with_its_reconcile() {
        let writes = Arc::new(StatusWrites::default());
        writes.record("same", "4", "4".into(), 0);
        assert_eq!(
            writes.len(),
            0,
            "no event comes for a version that did not change"
        );
        writes.record("same", "4", "5".into(), 1);
        writes.record("same", "5", "5".into(), 2);
        assert!(
            matches!(writes.base("same", "4"), StatusBase::Written { ref version, status: 2 } if version == "5"),
            "a no-op write leaves the chain waiting for version 5, as what it wrote"
        );
        writes.seen("same", Some("5"));

        let reconcile = writes.busy("gone");
        writes.seen("gone", None);
        writes.record("gone", "4", "5".into(), 0);
        assert_eq!(writes.len(), 1);
        drop(reconcile);
        assert_eq!(writes.len(), 0, "deleted before the answer was recorded");

        let (one, two) = (writes.busy("twice"), writes.busy("twice"));
        writes.record("twice", "1", "2".into(), 0);
        writes.seen("twice", Some("2"));
        drop(one);
        assert_eq!(writes.len(), 1, "the other reconcile is still under way");
        drop(two);
        assert_eq!(writes.len(), 0);
    }

    #[test]
    fn a_listed_version_counts_once_the_list_is_in_the_cache() {
        use k8s_openapi::api::core::v1::ConfigMap;
        let writes = Arc::new(StatusWrites::default());
        let mut follow = follow::<ConfigMap, ()>(writes.clone());
        let at = |rv: &str| {
            let mut cm = ConfigMap::default();
            cm.metadata.uid = Some("u".into());
            cm.metadata.resource_version = Some(rv.into());
            cm
        };
        writes.record("u", "1", "2".into(), 0);
        follow(&Ok(watcher::Event::Init));
        follow(&Ok(watcher::Event::InitApply(at("2"))));
        assert!(
            matches!(writes.base("u", "1"), StatusBase::Written { .. }),
            "the cache holds version 1 until the list ends"
        );
        follow(&Ok(watcher::Event::InitDone));
        assert_eq!(writes.len(), 0);
        writes.record("u", "2", "3".into(), 0);
        follow(&Ok(watcher::Event::Apply(at("3"))));
        assert_eq!(writes.len(), 0, "a watch event counts at once");
        writes.record("u", "3", "4".into(), 0);
        follow(&Ok(watcher::Event::Delete(at("3"))));
        assert_eq!(writes.len(), 0);
    }

    #[test]
    fn old_status_chains_are_swept_when_the_chains_have_doubled_not_on_every_write() {
        let writes = Arc::new(StatusWrites::default());
        let sweeps = |w: &StatusWrites| w.lock().by_uid.swept_at();
        for i in 0..1025 {
            writes.record(&format!("u-{i}"), "1", "2".into(), 0);
        }
        assert_eq!(sweeps(&writes), 0, "no sweep up to 1024 chains");
        writes.record("u-1025", "1", "2".into(), 0);
        assert_eq!(sweeps(&writes), 1025, "swept once past 1024, nothing old to drop");
        for i in 1026..2050 {
            writes.record(&format!("u-{i}"), "1", "2".into(), 0);
        }
        assert_eq!(sweeps(&writes), 1025, "no sweep before the chains doubled");
        // Half of them long untouched: the sweep at twice the size drops those.
        {
            let mut chains = writes.lock();
            let old = Instant::now() - CHAIN_TTL - Duration::from_secs(1);
            let even = |uid: &str| uid[2..].parse::<usize>().is_ok_and(|i| i % 2 == 0);
            for (_, c) in chains.by_uid.iter_mut().filter(|(uid, _)| even(uid)) {
                c.at = old;
            }
        }
        writes.record("u-2050", "1", "2".into(), 0);
        let chains = writes.lock();
        assert!(chains.by_uid.values().all(|c| c.at.elapsed() <= CHAIN_TTL));
        assert_eq!(chains.by_uid.swept_at(), 1025, "the 1025 odd ones kept");
        assert_eq!(chains.by_uid.len(), 1026, "and the new one");
    }
}
