//! The opkit controllers, one module per kind. Each module holds the whole story of its kind:
//! validation, the objects it builds, how it watches, its RBAC rules and its admission
//! webhooks. [`registry`] is the one list of them.

pub mod at;
pub mod config_mirror;
pub mod crontab;
pub mod eru;
pub mod foo;
pub mod label_propagation;
pub mod memcached;
pub mod postgres;

/// A small deterministic generator (xorshift) for the property tests, so a failing case
/// reproduces without a seed file or an extra crate.
#[cfg(test)]
pub(crate) mod test_rng {
    pub(crate) struct Rng(pub(crate) u64);

    impl Rng {
        pub(crate) fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        pub(crate) fn pick<'a>(&mut self, from: &[&'a str]) -> &'a str {
            from[(self.next() % from.len() as u64) as usize]
        }
    }
}

use kube::CustomResourceExt;
use opkit::{Operator, Registration, Registry, RunTimeKinds};

/// Operator settings the controllers take from the command line.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Image of the memcached containers.
    pub memcached_image: String,
    /// How often the PostgreSQL servers are read (drift is put right within it).
    pub postgres_poll: std::time::Duration,
    /// The kinds whose objects get their Namespace's labels (none: the controller idles).
    pub propagate: Vec<opkit::DynamicKind>,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            memcached_image: memcached::DEFAULT_IMAGE.into(),
            postgres_poll: postgres::DEFAULT_POLL,
            propagate: Vec::new(),
        }
    }
}

/// The operator: what `opkit run`, `opkit manifests` and `opkit bundle` are made from.
pub fn operator() -> Operator<Settings> {
    Operator {
        name: "opkit",
        version: env!("CARGO_PKG_VERSION"),
        about: "Kubernetes operators in Rust: Memcached, At, Eru, ConfigMirror, PostgresDatabase and friends",
        registry: registry(),
    }
}

/// Every controller opkit ships, in start order. Adding a kind: its folder, its types, and one
/// entry here.
pub fn registry() -> Registry<Settings> {
    Registry::<Settings>::new(vec![
        Registration {
            name: memcached::NAME,
            crds: || vec![opkit_api::memcached::crd()],
            rbac: memcached::rbac_rules,
            // A missing size is a schema default: nothing left for a webhook to do.
            webhooks: |w| w,
            add: |m, s| {
                m.add(memcached::MemcachedController {
                    image: s.memcached_image.clone(),
                });
            },
        },
        Registration {
            name: at::NAME,
            crds: || vec![opkit_api::at::crd()],
            rbac: at::rbac_rules,
            webhooks: at::webhooks,
            add: |m, _| {
                m.add(at::AtController);
            },
        },
        Registration {
            name: eru::NAME,
            crds: || vec![opkit_api::eru::Eru::crd()],
            rbac: eru::rbac_rules,
            webhooks: eru::webhooks,
            add: |m, _| {
                m.add(eru::EruController).add(eru::AnnotationController);
            },
        },
        Registration {
            name: config_mirror::NAME,
            crds: || vec![opkit_api::config_mirror::crd()],
            rbac: config_mirror::rbac_rules,
            webhooks: config_mirror::webhooks,
            add: |m, _| {
                m.add(config_mirror::ConfigMirrorController);
            },
        },
        Registration {
            name: crontab::NAME,
            crds: || vec![opkit_api::crontab::crd()],
            rbac: crontab::rbac_rules,
            webhooks: crontab::webhooks,
            // Nothing to reconcile: the kind is served for its conversion.
            add: |_, _| {},
        },
        Registration {
            name: postgres::NAME,
            crds: || vec![opkit_api::postgres::crd()],
            rbac: postgres::rbac_rules,
            // Names are checked by the CRD's rules; nothing left for a webhook to do.
            webhooks: |w| w,
            add: |m, s| {
                m.add(postgres::PostgresController {
                    poll: s.postgres_poll,
                });
            },
        },
        Registration {
            name: foo::NAME,
            crds: || vec![opkit_api::foo::crd()],
            rbac: foo::rbac_rules,
            webhooks: |w| w,
            add: |m, _| {
                m.add(foo::FooController);
            },
        },
        Registration {
            name: label_propagation::NAME,
            crds: Vec::new,
            rbac: label_propagation::rbac_rules,
            webhooks: |w| w,
            // Without kinds to act on, nothing to watch.
            add: |m, s| {
                if !s.propagate.is_empty() {
                    m.add(label_propagation::LabelPropagationController {
                        kinds: s.propagate.clone(),
                    });
                }
            },
        },
    ])
    .with_run_time_kinds(RunTimeKinds {
        controller: label_propagation::NAME,
        flag: label_propagation::FLAG,
        verbs: label_propagation::VERBS,
    })
}
