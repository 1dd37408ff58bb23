//! Quotas, scopes and the limiter's configuration, with the named defaults.

use std::sync::Arc;
use std::time::Duration;

use pgw_core::SourceId;

use crate::error::ConfigError;

/// The longest window or lease TTL: past it, clock arithmetic (tokio instants, Redis
/// expiries) would overflow; no provider quota is longer than a year.
const MAX_PERIOD: Duration = Duration::from_secs(366 * 24 * 3600);

/// Default window length: 60 s, because provider quotas are per minute (RPM, TPM).
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(60);

/// Default number of sub-windows a window is counted in: 60 (one second for a 60 s
/// window).
///
/// Quotas hold over every span of the window's length, not only over aligned windows
/// (a provider counting "10 per minute" counts any minute). The limiter counts each
/// window in sub-windows and, at an admission, sums the whole sub-windows that overlap
/// the span ending now: never less than the span holds, so never over the quota, and a
/// quota that frees comes back at most one sub-window late (1 s of a minute). Memory
/// is bounded by the sub-windows (61 counters per scope and dimension), not by the
/// traffic, as a sliding log's would be (one entry per admission, thousands per scope
/// at a high RPM, and a weighted entry per request for tokens).
pub const DEFAULT_SUB_WINDOWS: u32 = 60;

/// The most sub-windows per window: 1000 (keeps an admission that rolls many
/// sub-windows at once, after an idle spell, to one bounded read).
pub const MAX_SUB_WINDOWS: u32 = 1000;

/// Default concurrency lease TTL: 30 s. A process that dies holds its slots at most
/// this long; a live call renews its lease every [`RENEW_FRACTION`] of it.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(30);

/// A live lease is renewed every `lease_ttl / RENEW_FRACTION` (3: two renewals may be
/// lost before the lease expires under a call that is still running).
pub const RENEW_FRACTION: u32 = 3;

/// `retry_after` reported when every concurrency slot is taken: at most 50 ms.
///
/// A slot frees when some call ends, which no clock predicts; the hint is a polling
/// interval (shorter when the earliest lease expires sooner).
pub const DEFAULT_SLOT_RETRY_AFTER: Duration = Duration::from_millis(50);

/// How stale the holds of a Redis limiter with nothing else to enforce may be: 1 s.
///
/// Such a limiter (no requests, tokens or concurrency quota in any scope) admits from a
/// cache of its holds, without a round trip; a hold set through this process is in the
/// cache at once, one set by another process is read within this time (one read-only
/// round trip per limiter per `hold_refresh / 2` while traffic flows). One second lets
/// at most a second of this process's calls reach a provider that another process was
/// told to leave alone (a 429's `Retry-After` is whole seconds), for a Redis cost that
/// no longer grows with traffic.
pub const DEFAULT_HOLD_REFRESH: Duration = Duration::from_secs(1);

/// The most jitter added to a Redis wait whose end the clock knows (a window's end, a
/// hold's end): 250 ms, and at most a quarter of the wait. Waiters refused in one
/// window spread over the start of the next instead of arriving together.
pub const MAX_WAIT_JITTER: Duration = Duration::from_millis(250);

/// How often a Redis wait for a concurrency slot doubles its backoff: 4 times (from
/// the `retry_after` hint, [`DEFAULT_SLOT_RETRY_AFTER`]: 50, 100, 200, 400, then 800 ms
/// between tries, plus up to half as much jitter). A slot frees when some call ends,
/// which no clock predicts, and Redis cannot wake a waiter: this bounds the tries of a
/// long wait to about one a second, not twenty.
pub const SLOT_BACKOFF_DOUBLINGS: u32 = 4;

/// Default Redis key prefix: `pgw:rl`.
pub const DEFAULT_KEY_PREFIX: &str = "pgw:rl";

/// The limits of one scope (a source or an account). `None` means unlimited.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Quota {
    /// Requests per window (RPM for a 60 s window).
    pub requests: Option<u64>,
    /// Tokens per window (TPM for a 60 s window).
    pub tokens: Option<u64>,
    /// Concurrent requests (leases).
    pub concurrency: Option<u64>,
}

impl Quota {
    /// No limit on any dimension.
    #[must_use]
    pub const fn unlimited() -> Self {
        Self {
            requests: None,
            tokens: None,
            concurrency: None,
        }
    }

    /// Limits requests per window.
    #[must_use]
    pub const fn requests(mut self, n: u64) -> Self {
        self.requests = Some(n);
        self
    }

    /// Limits tokens per window.
    #[must_use]
    pub const fn tokens(mut self, n: u64) -> Self {
        self.tokens = Some(n);
        self
    }

    /// Limits concurrent requests.
    #[must_use]
    pub const fn concurrency(mut self, n: u64) -> Self {
        self.concurrency = Some(n);
        self
    }

    fn validate(&self, scope: &str) -> Result<(), ConfigError> {
        for (name, v) in [
            ("requests", self.requests),
            ("tokens", self.tokens),
            ("concurrency", self.concurrency),
        ] {
            if v == Some(0) {
                return Err(crate::error::config_error(
                    format!("{scope}.{name}"),
                    "must be at least 1 (leave it unset for no limit)",
                ));
            }
            if v.is_some_and(|v| v > MAX_QUOTA) {
                return Err(crate::error::config_error(
                    format!("{scope}.{name}"),
                    format!(
                        "is too large (at most {MAX_QUOTA}, 2^50: the Redis scripts count in Lua numbers, exact to 2^53)"
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// The largest quota a dimension takes: 2^50. The Redis backend counts in Lua numbers
/// (doubles, exact to 2^53); below this bound a window's total, plus one request's
/// tokens, never passes 2^53, where `+ 1` would stop counting and admit everything.
pub const MAX_QUOTA: u64 = 1 << 50;

/// What happens when a request is not admitted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Mode {
    /// Answer [`QuotaExceeded`](pgw_core::QuotaExceeded) at once, so a balancer can try
    /// another source (the default: gates shed, they don't block).
    #[default]
    Shed,
    /// Wait until admissible, for at most `max_wait` (then answer `QuotaExceeded`).
    /// A refusal whose `retry_after` ends past `max_wait` is answered at once, but a
    /// concurrency refusal's (the slot hint: a lease may end at any moment), which
    /// waits up to `max_wait`.
    ///
    /// The wait happens in the response future, not in `poll_ready`: the token
    /// reservation depends on the request, which `poll_ready` does not see.
    ///
    /// Memory: a first-come-first-served queue per scope; a freed slot (a release, a
    /// refund, a window's or a hold's end) wakes one waiter, and a newcomer queues
    /// behind those already waiting. Redis (which cannot wake a waiter): another try
    /// at the refusal's `retry_after` plus jitter ([`MAX_WAIT_JITTER`]), or for a slot
    /// after a backoff doubling per refusal ([`SLOT_BACKOFF_DOUBLINGS`]).
    Wait {
        /// The longest a request waits for admission; `None` waits as long as it takes.
        max_wait: Option<Duration>,
    },
}

/// The configuration of one source's limiter.
///
/// ```
/// use std::time::Duration;
/// use tower_ratelimit_redis::{Quota, RateLimitConfig};
///
/// let config = RateLimitConfig::new("s4", Quota::unlimited().requests(5).concurrency(2))
///     .account("acct-1", Quota::unlimited().tokens(200_000))
///     .window(Duration::from_secs(60));
/// assert_eq!(config.source_name().as_str(), "s4");
/// ```
#[derive(Clone, Debug)]
pub struct RateLimitConfig {
    pub(crate) source: SourceId,
    pub(crate) source_quota: Quota,
    pub(crate) account: Option<(Arc<str>, Quota)>,
    pub(crate) window: Duration,
    pub(crate) sub_windows: u32,
    pub(crate) lease_ttl: Duration,
    pub(crate) slot_retry_after: Duration,
    pub(crate) mode: Mode,
    pub(crate) key_prefix: String,
    pub(crate) response_timeout: Duration,
    pub(crate) hold_refresh: Duration,
    pub(crate) jitter_seed: Option<u64>,
}

impl RateLimitConfig {
    /// A limiter for `source` with its own `quota`, every other setting at its default.
    pub fn new(source: impl Into<SourceId>, quota: Quota) -> Self {
        Self {
            source: source.into(),
            source_quota: quota,
            account: None,
            window: DEFAULT_WINDOW,
            sub_windows: DEFAULT_SUB_WINDOWS,
            lease_ttl: DEFAULT_LEASE_TTL,
            slot_retry_after: DEFAULT_SLOT_RETRY_AFTER,
            mode: Mode::Shed,
            key_prefix: DEFAULT_KEY_PREFIX.to_owned(),
            response_timeout: pgw_core::redis_conn::DEFAULT_RESPONSE_TIMEOUT,
            hold_refresh: DEFAULT_HOLD_REFRESH,
            jitter_seed: None,
        }
    }

    /// The source also draws on `account`'s `quota`, shared with every source of that
    /// account (every process must configure the same account quota).
    #[must_use]
    pub fn account(mut self, account: &str, quota: Quota) -> Self {
        self.account = Some((Arc::from(account), quota));
        self
    }

    /// The window length (default [`DEFAULT_WINDOW`]); whole milliseconds.
    #[must_use]
    pub const fn window(mut self, window: Duration) -> Self {
        self.window = window;
        self
    }

    /// How many sub-windows the window is counted in (default
    /// [`DEFAULT_SUB_WINDOWS`], at most [`MAX_SUB_WINDOWS`]): at least this many,
    /// as many as fit evenly. The sub-window is the longest whole number of
    /// milliseconds that divides the window and is at most `window / sub_windows`
    /// (a 1 s window and the default 60: 100 sub-windows of 10 ms).
    ///
    /// Every span of the window's length holds at most the quota; what frees comes
    /// back at most one sub-window late. More sub-windows: closer to an exact sliding
    /// window, a few more counters per scope. One: two whole windows are summed (safe,
    /// but a quota frees up to a window late). Every limiter sharing a scope (sources
    /// of one account, every process) must use the same window and sub-windows.
    #[must_use]
    pub const fn sub_windows(mut self, n: u32) -> Self {
        self.sub_windows = n;
        self
    }

    /// The concurrency lease TTL (default [`DEFAULT_LEASE_TTL`]).
    #[must_use]
    pub const fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = ttl;
        self
    }

    /// The `retry_after` hint when every slot is taken (default
    /// [`DEFAULT_SLOT_RETRY_AFTER`]); at most 366 days.
    #[must_use]
    pub const fn slot_retry_after(mut self, hint: Duration) -> Self {
        self.slot_retry_after = hint;
        self
    }

    /// Shedding or waiting (default [`Mode::Shed`]).
    #[must_use]
    pub const fn mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    /// The Redis key prefix (default [`DEFAULT_KEY_PREFIX`]).
    #[must_use]
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.key_prefix = prefix.into();
        self
    }

    /// How long one Redis operation may take before it counts as unreachable (default
    /// [`pgw_core::redis_conn::DEFAULT_RESPONSE_TIMEOUT`]).
    #[must_use]
    pub const fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// How stale the cached holds of a Redis limiter with nothing else to enforce may
    /// be (default [`DEFAULT_HOLD_REFRESH`]); `Duration::ZERO` reads them on every
    /// admission. Ignored by the memory backend, and by limiters with a quota (their
    /// admission script reads the holds).
    #[must_use]
    pub const fn hold_refresh(mut self, every: Duration) -> Self {
        self.hold_refresh = every;
        self
    }

    /// Seeds the jitter of [`Mode::Wait`]'s waits on the Redis backend (default: a
    /// random seed per limiter), so a test can replay them.
    #[must_use]
    pub const fn jitter_seed(mut self, seed: u64) -> Self {
        self.jitter_seed = Some(seed);
        self
    }

    /// The source this limiter guards.
    #[must_use]
    pub const fn source_name(&self) -> &SourceId {
        &self.source
    }

    /// The account, if the source shares one.
    #[must_use]
    pub fn account_name(&self) -> Option<&str> {
        self.account.as_ref().map(|(a, _)| &**a)
    }

    /// The window length.
    #[must_use]
    pub const fn window_len(&self) -> Duration {
        self.window
    }

    /// The length of one sub-window the window is counted in (see
    /// [`sub_windows`](Self::sub_windows)): a quota that frees comes back at most this
    /// late.
    #[must_use]
    pub fn sub_window_len(&self) -> Duration {
        Duration::from_millis(sub_window_ms(window_ms(self.window), self.sub_windows))
    }

    /// Checks every field as [`RateLimiter::new`](crate::RateLimiter::new) does: a
    /// program that builds its configuration from its own (a config file) checks it
    /// before it starts anything.
    ///
    /// ```
    /// use tower_ratelimit_redis::{Quota, RateLimitConfig};
    ///
    /// assert!(RateLimitConfig::new("s1", Quota::unlimited().requests(60)).validate().is_ok());
    /// let err = RateLimitConfig::new("s{1}", Quota::unlimited()).validate().unwrap_err();
    /// assert_eq!(err.field(), "source");
    /// ```
    ///
    /// # Errors
    /// A [`ConfigError`] naming the field (`source`, `account.requests`, `window`, ...).
    pub fn validate(&self) -> Result<(), ConfigError> {
        check_name("source", self.source.as_str())?;
        self.source_quota.validate("source")?;
        if let Some((a, q)) = &self.account {
            check_name("account", a)?;
            q.validate("account")?;
        }
        if self.window < Duration::from_millis(1)
            || self.window > MAX_PERIOD
            || !self.window.subsec_nanos().is_multiple_of(1_000_000)
        {
            return Err(crate::error::config_error(
                "window",
                "must be a whole number of milliseconds, at least 1 ms and at most 366 days",
            ));
        }
        if self.sub_windows == 0 || self.sub_windows > MAX_SUB_WINDOWS {
            return Err(crate::error::config_error(
                "sub_windows",
                "must be at least 1 and at most 1000",
            ));
        }
        let (wms, sub) = (
            window_ms(self.window),
            sub_window_ms(window_ms(self.window), self.sub_windows),
        );
        if wms / sub > u64::from(MAX_SUB_WINDOWS) {
            // A window whose only divisors near window / sub_windows are tiny (a prime
            // number of ms) would be counted in thousands of 1 ms sub-windows: more
            // than a Redis script can read at once.
            return Err(crate::error::config_error(
                "window",
                format!(
                    "{wms} ms cannot be split into about {} equal sub-windows (the nearest whole-ms split is {} of {sub} ms, more than {MAX_SUB_WINDOWS}); use a window with a divisor near window / sub_windows, such as a whole number of seconds",
                    self.sub_windows,
                    wms / sub
                ),
            ));
        }
        if self.lease_ttl < Duration::from_millis(3)
            || self.lease_ttl > MAX_PERIOD
            || !self.lease_ttl.subsec_nanos().is_multiple_of(1_000_000)
        {
            return Err(crate::error::config_error(
                "lease_ttl",
                "must be a whole number of milliseconds, at least 3 ms and at most 366 days",
            ));
        }
        if self.hold_refresh > MAX_PERIOD {
            return Err(crate::error::config_error(
                "hold_refresh",
                "must be at most 366 days",
            ));
        }
        if self.slot_retry_after < Duration::from_millis(1) || self.slot_retry_after > MAX_PERIOD {
            // Zero would answer `retry_after = 0` to every concurrency refusal: a
            // caller waking at the earliest retry_after would spin.
            return Err(crate::error::config_error(
                "slot_retry_after",
                "must be at least 1 ms and at most 366 days",
            ));
        }
        if self.response_timeout.is_zero() {
            return Err(crate::error::config_error(
                "response_timeout",
                "must be more than zero",
            ));
        }
        if self.key_prefix.contains(['{', '}']) {
            return Err(crate::error::config_error(
                "key_prefix",
                "must not contain '{' or '}' (hash tags)",
            ));
        }
        Ok(())
    }

    /// The largest token reservation any scope can ever admit.
    pub(crate) fn max_tokens(&self) -> Option<(u64, &str)> {
        let src = self.source_quota.tokens.map(|t| (t, "source"));
        let acc = self
            .account
            .as_ref()
            .and_then(|(_, q)| q.tokens.map(|t| (t, "account")));
        match (src, acc) {
            (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
            (a, b) => a.or(b),
        }
    }
}

/// A window's whole milliseconds (validated: whole, at most 366 days).
pub(crate) fn window_ms(window: Duration) -> u64 {
    u64::try_from(window.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// The sub-window of a window of `window_ms`, counted in at least `n` sub-windows: the
/// longest divisor of `window_ms` that is at most `window_ms / n` (1 ms at least).
/// Trial division up to the square root: at most 180 000 steps for a 366-day window.
pub(crate) fn sub_window_ms(window_ms: u64, n: u32) -> u64 {
    let cap = window_ms / u64::from(n.max(1));
    if cap <= 1 {
        return 1;
    }
    let mut best = 1;
    let mut d = 1;
    while d * d <= window_ms {
        if window_ms.is_multiple_of(d) {
            let pair = window_ms / d;
            if d <= cap {
                best = best.max(d);
            }
            if pair <= cap {
                best = best.max(pair);
            }
        }
        d += 1;
    }
    best
}

fn check_name(field: &'static str, name: &str) -> Result<(), ConfigError> {
    if name.is_empty() {
        return Err(crate::error::config_error(field, "must not be empty"));
    }
    if name.contains(['{', '}']) {
        return Err(crate::error::config_error(
            field,
            "must not contain '{' or '}' (they delimit Redis Cluster hash tags)",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_config_names_the_field() {
        let cases = [
            (
                RateLimitConfig::new("s", Quota::unlimited().requests(0)),
                "source.requests",
            ),
            (
                RateLimitConfig::new("s", Quota::unlimited()).account("a", Quota::unlimited().tokens(0)),
                "account.tokens",
            ),
            (RateLimitConfig::new("", Quota::unlimited()), "source"),
            (RateLimitConfig::new("s{x}", Quota::unlimited()), "source"),
            (
                RateLimitConfig::new("s", Quota::unlimited()).window(Duration::from_micros(1500)),
                "window",
            ),
            (
                RateLimitConfig::new("s", Quota::unlimited()).lease_ttl(Duration::ZERO),
                "lease_ttl",
            ),
            (
                RateLimitConfig::new("s", Quota::unlimited()).key_prefix("a{b"),
                "key_prefix",
            ),
            // Past the clock's range: renewal and waiting arithmetic would overflow.
            (
                RateLimitConfig::new("s", Quota::unlimited()).lease_ttl(Duration::from_secs(u64::MAX)),
                "lease_ttl",
            ),
            (
                RateLimitConfig::new("s", Quota::unlimited()).window(Duration::from_secs(400 * 24 * 3600)),
                "window",
            ),
            (
                RateLimitConfig::new("s", Quota::unlimited()).slot_retry_after(Duration::MAX),
                "slot_retry_after",
            ),
            // Past what Lua numbers count exactly (2^53): `+ 1` would stop counting.
            (
                RateLimitConfig::new("s", Quota::unlimited().tokens(MAX_QUOTA + 1)),
                "source.tokens",
            ),
        ];
        for (config, field) in cases {
            let err = config.validate().unwrap_err();
            assert_eq!(err.field(), field, "{err}");
            assert!(err.to_string().contains(field), "{err}");
        }
        assert!(
            RateLimitConfig::new("s", Quota::unlimited().requests(1))
                .validate()
                .is_ok()
        );
        assert!(
            RateLimitConfig::new("s", Quota::unlimited().tokens(MAX_QUOTA))
                .validate()
                .is_ok()
        );
    }

    #[test]
    fn sub_windows_divide_the_window() {
        let len = |w: u64, n: u32| {
            RateLimitConfig::new("s", Quota::unlimited())
                .window(Duration::from_millis(w))
                .sub_windows(n)
                .sub_window_len()
        };
        assert_eq!(len(60_000, DEFAULT_SUB_WINDOWS), Duration::from_secs(1));
        assert_eq!(
            len(1000, 60),
            Duration::from_millis(10),
            "16.6 ms rounds to a divisor"
        );
        assert_eq!(len(1000, 1), Duration::from_millis(1000));
        assert_eq!(len(7, 60), Duration::from_millis(1));
        assert_eq!(len(7919, 2), Duration::from_millis(1), "a prime: 1 ms");
        assert_eq!(len(366 * 24 * 3_600_000, 60), Duration::from_secs(366 * 24 * 60));
        for n in [0, MAX_SUB_WINDOWS + 1] {
            let c = RateLimitConfig::new("s", Quota::unlimited()).sub_windows(n);
            assert_eq!(c.validate().unwrap_err().field(), "sub_windows");
        }
        // A window that splits only into more sub-windows than a script reads at once
        // (10,007 ms, a prime: 10,007 of 1 ms) is refused, naming the window; the
        // Redis script failed on it after writing its admission.
        let prime =
            RateLimitConfig::new("s", Quota::unlimited().requests(1)).window(Duration::from_millis(10_007));
        let err = prime.validate().unwrap_err();
        assert_eq!(err.field(), "window", "{err}");
        assert!(err.to_string().contains("10007 ms"), "{err}");
        // Few sub-windows of a prime are still fine (7 ms in 1 ms sub-windows).
        let small = RateLimitConfig::new("s", Quota::unlimited()).window(Duration::from_millis(7));
        assert!(small.validate().is_ok());
    }

    /// A zero slot hint answered `retry_after = 0` to every concurrency refusal.
    #[test]
    fn slot_retry_after_is_at_least_one_millisecond() {
        let c = RateLimitConfig::new("s", Quota::unlimited().concurrency(1)).slot_retry_after(Duration::ZERO);
        assert_eq!(c.validate().unwrap_err().field(), "slot_retry_after");
        let c = RateLimitConfig::new("s", Quota::unlimited().concurrency(1))
            .slot_retry_after(Duration::from_millis(1));
        assert!(c.validate().is_ok());
    }

    #[test]
    fn max_tokens_is_the_smaller_scope() {
        let c = RateLimitConfig::new("s", Quota::unlimited().tokens(100))
            .account("a", Quota::unlimited().tokens(50));
        assert_eq!(c.max_tokens(), Some((50, "account")));
        let c = RateLimitConfig::new("s", Quota::unlimited()).account("a", Quota::unlimited());
        assert_eq!(c.max_tokens(), None);
    }
}
