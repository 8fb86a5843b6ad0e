//! Storage-version migration: after a CRD's storage version changes, objects written before
//! stay in etcd in the old version until something rewrites them, and the old version cannot
//! be dropped from the CRD while `status.storedVersions` lists it. This rewrites every object
//! (an update without changes, which the apiserver stores in the current storage version, as
//! kube-storage-version-migrator does) and then trims `storedVersions` to that version alone.
use std::collections::HashSet;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};

/// The apiserver's hash of a storage version, as discovery reports it (`storageVersionHash`):
/// base64 of the first 8 bytes of SHA-256 of `group/version/kind`.
fn storage_version_hash(group: &str, version: &str, kind: &str) -> String {
    let digest = ring::digest::digest(
        &ring::digest::SHA256,
        format!("{group}/{version}/{kind}").as_bytes(),
    );
    base64(&digest.as_ref()[..8])
}

pub(crate) fn base64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(A[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Waits until the apiserver stores the CRD's objects in `storage` (it switches shortly after
/// the CRD changes, and discovery says when): a rewrite before that would store the old
/// version again. Three answers in a row, a second apart, for apiservers behind one address.
async fn wait_for_storage(
    client: &Client,
    crd: &CustomResourceDefinition,
    storage: &str,
) -> Result<(), MigrateError> {
    let (group, kind, plural) = (&crd.spec.group, &crd.spec.names.kind, &crd.spec.names.plural);
    let want = storage_version_hash(group, storage, kind);
    let give_up = tokio::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut in_a_row = 0;
    while in_a_row < 3 {
        let list = client
            .list_api_group_resources(&format!("{group}/{storage}"))
            .await?;
        let seen = list
            .resources
            .iter()
            .find(|r| &r.name == plural)
            .and_then(|r| r.storage_version_hash.clone())
            .unwrap_or_default();
        in_a_row = if seen == want { in_a_row + 1 } else { 0 };
        if tokio::time::Instant::now() > give_up {
            return Err(MigrateError::Refused(format!(
                "the apiserver does not store {plural}.{group} as {storage} yet (storage hash {seen:?}, want {want:?})"
            )));
        }
        if in_a_row < 3 {
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        }
    }
    Ok(())
}

/// Why a migration stopped; running it again is safe.
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    /// A request failed.
    #[error(transparent)]
    Kube(#[from] kube::Error),
    /// The CRD or the apiserver is not in a state to migrate; the message says why.
    #[error("{0}")]
    Refused(String),
    /// Every other object was rewritten, these were not (a webhook or policy refused the
    /// update, ...), so `status.storedVersions` was left as it was.
    #[error("{}", failed_message(.crd, .rewritten, .failures))]
    Failed {
        /// The CRD's name.
        crd: String,
        /// Objects rewritten.
        rewritten: usize,
        /// `namespace/name: why` of every object that could not be rewritten.
        failures: Vec<String>,
    },
}

/// Objects listed by name in [`MigrateError::Failed`]'s message; the rest are counted.
const LISTED: usize = 20;

fn failed_message(crd: &str, rewritten: &usize, failures: &[String]) -> String {
    let mut m = format!(
        "{crd}: {} objects could not be rewritten ({rewritten} were); storedVersions is left as it was: fix them and run again",
        failures.len()
    );
    for f in failures.iter().take(LISTED) {
        m += &format!("\n  {f}");
    }
    if failures.len() > LISTED {
        m += &format!("\n  ... and {} more", failures.len() - LISTED);
    }
    m
}

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
pub async fn migrate_storage(client: &Client, name: &str) -> Result<Migrated, MigrateError> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crd = crds.get(name).await?;
    let storage = crd
        .spec
        .versions
        .iter()
        .find(|v| v.storage)
        .map(|v| v.name.clone())
        .ok_or_else(|| MigrateError::Refused(format!("{name} has no storage version")))?;
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
    wait_for_storage(client, &crd, &storage).await?;
    let all: Api<DynamicObject> = Api::all_with(client.clone(), &resource);
    let namespaced = crd.spec.scope == "Namespaced";
    let (mut rewritten, mut skipped) = (0, 0);
    let mut failures = Vec::new();
    let mut done: HashSet<String> = HashSet::new();
    let mut lp = ListParams::default().limit(500);
    loop {
        let page = match all.list(&lp).await {
            Ok(p) => p,
            // The list outlived etcd's compaction: list again, skipping what is done.
            Err(kube::Error::Api(e)) if e.code == 410 && lp.continue_token.is_some() => {
                lp = ListParams::default().limit(500);
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        for obj in &page.items {
            let uid = obj.uid().unwrap_or_default();
            if !done.insert(uid) {
                continue;
            }
            let api: Api<DynamicObject> = match (namespaced, obj.namespace()) {
                (true, Some(ns)) => Api::namespaced_with(client.clone(), &ns, &resource),
                _ => Api::all_with(client.clone(), &resource),
            };
            // The resourceVersion read makes this a no-op unless nobody wrote it since; any
            // write since stored it in the current version already.
            match api.replace(&obj.name_any(), &PostParams::default(), obj).await {
                Ok(_) => rewritten += 1,
                Err(kube::Error::Api(e)) if e.code == 409 || e.code == 404 => skipped += 1,
                // Refused (a webhook, a policy): go on, one object must not leave the others
                // unmigrated. Anything else (the apiserver gone, a timeout) stops here.
                Err(kube::Error::Api(e)) => failures.push(format!(
                    "{}{}: {e}",
                    obj.namespace().map(|ns| format!("{ns}/")).unwrap_or_default(),
                    obj.name_any()
                )),
                Err(e) => return Err(e.into()),
            }
        }
        match page.metadata.continue_ {
            Some(c) if !c.is_empty() => lp = lp.continue_token(&c),
            _ => break,
        }
    }
    if !failures.is_empty() {
        return Err(MigrateError::Failed {
            crd: name.to_string(),
            rewritten,
            failures,
        });
    }
    // Only if the CRD is as it was: a storage version changed meanwhile may have written
    // objects in a version that this would drop from the list.
    let now = crds.get(name).await?;
    if now.metadata.generation != crd.metadata.generation {
        return Err(MigrateError::Refused(format!(
            "{name} changed while migrating (generation {:?}, was {:?}); run again",
            now.metadata.generation, crd.metadata.generation
        )));
    }
    let patch = serde_json::json!({
        "metadata": {"resourceVersion": now.metadata.resource_version},
        "status": {"storedVersions": [storage]},
    });
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storage_version_hashes_are_the_apiservers() {
        // What kube-apiserver's discovery reports for Deployments (apps/v1).
        assert_eq!(storage_version_hash("apps", "v1", "Deployment"), "8aSe+NMegvE=");
        assert_eq!(base64(b"Man"), "TWFu");
        assert_eq!(base64(b"Ma"), "TWE=");
    }

    #[test]
    fn a_failed_migration_names_its_objects_and_counts_those_past_the_list() {
        let failures: Vec<String> = (0..25).map(|i| format!("ns/o-{i}: denied")).collect();
        let m = MigrateError::Failed {
            crd: "crontabs.stable.example.com".into(),
            rewritten: 7,
            failures,
        }
        .to_string();
        assert!(
            m.starts_with("crontabs.stable.example.com: 25 objects could not be rewritten (7 were)"),
            "{m}"
        );
        assert!(m.contains("ns/o-19: denied") && !m.contains("ns/o-20"), "{m}");
        assert!(m.ends_with("... and 5 more"), "{m}");
    }
}
