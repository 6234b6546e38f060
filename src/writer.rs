//! Write sessions: one save, from a [`Layout`] to a durable, committed file,
//! on an [`Engine`]'s arena and I/O back end.
//!
//! ```text
//!  caller memory ──gather+crc32──► arena buffer k ──WriteFixed/O_DIRECT──► temp file
//!  (segments)      (this thread)   (aligned, locked)  (io_uring, async)       │
//!                        ▲                                  │                 ▼
//!                        └────── buffer k back when its ────┘   ftruncate, fsync, rename,
//!                                completion is reaped                fsync(dir)
//! ```
//!
//! The writer thread fills buffer k+1 while the device writes buffer k (and
//! up to `queue_depth` more): the copy and the checksum overlap the I/O.

use crate::align::{self, DioAlign};
use crate::arena::Arena;
use crate::commit::TempFile;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::guard;
use crate::held::SessionEnd;
use crate::layout::{Extent, Layout, Segment, Source};
use crate::lend::Lending;
use crate::sink::{Job, Sink};
use crc32fast::Hasher;
use std::collections::BTreeSet;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Instant;

/// What one save did.
#[derive(Debug, Clone, Default)]
pub struct WriteStats {
    /// True length of the file.
    pub bytes: u64,
    pub seconds: f64,
    pub direct: bool,
    pub io_uring: bool,
    pub registered: bool,
    pub locked: bool,
    /// O_DIRECT block size used.
    pub block: usize,
    /// Why O_DIRECT was not used, when it was asked for.
    pub direct_note: Option<String>,
    /// Why io_uring was not used, when it was asked for.
    pub uring_note: Option<String>,
    /// CRC32 of each checksum id.
    pub crcs: Vec<u32>,
    /// Time spent creating, reserving and probing the temporary file.
    pub open_seconds: f64,
    /// Time spent gathering and writing the data.
    pub io_seconds: f64,
    /// Time spent truncating, fsyncing, renaming and fsyncing the directory.
    pub commit_seconds: f64,
    /// Bytes written straight from caller memory (see [`crate::lend`]).
    pub zero_copy_bytes: u64,
}

/// One file being written: see [`Engine::begin`].
pub struct Session {
    /// Tells this session's writes in flight from another session's.
    pub(crate) id: u64,
    pub(crate) tmp: TempFile,
    target: std::path::PathBuf,
    pub(crate) block: usize,
    /// Segments not yet wholly written, sorted by offset.
    pub(crate) segments: Vec<Segment>,
    /// End of the last segment given so far.
    pub(crate) frontier: u64,
    /// Bytes `[0, written)` are written (a multiple of the block).
    pub(crate) written: u64,
    pub(crate) hashers: Vec<Hasher>,
    direct_note: Option<String>,
    t0: Instant,
    open_seconds: f64,
    pub(crate) io_seconds: f64,
    /// Bytes written since the last fdatasync was started.
    pub(crate) unflushed: u64,
    /// Memory alignment that writes straight from caller memory need
    /// (None: always gather).
    lend_align: Option<usize>,
    /// Whether the next writes may lend caller memory at all
    /// ([`Session::set_lending`]).
    lending: bool,
    zero_copy_bytes: u64,
    /// Checksum ids of the caller memory written from where it lies.
    lent_ids: BTreeSet<u32>,
    failed: bool,
    /// Gives the buffers the session still holds back to the engine when
    /// it is dropped ([`crate::held`]).
    _end: SessionEnd,
}

static NEXT_SESSION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl Session {
    /// Let the writes that follow lend caller memory to the kernel (the
    /// default, where `zero_copy` is on and the file allows it), or gather
    /// every byte into the arena. A lent write never outlives its call, so
    /// memory handed over one piece per call (a staging slot) writes faster
    /// gathered: the arena's writes stay in flight across calls, from
    /// buffers registered with io_uring.
    pub fn set_lending(&mut self, lending: bool) {
        self.lending = lending;
    }

    /// Reserve the file's first `len` bytes (rounded up to whole blocks),
    /// as [`Engine::begin`] reserved its size hint: a session begun before
    /// the whole file's size was known reserves the rest once it is, before
    /// writing past what it reserved (on extent file systems, O_DIRECT
    /// writes into reserved space go on in parallel; past it, each takes
    /// the file's lock). Bytes reserved already cost nothing again.
    pub fn reserve(&self, len: u64) -> Result<()> {
        let padded = align::align_up(len, self.block as u64).ok_or_else(|| {
            Error::option(format!(
                "cannot reserve {len} bytes: more than any file can hold"
            ))
        })?;
        self.tmp.preallocate(padded)
    }

    fn append(&mut self, mut segments: Vec<Segment>) -> Result<()> {
        segments.retain(|s| !s.source.is_empty());
        segments.sort_by_key(|s| s.offset);
        if let Some(first) = segments.first() {
            if first.offset < self.frontier {
                return Err(Error::layout(format!(
                    "segment at offset {} comes before the end of what was already given ({})",
                    first.offset, self.frontier
                )));
            }
        }
        for s in &segments {
            self.frontier = self.frontier.max(s.checked_end()?);
        }
        self.segments.extend(segments);
        Ok(())
    }

    /// Copy the caller memory that segments not yet written still point
    /// to (what lies past `written`: less than one block after a write)
    /// into segments of owned bytes, checked and read as a gather is.
    fn own_rest(&mut self) -> Result<()> {
        let cut = self.written;
        let mem = |s: &Segment| matches!(s.source, Source::Mem(_)) && s.end() > cut;
        if !self.segments.iter().any(mem) {
            return Ok(());
        }
        guard::before_gather(|| {
            self.segments
                .iter()
                .filter(|s| mem(s))
                .filter_map(|s| s.crc_id)
                .collect::<Vec<_>>()
                .into_iter()
        })?;
        for s in &mut self.segments {
            if let Source::Mem(m) = &s.source {
                if s.end() <= cut {
                    continue;
                }
                // Bytes before `cut` were written (and checksummed) already.
                let skip = cut.saturating_sub(s.offset) as usize;
                let src = m.slice(skip, m.len() - skip);
                let (owned, vanished) =
                    crate::vanish::read(src.as_ptr() as usize, src.len(), || src.to_vec());
                if vanished {
                    guard::before_block();
                    return Err(crate::vanish::error());
                }
                s.offset += skip as u64;
                s.source = Source::Bytes(owned);
            }
        }
        guard::before_block();
        Ok(())
    }

    /// An error once the session failed.
    pub(crate) fn check_usable(&self) -> Result<()> {
        if self.failed {
            return Err(Error::option("this write session already failed"));
        }
        Ok(())
    }

    /// Mark the session failed by `e`, naming the file the caller asked
    /// for (the checkpoint's path, as `torch.save` names it), the
    /// temporary file written in its message.
    pub(crate) fn fail(&mut self, mut e: Error) -> Error {
        self.failed = true;
        if e.path.is_none() && e.kind == crate::error::ErrorKind::Os {
            e.context = format!(
                "{}, in the temporary file {}",
                e.context,
                self.tmp.temp_path().display()
            );
            e.path = Some(self.target.clone());
        }
        e
    }

    /// The O_DIRECT block size of this file.
    pub fn block(&self) -> usize {
        self.block
    }

    /// Bytes written so far.
    pub fn written(&self) -> u64 {
        self.written
    }
}

impl Engine {
    /// Write the file described by `segments` (true length `file_len`) to
    /// `path`, durably and atomically.
    pub fn write_file(
        &mut self,
        path: &Path,
        segments: Vec<Segment>,
        file_len: u64,
    ) -> Result<WriteStats> {
        let session = self.begin(path, file_len)?;
        self.finish(session, segments, file_len)
    }

    /// Start writing `path`: create the temporary file, learn its O_DIRECT
    /// alignment, probe O_DIRECT, reserve `size_hint` bytes. The file is
    /// then written in order by [`Engine::write`] calls (which may go on
    /// while the caller still works out the rest of the file) and committed
    /// by [`Engine::finish`]. Dropping the session removes the file.
    pub fn begin(&mut self, path: &Path, size_hint: u64) -> Result<Session> {
        self.check_process()?;
        self.settle(None);
        let t0 = Instant::now();
        let (mut tmp, mut direct_note) =
            TempFile::create_with_mode(path, self.opts.direct, self.file_mode)?;
        let mut dio = if self.opts.direct {
            align::probe_fd(tmp.fd())
        } else {
            DioAlign::fallback()
        };
        dio.block = dio.block.max(self.min_block.unwrap_or(0));
        if dio.block > self.opts.block_size {
            return Err(Error::option(format!(
                "the file system needs {}-byte O_DIRECT blocks, more than block_size {}",
                dio.block, self.opts.block_size
            )));
        }
        if !self.opts.direct {
            direct_note = Some("O_DIRECT was turned off by the caller".into());
        }
        let reserve = align::align_up(size_hint, dio.block as u64).ok_or_else(|| {
            Error::option(format!(
                "size_hint {size_hint} is more than any file can hold"
            ))
        })?;
        tmp.preallocate(reserve)?;
        if tmp.is_direct() {
            if let Some(why) = self.probe_direct(&tmp, dio.block)? {
                tmp.clear_direct()?;
                direct_note = Some(why);
            }
        }
        let zero_copy = self.opts.zero_copy;
        let lend_align = lend_align(zero_copy, tmp.is_direct(), &dio, || {
            self.probe_lend_align(&tmp, dio.block)
        })?;
        let id = NEXT_SESSION.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Session {
            id,
            tmp,
            target: path.to_path_buf(),
            block: dio.block,
            segments: Vec::new(),
            frontier: 0,
            written: 0,
            hashers: Vec::new(),
            direct_note,
            t0,
            open_seconds: t0.elapsed().as_secs_f64(),
            io_seconds: 0.0,
            unflushed: 0,
            lend_align,
            lending: true,
            zero_copy_bytes: 0,
            lent_ids: BTreeSet::new(),
            failed: false,
            _end: self.held.token(id),
        })
    }

    /// Add `segments` (all at or after the end of those given so far) and
    /// write every whole block that is now fully known. Returns once the
    /// caller's memory has been copied into the arena, or, for the bytes
    /// past the last whole block (less than one block), into the session's
    /// own memory: the session keeps no reference to caller memory after
    /// the call, so the caller may reuse it at once (a staging slot, say),
    /// whatever the block size. With io_uring the writes may still be in
    /// flight (their failure is reported by a later call of this session),
    /// so the device stays busy between calls.
    pub fn write(&mut self, session: &mut Session, segments: Vec<Segment>) -> Result<()> {
        self.check_process()?;
        session.append(segments)?;
        let upto = align::align_down(session.frontier, session.block as u64);
        self.run(session, upto, session.frontier, &mut || Ok(()), true)?;
        session.own_rest().inspect_err(|_| session.failed = true)
    }

    /// Bytes between the fdatasyncs a durable save starts while it writes
    /// (0: none, for a save that is not durable).
    pub(crate) fn flush_every(&self) -> u64 {
        if self.opts.durable {
            self.opts.flush_every
        } else {
            0
        }
    }

    /// The session's error from a write another user of the arena
    /// drained, if any: the session fails with it.
    pub(crate) fn reported(&mut self, session: &mut Session) -> Result<()> {
        match self.take_lost(session.id) {
            Some(e) => Err(session.fail(e)),
            None => Ok(()),
        }
    }

    /// Write the blocks before `offset` (a block boundary at or after
    /// everything given; the bytes between are zeros), leaving the writes
    /// in flight as [`Engine::write`] does.
    pub(crate) fn write_upto(&mut self, session: &mut Session, offset: u64) -> Result<()> {
        self.run(session, offset, offset, &mut || Ok(()), true)
    }

    /// Give up on `session`: wait for its writes in flight (their results
    /// no longer matter) and remove its temporary file.
    pub fn abort(&mut self, session: Session) {
        if self.streaming == Some(session.id) {
            self.settle(None);
        }
        self.forget(session.id);
        drop(session);
    }

    /// Add the last `segments`, write the rest of the file (true length
    /// `file_len`), then truncate, fsync, rename and fsync the directory.
    pub fn finish(
        &mut self,
        session: Session,
        segments: Vec<Segment>,
        file_len: u64,
    ) -> Result<WriteStats> {
        self.finish_with(session, segments, file_len, &mut || Ok(()))
    }

    /// [`Engine::finish`], calling `on_gathered` as soon as every byte of
    /// the file has been copied into the arena (caller memory is no longer
    /// read from then on), before waiting for the writes and the commit.
    /// When it fails, the writes are drained, nothing is committed, and its
    /// error is returned.
    pub fn finish_with(
        &mut self,
        mut session: Session,
        segments: Vec<Segment>,
        file_len: u64,
        on_gathered: &mut dyn FnMut() -> Result<()>,
    ) -> Result<WriteStats> {
        self.check_process()?;
        session.append(segments)?;
        if file_len < session.frontier {
            return Err(Error::layout(format!(
                "file length {file_len} is shorter than the last segment's end {}",
                session.frontier
            )));
        }
        let padded = align::align_up(file_len, session.block as u64).ok_or_else(|| {
            Error::layout(format!(
                "file length {file_len} is more than any file can hold"
            ))
        })?;
        session.tmp.preallocate(padded)?;
        self.run(&mut session, padded, file_len, on_gathered, false)?;
        let t_commit = Instant::now();
        let direct = session.tmp.is_direct();
        let Session {
            mut tmp,
            target,
            block,
            hashers,
            direct_note,
            t0,
            open_seconds,
            io_seconds,
            zero_copy_bytes,
            ..
        } = session;
        tmp.set_dir_fsync_fault(self.dir_fsync_fault);
        tmp.commit(Some(file_len), self.opts.durable)
            .map_err(|mut e| {
                e.path.get_or_insert(target);
                e
            })?;
        Ok(WriteStats {
            bytes: file_len,
            seconds: t0.elapsed().as_secs_f64(),
            open_seconds,
            io_seconds,
            commit_seconds: t_commit.elapsed().as_secs_f64(),
            direct,
            io_uring: self.uring.is_some(),
            registered: self.registered(),
            locked: self.arena.locked(),
            block,
            direct_note,
            uring_note: self.uring_note.clone(),
            crcs: hashers.into_iter().map(Hasher::finalize).collect(),
            zero_copy_bytes,
        })
    }

    /// Write the blocks `[session.written, upto)` of a file whose bytes are
    /// known up to `known` (the rest of the last block is zeros). With
    /// `keep_in_flight` (and io_uring), return without waiting for the
    /// writes; otherwise every write of the session is complete on return.
    fn run(
        &mut self,
        session: &mut Session,
        upto: u64,
        known: u64,
        on_gathered: &mut dyn FnMut() -> Result<()>,
        keep_in_flight: bool,
    ) -> Result<()> {
        session.check_usable()?;
        self.settle(Some(session.id));
        self.reported(session)?;
        if upto <= session.written {
            if let Err(e) = on_gathered() {
                session.failed = true;
                if self.streaming == Some(session.id) {
                    // Its writes are in flight: settle them before failing.
                    let _ = self.drain_in_flight();
                }
                return Err(e);
            }
            if keep_in_flight || self.streaming.is_none() {
                return Ok(());
            }
            // Nothing new to write, but this session's writes are in flight.
            return self.drain_in_flight().map_err(|e| session.fail(e));
        }
        let t = Instant::now();
        let layout = Layout::new(std::mem::take(&mut session.segments), known, session.block)?;
        let ids = layout.crc_ids() as usize;
        if session.hashers.len() < ids {
            session.hashers.resize(ids, Hasher::new());
        }
        let flush_every = self.flush_every();
        let qd = self.opts.queue_depth;
        let threads = self.opts.gather_threads;
        // Only io_uring keeps writes in flight past the call: it holds its
        // own reference to the file, while the pwrite pool works on the fd
        // number, which a dropped session would close under it.
        let keep = keep_in_flight && self.uring.is_some();
        let fd = session.tmp.fd();
        let written = session.written;
        let align = session.lend_align.filter(|_| session.lending);
        let res = self.with_lending(unguarded(align), |sink, arena, free| {
            let lent = pump(
                &layout,
                written..upto,
                arena,
                sink,
                fd,
                Pacing {
                    qd,
                    flush_every,
                    keep_in_flight: keep,
                    threads,
                },
                (free, &mut session.unflushed),
                (&mut session.hashers, &mut session.lent_ids),
                on_gathered,
            )?;
            session.zero_copy_bytes += lent;
            Ok(sink.pending() > 0)
        });
        session.segments = layout.into_segments();
        session.io_seconds += t.elapsed().as_secs_f64();
        let still = res.map_err(|e| session.fail(e))?;
        self.streaming = still.then_some(session.id);
        session.written = upto;
        // Segments wholly written are no longer needed (their checksums live
        // in the hashers): drop them so a long streamed file stays small.
        session.segments.retain(|s| s.end() > upto);
        Ok(())
    }

    /// Write part `index` of `parts` of the file described by `segments`
    /// (true length `file_len`) into the existing file `path`, then fsync it.
    /// Every writer of the file must give the same segments: parts are the
    /// balanced block-aligned ranges of [`Layout::split`]. Checksum slots are
    /// not allowed (a part cannot know the checksums of bytes other parts
    /// write): the caller fills them in as bytes. Creating the file, and the
    /// final truncate, rename and directory fsync, are the caller's.
    pub fn write_part(
        &mut self,
        path: &Path,
        segments: Vec<Segment>,
        file_len: u64,
        (index, parts): (usize, usize),
    ) -> Result<WriteStats> {
        self.check_process()?;
        let t0 = Instant::now();
        if parts == 0 || index >= parts {
            return Err(Error::option(format!(
                "part {index} of {parts} does not exist"
            )));
        }
        if segments
            .iter()
            .any(|s| matches!(s.source, Source::Crc32(_)))
        {
            return Err(Error::layout("a part write cannot fill checksum slots"));
        }
        self.settle(None);
        let file = crate::commit::open_existing(path, self.opts.direct)?;
        let dio = if file.direct {
            align::probe_fd(file.fd())
        } else {
            DioAlign::fallback()
        };
        let layout = Layout::new(segments, file_len, dio.block)?;
        let range = layout.split(parts)[index].clone();
        // Without statx's word, O_DIRECT memory is taken to need the block's
        // alignment (no probe: the file is shared with the other parts).
        let lend_align = lend_align(self.opts.zero_copy, file.direct, &dio, || Ok(dio.block))?;
        let qd = self.opts.queue_depth;
        let threads = self.opts.gather_threads;
        let mut hashers = vec![Hasher::new(); layout.crc_ids() as usize];
        let mut lent_ids = BTreeSet::new();
        let t_io = Instant::now();
        let res = self.with_lending(unguarded(lend_align), |sink, arena, free| {
            pump(
                &layout,
                range.clone(),
                arena,
                sink,
                file.fd(),
                Pacing {
                    qd,
                    flush_every: 0,
                    keep_in_flight: false,
                    threads,
                },
                (free, &mut 0),
                (&mut hashers, &mut lent_ids),
                &mut || Ok(()),
            )
        });
        let zero_copy_bytes = match res {
            Ok(n) => n,
            Err(mut e) => {
                e.path.get_or_insert_with(|| path.to_path_buf());
                return Err(e);
            }
        };
        let io_seconds = t_io.elapsed().as_secs_f64();
        let t_c = Instant::now();
        if self.opts.durable {
            file.sync()?;
        }
        Ok(WriteStats {
            bytes: range
                .end
                .min(file_len)
                .saturating_sub(range.start.min(file_len)),
            seconds: t0.elapsed().as_secs_f64(),
            open_seconds: 0.0,
            io_seconds,
            commit_seconds: t_c.elapsed().as_secs_f64(),
            direct: file.direct,
            io_uring: self.uring.is_some(),
            registered: self.registered(),
            locked: self.arena.locked(),
            block: dio.block,
            direct_note: None,
            uring_note: self.uring_note.clone(),
            crcs: Vec::new(),
            zero_copy_bytes,
        })
    }

    /// Write one zero block at offset 0 (which the real data overwrites) to
    /// learn whether the file system takes O_DIRECT writes. Returns why not.
    fn probe_direct(&mut self, tmp: &TempFile, block: usize) -> Result<Option<String>> {
        if self.opts.refuse_direct {
            return Ok(Some(
                "the file system refused an O_DIRECT write (EINVAL, injected)".into(),
            ));
        }
        self.with_buffers(|_, arena, free| {
            let b = *free.last().expect("a free buffer");
            let buf = &mut arena.buf_mut(b)[..block];
            buf.fill(0);
            // An arena buffer is page-aligned, as O_DIRECT wants.
            let file = tmp.file().expect("the temporary file is open");
            match file.write_at(buf, 0) {
                Ok(n) if n == block => Ok(None),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(Some(
                    "the file system refused an O_DIRECT write (EINVAL)".into(),
                )),
                Ok(n) => Err(Error::os(
                    libc::EIO,
                    format!("probe write was short ({n} of {block} bytes)"),
                    Some(tmp.temp_path()),
                )),
                Err(e) => Err(Error::from_io(
                    &e,
                    "probe write failed",
                    Some(tmp.temp_path()),
                )),
            }
        })
    }
}

/// How [`pump`] paces its writes.
impl Engine {
    /// The memory alignment O_DIRECT writes to `tmp` need, where `statx`
    /// did not say: 1 when a write from an odd address is taken (tmpfs
    /// ignores O_DIRECT's alignment), else `block`.
    fn probe_lend_align(&mut self, tmp: &TempFile, block: usize) -> Result<usize> {
        if self.opts.refuse_direct || self.arena.buf_size() <= block {
            return Ok(block);
        }
        self.with_buffers(|_, arena, free| {
            let b = *free.last().expect("a free buffer");
            let buf = &mut arena.buf_mut(b)[..=block];
            buf.fill(0);
            let file = tmp.file().expect("the temporary file is open");
            match file.write_at(&buf[1..], 0) {
                Ok(n) if n == block => Ok(1),
                Ok(_) => Ok(block),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(block),
                Err(e) => Err(Error::from_io(
                    &e,
                    "probe write failed",
                    Some(tmp.temp_path()),
                )),
            }
        })
    }
}

/// The memory alignment writes straight from caller memory to a file need
/// (None: never, `zero_copy` is off): any address for buffered files,
/// `statx`'s O_DIRECT memory alignment where it says, else what `unknown`
/// finds.
fn lend_align(
    zero_copy: bool,
    direct: bool,
    dio: &DioAlign,
    unknown: impl FnOnce() -> Result<usize>,
) -> Result<Option<usize>> {
    Ok(match (zero_copy, direct, dio.from_statx) {
        (false, _, _) => None,
        (true, false, _) => Some(1),
        (true, true, true) => Some(dio.mem_align.max(1) as usize),
        (true, true, false) => Some(unknown()?),
    })
}

/// The alignment at which a write may lend caller memory to the kernel:
/// the file's (`align`), unless a [`crate::guard`] watches the memory. The
/// caller's runtime may free guarded memory whenever the guard is given
/// back, and the engine gives it back while it waits for the device: such
/// memory is only ever read under the guard, so it is gathered.
fn unguarded(align: Option<usize>) -> Option<usize> {
    align.filter(|_| !guard::installed())
}

#[derive(Clone, Copy)]
struct Pacing {
    /// Writes in flight at most.
    qd: usize,
    /// Start an fdatasync after every this many bytes (0: never).
    flush_every: u64,
    /// Return without waiting for the last writes.
    keep_in_flight: bool,
    /// Gather threads (1: on the calling thread; see [`crate::gather`]).
    threads: usize,
}

/// Gather every extent into arena buffers (taken from `free`) and hand them
/// to the sink, keeping up to `qd` writes in flight; an extent the sink can
/// write straight from caller memory (see [`crate::lend`]) is only
/// checksummed, its checksum id added to `lent`. `unflushed` counts the
/// bytes since the last fdatasync, across calls. Returns the bytes written
/// straight from caller memory.
#[allow(clippy::too_many_arguments)] // private; the tuples group what travels together
fn pump(
    layout: &Layout,
    range: std::ops::Range<u64>,
    arena: &mut Arena,
    sink: &mut Lending<'_>,
    fd: i32,
    pacing: Pacing,
    (free, unflushed): (&mut Vec<usize>, &mut u64),
    (hashers, lent): (&mut [Hasher], &mut BTreeSet<u32>),
    on_gathered: &mut dyn FnMut() -> Result<()>,
) -> Result<u64> {
    let extents = layout.write_extents(range, arena.buf_size(), sink.align())?;
    if pacing.threads > 1 && extents.len() >= crate::gather::MIN_PARALLEL_EXTENTS {
        crate::gather::pump_parallel(
            layout,
            &extents,
            arena,
            sink,
            pacing.threads,
            &mut crate::gather::Pumping {
                fd,
                qd: pacing.qd,
                flush_every: pacing.flush_every,
                free,
                unflushed,
                hashers,
            },
        )?;
        lent.extend(sink.lent_ids());
        return gathered_then_drain(sink, free, pacing, lent, on_gathered);
    }
    for ext in extents {
        if pacing.flush_every > 0 && *unflushed >= pacing.flush_every {
            guard::before_block();
            sink.submit_datasync(fd)?;
            *unflushed = 0;
        }
        *unflushed += ext.len as u64;
        let memory = sink.source(layout, ext);
        while (memory.is_none() && free.is_empty()) || sink.inflight() >= pacing.qd {
            guard::before_block();
            sink.reap(free, true)?;
        }
        guard::before_gather(|| layout.mem_crc_ids(ext))?;
        let lent = memory.and_then(|(m, id)| Some((m, id, sink.take(m, id)?)));
        let job = if let Some((m, crc_id, id)) = lent {
            if let Some(c) = crc_id {
                let h = &mut hashers[c as usize];
                crate::vanish::read_noting(m.addr(), m.len(), || h.update(m.slice(0, m.len())));
                if crate::vanish::take() {
                    sink.give_back(id);
                    return Err(crate::vanish::error());
                }
            }
            Job {
                buf: id,
                ptr: m.addr() as *const u8,
                len: ext.len,
                offset: ext.offset,
                read: false,
            }
        } else {
            while free.is_empty() {
                guard::before_block();
                sink.reap(free, true)?;
                guard::before_gather(|| layout.mem_crc_ids(ext))?;
            }
            let b = free.pop().expect("a free buffer");
            gather(layout, ext, &mut arena.buf_mut(b)[..ext.len], hashers);
            if crate::vanish::take() {
                free.push(b);
                return Err(crate::vanish::error());
            }
            Job {
                buf: b,
                ptr: arena.buf_ptr(b),
                len: ext.len,
                offset: ext.offset,
                read: false,
            }
        };
        // SAFETY: an arena buffer `b` came off the free list, so no other
        // job uses it, and it goes back only when the sink returns it (reap)
        // or has drained; the arena outlives the sink's use of it (the
        // engine drains on every error path and drops the sink first);
        // nobody writes the buffer before then, since `gather` only fills
        // buffers from the free list. Caller memory (a lent id) stays valid
        // for the call (`MemRef`'s contract) and its writes complete before
        // the call returns (no lending with `keep_in_flight`; the engine
        // drains on error). `fd` is open for the whole call; writes left in
        // flight past it (`keep_in_flight`) are io_uring's only, which holds
        // its own reference to the file from submission on.
        unsafe { sink.submit(fd, job) }?;
        sink.reap(free, false)?;
    }
    lent.extend(sink.lent_ids());
    gathered_then_drain(sink, free, pacing, lent, on_gathered)
}

/// Every extent is gathered. Wait for the writes from caller memory: the
/// memory handed to a call may be reused once it returns (a staging slot
/// refilled for the next call), so they never outlive it. At the end of a
/// file, check the memory of `lent` again (see [`crate::lend`]). Then ask
/// `on_gathered` whether to go on, and wait for the other writes (unless
/// they stay in flight past the call).
fn gathered_then_drain(
    sink: &mut Lending<'_>,
    free: &mut Vec<usize>,
    pacing: Pacing,
    lent: &BTreeSet<u32>,
    on_gathered: &mut dyn FnMut() -> Result<()>,
) -> Result<u64> {
    guard::before_block();
    if pacing.keep_in_flight {
        while sink.lent_in_flight() > 0 {
            sink.reap(free, true)?;
        }
    } else if !lent.is_empty() || sink.lent_in_flight() > 0 {
        // The caller may change its memory once `on_gathered` has run (a
        // pipelined save), and the kernel may still read what it was lent.
        sink.drain_checked(free)?;
        guard::before_gather(|| lent.iter().copied())?;
        guard::before_block();
    }
    let gathered = on_gathered();
    if pacing.keep_in_flight {
        return gathered.map(|()| sink.bytes);
    }
    // A refused commit still waits for the writes it started.
    sink.drain_checked(free)?;
    gathered.map(|()| sink.bytes)
}

/// Fill `buf` with the bytes of `ext`, feeding the checksums.
pub fn gather(layout: &Layout, ext: Extent, buf: &mut [u8], hashers: &mut [Hasher]) {
    debug_assert_eq!(buf.len(), ext.len);
    let mut pos = 0;
    for p in layout.pieces(ext) {
        buf[pos..p.buf_offset].fill(0);
        let seg = &layout.segments()[p.segment];
        let dst = &mut buf[p.buf_offset..p.buf_offset + p.len];
        let so = p.seg_offset as usize;
        match &seg.source {
            Source::Bytes(b) => {
                let src = &b[so..so + p.len];
                if let Some(id) = seg.crc_id {
                    hashers[id as usize].update(src);
                }
                dst.copy_from_slice(src);
            }
            Source::Mem(m) => {
                let src = m.slice(so, p.len);
                // Caller memory may vanish under the read (crate::vanish).
                crate::vanish::read_noting(src.as_ptr() as usize, src.len(), || match seg.crc_id {
                    // Checksummed from the copy, as the gather threads do.
                    Some(id) => crate::gather::copy_checksummed(
                        dst,
                        src,
                        &mut hashers[id as usize],
                        crate::gather::STEP,
                    ),
                    None => crate::crc_copy::copy_nontemporal(dst, src),
                });
            }
            Source::Crc32(id) => {
                let v = hashers[*id as usize].clone().finalize().to_le_bytes();
                dst.copy_from_slice(&v[so..so + p.len]);
            }
        }
        pos = p.buf_offset + p.len;
    }
    buf[pos..].fill(0);
}
