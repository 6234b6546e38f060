//! Reads of caller memory that another thread may free meanwhile.
//!
//! A save reads tensor storages after checking, under the GIL, that each
//! is still where it was planned. torch gives the GIL up inside
//! `Tensor.resize_()`, so a resize that another thread began before the
//! check can still free the old memory while it is being read: `munmap`
//! for a large block, and the read faults (SIGSEGV, `SEGV_MAPERR`).
//! `torch.save` never crashes there, because it reads through `write()`,
//! in the kernel, which answers such an address with EFAULT.
//!
//! [`read`] marks the range a thread is about to read. A fault inside it,
//! on an address no longer mapped, maps a zero page read-only at the page
//! (`MAP_FIXED_NOREPLACE`: never over a mapping) and returns: the read goes
//! on over zeros, the thread is told that its memory vanished, and its
//! caller fails the save with [`Error::vanished`] (a StorageChangedError in
//! Python); the pages mapped are unmapped at the end of the read. Every
//! other fault goes to the handler that was installed before, as if this
//! one were not there (the default action: the process dies as it would
//! have).

use std::cell::Cell;
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};
use std::sync::OnceLock;

use crate::error::Error;

/// The most separate runs of pages one read maps in place of vanished
/// memory (a read faults in order, so one run is usual); past that, a page
/// is mapped and left (a page of address space, for the process's life).
const RUNS: usize = 8;

thread_local! {
    /// The range this thread reads now: `[start, end)`, empty when none.
    static READING: Cell<(usize, usize)> = const { Cell::new((0, 0)) };
    /// The runs of pages mapped in place of vanished memory during the
    /// read, and how many there are.
    static MAPPED: Cell<([(usize, usize); RUNS], usize)> = const { Cell::new(([(0, 0); RUNS], 0)) };
    /// Set by a [`read`] whose memory vanished, until [`take`].
    static VANISHED: Cell<bool> = const { Cell::new(false) };
}

/// Whether a [`read`] on this thread saw its memory vanish since the last
/// call (cleared): for readers that report it after their copy.
pub(crate) fn take() -> bool {
    VANISHED.with(|v| v.replace(false))
}

/// [`read`] for a caller that learns of vanished memory from [`take`].
pub(crate) fn read_noting<R>(start: usize, len: usize, f: impl FnOnce() -> R) -> R {
    let (out, vanished) = read(start, len, f);
    if vanished {
        VANISHED.with(|v| v.set(true));
    }
    out
}

/// The handler that was installed before ours (a leaked `sigaction`), or
/// null before the first install.
static PREVIOUS: AtomicPtr<libc::sigaction> = AtomicPtr::new(std::ptr::null_mut());
/// The page size, read once before the handler can run.
static PAGE: AtomicUsize = AtomicUsize::new(4096);
/// `si_code` of a fault on an address that is not mapped (Linux's
/// `SEGV_MAPERR`, which the libc crate does not export).
const SEGV_MAPERR: libc::c_int = 1;
/// Reads in progress (any thread): the handler looks at its thread's
/// state only while some read is (a thread's first use of this module's
/// thread-locals may allocate, which a signal handler must not do for a
/// fault that is not ours).
static READS: AtomicUsize = AtomicUsize::new(0);
/// Whether [`install`] has run.
static INSTALLED: OnceLock<()> = OnceLock::new();

/// Install our handler, once per process, over the one SIGSEGV has then
/// (Python's `faulthandler`, or the default), to which every other fault
/// goes. Never again after: a handler installed over ours later (say
/// `faulthandler.enable()`) saves ours as its own previous one, and taking
/// SIGSEGV back would make the two pass a fault to each other for ever;
/// such a handler then sees a vanished read's fault first (a crash, as
/// without this module).
pub(crate) fn install() {
    INSTALLED.get_or_init(|| {
        // SAFETY: sigaction reads the current action into a zeroed struct
        // we own, then installs ours; the previous one is published first.
        unsafe {
            let mut now: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGSEGV, std::ptr::null(), &raw mut now) != 0 {
                return;
            }
            PAGE.store(crate::arena::page_size(), Ordering::SeqCst);
            PREVIOUS.store(Box::into_raw(Box::new(now)), Ordering::SeqCst);
            let mut ours: libc::sigaction = std::mem::zeroed();
            ours.sa_sigaction = on_segv as *const () as libc::sighandler_t;
            ours.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_NODEFER;
            libc::sigemptyset(&raw mut ours.sa_mask);
            libc::sigaction(libc::SIGSEGV, &raw const ours, std::ptr::null_mut());
        }
    });
}

/// Run `f`, which reads the caller memory `[start, start + len)` on this
/// thread; true with its result when some of that memory was freed under
/// the read (what `f` read there is zeros, and not to be used).
pub(crate) fn read<R>(start: usize, len: usize, f: impl FnOnce() -> R) -> (R, bool) {
    READING.with(|r| r.set((start, start.saturating_add(len))));
    READS.fetch_add(1, Ordering::SeqCst);
    let out = f();
    READS.fetch_sub(1, Ordering::SeqCst);
    READING.with(|r| r.set((0, 0)));
    let (runs, n) = MAPPED.with(Cell::get);
    if n == 0 {
        return (out, false);
    }
    MAPPED.with(|m| m.set(([(0, 0); RUNS], 0)));
    for &(lo, hi) in &runs[..n.min(RUNS)] {
        // SAFETY: pages this thread mapped in `on_segv` (fresh anonymous
        // mappings at addresses nothing else had mapped), used by nobody
        // now that the read is over.
        unsafe { libc::munmap(lo as *mut libc::c_void, hi - lo) };
    }
    (out, true)
}

/// The error of a save whose memory vanished under a read.
pub(crate) fn error() -> Error {
    Error::vanished(
        "the memory of a tensor being saved was freed while it was read (its storage was resized by \
         another thread meanwhile); nothing was committed",
    )
}

extern "C" fn on_segv(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for a SA_SIGINFO handler;
    // everything below is async-signal-safe (thread-local cells of plain
    // data, mmap, sigaction, atomics).
    unsafe {
        if (*info).si_code == SEGV_MAPERR
            && READS.load(Ordering::SeqCst) > 0
            && fix_up((*info).si_addr() as usize)
        {
            return; // the faulting read is made again, over a zero page
        }
        pass_on(sig, info, ctx);
    }
}

/// Map a zero page at `addr` when this thread is reading it; whether it did.
fn fix_up(addr: usize) -> bool {
    let (start, end) = READING.with(Cell::get);
    if addr < start || addr >= end {
        return false;
    }
    let page = PAGE.load(Ordering::Relaxed);
    let at = addr & !(page - 1);
    // SAFETY: MAP_FIXED_NOREPLACE maps only where nothing is mapped (the
    // fault says nothing is at `at`); a fresh private anonymous page,
    // read-only.
    let p = unsafe {
        libc::mmap(
            at as *mut libc::c_void,
            page,
            libc::PROT_READ,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
            -1,
            0,
        )
    };
    if p as usize != at {
        if p != libc::MAP_FAILED {
            // An old kernel that took the flag as a hint: not where asked.
            // SAFETY: the mapping just made, used by nobody.
            unsafe { libc::munmap(p, page) };
        }
        return false;
    }
    MAPPED.with(|m| {
        let (mut runs, mut n) = m.get();
        if n > 0 && n <= RUNS && runs[n - 1].1 == at {
            runs[n - 1].1 = at + page;
        } else if n < RUNS {
            runs[n] = (at, at + page);
            n += 1;
        } else {
            n = RUNS + 1; // (more runs than kept: left mapped, but counted)
        }
        m.set((runs, n));
    });
    true
}

/// Hand the fault to the handler installed before ours.
///
/// # Safety
/// Called from our SIGSEGV handler with its arguments.
unsafe fn pass_on(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let prev = PREVIOUS.load(Ordering::SeqCst);
    // SAFETY: a leaked `sigaction` that `install` published, never freed.
    let act = unsafe { prev.as_ref() };
    let handler = act.map_or(libc::SIG_DFL, |a| a.sa_sigaction);
    if handler == libc::SIG_DFL || handler == libc::SIG_IGN {
        // Back to the default action. A fault's instruction runs again when
        // we return and the kernel acts as if we had never been there; a
        // signal sent (kill, raise: no fault to repeat) is sent again.
        // SAFETY: sigaction, raise and the siginfo read are
        // async-signal-safe; the struct is ours.
        unsafe {
            let mut dfl: libc::sigaction = std::mem::zeroed();
            dfl.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(sig, &raw const dfl, std::ptr::null_mut());
            if (*info).si_code <= 0 {
                libc::raise(sig);
            }
        }
        return;
    }
    let flags = act.map_or(0, |a| a.sa_flags);
    // SAFETY: the previous handler as its installer declared it.
    unsafe {
        if flags & libc::SA_SIGINFO != 0 {
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                std::mem::transmute(handler);
            f(sig, info, ctx);
        } else {
            let f: extern "C" fn(libc::c_int) = std::mem::transmute(handler);
            f(sig);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Memory unmapped under a read: the read goes on over zeros, is told,
    /// and leaves nothing mapped; a read of memory that stays is not told.
    #[test]
    fn memory_unmapped_under_a_read_is_reported_not_a_crash() {
        install();
        let page = crate::arena::page_size();
        let len = 16 * page;
        let p = crate::arena::anonymous_mapping(len);
        let start = p as usize;
        // SAFETY: the mapping above.
        unsafe { std::ptr::write_bytes(p.cast::<u8>(), 7, len) };
        let sum = |mid: Option<usize>| {
            let mut s = 0u64;
            for i in 0..len {
                if Some(i) == mid {
                    // SAFETY: the second half of our own mapping, freed as
                    // another thread's resize would.
                    unsafe { libc::munmap((start + len / 2) as *mut libc::c_void, len / 2) };
                }
                // SAFETY: inside the mapping, or inside the range `read`
                // marks (what this test is about).
                s += u64::from(unsafe { std::ptr::read_volatile((start + i) as *const u8) });
            }
            s
        };
        let (s, vanished) = read(start, len, || sum(None));
        assert!(!vanished);
        assert_eq!(s, 7 * len as u64);
        let (s, vanished) = read(start, len, || sum(Some(len / 4)));
        assert!(vanished);
        assert_eq!(s, 7 * (len / 2) as u64, "the freed half reads as zeros");
        // Nothing of ours is left mapped there.
        let mut vec = vec![0u8; len / 2 / page];
        // SAFETY: mincore on an address range (ENOMEM when unmapped) into
        // a vector of one byte per page.
        let r = unsafe {
            libc::mincore(
                (start + len / 2) as *mut libc::c_void,
                len / 2,
                vec.as_mut_ptr(),
            )
        };
        assert_eq!(r, -1);
        // SAFETY: the first half, still ours.
        unsafe { libc::munmap(p, len / 2) };
    }
}
