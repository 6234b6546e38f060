//! Arena buffers the caller fills itself.
//!
//! A device-to-host copy (CUDA) can land straight in an arena buffer that
//! the caller registered with the device, instead of in a staging slot
//! whose bytes the engine then copies into the arena: one copy of every
//! byte fewer, and no CPU pass but the checksum.
//!
//! ```text
//!  take_buffer ──► buffer k (the caller's) ──D2H copy──► write_buffer(k, offset, len)
//!                                                           │ CRC32 where it lies
//!                                                           ▼
//!                          buffer k back when its ◄── WriteFixed/O_DIRECT, in flight
//!                          completion is reaped          across calls
//! ```
//!
//! The caller takes a buffer ([`Engine::take_buffer`]), fills it with the
//! file's next bytes (while the disk writes the buffers before it), placed
//! where their offset falls in its block, and hands it over
//! ([`Engine::write_buffer`]): the engine fills the buffer's head with the
//! rest of that block (the bytes given last), checksums the caller's bytes
//! where they lie and writes the buffer's whole blocks from there, the
//! writes staying in flight across calls as gathered ones do. The bytes
//! past its last whole block (less than a block) are copied into the
//! session, as a gathered write leaves them. A buffer taken and not
//! written goes back with [`Engine::give_back`], or when its session ends
//! (finished, aborted or dropped).
//!
//! While the caller holds a buffer the engine hands it to nothing else: not
//! to a gather, not to a read, and not to the list of free buffers that a
//! failure rebuilds. A few buffers are always left to the engine, so a
//! caller holding buffers never starves the writes it waits for.

use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::layout::{Extent, Layout, Segment, Source};
use crate::sink::Job;
use crate::writer::{gather, Session};
use crc32fast::Hasher;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Buffers the engine keeps for itself whatever its callers hold.
pub const KEPT_BUFFERS: usize = 2;

/// The buffers callers hold, by session, and the sessions that ended.
#[derive(Default)]
pub(crate) struct Held {
    /// (session id, buffer index).
    list: Vec<(u64, usize)>,
    /// Ids of sessions dropped since the last [`Held::reclaim`], pushed by
    /// their [`SessionEnd`].
    ended: Arc<Mutex<Vec<u64>>>,
}

impl Held {
    /// The token a session carries: it reports the session's end.
    pub(crate) fn token(&self, id: u64) -> SessionEnd {
        SessionEnd {
            id,
            pid: std::process::id(),
            ended: Arc::clone(&self.ended),
        }
    }

    /// Buffers held by sessions that ended, now free again.
    pub(crate) fn reclaim(&mut self, free: &mut Vec<usize>) {
        if self.list.is_empty() {
            if let Ok(mut e) = self.ended.lock() {
                e.clear();
            }
            return;
        }
        let ended = match self.ended.lock() {
            Ok(mut e) => std::mem::take(&mut *e),
            Err(_) => return,
        };
        if ended.is_empty() {
            return;
        }
        self.list.retain(|&(s, b)| {
            let gone = ended.contains(&s);
            if gone {
                free.push(b);
            }
            !gone
        });
    }

    /// Whether buffer `b` is held.
    pub(crate) fn holds(&self, b: usize) -> bool {
        self.list.iter().any(|&(_, x)| x == b)
    }

    fn take(&mut self, session: u64, b: usize) -> bool {
        match self.list.iter().position(|&e| e == (session, b)) {
            Some(i) => {
                self.list.remove(i);
                true
            }
            None => false,
        }
    }
}

/// Carried by a session: when it is dropped, the buffers it still holds
/// go back to its engine (at the engine's next use of its buffers).
pub(crate) struct SessionEnd {
    id: u64,
    /// A fork child's copy of a session reports nothing: the lock may be
    /// held by a parent's thread that does not exist in the child.
    pid: u32,
    ended: Arc<Mutex<Vec<u64>>>,
}

impl Drop for SessionEnd {
    fn drop(&mut self) {
        if std::process::id() == self.pid {
            if let Ok(mut e) = self.ended.lock() {
                e.push(self.id);
            }
        }
    }
}

impl Engine {
    /// Take a free arena buffer (its index) for `session` to fill, waiting
    /// for one of the writes in flight when none is free. The caller fills
    /// it through [`Engine::held_buffer`] (or at the arena's address plus
    /// index times buffer size) and hands it to [`Engine::write_buffer`] or
    /// [`Engine::give_back`].
    ///
    /// # Errors
    /// When the session failed, when a write in flight failed, or when the
    /// caller already holds all but [`KEPT_BUFFERS`] of the arena's buffers.
    pub fn take_buffer(&mut self, session: &mut Session) -> Result<usize> {
        self.check_process()?;
        session.check_usable()?;
        self.held.reclaim(&mut self.free);
        let nbufs = self.arena.nbufs();
        if self.held.list.len() + KEPT_BUFFERS >= nbufs {
            return Err(Error::option(format!(
                "cannot lend another arena buffer: {} of its {nbufs} are lent and the engine \
                 keeps {KEPT_BUFFERS}",
                self.held.list.len()
            )));
        }
        self.settle(Some(session.id));
        self.reported(session)?;
        let taken = self.with_buffers(|sink, _, free| loop {
            if let Some(b) = free.pop() {
                return Ok(b);
            }
            if sink.pending() == 0 {
                return Err(Error::option("no arena buffer is free or in flight"));
            }
            sink.reap(free, true)?;
        });
        match taken {
            Ok(b) => {
                self.held.list.push((session.id, b));
                Ok(b)
            }
            Err(e) => Err(session.fail(e)),
        }
    }

    /// Buffer `buf`, held by `session`, to fill.
    ///
    /// # Errors
    /// When `session` does not hold `buf`.
    pub fn held_buffer(&mut self, session: &Session, buf: usize) -> Result<&mut [u8]> {
        if !self.held.list.contains(&(session.id, buf)) {
            return Err(not_held(buf));
        }
        Ok(self.arena.buf_mut(buf))
    }

    /// Give back buffer `buf`, taken by `session` and not written.
    ///
    /// # Errors
    /// When `session` does not hold `buf`.
    pub fn give_back(&mut self, session: &Session, buf: usize) -> Result<()> {
        if !self.held.take(session.id, buf) {
            return Err(not_held(buf));
        }
        self.free.push(buf);
        Ok(())
    }

    /// Write buffer `buf`, taken by `session`, which the caller filled with
    /// the file's `len` bytes at `offset` (at or after everything given so
    /// far; the bytes between are zeros), placed in the buffer at `offset`
    /// modulo the session's block (the first bytes of a record that starts
    /// inside a block; at 0 once on a block boundary). `crc_id`: the
    /// checksum they are accumulated into. The engine writes the bytes
    /// given before it, fills the buffer's head (before those bytes) with
    /// the rest of their block, checksums the caller's bytes where they lie
    /// and writes the buffer's whole blocks from there; the bytes past them
    /// (less than a block) are copied into the session. The buffer is no
    /// longer the caller's, whatever the outcome; its write may still be in
    /// flight on return (a later call reports its failure), as a gathered
    /// write's may.
    ///
    /// # Errors
    /// When `session` does not hold `buf`, `offset` comes before what was
    /// given, the bytes do not fit the buffer where they go, the session
    /// failed, or a write failed.
    pub fn write_buffer(
        &mut self,
        session: &mut Session,
        buf: usize,
        offset: u64,
        len: usize,
        crc_id: Option<u32>,
    ) -> Result<()> {
        self.check_process()?;
        if !self.held.list.contains(&(session.id, buf)) {
            return Err(not_held(buf));
        }
        let block = session.block as u64;
        let base = offset - offset % block;
        // The blocks before `base` go first (the buffer still held: no
        // gather takes it meanwhile).
        let before = self.before_buffer(session, offset, len, base);
        // From here on the buffer is the engine's again, whatever happens.
        self.held.take(session.id, buf);
        if let Err(e) = before {
            // Back among the free ones (a failed write rebuilt that list
            // without the buffers held).
            if !self.free.contains(&buf) {
                self.free.push(buf);
            }
            return Err(e);
        }
        debug_assert_eq!(session.written, base);
        let t = Instant::now();
        let at = (offset - base) as usize;
        let filled = at + len;
        let whole = filled - filled % session.block;
        // What lies before the caller's bytes in their block: the bytes
        // given last (less than a block, all before `offset`), zeros between.
        let head = match Layout::new(std::mem::take(&mut session.segments), offset, session.block) {
            Ok(head) => head,
            Err(e) => {
                self.free.push(buf);
                return Err(session.fail(e));
            }
        };
        let ids = (head.crc_ids() as usize).max(crc_id.map_or(0, |c| c as usize + 1));
        if session.hashers.len() < ids {
            session.hashers.resize(ids, Hasher::new());
        }
        let fd = session.tmp.fd();
        let flush_every = self.flush_every();
        let qd = self.opts.queue_depth;
        let keep = self.uring.is_some();
        let hashers = &mut session.hashers;
        let unflushed = &mut session.unflushed;
        let mut tail = Vec::new();
        let res = self.with_buffers(|sink, arena, free| {
            let mem = &mut arena.buf_mut(buf)[..filled];
            let ext = Extent {
                offset: base,
                len: at,
            };
            gather(&head, ext, &mut mem[..at], hashers);
            if crate::vanish::take() {
                free.push(buf);
                return Err(crate::vanish::error());
            }
            if let Some(c) = crc_id {
                hashers[c as usize].update(&mem[at..]);
            }
            tail.extend_from_slice(&mem[whole..]);
            if whole == 0 {
                free.push(buf);
                return Ok(sink.pending() > 0);
            }
            if flush_every > 0 && *unflushed >= flush_every {
                sink.submit_datasync(fd)?;
                *unflushed = 0;
            }
            *unflushed += whole as u64;
            while sink.inflight() >= qd {
                sink.reap(free, true)?;
            }
            let job = Job {
                buf,
                ptr: arena.buf_ptr(buf),
                len: whole,
                offset: base,
                read: false,
            };
            // SAFETY: buffer `buf` was the caller's (held: no gather, read
            // or other job used it) and is now the sink's alone: it goes
            // back to the free list only when the sink returns it (reap) or
            // has drained, and the caller no longer writes it (its contract,
            // `write_buffer`'s doc). The arena outlives the sink's use of it
            // (the engine drains on every error path). `fd` is the open
            // temporary file; writes left in flight past the call are
            // io_uring's only (`keep`), which holds its own reference to the
            // file from submission on.
            unsafe { sink.submit(fd, job) }?;
            sink.reap(free, false)?;
            if !keep {
                sink.drain_checked(free)?;
            }
            Ok(sink.pending() > 0)
        });
        session.io_seconds += t.elapsed().as_secs_f64();
        let still = res.map_err(|e| session.fail(e))?;
        self.streaming = still.then_some(session.id);
        session.written = base + whole as u64;
        session.frontier = offset + len as u64;
        if !tail.is_empty() {
            session.segments.push(Segment {
                offset: session.written,
                source: Source::Bytes(tail),
                crc_id: None,
            });
        }
        Ok(())
    }

    /// What a buffer's write needs first: that it fits where the session
    /// is, that another session's writes in flight are settled (their
    /// completions are theirs, not this session's) and this session's
    /// failure among them reported, and the blocks before `base` written.
    fn before_buffer(
        &mut self,
        session: &mut Session,
        offset: u64,
        len: usize,
        base: u64,
    ) -> Result<()> {
        self.check_buffer(session, offset, len)?;
        self.settle(Some(session.id));
        self.reported(session)?;
        if session.written < base {
            self.write_upto(session, base)?;
        }
        Ok(())
    }

    /// Refuse a buffer's write that does not fit where the session is.
    fn check_buffer(&self, session: &Session, offset: u64, len: usize) -> Result<()> {
        session.check_usable()?;
        let size = self.arena.buf_size();
        let at = (offset % session.block as u64) as usize;
        if len == 0 || at + len > size {
            return Err(Error::option(format!(
                "a buffer's write of {len} bytes at offset {offset}: a {size}-byte buffer takes \
                 1 to {} bytes there (they go {at} bytes into it, where the offset falls in \
                 its {}-byte block)",
                size - at,
                session.block
            )));
        }
        if offset < session.frontier {
            return Err(Error::layout(format!(
                "a buffer's write at offset {offset} comes before the end of what was already \
                 given ({})",
                session.frontier
            )));
        }
        offset.checked_add(len as u64).ok_or_else(|| {
            Error::layout(format!("a buffer's write at offset {offset} overflows"))
        })?;
        Ok(())
    }
}

fn not_held(buf: usize) -> Error {
    Error::option(format!("arena buffer {buf} is not held by this session"))
}
