//! The in-memory harness catches what a unit test of a plan does not: a plan that writes on
//! every reconcile. Two controllers keep a copy of every ConfigMap labelled `mirror`; one
//! stamps the time of the copy into it, so that its output is never the same twice.
mod common;

use std::collections::BTreeMap;

use anyhow::ensure;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use kube::{Client, Resource, ResourceExt};
use opkit_runtime::testing::Harness;
use opkit_runtime::{Cache, Child, Invalid, Operator, Plan, Reconciler, Registry, Requeue, Watch, Watches};

struct Mirror {
    name: &'static str,
    /// The defect: the copy records when it was made.
    stamp: bool,
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
        Ok(Plan::nothing(Requeue::OnChange).child(Child::apply(&copy, live.as_deref())))
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
                });
            }),
            common::entry("stamped", |m, _| {
                m.add(Mirror {
                    name: "stamped",
                    stamp: true,
                });
            }),
        ]),
    }
}

/// Runs `controller`, makes one ConfigMap to copy and returns the writes of the resync
/// after its copy was made.
async fn resync_of(controller: &str) -> anyhow::Result<opkit_runtime::testing::Writes> {
    let mut h = Harness::start(operator(), &[controller], ()).await?;
    let cms: Api<ConfigMap> = Api::namespaced(h.client(), "default");
    let mut cm = ConfigMap {
        data: Some(BTreeMap::from([("colour".into(), "blue".into())])),
        ..Default::default()
    };
    cm.metadata.name = Some("settings".into());
    cm.metadata.labels = Some(BTreeMap::from([("mirror".into(), "yes".into())]));
    cms.create(&PostParams::default(), &cm).await?;
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
