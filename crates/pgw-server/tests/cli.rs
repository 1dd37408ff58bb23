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
        (GOOD.replace("[[sources]]", "[[sources]]\nbogus = 1"), "bogus"),
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
