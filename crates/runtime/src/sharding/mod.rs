//! Sharding: the objects of a controller spread over several replicas, each object handled by
//! exactly one of them.
//!
//! Each replica is a *member* with a Lease of its own. A *sharder*, run by the leader, places
//! every object on a [`Ring`] of the live members and records the owner in the object's
//! [`shard_label`]; each member watches (and caches) only the objects labelled with its own
//! name. Moving an object between two live members takes their cooperation: the sharder
//! marks it with [`drain_label`], the old owner stops working on it and takes its label off,
//! and only then is it given to the new one. An object whose owner's Lease has run out moves
//! at once: the old owner's write gate closed before its Lease could run out.
//!
//! With *slots* (`opkit run --sharding-slots N`) a member is not a process but one of N slot
//! Leases, which any replica may claim: a replica holds at most one, and one that finds them
//! all held stands by as a spare. A rolling restart then hands each slot, with its objects
//! and their labels, from the stopping replica to a spare: no object is relabelled, and each
//! changes hands once. A released slot stays on the ring for [`SLOT_REJOIN`] while a spare
//! claims it.
//!
//! This module holds the decisions, as pure functions of what the sharder observes.
pub mod admit;
pub mod members;
pub mod ring;
pub mod sharder;

pub use members::Members;
pub use ring::Ring;

use crate::leader::LeaderElectionConfig;

/// The label of a member Lease that names its group (the leader Lease's name).
pub const GROUP_LABEL: &str = "shard.opkit.dev/group";

/// The label of a member Lease that names its member ([`member_name`]).
pub const MEMBER_LABEL: &str = "shard.opkit.dev/member";

/// The label of a slot's member Lease that names its slot number.
pub const SLOT_LABEL: &str = "shard.opkit.dev/slot";

/// How long a released slot stays on the ring, its objects waiting for a replica to claim it
/// (the spare of a rolling update does at once; a replacement Pod within this), before they
/// move to the other slots.
pub const SLOT_REJOIN: std::time::Duration = std::time::Duration::from_secs(30);

/// How long a member Lease that stops naming its holder keeps the member on the ring beyond
/// the record's own duration: [`SLOT_REJOIN`] for a slot, nothing for a member that is one
/// process.
pub(crate) fn rejoin(l: &k8s_openapi::api::coordination::v1::Lease) -> std::time::Duration {
    use kube::ResourceExt;
    if l.labels().contains_key(SLOT_LABEL) {
        SLOT_REJOIN
    } else {
        std::time::Duration::ZERO
    }
}

/// The member a member Lease belongs to (its [`MEMBER_LABEL`]).
pub(crate) fn member_of(l: &k8s_openapi::api::coordination::v1::Lease) -> Option<String> {
    use kube::ResourceExt;
    l.labels().get(MEMBER_LABEL).cloned()
}

/// How this replica takes part in sharding (`opkit run --sharding`).
#[derive(Clone, Debug)]
pub struct ShardingConfig {
    /// The group: every replica of one operator uses the same (the leader Lease's name).
    pub group: String,
    /// This replica's member Lease, `<group>-member-<member>` in the leader Lease's namespace,
    /// held and renewed as a leader holds its Lease: while it is held, this replica may write
    /// for the objects labelled with its name. With slots, the identity and timings of the
    /// slot Leases.
    pub lease: LeaderElectionConfig,
    /// The number of slots (0: each replica is a member of its own, named after its identity).
    pub slots: u16,
}

impl ShardingConfig {
    /// Members of the group of `leader`'s Lease, with its identity and timings.
    pub fn new(leader: &LeaderElectionConfig) -> Self {
        let group = leader.name.clone();
        let member = member_name(&leader.identity);
        let mut lease = leader.clone();
        lease.name = format!("{group}-member-{member}");
        lease.labels = [
            (GROUP_LABEL.to_string(), group.clone()),
            (MEMBER_LABEL.to_string(), member),
        ]
        .into();
        ShardingConfig {
            group,
            lease,
            slots: 0,
        }
    }

    /// Members are `slots` slots that the replicas claim (see the module's doc), rather than
    /// one per replica; 0 keeps one per replica.
    pub fn with_slots(mut self, slots: u16) -> Self {
        self.slots = slots;
        self
    }

    /// This replica's name in the shard labels, when it is one member of its own (no slots).
    pub fn member(&self) -> Option<String> {
        (self.slots == 0).then(|| member_name(&self.lease.identity))
    }

    /// The Lease of slot `i`, `<group>-member-slot-<i>`, with this replica's identity.
    pub(crate) fn slot_lease(&self, i: u16) -> LeaderElectionConfig {
        let member = slot_member(i);
        let mut lease = self.lease.clone();
        lease.name = format!("{}-member-{member}", self.group);
        lease.labels = [
            (GROUP_LABEL.to_string(), self.group.clone()),
            (MEMBER_LABEL.to_string(), member),
            (SLOT_LABEL.to_string(), i.to_string()),
        ]
        .into();
        lease
    }
}

/// The member name of slot `i` (a random member's name always ends in ten hex digits after
/// its host, so never reads as one).
pub(crate) fn slot_member(i: u16) -> String {
    format!("slot-{i}")
}

/// The label that names an object's owner for the controller `controller`.
pub fn shard_label(controller: &str) -> String {
    format!("shard.opkit.dev/{controller}")
}

/// The label by which the sharder asks an object's owner to let it go.
pub fn drain_label(controller: &str) -> String {
    format!("drain.shard.opkit.dev/{controller}")
}

/// The annotation by which the sharder tells an object's new owner that the object had another
/// owner before (or predates the sharder), so its children may still be labelled for that one:
/// the new owner takes them over before it plans.
pub fn adopt_annotation(controller: &str) -> String {
    format!("adopt.shard.opkit.dev/{controller}")
}

/// The name a member goes by in labels and in its Lease's name: the start of the host part of
/// its `identity` (a valid label value, at most 40 characters), then a hash of the whole
/// identity, so that a restarted process (same host, new identity) is a new member.
pub fn member_name(identity: &str) -> String {
    let host = identity.split('_').next().unwrap_or_default();
    let host: String = host
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .take(40)
        .collect();
    let host = host.trim_matches(|c: char| !c.is_ascii_alphanumeric());
    let h = format!("{:010x}", ring::hash(identity) >> 24);
    if host.is_empty() { h } else { format!("{host}-{h}") }
}

/// What the sharder sees of one object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placed<'a> {
    /// Where the object is placed ([`ring::key`]).
    pub key: &'a str,
    /// Its [`shard_label`], if any.
    pub owner: Option<&'a str>,
    /// Whether it carries the [`drain_label`].
    pub draining: bool,
}

/// What the sharder does about one object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Move {
    /// Label it for `to` (no owner yet, or its owner is gone), taking any drain label off.
    Assign {
        /// The new owner.
        to: String,
    },
    /// Ask its live owner to let it go (the ring now places it elsewhere).
    Drain,
    /// Take a drain label off that no longer applies (the ring places it on its owner again).
    Undrain,
}

/// The move for `object`, given the ring of live members and whether a member is live. A
/// member the ring does not hold but that is still live (its Lease not yet run out, for
/// example one that is stopping) is drained, not overridden: it may still be writing.
pub fn decide(object: &Placed<'_>, ring: &Ring, live: impl Fn(&str) -> bool) -> Option<Move> {
    let target = ring.owner(object.key)?;
    match object.owner {
        None => Some(Move::Assign {
            to: target.to_string(),
        }),
        Some(owner) if !live(owner) => Some(Move::Assign {
            to: target.to_string(),
        }),
        Some(owner) if owner == target => object.draining.then_some(Move::Undrain),
        Some(_) if object.draining => None,
        Some(_) => Some(Move::Drain),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn placed<'a>(key: &'a str, owner: Option<&'a str>, draining: bool) -> Placed<'a> {
        Placed { key, owner, draining }
    }

    #[test]
    fn new_objects_are_assigned_and_placed_ones_stay() {
        let ring = Ring::new(["a", "b", "c"]);
        let k = "default/mc-1";
        let owner = ring.owner(k).unwrap().to_string();
        assert_eq!(
            decide(&placed(k, None, false), &ring, |_| true),
            Some(Move::Assign { to: owner.clone() })
        );
        assert_eq!(decide(&placed(k, Some(&owner), false), &ring, |_| true), None);
        assert_eq!(
            decide(&placed(k, Some(&owner), true), &ring, |_| true),
            Some(Move::Undrain)
        );
    }

    #[test]
    fn a_live_owner_is_drained_and_a_dead_one_replaced() {
        let ring = Ring::new(["a", "b"]);
        // An object of "c", which the ring no longer holds.
        let k = "default/mc-2";
        let target = ring.owner(k).unwrap().to_string();
        assert_eq!(
            decide(&placed(k, Some("c"), false), &ring, |_| true),
            Some(Move::Drain)
        );
        // Already asked: wait for the owner to let go.
        assert_eq!(decide(&placed(k, Some("c"), true), &ring, |_| true), None);
        // Its Lease ran out: its gate closed before, the object moves at once.
        assert_eq!(
            decide(&placed(k, Some("c"), true), &ring, |m| m != "c"),
            Some(Move::Assign { to: target })
        );
    }

    #[test]
    fn nothing_is_decided_without_live_members() {
        let ring = Ring::new(Vec::<String>::new());
        assert_eq!(decide(&placed("default/x", None, false), &ring, |_| false), None);
        assert_eq!(
            decide(&placed("default/x", Some("a"), false), &ring, |_| false),
            None
        );
    }

    #[test]
    fn member_names_are_label_values_and_tell_restarts_apart() {
        let valid = |v: &str| {
            v.len() <= 63
                && v.starts_with(|c: char| c.is_ascii_alphanumeric())
                && v.ends_with(|c: char| c.is_ascii_alphanumeric())
                && v.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        };
        let a = member_name("opkit-controller-manager-7d9f8b6c5-x2x4z_0123456789abcdef");
        assert!(a.starts_with("opkit-controller-manager-7d9f8b6c5-x2x4z-"), "{a}");
        assert!(valid(&a), "{a}");
        assert_ne!(
            a,
            member_name("opkit-controller-manager-7d9f8b6c5-x2x4z_fedcba9876543210")
        );
        for odd in ["", "_x", "-_", &"Ö".repeat(80), &"a".repeat(200)] {
            let m = member_name(odd);
            assert!(valid(&m), "{odd:?} -> {m:?}");
        }
    }

    #[test]
    fn labels_are_valid_label_keys() {
        let l = shard_label("memcached");
        let (prefix, name) = l.split_once('/').unwrap();
        assert!(prefix.len() <= 253 && name.len() <= 63);
        assert_eq!(drain_label("memcached"), "drain.shard.opkit.dev/memcached");
        assert_eq!(adopt_annotation("memcached"), "adopt.shard.opkit.dev/memcached");
    }
}
