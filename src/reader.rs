//! The read path: many records of one file into caller memory, with
//! O_DIRECT reads into the aligned arena (several in flight), then a copy
//! into each destination with its CRC32 computed on the way.
//!
//! Reads are issued in file order. With `gather_threads` > 1 each completed
//! buffer goes to a scatter thread (copy and partial CRC32 per piece: the
//! per-byte work, which on a fast device is the bound, spread over the
//! cores), and the partial checksums are folded in file order before the
//! buffer is reused; with one thread the calling thread scatters the
//! buffers in file order itself. Either way each record's checksum is its
//! bytes' in order, whatever order the device completes them in.

use crate::align::{self, align_down, align_up};
use crate::arena::Arena;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::gather::{copy_checksummed, with_workers, MIN_PARALLEL_EXTENTS, STEP};
use crate::sink::{Job, Sink};
use crc32fast::Hasher;
use std::collections::{BTreeMap, VecDeque};
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Destination pieces at least this long are faulted in with one call
/// before the copy ([`crate::arena::populate`]); shorter ones take their
/// few page faults as the copy goes.
const POPULATE_MIN: usize = 64 << 10;

/// The last reads of a read are this many times smaller than a buffer
/// ([`split_tail`]).
const TAIL_PIECES: usize = 4;

/// Idle scatter threads fault in the destinations of a read's last bytes
/// ahead of time ([`tail_chunks`]), this many bytes per task: short enough
/// that a completed buffer queued behind one waits little.
const PREFAULT_CHUNK: usize = 1 << 20;

/// Caller memory to read into.
#[derive(Debug, Clone, Copy)]
pub struct MutMemRef {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a (pointer, length) pair; `MutMemRef::new`'s contract makes the
// creator guarantee exclusive, valid memory for the duration of the read.
unsafe impl Send for MutMemRef {}
// SAFETY: shared, it hands out only its address and length; the writes
// through it are `unsafe` and made by the read, which gives each byte of a
// destination to exactly one scatter thread (extents do not overlap).
unsafe impl Sync for MutMemRef {}

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
pub(crate) const MERGE_GAP: u64 = 256 << 10;

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
        self.read_file(&file, direct, reqs, t0, MERGE_GAP)
            .map_err(|mut e| {
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
        self.read_into_fd_gap(fd, reqs, MERGE_GAP)
    }

    /// [`Engine::read_into_fd`] with requests merged into one read only
    /// across gaps of at most `merge_gap` bytes (`MERGE_GAP` there): 0 reads
    /// scattered small requests (the local headers of a zip) as that many
    /// block-sized reads in flight, not the whole span between them.
    pub fn read_into_fd_gap(
        &mut self,
        fd: RawFd,
        reqs: &[ReadReq],
        merge_gap: u64,
    ) -> Result<ReadStats> {
        self.read_fd_planned(fd, reqs, merge_gap, |eng, fd, extents, order| {
            eng.read_extents(fd, &extents, reqs, order)
        })
    }

    /// The open file `fd` reopened for reading (see
    /// [`Engine::read_into_fd`]), its requests checked and planned as
    /// extents, then `run(engine, fd, extents, order)` reading them and
    /// returning each request's CRC32; the file's length is checked again
    /// after (see [`Engine::read_planned`]).
    pub(crate) fn read_fd_planned(
        &mut self,
        fd: RawFd,
        reqs: &[ReadReq],
        merge_gap: u64,
        run: impl FnOnce(&mut Self, RawFd, Vec<(u64, usize)>, &[usize]) -> Result<Vec<u32>>,
    ) -> Result<ReadStats> {
        self.check_process()?;
        self.settle(None);
        let t0 = Instant::now();
        let (file, direct) = reopen_for_read(fd, self.opts.direct)?;
        let file_len = stat_len(&file)?;
        self.read_planned(&file, file_len, direct, reqs, t0, merge_gap, run)
            .map_err(|mut e| {
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
        merge_gap: u64,
    ) -> Result<ReadStats> {
        let file_len = stat_len(file)?;
        self.read_file_of_len(file, file_len, direct, reqs, t0, merge_gap)
    }

    /// [`Engine::read_file`] of a file `file_len` bytes long when stat'ed:
    /// the requests are checked against that length, the reads planned by
    /// it. A read comes back short only at the end of the file (the rest
    /// of its buffer is zeroed: the block padding past the end), so a file
    /// that shrank meanwhile would give zeros for bytes it no longer holds:
    /// the length is taken again once every read is done, and a file now
    /// shorter than the requests reach is an EIO error, not zeros.
    fn read_file_of_len(
        &mut self,
        file: &File,
        file_len: u64,
        direct: bool,
        reqs: &[ReadReq],
        t0: Instant,
        merge_gap: u64,
    ) -> Result<ReadStats> {
        self.read_planned(
            file,
            file_len,
            direct,
            reqs,
            t0,
            merge_gap,
            |eng, fd, extents, order| eng.read_extents(fd, &extents, reqs, order),
        )
    }

    /// [`Engine::read_file_of_len`] with `run(engine, fd, extents, order)`
    /// doing the reads of the planned extents (file order) and returning
    /// each request's CRC32.
    #[allow(clippy::too_many_arguments)] // private; the read's parts
    pub(crate) fn read_planned(
        &mut self,
        file: &File,
        file_len: u64,
        direct: bool,
        reqs: &[ReadReq],
        t0: Instant,
        merge_gap: u64,
        run: impl FnOnce(&mut Self, RawFd, Vec<(u64, usize)>, &[usize]) -> Result<Vec<u32>>,
    ) -> Result<ReadStats> {
        let block = if direct {
            align::probe_fd(file.as_raw_fd()).block
        } else {
            align::MIN_BLOCK
        } as u64;
        let order = check_requests(reqs, file_len)?;
        let buf_size = self.arena.buf_size();
        let mut extents = plan_extents(reqs, &order, block, buf_size as u64, merge_gap)?;
        let piece = align_down((buf_size / TAIL_PIECES) as u64, block).max(block);
        split_tail(&mut extents, self.opts.queue_depth, piece as usize);
        let crcs = run(self, file.as_raw_fd(), extents.into(), &order)?;
        let reach = reqs
            .iter()
            .map(|r| r.offset + r.dst.len as u64)
            .max()
            .unwrap_or(0);
        let now = stat_len(file)?;
        if now < reach {
            return Err(Error::os(
                libc::EIO,
                format!(
                    "the file shrank during the read: {now} bytes now, {file_len} when the read \
                     began; the records read reach byte {reach}"
                ),
                fd_path(file.as_raw_fd()).as_deref(),
            ));
        }
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
    /// `queue_depth` in flight; each buffer's bytes are copied to the
    /// requests' destinations and checksummed (one partial CRC32 per piece),
    /// on `gather_threads` scatter threads when there are enough extents,
    /// else on this thread; the partial checksums are folded in file order.
    /// Returns each request's CRC32.
    fn read_extents(
        &mut self,
        fd: RawFd,
        extents: &[(u64, usize)],
        reqs: &[ReadReq],
        order: &[usize],
    ) -> Result<Vec<u32>> {
        let qd = self.opts.queue_depth;
        let threads = self.opts.gather_threads;
        let plan = ReadPlan::new(fd, qd, extents, reqs, order);
        let mut hashers = vec![Hasher::new(); reqs.len()];
        self.with_buffers(|sink, arena, free| {
            if threads > 1 && extents.len() >= MIN_PARALLEL_EXTENTS {
                read_parallel(&plan, sink, arena, free, threads, &mut hashers)
            } else {
                read_serial(&plan, sink, arena, free, &mut hashers)
            }
        })?;
        Ok(hashers.into_iter().map(Hasher::finalize).collect())
    }
}

/// The length of the open `file`.
fn stat_len(file: &File) -> Result<u64> {
    Ok(file
        .metadata()
        .map_err(|e| Error::from_io(&e, "cannot stat the checkpoint", None))?
        .len())
}

/// The path `fd` was opened by (for messages), where `/proc` says.
fn fd_path(fd: RawFd) -> Option<std::path::PathBuf> {
    std::fs::read_link(format!("/proc/self/fd/{fd}")).ok()
}

/// One read, planned: the extents (file order) and, for each, the span of
/// `order` whose requests it overlaps.
pub(crate) struct ReadPlan<'a> {
    pub(crate) fd: RawFd,
    pub(crate) qd: usize,
    pub(crate) extents: &'a [(u64, usize)],
    pub(crate) spans: Vec<(usize, usize)>,
    pub(crate) reqs: &'a [ReadReq],
    pub(crate) order: &'a [usize],
}

impl<'a> ReadPlan<'a> {
    /// The plan of reading `extents` (file order) of `fd`, `qd` in flight,
    /// for `reqs` (`order`: their indices in file order).
    pub(crate) fn new(
        fd: RawFd,
        qd: usize,
        extents: &'a [(u64, usize)],
        reqs: &'a [ReadReq],
        order: &'a [usize],
    ) -> Self {
        ReadPlan {
            fd,
            qd,
            extents,
            spans: extent_spans(reqs, order, extents),
            reqs,
            order,
        }
    }
}

impl ReadPlan<'_> {
    /// Start the read of extent `seq` into arena buffer `b`.
    pub(crate) fn submit(
        &self,
        sink: &mut dyn Sink,
        arena: &Arena,
        seq: usize,
        b: usize,
    ) -> Result<()> {
        let (offset, len) = self.extents[seq];
        let job = Job {
            buf: b,
            ptr: arena.buf_ptr(b),
            len,
            offset,
            read: true,
        };
        // SAFETY: buffer `b` came off the free list (no other job or
        // scatter thread uses it) and is only read (scattered) after the
        // sink has returned it; on error `with_buffers` drains the sink
        // before the arena is used again. `fd` stays open until the read
        // has returned, after the drain.
        unsafe { sink.submit(self.fd, job) }
    }

    /// Scatter extent `seq`, read into `data`.
    pub(crate) fn scatter(&self, seq: usize, data: &[u8]) -> Vec<(usize, Hasher)> {
        scatter(
            self.reqs,
            self.order,
            self.spans[seq],
            self.extents[seq].0,
            data,
        )
    }
}

/// Reads in flight, scattered on this thread in file order.
fn read_serial(
    plan: &ReadPlan<'_>,
    sink: &mut dyn Sink,
    arena: &mut Arena,
    free: &mut Vec<usize>,
    hashers: &mut [Hasher],
) -> Result<()> {
    // In flight, in file order: (extent, buffer).
    let mut window: VecDeque<(usize, usize)> = VecDeque::new();
    let mut done = vec![false; arena.nbufs()];
    let mut next = 0usize;
    let mut freed = Vec::new();
    loop {
        while sink.inflight() < plan.qd && next < plan.extents.len() {
            let Some(b) = free.pop() else {
                break;
            };
            done[b] = false;
            plan.submit(sink, arena, next, b)?;
            window.push_back((next, b));
            next += 1;
        }
        let Some(&(seq, b)) = window.front() else {
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
        let len = plan.extents[seq].1;
        fold(hashers, plan.scatter(seq, &arena.buf(b)[..len]));
        free.push(b);
    }
    Ok(())
}

/// An extent read into arena buffer `buf` (at `addr`), for a scatter thread.
#[derive(Clone, Copy)]
struct ScatterTask {
    seq: usize,
    buf: usize,
    addr: usize,
}

/// A scatter thread's task: a completed buffer to scatter, or, while the
/// thread would otherwise wait for the device, destination memory near the
/// end of the read to fault in ahead of its copy.
#[derive(Clone, Copy)]
enum ReadTask {
    Scatter(ScatterTask),
    Prefault { addr: usize, len: usize },
}

/// A scatter thread's result: the extent's partial checksums.
struct Scattered {
    seq: usize,
    buf: usize,
    partials: Vec<(usize, Hasher)>,
}

/// Reads in flight, each completed buffer scattered by one of `threads`
/// scatter threads (in any order: the copies go to disjoint places) and
/// reused as soon as it is; the partial checksums are folded in file order. On
/// return (also on an error) no scatter thread touches any buffer or
/// destination any more.
fn read_parallel(
    plan: &ReadPlan<'_>,
    sink: &mut dyn Sink,
    arena: &mut Arena,
    free: &mut Vec<usize>,
    threads: usize,
    hashers: &mut [Hasher],
) -> Result<()> {
    let prefault = tail_chunks(plan, arena.len());
    with_workers(
        threads,
        |t: ReadTask| match t {
            ReadTask::Scatter(t) => Some(scatter_task(plan, t)),
            ReadTask::Prefault { addr, len } => {
                // SAFETY: `addr..addr+len` lies inside one request's
                // destination (`tail_chunks`), caller memory that the read
                // is about to write (valid for writes by `MutMemRef`'s
                // contract); faulting its pages in changes no byte, so a
                // scatter thread copying into the same pages meanwhile
                // loses nothing.
                unsafe { crate::arena::populate(addr, len) };
                None
            }
        },
        |task_tx, done_rx| {
            coordinate_reads(
                plan, sink, arena, free, hashers, threads, prefault, task_tx, done_rx,
            )
        },
    )?
}

/// The destination memory of the read's last `budget` bytes (pieces of at
/// least [`POPULATE_MIN`] bytes), from the end of the file backwards, in
/// chunks of at most [`PREFAULT_CHUNK`] bytes, each with the file offset
/// its bytes come from: (file offset, address, length).
///
/// A read leaves a tail: when the device has delivered the last extent,
/// the scatter threads are still copying the last few buffers, and a copy
/// into fresh memory spends most of its time faulting pages in. Until the
/// first reads complete, and whenever the threads are ahead of the device,
/// they are idle: faulting in the tail's destinations then takes that work
/// off the end of the read.
fn tail_chunks(plan: &ReadPlan<'_>, budget: usize) -> VecDeque<(u64, usize, usize)> {
    let mut out = VecDeque::new();
    let mut left = budget;
    for &i in plan.order.iter().rev() {
        if left == 0 {
            break;
        }
        let r = &plan.reqs[i];
        if r.dst.ptr.is_null() || r.dst.len < POPULATE_MIN {
            continue;
        }
        let stop = r.dst.len - r.dst.len.min(left);
        let mut end = r.dst.len;
        while end > stop {
            let lo = end.saturating_sub(PREFAULT_CHUNK).max(stop);
            out.push_back((r.offset + lo as u64, r.dst.ptr as usize + lo, end - lo));
            left -= end - lo;
            end = lo;
        }
    }
    out
}

/// A scatter thread's task: copy a completed buffer to its destinations.
fn scatter_task(plan: &ReadPlan<'_>, t: ScatterTask) -> Scattered {
    let len = plan.extents[t.seq].1;
    // SAFETY: buffer `t.buf` (at `t.addr`, at least `len` bytes: an extent
    // is at most one buffer) holds a completed read and was handed to this
    // task alone; the calling thread neither reuses nor resubmits it until
    // the worker sends it back, and the arena outlives the workers' scope.
    let data = unsafe { std::slice::from_raw_parts(t.addr as *const u8, len) };
    Scattered {
        seq: t.seq,
        buf: t.buf,
        partials: plan.scatter(t.seq, data),
    }
}

/// The calling thread's part of [`read_parallel`]; `threads` scatter
/// threads, of which idle ones fault in the chunks of `prefault` (in that
/// order) while their bytes' reads have not started.
#[allow(clippy::too_many_arguments)] // private; split out of read_parallel
fn coordinate_reads(
    plan: &ReadPlan<'_>,
    sink: &mut dyn Sink,
    arena: &mut Arena,
    free: &mut Vec<usize>,
    hashers: &mut [Hasher],
    threads: usize,
    mut prefault: VecDeque<(u64, usize, usize)>,
    task_tx: &mpsc::Sender<ReadTask>,
    done_rx: &mpsc::Receiver<Option<Scattered>>,
) -> Result<()> {
    let n = plan.extents.len();
    let (mut next, mut fin, mut outstanding) = (0usize, 0usize, 0usize);
    let mut seq_of = vec![usize::MAX; arena.nbufs()];
    // Partial checksums of extents scattered ahead of `fin`. A buffer goes
    // back to the free list as soon as it is scattered (whatever its place
    // in the file): only the checksums wait for file order.
    let mut ready: BTreeMap<usize, Vec<(usize, Hasher)>> = BTreeMap::new();
    let mut completed = Vec::new();
    let lost = || Error::internal("a scatter thread ended early");
    let take = |d: Option<Scattered>,
                free: &mut Vec<usize>,
                ready: &mut BTreeMap<usize, Vec<(usize, Hasher)>>,
                outstanding: &mut usize| {
        *outstanding -= 1;
        if let Some(d) = d {
            free.push(d.buf);
            ready.insert(d.seq, d.partials);
        }
    };
    while fin < n {
        while sink.inflight() < plan.qd && next < n {
            let Some(b) = free.pop() else {
                break;
            };
            plan.submit(sink, arena, next, b)?;
            seq_of[b] = next;
            next += 1;
        }
        sink.reap(&mut completed, false)?;
        let mut progressed = !completed.is_empty();
        for b in completed.drain(..) {
            let task = ReadTask::Scatter(ScatterTask {
                seq: seq_of[b],
                buf: b,
                addr: arena.buf_ptr(b) as usize,
            });
            task_tx.send(task).map_err(|_| lost())?;
            outstanding += 1;
        }
        while let Ok(d) = done_rx.try_recv() {
            take(d, free, &mut ready, &mut outstanding);
            progressed = true;
        }
        while let Some(partials) = ready.remove(&fin) {
            fold(hashers, partials);
            fin += 1;
        }
        if progressed || fin >= n {
            continue;
        }
        // Nothing moved. A thread is idle: fault in the destination of the
        // read's last bytes while their reads have not started (once they
        // have, their own scatter faults them in soon enough).
        if outstanding < threads {
            if let Some(&(off, addr, len)) = prefault.front() {
                if off >= plan.extents.get(next).map_or(u64::MAX, |e| e.0) {
                    prefault.pop_front();
                    task_tx
                        .send(ReadTask::Prefault { addr, len })
                        .map_err(|_| lost())?;
                    outstanding += 1;
                    continue;
                }
                prefault.clear();
            }
        }
        // Wait for the device or for a scatter thread.
        if outstanding == 0 {
            sink.reap(&mut completed, true)?;
        } else if sink.inflight() == 0 {
            let d = done_rx.recv().map_err(|_| lost())?;
            take(d, free, &mut ready, &mut outstanding);
        } else {
            // Both may finish first: a short wait on the threads, then the
            // device is polled again.
            match done_rx.recv_timeout(Duration::from_micros(200)) {
                Ok(d) => take(d, free, &mut ready, &mut outstanding),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => return Err(lost()),
            }
        }
    }
    Ok(())
}

/// Fold one extent's partial checksums (file order) into the requests'.
pub(crate) fn fold(hashers: &mut [Hasher], partials: Vec<(usize, Hasher)>) {
    for (i, h) in partials {
        hashers[i].combine(&h);
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

/// The block-aligned ranges to read, merged across gaps of at most
/// `merge_gap` bytes (touching ranges always merge), cut into
/// extents of at most `buf_size` bytes: `(offset, length)` in file order.
/// The requests lie inside the file ([`check_requests`]).
fn plan_extents(
    reqs: &[ReadReq],
    order: &[usize],
    block: u64,
    buf_size: u64,
    merge_gap: u64,
) -> Result<VecDeque<(u64, usize)>> {
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    for r in order.iter().map(|&i| &reqs[i]).filter(|r| r.dst.len > 0) {
        let lo = align_down(r.offset, block);
        // The end is inside the file, so its rounding fits; checked anyway.
        let hi = align_up(r.offset + r.dst.len as u64, block)
            .ok_or_else(|| Error::layout(format!("a record at offset {} is too far", r.offset)))?;
        match ranges.last_mut() {
            Some(last) if lo <= last.1.saturating_add(merge_gap) => last.1 = last.1.max(hi),
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

/// Cut the extents that the read's last `qd` reads would cover into
/// pieces of at most `piece` bytes (a multiple of the block), when there
/// are more extents than `qd` (reads in flight).
///
/// A device that works on the reads in flight side by side completes them
/// in waves (this VM's virtio disk: 16 reads of 4 MiB started together end
/// together, 19 ms later), so when the last wave lands, every buffer of it
/// is still to be copied out: 64 MiB of scatter work after the device has
/// gone idle (13 ms on 2 cores into fresh memory). Smaller last reads make
/// the last wave smaller, and the device stays as fast (fio: 1 MiB x 32
/// reads as fast as 4 MiB x 16 here).
fn split_tail(extents: &mut VecDeque<(u64, usize)>, qd: usize, piece: usize) {
    if extents.len() <= qd || piece == 0 {
        return;
    }
    let tail: Vec<(u64, usize)> = extents.drain(extents.len() - qd..).collect();
    for (off, len) in tail {
        let mut at = 0usize;
        while at < len {
            let n = piece.min(len - at);
            extents.push_back((off + at as u64, n));
            at += n;
        }
    }
}

/// For each extent (file order), the span `[k0, k1)` of `order` whose
/// requests it overlaps (requests are in file order and do not overlap).
fn extent_spans(
    reqs: &[ReadReq],
    order: &[usize],
    extents: &[(u64, usize)],
) -> Vec<(usize, usize)> {
    let mut spans = Vec::with_capacity(extents.len());
    let mut k0 = 0usize;
    for &(off, len) in extents {
        let end = off + len as u64;
        while k0 < order.len() && {
            let r = &reqs[order[k0]];
            r.offset + r.dst.len as u64 <= off
        } {
            k0 += 1;
        }
        let mut k1 = k0;
        while k1 < order.len() && reqs[order[k1]].offset < end {
            k1 += 1;
        }
        spans.push((k0, k1));
    }
    spans
}

/// Where the bytes of an extent go: one piece per request it overlaps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadPiece {
    /// The request (its index in the order given).
    pub req: usize,
    /// Where the piece starts within the request.
    pub start: usize,
    /// Its length.
    pub len: usize,
    /// Where it lies in the extent's buffer.
    pub at: usize,
}

/// The pieces of the extent of `len` bytes at file offset `off` that the
/// requests of `span` (of `order`) need, in file order.
pub(crate) fn extent_pieces<'a>(
    reqs: &'a [ReadReq],
    order: &'a [usize],
    (k0, k1): (usize, usize),
    off: u64,
    len: usize,
) -> impl Iterator<Item = ReadPiece> + 'a {
    let end = off + len as u64;
    order[k0..k1].iter().filter_map(move |&i| {
        let r = &reqs[i];
        let lo = r.offset.max(off);
        let hi = (r.offset + r.dst.len as u64).min(end);
        (lo < hi).then(|| ReadPiece {
            req: i,
            start: (lo - r.offset) as usize,
            len: (hi - lo) as usize,
            at: (lo - off) as usize,
        })
    })
}

/// Copy the part of `data` (file bytes at `off`) that each request of
/// `span` needs to its destination (a discarded one: checksum it in
/// place); returns the CRC32 of each piece, with its request's index, in
/// file order.
pub(crate) fn scatter(
    reqs: &[ReadReq],
    order: &[usize],
    span: (usize, usize),
    off: u64,
    data: &[u8],
) -> Vec<(usize, Hasher)> {
    let mut out = Vec::with_capacity(span.1 - span.0);
    for p in extent_pieces(reqs, order, span, off, data.len()) {
        let r = &reqs[p.req];
        let src = &data[p.at..p.at + p.len];
        let mut h = Hasher::new();
        if r.dst.ptr.is_null() {
            h.update(src);
        } else {
            // SAFETY: `p.start + p.len <= r.dst.len` (`extent_pieces`):
            // inside the destination.
            let dst = unsafe { r.dst.ptr.add(p.start) };
            if src.len() >= POPULATE_MIN {
                // SAFETY: the destination bytes this piece is about to
                // write (caller memory, valid for writes by contract).
                unsafe { crate::arena::populate(dst as usize, src.len()) };
            }
            // SAFETY: `p.start + p.len <= r.dst.len`: inside the
            // destination; the caller guaranteed exclusive write access to
            // it, and no other extent (so no other scatter thread) covers
            // these bytes.
            let dst = unsafe { std::slice::from_raw_parts_mut(dst, src.len()) };
            copy_checksummed(dst, src, &mut h, STEP);
        }
        out.push((p.req, h));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_that_shrank_during_the_read_is_an_error_not_zeros() {
        // The file is stat'ed at 64 KiB and holds 24 KiB when it is read
        // (truncated between the stat and the reads): every back end
        // reads short there, and the read fails with EIO naming the file
        // instead of handing the zeroed tail back as its bytes.
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f.bin");
        let data: Vec<u8> = (0..64u32 << 10).map(|i| (i * 7 + 1) as u8).collect();
        std::fs::write(&p, &data[..24 << 10]).unwrap();
        for io_uring in [true, false] {
            {
                let opts = crate::engine::Options {
                    io_uring,
                    block_size: 16 << 10,
                    arena_bytes: 64 << 10,
                    queue_depth: 2,
                    gather_threads: 1,
                    ..crate::engine::Options::default()
                };
                let mut eng = Engine::new(opts).unwrap();
                let file = File::open(&p).unwrap();
                let mut dst = vec![0xEEu8; 48 << 10];
                // SAFETY: `dst` outlives the read and nothing else uses it.
                let r = unsafe { MutMemRef::new(dst.as_mut_ptr(), dst.len()) };
                let reqs = [ReadReq {
                    offset: 8 << 10,
                    dst: r,
                }];
                let e = eng
                    .read_file_of_len(&file, 64 << 10, false, &reqs, Instant::now(), MERGE_GAP)
                    .unwrap_err();
                assert_eq!(e.errno, Some(libc::EIO), "io_uring {io_uring}: {e}");
                assert!(e.context.contains("shrank during the read"), "{e}");
                assert_eq!(e.path.as_deref(), Some(p.canonicalize().unwrap().as_path()));
                // Read within what it still holds: its bytes.
                let reqs = [ReadReq {
                    offset: 8 << 10,
                    // SAFETY: as above.
                    dst: unsafe { MutMemRef::new(dst.as_mut_ptr(), 16 << 10) },
                }];
                eng.read_file_of_len(&file, 64 << 10, false, &reqs, Instant::now(), MERGE_GAP)
                    .unwrap();
                assert!(dst[..16 << 10] == data[8 << 10..24 << 10]);
            }
        }
    }

    fn reqs(ranges: &[(u64, usize)]) -> Vec<ReadReq> {
        ranges
            .iter()
            .map(|&(offset, len)| ReadReq {
                offset,
                dst: MutMemRef::discard(len),
            })
            .collect()
    }

    #[test]
    fn scatter_copies_and_checksums_pieces_of_many_steps_across_extents() {
        // A file of patterned bytes; a destination request of several
        // checksum-and-copy steps starting mid-extent (so populated and
        // copied in parts), and a checksum-only request after it.
        let file: Vec<u8> = (0..8 * STEP).map(|i| (i * 31 + i / 7) as u8).collect();
        let (off0, len0) = (1000u64, 3 * STEP + 123);
        let (off1, len1) = (off0 + len0 as u64 + 5, STEP + 7);
        let mut dst = vec![0u8; len0];
        // SAFETY: `dst` outlives the scatters below and nothing else uses it.
        let d0 = unsafe { MutMemRef::new(dst.as_mut_ptr(), len0) };
        let rs = vec![
            ReadReq {
                offset: off0,
                dst: d0,
            },
            ReadReq {
                offset: off1,
                dst: MutMemRef::discard(len1),
            },
        ];
        let order = vec![0, 1];
        let mut hashers = vec![Hasher::new(); 2];
        // Two extents cutting the first request after 2 steps and a bit.
        let cut = 2 * STEP + 500;
        for (lo, hi) in [(0, cut), (cut, file.len())] {
            fold(
                &mut hashers,
                scatter(&rs, &order, (0, 2), lo as u64, &file[lo..hi]),
            );
        }
        assert!(
            dst == file[off0 as usize..off0 as usize + len0],
            "destination bytes differ"
        );
        let crcs: Vec<u32> = hashers.into_iter().map(Hasher::finalize).collect();
        let span = |o: u64, n: usize| crc32fast::hash(&file[o as usize..o as usize + n]);
        assert_eq!(crcs, vec![span(off0, len0), span(off1, len1)]);
    }

    #[test]
    fn a_zero_merge_gap_reads_scattered_requests_as_separate_blocks() {
        // Three small requests 100 KiB apart (a zip's local headers), and a
        // fourth in the same block as the third.
        let rs = reqs(&[
            (0, 50),
            (100 << 10, 60),
            (200 << 10, 40),
            ((200 << 10) + 100, 10),
        ]);
        let order: Vec<usize> = (0..rs.len()).collect();
        let merged = plan_extents(&rs, &order, 4096, 1 << 20, MERGE_GAP).unwrap();
        assert_eq!(merged, VecDeque::from(vec![(0, (200 << 10) + 4096)]));
        let sparse = plan_extents(&rs, &order, 4096, 1 << 20, 0).unwrap();
        assert_eq!(
            sparse,
            VecDeque::from(vec![(0, 4096), (100 << 10, 4096), (200 << 10, 4096)])
        );
        // Touching blocks still merge, and extents stay within a buffer.
        let rs = reqs(&[(0, 4096), (4096, 10000)]);
        let order = vec![0, 1];
        assert_eq!(
            plan_extents(&rs, &order, 4096, 8192, 0).unwrap(),
            VecDeque::from(vec![(0, 8192), (8192, 8192)])
        );
    }

    #[test]
    fn the_last_reads_are_cut_into_pieces_and_cover_the_same_bytes() {
        let ext: VecDeque<(u64, usize)> = (0..10u64).map(|i| (i * 20480, 16384)).collect();
        let mut cut = ext.clone();
        split_tail(&mut cut, 3, 4096);
        // The first 7 extents stay; the last 3 become 4 pieces each, in
        // file order, block-aligned, covering exactly what they covered.
        assert_eq!(cut.len(), 7 + 3 * 4);
        assert!(cut.iter().take(7).eq(ext.iter().take(7)));
        let pieces: Vec<_> = cut.iter().skip(7).copied().collect();
        assert!(pieces.iter().all(|&(o, n)| o % 4096 == 0 && n == 4096));
        let covered: Vec<u64> = pieces.iter().map(|&(o, _)| o).collect();
        let want: Vec<u64> = (7..10u64)
            .flat_map(|i| (0..4u64).map(move |k| i * 20480 + k * 4096))
            .collect();
        assert_eq!(covered, want);
        // A short last extent keeps its length in its last piece.
        let mut short = VecDeque::from(vec![(0, 8192), (8192, 8192), (16384, 6144)]);
        split_tail(&mut short, 1, 4096);
        assert_eq!(
            short,
            VecDeque::from(vec![(0, 8192), (8192, 8192), (16384, 4096), (20480, 2048)])
        );
        // No more extents than reads in flight: nothing to gain, nothing cut.
        let mut few = ext.clone();
        split_tail(&mut few, 10, 4096);
        assert_eq!(few, ext);
    }

    #[test]
    fn idle_threads_fault_in_the_destinations_of_the_last_bytes_first() {
        const MIB: usize = 1 << 20;
        let mut a = vec![0u8; 3 * MIB + 5];
        let mut b = vec![0u8; 5 * MIB / 2];
        let mut c = vec![0u8; 1000];
        let (la, lb) = (a.len(), b.len());
        // SAFETY: the buffers outlive the plan, which only reads addresses.
        let (da, db, dc) = unsafe {
            (
                MutMemRef::new(a.as_mut_ptr(), la),
                MutMemRef::new(b.as_mut_ptr(), lb),
                MutMemRef::new(c.as_mut_ptr(), c.len()),
            )
        };
        let rs = vec![
            ReadReq {
                offset: 4096,
                dst: da,
            },
            // Too short to fault in ahead, and one that is only checksummed.
            ReadReq {
                offset: (4096 + la + 10) as u64,
                dst: dc,
            },
            ReadReq {
                offset: (8 * MIB) as u64,
                dst: MutMemRef::discard(2 * MIB),
            },
            ReadReq {
                offset: (11 * MIB) as u64,
                dst: db,
            },
        ];
        let order: Vec<usize> = (0..rs.len()).collect();
        let plan = ReadPlan::new(-1, 4, &[], &rs, &order);
        let chunks = tail_chunks(&plan, 4 * MIB);
        let (pa, pb) = (a.as_ptr() as usize, b.as_ptr() as usize);
        let want = vec![
            ((11 * MIB + 3 * MIB / 2) as u64, pb + 3 * MIB / 2, MIB),
            ((11 * MIB + MIB / 2) as u64, pb + MIB / 2, MIB),
            ((11 * MIB) as u64, pb, MIB / 2),
            ((4096 + la - MIB) as u64, pa + la - MIB, MIB),
            (
                (4096 + la - 3 * MIB / 2) as u64,
                pa + la - 3 * MIB / 2,
                MIB / 2,
            ),
        ];
        assert_eq!(chunks, VecDeque::from(want));
        // A budget past every destination covers each large one whole.
        let all: usize = tail_chunks(&plan, 64 * MIB).iter().map(|c| c.2).sum();
        assert_eq!(all, la + lb);
        assert!(tail_chunks(&plan, 0).is_empty());
    }
}
