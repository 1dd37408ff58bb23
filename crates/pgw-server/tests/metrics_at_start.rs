//! The counters a scrape should see from the first one, at 0, before any call: in a
//! process of their own (the recorder is global), so nothing else has touched them.

#[test]
fn counters_are_there_at_zero_before_any_call() {
    let handle = pgw_server::install_metrics().expect("the recorder installs");
    let text = handle.render();
    for series in [
        "pgw_cache_hits_total 0",
        "pgw_cache_misses_total 0",
        "pgw_server_shed_total{reason=\"connections\"} 0",
        "pgw_server_shed_total{reason=\"in_flight\"} 0",
    ] {
        assert!(
            text.lines().any(|l| l == series),
            "{series} missing from:\n{text}"
        );
    }
}
