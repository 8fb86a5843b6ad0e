//! The PostgreSQL servers `PostgresDatabase`s name, as an outside source: every server whose
//! Secret is cached is read in full (its databases and roles, two catalog queries) on each
//! poll, and changed only through the [`Change`]s a plan asks for. This is the only code of
//! the controller that talks to a server.
use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use opkit::{Cache, Outside, Retry};
use tokio_postgres::Client;

use super::tls::{MakeRustls, Mode};

/// How long connecting to a server, or one statement, may take.
const TIMEOUT: Duration = Duration::from_secs(5);
/// How long reading one server in full may take: the servers are read at once, so a poll
/// takes this long at most, well within opkit's limit for a full read.
const SERVER_TIMEOUT: Duration = Duration::from_secs(15);
/// How many servers are read at once.
const AT_ONCE: usize = 16;
/// When to try again after a server failed to answer.
pub const RETRY: Duration = Duration::from_secs(10);
/// The condition type every failure is reported under.
const READY: &str = "Ready";
/// Reason of a server that cannot be reached or refused a login.
pub const UNAVAILABLE: &str = "ServerUnavailable";
/// Reason of a statement the server refused.
pub const REFUSED: &str = "ServerRefused";
/// Reason of a thing of that name the controller did not make.
pub const NOT_OURS: &str = "NotOwned";

/// One thing on one server. `server` is `<namespace>/<Secret name>`.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Key {
    pub server: String,
    pub thing: Thing,
}

/// What on a server a key names.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Thing {
    /// The server itself: whether it answered the last read.
    Server,
    Database(String),
    Role(String),
}

impl Key {
    pub fn server(server: &str) -> Self {
        Key {
            server: server.into(),
            thing: Thing::Server,
        }
    }
    pub fn database(server: &str, name: &str) -> Self {
        Key {
            server: server.into(),
            thing: Thing::Database(name.into()),
        }
    }
    pub fn role(server: &str, name: &str) -> Self {
        Key {
            server: server.into(),
            thing: Thing::Role(name.into()),
        }
    }
}

/// How logs, Events and conditions name a thing: `database "app" on ns/pg`.
impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.thing {
            Thing::Server => write!(f, "server {}", self.server),
            Thing::Database(d) => write!(f, "database {d:?} on {}", self.server),
            Thing::Role(r) => write!(f, "role {r:?} on {}", self.server),
        }
    }
}

/// What was read of one thing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Found {
    /// The server answered.
    Reachable,
    /// The server could not be reached or refused the admin's login: why.
    Unreachable(String),
    Database(Database),
    Role(Role),
}

/// A database as the catalog shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Database {
    /// The owning role.
    pub owner: String,
    /// Whether the owner may connect, create schemas and temporary tables (revoked by hand,
    /// the controller grants them again).
    pub owner_privileges: bool,
    /// The comment that says which object made it.
    pub comment: Option<String>,
}

/// A role as the catalog shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct Role {
    pub login: bool,
    /// The stored password verifier (`SCRAM-SHA-256$…` or `md5…`), to check a password
    /// against without the server's help.
    pub verifier: Option<String>,
    pub comment: Option<String>,
}

/// Never prints the verifier.
impl fmt::Debug for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Role")
            .field("login", &self.login)
            .field("has_password", &self.verifier.is_some())
            .field("comment", &self.comment)
            .finish()
    }
}

/// A change a plan asks for. Each is idempotent: asked again after a lost reply, it finds
/// its work done and does it again harmlessly. Each carries the marker of the object it is
/// for and checks it on the server right before it changes anything, so a thing of that
/// name made meanwhile by someone else (by hand, or by another object) is never taken over
/// or dropped, whatever the last poll saw.
pub enum Change {
    /// Creates the login role with `password` and `marker` as its comment.
    CreateRole { password: String, marker: String },
    /// Puts back a role's login and password.
    RepairRole { password: String, marker: String },
    /// Creates the database owned by `owner`, with `marker` as its comment.
    CreateDatabase { owner: String, marker: String },
    /// Puts back a database's owner and the owner's privileges.
    RepairDatabase { owner: String, marker: String },
    /// Drops the database, closing its connections.
    DropDatabase { owner: String, marker: String },
    /// Drops what the role owns in the admin's database, then the role.
    DropRole { marker: String },
}

/// How to log in to a server as its admin, from its Secret.
#[derive(Clone, PartialEq, Eq)]
struct Login {
    address: Address,
    user: String,
    password: String,
}

/// Where a server is and how to reach it, from its Secret: what applications get too.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Address {
    pub host: String,
    pub port: u16,
    /// `sslmode` as the Secret gives it (unset: `prefer`).
    pub sslmode: Option<String>,
    /// `ca.crt`: the CA `verify-full` trusts.
    pub ca: Option<Vec<u8>>,
}

/// The server's address, or what is wrong with its Secret.
pub fn address(secret: &Secret) -> Result<Address, String> {
    let bytes = |key: &str| secret.data.as_ref()?.get(key).map(|d| d.0.clone());
    let text =
        |key: &str| -> Option<String> { String::from_utf8(bytes(key)?).ok().map(|s| s.trim().to_string()) };
    let host = text("host")
        .filter(|h| !h.is_empty())
        .ok_or_else(|| format!("Secret {} has no host", secret.name_any()))?;
    let port = match text("port") {
        None => 5432,
        Some(p) => p
            .parse()
            .map_err(|_| format!("Secret {}: port {p:?} is not a port number", secret.name_any()))?,
    };
    let sslmode = text("sslmode").filter(|m| !m.is_empty());
    Mode::parse(sslmode.as_deref()).map_err(|e| format!("Secret {}: {e}", secret.name_any()))?;
    Ok(Address {
        host,
        port,
        sslmode,
        ca: bytes("ca.crt"),
    })
}

fn login(secret: &Secret) -> Result<Login, String> {
    let address = address(secret)?;
    let text = |key: &str| -> Result<String, String> {
        secret
            .data
            .as_ref()
            .and_then(|d| d.get(key))
            .and_then(|d| String::from_utf8(d.0.clone()).ok())
            .filter(|s| !s.is_empty())
            .ok_or_else(|| format!("Secret {} has no {key}", secret.name_any()))
    };
    Ok(Login {
        address,
        user: text("username")?,
        password: text("password")?,
    })
}

/// `<namespace>/<name>` of a server's Secret.
pub fn server_key(secret: &Secret) -> String {
    format!("{}/{}", secret.namespace().unwrap_or_default(), secret.name_any())
}

/// Whether some object names a server (`<namespace>/<Secret name>`).
type Used = Box<dyn Fn(&str) -> bool + Send + Sync>;

/// The servers of the cached server Secrets that some object names, and one open
/// connection to each.
pub struct Servers {
    secrets: Cache<Secret>,
    used: Used,
    clients: Mutex<BTreeMap<String, (Login, Arc<Client>)>>,
}

/// A quoted identifier: `"a""b"`.
fn ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// A quoted string literal (standard_conforming_strings, the default since 9.1).
fn literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

fn failed(e: &tokio_postgres::Error) -> Retry {
    match e.as_db_error() {
        Some(db) => {
            let detail = db.detail().map(|d| format!(" ({d})")).unwrap_or_default();
            Retry::new(
                RETRY,
                READY,
                false,
                REFUSED,
                format!("the server refused: {}{detail}", db.message()),
            )
        }
        None => {
            // The causes say what went wrong ("invalid peer certificate: UnknownIssuer").
            let mut message = e.to_string();
            let mut cause = std::error::Error::source(e);
            while let Some(c) = cause {
                message.push_str(": ");
                message.push_str(&c.to_string());
                cause = c.source();
            }
            Retry::new(RETRY, READY, false, UNAVAILABLE, message)
        }
    }
}

fn timed_out() -> Retry {
    Retry::new(
        RETRY,
        READY,
        false,
        UNAVAILABLE,
        format!("the server did not answer within {TIMEOUT:?}"),
    )
}

/// Runs `f` within [`TIMEOUT`], turning its error into a [`Retry`].
async fn bounded<T>(f: impl Future<Output = Result<T, tokio_postgres::Error>>) -> Result<T, Retry> {
    match tokio::time::timeout(TIMEOUT, f).await {
        Ok(r) => r.map_err(|e| failed(&e)),
        Err(_) => Err(timed_out()),
    }
}

/// Every database, templates too: `template1` must show as a database the controller did
/// not make, never as a free name.
const DATABASES: &str = "SELECT d.datname, pg_get_userbyid(d.datdba), \
     has_database_privilege(d.datdba, d.oid, 'CONNECT') \
       AND has_database_privilege(d.datdba, d.oid, 'CREATE') \
       AND has_database_privilege(d.datdba, d.oid, 'TEMPORARY'), \
     shobj_description(d.oid, 'pg_database') \
     FROM pg_database d WHERE true";

/// Every role; the password verifier only of the roles the controller made.
const ROLES: &str = "SELECT r.rolname, r.rolcanlogin, \
     CASE WHEN shobj_description(r.oid, 'pg_authid') LIKE 'made by opkit %' THEN r.rolpassword END, \
     shobj_description(r.oid, 'pg_authid') \
     FROM pg_authid r WHERE r.rolname !~ '^pg_'";

impl Servers {
    /// Reads the servers of the Secrets in `secrets` that `used` says some object names.
    pub fn new(secrets: Cache<Secret>, used: impl Fn(&str) -> bool + Send + Sync + 'static) -> Self {
        Servers {
            secrets,
            used: Box::new(used),
            clients: Mutex::new(BTreeMap::new()),
        }
    }

    /// Closes the connection to `server`: after a timeout or a broken connection the next
    /// call connects again instead of waiting on a dead one.
    fn forget(&self, server: &str) {
        self.clients
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(server);
    }

    /// Runs `f` on `server`'s connection; forgets the connection unless the server answered.
    async fn on<T, F, Fut>(&self, server: &str, f: F) -> Result<T, Retry>
    where
        F: FnOnce(Arc<Client>) -> Fut,
        Fut: Future<Output = Result<T, Retry>>,
    {
        let client = self.connect(server).await?;
        let out = f(client).await;
        if out
            .as_ref()
            .is_err_and(|e| e.reason != REFUSED && e.reason != NOT_OURS)
        {
            self.forget(server);
        }
        out
    }

    fn login_of(&self, server: &str) -> Result<Login, Retry> {
        let (ns, name) = server.split_once('/').unwrap_or(("", server));
        let secret = self.secrets.get(ns, name).ok_or_else(|| {
            Retry::new(
                RETRY,
                READY,
                false,
                super::SERVER_SECRET_MISSING,
                format!(
                    "no Secret {server} labelled {}=true",
                    opkit_api::postgres::SERVER_LABEL
                ),
            )
        })?;
        login(&secret).map_err(|m| Retry::new(RETRY, READY, false, UNAVAILABLE, m))
    }

    /// The open connection to `server`, or a new one.
    async fn client(&self, server: &str, login: &Login) -> Result<Arc<Client>, Retry> {
        {
            let clients = self.clients.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((l, c)) = clients.get(server)
                && l == login
                && !c.is_closed()
            {
                return Ok(c.clone());
            }
        }
        let a = &login.address;
        let mode =
            Mode::parse(a.sslmode.as_deref()).map_err(|m| Retry::new(RETRY, READY, false, UNAVAILABLE, m))?;
        let tls = super::tls::config(mode, a.ca.as_deref())
            .map_err(|m| Retry::new(RETRY, READY, false, UNAVAILABLE, m))?;
        let mut config = tokio_postgres::Config::new();
        config
            .host(&a.host)
            .port(a.port)
            .ssl_mode(mode.postgres())
            .user(&login.user)
            .password(&login.password)
            .dbname("postgres")
            .application_name("opkit")
            .connect_timeout(TIMEOUT)
            .keepalives_idle(Duration::from_secs(30));
        let (client, connection) = bounded(config.connect(MakeRustls(tls))).await?;
        let name = server.to_string();
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(server = name, error = %e, "connection to a PostgreSQL server ended");
            }
        });
        let client = Arc::new(client);
        self.clients
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(server.into(), (login.clone(), client.clone()));
        Ok(client)
    }

    async fn connect(&self, server: &str) -> Result<Arc<Client>, Retry> {
        let login = self.login_of(server)?;
        self.client(server, &login).await
    }

    /// Every database and role of one server.
    async fn read_all(&self, server: &str) -> Result<Vec<(Key, Found)>, Retry> {
        self.on(server, |client| async move {
            let mut out = vec![(Key::server(server), Found::Reachable)];
            for row in bounded(client.query(DATABASES, &[])).await? {
                let name: String = row.get(0);
                out.push((Key::database(server, &name), database_of(&row)));
            }
            for row in bounded(client.query(ROLES, &[])).await? {
                let name: String = row.get(0);
                out.push((Key::role(server, &name), role_of(&row)));
            }
            Ok(out)
        })
        .await
    }
}

/// Whether the thing `query` finds by name carries `marker` (or is absent: `None`).
/// A database without a comment but owned by `owner` counts as made with it: `CREATE
/// DATABASE` and its comment cannot be one transaction.
async fn owned(
    client: &Client,
    query: &str,
    name: &str,
    marker: &str,
    owner: Option<&str>,
) -> Result<Option<bool>, Retry> {
    let row = bounded(client.query_opt(query, &[&name])).await?;
    Ok(row.map(|r| {
        let comment: Option<String> = r.get(0);
        match comment {
            Some(c) => c == marker,
            None => owner.is_some_and(|o| r.get::<_, String>(1) == o),
        }
    }))
}

const ROLE_COMMENT: &str =
    "SELECT shobj_description(oid, 'pg_authid'), rolname FROM pg_roles WHERE rolname = $1";
const DATABASE_COMMENT: &str = "SELECT shobj_description(oid, 'pg_database'), pg_get_userbyid(datdba) FROM pg_database WHERE datname = $1";

fn not_ours(key: &Key) -> Retry {
    Retry::new(
        RETRY,
        READY,
        false,
        NOT_OURS,
        format!("{key:?} was not made by this object: it is left alone"),
    )
}

fn database_of(row: &tokio_postgres::Row) -> Found {
    Found::Database(Database {
        owner: row.get(1),
        owner_privileges: row.get(2),
        comment: row.get(3),
    })
}

fn role_of(row: &tokio_postgres::Row) -> Found {
    Found::Role(Role {
        login: row.get(1),
        verifier: row.get(2),
        comment: row.get(3),
    })
}

impl Outside for Servers {
    type Key = Key;
    type State = Found;
    type Action = Change;

    fn name(&self) -> &'static str {
        "postgres"
    }

    /// One server that cannot be read does not hide the others: it is listed as
    /// [`Found::Unreachable`], and its objects report it.
    async fn list(&self) -> Result<BTreeMap<Key, Found>, Retry> {
        use futures::StreamExt;
        let servers: Vec<String> = self
            .secrets
            .all()
            .iter()
            .map(|s| server_key(s))
            .filter(|s| (self.used)(s))
            .collect();
        self.clients
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|s, _| servers.contains(s));
        let reads = futures::stream::iter(servers)
            .map(|server| async move {
                let read = match tokio::time::timeout(SERVER_TIMEOUT, self.read_all(&server)).await {
                    Ok(read) => read,
                    Err(_) => {
                        self.forget(&server);
                        Err(Retry::new(
                            RETRY,
                            READY,
                            false,
                            UNAVAILABLE,
                            format!("reading the server took longer than {SERVER_TIMEOUT:?}"),
                        ))
                    }
                };
                (server, read)
            })
            .buffer_unordered(AT_ONCE)
            .collect::<Vec<_>>()
            .await;
        let mut all = BTreeMap::new();
        for (server, read) in reads {
            match read {
                Ok(things) => all.extend(things),
                Err(why) => {
                    all.insert(Key::server(&server), Found::Unreachable(why.message));
                }
            }
        }
        Ok(all)
    }

    async fn read(&self, key: &Key) -> Result<Option<Found>, Retry> {
        self.on(&key.server, |client| async move {
            Ok(match &key.thing {
                Thing::Server => Some(Found::Reachable),
                Thing::Database(name) => {
                    let query = format!("{DATABASES} AND d.datname = $1");
                    bounded(client.query_opt(&query, &[name]))
                        .await?
                        .map(|r| database_of(&r))
                }
                Thing::Role(name) => {
                    let query = format!("{ROLES} AND r.rolname = $1");
                    bounded(client.query_opt(&query, &[name]))
                        .await?
                        .map(|r| role_of(&r))
                }
            })
        })
        .await
    }

    async fn act(&self, key: &Key, change: &Change) -> Result<(), Retry> {
        let name = match &key.thing {
            Thing::Database(n) | Thing::Role(n) => n.as_str(),
            Thing::Server => return Ok(()),
        };
        self.on(&key.server, |client| async move {
            let sql = match change {
                Change::CreateRole { password, marker } | Change::RepairRole { password, marker } => {
                    let verb = match owned(&client, ROLE_COMMENT, name, marker, None).await? {
                        None => "CREATE",
                        Some(true) => "ALTER",
                        Some(false) => return Err(not_ours(key)),
                    };
                    // Sent already hashed: the password itself never reaches the server's logs.
                    let verifier = postgres_protocol::password::scram_sha_256(password.as_bytes());
                    format!(
                        "{verb} ROLE {role} LOGIN PASSWORD {verifier}; COMMENT ON ROLE {role} IS {marker}",
                        role = ident(name),
                        verifier = literal(&verifier),
                        marker = literal(marker),
                    )
                }
                Change::CreateDatabase { owner, marker } | Change::RepairDatabase { owner, marker } => {
                    match owned(&client, DATABASE_COMMENT, name, marker, Some(owner)).await? {
                        Some(false) => return Err(not_ours(key)),
                        Some(true) => {}
                        None => {
                            // Alone: CREATE DATABASE cannot run inside a transaction.
                            let sql = format!("CREATE DATABASE {} OWNER {}", ident(name), ident(owner));
                            bounded(client.batch_execute(&sql)).await?;
                        }
                    }
                    format!(
                        "COMMENT ON DATABASE {db} IS {marker}; ALTER DATABASE {db} OWNER TO {owner}; \
                         GRANT ALL ON DATABASE {db} TO {owner}",
                        db = ident(name),
                        owner = ident(owner),
                        marker = literal(marker),
                    )
                }
                Change::DropDatabase { owner, marker } => {
                    if owned(&client, DATABASE_COMMENT, name, marker, Some(owner)).await? != Some(true) {
                        return Ok(());
                    }
                    format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", ident(name))
                }
                Change::DropRole { marker } => {
                    if owned(&client, ROLE_COMMENT, name, marker, None).await? != Some(true) {
                        return Ok(());
                    }
                    // What it owns or was granted here goes first; in another database it
                    // makes the drop fail, and the condition names it.
                    format!("DROP OWNED BY {role}; DROP ROLE {role}", role = ident(name))
                }
            };
            bounded(client.batch_execute(&sql)).await
        })
        .await
    }

    fn action_name(change: &Change) -> &'static str {
        match change {
            Change::CreateRole { .. } => "create_role",
            Change::RepairRole { .. } => "repair_role",
            Change::CreateDatabase { .. } => "create_database",
            Change::RepairDatabase { .. } => "repair_database",
            Change::DropDatabase { .. } => "drop_database",
            Change::DropRole { .. } => "drop_role",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_texts_are_quoted_so_no_name_can_end_a_statement() {
        assert_eq!(ident("app"), "\"app\"");
        assert_eq!(ident("a\"; DROP ROLE x; --"), "\"a\"\"; DROP ROLE x; --\"");
        assert_eq!(literal("it's"), "'it''s'");
    }

    #[test]
    fn keys_read_as_a_person_names_them() {
        assert_eq!(
            format!("{:?}", Key::database("ns/pg", "app")),
            "database \"app\" on ns/pg"
        );
        assert_eq!(format!("{:?}", Key::server("ns/pg")), "server ns/pg");
        let role = Role {
            login: true,
            verifier: Some("SCRAM-SHA-256$4096:c2FsdA==$a:b".into()),
            comment: None,
        };
        assert!(!format!("{role:?}").contains("SCRAM"), "{role:?}");
    }
}
