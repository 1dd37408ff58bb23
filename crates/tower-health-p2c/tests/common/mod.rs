//! The request the integration tests balance: streamed or not, of a size, carrying the
//! call's history.

use pgw_core::{CallHistory, CarriesHistory};

/// A request: each test reads the fields it is about (`classes` the shape, `sizes`
/// the size).
#[derive(Clone, Default)]
#[allow(dead_code, reason = "each test crate reads its own fields")]
pub(crate) struct Req {
    pub(crate) streamed: bool,
    pub(crate) size: u64,
    pub(crate) history: Option<CallHistory>,
}

impl CarriesHistory for Req {
    fn call_history(&self) -> Option<&CallHistory> {
        self.history.as_ref()
    }
    fn set_call_history(&mut self, h: CallHistory) {
        self.history = Some(h);
    }
}
