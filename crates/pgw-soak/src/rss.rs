//! Current resident set size, from `/proc/self/statm`.
//!
//! The current value, never the peak (`ru_maxrss` only grows: judging "stability" on
//! the peak once reported a leak that was only the start-up peak).

use std::sync::OnceLock;

/// The page size from the auxiliary vector (`AT_PAGESZ`), 4096 when unreadable.
fn page_size() -> u64 {
    static PAGE: OnceLock<u64> = OnceLock::new();
    *PAGE.get_or_init(|| {
        const AT_PAGESZ: u64 = 6;
        let Ok(auxv) = std::fs::read("/proc/self/auxv") else {
            return 4096;
        };
        auxv.chunks_exact(16)
            .find_map(|kv| {
                let k = u64::from_ne_bytes(kv[..8].try_into().ok()?);
                let v = u64::from_ne_bytes(kv[8..].try_into().ok()?);
                (k == AT_PAGESZ && v > 0).then_some(v)
            })
            .unwrap_or(4096)
    })
}

/// The current resident set size of this process, KiB; `None` where `/proc` is absent.
#[must_use]
pub fn current_kib() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let resident: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(resident * page_size() / 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_plausible_current_rss_that_follows_allocations() {
        let before = current_kib().expect("linux /proc");
        assert!(before > 100, "{before} KiB");
        assert!(page_size().is_power_of_two());
        // Touch 64 MiB: the current RSS must see it (a peak-only figure could not drop after).
        let big = vec![1u8; 64 << 20];
        let during = current_kib().unwrap();
        assert!(during >= before + 60 * 1024, "{before} -> {during}");
        drop(std::hint::black_box(big));
    }
}
