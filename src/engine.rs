//! The engine: the resources every save and read shares, and who owns them.
//!
//! An [`Engine`] holds the staging [`Arena`], the I/O back end (an io_uring
//! ring, else a pool of `pwrite`/`pread` threads made on first use) and the
//! list of arena buffers that are not in flight. Between the calls of one
//! streamed save its writes stay in flight (the device never idles while
//! the caller produces the next part); the engine remembers which session
//! they belong to, and anything else that needs the arena first waits for
//! them (`Engine::settle`), keeping a failure among them for the session
//! that made them.
//!
//! Sessions (`begin`/`write`/`finish`, `write_part`) live in
//! [`crate::writer`], reads in [`crate::reader`]; both reach the arena and
//! the sink only through `Engine::with_buffers`, the one place that takes
//! the free-buffer list, runs the I/O, and on failure drains the sink and
//! gives every buffer back.

use crate::arena::Arena;
use crate::error::{Error, Result};
use crate::held::Held;
use crate::lend::Lending;
use crate::sink::{Fault, PoolSink, Sink, UringSink};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;

/// Tuning knobs. The defaults were chosen by measurement (see the README).
#[derive(Debug, Clone)]
pub struct Options {
    /// Bytes per write (one arena buffer); a multiple of the page size.
    pub block_size: usize,
    /// Total staging memory; `arena_bytes / block_size` buffers.
    pub arena_bytes: usize,
    /// Writes in flight at most.
    pub queue_depth: usize,
    /// Try O_DIRECT (falls back to buffered writes when refused).
    pub direct: bool,
    /// Try io_uring (falls back to a pwrite thread pool when unavailable).
    pub io_uring: bool,
    /// Register the arena with io_uring (WriteFixed).
    pub register_buffers: bool,
    /// mlock the arena.
    pub lock_memory: bool,
    /// Threads of the pwrite fallback pool.
    pub pool_threads: usize,
    /// Threads that gather (copy into the arena and checksum) each write;
    /// 1 gathers on the calling thread. Default: the cores this process
    /// may use, at most 8 ([`crate::gather::default_gather_threads`]).
    pub gather_threads: usize,
    /// Start an fdatasync after every this many bytes (0: only at the end),
    /// so the device flushes its cache while the save goes on and the final
    /// fsync has little left to do.
    pub flush_every: u64,
    /// fsync the file and the directory (off only for benchmarks of the
    /// non-durable case; a checkpoint should always be durable).
    pub durable: bool,
    /// Write extents that lie wholly in caller memory straight from there
    /// when the file takes writes from that address (see [`crate::lend`]).
    pub zero_copy: bool,
    /// Test hook: the write covering this offset fails with this errno.
    pub fault: Option<Fault>,
    /// Test hook: behave as if the file system refused O_DIRECT writes.
    pub refuse_direct: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            block_size: 4 << 20,
            arena_bytes: 128 << 20,
            queue_depth: 16,
            direct: true,
            io_uring: true,
            register_buffers: true,
            lock_memory: true,
            pool_threads: 4,
            gather_threads: crate::gather::default_gather_threads(),
            flush_every: 256 << 20,
            durable: true,
            zero_copy: true,
            fault: None,
            refuse_direct: false,
        }
    }
}

impl Options {
    pub(crate) fn validate(&self) -> Result<()> {
        let page = crate::arena::page_size();
        if self.block_size == 0 || self.block_size % page != 0 {
            return Err(Error::option(format!(
                "block_size {} must be a positive multiple of {page}",
                self.block_size
            )));
        }
        if self.block_size > (1 << 30) {
            return Err(Error::option("block_size must be at most 1 GiB"));
        }
        if self.arena_bytes < self.block_size {
            return Err(Error::option(format!(
                "arena_bytes {} must hold at least one block of {}",
                self.arena_bytes, self.block_size
            )));
        }
        if let Some(mem) = crate::arena::physical_memory() {
            if self.arena_bytes as u64 > mem {
                return Err(Error::option(format!(
                    "arena_bytes {} is more than this machine's memory ({mem} bytes)",
                    self.arena_bytes
                )));
            }
        }
        if self.queue_depth == 0 || self.queue_depth > 4096 {
            return Err(Error::option(format!(
                "queue_depth must be in 1..=4096, got {}",
                self.queue_depth
            )));
        }
        check_gather_threads(self.gather_threads)?;
        if self.pool_threads > MAX_POOL_THREADS {
            return Err(Error::option(format!(
                "pool_threads must be at most {MAX_POOL_THREADS}, got {}",
                self.pool_threads
            )));
        }
        Ok(())
    }
}

/// More fallback threads than any machine has use for.
const MAX_POOL_THREADS: usize = 1024;
/// More gather threads than any machine has use for.
const MAX_GATHER_THREADS: usize = 256;

/// A gather-thread count an engine takes: at least 1, at most
/// [`MAX_GATHER_THREADS`] (for `Options` and `Engine::set_gather_threads`).
fn check_gather_threads(threads: usize) -> Result<()> {
    if threads == 0 || threads > MAX_GATHER_THREADS {
        return Err(Error::option(format!(
            "gather_threads must be in 1..={MAX_GATHER_THREADS}, got {threads}"
        )));
    }
    Ok(())
}

/// A reusable writer and reader: the arena, the ring and the fallback pool
/// live across saves, so a save allocates nothing proportional to the
/// checkpoint.
pub struct Engine {
    // Field order matters: the ring (holding the arena's registration) and
    // the pool (whose threads may hold jobs) are dropped before the arena.
    pub(crate) uring: Option<UringSink>,
    pub(crate) pool: Option<PoolSink>,
    pub(crate) arena: Arena,
    pub(crate) opts: Options,
    pub(crate) uring_note: Option<String>,
    /// Arena buffers not in flight. Between the `write` calls of one
    /// streamed file, writes stay in flight; every other use of the arena
    /// first waits for them ([`Engine::settle`]). When no session streams,
    /// this holds every buffer.
    pub(crate) free: Vec<usize>,
    /// Buffers the callers hold ([`crate::held`]): in neither `free` nor
    /// flight.
    pub(crate) held: Held,
    /// The session whose writes are in flight, if any.
    pub(crate) streaming: Option<u64>,
    /// Failures of writes drained on behalf of another session, reported
    /// to their own session at its next call (a few kept, newest last).
    lost: Vec<(u64, Error)>,
    /// Test hook: the directory fsync of every commit fails with this errno.
    pub(crate) dir_fsync_fault: Option<i32>,
    /// Test hook: sessions use at least this O_DIRECT block (as a file
    /// system with a larger alignment would ask for).
    pub(crate) min_block: Option<usize>,
    /// The mode of the files begun (see [`Engine::set_file_mode`]).
    pub(crate) file_mode: Option<u32>,
    /// The process that made the engine. After `fork()` a child has a copy
    /// of it whose ring is shared with this process (same submission and
    /// completion queues), whose pool threads do not exist and whose
    /// writes in flight are this process's: the child never uses it, and
    /// dropping it there leaves the ring and the pool alone.
    pid: u32,
    /// Not 0 (the errno) once the ring could not be waited on while
    /// requests were in flight: the kernel may still read or write the
    /// arena's buffers, so the engine is used no more (shared with the
    /// binding, which reads it without the engine's lock).
    retired: Arc<AtomicI32>,
}

impl Drop for Engine {
    fn drop(&mut self) {
        if std::process::id() != self.pid {
            // A fork child's copy: the ring is the parent's (draining it here
            // would take the parent's completions) and the pool's threads
            // exist only there (joining them would wait forever). Leak both;
            // the arena is this process's own copy and is unmapped as usual.
            std::mem::forget(self.uring.take());
            std::mem::forget(self.pool.take());
        }
    }
}

/// How many failures of other sessions' writes are kept for them.
const LOST_KEPT: usize = 8;

impl Engine {
    pub fn new(opts: Options) -> Result<Self> {
        opts.validate()?;
        let nbufs = opts.arena_bytes / opts.block_size;
        let arena = Arena::new(opts.block_size, nbufs, opts.lock_memory)?;
        let mut uring_note = None;
        let uring = if opts.io_uring {
            match UringSink::new(opts.queue_depth.min(nbufs) as u32) {
                Ok(mut u) => {
                    if opts.register_buffers {
                        // Unregistered writes still work: only the per-I/O
                        // page pinning is saved by registering.
                        let _ = u.register(&arena);
                    }
                    Some(u)
                }
                Err(e) => {
                    uring_note = Some(format!("io_uring is unavailable ({e})"));
                    None
                }
            }
        } else {
            uring_note = Some("io_uring was turned off by the caller".into());
            None
        };
        let free = (0..arena.nbufs()).rev().collect();
        Ok(Engine {
            uring,
            pool: None,
            arena,
            opts,
            uring_note,
            free,
            held: Held::default(),
            streaming: None,
            lost: Vec::new(),
            dir_fsync_fault: None,
            min_block: None,
            file_mode: None,
            pid: std::process::id(),
            retired: Arc::new(AtomicI32::new(0)),
        })
    }

    /// An error when this is a `fork()` child of the process that made the
    /// engine (see [`Engine::owner_pid`]).
    pub fn check_process(&self) -> Result<()> {
        if std::process::id() != self.pid {
            return Err(Error::forked("this engine", self.pid, None));
        }
        match self.retired.load(Ordering::SeqCst) {
            0 => Ok(()),
            errno => Err(Error::internal(format!(
                "this engine's io_uring ring could not be waited on ({}) with requests in flight, \
                 which may still use its buffers: it is retired (a new engine is made for the next call)",
                std::io::Error::from_raw_os_error(errno)
            ))),
        }
    }

    /// The engine's retirement (see [`Engine::check_process`]), readable
    /// without the engine: not 0 once retired.
    pub fn retired(&self) -> Arc<AtomicI32> {
        Arc::clone(&self.retired)
    }

    /// The process that made the engine: only it may use it.
    pub fn owner_pid(&self) -> u32 {
        self.pid
    }

    pub fn options(&self) -> &Options {
        &self.opts
    }

    pub fn arena(&self) -> &Arena {
        &self.arena
    }

    pub fn uses_io_uring(&self) -> bool {
        self.uring.is_some()
    }

    /// Test hook: the directory fsync after every commit's rename fails
    /// with `errno` (the commit then reports `ErrorKind::NotDurable`).
    #[doc(hidden)]
    pub fn set_dir_fsync_fault(&mut self, errno: Option<i32>) {
        self.dir_fsync_fault = errno;
    }

    /// Gather (and scatter) on `threads` threads from the next call on:
    /// the one option an engine's resources do not depend on, so saves
    /// that want fewer threads (those that overlap training) share the
    /// engine, and its arena, with those that want more.
    ///
    /// # Errors
    /// When `threads` is 0 or more than the engine takes.
    pub fn set_gather_threads(&mut self, threads: usize) -> Result<()> {
        check_gather_threads(threads)?;
        self.opts.gather_threads = threads;
        Ok(())
    }

    /// Files begun from now on are made with exactly these mode bits and
    /// the writer's owner, whatever the target was (as a writer that makes
    /// a new file and renames it onto the path leaves it); `None`, the
    /// default: a replaced file's owner, group and mode are kept, a new
    /// file gets `0o666` less the umask.
    ///
    /// # Errors
    /// When `mode` has bits outside `0o7777`.
    pub fn set_file_mode(&mut self, mode: Option<u32>) -> Result<()> {
        if let Some(m) = mode {
            if m & !0o7777 != 0 {
                return Err(Error::option(format!(
                    "file mode {m:#o} has bits outside 0o7777"
                )));
            }
        }
        self.file_mode = mode;
        Ok(())
    }

    /// Test hook: sessions begun from now on write with O_DIRECT blocks of
    /// at least `block` bytes (a power of two, at most `block_size`), as on
    /// a file system whose `STATX_DIOALIGN` asks for that much.
    #[doc(hidden)]
    pub fn set_min_block(&mut self, block: Option<usize>) -> Result<()> {
        if let Some(b) = block {
            if !b.is_power_of_two() || b > self.opts.block_size {
                return Err(Error::option(format!(
                    "min_block {b} must be a power of two of at most block_size {}",
                    self.opts.block_size
                )));
            }
        }
        self.min_block = block;
        Ok(())
    }

    /// Whether the arena is registered with io_uring.
    pub(crate) fn registered(&self) -> bool {
        self.uring.as_ref().is_some_and(UringSink::registered)
    }

    /// Test hooks: fail the write covering an offset; act as if O_DIRECT
    /// were refused by the file system.
    pub fn set_fault(&mut self, fault: Option<Fault>, refuse_direct: bool) {
        self.opts.fault = fault;
        self.opts.refuse_direct = refuse_direct;
    }

    /// Writes in flight and not `owner`'s are waited for, so the arena is
    /// free for someone else. A failure among them is kept for its session.
    pub(crate) fn settle(&mut self, owner: Option<u64>) {
        let Some(id) = self.streaming else {
            return;
        };
        if Some(id) == owner {
            return;
        }
        if let Err(e) = self.drain_in_flight() {
            if self.lost.len() >= LOST_KEPT {
                self.lost.remove(0);
            }
            self.lost.push((id, e));
        }
    }

    /// The failure of one of `session`'s writes that another user of the
    /// arena drained, if any (taken: it is reported once).
    pub(crate) fn take_lost(&mut self, session: u64) -> Option<Error> {
        let i = self.lost.iter().position(|(id, _)| *id == session)?;
        Some(self.lost.remove(i).1)
    }

    /// Forget whatever was kept for `session` (it was aborted).
    pub(crate) fn forget(&mut self, session: u64) {
        self.lost.retain(|(id, _)| *id != session);
    }

    /// Wait for every write in flight; afterwards the whole arena is free
    /// (also when one of them failed: its error is returned) and no
    /// session streams.
    pub(crate) fn drain_in_flight(&mut self) -> Result<()> {
        let res = self.with_buffers(|sink, _, free| sink.drain_checked(free));
        self.streaming = None;
        res
    }

    /// Run `io` with the I/O back end, the arena and the list of free
    /// buffers, which `io` takes buffers from and gives them back to as
    /// their I/O completes. When `io` fails, every request in flight is
    /// waited for (the kernel is done with every buffer), the whole arena
    /// but the buffers callers hold is free again and no session streams. This is the only way to the sink
    /// and the arena's buffers.
    pub(crate) fn with_buffers<T>(
        &mut self,
        io: impl FnOnce(&mut dyn Sink, &mut Arena, &mut Vec<usize>) -> Result<T>,
    ) -> Result<T> {
        self.with_lending(None, |sink, arena, free| io(sink, arena, free))
    }

    /// [`Engine::with_buffers`] for a pump that may write straight from
    /// caller memory at `align` (see [`crate::lend`]). No lent write
    /// outlives the call, so its ids are the call's own: enough for the
    /// writes in flight (at most `queue_depth`) plus those handed to gather
    /// threads (at most two per thread).
    pub(crate) fn with_lending<T>(
        &mut self,
        align: Option<usize>,
        io: impl FnOnce(&mut Lending<'_>, &mut Arena, &mut Vec<usize>) -> Result<T>,
    ) -> Result<T> {
        self.check_process()?;
        if self.uring.is_none() && self.pool.is_none() {
            self.pool = Some(PoolSink::new(self.opts.pool_threads)?);
        }
        crate::vanish::install(); // (caller memory read meanwhile may vanish)
        let mut free = std::mem::take(&mut self.free);
        self.held.reclaim(&mut free);
        let ids = self.opts.queue_depth + 2 * self.opts.gather_threads + 1;
        let (sink, arena) = self.parts();
        let mut lending = Lending::new(sink, arena.nbufs(), ids, align);
        let res = io(&mut lending, arena, &mut free);
        if res.is_err() {
            lending.drain();
            free = (0..arena.nbufs()).rev().collect();
        }
        debug_assert!(
            lending.lent_in_flight() == 0 && free.len() <= arena.nbufs(),
            "a lent write outlived its call, or an I/O id came back twice"
        );
        if let Some(errno) = self.uring.as_ref().and_then(UringSink::lost) {
            self.retired.store(errno, Ordering::SeqCst);
        }
        if res.is_err() {
            free.retain(|&b| !self.held.holds(b));
            self.streaming = None;
        }
        self.free = free;
        res
    }

    /// The I/O back end (io_uring, else the pwrite pool, made on first use
    /// by [`Engine::with_lending`]) with its fault hook set, and the arena.
    fn parts(&mut self) -> (&mut dyn Sink, &mut Arena) {
        let fault = self.opts.fault;
        let sink: &mut dyn Sink = match (self.uring.as_mut(), self.pool.as_mut()) {
            (Some(u), _) => u,
            (None, Some(p)) => p,
            (None, None) => unreachable!("with_lending makes the pool first"),
        };
        sink.set_fault(fault);
        (sink, &mut self.arena)
    }
}
