//! Arena buffers the caller fills (`Engine::take_buffer` / `write_buffer`):
//! the same file as a gathered write, on every back end, and no buffer lost,
//! doubled or handed to anyone else while a caller holds it, whatever fails.

use fastpersist::{Engine, Fault, Options, Segment, Session, Source};
use std::path::Path;

const BUF: usize = 64 << 10;
const NBUFS: usize = 8;

/// An arena of `NBUFS` buffers of `BUF` bytes, 3 writes in flight.
fn opts(io_uring: bool, direct: bool) -> Options {
    Options {
        io_uring,
        direct,
        block_size: BUF,
        arena_bytes: BUF * NBUFS,
        queue_depth: 3,
        ..Options::default()
    }
}

fn combos() -> Vec<Options> {
    let mut v = vec![];
    for io_uring in [true, false] {
        for direct in [true, false] {
            v.push(opts(io_uring, direct));
        }
    }
    v
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i * 131 + seed as usize) as u8).collect()
}

fn bytes(offset: u64, b: &[u8], crc_id: Option<u32>) -> Segment {
    Segment {
        offset,
        source: Source::Bytes(b.to_vec()),
        crc_id,
    }
}

/// Write `data` at `offset` (checksum id 0) as the CUDA path does: held
/// buffers of at most `piece` bytes each, placed where their offset falls
/// in its block, the next one taken (and filled) before the previous one is
/// written.
fn stream(eng: &mut Engine, s: &mut Session, offset: u64, data: &[u8], piece: usize) {
    let block = s.block() as u64;
    let mut at = 0;
    let mut prev: Option<(usize, u64, usize)> = None;
    while at < data.len() || prev.is_some() {
        let next = if at < data.len() {
            let off = offset + at as u64;
            let into = (off % block) as usize;
            let n = piece.min(BUF - into).min(data.len() - at);
            let b = eng.take_buffer(s).unwrap();
            eng.held_buffer(s, b).unwrap()[into..into + n].copy_from_slice(&data[at..at + n]);
            at += n;
            Some((b, off, n))
        } else {
            None
        };
        if let Some((b, off, n)) = prev {
            eng.write_buffer(s, b, off, n, Some(0)).unwrap();
        }
        prev = next;
    }
}

/// Header, `data` at `offset`, its CRC slot, a trailer: the segments of the
/// one-shot write and the expected bytes.
fn whole_file(offset: u64, data: &[u8]) -> (Vec<u8>, u64) {
    let end = offset as usize + data.len();
    let mut expect = vec![0u8; end + 8];
    expect[..4].copy_from_slice(b"HEAD");
    expect[offset as usize..end].copy_from_slice(data);
    expect[end..end + 4].copy_from_slice(&crc32fast::hash(data).to_le_bytes());
    expect[end + 4..].copy_from_slice(b"TAIL");
    (expect, end as u64 + 8)
}

fn write_streamed(eng: &mut Engine, path: &Path, offset: u64, data: &[u8], piece: usize) -> u32 {
    let (_, len) = whole_file(offset, data);
    let mut s = eng.begin(path, 0).unwrap();
    eng.write(&mut s, vec![bytes(0, b"HEAD", None)]).unwrap();
    stream(eng, &mut s, offset, data, piece);
    let end = offset + data.len() as u64;
    let last = vec![
        Segment {
            offset: end,
            source: Source::Crc32(0),
            crc_id: None,
        },
        bytes(end + 4, b"TAIL", None),
    ];
    eng.finish(s, last, len).unwrap().crcs[0]
}

fn only(d: &Path) -> Vec<String> {
    std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

/// How many buffers a session can hold at once (all the engine lends).
fn lendable(eng: &mut Engine, path: &Path) -> usize {
    let mut s = eng.begin(path, 0).unwrap();
    let mut n = 0;
    while eng.take_buffer(&mut s).is_ok() {
        n += 1;
        assert!(n <= NBUFS);
    }
    eng.abort(s);
    n
}

#[test]
fn buffers_filled_in_place_make_the_gathered_file() {
    for opts in combos() {
        let d = tempfile::tempdir().unwrap();
        let mut eng = Engine::new(opts.clone()).unwrap();
        // Offsets on and off a block; sizes of less than a block, whole
        // buffers and odd tails; pieces of a whole buffer and of less.
        for (offset, n, piece) in [
            (4096u64, 3 * BUF + 1000, BUF),
            (4100, 10 * BUF, BUF - 4096),
            (8192, 300, BUF),
            (5000, 700, BUF),
            (64, 2 * BUF, 5000),
            (4096 * 3 + 17, 3000, 1),
            (4096 * 3 + 17, 5 * BUF, 7777),
        ] {
            let data = pattern(n, n as u8);
            let path = d.path().join("f");
            let crc = write_streamed(&mut eng, &path, offset, &data, piece);
            let (expect, _) = whole_file(offset, &data);
            assert_eq!(crc, crc32fast::hash(&data), "{opts:?} {offset} {n}");
            assert!(
                std::fs::read(&path).unwrap() == expect,
                "{opts:?} {offset} {n} {piece}"
            );
        }
        assert_eq!(only(d.path()), vec!["f"]);
        // Every buffer came back.
        assert_eq!(lendable(&mut eng, &d.path().join("g")), NBUFS - 2);
    }
}

#[test]
fn a_held_buffer_is_never_gathered_into() {
    for opts in combos() {
        let d = tempfile::tempdir().unwrap();
        let mut eng = Engine::new(opts.clone()).unwrap();
        let mut s = eng.begin(&d.path().join("f"), 0).unwrap();
        let b = eng.take_buffer(&mut s).unwrap();
        let mine = pattern(BUF, 7);
        eng.held_buffer(&s, b).unwrap().copy_from_slice(&mine);
        // A write of many buffers' worth goes through every free buffer.
        let other = pattern(5 * NBUFS * BUF, 9);
        eng.write(&mut s, vec![bytes(0, &other, None)]).unwrap();
        assert!(eng.held_buffer(&s, b).unwrap() == &mine[..], "{opts:?}");
        // And a failed write, which rebuilds the free list, leaves it held.
        eng.set_fault(
            Some(Fault {
                offset: other.len() as u64 + 10,
                errno: libc::EIO,
            }),
            false,
        );
        let more = bytes(other.len() as u64, &other, None);
        let err = eng
            .write(&mut s, vec![more])
            .and_then(|()| eng.finish(s, vec![], 2 * other.len() as u64).map(drop));
        assert_eq!(err.unwrap_err().errno, Some(libc::EIO), "{opts:?}");
        eng.set_fault(None, false);
        // The session is gone: its buffer came back, and only once.
        assert_eq!(lendable(&mut eng, &d.path().join("g")), NBUFS - 2);
        let data = pattern(3 * BUF, 3);
        let path = d.path().join("h");
        write_streamed(&mut eng, &path, 4096, &data, BUF);
        assert!(std::fs::read(&path).unwrap() == whole_file(4096, &data).0);
    }
}

#[test]
fn misuse_is_refused_and_loses_no_buffer() {
    let d = tempfile::tempdir().unwrap();
    let mut eng = Engine::new(combos()[0].clone()).unwrap();
    let mut s = eng.begin(&d.path().join("f"), 0).unwrap();
    let block = s.block() as u64;
    eng.write(
        &mut s,
        vec![bytes(0, &pattern(3 * block as usize, 1), None)],
    )
    .unwrap();
    let refused = [
        (block, 100, "before the end"),
        (4 * block, 0, "1 to"),
        (4 * block, BUF + 1, "1 to"),
        (4 * block + 100, BUF - 99, "100 bytes into it"),
    ];
    for (off, n, why) in refused {
        let b = eng.take_buffer(&mut s).unwrap();
        let e = eng.write_buffer(&mut s, b, off, n, None).unwrap_err();
        assert!(e.to_string().contains(why), "{e}");
        // The buffer went back; the session goes on.
        assert!(eng.held_buffer(&s, b).is_err());
        let e = eng
            .write_buffer(&mut s, b, 4 * block, 10, None)
            .unwrap_err();
        assert!(e.to_string().contains("not held"), "{e}");
        let b2 = eng.take_buffer(&mut s).unwrap();
        eng.give_back(&s, b2).unwrap();
        assert!(eng.give_back(&s, b2).is_err(), "given back twice");
    }
    // Another session cannot write, fill or give back this one's buffer.
    let b = eng.take_buffer(&mut s).unwrap();
    let mut other = eng.begin(&d.path().join("g"), 0).unwrap();
    assert!(eng.held_buffer(&other, b).is_err());
    assert!(eng.give_back(&other, b).is_err());
    assert!(eng.write_buffer(&mut other, b, 0, 10, None).is_err());
    eng.abort(other);
    eng.give_back(&s, b).unwrap();
    // The engine keeps two buffers for itself.
    let mut held = vec![];
    while let Ok(b) = eng.take_buffer(&mut s) {
        held.push(b);
    }
    assert_eq!(held.len(), NBUFS - 2);
    let e = eng.take_buffer(&mut s).unwrap_err();
    assert!(e.to_string().contains("keeps 2"), "{e}");
    // A dropped session's buffers come back.
    drop(s);
    assert_eq!(lendable(&mut eng, &d.path().join("h")), NBUFS - 2);
    assert!(only(d.path()).is_empty());
    // A layout the head of a buffer's block cannot be made of fails the
    // session, and the buffer still comes back (three times: the engine's
    // own two would hide one lost buffer).
    for _ in 0..3 {
        let mut s = eng.begin(&d.path().join("i"), 0).unwrap();
        let bad = Segment {
            offset: 10,
            source: Source::Crc32(0),
            crc_id: Some(1),
        };
        eng.write(&mut s, vec![bad]).unwrap(); // less than a block: not laid out yet
        let b = eng.take_buffer(&mut s).unwrap();
        let e = eng.write_buffer(&mut s, b, 100, 10, None).unwrap_err();
        assert!(
            e.to_string().contains("cannot itself be checksummed"),
            "{e}"
        );
        assert!(
            eng.take_buffer(&mut s).is_err(),
            "a failed session lends nothing"
        );
        eng.abort(s);
    }
    let mut fresh = eng.begin(&d.path().join("j"), 0).unwrap();
    let mut lent = 0;
    while eng.take_buffer(&mut fresh).is_ok() {
        lent += 1;
    }
    assert_eq!(lent, NBUFS - 2, "the failed write's buffer was lost");
}

#[test]
fn a_failed_buffer_write_keeps_the_old_file() {
    for mut opts in combos() {
        opts.fault = Some(Fault {
            offset: 4096 + 2 * BUF as u64 + 5,
            errno: libc::EIO,
        });
        let d = tempfile::tempdir().unwrap();
        let target = d.path().join("ckpt");
        std::fs::write(&target, b"previous").unwrap();
        let mut eng = Engine::new(opts.clone()).unwrap();
        let data = pattern(6 * BUF, 4);
        let mut s = eng.begin(&target, 0).unwrap();
        eng.write(&mut s, vec![bytes(0, b"HEAD", None)]).unwrap();
        let mut failed = None;
        let mut at = 0;
        while at < data.len() {
            let b = eng.take_buffer(&mut s);
            let b = match b {
                Ok(b) => b,
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            };
            eng.held_buffer(&s, b).unwrap()[..BUF].copy_from_slice(&data[at..at + BUF]);
            if let Err(e) = eng.write_buffer(&mut s, b, 4096 + at as u64, BUF, Some(0)) {
                failed = Some(e);
                break;
            }
            at += BUF;
        }
        let e = match failed {
            Some(e) => {
                eng.abort(s);
                e
            }
            None => eng.finish(s, vec![], 4096 + data.len() as u64).unwrap_err(),
        };
        assert_eq!(e.errno, Some(libc::EIO), "{opts:?}");
        assert_eq!(std::fs::read(&target).unwrap(), b"previous");
        eng.set_fault(None, false);
        assert_eq!(lendable(&mut eng, &d.path().join("g")), NBUFS - 2);
        write_streamed(&mut eng, &target, 4096, &data, BUF);
        assert!(std::fs::read(&target).unwrap() == whole_file(4096, &data).0);
        assert_eq!(only(d.path()), vec!["ckpt"]);
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(32))]

    /// Any mix of records written through held buffers (pieces of any size,
    /// any offset) and records written as bytes, with gaps between them and
    /// each record's CRC32 slot after it, makes the file a one-shot write of
    /// the same bytes makes, whatever the back end and O_DIRECT block.
    #[test]
    fn any_mix_of_held_and_given_records_makes_the_same_file(
        recs in proptest::collection::vec(
            (0u64..10_000, 1usize..200_000, proptest::bool::weighted(0.7), 1usize..100_000),
            1..8,
        ),
        seed in 0u8..255,
        io_uring in proptest::bool::ANY,
        direct in proptest::bool::ANY,
        big_block in proptest::bool::ANY,
    ) {
        let d = tempfile::tempdir().unwrap();
        let mut eng = Engine::new(opts(io_uring, direct)).unwrap();
        if big_block {
            eng.set_min_block(Some(16384)).unwrap();
        }
        let mut s = eng.begin(&d.path().join("f"), 0).unwrap();
        let mut expect = vec![];
        let mut segs = vec![];
        for (i, &(gap, n, held, piece)) in recs.iter().enumerate() {
            let id = i as u32;
            let off = expect.len() as u64 + gap;
            let data = pattern(n, seed.wrapping_add(i as u8));
            expect.resize(off as usize, 0);
            expect.extend_from_slice(&data);
            expect.extend_from_slice(&crc32fast::hash(&data).to_le_bytes());
            let end = off + n as u64;
            let slot = Segment { offset: end, source: Source::Crc32(id), crc_id: None };
            if held {
                stream_id(&mut eng, &mut s, off, &data, piece, id);
                eng.write(&mut s, vec![slot.clone()]).unwrap();
            } else {
                eng.write(&mut s, vec![bytes(off, &data, Some(id)), slot.clone()]).unwrap();
            }
            segs.push(bytes(off, &data, Some(id)));
            segs.push(slot);
        }
        let len = expect.len() as u64;
        let st = eng.finish(s, vec![], len).unwrap();
        proptest::prop_assert!(std::fs::read(d.path().join("f")).unwrap() == expect);
        // The same bytes written in one shot.
        let one = eng.write_file(&d.path().join("g"), segs, len).unwrap();
        proptest::prop_assert_eq!(st.crcs, one.crcs);
        proptest::prop_assert!(std::fs::read(d.path().join("g")).unwrap() == expect);
        proptest::prop_assert_eq!(lendable(&mut eng, &d.path().join("h")), NBUFS - 2);
    }
}

/// [`stream`] into checksum `id`.
fn stream_id(eng: &mut Engine, s: &mut Session, offset: u64, data: &[u8], piece: usize, id: u32) {
    let block = s.block() as u64;
    let mut at = 0;
    while at < data.len() {
        let off = offset + at as u64;
        let into = (off % block) as usize;
        let n = piece.min(BUF - into).min(data.len() - at);
        let b = eng.take_buffer(s).unwrap();
        eng.held_buffer(s, b).unwrap()[into..into + n].copy_from_slice(&data[at..at + n]);
        eng.write_buffer(s, b, off, n, Some(id)).unwrap();
        at += n;
    }
}

#[test]
fn a_buffer_write_never_takes_another_sessions_writes_for_its_own() {
    // Session A leaves a write in flight that fails (32 MiB: still in
    // flight when its call returns); session B's buffer write (inside its
    // first block: no earlier blocks to write) must not count A's write as
    // its own. A fails, B commits.
    const BIG: usize = 32 << 20;
    let d = tempfile::tempdir().unwrap();
    let mut eng = Engine::new(Options {
        block_size: BIG,
        arena_bytes: 4 * BIG,
        ..Options::default()
    })
    .unwrap();
    eng.set_fault(
        Some(Fault {
            offset: BIG as u64 / 2,
            errno: libc::EIO,
        }),
        false,
    );
    let mut a = eng.begin(&d.path().join("a"), 0).unwrap();
    let mut b = eng.begin(&d.path().join("b"), 0).unwrap();
    let kb = eng.take_buffer(&mut b).unwrap();
    let ka = eng.take_buffer(&mut a).unwrap();
    eng.held_buffer(&a, ka).unwrap().fill(0x41);
    eng.write_buffer(&mut a, ka, 0, BIG, Some(0)).unwrap();
    let data = pattern(100, 2);
    eng.held_buffer(&b, kb).unwrap()[..100].copy_from_slice(&data);
    eng.write_buffer(&mut b, kb, 0, 100, Some(0)).unwrap();
    let ea = eng.finish(a, vec![], BIG as u64);
    assert_eq!(ea.map(drop).unwrap_err().errno, Some(libc::EIO));
    eng.finish(b, vec![], 100).unwrap();
    assert_eq!(std::fs::read(d.path().join("b")).unwrap(), data);
    assert!(!d.path().join("a").exists());
}
