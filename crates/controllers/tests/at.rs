//! The At controller on the real local control plane (kwok ends one-shot Pods as their script
//! says: `exit N` fails with N, `sleep N` runs N seconds, anything else succeeds after ~1 s).

use anyhow::{Context, anyhow, ensure};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::core::ApiResource;
use kube::{Client, ResourceExt};
use opkit::ManagerOptions;
use opkit_api::at::{At, AtStatus, Outcome, Phase};
use opkit_controllers::at;
use opkit_testenv::{shared, wait_for};
use serde_json::json;

mod common;
use common::{Operator, T, install_crd, sample};

async fn start(client: &Client, ns: &str) -> anyhow::Result<Operator> {
    common::start(client, ns, at::NAME, ManagerOptions::default()).await
}

/// The book's sample, optionally with another schedule and command.
fn book_sample(schedule: Option<Timestamp>, command: Option<&str>) -> At {
    let mut a: At = serde_yaml::from_str(&sample("cnat_v1alpha1_at.yaml")).expect("the At sample parses");
    if let Some(s) = schedule {
        a.spec.schedule = s.strftime("%Y-%m-%dT%H:%M:%SZ").to_string();
    }
    if let Some(c) = command {
        a.spec.command = c.into();
    }
    a
}

/// The whole second `secs` seconds from now.
fn in_whole_seconds(secs: i64) -> anyhow::Result<Timestamp> {
    Ok(Timestamp::from_second(Timestamp::now().as_second() + secs)?)
}

async fn create(client: &Client, ns: &str, at: &At) -> anyhow::Result<At> {
    let api: Api<At> = Api::namespaced(client.clone(), ns);
    Ok(api.create(&PostParams::default(), at).await?)
}

/// Waits until the At reaches `phase`; returns its status.
async fn wait_phase(client: &Client, ns: &str, name: &str, phase: Phase) -> anyhow::Result<AtStatus> {
    let api: Api<At> = Api::namespaced(client.clone(), ns);
    wait_for(&format!("{name} to be {phase:?}"), T, || async {
        let st = api.get(name).await?.status.unwrap_or_default();
        if st.phase == Some(phase) {
            Ok(st)
        } else {
            Err(anyhow!("phase {:?}", st.phase))
        }
    })
    .await
}

async fn at_pods(client: &Client, ns: &str) -> anyhow::Result<Vec<Pod>> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    Ok(pods
        .list(&ListParams::default().labels(&at::selector()))
        .await?
        .items)
}

/// Reasons of the Events about `name`, oldest first.
async fn event_reasons(client: &Client, ns: &str, name: &str) -> anyhow::Result<Vec<String>> {
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    let mut evs: Vec<Event> = events
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .collect();
    evs.sort_by_key(|e| e.event_time.as_ref().map(|t| t.0));
    Ok(evs.into_iter().filter_map(|e| e.reason).collect())
}

async fn wait_event(client: &Client, ns: &str, name: &str, reason: &str) -> anyhow::Result<()> {
    wait_for(&format!("a {reason} Event about {name}"), T, || async {
        let r = event_reasons(client, ns, name).await?;
        if r.iter().any(|x| x == reason) {
            Ok(())
        } else {
            Err(anyhow!("events: {r:?}"))
        }
    })
    .await
}

#[tokio::test]
async fn a_finished_at_is_removed_with_its_pod_after_its_ttl() {
    shared()
        .in_namespace("at-ttl", |client, ns| async move {
            let _op = start(&client, &ns).await?;
            let mut a = book_sample(None, Some("true"));
            a.spec.ttl_seconds_after_finished = Some(2);
            create(&client, &ns, &a).await?;
            let st = wait_phase(&client, &ns, "example-at", Phase::Done).await?;
            ensure!(st.outcome == Some(Outcome::Succeeded), "{st:?}");
            ensure!(at_pods(&client, &ns).await?.len() == 1, "no Pod ran");
            let ats: Api<At> = Api::namespaced(client.clone(), &ns);
            wait_for("the At to be deleted after its TTL", T, || async {
                match ats.get_opt("example-at").await? {
                    None => Ok(()),
                    Some(a) => Err(anyhow!(
                        "still there: {:?}",
                        a.status.and_then(|s| s.completion_time)
                    )),
                }
            })
            .await?;
            let done = st.completion_time.context("no completion time")?.0;
            ensure!(
                Timestamp::now().duration_since(done) >= SignedDuration::from_secs(2),
                "deleted before its TTL ran out (finished at {done})"
            );
            // Its Pod goes with it (garbage collection of an owned object).
            wait_for("the At's Pod to be collected", T, || async {
                let left = at_pods(&client, &ns).await?.len();
                if left == 0 {
                    Ok(())
                } else {
                    Err(anyhow!("{left} Pods left"))
                }
            })
            .await?;
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn the_book_sample_runs_once_at_its_scheduled_time() {
    shared()
        .in_namespace("at-book", |client, ns| async move {
            let op = start(&client, &ns).await?;
            // Whole seconds, like the book's schedule and like `status.startTime`.
            let due = in_whole_seconds(8)?;
            create(&client, &ns, &book_sample(Some(due), None)).await?;
            let pending = wait_phase(&client, &ns, "example-at", Phase::Pending).await?;
            ensure!(
                at_pods(&client, &ns).await?.is_empty(),
                "a Pod before the schedule"
            );
            let reconciles_while_pending = op.metrics().reconciles_total();

            let running = wait_phase(&client, &ns, "example-at", Phase::Running).await?;
            let started = running.start_time.context("no startTime")?.0;
            let late = started.duration_since(due);
            println!("scheduled {due}, started {started} ({late:#})");
            ensure!(
                late >= SignedDuration::ZERO && late < SignedDuration::from_secs(2),
                "started {late:#} after the schedule"
            );
            // A timer, not a polling loop: over 8 s at most the echo of the PENDING status
            // write, the timer itself and the echo of the RUNNING write.
            let reconciles_at_start = op.metrics().reconciles_total();
            ensure!(
                reconciles_at_start - reconciles_while_pending <= 3,
                "{} reconciles while waiting",
                reconciles_at_start - reconciles_while_pending
            );
            ensure!(
                pending
                    .conditions
                    .iter()
                    .any(|c| c.type_ == "Scheduled" && c.status == "True")
            );

            let done = wait_phase(&client, &ns, "example-at", Phase::Done).await?;
            ensure!(done.outcome == Some(Outcome::Succeeded), "{done:?}");
            ensure!(done.exit_code == Some(0) && done.pod_name.as_deref() == Some("example-at-pod"));
            let pods = at_pods(&client, &ns).await?;
            ensure!(pods.len() == 1, "{} Pods", pods.len());
            let pod = &pods[0];
            let c = &pod.spec.as_ref().context("spec")?.containers[0];
            ensure!(c.command.as_deref() == Some(&["sh".into(), "-c".into(), "echo YAY".into()][..]));
            ensure!(pod.owner_references()[0].name == "example-at");
            wait_event(&client, &ns, "example-at", "CommandSucceeded").await?;
            let reasons = event_reasons(&client, &ns, "example-at").await?;
            ensure!(reasons.contains(&"Started".to_string()), "{reasons:?}");
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn a_past_schedule_runs_at_once() {
    shared()
        .in_namespace("at-past", |client, ns| async move {
            let _op = start(&client, &ns).await?;
            // The sample as published: scheduled in 2019.
            let created = Timestamp::now();
            create(&client, &ns, &book_sample(None, None)).await?;
            let running = wait_phase(&client, &ns, "example-at", Phase::Running).await?;
            let started = running.start_time.context("no startTime")?.0;
            ensure!(started.duration_since(created) < SignedDuration::from_secs(3));
            let done = wait_phase(&client, &ns, "example-at", Phase::Done).await?;
            ensure!(done.outcome == Some(Outcome::Succeeded), "{done:?}");
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn a_failing_command_ends_done_with_the_failure_shown() {
    shared()
        .in_namespace("at-fail", |client, ns| async move {
            let _op = start(&client, &ns).await?;
            create(&client, &ns, &book_sample(None, Some("exit 3"))).await?;
            let done = wait_phase(&client, &ns, "example-at", Phase::Done).await?;
            ensure!(done.outcome == Some(Outcome::Failed), "{done:?}");
            ensure!(done.exit_code == Some(3), "{done:?}");
            let cond = done
                .conditions
                .iter()
                .find(|c| c.type_ == "Succeeded")
                .context("no Succeeded condition")?;
            ensure!(
                cond.status == "False" && cond.reason == "CommandFailed",
                "{cond:?}"
            );
            ensure!(cond.message.contains("exit code 3"), "{}", cond.message);
            wait_event(&client, &ns, "example-at", "CommandFailed").await?;
            ensure!(at_pods(&client, &ns).await?.len() == 1, "the command was retried");
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn an_operator_restart_while_running_starts_no_second_pod() {
    shared()
        .in_namespace("at-restart", |client, ns| async move {
            let op = start(&client, &ns).await?;
            create(&client, &ns, &book_sample(None, Some("sleep 6"))).await?;
            wait_phase(&client, &ns, "example-at", Phase::Running).await?;
            let before = at_pods(&client, &ns).await?;
            ensure!(before.len() == 1);
            op.stop().await;

            let op = start(&client, &ns).await?;
            let done = wait_phase(&client, &ns, "example-at", Phase::Done).await?;
            ensure!(done.outcome == Some(Outcome::Succeeded), "{done:?}");
            let after = at_pods(&client, &ns).await?;
            ensure!(after.len() == 1, "{} Pods", after.len());
            ensure!(after[0].uid() == before[0].uid(), "the Pod was replaced");
            drop(op);
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn a_pod_deleted_while_running_is_reported_not_recreated() {
    shared()
        .in_namespace("at-lost", |client, ns| async move {
            let _op = start(&client, &ns).await?;
            create(&client, &ns, &book_sample(None, Some("sleep 30"))).await?;
            wait_phase(&client, &ns, "example-at", Phase::Running).await?;
            // RUNNING is recorded before the Pod is created (the intent first): wait for it.
            let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
            wait_for("the At's Pod", T, || async {
                pods.get_opt("example-at-pod")
                    .await?
                    .map(|_| ())
                    .ok_or_else(|| anyhow!("not created yet"))
            })
            .await?;
            pods.delete("example-at-pod", &DeleteParams::default()).await?;
            let done = wait_phase(&client, &ns, "example-at", Phase::Done).await?;
            ensure!(done.outcome == Some(Outcome::Failed), "{done:?}");
            ensure!(done.reason.as_deref() == Some("PodDeleted"), "{done:?}");
            wait_event(&client, &ns, "example-at", "PodDeleted").await?;
            ensure!(
                pods.get_opt("example-at-pod").await?.is_none(),
                "the Pod came back"
            );
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn editing_the_schedule_while_pending_reschedules() {
    shared()
        .in_namespace("at-edit", |client, ns| async move {
            let _op = start(&client, &ns).await?;
            let later = Timestamp::now() + SignedDuration::from_hours(1);
            create(&client, &ns, &book_sample(Some(later), None)).await?;
            wait_phase(&client, &ns, "example-at", Phase::Pending).await?;
            let due = in_whole_seconds(3)?;
            let api: Api<At> = Api::namespaced(client.clone(), &ns);
            api.patch(
                "example-at",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"schedule": due.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()}})),
            )
            .await?;
            let running = wait_phase(&client, &ns, "example-at", Phase::Running).await?;
            let late = running.start_time.context("no startTime")?.0.duration_since(due);
            ensure!(
                late >= SignedDuration::ZERO && late < SignedDuration::from_secs(2),
                "started {late:#} after the new schedule"
            );
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn deleting_the_at_deletes_its_pod() {
    shared()
        .in_namespace("at-delete", |client, ns| async move {
            let _op = start(&client, &ns).await?;
            create(&client, &ns, &book_sample(None, Some("sleep 30"))).await?;
            wait_phase(&client, &ns, "example-at", Phase::Running).await?;
            let api: Api<At> = Api::namespaced(client.clone(), &ns);
            api.delete("example-at", &DeleteParams::background()).await?;
            wait_for("the Pod to be collected", T, || async {
                let n = at_pods(&client, &ns).await?.len();
                if n == 0 {
                    Ok(())
                } else {
                    Err(anyhow!("{n} Pods left"))
                }
            })
            .await?;
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn a_malformed_schedule_is_refused_by_the_apiserver() {
    shared()
        .in_namespace("at-bad", |client, ns| async move {
            install_crd(&client, opkit_api::at::crd()).await?;
            let api: Api<DynamicObject> =
                Api::namespaced_with(client.clone(), &ns, &ApiResource::erase::<At>(&()));
            for (i, bad) in ["tomorrow", "2019-04-12T10:12:00", "2019-04-12 10:12"]
                .iter()
                .enumerate()
            {
                let obj: DynamicObject = serde_json::from_value(json!({
                    "apiVersion": "cnat.programming-kubernetes.info/v1alpha1",
                    "kind": "At",
                    "metadata": {"name": format!("bad-{i}")},
                    "spec": {"schedule": bad, "command": "echo YAY"},
                }))?;
                let err = api
                    .create(&PostParams::default(), &obj)
                    .await
                    .err()
                    .with_context(|| format!("schedule {bad:?} was accepted"))?;
                let msg = err.to_string();
                ensure!(msg.contains("spec.schedule"), "{bad:?}: {msg}");
                ensure!(msg.contains("RFC 3339"), "{bad:?}: {msg}");
            }
            let missing: DynamicObject = serde_json::from_value(json!({
                "apiVersion": "cnat.programming-kubernetes.info/v1alpha1",
                "kind": "At",
                "metadata": {"name": "no-command"},
                "spec": {"schedule": "2019-04-12T10:12:00Z"},
            }))?;
            let msg = api
                .create(&PostParams::default(), &missing)
                .await
                .err()
                .context("accepted")?
                .to_string();
            ensure!(msg.contains("spec.command"), "{msg}");
            Ok(())
        })
        .await;
}
