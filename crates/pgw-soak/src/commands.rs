//! Redis commands per call in the Redis mode: `INFO commandstats` of the run's Redis
//! read before the workers start and after they are done, the difference divided by
//! the calls of the run.
//!
//! Redis counts every command it runs, those a Lua script runs included (an `EVALSHA`
//! of the breaker's admission counts as `EVALSHA`, `TIME` and `HMGET`), so the total
//! is what the server does. The counts are the server's: a Redis shared with other
//! clients during the run counts their commands too (give the run its own server).
//!
//! The server's CPU time is read the same way (`INFO cpu`: `used_cpu_user` plus
//! `used_cpu_sys`, every node summed): what the run cost the Redis, parsing and I/O
//! included, which a count of commands does not weigh (a script's `EVALSHA` costs
//! 20-130 us, a `GET` 1). It includes the server's own housekeeping while the run lasts
//! (about 1.5 ms a second on the machine the README's figures come from).
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
    /// The server's CPU time over the run, seconds (`INFO cpu`, user plus system, every
    /// node), when read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_s: Option<f64>,
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
            cpu_s: None,
        }
    }

    /// The server's CPU time per call of the run, microseconds, when read.
    #[must_use]
    #[allow(clippy::cast_precision_loss)]
    pub fn cpu_us_per_call(&self) -> Option<f64> {
        self.cpu_s
            .filter(|_| self.calls > 0)
            .map(|s| s * 1e6 / self.calls as f64)
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
        if let (Some(s), Some(us)) = (self.cpu_s, self.cpu_us_per_call()) {
            let _ = writeln!(
                out,
                "redis cpu: {:.0} ms for {} calls = {us:.0} us per call (the server's user + system time, housekeeping included)",
                s * 1e3,
                self.calls,
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
        if let (Some(s), Some(us)) = (self.cpu_s, self.cpu_us_per_call()) {
            let _ = writeln!(
                md,
                "The server's CPU time (`INFO cpu`, `used_cpu_user` + `used_cpu_sys`, every \
                 node; its housekeeping while the run lasts included): {:.0} ms, **{us:.0} us \
                 per call**.\n",
                s * 1e3
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

/// The server's CPU seconds so far from the `used_cpu_user` and `used_cpu_sys` lines
/// of `INFO cpu` (`None` when either is missing or not a number).
///
/// ```
/// let s = pgw_soak::commands::parse_cpu("# CPU\r\nused_cpu_sys:1.25\r\nused_cpu_user:2.5\r\nused_cpu_sys_children:9\r\n");
/// assert_eq!(s, Some(3.75));
/// ```
#[must_use]
pub fn parse_cpu(info: &str) -> Option<f64> {
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.trim().strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| v.is_finite() && *v >= 0.0)
    };
    Some(field("used_cpu_user")? + field("used_cpu_sys")?)
}

/// What one reading of the run's Redis saw: every node's commands, summed.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Reading {
    /// `INFO commandstats`, summed.
    pub commands: Counts,
    /// `INFO cpu`'s user plus system seconds, summed (`None` when a node's could not
    /// be parsed).
    pub cpu_s: Option<f64>,
}

impl RedisCommands {
    /// The commands and the server's CPU time between two readings, for `calls` calls.
    #[must_use]
    pub fn between_readings(before: &Reading, after: &Reading, calls: u64) -> Self {
        let mut c = Self::between(&before.commands, &after.commands, calls);
        c.cpu_s = before.cpu_s.zip(after.cpu_s).map(|(b, a)| (a - b).max(0.0));
        c
    }
}

/// Reads `INFO commandstats` and `INFO cpu` of every node of `url` (a standalone
/// server, or each node a `redis+cluster://` URL names) and sums them.
///
/// # Errors
/// A bad URL, or a node that cannot be reached or read (named, password hidden).
pub async fn read(url: &str) -> Result<Reading, BoxError> {
    let mut sum = Reading {
        commands: Counts::new(),
        cpu_s: Some(0.0),
    };
    for (node, mut conn) in connect_nodes(url).await? {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut conn)
            .await
            .map_err(|e| format!("INFO commandstats of {node}: {e}"))?;
        for (k, n) in parse(&info) {
            *sum.commands.entry(k).or_default() += n;
        }
        let cpu: String = redis::cmd("INFO")
            .arg("cpu")
            .query_async(&mut conn)
            .await
            .map_err(|e| format!("INFO cpu of {node}: {e}"))?;
        sum.cpu_s = sum.cpu_s.zip(parse_cpu(&cpu)).map(|(a, b)| a + b);
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
        assert!(!c.terminal().contains("redis cpu"), "not read: not shown");
        c.cpu_s = Some(0.004);
        assert!(
            c.terminal()
                .contains("redis cpu: 4 ms for 8 calls = 500 us per call"),
            "{}",
            c.terminal()
        );
        assert!(
            c.markdown().contains("4 ms, **500 us per call**"),
            "{}",
            c.markdown()
        );
        let back: RedisCommands = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(back, c);
    }

    #[test]
    fn the_cpu_between_two_readings_needs_both() {
        let at = |cmds: &str, cpu: &str| Reading {
            commands: parse(cmds),
            cpu_s: parse_cpu(cpu),
        };
        let before = at("cmdstat_get:calls=1\n", "used_cpu_user:1.0\nused_cpu_sys:0.5\n");
        let after = at("cmdstat_get:calls=5\n", "used_cpu_user:1.25\nused_cpu_sys:0.75\n");
        let c = RedisCommands::between_readings(&before, &after, 4);
        assert_eq!(c.total(), 4);
        assert!((c.cpu_s.unwrap() - 0.5).abs() < 1e-9);
        assert!((c.cpu_us_per_call().unwrap() - 125_000.0).abs() < 1e-6);
        let blind = at("", "used_cpu_user:x\nused_cpu_sys:1\n");
        assert_eq!(blind.cpu_s, None, "a field that is not a number is no reading");
        assert_eq!(RedisCommands::between_readings(&blind, &after, 4).cpu_s, None);
        assert_eq!(parse_cpu("used_cpu_user:1\n"), None, "both fields or none");
        assert_eq!(
            parse_cpu("used_cpu_user_children:3\nused_cpu_sys:1\nused_cpu_user:2\n"),
            Some(3.0)
        );
        assert_eq!(RedisCommands::default().cpu_us_per_call(), None);
    }

    #[test]
    fn garbage_lines_are_skipped_and_no_calls_is_zero_per_call() {
        let c = parse("cmdstat_x:usec=3\nnot a stat\ncmdstat_y:calls=oops\ncmdstat_z:calls=2");
        assert_eq!(c, Counts::from([("z".into(), 2)]));
        assert!(RedisCommands::default().per_call(5).abs() < f64::EPSILON);
    }
}
