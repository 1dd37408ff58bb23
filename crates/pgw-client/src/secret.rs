//! [`SecretKey`]: an API key that never prints.

use std::fmt;
use std::sync::Arc;

/// An API key. `Debug` and `Display` print `***`; the only way to read it is
/// [`SecretKey::expose`], called in one place: when the `authorization` header is built.
///
/// ```
/// use pgw_client::SecretKey;
/// let key = SecretKey::new("sk-live-123");
/// assert_eq!(format!("{key} {key:?}"), "*** ***");
/// assert_eq!(key.expose(), "sk-live-123");
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct SecretKey(Arc<str>);

impl SecretKey {
    /// Wraps a key.
    pub fn new(key: impl Into<Arc<str>>) -> Self {
        Self(key.into())
    }

    /// The key itself. Never log the result.
    #[must_use]
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Whether the key is the empty string.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Replaces every occurrence of the key in `text` by `***` (providers sometimes
    /// echo the key they refused in their error message).
    #[must_use]
    pub fn scrub(&self, text: &str) -> String {
        // Keys shorter than 4 bytes would scrub ordinary words; nobody issues those.
        if self.0.len() < 4 {
            return text.to_owned();
        }
        text.replace(&*self.0, "***")
    }
}

impl fmt::Debug for SecretKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl fmt::Display for SecretKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl<'de> serde::Deserialize<'de> for SecretKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Ok(Self::new(s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_prints_and_scrubs() {
        let k = SecretKey::new("sk-abcdef");
        assert_eq!(format!("{k:?}/{k}/{:?}", Some(&k)), "***/***/Some(***)");
        assert_eq!(k.scrub("bad key sk-abcdef given"), "bad key *** given");
        assert_eq!(SecretKey::new("ab").scrub("ab cd"), "ab cd");
    }
}
