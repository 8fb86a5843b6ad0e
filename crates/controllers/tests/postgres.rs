//! PostgresDatabase against a real PostgreSQL server (Debian's package, one throwaway server
//! per test from opkit-testenv) and the local control plane: the database and role are made
//! and usable with the Secret's password, drift by hand is put back, the password rotates,
//! the server's outage is reported and waited out, `Retain` keeps and `Delete` drops, and what
//! the operator did not make is never touched.
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, ensure};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use opkit_api::postgres::{PostgresDatabase, PostgresDatabaseSpec, ReclaimPolicy, SERVER_LABEL};
use opkit_controllers::{Settings, operator};
use opkit_testenv::postgres::{self, Postgres};
use opkit_testenv::{consistently, shared, wait_for};
use serde_json::json;

mod common;
use common::{Run, T};

/// The server's Secret, as an administrator writes it.
fn server_secret(pg: &Postgres) -> Secret {
    let data = [
        ("host", pg.host.clone()),
        ("port", pg.port.to_string()),
        ("username", pg.user.clone()),
        ("password", pg.password.clone()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), ByteString(v.into_bytes())))
    .collect();
    Secret {
        metadata: ObjectMeta {
            name: Some("pg".into()),
            labels: Some([(SERVER_LABEL.to_string(), "true".to_string())].into()),
            ..Default::default()
        },
        data: Some(data),
        ..Default::default()
    }
}

fn database(name: &str, policy: Option<ReclaimPolicy>) -> PostgresDatabase {
    PostgresDatabase::new(
        name,
        PostgresDatabaseSpec {
            server_secret: "pg".into(),
            database_name: None,
            role_name: None,
            secret_name: None,
            reclaim_policy: policy,
            password_revision: None,
        },
    )
}

/// A key of the application's Secret.
fn field(s: &Secret, key: &str) -> anyhow::Result<String> {
    let v = s
        .data
        .as_ref()
        .and_then(|d| d.get(key))
        .ok_or_else(|| anyhow!("the Secret has no {key}"))?;
    Ok(String::from_utf8(v.0.clone())?)
}

/// `Ready`'s (status, reason) of `name`.
async fn ready(api: &Api<PostgresDatabase>, name: &str) -> anyhow::Result<(String, String, String)> {
    let p = api.get(name).await?;
    let c = p
        .status
        .unwrap_or_default()
        .conditions
        .into_iter()
        .find(|c| c.type_ == "Ready")
        .ok_or_else(|| anyhow!("no Ready condition yet"))?;
    Ok((c.status, c.reason, c.message))
}

async fn ready_is(api: &Api<PostgresDatabase>, name: &str, status: &str, reason: &str) -> anyhow::Result<()> {
    wait_for(&format!("{name} Ready={status} {reason}"), T, || async {
        let (s, r, m) = ready(api, name).await?;
        ensure!(s == status && r == reason, "Ready={s} {r}: {m}");
        Ok(())
    })
    .await
}

/// What the application logged in as `user` with `password` sees: its own name.
fn login(pg: &Postgres, user: &str, password: &str, db: &str) -> anyhow::Result<String> {
    Ok(pg.psql_as(user, password, db, "SELECT current_user")?)
}

async fn app_secret(secrets: &Api<Secret>, name: &str) -> anyhow::Result<Secret> {
    wait_for(&format!("Secret {name}"), T, || async {
        secrets.get_opt(name).await?.ok_or_else(|| anyhow!("not yet"))
    })
    .await
}

fn client_usable(pg: &Postgres, s: &Secret) -> anyhow::Result<()> {
    let (user, password, db) = (
        field(s, "username")?,
        field(s, "password")?,
        field(s, "database")?,
    );
    ensure!(login(pg, &user, &password, &db)? == user);
    Ok(())
}

fn skipped() -> bool {
    if postgres::available() {
        return false;
    }
    eprintln!("skipped: PostgreSQL is not installed (crates/testenv/scripts/postgres.sh install)");
    true
}

#[tokio::test]
async fn a_database_is_made_usable_kept_against_drift_rotated_waited_for_and_dropped() {
    if skipped() {
        return;
    }
    let pg = Arc::new(Postgres::start().expect("a PostgreSQL server"));
    shared()
        .in_namespace("postgres", |client, ns| async move {
            let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
            secrets.create(&PostParams::default(), &server_secret(&pg)).await?;
            let settings = Settings {
                postgres_poll: Duration::from_millis(300),
                ..Default::default()
            };
            let op = common::start_op(&operator(), &client, &ns, Run::new(&["postgres"]), &settings, |_| {}).await?;
            let dbs: Api<PostgresDatabase> = Api::namespaced(client.clone(), &ns);
            dbs.create(&PostParams::default(), &database("app", Some(ReclaimPolicy::Delete)))
                .await?;

            // Made: the Secret's credentials log in, and the role owns the database.
            ready_is(&dbs, "app", "True", "DatabaseReady").await?;
            let s = app_secret(&secrets, "app-postgres").await?;
            let password = field(&s, "password")?;
            client_usable(&pg, &s)?;
            ensure!(field(&s, "uri")? == format!("postgresql://app:{password}@127.0.0.1:{}/app", pg.port));
            ensure!(pg.psql("SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = 'app'")? == "app");

            // TLS: a server Secret with `sslmode: verify-full` and the CA; the operator's
            // connection is encrypted, and applications get the mode and the CA. A CA that did
            // not sign the server's certificate is refused, and said so.
            let other = Postgres::start().expect("a second PostgreSQL server");
            for (name, ca) in [("pg-tls", &pg.ca), ("pg-distrusted", &other.ca)] {
                let mut s = server_secret(&pg);
                s.metadata.name = Some(name.into());
                let data = s.data.get_or_insert_with(Default::default);
                data.insert("sslmode".into(), ByteString(b"verify-full".to_vec()));
                data.insert("ca.crt".into(), ByteString(ca.clone().into_bytes()));
                secrets.create(&PostParams::default(), &s).await?;
            }
            let mut secure = database("secure", Some(ReclaimPolicy::Delete));
            secure.spec.server_secret = "pg-tls".into();
            dbs.create(&PostParams::default(), &secure).await?;
            let mut distrust = database("distrust", None);
            distrust.spec.server_secret = "pg-distrusted".into();
            dbs.create(&PostParams::default(), &distrust).await?;
            ready_is(&dbs, "secure", "True", "DatabaseReady").await?;
            let s = app_secret(&secrets, "secure-postgres").await?;
            client_usable(&pg, &s)?;
            ensure!(field(&s, "sslmode")? == "verify-full" && field(&s, "ca.crt")? == pg.ca);
            ensure!(field(&s, "uri")?.ends_with("/secure?sslmode=verify-full"));
            let encrypted = pg.psql(
                "SELECT count(*) FROM pg_stat_ssl JOIN pg_stat_activity USING (pid) \
                 WHERE application_name = 'opkit' AND ssl",
            )?;
            ensure!(encrypted != "0", "no encrypted connection of the operator");
            ready_is(&dbs, "distrust", "False", "ServerUnavailable").await?;
            let (_, _, why) = ready(&dbs, "distrust").await?;
            ensure!(why.contains("certificate"), "{why}");
            drop(other);

            // Settled: no act repeats through many polls.
            let acts = |op: &common::Operator| -> f64 {
                ["create_role", "repair_role", "create_database", "repair_database"]
                    .iter()
                    .map(|a| op.sample(&format!(r#"opkit_calls_total{{controller="postgres",step="postgres.{a}",result="ok"}}"#)))
                    .sum()
            };
            common::settled(&op.metrics()).await?;
            let made = acts(&op);
            ensure!(made == 4.0, "{made} acts to make two roles and two databases");
            consistently("no act while settled", Duration::from_secs(2), || async {
                ensure!(acts(&op) == made, "{} acts", acts(&op));
                Ok(())
            })
            .await?;

            // Drift by hand: the database given away and the role dropped, then put back
            // within a poll, with the Secret's password.
            pg.psql("ALTER DATABASE app OWNER TO opkit_admin")?;
            pg.psql("DROP ROLE app")?;
            wait_for("the role and the owner put back", T, || async {
                ensure!(pg.psql("SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = 'app'")? == "app");
                client_usable(&pg, &s)
            })
            .await?;
            // The owner may create tables in its database (and so owns objects from now on).
            pg.psql_as("app", &password, "app", "CREATE TABLE t (x int); INSERT INTO t VALUES (1)")?;
            // A password and a privilege changed by hand.
            pg.psql("ALTER ROLE app PASSWORD 'by hand'; REVOKE CONNECT ON DATABASE app FROM app")?;
            wait_for("the password put back", T, || async { client_usable(&pg, &s) }).await?;
            // The server's own verifier of the Secret's password matches: set by hand to the
            // same password, nothing is repaired.
            common::settled(&op.metrics()).await?;
            let before = acts(&op);
            pg.psql(&format!("ALTER ROLE app PASSWORD '{password}'"))?;
            consistently("the same password by hand is left alone", Duration::from_secs(2), || async {
                ensure!(acts(&op) == before, "{} acts", acts(&op) - before);
                Ok(())
            })
            .await?;

            // Rotation: a new password in the Secret, the old one no longer logs in.
            dbs.patch("app", &PatchParams::default(), &Patch::Merge(json!({"spec": {"passwordRevision": 1}})))
                .await?;
            let rotated = wait_for("a new password", T, || async {
                let s = secrets.get("app-postgres").await?;
                ensure!(field(&s, "password")? != password, "the old one");
                Ok(s)
            })
            .await?;
            wait_for("the new password logs in", T, || async { client_usable(&pg, &rotated) }).await?;
            ensure!(login(&pg, "app", &password, "app").is_err(), "the old password still logs in");
            wait_for("status.passwordRevision 1", T, || async {
                let st = dbs.get("app").await?.status.unwrap_or_default();
                ensure!(st.password_revision == Some(1) && st.observed_generation == Some(2), "{st:?}");
                Ok(())
            })
            .await?;
            common::event(&client, Some(&ns), "app", "PasswordRotated").await?;

            // The server down: a condition, a few retries (no hot loop), nothing lost: a
            // rotation asked meanwhile is done once the server is back.
            pg.stop();
            ready_is(&dbs, "app", "False", "ServerUnavailable").await?;
            dbs.patch("app", &PatchParams::default(), &Patch::Merge(json!({"spec": {"passwordRevision": 2}})))
                .await?;
            let m = op.metrics();
            let (started, window) = (m.reconciles_total(), Duration::from_secs(6));
            let down = Instant::now();
            tokio::time::sleep(window).await;
            let during = m.reconciles_total() - started;
            // One per retry (10 s) and per poll that saw a change, plus the patch.
            ensure!(during <= 6, "{during} reconciles in {:?} while the server was down", down.elapsed());
            pg.resume()?;
            let back = wait_for("the revision-2 password logs in", T, || async {
                let s = secrets.get("app-postgres").await?;
                ensure!(s.annotations().get("db.opkit.dev/password-revision").map(String::as_str) == Some("2"));
                client_usable(&pg, &s)?;
                Ok(s)
            })
            .await?;
            ready_is(&dbs, "app", "True", "DatabaseReady").await?;

            // Passwords appear in no metric and no Event.
            let exposition = op.encoded();
            for p in [&password, &field(&rotated, "password")?, &field(&back, "password")?] {
                ensure!(!exposition.contains(p.as_str()), "a password in the metrics");
            }
            let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), &ns);
            let notes: Vec<String> = events
                .list(&Default::default())
                .await?
                .items
                .into_iter()
                .filter_map(|e| e.note)
                .collect();
            ensure!(!notes.is_empty());
            ensure!(!notes.iter().any(|n| n.contains(&password)), "a password in an Event");

            // What the operator did not make: reported, and left alone on delete.
            pg.psql("CREATE DATABASE taken")?;
            dbs.create(&PostParams::default(), &database("taken", Some(ReclaimPolicy::Delete)))
                .await?;
            ready_is(&dbs, "taken", "False", "NotOwned").await?;
            // A template is never a free name; a Secret someone else made is never written.
            let mut template = database("tmpl", Some(ReclaimPolicy::Delete));
            template.spec.database_name = Some("template1".into());
            dbs.create(&PostParams::default(), &template).await?;
            ready_is(&dbs, "tmpl", "False", "NotOwned").await?;
            let mut theirs = server_secret(&pg);
            theirs.metadata.name = Some("mine-postgres".into());
            theirs.metadata.labels = None;
            secrets.create(&PostParams::default(), &theirs).await?;
            dbs.create(&PostParams::default(), &database("mine", Some(ReclaimPolicy::Delete)))
                .await?;
            ready_is(&dbs, "mine", "False", "NotOwned").await?;
            ensure!(secrets.get("mine-postgres").await?.data == theirs.data, "their Secret was written");
            // `Retain` (the default) keeps what it made.
            dbs.create(&PostParams::default(), &database("kept", None)).await?;
            ready_is(&dbs, "kept", "True", "DatabaseReady").await?;

            for name in ["app", "taken", "kept", "tmpl", "mine", "secure", "distrust"] {
                dbs.delete(name, &DeleteParams::default()).await?;
            }
            wait_for("the objects gone", T, || async {
                let left = dbs.list(&Default::default()).await?.items.len();
                ensure!(left == 0, "{left} left");
                Ok(())
            })
            .await?;
            let on_server = pg.psql("SELECT string_agg(datname, ',' ORDER BY datname) FROM pg_database")?;
            ensure!(
                on_server == "kept,postgres,taken,template0,template1",
                "databases on the server: {on_server}"
            );
            let template_owner = pg.psql("SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = 'template1'")?;
            ensure!(template_owner == pg.user, "template1 belongs to {template_owner}");
            let roles = pg.psql("SELECT string_agg(rolname, ',' ORDER BY rolname) FROM pg_roles WHERE rolname IN ('app', 'kept', 'taken', 'tmpl', 'mine')")?;
            ensure!(roles == "kept", "roles on the server: {roles}");
            let dropped = op.sample(r#"opkit_calls_total{controller="postgres",step="postgres.drop_database",result="ok"}"#);
            ensure!(dropped == 2.0, "{dropped} databases dropped");
            op.stop().await;
            Ok(())
        })
        .await;
}
