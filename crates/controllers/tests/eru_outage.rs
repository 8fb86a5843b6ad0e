//! The Eru controller after an outage, with thousands of unrelated Deployments to list first.
//! A test binary of its own: creating those Deployments keeps the control plane busy, which
//! would slow the other Eru tests down.
use std::time::Duration;

use anyhow::ensure;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, ListParams, PostParams};
use opkit::ManagerOptions;
use opkit_api::eru::Eru;
use opkit_controllers::eru;
use opkit_testenv::shared;
use serde_json::json;

mod common;
use common::Operator;
use common::assert_quiescent;
use common::eru::{deployment, deployment_settled, eru_status, hand_written, idle_deployment};

async fn start(client: &Client, ns: &str) -> anyhow::Result<Operator> {
    common::start(client, ns, eru::NAME, ManagerOptions::default()).await
}

#[tokio::test]
async fn a_slot_missed_while_the_operator_was_down_is_caught_up_once_among_3000_deployments() {
    use futures::{StreamExt, TryStreamExt};
    const UNRELATED: usize = 3000;
    const OUTAGE: Duration = Duration::from_secs(120);
    shared()
        .in_namespace("eru-outage", |client, ns| async move {
            let deploys: Api<Deployment> = Api::namespaced(client.clone(), &ns);
            let erus: Api<Eru> = Api::namespaced(client.clone(), &ns);
            // Many unrelated Deployments make the operator's initial list of Deployments slow.
            futures::stream::iter(0..UNRELATED)
                .map(|i| {
                    let deploys = deploys.clone();
                    async move {
                        deploys
                            .create(&PostParams::default(), &idle_deployment(&format!("other-{i}"))?)
                            .await?;
                        anyhow::Ok(())
                    }
                })
                .buffer_unordered(32)
                .try_collect::<Vec<_>>()
                .await?;
            deploys
                .create(&PostParams::default(), &deployment("web", json!({}), 0)?)
                .await?;
            deployment_settled(&deploys, "web").await?;

            // A daily schedule whose one slot in the next day falls inside the outage.
            let op = start(&client, &ns).await?;
            let slot = Timestamp::from_second(Timestamp::now().as_second() + 40)?;
            let (h, m, sec) = {
                let z = slot.to_zoned(k8s_openapi::jiff::tz::TimeZone::UTC);
                (z.hour(), z.minute(), z.second())
            };
            erus.create(
                &PostParams::default(),
                &hand_written("web", "web", &format!("{sec} {m} {h} * * *")),
            )
            .await?;
            eru_status(&erus, "web", "scheduled for the slot", |s| {
                s.next_restart_time.as_ref().map(|t| t.0) == Some(slot)
            })
            .await?;
            op.stop().await;
            let down = Timestamp::now();
            ensure!(down < slot, "the operator stopped after the slot");

            tokio::time::sleep(OUTAGE).await;
            ensure!(Timestamp::now() > slot, "the outage ended before the slot");
            let op = start(&client, &ns).await?;
            let s = eru_status(&erus, "web", "the catch-up restart", |s| s.restart_count >= 1).await?;
            ensure!(s.last_schedule_time.as_ref().map(|t| t.0) == Some(slot), "{s:?}");
            ensure!(
                eru::restarted_at(&deploys.get("web").await?) == Some(eru::restart_stamp(slot).as_str()),
                "the Deployment was not restarted for the slot"
            );
            assert_quiescent(&op.metrics(), &erus, "web", Duration::from_secs(5)).await?;
            let s = erus.get("web").await?.status.unwrap_or_default();
            ensure!(s.restart_count == 1, "restarted more than once: {s:?}");
            let events: Api<Event> = Api::namespaced(client.clone(), &ns);
            let wrong: Vec<String> = events
                .list(&ListParams::default())
                .await?
                .items
                .into_iter()
                .filter(|e| {
                    matches!(
                        e.reason.as_deref(),
                        Some(eru::reason::DEPLOYMENT_NOT_FOUND | eru::reason::MISSED_SCHEDULE)
                    )
                })
                .map(|e| format!("{:?}: {:?}", e.reason, e.note))
                .collect();
            ensure!(wrong.is_empty(), "{wrong:?}");
            Ok(())
        })
        .await;
}
