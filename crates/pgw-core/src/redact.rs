//! Hiding secrets in URLs before they are printed (`Debug`, error messages, logs).

/// `url` with its user info hidden (`scheme://user:secret@host` -> `scheme://***@host`)
/// and the value of every query parameter `secret` names (`?key=sk-1` -> `?key=***`).
/// The user info is found on the whole URL first: a password may hold a `?`.
pub fn redact_url_with(url: &str, secret: impl Fn(&str) -> bool) -> String {
    let (mut out, rest) = match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s + 3 => (format!("{}://***@", &url[..s]), &url[at + 1..]),
        _ => (String::new(), url),
    };
    let (base, query) = match rest.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (rest, None),
    };
    out.push_str(base);
    if let Some(query) = query {
        out.push('?');
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
