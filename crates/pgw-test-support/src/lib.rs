//! Test helpers shared by the pgw crates.
//!
//! Redis tests run against real servers started by `cargo xtask test`, which exports
//! `REDIS_URL` (a standalone server) and `REDIS_CLUSTER_NODES` (a comma-separated list
//! of the nodes of a 3-node cluster). A test that needs Redis and finds none **fails**
//! with a message saying how to run it; it never passes silently. The only way to skip
//! is to say so explicitly with `PGW_SKIP_REDIS=1`, which is refused when `CI` is set.

use std::env;

const HOW: &str = "run the suite with `cargo xtask test`, which starts a throwaway Redis \
                   and a 3-node cluster on loopback and exports REDIS_URL and REDIS_CLUSTER_NODES";

fn skip_allowed(var: &str) -> bool {
    let ci = env::var_os("CI").is_some_and(|v| !v.is_empty() && v != "0" && v != "false");
    let skip = env::var_os("PGW_SKIP_REDIS").is_some_and(|v| v == "1");
    if ci || !skip {
        panic!("{var} is not set: this test needs a real Redis; {HOW}");
    }
    eprintln!("{var} is not set and PGW_SKIP_REDIS=1: skipping this Redis test");
    true
}

/// The URL of the standalone test Redis (`REDIS_URL`).
///
/// Returns `None` only when `PGW_SKIP_REDIS=1` is set outside CI; otherwise a missing
/// server makes the calling test panic with instructions.
#[must_use]
pub fn redis_url() -> Option<String> {
    match env::var("REDIS_URL") {
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            skip_allowed("REDIS_URL");
            None
        }
    }
}

/// The node URLs of the 3-node test cluster (`REDIS_CLUSTER_NODES`, comma-separated).
///
/// Same contract as [`redis_url`].
#[must_use]
pub fn redis_cluster_nodes() -> Option<Vec<String>> {
    match env::var("REDIS_CLUSTER_NODES") {
        Ok(nodes) if !nodes.is_empty() => Some(
            nodes
                .split(',')
                .map(|n| {
                    let n = n.trim();
                    if n.starts_with("redis://") {
                        n.to_owned()
                    } else {
                        format!("redis://{n}")
                    }
                })
                .collect(),
        ),
        _ => {
            skip_allowed("REDIS_CLUSTER_NODES");
            None
        }
    }
}

/// A key prefix unique to this test run and name, so tests sharing one server never
/// see each other's keys.
#[must_use]
pub fn unique_prefix(test: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    format!("pgwtest:{}:{}:{test}:{n}", std::process::id(), nanos())
}

fn nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// A `redis-server` of one test's own on a free loopback port, for tests that stop and
/// restart the server (outage tests must never touch the shared servers). Killed on
/// drop.
///
/// The binary is `redis-server` next to `PGW_REDIS_CLI` (exported by `cargo xtask
/// test`), else from `PATH`.
#[derive(Debug)]
pub struct PrivateRedis {
    port: u16,
    child: Option<std::process::Child>,
}

impl PrivateRedis {
    /// Starts a server on a free port and waits until it answers `PING`.
    ///
    /// # Panics
    /// When `redis-server` cannot be started or does not answer within 5 s: the test
    /// cannot run, and must say so.
    #[must_use]
    pub fn start() -> Self {
        // A port found free may be taken before the server binds it (by another
        // test's server, or as a client connection's local port): the server then
        // exits, and another server may answer on that port. So: another port.
        for _ in 0..20 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map(|a| a.port())
                .expect("a free loopback port");
            let mut me = Self { port, child: None };
            if me.try_start() {
                return me;
            }
        }
        panic!("no private redis-server of this test answered on 20 ports in a row");
    }

    /// The server's port.
    #[must_use]
    pub const fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:PORT`.
    #[must_use]
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Starts the server again on the same port (after [`stop`](Self::stop)).
    ///
    /// # Panics
    /// As [`start`](Self::start).
    pub fn restart(&mut self) {
        assert!(
            self.try_start(),
            "private redis-server could not start again on port {}",
            self.port
        );
    }

    /// Starts the server on its port; `true` once that server, the child started
    /// here and no other process, answers `PING` (checked by its `process_id`).
    fn try_start(&mut self) -> bool {
        self.stop();
        let child = std::process::Command::new(redis_server_bin())
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
            ])
            .args([
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
                "--loglevel",
                "warning",
            ])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start redis-server ({e}); {HOW}"));
        let pid = child.id();
        self.child = Some(child);
        for _ in 0..500 {
            if let Some(c) = &mut self.child
                && c.try_wait().is_ok_and(|exited| exited.is_some())
            {
                // It exited: the port was not free after all.
                self.child = None;
                return false;
            }
            if ping(self.port) {
                let ours = query(self.port, "INFO server")
                    .is_ok_and(|info| info.lines().any(|l| l.trim() == format!("process_id:{pid}")));
                if !ours {
                    self.stop();
                }
                return ours;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        panic!("private redis-server on port {} never answered PING", self.port);
    }

    /// How many times the server has run command `cmd` (lowercase, as `INFO
    /// commandstats` names it: `evalsha`, `pexpire`; commands Lua scripts run
    /// included), 0 when never. Round trips are counted by the client commands, e.g.
    /// `evalsha`.
    ///
    /// # Panics
    /// When the server does not answer `INFO commandstats`.
    #[must_use]
    pub fn command_calls(&self, cmd: &str) -> u64 {
        let info = self.query("INFO commandstats");
        let prefix = format!("cmdstat_{cmd}:calls=");
        info.lines()
            .find_map(|l| l.trim().strip_prefix(prefix.as_str()))
            .and_then(|rest| rest.split(',').next())
            .map_or(0, |n| n.parse().unwrap_or(0))
    }

    /// The remaining time to live of `key` in milliseconds (`PTTL`: -1 without one,
    /// -2 when the key does not exist).
    ///
    /// # Panics
    /// When the server does not answer.
    #[must_use]
    pub fn pttl(&self, key: &str) -> i64 {
        let reply = self.query(&format!("PTTL {key}"));
        reply
            .parse()
            .unwrap_or_else(|_| panic!("PTTL {key}: unexpected reply {reply:?}"))
    }

    /// One inline command's reply (a bulk string's text, an integer's digits).
    fn query(&self, line: &str) -> String {
        query(self.port, line).unwrap_or_else(|e| panic!("{line} on port {}: {e}", self.port))
    }

    /// Stops the server without closing anything (`SIGSTOP`): connections stay open
    /// and nothing is answered, as from a server that hangs or a network that drops
    /// packets, until [`thaw`](Self::thaw).
    ///
    /// # Panics
    /// When the server is not running or the signal cannot be sent.
    pub fn freeze(&self) {
        self.signal("-STOP");
    }

    /// Lets a [`freeze`](Self::freeze)d server run again (`SIGCONT`).
    ///
    /// # Panics
    /// As [`freeze`](Self::freeze).
    pub fn thaw(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, sig: &str) {
        let pid = self
            .child
            .as_ref()
            .expect("the private redis-server is running")
            .id();
        let status = std::process::Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .unwrap_or_else(|e| panic!("kill {sig} {pid}: {e}"));
        assert!(status.success(), "kill {sig} {pid}: {status}");
    }

    /// Kills the server (an outage).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.stop();
    }
}

fn redis_server_bin() -> std::path::PathBuf {
    if let Some(cli) = env::var_os("PGW_REDIS_CLI") {
        let sibling = std::path::PathBuf::from(cli).with_file_name("redis-server");
        if sibling.exists() {
            return sibling;
        }
    }
    "redis-server".into()
}

/// One inline command (words separated by spaces) over a plain connection, and its
/// reply: a bulk string's text or an integer's digits; any other reply is an error.
fn query(port: u16, line: &str) -> std::io::Result<String> {
    use std::io::{BufRead, BufReader, Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))?;
    s.write_all(format!("{line}\r\n").as_bytes())?;
    let mut reader = BufReader::new(s);
    let mut header = String::new();
    reader.read_line(&mut header)?;
    let header = header.trim_end();
    if let Some(n) = header.strip_prefix(':') {
        return Ok(n.to_owned());
    }
    let len: usize = header
        .strip_prefix('$')
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("unexpected reply {header:?}")))?;
    let mut body = vec![0; len];
    reader.read_exact(&mut body)?;
    String::from_utf8(body).map_err(std::io::Error::other)
}

fn ping(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(std::time::Duration::from_millis(200)));
    let mut buf = [0u8; 16];
    s.write_all(b"PING\r\n").is_ok() && s.read(&mut buf).is_ok_and(|n| buf[..n].starts_with(b"+PONG"))
}

#[cfg(test)]
mod tests {
    use super::PrivateRedis;

    /// A server started on a port another test's server already holds is not taken
    /// for this test's own: it exits (the port is in use), and the server answering
    /// there has another `process_id`. Before, `PING` from the other server passed,
    /// and the test used a server that went away when its owner ended.
    #[test]
    fn a_port_already_served_is_not_taken_for_ours() {
        let first = PrivateRedis::start();
        let mut second = PrivateRedis {
            port: first.port(),
            child: None,
        };
        assert!(!second.try_start(), "another test's server taken for ours");
        assert!(second.child.is_none());
        // And `start` finds a port of its own.
        let third = PrivateRedis::start();
        assert_ne!(third.port(), first.port());
    }
}
