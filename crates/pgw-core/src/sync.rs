//! Locks that survive a panic: the workspace's one rule for a poisoned lock.
//!
//! Every lock taken through these guards state that stays valid between statements (a
//! few assignments, a push, a map entry), is never held across an `.await` or a call
//! into user code, and so cannot be left half-written by a panic that unwound through
//! a holder. A poisoned lock is then still usable, and refusing it would turn one
//! panicking caller into a failure of every later one. These take the guard either
//! way. A lock held across user code decides for itself (the balancer's `live`
//! service, replaced when poisoned, does).
//!
//! ```
//! use std::sync::{Mutex, RwLock};
//!
//! let m = Mutex::new(1);
//! *pgw_core::sync::lock(&m) += 1;
//! assert_eq!(*pgw_core::sync::lock(&m), 2);
//!
//! let l = RwLock::new(vec![1]);
//! pgw_core::sync::write(&l).push(2);
//! assert_eq!(pgw_core::sync::read(&l).len(), 2);
//! ```

use std::sync::{Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Locks `m`, poisoned or not.
#[inline]
pub fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Read-locks `l`, poisoned or not.
#[inline]
pub fn read<T: ?Sized>(l: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(PoisonError::into_inner)
}

/// Write-locks `l`, poisoned or not.
#[inline]
pub fn write<T: ?Sized>(l: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lock_poisoned_by_a_panicking_holder_is_still_taken() {
        let m = Mutex::new(1);
        let l = RwLock::new(1);
        let _ = std::panic::catch_unwind(|| {
            let _g = lock(&m);
            let _w = write(&l);
            panic!("a holder panics");
        });
        assert!(m.is_poisoned() && l.is_poisoned());
        *lock(&m) += 1;
        *write(&l) += 1;
        assert_eq!((*lock(&m), *read(&l)), (2, 2));
    }
}
