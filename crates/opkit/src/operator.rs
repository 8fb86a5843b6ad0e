//! An operator as a whole: its name, version and [`Registry`]. The command line
//! ([`crate::cli`]), the generated manifests ([`crate::manifests`]) and the OLM bundle
//! ([`crate::bundle`]) are all derived from it, so two operators built on opkit differ only in
//! this value and their controllers.
use crate::registry::Registry;

/// One operator. `S` carries its own settings (images, ...) from the command line to the
/// controllers.
pub struct Operator<S> {
    /// Prefix of every object the operator owns (`<name>-system`, `<name>-controller-manager`,
    /// `<name>-leader`, webhook configurations); a DNS label.
    pub name: &'static str,
    /// The operator's version (semver): the default image tag and bundle version.
    pub version: &'static str,
    /// One line for `--help`.
    pub about: &'static str,
    /// Its controllers.
    pub registry: Registry<S>,
}

impl<S> Operator<S> {
    /// The namespace `make deploy` puts the operator in.
    pub fn namespace(&self) -> String {
        format!("{}-system", self.name)
    }

    /// The name of the operator's Deployment and ServiceAccount.
    pub fn manager(&self) -> String {
        format!("{}-controller-manager", self.name)
    }

    /// The image the generated Deployment runs: a fixed tag, never `latest`.
    pub fn image(&self) -> String {
        self.image_for(self.version)
    }

    /// The image of `version`.
    pub fn image_for(&self, version: &str) -> String {
        format!("{}:v{version}", self.name)
    }

    /// The default leader-election Lease.
    pub fn lease(&self) -> String {
        format!("{}-leader", self.name)
    }
}
