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
