//! Gathering on several threads.
//!
//! One thread gathering (copying segment bytes into arena buffers and
//! checksumming them) runs at a few GB/s: less than a RAM-backed file
//! system or an array of NVMe drives takes. [`pump_parallel`] spreads the
//! per-byte work of one write over `gather_threads` workers:
//!
//! - a worker copies an extent's pieces into its arena buffer (gaps
//!   zeroed, checksum slots left for later) and checksums the checksummed
//!   pieces' bytes as copied (the bytes that go to disk), one partial
//!   CRC32 per piece, in one pass ([`crate::crc_copy`]);
//! - the calling thread hands out extents, and then, in file order,
//!   combines each extent's partial checksums into the running ones, fills
//!   the extent's checksum slots (a slot comes after every byte it covers,
//!   which [`Layout::new`] checks) and submits the buffer.
//!
//! Under a [`crate::guard`] (caller memory that the caller's runtime may
//! free, read only while the guard is held) the calling thread takes the
//! guard and checks each extent's memory before handing it out, and keeps
//! the guard while any worker may still be copying: it gives the guard back
//! (after a slice, or to wait for the device) only once every extent handed
//! out has come back. So the copies, too, run on all the workers.
//!
//! Workers are scoped to the call: every one has finished with its buffer
//! before the call returns, also on an error.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Mutex;
use std::time::Duration;

use crc32fast::Hasher;

use crate::arena::Arena;
use crate::error::{Error, Result};
use crate::guard;
use crate::layout::{Extent, Layout, Source};
use crate::lend::Lending;
use crate::sink::{Job, Sink};

/// Fewer extents than this are gathered on the calling thread (starting
/// workers would cost more than they save).
pub(crate) const MIN_PARALLEL_EXTENTS: usize = 4;

/// Where the one-pass copy is not used ([`crate::crc_copy`]), copies that
/// checksum too go in steps of this many bytes, each checksummed right
/// after it is copied, while it is in cache.
pub(crate) const STEP: usize = 64 << 10;

/// The default number of gather threads: the cores this process may use,
/// at most 8.
pub fn default_gather_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(8))
}

/// Copy the pieces of `ext` into `buf` (its length), zeroing the gaps and
/// leaving checksum slots zero, and checksum each checksummed piece's
/// bytes as copied (the bytes that go to disk, [`copy_checksummed`]): one
/// partial CRC32 per piece, in file order (as [`checksum_extent`] gives
/// them).
pub(crate) fn copy_extent(layout: &Layout, ext: Extent, buf: &mut [u8]) -> Vec<(u32, Hasher)> {
    copy_extent_in_steps(layout, ext, buf, STEP)
}

fn copy_extent_in_steps(
    layout: &Layout,
    ext: Extent,
    buf: &mut [u8],
    step: usize,
) -> Vec<(u32, Hasher)> {
    debug_assert_eq!(buf.len(), ext.len);
    let mut out = Vec::new();
    let mut pos = 0;
    for p in layout.pieces(ext) {
        buf[pos..p.buf_offset].fill(0);
        let seg = &layout.segments()[p.segment];
        let dst = &mut buf[p.buf_offset..p.buf_offset + p.len];
        let so = p.seg_offset as usize;
        let src = match &seg.source {
            Source::Bytes(b) => &b[so..so + p.len],
            Source::Mem(m) => m.slice(so, p.len),
            Source::Crc32(_) => {
                dst.fill(0);
                pos = p.buf_offset + p.len;
                continue;
            }
        };
        // Caller memory may vanish under the read (crate::vanish).
        crate::vanish::read_noting(src.as_ptr() as usize, src.len(), || match seg.crc_id {
            Some(id) => {
                let mut h = Hasher::new();
                copy_checksummed(dst, src, &mut h, step);
                out.push((id, h));
            }
            None => crate::crc_copy::copy_nontemporal(dst, src),
        });
        pos = p.buf_offset + p.len;
    }
    buf[pos..].fill(0);
    out
}

/// Copy `src` into `dst` (as long) and feed `h` the copied bytes (what a
/// write sends to disk, what a read hands over): in one pass with
/// non-temporal stores where the CPU allows ([`crate::crc_copy`]), else
/// `step` bytes at a time, each step checksummed right after it is copied.
pub(crate) use crate::crc_copy::copy_checksummed;

/// The checksum of each checksummed piece of `ext`, read from `buf` (the
/// extent, already copied), in file order.
pub(crate) fn checksum_extent(layout: &Layout, ext: Extent, buf: &[u8]) -> Vec<(u32, Hasher)> {
    let mut out = Vec::new();
    for p in layout.pieces(ext) {
        let seg = &layout.segments()[p.segment];
        if let (Some(id), Source::Bytes(_) | Source::Mem(_)) = (seg.crc_id, &seg.source) {
            let mut h = Hasher::new();
            h.update(&buf[p.buf_offset..p.buf_offset + p.len]);
            out.push((id, h));
        }
    }
    out
}

/// Fold an extent's partial checksums into `hashers` (in file order).
fn fold(partials: &[(u32, Hasher)], hashers: &mut [Hasher]) {
    for (id, h) in partials {
        hashers[*id as usize].combine(h);
    }
}

/// In file order: fold `partials` (of `ext`) into `hashers`, then fill the
/// extent's checksum slots in `buf`.
pub(crate) fn finish_extent(
    layout: &Layout,
    ext: Extent,
    buf: &mut [u8],
    partials: &[(u32, Hasher)],
    hashers: &mut [Hasher],
) {
    fold(partials, hashers);
    for p in layout.pieces(ext) {
        if let Source::Crc32(id) = layout.segments()[p.segment].source {
            let v = hashers[id as usize].clone().finalize().to_le_bytes();
            let so = p.seg_offset as usize;
            buf[p.buf_offset..p.buf_offset + p.len].copy_from_slice(&v[so..so + p.len]);
        }
    }
}

/// One extent for a worker: its arena buffer (index and address), or, for
/// an extent written straight from caller memory, a lent id and the
/// memory's address.
#[derive(Clone, Copy)]
struct Task {
    seq: usize,
    buf: usize,
    addr: usize,
    lent: bool,
}

/// A worker's result: the extent's partial checksums.
struct Gathered {
    seq: usize,
    buf: usize,
    addr: usize,
    lent: bool,
    partials: Vec<(u32, Hasher)>,
    /// Caller memory it read was freed meanwhile (crate::vanish).
    vanished: bool,
}

/// What [`pump_parallel`] needs from the writer, grouped.
pub(crate) struct Pumping<'a> {
    pub fd: i32,
    pub qd: usize,
    pub flush_every: u64,
    pub free: &'a mut Vec<usize>,
    pub unflushed: &'a mut u64,
    pub hashers: &'a mut [Hasher],
}

/// Gather and submit `extents` (in file order) with `threads` workers; see
/// the module docs. On return (also on an error) no worker touches any
/// buffer any more; buffers of submitted writes are the sink's.
pub(crate) fn pump_parallel(
    layout: &Layout,
    extents: &[Extent],
    arena: &mut Arena,
    sink: &mut Lending<'_>,
    threads: usize,
    p: &mut Pumping<'_>,
) -> Result<()> {
    let guarded = guard::installed();
    with_workers(
        threads,
        |t: Task| gather_task(layout, extents, t),
        |task_tx, done_rx| {
            coordinate(
                layout,
                extents,
                arena,
                sink,
                p,
                (guarded, threads * 2),
                task_tx,
                done_rx,
            )
        },
    )?
}

/// Run `coordinate` on the calling thread with `threads` scoped workers:
/// each takes tasks from the sender `coordinate` is given, applies `work`
/// and sends the result back on the receiver. Once `coordinate` returns,
/// the workers finish what is queued and end; the scope joins them before
/// this function returns (also on an error). Shared by the gather threads
/// and the read path's scatter threads.
pub(crate) fn with_workers<T: Send, R: Send, O>(
    threads: usize,
    work: impl Fn(T) -> R + Sync,
    coordinate: impl FnOnce(&mpsc::Sender<T>, &mpsc::Receiver<R>) -> O,
) -> Result<O> {
    let (task_tx, task_rx) = mpsc::channel::<T>();
    let task_rx = Mutex::new(task_rx);
    let (done_tx, done_rx) = mpsc::channel::<R>();
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let mut started = 0;
        let mut refused = None;
        for _ in 0..threads {
            let (rx, tx, work, stop) = (&task_rx, done_tx.clone(), &work, &stop);
            // A thread the system will not start (EAGAIN: a process or
            // memory limit) is one worker fewer, not a panic (which would
            // poison the engine held meanwhile).
            match std::thread::Builder::new()
                .spawn_scoped(scope, move || serve(rx, &tx, work, stop))
            {
                Ok(_) => started += 1,
                Err(e) => {
                    refused = Some(e);
                    break;
                }
            }
        }
        drop(done_tx);
        if started == 0 {
            if let Some(e) = refused {
                return Err(Error::from_io(&e, "cannot start a worker thread", None));
            }
        }
        let out = coordinate(&task_tx, &done_rx);
        drop(task_tx);
        Ok(out)
    })
}

/// A worker thread's loop: `work` on each task from `rx`, its result sent
/// to `tx`, until the calling thread stops handing tasks out (or stops
/// listening). A task that panics (a bug) stops every worker (`stop`):
/// once they have all ended, the calling thread's receiver is
/// disconnected, which it reports as lost workers, instead of waiting for
/// ever for the result that never comes.
fn serve<T, R>(
    rx: &Mutex<mpsc::Receiver<T>>,
    tx: &mpsc::Sender<R>,
    work: impl Fn(T) -> R,
    stop: &AtomicBool,
) {
    while !stop.load(Ordering::SeqCst) {
        let task = match rx.lock() {
            Ok(rx) => rx.recv_timeout(Duration::from_millis(10)),
            Err(_) => return,
        };
        let t = match task {
            Ok(t) => t,
            Err(mpsc::RecvTimeoutError::Timeout) => continue, // look at `stop` again
            Err(mpsc::RecvTimeoutError::Disconnected) => return, // no more work
        };
        let Ok(r) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(t))) else {
            // The panic hook has printed it.
            stop.store(true, Ordering::SeqCst);
            return;
        };
        if tx.send(r).is_err() {
            return;
        }
    }
}

/// A gather thread's task: copy the extent and checksum it (an extent
/// written from caller memory: checksum it where it lies).
fn gather_task(layout: &Layout, extents: &[Extent], t: Task) -> Gathered {
    let ext = extents[t.seq];
    // Caller memory under a guard: the calling thread checked it and holds
    // the guard until this task has come back (see `coordinate`).
    let partials = if t.lent {
        // SAFETY: `t.addr..+ext.len` is the caller memory of the extent's one
        // segment (`Lending::source`), valid for reads for the call
        // (`MemRef`'s contract); nobody writes it through this crate.
        let mem = unsafe { std::slice::from_raw_parts(t.addr as *const u8, ext.len) };
        crate::vanish::read_noting(t.addr, ext.len, || checksum_extent(layout, ext, mem))
    } else {
        // SAFETY: buffer `t.buf` (at `t.addr`, at least `ext.len` bytes: an
        // extent is at most one buffer) was taken off the free list for this
        // task alone; the calling thread does not touch it until the worker
        // sends it back, and the arena outlives the workers' scope.
        let buf = unsafe { std::slice::from_raw_parts_mut(t.addr as *mut u8, ext.len) };
        copy_extent(layout, ext, buf)
    };
    Gathered {
        seq: t.seq,
        buf: t.buf,
        addr: t.addr,
        lent: t.lent,
        partials,
        vanished: crate::vanish::take(),
    }
}

/// The calling thread's part of [`pump_parallel`].
#[allow(clippy::too_many_arguments)] // private; split out of pump_parallel
fn coordinate(
    layout: &Layout,
    extents: &[Extent],
    arena: &mut Arena,
    sink: &mut Lending<'_>,
    p: &mut Pumping<'_>,
    (guarded, window): (bool, usize),
    task_tx: &mpsc::Sender<Task>,
    done_rx: &mpsc::Receiver<Gathered>,
) -> Result<()> {
    let n = extents.len();
    // Extents handed out but not yet submitted (`outstanding`), of which
    // `at_workers` have not come back yet: under a guard, those may be
    // reading caller memory, and the guard stays held until they are back.
    let (mut next, mut fin, mut outstanding) = (0usize, 0usize, 0usize);
    let mut at_workers = 0usize;
    let mut ready: BTreeMap<usize, Gathered> = BTreeMap::new();
    let lost = || Error::internal("a gather thread ended early");
    // Before this thread blocks on the device: under a guard, first take
    // back every extent from the workers (holding the guard meanwhile),
    // then give the guard back.
    let quiesce = |ready: &mut BTreeMap<usize, Gathered>, at_workers: &mut usize| -> Result<()> {
        if guarded {
            while *at_workers > 0 {
                let d = done_rx.recv().map_err(|_| lost())?;
                *at_workers -= 1;
                ready.insert(d.seq, d);
            }
        }
        guard::before_block();
        Ok(())
    };
    while fin < n {
        // Hand out work while there are buffers (or memory to lend) and
        // room in the window.
        while next < n && outstanding < window {
            let ext = extents[next];
            let memory = sink.source(layout, ext);
            if memory.is_none() && p.free.is_empty() {
                break;
            }
            if guarded {
                if at_workers == 0 {
                    // Nobody reads under the guard: it may be given back
                    // first, after a slice.
                    guard::before_gather(|| layout.mem_crc_ids(ext))?;
                } else if guard::slice_over() {
                    break; // let the workers finish, then give it back
                } else {
                    guard::hold_for_gather(|| layout.mem_crc_ids(ext))?;
                }
            }
            let lent = memory.and_then(|(m, id)| Some((m, sink.take(m, id)?)));
            let task = if let Some((m, id)) = lent {
                Task {
                    seq: next,
                    buf: id,
                    addr: m.addr(),
                    lent: true,
                }
            } else {
                let Some(b) = p.free.pop() else {
                    break; // every lent id is out: wait for the device
                };
                Task {
                    seq: next,
                    buf: b,
                    addr: arena.buf_ptr(b) as usize,
                    lent: false,
                }
            };
            task_tx.send(task).map_err(|_| lost())?;
            next += 1;
            outstanding += 1;
            at_workers += 1;
        }
        // Finish, in file order, what the workers have done.
        while let Ok(d) = done_rx.try_recv() {
            at_workers -= 1;
            ready.insert(d.seq, d);
        }
        let mut progressed = false;
        while let Some(d) = ready.remove(&fin) {
            outstanding -= 1;
            submit(layout, extents[fin], &d, arena, sink, p, &mut || {
                quiesce(&mut ready, &mut at_workers)
            })?;
            fin += 1;
            progressed = true;
        }
        if progressed || fin >= n {
            continue;
        }
        // Nothing to finish yet: wait for a worker (under a guard, holding
        // it: the worker may be reading caller memory), or for the device.
        if at_workers > 0 {
            if !guarded {
                guard::before_block();
            }
            let d = done_rx.recv().map_err(|_| lost())?;
            at_workers -= 1;
            ready.insert(d.seq, d);
        } else {
            // Handing out waits for a buffer (or a lent id) to come back.
            quiesce(&mut ready, &mut at_workers)?;
            sink.reap(p.free, true)?;
        }
    }
    Ok(())
}

/// Fold an extent's checksums, fill its slots and submit it, keeping at
/// most `qd` writes in flight and starting an fdatasync every
/// `flush_every` bytes.
/// `before_block` is called before each wait for the device.
fn submit(
    layout: &Layout,
    ext: Extent,
    d: &Gathered,
    arena: &mut Arena,
    sink: &mut Lending<'_>,
    p: &mut Pumping<'_>,
    before_block: &mut dyn FnMut() -> Result<()>,
) -> Result<()> {
    if d.vanished {
        return Err(crate::vanish::error());
    }
    if p.flush_every > 0 && *p.unflushed >= p.flush_every {
        before_block()?;
        sink.submit_datasync(p.fd)?;
        *p.unflushed = 0;
    }
    *p.unflushed += ext.len as u64;
    while sink.inflight() >= p.qd {
        before_block()?;
        sink.reap(p.free, true)?;
    }
    let ptr = if d.lent {
        // One caller-memory segment covers the extent: no slots to fill.
        fold(&d.partials, p.hashers);
        d.addr as *const u8
    } else {
        finish_extent(
            layout,
            ext,
            &mut arena.buf_mut(d.buf)[..ext.len],
            &d.partials,
            p.hashers,
        );
        arena.buf_ptr(d.buf)
    };
    let job = Job {
        buf: d.buf,
        ptr,
        len: ext.len,
        offset: ext.offset,
        read: false,
    };
    // SAFETY: buffer `d.buf` came off the free list for this extent and its
    // worker is done with it; it goes back only when the sink returns it
    // (reap) or has drained; the arena outlives the sink's use of it (the
    // engine drains on every error path and drops the sink first). Lent
    // caller memory stays valid for the call and its writes complete before
    // the call returns (see `crate::lend`). `fd` is open for the whole call
    // (see `writer::pump`).
    unsafe { sink.submit(p.fd, job) }?;
    sink.reap(p.free, false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{MemRef, Segment};
    use proptest::prelude::*;

    /// A task that panics (a bug) disconnects the caller's receiver once
    /// every worker has stopped, instead of leaving it waiting for ever for
    /// the result; the other tasks' results still come.
    #[test]
    fn a_panicking_task_ends_the_workers_instead_of_hanging_the_caller() {
        for threads in [1, 2, 4] {
            let got = with_workers(
                threads,
                |t: u32| {
                    assert!(t != 3, "task 3 fails");
                    t * 2
                },
                |tx, rx| {
                    for t in 0..8 {
                        tx.send(t).unwrap();
                    }
                    let mut out = Vec::new();
                    while out.len() < 8 {
                        match rx.recv() {
                            Ok(r) => out.push(r),
                            Err(_) => return Err(out),
                        }
                    }
                    Ok(out)
                },
            );
            let done = got
                .expect("the workers start")
                .expect_err("one task never gives a result");
            assert!(done.len() < 8 && !done.contains(&6), "{done:?}");
        }
    }

    /// Records of random sizes, each followed by its checksum slot (as in a
    /// torch zip's data descriptors), some from memory, some from bytes,
    /// some not checksummed, at random gaps; all slots again at the end (the
    /// central directory).
    fn records(sizes: &[(usize, u8, u8)], mem: &[Vec<u8>]) -> (Vec<Segment>, u64) {
        let mut segs = vec![];
        let mut off = 0u64;
        let mut ids = vec![];
        for (i, &(_, gap, kind)) in sizes.iter().enumerate() {
            off += u64::from(gap);
            let id = u32::try_from(i).unwrap();
            let data = &mem[i];
            let source = if kind % 2 == 0 {
                // SAFETY: `mem` outlives every use of the segments.
                Source::Mem(unsafe { MemRef::new(data.as_ptr(), data.len()) })
            } else {
                Source::Bytes(data.clone())
            };
            let crc_id = (kind % 3 != 0).then_some(id);
            segs.push(Segment {
                offset: off,
                source,
                crc_id,
            });
            off += data.len() as u64;
            if crc_id.is_some() {
                segs.push(Segment {
                    offset: off,
                    source: Source::Crc32(id),
                    crc_id: None,
                });
                off += 4;
                ids.push(id);
            }
        }
        for id in ids {
            off += 3;
            segs.push(Segment {
                offset: off,
                source: Source::Crc32(id),
                crc_id: None,
            });
            off += 4;
        }
        (segs, off + 5)
    }

    proptest! {
        #[test]
        fn split_gather_equals_the_one_thread_gather(
            sizes in proptest::collection::vec((0usize..20_000, 0u8..200, 0u8..6), 1..30),
            block_pow in 9u32..13,
            bufs in 1usize..5,
            step in 1usize..5000,
        ) {
            let mem: Vec<Vec<u8>> = sizes.iter().enumerate()
                .map(|(i, &(n, _, _))| (0..n).map(|j| (j * 7 + i * 13) as u8).collect())
                .collect();
            let (segs, file_len) = records(&sizes, &mem);
            let block = 1usize << block_pow;
            let layout = Layout::new(segs, file_len, block).unwrap();
            let ids = layout.crc_ids() as usize;
            let (mut h1, mut h2) = (vec![Hasher::new(); ids], vec![Hasher::new(); ids]);
            let buf_len = block * bufs;
            for ext in layout.extents(0..layout.padded_len(), buf_len).unwrap() {
                let mut a = vec![0xEEu8; ext.len];
                crate::writer::gather(&layout, ext, &mut a, &mut h1);
                let mut b = vec![0xDDu8; ext.len];
                let partials = copy_extent_in_steps(&layout, ext, &mut b, step);
                // The same partial checksums as checksumming the copied extent.
                let whole: Vec<(u32, u32)> = checksum_extent(&layout, ext, &b)
                    .into_iter().map(|(id, h)| (id, h.finalize())).collect();
                let stepped: Vec<(u32, u32)> = partials.iter()
                    .map(|(id, h)| (*id, h.clone().finalize())).collect();
                prop_assert_eq!(whole, stepped);
                finish_extent(&layout, ext, &mut b, &partials, &mut h2);
                prop_assert!(a == b, "extent at {} differs", ext.offset);
            }
            let f1: Vec<u32> = h1.into_iter().map(Hasher::finalize).collect();
            let f2: Vec<u32> = h2.into_iter().map(Hasher::finalize).collect();
            prop_assert_eq!(f1, f2);
        }
    }
}
