//! Metric handles kept by their label values.
//!
//! `metrics::histogram!("name", "label" => value)` builds a key on every update (each
//! label value copied into a `String`, the key hashed) and looks it up in the
//! recorder's registry: about 900 instructions, and a served call updates six such
//! series. Their label sets are small and bounded (routes, sources, configured
//! models, statuses, tenants, outcomes), so each handle is made once and found again
//! by comparing the label values in a short list.

use std::sync::RwLock;

use crate::sync::{read, write};

/// The handles of one metric, by its `N` label values, each made once.
///
/// For metrics whose label values come from a small, bounded set: the list is searched
/// in order. Handles are made with the recorder installed when first asked for.
///
/// ```
/// use pgw_core::MetricHandles;
///
/// let handles = MetricHandles::<u32, 2>::default();
/// let mut made = 0;
/// let mut get = |labels| handles.get(labels, |_| { made += 1; made });
/// assert_eq!(get(["s1", "success"]), 1);
/// assert_eq!(get(["s1", "success"]), 1); // found again, not made
/// assert_eq!(get(["s2", "success"]), 2);
/// ```
pub struct MetricHandles<H, const N: usize> {
    list: RwLock<Vec<([Box<str>; N], H)>>,
}

impl<H, const N: usize> std::fmt::Debug for MetricHandles<H, N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let len = read(&self.list).len();
        f.debug_struct("MetricHandles").field("series", &len).finish()
    }
}

impl<H, const N: usize> Default for MetricHandles<H, N> {
    fn default() -> Self {
        Self {
            list: RwLock::new(Vec::new()),
        }
    }
}

impl<H: Clone, const N: usize> MetricHandles<H, N> {
    /// The handle of the series with `labels`, made with `make` the first time.
    pub fn get(&self, labels: [&str; N], make: impl FnOnce([&str; N]) -> H) -> H {
        let same = |k: &[Box<str>; N]| k.iter().zip(labels).all(|(a, b)| **a == *b);
        {
            let list = read(&self.list);
            if let Some((_, h)) = list.iter().find(|(k, _)| same(k)) {
                return h.clone();
            }
        }
        let mut list = write(&self.list);
        if let Some((_, h)) = list.iter().find(|(k, _)| same(k)) {
            return h.clone();
        }
        let h = make(labels);
        list.push((labels.map(Box::from), h.clone()));
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_handle_is_made_once_per_label_set() {
        let handles = MetricHandles::<usize, 2>::default();
        let mut made = 0;
        let mut get = |labels| {
            handles.get(labels, |_| {
                made += 1;
                made
            })
        };
        assert_eq!(get(["a", "200"]), 1);
        assert_eq!(get(["a", "500"]), 2);
        assert_eq!(get(["a", "200"]), 1);
        assert_eq!(get(["b", "200"]), 3);
        assert_eq!(made, 3);
    }
}
