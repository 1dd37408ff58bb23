//! Server-sent events framing as OpenAI-compatible APIs use it: `data: {...}\n\n`
//! events ending with `data: [DONE]`.

/// One decoded event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SseEvent {
    /// The `data:` payload of an event (lines joined with `\n`).
    Data(String),
    /// The `data: [DONE]` terminator.
    Done,
}

/// The largest event the decoder buffers: 16 MiB. Beyond it the stream is garbage.
pub const MAX_EVENT_BYTES: usize = 16 << 20;

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
/// ```
#[derive(Debug, Default)]
pub struct SseDecoder {
    data: Vec<u8>,
    /// Read cursor into `data`: bytes before it belong to events already taken.
    start: usize,
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
    /// Appends received bytes.
    ///
    /// # Errors
    /// [`EventTooLarge`] when an unterminated event grows past [`MAX_EVENT_BYTES`].
    pub fn feed(&mut self, bytes: &[u8]) -> Result<(), EventTooLarge> {
        if self.start > 0 && self.start * 2 >= self.data.len() {
            self.data.drain(..self.start);
            self.start = 0;
        }
        self.data.extend_from_slice(bytes);
        if self.data.len() - self.start > MAX_EVENT_BYTES {
            return Err(EventTooLarge);
        }
        Ok(())
    }

    /// The next complete event, if one has arrived. Comments and non-`data` fields are
    /// skipped.
    pub fn next_event(&mut self) -> Option<SseEvent> {
        loop {
            let pending = &self.data[self.start..];
            let (end, sep) = find_event_end(pending)?;
            let raw = String::from_utf8_lossy(&pending[..end]).into_owned();
            self.start += end + sep;
            let mut data: Option<String> = None;
            for line in raw.lines() {
                let Some(rest) = line.strip_prefix("data:") else {
                    continue;
                };
                let rest = rest.strip_prefix(' ').unwrap_or(rest);
                match &mut data {
                    Some(d) => {
                        d.push('\n');
                        d.push_str(rest);
                    }
                    None => data = Some(rest.to_owned()),
                }
            }
            match data {
                Some(d) if d.trim() == "[DONE]" => return Some(SseEvent::Done),
                Some(d) => return Some(SseEvent::Data(d)),
                None => {}
            }
        }
    }
}

fn find_event_end(b: &[u8]) -> Option<(usize, usize)> {
    let mut i = 0;
    while i + 1 < b.len() {
        if b[i] == b'\n' && b[i + 1] == b'\n' {
            return Some((i, 2));
        }
        if i + 3 < b.len() && &b[i..i + 4] == b"\r\n\r\n" {
            return Some((i, 4));
        }
        i += 1;
    }
    None
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
            let mut d = SseDecoder::default();
            let mut got = Vec::new();
            d.feed(&bytes[..cut]).unwrap();
            while let Some(e) = d.next_event() {
                got.push(e);
            }
            d.feed(&bytes[cut..]).unwrap();
            while let Some(e) = d.next_event() {
                got.push(e);
            }
            assert_eq!(
                got,
                vec![
                    SseEvent::Data("{\"x\":1}".into()),
                    SseEvent::Data("{\"y\":2}".into()),
                    SseEvent::Done
                ],
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn crlf_and_oversize() {
        let mut d = SseDecoder::default();
        d.feed(b"data: a\r\n\r\n").unwrap();
        assert_eq!(d.next_event(), Some(SseEvent::Data("a".into())));
        let mut d = SseDecoder::default();
        assert_eq!(d.feed(&vec![b'x'; MAX_EVENT_BYTES + 1]), Err(EventTooLarge));
    }
}
