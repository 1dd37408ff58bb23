//! Hiding secrets in URLs before they are printed (`Debug`, error messages, logs).

/// `url` with its user info hidden (`scheme://user:secret@host` -> `scheme://***@host`)
/// and the value of every query parameter `secret` names (`?key=sk-1` -> `?key=***`).
/// The user info is found on the whole URL first: a password may hold a `?`. So an
/// `@` in the query (`?user=ops@corp.com&key=sk-1`) hides everything before it as if
/// it were user info, and what follows it is read as query parameters. Parameters are
/// split at every `&` and every `?` after the first: a `key=` is hidden wherever a
/// stray `?` put it.
///
/// ```
/// use pgw_core::redact::redact_url_with;
///
/// let key = |k: &str| k == "key";
/// assert_eq!(
///     redact_url_with("https://llm.test/v1?user=ops@corp.com&key=sk-1", key),
///     "https://***@corp.com&key=***"
/// );
/// assert_eq!(
///     redact_url_with("https://h/v1?u=a@b&key=sk-1&r=c?d", key),
///     "https://***@b&key=***&r=c?d"
/// );
/// assert_eq!(redact_url_with("redis://:p?w@h:6379?key=1", key), "redis://***@h:6379?key=***");
/// assert_eq!(redact_url_with("https://h/v1?a=b?key=sk-1", key), "https://h/v1?a=b?key=***");
/// ```
pub fn redact_url_with(url: &str, secret: impl Fn(&str) -> bool) -> String {
    let (mut out, rest, after_query) = match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s + 3 => (
            format!("{}://***@", &url[..s]),
            &url[at + 1..],
            // A `?` before the `@`: what follows may be query (an `@` in a value) or
            // the host (a password holding a `?`); read as parameters either way.
            url[s + 3..at].contains('?'),
        ),
        _ => (String::new(), url, false),
    };
    match (after_query, rest.find('?')) {
        (true, _) => mask_params(&mut out, rest, &secret),
        (false, Some(q)) => {
            out.push_str(&rest[..=q]);
            mask_params(&mut out, &rest[q + 1..], &secret);
        }
        (false, None) => out.push_str(rest),
    }
    out
}

/// Appends `query` to `out` with the value of every `k=v` whose `k` is `secret` hidden,
/// its parts split at `&` and `?` (kept as they were).
fn mask_params(out: &mut String, query: &str, secret: &impl Fn(&str) -> bool) {
    for part in query.split_inclusive(['&', '?']) {
        let (body, sep) = match part.strip_suffix(['&', '?']) {
            Some(body) => (body, &part[body.len()..]),
            None => (part, ""),
        };
        match body.split_once('=') {
            Some((k, _)) if secret(k) => {
                out.push_str(k);
                out.push_str("=***");
            }
            _ => out.push_str(body),
        }
        out.push_str(sep);
    }
}

/// A provider's base URL as it may be printed: the user info hidden, and every query
/// value but `api-version` (Azure's) hidden: `?key=`, `?api-key=`, `?code=`, `?sig=`
/// and their kin carry credentials, and no other parameter is worth a leak.
///
/// ```
/// use pgw_core::redact::redact_endpoint;
///
/// assert_eq!(
///     redact_endpoint("https://user:tok@llm.test/v1?api-version=2024-06-01&key=AIza1"),
///     "https://***@llm.test/v1?api-version=2024-06-01&key=***"
/// );
/// assert_eq!(redact_endpoint("https://api.openai.com/v1"), "https://api.openai.com/v1");
/// ```
#[must_use]
pub fn redact_endpoint(url: &str) -> String {
    redact_url_with(url, |k| !k.eq_ignore_ascii_case("api-version"))
}
