//! The `Classify` trait: how any service's result becomes an [`Outcome`].

use crate::Outcome;

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
}

impl<F, Res, E> Classify<Res, E> for F
where
    F: Fn(&Result<Res, E>) -> Outcome,
{
    fn classify(&self, result: &Result<Res, E>) -> Outcome {
        self(result)
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
