//! The in-memory harness catches what a unit test of a plan does not: a plan that writes on
//! every reconcile. Two controllers keep a copy of every ConfigMap labelled `mirror`; one
//! stamps the time of the copy into it, so that its output is never the same twice.
mod common;

use std::collections::BTreeMap;

use anyhow::ensure;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ApiResource, DynamicObject, PostParams};
use kube::{Client, Resource, ResourceExt};
use opkit_runtime::testing::Harness;
use opkit_runtime::{Cache, Child, Invalid, Operator, Plan, Reconciler, Registry, Requeue, Watch, Watches};

struct Mirror {
    name: &'static str,
    /// The defect: the copy records when it was made.
    stamp: bool,
    /// Reconciles again this long after each reconcile (none: on a change only).
    every: Option<std::time::Duration>,
}

impl Reconciler for Mirror {
    type Object = ConfigMap;
    type Caches = Cache<ConfigMap>;
    type World = Option<std::sync::Arc<ConfigMap>>;
    type Status = ();

    fn name(&self) -> &'static str {
        self.name
    }

    fn primary(&self) -> Watch<ConfigMap> {
        Watch::labels("mirror")
    }

    fn watch(&self, w: &mut Watches<ConfigMap>) -> Cache<ConfigMap> {
        w.owns(Watch::labels("mirror-of"))
    }

    async fn observe(&self, cm: &ConfigMap, copies: &Self::Caches, _: &Client) -> kube::Result<Self::World> {
        Ok(copies.get(
            &cm.namespace().unwrap_or_default(),
            &format!("{}-copy", cm.name_any()),
        ))
    }

    fn plan(&self, cm: &ConfigMap, live: &Self::World, now: Timestamp) -> Result<Plan<()>, Invalid> {
        let mut data = cm.data.clone().unwrap_or_default();
        if self.stamp {
            data.insert("copied-at".into(), now.to_string());
        }
        let mut copy = ConfigMap {
            data: Some(data),
            ..Default::default()
        };
        copy.metadata.name = Some(format!("{}-copy", cm.name_any()));
        copy.metadata.namespace = cm.namespace();
        copy.metadata.labels = Some(BTreeMap::from([("mirror-of".into(), cm.name_any())]));
        copy.metadata.owner_references = cm.controller_owner_ref(&()).map(|o| vec![o]);
        // Labelled `once`, it asks for no requeue.
        let every = self.every.filter(|_| !cm.labels().contains_key("once"));
        let requeue = every.map_or(Requeue::OnChange, Requeue::After);
        Ok(Plan::nothing(requeue).child(Child::apply(&copy, live.as_deref())))
    }
}

fn operator() -> Operator<()> {
    Operator {
        name: "mirror",
        version: "0.1.0",
        about: "Copies ConfigMaps",
        registry: Registry::new(vec![
            common::entry("mirror", |m, _| {
                m.add(Mirror {
                    name: "mirror",
                    stamp: false,
                    every: None,
                });
            }),
            common::entry("stamped", |m, _| {
                m.add(Mirror {
                    name: "stamped",
                    stamp: true,
                    every: None,
                });
            }),
            common::entry("hourly", |m, _| {
                m.add(Mirror {
                    name: "hourly",
                    stamp: true,
                    every: Some(HOUR),
                });
            }),
        ]),
    }
}

const HOUR: std::time::Duration = std::time::Duration::from_secs(3600);

/// Makes one ConfigMap for the controllers of `h` to copy.
async fn settings(h: &Harness) -> anyhow::Result<Api<ConfigMap>> {
    let cms: Api<ConfigMap> = Api::namespaced(h.client(), "default");
    let mut cm = ConfigMap {
        data: Some(BTreeMap::from([("colour".into(), "blue".into())])),
        ..Default::default()
    };
    cm.metadata.name = Some("settings".into());
    cm.metadata.labels = Some(BTreeMap::from([("mirror".into(), "yes".into())]));
    cms.create(&PostParams::default(), &cm).await?;
    Ok(cms)
}

/// Runs `controller`, makes one ConfigMap to copy and returns the writes of the resync
/// after its copy was made.
async fn resync_of(controller: &str) -> anyhow::Result<opkit_runtime::testing::Writes> {
    let mut h = Harness::start(operator(), &[controller], ()).await?;
    let cms = settings(&h).await?;
    let writes = h.settle().await?;
    ensure!(
        writes.applied("ConfigMap").len() == 1 && writes.failures() == 0,
        "{writes}"
    );
    ensure!(cms.get("settings-copy").await?.data.unwrap_or_default()["colour"] == "blue");
    ensure!(h.settle().await?.is_empty(), "a step with nothing to do wrote");
    let resync = h.resync().await?;
    ensure!(resync.reconciles() >= 1, "the restart reconciled nothing");
    Ok(resync)
}

#[tokio::test]
async fn the_resync_of_a_converged_object_writes_nothing() -> anyhow::Result<()> {
    let resync = resync_of("mirror").await?;
    ensure!(resync.is_empty(), "{resync}");
    Ok(())
}

/// An object that does not decode as its kind (a server with a laxer schema, or a newer
/// version of the kind) is left out of the cache and counted in
/// `opkit_watch_objects_undecodable_total`, and the watch goes on to the next event.
#[tokio::test]
async fn an_object_that_does_not_decode_is_counted_and_the_watch_goes_on() -> anyhow::Result<()> {
    // Longer than the watch's backoff after the failed event (0.8 s, with jitter up to twice
    // that), so that a step ends after the events behind it.
    let mut h = Harness::start(operator(), &["mirror"], ())
        .await?
        .with_window(std::time::Duration::from_secs(3));
    let cms = settings(&h).await?;
    ensure!(h.settle().await?.applied("ConfigMap").len() == 1);
    let series = r#"opkit_watch_objects_undecodable_total{controller="mirror",kind="ConfigMap"}"#;
    ensure!(
        h.metrics().encode().contains(series) && h.metrics().sample(series) == 0.0,
        "the series is not there at 0 before the first: {}",
        h.metrics().encode()
    );
    // A ConfigMap's data is a map of strings: a number is no ConfigMap.
    let odd: DynamicObject = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "odd", "labels": {"mirror": "yes"}},
        "data": 3,
    }))?;
    let raw: Api<DynamicObject> =
        Api::namespaced_with(h.client(), "default", &ApiResource::erase::<ConfigMap>(&()));
    raw.create(&PostParams::default(), &odd).await?;
    let mut changed = cms.get("settings").await?;
    changed.data = Some(BTreeMap::from([("colour".into(), "red".into())]));
    cms.replace("settings", &PostParams::default(), &changed).await?;
    let writes = h.settle().await?;
    let applied = writes.applied("ConfigMap");
    ensure!(
        applied.len() == 1 && applied[0].name.as_deref() == Some("settings-copy"),
        "the change after the odd object was not copied: {writes}"
    );
    ensure!(cms.get("settings-copy").await?.data.unwrap_or_default()["colour"] == "red");
    ensure!(cms.get_opt("odd-copy").await?.is_none());
    ensure!(h.metrics().sample(series) >= 1.0, "{}", h.metrics().encode());
    Ok(())
}

#[tokio::test]
async fn a_plan_that_writes_on_every_reconcile_is_caught() -> anyhow::Result<()> {
    let resync = resync_of("stamped").await?;
    let applied = resync.applied("ConfigMap");
    ensure!(
        applied.len() == 1 && applied[0].name.as_deref() == Some("settings-copy"),
        "the stamped copy should be written again on the resync: {resync}"
    );
    Ok(())
}

/// A requeue an hour away (the usual safety net) brings the object back after the hour, and
/// only then; without one, nothing does. Time is the test's: it passes the hours at once.
#[tokio::test(start_paused = true)]
async fn a_requeue_an_hour_away_reconciles_after_the_hour_and_only_then() -> anyhow::Result<()> {
    for (controller, every) in [("hourly", Some(HOUR)), ("stamped", None)] {
        let mut h = Harness::start(operator(), &[controller], ()).await?;
        settings(&h).await?;
        let made = h.settle().await?;
        ensure!(made.applied("ConfigMap").len() == 1, "{controller}: {made}");
        let start = tokio::time::Instant::now();
        tokio::time::sleep(HOUR - std::time::Duration::from_secs(60)).await;
        let early = h.settle().await?;
        ensure!(
            early.is_empty(),
            "{controller}: reconciled before the hour was up: {early}"
        );
        tokio::time::sleep_until(start + HOUR + std::time::Duration::from_secs(2)).await;
        let after = h.settle().await?;
        let woken = after.applied("ConfigMap").len();
        ensure!(woken == usize::from(every.is_some()), "{controller}: {after}");
        ensure!(
            after.reconciles() == u64::from(every.is_some()),
            "{controller}: woken twice? {after}"
        );
        if every.is_some() {
            // And again an hour after that reconcile: each one sets the next.
            tokio::time::sleep(HOUR + std::time::Duration::from_secs(2)).await;
            let again = h.settle().await?;
            ensure!(
                again.applied("ConfigMap").len() == 1,
                "{controller}, second hour: {again}"
            );
        }
    }
    Ok(())
}

/// Each reconcile decides the next wake-up: one that asks for none after a change takes the
/// hour's wake-up of the reconcile before it away.
#[tokio::test(start_paused = true)]
async fn a_reconcile_that_asks_for_no_requeue_cancels_the_one_before_it() -> anyhow::Result<()> {
    use kube::api::{Patch, PatchParams};

    let mut h = Harness::start(operator(), &["hourly"], ()).await?;
    let cms = settings(&h).await?;
    ensure!(h.settle().await?.applied("ConfigMap").len() == 1);
    let start = tokio::time::Instant::now();
    tokio::time::sleep(HOUR / 2).await;
    let once = serde_json::json!({"metadata": {"labels": {"once": "yes"}}});
    cms.patch("settings", &PatchParams::default(), &Patch::Merge(&once))
        .await?;
    let changed = h.settle().await?;
    ensure!(changed.applied("ConfigMap").len() == 1, "{changed}");
    for at in [HOUR, HOUR / 2 + HOUR] {
        tokio::time::sleep_until(start + at + std::time::Duration::from_secs(2)).await;
        let later = h.settle().await?;
        ensure!(
            later.is_empty() && later.reconciles() == 0,
            "woken {at:?} after the start: {later}"
        );
    }
    Ok(())
}

/// The server in memory keeps field ownership as server-side apply does: what a create or an
/// update set is its writer's, an unforced apply that changes it conflicts, a forced one
/// takes it over.
#[tokio::test]
async fn fields_set_by_a_create_conflict_with_an_unforced_apply_until_forced() -> anyhow::Result<()> {
    use kube::api::{Patch, PatchParams};
    use opkit_runtime::testing::ApiServer;

    let server = ApiServer::new();
    let theirs: Api<ConfigMap> = Api::namespaced(server.client_as("someone"), "default");
    let ours: Api<ConfigMap> = Api::namespaced(server.client_as("operator"), "default");
    let mut cm = ConfigMap {
        data: Some(BTreeMap::from([("a".into(), "1".into())])),
        ..Default::default()
    };
    cm.metadata.name = Some("hand-made".into());
    theirs
        .create(
            &PostParams {
                field_manager: Some("someone".into()),
                ..Default::default()
            },
            &cm,
        )
        .await?;
    let body = |k: &str, v: &str| serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "hand-made"}, "data": {k: v}});
    let unforced = PatchParams::apply("op");
    match ours
        .patch("hand-made", &unforced, &Patch::Apply(body("a", "2")))
        .await
    {
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        other => anyhow::bail!("an unforced apply over someone's field: {other:?}"),
    }
    ours.patch("hand-made", &unforced, &Patch::Apply(body("b", "2")))
        .await?;
    let forced = ours
        .patch(
            "hand-made",
            &unforced.clone().force(),
            &Patch::Apply(body("a", "2")),
        )
        .await?;
    ensure!(forced.data.unwrap_or_default()["a"] == "2");
    let managed = forced.metadata.managed_fields.unwrap_or_default();
    let fields = |m: &str| {
        managed
            .iter()
            .find(|e| e.manager.as_deref() == Some(m))
            .and_then(|e| e.fields_v1.as_ref())
            .map(|f| f.0.to_string())
            .unwrap_or_default()
    };
    ensure!(
        !fields("someone").contains("f:a"),
        "someone still owns data.a: {managed:?}"
    );
    ensure!(
        fields("op").contains("f:a"),
        "the forced apply does not own data.a: {managed:?}"
    );
    Ok(())
}

/// As kube-apiserver does, the in-memory one refuses an apply that names the uid of an object
/// that is not there, instead of creating it.
#[tokio::test]
async fn an_apply_that_names_a_uid_creates_nothing() -> anyhow::Result<()> {
    let h = Harness::start(operator(), &["mirror"], ()).await?;
    let cms: Api<ConfigMap> = Api::namespaced(h.client(), "default");
    let body = serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
        "name": "gone", "uid": "0d6f0f1c-0000-4000-8000-000000000000", "finalizers": ["opkit.dev/x"],
    }});
    match cms
        .patch(
            "gone",
            &kube::api::PatchParams::apply("t").force(),
            &kube::api::Patch::Apply(&body),
        )
        .await
    {
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        other => anyhow::bail!("expected a conflict, got {other:?}"),
    }
    ensure!(cms.get_opt("gone").await?.is_none(), "the apply created it");
    Ok(())
}

/// A copy the controller created (a POST) loses a key the source no longer has, as one it
/// applied would: the in-memory API server takes the managed fields a write sets, as
/// kube-apiserver does, so opkit can hand the created fields over to its apply.
#[tokio::test]
async fn a_key_the_source_drops_leaves_a_copy_created_by_a_post() -> anyhow::Result<()> {
    let mut h = Harness::start(operator(), &["mirror"], ()).await?;
    let cms: Api<ConfigMap> = Api::namespaced(h.client(), "default");
    let source = serde_json::json!({"metadata": {"name": "settings", "labels": {"mirror": "yes"}},
                                    "data": {"colour": "blue", "size": "2"}});
    cms.create(&PostParams::default(), &serde_json::from_value(source)?)
        .await?;
    let patch = |p: serde_json::Value| {
        let cms = cms.clone();
        async move {
            cms.patch(
                "settings",
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(p),
            )
            .await
        }
    };
    h.settle().await?;
    let copy = cms.get("settings-copy").await?;
    ensure!(
        copy.data.as_ref().is_some_and(|d| d.len() == 2),
        "{:?}",
        copy.data
    );
    let created = |c: &ConfigMap| c.annotations().contains_key(opkit_runtime::diff::CREATED_SHAPE);
    ensure!(created(&copy), "not created by a POST: {:?}", copy.metadata);

    // With another change: a key dropped alone is noticed at the next change (`diff::is_subset`).
    patch(serde_json::json!({"data": {"size": null, "colour": "red"}})).await?;
    h.settle().await?;
    let copy = cms.get("settings-copy").await?;
    let data = copy.data.clone().unwrap_or_default();
    ensure!(
        data == BTreeMap::from([("colour".to_string(), "red".to_string())]),
        "{data:?}"
    );
    ensure!(!created(&copy), "{:?}", copy.metadata);
    Ok(())
}
