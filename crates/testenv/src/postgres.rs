//! A real PostgreSQL server (Debian's `postgresql` package) for the tests of operators of
//! things outside the cluster: one throwaway cluster per [`Postgres::start`], on a free port
//! of 127.0.0.1, with a superuser whose password is made up at start. It dies with the test
//! process, like every [`Component`]. `crates/testenv/scripts/postgres.sh install` installs the
//! package (as root); `make test` runs it.
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::{Component, Error, Result, free_port};

/// The superuser every test server is made with.
pub const ADMIN: &str = "opkit_admin";

/// One running PostgreSQL server.
#[derive(Debug)]
pub struct Postgres {
    /// Where it listens: always `127.0.0.1`.
    pub host: String,
    /// Its TCP port.
    pub port: u16,
    /// The superuser's name ([`ADMIN`]).
    pub user: String,
    /// The superuser's password.
    pub password: String,
    /// The CA (PEM) that signed the server's certificate: the server speaks TLS too, for
    /// `sslmode=verify-full` with host `127.0.0.1`.
    pub ca: String,
    server: Mutex<Component>,
    bin: PathBuf,
    dir: PathBuf,
}

/// The directory of PostgreSQL's programs: `OPKIT_TESTENV_POSTGRES_BIN`, or the newest
/// `/usr/lib/postgresql/*/bin` Debian installed.
fn bin_dir() -> Result<PathBuf> {
    if let Ok(dir) = std::env::var("OPKIT_TESTENV_POSTGRES_BIN") {
        return Ok(PathBuf::from(dir));
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| d.flatten().map(|e| e.path().join("bin")).collect())
        .unwrap_or_default();
    found.retain(|b| b.join("postgres").exists());
    found.sort();
    found.pop().ok_or_else(|| {
        Error::Setup(
            "PostgreSQL is not installed: run `bash crates/testenv/scripts/postgres.sh install` as root \
             (Debian's postgresql package), or set OPKIT_TESTENV_POSTGRES_BIN"
                .into(),
        )
    })
}

/// As root, the user the server runs as (PostgreSQL refuses to run as root): `postgres`,
/// which Debian's package creates, else `nobody`. `None` when not root.
fn server_user() -> Option<nix::unistd::User> {
    if !nix::unistd::Uid::effective().is_root() {
        return None;
    }
    ["postgres", "nobody"]
        .into_iter()
        .find_map(|n| nix::unistd::User::from_name(n).ok().flatten())
}

/// `program args` as `user` (through `setpriv`), or as is.
fn as_user(user: Option<&nix::unistd::User>, program: &Path, args: &[String]) -> (PathBuf, Vec<String>) {
    match user {
        Some(u) => {
            let mut all = vec![
                format!("--reuid={}", u.uid),
                format!("--regid={}", u.gid),
                "--clear-groups".into(),
                "--pdeathsig".into(),
                "KILL".into(),
                "--".into(),
                program.display().to_string(),
            ];
            all.extend(args.iter().cloned());
            (PathBuf::from("setpriv"), all)
        }
        None => (program.to_path_buf(), args.to_vec()),
    }
}

/// A CA, and a serving certificate and key signed by it for `127.0.0.1` and `localhost`:
/// `(ca, cert, key)` in PEM.
fn serving_certificate() -> Result<(String, String, String)> {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
    let err = |e: rcgen::Error| Error::Setup(format!("generating the server's certificate: {e}"));
    let ca_key = KeyPair::generate().map_err(err)?;
    let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(err)?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "opkit-testenv-postgres-ca");
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_cert = ca.self_signed(&ca_key).map_err(err)?;
    let issuer = Issuer::new(ca, &ca_key);
    let key = KeyPair::generate().map_err(err)?;
    let mut serving =
        CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()]).map_err(err)?;
    serving.distinguished_name.push(DnType::CommonName, "postgres");
    let cert = serving.signed_by(&key, &issuer).map_err(err)?;
    Ok((ca_cert.pem(), cert.pem(), key.serialize_pem()))
}

/// A password of 32 hex digits from the kernel's random source.
fn made_up_password() -> Result<String> {
    let mut bytes = [0u8; 16];
    std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom")?, &mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Whether a server can be started here: PostgreSQL is installed, or this process runs as
/// root and installs it on first use. Tests that need one print `skipped` otherwise.
pub fn available() -> bool {
    bin_dir().is_ok() || nix::unistd::Uid::effective().is_root()
}

/// Installs Debian's package with the repository's script (root only).
fn install() -> Result<()> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/postgres.sh");
    let out = Command::new("bash").arg(&script).arg("install").output()?;
    if !out.status.success() {
        return Err(Error::Setup(format!(
            "installing PostgreSQL failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

impl Postgres {
    /// Makes a new database cluster in a temporary directory and starts its server; returns
    /// once it accepts connections. As root, installs PostgreSQL first if it is missing.
    pub fn start() -> Result<Postgres> {
        let bin = match bin_dir() {
            Ok(bin) => bin,
            Err(_) if nix::unistd::Uid::effective().is_root() => {
                install()?;
                bin_dir()?
            }
            Err(e) => return Err(e),
        };
        let user = server_user();
        let port = free_port()?;
        let dir = std::env::temp_dir().join(format!("opkit-postgres-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let password = made_up_password()?;
        let pwfile = dir.join("password");
        std::fs::write(&pwfile, &password)?;
        let (ca, cert, key) = serving_certificate()?;
        let (cert_file, key_file) = (dir.join("server.crt"), dir.join("server.key"));
        std::fs::write(&cert_file, cert)?;
        std::fs::write(&key_file, key)?;
        // PostgreSQL refuses a key others may read.
        std::fs::set_permissions(
            &key_file,
            <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o600),
        )?;
        if let Some(u) = &user {
            for p in [&dir, &pwfile, &cert_file, &key_file] {
                nix::unistd::chown(p, Some(u.uid), Some(u.gid))
                    .map_err(|e| Error::Setup(format!("chown {}: {e}", p.display())))?;
            }
        }
        let data = dir.join("data");
        let init = [
            "-D".to_string(),
            data.display().to_string(),
            "-U".into(),
            ADMIN.into(),
            format!("--pwfile={}", pwfile.display()),
            "--auth=scram-sha-256".into(),
            "--no-sync".into(),
            "--encoding=UTF8".into(),
            "--locale=C".into(),
        ];
        let (program, args) = as_user(user.as_ref(), &bin.join("initdb"), &init);
        let out = Command::new(&program).args(&args).current_dir(&dir).output()?;
        if !out.status.success() {
            return Err(Error::Setup(format!(
                "initdb failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        let serve = [
            "-D".to_string(),
            data.display().to_string(),
            "-h".into(),
            "127.0.0.1".into(),
            "-p".into(),
            port.to_string(),
            "-k".into(),
            dir.display().to_string(),
            "-c".into(),
            "fsync=off".into(),
            // Every CREATE, ALTER and DROP in the log: what a test counts server-side.
            "-c".into(),
            "log_statement=ddl".into(),
            "-c".into(),
            "ssl=on".into(),
            "-c".into(),
            format!("ssl_cert_file={}", cert_file.display()),
            "-c".into(),
            format!("ssl_key_file={}", key_file.display()),
        ];
        let (program, args) = as_user(user.as_ref(), &bin.join("postgres"), &serve);
        let server = Component::start(&format!("postgres-{port}"), &program, &args, &dir)?;
        let pg = Postgres {
            host: "127.0.0.1".into(),
            port,
            user: ADMIN.into(),
            password,
            ca,
            server: Mutex::new(server),
            bin,
            dir,
        };
        pg.wait_ready()?;
        Ok(pg)
    }

    /// Waits (up to 30 s) until the server accepts connections.
    fn wait_ready(&self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ready = Command::new(self.bin.join("pg_isready"))
                .args(["-q", "-h", &self.host, "-p", &self.port.to_string()])
                .status()?;
            if ready.success() {
                return Ok(());
            }
            let mut server = self.server.lock().unwrap_or_else(|p| p.into_inner());
            server.check_running()?;
            if Instant::now() > deadline {
                return Err(server.failure("not accepting connections after 30 s".into()));
            }
            drop(server);
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Stops the server (an outage); [`Postgres::resume`] starts it again on the same port
    /// with the same data.
    pub fn stop(&self) {
        self.server
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .stop(Duration::from_secs(5));
    }

    /// Starts the stopped server again and waits until it accepts connections.
    pub fn resume(&self) -> Result<()> {
        self.server
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .restart(Duration::from_secs(5))?;
        self.wait_ready()
    }

    /// The server's log so far: with every DDL statement it ran (`statement: CREATE ROLE …`),
    /// to count what clients did on the server's side.
    pub fn log(&self) -> String {
        let path = self.server.lock().unwrap_or_else(|p| p.into_inner()).log.clone();
        std::fs::read_to_string(path).unwrap_or_default()
    }

    /// Runs `sql` with `psql` as the superuser in database `postgres`; returns what it printed
    /// (unaligned, tuples only: one row per line, `|` between columns).
    pub fn psql(&self, sql: &str) -> Result<String> {
        self.psql_as(&self.user, &self.password, "postgres", sql)
    }

    /// Runs `sql` as `user` with `password` in `database`: what an application with those
    /// credentials can do.
    pub fn psql_as(&self, user: &str, password: &str, database: &str, sql: &str) -> Result<String> {
        let out = Command::new(self.bin.join("psql"))
            .args(["-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1"])
            .args([
                "-h",
                &self.host,
                "-p",
                &self.port.to_string(),
                "-U",
                user,
                "-d",
                database,
            ])
            .args(["-c", sql])
            .env("PGPASSWORD", password)
            .env("PGCONNECT_TIMEOUT", "5")
            .output()?;
        if !out.status.success() {
            return Err(Error::Setup(format!(
                "psql as {user} in {database}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_starts_serves_a_password_login_stops_and_comes_back() {
        if !available() {
            eprintln!("skipped: PostgreSQL is not installed and this test does not run as root");
            return;
        }
        let pg = Postgres::start().expect("a PostgreSQL server");
        assert_eq!(pg.psql("select 1").expect("a query"), "1");
        assert_eq!(pg.psql("show ssl").expect("a query"), "on", "TLS served too");
        assert!(pg.ca.starts_with("-----BEGIN CERTIFICATE-----"));
        let wrong = pg.psql_as(ADMIN, "not-the-password", "postgres", "select 1");
        assert!(wrong.is_err(), "a wrong password is refused: {wrong:?}");
        pg.psql("create database app").expect("create database");
        pg.stop();
        assert!(pg.psql("select 1").is_err(), "stopped");
        pg.resume().expect("started again");
        assert_eq!(
            pg.psql("select datname from pg_database where datname = 'app'")
                .expect("a query"),
            "app",
            "the data survived the outage"
        );
    }
}
