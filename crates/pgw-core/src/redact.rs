//! Hiding secrets in URLs before they are printed (`Debug`, error messages, logs).

/// `url` with its user info hidden (`scheme://user:secret@host` -> `scheme://***@host`)
/// and the value of every query parameter `secret` names (`?key=sk-1` -> `?key=***`).
/// The user info is found on the whole URL first: a password may hold a `?`. So an
/// `@` in the query (`?user=ops@corp.com&key=sk-1`) hides everything before it as if
/// it were user info, and what follows it is still read as query parameters.
///
/// ```
/// use pgw_core::redact::redact_url_with;
///
/// let key = |k: &str| k == "key";
/// assert_eq!(
///     redact_url_with("https://llm.test/v1?user=ops@corp.com&key=sk-1", key),
///     "https://***@corp.com&key=***"
/// );
/// assert_eq!(redact_url_with("redis://:p?w@h:6379?key=1", key), "redis://***@h:6379?key=***");
/// ```
pub fn redact_url_with(url: &str, secret: impl Fn(&str) -> bool) -> String {
    let (mut out, rest, in_query) = match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s + 3 => (
            format!("{}://***@", &url[..s]),
            &url[at + 1..],
            // The `@` may have been in the query: then so is what follows it (up to
            // a `?` of its own, which only a password holding one explains).
            url[s + 3..at].contains('?') && !url[at + 1..].contains('?'),
        ),
        _ => (String::new(), url, false),
    };
    let (base, query) = match rest.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None if in_query => ("", Some(rest)),
        None => (rest, None),
    };
    out.push_str(base);
    if let Some(query) = query {
        if !in_query {
            out.push('?');
        }
        let params: Vec<String> = query
            .split('&')
            .map(|p| match p.split_once('=') {
                Some((k, _)) if secret(k) => format!("{k}=***"),
                _ => p.to_owned(),
            })
            .collect();
        out.push_str(&params.join("&"));
    }
    out
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
