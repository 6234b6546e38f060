//! Reads handed over where they land: each completed read stays in its
//! arena buffer, where a [`Consumer`] copies its pieces on (the Python
//! side: host-to-device copies out of the arena, which it registered with
//! CUDA) while the CRC32 of each piece is taken in place. A buffer is read
//! into again once the consumer has released it and its checksums are
//! taken.
//!
//! Unlike [`Engine::read_into_fd`] no byte is copied on the CPU, and the
//! reads stay `queue_depth` deep from the first extent to the last, instead
//! of one bounce buffer's worth of reads at a time.

use crate::arena::Arena;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::gather::{with_workers, MIN_PARALLEL_EXTENTS};
use crate::reader::{extent_pieces, fold, MutMemRef, ReadPiece, ReadPlan, ReadReq, ReadStats};
use crate::sink::Sink;
use crc32fast::Hasher;
use std::collections::BTreeMap;
use std::os::fd::RawFd;
use std::sync::mpsc;
use std::time::Duration;

/// What a read hands its completed buffers to.
pub trait Consumer {
    /// The read into arena buffer `buf` (`len` bytes at `addr`) is
    /// complete; `pieces` say which of its bytes belong to which request
    /// (file order). The consumer may read the buffer, not write it, until
    /// it releases it.
    fn filled(&mut self, buf: usize, addr: usize, len: usize, pieces: &[ReadPiece]) -> Result<()>;

    /// Append to `out` the buffers the consumer is done with (each once).
    /// With `wait`, block until there is at least one, if it holds any.
    fn released(&mut self, out: &mut Vec<usize>, wait: bool) -> Result<()>;
}

/// A buffer handed to the consumer and not yet released.
const HELD: u8 = 1;
/// A buffer whose checksums are being taken.
const SUMMING: u8 = 2;

/// A checksum thread's result: extent `seq`'s partial checksums, in buffer
/// `buf`.
struct Summed {
    seq: usize,
    buf: usize,
    partials: Vec<(usize, Hasher)>,
}

impl Engine {
    /// Read the `(file offset, length)` ranges of the file open as `fd`
    /// (see [`Engine::read_into_fd`]: the same file checks, planning and
    /// errors), handing each completed arena buffer to `consumer` instead
    /// of copying it to caller memory. Returns each range's CRC32.
    ///
    /// When this returns `Ok`, the consumer has released every buffer. When
    /// it returns an error, buffers the consumer holds may still be in use
    /// by it: the caller must let the consumer finish with them before the
    /// engine is used again.
    pub fn read_handed(
        &mut self,
        fd: RawFd,
        ranges: &[(u64, usize)],
        merge_gap: u64,
        consumer: &mut dyn Consumer,
    ) -> Result<ReadStats> {
        let reqs: Vec<ReadReq> = ranges
            .iter()
            .map(|&(offset, len)| ReadReq {
                offset,
                dst: MutMemRef::discard(len),
            })
            .collect();
        self.read_fd_planned(fd, &reqs, merge_gap, |eng, fd, extents, order| {
            eng.hand_extents(fd, &extents, &reqs, order, consumer)
        })
    }

    /// Read `extents` (file order) into arena buffers, up to `queue_depth`
    /// in flight, handing each completed one to `consumer` and taking its
    /// checksums in place (on `gather_threads` threads when there are
    /// enough extents); the partial checksums are folded in file order.
    fn hand_extents(
        &mut self,
        fd: RawFd,
        extents: &[(u64, usize)],
        reqs: &[ReadReq],
        order: &[usize],
        consumer: &mut dyn Consumer,
    ) -> Result<Vec<u32>> {
        let threads = self.opts.gather_threads;
        let plan = ReadPlan::new(fd, self.opts.queue_depth, extents, reqs, order);
        let mut hashers = vec![Hasher::new(); reqs.len()];
        self.with_buffers(|sink, arena, free| {
            let mut hand = Handing {
                plan: &plan,
                sink,
                arena,
                free,
                consumer,
                hashers: &mut hashers,
            };
            if threads > 1 && extents.len() >= MIN_PARALLEL_EXTENTS {
                with_workers(
                    threads,
                    |(seq, buf, addr): (usize, usize, usize)| {
                        let len = plan.extents[seq].1;
                        // SAFETY: buffer `buf` (at `addr`, at least `len`
                        // bytes: an extent is at most one buffer) holds a
                        // completed read; until this task's result comes
                        // back it is neither read into nor written by
                        // anyone (the consumer only reads it), and the
                        // arena outlives the workers' scope.
                        let data = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
                        Summed {
                            seq,
                            buf,
                            partials: plan.scatter(seq, data),
                        }
                    },
                    |tx, rx| hand.run(Some((tx, rx))),
                )?
            } else {
                hand.run(None)
            }
        })?;
        Ok(hashers.into_iter().map(Hasher::finalize).collect())
    }
}

/// One handed read under way.
struct Handing<'a, 'p> {
    plan: &'a ReadPlan<'p>,
    sink: &'a mut dyn Sink,
    arena: &'a Arena,
    free: &'a mut Vec<usize>,
    consumer: &'a mut dyn Consumer,
    hashers: &'a mut [Hasher],
}

type Workers<'w> = Option<(
    &'w mpsc::Sender<(usize, usize, usize)>,
    &'w mpsc::Receiver<Summed>,
)>;

impl Handing<'_, '_> {
    /// The calling thread's loop; `workers` take the checksums when given
    /// (else this thread does, right after handing a buffer over). On
    /// return (also on an error) no checksum thread reads any buffer.
    fn run(&mut self, workers: Workers<'_>) -> Result<()> {
        let plan = self.plan;
        let n = plan.extents.len();
        let nb = self.arena.nbufs();
        let mut seq_of = vec![usize::MAX; nb];
        let mut busy = vec![0u8; nb];
        // Partial checksums of extents summed ahead of `fin`.
        let mut ready: BTreeMap<usize, Vec<(usize, Hasher)>> = BTreeMap::new();
        let (mut next, mut fin, mut summing, mut held) = (0usize, 0usize, 0usize, 0usize);
        let (mut completed, mut released) = (Vec::new(), Vec::new());
        let lost = || Error::internal("a checksum thread ended early");
        while fin < n || held > 0 {
            while self.sink.inflight() < plan.qd && next < n {
                let Some(b) = self.free.pop() else {
                    break;
                };
                plan.submit(self.sink, self.arena, next, b)?;
                seq_of[b] = next;
                next += 1;
            }
            self.sink.reap(&mut completed, false)?;
            let mut progressed = !completed.is_empty();
            for b in completed.drain(..) {
                let seq = seq_of[b];
                let (off, len) = plan.extents[seq];
                let pieces: Vec<ReadPiece> =
                    extent_pieces(plan.reqs, plan.order, plan.spans[seq], off, len).collect();
                busy[b] = HELD | SUMMING;
                held += 1;
                self.consumer
                    .filled(b, self.arena.buf_ptr(b) as usize, len, &pieces)?;
                if let Some((tx, _)) = workers {
                    tx.send((seq, b, self.arena.buf_ptr(b) as usize))
                        .map_err(|_| lost())?;
                    summing += 1;
                } else {
                    // The consumer only reads the buffer meanwhile.
                    ready.insert(seq, plan.scatter(seq, &self.arena.buf(b)[..len]));
                    busy[b] &= !SUMMING;
                }
            }
            if let Some((_, rx)) = workers {
                while let Ok(d) = rx.try_recv() {
                    summing -= 1;
                    ready.insert(d.seq, d.partials);
                    self.unbusy(&mut busy, d.buf, SUMMING);
                    progressed = true;
                }
            }
            // The consumer is asked for buffers back only when a read
            // waits for one (or at the end): each question is a call into
            // Python, and the arena has buffers to spare beyond the reads
            // in flight.
            let starved = next < n && self.sink.inflight() < plan.qd && self.free.is_empty();
            if held > 0 && starved {
                self.consumer.released(&mut released, false)?;
                progressed |= self.take_released(&mut busy, &mut released, &mut held)?;
            }
            while let Some(partials) = ready.remove(&fin) {
                fold(self.hashers, partials);
                fin += 1;
            }
            if progressed {
                continue;
            }
            // Nothing moved: wait for the checksum threads, the device or
            // the consumer, whichever the read waits on.
            if summing > 0 {
                let rx = workers.map(|(_, rx)| rx).ok_or_else(lost)?;
                let got = if self.sink.inflight() == 0 && held == 0 {
                    rx.recv().map_err(|_| lost())
                } else {
                    match rx.recv_timeout(Duration::from_micros(200)) {
                        Ok(d) => Ok(d),
                        Err(mpsc::RecvTimeoutError::Timeout) => continue,
                        Err(mpsc::RecvTimeoutError::Disconnected) => Err(lost()),
                    }
                }?;
                summing -= 1;
                ready.insert(got.seq, got.partials);
                self.unbusy(&mut busy, got.buf, SUMMING);
            } else if held > 0 && (starved || self.sink.inflight() == 0) {
                // A buffer the consumer gives back is a read started (the
                // reads in flight go on meanwhile).
                self.consumer.released(&mut released, true)?;
                if !self.take_released(&mut busy, &mut released, &mut held)? {
                    return Err(Error::internal(format!(
                        "the consumer holds {held} arena buffers and released none when the \
                         read waited for one"
                    )));
                }
            } else if self.sink.inflight() > 0 {
                self.sink.reap(&mut completed, true)?;
            } else if fin < n {
                return Err(Error::internal(
                    "a handed read stalled: nothing in flight, held or being summed",
                ));
            }
        }
        Ok(())
    }

    /// `bit` is done for buffer `b`; once nothing is, it is free again.
    fn unbusy(&mut self, busy: &mut [u8], b: usize, bit: u8) {
        busy[b] &= !bit;
        if busy[b] == 0 {
            self.free.push(b);
        }
    }

    /// Take the buffers the consumer released; whether there were any.
    fn take_released(
        &mut self,
        busy: &mut [u8],
        released: &mut Vec<usize>,
        held: &mut usize,
    ) -> Result<bool> {
        let any = !released.is_empty();
        for b in released.drain(..) {
            if busy.get(b).is_none_or(|s| s & HELD == 0) {
                return Err(Error::internal(format!(
                    "the consumer released arena buffer {b}, which it does not hold"
                )));
            }
            *held -= 1;
            self.unbusy(busy, b, HELD);
        }
        Ok(any)
    }
}
