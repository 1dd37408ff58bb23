//! The driver: bounded dispatch of the traffic over the workers, the success judgement,
//! the progress display and the RSS samples.
//!
//! Dispatch is bounded: each worker takes the next call only
//! when one of its `concurrency` slots is free, so there are never more call tasks than
//! calls in flight, and the harness's memory stays flat.

use std::error::Error as StdError;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use futures_util::future::BoxFuture;
use indicatif::ProgressBar;
use pgw_core::openai::{ChatRequest, ChatResponse};
use pgw_core::sync::lock;
use pgw_core::{BoxError, NotAdmitted, classify_error};
use std::time::Duration;
use tokio::task::JoinSet;

use tokio::time::Instant;

use crate::telemetry::{CallRow, Recorder, RssSample};

/// One call of the traffic, as the driver hands it to a profile's client.
#[derive(Clone, Debug)]
pub struct SoakCall {
    /// Unique call id (the traffic index).
    pub id: u64,
    /// The worker running it.
    pub worker: u32,
    /// Traffic kind (`P1` .. `P5`).
    pub kind: &'static str,
    /// The request (shared: P2 prompts are ~300 KB).
    pub request: Arc<ChatRequest>,
    /// Whether a valid answer must be structured JSON (P3).
    pub structured: bool,
    /// When the call arrives, as an offset from the run's start on the run's clock, for
    /// open-loop traffic: the driver holds it until then, and its latency counts from
    /// then (a wait for a free slot included). `None`: it starts when a slot takes it.
    pub arrival: Option<Duration>,
}

impl SoakCall {
    /// The call id as telemetry writes it.
    #[must_use]
    pub fn call_id(&self) -> String {
        self.id.to_string()
    }
}

/// What a client hands the caller for one call: the final answer, and when its first
/// chunk reached the caller.
#[derive(Clone, Debug)]
pub struct Delivered {
    /// The whole answer, judged by the driver.
    pub response: ChatResponse,
    /// When the first chunk reached the caller; `None` when the answer was handed over
    /// whole, at the end of the call.
    pub first_chunk: Option<Instant>,
}

impl From<ChatResponse> for Delivered {
    /// An answer handed over whole, at the end of the call.
    fn from(response: ChatResponse) -> Self {
        Self {
            response,
            first_chunk: None,
        }
    }
}

/// One worker's client: runs a call to its end (every attempt, retry and wait inside).
pub trait Client: Send + Sync + 'static {
    /// Runs `call`; `Ok` carries the final answer, judged by the driver.
    fn call(&self, call: SoakCall) -> BoxFuture<'static, Result<Delivered, BoxError>>;
}

/// Whether `content` is a valid structured answer (P3): it parses as a JSON object.
#[must_use]
pub fn is_valid_structured(content: &str) -> bool {
    matches!(
        serde_json::from_str::<serde_json::Value>(content.trim()),
        Ok(serde_json::Value::Object(_))
    )
}

/// The `finish_reason`s of a complete answer: it stopped by itself (`stop`), at the
/// caller's token budget (`length`: what the caller asked for), or to call tools
/// (`tool_calls`). The simulator ends every complete answer with `stop`, streamed or
/// not, structured or not; the profiles' caches keep the answer as it came.
pub const COMPLETE_FINISH_REASONS: [&str; 3] = [
    pgw_core::openai::FINISH_STOP,
    pgw_core::openai::FINISH_LENGTH,
    pgw_core::openai::FINISH_TOOL_CALLS,
];

/// The cause of a call whose answer has text but no `finish_reason` of a complete
/// answer ([`COMPLETE_FINISH_REASONS`]): it was cut before its end.
pub const UNFINISHED: &str = "unfinished";

/// The driver's verdict on one call's result: `Ok(())` for a valid answer, else the
/// cause of the failure.
///
/// # Errors
/// The cause's name when the call did not return a valid answer.
pub fn judge_answer(structured: bool, result: &Result<ChatResponse, BoxError>) -> Result<(), String> {
    match result {
        Ok(r) if provider_verdict(r).is_some() => Err(provider_verdict(r).unwrap_or_default().into()),
        Ok(r) if r.is_empty_completion() => Err("empty_completion".into()),
        Ok(r) if !is_finished(r) => Err(UNFINISHED.into()),
        Ok(r) if structured && !is_valid_structured(r.content()) => Err("invalid".into()),
        Ok(_) => Ok(()),
        Err(e) => Err(failure_cause(&**e)),
    }
}

/// Whether the answer's first choice (the one judged) ended as a complete answer ends.
fn is_finished(r: &ChatResponse) -> bool {
    r.choices.first().is_some_and(|c| {
        c.finish_reason
            .as_deref()
            .is_some_and(|f| COMPLETE_FINISH_REASONS.contains(&f))
    })
}

/// The provider's own verdict on the prompt, when the answer carries one: a content
/// filter (`finish_reason: content_filter`) or a refusal (`message.refusal`). The
/// caller got the provider's answer; no client could have made the prompt pass.
#[must_use]
pub fn provider_verdict(r: &ChatResponse) -> Option<&'static str> {
    let c = r.choices.first()?;
    if c.finish_reason.as_deref() == Some("content_filter") {
        return Some("content_filter");
    }
    c.message
        .extra
        .get("refusal")
        .is_some_and(|v| v.as_str().is_some_and(|t| !t.is_empty()))
        .then_some("refusal")
}

/// A short name for why a call failed: the not-admitted gate, else the name of the
/// innermost recognisable error of the chain, else its outcome class.
#[must_use]
pub fn failure_cause(err: &(dyn StdError + 'static)) -> String {
    if let Some(reason) = crate::profiles::retry_reason(err) {
        return reason;
    }
    if let Some(na) = NotAdmitted::of(err) {
        return match na {
            NotAdmitted::CircuitOpen(_) => "circuit_open".into(),
            NotAdmitted::QuotaExceeded(_) => "quota_exceeded".into(),
            NotAdmitted::Paced => "paced".into(),
            NotAdmitted::Unavailable => "backend_unavailable".into(),
            NotAdmitted::Never => "never_admitted".into(),
        };
    }
    let mut cur: Option<&(dyn StdError + 'static)> = Some(err);
    let mut named: Option<String> = None;
    while let Some(e) = cur {
        if let Some(s) = e.downcast_ref::<pgw_core::UpstreamStatus>() {
            named = Some(format!("http_{}", s.status().as_u16()));
        } else if e.is::<pgw_core::EmptyCompletion>() {
            named = Some("empty_completion".into());
        } else if e.is::<pgw_core::InvalidResponse>() {
            named = Some("invalid".into());
        } else if let Some(name) = crate::profiles::error_name(e) {
            named = Some(name);
        }
        cur = e.source();
    }
    named.unwrap_or_else(|| classify_error(err).as_str().to_owned())
}

/// How the driver runs the traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DriveOptions {
    /// Calls in flight per worker.
    pub concurrency: u32,
    /// RSS samples to take over the run (about; one every `calls / rss_samples` calls).
    pub rss_samples: u64,
    /// Calls expected (for the progress bar and the RSS cadence).
    pub calls: u64,
}

/// Live numbers of a run, shared with the progress display.
#[derive(Debug, Default)]
struct Live {
    done: AtomicU64,
    ok: AtomicU64,
    inflight: AtomicU64,
}

/// Runs `traffic` over one client per worker, recording a [`CallRow`] per call into
/// `recorder`; returns the RSS samples.
///
/// Calls are taken from `traffic` in order by whichever worker has a free slot.
pub async fn drive<I>(
    clients: Vec<Arc<dyn Client>>,
    traffic: I,
    recorder: &Recorder,
    opts: DriveOptions,
    progress: &ProgressBar,
) -> Vec<RssSample>
where
    I: Iterator<Item = SoakCall> + Send + 'static,
{
    let traffic = Arc::new(Mutex::new(traffic));
    let live = Arc::new(Live::default());
    let rss = Arc::new(Mutex::new(vec![RssSample {
        calls_done: 0,
        rss_kib: crate::rss::current_kib().unwrap_or(0),
    }]));
    let every = (opts.calls / opts.rss_samples.max(1)).max(1);
    let mut workers = JoinSet::new();
    for (w, client) in clients.into_iter().enumerate() {
        let worker = u32::try_from(w).unwrap_or(u32::MAX);
        let traffic = Arc::clone(&traffic);
        let live = Arc::clone(&live);
        let rss = Arc::clone(&rss);
        let recorder = recorder.clone();
        let progress = progress.clone();
        workers.spawn(async move {
            let origin = recorder.clock().origin();
            let mut inflight = JoinSet::new();
            let finished = |done: Result<bool, tokio::task::JoinError>| {
                live.inflight.fetch_sub(1, Ordering::Relaxed);
                let ok = done.unwrap_or(false);
                let n = live.done.fetch_add(1, Ordering::Relaxed) + 1;
                let good = live.ok.fetch_add(u64::from(ok), Ordering::Relaxed) + u64::from(ok);
                if n % every == 0 {
                    lock(&rss).push(RssSample {
                        calls_done: n,
                        rss_kib: crate::rss::current_kib().unwrap_or(0),
                    });
                }
                if n % 16 == 0 || n == opts.calls {
                    progress.set_position(n);
                    progress.set_message(status_line(
                        n,
                        good,
                        live.inflight.load(Ordering::Relaxed),
                        &recorder,
                    ));
                }
            };
            loop {
                if inflight.len() < opts.concurrency as usize {
                    let next = lock(&traffic).next();
                    if let Some(mut call) = next {
                        // Open loop: hold the call until it arrives, reaping finished calls.
                        if let Some(at) = call.arrival.map(|d| origin + d) {
                            let arrived = tokio::time::sleep_until(at);
                            tokio::pin!(arrived);
                            loop {
                                tokio::select! {
                                    () = &mut arrived => break,
                                    Some(done) = inflight.join_next() => finished(done),
                                }
                            }
                        }
                        call.worker = worker;
                        live.inflight.fetch_add(1, Ordering::Relaxed);
                        inflight.spawn(run_one(Arc::clone(&client), call, recorder.clone()));
                        continue;
                    }
                }
                let Some(done) = inflight.join_next().await else {
                    break;
                };
                finished(done);
            }
        });
    }
    while workers.join_next().await.is_some() {}
    let mut samples = std::mem::take(&mut *lock(&rss));
    let n = live.done.load(Ordering::Relaxed);
    if samples.last().is_none_or(|s| s.calls_done != n) {
        samples.push(RssSample {
            calls_done: n,
            rss_kib: crate::rss::current_kib().unwrap_or(0),
        });
    }
    progress.set_position(n);
    samples
}

#[allow(clippy::cast_precision_loss)]
fn status_line(done: u64, ok: u64, inflight: u64, recorder: &Recorder) -> String {
    let per = recorder.live_attempts();
    let total: u64 = per.iter().map(|(_, n)| n).sum();
    let shares: Vec<String> = per
        .iter()
        .map(|(s, n)| {
            format!(
                "{s}:{:.0}",
                if total == 0 {
                    0.0
                } else {
                    *n as f64 * 100.0 / total as f64
                }
            )
        })
        .collect();
    format!(
        "ok {:.1}% inflight {inflight} attempt% {}",
        ok as f64 * 100.0 / done.max(1) as f64,
        shares.join(" ")
    )
}

async fn run_one(client: Arc<dyn Client>, call: SoakCall, recorder: Recorder) -> bool {
    let clock = recorder.clock();
    let started_ms = call
        .arrival
        .map_or_else(|| clock.now_ms(), |d| clock.ms_at(clock.origin() + d));
    let (id, worker, kind, structured) = (call.call_id(), call.worker, call.kind, call.structured);
    let stream = call.request.stream;
    let result = client.call(call).await;
    let ended_ms = clock.now_ms();
    let first_chunk_ms = result
        .as_ref()
        .ok()
        .map(|d| d.first_chunk.map_or(ended_ms, |t| clock.ms_at(t)));
    let result = result.map(|d| d.response);
    let verdict = judge_answer(structured, &result);
    let ok = verdict.is_ok();
    recorder.call(CallRow {
        call_id: id,
        worker,
        kind: kind.to_owned(),
        started_ms,
        ended_ms,
        ok,
        cause: verdict.err().unwrap_or_else(|| "ok".into()),
        stream,
        first_chunk_ms,
    });
    ok
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::RunClock;
    use pgw_core::openai::{ChatMessage, Choice};
    use std::time::Duration;

    /// A complete answer: `text`, ended as the simulator ends every answer.
    fn answer(text: &str) -> ChatResponse {
        ChatResponse {
            choices: vec![Choice::new(
                0,
                ChatMessage::new("assistant", text),
                Some("stop".into()),
            )],
            ..ChatResponse::default()
        }
    }

    /// A client that counts how many calls are in flight at once and sleeps 1 s per call.
    struct Counting {
        now: AtomicU64,
        max: AtomicU64,
    }

    impl Client for Arc<Counting> {
        fn call(&self, call: SoakCall) -> BoxFuture<'static, Result<Delivered, BoxError>> {
            let me = Arc::clone(self);
            Box::pin(async move {
                let n = me.now.fetch_add(1, Ordering::SeqCst) + 1;
                me.max.fetch_max(n, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(1)).await;
                me.now.fetch_sub(1, Ordering::SeqCst);
                match call.id % 4 {
                    0 => Err(Box::new(pgw_core::CircuitOpen::new(Duration::ZERO)) as BoxError),
                    1 => Ok(answer("not json").into()),
                    _ => Ok(answer("{\"a\":1}").into()),
                }
            })
        }
    }

    #[tokio::test(start_paused = true)]
    async fn dispatch_is_bounded_and_every_call_is_judged() {
        let counting = Arc::new(Counting {
            now: AtomicU64::new(0),
            max: AtomicU64::new(0),
        });
        let clients: Vec<Arc<dyn Client>> =
            vec![Arc::new(Arc::clone(&counting)), Arc::new(Arc::clone(&counting))];
        let traffic = (0..100u64).map(|id| SoakCall {
            id,
            worker: 0,
            kind: "P3",
            request: Arc::new(ChatRequest::default()),
            structured: true,
            arrival: None,
        });
        let recorder = Recorder::in_memory(RunClock::start(), vec!["s1".into()]);
        let opts = DriveOptions {
            concurrency: 3,
            rss_samples: 10,
            calls: 100,
        };
        let rss = drive(clients, traffic, &recorder, opts, &ProgressBar::hidden()).await;
        assert_eq!(
            counting.max.load(Ordering::SeqCst),
            6,
            "2 workers x 3 in flight, never more"
        );
        let (_, calls) = recorder.finish().unwrap();
        assert_eq!(calls.len(), 100);
        let ok = calls.iter().filter(|c| c.ok).count();
        assert_eq!(ok, 50);
        assert_eq!(calls.iter().filter(|c| c.cause == "invalid").count(), 25);
        assert_eq!(calls.iter().filter(|c| c.cause == "circuit_open").count(), 25);
        assert!(rss.len() >= 10, "{rss:?}");
        assert_eq!(rss.last().unwrap().calls_done, 100);
        // 100 calls of 1 s, 6 at a time: 17 rounds of virtual time.
        assert_eq!(calls.iter().map(|c| c.ended_ms).max(), Some(17_000));
    }

    /// A client that answers after 10 s.
    struct Slow;

    impl Client for Slow {
        fn call(&self, _call: SoakCall) -> BoxFuture<'static, Result<Delivered, BoxError>> {
            Box::pin(async {
                tokio::time::sleep(Duration::from_secs(10)).await;
                Ok(answer("hi").into())
            })
        }
    }

    #[tokio::test(start_paused = true)]
    async fn open_loop_calls_start_at_their_arrival_and_wait_for_a_slot() {
        // One worker, one slot, calls arriving every 4 s while each takes 10 s: call n
        // arrives at 4n s but starts when the slot frees, at 10n s.
        let traffic = (0..4u64).map(|id| SoakCall {
            id,
            worker: 0,
            kind: "P1",
            request: Arc::new(ChatRequest::default()),
            structured: false,
            arrival: Some(Duration::from_secs(4 * id)),
        });
        let recorder = Recorder::in_memory(RunClock::start(), vec!["s1".into()]);
        let opts = DriveOptions {
            concurrency: 1,
            rss_samples: 1,
            calls: 4,
        };
        drive(
            vec![Arc::new(Slow)],
            traffic,
            &recorder,
            opts,
            &ProgressBar::hidden(),
        )
        .await;
        let (_, mut calls) = recorder.finish().unwrap();
        calls.sort_by_key(|c| c.started_ms);
        let got: Vec<(u64, u64)> = calls.iter().map(|c| (c.started_ms, c.ended_ms)).collect();
        assert_eq!(
            got,
            vec![(0, 10_000), (4_000, 20_000), (8_000, 30_000), (12_000, 40_000)],
            "latency counts from arrival, the wait for the slot included"
        );
        assert!(calls.iter().all(|c| c.first_chunk_ms == Some(c.ended_ms)));
    }

    #[test]
    fn causes() {
        let e: BoxError = Box::new(pgw_core::UpstreamStatus::new(http_status(401), None, "bad key"));
        assert_eq!(failure_cause(&*e), "http_401");
        let e: BoxError = Box::new(std::io::Error::from(std::io::ErrorKind::TimedOut));
        assert_eq!(failure_cause(&*e), "transient");
        assert_eq!(
            judge_answer(false, &Ok(answer(" "))),
            Err("empty_completion".into())
        );
        assert_eq!(judge_answer(true, &Ok(answer("[1]"))), Err("invalid".into()));
        assert_eq!(judge_answer(true, &Ok(answer("{}"))), Ok(()));
        // Text without a finish_reason was cut before its end: a truncated stream
        // accumulated, not an answer.
        let mut cut = answer("The first half of an ans");
        cut.choices[0].finish_reason = None;
        assert_eq!(judge_answer(false, &Ok(cut.clone())), Err("unfinished".into()));
        cut.choices[0].finish_reason = Some(pgw_core::openai::FINISH_ERROR.into());
        assert_eq!(judge_answer(false, &Ok(cut.clone())), Err("unfinished".into()));
        for done in COMPLETE_FINISH_REASONS {
            cut.choices[0].finish_reason = Some(done.into());
            assert_eq!(judge_answer(false, &Ok(cut.clone())), Ok(()), "{done}");
        }
        let mut filtered = answer("");
        filtered.choices[0].finish_reason = Some("content_filter".into());
        assert_eq!(judge_answer(false, &Ok(filtered)), Err("content_filter".into()));
        let mut refused = answer("");
        refused.choices[0]
            .message
            .extra
            .insert("refusal".into(), "I can't help with that.".into());
        assert_eq!(judge_answer(false, &Ok(refused)), Err("refusal".into()));
    }

    fn http_status(code: u16) -> http::StatusCode {
        http::StatusCode::from_u16(code).unwrap()
    }
}
