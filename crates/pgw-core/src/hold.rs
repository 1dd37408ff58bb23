//! The hold hook: make a source not admitted until a time, so a 429's pushback is
//! honoured by every process.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use crate::{BoxError, SourceId};

/// A boxed, sendable future, as returned by [`Hold::hold`].
pub type HoldFuture = Pin<Box<dyn Future<Output = Result<(), BoxError>> + Send + 'static>>;

/// Something that can hold a source (and, if it knows it, the source's account) so no
/// process admits it for a while.
///
/// The retry layer calls it on 429 pushback; `tower-ratelimit-redis` implements it
/// with one round trip, shared by every process through its backend. Defined here so
/// the retry layer does not depend on the limiter.
pub trait Hold: Send + Sync {
    /// Holds `source` (and its account, when the implementation knows one) for
    /// `duration` from now.
    fn hold(&self, source: &SourceId, duration: Duration) -> HoldFuture;

    /// Holds `source` alone, not its account: the pushback was the source's own limit
    /// ([`crate::pushback_is_account_wide`] says which). Default: [`Hold::hold`].
    fn hold_source(&self, source: &SourceId, duration: Duration) -> HoldFuture {
        self.hold(source, duration)
    }

    /// As [`Hold::hold`] (`account_wide`) or [`Hold::hold_source`], after an
    /// overloaded provider's pushback (a 5xx with `Retry-After`) rather than a rate
    /// limit: an implementation that can keep the reason refuses the calls it holds
    /// with a [`QuotaExceeded`](crate::QuotaExceeded) marked
    /// [`after_overload`](crate::QuotaExceeded::after_overload), so they are told
    /// "overloaded", not "rate limited", also on another process and with no attempt
    /// of their own. Default: the hold without the reason.
    fn hold_after_overload(&self, source: &SourceId, duration: Duration, account_wide: bool) -> HoldFuture {
        if account_wide {
            self.hold(source, duration)
        } else {
            self.hold_source(source, duration)
        }
    }

    /// Whether a hold placed here keeps the source not admitted (the gates below
    /// refuse it until the hold ends). Default `true`. A hook that enforces nothing
    /// ([`NoHold`]) says `false`, and the retry layer treats it as no hook at all: it
    /// sleeps through the pushback itself, instead of sending the next attempt at
    /// once to a source nothing holds (back to back, for as long as the call may wait).
    fn enforces(&self) -> bool {
        true
    }
}

/// A hold that does nothing: the default when no limiter is present. It enforces
/// nothing ([`Hold::enforces`] is `false`): a retry layer given it sleeps through a
/// pushback as without a hook.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoHold;

impl Hold for NoHold {
    fn hold(&self, _source: &SourceId, _duration: Duration) -> HoldFuture {
        Box::pin(std::future::ready(Ok(())))
    }

    fn enforces(&self) -> bool {
        false
    }
}
