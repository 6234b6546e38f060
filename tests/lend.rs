//! Writes straight from caller memory (`Options::zero_copy`): the same file
//! as a gathered write, only for memory no guard watches, and the ids of
//! those writes never lost or doubled, whatever fails or interleaves.

use fastpersist::{Engine, Fault, MemRef, Options, Segment, Session, Source};

fn combos() -> Vec<Options> {
    let mut v = vec![];
    for io_uring in [true, false] {
        for direct in [true, false] {
            for gather_threads in [1, 3] {
                v.push(Options {
                    io_uring,
                    direct,
                    block_size: 64 << 10,
                    arena_bytes: 256 << 10,
                    queue_depth: 3,
                    gather_threads,
                    ..Options::default()
                });
            }
        }
    }
    v
}

/// `n` bytes of a pattern at a page-aligned address inside `store`.
fn aligned(store: &mut Vec<u8>, n: usize, seed: u8) -> &mut [u8] {
    *store = vec![0u8; n + 4096];
    let off = store.as_ptr().align_offset(4096);
    let s = &mut store[off..off + n];
    for (i, b) in s.iter_mut().enumerate() {
        *b = (i * 131 + seed as usize) as u8;
    }
    s
}

/// Header bytes, then `mem` at file offset 4096 (page-aligned in memory
/// as in the file) with its CRC slot after it, then a trailer of bytes.
fn file_of(mem: &[u8]) -> (Vec<Segment>, Vec<u8>, u64) {
    // SAFETY: every test keeps `mem` alive and unchanged while the
    // segments are in use.
    let m = unsafe { MemRef::new(mem.as_ptr(), mem.len()) };
    let end = 4096 + mem.len() as u64;
    let crc = crc32fast::hash(mem).to_le_bytes();
    let segs = vec![
        Segment {
            offset: 0,
            source: Source::Bytes(b"HEAD".to_vec()),
            crc_id: None,
        },
        Segment {
            offset: 4096,
            source: Source::Mem(m),
            crc_id: Some(0),
        },
        Segment {
            offset: end,
            source: Source::Crc32(0),
            crc_id: None,
        },
        Segment {
            offset: end + 4,
            source: Source::Bytes(b"TAIL".to_vec()),
            crc_id: None,
        },
    ];
    let mut expect = vec![0u8; (end + 8) as usize];
    expect[..4].copy_from_slice(b"HEAD");
    expect[4096..end as usize].copy_from_slice(mem);
    expect[end as usize..end as usize + 4].copy_from_slice(&crc);
    expect[end as usize + 4..].copy_from_slice(b"TAIL");
    (segs, expect, end + 8)
}

/// Bytes written from the memory at `[4096, 4096+n)`, whose end is less
/// than 512 bytes past a page: its whole pages, when they span at least one
/// extent of `block` (the engine cuts its extents where they begin and end,
/// whatever the file's O_DIRECT block up to a page); else the extents of
/// `block` that lie inside it.
fn lendable_bytes(n: usize, block: u64) -> u64 {
    assert!(n % 4096 < 512);
    let whole = n as u64 / 4096 * 4096;
    if whole >= block {
        return whole;
    }
    let first = 4096u64.div_ceil(block) * block;
    let last = (4096 + n as u64) / block * block;
    last.saturating_sub(first)
}

#[test]
fn lent_and_gathered_writes_make_the_same_file() {
    let d = tempfile::tempdir().unwrap();
    let mut store = vec![];
    let mem = aligned(&mut store, (1 << 20) + 123, 7);
    // Extents of 64 KiB (the memory's whole pages are lent) and of 2 MiB
    // (more than the memory: nothing is lent, every extent is gathered).
    for (opts, block) in combos()
        .into_iter()
        .flat_map(|o| [(o.clone(), 64 << 10), (o, 2 << 20)])
    {
        for zero_copy in [true, false] {
            let o = Options {
                zero_copy,
                block_size: block,
                arena_bytes: 4 * block,
                ..opts.clone()
            };
            let p = d.path().join("z.bin");
            let (segs, expect, len) = file_of(mem);
            let mut eng = Engine::new(o.clone()).unwrap();
            let st = eng.write_file(&p, segs, len).unwrap();
            assert!(std::fs::read(&p).unwrap() == expect, "{o:?}");
            assert_eq!(st.crcs, vec![crc32fast::hash(mem)], "{o:?}");
            let want = if zero_copy {
                lendable_bytes(mem.len(), o.block_size as u64)
            } else {
                0
            };
            assert_eq!(st.zero_copy_bytes, want, "{o:?}");
        }
    }
}

struct Noop;

impl fastpersist::GatherGuard for Noop {
    fn lock(&mut self) -> fastpersist::Result<()> {
        Ok(())
    }
    fn check(&mut self, _crc_id: u32) -> fastpersist::Result<()> {
        Ok(())
    }
    fn unlock(&mut self) {}
}

#[test]
fn guarded_memory_is_never_lent() {
    // The runtime behind a guard may free its memory whenever the guard is
    // given back, which the engine does while the device works: such memory
    // is read only under the guard (see also `tests/engine.rs`, whose
    // scribbling guard writes garbage whenever it is not held).
    let d = tempfile::tempdir().unwrap();
    let mut store = vec![];
    let mem = aligned(&mut store, 1 << 20, 3);
    for opts in combos() {
        let p = d.path().join("g.bin");
        let (segs, expect, len) = file_of(mem);
        let mut eng = Engine::new(opts.clone()).unwrap();
        let st = fastpersist::with_guard(Box::new(Noop), || eng.write_file(&p, segs, len)).unwrap();
        assert!(std::fs::read(&p).unwrap() == expect, "{opts:?}");
        assert_eq!(st.zero_copy_bytes, 0, "{opts:?}");
    }
}

#[test]
fn a_failed_lent_write_fails_the_save_and_loses_no_id() {
    let d = tempfile::tempdir().unwrap();
    let mut store = vec![];
    let mem = aligned(&mut store, 1 << 20, 9);
    for opts in combos() {
        let mut eng = Engine::new(opts.clone()).unwrap();
        let p = d.path().join("f.bin");
        let _ = std::fs::remove_file(&p);
        // A lent extent: the third block of the memory.
        let fault = Fault {
            offset: 3 * opts.block_size as u64 + 17,
            errno: libc::EIO,
        };
        eng.set_fault(Some(fault), false);
        let (segs, _, len) = file_of(mem);
        let e = eng.write_file(&p, segs, len).unwrap_err();
        assert_eq!(e.errno, Some(libc::EIO), "{opts:?}");
        assert!(!p.exists(), "{opts:?}");
        eng.set_fault(None, false);
        // Every id came back: as many bytes are lent, save after save.
        for _ in 0..5 {
            let (segs, expect, len) = file_of(mem);
            let st = eng.write_file(&p, segs, len).unwrap();
            assert!(std::fs::read(&p).unwrap() == expect, "{opts:?}");
            assert_eq!(
                st.zero_copy_bytes,
                lendable_bytes(mem.len(), opts.block_size as u64),
                "{opts:?}"
            );
        }
    }
}

/// Begin a streamed save of `p` and write `ma` at 4096 in one call, lent
/// or (`lend` false) gathered; later calls lend again.
fn begin_with_first(eng: &mut Engine, p: &std::path::Path, ma: MemRef, lend: bool) -> Session {
    let mut s = eng.begin(p, 3 << 20).unwrap();
    s.set_lending(lend);
    eng.write(
        &mut s,
        vec![Segment {
            offset: 4096,
            source: Source::Mem(ma),
            crc_id: Some(0),
        }],
    )
    .unwrap();
    s.set_lending(true);
    s
}

/// Finish a streamed save whose first 1 MiB memory (`first`, as it was
/// given) lies at 4096 with `second` after it (`mb`, 64 KiB apart); check
/// the file's bytes and CRCs, and return the bytes written from memory.
fn finish_with_second(
    eng: &mut Engine,
    s: Session,
    p: &std::path::Path,
    mb: MemRef,
    first: &[u8],
    second: &[u8],
    opts: &Options,
) -> u64 {
    let n = first.len() as u64;
    let at = 4096 + n + (64 << 10);
    let st = eng
        .finish(
            s,
            vec![Segment {
                offset: at,
                source: Source::Mem(mb),
                crc_id: Some(1),
            }],
            at + second.len() as u64,
        )
        .unwrap();
    let got = std::fs::read(p).unwrap();
    assert!(got[4096..4096 + n as usize] == *first, "{opts:?}");
    assert!(got[at as usize..] == *second, "{opts:?}");
    assert_eq!(
        st.crcs,
        vec![crc32fast::hash(first), crc32fast::hash(second)],
        "{opts:?}"
    );
    st.zero_copy_bytes
}

#[test]
fn streamed_saves_lend_across_calls_and_other_uses_of_the_engine() {
    // A streamed save's lent writes complete before each call returns: the
    // memory handed to a call may be reused afterwards (a staging slot
    // refilled), and here is scribbled over; other writes stay in flight,
    // and a read on the same engine in between waits for them. The save
    // still commits the right bytes, and save after save lends as much as
    // the first (no lent id is lost).
    let d = tempfile::tempdir().unwrap();
    let mut s1 = vec![];
    let mut s2 = vec![];
    let first_ptr = aligned(&mut s1, 1 << 20, 1).as_mut_ptr();
    // SAFETY: `s1` is not touched again but through this slice and the
    // pointer, which the test uses only where no write of it is in flight.
    let first = unsafe { std::slice::from_raw_parts(first_ptr, 1 << 20) };
    let first_copy = first.to_vec();
    let second_mem = aligned(&mut s2, 1 << 20, 2);
    let other = d.path().join("other.bin");
    std::fs::write(&other, vec![5u8; 200_000]).unwrap();
    for opts in combos() {
        let mut eng = Engine::new(opts.clone()).unwrap();
        let mut lent = vec![];
        for _ in 0..3 {
            let p = d.path().join("s.bin");
            // SAFETY: both memories outlive the session and stay unchanged.
            let (ma, mb) = unsafe {
                (
                    MemRef::new(first.as_ptr(), first.len()),
                    MemRef::new(second_mem.as_ptr(), second_mem.len()),
                )
            };
            let s = begin_with_first(&mut eng, &p, ma, true);
            // SAFETY: the write of this memory has returned (see above).
            unsafe { std::ptr::write_bytes(first_ptr, 0xEE, 1 << 20) };
            let mut buf = vec![0u8; 100_000];
            let reqs = vec![fastpersist::ReadReq {
                offset: 4096,
                // SAFETY: `buf` outlives the read and is not touched meanwhile.
                dst: unsafe { fastpersist::MutMemRef::new(buf.as_mut_ptr(), buf.len()) },
            }];
            eng.read_into(&other, &reqs).unwrap();
            assert!(buf.iter().all(|&x| x == 5));
            lent.push(finish_with_second(
                &mut eng,
                s,
                &p,
                mb,
                &first_copy,
                second_mem,
                &opts,
            ));
            // SAFETY: the session is finished; nothing reads the memory.
            unsafe { std::ptr::copy_nonoverlapping(first_copy.as_ptr(), first_ptr, 1 << 20) };
        }
        assert!(lent[0] > 0, "{opts:?}");
        assert!(lent.iter().all(|&x| x == lent[0]), "{lent:?} {opts:?}");
    }
}

#[test]
fn a_session_told_not_to_lend_gathers_those_writes_and_lends_the_rest() {
    // `Session::set_lending(false)` (staged device chunks): the memory of
    // those calls is copied into the arena, whatever `zero_copy` says, and
    // may be scribbled over once the call returns, like lent memory; a
    // later call that lends again does. The same save with lending left on
    // lends both memories.
    let d = tempfile::tempdir().unwrap();
    let mut s1 = vec![];
    let mut s2 = vec![];
    let first = aligned(&mut s1, 1 << 20, 3);
    let first_copy = first.to_vec();
    let second = aligned(&mut s2, 1 << 20, 4);
    let n = first.len() as u64;
    for opts in combos() {
        let mut eng = Engine::new(opts.clone()).unwrap();
        let mut lent = vec![];
        for lend_first in [false, true] {
            let p = d.path().join("g.bin");
            // SAFETY: both memories outlive the session; the first is
            // changed only after the call that was given it has returned.
            let (ma, mb) = unsafe {
                (
                    MemRef::new(first.as_ptr(), first.len()),
                    MemRef::new(second.as_ptr(), second.len()),
                )
            };
            let s = begin_with_first(&mut eng, &p, ma, lend_first);
            first.fill(0xEE);
            lent.push(finish_with_second(
                &mut eng,
                s,
                &p,
                mb,
                &first_copy,
                second,
                &opts,
            ));
            first.copy_from_slice(&first_copy);
        }
        let block = opts.block_size as u64;
        // Gathered first: only (most of) the second memory is lent; lent
        // first: (most of) the first memory too.
        assert!(lent[0] > 0 && lent[0] <= n, "{lent:?} {opts:?}");
        assert!(lent[1] >= lent[0] + n - 2 * block, "{lent:?} {opts:?}");
    }
}
