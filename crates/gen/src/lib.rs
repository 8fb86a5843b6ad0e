//! Generation for opkit operators, as controller-tools is to controller-runtime: from an
//! [`Operator`](opkit_runtime::Operator) and its registry, the CRDs, RBAC, the `config/`
//! manifests ([`manifests`]), the Helm chart ([`helm`]), the OLM bundle ([`bundle`]) and the
//! Prometheus rules and Grafana dashboards ([`monitoring`]). The runtime hands it typed
//! objects; this crate owns the files and their YAML.

#![deny(missing_docs)]

pub mod bundle;
pub mod helm;
pub mod manifests;
pub mod monitoring;
pub mod yaml;
