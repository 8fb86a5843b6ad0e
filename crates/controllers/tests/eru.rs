//! The Eru controller on the real local control plane.

use std::time::Duration;

use anyhow::{Context, anyhow, ensure};
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::core::ApiResource;
use kube::{Client, ResourceExt};
use opkit::ManagerOptions;
use opkit_api::eru::{ANNOTATION, Eru, SCHEDULE_ANNOTATION};
use opkit_controllers::eru;
use opkit_testenv::{shared, wait_for};
use serde_json::json;

mod common;
use common::eru::*;
use common::{Operator, T, assert_quiescent, settled};

async fn start(client: &Client, ns: &str) -> anyhow::Result<Operator> {
    common::start(client, ns, eru::NAME, ManagerOptions::default()).await
}

#[tokio::test]
async fn an_annotated_deployment_gets_an_eru_and_rolls_on_schedule() {
    shared()
        .in_namespace("eru-roll", |client, ns| async move {
            let op = start(&client, &ns).await?;
            // The schedule loop watches Deployments exactly as the annotation controller's
            // primary does: one cache between them, reported once.
            let caches = |controller: &str| {
                op.sample(&format!(
                    r#"opkit_cache_objects{{controller="{controller}",kind="Deployment"}}"#
                ))
            };
            let deployment_caches = |text: String| {
                text.lines()
                    .filter(|l| l.starts_with("opkit_cache_objects{") && l.contains(r#"kind="Deployment""#))
                    .count()
            };
            ensure!(
                deployment_caches(op.encoded()) == 1,
                "two Deployment caches: {:?}",
                (caches(eru::NAME), caches(eru::ANNOTATIONS))
            );
            let deploys: Api<Deployment> = Api::namespaced(client.clone(), &ns);
            let erus: Api<Eru> = Api::namespaced(client.clone(), &ns);
            let d = deployment(
                "web",
                json!({ANNOTATION: "true", SCHEDULE_ANNOTATION: "*/10 * * * * *"}),
                0,
            )?;
            let d = deploys.create(&PostParams::default(), &d).await?;
            let e = exists(&erus, "web").await?;
            ensure!(e.spec.deployment_name == "web" && e.spec.schedule == "*/10 * * * * *");
            ensure!(
                e.owner_references()
                    .iter()
                    .any(|o| Some(&o.uid) == d.metadata.uid.as_ref())
            );
            has_event(&client, &ns, "web", "EruCreated").await?;
            deployment_settled(&deploys, "web").await?;

            let s = eru_status(&erus, "web", "restarted once", |s| s.restart_count >= 1).await?;
            let slot = s.last_schedule_time.context("no lastScheduleTime")?.0;
            let d = deploys.get("web").await?;
            ensure!(
                eru::restarted_at(&d) == Some(eru::restart_stamp(slot).as_str()),
                "restartedAt does not match the slot"
            );
            ensure!(slot.as_second() % 10 == 0, "slot {slot} is not on the schedule");
            let restart = s.last_restart_time.context("no lastRestartTime")?.0;
            ensure!(
                restart.duration_since(slot).as_secs() < 2,
                "restarted {restart}, slot {slot}"
            );
            ensure!(s.next_restart_time.is_some());
            // The Deployment controller rolled a new ReplicaSet and its Pods became Ready.
            let rss: Api<ReplicaSet> = Api::namespaced(client.clone(), &ns);
            wait_for("a second ReplicaSet", T, || async {
                let n = rss
                    .list(&ListParams::default().labels("app=web"))
                    .await?
                    .items
                    .len();
                if n >= 2 {
                    Ok(())
                } else {
                    Err(anyhow!("{n} ReplicaSets"))
                }
            })
            .await?;
            deployment_settled(&deploys, "web").await?;
            // opkit owns only the restart annotation of the Deployment.
            let d = deploys.get("web").await?;
            let ours: Vec<_> = d
                .managed_fields()
                .iter()
                .filter(|m| m.manager.as_deref() == Some("opkit-eru"))
                .collect();
            ensure!(ours.len() == 1, "{ours:?}");
            let fields = serde_json::to_string(&ours[0].fields_v1)?;
            ensure!(
                fields.contains("kubectl.kubernetes.io/restartedAt") && !fields.contains("replicas"),
                "{fields}"
            );
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn removing_the_annotation_deletes_only_the_eru_opkit_created() {
    shared()
        .in_namespace("eru-unannotate", |client, ns| async move {
            let _op = start(&client, &ns).await?;
            let deploys: Api<Deployment> = Api::namespaced(client.clone(), &ns);
            let erus: Api<Eru> = Api::namespaced(client.clone(), &ns);
            deploys
                .create(
                    &PostParams::default(),
                    &deployment("web", json!({ANNOTATION: "true"}), 0)?,
                )
                .await?;
            erus.create(&PostParams::default(), &hand_written("manual", "web", "@daily"))
                .await?;
            exists(&erus, "web").await?;
            deploys
                .patch(
                    "web",
                    &PatchParams::default(),
                    &Patch::Merge(json!({"metadata": {"annotations": {ANNOTATION: null}}})),
                )
                .await?;
            gone(&erus, "web").await?;
            ensure!(
                erus.get_opt("manual").await?.is_some(),
                "the hand-written Eru was deleted"
            );
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn deleting_the_deployment_removes_its_eru() {
    shared()
        .in_namespace("eru-gc", |client, ns| async move {
            let _op = start(&client, &ns).await?;
            let deploys: Api<Deployment> = Api::namespaced(client.clone(), &ns);
            let erus: Api<Eru> = Api::namespaced(client.clone(), &ns);
            deploys
                .create(
                    &PostParams::default(),
                    &deployment("web", json!({ANNOTATION: "true"}), 0)?,
                )
                .await?;
            exists(&erus, "web").await?;
            deploys.delete("web", &DeleteParams::background()).await?;
            gone(&erus, "web").await?;
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn a_rollout_in_progress_postpones_the_restart() {
    shared()
        .in_namespace("eru-slow", |client, ns| async move {
            let _op = start(&client, &ns).await?;
            let deploys: Api<Deployment> = Api::namespaced(client.clone(), &ns);
            let erus: Api<Eru> = Api::namespaced(client.clone(), &ns);
            // minReadySeconds keeps the rollout going for a minute after the Pods are Ready.
            deploys
                .create(&PostParams::default(), &deployment("slow", json!({}), 60)?)
                .await?;
            erus.create(
                &PostParams::default(),
                &hand_written("slow", "slow", "*/3 * * * * *"),
            )
            .await?;
            let s = eru_status(&erus, "slow", "postponed", |s| {
                condition(s, "Postponed") == Some(("True".into(), "RolloutInProgress".into()))
            })
            .await?;
            ensure!(s.restart_count == 0, "restarted during a rollout: {s:?}");
            ensure!(
                eru::restarted_at(&deploys.get("slow").await?).is_none(),
                "restartedAt was set"
            );
            has_event(&client, &ns, "slow", "Postponed").await?;
            // Once the rollout completes, the postponed restart happens.
            deploys
                .patch(
                    "slow",
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"minReadySeconds": 0}})),
                )
                .await?;
            let s = eru_status(&erus, "slow", "restarted", |s| s.restart_count >= 1).await?;
            ensure!(
                condition(&s, "Postponed").map(|c| c.0) == Some("False".into()),
                "{s:?}"
            );
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn suspend_stops_restarts_and_missed_slots_are_not_made_up() {
    shared()
        .in_namespace("eru-suspend", |client, ns| async move {
            let op = start(&client, &ns).await?;
            let deploys: Api<Deployment> = Api::namespaced(client.clone(), &ns);
            let erus: Api<Eru> = Api::namespaced(client.clone(), &ns);
            deploys
                .create(&PostParams::default(), &deployment("web", json!({}), 0)?)
                .await?;
            deployment_settled(&deploys, "web").await?;
            let mut e = hand_written("web", "web", "*/2 * * * * *");
            e.spec.suspend = Some(true);
            erus.create(&PostParams::default(), &e).await?;
            eru_status(&erus, "web", "suspended", |s| {
                condition(s, "Scheduled") == Some(("False".into(), "Suspended".into()))
                    && s.next_restart_time.is_none()
            })
            .await?;
            // Slots pass every 2 s: once the controller has settled, nothing may write to the
            // Eru (or restart the Deployment) over a window of several slots.
            assert_quiescent(&op.metrics(), &erus, "web", Duration::from_secs(5)).await?;
            ensure!(erus.get("web").await?.status.unwrap_or_default().restart_count == 0);
            ensure!(
                eru::restarted_at(&deploys.get("web").await?).is_none(),
                "restarted while suspended"
            );

            let resumed = Timestamp::now();
            erus.patch(
                "web",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"suspend": false}})),
            )
            .await?;
            let s = eru_status(&erus, "web", "restarted after resuming", |s| s.restart_count >= 1).await?;
            let slot = s.last_schedule_time.clone().context("no slot")?.0;
            ensure!(
                slot >= resumed,
                "made up slot {slot} from before resuming at {resumed}"
            );
            ensure!(s.restart_count == 1, "{s:?}");
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn a_missing_deployment_costs_one_event_then_nothing_and_is_not_restarted_for_old_slots() {
    shared()
        .in_namespace("eru-missing", |client, ns| async move {
            let op = start(&client, &ns).await?;
            let deploys: Api<Deployment> = Api::namespaced(client.clone(), &ns);
            let erus: Api<Eru> = Api::namespaced(client.clone(), &ns);
            // Every second, and no Deployment.
            erus.create(&PostParams::default(), &hand_written("web", "web", "* * * * * *"))
                .await?;
            eru_status(&erus, "web", "the target reported missing", |s| {
                condition(s, "TargetFound") == Some(("False".into(), "DeploymentNotFound".into()))
                    && condition(s, "Scheduled") == Some(("False".into(), "DeploymentNotFound".into()))
            })
            .await?;
            // Slots pass every second: no write, no new Event over several of them.
            assert_quiescent(&op.metrics(), &erus, "web", Duration::from_secs(5)).await?;
            let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), &ns);
            let warnings = events
                .list(&Default::default())
                .await?
                .items
                .into_iter()
                .filter(|e| e.reason.as_deref() == Some("DeploymentNotFound"))
                .map(|e| e.series.map_or(1, |s| s.count))
                .sum::<i32>();
            ensure!(warnings == 1, "{warnings} DeploymentNotFound Events");

            // It appears: the slots from before it existed are not restarted; the next one is.
            let created = Timestamp::now();
            deploys
                .create(&PostParams::default(), &deployment("web", json!({}), 0)?)
                .await?;
            let s = eru_status(&erus, "web", "restarted once it exists", |s| s.restart_count >= 1).await?;
            let slot = s.last_schedule_time.clone().context("no slot")?.0;
            let made = deploys
                .get("web")
                .await?
                .metadata
                .creation_timestamp
                .context("no creation time")?
                .0;
            ensure!(
                slot >= made,
                "restarted for slot {slot}, before the Deployment existed ({made}, seen {created})"
            );
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn an_edit_to_the_schedule_does_not_restart_for_a_slot_before_the_edit() {
    shared()
        .in_namespace("eru-edit", |client, ns| async move {
            let op = start(&client, &ns).await?;
            let deploys: Api<Deployment> = Api::namespaced(client.clone(), &ns);
            let erus: Api<Eru> = Api::namespaced(client.clone(), &ns);
            deploys
                .create(&PostParams::default(), &deployment("web", json!({}), 0)?)
                .await?;
            deployment_settled(&deploys, "web").await?;
            // Daily at 04:00 in a zone where that is far away; settled, nothing due.
            erus.create(&PostParams::default(), &hand_written("web", "web", "0 4 * * *"))
                .await?;
            eru_status(&erus, "web", "scheduled", |s| s.next_restart_time.is_some()).await?;
            settled(&op.metrics()).await?;
            // Let a second pass after the Eru was made, so a slot can lie between the two.
            let made = erus
                .get("web")
                .await?
                .metadata
                .creation_timestamp
                .context("no creation time")?
                .0;
            wait_for("a second to pass since the Eru was made", T, || async {
                let now = Timestamp::now();
                if now.as_second() >= made.as_second() + 2 {
                    Ok(())
                } else {
                    Err(anyhow!("at {now}"))
                }
            })
            .await?;
            // To a daily schedule whose slot was a second ago (after the Eru was made, so a
            // catch-up would restart for it); its next slot is tomorrow.
            let edited = Timestamp::now();
            let slot = edited
                .checked_sub(Duration::from_secs(1))?
                .to_zoned(k8s_openapi::jiff::tz::TimeZone::UTC);
            let schedule = format!("{} {} {} * * *", slot.second(), slot.minute(), slot.hour());
            erus.patch(
                "web",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"schedule": schedule}})),
            )
            .await?;
            let s = eru_status(&erus, "web", "the edit seen", |s| {
                s.observed_generation == Some(2)
            })
            .await?;
            ensure!(s.restart_count == 0, "restarted right after the edit: {s:?}");
            ensure!(
                eru::restarted_at(&deploys.get("web").await?).is_none(),
                "the Deployment was restarted for a slot before the edit at {edited}"
            );
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn an_operator_restart_does_not_restart_twice_for_one_slot() {
    shared()
        .in_namespace("eru-oprestart", |client, ns| async move {
            let op = start(&client, &ns).await?;
            let deploys: Api<Deployment> = Api::namespaced(client.clone(), &ns);
            let erus: Api<Eru> = Api::namespaced(client.clone(), &ns);
            deploys
                .create(&PostParams::default(), &deployment("web", json!({}), 0)?)
                .await?;
            deployment_settled(&deploys, "web").await?;
            erus.create(
                &PostParams::default(),
                &hand_written("web", "web", "*/15 * * * * *"),
            )
            .await?;
            let s = eru_status(&erus, "web", "restarted once", |s| s.restart_count == 1).await?;
            let slot = s.last_schedule_time.context("no slot")?.0;
            let next = s.next_restart_time.context("no next")?.0;
            op.stop().await;

            let op = start(&client, &ns).await?;
            wait_for("the new operator to reconcile", T, || async {
                if op.metrics().reconciles_total() >= 1 {
                    Ok(())
                } else {
                    Err(anyhow!("not yet"))
                }
            })
            .await?;
            common::settled(&op.metrics()).await?;
            ensure!(
                Timestamp::now() < next,
                "the next slot came too soon for this check"
            );
            let s = erus.get("web").await?.status.unwrap_or_default();
            ensure!(s.restart_count == 1, "restarted again: {s:?}");
            let d = deploys.get("web").await?;
            ensure!(eru::restarted_at(&d) == Some(eru::restart_stamp(slot).as_str()));
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn bad_schedules_and_time_zones_are_refused_or_reported() {
    shared()
        .in_namespace("eru-bad", |client, ns| async move {
            let _op = start(&client, &ns).await?;
            let dynamic: Api<DynamicObject> =
                Api::namespaced_with(client.clone(), &ns, &ApiResource::erase::<Eru>(&()));
            for (spec, field) in [
                (
                    json!({"deploymentName": "web", "schedule": "every day"}),
                    "spec.schedule",
                ),
                (
                    json!({"deploymentName": "web", "schedule": "@daily", "timeZone": "Mars/Olympus"}),
                    "spec.timeZone",
                ),
                (
                    json!({"deploymentName": "Web_1", "schedule": "@daily"}),
                    "spec.deploymentName",
                ),
            ] {
                let obj: DynamicObject = serde_json::from_value(json!({
                    "apiVersion": "mtsre.meitu.com/v1", "kind": "Eru",
                    "metadata": {"name": "bad"}, "spec": spec,
                }))?;
                let err = dynamic
                    .create(&PostParams::default(), &obj)
                    .await
                    .err()
                    .context("accepted")?;
                ensure!(err.to_string().contains(field), "{err}");
            }
            // Well-formed but out of range: only the controller can tell.
            let erus: Api<Eru> = Api::namespaced(client.clone(), &ns);
            erus.create(
                &PostParams::default(),
                &hand_written("range", "web", "61 * * * *"),
            )
            .await?;
            let s = eru_status(&erus, "range", "invalid", |s| {
                condition(s, "Scheduled") == Some(("False".into(), "InvalidSchedule".into()))
            })
            .await?;
            let msg = &s
                .conditions
                .iter()
                .find(|c| c.type_ == "Scheduled")
                .context("no condition")?
                .message;
            ensure!(msg.contains("minute: 61"), "{msg}");
            has_event(&client, &ns, "range", "InvalidSchedule").await?;
            // And a target that does not exist.
            ensure!(condition(&s, "TargetFound") == Some(("False".into(), "DeploymentNotFound".into())));
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn a_hand_written_eru_is_untouched_when_its_deployment_is_annotated_and_the_operator_restarts() {
    shared()
        .in_namespace("eru-handwritten", |client, ns| async move {
            let op = start(&client, &ns).await?;
            let deploys: Api<Deployment> = Api::namespaced(client.clone(), &ns);
            let erus: Api<Eru> = Api::namespaced(client.clone(), &ns);
            deploys
                .create(&PostParams::default(), &deployment("web", json!({}), 0)?)
                .await?;
            let mut mine = hand_written("web", "web", "0 4 * * *");
            mine.metadata.labels = Some([("team".to_string(), "payments".to_string())].into());
            erus.create(&PostParams::default(), &mine).await?;
            eru_status(&erus, "web", "scheduled", |s| s.next_restart_time.is_some()).await?;
            let snapshot = |e: &Eru| {
                serde_json::to_string(&json!({
                    "spec": e.spec,
                    "labels": e.metadata.labels,
                    "ownerReferences": e.metadata.owner_references,
                }))
            };
            let before = snapshot(&erus.get("web").await?)?;

            let annotations = op.metrics_of(eru::ANNOTATIONS);
            let seen = annotations.reconciles_total();
            deploys
                .patch(
                    "web",
                    &PatchParams::default(),
                    &Patch::Merge(json!({"metadata": {"annotations": {
                        ANNOTATION: "true", SCHEDULE_ANNOTATION: "*/5 * * * * *"}}})),
                )
                .await?;
            wait_for("the annotation loop to see the annotation", T, || async {
                if annotations.reconciles_total() > seen {
                    Ok(())
                } else {
                    Err(anyhow!("not yet"))
                }
            })
            .await?;
            common::settled(&annotations).await?;
            ensure!(annotations.writes_total() == 0, "the annotation loop wrote");
            op.stop().await;

            let op = start(&client, &ns).await?;
            let annotations = op.metrics_of(eru::ANNOTATIONS);
            wait_for("the annotation loop to run after the restart", T, || async {
                if annotations.reconciles_total() >= 1 {
                    Ok(())
                } else {
                    Err(anyhow!("not yet"))
                }
            })
            .await?;
            common::settled(&annotations).await?;
            ensure!(
                annotations.writes_total() == 0,
                "the annotation loop wrote after the restart"
            );
            let after = snapshot(&erus.get("web").await?)?;
            ensure!(
                before == after,
                "the hand-written Eru changed:\n{before}\n{after}"
            );
            Ok(())
        })
        .await;
}
