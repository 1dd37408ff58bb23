//! The P6 traffic mix: 8000 calls, P1 .10 short chat, P2 .20
//! large prompts (~300 KB, TPM pressure), P3 .35 structured JSON output, P4 .15 repeated
//! prompts (cache hits), P5 .20 long streamed answers.
//!
//! Items are generated lazily (a 300 KB prompt exists only while its item is alive);
//! the kind of every call is fixed up front by a seeded shuffle of the exact mix.

use pgw_core::openai::ChatRequest;
use rand::Rng;
use rand::SeedableRng;
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use serde::{Deserialize, Serialize};
use serde_json::json;

/// The kind of one P6 call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// P1: a short chat question.
    ShortChat,
    /// P2: a large prompt (~300 KB): TPM pressure.
    LargePrompt,
    /// P3: structured output (`response_format: json_object`), validated with
    /// [`is_valid_structured`]; an invalid answer is re-asked.
    Structured,
    /// P4: a prompt from a small repeated set: cache hits.
    Repeated,
    /// P5: a long streamed answer (`stream: true`).
    LongStream,
}

impl Kind {
    /// Every kind, in P order.
    pub const ALL: [Self; 5] = [
        Self::ShortChat,
        Self::LargePrompt,
        Self::Structured,
        Self::Repeated,
        Self::LongStream,
    ];

    /// `p1` .. `p5`.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::ShortChat => "p1",
            Self::LargePrompt => "p2",
            Self::Structured => "p3",
            Self::Repeated => "p4",
            Self::LongStream => "p5",
        }
    }
}

/// The P3 validator: the content parses as a JSON object.
///
/// ```
/// assert!(pgw_sim::p6::is_valid_structured(r#"{"answer":"x"}"#));
/// assert!(!pgw_sim::p6::is_valid_structured(r#"{"answer":"x""#));
/// assert!(!pgw_sim::p6::is_valid_structured(""));
/// ```
#[must_use]
pub fn is_valid_structured(content: &str) -> bool {
    serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(content).is_ok()
}

/// The traffic's shape. Defaults are P6's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrafficConfig {
    /// Number of calls (default 8000). A run parameter, not part of the traffic's
    /// serialised shape: the soak sets it from its scenario's `calls`.
    #[serde(skip)]
    pub calls: usize,
    /// Shares of P1..P5 (default `[0.10, 0.20, 0.35, 0.15, 0.20]`), normalised.
    pub mix: [f64; 5],
    /// The model named in requests (default `sim-model`).
    pub model: String,
    /// Bytes of a P2 prompt (default 300 000; seed 003: ~313 KB payloads).
    pub large_prompt_bytes: usize,
    /// Distinct P1 prompts (default 400: short chat repeats now and then).
    pub short_chat_distinct: u64,
    /// Distinct P3 prompts (default 1000).
    pub structured_distinct: u64,
    /// Distinct P4 prompts (default 16: the repeated set).
    pub repeated_distinct: u64,
    /// `max_tokens` of P1..P5 (default `[200, 512, 600, 256, 2048]`).
    pub max_tokens: [u64; 5],
    /// Fraction of the P1, P2 and P4 calls that are streamed too (default 0: only P5
    /// streams, as in P6). Drawn from the traffic's seed only when > 0, so P6 traffic
    /// is unchanged.
    pub stream_share: f64,
}

impl Default for TrafficConfig {
    fn default() -> Self {
        Self {
            calls: 8000,
            mix: [0.10, 0.20, 0.35, 0.15, 0.20],
            model: "sim-model".into(),
            large_prompt_bytes: 300_000,
            short_chat_distinct: 400,
            structured_distinct: 1000,
            repeated_distinct: 16,
            max_tokens: [200, 512, 600, 256, 2048],
            stream_share: 0.0,
        }
    }
}

/// One call of the traffic.
#[derive(Clone, Debug, PartialEq)]
pub struct TrafficItem {
    /// Position in the traffic, from 0.
    pub index: usize,
    /// Its kind.
    pub kind: Kind,
    /// The request to send.
    pub request: ChatRequest,
}

/// The P6 traffic: an iterator of [`TrafficItem`]s, deterministic per seed.
#[derive(Debug)]
pub struct Traffic {
    config: TrafficConfig,
    kinds: Vec<Kind>,
    rng: SmallRng,
    next: usize,
}

const FILLER: &str = "Quarterly figures for the northern region show steady growth in \
    subscriptions, while churn stayed flat; the appendix lists every account by tier. ";

impl Traffic {
    /// The default traffic (8000 calls) for `seed`.
    #[must_use]
    pub fn new(seed: u64) -> Self {
        Self::with_config(TrafficConfig::default(), seed)
    }

    /// Traffic of `config` for `seed`. Counts per kind are exact (the mix times
    /// `calls`, rounded, the remainder going to P1) and shuffled with the seed.
    #[must_use]
    pub fn with_config(config: TrafficConfig, seed: u64) -> Self {
        let total: f64 = config.mix.iter().map(|m| m.max(0.0)).sum();
        let mut kinds = Vec::with_capacity(config.calls);
        for (k, share) in Kind::ALL.iter().zip(config.mix).skip(1) {
            let n = if total > 0.0 {
                (share.max(0.0) / total * config.calls as f64).round() as usize
            } else {
                0
            };
            kinds.extend(std::iter::repeat_n(*k, n.min(config.calls - kinds.len())));
        }
        kinds.extend(std::iter::repeat_n(Kind::ShortChat, config.calls - kinds.len()));
        let mut rng = SmallRng::seed_from_u64(seed ^ 0x7AFF_1C00_0000_0006);
        kinds.shuffle(&mut rng);
        Self {
            config,
            kinds,
            rng,
            next: 0,
        }
    }

    /// The kinds of every call, in order.
    #[must_use]
    pub fn kinds(&self) -> &[Kind] {
        &self.kinds
    }

    fn request(&mut self, index: usize, kind: Kind) -> ChatRequest {
        let c = &self.config;
        let max_tokens = c.max_tokens[kind as usize];
        let prompt = match kind {
            Kind::ShortChat => {
                let k = self.rng.random_range(0..c.short_chat_distinct.max(1));
                format!("Short question {k}: what is a good name for a project about resilient calls?")
            }
            Kind::LargePrompt => {
                let head = format!("Document {index}: summarise the report below in five bullet points.\n");
                let mut p = String::with_capacity(c.large_prompt_bytes.max(head.len()));
                p.push_str(&head);
                while p.len() + FILLER.len() <= c.large_prompt_bytes {
                    p.push_str(FILLER);
                }
                p
            }
            Kind::Structured => {
                let k = self.rng.random_range(0..c.structured_distinct.max(1));
                format!(
                    "Extract the customer record {k} as a JSON object with fields answer, confidence, complete.\n{}",
                    FILLER.repeat(4)
                )
            }
            Kind::Repeated => {
                let k = self.rng.random_range(0..c.repeated_distinct.max(1));
                format!("Frequently asked question {k}: how do I reset my password?")
            }
            Kind::LongStream => format!("Write a long, detailed essay (topic {index}) about rate limiting."),
        };
        let mut req = ChatRequest::user(c.model.clone(), prompt);
        req.max_tokens = Some(max_tokens);
        match kind {
            Kind::Structured => {
                req.extra
                    .insert("response_format".into(), json!({"type": "json_object"}));
            }
            Kind::LongStream => req.stream = true,
            Kind::ShortChat | Kind::LargePrompt | Kind::Repeated => {
                let share = c.stream_share;
                req.stream = share > 0.0 && self.rng.random::<f64>() < share;
            }
        }
        req
    }
}

impl Iterator for Traffic {
    type Item = TrafficItem;

    fn next(&mut self) -> Option<TrafficItem> {
        let index = self.next;
        let kind = *self.kinds.get(index)?;
        self.next += 1;
        let request = self.request(index, kind);
        Some(TrafficItem { index, kind, request })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.kinds.len() - self.next;
        (n, Some(n))
    }
}

impl ExactSizeIterator for Traffic {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_mix_and_deterministic() {
        let t = Traffic::new(7);
        let count = |k| t.kinds().iter().filter(|x| **x == k).count();
        assert_eq!(count(Kind::ShortChat), 800);
        assert_eq!(count(Kind::LargePrompt), 1600);
        assert_eq!(count(Kind::Structured), 2800);
        assert_eq!(count(Kind::Repeated), 1200);
        assert_eq!(count(Kind::LongStream), 1600);
        let a: Vec<_> = Traffic::new(7).take(50).collect();
        let b: Vec<_> = Traffic::new(7).take(50).collect();
        assert_eq!(a, b);
        let c: Vec<_> = Traffic::new(8).take(50).collect();
        assert_ne!(a, c);
    }

    #[test]
    fn items_have_their_shape() {
        let mut seen = [false; 5];
        for item in Traffic::new(1).take(200) {
            seen[item.kind as usize] = true;
            let r = &item.request;
            match item.kind {
                Kind::LargePrompt => {
                    assert!(r.prompt_bytes() > 299_000 && r.prompt_bytes() <= 300_000);
                }
                Kind::Structured => assert_eq!(r.extra["response_format"]["type"], "json_object"),
                Kind::LongStream => assert!(r.stream),
                Kind::ShortChat | Kind::Repeated => assert!(r.prompt_bytes() < 200),
            }
        }
        assert_eq!(seen, [true; 5]);
        let repeated: std::collections::HashSet<_> = Traffic::new(1)
            .filter(|i| i.kind == Kind::Repeated)
            .map(|i| i.request.messages[0].content.clone())
            .collect();
        assert!(repeated.len() <= 16);
    }
}
