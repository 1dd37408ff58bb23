//! [`RateLimitLayer`]: wraps any service in a [`RateLimit`].

use std::fmt;
use std::sync::Arc;

use tower_layer::Layer;

use crate::hooks::{ChatEstimate, ChatUsage, NoObserver};
use crate::service::{Hooks, RateLimit};
use crate::{Admission, RateLimiter};

/// Applies a [`RateLimiter`] to a service: every request is admitted (requests, tokens,
/// concurrency, holds) before it is dispatched, and settled after.
///
/// Type parameters are the hooks: `E` estimates a request's tokens (default
/// [`ChatEstimate`]), `U` reads the real usage of a response (default [`ChatUsage`]),
/// `O` observes every admission (default [`NoObserver`]).
#[derive(Clone)]
pub struct RateLimitLayer<E = ChatEstimate, U = ChatUsage, O = NoObserver> {
    limiter: RateLimiter,
    estimate: E,
    usage: U,
    observer: O,
}

impl<E, U, O> fmt::Debug for RateLimitLayer<E, U, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("limiter", &self.limiter)
            .finish_non_exhaustive()
    }
}

impl RateLimitLayer {
    /// A layer over `limiter` with the chat hooks.
    #[must_use]
    pub const fn new(limiter: RateLimiter) -> Self {
        Self {
            limiter,
            estimate: ChatEstimate,
            usage: ChatUsage,
            observer: NoObserver,
        }
    }
}

impl<E, U, O> RateLimitLayer<E, U, O> {
    /// Replaces the token estimate (a closure `Fn(&Req) -> u64`, or [`NoTokens`](crate::NoTokens)).
    pub fn token_estimate<E2>(self, estimate: E2) -> RateLimitLayer<E2, U, O> {
        RateLimitLayer {
            limiter: self.limiter,
            estimate,
            usage: self.usage,
            observer: self.observer,
        }
    }

    /// Replaces the usage reader (a closure `Fn(&Res) -> Option<u64>`).
    pub fn usage<U2>(self, usage: U2) -> RateLimitLayer<E, U2, O> {
        RateLimitLayer {
            limiter: self.limiter,
            estimate: self.estimate,
            usage,
            observer: self.observer,
        }
    }

    /// Calls `observer(&req, &admission)` for every admission, before dispatch.
    pub fn on_admission<O2, Req>(self, observer: O2) -> RateLimitLayer<E, U, O2>
    where
        O2: Fn(&Req, &Admission),
    {
        RateLimitLayer {
            limiter: self.limiter,
            estimate: self.estimate,
            usage: self.usage,
            observer,
        }
    }

    /// The limiter.
    pub const fn limiter(&self) -> &RateLimiter {
        &self.limiter
    }
}

impl<S, E: Clone, U: Clone, O: Clone> Layer<S> for RateLimitLayer<E, U, O> {
    type Service = RateLimit<S, E, U, O>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit::from_hooks(
            inner,
            Arc::new(Hooks {
                limiter: self.limiter.clone(),
                estimate: self.estimate.clone(),
                usage: self.usage.clone(),
                observer: self.observer.clone(),
            }),
        )
    }
}
