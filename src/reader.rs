//! The read path: many records of one file into caller memory, with
//! O_DIRECT reads into the aligned arena (several in flight), then a copy
//! into each destination with its CRC32 computed on the way.
//!
//! Reads are issued in file order and consumed in file order (a completed
//! buffer waits for the ones before it), so each record's checksum is fed
//! its bytes in order whatever order the device completes them in.

use crate::align::{self, align_down, align_up};
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::sink::Job;
use crc32fast::Hasher;
use std::collections::VecDeque;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::Instant;

/// Caller memory to read into.
#[derive(Debug, Clone, Copy)]
pub struct MutMemRef {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a (pointer, length) pair; `MutMemRef::new`'s contract makes the
// creator guarantee exclusive, valid memory for the duration of the read.
unsafe impl Send for MutMemRef {}

impl MutMemRef {
    /// # Safety
    /// `ptr` must be valid for writes of `len` bytes, and nothing else may
    /// read or write that memory, until the read that uses it returns.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> Self {
        MutMemRef { ptr, len }
    }

    /// `len` bytes to checksum but not keep (verification).
    pub fn discard(len: usize) -> Self {
        MutMemRef {
            ptr: std::ptr::null_mut(),
            len,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// One record to read: `dst.len()` bytes at `offset`.
#[derive(Debug, Clone, Copy)]
pub struct ReadReq {
    pub offset: u64,
    pub dst: MutMemRef,
}

#[derive(Debug, Clone, Default)]
pub struct ReadStats {
    pub bytes: u64,
    pub seconds: f64,
    pub file_len: u64,
    pub direct: bool,
    pub io_uring: bool,
    /// CRC32 of each request, in the order given.
    pub crcs: Vec<u32>,
}

/// Gaps smaller than this between records are read through rather than
/// skipped (one larger read beats two small ones).
const MERGE_GAP: u64 = 256 << 10;

impl Engine {
    /// Read every request from `path`. Requests must not overlap and must lie
    /// inside the file.
    pub fn read_into(&mut self, path: &Path, reqs: &[ReadReq]) -> Result<ReadStats> {
        self.check_process()?;
        // The arena is ours alone: writes a streamed save left in flight
        // finish first.
        self.settle(None);
        let t0 = Instant::now();
        let (file, direct) = crate::commit::open_direct(
            path,
            std::fs::OpenOptions::new().read(true),
            self.opts.direct,
        )
        .map_err(|e| Error::from_io(&e, "cannot open the checkpoint", Some(path)))?;
        self.read_file(&file, direct, reqs, t0).map_err(|mut e| {
            e.path.get_or_insert_with(|| path.to_path_buf());
            e
        })
    }

    /// Read every request from the file open as `fd` (a descriptor the
    /// caller keeps open for the call and that this call never closes):
    /// the same inode as `fd`, even when its path has been replaced or
    /// removed meanwhile. With `direct` the file is reopened through
    /// `/proc/self/fd` with O_DIRECT (which follows the open file, not a
    /// path); where that fails (no `/proc`, a file system that refuses
    /// O_DIRECT) a `dup` of `fd` is read with buffered reads. Same results
    /// as [`Engine::read_into`].
    pub fn read_into_fd(&mut self, fd: RawFd, reqs: &[ReadReq]) -> Result<ReadStats> {
        self.check_process()?;
        self.settle(None);
        let t0 = Instant::now();
        let (file, direct) = reopen_for_read(fd, self.opts.direct)?;
        self.read_file(&file, direct, reqs, t0).map_err(|mut e| {
            if e.path.is_none() {
                e.context = format!("{} (fd {fd})", e.context);
            }
            e
        })
    }

    /// Read every request from the open `file` (opened with O_DIRECT when
    /// `direct`).
    fn read_file(
        &mut self,
        file: &File,
        direct: bool,
        reqs: &[ReadReq],
        t0: Instant,
    ) -> Result<ReadStats> {
        let file_len = file
            .metadata()
            .map_err(|e| Error::from_io(&e, "cannot stat the checkpoint", None))?
            .len();
        let block = if direct {
            align::probe_fd(file.as_raw_fd()).block
        } else {
            align::MIN_BLOCK
        } as u64;
        let order = check_requests(reqs, file_len)?;
        let extents = plan_extents(reqs, &order, block, self.arena.buf_size() as u64)?;
        let crcs = self.read_extents(file.as_raw_fd(), extents, reqs, &order)?;
        Ok(ReadStats {
            bytes: reqs.iter().map(|r| r.dst.len as u64).sum(),
            seconds: t0.elapsed().as_secs_f64(),
            file_len,
            direct,
            io_uring: self.uring.is_some(),
            crcs,
        })
    }

    /// Read `extents` (file order) of `fd` into arena buffers, up to
    /// `queue_depth` in flight, and consume them in file order: each
    /// request's bytes are copied to its destination and checksummed.
    /// Returns each request's CRC32.
    fn read_extents(
        &mut self,
        fd: RawFd,
        mut extents: VecDeque<(u64, usize)>,
        reqs: &[ReadReq],
        order: &[usize],
    ) -> Result<Vec<u32>> {
        let qd = self.opts.queue_depth;
        let mut hashers = vec![Hasher::new(); reqs.len()];
        self.with_buffers(|sink, arena, free| {
            // In flight, in file order: (offset, len, buffer).
            let mut window: VecDeque<(u64, usize, usize)> = VecDeque::new();
            let mut done = vec![false; arena.nbufs()];
            let mut next_req = 0usize; // index into `order` of the first request not yet finished
            let mut freed = Vec::new();
            loop {
                while sink.inflight() < qd {
                    let Some(&b) = free.last() else {
                        break;
                    };
                    let Some((off, len)) = extents.pop_front() else {
                        break;
                    };
                    free.pop();
                    done[b] = false;
                    let job = Job {
                        buf: b,
                        ptr: arena.buf_ptr(b),
                        len,
                        offset: off,
                        read: true,
                    };
                    // SAFETY: buffer `b` came off the free list (no other
                    // job uses it) and is only read (`scatter`) after the
                    // sink has returned it; on error `with_buffers` drains
                    // the sink before the arena is used again. `fd` stays
                    // open until this closure has returned, after the drain.
                    unsafe { sink.submit(fd, job) }?;
                    window.push_back((off, len, b));
                }
                let Some(&(off, len, b)) = window.front() else {
                    break;
                };
                while !done[b] {
                    freed.clear();
                    sink.reap(&mut freed, true)?;
                    for &f in &freed {
                        done[f] = true;
                    }
                }
                window.pop_front();
                scatter(
                    reqs,
                    order,
                    &mut next_req,
                    off,
                    &arena.buf(b)[..len],
                    &mut hashers,
                );
                free.push(b);
            }
            Ok(())
        })?;
        Ok(hashers.into_iter().map(Hasher::finalize).collect())
    }
}

/// A new open file of the inode `fd` refers to, for positional reads, and
/// whether it has O_DIRECT; `fd` itself is left alone (positional reads on
/// a `dup` do not move its file offset either).
fn reopen_for_read(fd: RawFd, direct: bool) -> Result<(File, bool)> {
    if fd < 0 {
        return Err(Error::os(
            libc::EBADF,
            format!("{fd} is not a file descriptor"),
            None,
        ));
    }
    // SAFETY: F_DUPFD_CLOEXEC takes no memory; on any number it either
    // fails (EBADF) or returns a new descriptor, which we own.
    let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if dup < 0 {
        return Err(Error::last_os(format!("cannot duplicate fd {fd}"), None));
    }
    // SAFETY: `dup` was just returned by fcntl and is owned by nobody else.
    let dup = File::from(unsafe { OwnedFd::from_raw_fd(dup) });
    // SAFETY: F_GETFL on our own descriptor; no memory is passed.
    let flags = unsafe { libc::fcntl(dup.as_raw_fd(), libc::F_GETFL) };
    if flags < 0 {
        return Err(Error::last_os(format!("cannot inspect fd {fd}"), None));
    }
    if flags & libc::O_ACCMODE == libc::O_WRONLY {
        return Err(Error::os(
            libc::EBADF,
            format!("fd {fd} is not open for reading"),
            None,
        ));
    }
    if !direct || flags & libc::O_DIRECT != 0 {
        // Buffered as asked, or already O_DIRECT (shared by the dup).
        return Ok((dup, flags & libc::O_DIRECT != 0));
    }
    let meta = dup
        .metadata()
        .map_err(|e| Error::from_io(&e, format!("cannot stat fd {fd}"), None))?;
    if !meta.is_file() {
        return Ok((dup, false));
    }
    // Through our own descriptor's /proc entry: the caller may close and
    // reuse `fd` meanwhile, ours stays. The open follows the open file (the
    // inode), not whatever path it had.
    let proc_path = format!("/proc/self/fd/{}", dup.as_raw_fd());
    let reopened = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(proc_path);
    match reopened {
        Ok(f) if f.metadata().is_ok_and(|m| same_inode(&m, &meta)) => Ok((f, true)),
        // No /proc, O_DIRECT refused (EINVAL), or not the same file.
        _ => Ok((dup, false)),
    }
}

fn same_inode(a: &std::fs::Metadata, b: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    a.dev() == b.dev() && a.ino() == b.ino()
}

/// The requests' indices in file order, after checking that each lies
/// inside the file and that none overlap.
fn check_requests(reqs: &[ReadReq], file_len: u64) -> Result<Vec<usize>> {
    let mut order: Vec<usize> = (0..reqs.len()).collect();
    order.sort_by_key(|&i| reqs[i].offset);
    let mut prev_end = 0u64;
    for &i in &order {
        let r = &reqs[i];
        let end = r
            .offset
            .checked_add(r.dst.len as u64)
            .filter(|&e| e <= file_len)
            .ok_or_else(|| {
                Error::layout(format!(
                    "a record at offset {} of {} bytes extends past the end of the file \
                     ({file_len} bytes)",
                    r.offset, r.dst.len
                ))
            })?;
        if r.dst.len > 0 && r.offset < prev_end {
            return Err(Error::layout(format!(
                "records overlap at offset {}",
                r.offset
            )));
        }
        prev_end = prev_end.max(end);
    }
    Ok(order)
}

/// The block-aligned ranges to read, merged across small gaps, cut into
/// extents of at most `buf_size` bytes: `(offset, length)` in file order.
/// The requests lie inside the file ([`check_requests`]).
fn plan_extents(
    reqs: &[ReadReq],
    order: &[usize],
    block: u64,
    buf_size: u64,
) -> Result<VecDeque<(u64, usize)>> {
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    for r in order.iter().map(|&i| &reqs[i]).filter(|r| r.dst.len > 0) {
        let lo = align_down(r.offset, block);
        // The end is inside the file, so its rounding fits; checked anyway.
        let hi = align_up(r.offset + r.dst.len as u64, block)
            .ok_or_else(|| Error::layout(format!("a record at offset {} is too far", r.offset)))?;
        match ranges.last_mut() {
            Some(last) if lo <= last.1 + MERGE_GAP => last.1 = last.1.max(hi),
            _ => ranges.push((lo, hi)),
        }
    }
    let mut extents = VecDeque::new();
    for (lo, hi) in ranges {
        let mut off = lo;
        while off < hi {
            let len = buf_size.min(hi - off);
            extents.push_back((off, len as usize));
            off += len;
        }
    }
    Ok(extents)
}

/// Copy the part of `data` (file bytes at `off`) that each request needs.
fn scatter(
    reqs: &[ReadReq],
    order: &[usize],
    next: &mut usize,
    off: u64,
    data: &[u8],
    hashers: &mut [Hasher],
) {
    let end = off + data.len() as u64;
    let mut k = *next;
    while k < order.len() {
        let i = order[k];
        let r = &reqs[i];
        let r_end = r.offset + r.dst.len as u64;
        if r.offset >= end {
            break;
        }
        let lo = r.offset.max(off);
        let hi = r_end.min(end);
        if lo < hi {
            let src = &data[(lo - off) as usize..(hi - off) as usize];
            hashers[i].update(src);
            if !r.dst.ptr.is_null() {
                // SAFETY: `lo - r.offset + src.len() <= r.dst.len`; the caller
                // guaranteed exclusive write access to the destination.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        src.as_ptr(),
                        r.dst.ptr.add((lo - r.offset) as usize),
                        src.len(),
                    );
                };
            }
        }
        if r_end <= end {
            // Finished: later buffers never touch it again.
            if k == *next {
                *next += 1;
            }
            k += 1;
        } else {
            break;
        }
    }
}
