//! The controllers' client (`opkit::client`) under faults injected by `opkit-testenv`'s proxy:
//! the write gate is checked on every attempt, retries included; no attempt is still waiting
//! when the gate closes; a request that gets no answer (a half-open connection) fails at the
//! request timeout and the next one goes through.

use std::time::{Duration, Instant};

use anyhow::{anyhow, ensure};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::api::PostParams;
use opkit::leader::WriteGate;
use opkit::metrics::Metrics;
use opkit_testenv::proxy::{Fault, FaultProxy};
use opkit_testenv::shared;
use serde_json::json;

fn configmap(name: &str) -> ConfigMap {
    serde_json::from_value(json!({"metadata": {"name": name}, "data": {"k": "v"}})).expect("a ConfigMap")
}

/// A gate that is enforced and open for `open` from now, as a leader's after a renewal.
fn gate_open_for(open: Duration) -> WriteGate {
    let gate = WriteGate::new();
    gate.enforce();
    gate.open_until(Instant::now() + open);
    gate
}

#[tokio::test]
async fn a_write_answered_429_is_not_retried_once_the_gate_has_closed() {
    shared()
        .in_namespace("gate-429", |client, ns| async move {
            let proxy = FaultProxy::start(client.clone()).await?;
            let metrics = Metrics::default();
            let gate = gate_open_for(Duration::from_secs(2));
            let c = opkit::client::build(proxy.config(), &gate, Duration::from_secs(30), &metrics)?;
            proxy.set(Fault::TooManyRequests { retry_after_secs: 4 }, Fault::Pass);
            let api: Api<ConfigMap> = Api::namespaced(c, &ns);
            let started = Instant::now();
            let err = api
                .create(&PostParams::default(), &configmap("late"))
                .await
                .err()
                .ok_or_else(|| anyhow!("the write went through"))?;
            ensure!(opkit::client::refused_by_gate(&err), "failed otherwise: {err}");
            // The server asked to wait 4 s; the retry found the gate (open for 2 s) closed.
            ensure!(
                started.elapsed() >= Duration::from_secs(4),
                "gave up after {:?}",
                started.elapsed()
            );
            ensure!(
                proxy.writes_seen() == 1,
                "{} attempts reached the server",
                proxy.writes_seen()
            );
            ensure!(metrics.sample("opkit_api_attempts_refused_total") == 1.0);
            let direct: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
            ensure!(
                direct.get_opt("late").await?.is_none(),
                "the ConfigMap was created"
            );

            // Without a fault and with an open gate, the same client writes.
            gate.open_until(Instant::now() + Duration::from_secs(30));
            proxy.set(Fault::Pass, Fault::Pass);
            api.create(&PostParams::default(), &configmap("on-time")).await?;
            ensure!(direct.get_opt("on-time").await?.is_some());
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn an_unanswered_write_gives_up_when_the_gate_closes() {
    shared()
        .in_namespace("gate-hang", |client, ns| async move {
            let proxy = FaultProxy::start(client.clone()).await?;
            let metrics = Metrics::default();
            let gate = gate_open_for(Duration::from_secs(2));
            let c = opkit::client::build(proxy.config(), &gate, Duration::from_secs(30), &metrics)?;
            proxy.set(Fault::Hang, Fault::Pass);
            let api: Api<ConfigMap> = Api::namespaced(c, &ns);
            let started = Instant::now();
            let out = tokio::time::timeout(
                Duration::from_secs(20),
                api.create(&PostParams::default(), &configmap("held")),
            )
            .await
            .map_err(|_| anyhow!("the write was still waiting after 20 s"))?;
            let took = started.elapsed();
            let err = out.err().ok_or_else(|| anyhow!("the write went through"))?;
            ensure!(err.to_string().contains("write gate closing"), "{err}");
            ensure!(took < Duration::from_secs(5), "gave up after {took:?}");
            let timeouts = r#"opkit_api_request_timeouts_total{reason="write_gate_closing"}"#;
            ensure!(metrics.sample(timeouts) == 1.0, "{}", metrics.encode());
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn a_half_open_read_fails_at_the_request_timeout_and_the_next_goes_through() {
    shared()
        .in_namespace("half-open", |client, ns| async move {
            let proxy = FaultProxy::start(client.clone()).await?;
            let metrics = Metrics::default();
            let c = opkit::client::build(
                proxy.config(),
                &WriteGate::new(),
                Duration::from_secs(2),
                &metrics,
            )?;
            let api: Api<ConfigMap> = Api::namespaced(c, &ns);
            api.create(&PostParams::default(), &configmap("here")).await?;
            proxy.set(Fault::Pass, Fault::Hang);
            let started = Instant::now();
            let out = tokio::time::timeout(Duration::from_secs(20), api.get("here"))
                .await
                .map_err(|_| anyhow!("the read was still waiting after 20 s"))?;
            let took = started.elapsed();
            let err = out.err().ok_or_else(|| anyhow!("the read got an answer"))?;
            ensure!(err.to_string().contains("request timeout"), "{err}");
            ensure!(
                took >= Duration::from_secs(2) && took < Duration::from_secs(5),
                "{took:?}"
            );
            let timeouts = r#"opkit_api_request_timeouts_total{reason="request_timeout"}"#;
            ensure!(metrics.sample(timeouts) == 1.0, "{}", metrics.encode());
            proxy.set(Fault::Pass, Fault::Pass);
            ensure!(api.get("here").await?.data.is_some_and(|d| d["k"] == "v"));
            Ok(())
        })
        .await;
}
