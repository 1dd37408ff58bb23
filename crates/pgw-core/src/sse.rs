//! Server-sent events framing as OpenAI-compatible APIs use it: `data: {...}\n\n`
//! events ending with `data: [DONE]`.
//!
//! The decoder follows the event stream interpretation of the SSE specification (WHATWG
//! HTML, "Server-sent events"): lines end with CR, LF or CRLF; a UTF-8 byte order mark at
//! the very start of the stream is skipped; a line starting with `:` is a comment; a line
//! without a colon is a field with an empty value; one space after the colon is removed;
//! an empty line dispatches the event. Only the `data` field is surfaced, and whether the
//! event's type (`event:`) is `error`, which is how some providers send an error in a
//! stream (its data then need not be JSON: `event: error` / `data: Overloaded`); `id`,
//! `retry`, other event types and unknown fields are ignored, and an event without a
//! `data` field is not dispatched. An event the stream ends in the middle of is
//! discarded.
//!
//! The work is linear in the stream's size: each byte is looked at once by the line
//! scan, however the stream is split into `feed` calls.

use std::collections::VecDeque;

/// One decoded event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SseEvent {
    /// The `data:` payload of an event (lines joined with `\n`).
    Data(String),
    /// The `data:` payload of an event of type `error` (`event: error`): the provider's
    /// error, whatever its data looks like.
    Error(String),
    /// The `data: [DONE]` terminator.
    Done,
}

/// The largest event the decoder buffers: 16 MiB. Beyond it the stream is garbage.
pub const MAX_EVENT_BYTES: usize = 16 << 20;

/// A line buffer grown past this (64 KiB, far above a chat chunk's few hundred bytes)
/// by one long line split across body frames is freed, not kept for the next lines.
const KEPT_LINE_CAPACITY: usize = 64 << 10;

/// The UTF-8 byte order mark, skipped at the start of a stream.
const BOM: &[u8] = b"\xEF\xBB\xBF";

/// An incremental SSE decoder: feed it bytes as they arrive, take complete events out.
///
/// ```
/// use pgw_core::sse::{SseDecoder, SseEvent};
/// let mut d = SseDecoder::default();
/// d.feed(b"data: {\"a\":1}\n\nda").unwrap();
/// assert_eq!(d.next_event(), Some(SseEvent::Data("{\"a\":1}".into())));
/// assert_eq!(d.next_event(), None);
/// d.feed(b"ta: [DONE]\n\n").unwrap();
/// assert_eq!(d.next_event(), Some(SseEvent::Done));
///
/// // CR, LF and CRLF line ends, comments, other fields, `data` without a colon.
/// d.feed(b": keep-alive\r\nid: 7\rdata:a\r\ndata\n\n").unwrap();
/// assert_eq!(d.next_event(), Some(SseEvent::Data("a\n".into())));
///
/// // An event of type `error`.
/// d.feed(b"event: error\ndata: Overloaded\n\n").unwrap();
/// assert_eq!(d.next_event(), Some(SseEvent::Error("Overloaded".into())));
/// ```
#[derive(Debug, Default)]
pub struct SseDecoder {
    /// The start of the current line when it began in an earlier `feed` (no line end
    /// seen yet).
    line: Vec<u8>,
    /// The current event's data buffer: each `data` value followed by `\n`.
    data: Vec<u8>,
    /// Complete events not yet taken.
    events: VecDeque<SseEvent>,
    /// The current event's type is `error`.
    error_event: bool,
    /// The last byte fed was a CR that ended a line: an LF first in the next feed is the
    /// rest of that line end, not an empty line.
    after_cr: bool,
    /// The start of the stream is behind us: a BOM is no longer skipped.
    past_start: bool,
    /// How many bytes of a BOM the stream started with so far (while not `past_start`).
    bom_matched: usize,
    /// An event grew past [`MAX_EVENT_BYTES`]: every later `feed` fails.
    failed: bool,
    /// Bytes looked at by the line-end scan, to test that the work is linear.
    #[cfg(test)]
    scanned: usize,
}

/// The stream sent an event larger than [`MAX_EVENT_BYTES`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EventTooLarge;

impl std::fmt::Display for EventTooLarge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "server-sent event larger than {MAX_EVENT_BYTES} bytes")
    }
}

impl std::error::Error for EventTooLarge {}

impl SseDecoder {
    /// Decodes received bytes; the complete events among them are then taken with
    /// [`next_event`](Self::next_event).
    ///
    /// # Errors
    /// [`EventTooLarge`] when an event (its data so far plus the line being received)
    /// grows past [`MAX_EVENT_BYTES`]. The decoder then drops what it buffered for that
    /// event and every later `feed` fails too; events completed before it can still be
    /// taken.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<(), EventTooLarge> {
        if self.failed {
            return Err(EventTooLarge);
        }
        let result = self.feed_inner(bytes);
        if result.is_err() {
            self.failed = true;
            self.line = Vec::new();
            self.data = Vec::new();
        }
        result
    }

    /// The next complete event, if one has arrived. Comments, events without data and
    /// non-`data` fields are skipped.
    pub fn next_event(&mut self) -> Option<SseEvent> {
        self.events.pop_front()
    }

    fn feed_inner(&mut self, mut bytes: &[u8]) -> Result<(), EventTooLarge> {
        if !self.past_start {
            let m = self.bom_matched;
            let take = (BOM.len() - m).min(bytes.len());
            if bytes[..take] == BOM[m..m + take] {
                if m + take < BOM.len() {
                    // All of it so far may be a BOM: decide when more arrives.
                    self.bom_matched = m + take;
                    return Ok(());
                }
                self.past_start = true;
                bytes = &bytes[take..];
            } else {
                // Not a BOM: the bytes held back were the start of the stream.
                self.past_start = true;
                self.decode(&BOM[..m])?;
            }
        }
        self.decode(bytes)
    }

    /// Splits `bytes` into lines, continuing the line left over from the last call.
    fn decode(&mut self, mut bytes: &[u8]) -> Result<(), EventTooLarge> {
        if bytes.is_empty() {
            return Ok(());
        }
        if std::mem::take(&mut self.after_cr) && bytes[0] == b'\n' {
            bytes = &bytes[1..];
        }
        while let Some(i) = self.find_line_end(bytes) {
            if self.line.is_empty() {
                on_line(
                    &mut self.data,
                    &mut self.error_event,
                    &mut self.events,
                    &bytes[..i],
                )?;
            } else {
                self.line.extend_from_slice(&bytes[..i]);
                on_line(
                    &mut self.data,
                    &mut self.error_event,
                    &mut self.events,
                    &self.line,
                )?;
                if self.line.capacity() > KEPT_LINE_CAPACITY {
                    // One huge line (up to MAX_EVENT_BYTES) must not pin its buffer for
                    // the rest of a long stream.
                    self.line = Vec::new();
                } else {
                    self.line.clear();
                }
            }
            let cr = bytes[i] == b'\r';
            bytes = &bytes[i + 1..];
            if cr {
                match bytes.first() {
                    Some(b'\n') => bytes = &bytes[1..],
                    Some(_) => {}
                    None => self.after_cr = true,
                }
            }
        }
        if self.data.len() + self.line.len() + bytes.len() > MAX_EVENT_BYTES {
            return Err(EventTooLarge);
        }
        self.line.extend_from_slice(bytes);
        Ok(())
    }

    /// Where the first CR or LF of `bytes` is.
    fn find_line_end(&mut self, bytes: &[u8]) -> Option<usize> {
        let found = memchr::memchr2(b'\n', b'\r', bytes);
        #[cfg(test)]
        {
            self.scanned += found.map_or(bytes.len(), |i| i + 1);
        }
        found
    }
}

/// Interprets one line (without its line end): an empty line dispatches the event.
fn on_line(
    data: &mut Vec<u8>,
    error: &mut bool,
    events: &mut VecDeque<SseEvent>,
    line: &[u8],
) -> Result<(), EventTooLarge> {
    if line.is_empty() {
        let error = std::mem::take(error);
        if data.is_empty() {
            return Ok(());
        }
        data.pop(); // the `\n` after the last value
        let text = match String::from_utf8(std::mem::take(data)) {
            Ok(text) => text,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        };
        events.push_back(if error {
            SseEvent::Error(text)
        } else if text.trim() == "[DONE]" {
            SseEvent::Done
        } else {
            SseEvent::Data(text)
        });
        return Ok(());
    }
    let (field, value) = match line.iter().position(|&b| b == b':') {
        Some(0) => return Ok(()), // a comment
        Some(colon) => {
            let value = &line[colon + 1..];
            (&line[..colon], value.strip_prefix(b" ").unwrap_or(value))
        }
        None => (line, &b""[..]),
    };
    // `id`, `retry` and unknown fields: only the data and an error type are surfaced.
    if field == b"event" {
        *error = value == b"error";
    } else if field == b"data" {
        if data.len() + value.len() + 1 > MAX_EVENT_BYTES {
            return Err(EventTooLarge);
        }
        // One allocation for the value and its line end: `push` after an exact-size
        // `extend` grew (reallocated) the buffer on every event.
        data.reserve(value.len() + 1);
        data.extend_from_slice(value);
        data.push(b'\n');
    }
    Ok(())
}

/// Encodes one `data:` event.
#[must_use]
pub fn encode_data(json: &str) -> String {
    format!("data: {json}\n\n")
}

/// The terminating event.
pub const DONE: &str = "data: [DONE]\n\n";

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Feeds `chunks` one after another, taking the events after each.
    fn decode_chunks(d: &mut SseDecoder, chunks: &[&[u8]]) -> Vec<SseEvent> {
        let mut got = Vec::new();
        for chunk in chunks {
            d.feed(chunk).unwrap();
            while let Some(e) = d.next_event() {
                got.push(e);
            }
        }
        got
    }

    fn events(chunks: &[&[u8]]) -> Vec<SseEvent> {
        decode_chunks(&mut SseDecoder::default(), chunks)
    }

    /// Feeds `bytes` cut at `cuts` (sorted, each at most `bytes.len()`).
    fn events_cut(bytes: &[u8], cuts: &[usize]) -> (Vec<SseEvent>, usize) {
        let mut chunks = Vec::new();
        let mut at = 0;
        for &cut in cuts {
            chunks.push(&bytes[at..cut]);
            at = cut;
        }
        chunks.push(&bytes[at..]);
        let mut d = SseDecoder::default();
        let got = decode_chunks(&mut d, &chunks);
        (got, d.scanned)
    }

    fn data(s: &str) -> SseEvent {
        SseEvent::Data(s.into())
    }

    #[test]
    fn split_anywhere_gives_same_events() {
        let stream = format!(
            "{}: comment\n\n{}{}",
            encode_data("{\"x\":1}"),
            encode_data("{\"y\":2}"),
            DONE
        );
        let bytes = stream.as_bytes();
        for cut in 0..bytes.len() {
            assert_eq!(
                events(&[&bytes[..cut], &bytes[cut..]]),
                vec![data("{\"x\":1}"), data("{\"y\":2}"), SseEvent::Done],
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn every_two_cuts_of_a_mixed_stream_give_the_same_events() {
        let bytes: &[u8] =
            b"\xEF\xBB\xBFdata: a\r\n\r\n: c\rdata:b\rdata\r\rdata: \xC3\xA9\n\r\ndata: [DONE]\r\n\r\n";
        let want = vec![data("a"), data("b\n"), data("\u{e9}"), SseEvent::Done];
        assert_eq!(events(&[bytes]), want);
        for i in 0..=bytes.len() {
            for j in i..=bytes.len() {
                assert_eq!(events_cut(bytes, &[i, j]).0, want, "cuts at {i} and {j}");
            }
        }
    }

    #[test]
    fn cr_lf_and_crlf_end_lines() {
        assert_eq!(events(&[b"data: a\n\n"]), vec![data("a")]);
        assert_eq!(events(&[b"data: a\r\r"]), vec![data("a")]);
        assert_eq!(events(&[b"data: a\r\n\r\n"]), vec![data("a")]);
        assert_eq!(
            events(&[b"data: a\rdata: b\ndata: c\r\n\r\ndata: d\n\r\n"]),
            vec![data("a\nb\nc"), data("d")]
        );
        // LF CR is two line ends (an LF, then a CR): the event ends.
        assert_eq!(events(&[b"data: a\n\rdata: b\n\n"]), vec![data("a"), data("b")]);
    }

    #[test]
    fn a_crlf_split_across_feeds_is_one_line_end() {
        let mut d = SseDecoder::default();
        assert_eq!(decode_chunks(&mut d, &[b"data: a\r", b"\n"]), vec![]);
        assert_eq!(decode_chunks(&mut d, &[b"data: b\r", b"", b"\n"]), vec![]);
        assert_eq!(decode_chunks(&mut d, &[b"\r", b"\n"]), vec![data("a\nb")]);
        // A CR at the end of a feed followed by anything but LF is a line end on its own.
        assert_eq!(events(&[b"data: a\r", b"\r"]), vec![data("a")]);
        assert_eq!(events(&[b"data: a\r", b"data: b\r", b"\r"]), vec![data("a\nb")]);
    }

    #[test]
    fn an_event_ends_at_an_empty_line_only() {
        let mut d = SseDecoder::default();
        assert_eq!(decode_chunks(&mut d, &[b"data: a\ndata: b\n"]), vec![]);
        assert_eq!(decode_chunks(&mut d, &[b"\n"]), vec![data("a\nb")]);
        // A stream that ends in the middle of an event never dispatches it.
        assert_eq!(events(&[b"data: a\n"]), vec![]);
        assert_eq!(events(&[b"data: a"]), vec![]);
    }

    #[test]
    fn a_bom_is_skipped_at_the_very_start_only() {
        assert_eq!(events(&[b"\xEF\xBB\xBFdata: a\n\n"]), vec![data("a")]);
        assert_eq!(
            events(&[b"\xEF", b"\xBB", b"", b"\xBFdata: a\n\n"]),
            vec![data("a")]
        );
        assert_eq!(events(&[b"", b"\xEF\xBB\xBF", b"data: a\n\n"]), vec![data("a")]);
        // A second BOM is part of the first field's name: not `data`.
        assert_eq!(
            events(&[b"\xEF\xBB\xBF\xEF\xBB\xBFdata: a\n\ndata: b\n\n"]),
            vec![data("b")]
        );
        // Later, a BOM is an ordinary character.
        assert_eq!(
            events(&[b"data: a\n\n\xEF\xBB\xBFdata: b\n\ndata: \xEF\xBB\xBFc\n\n"]),
            vec![data("a"), data("\u{feff}c")]
        );
        // The start of a BOM that is not one is kept (here: spoils the field name).
        assert_eq!(events(&[b"\xEF\xBBdata: a\n\ndata: b\n\n"]), vec![data("b")]);
        assert_eq!(events(&[b"\xEF", b"data: a\n\ndata: b\n\n"]), vec![data("b")]);
        // And a stream without one loses nothing.
        assert_eq!(events(&[b"d", b"ata: a\n\n"]), vec![data("a")]);
    }

    #[test]
    fn fields_are_parsed_per_the_spec() {
        // `data` without a colon is a data field with an empty value.
        assert_eq!(events(&[b"data\n\n"]), vec![data("")]);
        assert_eq!(events(&[b"data\ndata\n\n"]), vec![data("\n")]);
        assert_eq!(events(&[b"data:\n\n"]), vec![data("")]);
        // One leading space is removed, no more.
        assert_eq!(events(&[b"data:x\n\n"]), vec![data("x")]);
        assert_eq!(events(&[b"data: x\n\n"]), vec![data("x")]);
        assert_eq!(events(&[b"data:  x \n\n"]), vec![data(" x ")]);
        // The field name ends at the first colon.
        assert_eq!(events(&[b"data: a: b\n\n"]), vec![data("a: b")]);
        // Data lines are joined with `\n`.
        assert_eq!(events(&[b"data: a\ndata:\ndata: c\n\n"]), vec![data("a\n\nc")]);
        // Names are exact: these are unknown fields.
        assert_eq!(events(&[b"Data: a\ndata : b\n data: c\ndatax\n\n"]), vec![]);
    }

    #[test]
    fn comments_and_other_fields_are_ignored() {
        assert_eq!(
            events(&[b": hi\nid: 7\nretry: 1000\nevent: message\nfoo: bar\nfoo\n:\ndata: x\n\n"]),
            vec![data("x")]
        );
        // An event without a data field is not dispatched; keep-alive comments alone
        // dispatch nothing.
        assert_eq!(
            events(&[b": keep-alive\n\nevent: ping\nid: 1\n\n\n\n\r\n: x\r\rdata: y\n\n"]),
            vec![data("y")]
        );
    }

    #[test]
    fn an_error_event_surfaces_its_data_as_an_error() {
        let stream = b"event: error\ndata: {\"error\":{\"message\":\"overloaded\"}}\n\n";
        assert_eq!(
            events(&[stream]),
            vec![SseEvent::Error("{\"error\":{\"message\":\"overloaded\"}}".into())]
        );
        // The type is the event's: the next one, without it, is data again; another
        // type is data too.
        let stream = b"event: error\ndata: Overloaded\n\ndata: x\n\nevent: ping\ndata: y\n\n";
        assert_eq!(
            events(&[stream]),
            vec![SseEvent::Error("Overloaded".into()), data("x"), data("y")]
        );
        // An error type without data is not dispatched, and does not carry over.
        assert_eq!(events(&[b"event: error\n\ndata: z\n\n"]), vec![data("z")]);
    }

    #[test]
    fn done_is_the_trimmed_data() {
        assert_eq!(events(&[DONE.as_bytes()]), vec![SseEvent::Done]);
        assert_eq!(events(&[b"data:[DONE]\r\n\r\n"]), vec![SseEvent::Done]);
        assert_eq!(events(&[b"data:  [DONE] \n\n"]), vec![SseEvent::Done]);
        assert_eq!(events(&[b"data: [DONE]x\n\n"]), vec![data("[DONE]x")]);
        assert_eq!(events(&[b"data: [done]\n\n"]), vec![data("[done]")]);
    }

    #[test]
    fn invalid_utf8_is_replaced_not_a_panic() {
        assert_eq!(events(&[b"data: \xFF\xFEa\n\n"]), vec![data("\u{fffd}\u{fffd}a")]);
        // A character split across feeds is whole.
        assert_eq!(events(&[b"data: \xC3", b"\xA9\n\n"]), vec![data("\u{e9}")]);
        // A truncated character at the end of a line is replaced, the line end kept.
        assert_eq!(
            events(&[b"data: \xE2\x82\ndata: b\n\n"]),
            vec![data("\u{fffd}\nb")]
        );
        assert_eq!(events(&[b"\xFF\xFE\r\n\r\ndata: c\n\n"]), vec![data("c")]);
    }

    #[test]
    fn an_event_larger_than_the_limit_fails() {
        // An unterminated line.
        let mut d = SseDecoder::default();
        assert_eq!(d.feed(&vec![b'x'; MAX_EVENT_BYTES + 1]), Err(EventTooLarge));
        assert_eq!(d.feed(b"\n\ndata: a\n\n"), Err(EventTooLarge), "failed for good");
        assert_eq!(d.next_event(), None);

        // Data lines that are each small but add up, fed in pieces: the event completed
        // before is still taken.
        let mut d = SseDecoder::default();
        d.feed(b"data: first\n\n").unwrap();
        let line = format!("data: {}\n", "y".repeat(1 << 20));
        let mut result = Ok(());
        for _ in 0..=MAX_EVENT_BYTES >> 20 {
            result = d.feed(line.as_bytes());
            if result.is_err() {
                break;
            }
        }
        assert_eq!(result, Err(EventTooLarge));
        assert_eq!(d.next_event(), Some(data("first")));
        assert_eq!(d.next_event(), None);

        // Many small complete events in one feed are not one large event.
        let small = encode_data(&"z".repeat(1000));
        let many = small.repeat(MAX_EVENT_BYTES / small.len() + 10);
        let mut d = SseDecoder::default();
        d.feed(many.as_bytes()).unwrap();
        let mut n = 0;
        while let Some(e) = d.next_event() {
            assert!(matches!(e, SseEvent::Data(ref s) if s.len() == 1000));
            n += 1;
        }
        assert_eq!(n, MAX_EVENT_BYTES / small.len() + 10);
    }

    /// A long line split across feeds grows the line buffer; once the line ends, a
    /// buffer that large is freed, not kept for the rest of the stream.
    #[test]
    fn a_long_split_line_does_not_pin_its_buffer() {
        let mut d = SseDecoder::default();
        let text = "x".repeat(1 << 20);
        d.feed(format!("data: {}", &text[..1000]).as_bytes()).unwrap();
        d.feed(&text.as_bytes()[1000..]).unwrap();
        assert!(d.line.capacity() >= 1 << 20);
        d.feed(b"\n\n").unwrap();
        assert_eq!(d.next_event(), Some(SseEvent::Data(text)));
        assert!(d.line.capacity() <= KEPT_LINE_CAPACITY, "{}", d.line.capacity());
        // A short line split across feeds keeps its small buffer.
        d.feed(b"data: {\"a\"").unwrap();
        d.feed(b":1}\n\n").unwrap();
        assert_eq!(d.next_event(), Some(SseEvent::Data("{\"a\":1}".into())));
        assert!(d.line.capacity() > 0);
    }

    #[test]
    fn a_large_event_fed_byte_by_byte_is_scanned_once() {
        let stream = format!(
            "data: {}\r\ndata: {}\r\n\r\n",
            "x".repeat(1 << 20),
            "w".repeat(1 << 10)
        );
        let mut d = SseDecoder::default();
        for b in stream.as_bytes() {
            d.feed(std::slice::from_ref(b)).unwrap();
        }
        // Each byte is looked at once (the LF of a CRLF fed after its CR is not even
        // scanned for): the old decoder rescanned the pending event on every feed,
        // about 5 * 10^11 bytes here.
        assert!(d.scanned <= stream.len(), "{} > {}", d.scanned, stream.len());
        assert!(d.scanned >= stream.len() - 3);
        let want = format!("{}\n{}", "x".repeat(1 << 20), "w".repeat(1 << 10));
        assert_eq!(d.next_event(), Some(SseEvent::Data(want)));
    }

    /// One line of a generated stream.
    #[derive(Clone, Debug)]
    enum Line {
        /// `data: v` (with the space) or `data:v`.
        Data { value: String, space: bool },
        /// `data` alone.
        BareData,
        /// `:text`.
        Comment(String),
        /// Another field, with or without a value.
        Other(&'static str, Option<String>),
    }

    impl Line {
        fn render(&self) -> String {
            match self {
                Self::Data { value, space: true } => format!("data: {value}"),
                Self::Data { value, space: false } => format!("data:{value}"),
                Self::BareData => "data".into(),
                Self::Comment(text) => format!(":{text}"),
                Self::Other(name, Some(value)) => format!("{name}: {value}"),
                Self::Other(name, None) => (*name).to_owned(),
            }
        }

        /// The value the line adds to the event's data, if any (the spec's rules).
        fn data(&self) -> Option<&str> {
            match self {
                Self::Data { value, space: true } => Some(value),
                Self::Data { value, space: false } => Some(value.strip_prefix(' ').unwrap_or(value)),
                Self::BareData => Some(""),
                Self::Comment(_) | Self::Other(..) => None,
            }
        }
    }

    fn text() -> impl Strategy<Value = String> {
        // No CR or LF; colons, spaces, multi-byte characters and BOMs are fine.
        "[a-z :{}\"\\[\\]\u{e9}\u{feff}\u{1f600}]{0,6}"
    }

    fn line() -> impl Strategy<Value = Line> {
        prop_oneof![
            4 => (text(), any::<bool>()).prop_map(|(value, space)| Line::Data { value, space }),
            1 => Just("[DONE]".to_owned()).prop_map(|value| Line::Data { value, space: true }),
            1 => Just(Line::BareData),
            1 => text().prop_map(Line::Comment),
            1 => (
                prop::sample::select(vec!["event", "id", "retry", "foo", "Data", "data "]),
                prop::option::of(text())
            )
                .prop_map(|(name, value)| Line::Other(name, value)),
            1 => Just(Line::Other("event", Some("error".into()))),
        ]
    }

    /// A stream: a BOM or not, events of lines, a trailing unterminated event; each
    /// line end picked among CR, LF and CRLF.
    #[derive(Clone, Debug)]
    struct Stream {
        bom: bool,
        events: Vec<Vec<(Line, u8)>>,
        blank_ends: Vec<u8>,
        tail: Vec<(Line, u8)>,
    }

    fn stream() -> impl Strategy<Value = Stream> {
        let lines = || prop::collection::vec((line(), 0..3u8), 0..5);
        (
            any::<bool>(),
            prop::collection::vec(lines(), 0..6),
            prop::collection::vec(0..3u8, 6),
            lines(),
        )
            .prop_map(|(bom, events, blank_ends, tail)| Stream {
                bom,
                events,
                blank_ends,
                tail,
            })
    }

    impl Stream {
        fn render(&self) -> Vec<u8> {
            let mut out = String::new();
            if self.bom {
                out.push('\u{feff}');
            }
            let mut after_cr = false;
            let mut end = |out: &mut String, blank: bool, pick: u8| {
                let pick = match pick {
                    // An LF right after a CR would make one CRLF, not an empty line.
                    1 if blank && after_cr => 2,
                    p => p,
                };
                out.push_str(["\r", "\n", "\r\n"][usize::from(pick)]);
                after_cr = pick == 0;
            };
            for (event, &blank_end) in self.events.iter().zip(&self.blank_ends) {
                for (line, pick) in event {
                    out.push_str(&line.render());
                    end(&mut out, false, *pick);
                }
                end(&mut out, true, blank_end);
            }
            for (line, pick) in &self.tail {
                out.push_str(&line.render());
                end(&mut out, false, *pick);
            }
            out.into_bytes()
        }

        fn expected(&self) -> Vec<SseEvent> {
            self.events
                .iter()
                .filter_map(|event| {
                    let values: Vec<&str> = event.iter().filter_map(|(l, _)| l.data()).collect();
                    if values.is_empty() {
                        return None;
                    }
                    let joined = values.join("\n");
                    // The event's type is its last `event` line's value.
                    let error = event
                        .iter()
                        .rev()
                        .find_map(|(l, _)| match l {
                            Line::Other("event", value) => Some(value.as_deref() == Some("error")),
                            _ => None,
                        })
                        .unwrap_or(false);
                    Some(if error {
                        SseEvent::Error(joined)
                    } else if joined.trim() == "[DONE]" {
                        SseEvent::Done
                    } else {
                        SseEvent::Data(joined)
                    })
                })
                .collect()
        }
    }

    fn cuts(len: usize, picks: &[prop::sample::Index]) -> Vec<usize> {
        let mut cuts: Vec<usize> = picks.iter().map(|i| i.index(len + 1)).collect();
        cuts.sort_unstable();
        cuts
    }

    proptest! {
        #[test]
        fn any_split_of_a_valid_stream_gives_its_events(
            s in stream(),
            picks in prop::collection::vec(any::<prop::sample::Index>(), 0..16),
        ) {
            let bytes = s.render();
            let want = s.expected();
            let (whole, scanned) = events_cut(&bytes, &[]);
            prop_assert_eq!(&whole, &want);
            prop_assert!(scanned <= bytes.len());
            let (split, scanned) = events_cut(&bytes, &cuts(bytes.len(), &picks));
            prop_assert_eq!(&split, &want);
            prop_assert!(scanned <= bytes.len());
        }

        #[test]
        fn every_crlf_split_of_a_valid_stream_gives_its_events(s in stream()) {
            let bytes = s.render();
            let want = s.expected();
            let crs: Vec<usize> = (0..bytes.len()).filter(|&i| bytes[i] == b'\r').collect();
            // Between every CR and what follows it at once.
            let cuts: Vec<usize> = crs.iter().map(|i| i + 1).collect();
            prop_assert_eq!(events_cut(&bytes, &cuts).0, want);
        }

        #[test]
        fn any_split_of_any_bytes_gives_the_same_events(
            pieces in prop::collection::vec(
                prop_oneof![
                    Just(&b"data"[..]), Just(&b":"[..]), Just(&b" "[..]), Just(&b"\r"[..]),
                    Just(&b"\n"[..]), Just(&b"\r\n"[..]), Just(&b"\xEF\xBB\xBF"[..]),
                    Just(&b"\xEF"[..]), Just(&b"\xFF"[..]), Just(&b"\xC3\xA9"[..]),
                    Just(&b"[DONE]"[..]), Just(&b"x"[..]), Just(&b"event"[..]),
                ],
                0..64,
            ),
            picks in prop::collection::vec(any::<prop::sample::Index>(), 0..16),
        ) {
            let bytes = pieces.concat();
            let (whole, _) = events_cut(&bytes, &[]);
            let (split, scanned) = events_cut(&bytes, &cuts(bytes.len(), &picks));
            prop_assert_eq!(split, whole);
            prop_assert!(scanned <= bytes.len());
        }
    }
}
