//! The `pgw-soak` command line refuses what it would otherwise ignore or misread: each
//! case fails before any traffic runs, naming the flag.

use std::process::Command;

fn soak(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_pgw-soak"))
        .args(args)
        .arg("--no-progress")
        .env_remove("REDIS_URL")
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn flags_it_would_ignore_or_misread_are_refused() {
    let dir = std::env::temp_dir().join(format!("pgw-soak-cli-{}", std::process::id()));
    let out = dir.join("never");
    let out = out.to_str().unwrap();
    for (args, says) in [
        // --rescore re-judges the stored run: every other flag was ignored.
        (
            vec!["--rescore", "/nonexistent", "--calls", "5"],
            "cannot be used with",
        ),
        (
            vec!["--profiles", "pgw,pgw", "--calls", "5", "--out", out],
            "listed twice",
        ),
        (
            vec!["--redis-url", "redis://127.0.0.1:1", "--out", out],
            "only with --backend redis",
        ),
        (
            vec!["--key-prefix", "x", "--out", out],
            "only with --backend redis",
        ),
        // 1 passed the flag and left pgw unbuilt, the run "passing" without it.
        (vec!["--balance-choices", "1", "--out", out], "at least 2"),
        (
            vec!["--calls", "18446744073709551615", "--out", out],
            "calls: must be within",
        ),
        // workers x concurrency overflowed u32: a panic where the profiles count them.
        (
            vec!["--workers", "4294967295", "--concurrency", "2", "--out", out],
            "workers x concurrency: at most",
        ),
    ] {
        let (code, stderr) = soak(&args);
        assert!(matches!(code, Some(1 | 2)), "{args:?}: {code:?} {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
    assert!(!dir.join("never").exists(), "nothing written for a refused run");
}
