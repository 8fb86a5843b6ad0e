//! Storage-version migration: after a CRD's storage version changes, objects written before
//! stay in etcd in the old version until something rewrites them, and the old version cannot
//! be dropped from the CRD while `status.storedVersions` lists it. This rewrites every object
//! (an update without changes, which the apiserver stores in the current storage version, as
//! kube-storage-version-migrator does) and then trims `storedVersions` to that version alone.
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};

/// What one migration did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Migrated {
    /// The CRD's name.
    pub crd: String,
    /// Its storage version, which every object is now stored in.
    pub storage: String,
    /// Objects rewritten.
    pub rewritten: usize,
    /// Objects changed or deleted by someone else meanwhile (so already stored anew).
    pub skipped: usize,
    /// `status.storedVersions` before.
    pub stored_before: Vec<String>,
}

impl std::fmt::Display for Migrated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: {} objects rewritten in {} ({} changed by others meanwhile); storedVersions {:?} -> [{:?}]",
            self.crd, self.rewritten, self.storage, self.skipped, self.stored_before, self.storage
        )
    }
}

/// Rewrites every object of the CRD `name` in its storage version, then sets its
/// `status.storedVersions` to that version. Objects of versions served through a conversion
/// webhook need the webhook running. Safe to run again, and while the operator runs.
pub async fn migrate_storage(client: &Client, name: &str) -> anyhow::Result<Migrated> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crd = crds.get(name).await?;
    let storage = crd
        .spec
        .versions
        .iter()
        .find(|v| v.storage)
        .map(|v| v.name.clone())
        .ok_or_else(|| anyhow::anyhow!("{name} has no storage version"))?;
    let stored_before = crd
        .status
        .as_ref()
        .and_then(|s| s.stored_versions.clone())
        .unwrap_or_default();
    let group = &crd.spec.group;
    let resource = ApiResource {
        group: group.clone(),
        version: storage.clone(),
        api_version: format!("{group}/{storage}"),
        kind: crd.spec.names.kind.clone(),
        plural: crd.spec.names.plural.clone(),
    };
    let all: Api<DynamicObject> = Api::all_with(client.clone(), &resource);
    let namespaced = crd.spec.scope == "Namespaced";
    let (mut rewritten, mut skipped) = (0, 0);
    let mut lp = ListParams::default().limit(500);
    loop {
        let page = all.list(&lp).await?;
        for obj in &page.items {
            let api: Api<DynamicObject> = match (namespaced, obj.namespace()) {
                (true, Some(ns)) => Api::namespaced_with(client.clone(), &ns, &resource),
                _ => Api::all_with(client.clone(), &resource),
            };
            // The resourceVersion read makes this a no-op unless nobody wrote it since; any
            // write since stored it in the current version already.
            match api.replace(&obj.name_any(), &PostParams::default(), obj).await {
                Ok(_) => rewritten += 1,
                Err(kube::Error::Api(e)) if e.code == 409 || e.code == 404 => skipped += 1,
                Err(e) => {
                    return Err(anyhow::anyhow!(
                        "rewriting {} {}: {e}",
                        resource.kind,
                        obj.name_any()
                    ));
                }
            }
        }
        match page.metadata.continue_ {
            Some(c) if !c.is_empty() => lp = lp.continue_token(&c),
            _ => break,
        }
    }
    let patch = serde_json::json!({"status": {"storedVersions": [storage]}});
    crds.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(Migrated {
        crd: name.to_string(),
        storage,
        rewritten,
        skipped,
        stored_before,
    })
}
