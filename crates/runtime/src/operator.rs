//! An operator as a whole: its name, version and [`Registry`]. The command line
//! (`opkit::cli`), the generated manifests (`opkit::manifests`) and the OLM bundle
//! (`opkit::bundle`) are all derived from it, so two operators built on opkit differ only in
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

/// The operator's controllers running inside this process (what a controller test starts);
/// they stop when this is dropped.
pub struct Running {
    stop: tokio_util::sync::CancellationToken,
    metrics: crate::metrics::Metrics,
    handle: Option<tokio::task::JoinHandle<Result<(), crate::manager::ManagerError>>>,
}

impl Running {
    /// The metrics every controller of this run reports to.
    pub fn metrics(&self) -> &crate::metrics::Metrics {
        &self.metrics
    }

    /// Stops the controllers gracefully and returns how the manager ended.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        self.stop.cancel();
        match self.handle.take() {
            Some(h) => Ok(h.await??),
            None => Ok(()),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(h) = self.handle.take() {
            h.abort();
        }
    }
}

impl<S> Operator<S> {
    /// Applies every CRD of the operator (server-side, forced) and waits until each is
    /// Established, so objects of them can be created right after.
    pub async fn install_crds(&self, client: &kube::Client) -> anyhow::Result<()> {
        for crd in self.registry.crds() {
            install_crd(client, &crd, &format!("{}-install", self.name)).await?;
        }
        Ok(())
    }

    /// Runs every controller in this process, confined to `scope`, without leader election or
    /// signal handling: what a controller test needs. Install the CRDs first.
    pub fn spawn(&self, client: kube::Client, scope: crate::Scope, settings: &S) -> Running {
        let mut manager = crate::Manager::new(client).with_scope(scope);
        for r in self.registry.all() {
            (r.add)(&mut manager, settings);
        }
        let stop = manager.shutdown_token();
        let metrics = manager.metrics().clone();
        let opts = crate::ManagerOptions {
            handle_signals: false,
            ..Default::default()
        };
        Running {
            stop,
            metrics,
            handle: Some(tokio::spawn(manager.run(opts))),
        }
    }
}

/// Applies one CRD (server-side, forced, as `field_manager`) and waits up to 60 s until it is
/// Established, so objects of it can be created right after.
pub async fn install_crd(
    client: &kube::Client,
    crd: &k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
    field_manager: &str,
) -> anyhow::Result<()> {
    use kube::api::{Api, Patch, PatchParams};
    use kube::runtime::wait::{await_condition, conditions};
    let api: Api<_> = Api::all(client.clone());
    let name = kube::ResourceExt::name_any(crd);
    api.patch(
        &name,
        &PatchParams::apply(field_manager).force(),
        &Patch::Apply(crd),
    )
    .await?;
    let established = await_condition(api, &name, conditions::is_crd_established());
    tokio::time::timeout(std::time::Duration::from_secs(60), established)
        .await
        .map_err(|_| anyhow::anyhow!("CRD {name} was not Established within 60 s"))??;
    Ok(())
}
