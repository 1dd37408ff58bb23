//! AIMD on the simulator's account-level 429 model (pgw-sim's P6 account curve): 64
//! callers hammering the healthy source of a shared account, with and without AIMD.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use pgw_core::openai::ChatRequest;
use pgw_core::{BoxError, HttpClassifier};
use pgw_sim::{PoolConfig, SimPool};
use tower::util::BoxCloneService;
use tower::{Service, ServiceExt};
use tower_aimd::{AimdConfig, AimdLayer};
use tower_layer::Layer;

const CALLERS: u64 = 64;
const CALLS_EACH: u64 = 15;

type Svc = BoxCloneService<http::Request<Bytes>, http::Response<pgw_sim::SimBody>, BoxError>;

fn request() -> http::Request<Bytes> {
    let mut chat = ChatRequest::user("m", "a short question");
    chat.max_tokens = Some(50);
    http::Request::post("/v1/chat/completions")
        .header(
            "authorization",
            format!("Bearer {}", pgw_sim::config::P6_SHARED_KEY),
        )
        .body(Bytes::from(serde_json::to_vec(&chat).unwrap()))
        .unwrap()
}

/// Runs every caller to completion; returns (429s, attempts).
async fn hammer(svc: Svc) -> (u64, u64) {
    let limited = Arc::new(AtomicU64::new(0));
    let attempts = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..CALLERS {
        let mut svc = svc.clone();
        let (limited, attempts) = (Arc::clone(&limited), Arc::clone(&attempts));
        tasks.push(tokio::spawn(async move {
            for _ in 0..CALLS_EACH {
                let resp = svc.ready().await.unwrap().call(request()).await.unwrap();
                attempts.fetch_add(1, Ordering::Relaxed);
                if resp.status() == http::StatusCode::TOO_MANY_REQUESTS {
                    limited.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    (limited.load(Ordering::Relaxed), attempts.load(Ordering::Relaxed))
}

#[tokio::test(start_paused = true)]
async fn aimd_brings_the_account_429_share_far_down() {
    let pool = || SimPool::new(PoolConfig::p6(), 11).unwrap();

    let unpaced: Svc = BoxCloneService::new(pool().service("s1").unwrap());
    let (l0, n0) = hammer(unpaced).await;

    let aimd = AimdLayer::new(AimdConfig {
        max_concurrency: Some(64),
        caller_concurrency: Some(usize::try_from(CALLERS).unwrap()),
        ..AimdConfig::default()
    })
    .unwrap()
    .with_classifier(HttpClassifier);
    let handle = aimd.handle();
    let paced: Svc = BoxCloneService::new(aimd.layer(pool().service("s1").unwrap()));
    let (l1, n1) = hammer(paced).await;

    let (share0, share1) = (l0 as f64 / n0 as f64, l1 as f64 / n1 as f64);
    println!("429 share of attempts: unpaced {l0}/{n0} = {share0:.3}, AIMD {l1}/{n1} = {share1:.3}");
    assert!(
        share0 > 0.25,
        "the account curve must bite without pacing: {share0:.3}"
    );
    assert!(share1 < share0 / 3.0, "AIMD: {share1:.3} vs unpaced {share0:.3}");
    assert_eq!(handle.inflight(), 0, "every slot returned");
}
