//! The staging arena: one anonymous mapping, cut into equal buffers.
//!
//! Anonymous mmap gives page-aligned memory (so every buffer is aligned for
//! O_DIRECT when the buffer size is a multiple of the block), populated up
//! front so the first save does not page-fault, and locked with `mlock` when
//! RLIMIT_MEMLOCK allows so the kernel never swaps it out under a write. Its
//! size is fixed when it is made and does not depend on the checkpoint.
//!
//! For CUDA, the Python layer registers the whole mapping with
//! `cudaHostRegister`; `mlock` alone does not make memory DMA-pinned for CUDA.

use crate::error::{Error, Result};
use std::sync::OnceLock;

/// Huge page size the arena is aligned to.
const HUGE: usize = 2 << 20;

pub struct Arena {
    ptr: *mut u8,
    len: usize,
    buf_size: usize,
    locked: bool,
}

// SAFETY: the arena owns its mapping exclusively; the raw pointer is only an
// address. Handing out disjoint buffers and making sure the kernel is done
// with one before it is reused is the writer's job.
unsafe impl Send for Arena {}
// SAFETY: shared references only expose the address and sizes; writing into
// buffers goes through `buf_mut`, which takes `&mut self`.
unsafe impl Sync for Arena {}

/// Ask for transparent huge pages on the 2 MiB-aligned part of
/// `addr..addr+len` and fault every whole page of it in now (Linux 5.14's
/// `MADV_POPULATE_WRITE`; on older kernels only the advice is given), so a
/// buffer that is about to be filled does not take a page fault per 4 KiB
/// on the critical path. The bytes are left as they are (populating keeps
/// any page already present). Pages partly outside the range are skipped.
///
/// # Safety
///
/// `addr..addr+len` must be memory of this process that the caller owns
/// and that is private, anonymous and writable (e.g. a fresh `malloc`
/// buffer): advice applies to whole mappings' pages in the range.
pub unsafe fn prepare_memory(addr: usize, len: usize) {
    let Some(end) = addr.checked_add(len) else {
        return;
    };
    let (hs, he) = (addr.next_multiple_of(HUGE), end - end % HUGE);
    if he > hs {
        // SAFETY: the range lies inside `addr..addr+len` (the caller's
        // private anonymous memory); advice cannot change the bytes of
        // pages that are present; a failure only means small pages.
        unsafe { libc::madvise(hs as *mut libc::c_void, he - hs, libc::MADV_HUGEPAGE) };
    }
    // SAFETY: the caller's memory, private, anonymous and writable.
    unsafe { populate(addr, len) };
}

/// Whether this kernel knows `MADV_POPULATE_WRITE` (Linux 5.14), asked
/// once with an empty range.
fn populate_known() -> bool {
    static KNOWN: OnceLock<bool> = OnceLock::new();
    *KNOWN.get_or_init(|| {
        let page = page_size();
        // SAFETY: an empty range: the kernel only checks the advice (and
        // the alignment of the address, which is a page's).
        unsafe { libc::madvise(page as *mut libc::c_void, 0, libc::MADV_POPULATE_WRITE) == 0 }
    })
}

/// Fault in the whole pages inside `addr..addr+len` now, writable, with one
/// call (Linux 5.14's `MADV_POPULATE_WRITE`), instead of one page fault per
/// 4 KiB as a copy into them goes: about a fifth less time to fill fresh
/// memory. The bytes are left as they are (pages already present are kept;
/// pages partly outside the range are not touched), and nothing about the
/// mapping changes. Best effort: on a kernel without the advice, or a
/// mapping that refuses it, the copy takes the faults as before.
///
/// # Safety
///
/// `addr..addr+len` must be memory the caller is about to write (so
/// mapped and writable); other memory of the same pages is left as it is.
pub unsafe fn populate(addr: usize, len: usize) {
    let page = page_size();
    let Some(end) = addr.checked_add(len) else {
        return;
    };
    let (ps, pe) = (addr.next_multiple_of(page), end - end % page);
    if pe <= ps || !populate_known() {
        return;
    }
    // SAFETY: the whole pages inside the caller's writable memory; the
    // advice only faults them in, it changes no byte and no mapping.
    unsafe { libc::madvise(ps as *mut libc::c_void, pe - ps, libc::MADV_POPULATE_WRITE) };
}

impl Arena {
    /// Map `nbufs` buffers of `buf_size` bytes (a multiple of the page size).
    pub fn new(buf_size: usize, nbufs: usize, lock: bool) -> Result<Self> {
        let page = page_size();
        if buf_size == 0 || buf_size % page != 0 {
            return Err(Error::option(format!(
                "buffer size {buf_size} must be a positive multiple of the page size {page}"
            )));
        }
        if nbufs == 0 {
            return Err(Error::option("the arena needs at least one buffer"));
        }
        let len = buf_size
            .checked_mul(nbufs)
            .ok_or_else(|| Error::option("arena size overflows"))?;
        if let Some(mem) = physical_memory() {
            if len as u64 > mem {
                return Err(Error::option(format!(
                    "{len} bytes of staging memory is more than this machine's memory \
                     ({mem} bytes)"
                )));
            }
        }
        // Map 2 MiB more than needed so the arena can start on a 2 MiB
        // boundary: with transparent huge pages each buffer is then a few
        // physically contiguous segments, and a 4 MiB write is one block
        // request instead of several (virtio-blk takes 254 segments a request).
        let map_len = len
            .checked_add(HUGE)
            .ok_or_else(|| Error::option(format!("a {len}-byte arena is too large")))?;
        // SAFETY: an anonymous private mapping with no address hint; the
        // arguments are valid and the result is checked against MAP_FAILED.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(Error::last_os(
                format!("cannot map a {len}-byte staging arena"),
                None,
            ));
        }
        let start = (raw as usize).next_multiple_of(HUGE);
        let head = start - raw as usize;
        let tail = map_len - head - len;
        // SAFETY: both ranges lie inside the mapping just made and outside
        // `start..start+len`, which we keep; unmapping slack is always valid.
        unsafe {
            if head > 0 {
                libc::munmap(raw, head);
            }
            if tail > 0 {
                libc::munmap((start + len) as *mut libc::c_void, tail);
            }
        }
        let ptr = start as *mut libc::c_void;
        // SAFETY: advice and population on our own mapping `ptr..ptr+len`;
        // failures only mean small pages or faults on first touch.
        unsafe {
            libc::madvise(ptr, len, libc::MADV_HUGEPAGE);
            if libc::madvise(ptr, len, libc::MADV_POPULATE_WRITE) != 0 {
                std::ptr::write_bytes(ptr.cast::<u8>(), 0, len);
            }
        }
        // SAFETY: `ptr..ptr+len` is the mapping we just created.
        let locked = lock && unsafe { libc::mlock(ptr, len) } == 0;
        // Not inherited by fork() children: a child never uses an engine or
        // staging buffer of its parent (see `Engine`'s process check), and
        // memory pinned for I/O (registered with io_uring or CUDA) would be
        // copied eagerly into every child (a DataLoader worker each).
        // SAFETY: advice on our own mapping; failure only means the child
        // gets a copy, as without it.
        unsafe { libc::madvise(ptr, len, libc::MADV_DONTFORK) };
        Ok(Arena {
            ptr: ptr.cast(),
            len,
            buf_size,
            locked,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn buf_size(&self) -> usize {
        self.buf_size
    }

    pub fn nbufs(&self) -> usize {
        self.len / self.buf_size
    }

    /// Whether `mlock` succeeded.
    pub fn locked(&self) -> bool {
        self.locked
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Address of buffer `i`.
    ///
    /// # Panics
    /// When `i` is not a buffer index (`i >= nbufs()`).
    pub fn buf_ptr(&self, i: usize) -> *mut u8 {
        assert!(i < self.nbufs());
        // SAFETY: `i * buf_size < len`, so the result stays inside the mapping.
        unsafe { self.ptr.add(i * self.buf_size) }
    }

    /// Buffer `i`, writable.
    ///
    /// # Panics
    /// When `i >= nbufs()`.
    pub fn buf_mut(&mut self, i: usize) -> &mut [u8] {
        let p = self.buf_ptr(i);
        // SAFETY: the buffer lies inside our mapping, and `&mut self`
        // guarantees no other slice of the arena is alive in this thread.
        // The kernel must not be using this buffer: the writer only hands out
        // buffers whose I/O has completed.
        unsafe { std::slice::from_raw_parts_mut(p, self.buf_size) }
    }

    /// Buffer `i`, readable.
    ///
    /// # Panics
    /// When `i >= nbufs()`.
    pub fn buf(&self, i: usize) -> &[u8] {
        let p = self.buf_ptr(i);
        // SAFETY: inside our mapping; see `buf_mut`.
        unsafe { std::slice::from_raw_parts(p, self.buf_size) }
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: we created exactly this mapping in `new` and nobody else
        // unmaps it; munmap also drops the mlock.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

/// The machine's physical memory in bytes, when the system says.
pub fn physical_memory() -> Option<u64> {
    // SAFETY: sysconf has no memory-safety preconditions.
    let pages = unsafe { libc::sysconf(libc::_SC_PHYS_PAGES) };
    u64::try_from(pages)
        .ok()
        .filter(|&p| p > 0)
        .and_then(|p| p.checked_mul(page_size() as u64))
}

/// A fresh private anonymous read-write mapping of `len` bytes, for tests
/// (the caller unmaps it).
#[cfg(test)]
pub(crate) fn anonymous_mapping(len: usize) -> *mut libc::c_void {
    // SAFETY: mmap of new anonymous memory; no existing memory is touched.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    p
}

pub fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_and_disjoint() {
        let mut a = Arena::new(1 << 16, 4, true).unwrap();
        assert_eq!(a.len(), 1 << 18);
        for i in 0..a.nbufs() {
            assert_eq!(a.buf_ptr(i) as usize % 4096, 0);
            a.buf_mut(i).fill(i as u8 + 1);
        }
        for i in 0..a.nbufs() {
            assert!(a.buf(i).iter().all(|&b| b == i as u8 + 1));
        }
    }

    #[test]
    fn rejects_bad_sizes() {
        assert!(Arena::new(1000, 4, false).is_err());
        assert!(Arena::new(4096, 0, false).is_err());
    }

    #[test]
    fn huge_sizes_are_errors_not_overflows() {
        // The largest multiple of the buffer size: the 2 MiB of alignment
        // slack used to wrap around.
        for nbufs in [usize::MAX >> 20, (usize::MAX >> 20) - 1, 1 << 40] {
            let e = Arena::new(1 << 20, nbufs, false).err().expect("refused");
            assert_eq!(e.kind, crate::ErrorKind::InvalidOption, "{e}");
        }
        assert!(Arena::new(1 << 20, usize::MAX, false).is_err());
    }

    /// `fill(addr, len)` on a fresh mapping, from mid-page to its end:
    /// every whole page in the range is faulted in (where the kernel has
    /// `MADV_POPULATE_WRITE`), the partial first page is not, and a byte
    /// written before keeps its value.
    fn faults_in_whole_pages_and_keeps_the_bytes(fill: unsafe fn(usize, usize)) {
        let len = 6 << 20;
        let raw = anonymous_mapping(len); // (unmapped below)
        let page = page_size();
        let resident = || {
            let mut v = vec![0u8; len / page];
            // SAFETY: `raw..raw+len` is our mapping; `v` has a byte per page.
            assert_eq!(unsafe { libc::mincore(raw, len, v.as_mut_ptr()) }, 0);
            v.iter().filter(|&&b| b & 1 == 1).count()
        };
        // One page written before (its byte must survive); the rest untouched.
        // SAFETY: inside our mapping.
        unsafe { raw.cast::<u8>().add(page + 5).write(0xAB) };
        assert_eq!(resident(), 1);
        // Start mid-page: only whole pages inside the range are populated.
        // SAFETY: our own private anonymous mapping.
        unsafe { fill(raw as usize + 100, len - 100) };
        // SAFETY: inside our mapping.
        assert_eq!(unsafe { raw.cast::<u8>().add(page + 5).read() }, 0xAB);
        let n = resident();
        if populate_known() {
            assert_eq!(n, len / page - 1, "the partial first page is skipped");
        } else {
            assert_eq!(n, 1, "nothing but the page written before");
        }
        // SAFETY: unmapping the mapping made above.
        unsafe { libc::munmap(raw, len) };
    }

    #[test]
    fn prepare_memory_faults_in_and_keeps_the_bytes() {
        faults_in_whole_pages_and_keeps_the_bytes(prepare_memory);
    }

    #[test]
    fn populate_faults_in_and_keeps_the_bytes() {
        faults_in_whole_pages_and_keeps_the_bytes(populate);
        // Ranges with no whole page, or past the address space, do nothing.
        let mut v = vec![1u8; 100];
        // SAFETY: inside `v` (no whole page: nothing is asked).
        unsafe { populate(v.as_mut_ptr() as usize, v.len()) };
        // SAFETY: the end overflows: returns before any call.
        unsafe { populate(usize::MAX - 10, 100) };
        assert!(v.iter().all(|&b| b == 1));
    }

    #[test]
    fn not_inherited_by_fork_children() {
        let a = Arena::new(1 << 20, 2, false).unwrap();
        let (ptr, len) = (a.as_ptr() as usize, a.len());
        // SAFETY: the child only calls mincore and _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let mut v = vec![0u8; len / page_size()];
            // SAFETY: mincore on an address range; ENOMEM when not mapped.
            let rc = unsafe { libc::mincore(ptr as *mut libc::c_void, len, v.as_mut_ptr()) };
            let unmapped =
                rc != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOMEM);
            // SAFETY: ends the child without running the harness.
            unsafe { libc::_exit(i32::from(!unmapped)) };
        }
        let mut status = 0;
        // SAFETY: reaping our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &raw mut status, 0) }, pid);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "the child has the arena"
        );
        drop(a);
    }
}
