//! Direct-I/O alignment of a directory's file system.
//!
//! O_DIRECT needs the buffer address, the file offset and the length aligned.
//! Linux 6.1+ reports the exact requirements through `statx(STATX_DIOALIGN)`;
//! elsewhere we assume the page size, which is a multiple of every logical
//! block size in use. We never go below 4096: page-sized blocks are what the
//! page cache, the NVMe and `torch.load(mmap=True)` like best.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// The floor for every alignment we use.
pub const MIN_BLOCK: usize = 4096;

/// What the file system told us, and the block size we will use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DioAlign {
    /// Required alignment of user buffers (0: the file system did not say).
    pub mem_align: u32,
    /// Required alignment of file offsets and lengths (0: did not say).
    pub offset_align: u32,
    /// Block size used for every extent: a power of two, a multiple of both
    /// requirements, at least [`MIN_BLOCK`].
    pub block: usize,
    /// Whether the numbers came from `statx(STATX_DIOALIGN)`.
    pub from_statx: bool,
}

impl DioAlign {
    pub fn fallback() -> Self {
        DioAlign {
            mem_align: 0,
            offset_align: 0,
            block: MIN_BLOCK,
            from_statx: false,
        }
    }
}

/// Probe `path` for its direct-I/O alignment. File systems report it for
/// regular files (ext4 does not for directories): probe the file itself
/// when it exists, e.g. the temporary file of a save ([`probe_fd`]).
pub fn probe(path: &Path) -> DioAlign {
    let Ok(c) = CString::new(path.as_os_str().as_bytes()) else {
        return DioAlign::fallback();
    };
    statx_dio(libc::AT_FDCWD, &c, 0)
}

/// Probe an open file for its direct-I/O alignment.
pub fn probe_fd(fd: std::os::fd::RawFd) -> DioAlign {
    statx_dio(fd, c"", libc::AT_EMPTY_PATH)
}

fn statx_dio(dirfd: i32, path: &std::ffi::CStr, flags: i32) -> DioAlign {
    // SAFETY: `statx` is plain old data; all-zero is a valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is a valid NUL-terminated string and `stx` a valid,
    // writable statx buffer that lives across the call.
    let rc = unsafe {
        libc::statx(
            dirfd,
            path.as_ptr(),
            flags,
            libc::STATX_DIOALIGN,
            &raw mut stx,
        )
    };
    if rc != 0 || stx.stx_mask & libc::STATX_DIOALIGN == 0 || stx.stx_dio_offset_align == 0 {
        return DioAlign::fallback();
    }
    let need = (stx.stx_dio_mem_align.max(stx.stx_dio_offset_align) as usize).max(MIN_BLOCK);
    DioAlign {
        mem_align: stx.stx_dio_mem_align,
        offset_align: stx.stx_dio_offset_align,
        block: need.next_power_of_two(),
        from_statx: true,
    }
}

/// Round `x` up to a multiple of `a` (a power of two); `None` when the
/// result does not fit in a u64.
pub fn align_up(x: u64, a: u64) -> Option<u64> {
    debug_assert!(a.is_power_of_two());
    Some(x.checked_add(a - 1)? & !(a - 1))
}

/// Round `x` down to a multiple of `a` (a power of two).
pub fn align_down(x: u64, a: u64) -> u64 {
    debug_assert!(a.is_power_of_two());
    x & !(a - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_tmp_is_sane() {
        let d = tempfile::tempdir().unwrap();
        let a = probe(d.path());
        assert!(a.block >= MIN_BLOCK && a.block.is_power_of_two());
        if a.from_statx {
            assert_eq!(a.block % a.offset_align as usize, 0);
            assert_eq!(a.block % a.mem_align.max(1) as usize, 0);
        }
    }

    #[test]
    fn probe_regular_file() {
        use std::os::fd::AsRawFd;
        let f = tempfile::NamedTempFile::new().unwrap();
        let by_path = probe(f.path());
        assert_eq!(probe_fd(f.as_file().as_raw_fd()), by_path);
        assert!(by_path.block >= MIN_BLOCK);
    }

    #[test]
    fn probe_missing_path_falls_back() {
        assert_eq!(
            probe(Path::new("/nonexistent/fastpersist")),
            DioAlign::fallback()
        );
    }

    #[test]
    fn rounding() {
        assert_eq!(align_up(0, 4096), Some(0));
        assert_eq!(align_up(1, 4096), Some(4096));
        assert_eq!(align_up(4096, 4096), Some(4096));
        assert_eq!(align_up(u64::MAX - 4095, 4096), Some(u64::MAX - 4095));
        assert_eq!(align_up(u64::MAX - 4094, 4096), None);
        assert_eq!(align_down(8191, 4096), 4096);
    }
}
