//! Bad configuration is a clear error naming the field or the address.

use pgw_stack::{ConfigError, Gateway, GatewayConfig};

const GOOD: &str = r#"
[[sources]]
name = "s1"
base_url = "http://127.0.0.1:9/v1"
key = "sk-config-test-123"
"#;

fn err_of(text: &str) -> ConfigError {
    GatewayConfig::from_toml_str(text).unwrap_err()
}

#[test]
fn unknown_field_is_named() {
    let e = err_of(&format!("{GOOD}rpmm = 5\n"));
    assert_eq!(e.field(), "sources[0].rpmm", "{e}");
    let e = err_of("colour = 1\n");
    assert_eq!(e.field(), "colour");
    let e = err_of(&format!("{GOOD}[retry]\nattempts = 2\n"));
    assert!(e.to_string().contains("attempts"), "{e}");
}

#[test]
fn missing_key_is_named() {
    let e = err_of("[[sources]]\nname = \"s1\"\nbase_url = \"http://h/v1\"\n");
    assert_eq!(e.field(), "sources[0].key");
    let e = err_of(
        "[[sources]]\nname = \"s1\"\nbase_url = \"http://h/v1\"\nkey_env = \"PGW_TEST_SURELY_UNSET_VAR\"\n",
    );
    assert_eq!(e.field(), "sources[0].key_env");
    assert!(e.to_string().contains("PGW_TEST_SURELY_UNSET_VAR"));
    let e = err_of(&format!("{GOOD}key_env = \"PATH\"\n"));
    assert_eq!(e.field(), "sources[0].key_env", "{e}");
    assert!(e.to_string().contains("not both"), "{e}");
    assert!(!e.to_string().contains("sk-config-test"), "{e}");
}

#[test]
fn negative_quota_is_named() {
    let e = err_of(&format!("{GOOD}rpm = -5\n"));
    assert_eq!(e.field(), "sources[0].rpm");
    assert!(e.to_string().contains("-5"));
    let e = err_of(&format!("{GOOD}account = \"a\"\n[accounts.a]\ntpm = -1\n"));
    assert_eq!(e.field(), "accounts.a.tpm");
}

#[test]
fn other_bad_values_are_named() {
    let e = err_of(&format!("{GOOD}first_token_timeout_s = 0\n"));
    assert_eq!(e.field(), "sources[0].first_token_timeout_s");
    let e = err_of(&GOOD.replace("http://127.0.0.1:9/v1", "nope"));
    assert_eq!(e.field(), "sources[0].base_url");
    let e = err_of(&format!("backend = \"redis\"\n{GOOD}"));
    assert_eq!(e.field(), "redis_url");
    let e = err_of(&format!("fallback = [\"ghost\"]\n{GOOD}"));
    assert_eq!(e.field(), "fallback");
    let e = err_of(&format!(
        "{GOOD}[[sources]]\nname = \"s1\"\nbase_url = \"http://h/v1\"\nkey = \"k\"\n"
    ));
    assert_eq!(e.field(), "sources[1].name");
    assert!(err_of("").field() == "sources");
    let e = err_of(&format!("{GOOD}[breaker]\nquota_hold_s = -1\n"));
    assert_eq!(e.field(), "breaker.quota_hold_s", "{e}");
    let e = err_of(&format!("{GOOD}key_header = \"api key\"\n"));
    assert_eq!(e.field(), "sources[0].key_header", "{e}");
    GatewayConfig::from_toml_str(&format!("{GOOD}key_header = \"api-key\"\n")).unwrap();
}

/// What the client or the limiter would refuse at start is refused by the config
/// (`pgw check`), naming the field: a key that is not a valid header value (a secret
/// file's trailing newline), a source quota past the limiter's bound.
#[test]
fn what_serving_would_refuse_is_named_by_the_config() {
    let e = err_of("[[sources]]\nname = \"s1\"\nbase_url = \"http://127.0.0.1:9/v1\"\nkey = \"sk-1\\n\"\n");
    assert_eq!(e.field(), "sources[0].key", "{e}");
    assert!(!e.to_string().contains("sk-1"), "{e}");
    let e = err_of(&format!("{GOOD}rpm = 2000000000000000\n"));
    assert_eq!(e.field(), "sources[0].rpm", "{e}");
}

/// What a layer refuses at build time is refused by the config's own check, so `pgw
/// check` passes nothing `pgw serve` then refuses to start with.
#[test]
fn layer_rules_are_checked_by_the_config() {
    let cases = [
        ("[breaker]\ncooldown_s = -3\n", "breaker.cooldown_s"),
        ("[breaker]\ncooldown_s = nan\n", "breaker.cooldown_s"),
        ("[breaker]\nfail_rate = 7\n", "breaker.fail_rate"),
        ("[breaker]\nfail_threshold = 0\n", "breaker.fail_threshold"),
        ("[breaker]\nwindow_s = -1\n", "breaker.window_s"),
        ("[breaker]\nmax_cooldown_s = -1\n", "breaker.max_cooldown_s"),
        ("[breaker]\nprobe_ttl_s = -1\n", "breaker.probe_ttl_s"),
        ("[retry]\nmax_attempts = 0\n", "retry.max_attempts"),
        (
            "[retry]\nbase_backoff_s = 2\nmax_backoff_s = 1\n",
            "retry.max_backoff_s",
        ),
        ("[balance]\nchoices = 0\n", "balance.choices"),
        ("[aimd]\ndecrease_factor = 5\n", "aimd.decrease_factor"),
        ("[aimd]\ninitial_limit = -1\n", "aimd.initial_limit"),
        // The rate limiter's own rules, named by the gateway's fields.
        ("[ratelimit]\nwindow_s = 0.0005\n", "ratelimit.window_s"),
        ("[ratelimit]\nwindow_s = 60.0001\n", "ratelimit.window_s"),
    ];
    for (section, field) in cases {
        let e = err_of(&format!("{GOOD}{section}"));
        assert_eq!(e.field(), field, "{section}: {e}");
    }
}

#[test]
fn env_overrides_apply_and_are_checked() {
    let env = |k: &str, v: &str| vec![(k.to_owned(), v.to_owned())];
    let c = GatewayConfig::from_toml_str_with_env(GOOD, env("PGW__SOURCES__0__MODEL", "gpt-x")).unwrap();
    assert_eq!(c.sources[0].model.as_deref(), Some("gpt-x"));
    let c = GatewayConfig::from_toml_str_with_env(GOOD, env("PGW__CACHE__ENABLED", "false")).unwrap();
    assert!(!c.cache.enabled);
    let e = GatewayConfig::from_toml_str_with_env(GOOD, env("PGW__SOURCES__0__RPM", "-3")).unwrap_err();
    assert_eq!(e.field(), "sources[0].rpm");
    let e = GatewayConfig::from_toml_str_with_env(GOOD, env("PGW__SOURCES__4__RPM", "3")).unwrap_err();
    assert_eq!(e.field(), "PGW__SOURCES__4__RPM");
    let e = GatewayConfig::from_toml_str_with_env(GOOD, env("PGW__NOPE", "1")).unwrap_err();
    assert_eq!(e.field(), "nope");
}

#[tokio::test]
async fn unreachable_redis_names_the_address() {
    let cfg = GatewayConfig::from_toml_str(&format!(
        "backend = \"redis\"\nredis_url = \"redis://127.0.0.1:1\"\n{GOOD}"
    ))
    .unwrap();
    let e = Gateway::from_config(cfg).await.unwrap_err();
    // Not a config error: the config is fine, Redis is down.
    let e = e
        .downcast_ref::<pgw_core::BackendUnavailable>()
        .unwrap_or_else(|| panic!("backend unavailable: {e}"));
    assert!(e.to_string().contains("127.0.0.1:1"), "{e}");
    assert!(e.to_string().contains("redis_url"), "{e}");
    assert!(!e.to_string().contains("invalid"), "{e}");
}

#[test]
fn redis_password_never_prints() {
    let text = format!("backend = \"redis\"\nredis_url = \"redis://:hunter2-pw@127.0.0.1:6379\"\n{GOOD}");
    let cfg = GatewayConfig::from_toml_str(&text).unwrap();
    let debug = format!("{cfg:?} {:?}", Gateway::builder(cfg.clone()));
    assert!(!debug.contains("hunter2"), "{debug}");
    assert!(!debug.contains("sk-config-test"), "{debug}");
    assert!(debug.contains("127.0.0.1:6379"), "{debug}");
    let e = err_of(&format!("redis_url = \"http://:hunter2-pw@h:1\"\n{GOOD}"));
    assert_eq!(e.field(), "redis_url");
    assert!(!e.to_string().contains("hunter2"), "{e}");
}

#[test]
fn huge_or_non_finite_numbers_are_named_not_panics() {
    let e = err_of(&format!("{GOOD}total_timeout_s = 1e19\n"));
    assert_eq!(e.field(), "sources[0].total_timeout_s", "{e}");
    let e = err_of(&format!("{GOOD}[cache]\nttl_s = 1e300\n"));
    assert_eq!(e.field(), "cache.ttl_s", "{e}");
    let e = err_of(&format!("{GOOD}first_token_timeout_s = nan\n"));
    assert_eq!(e.field(), "sources[0].first_token_timeout_s", "{e}");
    let e = err_of(&format!(
        "{GOOD}[prices.m]\ninput_per_mtok = inf\noutput_per_mtok = 1.0\n"
    ));
    assert_eq!(e.field(), "prices.m", "{e}");
}

#[test]
fn a_source_outside_the_fallback_chain_is_named() {
    let two = format!(
        "{GOOD}group = \"a\"\n[[sources]]\nname = \"s2\"\nbase_url = \"http://h/v1\"\nkey = \"k\"\ngroup = \"b\"\n"
    );
    let e = err_of(&format!("fallback = [\"a\"]\n{two}"));
    assert_eq!(e.field(), "sources[1].group", "{e}");
    let e = err_of(&format!("fallback = [\"a\", \"b\", \"a\"]\n{two}"));
    assert_eq!(e.field(), "fallback", "{e}");
    let e = err_of(&format!("fallback = [\"a\", \"c\"]\n{two}"));
    assert_eq!(e.field(), "fallback", "{e}");
    assert!(GatewayConfig::from_toml_str(&format!("fallback = [\"b\", \"a\"]\n{two}")).is_ok());
}

#[test]
fn a_toml_error_does_not_quote_the_line_holding_a_secret() {
    let e = err_of(
        "[[sources]]\nname = \"s1\"\nbase_url = \"http://h/v1\"\nkey = \"sk-quoted-secret\" rpm = 5\n",
    );
    assert!(!e.to_string().contains("sk-quoted-secret"), "{e}");
    assert!(e.to_string().contains("line 4"), "{e}");
}

/// The durations where 0 means off accept 0 (and build a gateway), and refuse a
/// negative value naming the field.
#[tokio::test]
async fn zero_turns_off_the_closed_view_and_slow_call_detection() {
    let text = format!("{GOOD}[breaker]\nclosed_view_s = 0\n[balance]\nsilent_after_s = 0\n");
    let cfg = GatewayConfig::from_toml_str(&text).expect("0 is off, not an error");
    Gateway::builder(cfg).build().await.expect("builds with both off");
    for field in ["breaker.closed_view_s", "balance.silent_after_s"] {
        let (table, key) = field.split_once('.').unwrap();
        let e = err_of(&format!("{GOOD}[{table}]\n{key} = -1\n"));
        assert_eq!(e.field(), field, "{e}");
    }
}

/// Configuration that would silently do less than it says is an error: an account's
/// quota table no source names (a misspelt `account` ran without its account's
/// quota), and with `[models]`, a source no route names (it would never be used).
#[test]
fn config_that_would_do_nothing_is_named() {
    let e = err_of(&format!("{GOOD}account = \"org-1\"\n[accounts.org1]\nrpm = 10\n"));
    assert_eq!(e.field(), "accounts.org1", "{e}");
    assert!(e.to_string().contains("no source names"), "{e}");
    let two = format!(
        "{GOOD}\n[[sources]]\nname = \"s2\"\nbase_url = \"http://127.0.0.1:9/v1\"\nkey = \"sk-config-test-456\"\n\n[models.m]\nroutes = [{{ source = \"s1\" }}]\n"
    );
    let e = err_of(&two);
    assert_eq!(e.field(), "sources[1]", "{e}");
    assert!(e.to_string().contains("in no route"), "{e}");
    // Both used: fine.
    let ok = two.replace(
        r#"routes = [{ source = "s1" }]"#,
        r#"routes = [{ source = "s1" }, { source = "s2" }]"#,
    );
    GatewayConfig::from_toml_str(&ok).unwrap();
}

/// The memory cache's bounds with the Redis backend would bound nothing: named, not
/// ignored. Without the cache they are moot and accepted.
#[test]
fn memory_cache_bounds_with_the_redis_backend_are_named() {
    let redis = format!("backend = \"redis\"\nredis_url = \"redis://127.0.0.1:1\"\n{GOOD}");
    for (line, field) in [
        ("max_entries = 10", "cache.max_entries"),
        ("max_bytes = 4096", "cache.max_bytes"),
    ] {
        let e = err_of(&format!("{redis}[cache]\n{line}\n"));
        assert_eq!(e.field(), field, "{e}");
        assert!(e.to_string().contains("maxmemory"), "{e}");
        GatewayConfig::from_toml_str(&format!("{redis}[cache]\nenabled = false\n{line}\n")).unwrap();
        GatewayConfig::from_toml_str(&format!("{GOOD}[cache]\n{line}\n")).unwrap();
    }
}
