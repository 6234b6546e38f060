//! Reads handed over in the arena (`Engine::read_handed`): the consumer sees
//! every requested byte once, where it lies in the file, with the same
//! CRC32s as a read into memory, on every back end, whatever order and
//! pace it releases buffers in; a buffer is never read into while the
//! consumer holds it, and a consumer's failure or misuse is an error that
//! leaves the engine usable.

use fastpersist::handoff::Consumer;
use fastpersist::{Engine, Fault, MutMemRef, Options, ReadPiece, ReadReq, Result};
use std::collections::VecDeque;
use std::io::Write;
use std::os::fd::AsRawFd;

const BUF: usize = 64 << 10;
const NBUFS: usize = 8;

/// An arena of `NBUFS` buffers of `BUF` bytes, 3 reads in flight.
fn opts(io_uring: bool, direct: bool, gather_threads: usize) -> Options {
    Options {
        io_uring,
        direct,
        block_size: BUF,
        arena_bytes: BUF * NBUFS,
        queue_depth: 3,
        gather_threads,
        ..Options::default()
    }
}

fn combos() -> Vec<Options> {
    let mut v = vec![];
    for io_uring in [true, false] {
        for direct in [true, false] {
            for threads in [1, 3] {
                v.push(opts(io_uring, direct, threads));
            }
        }
    }
    v
}

fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 131 + i / 7919) as u8).collect()
}

/// A file of `n` patterned bytes.
fn file_of(n: usize) -> (tempfile::TempDir, std::fs::File, Vec<u8>) {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("f.bin");
    let data = pattern(n);
    std::fs::File::create(&p).unwrap().write_all(&data).unwrap();
    let f = std::fs::File::open(&p).unwrap();
    (d, f, data)
}

/// Copies each piece into its request's bytes, holding at most `hold`
/// buffers (released oldest first, or newest first with `lifo`), and
/// checks that no buffer it holds is handed to it again.
struct Copying {
    out: Vec<Vec<u8>>,
    held: VecDeque<usize>,
    hold: usize,
    lifo: bool,
    /// `filled` fails at this call.
    fail_at: Option<usize>,
    calls: usize,
    seen: usize,
}

impl Copying {
    fn new(lens: &[usize], hold: usize) -> Self {
        Copying {
            out: lens.iter().map(|&n| vec![0xEE; n]).collect(),
            held: VecDeque::new(),
            hold,
            lifo: false,
            fail_at: None,
            calls: 0,
            seen: 0,
        }
    }
}

impl Consumer for Copying {
    fn filled(&mut self, buf: usize, addr: usize, len: usize, pieces: &[ReadPiece]) -> Result<()> {
        self.calls += 1;
        if self.fail_at == Some(self.calls) {
            return Err(fastpersist::Error::cancelled("the consumer gave up"));
        }
        assert!(
            !self.held.contains(&buf),
            "buffer {buf} handed again while held"
        );
        // SAFETY: the read hands over `len` readable bytes at `addr`, ours
        // to read until released.
        let data = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
        for p in pieces {
            assert!(p.at + p.len <= len);
            self.out[p.req][p.start..p.start + p.len].copy_from_slice(&data[p.at..p.at + p.len]);
            self.seen += p.len;
        }
        self.held.push_back(buf);
        Ok(())
    }

    fn released(&mut self, out: &mut Vec<usize>, wait: bool) -> Result<()> {
        while self.held.len() > self.hold || (wait && !self.held.is_empty()) {
            let b = if self.lifo {
                self.held.pop_back()
            } else {
                self.held.pop_front()
            };
            out.extend(b);
            if wait {
                break;
            }
        }
        Ok(())
    }
}

/// Read `ranges` of `f` both ways and compare.
fn check(o: &Options, f: &std::fs::File, data: &[u8], ranges: &[(u64, usize)], c: &mut Copying) {
    let mut eng = Engine::new(o.clone()).unwrap();
    let st = eng
        .read_handed(f.as_raw_fd(), ranges, 256 << 10, c)
        .unwrap();
    assert!(c.held.is_empty(), "buffers still held after the read");
    let mut bufs: Vec<Vec<u8>> = ranges.iter().map(|&(_, n)| vec![0u8; n]).collect();
    let reqs: Vec<ReadReq> = ranges
        .iter()
        .zip(bufs.iter_mut())
        .map(|(&(offset, _), b)| ReadReq {
            offset,
            // SAFETY: `b` outlives the read and nothing else touches it.
            dst: unsafe { MutMemRef::new(b.as_mut_ptr(), b.len()) },
        })
        .collect();
    let want = eng.read_into_fd(f.as_raw_fd(), &reqs).unwrap();
    assert_eq!(st.crcs, want.crcs);
    for (i, &(off, n)) in ranges.iter().enumerate() {
        assert_eq!(
            &c.out[i][..],
            &data[off as usize..off as usize + n],
            "range {i}"
        );
        assert_eq!(st.crcs[i], crc32fast::hash(&c.out[i]));
    }
    assert_eq!(c.seen, ranges.iter().map(|r| r.1).sum::<usize>());
}

#[test]
fn every_byte_reaches_the_consumer_with_its_crc_on_every_back_end() {
    let (_d, f, data) = file_of(2 * 1024 * 1024 + 777);
    // Large ranges across many buffers, small ones sharing a buffer, gaps
    // skipped and read through, unaligned ends, one empty range.
    let ranges = [
        (0u64, 100usize),
        (4096, 1_000_000),
        (1_000_096 + 4096, 30),
        (1_100_000, 0),
        (1_200_001, 600_000),
        (2 * 1024 * 1024 + 1, 776),
    ];
    for o in combos() {
        for hold in [0, 2, NBUFS] {
            let mut c = Copying::new(&ranges.map(|r| r.1), hold);
            check(&o, &f, &data, &ranges, &mut c);
            let mut c = Copying::new(&ranges.map(|r| r.1), hold);
            c.lifo = true;
            check(&o, &f, &data, &ranges, &mut c);
        }
    }
}

#[test]
fn a_consumer_that_fails_stops_the_read_and_the_engine_reads_on() {
    let (_d, f, data) = file_of(1 << 20);
    let ranges = [(0u64, 1usize << 20)];
    for o in combos() {
        let mut eng = Engine::new(o.clone()).unwrap();
        let mut c = Copying::new(&[1 << 20], 2);
        c.fail_at = Some(3);
        let e = eng
            .read_handed(f.as_raw_fd(), &ranges, 0, &mut c)
            .unwrap_err();
        assert!(e.to_string().contains("the consumer gave up"), "{e}");
        // Every buffer is the engine's again: a full read works.
        let mut c = Copying::new(&[1 << 20], 0);
        let st = eng.read_handed(f.as_raw_fd(), &ranges, 0, &mut c).unwrap();
        assert_eq!(c.out[0], data);
        assert_eq!(st.crcs[0], crc32fast::hash(&data));
    }
}

/// Releases buffers it was never given, or none when asked to wait.
struct Misbehaving {
    stray: bool,
}

impl Consumer for Misbehaving {
    fn filled(&mut self, _: usize, _: usize, _: usize, _: &[ReadPiece]) -> Result<()> {
        Ok(())
    }

    fn released(&mut self, out: &mut Vec<usize>, _wait: bool) -> Result<()> {
        if self.stray {
            out.push(NBUFS + 5);
        }
        Ok(())
    }
}

#[test]
fn a_consumer_that_breaks_the_contract_gets_an_error_not_a_hang() {
    let (_d, f, _) = file_of(1 << 20);
    for o in combos() {
        let mut eng = Engine::new(o.clone()).unwrap();
        let e = eng
            .read_handed(
                f.as_raw_fd(),
                &[(0, 1 << 20)],
                0,
                &mut Misbehaving { stray: true },
            )
            .unwrap_err();
        assert!(e.to_string().contains("which it does not hold"), "{e}");
        assert_eq!(e.kind, fastpersist::ErrorKind::Internal);
        let e = eng
            .read_handed(
                f.as_raw_fd(),
                &[(0, 1 << 20)],
                0,
                &mut Misbehaving { stray: false },
            )
            .unwrap_err();
        assert!(e.to_string().contains("released none"), "{e}");
        assert_eq!(e.kind, fastpersist::ErrorKind::Internal);
    }
}

#[test]
fn a_failed_read_or_a_bad_range_is_an_error_naming_the_problem() {
    let (_d, f, data) = file_of(1 << 20);
    for o in combos() {
        let mut eng = Engine::new(o.clone()).unwrap();
        let mut c = Copying::new(&[100], 0);
        let e = eng
            .read_handed(f.as_raw_fd(), &[((1 << 20) - 50, 100)], 0, &mut c)
            .unwrap_err();
        assert!(e.to_string().contains("past the end of the file"), "{e}");
        eng.set_fault(
            Some(Fault {
                offset: 300_000,
                errno: libc::EIO,
            }),
            false,
        );
        let mut c = Copying::new(&[1 << 20], 1);
        let e = eng
            .read_handed(f.as_raw_fd(), &[(0, 1 << 20)], 0, &mut c)
            .unwrap_err();
        assert_eq!(e.errno, Some(libc::EIO), "{e}");
        eng.set_fault(None, false);
        let mut c = Copying::new(&[1 << 20], 1);
        eng.read_handed(f.as_raw_fd(), &[(0, 1 << 20)], 0, &mut c)
            .unwrap();
        assert_eq!(c.out[0], data);
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(32))]

    /// Any set of non-overlapping ranges, any hold and release order, any
    /// back end: the bytes and CRC32s of a read into memory.
    #[test]
    fn handed_reads_match_reads_into_memory(
        gaps in proptest::collection::vec((0u64..70_000, 0usize..300_000), 1..12),
        hold in 0usize..=NBUFS,
        lifo in proptest::bool::ANY,
        combo in 0usize..8,
        gap in proptest::sample::select(vec![0u64, 4096, 256 << 10]),
    ) {
        let mut ranges = vec![];
        let mut at = 0u64;
        for (g, n) in gaps {
            ranges.push((at + g, n));
            at += g + n as u64;
        }
        let (_d, f, data) = file_of(at as usize + 10);
        let o = &combos()[combo];
        let mut eng = Engine::new(o.clone()).unwrap();
        let mut c = Copying::new(&ranges.iter().map(|r| r.1).collect::<Vec<_>>(), hold);
        c.lifo = lifo;
        let st = eng.read_handed(f.as_raw_fd(), &ranges, gap, &mut c).unwrap();
        for (i, &(off, n)) in ranges.iter().enumerate() {
            proptest::prop_assert_eq!(&c.out[i][..], &data[off as usize..off as usize + n]);
            proptest::prop_assert_eq!(st.crcs[i], crc32fast::hash(&c.out[i]));
        }
    }
}
