//! Keys for [`crate::Watch::on_change`]: what of an object must change for a watch event to
//! trigger a reconcile (controller-runtime's `GenerationChangedPredicate`,
//! `LabelChangedPredicate`, `AnnotationChangedPredicate`). Combine them in a tuple.
use std::hash::{Hash, Hasher};

use kube::Resource;

/// One hash of a key, for filters and their tests.
pub(crate) fn hash(h: &impl Hash) -> u64 {
    let mut s = std::collections::hash_map::DefaultHasher::new();
    h.hash(&mut s);
    s.finish()
}

/// FNV-1a's starting value ([`fnv1a`]).
pub(crate) const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// `bytes` folded into `h` by FNV-1a, 64 bits: stable across builds and releases, unlike
/// [`hash`], for what is stored or compared between builds.
pub(crate) fn fnv1a(h: u64, bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(h, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3))
}

/// The spec's generation: status-only updates (and metadata changes) trigger nothing.
pub fn generation<K: Resource>(obj: &K) -> Option<i64> {
    obj.meta().generation
}

/// The labels.
pub fn labels<K: Resource>(obj: &K) -> u64 {
    hash(&obj.meta().labels)
}

/// The annotations.
pub fn annotations<K: Resource>(obj: &K) -> u64 {
    hash(&obj.meta().annotations)
}

/// Whether the object is being deleted, and its finalizers.
pub fn deletion<K: Resource>(obj: &K) -> u64 {
    hash(&(obj.meta().deletion_timestamp.is_some(), &obj.meta().finalizers))
}
