//! Which member owns which object: a consistent-hash ring over the live members.
//!
//! Each member puts [`POINTS`] points on a 64-bit ring; an object belongs to the member of the
//! first point at or after its own hash. A member joining takes over about `1/N` of the
//! objects, each from one of the others; a member leaving gives its objects to the others,
//! spread evenly; nothing else moves.
//!
//! The hash is FNV-1a with a final mixer, spelled out here rather than taken from the
//! standard library, whose hashers may change between Rust releases: replicas of two opkit
//! builds (a rolling update) should agree on every owner, or objects move for nothing.

/// Points per member. The most loaded member sets every replica's memory limit, so the
/// shares must be even: with 1000, the largest of 3 random members' shares is on average 3%
/// over a third, 5% in one ring of ten (8% and 14% with 100; simulated). Building a ring of 1000 points per
/// member takes well under a millisecond per member.
///
/// Builds with different values place objects differently: while both run (a rolling
/// update from a build with another value), a new object the placement webhook of one build
/// labels may be drained by the sharder of the other, and a new leader of another build
/// moves what it would place elsewhere. Safe (the drain handshake), but each such move costs
/// writes.
pub const POINTS: u32 = 1000;

/// A stable 64-bit hash of `s`.
pub fn hash(s: &str) -> u64 {
    let mut h = crate::changed::fnv1a(crate::changed::FNV_OFFSET, s.as_bytes());
    // splitmix64's finalizer: FNV alone leaves similar names on nearby points.
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// The key an object is placed by: its namespace and name, so that its children, which carry
/// their primary's shard, need no key of their own.
pub fn key(namespace: Option<&str>, name: &str) -> String {
    format!("{}/{name}", namespace.unwrap_or(""))
}

/// The namespace (`None`: cluster-scoped) and name an object's [`key`] was made of: neither
/// may hold a `/`.
pub fn split_key(key: &str) -> (Option<&str>, &str) {
    match key.split_once('/') {
        Some(("", name)) => (None, name),
        Some((ns, name)) => (Some(ns), name),
        None => (None, key),
    }
}

/// The live members on the ring.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ring {
    points: Vec<(u64, u32)>,
    members: Vec<String>,
}

impl Ring {
    /// A ring of `members` (order and repeats do not matter).
    pub fn new<S: AsRef<str>>(members: impl IntoIterator<Item = S>) -> Self {
        let mut members: Vec<String> = members.into_iter().map(|m| m.as_ref().to_string()).collect();
        members.sort();
        members.dedup();
        let mut points = Vec::with_capacity(members.len() * POINTS as usize);
        for (i, m) in members.iter().enumerate() {
            let i = u32::try_from(i).unwrap_or(u32::MAX);
            for p in 0..POINTS {
                points.push((hash(&format!("{m}#{p}")), i));
            }
        }
        // Two members on one point (a 64-bit collision): the smaller name wins, everywhere.
        points.sort_unstable();
        points.dedup_by_key(|(h, _)| *h);
        Ring { points, members }
    }

    /// The members, sorted.
    pub fn members(&self) -> &[String] {
        &self.members
    }

    /// Whether no member is live (nothing can be assigned).
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// The member that owns `key` (see [`key`]); `None` on an empty ring.
    pub fn owner(&self, key: &str) -> Option<&str> {
        if self.points.is_empty() {
            return None;
        }
        let h = hash(key);
        let at = self.points.partition_point(|(p, _)| *p < h);
        let (_, member) = self.points[at % self.points.len()];
        self.members.get(member as usize).map(String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn keys(n: usize) -> Vec<String> {
        (0..n)
            .map(|i| key(Some("default"), &format!("memcached-{i}")))
            .collect()
    }

    fn shares(ring: &Ring, keys: &[String]) -> HashMap<String, usize> {
        let mut s = HashMap::new();
        for k in keys {
            *s.entry(ring.owner(k).unwrap().to_string()).or_default() += 1;
        }
        s
    }

    const PINNED: u64 = 0xf52a_15e9_a9b5_e89b;
    const PINNED_KEY: u64 = 0x1929_37ad_03c2_ffa0;

    #[test]
    fn the_hash_is_fixed_across_builds() {
        // Pinned: replicas of different builds must place every object alike.
        assert_eq!(hash(""), PINNED, "{:#x}", hash(""));
        assert_eq!(
            hash("default/memcached-1"),
            PINNED_KEY,
            "{:#x}",
            hash("default/memcached-1")
        );
        assert_ne!(hash("a"), hash("b"));
    }

    #[test]
    fn shares_are_about_even() {
        let keys = keys(30_000);
        for n in [2usize, 3, 5] {
            let ring = Ring::new((0..n).map(|i| format!("m{i}")));
            let s = shares(&ring, &keys);
            let fair = keys.len() / n;
            for (m, c) in &s {
                let off = (*c as f64 - fair as f64).abs() / fair as f64;
                assert!(off < 0.08, "{n} members: {m} owns {c}, fair {fair}");
            }
        }
    }

    #[test]
    fn a_member_joining_takes_about_its_share_and_nothing_else_moves() {
        let keys = keys(30_000);
        let before = Ring::new(["m0", "m1", "m2"]);
        let after = Ring::new(["m0", "m1", "m2", "m3"]);
        let mut moved = 0;
        for k in &keys {
            let (b, a) = (before.owner(k).unwrap(), after.owner(k).unwrap());
            if a != b {
                assert_eq!(a, "m3", "{k} moved between two old members");
                moved += 1;
            }
        }
        let share = moved as f64 / keys.len() as f64;
        assert!((0.2..0.3).contains(&share), "moved {share}");
    }

    #[test]
    fn a_member_leaving_gives_only_its_own_objects_away() {
        let keys = keys(10_000);
        let before = Ring::new(["m0", "m1", "m2"]);
        let after = Ring::new(["m0", "m2"]);
        for k in &keys {
            let b = before.owner(k).unwrap();
            if b != "m1" {
                assert_eq!(after.owner(k).unwrap(), b, "{k} moved");
            }
        }
    }

    #[test]
    fn a_key_splits_back_into_namespace_and_name() {
        assert_eq!(split_key(&key(Some("ns"), "a")), (Some("ns"), "a"));
        assert_eq!(split_key(&key(None, "a")), (None, "a"));
    }

    #[test]
    fn order_and_repeats_do_not_matter_and_an_empty_ring_owns_nothing() {
        assert_eq!(Ring::new(["b", "a", "b"]), Ring::new(["a", "b"]));
        assert_eq!(Ring::new(Vec::<String>::new()).owner("x"), None);
        assert!(Ring::default().is_empty());
    }
}
