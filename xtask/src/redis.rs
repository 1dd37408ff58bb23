//! Throwaway Redis servers on loopback: one standalone, one 3-node cluster.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::Result;

const SERVER: &str = "redis-server";
const CLI: &str = "redis-cli";

/// The path of `redis-cli`, for tests that stop and restart a server.
pub(crate) fn cli_path() -> String {
    which(CLI).map_or_else(|| CLI.to_owned(), |p| p.display().to_string())
}

fn which(bin: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(bin))
        .find(|p| p.is_file())
}

/// Installs redis-server and redis-tools from Debian's packages when missing.
fn ensure_installed() -> Result<()> {
    if which(SERVER).is_some() && which(CLI).is_some() {
        return Ok(());
    }
    eprintln!("xtask: redis-server not found; installing redis-server and redis-tools with apt-get");
    let sudo: &[&str] = if is_root() { &[] } else { &["sudo"] };
    let run = |args: &[&str]| -> Result<()> {
        let mut full: Vec<&str> = sudo.to_vec();
        full.extend_from_slice(args);
        let status = Command::new(full[0])
            .args(&full[1..])
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .map_err(|e| format!("cannot run {}: {e}", full.join(" ")))?;
        if status.success() {
            Ok(())
        } else {
            Err(format!("`{}` failed ({status})", full.join(" ")))
        }
    };
    run(&["apt-get", "update", "-qq"])?;
    run(&["apt-get", "install", "-y", "-qq", "redis-server", "redis-tools"])?;
    if which(SERVER).is_none() {
        return Err("apt-get finished but redis-server is still not on PATH".into());
    }
    Ok(())
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// A free loopback port whose cluster bus port (port + 10000) is free too.
fn free_port(taken: &[u16]) -> Result<u16> {
    for _ in 0..200 {
        let l = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("cannot bind loopback: {e}"))?;
        let p = l.local_addr().map_err(|e| e.to_string())?.port();
        if p > 55_000 || taken.contains(&p) {
            continue;
        }
        if TcpListener::bind(("127.0.0.1", p + 10_000)).is_ok() {
            return Ok(p);
        }
    }
    Err("no free loopback port pair found".into())
}

/// Running servers; dropping this stops them (by PID) and removes their files.
pub(crate) struct Servers {
    children: Vec<Child>,
    standalone: u16,
    cluster: Vec<u16>,
    dir: PathBuf,
}

impl Servers {
    pub(crate) fn start() -> Result<Self> {
        ensure_installed()?;
        let dir = std::env::temp_dir().join(format!("pgw-redis-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        let mut servers = Self {
            children: Vec::new(),
            standalone: 0,
            cluster: Vec::new(),
            dir,
        };
        let mut taken = Vec::new();
        servers.standalone = free_port(&taken)?;
        taken.push(servers.standalone);
        servers.spawn(servers.standalone, false)?;
        for _ in 0..3 {
            let p = free_port(&taken)?;
            taken.push(p);
            servers.cluster.push(p);
            servers.spawn(p, true)?;
        }
        for &p in &taken {
            wait_ping(p)?;
        }
        servers.create_cluster()?;
        Ok(servers)
    }

    fn spawn(&mut self, port: u16, cluster: bool) -> Result<()> {
        let mut cmd = Command::new(SERVER);
        cmd.args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .args(["--protected-mode", "no", "--loglevel", "warning"])
        .arg("--dir")
        .arg(&self.dir)
        .args(["--logfile", &format!("redis-{port}.log")]);
        if cluster {
            cmd.args([
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                &format!("nodes-{port}.conf"),
            ])
            .args(["--cluster-node-timeout", "2000"]);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start redis-server on port {port}: {e}"))?;
        self.children.push(child);
        Ok(())
    }

    fn create_cluster(&self) -> Result<()> {
        let nodes: Vec<String> = self.cluster.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let out = Command::new(CLI)
            .arg("--cluster")
            .arg("create")
            .args(&nodes)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("cannot run redis-cli --cluster create: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "redis-cli --cluster create failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        for &p in &self.cluster {
            loop {
                let info = cli(p, &["cluster", "info"]).unwrap_or_default();
                if info.contains("cluster_state:ok") {
                    break;
                }
                if Instant::now() > deadline {
                    return Err(format!("cluster node {p} never reached cluster_state:ok: {info}"));
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        Ok(())
    }

    pub(crate) fn standalone_url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.standalone)
    }

    pub(crate) fn cluster_nodes(&self) -> String {
        self.cluster
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(",")
    }
}

impl Drop for Servers {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn cli(port: u16, args: &[&str]) -> Option<String> {
    let out = Command::new(CLI)
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .ok()?;
    Some(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn wait_ping(port: u16) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if cli(port, &["ping"]).is_some_and(|s| s.trim() == "PONG") {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(format!(
        "redis-server on port {port} did not answer PING within 10 s"
    ))
}

/// `cargo xtask redis`: start, print, wait until killed.
pub(crate) fn serve_forever() -> Result<std::process::ExitCode> {
    let servers = Servers::start()?;
    println!("export REDIS_URL={}", servers.standalone_url());
    println!("export REDIS_CLUSTER_NODES={}", servers.cluster_nodes());
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}
