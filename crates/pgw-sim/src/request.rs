//! The simulator's own, lenient reading of a chat completion request.
//!
//! Providers accept more than `pgw_core::openai::ChatRequest` types: a message's
//! `content` may be a string, `null` or an array of parts, `max_completion_tokens`
//! replaces `max_tokens`, and fields nobody knows are ignored. This view reads what the
//! simulator needs from a `serde_json::Value`, so the gateway's stricter type never
//! decides what the provider accepts. For plain string contents it counts the same
//! bytes and hashes the same text as the simulator always did.

use serde_json::Value;

use crate::dist::{hash_bytes, mix};

/// Prompt tokens of one image part: 85, OpenAI's flat cost of a low-detail image.
pub(crate) const IMAGE_PROMPT_TOKENS: u64 = 85;

/// Salt of an image URL in the prompt hash (text and URLs never hash alike).
const IMAGE_SALT: u64 = 0x1A6E;

/// One message: its text (a string content, or the text parts concatenated) and the
/// URLs of its image parts.
#[derive(Debug, Default)]
pub(crate) struct Message {
    pub(crate) role: String,
    pub(crate) text: String,
    pub(crate) images: Vec<String>,
}

/// What the simulator reads of a request.
#[derive(Debug, Default)]
pub(crate) struct SimRequest {
    /// The model named (`""` if none was named).
    pub(crate) model: String,
    pub(crate) messages: Vec<Message>,
    /// `max_tokens`, else `max_completion_tokens`.
    pub(crate) max_tokens: Option<u64>,
    pub(crate) stream: bool,
    /// `stream_options.include_usage: true`.
    pub(crate) include_usage: bool,
    /// `response_format.type` starts with `json`.
    pub(crate) json_mode: bool,
    /// `logprobs: true`.
    pub(crate) logprobs: bool,
    /// `service_tier`, if the request named one.
    pub(crate) service_tier: Option<String>,
}

fn type_error(field: &str, want: &str, got: &Value) -> String {
    let got = match got {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    };
    format!("invalid type for `{field}`: {got}, expected {want}")
}

/// `Ok(None)` for an absent or `null` field.
fn opt_u64(obj: &serde_json::Map<String, Value>, field: &str) -> Result<Option<u64>, String> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| type_error(field, "a non-negative integer", v)),
    }
}

fn message(i: usize, v: Value) -> Result<Message, String> {
    let Value::Object(mut m) = v else {
        return Err(type_error(&format!("messages[{i}]"), "an object", &v));
    };
    let mut out = Message::default();
    match m.get("role") {
        Some(Value::String(r)) => out.role.clone_from(r),
        Some(other) => return Err(type_error(&format!("messages[{i}].role"), "a string", other)),
        None => return Err(format!("missing field `role` in messages[{i}]")),
    }
    match m.remove("content") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => out.text = s,
        Some(Value::Array(parts)) => {
            for part in parts {
                let Value::Object(mut p) = part else { continue };
                match p.get("type").and_then(Value::as_str) {
                    Some("text") => {
                        if let Some(Value::String(t)) = p.remove("text") {
                            out.text.push_str(&t);
                        }
                    }
                    Some("image_url") => {
                        let url = match p.remove("image_url") {
                            Some(Value::String(u)) => u,
                            Some(Value::Object(mut o)) => match o.remove("url") {
                                Some(Value::String(u)) => u,
                                _ => String::new(),
                            },
                            _ => String::new(),
                        };
                        out.images.push(url);
                    }
                    // Audio, files, future part types: accepted, not counted.
                    _ => {}
                }
            }
        }
        Some(other) => {
            return Err(type_error(
                &format!("messages[{i}].content"),
                "a string, null or an array of parts",
                &other,
            ));
        }
    }
    Ok(out)
}

impl SimRequest {
    /// Reads a request body; the error is the sentence a provider would send back.
    pub(crate) fn parse(body: &[u8]) -> Result<Self, String> {
        let v: Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
        let Value::Object(mut obj) = v else {
            return Err(type_error("body", "an object", &v));
        };
        let model = match obj.remove("model") {
            Some(Value::String(s)) => s,
            Some(other) => return Err(type_error("model", "a string", &other)),
            None => return Err("missing field `model`".into()),
        };
        let messages = match obj.remove("messages") {
            Some(Value::Array(ms)) => ms
                .into_iter()
                .enumerate()
                .map(|(i, m)| message(i, m))
                .collect::<Result<Vec<_>, _>>()?,
            Some(other) => return Err(type_error("messages", "an array", &other)),
            None => return Err("missing field `messages`".into()),
        };
        let max_tokens = match opt_u64(&obj, "max_tokens")? {
            Some(n) => Some(n),
            None => opt_u64(&obj, "max_completion_tokens")?,
        };
        let stream = match obj.get("stream") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(other) => return Err(type_error("stream", "a boolean", other)),
        };
        let include_usage = obj
            .get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let json_mode = obj
            .get("response_format")
            .and_then(|f| f.get("type"))
            .and_then(Value::as_str)
            .is_some_and(|t| t.starts_with("json"));
        let logprobs = obj.get("logprobs").and_then(Value::as_bool).unwrap_or(false);
        let service_tier = obj.get("service_tier").and_then(Value::as_str).map(str::to_owned);
        Ok(Self {
            model,
            messages,
            max_tokens,
            stream,
            include_usage,
            json_mode,
            logprobs,
            service_tier,
        })
    }

    /// A function of the prompt only (texts and image URLs), the seed of every
    /// per-prompt decision (400s, content filter, refusals).
    pub(crate) fn prompt_hash(&self) -> u64 {
        self.messages.iter().fold(0x5EED_u64, |h, m| {
            let h = mix(h ^ hash_bytes(h, m.text.as_bytes()));
            m.images
                .iter()
                .fold(h, |h, url| mix(h ^ hash_bytes(h ^ IMAGE_SALT, url.as_bytes())))
        })
    }

    /// A trailing assistant message's text (an assistant prefill), and the hash of the
    /// prompt before it.
    pub(crate) fn prefill(&self) -> (Option<&str>, u64) {
        match self.messages.split_last() {
            Some((last, before)) if last.role == "assistant" => {
                let prompt = Self {
                    messages: before
                        .iter()
                        .map(|m| Message {
                            role: m.role.clone(),
                            text: m.text.clone(),
                            images: m.images.clone(),
                        })
                        .collect(),
                    ..Self::default()
                };
                (Some(last.text.as_str()), prompt.prompt_hash())
            }
            _ => (None, self.prompt_hash()),
        }
    }

    /// Bytes of prompt text.
    pub(crate) fn prompt_bytes(&self) -> u64 {
        self.messages.iter().map(|m| m.text.len() as u64).sum()
    }

    /// Image parts over all messages.
    pub(crate) fn images(&self) -> u64 {
        self.messages.iter().map(|m| m.images.len() as u64).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_strings_hash_as_before_and_parts_are_read() {
        let plain =
            SimRequest::parse(br#"{"model":"m","messages":[{"role":"user","content":"hi there"}]}"#).unwrap();
        let parts = SimRequest::parse(
            br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi "},{"type":"text","text":"there"}]}],"future":{"x":1}}"#,
        )
        .unwrap();
        assert_eq!(plain.prompt_hash(), parts.prompt_hash());
        // The historical hash of a plain-string prompt (pgw_core's ChatRequest view).
        let old = [("user", "hi there")]
            .iter()
            .fold(0x5EED_u64, |h, (_, c)| mix(h ^ hash_bytes(h, c.as_bytes())));
        assert_eq!(plain.prompt_hash(), old);
        let image = SimRequest::parse(
            br#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:x"}}]}],"max_completion_tokens":9}"#,
        )
        .unwrap();
        assert_eq!(
            (image.images(), image.prompt_bytes(), image.max_tokens),
            (1, 0, Some(9))
        );
        assert!(SimRequest::parse(br#"{"model":"m","messages":[{"role":"user","content":7}]}"#).is_err());
        assert!(SimRequest::parse(br#"{"messages":[]}"#).is_err());
        let huge = SimRequest::parse(
            br#"{"model":"m","messages":[],"max_tokens":18446744073709551615,"stream":null}"#,
        )
        .unwrap();
        assert_eq!((huge.max_tokens, huge.stream), (Some(u64::MAX), false));
    }
}
