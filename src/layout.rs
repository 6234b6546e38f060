//! The hybrid alignment partitioner.
//!
//! A file is described as a list of [`Segment`]s: where each piece of the
//! file comes from (caller memory, owned bytes, or the CRC32 of other
//! segments) and at which offset it goes. Gaps between segments are zeros.
//!
//! The partitioner turns that description into *extents*: block-aligned,
//! block-multiple ranges of the file, each at most one arena buffer long.
//! Every extent is gathered (copied, checksummed) from its segments into an
//! aligned arena buffer and written with O_DIRECT. Pieces that are not
//! aligned themselves (zip headers, small records, a record's unaligned end)
//! are gathered into the aligned blocks they share with their neighbours, so
//! the only unaligned thing left is the end of the file: the last extent is
//! padded with zeros to a whole block and the file is truncated to its true
//! length afterwards.
//!
//! [`Layout::split`] cuts the padded file into `n` balanced, block-aligned
//! parts, one per parallel writer.

use crate::error::{Error, Result};
use std::ops::Range;

/// Caller memory that the writer reads from.
#[derive(Debug, Clone, Copy)]
pub struct MemRef {
    ptr: *const u8,
    len: usize,
}

// SAFETY: a MemRef is only a (pointer, length) pair; the contract of
// `MemRef::new` makes the creator guarantee that the memory stays valid and
// readable for as long as any layout holding it is in use, from any thread.
unsafe impl Send for MemRef {}
// SAFETY: as above; the writer only ever reads through the pointer.
unsafe impl Sync for MemRef {}

impl MemRef {
    /// # Safety
    /// `ptr` must be valid for reads of `len` bytes for as long as the
    /// [`Layout`] that holds this reference is used, and nobody may free that
    /// memory meanwhile. (Concurrent *writes* are a race on the values, not
    /// on memory safety of this crate's own structures, and are the caller's
    /// business: the file then holds some mix of old and new bytes.)
    pub unsafe fn new(ptr: *const u8, len: usize) -> Self {
        MemRef { ptr, len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The memory's address.
    pub fn addr(&self) -> usize {
        self.ptr as usize
    }

    /// The part `[off, off + len)` of this memory (under the same contract).
    ///
    /// # Panics
    /// When that range is not inside the memory.
    #[must_use]
    pub fn sub(&self, off: usize, len: usize) -> MemRef {
        assert!(off.checked_add(len).is_some_and(|e| e <= self.len));
        MemRef {
            ptr: self.ptr.wrapping_add(off),
            len,
        }
    }

    /// The bytes `[off, off + len)` of this memory.
    ///
    /// # Panics
    /// When that range is not inside the memory.
    pub fn slice(&self, off: usize, len: usize) -> &[u8] {
        assert!(off.checked_add(len).is_some_and(|e| e <= self.len));
        if len == 0 {
            return &[];
        }
        // SAFETY: bounds checked above; validity for reads is the contract
        // of `MemRef::new`.
        unsafe { std::slice::from_raw_parts(self.ptr.add(off), len) }
    }
}

/// Where a segment's bytes come from.
#[derive(Debug, Clone)]
pub enum Source {
    /// Bytes owned by the layout (headers, small records).
    Bytes(Vec<u8>),
    /// Caller memory (tensor storages).
    Mem(MemRef),
    /// The little-endian CRC32 of every segment tagged with this checksum id.
    /// All those segments must end before this slot begins, so the value is
    /// known when the writer (which goes in file order) reaches it.
    Crc32(u32),
}

impl Source {
    pub fn len(&self) -> u64 {
        match self {
            Source::Bytes(b) => b.len() as u64,
            Source::Mem(m) => m.len() as u64,
            Source::Crc32(_) => 4,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One piece of the file.
#[derive(Debug, Clone)]
pub struct Segment {
    pub offset: u64,
    pub source: Source,
    /// Checksum id this segment's bytes are accumulated into.
    pub crc_id: Option<u32>,
}

impl Segment {
    /// The offset just past the segment (saturating: a segment whose end
    /// does not fit in a u64 is refused by [`Layout::new`] and by write
    /// sessions, see [`Segment::checked_end`]).
    pub fn end(&self) -> u64 {
        self.offset.saturating_add(self.source.len())
    }

    /// The offset just past the segment, or a layout error when it does
    /// not fit in a u64.
    pub fn checked_end(&self) -> Result<u64> {
        self.offset.checked_add(self.source.len()).ok_or_else(|| {
            Error::layout(format!(
                "segment at offset {} of {} bytes ends past the largest file offset",
                self.offset,
                self.source.len()
            ))
        })
    }
}

/// A block-aligned range of the file, written from one arena buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub offset: u64,
    /// A multiple of the block size.
    pub len: usize,
}

/// A run of one segment's bytes inside an extent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Index into [`Layout::segments`].
    pub segment: usize,
    /// Offset inside the segment.
    pub seg_offset: u64,
    /// Offset inside the extent (the arena buffer).
    pub buf_offset: usize,
    pub len: usize,
}

/// A validated file description.
#[derive(Debug, Clone)]
pub struct Layout {
    segments: Vec<Segment>,
    file_len: u64,
    /// `file_len` rounded up to a whole block.
    padded_len: u64,
    block: usize,
    crc_ids: u32,
}

impl Layout {
    /// Validate and sort `segments`. `file_len` is the true length of the
    /// file (at least the end of the last segment; the rest is zeros).
    /// `block` is the O_DIRECT block size (a power of two).
    pub fn new(mut segments: Vec<Segment>, file_len: u64, block: usize) -> Result<Self> {
        if !block.is_power_of_two() {
            return Err(Error::option(format!(
                "block size {block} is not a power of two"
            )));
        }
        segments.retain(|s| !s.source.is_empty());
        segments.sort_by_key(|s| s.offset);
        let mut crc_ids = 0u32;
        for s in &segments {
            if let Some(id) = s.crc_id {
                crc_ids = crc_ids.max(id + 1);
            }
            if let Source::Crc32(id) = s.source {
                crc_ids = crc_ids.max(id + 1);
                if s.crc_id.is_some() {
                    return Err(Error::layout(
                        "a checksum slot cannot itself be checksummed",
                    ));
                }
            }
        }
        // Where each checksum's covered bytes end, to check slot placement.
        let mut covered_end = vec![0u64; crc_ids as usize];
        let mut prev_end = 0u64;
        for (i, s) in segments.iter().enumerate() {
            if i > 0 && s.offset < prev_end {
                return Err(Error::layout(format!(
                    "segment at offset {} overlaps the previous one, which ends at {}",
                    s.offset, prev_end
                )));
            }
            prev_end = s.checked_end()?;
            if let Some(id) = s.crc_id {
                covered_end[id as usize] = covered_end[id as usize].max(s.end());
            }
        }
        for s in &segments {
            if let Source::Crc32(id) = s.source {
                if covered_end[id as usize] > s.offset {
                    return Err(Error::layout(format!(
                        "checksum slot for id {id} at offset {} comes before the end of the \
                         bytes it covers ({})",
                        s.offset, covered_end[id as usize]
                    )));
                }
            }
        }
        if file_len < prev_end {
            return Err(Error::layout(format!(
                "file length {file_len} is shorter than the last segment's end {prev_end}"
            )));
        }
        let padded_len = crate::align::align_up(file_len, block as u64)
            .filter(|&p| i64::try_from(p).is_ok())
            .ok_or_else(|| {
                Error::layout(format!(
                    "file length {file_len}, padded to whole {block}-byte blocks, is more \
                     than the largest file size"
                ))
            })?;
        Ok(Layout {
            segments,
            file_len,
            padded_len,
            block,
            crc_ids,
        })
    }

    /// Give the segments back (sorted by offset).
    pub fn into_segments(self) -> Vec<Segment> {
        self.segments
    }

    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    pub fn file_len(&self) -> u64 {
        self.file_len
    }

    pub fn block(&self) -> usize {
        self.block
    }

    /// Number of checksum ids in use (ids are `0..crc_ids`).
    pub fn crc_ids(&self) -> u32 {
        self.crc_ids
    }

    /// The file length rounded up to a whole block: what is written before
    /// the final truncate.
    pub fn padded_len(&self) -> u64 {
        self.padded_len
    }

    /// Split the padded file into `n` block-aligned parts whose sizes differ
    /// by at most one block. Parts may be empty when there are fewer blocks
    /// than parts.
    pub fn split(&self, n: usize) -> Vec<Range<u64>> {
        let n = n.max(1) as u128;
        let blocks = u128::from(self.padded_len / self.block as u64);
        let b = self.block as u64;
        // blocks * i / n <= blocks, so every bound fits back in a u64; the
        // product is taken in u128 so that it cannot overflow.
        let at = |i: u128| (blocks * i / n) as u64 * b;
        (0..n).map(|i| at(i)..at(i + 1)).collect()
    }

    /// The extents covering `range` (block-aligned; its end may be the padded
    /// length), each at most `max_len` bytes (rounded down to whole blocks),
    /// in file order. Made as they are consumed: memory does not grow with
    /// the range.
    pub fn extents(
        &self,
        range: Range<u64>,
        max_len: usize,
    ) -> Result<impl Iterator<Item = Extent> + use<>> {
        let b = self.block as u64;
        if range.start % b != 0
            || range.end % b != 0
            || range.end > self.padded_len
            || range.start > range.end
        {
            return Err(Error::layout(format!(
                "range {range:?} is not block-aligned ({b}) inside the padded file ({})",
                self.padded_len
            )));
        }
        let step = crate::align::align_down(max_len as u64, b).max(b);
        let end = range.end;
        // `step` is at most `max_len` or one block, both usize.
        Ok(range.step_by(step as usize).map(move |offset| Extent {
            offset,
            len: step.min(end - offset) as usize,
        }))
    }

    /// The extents a write of `range` goes in: [`Layout::extents`], also cut
    /// where the whole blocks of a caller-memory segment begin and end when
    /// that memory could be lent (`align`: the memory alignment the file
    /// takes writes from, see [`Layout::lendable`]; None: nothing is lent,
    /// the plain extents) and those blocks span at least one whole extent.
    /// Such a segment is then written from where it lies up to its last
    /// whole block, whatever its file offset against `max_len`: with
    /// extents of `max_len` from the range's start, the two that straddle
    /// its ends would be gathered, up to `2 * max_len` bytes of it copied.
    pub(crate) fn write_extents(
        &self,
        range: Range<u64>,
        max_len: usize,
        align: Option<usize>,
    ) -> Result<Vec<Extent>> {
        let plain = self.extents(range.clone(), max_len)?;
        let Some(align) = align else {
            return Ok(plain.collect());
        };
        let b = self.block as u64;
        let step = crate::align::align_down(max_len as u64, b).max(b);
        let mut cuts = Vec::new();
        let first = self.segments.partition_point(|s| s.end() <= range.start);
        for s in &self.segments[first..] {
            if s.offset >= range.end {
                break;
            }
            let Source::Mem(m) = &s.source else {
                continue;
            };
            let Some(lo) = crate::align::align_up(s.offset, b) else {
                continue;
            };
            let (lo, hi) = (
                lo.max(range.start),
                crate::align::align_down(s.end(), b).min(range.end),
            );
            if hi < lo.saturating_add(step) {
                continue;
            }
            // `lo - s.offset` is inside the segment, whose length is a usize.
            if (m.addr() + (lo - s.offset) as usize) % align.max(1) == 0 {
                cuts.extend([lo, hi]);
            }
        }
        let (mut out, mut offset, mut next) = (Vec::new(), range.start, 0);
        while offset < range.end {
            while next < cuts.len() && cuts[next] <= offset {
                next += 1;
            }
            let mut end = offset.saturating_add(step).min(range.end);
            if next < cuts.len() && cuts[next] < end {
                end = cuts[next];
            }
            out.push(Extent {
                offset,
                len: (end - offset) as usize,
            });
            offset = end;
        }
        Ok(out)
    }

    /// The checksum ids of the caller memory (`Source::Mem`) that gathering
    /// `extent` reads: what a [`crate::guard`] checks before the gather.
    pub(crate) fn mem_crc_ids(&self, extent: Extent) -> impl Iterator<Item = u32> + '_ {
        self.pieces(extent).into_iter().filter_map(|p| {
            let seg = &self.segments[p.segment];
            matches!(seg.source, Source::Mem(_))
                .then_some(seg.crc_id)
                .flatten()
        })
    }

    /// When the whole of `extent` is the bytes of one caller-memory segment,
    /// starting at an address that is a multiple of `align`: that memory
    /// and its checksum id. The extent can then be written from where it
    /// lies, without gathering it into a buffer.
    pub(crate) fn lendable(&self, extent: Extent, align: usize) -> Option<(MemRef, Option<u32>)> {
        let start = extent.offset;
        let s = &self.segments[self.segments.partition_point(|s| s.end() <= start)..].first()?;
        let Source::Mem(m) = &s.source else {
            return None;
        };
        if s.offset > start || s.end() < start + extent.len as u64 {
            return None;
        }
        let m = m.sub((start - s.offset) as usize, extent.len);
        (m.addr() % align.max(1) == 0).then_some((m, s.crc_id))
    }

    /// The segment pieces that make up `extent`, in file order. Bytes of the
    /// extent not covered by any piece are zeros.
    pub fn pieces(&self, extent: Extent) -> Vec<Piece> {
        let start = extent.offset;
        let end = start + extent.len as u64;
        let first = self.segments.partition_point(|s| s.end() <= start);
        let mut out = Vec::new();
        for (i, s) in self.segments.iter().enumerate().skip(first) {
            if s.offset >= end {
                break;
            }
            let lo = s.offset.max(start);
            let hi = s.end().min(end);
            out.push(Piece {
                segment: i,
                seg_offset: lo - s.offset,
                buf_offset: (lo - start) as usize,
                len: (hi - lo) as usize,
            });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn bytes(offset: u64, b: &[u8]) -> Segment {
        Segment {
            offset,
            source: Source::Bytes(b.to_vec()),
            crc_id: None,
        }
    }

    #[test]
    fn lendable_extents_are_whole_aligned_memory() {
        let store = vec![7u8; 3 * 4096 + 4096];
        let off = store.as_ptr().align_offset(4096);
        let mem = &store[off..off + 3 * 4096];
        // SAFETY: `store` outlives the layout.
        let m = unsafe { MemRef::new(mem.as_ptr(), mem.len()) };
        let segs = vec![
            bytes(0, b"head"),
            Segment {
                offset: 4096,
                source: Source::Mem(m),
                crc_id: Some(3),
            },
            bytes(4 * 4096, b"tail"),
        ];
        let l = Layout::new(segs, 5 * 4096, 4096).unwrap();
        let ext = |i: u64| Extent {
            offset: i * 4096,
            len: 4096,
        };
        // Bytes, not memory; the end of the file: never.
        assert!(l.lendable(ext(0), 1).is_none());
        assert!(l.lendable(ext(4), 1).is_none());
        for i in 1..4 {
            let (got, id) = l.lendable(ext(i), 4096).unwrap();
            assert_eq!(got.addr(), mem.as_ptr() as usize + (i as usize - 1) * 4096);
            assert_eq!((got.len(), id), (4096, Some(3)));
        }
        // Two blocks: inside; past the memory's end: not.
        let two = |i: u64| Extent {
            offset: i * 4096,
            len: 8192,
        };
        assert!(l.lendable(two(1), 4096).is_some());
        assert!(l.lendable(two(3), 4096).is_none());
        assert!(l.lendable(two(0), 1).is_none());
        // An address the file does not take writes from.
        let odd = Layout::new(
            vec![Segment {
                offset: 4096,
                // SAFETY: as above.
                source: Source::Mem(unsafe { MemRef::new(mem.as_ptr().add(64), 4096 * 2) }),
                crc_id: None,
            }],
            3 * 4096,
            4096,
        )
        .unwrap();
        assert!(odd.lendable(ext(1), 512).is_none());
        assert_eq!(odd.lendable(ext(1), 64).unwrap().1, None);
    }

    /// Extents that tile `range` in order, each of whole blocks and at most
    /// `step` long.
    fn check_tiling(exts: &[Extent], range: Range<u64>, step: usize, block: u64) {
        let mut at = range.start;
        for e in exts {
            assert_eq!(e.offset, at);
            assert!(
                e.len > 0 && e.len <= step && e.len as u64 % block == 0,
                "{e:?}"
            );
            at += e.len as u64;
        }
        assert_eq!(at, range.end);
    }

    #[test]
    fn write_extents_cut_around_a_big_memory_segment() {
        const B: u64 = 4096;
        let step = 4 * B as usize;
        let store = vec![7u8; 16 * B as usize];
        let off = store.as_ptr().align_offset(B as usize);
        // Memory whose first whole block (file offset 3B) is page-aligned:
        // the segment starts 100 bytes before it.
        let base = store[off + B as usize - 100..].as_ptr();
        let len = 9 * B as usize + 300;
        // SAFETY: `store` outlives the layout.
        let m = unsafe { MemRef::new(base, len) };
        let seg_at = 3 * B - 100;
        let segs = vec![
            bytes(0, b"head"),
            Segment {
                offset: seg_at,
                source: Source::Mem(m),
                crc_id: Some(0),
            },
        ];
        let file_len = 14 * B;
        let l = Layout::new(segs, file_len, B as usize).unwrap();
        let plain: Vec<Extent> = l.extents(0..file_len, step).unwrap().collect();
        assert_eq!(l.write_extents(0..file_len, step, None).unwrap(), plain);
        let exts = l
            .write_extents(0..file_len, step, Some(B as usize))
            .unwrap();
        check_tiling(&exts, 0..file_len, step, B);
        // Cut at the segment's first whole block (3B) and after its last
        // (12B): every extent in between is lent, 9 blocks, where the plain
        // extents lend only the two that happen to lie inside it.
        let lent: u64 = exts
            .iter()
            .filter(|e| l.lendable(**e, B as usize).is_some())
            .map(|e| e.len as u64)
            .sum();
        assert_eq!(lent, 12 * B - 3 * B);
        assert!(exts.iter().any(|e| e.offset == 3 * B) && exts.iter().any(|e| e.offset == 12 * B));
        let plain_lent: u64 = plain
            .iter()
            .filter(|e| l.lendable(**e, B as usize).is_some())
            .map(|e| e.len as u64)
            .sum();
        assert_eq!(plain_lent, 8 * B); // [0, 4B) and [12B, 14B) straddle its ends
                                       // Memory the file does not take writes from, or a segment under one
                                       // whole extent: the plain extents.
        assert_eq!(
            l.write_extents(0..file_len, step, Some(1 << 20)).unwrap(),
            plain
        );
        assert_eq!(
            l.write_extents(0..file_len, 16 * B as usize, Some(B as usize))
                .unwrap(),
            l.extents(0..file_len, 16 * B as usize)
                .unwrap()
                .collect::<Vec<_>>()
        );
        // A part of the file: the cuts that fall inside it.
        let part = l
            .write_extents(5 * B..14 * B, step, Some(B as usize))
            .unwrap();
        check_tiling(&part, 5 * B..14 * B, step, B);
        assert!(part.iter().any(|e| e.offset == 12 * B));
    }

    proptest! {
        /// Whatever the segments (bytes or memory at any address), the
        /// extents tile the range in whole blocks of at most one step.
        #[test]
        fn write_extents_tile_the_range(
            segs in proptest::collection::vec((0u64..64, 1usize..40_000, any::<bool>(), 0usize..4096), 0..8),
            step_blocks in 1usize..6,
            align in prop_oneof![Just(None), Just(Some(1usize)), Just(Some(512)), Just(Some(4096))],
        ) {
            const B: u64 = 4096;
            let store = vec![1u8; 48_000];
            let mut at = 0u64;
            let mut segments = Vec::new();
            for (gap, len, mem, shift) in segs {
                let offset = at + gap * 97;
                let source = if mem {
                    let shift = shift.min(store.len() - len.min(store.len()));
                    let len = len.min(store.len() - shift);
                    // SAFETY: `store` outlives the layout.
                    Source::Mem(unsafe { MemRef::new(store.as_ptr().add(shift), len) })
                } else {
                    Source::Bytes(vec![2; len])
                };
                let s = Segment { offset, source, crc_id: None };
                at = s.end();
                segments.push(s);
            }
            let l = Layout::new(segments, at, B as usize).unwrap();
            let end = l.padded_len();
            let exts = l.write_extents(0..end, step_blocks * B as usize, align).unwrap();
            check_tiling(&exts, 0..end, step_blocks * B as usize, B);
        }
    }

    #[test]
    fn rejects_overlap() {
        let e = Layout::new(vec![bytes(0, &[1; 10]), bytes(5, &[2; 10])], 20, 4096).unwrap_err();
        assert!(e.context.contains("overlaps"), "{e}");
    }

    #[test]
    fn rejects_early_crc_slot() {
        let segs = vec![
            Segment {
                offset: 0,
                source: Source::Crc32(0),
                crc_id: None,
            },
            Segment {
                offset: 10,
                source: Source::Bytes(vec![1; 10]),
                crc_id: Some(0),
            },
        ];
        let e = Layout::new(segs, 20, 4096).unwrap_err();
        assert!(e.context.contains("comes before"), "{e}");
    }

    #[test]
    fn rejects_short_file_len_and_bad_block() {
        assert!(Layout::new(vec![bytes(0, &[1; 10])], 5, 4096).is_err());
        assert!(Layout::new(vec![], 5, 3000).is_err());
    }

    #[test]
    fn huge_lengths_are_errors_not_overflows() {
        // Padding to whole blocks would wrap, or exceed the largest off_t.
        for len in [u64::MAX, u64::MAX - 4094, 1 << 63] {
            let e = Layout::new(vec![], len, 4096).unwrap_err();
            assert_eq!(e.kind, crate::ErrorKind::InvalidLayout, "{e}");
        }
        let l = Layout::new(vec![], (1 << 63) - 4096, 4096).unwrap();
        assert_eq!(l.padded_len(), (1 << 63) - 4096);
        // A segment whose end does not fit.
        let e = Layout::new(vec![bytes(u64::MAX - 2, &[1; 10])], u64::MAX, 4096).unwrap_err();
        assert!(e.context.contains("past the largest"), "{e}");
        assert_eq!(bytes(u64::MAX - 2, &[1; 10]).end(), u64::MAX);
    }

    #[test]
    fn split_and_extents_of_huge_files() {
        let len = 1u64 << 62;
        let l = Layout::new(vec![], len, 4096).unwrap();
        // blocks * parts does not fit in a u64.
        let parts = l.split(1 << 20);
        assert_eq!(parts.len(), 1 << 20);
        assert_eq!(parts[0], 0..(len >> 20));
        assert_eq!(parts[(1 << 20) - 1].end, len);
        assert!(parts.windows(2).all(|w| w[0].end == w[1].start));
        // Extents are made as consumed: no allocation proportional to 4 EiB.
        let mut ext = l.extents(0..len, 1 << 20).unwrap();
        assert_eq!(
            ext.next(),
            Some(Extent {
                offset: 0,
                len: 1 << 20
            })
        );
        assert_eq!(ext.next().map(|e| e.offset), Some(1 << 20));
        let tail: Vec<Extent> = l.extents(len - (3 << 19)..len, 1 << 20).unwrap().collect();
        assert_eq!(
            tail,
            vec![
                Extent {
                    offset: len - (3 << 19),
                    len: 1 << 20
                },
                Extent {
                    offset: len - (1 << 19),
                    len: 1 << 19
                }
            ]
        );
    }

    #[test]
    fn empty_file() {
        let l = Layout::new(vec![], 0, 4096).unwrap();
        assert_eq!(l.padded_len(), 0);
        assert_eq!(l.extents(0..0, 1 << 20).unwrap().count(), 0);
        assert_eq!(l.split(3), vec![0..0, 0..0, 0..0]);
    }

    /// Random layouts: segment lengths and gaps, block and buffer sizes.
    fn arb_layout() -> impl Strategy<Value = (Vec<(u64, usize)>, u64, usize, usize)> {
        (
            prop::collection::vec((0u64..9000, 1usize..20000), 0..40),
            0u64..5000,
            prop::sample::select(vec![512usize, 4096, 8192]),
            1usize..40,
        )
            .prop_map(|(gl, trail, block, bufs)| {
                let mut off = 0;
                let mut segs = vec![];
                for (gap, len) in gl {
                    off += gap;
                    segs.push((off, len));
                    off += len as u64;
                }
                (segs, off + trail, block, bufs * block)
            })
    }

    proptest! {
        #[test]
        fn every_byte_exactly_once((segs, file_len, block, buf) in arb_layout(), parts in 1usize..7) {
            let segments: Vec<Segment> = segs.iter().enumerate()
                .map(|(i, &(o, l))| bytes(o, &vec![(i % 251 + 1) as u8; l]))
                .collect();
            let layout = Layout::new(segments, file_len, block).unwrap();
            let padded = layout.padded_len();
            prop_assert_eq!(padded % block as u64, 0);
            prop_assert!(padded >= file_len && padded < file_len + block as u64);

            let ranges = layout.split(parts);
            prop_assert_eq!(ranges.len(), parts);
            prop_assert_eq!(ranges[0].start, 0);
            prop_assert_eq!(ranges[parts - 1].end, padded);
            let sizes: Vec<u64> = ranges.iter().map(|r| r.end - r.start).collect();
            prop_assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= block as u64);

            let mut image = vec![0u8; padded as usize];
            let mut written = vec![0u8; padded as usize];
            for (k, r) in ranges.iter().enumerate() {
                if k > 0 { prop_assert_eq!(ranges[k - 1].end, r.start); }
                prop_assert_eq!(r.start % block as u64, 0);
                for ext in layout.extents(r.clone(), buf).unwrap() {
                    prop_assert_eq!(ext.offset % block as u64, 0);
                    prop_assert_eq!(ext.len % block, 0);
                    prop_assert!(ext.len <= buf && ext.len > 0);
                    let mut last_end = 0usize;
                    for p in layout.pieces(ext) {
                        prop_assert!(p.buf_offset >= last_end);
                        last_end = p.buf_offset + p.len;
                        prop_assert!(last_end <= ext.len);
                        let Source::Bytes(b) = &layout.segments()[p.segment].source else { unreachable!() };
                        let at = ext.offset as usize + p.buf_offset;
                        image[at..at + p.len].copy_from_slice(&b[p.seg_offset as usize..p.seg_offset as usize + p.len]);
                    }
                    for w in &mut written[ext.offset as usize..ext.offset as usize + ext.len] { *w += 1; }
                }
            }
            prop_assert!(written.iter().all(|&w| w == 1));
            let mut expect = vec![0u8; padded as usize];
            for (i, &(o, l)) in segs.iter().enumerate() {
                expect[o as usize..o as usize + l].fill((i % 251 + 1) as u8);
            }
            prop_assert_eq!(image, expect);
        }
    }
}
