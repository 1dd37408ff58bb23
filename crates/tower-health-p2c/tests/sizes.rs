//! Request sizes: a source that refused a request as too large for it (a context
//! window) is not offered requests as large first, and is offered them again once
//! `OVERSIZE_MEMORY` has passed.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

mod common;

use common::Req;
use pgw_core::{BoxError, Outcome, ProviderError, UpstreamStatus};
use tower::util::BoxCloneSyncService;
use tower::{Service, ServiceExt, service_fn};
use tower_health_p2c::{BalanceConfig, ClassOf, HealthP2c, OVERSIZE_MEMORY, Sources};

/// Every request in class 0, sized by its `size`.
#[derive(Clone, Copy)]
struct Sized;

impl ClassOf<Req> for Sized {
    fn class_of(&self, _req: &Req) -> usize {
        0
    }
    fn size_of(&self, req: &Req) -> Option<u64> {
        Some(req.size)
    }
}

type Svc = BoxCloneSyncService<Req, &'static str, BoxError>;

/// The provider's answer to a prompt past the model's window.
fn context_length_exceeded() -> BoxError {
    let message = "This model's maximum context length is 1000 tokens.";
    Box::new(
        UpstreamStatus::new(http::StatusCode::BAD_REQUEST, None, message).with_provider(ProviderError {
            message: message.into(),
            code: Some("context_length_exceeded".into()),
            ..ProviderError::default()
        }),
    )
}

/// A source answering in 1 s that refuses requests of `window` tokens or more,
/// counting the requests it gets: `[under 1000 tokens, 1000 or more]`.
fn source(name: &'static str, window: u64, hits: Arc<[AtomicUsize; 2]>) -> Svc {
    BoxCloneSyncService::new(service_fn(move |req: Req| {
        hits[usize::from(req.size >= 1_000)].fetch_add(1, Ordering::SeqCst);
        let refused = req.size >= window;
        async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            if refused {
                Err(context_length_exceeded())
            } else {
                Ok(name)
            }
        }
    }))
}

fn counters() -> Arc<[AtomicUsize; 2]> {
    Arc::new([AtomicUsize::new(0), AtomicUsize::new(0)])
}

/// As pgw's classifier does: a refusal that blames the request (here, its size) is
/// no health sample; any other error is a failure.
fn classify(result: &Result<&'static str, BoxError>) -> Outcome {
    match result {
        Ok(_) => Outcome::Success,
        Err(e) if pgw_core::exceeds_source(&**e) => Outcome::Rejected,
        Err(_) => Outcome::Transient,
    }
}

type Classifier = fn(&Result<&'static str, BoxError>) -> Outcome;

async fn send<K: ClassOf<Req>>(lb: &mut HealthP2c<Svc, Classifier, K>, size: u64, n: usize) {
    for _ in 0..n {
        let req = Req {
            size,
            ..Req::default()
        };
        let _ = lb.ready().await.unwrap().call(req).await;
    }
}

#[tokio::test(start_paused = true)]
async fn a_source_that_refused_a_size_is_not_offered_that_size_first() {
    let small = counters();
    let big = counters();
    let sources: Sources<Svc> = Sources::new();
    sources.insert("small".into(), source("small", 1_000, Arc::clone(&small)));
    sources.insert("big".into(), source("big", u64::MAX, Arc::clone(&big)));
    let mut lb = HealthP2c::new(sources, BalanceConfig::default())
        .unwrap()
        .with_seed(7)
        .with_classifier(classify as Classifier)
        .with_class(Sized);

    send(&mut lb, 5_000, 40).await;
    assert_eq!(
        small[1].load(Ordering::SeqCst),
        1,
        "the small source refused one large prompt, then was not offered them"
    );
    assert_eq!(big[1].load(Ordering::SeqCst), 39);

    // Short calls still go to both: the mark is for sizes, not the source.
    send(&mut lb, 10, 40).await;
    let short = small[0].load(Ordering::SeqCst);
    assert!(short >= 5, "the small source got {short} of 40 short calls");

    // A size under the refused one is still offered, and its refusal lowers the mark.
    send(&mut lb, 2_000, 40).await;
    let after_medium = small[1].load(Ordering::SeqCst);
    assert_eq!(after_medium, 2, "one refusal of 2000 tokens, then none");

    // Once the memory has passed, a large prompt is offered again: one more refusal,
    // and it is learnt again.
    tokio::time::advance(OVERSIZE_MEMORY).await;
    send(&mut lb, 5_000, 40).await;
    assert_eq!(small[1].load(Ordering::SeqCst), 3);
}

#[tokio::test(start_paused = true)]
async fn without_sizes_every_large_prompt_may_meet_the_refusal() {
    // The same pool under the default `ClassOf` (no size): the balancer learns nothing
    // of sizes, and the small source, its health untouched by refusals that blame the
    // request, keeps getting about half of the large prompts.
    let small = counters();
    let sources: Sources<Svc> = Sources::new();
    sources.insert("small".into(), source("small", 1_000, Arc::clone(&small)));
    sources.insert("big".into(), source("big", u64::MAX, counters()));
    let mut lb = HealthP2c::new(sources, BalanceConfig::default())
        .unwrap()
        .with_seed(7)
        .with_classifier(classify as Classifier);
    send(&mut lb, 5_000, 40).await;
    let refused = small[1].load(Ordering::SeqCst);
    assert!(
        refused >= 10,
        "the small source got {refused} of 40 large prompts"
    );
}
