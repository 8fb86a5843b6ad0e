//! Child processes that never outlive their owner.
//!
//! Every component is started through `setpriv --pdeathsig KILL`, so the kernel kills it when
//! the thread that forked it exits. All forks happen on one dedicated thread that lives as long
//! as the process, so a component dies exactly when its owner process does: normal exit, panic,
//! Ctrl-C or SIGKILL. [`Component`]'s `Drop` stops it earlier when its owner is dropped.
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::{Error, Result};

type SpawnRequest = (Command, mpsc::Sender<std::io::Result<Child>>);

fn spawner() -> &'static Mutex<mpsc::Sender<SpawnRequest>> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("testenv-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
                // The channel's sender lives in a static, so this loop never ends and the
                // thread (and with it every child's parent-death signal) lasts until exit.
            })
            .expect("spawning the testenv-spawner thread");
        Mutex::new(tx)
    })
}

/// One running process (a control-plane component or an operator under test) with its log
/// file; it dies with the test process.
#[derive(Debug)]
pub struct Component {
    /// The name it was started under (also its log file's name).
    pub name: String,
    /// Where its stdout and stderr go.
    pub log: PathBuf,
    child: Child,
    program: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    dir: PathBuf,
}

impl Component {
    /// Starts `program args...` with stdout and stderr appended to `<dir>/<name>.log`.
    pub fn start(name: &str, program: &Path, args: &[String], dir: &Path) -> Result<Component> {
        Self::start_with_env(name, program, args, &[], dir)
    }

    /// [`Component::start`] with extra environment variables (an operator under test: its
    /// `KUBECONFIG`, `POD_NAME`).
    pub fn start_with_env(
        name: &str,
        program: &Path,
        args: &[String],
        env: &[(String, String)],
        dir: &Path,
    ) -> Result<Component> {
        let log = dir.join(format!("{name}.log"));
        let file = std::fs::OpenOptions::new().create(true).append(true).open(&log)?;
        let mut cmd = Command::new("setpriv");
        cmd.arg("--pdeathsig")
            .arg("KILL")
            .arg("--")
            .arg(program)
            .args(args)
            .current_dir(dir)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file);
        let (tx, rx) = mpsc::channel();
        spawner()
            .lock()
            .map_err(|_| Error::Setup("testenv spawner lock poisoned".into()))?
            .send((cmd, tx))
            .map_err(|_| Error::Setup("testenv spawner thread is gone".into()))?;
        let child = rx
            .recv()
            .map_err(|_| Error::Setup("testenv spawner thread is gone".into()))?
            .map_err(|e| Error::Setup(format!("starting {name} ({}): {e}", program.display())))?;
        Ok(Component {
            name: name.to_string(),
            log,
            child,
            program: program.to_path_buf(),
            args: args.to_vec(),
            env: env.to_vec(),
            dir: dir.to_path_buf(),
        })
    }

    /// Stops the process (SIGTERM, SIGKILL after `grace`) and starts it again with the same
    /// arguments, appending to the same log.
    pub fn restart(&mut self, grace: Duration) -> Result<()> {
        self.stop(grace);
        let again = Component::start_with_env(&self.name, &self.program, &self.args, &self.env, &self.dir)?;
        // The old value's Drop finds its child already reaped.
        let _ = std::mem::replace(self, again);
        Ok(())
    }

    /// Sends `signal` to the process (SIGSTOP to freeze it, SIGCONT to let it run again).
    pub fn signal(&self, signal: Signal) -> Result<()> {
        kill(Pid::from_raw(self.child.id() as i32), signal)
            .map_err(|e| Error::Setup(format!("signalling {}: {e}", self.name)))
    }

    /// Whether the process has exited (and how), without waiting.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Returns an error naming the component with its log tail if it has exited.
    pub fn check_running(&mut self) -> Result<()> {
        match self.child.try_wait()? {
            None => Ok(()),
            Some(status) => Err(self.failure(format!("exited with {status}"))),
        }
    }

    /// Builds an error that names this component and carries the tail of its log.
    pub fn failure(&self, reason: String) -> Error {
        Error::Component {
            component: self.name.clone(),
            reason,
            log: self.log.display().to_string(),
            tail: log_tail(&self.log, 25),
        }
    }

    /// Process id, for callers that signal it themselves.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGTERM, then SIGKILL if it has not exited within `grace`.
    pub fn stop(&mut self, grace: Duration) {
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        let pid = Pid::from_raw(self.child.id() as i32);
        let _ = kill(pid, Signal::SIGTERM);
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Component {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(5));
    }
}

/// The last `lines` lines of a log file (or a note that it cannot be read).
pub fn log_tail(path: &Path, lines: usize) -> String {
    match std::fs::read_to_string(path) {
        Ok(s) => {
            let all: Vec<&str> = s.lines().collect();
            all[all.len().saturating_sub(lines)..].join("\n")
        }
        Err(e) => format!("(cannot read {}: {e})", path.display()),
    }
}

/// A TCP port on 127.0.0.1 that was free a moment ago, for a component to listen on.
///
/// Taken below the kernel's ephemeral range where there is room: a port handed out by the
/// kernel (`bind(0)`) is also what outgoing connections use, so between this check and the
/// component's own bind an apiserver-to-etcd connection can take it ("address already in
/// use"). Below that range only another listener can, and the random start makes two
/// control planes booting at once unlikely to meet.
pub fn free_port() -> Result<u16> {
    const LOW: u16 = 10_000;
    let ephemeral_start = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768);
    if ephemeral_start > LOW + 1_000 {
        let span = u32::from(ephemeral_start - LOW);
        let start = random_u32()? % span;
        for i in 0..span.min(2_000) {
            let port = LOW + ((start + i) % span) as u16;
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return Ok(port);
            }
        }
    }
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

fn random_u32() -> Result<u32> {
    use std::io::Read;
    let mut buf = [0u8; 4];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut buf)?;
    Ok(u32::from_le_bytes(buf))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_are_bindable_and_outside_the_ephemeral_range() {
        let start: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap();
        for _ in 0..20 {
            let port = free_port().unwrap();
            std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
            if start > 11_000 {
                assert!(
                    (10_000..start).contains(&port),
                    "port {port}, ephemeral from {start}"
                );
            }
        }
    }

    #[test]
    fn a_component_that_exits_is_reported_by_name_with_its_log_tail() {
        let dir = std::env::temp_dir().join(format!("opkit-testenv-proc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let args = vec![
            "-c".to_string(),
            "echo 'flag provided but not defined: -bogus' >&2; exit 3".to_string(),
        ];
        let mut c = Component::start("fake-apiserver", Path::new("/bin/sh"), &args, &dir).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let err = loop {
            if let Err(e) = c.check_running() {
                break e.to_string();
            }
            assert!(Instant::now() < deadline, "the process never exited");
            std::thread::sleep(Duration::from_millis(10));
        };
        assert!(err.contains("fake-apiserver failed to start"), "{err}");
        assert!(err.contains("exit status: 3"), "{err}");
        assert!(err.contains("flag provided but not defined: -bogus"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn dropping_a_component_stops_its_process() {
        let dir = std::env::temp_dir().join(format!("opkit-testenv-drop-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let c = Component::start("sleeper", Path::new("/bin/sleep"), &["600".to_string()], &dir).unwrap();
        let pid = Pid::from_raw(c.pid() as i32);
        assert!(kill(pid, None).is_ok(), "the process should be running");
        drop(c);
        assert!(kill(pid, None).is_err(), "the process should be gone after drop");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
