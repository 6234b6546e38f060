//! I/O back ends: an io_uring ring, or a pool of threads doing `pwrite`/`pread`.
//!
//! Both take [`Job`]s (one arena buffer to write at one offset) and hand the
//! buffer back once every byte of it is on its way to the file, resubmitting
//! short writes and turning a failed completion into an [`Error`] with its
//! errno. Neither ever lets a buffer go back to the writer while the kernel
//! may still read it: error paths call [`Sink::drain`] first.

use crate::arena::Arena;
use crate::error::{Error, Result};
use io_uring::{opcode, types, IoUring};
use std::os::fd::RawFd;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// One buffer's write (or read, with `read`).
#[derive(Debug, Clone, Copy)]
pub struct Job {
    /// Arena buffer index (returned when the I/O is complete).
    pub buf: usize,
    /// The buffer: read from for writes, written to for reads.
    pub ptr: *const u8,
    pub len: usize,
    pub offset: u64,
    /// A read: one that returns no bytes means end of file, and the rest of
    /// the buffer is zero-filled (the block padding past the end; the
    /// reader takes the file's length again after its reads, so a file that
    /// shrank meanwhile is an error, not zeros); a short one goes on.
    pub read: bool,
}

// SAFETY: a Job is an address and a length; the memory it names is only
// touched by the kernel or a pool thread under the contract of the unsafe
// `Sink::submit` that handed it over.
unsafe impl Send for Job {}

/// A fault to inject for tests: the I/O that covers `offset` completes
/// with `-errno` instead of its real result; with `errno` 0, one that
/// covers it past its start stops short there (as a network or FUSE file
/// system may), and the rest is for the sink to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    pub offset: u64,
    pub errno: i32,
}

impl Fault {
    /// The offset of a fault that makes every wait on the ring fail with
    /// `errno` (io_uring only).
    pub const WAIT: u64 = u64::MAX;

    /// The offset of a fault that fails every I/O beginning at an offset
    /// that is not a multiple of 512 with `errno` (EINVAL), as file systems
    /// do that check a direct I/O's alignment before the end of the file
    /// (those on the kernel's older direct-I/O code, `fs/direct-io.c`).
    pub const UNALIGNED: u64 = u64::MAX - 1;

    fn hits(fault: Option<Fault>, job: &Job) -> Option<i32> {
        fault
            .filter(|f| {
                if f.offset == Self::UNALIGNED {
                    job.offset % 512 != 0
                } else {
                    f.offset >= job.offset && f.offset < job.offset.saturating_add(job.len as u64)
                }
            })
            .filter(|f| f.errno != 0)
            .map(|f| f.errno)
    }

    /// With a short-I/O fault (`errno` 0) inside `job` past its start: the
    /// bytes before it.
    fn short(fault: Option<Fault>, job: &Job) -> Option<usize> {
        let f = fault.filter(|f| f.errno == 0)?;
        let k = usize::try_from(f.offset.checked_sub(job.offset)?).ok()?;
        (k > 0 && k < job.len).then_some(k)
    }
}

impl Job {
    /// What is left of this job once its first `n` bytes are done (`n`
    /// below its length).
    fn rest(&self, n: usize) -> Job {
        debug_assert!(n < self.len);
        Job {
            buf: self.buf,
            // SAFETY: n < len, so the pointer stays in the job's buffer.
            ptr: unsafe { self.ptr.add(n) },
            len: self.len - n,
            offset: self.offset + n as u64,
            read: self.read,
        }
    }
}

fn write_error(errno: i32, job: &Job) -> Error {
    let what = if job.read { "read" } else { "write" };
    Error::os(
        errno,
        format!("{what} of {} bytes at offset {}", job.len, job.offset),
        None,
    )
}

/// Zero the part of a read buffer past end of file.
fn zero_tail(job: &Job, got: usize) {
    if got < job.len {
        // SAFETY: `job.ptr..job.ptr+job.len` is a buffer handed to this read,
        // owned by the I/O until the job completes, which is now.
        unsafe { std::ptr::write_bytes(job.ptr.cast_mut().add(got), 0, job.len - got) };
    }
}

pub trait Sink {
    /// Start writing (or, for a read job, reading) `job` on `fd`.
    ///
    /// # Safety
    ///
    /// The kernel (or a pool thread) reads `job.len` bytes from `job.ptr`
    /// for a write and writes them for a read, after this call returns. The
    /// caller guarantees that:
    /// - `job.ptr..job.ptr + job.len` is valid for reads (a write job) or
    ///   for writes (a read job) until the job's buffer index comes back
    ///   from [`Sink::reap`], or until [`Sink::drain`] returns or the sink is
    ///   dropped, whichever comes first;
    /// - nothing else writes that memory meanwhile, nor, for a read job,
    ///   reads it or holds a reference to it;
    /// - `fd` stays open until the same point (a closed and reused number
    ///   would send the I/O to another file);
    /// - `job.buf` is not the buffer index of another job in flight.
    unsafe fn submit(&mut self, fd: RawFd, job: Job) -> Result<()>;
    /// Move the buffers whose writes completed into `free`. With `wait`,
    /// block until at least one completes (if any is in flight).
    fn reap(&mut self, free: &mut Vec<usize>, wait: bool) -> Result<()>;
    /// Start an fdatasync of `fd` that runs alongside the writes, so the
    /// device drains its cache during the save rather than all at the end.
    /// Its failure is reported by a later `reap`.
    fn submit_datasync(&mut self, fd: RawFd) -> Result<()>;
    /// Writes in flight.
    fn inflight(&self) -> usize;
    /// Wait for every write in flight, discarding results. Used on error
    /// paths so no buffer is reused while the kernel may still read it.
    fn drain(&mut self);
    fn set_fault(&mut self, fault: Option<Fault>);
    /// Requests (writes and datasyncs) in flight.
    fn pending(&self) -> usize;
    /// Wait for every request in flight, reporting the first error.
    fn drain_checked(&mut self, free: &mut Vec<usize>) -> Result<()> {
        while self.pending() > 0 {
            self.reap(free, true)?;
        }
        Ok(())
    }
}

/// io_uring back end, driven from the writer's thread: submission is a
/// memory store plus one syscall, and the kernel does the I/O asynchronously,
/// so a separate thread would add a hop without adding parallelism.
pub struct UringSink {
    ring: IoUring,
    /// Registered arena (WriteFixed) or plain writes.
    fixed: Option<(usize, usize)>,
    jobs: Vec<Option<(RawFd, Job)>>,
    /// Resubmissions of each buffer's request after a transient error
    /// (see [`transient`]), counted from its submission.
    retried: Vec<u8>,
    /// Resubmissions of datasync requests after a transient error.
    sync_retried: u8,
    inflight: usize,
    syncs: usize,
    fault: Option<Fault>,
    /// Set (the errno) when the ring could not be waited on with requests
    /// in flight: they may still use their buffers (see [`UringSink::lost`]).
    lost: Option<i32>,
}

/// The bit of user_data that marks a datasync request (the rest is its
/// file descriptor; write and read requests carry their buffer index).
const SYNC_TAG: u64 = 1 << 63;

fn sync_entry(fd: RawFd) -> io_uring::squeue::Entry {
    opcode::Fsync::new(types::Fd(fd))
        .flags(types::FsyncFlags::DATASYNC)
        .build()
        .user_data(SYNC_TAG | u64::from(fd.unsigned_abs()))
}

/// How often one request is resubmitted after a transient error.
const TRANSIENT_RETRIES: u8 = 16;

/// Errors a request can end with that say nothing about the file: the
/// kernel cancels a request (ECANCELED) whose io-wq worker could not be
/// made while a signal was pending for the submitting thread (a handled
/// SIGUSR1, a DataLoader's SIGCHLD, a profiler's timer), or one ends with
/// EINTR or EAGAIN. The engine cancels nothing itself: such a request is
/// submitted again, as the pool's pwrite retries EINTR.
fn transient(errno: i32) -> bool {
    matches!(errno, libc::ECANCELED | libc::EINTR | libc::EAGAIN)
}

impl UringSink {
    /// A ring with `entries` submission slots. Fails with EPERM/ENOSYS when
    /// io_uring is disabled or filtered, ENOMEM when locked memory is short.
    pub fn new(entries: u32) -> std::io::Result<Self> {
        let ring = IoUring::new(entries.max(1).next_power_of_two())?;
        Ok(UringSink {
            ring,
            fixed: None,
            jobs: Vec::new(),
            retried: Vec::new(),
            sync_retried: 0,
            inflight: 0,
            syncs: 0,
            fault: None,
            lost: None,
        })
    }

    /// Register the arena as one fixed buffer so writes skip the per-I/O
    /// page pinning. Returns the error when the kernel refuses (ENOMEM from
    /// RLIMIT_MEMLOCK, EPERM); plain writes are used then.
    pub fn register(&mut self, arena: &Arena) -> std::io::Result<()> {
        let iov = libc::iovec {
            iov_base: arena.as_ptr().cast(),
            iov_len: arena.len(),
        };
        // SAFETY: the iovec describes the arena's live mapping. The engine
        // owns both the ring and the arena and drops the ring first (field
        // order in `Engine`), so the registration never outlives the memory.
        unsafe { self.ring.submitter().register_buffers(&[iov])? };
        self.fixed = Some((arena.as_ptr() as usize, arena.len()));
        Ok(())
    }

    pub fn registered(&self) -> bool {
        self.fixed.is_some()
    }

    fn push(&mut self, fd: RawFd, job: Job) -> Result<()> {
        let within_fixed = self.fixed.is_some_and(|(base, len)| {
            let p = job.ptr as usize;
            p >= base && p + job.len <= base + len
        });
        let len = u32::try_from(job.len).map_err(|_| Error::option("write larger than 4 GiB"))?;
        let fd_t = types::Fd(fd);
        let entry = match (job.read, within_fixed) {
            (false, true) => opcode::WriteFixed::new(fd_t, job.ptr, len, 0)
                .offset(job.offset)
                .build(),
            (false, false) => opcode::Write::new(fd_t, job.ptr, len)
                .offset(job.offset)
                .build(),
            (true, true) => opcode::ReadFixed::new(fd_t, job.ptr.cast_mut(), len, 0)
                .offset(job.offset)
                .build(),
            (true, false) => opcode::Read::new(fd_t, job.ptr.cast_mut(), len)
                .offset(job.offset)
                .build(),
        }
        .user_data(job.buf as u64);
        if self.jobs.len() <= job.buf {
            self.jobs.resize(job.buf + 1, None);
        }
        self.jobs[job.buf] = Some((fd, job));
        self.push_entry(&entry)
    }

    fn push_entry(&mut self, entry: &io_uring::squeue::Entry) -> Result<()> {
        loop {
            // SAFETY: the entry points at `job.len` bytes of the arena (or of
            // memory the caller keeps alive), which stay untouched until its
            // completion is reaped; `fd` stays open until the sink is drained.
            let pushed = unsafe { self.ring.submission().push(entry) };
            if pushed.is_ok() {
                break;
            }
            // Submission queue full: hand the queued entries to the kernel.
            self.ring
                .submit()
                .map_err(|e| Error::from_io(&e, "io_uring submit", None))?;
        }
        self.ring
            .submit()
            .map_err(|e| Error::from_io(&e, "io_uring submit", None))?;
        Ok(())
    }

    /// The errno with which the ring could not be waited on while requests
    /// were in flight, if that happened: its requests may still use their
    /// buffers, and the engine must not use them again.
    pub fn lost(&self) -> Option<i32> {
        self.lost
    }

    fn wait_one(&mut self) -> Result<()> {
        if let Some(f) = self.fault.filter(|f| f.offset == Fault::WAIT) {
            return Err(Error::os(f.errno, "io_uring wait (injected)", None));
        }
        loop {
            match self.ring.submit_and_wait(1) {
                Ok(_) => return Ok(()),
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
                    ) => {}
                Err(e) => return Err(Error::from_io(&e, "io_uring wait", None)),
            }
        }
    }
}

impl Sink for UringSink {
    unsafe fn submit(&mut self, fd: RawFd, job: Job) -> Result<()> {
        if self.retried.len() <= job.buf {
            self.retried.resize(job.buf + 1, 0);
        }
        self.retried[job.buf] = 0;
        self.push(fd, job)?;
        self.inflight += 1;
        Ok(())
    }

    fn submit_datasync(&mut self, fd: RawFd) -> Result<()> {
        self.sync_retried = 0;
        self.push_entry(&sync_entry(fd))?;
        self.syncs += 1;
        Ok(())
    }

    fn reap(&mut self, free: &mut Vec<usize>, wait: bool) -> Result<()> {
        if wait && self.inflight + self.syncs > 0 {
            self.wait_one()?;
        }
        let done: Vec<(u64, i32)> = self
            .ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        let mut first_err = None;
        for (ud, res) in done {
            if ud & SYNC_TAG != 0 {
                if res < 0 && transient(-res) && self.sync_retried < TRANSIENT_RETRIES {
                    self.sync_retried += 1;
                    let fd = RawFd::try_from(ud & !SYNC_TAG).unwrap_or(-1);
                    if let Err(e) = self.push_entry(&sync_entry(fd)) {
                        self.syncs -= 1;
                        first_err.get_or_insert(e);
                    }
                    continue;
                }
                self.syncs -= 1;
                if res < 0 {
                    first_err.get_or_insert(Error::os(-res, "fdatasync during the write", None));
                }
                continue;
            }
            let buf = ud as usize;
            let Some((fd, job)) = self.jobs.get_mut(buf).and_then(Option::take) else {
                continue;
            };
            let tries = self.retried.get(buf).copied().unwrap_or(0);
            let res = match (
                Fault::hits(self.fault, &job),
                Fault::short(self.fault, &job),
            ) {
                // An injected transient error hits a request's first try only.
                (Some(errno), _) if !(transient(errno) && tries > 0) => -errno,
                (None, Some(k)) if res > 0 => res.min(i32::try_from(k).unwrap_or(i32::MAX)),
                _ => res,
            };
            // A negative result is -errno; a non-negative one a byte count.
            let done = usize::try_from(res).map_err(|_| -res);
            if done.is_err_and(transient) && tries < TRANSIENT_RETRIES {
                self.retried[buf] = tries + 1;
                if let Err(e) = self.push(fd, job) {
                    self.inflight -= 1;
                    first_err.get_or_insert(e);
                }
                continue;
            }
            if let (true, Ok(n)) = (job.read, done.map(|n| n.min(job.len))) {
                if n == 0 || n == job.len || reaches_end(fd, job.offset + n as u64) {
                    // Nothing more (end of file: the tail reads as zeros;
                    // the reader checks that the file did not shrink past
                    // its requests), or all of it.
                    zero_tail(&job, n);
                    self.inflight -= 1;
                    free.push(buf);
                } else if let Err(e) = self.push(fd, job.rest(n)) {
                    // Short before the end of file (a network or FUSE file
                    // system): read the rest, as the pool's pread does.
                    self.inflight -= 1;
                    first_err.get_or_insert(e);
                }
            } else if done.is_err() || (done == Ok(0) && job.len > 0) {
                self.inflight -= 1;
                first_err.get_or_insert(write_error(done.err().unwrap_or(libc::EIO), &job));
            } else if let Some(n) = done.ok().filter(|&n| n < job.len) {
                // Short write: resubmit the rest.
                let rest = job.rest(n);
                if let Err(e) = self.push(fd, rest) {
                    self.inflight -= 1;
                    first_err.get_or_insert(e);
                }
            } else {
                self.inflight -= 1;
                free.push(buf);
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn inflight(&self) -> usize {
        self.inflight
    }

    fn drain(&mut self) {
        while self.inflight + self.syncs > 0 {
            if let Err(e) = self.wait_one() {
                // Cannot wait on the ring: its requests may still use their
                // buffers. Nothing safe is left but to stop using the
                // ring and the arena: the engine retires (`lost`); its
                // ring is closed (which cancels the requests) before the
                // arena is unmapped, and the pages the kernel pinned stay
                // until it lets them go.
                self.lost = Some(e.errno.unwrap_or(libc::EIO));
                self.inflight = 0;
                self.syncs = 0;
                break;
            }
            let done: Vec<u64> = self.ring.completion().map(|c| c.user_data()).collect();
            for ud in done {
                if ud & SYNC_TAG != 0 {
                    self.syncs -= 1;
                } else if let Some(slot) = self.jobs.get_mut(ud as usize) {
                    if slot.take().is_some() {
                        self.inflight -= 1;
                    }
                }
            }
        }
        self.jobs.iter_mut().for_each(|j| *j = None);
    }

    fn set_fault(&mut self, fault: Option<Fault>) {
        self.fault = fault;
    }

    fn pending(&self) -> usize {
        self.inflight + self.syncs
    }
}

type Done = (usize, std::result::Result<(), Error>);

/// Positional-write thread pool: the fallback when io_uring is unavailable
/// (disabled by `kernel.io_uring_disabled`, filtered by seccomp, too old).
pub struct PoolSink {
    jobs: Option<Sender<(RawFd, Job, Option<Fault>)>>,
    done: Receiver<Done>,
    workers: Vec<JoinHandle<()>>,
    inflight: usize,
    syncs: usize,
    fault: Option<Fault>,
}

impl PoolSink {
    /// A pool of `threads` writer threads (fewer when the system will not
    /// start them all: EAGAIN, a process or memory limit; an error when it
    /// starts none).
    pub fn new(threads: usize) -> Result<Self> {
        let (jtx, jrx) = channel::<(RawFd, Job, Option<Fault>)>();
        let (dtx, drx) = channel::<Done>();
        let jrx = Arc::new(Mutex::new(jrx));
        let mut refused = None;
        let workers: Vec<_> = (0..threads.max(1))
            .map_while(|i| {
                let jrx = Arc::clone(&jrx);
                let dtx = dtx.clone();
                std::thread::Builder::new()
                    .name(format!("fastpersist-pwrite-{i}"))
                    .spawn(move || loop {
                        let next = jrx.lock().map(|rx| rx.recv());
                        let Ok(Ok((fd, job, fault))) = next else {
                            return;
                        };
                        let res = if job.buf == SYNC_BUF {
                            datasync(fd)
                        } else {
                            match (Fault::hits(fault, &job), Fault::short(fault, &job)) {
                                (Some(errno), _) => Err(write_error(errno, &job)),
                                (None, Some(k)) => {
                                    // Stopped short at `k`: the loops go on
                                    // from there.
                                    let (head, rest) = (Job { len: k, ..job }, job.rest(k));
                                    if job.read {
                                        pread_all(fd, &head, fault)
                                            .and_then(|()| pread_all(fd, &rest, fault))
                                    } else {
                                        pwrite_all(fd, &head).and_then(|()| pwrite_all(fd, &rest))
                                    }
                                }
                                (None, None) if job.read => pread_all(fd, &job, fault),
                                (None, None) => pwrite_all(fd, &job),
                            }
                        };
                        if dtx.send((job.buf, res)).is_err() {
                            return;
                        }
                    })
                    .map_err(|e| refused = Some(e))
                    .ok()
            })
            .collect();
        if workers.is_empty() {
            let e = refused.unwrap_or_else(|| std::io::Error::from_raw_os_error(libc::EAGAIN));
            return Err(Error::from_io(&e, "cannot start a writer thread", None));
        }
        Ok(PoolSink {
            jobs: Some(jtx),
            done: drx,
            workers,
            inflight: 0,
            syncs: 0,
            fault: None,
        })
    }

    fn take(&mut self, d: Done, free: &mut Vec<usize>, err: &mut Option<Error>) {
        if d.0 == SYNC_BUF {
            self.syncs -= 1;
        } else {
            self.inflight -= 1;
        }
        match d.1 {
            Ok(()) if d.0 != SYNC_BUF => free.push(d.0),
            Ok(()) => {}
            Err(e) => {
                err.get_or_insert(e);
            }
        }
    }
}

/// Buffer index of a pool job that is an fdatasync, not a write.
const SYNC_BUF: usize = usize::MAX;

fn datasync(fd: RawFd) -> std::result::Result<(), Error> {
    // SAFETY: fdatasync on an fd the writer keeps open until the pool drains.
    if unsafe { libc::fdatasync(fd) } != 0 {
        return Err(Error::last_os("fdatasync during the write", None));
    }
    Ok(())
}

/// The file offset `done` bytes into `job`, as the kernel takes it.
fn job_offset(job: &Job, done: usize) -> std::result::Result<libc::off_t, Error> {
    (done as u64)
        .checked_add(job.offset)
        .and_then(|o| libc::off_t::try_from(o).ok())
        .ok_or_else(|| write_error(libc::EFBIG, job))
}

/// Whether byte `end` of `fd` is at or past its end: a read that came
/// back short there is done, not made again from `end` (a direct read
/// from there would be unaligned, which some file systems refuse with
/// EINVAL before they look at the file's length). False when `fd` cannot
/// be stat'ed: the rest is read, as from a network file system's short
/// read.
fn reaches_end(fd: RawFd, end: u64) -> bool {
    // SAFETY: `stat` is plain integers, for which all-zero bytes are valid.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes only into the struct we pass; `fd` is the read's.
    let ok = unsafe { libc::fstat(fd, &raw mut st) } == 0;
    ok && u64::try_from(st.st_size).is_ok_and(|len| len <= end)
}

/// The byte count of a positional read or write, or its errno (EINTR: retry).
fn io_result(n: isize) -> std::result::Result<usize, i32> {
    usize::try_from(n).map_err(|_| {
        std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO)
    })
}

fn pwrite_all(fd: RawFd, job: &Job) -> std::result::Result<(), Error> {
    let mut done = 0usize;
    while done < job.len {
        let offset = job_offset(job, done)?;
        // SAFETY: `job.ptr + done .. job.ptr + job.len` is inside the buffer
        // the writer keeps untouched until this job is reported done.
        let n = unsafe { libc::pwrite(fd, job.ptr.add(done).cast(), job.len - done, offset) };
        match io_result(n) {
            Err(libc::EINTR) => {}
            Err(errno) => return Err(write_error(errno, job)),
            Ok(0) => return Err(write_error(libc::EIO, job)),
            Ok(n) => done += n,
        }
    }
    Ok(())
}

/// Read all of `job`, or up to the end of the file (the rest of its
/// buffer is zeroed); `fault`: as [`Fault::hits`] for each read made.
fn pread_all(fd: RawFd, job: &Job, fault: Option<Fault>) -> std::result::Result<(), Error> {
    let mut done = 0usize;
    while done < job.len {
        if done > 0 && reaches_end(fd, job.offset + done as u64) {
            break;
        }
        let offset = job_offset(job, done)?;
        if let Some(errno) = Fault::hits(fault, &job.rest(done)).filter(|_| done > 0) {
            return Err(write_error(errno, job));
        }
        // SAFETY: `job.ptr + done .. job.ptr + job.len` is inside the buffer
        // given to this read, which nobody touches until it is reported done.
        let n = unsafe {
            libc::pread(
                fd,
                job.ptr.cast_mut().add(done).cast(),
                job.len - done,
                offset,
            )
        };
        match io_result(n) {
            Err(libc::EINTR) => {}
            Err(errno) => return Err(write_error(errno, job)),
            Ok(0) => break,
            Ok(n) => done += n,
        }
    }
    zero_tail(job, done);
    Ok(())
}

impl Sink for PoolSink {
    unsafe fn submit(&mut self, fd: RawFd, job: Job) -> Result<()> {
        let tx = self.jobs.as_ref().expect("pool is running");
        tx.send((fd, job, self.fault))
            .map_err(|_| Error::os(libc::EIO, "writer thread pool has stopped", None))?;
        self.inflight += 1;
        Ok(())
    }

    fn submit_datasync(&mut self, fd: RawFd) -> Result<()> {
        let job = Job {
            buf: SYNC_BUF,
            ptr: std::ptr::null(),
            len: 0,
            offset: 0,
            read: false,
        };
        let tx = self.jobs.as_ref().expect("pool is running");
        tx.send((fd, job, None))
            .map_err(|_| Error::os(libc::EIO, "writer thread pool has stopped", None))?;
        self.syncs += 1;
        Ok(())
    }

    fn reap(&mut self, free: &mut Vec<usize>, wait: bool) -> Result<()> {
        let mut err = None;
        if wait && self.inflight + self.syncs > 0 {
            match self.done.recv() {
                Ok(d) => self.take(d, free, &mut err),
                Err(_) => return Err(Error::os(libc::EIO, "writer thread pool has stopped", None)),
            }
        }
        while let Ok(d) = self.done.try_recv() {
            self.take(d, free, &mut err);
        }
        match err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn inflight(&self) -> usize {
        self.inflight
    }

    fn drain(&mut self) {
        while self.inflight + self.syncs > 0 {
            match self.done.recv() {
                Ok((SYNC_BUF, _)) => self.syncs -= 1,
                Ok(_) => self.inflight -= 1,
                Err(_) => break,
            }
        }
    }

    fn set_fault(&mut self, fault: Option<Fault>) {
        self.fault = fault;
    }

    fn pending(&self) -> usize {
        self.inflight + self.syncs
    }
}

impl Drop for PoolSink {
    fn drop(&mut self) {
        self.drain();
        self.jobs = None;
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

impl Drop for UringSink {
    fn drop(&mut self) {
        self.drain();
    }
}
