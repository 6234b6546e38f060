//! Exclusive access to caller memory while it is gathered.
//!
//! The engine copies caller memory (`Source::Mem`) into its arena. Memory
//! that the caller's own runtime can free at any moment (a tensor storage
//! that another thread resizes) must not change between a check that it is
//! still there and the copy. A [`GatherGuard`] installed for the calling
//! thread with [`with_guard`] is locked before each extent is gathered (for
//! Python: the GIL, which any resize needs), asked to check every checksum
//! id whose memory the extent reads, and unlocked before the engine blocks
//! (waiting for the device) and after each [`SLICE`] of gathering, so the
//! caller's other threads run while the disk works and while the engine
//! copies. While the guard is held, the gather threads may read caller
//! memory too (the calling thread hands them extents it has checked, and
//! gives the guard back only once they are done: [`hold_for_gather`]).
//! Without a guard, gathering costs nothing extra.

use std::cell::RefCell;
use std::time::{Duration, Instant};

use crate::error::Result;

/// What the engine calls around gathers of caller memory; see the module doc.
pub trait GatherGuard {
    /// Take exclusive access (idempotent while held).
    fn lock(&mut self) -> Result<()>;
    /// With access held: is the memory of checksum `crc_id` still what the
    /// caller planned? An error abandons the write. It must not give
    /// access up, even for a moment, also when it fails: other threads may
    /// be reading caller memory under it.
    fn check(&mut self, crc_id: u32) -> Result<()>;
    /// Give access back (idempotent).
    fn unlock(&mut self);
}

/// The longest a guard is held across gathers before it is given back and
/// taken again. For the GIL: while the engine holds it, the caller's other
/// threads (pickling the rest of the same checkpoint, the training loop)
/// cannot run; giving it back after each extent would instead pace the
/// gather by the interpreter's switch interval (5 ms per re-take while
/// another thread runs Python). A slice of a few extents lets both go on.
pub const SLICE: Duration = Duration::from_millis(2);

struct Installed {
    guard: Box<dyn GatherGuard>,
    /// When the guard was taken, while it is held.
    since: Option<Instant>,
}

thread_local! {
    static GUARD: RefCell<Option<Installed>> = const { RefCell::new(None) };
}

/// Run `f` with `guard` installed for this thread (the engine gathers on
/// the calling thread); the guard is unlocked and removed afterwards, also
/// when `f` panics.
pub fn with_guard<R>(guard: Box<dyn GatherGuard>, f: impl FnOnce() -> R) -> R {
    struct Remove;
    impl Drop for Remove {
        fn drop(&mut self) {
            if let Some(mut g) = GUARD.with(|c| c.borrow_mut().take()) {
                g.guard.unlock();
            }
        }
    }
    GUARD.with(|c| *c.borrow_mut() = Some(Installed { guard, since: None }));
    let _remove = Remove;
    f()
}

/// Before gathering memory of the checksum ids that `ids()` lists (called
/// only when a guard is installed): lock (giving the guard back first when
/// it has been held for a [`SLICE`]) and check them.
pub(crate) fn before_gather<I: Iterator<Item = u32>>(ids: impl FnOnce() -> I) -> Result<()> {
    take_and_check(ids, true)
}

/// Like [`before_gather`], while other threads are reading caller memory
/// under the guard this thread holds: never gives it back, not after a
/// slice and not on a failed check (the caller lets those threads finish
/// before it gives the guard back).
pub(crate) fn hold_for_gather<I: Iterator<Item = u32>>(ids: impl FnOnce() -> I) -> Result<()> {
    take_and_check(ids, false)
}

fn take_and_check<I: Iterator<Item = u32>>(
    ids: impl FnOnce() -> I,
    may_release: bool,
) -> Result<()> {
    GUARD.with(|c| {
        let mut slot = c.borrow_mut();
        let Some(inst) = slot.as_mut() else {
            return Ok(());
        };
        if may_release && inst.since.is_some_and(|t| t.elapsed() >= SLICE) {
            inst.guard.unlock();
            inst.since = None;
        }
        inst.guard.lock()?;
        inst.since.get_or_insert_with(Instant::now);
        for id in ids() {
            if let Err(e) = inst.guard.check(id) {
                if may_release {
                    // The engine now drains what is in flight: not while locked.
                    inst.guard.unlock();
                    inst.since = None;
                }
                return Err(e);
            }
        }
        Ok(())
    })
}

/// Whether the guard has been held for a [`SLICE`] (time to give it back
/// once nothing reads caller memory under it).
pub(crate) fn slice_over() -> bool {
    GUARD.with(|c| {
        c.borrow()
            .as_ref()
            .is_some_and(|inst| inst.since.is_some_and(|t| t.elapsed() >= SLICE))
    })
}

/// Whether a guard is installed for this thread (caller memory must then
/// be read on this thread, under the guard).
pub(crate) fn installed() -> bool {
    GUARD.with(|c| c.borrow().is_some())
}

/// Before the engine may block: give access back.
pub(crate) fn before_block() {
    GUARD.with(|c| {
        if let Some(inst) = c.borrow_mut().as_mut() {
            inst.guard.unlock();
            inst.since = None;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[derive(Default)]
    struct Log(Arc<Mutex<Vec<String>>>);

    impl GatherGuard for Log {
        fn lock(&mut self) -> Result<()> {
            self.0.lock().unwrap().push("lock".into());
            Ok(())
        }
        fn check(&mut self, crc_id: u32) -> Result<()> {
            self.0.lock().unwrap().push(format!("check {crc_id}"));
            if crc_id == 99 {
                return Err(crate::Error::cancelled("changed"));
            }
            Ok(())
        }
        fn unlock(&mut self) {
            self.0.lock().unwrap().push("unlock".into());
        }
    }

    #[test]
    fn installed_for_the_call_only() {
        let log = Arc::new(Mutex::new(vec![]));
        with_guard(Box::new(Log(log.clone())), || {
            before_gather(|| [1, 2].into_iter()).unwrap();
            before_block();
            assert!(before_gather(|| [99].into_iter()).is_err());
        });
        // Removed (and unlocked) afterwards: no effect, no error.
        before_gather(|| [99].into_iter()).unwrap();
        before_block();
        let got = log.lock().unwrap().clone();
        assert_eq!(
            got,
            ["lock", "check 1", "check 2", "unlock", "lock", "check 99", "unlock", "unlock"]
        );
    }

    #[test]
    fn given_back_after_a_slice() {
        let log = Arc::new(Mutex::new(vec![]));
        with_guard(Box::new(Log(log.clone())), || {
            before_gather(|| [1].into_iter()).unwrap();
            before_gather(|| [2].into_iter()).unwrap(); // same slice: kept
            std::thread::sleep(SLICE + Duration::from_millis(1));
            before_gather(|| [3].into_iter()).unwrap(); // slice over
        });
        let got = log.lock().unwrap().clone();
        assert_eq!(
            got,
            ["lock", "check 1", "lock", "check 2", "unlock", "lock", "check 3", "unlock"]
        );
    }
}
