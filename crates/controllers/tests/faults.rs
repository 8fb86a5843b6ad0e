//! The controllers' client (`opkit::client`) under faults injected by `opkit-testenv`'s proxy:
//! the write gate is checked on every attempt, retries included; no attempt is still waiting
//! when the gate closes; a request that gets no answer (a half-open connection) fails at the
//! request timeout and the next one goes through, and so does one whose body stops half-way.

use std::time::{Duration, Instant};

use anyhow::{anyhow, ensure};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::api::PostParams;
use opkit::leader::WriteGate;
use opkit::metrics::Metrics;
use opkit_testenv::proxy::{Fault, FaultProxy};
use opkit_testenv::{shared, tls_trusted};
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
async fn a_read_without_a_whole_answer_fails_at_the_request_timeout_and_the_next_goes_through() {
    shared()
        .in_namespace("half-open", |client, ns| async move {
            // No answer at all (a half-open connection), then an answer whose body stops
            // half-way.
            for fault in [Fault::Hang, Fault::StallBody] {
                let proxy = FaultProxy::start(client.clone()).await?;
                let metrics = Metrics::default();
                let c = opkit::client::build(
                    proxy.config(),
                    &WriteGate::new(),
                    Duration::from_secs(2),
                    &metrics,
                )?;
                let api: Api<ConfigMap> = Api::namespaced(c, &ns);
                if api.get_opt("here").await?.is_none() {
                    api.create(&PostParams::default(), &configmap("here")).await?;
                }
                proxy.set(Fault::Pass, fault.clone());
                let started = Instant::now();
                let out = tokio::time::timeout(Duration::from_secs(20), api.get("here"))
                    .await
                    .map_err(|_| anyhow!("{fault:?}: the read was still waiting after 20 s"))?;
                let took = started.elapsed();
                let err = out
                    .err()
                    .ok_or_else(|| anyhow!("{fault:?}: the read got a whole answer"))?;
                ensure!(err.to_string().contains("request timeout"), "{fault:?}: {err}");
                ensure!(
                    took >= Duration::from_secs(2) && took < Duration::from_secs(5),
                    "{fault:?}: {took:?}"
                );
                let timeouts = r#"opkit_api_request_timeouts_total{reason="request_timeout"}"#;
                ensure!(metrics.sample(timeouts) == 1.0, "{fault:?}: {}", metrics.encode());
                proxy.set(Fault::Pass, Fault::Pass);
                ensure!(api.get("here").await?.data.is_some_and(|d| d["k"] == "v"));
            }
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn a_replica_that_could_not_read_the_shared_certificate_never_publishes_its_own_and_converges() {
    use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
    use kube::core::DynamicObject;
    use opkit::webhook::{FailurePolicy, Rule, RuleScope, Verdict, WebhookOptions, Webhooks};
    shared()
        .in_namespace("certs", |client, ns| async move {
            let project: &'static str = Box::leak(format!("c{}", &ns[ns.len() - 8..]).into_boxed_str());
            let hooks = Webhooks::new().validating::<DynamicObject, _, _>(
                Rule {
                    name: "v.certs.example.com",
                    path: "/validate",
                    group: "example.com",
                    versions: &["v1"],
                    resource: "things",
                    operations: &["CREATE"],
                    failure_policy: FailurePolicy::Ignore,
                    scope: RuleScope::Namespaced,
                },
                |_| async { Verdict::allow() },
            );
            let opts = |port: u16| WebhookOptions {
                project,
                bind: ([127, 0, 0, 1], port).into(),
                cert_dir: None,
                url: Some(format!("https://127.0.0.1:{port}")),
                namespace: ns.clone(),
                configure: true,
                http2: false,
            };
            let stop = tokio_util::sync::CancellationToken::new();
            let _stop = stop.clone().drop_guard();
            let (pa, pb) = (opkit_testenv::free_port()?, opkit_testenv::free_port()?);
            opkit::webhook::start(&client, &hooks, &opts(pa), stop.clone()).await?;
            let vwcs: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
            let name = format!("{project}-validating-webhook-configuration");
            let published = || async {
                let v = vwcs.get(&name).await?;
                let ca = v.webhooks.unwrap_or_default()[0].client_config.ca_bundle.clone();
                ca.map(|b| b.0).ok_or_else(|| anyhow!("no caBundle"))
            };
            let shared_ca = published().await?;
            ensure!(
                tls_trusted(pa, &shared_ca).await?,
                "the first replica is not trusted"
            );

            // The second replica cannot read the Secret (every read gets a 500) for longer
            // than it retries at start: it serves a certificate of its own meanwhile.
            let proxy = FaultProxy::start(client.clone()).await?;
            proxy.set(Fault::Pass, Fault::Status(500));
            let through_proxy = kube::Client::try_from(proxy.config())?;
            let started = Instant::now();
            opkit::webhook::start(&through_proxy, &hooks, &opts(pb), stop.clone()).await?;
            ensure!(
                started.elapsed() >= Duration::from_secs(15),
                "gave up on the Secret after {:?}",
                started.elapsed()
            );
            ensure!(
                !tls_trusted(pb, &shared_ca).await?,
                "serving the shared certificate without reading it?"
            );
            ensure!(
                published().await? == shared_ca,
                "the second replica published its own CA"
            );
            ensure!(
                tls_trusted(pa, &published().await?).await?,
                "the first replica is no longer trusted"
            );

            // The reads work again: the second replica switches to the shared certificate.
            proxy.set(Fault::Pass, Fault::Pass);
            opkit_testenv::wait_for(
                "the second replica to be trusted",
                Duration::from_secs(30),
                || async {
                    let ca = published().await?;
                    if tls_trusted(pb, &ca).await? && tls_trusted(pa, &ca).await? {
                        Ok(())
                    } else {
                        Err(anyhow!("not trusted yet"))
                    }
                },
            )
            .await?;
            vwcs.delete(&name, &Default::default()).await?;
            let mwcs: Api<k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration> =
                Api::all(client.clone());
            mwcs.delete(
                &format!("{project}-mutating-webhook-configuration"),
                &Default::default(),
            )
            .await?;
            Ok(())
        })
        .await;
}
