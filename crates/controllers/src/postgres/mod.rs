//! The PostgresDatabase controller: a database and its login role on a PostgreSQL server
//! outside the cluster, and a Secret with what an application needs to connect.
//!
//! observe (the owned Secret, the server's Secret and what the last poll of the server saw)
//! → plan (pure): the Secret, with the password it keeps or a new one, then the acts that make
//! or repair the role and the database, checked against the catalog (a role dropped, its
//! password or login changed, the database's owner or the owner's privileges changed by
//! hand are put back within a poll). The Secret is written before the role gets its
//! password, so it always holds the newest password asked for. On delete, `Retain` keeps
//! both; `Delete` drops what this object made, never anything else of the same name.
//!
//! Passwords appear only in the Secret: never in logs, Events, status, metrics or the
//! server's statement log (the role's password is sent as a SCRAM verifier).
mod password;
pub mod server;
mod tls;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::rbac::v1::PolicyRule;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Client, Resource, ResourceExt};
use opkit::conditions::{self, Desired};
use opkit::rbac::{events, rule};
use opkit::{
    Act, Cache, Child, Cleanup, Event, Invalid, OutsideCache, Plan, Reconciler, Requeue, Retry, Watch,
    Watches,
};
use opkit_api::MANAGED_BY;
use opkit_api::postgres::{PostgresDatabase, PostgresDatabaseStatus, ReclaimPolicy, SERVER_LABEL};

pub use password::matches as password_matches;
use server::{Change, Found, Key, Servers};

/// The controller's name (`--controllers postgres`) and metrics label.
pub const NAME: &str = "postgres";
/// How often every server is read when `--postgres-poll-interval` is not given: drift made
/// by hand is put right within this.
pub const DEFAULT_POLL: Duration = Duration::from_secs(30);
/// Annotation on the Secret: the `passwordRevision` its password belongs to.
pub const REVISION_ANNOTATION: &str = "db.opkit.dev/password-revision";
/// Label on the Secret naming its `PostgresDatabase`.
pub const DATABASE_LABEL: &str = "db.opkit.dev/database";

const READY: &str = "Ready";
/// Reasons a person reads in `kubectl describe`.
pub mod reason {
    pub const READY: &str = "DatabaseReady";
    pub const INVALID_SPEC: &str = "InvalidSpec";
    pub const NOT_OURS: &str = "NotOwned";
    pub const SERVER_SECRET_MISSING: &str = "ServerSecretMissing";
    pub const KEPT: &str = "Retained";
    pub const PASSWORD_ROTATED: &str = "PasswordRotated";
}
pub(crate) use reason::SERVER_SECRET_MISSING;

/// Indexes of the primary cache: objects by server, and by the things they name.
const BY_SERVER: &str = "server";
const BY_THING: &str = "thing";

/// The API access this controller uses, for the generated ClusterRole.
pub fn rbac_rules() -> Vec<PolicyRule> {
    vec![
        // `patch` adds and removes the finalizer.
        rule(
            &["db.opkit.dev"],
            &["postgresdatabases"],
            &["list", "watch", "patch"],
        ),
        rule(&["db.opkit.dev"], &["postgresdatabases/status"], &["patch"]),
        // The servers' Secrets (a label selects them) and the Secrets written for
        // applications. `create`: an apply that makes one is authorized as a create too;
        // `get`: a Secret of that name not in the cache (someone else's?).
        rule(
            &[""],
            &["secrets"],
            &["get", "list", "watch", "create", "patch", "delete"],
        ),
        events(),
    ]
}

/// The PostgresDatabase reconciler.
#[derive(Clone, Debug)]
pub struct PostgresController {
    /// How often every server is read.
    pub poll: Duration,
}

impl Default for PostgresController {
    fn default() -> Self {
        PostgresController { poll: DEFAULT_POLL }
    }
}

/// The caches a plan reads.
pub struct Caches {
    secrets: Cache<Secret>,
    servers: Cache<Secret>,
    things: OutsideCache<Servers>,
}

/// What the plan reads.
#[derive(Clone, Default)]
pub struct World {
    /// The server's Secret (`None`: missing or not labelled).
    pub server: Option<Arc<Secret>>,
    /// The database and the role as the server last showed them (`None`: absent).
    pub database: Option<server::Database>,
    pub role: Option<server::Role>,
    /// The Secret written for applications.
    pub secret: Option<Arc<Secret>>,
    /// A new password, used if the Secret has none for the current revision.
    pub new_password: String,
}

/// Names what is there, never a password or the server's credentials.
impl std::fmt::Debug for World {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("World")
            .field("server", &self.server.as_ref().map(|s| s.name_any()))
            .field("database", &self.database)
            .field("role", &self.role)
            .field("secret", &self.secret.as_ref().map(|s| s.name_any()))
            .finish_non_exhaustive()
    }
}

/// `<namespace>/<serverSecret>`.
pub fn server_of(p: &PostgresDatabase) -> String {
    format!("{}/{}", p.namespace().unwrap_or_default(), p.spec.server_secret)
}

/// The database's name on the server.
pub fn database_name(p: &PostgresDatabase) -> String {
    p.spec.database_name.clone().unwrap_or_else(|| p.name_any())
}

/// The role's name.
pub fn role_name(p: &PostgresDatabase) -> String {
    p.spec.role_name.clone().unwrap_or_else(|| database_name(p))
}

/// The Secret written for applications.
pub fn secret_name(p: &PostgresDatabase) -> String {
    p.spec
        .secret_name
        .clone()
        .unwrap_or_else(|| format!("{}-postgres", p.name_any()))
}

/// The comment on the database and the role that says this object made them: only what
/// carries it is repaired or dropped.
pub fn marker(p: &PostgresDatabase) -> String {
    format!(
        "made by opkit for PostgresDatabase {}/{} (uid {})",
        p.namespace().unwrap_or_default(),
        p.name_any(),
        p.uid().unwrap_or_default()
    )
}

fn thing_index(server: &str, kind: &str, name: &str) -> String {
    format!("{server}|{kind}|{name}")
}

/// A name the server would refuse or cut short (a default taken from `metadata.name`; the
/// fields themselves are checked by the CRD).
fn check_name(field: &str, name: &str) -> Result<(), Invalid> {
    if field.ends_with("roleName") && name.starts_with("pg_") {
        return Err(Invalid::new(
            READY,
            false,
            reason::INVALID_SPEC,
            format!(
                "{field}: {name:?} starts with pg_, which PostgreSQL keeps for its own roles; set {field}"
            ),
        ));
    }
    if name.is_empty() || name.len() > 63 || name.contains('\0') {
        return Err(Invalid::new(
            READY,
            false,
            reason::INVALID_SPEC,
            format!("{field}: {name:?} cannot be a PostgreSQL name (1 to 63 bytes); set {field}"),
        ));
    }
    Ok(())
}

/// A password of 32 letters and digits from the system's random source.
fn new_password() -> String {
    use ring::rand::SecureRandom;
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let rng = ring::rand::SystemRandom::new();
    let mut out = String::with_capacity(32);
    while out.len() < 32 {
        let mut bytes = [0u8; 64];
        if rng.fill(&mut bytes).is_err() {
            continue;
        }
        // Only bytes below 248 (4 × 62): every character equally likely.
        for b in bytes.into_iter().filter(|b| *b < 248) {
            if out.len() < 32 {
                out.push(ALPHABET[usize::from(b) % ALPHABET.len()] as char);
            }
        }
    }
    out
}

fn text(secret: &Secret, key: &str) -> Option<String> {
    secret
        .data
        .as_ref()?
        .get(key)
        .and_then(|v| String::from_utf8(v.0.clone()).ok())
}

/// The Secret applications read: `host`, `port`, `database`, `username`, `password`, `uri`,
/// and the server's `sslmode` and `ca.crt` when its Secret has them.
pub fn build_secret(
    p: &PostgresDatabase,
    server: &server::Address,
    password: &str,
    revision: i64,
) -> Result<Secret, String> {
    let (host, port) = (server.host.as_str(), server.port);
    let owner = p
        .controller_owner_ref(&())
        .ok_or_else(|| format!("PostgresDatabase {} has no uid yet", p.name_any()))?;
    let (database, role) = (database_name(p), role_name(p));
    // An IPv6 address is bracketed in a URI.
    let at = if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_string()
    };
    let options = match &server.sslmode {
        Some(mode) => format!("?sslmode={}", percent(mode)),
        None => String::new(),
    };
    let uri = format!(
        "postgresql://{}:{}@{at}:{port}/{}{options}",
        percent(&role),
        percent(password),
        percent(&database)
    );
    let mut data: BTreeMap<String, ByteString> = [
        ("host", host.to_string()),
        ("port", port.to_string()),
        ("database", database),
        ("username", role),
        ("password", password.to_string()),
        ("uri", uri),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), ByteString(v.into_bytes())))
    .collect();
    if let Some(mode) = &server.sslmode {
        data.insert("sslmode".into(), ByteString(mode.clone().into_bytes()));
    }
    if let Some(ca) = &server.ca {
        data.insert("ca.crt".into(), ByteString(ca.clone()));
    }
    Ok(Secret {
        metadata: ObjectMeta {
            name: Some(secret_name(p)),
            namespace: p.namespace(),
            labels: Some(BTreeMap::from([
                ("app.kubernetes.io/managed-by".into(), MANAGED_BY.into()),
                (DATABASE_LABEL.into(), p.name_any()),
            ])),
            annotations: Some(BTreeMap::from([(
                REVISION_ANNOTATION.into(),
                revision.to_string(),
            )])),
            owner_references: Some(vec![owner]),
            ..Default::default()
        },
        type_: Some("Opaque".into()),
        data: Some(data),
        ..Default::default()
    })
}

/// Escapes what a URI's user or path cannot hold as is.
fn percent(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The password the Secret holds for `revision`, if it holds one.
fn kept_password(secret: Option<&Secret>, revision: i64) -> Option<String> {
    let s = secret?;
    let annotated = s.annotations().get(REVISION_ANNOTATION)?;
    (annotated == &revision.to_string())
        .then(|| text(s, "password"))
        .flatten()
        .filter(|p| !p.is_empty())
}

fn ours(comment: Option<&String>, marker: &str) -> bool {
    comment.is_some_and(|c| c == marker)
}

/// Whether this object made the role.
fn role_ours(world: &World, marker: &str) -> bool {
    world
        .role
        .as_ref()
        .is_some_and(|r| ours(r.comment.as_ref(), marker))
}

/// Whether this object made the database: it carries the marker, or has no comment yet and
/// belongs to the role this object made (`CREATE DATABASE` and its comment cannot be one
/// transaction, so a lost reply may leave it without one).
fn database_ours(world: &World, marker: &str, role: &str) -> bool {
    world.database.as_ref().is_some_and(|d| {
        ours(d.comment.as_ref(), marker)
            || (d.comment.is_none() && d.owner == role && role_ours(world, marker))
    })
}

/// Whether this object controls the Secret.
fn secret_ours(s: &Secret, p: &PostgresDatabase) -> bool {
    s.owner_references()
        .iter()
        .any(|o| o.controller == Some(true) && Some(&o.uid) == p.uid().as_ref())
}

fn not_ours(what: &str, name: &str, server: &str) -> Invalid {
    Invalid::new(
        READY,
        false,
        reason::NOT_OURS,
        format!(
            "{what} {name:?} already exists on {server} and was not made by this PostgresDatabase: \
             nothing is changed on it; choose another name, or drop it on the server"
        ),
    )
}

impl Reconciler for PostgresController {
    type Object = PostgresDatabase;
    type Caches = Caches;
    type World = World;
    type Status = PostgresDatabaseStatus;

    fn name(&self) -> &'static str {
        NAME
    }

    fn cleans_up(&self) -> bool {
        true
    }

    fn watch(&self, w: &mut Watches<PostgresDatabase>) -> Caches {
        w.index_primary(BY_SERVER, |p: &PostgresDatabase| Some(server_of(p)));
        w.index_primary(BY_THING, |p: &PostgresDatabase| {
            let server = server_of(p);
            [
                thing_index(&server, "database", &database_name(p)),
                thing_index(&server, "role", &role_name(p)),
            ]
        });
        let primary = w.primary();
        let servers = w.watches(
            Watch::labels(&format!("{SERVER_LABEL}=true")),
            move |s: Secret| primary.indexed_refs(BY_SERVER, &server::server_key(&s)),
        );
        let secrets = w.owns(Watch::labels(DATABASE_LABEL).prune());
        let primary = w.primary();
        let used = move |server: &str| !primary.indexed_refs(BY_SERVER, server).is_empty();
        let primary = w.primary();
        let things = w.outside(
            Servers::new(servers.clone(), used),
            self.poll,
            move |key: &Key| {
                let refs: Vec<ObjectRef<PostgresDatabase>> = match &key.thing {
                    server::Thing::Server => primary.indexed_refs(BY_SERVER, &key.server),
                    server::Thing::Database(d) => {
                        primary.indexed_refs(BY_THING, &thing_index(&key.server, "database", d))
                    }
                    server::Thing::Role(r) => {
                        primary.indexed_refs(BY_THING, &thing_index(&key.server, "role", r))
                    }
                };
                refs
            },
        );
        Caches {
            secrets,
            servers,
            things,
        }
    }

    async fn observe(&self, p: &PostgresDatabase, c: &Caches, client: &Client) -> kube::Result<World> {
        if p.metadata.deletion_timestamp.is_some()
            && p.spec.reclaim_policy.unwrap_or_default() == ReclaimPolicy::Retain
        {
            // Nothing on the server is needed to keep it: a server that is down does not
            // hold the deletion.
            return Ok(World::default());
        }
        let ns = p.namespace().unwrap_or_default();
        let secret = match c.secrets.get(&ns, &secret_name(p)) {
            Some(s) => Some(s),
            // Not ours (or not written yet): someone else's Secret of that name carries none
            // of our labels, so only a read tells it apart from a missing one.
            None => Api::<Secret>::namespaced(client.clone(), &ns)
                .get_opt(&secret_name(p))
                .await?
                .map(Arc::new),
        };
        let new_password = new_password();
        let Some(server) = c.servers.get(&ns, &p.spec.server_secret) else {
            return Ok(World {
                secret,
                new_password,
                ..Default::default()
            });
        };
        let at = server_of(p);
        match c.things.get(&Key::server(&at))? {
            Some(Found::Reachable) => {}
            Some(Found::Unreachable(why)) => {
                return Err(Retry::new(server::RETRY, READY, false, server::UNAVAILABLE, why).into());
            }
            // A server Secret the last poll did not know yet: read it now rather than at the
            // next interval; the read reconciles this object when it finds the server.
            _ => {
                c.things.read_soon();
                return Err(Retry::new(
                    self.poll.min(server::RETRY),
                    READY,
                    false,
                    "ServerNotReadYet",
                    format!("server {at} has not been read yet"),
                )
                .into());
            }
        }
        let database = match c.things.get(&Key::database(&at, &database_name(p)))? {
            Some(Found::Database(d)) => Some(d),
            _ => None,
        };
        let role = match c.things.get(&Key::role(&at, &role_name(p)))? {
            Some(Found::Role(r)) => Some(r),
            _ => None,
        };
        Ok(World {
            server: Some(server),
            database,
            role,
            secret,
            new_password,
        })
    }

    fn plan(
        &self,
        p: &PostgresDatabase,
        world: &World,
        now: Timestamp,
    ) -> Result<Plan<PostgresDatabaseStatus>, Invalid> {
        let (database, role) = (database_name(p), role_name(p));
        check_name("spec.databaseName", &database)?;
        check_name("spec.roleName", &role)?;
        let at = server_of(p);
        let Some(server) = &world.server else {
            return Err(Retry::new(
                server::RETRY,
                READY,
                false,
                reason::SERVER_SECRET_MISSING,
                format!(
                    "no Secret {} labelled {SERVER_LABEL}=true in namespace {}",
                    p.spec.server_secret,
                    p.namespace().unwrap_or_default()
                ),
            )
            .into());
        };
        let address =
            server::address(server).map_err(|m| Invalid::new(READY, false, reason::INVALID_SPEC, m))?;
        let marker = marker(p);
        if world.role.is_some() && !role_ours(world, &marker) {
            return Err(not_ours("role", &role, &at));
        }
        if world.database.is_some() && !database_ours(world, &marker, &role) {
            return Err(not_ours("database", &database, &at));
        }
        if let Some(s) = &world.secret
            && !secret_ours(s, p)
        {
            return Err(Invalid::new(
                READY,
                false,
                reason::NOT_OURS,
                format!(
                    "Secret {} exists and is not this PostgresDatabase's: nothing is written to it; set spec.secretName",
                    secret_name(p)
                ),
            ));
        }

        let revision = p.spec.password_revision.unwrap_or(0);
        let kept = kept_password(world.secret.as_deref(), revision);
        let rotated = kept.is_none()
            && world
                .secret
                .as_ref()
                .is_some_and(|s| s.annotations().contains_key(REVISION_ANNOTATION));
        let password = kept.unwrap_or_else(|| world.new_password.clone());
        let secret = build_secret(p, &address, &password, revision)
            .map_err(|m| Invalid::new(READY, false, reason::INVALID_SPEC, m))?;

        let role_key = Key::role(&at, &role);
        let role_ok = world
            .role
            .as_ref()
            .is_some_and(|r| r.login && password::matches(r.verifier.as_deref(), &password, &role));
        let role_act = match &world.role {
            None => Some(Change::CreateRole {
                password: password.clone(),
                marker: marker.clone(),
            }),
            Some(_) if !role_ok => Some(Change::RepairRole {
                password: password.clone(),
                marker: marker.clone(),
            }),
            Some(_) => None,
        };
        let database_act = match &world.database {
            None => Some(Change::CreateDatabase {
                owner: role.clone(),
                marker: marker.clone(),
            }),
            Some(d) if d.owner != role || !d.owner_privileges => Some(Change::RepairDatabase {
                owner: role.clone(),
                marker: marker.clone(),
            }),
            Some(_) => None,
        };

        let live = p.status.clone().unwrap_or_default();
        let ready = Desired::yes(
            READY,
            reason::READY,
            format!(
                "database {database:?} owned by role {role:?} on {}:{}; Secret {}",
                address.host,
                address.port,
                secret_name(p)
            ),
        );
        let status = PostgresDatabaseStatus {
            database: Some(database.clone()),
            role: Some(role.clone()),
            secret_name: Some(secret_name(p)),
            password_revision: Some(revision),
            observed_generation: p.metadata.generation,
            conditions: conditions::merge(&live.conditions, &[ready], p.metadata.generation, &Time(now)),
        };
        // Created when absent, so that a Secret someone makes meanwhile is not taken over;
        // written again before each act on the role, so it holds the password the act sets
        // even when the cache is behind.
        let child = match world.secret.as_deref() {
            None => Child::create(&secret, None),
            Some(live) => Child::apply(&secret, Some(live)),
        };
        let child = if role_act.is_some() {
            child.needed(true)
        } else {
            child
        };
        let mut plan = Plan::status(status, Requeue::After(Duration::from_secs(3600))).child(child);
        if rotated {
            plan = plan.event(Event::normal(
                reason::PASSWORD_ROTATED,
                "RotatePassword",
                format!(
                    "a new password for revision {revision} is in Secret {}",
                    secret_name(p)
                ),
            ));
        }
        if let Some(change) = role_act {
            plan = plan.act(Act::new::<Servers>(role_key, change));
        }
        if let Some(change) = database_act {
            plan = plan.act(Act::new::<Servers>(Key::database(&at, &database), change));
        }
        Ok(plan)
    }

    fn cleanup(&self, p: &PostgresDatabase, world: &World, _: Timestamp) -> Cleanup<PostgresDatabaseStatus> {
        let (database, role) = (database_name(p), role_name(p));
        let at = server_of(p);
        if p.spec.reclaim_policy.unwrap_or_default() == ReclaimPolicy::Retain {
            return Cleanup::done().event(Event::normal(
                reason::KEPT,
                "Retain",
                format!("database {database:?} and role {role:?} are kept on {at} (reclaimPolicy Retain)"),
            ));
        }
        if world.server.is_none() {
            // Deleted with its namespace, or before this object: waiting would hold the
            // deletion forever, so what is on the server stays, and says so.
            return Cleanup::done().event(Event::warning(
                reason::SERVER_SECRET_MISSING,
                "Delete",
                format!(
                    "database {database:?} and role {role:?} are left on {at}: its Secret is gone, so the server cannot be reached"
                ),
            ));
        }
        let marker = marker(p);
        let mut cleanup = Cleanup::done();
        if database_ours(world, &marker, &role) {
            let drop = Change::DropDatabase {
                owner: role.clone(),
                marker: marker.clone(),
            };
            cleanup = cleanup.act(Act::new::<Servers>(Key::database(&at, &database), drop));
        }
        if role_ours(world, &marker) {
            let drop = Change::DropRole { marker };
            cleanup = cleanup.act(Act::new::<Servers>(Key::role(&at, &role), drop));
        }
        cleanup
    }
}

#[cfg(test)]
mod tests;
