//! The clone hook: how a request is copied for the next attempt.

use tokio::time::Instant;

/// Makes the copy of a request that the next attempt sends, like tower's
/// `Policy::clone_request`, and optionally reads the caller's deadline from it.
///
/// The layer asks for a copy before every attempt (the original goes to the attempt);
/// `None` means this request cannot be re-sent, so the call ends after the attempt in
/// flight ([`Reason::NotResendable`](crate::Reason::NotResendable) if it needed another).
/// Closures `Fn(&Req) -> Option<Req>` implement it.
pub trait Resend<Req> {
    /// A copy of `req` for another attempt, or `None` if it cannot be re-sent.
    fn resend(&self, req: &Req) -> Option<Req>;

    /// The caller's deadline for this call, if the request carries one. Default: none.
    fn deadline(&self, _req: &Req) -> Option<Instant> {
        None
    }
}

impl<F, Req> Resend<Req> for F
where
    F: Fn(&Req) -> Option<Req>,
{
    fn resend(&self, req: &Req) -> Option<Req> {
        self(req)
    }
}

/// Re-sends a `Clone` request by cloning it (make the clone cheap: `Arc` inside). The
/// default hook.
#[derive(Clone, Copy, Debug, Default)]
pub struct ByClone;

impl<Req: Clone> Resend<Req> for ByClone {
    fn resend(&self, req: &Req) -> Option<Req> {
        Some(req.clone())
    }
}

/// A per-call deadline carried in an `http::Request`'s extensions, read by
/// [`HttpResend`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallDeadline(pub Instant);

/// Re-sends `http::Request<B>` with a `Clone` body by cloning it, and reads the call's
/// deadline from a [`CallDeadline`] extension.
#[derive(Clone, Copy, Debug, Default)]
pub struct HttpResend;

impl<B: Clone> Resend<http::Request<B>> for HttpResend {
    fn resend(&self, req: &http::Request<B>) -> Option<http::Request<B>> {
        Some(req.clone())
    }

    fn deadline(&self, req: &http::Request<B>) -> Option<Instant> {
        req.extensions().get::<CallDeadline>().map(|d| d.0)
    }
}
