//! Message content as providers accept and send it: a string, `null`, or an array of
//! content parts (text, images, audio, files, ...).

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::ser::{Serialize, SerializeMap, Serializer};
use serde_json::{Number, Value};

/// Prompt tokens assumed per image part by [`ChatRequest::estimate_tokens`](super::ChatRequest::estimate_tokens):
/// 765, what OpenAI charges for a high-detail 1024x1024 image (85 base + 4 tiles x 170).
/// A low-detail image costs 85; a larger high-detail one more, so this is a typical
/// figure rather than a bound (the limiter reconciles with the reported usage).
pub const IMAGE_PART_TOKENS_ESTIMATE: u64 = 765;

/// The content of one chat message.
///
/// Serialized back exactly as it was read: a string stays a string, `null` stays
/// `null` (an absent `content` reads as `Null` and is written as `null`), and parts
/// keep their fields in the order they arrived.
///
/// ```
/// use pgw_core::openai::{ChatMessage, Content};
///
/// let m: ChatMessage = serde_json::from_str(
///     r#"{"role":"user","content":[{"type":"text","text":"what is this?"},{"type":"image_url","image_url":{"url":"https://x.test/a.png","detail":"low"}}]}"#,
/// ).unwrap();
/// assert_eq!(m.content.text_bytes(), 13);
/// assert_eq!(m.content.image_parts(), 1);
/// assert_eq!(
///     serde_json::to_string(&m).unwrap(),
///     r#"{"role":"user","content":[{"type":"text","text":"what is this?"},{"type":"image_url","image_url":{"url":"https://x.test/a.png","detail":"low"}}]}"#,
/// );
/// let refusal: ChatMessage = serde_json::from_str(r#"{"role":"assistant","content":null,"refusal":"no"}"#).unwrap();
/// assert_eq!(refusal.content, Content::Null);
/// assert_eq!(serde_json::to_string(&refusal).unwrap(), r#"{"role":"assistant","content":null,"refusal":"no"}"#);
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum Content {
    /// `null` or absent: a tool-call answer, a refusal, a content-filtered answer.
    #[default]
    Null,
    /// A plain string.
    Text(String),
    /// An array of content parts, kept as sent.
    Parts(Vec<ContentPart>),
}

impl Content {
    /// The string, for `Text`.
    #[must_use]
    pub fn as_text(&self) -> Option<&str> {
        match self {
            Self::Text(s) => Some(s),
            Self::Null | Self::Parts(_) => None,
        }
    }

    /// Whether the content is `null`.
    #[must_use]
    pub const fn is_null(&self) -> bool {
        matches!(self, Self::Null)
    }

    /// The bytes of text: the string, or the sum of the text parts' texts.
    #[must_use]
    pub fn text_bytes(&self) -> u64 {
        match self {
            Self::Null => 0,
            Self::Text(s) => len_u64(s),
            Self::Parts(parts) => parts
                .iter()
                .filter_map(ContentPart::text)
                .fold(0, |n, t| n.saturating_add(len_u64(t))),
        }
    }

    /// The number of image parts (`image_url`, `input_image`, `image`).
    #[must_use]
    pub fn image_parts(&self) -> u64 {
        match self {
            Self::Null | Self::Text(_) => 0,
            Self::Parts(parts) => parts.iter().filter(|p| p.is_image()).count() as u64,
        }
    }

    /// Whether there is anything but whitespace: non-blank text, or a part that is not
    /// text (an image or audio answer is output).
    #[must_use]
    pub fn has_output(&self) -> bool {
        match self {
            Self::Null => false,
            Self::Text(s) => !s.trim().is_empty(),
            Self::Parts(parts) => parts
                .iter()
                .any(|p| p.text().is_none_or(|t| !t.trim().is_empty())),
        }
    }
}

fn len_u64(s: &str) -> u64 {
    u64::try_from(s.len()).unwrap_or(u64::MAX)
}

impl From<String> for Content {
    fn from(s: String) -> Self {
        Self::Text(s)
    }
}

impl From<&str> for Content {
    fn from(s: &str) -> Self {
        Self::Text(s.to_owned())
    }
}

impl Serialize for Content {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Null => s.serialize_unit(),
            Self::Text(t) => s.serialize_str(t),
            Self::Parts(parts) => s.collect_seq(parts),
        }
    }
}

impl<'de> Deserialize<'de> for Content {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Content;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string, null or an array of content parts")
            }
            fn visit_unit<E: de::Error>(self) -> Result<Content, E> {
                Ok(Content::Null)
            }
            fn visit_none<E: de::Error>(self) -> Result<Content, E> {
                Ok(Content::Null)
            }
            fn visit_some<D2: Deserializer<'de>>(self, d: D2) -> Result<Content, D2::Error> {
                Content::deserialize(d)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Content, E> {
                Ok(Content::Text(v.to_owned()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Content, E> {
                Ok(Content::Text(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Content, A::Error> {
                let mut parts = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
                while let Some(p) = seq.next_element::<ContentPart>()? {
                    parts.push(p);
                }
                Ok(Content::Parts(parts))
            }
        }
        d.deserialize_any(V)
    }
}

/// One content part (`{"type":"text","text":..}`, `{"type":"image_url","image_url":{..}}`,
/// `{"type":"input_audio",..}`, ...), kept byte for byte as it arrived: its fields, in
/// their order, at every depth (numbers are re-encoded by value: `1e3` is written
/// `1000.0`).
///
/// The order is kept by this type itself, whatever serde_json's features: a user of
/// this crate may build it without `preserve_order` (this workspace turns it on for
/// every other map since 2026-12-05, so a schema's keys stay in the caller's order).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ContentPart(Json);

impl ContentPart {
    /// A text part.
    pub fn new_text(text: impl Into<String>) -> Self {
        Self(Json::Object(vec![
            ("type".into(), Json::String("text".into())),
            ("text".into(), Json::String(text.into())),
        ]))
    }

    /// The part's `type`, if it has a string one.
    #[must_use]
    pub fn kind(&self) -> Option<&str> {
        self.field("type")?.as_str()
    }

    /// The text of a `text` part.
    #[must_use]
    pub fn text(&self) -> Option<&str> {
        if self.kind() != Some("text") {
            return None;
        }
        self.field("text")?.as_str()
    }

    /// Whether the part is an image (`image_url`, `input_image` or `image`).
    #[must_use]
    pub fn is_image(&self) -> bool {
        matches!(self.kind(), Some("image_url" | "input_image" | "image"))
    }

    /// The part as a `serde_json::Value` (keys sorted, as serde_json's maps are).
    #[must_use]
    pub fn to_value(&self) -> Value {
        self.0.to_value()
    }

    fn field(&self, key: &str) -> Option<&Json> {
        match &self.0 {
            Json::Object(fields) => fields.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }
}

impl From<Value> for ContentPart {
    fn from(v: Value) -> Self {
        Self(Json::from(v))
    }
}

impl Serialize for ContentPart {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl<'de> Deserialize<'de> for ContentPart {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Json::deserialize(d).map(Self)
    }
}

/// A JSON value whose objects keep their keys in arrival order (duplicates too).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Json {
    Null,
    Bool(bool),
    Number(Number),
    String(String),
    Array(Vec<Json>),
    Object(Vec<(String, Json)>),
}

impl Json {
    fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }

    fn to_value(&self) -> Value {
        match self {
            Self::Null => Value::Null,
            Self::Bool(b) => Value::Bool(*b),
            Self::Number(n) => Value::Number(n.clone()),
            Self::String(s) => Value::String(s.clone()),
            Self::Array(a) => Value::Array(a.iter().map(Self::to_value).collect()),
            Self::Object(o) => Value::Object(o.iter().map(|(k, v)| (k.clone(), v.to_value())).collect()),
        }
    }
}

impl From<Value> for Json {
    fn from(v: Value) -> Self {
        match v {
            Value::Null => Self::Null,
            Value::Bool(b) => Self::Bool(b),
            Value::Number(n) => Self::Number(n),
            Value::String(s) => Self::String(s),
            Value::Array(a) => Self::Array(a.into_iter().map(Self::from).collect()),
            Value::Object(o) => Self::Object(o.into_iter().map(|(k, v)| (k, Self::from(v))).collect()),
        }
    }
}

impl Serialize for Json {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Null => s.serialize_unit(),
            Self::Bool(b) => s.serialize_bool(*b),
            Self::Number(n) => n.serialize(s),
            Self::String(t) => s.serialize_str(t),
            Self::Array(a) => s.collect_seq(a),
            Self::Object(o) => {
                let mut m = s.serialize_map(Some(o.len()))?;
                for (k, v) in o {
                    m.serialize_entry(k, v)?;
                }
                m.end()
            }
        }
    }
}

impl<'de> Deserialize<'de> for Json {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Json;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_unit<E: de::Error>(self) -> Result<Json, E> {
                Ok(Json::Null)
            }
            fn visit_none<E: de::Error>(self) -> Result<Json, E> {
                Ok(Json::Null)
            }
            fn visit_some<D2: Deserializer<'de>>(self, d: D2) -> Result<Json, D2::Error> {
                Json::deserialize(d)
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Json, E> {
                Ok(Json::Bool(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Json, E> {
                Ok(Json::Number(v.into()))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Json, E> {
                Ok(Json::Number(v.into()))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Json, E> {
                Ok(Number::from_f64(v).map_or(Json::Null, Json::Number))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Json, E> {
                Ok(Json::String(v.to_owned()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Json, E> {
                Ok(Json::String(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
                while let Some(v) = seq.next_element::<Json>()? {
                    out.push(v);
                }
                Ok(Json::Array(out))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
                let mut out = Vec::with_capacity(map.size_hint().unwrap_or(0).min(64));
                while let Some((k, v)) = map.next_entry::<String, Json>()? {
                    out.push((k, v));
                }
                Ok(Json::Object(out))
            }
        }
        d.deserialize_any(V)
    }
}
