//! The one list of an operator's controllers. `--controllers`, the CRDs `run` waits for, the
//! generated RBAC and CRD manifests, and the webhooks all come from it, so adding a kind is
//! its folder plus one line here.
use k8s_openapi::api::rbac::v1::PolicyRule;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;

use crate::manager::Manager;
use crate::rbac;
use crate::webhook::Webhooks;

/// One selectable controller (one or more [`crate::Reconciler`]s) with everything generated
/// from it. `S` carries the operator's own settings (images, ...) to `add`.
pub struct Registration<S> {
    /// What `--controllers` selects.
    pub name: &'static str,
    /// The CRDs it serves; `run` waits for them to be established.
    pub crds: fn() -> Vec<CustomResourceDefinition>,
    /// The API access its reconcilers use, for the generated RBAC, and nothing more: `list`
    /// and `watch` for every watch, `patch` for the status subresource and for children (an
    /// apply that makes a child also needs `create`), `delete` where children are pruned or
    /// an object deletes itself, `get` only where `observe` reads through the client.
    pub rbac: fn() -> Vec<PolicyRule>,
    /// Its admission webhooks and conversions (none: `|w| w`). Declared without a client
    /// (a handler that reads the cluster gets one from its [`crate::webhook::Review`]), so
    /// the manifests list them without a cluster.
    pub webhooks: fn(Webhooks) -> Webhooks,
    /// Adds its reconcilers to a manager.
    pub add: fn(&mut Manager, &S),
}

/// Kinds a controller acts on that are named when the operator runs (a flag of the operator's,
/// parsed into [`crate::DynamicKind`]s), not when it is built: the generated chart takes them
/// as a value, passes them as the flag and grants `verbs` on each.
#[derive(Clone, Copy, Debug)]
pub struct RunTimeKinds {
    /// The controller ([`Registration::name`]).
    pub controller: &'static str,
    /// The operator's flag that names them, comma-separated, without its dashes.
    pub flag: &'static str,
    /// What the controller does with them, e.g. `list`, `watch`, `patch`.
    pub verbs: &'static [&'static str],
}

impl RunTimeKinds {
    /// The chart value that names them: the flag in camel case (`labelPropagationResources`).
    pub fn value(&self) -> String {
        let mut out = String::new();
        let mut upper = false;
        for c in self.flag.chars() {
            match c {
                '-' => upper = true,
                c if upper => {
                    out.push(c.to_ascii_uppercase());
                    upper = false;
                }
                c => out.push(c),
            }
        }
        out
    }
}

/// The ordered list of an operator's controllers.
pub struct Registry<S> {
    entries: Vec<Registration<S>>,
    run_time_kinds: Vec<RunTimeKinds>,
}

impl<S> Registry<S> {
    /// A registry of `entries`, in the order they should start and be listed.
    pub fn new(entries: Vec<Registration<S>>) -> Self {
        Registry {
            entries,
            run_time_kinds: Vec::new(),
        }
    }

    /// Declares that a controller acts on kinds named by a flag ([`RunTimeKinds`]).
    pub fn with_run_time_kinds(mut self, kinds: RunTimeKinds) -> Self {
        assert!(
            self.names().contains(&kinds.controller),
            "run-time kinds for {:?}, which is not in the registry",
            kinds.controller
        );
        self.run_time_kinds.push(kinds);
        self
    }

    /// The controllers' kinds named when the operator runs.
    pub fn run_time_kinds(&self) -> &[RunTimeKinds] {
        &self.run_time_kinds
    }

    /// Every name, for `--controllers` help and errors.
    pub fn names(&self) -> Vec<&'static str> {
        self.entries.iter().map(|e| e.name).collect()
    }

    /// The entries named in `wanted`, or an error naming the unknown one and the known ones.
    pub fn select(&self, wanted: &[String]) -> Result<Vec<&Registration<S>>, String> {
        if let Some(unknown) = wanted.iter().find(|w| !self.names().contains(&w.as_str())) {
            return Err(format!(
                "unknown controller {unknown:?}; known: {}",
                self.names().join(", ")
            ));
        }
        Ok(self
            .entries
            .iter()
            .filter(|e| wanted.iter().any(|w| w == e.name))
            .collect())
    }

    /// Every entry.
    pub fn all(&self) -> Vec<&Registration<S>> {
        self.entries.iter().collect()
    }

    /// Every CRD, once each, in registry order.
    pub fn crds(&self) -> Vec<CustomResourceDefinition> {
        crds(&self.all())
    }

    /// The union of every entry's rules.
    pub fn rbac(&self) -> Vec<PolicyRule> {
        rbac::merge(self.entries.iter().map(|e| (e.rbac)()))
    }

    /// Every entry's webhooks.
    pub fn webhooks(&self) -> Webhooks {
        webhooks(&self.all())
    }
}

/// The CRDs of `entries`, once each.
pub(crate) fn crds<S>(entries: &[&Registration<S>]) -> Vec<CustomResourceDefinition> {
    let mut out: Vec<CustomResourceDefinition> = Vec::new();
    for crd in entries.iter().flat_map(|e| (e.crds)()) {
        if !out.iter().any(|c| c.metadata.name == crd.metadata.name) {
            out.push(crd);
        }
    }
    out
}

/// The webhooks of `entries`.
pub(crate) fn webhooks<S>(entries: &[&Registration<S>]) -> Webhooks {
    entries.iter().fold(Webhooks::new(), |w, e| (e.webhooks)(w))
}
