//! Writes straight from caller memory, without the copy into the arena.
//!
//! An extent that lies wholly inside one caller-memory segment, at an
//! address the file takes writes from (O_DIRECT's memory alignment, which
//! `statx` reports: 4 bytes on NVMe, 512 on many virtual disks; any address
//! for buffered files and for tmpfs), needs no arena buffer: its checksum is
//! taken where it lies and the kernel reads the bytes from there. That
//! spares one copy of every byte (the gather's memcpy), which is most of a
//! gather thread's work.
//!
//! The rules that keep this as safe as the copy:
//! - only memory that no [`crate::guard`] watches is lent: the kernel reads
//!   it while the engine waits for the device, when a guard would have been
//!   given back (and the caller's runtime could free the memory). Memory a
//!   save owns (an async save's snapshot) is lent; tensors a synchronous or
//!   pipelined save reads in place are gathered;
//! - a call never returns with a lent write in flight: memory handed to
//!   one call of a streamed save may be reused once it returns (a staging
//!   slot refilled with the next chunk of a device storage), as when it is
//!   gathered. Other writes of the call may stay in flight. So every lent
//!   write has completed before the writer reports the data
//!   gathered (`on_gathered`: the point after which an async save lets the
//!   caller reuse the memory) and before the file is committed;
//! - should a guard be installed all the same, the memory of every lent
//!   extent is checked under it once more after those writes completed.
//!
//! [`Lending`] wraps the I/O back end for one use of it
//! (`Engine::with_lending`): a write from caller memory carries an id past
//! the arena's buffer indices, and the wrapper keeps those ids out of the
//! free-buffer list the sink fills.

use std::collections::BTreeSet;

use crate::error::Result;
use crate::layout::{Extent, Layout, MemRef};
use crate::sink::{Fault, Job, Sink};
use std::os::fd::RawFd;

/// The sink of one use of the engine's I/O back end, lending extents of
/// caller memory to the kernel when `align` allows it.
pub(crate) struct Lending<'a> {
    sink: &'a mut dyn Sink,
    /// Memory alignment a lent write needs (None: never lend).
    align: Option<usize>,
    /// The first id past the arena's buffers.
    first: usize,
    /// Ids not lent, and how many there are in all.
    ids: Vec<usize>,
    cap: usize,
    /// Bytes written from caller memory.
    pub(crate) bytes: u64,
    /// Checksum ids whose memory was lent.
    lent_ids: BTreeSet<u32>,
}

impl<'a> Lending<'a> {
    /// `nbufs` arena buffers; `cap` lent writes at most at once.
    pub(crate) fn new(
        sink: &'a mut dyn Sink,
        nbufs: usize,
        cap: usize,
        align: Option<usize>,
    ) -> Self {
        Lending {
            sink,
            align,
            first: nbufs,
            ids: all_ids(nbufs, cap),
            cap,
            bytes: 0,
            lent_ids: BTreeSet::new(),
        }
    }

    /// The memory alignment a lent write needs (None: nothing is lent).
    pub(crate) fn align(&self) -> Option<usize> {
        self.align
    }

    /// The caller memory `ext` can be written from, if it can.
    pub(crate) fn source(&self, layout: &Layout, ext: Extent) -> Option<(MemRef, Option<u32>)> {
        let align = self.align?;
        layout.lendable(ext, align)
    }

    /// An id for a write from `mem` (checksum `crc_id`), or None when every
    /// id is out (the extent is then gathered as usual).
    pub(crate) fn take(&mut self, mem: MemRef, crc_id: Option<u32>) -> Option<usize> {
        let id = self.ids.pop()?;
        self.bytes += mem.len() as u64;
        self.lent_ids.extend(crc_id);
        Some(id)
    }

    /// Give back an id from [`Lending::take`] whose write was not made.
    pub(crate) fn give_back(&mut self, id: usize) {
        self.ids.push(id);
    }

    /// The checksum ids of the memory lent through this sink.
    pub(crate) fn lent_ids(&self) -> &BTreeSet<u32> {
        &self.lent_ids
    }

    /// Lent writes in flight.
    pub(crate) fn lent_in_flight(&self) -> usize {
        self.cap - self.ids.len()
    }

    /// Move the ids of completed lent writes out of `free` (the arena's).
    fn sort(&mut self, free: &mut Vec<usize>) {
        let first = self.first;
        let ids = &mut self.ids;
        free.retain(|&b| {
            if b >= first {
                ids.push(b);
                false
            } else {
                true
            }
        });
    }
}

/// Every lent id, for an arena of `nbufs` buffers and `cap` ids.
fn all_ids(nbufs: usize, cap: usize) -> Vec<usize> {
    (nbufs..nbufs + cap).rev().collect()
}

impl Sink for Lending<'_> {
    unsafe fn submit(&mut self, fd: RawFd, job: Job) -> Result<()> {
        // SAFETY: the caller's guarantees for `job`, passed on unchanged.
        unsafe { self.sink.submit(fd, job) }
    }

    fn reap(&mut self, free: &mut Vec<usize>, wait: bool) -> Result<()> {
        let res = self.sink.reap(free, wait);
        self.sort(free);
        res
    }

    fn submit_datasync(&mut self, fd: RawFd) -> Result<()> {
        self.sink.submit_datasync(fd)
    }

    fn inflight(&self) -> usize {
        self.sink.inflight()
    }

    fn drain(&mut self) {
        self.sink.drain();
        self.ids = all_ids(self.first, self.cap);
    }

    fn set_fault(&mut self, fault: Option<Fault>) {
        self.sink.set_fault(fault);
    }

    fn pending(&self) -> usize {
        self.sink.pending()
    }
}
