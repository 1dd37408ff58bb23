//! What each layer crate is given: the gateway's config sections as each crate's own
//! configuration, defaults filled in and errors naming the gateway's field.

use std::time::Duration;

use tower_aimd::AimdConfig;
use tower_breaker_window::BreakerConfig;
use tower_health_p2c::{BalanceConfig, Policy};
use tower_ratelimit_redis::{Quota, RateLimitConfig};
use tower_retry_pushback::{RetryBudgetConfig, RetryConfig, ThrottleConfig};

use crate::config::{
    Choices, ConfigError, DEFAULT_COOLDOWN_S, DEFAULT_FAIL_THRESHOLD, GatewayConfig, SourceConfig,
    config_error, quota, secs, secs_or_off,
};

/// The deadline of a call when neither the config (`retry.max_call_duration_s`) nor
/// the call ([`tower_retry_pushback::CallDeadline`], the server's timeout header)
/// gives one: every call has a deadline (DESIGN section 7). It is the OpenAI SDKs'
/// own default timeout (600 s), past which such a caller waiting for an answer has
/// given up; it bounds the call until its answer starts, not a stream in progress
/// (the SDKs' timeout is per read: a stream may run longer).
pub const DEFAULT_MAX_CALL_DURATION: Duration = Duration::from_secs(600);

pub(crate) fn retry_config(cfg: &GatewayConfig) -> Result<RetryConfig, ConfigError> {
    let r = &cfg.retry;
    let d = RetryConfig::default();
    let c = RetryConfig {
        max_attempts: r.max_attempts.unwrap_or(d.max_attempts),
        max_reasks: r.max_reasks.unwrap_or(d.max_reasks),
        base_backoff: secs("retry.base_backoff_s", r.base_backoff_s)?.unwrap_or(d.base_backoff),
        max_backoff: secs("retry.max_backoff_s", r.max_backoff_s)?.unwrap_or(d.max_backoff),
        stall_window: secs("retry.stall_window_s", r.stall_window_s)?.unwrap_or(d.stall_window),
        max_pushback_wait: secs("retry.max_pushback_wait_s", r.max_pushback_wait_s)?
            .unwrap_or(d.max_pushback_wait),
        max_call_duration: secs("retry.max_call_duration_s", r.max_call_duration_s)?.or(d.max_call_duration),
        retry_budget: match &r.budget {
            None => None,
            Some(b) => {
                let d = RetryBudgetConfig::default();
                Some(RetryBudgetConfig {
                    ratio: b.ratio.unwrap_or(d.ratio),
                    min_retries_per_sec: b.min_retries_per_sec.unwrap_or(d.min_retries_per_sec),
                    ttl: secs("retry.budget.ttl_s", b.ttl_s)?.unwrap_or(d.ttl),
                })
            }
        },
        throttle: match &r.throttle {
            None => None,
            Some(t) => {
                let d = ThrottleConfig::default();
                Some(ThrottleConfig {
                    k: t.k.unwrap_or(d.k),
                    window: secs("retry.throttle.window_s", t.window_s)?.unwrap_or(d.window),
                })
            }
        },
    };
    c.validate()
        .map_err(|e| config_error(format!("retry.{}", retry_field(e.field())), e.to_string()))?;
    Ok(c)
}

/// Every layer's configuration as the builder derives it, checked by the layer's own
/// rules (the derivation [`effective`] prints: one piece of code for both). Errors
/// name the gateway's field.
pub(crate) fn check_layers(cfg: &GatewayConfig) -> Result<(), ConfigError> {
    effective(cfg).map(drop)
}

/// What each layer is given, every default filled in, as text: the retry loop, the
/// balancer, the cache, then per source its client settings (timeouts; key redacted),
/// breaker, AIMD limit and rate limits, each checked by the layer's own rules.
/// `pgw check` prints it: the sections of the file leave a default as `None`.
pub(crate) fn effective(cfg: &GatewayConfig) -> Result<String, ConfigError> {
    use std::fmt::Write as _;
    let mut out = String::new();
    let prefix = cfg
        .key_prefix
        .clone()
        .unwrap_or_else(|| crate::config::DEFAULT_KEY_PREFIX.to_owned());
    let _ = writeln!(out, "backend: {:?}, key_prefix: {prefix:?}", cfg.backend);
    let _ = writeln!(out, "retry: {:#?}", retry_config(cfg)?);
    // `choices: all` as the config writes it, not `CHOICES_ALL`'s `usize::MAX`.
    let balance = format!("{:#?}", balance_config(cfg)?).replace(
        &format!("choices: {},", tower_health_p2c::CHOICES_ALL),
        "choices: all,",
    );
    let _ = writeln!(out, "balance: {balance}");
    let ttl = secs("cache.ttl_s", cfg.cache.ttl_s)?
        .unwrap_or_else(|| Duration::from_secs_f64(crate::config::DEFAULT_CACHE_TTL_S));
    let _ = writeln!(
        out,
        "cache: enabled {}, when {:?}, ttl {ttl:?}, closed view of the breaker {:?}",
        cfg.cache.enabled,
        cfg.cache.when,
        secs_or_off("breaker.closed_view_s", cfg.breaker.closed_view_s)?
            .unwrap_or(tower_breaker_window::DEFAULT_CLOSED_VIEW),
    );
    for (i, sc) in cfg.sources.iter().enumerate() {
        let at = format!("sources[{i}]");
        let settings = sc.settings(&at)?;
        let max_conc = quota(&format!("{at}.max_concurrency"), sc.max_concurrency)?;
        let breaker = breaker_config(cfg, max_conc, settings.timeouts.total)?;
        let _ = writeln!(out, "{at} ({}):", sc.name);
        let _ = writeln!(out, "  client: {settings:#?}");
        let _ = writeln!(out, "  quota hold: {:?}", quota_hold(cfg, &breaker)?);
        let _ = writeln!(out, "  breaker: {breaker:#?}");
        let aimd = aimd_config(cfg, max_conc);
        aimd.validate().map_err(|e| aimd_error(&at, &e))?;
        let _ = writeln!(out, "  aimd: {aimd:#?}");
        let _ = writeln!(
            out,
            "  rate limit: {:#?}",
            rate_limit_config(cfg, sc, &at, &prefix)?
        );
    }
    Ok(out)
}

/// An error of tower-aimd's configuration of the source `at`, naming the gateway's
/// field: `aimd.FIELD`, or the source's `max_concurrency` (the AIMD ceiling).
pub(crate) fn aimd_error(at: &str, e: &ConfigError) -> ConfigError {
    let field = match e.field() {
        "max_concurrency" => format!("{at}.max_concurrency"),
        f => format!("aimd.{f}"),
    };
    config_error(field, e.reason().to_owned())
}

/// A field of tower-retry-pushback's `RetryConfig` as this crate's config names it.
fn retry_field(field: &str) -> String {
    match field {
        "retry_budget.ratio" => "budget.ratio".into(),
        "retry_budget.ttl" => "budget.ttl_s".into(),
        "throttle.k" => "throttle.k".into(),
        "throttle.window" => "throttle.window_s".into(),
        "base_backoff" | "max_backoff" | "stall_window" | "max_pushback_wait" | "max_call_duration" => {
            format!("{field}_s")
        }
        other => other.to_owned(),
    }
}

/// A duration where 0 turns the feature off: the configured one, else the default.
fn off_or(configured: Option<Duration>, default: Option<Duration>) -> Option<Duration> {
    match configured {
        Some(d) if d.is_zero() => None,
        Some(d) => Some(d),
        None => default,
    }
}

/// How many sources the gateway's balancer compares for an attempt's first candidate
/// unless `balance.choices` says otherwise: all of them
/// ([`CHOICES_ALL`](tower_health_p2c::CHOICES_ALL)), where tower-health-p2c alone
/// draws two. An LLM pool mixes sources of unlike speed (a provider's fast and slow
/// deployments, a small model beside a large one); of eight, two drawn hold neither of
/// the two fast ones more than half the time. On the soak (30 seeds) the best of all
/// took pgw's goodput against the oracle's from x0.83 to x0.86 on mixed-8-sources
/// (seeds under x0.80: 6 -> 1), x0.87 -> x0.88 on P6 (12 seeds), and left the flapping
/// pool, where the best source keeps going bad, at x0.90 (see
/// `tower_health_p2c::BalanceConfig::choices`). Each process ranks by its own view (its
/// calls in flight, its health and latency averages): replicas may all favour the same
/// fast source, held back by its gates (quota, AIMD, breaker) rather than by random
/// draws; `balance.choices = 2` spreads more.
pub const GATEWAY_CHOICES: usize = tower_health_p2c::CHOICES_ALL;

pub(crate) fn balance_config(cfg: &GatewayConfig) -> Result<BalanceConfig, ConfigError> {
    let b = &cfg.balance;
    let d = BalanceConfig::default();
    let policy = match b.policy.as_deref() {
        None | Some("health_aware") => Policy::HealthAware,
        Some("round_robin") => Policy::RoundRobin,
        Some("least_inflight") => Policy::LeastInflight,
        Some(other) => {
            return Err(config_error(
                "balance.policy",
                format!("unknown policy {other:?}"),
            ));
        }
    };
    let c = BalanceConfig {
        policy,
        choices: b.choices.map_or(GATEWAY_CHOICES, Choices::count),
        max_wait: secs("balance.max_wait_s", b.max_wait_s)?.unwrap_or(d.max_wait),
        silent_after: off_or(
            secs_or_off("balance.silent_after_s", b.silent_after_s)?,
            d.silent_after,
        ),
        probe_every: off_or(
            secs_or_off("balance.probe_every_s", b.probe_every_s)?,
            d.probe_every,
        ),
        cut_silent: b.cut_silent.unwrap_or(d.cut_silent),
        ..d
    };
    c.validate().map_err(|e| {
        // The gateway's key of the balancer's field: its durations carry `_s` here.
        let key = match e.field() {
            f @ ("max_wait" | "silent_after" | "probe_every") => format!("balance.{f}_s"),
            f => format!("balance.{f}"),
        };
        config_error(key, e.reason())
    })?;
    Ok(c)
}

/// The breaker of one source. Unless `breaker.probe_ttl_s` says otherwise, a probe's
/// lease outlives the source's longest attempt (`attempt_timeout` plus a tenth): a
/// probe lease shorter than an attempt expires while the probe still runs, a second
/// "single" probe goes out, and the first one's late verdict is fenced off, so a source
/// whose calls take 90 s never left half-open with the old fixed 60 s.
pub(crate) fn breaker_config(
    cfg: &GatewayConfig,
    max_concurrency: Option<u64>,
    attempt_timeout: Duration,
) -> Result<BreakerConfig, ConfigError> {
    let b = &cfg.breaker;
    let mut builder = BreakerConfig::builder()
        .fail_threshold(b.fail_threshold.unwrap_or(DEFAULT_FAIL_THRESHOLD))
        .cooldown(
            secs("breaker.cooldown_s", b.cooldown_s)?.unwrap_or(Duration::from_secs_f64(DEFAULT_COOLDOWN_S)),
        );
    if let Some(n) = max_concurrency {
        builder = builder.max_concurrency(u32::try_from(n).unwrap_or(u32::MAX));
    }
    if let Some(n) = b.min_calls {
        builder = builder.min_calls(n);
    }
    if let Some(r) = b.fail_rate {
        builder = builder.fail_rate(r);
    }
    if let Some(d) = secs("breaker.window_s", b.window_s)? {
        builder = builder.window(d);
    }
    if let Some(d) = secs("breaker.max_cooldown_s", b.max_cooldown_s)? {
        builder = builder.max_cooldown(d);
    }
    match secs("breaker.probe_ttl_s", b.probe_ttl_s)? {
        Some(d) => builder = builder.probe_ttl(d),
        None => {
            let cooldown = secs("breaker.cooldown_s", b.cooldown_s)?
                .unwrap_or(Duration::from_secs_f64(DEFAULT_COOLDOWN_S));
            let outlives = attempt_timeout.saturating_add(attempt_timeout / 10);
            builder = builder.probe_ttl(
                tower_breaker_window::DEFAULT_PROBE_TTL_FLOOR
                    .max(cooldown)
                    .max(outlives),
            );
        }
    }
    builder
        .build()
        .map_err(|e| config_error(format!("breaker.{}", e.field()), e.to_string()))
}

/// How long a source that answered `insufficient_quota` is held
/// (`breaker.quota_hold_s`): by default the breaker's longest open period, its
/// `max_cooldown` (300 s with the defaults), so no failure keeps a source out longer
/// than its account running out of credit does.
pub(crate) fn quota_hold(cfg: &GatewayConfig, breaker: &BreakerConfig) -> Result<Duration, ConfigError> {
    Ok(secs("breaker.quota_hold_s", cfg.breaker.quota_hold_s)?.unwrap_or_else(|| breaker.max_cooldown()))
}

pub(crate) fn aimd_config(cfg: &GatewayConfig, max_concurrency: Option<u64>) -> AimdConfig {
    let a = &cfg.aimd;
    let d = AimdConfig::default();
    AimdConfig {
        initial_limit: a.initial_limit.unwrap_or(d.initial_limit),
        min_limit: a.min_limit.unwrap_or(d.min_limit),
        decrease_factor: a.decrease_factor.unwrap_or(d.decrease_factor),
        tolerated_pushback: a.tolerated_pushback.unwrap_or(d.tolerated_pushback),
        max_concurrency: max_concurrency.map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
        caller_concurrency: a.caller_concurrency,
    }
}

pub(crate) fn rate_limit_config(
    cfg: &GatewayConfig,
    sc: &SourceConfig,
    at: &str,
    prefix: &str,
) -> Result<RateLimitConfig, ConfigError> {
    let q = |rpm: Option<u64>, tpm: Option<u64>, conc: Option<u64>| {
        let mut q = Quota::unlimited();
        if let Some(n) = rpm {
            q = q.requests(n);
        }
        if let Some(n) = tpm {
            q = q.tokens(n);
        }
        if let Some(n) = conc {
            q = q.concurrency(n);
        }
        q
    };
    let source_quota = q(
        quota(&format!("{at}.rpm"), sc.rpm)?,
        quota(&format!("{at}.tpm"), sc.tpm)?,
        quota(&format!("{at}.max_concurrency"), sc.max_concurrency)?,
    );
    let mut c = RateLimitConfig::new(sc.name.as_str(), source_quota).key_prefix(format!("{prefix}:rl"));
    if let Some(account) = &sc.account {
        let a = cfg.accounts.get(account).cloned().unwrap_or_default();
        let at = format!("accounts.{account}");
        let account_quota = q(
            quota(&format!("{at}.rpm"), a.rpm)?,
            quota(&format!("{at}.tpm"), a.tpm)?,
            quota(&format!("{at}.max_concurrency"), a.max_concurrency)?,
        );
        c = c.account(account, account_quota);
    }
    if let Some(d) = secs("ratelimit.window_s", cfg.ratelimit.window_s)? {
        c = c.window(d);
    }
    if let Some(d) = secs("ratelimit.lease_ttl_s", cfg.ratelimit.lease_ttl_s)? {
        c = c.lease_ttl(d);
    }
    // Checked here, by the limiter's own rules, so `pgw check` fails where `pgw serve`
    // would, naming the gateway's field.
    c.validate().map_err(|e| {
        let field = match (e.field(), sc.account.as_deref()) {
            ("source", _) => format!("{at}.name"),
            ("source.requests", _) => format!("{at}.rpm"),
            ("source.tokens", _) => format!("{at}.tpm"),
            ("source.concurrency", _) => format!("{at}.max_concurrency"),
            ("account", _) => format!("{at}.account"),
            ("account.requests", Some(a)) => format!("accounts.{a}.rpm"),
            ("account.tokens", Some(a)) => format!("accounts.{a}.tpm"),
            ("account.concurrency", Some(a)) => format!("accounts.{a}.max_concurrency"),
            ("window" | "sub_windows", _) => "ratelimit.window_s".to_owned(),
            ("lease_ttl", _) => "ratelimit.lease_ttl_s".to_owned(),
            ("key_prefix", _) => "key_prefix".to_owned(),
            (other, _) => format!("ratelimit.{other}"),
        };
        config_error(field, e.reason().to_owned())
    })?;
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_probe_lease_outlives_the_sources_longest_attempt() {
        let cfg = GatewayConfig::default();
        let long = breaker_config(&cfg, None, Duration::from_secs(180)).unwrap();
        assert_eq!(long.probe_ttl(), Duration::from_secs(198));
        // Short attempts keep the floor (60 s, or the cooldown when longer).
        let short = breaker_config(&cfg, None, Duration::from_secs(10)).unwrap();
        assert_eq!(short.probe_ttl(), Duration::from_secs(60));
        let mut set = GatewayConfig::default();
        set.breaker.probe_ttl_s = Some(5.0);
        let set = breaker_config(&set, None, Duration::from_secs(180)).unwrap();
        assert_eq!(set.probe_ttl(), Duration::from_secs(5), "configured wins");
    }

    #[test]
    fn slow_call_cuts_are_on_by_default_and_can_be_turned_off() {
        let on = balance_config(&GatewayConfig::default()).unwrap();
        assert!(on.cut_silent);
        let off = GatewayConfig::from_toml_str(
            "[balance]\ncut_silent = false\n[[sources]]\nname = \"a\"\nbase_url = \"http://127.0.0.1:1/v1\"\nkey = \"sk-a\"\n",
        )
        .unwrap();
        assert!(!balance_config(&off).unwrap().cut_silent);
    }

    /// The gateway compares every source for an attempt's first candidate unless told
    /// a number (at least 2) or `"all"`, in TOML or from the environment; anything else
    /// names the field.
    #[test]
    fn choices_default_to_all_and_take_a_number_or_all() {
        let source = "[[sources]]\nname = \"a\"\nbase_url = \"http://127.0.0.1:1/v1\"\nkey = \"sk-a\"\n";
        let with = |balance: &str| GatewayConfig::from_toml_str(&format!("[balance]\n{balance}\n{source}"));
        let choices = |balance: &str| balance_config(&with(balance).unwrap()).map(|c| c.choices);
        assert_eq!(choices("").unwrap(), tower_health_p2c::CHOICES_ALL);
        assert_eq!(GATEWAY_CHOICES, tower_health_p2c::CHOICES_ALL);
        assert_eq!(
            choices("choices = \"all\"").unwrap(),
            tower_health_p2c::CHOICES_ALL
        );
        assert_eq!(choices("choices = 2").unwrap(), 2);
        assert_eq!(choices("choices = 5").unwrap(), 5);
        // Text reads as a flag's value does.
        assert_eq!(choices("choices = \"3\"").unwrap(), 3);
        // Refused when the config is read (so `pgw check` refuses it too).
        let one = with("choices = 1").unwrap_err();
        assert_eq!(one.field(), "balance.choices", "{one}");
        assert!(one.to_string().contains("at least 2"), "{one}");
        for bad in ["choices = -3", "choices = \"most\"", "choices = 2.5"] {
            let e = with(bad).unwrap_err();
            assert!(e.to_string().contains("choices"), "{bad}: {e}");
            assert!(e.to_string().contains("\"all\""), "{bad}: {e}");
        }
        let env = |v: &str| {
            GatewayConfig::from_toml_str_with_env(
                source,
                [("PGW__BALANCE__CHOICES".to_owned(), v.to_owned())],
            )
            .map(|c| balance_config(&c).unwrap().choices)
        };
        assert_eq!(env("4").unwrap(), 4);
        assert_eq!(env("all").unwrap(), tower_health_p2c::CHOICES_ALL);
        // A flag's value reads the same, and prints as the config writes it.
        for (text, want) in [("all", Choices::All), (" 3 ", Choices::Count(3))] {
            let c: Choices = text.parse().unwrap();
            assert_eq!(c, want);
            assert_eq!(c.to_string(), text.trim());
        }
        let bad = "most".parse::<Choices>().unwrap_err();
        assert_eq!(bad.field(), "balance.choices", "{bad}");
    }
}
