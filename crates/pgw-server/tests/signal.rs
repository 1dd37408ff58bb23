//! `shutdown_signal` listens from its call: a signal sent before the future is first
//! polled is taken by it, not by the default action (which ends the process). In its
//! own test binary: the SIGTERM sent here is this process's.

#[cfg(unix)]
#[tokio::test]
async fn a_signal_sent_before_the_first_poll_is_taken() {
    let shutdown = pgw_server::shutdown_signal();
    // The shell's own `kill` (dash has it built in; `/bin/kill` comes with procps,
    // not on every machine).
    let sent = std::process::Command::new("sh")
        .args(["-c", &format!("kill -TERM {}", std::process::id())])
        .status()
        .expect("sh runs");
    assert!(sent.success());
    // Delivered as `kill`'s wait returns: without a listener, the process would have
    // ended there. Polled for the first time now.
    tokio::time::timeout(std::time::Duration::from_secs(10), shutdown)
        .await
        .expect("the signal, taken");
}
