//! The `Classify` trait: how any service's result becomes an [`Outcome`], and when.

use crate::{BoxError, NotAdmitted, Outcome};

/// What a layer does once an attempt's result is final: record it, release what it
/// holds. Called with the final result; dropped unrun when the caller drops the
/// answer first (so what it owns is released on drop, as the layer's future would).
pub type Settle<Res, E> = Box<dyn FnOnce(&Result<Res, E>) + Send>;

/// Turns the result of one attempt into an [`Outcome`].
///
/// Generic over `&Result<Res, E>` (like tower's retry `Policy` and tower-http's
/// `classify`), so every pgw layer works over any `Service`. Closures implement it:
///
/// ```
/// use pgw_core::{Classify, Outcome};
///
/// let classify = |r: &Result<u16, String>| match r {
///     Ok(200) => Outcome::Success,
///     Ok(429) => Outcome::RateLimited { retry_after: None },
///     Ok(_) | Err(_) => Outcome::Transient,
/// };
/// assert_eq!(classify.classify(&Ok(429)), Outcome::RateLimited { retry_after: None });
/// assert_eq!(classify.classify(&Err("reset".into())), Outcome::Transient);
/// ```
pub trait Classify<Res, E> {
    /// Classifies one attempt's result.
    fn classify(&self, result: &Result<Res, E>) -> Outcome;

    /// Whether `result` is an attempt still running: a response handed up before its
    /// end, such as a stream passed through to the caller after its first chunk. A
    /// layer then records nothing now and hands what it would do to
    /// [`Classify::defer`]. The default: every result is final.
    fn in_progress(&self, result: &Result<Res, E>) -> bool {
        let _ = result;
        false
    }

    /// Keeps `then`, to be called with the final result when the running `result`
    /// ends (or dropped unrun if the caller drops it first). Called only when
    /// [`Classify::in_progress`] said so; the default runs `then` at once.
    fn defer(&self, result: &mut Result<Res, E>, then: Settle<Res, E>) {
        then(result);
    }
}

/// Runs `then` on `result` now, or when it ends if the classifier says it is still
/// running ([`Classify::in_progress`]): the one way a layer settles an attempt. A
/// final result costs no allocation.
pub fn settle<C, Res, E, F>(classifier: &C, result: &mut Result<Res, E>, then: F)
where
    C: Classify<Res, E> + ?Sized,
    F: FnOnce(&Result<Res, E>) + Send + 'static,
{
    if classifier.in_progress(result) {
        classifier.defer(result, Box::new(then));
    } else {
        then(result);
    }
}

/// The outcome of an attempt, or `None` when the result is not an attempt at all: a
/// gate below refused the call ([`NotAdmitted`]) and the source was never asked. The
/// one place every layer decides both.
pub fn attempt_outcome<C, Res>(classifier: &C, result: &Result<Res, BoxError>) -> Option<Outcome>
where
    C: Classify<Res, BoxError> + ?Sized,
{
    match result {
        Err(e) if NotAdmitted::of(&**e).is_some() => None,
        r => Some(classifier.classify(r)),
    }
}

impl<F, Res, E> Classify<Res, E> for F
where
    F: Fn(&Result<Res, E>) -> Outcome,
{
    fn classify(&self, result: &Result<Res, E>) -> Outcome {
        self(result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::QuotaExceeded;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::Duration;

    #[test]
    fn a_final_result_settles_at_once_and_a_refusal_is_not_an_attempt() {
        let runs = Arc::new(AtomicU32::new(0));
        let r = Arc::clone(&runs);
        let mut ok: Result<u8, BoxError> = Ok(1);
        settle(&OkIsSuccess, &mut ok, move |_| {
            r.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(runs.load(Ordering::Relaxed), 1);
        assert_eq!(attempt_outcome(&OkIsSuccess, &ok), Some(Outcome::Success));
        let refused: Result<u8, BoxError> = Err(QuotaExceeded::new("rpm", Duration::from_secs(1)).into());
        assert_eq!(attempt_outcome(&OkIsSuccess, &refused), None);
        let failed: Result<u8, BoxError> = Err("reset".into());
        assert_eq!(attempt_outcome(&OkIsSuccess, &failed), Some(Outcome::Transient));
    }
}

/// A classifier for services that never say more than "it worked" or "it failed":
/// `Ok` is `Success`, `Err` is `Transient`. The default of every layer used alone.
#[derive(Clone, Copy, Debug, Default)]
pub struct OkIsSuccess;

impl<Res, E> Classify<Res, E> for OkIsSuccess {
    fn classify(&self, result: &Result<Res, E>) -> Outcome {
        if result.is_ok() {
            Outcome::Success
        } else {
            Outcome::Transient
        }
    }
}
