//! Fixtures and waits for the Eru tests.
use anyhow::{Context, anyhow};
use k8s_openapi::api::apps::v1::Deployment;
use kube::Client;
use kube::api::Api;
use opkit_api::eru::{Eru, EruStatus};
use opkit_controllers::eru;
use opkit_testenv::wait_for;
use serde_json::json;

use super::T;

pub fn deployment(
    name: &str,
    annotations: serde_json::Value,
    min_ready_seconds: i32,
) -> anyhow::Result<Deployment> {
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name, "annotations": annotations},
        "spec": {
            "replicas": 2,
            "minReadySeconds": min_ready_seconds,
            "selector": {"matchLabels": {"app": name}},
            "strategy": {"rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{"name": "web", "image": "nginx:1.27"}]}
            }
        }
    }))?)
}

pub fn hand_written(name: &str, target: &str, schedule: &str) -> Eru {
    let mut e = Eru::new(
        name,
        opkit_api::eru::EruSpec {
            deployment_name: target.into(),
            schedule: schedule.into(),
            time_zone: None,
            suspend: None,
            starting_deadline_seconds: None,
        },
    );
    e.metadata.namespace = None;
    e
}

/// Waits until the Deployment has no rollout in progress.
pub async fn deployment_settled(deploys: &Api<Deployment>, name: &str) -> anyhow::Result<Deployment> {
    wait_for(&format!("{name} to settle"), T, || async {
        let d = deploys.get(name).await?;
        match eru::rollout_in_progress(&d) {
            None if d.status.as_ref().and_then(|s| s.ready_replicas) == Some(2) => Ok(d),
            other => Err(anyhow!("{other:?}")),
        }
    })
    .await
}

pub async fn eru_status(
    erus: &Api<Eru>,
    name: &str,
    what: &str,
    ok: impl Fn(&EruStatus) -> bool,
) -> anyhow::Result<EruStatus> {
    wait_for(&format!("Eru {name}: {what}"), T, || async {
        let s = erus.get(name).await?.status.unwrap_or_default();
        if ok(&s) { Ok(s) } else { Err(anyhow!("{s:?}")) }
    })
    .await
}

pub async fn gone(erus: &Api<Eru>, name: &str) -> anyhow::Result<()> {
    wait_for(&format!("the Eru {name} to be gone"), T, || async {
        match erus.get_opt(name).await? {
            None => Ok(()),
            Some(_) => Err(anyhow!("still there")),
        }
    })
    .await
}

/// Waits until the Eru `name` exists.
pub async fn exists(erus: &Api<Eru>, name: &str) -> anyhow::Result<Eru> {
    wait_for(&format!("the Eru {name}"), T, || async {
        erus.get(name).await.map_err(anyhow::Error::from)
    })
    .await
}

pub fn condition(s: &EruStatus, type_: &str) -> Option<(String, String)> {
    s.conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone()))
}

pub async fn has_event(client: &Client, ns: &str, name: &str, reason: &str) -> anyhow::Result<()> {
    super::event(client, Some(ns), name, reason).await.map(|_| ())
}

/// A Deployment with no replicas: cheap for the control plane, but cached all the same.
pub fn idle_deployment(name: &str) -> anyhow::Result<Deployment> {
    let mut d = deployment(name, json!({}), 0)?;
    d.spec.as_mut().context("spec")?.replicas = Some(0);
    Ok(d)
}
