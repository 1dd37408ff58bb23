//! Helpers shared by the simulator's integration tests: a tiny client of the virtual
//! provider with a total timeout and an inter-frame watchdog.
#![allow(dead_code, unreachable_pub)]

use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use pgw_core::openai::{ChatChunk, ChatRequest, ChatResponse, ChunkAccumulator};
use pgw_core::sse::{SseDecoder, SseEvent};
use pgw_sim::SimService;
use tokio::time::{Instant, timeout};
use tower_service::Service;

/// What the test client saw.
#[derive(Clone, Debug, PartialEq)]
#[allow(
    clippy::large_enum_variant,
    reason = "a test's record of one answer, made a few times per test"
)]
pub enum Seen {
    /// A 200 with the answer (accumulated for streams), the time to headers and the
    /// longest gap between frames.
    Answer {
        resp: ChatResponse,
        to_headers: Duration,
        max_gap: Duration,
        frames: usize,
    },
    /// A non-200 status with its `retry-after` header and body.
    Status {
        status: u16,
        retry_after: Option<String>,
        body: String,
    },
    /// The total timeout fired before the end.
    TimedOut,
    /// The inter-frame watchdog cut the stream.
    Cut,
}

impl Seen {
    pub fn status(&self) -> Option<u16> {
        match self {
            Self::Answer { .. } => Some(200),
            Self::Status { status, .. } => Some(*status),
            _ => None,
        }
    }
}

pub fn request(req: &ChatRequest, key: Option<&str>) -> http::Request<Bytes> {
    let mut b = http::Request::post("/v1/chat/completions").header("content-type", "application/json");
    if let Some(k) = key {
        b = b.header("authorization", format!("Bearer {k}"));
    }
    b.body(Bytes::from(serde_json::to_vec(req).unwrap())).unwrap()
}

/// Calls `svc` with a total timeout and an inter-frame watchdog.
pub async fn call(
    svc: &mut SimService,
    req: &ChatRequest,
    key: Option<&str>,
    total: Duration,
    watchdog: Duration,
) -> Seen {
    let start = Instant::now();
    let deadline = start + total;
    let fut = svc.call(request(req, key));
    let resp = match timeout(total, fut).await {
        Err(_) => return Seen::TimedOut,
        Ok(r) => r.expect("the simulator never fails"),
    };
    let to_headers = start.elapsed();
    let status = resp.status().as_u16();
    let retry_after = resp
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_owned());
    let stream = resp.headers()["content-type"] == "text/event-stream";
    let mut body = resp.into_body();
    if status != 200 || !stream {
        let bytes = body.collect().await.unwrap().to_bytes();
        if status != 200 {
            return Seen::Status {
                status,
                retry_after,
                body: String::from_utf8(bytes.to_vec()).unwrap(),
            };
        }
        return Seen::Answer {
            resp: serde_json::from_slice(&bytes).unwrap(),
            to_headers,
            max_gap: Duration::ZERO,
            frames: 1,
        };
    }
    let mut dec = SseDecoder::default();
    let mut acc = ChunkAccumulator::default();
    let mut max_gap = Duration::ZERO;
    let mut last = Instant::now();
    let mut frames = 0;
    let mut done = false;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let wait = left.min(watchdog);
        let frame = match timeout(wait, body.frame()).await {
            Err(_) if left <= watchdog => return Seen::TimedOut,
            Err(_) => return Seen::Cut,
            Ok(None) => break,
            Ok(Some(f)) => f.unwrap(),
        };
        let Ok(data) = frame.into_data() else { continue };
        frames += 1;
        max_gap = max_gap.max(last.elapsed());
        last = Instant::now();
        dec.feed(&data).unwrap();
        while let Some(ev) = dec.next_event() {
            match ev {
                SseEvent::Data(d) => acc.push(&serde_json::from_str::<ChatChunk>(&d).unwrap()),
                SseEvent::Done => done = true,
                SseEvent::Error(e) => panic!("an error event: {e}"),
            }
        }
    }
    assert!(done, "stream ended without [DONE]");
    Seen::Answer {
        resp: acc.finish(),
        to_headers,
        max_gap,
        frames,
    }
}

/// A fraction with a tolerance check that prints what it compares.
#[track_caller]
pub fn assert_rate(name: &str, hits: usize, n: usize, want: f64, tol: f64) {
    let got = hits as f64 / n as f64;
    println!("{name}: {hits}/{n} = {got:.4} (configured {want}, tolerance {tol})");
    assert!(
        (got - want).abs() <= tol,
        "{name}: {got:.4} outside {want} +- {tol} ({hits}/{n})"
    );
}

/// A whole answer as bytes: status, headers, body, and for a stream its SSE data
/// payloads in order (`[DONE]` included as is).
#[derive(Debug)]
pub struct Raw {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: String,
    pub events: Vec<String>,
}

impl Raw {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap()
    }

    /// The stream's events that parse as JSON.
    pub fn chunks(&self) -> Vec<serde_json::Value> {
        self.events
            .iter()
            .filter_map(|e| serde_json::from_str(e).ok())
            .collect()
    }
}

pub fn json_request(body: &serde_json::Value, key: Option<&str>) -> http::Request<Bytes> {
    let mut b = http::Request::post("/v1/chat/completions").header("content-type", "application/json");
    if let Some(k) = key {
        b = b.header("authorization", format!("Bearer {k}"));
    }
    b.body(Bytes::from(body.to_string())).unwrap()
}

/// Reads a response to the end.
pub async fn read(resp: http::Response<pgw_sim::SimBody>) -> Raw {
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let body = String::from_utf8(bytes.to_vec()).unwrap();
    let events = if headers
        .get("content-type")
        .is_some_and(|v| v == "text/event-stream")
    {
        body.split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .map(str::to_owned)
            .collect()
    } else {
        Vec::new()
    };
    Raw {
        status,
        headers,
        body,
        events,
    }
}

/// Calls `svc` with a JSON body and reads the whole answer.
pub async fn raw(svc: &mut SimService, body: &serde_json::Value, key: Option<&str>) -> Raw {
    read(svc.call(json_request(body, key)).await.unwrap()).await
}
