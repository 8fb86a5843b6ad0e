use super::server::{Change, Database, Role};
use super::*;
use opkit::Outside;
use opkit_api::postgres::PostgresDatabaseSpec;

fn address(host: &str, port: u16) -> server::Address {
    server::Address {
        host: host.into(),
        port,
        sslmode: None,
        ca: None,
    }
}

fn object(revision: Option<i64>, policy: Option<ReclaimPolicy>) -> PostgresDatabase {
    let mut p = PostgresDatabase::new(
        "app",
        PostgresDatabaseSpec {
            server_secret: "pg".into(),
            database_name: None,
            role_name: None,
            secret_name: None,
            reclaim_policy: policy,
            password_revision: revision,
        },
    );
    p.metadata.namespace = Some("ns".into());
    p.metadata.uid = Some("u-1".into());
    p.metadata.generation = Some(1);
    p
}

fn server_secret() -> Arc<Secret> {
    let data = [
        ("host", "db.example"),
        ("username", "admin"),
        ("password", "adminpw"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec())))
    .collect();
    Arc::new(Secret {
        metadata: ObjectMeta {
            name: Some("pg".into()),
            namespace: Some("ns".into()),
            ..Default::default()
        },
        data: Some(data),
        ..Default::default()
    })
}

/// The server as it is once `p` was made with `password`.
fn made(p: &PostgresDatabase, password: &str, revision: i64) -> World {
    let secret = build_secret(p, &address("db.example", 5432), password, revision).unwrap();
    World {
        server: Some(server_secret()),
        database: Some(Database {
            owner: "app".into(),
            owner_privileges: true,
            comment: Some(marker(p)),
        }),
        role: Some(Role {
            login: true,
            verifier: Some(postgres_protocol::password::scram_sha_256(password.as_bytes())),
            comment: Some(marker(p)),
        }),
        secret: Some(Arc::new(secret)),
        new_password: "fresh".into(),
    }
}

fn acts(plan: &Plan<PostgresDatabaseStatus>) -> Vec<(String, &'static str, Option<String>)> {
    plan.acts
        .iter()
        .map(|a| {
            let (key, change) = a.get::<Servers>().expect("an act on the servers");
            let password = match change {
                Change::CreateRole { password, .. } | Change::RepairRole { password, .. } => {
                    Some(password.clone())
                }
                _ => None,
            };
            (format!("{key:?}"), Servers::action_name(change), password)
        })
        .collect()
}

fn now() -> Timestamp {
    Timestamp::from_second(1_800_000_000).unwrap()
}

#[test]
fn a_new_database_gets_a_secret_then_its_role_with_that_password_then_the_database() {
    let p = object(None, None);
    let world = World {
        server: Some(server_secret()),
        new_password: "fresh".into(),
        ..Default::default()
    };
    let plan = PostgresController::default().plan(&p, &world, now()).unwrap();
    assert_eq!(plan.children.len(), 1);
    assert!(plan.children[0].is_needed());
    assert_eq!(plan.children[0].describe(), "Secret app-postgres");
    assert_eq!(
        acts(&plan),
        vec![
            (
                "role \"app\" on ns/pg".into(),
                "create_role",
                Some("fresh".into())
            ),
            ("database \"app\" on ns/pg".into(), "create_database", None),
        ]
    );
    // The acts name the thing, never the password.
    for a in &plan.acts {
        assert!(!a.describe().contains("fresh"), "{}", a.describe());
    }
    let status = plan.status.unwrap();
    assert_eq!(status.database.as_deref(), Some("app"));
    assert!(!serde_json::to_string(&status).unwrap().contains("fresh"));
}

#[test]
fn a_database_as_made_asks_for_nothing() {
    let p = object(None, None);
    let plan = PostgresController::default()
        .plan(&p, &made(&p, "kept", 0), now())
        .unwrap();
    assert!(acts(&plan).is_empty());
    assert!(!plan.children[0].is_needed(), "the Secret is as it should be");
    assert!(plan.events.is_empty());
    let status = plan.status.unwrap();
    assert_eq!(status.conditions[0].reason, reason::READY);
    assert_eq!(status.password_revision, Some(0));
}

#[test]
fn drift_by_hand_is_put_back_with_the_secrets_password() {
    let p = object(None, None);
    let mut world = made(&p, "kept", 0);
    if let Some(r) = world.role.as_mut() {
        r.verifier = Some(postgres_protocol::password::scram_sha_256(b"changed by hand"));
    }
    if let Some(d) = world.database.as_mut() {
        d.owner = "postgres".into();
    }
    let plan = PostgresController::default().plan(&p, &world, now()).unwrap();
    assert_eq!(
        acts(&plan),
        vec![
            ("role \"app\" on ns/pg".into(), "repair_role", Some("kept".into())),
            ("database \"app\" on ns/pg".into(), "repair_database", None),
        ]
    );
    assert!(
        plan.children[0].is_needed(),
        "written again before the role gets its password: the cache may be behind"
    );

    // A role that lost its login, a database whose owner lost a privilege; a dropped role.
    let mut world = made(&p, "kept", 0);
    if let Some(r) = world.role.as_mut() {
        r.login = false;
    }
    if let Some(d) = world.database.as_mut() {
        d.owner_privileges = false;
    }
    let names: Vec<_> = acts(&PostgresController::default().plan(&p, &world, now()).unwrap())
        .into_iter()
        .map(|a| a.1)
        .collect();
    assert_eq!(names, ["repair_role", "repair_database"]);
    let mut world = made(&p, "kept", 0);
    world.role = None;
    let plan = PostgresController::default().plan(&p, &world, now()).unwrap();
    assert_eq!(
        acts(&plan),
        vec![("role \"app\" on ns/pg".into(), "create_role", Some("kept".into()))]
    );
}

#[test]
fn a_higher_revision_makes_a_new_password_for_the_secret_and_the_role_together() {
    let p = object(Some(1), None);
    let plan = PostgresController::default()
        .plan(&p, &made(&p, "old", 0), now())
        .unwrap();
    assert!(plan.children[0].is_needed(), "the Secret gets the new password");
    assert_eq!(
        acts(&plan),
        vec![(
            "role \"app\" on ns/pg".into(),
            "repair_role",
            Some("fresh".into())
        )]
    );
    assert_eq!(plan.events.len(), 1);
    assert_eq!(plan.events[0].reason, reason::PASSWORD_ROTATED);
    assert!(!plan.events[0].note.contains("fresh"));
    assert_eq!(plan.status.unwrap().password_revision, Some(1));
}

#[test]
fn what_this_object_did_not_make_is_reported_and_left_alone() {
    let p = object(None, Some(ReclaimPolicy::Delete));
    let mut world = made(&p, "kept", 0);
    if let Some(d) = world.database.as_mut() {
        d.comment = None;
        d.owner = "postgres".into();
    }
    let err = PostgresController::default()
        .plan(&p, &world, now())
        .map(|_| ())
        .unwrap_err();
    assert_eq!(err.reason, reason::NOT_OURS);
    assert!(
        err.message.contains("database \"app\" already exists on ns/pg"),
        "{}",
        err.message
    );
    // Deleted: only the role (ours) is dropped.
    let cleanup = PostgresController::default().cleanup(&p, &world, now());
    let dropped: Vec<String> = cleanup.acts.iter().map(|a| a.describe()).collect();
    assert_eq!(dropped, ["drop_role role \"app\" on ns/pg"]);
}

#[test]
fn deleting_keeps_or_drops_as_the_policy_says() {
    let keep = object(None, None);
    let cleanup = PostgresController::default().cleanup(&keep, &made(&keep, "pw", 0), now());
    assert!(cleanup.done && cleanup.acts.is_empty());
    assert_eq!(cleanup.events[0].reason, reason::KEPT);

    let drop = object(None, Some(ReclaimPolicy::Delete));
    let cleanup = PostgresController::default().cleanup(&drop, &made(&drop, "pw", 0), now());
    let order: Vec<String> = cleanup.acts.iter().map(|a| a.describe()).collect();
    assert_eq!(
        order,
        [
            "drop_database database \"app\" on ns/pg",
            "drop_role role \"app\" on ns/pg"
        ]
    );
    // The server's Secret gone (its namespace is being deleted): nothing can be dropped, and
    // the deletion is not held.
    let gone = World {
        new_password: "x".into(),
        ..Default::default()
    };
    let cleanup = PostgresController::default().cleanup(&drop, &gone, now());
    assert!(cleanup.done && cleanup.acts.is_empty());
    assert_eq!(cleanup.events[0].reason, reason::SERVER_SECRET_MISSING);
}

#[test]
fn a_missing_server_secret_or_a_name_too_long_is_reported() {
    let p = object(None, None);
    let err = PostgresController::default()
        .plan(&p, &World::default(), now())
        .map(|_| ())
        .unwrap_err();
    assert_eq!(err.reason, reason::SERVER_SECRET_MISSING);
    assert!(err.retry.is_some(), "looked at again: the Secret may come");
    let mut long = object(None, None);
    long.metadata.name = Some("a".repeat(64));
    let err = PostgresController::default()
        .plan(&long, &made(&p, "pw", 0), now())
        .map(|_| ())
        .unwrap_err();
    assert!(err.message.starts_with("spec.databaseName:"), "{}", err.message);
}

#[test]
fn the_secret_has_a_uri_applications_can_use() {
    let p = object(None, None);
    let s = build_secret(&p, &address("db.example", 5433), "pw", 0).unwrap();
    let uri = text(&s, "uri").unwrap();
    assert_eq!(uri, "postgresql://app:pw@db.example:5433/app");
    let v6 = build_secret(&p, &address("fd00::1", 5432), "pw", 0).unwrap();
    assert_eq!(
        text(&v6, "uri").unwrap(),
        "postgresql://app:pw@[fd00::1]:5432/app"
    );
    // TLS settings reach the application: the mode in the URI and beside it, the CA as a file.
    let tls = server::Address {
        sslmode: Some("verify-full".into()),
        ca: Some(b"-----BEGIN CERTIFICATE-----".to_vec()),
        ..address("db.example", 5432)
    };
    let s_tls = build_secret(&p, &tls, "pw", 0).unwrap();
    assert_eq!(
        text(&s_tls, "uri").unwrap(),
        "postgresql://app:pw@db.example:5432/app?sslmode=verify-full"
    );
    assert_eq!(text(&s_tls, "sslmode").unwrap(), "verify-full");
    assert_eq!(text(&s_tls, "ca.crt").unwrap(), "-----BEGIN CERTIFICATE-----");
    assert!(text(&s, "sslmode").is_none() && text(&s, "ca.crt").is_none());
    assert_eq!(s.annotations()[REVISION_ANNOTATION], "0");
    let passwords: Vec<String> = (0..50).map(|_| new_password()).collect();
    assert!(
        passwords
            .iter()
            .all(|p| p.len() == 32 && p.chars().all(|c| c.is_ascii_alphanumeric()))
    );
    let distinct: std::collections::BTreeSet<_> = passwords.iter().collect();
    assert_eq!(distinct.len(), 50);
}

#[test]
fn a_database_left_without_its_comment_by_a_lost_reply_is_still_ours() {
    let p = object(None, Some(ReclaimPolicy::Delete));
    let mut world = made(&p, "kept", 0);
    if let Some(d) = world.database.as_mut() {
        d.comment = None;
    }
    let plan = PostgresController::default().plan(&p, &world, now()).unwrap();
    assert!(acts(&plan).is_empty(), "{:?}", acts(&plan));
    let cleanup = PostgresController::default().cleanup(&p, &world, now());
    assert_eq!(cleanup.acts.len(), 2, "both dropped");
    // Not when the role is not ours either.
    if let Some(r) = world.role.as_mut() {
        r.comment = None;
    }
    let err = PostgresController::default()
        .plan(&p, &world, now())
        .map(|_| ())
        .unwrap_err();
    assert_eq!(err.reason, reason::NOT_OURS);
}

#[test]
fn a_secret_of_that_name_someone_else_made_is_left_alone() {
    let p = object(None, None);
    let mut world = made(&p, "kept", 0);
    let mut theirs = (*world.secret.clone().unwrap()).clone();
    theirs.metadata.owner_references = None;
    world.secret = Some(Arc::new(theirs));
    let err = PostgresController::default()
        .plan(&p, &world, now())
        .map(|_| ())
        .unwrap_err();
    assert_eq!(err.reason, reason::NOT_OURS);
    assert!(
        err.message.starts_with("Secret app-postgres exists"),
        "{}",
        err.message
    );
    // No Secret at all: created, never applied over one made meanwhile.
    world.secret = None;
    let plan = PostgresController::default().plan(&p, &world, now()).unwrap();
    assert!(plan.children[0].is_needed());
    assert!(format!("{:?}", plan.children[0]).contains("Create"));
}

#[test]
fn a_role_name_postgresql_keeps_for_itself_is_refused() {
    let mut p = object(None, None);
    p.spec.role_name = Some("pg_monitor".into());
    let err = PostgresController::default()
        .plan(&p, &made(&p, "pw", 0), now())
        .map(|_| ())
        .unwrap_err();
    assert!(
        err.message
            .starts_with("spec.roleName: \"pg_monitor\" starts with pg_"),
        "{}",
        err.message
    );
}

#[test]
fn the_world_never_prints_a_password() {
    let p = object(None, None);
    let world = made(&p, "kept-secret", 0);
    let printed = format!("{world:?}");
    assert!(
        !printed.contains("fresh") && !printed.contains("adminpw") && !printed.contains("SCRAM"),
        "{printed}"
    );
}
