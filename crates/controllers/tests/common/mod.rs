//! Shared by the controller tests: install a CRD, run one controller in-process.
#![allow(dead_code)]
use std::future::Future;
use std::time::Duration;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::wait::{await_condition, conditions};
use kube::{Client, ResourceExt};
use opkit::{ControllerContext, Manager, ManagerOptions};
use tokio_util::sync::CancellationToken;

/// How long any single condition in a test may take.
pub const T: Duration = Duration::from_secs(60);

/// A running manager with one controller; stops on drop (or `stop().await`).
pub struct Operator {
    pub ctx: ControllerContext,
    stop: CancellationToken,
    handle: Option<tokio::task::JoinHandle<()>>,
}

impl Operator {
    /// Shuts down gracefully and waits until the manager has stopped.
    pub async fn stop(mut self) {
        self.stop.cancel();
        if let Some(h) = self.handle.take() {
            let _ = h.await;
        }
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(h) = self.handle.take() {
            h.abort();
        }
    }
}

/// Applies a CRD and waits until it is Established.
pub async fn install_crd(client: &Client, crd: CustomResourceDefinition) -> anyhow::Result<()> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let name = crd.name_any();
    crds.patch(
        &name,
        &PatchParams::apply("opkit-tests").force(),
        &Patch::Apply(&crd),
    )
    .await?;
    let established = await_condition(crds, &name, conditions::is_crd_established());
    tokio::time::timeout(T, established).await??;
    Ok(())
}

/// Starts a manager running one controller, without signal handling.
pub fn run_controller<F, Fut>(client: &Client, name: &'static str, opts: ManagerOptions, run: F) -> Operator
where
    F: FnOnce(ControllerContext) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let mut manager = Manager::new(client.clone());
    let ctx = manager.add(name, run);
    let stop = manager.shutdown_token();
    let opts = ManagerOptions {
        handle_signals: false,
        ..opts
    };
    let handle = tokio::spawn(async move {
        manager.run(opts).await.expect("manager failed");
    });
    Operator {
        ctx,
        stop,
        handle: Some(handle),
    }
}

/// A file under `config/samples/`.
pub fn sample(file: &str) -> String {
    std::fs::read_to_string(format!(
        "{}/../../config/samples/{file}",
        env!("CARGO_MANIFEST_DIR")
    ))
    .expect("sample")
}
