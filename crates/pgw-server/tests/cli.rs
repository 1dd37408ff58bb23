//! The `pgw` binary: `check` names the bad field and redacts secrets, `hash-key`.

use std::io::Write;
use std::process::{Command, Stdio};

const GOOD: &str = r#"
[server]
listen = "127.0.0.1:8080"

[[server.keys]]
label = "team-a"
sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"

[[sources]]
name = "s1"
base_url = "http://127.0.0.1:1/v1"
key = "sk-secret-upstream-key-123"
"#;

fn file(name: &str, text: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("pgw-cli-{}-{name}.toml", std::process::id()));
    std::fs::write(&path, text).unwrap();
    path
}

fn pgw(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_pgw"))
        .args(args)
        .env_remove("PGW__SERVER__LISTEN")
        .output()
        .unwrap()
}

#[test]
fn check_prints_the_effective_config_without_secrets() {
    let path = file("good", GOOD);
    let out = pgw(&["check", "--config", path.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("max_connections: 1024"),
        "defaults are filled in: {stdout}"
    );
    assert!(stdout.contains("team-a"), "{stdout}");
    // The gateway's defaults too, not `None`: the retry loop's, a source's timeouts.
    assert!(stdout.contains("max_attempts: 3"), "{stdout}");
    assert!(stdout.contains("first_token"), "{stdout}");
    assert!(!stdout.contains("sk-secret-upstream-key-123"), "{stdout}");
    assert!(!stdout.contains("9f86d081884c7d659a2feaa0c55ad015"), "{stdout}");
}

#[test]
fn check_names_the_bad_field_and_fails() {
    for (bad, field) in [
        (
            GOOD.replace("listen = \"127.0.0.1:8080\"", "max_in_flight = 0"),
            "server.max_in_flight",
        ),
        (
            GOOD.replace("sha256 = \"9f86", "sha256 = \"zz86"),
            "server.keys[0].sha256",
        ),
        (
            GOOD.replace("key = \"sk-secret-upstream-key-123\"", "rpm = -1\nkey = \"k\""),
            "sources[0].rpm",
        ),
        (
            GOOD.replace("[[sources]]", "[[sources]]\nbogus = 1"),
            "sources[0].bogus",
        ),
        (
            GOOD.replace("[server]", "[server]\nmax_body_bytes = \"big\""),
            "server.max_body_bytes",
        ),
        // What only the layers used to check, when `serve` built them.
        (
            format!("{GOOD}\n[breaker]\ncooldown_s = -3\n"),
            "breaker.cooldown_s",
        ),
        (
            format!("{GOOD}\n[aimd]\ndecrease_factor = 5\n"),
            "aimd.decrease_factor",
        ),
    ] {
        let path = file("bad", &bad);
        let out = pgw(&["check", "--config", path.to_str().unwrap()]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains(&format!("field: {field}")), "{field}: {stderr}");
        assert!(!stderr.contains("sk-secret-upstream-key-123"), "{stderr}");
    }
    let out = pgw(&["check", "--config", "/nonexistent/pgw.toml"]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--config /nonexistent/pgw.toml: cannot read it"),
        "{stderr}"
    );
}

fn without_keys(listen: &str) -> String {
    GOOD.replace("listen = \"127.0.0.1:8080\"", &format!("listen = \"{listen}\""))
        .replace(
            "[[server.keys]]\nlabel = \"team-a\"\nsha256 = \"9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08\"\n",
            "",
        )
}

#[test]
fn check_refuses_what_serve_refuses_a_public_address_without_keys() {
    let path = file("check-public", &without_keys("0.0.0.0:8080"));
    let out = pgw(&["check", "--config", path.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("field: server.listen"), "{stderr}");
    assert!(stderr.contains("--allow-unauthenticated"), "{stderr}");
    let out = pgw(&[
        "check",
        "--config",
        path.to_str().unwrap(),
        "--allow-unauthenticated",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // The same flag as serve's: a loopback config checked for a public address.
    let path = file("check-loopback", &without_keys("127.0.0.1:8080"));
    let out = pgw(&[
        "check",
        "--config",
        path.to_str().unwrap(),
        "--listen",
        "0.0.0.0:9",
    ]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn check_into_a_closed_pipe_does_not_panic() {
    let path = file("pipe", GOOD);
    let mut child = Command::new(env!("CARGO_BIN_EXE_pgw"))
        .args(["check", "--config", path.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take()); // `| head -0`
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn serve_names_a_bad_log_filter_and_the_address_it_cannot_listen_on() {
    // 192.0.2.1 (TEST-NET-1) is no address of this machine: binding it fails at once.
    let path = file("unbindable", &without_keys("192.0.2.1:9"));
    let serve = |rust_log: &str| {
        Command::new(env!("CARGO_BIN_EXE_pgw"))
            .args([
                "serve",
                "--allow-unauthenticated",
                "--config",
                path.to_str().unwrap(),
            ])
            .env("RUST_LOG", rust_log)
            .env_remove("PGW__SERVER__LISTEN")
            .output()
            .unwrap()
    };
    let out = serve("not a valid=filter[");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("RUST_LOG=\"not a valid=filter[\" is not a log filter"),
        "{stderr}"
    );
    let out = serve("info");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("cannot listen on 192.0.2.1:9"), "{stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        format!("{stdout}{stderr}").matches("cannot listen").count(),
        1,
        "said once: {stdout}{stderr}"
    );
    assert!(stdout.contains("pgw starting"), "{stdout}");
    assert!(
        !stdout.contains('\u{1b}'),
        "no colour codes off a terminal: {stdout:?}"
    );
}

#[test]
fn hash_key_from_the_argument_or_standard_input() {
    let out = pgw(&["hash-key", "test"]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_pgw"))
        .arg("hash-key")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"test\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        pgw_server::hash_key("test")
    );
}

#[test]
fn serve_refuses_a_public_address_without_keys() {
    let text = GOOD
        .replace("listen = \"127.0.0.1:8080\"", "listen = \"0.0.0.0:0\"")
        .replace("[[server.keys]]\nlabel = \"team-a\"\nsha256 = \"9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08\"\n", "");
    let path = file("public", &text);
    let out = pgw(&["serve", "--config", path.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("--allow-unauthenticated"), "{stderr}");
}

/// A second SIGINT while `pgw serve` drains a call ends it at once with exit code
/// 130; the first only starts the drain (here of a call whose upstream never answers,
/// with a grace of ten minutes).
#[cfg(unix)]
#[test]
fn a_second_signal_ends_the_drain_at_once() {
    use std::io::{BufRead, BufReader};
    use std::net::{TcpListener, TcpStream};
    // An upstream that accepts and never answers: the call stays in flight.
    let upstream = TcpListener::bind("127.0.0.1:0").unwrap();
    let up = upstream.local_addr().unwrap();
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let cfg = format!(
        "[server]\nlisten = \"127.0.0.1:{port}\"\nshutdown_grace_s = 600\n\n[cache]\nenabled = false\n\n\
         [[sources]]\nname = \"s1\"\nbase_url = \"http://{up}/v1\"\nkey = \"k\"\n"
    );
    let path = file("drain", &cfg);
    let mut child = Command::new(env!("CARGO_BIN_EXE_pgw"))
        .args(["serve", "--config", path.to_str().unwrap()])
        .env("RUST_LOG", "info")
        .env_remove("PGW__SERVER__LISTEN")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    // A bound on a hung test, not a timing assertion: the child is killed after 120 s.
    let (done, bound) = std::sync::mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        if matches!(
            bound.recv_timeout(std::time::Duration::from_secs(120)),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout)
        ) {
            let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
        }
    });
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut log = String::new();
    wait_for(&mut lines, &mut log, "serving");
    let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
    let mut client = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        client,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // In flight once the gateway connected to the upstream.
    let (_held, _) = upstream.accept().unwrap();
    let interrupt = || {
        let ok = Command::new("kill")
            .args(["-INT", &pid.to_string()])
            .status()
            .unwrap();
        assert!(ok.success());
    };
    interrupt();
    wait_for(&mut lines, &mut log, "draining");
    assert!(
        child.try_wait().unwrap().is_none(),
        "the first signal only drains: {log}"
    );
    interrupt();
    let status = child.wait().unwrap();
    drop(done);
    watchdog.join().unwrap();
    assert_eq!(status.code(), Some(130), "{status:?}: {log}");
    wait_for(&mut lines, &mut log, "second signal: exiting now");
}

/// Reads log lines into `log` until one contains `what`.
fn wait_for(lines: &mut impl Iterator<Item = std::io::Result<String>>, log: &mut String, what: &str) {
    loop {
        let Some(line) = lines.next() else {
            panic!("no {what:?} in the log: {log}");
        };
        let line = line.unwrap();
        log.push_str(&line);
        log.push('\n');
        if line.contains(what) {
            return;
        }
    }
}
