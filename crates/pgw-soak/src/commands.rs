//! Redis commands per call in the Redis mode: `INFO commandstats` of the run's Redis
//! read before the workers start and after they are done, the difference divided by
//! the calls of the run.
//!
//! Redis counts every command it runs, those a Lua script runs included (an `EVALSHA`
//! of the breaker's admission counts as `EVALSHA`, `TIME` and `HMGET`), so the total
//! is what the server does. The counts are the server's: a Redis shared with other
//! clients during the run counts their commands too (give the run its own server).
//!
//! The round trips are counted on the other side: each worker reads
//! [`pgw_core::redis_conn::round_trips`] (every request its gateway sent: one per
//! command, pipeline or script call), and the run sums them; so are the commands sent
//! ([`pgw_core::redis_conn::commands_sent`]: a pipeline's commands each, a script call
//! once), what the gateways ask of Redis before the scripts' own commands.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use pgw_core::BoxError;
use pgw_core::redis_conn::{RedisTarget, redact_url};
use serde::{Deserialize, Serialize};

/// Commands the measurement itself sends: not counted.
const OWN: [&str; 2] = ["info", "config|resetstat"];

/// Calls per command, summed over the nodes of the run's Redis.
pub type Counts = BTreeMap<String, u64>;

/// The Redis commands a run made (stored as `redis-commands.json`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RedisCommands {
    /// Calls of the run.
    pub calls: u64,
    /// Commands per command name (lowercase, as `INFO commandstats` names them, e.g.
    /// `evalsha`, `script|load`), over the run.
    pub per_command: Counts,
    /// Requests the run's processes sent to Redis (round trips), when they counted them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub round_trips: Option<u64>,
    /// Commands the run's processes sent to Redis (a pipeline's each, a script call
    /// once), when they counted them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sent: Option<u64>,
}

impl RedisCommands {
    /// The commands between two readings, for `calls` calls.
    #[must_use]
    pub fn between(before: &Counts, after: &Counts, calls: u64) -> Self {
        let per_command = after
            .iter()
            .filter(|(name, _)| !OWN.contains(&name.as_str()))
            .map(|(name, &n)| {
                (
                    name.clone(),
                    n.saturating_sub(before.get(name).copied().unwrap_or(0)),
                )
            })
            .filter(|&(_, n)| n > 0)
            .collect();
        Self {
            calls,
            per_command,
            round_trips: None,
            sent: None,
        }
    }

    /// The commands a stored Redis-mode run made (`redis-commands.json` in `dir`), or
    /// `None` for a run without the file (the memory mode's).
    ///
    /// # Errors
    /// The file is there but cannot be read or parsed, naming it.
    pub fn load(dir: &std::path::Path) -> Result<Option<Self>, BoxError> {
        crate::telemetry::read_json_if_there(&dir.join(crate::realtime::COMMANDS_FILE))
    }

    /// Every command of the run.
    #[must_use]
    pub fn total(&self) -> u64 {
        self.per_command.values().sum()
    }

    /// `n` per call of the run (0 without calls).
    #[must_use]
    #[allow(clippy::cast_precision_loss)]
    pub fn per_call(&self, n: u64) -> f64 {
        if self.calls == 0 {
            0.0
        } else {
            n as f64 / self.calls as f64
        }
    }

    /// The commands, most frequent first.
    fn by_count(&self) -> Vec<(&str, u64)> {
        let mut v: Vec<_> = self.per_command.iter().map(|(k, &n)| (k.as_str(), n)).collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        v
    }

    /// One line for the terminal: the total per call, then each command per call.
    #[must_use]
    pub fn terminal(&self) -> String {
        let mut out = format!(
            "redis commands: {} for {} calls = {:.1} per call (",
            self.total(),
            self.calls,
            self.per_call(self.total())
        );
        let parts: Vec<String> = self
            .by_count()
            .into_iter()
            .map(|(k, n)| format!("{k} {:.2}", self.per_call(n)))
            .collect();
        out.push_str(&parts.join(", "));
        out.push_str(")\n");
        if let Some(n) = self.round_trips {
            let _ = writeln!(
                out,
                "redis round trips: {n} for {} calls = {:.1} per call (requests the gateways sent)",
                self.calls,
                self.per_call(n)
            );
        }
        if let Some(n) = self.sent {
            let _ = writeln!(
                out,
                "redis commands sent: {n} for {} calls = {:.1} per call (by the gateways: a script call once, its own commands not)",
                self.calls,
                self.per_call(n)
            );
        }
        out
    }

    /// The report's section: a table of commands, total and per call.
    #[must_use]
    pub fn markdown(&self) -> String {
        let mut md = String::from("\n## Redis commands\n\n");
        let _ = writeln!(
            md,
            "`INFO commandstats` of the run's Redis, before and after (commands a Lua script \
             runs included): {} commands for {} calls, **{:.1} per call**.\n",
            self.total(),
            self.calls,
            self.per_call(self.total())
        );
        if let Some(n) = self.round_trips {
            let _ = writeln!(
                md,
                "Round trips, counted by the gateways (`pgw_core::redis_conn::round_trips`: one \
                 per command, pipeline or script call they sent): {n}, **{:.1} per call**.\n",
                self.per_call(n)
            );
        }
        if let Some(n) = self.sent {
            let _ = writeln!(
                md,
                "Commands the gateways sent (`pgw_core::redis_conn::commands_sent`: a \
                 pipeline's commands each, a script call once, the script's own commands \
                 not): {n}, **{:.1} per call**.\n",
                self.per_call(n)
            );
        }
        md.push_str("| command | calls | per call |\n|---|---:|---:|\n");
        for (k, n) in self.by_count() {
            let _ = writeln!(md, "| `{k}` | {n} | {:.2} |", self.per_call(n));
        }
        md
    }
}

/// Parses the `cmdstat_NAME:calls=N,...` lines of `INFO commandstats`.
///
/// ```
/// let c = pgw_soak::commands::parse("# Commandstats\r\ncmdstat_evalsha:calls=12,usec=9\r\ncmdstat_get:calls=3\r\n");
/// assert_eq!(c["evalsha"], 12);
/// assert_eq!(c["get"], 3);
/// ```
#[must_use]
pub fn parse(info: &str) -> Counts {
    let mut out = Counts::new();
    for line in info.lines() {
        let Some((name, rest)) = line
            .trim()
            .strip_prefix("cmdstat_")
            .and_then(|l| l.split_once(':'))
        else {
            continue;
        };
        let calls = rest
            .split(',')
            .find_map(|kv| kv.strip_prefix("calls="))
            .and_then(|v| v.parse::<u64>().ok());
        if let Some(n) = calls {
            *out.entry(name.to_owned()).or_default() += n;
        }
    }
    out
}

/// Reads `INFO commandstats` of every node of `url` (a standalone server, or each
/// node a `redis+cluster://` URL names) and sums them.
///
/// # Errors
/// A bad URL, or a node that cannot be reached or read (named, password hidden).
pub async fn read(url: &str) -> Result<Counts, BoxError> {
    let mut sum = Counts::new();
    for (node, mut conn) in connect_nodes(url).await? {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut conn)
            .await
            .map_err(|e| format!("INFO commandstats of {node}: {e}"))?;
        for (k, n) in parse(&info) {
            *sum.entry(k).or_default() += n;
        }
    }
    Ok(sum)
}

/// A connection to every node of `url` (one for a standalone server), each with the
/// node's address, password hidden.
async fn connect_nodes(url: &str) -> Result<Vec<(String, redis::aio::MultiplexedConnection)>, BoxError> {
    let nodes = match RedisTarget::parse(url)? {
        RedisTarget::Standalone(u) => vec![u],
        RedisTarget::Cluster(n) => n,
    };
    let mut out = Vec::with_capacity(nodes.len());
    for node in nodes {
        let shown = redact_url(&node);
        let named = |e: redis::RedisError| format!("{shown}: {e}");
        let client = redis::Client::open(node.as_str()).map_err(named)?;
        let conn = client.get_multiplexed_async_connection().await.map_err(named)?;
        out.push((shown, conn));
    }
    Ok(out)
}

/// The keys under `prefix` on every node of `url`; with `delete`, each unlinked as it
/// is found. The run's own keys: a Redis-mode run starts only where there are none
/// (another run's cache and breakers would be its state), and removes its own at the
/// end (the cache's lived for hours).
///
/// # Errors
/// A node that cannot be reached or scanned, named.
pub async fn keys_under(url: &str, prefix: &str, delete: bool) -> Result<u64, BoxError> {
    let mut pattern = String::with_capacity(prefix.len() + 1);
    for c in prefix.chars() {
        if "*?[]\\".contains(c) {
            pattern.push('\\');
        }
        pattern.push(c);
    }
    pattern.push('*');
    let mut found = 0;
    for (node, mut conn) in connect_nodes(url).await? {
        let named = |e: redis::RedisError| format!("SCAN of {node}: {e}");
        let mut cursor = 0u64;
        loop {
            let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut conn)
                .await
                .map_err(named)?;
            found += keys.len() as u64;
            if delete && !keys.is_empty() {
                // One key a command (a cluster node holds many slots), a batch a round
                // trip.
                let mut pipe = redis::pipe();
                for key in &keys {
                    pipe.cmd("UNLINK").arg(key).ignore();
                }
                let () = pipe.query_async(&mut conn).await.map_err(named)?;
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_difference_excludes_the_measurement_and_unchanged_commands() {
        let before = parse("cmdstat_evalsha:calls=10\ncmdstat_get:calls=5\ncmdstat_info:calls=1\n");
        let after = parse(
            "cmdstat_evalsha:calls=30\ncmdstat_get:calls=5\ncmdstat_set:calls=4\ncmdstat_info:calls=2\n",
        );
        let c = RedisCommands::between(&before, &after, 8);
        assert_eq!(
            c.per_command,
            Counts::from([("evalsha".into(), 20), ("set".into(), 4)])
        );
        assert_eq!(c.total(), 24);
        assert!((c.per_call(c.total()) - 3.0).abs() < 1e-9);
        assert!(
            c.terminal().contains("3.0 per call (evalsha 2.50, set 0.50)"),
            "{}",
            c.terminal()
        );
        assert!(c.markdown().contains("| `evalsha` | 20 | 2.50 |"));
        assert!(!c.terminal().contains("round trips"), "not counted: not shown");
        assert!(!c.terminal().contains("sent"), "not counted: not shown");
    }

    #[test]
    fn round_trips_are_shown_per_call_when_counted() {
        let mut c = RedisCommands::between(&Counts::new(), &parse("cmdstat_evalsha:calls=30\n"), 8);
        c.round_trips = Some(52);
        c.sent = Some(60);
        assert!(
            c.terminal()
                .contains("redis commands sent: 60 for 8 calls = 7.5 per call"),
            "{}",
            c.terminal()
        );
        assert!(c.markdown().contains("60, **7.5 per call**"), "{}", c.markdown());
        assert!(
            c.terminal()
                .contains("redis round trips: 52 for 8 calls = 6.5 per call"),
            "{}",
            c.terminal()
        );
        assert!(c.markdown().contains("52, **6.5 per call**"), "{}", c.markdown());
        let back: RedisCommands = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(back, c);
    }

    #[test]
    fn garbage_lines_are_skipped_and_no_calls_is_zero_per_call() {
        let c = parse("cmdstat_x:usec=3\nnot a stat\ncmdstat_y:calls=oops\ncmdstat_z:calls=2");
        assert_eq!(c, Counts::from([("z".into(), 2)]));
        assert!(RedisCommands::default().per_call(5).abs() < f64::EPSILON);
    }
}
