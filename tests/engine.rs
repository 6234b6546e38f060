//! End-to-end tests of the write engine on the real file system, on every
//! back-end combination (io_uring / pwrite pool, O_DIRECT / buffered).

use fastpersist::{Engine, Fault, MemRef, Options, Segment, Source};
use std::path::Path;

fn combos() -> Vec<Options> {
    let mut v = vec![];
    for io_uring in [true, false] {
        for direct in [true, false] {
            for register_buffers in [true, false] {
                // One gather thread (on the caller) and three workers.
                for gather_threads in [1, 3] {
                    v.push(Options {
                        io_uring,
                        direct,
                        register_buffers,
                        block_size: 64 << 10,
                        arena_bytes: 256 << 10,
                        queue_depth: 3,
                        gather_threads,
                        ..Options::default()
                    });
                }
            }
        }
    }
    v
}

/// A file made of a header, a big memory region with its CRC slot after it,
/// an odd-sized memory region, and a trailer; returns (segments, expected bytes).
fn sample(big: &[u8], odd: &[u8]) -> (Vec<Segment>, Vec<u8>, u64) {
    let mut expect = vec![0u8; 0];
    let mut segs = vec![];
    let mut put = |off: u64, src: Source, crc: Option<u32>, bytes: &[u8]| {
        segs.push(Segment {
            offset: off,
            source: src,
            crc_id: crc,
        });
        let end = off as usize + bytes.len();
        if expect.len() < end {
            expect.resize(end, 0);
        }
        expect[off as usize..end].copy_from_slice(bytes);
    };
    put(0, Source::Bytes(b"HEAD".to_vec()), None, b"HEAD");
    // SAFETY: `big` and `odd` outlive every use of the segments in the tests.
    let (bm, om) = unsafe {
        (
            MemRef::new(big.as_ptr(), big.len()),
            MemRef::new(odd.as_ptr(), odd.len()),
        )
    };
    put(4096, Source::Mem(bm), Some(0), big);
    let after_big = 4096 + big.len() as u64;
    put(
        after_big,
        Source::Crc32(0),
        None,
        &crc32fast::hash(big).to_le_bytes(),
    );
    let odd_at = after_big + 4 + 13;
    put(odd_at, Source::Mem(om), Some(1), odd);
    let tail_at = odd_at + odd.len() as u64;
    put(
        tail_at,
        Source::Crc32(1),
        None,
        &crc32fast::hash(odd).to_le_bytes(),
    );
    put(
        tail_at + 4,
        Source::Crc32(0),
        None,
        &crc32fast::hash(big).to_le_bytes(),
    );
    let file_len = tail_at + 8 + 3; // three trailing zeros
    expect.resize(file_len as usize, 0);
    (segs, expect, file_len)
}

/// One read request per `(offset, _)` range, into the buffer of the same
/// index. The buffers must outlive the reads and not be touched during them.
fn read_requests(ranges: &[(u64, usize)], bufs: &mut [Vec<u8>]) -> Vec<fastpersist::ReadReq> {
    ranges
        .iter()
        .zip(bufs.iter_mut())
        .map(|(&(offset, _), b)| fastpersist::ReadReq {
            offset,
            // SAFETY: the caller keeps each buffer alive and untouched until
            // the reads that use these requests have returned.
            dst: unsafe { fastpersist::MutMemRef::new(b.as_mut_ptr(), b.len()) },
        })
        .collect()
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i * 131 + seed as usize) as u8).collect()
}

#[test]
fn writes_exact_bytes_on_every_backend() {
    let big = pattern(1_000_003, 7);
    let odd = pattern(70_001, 9);
    for opts in combos() {
        let d = tempfile::tempdir().unwrap();
        let target = d.path().join("out.bin");
        std::fs::write(&target, vec![0xEEu8; 3_000_000]).unwrap(); // older, larger file
        let (segs, expect, len) = sample(&big, &odd);
        let mut eng = Engine::new(opts.clone()).unwrap();
        let st = eng.write_file(&target, segs, len).unwrap();
        let got = std::fs::read(&target).unwrap();
        assert_eq!(got.len(), expect.len(), "{opts:?}");
        assert!(got == expect, "content differs for {opts:?}");
        assert_eq!(st.bytes, len);
        assert_eq!(st.io_uring, opts.io_uring);
        assert_eq!(st.crcs, vec![crc32fast::hash(&big), crc32fast::hash(&odd)]);
        if !opts.direct {
            assert!(!st.direct);
        }
        // Reuse the engine for a second file.
        let (segs, expect, len) = sample(&big, &odd);
        eng.write_file(&d.path().join("again.bin"), segs, len)
            .unwrap();
        assert!(std::fs::read(d.path().join("again.bin")).unwrap() == expect);
        assert_eq!(
            std::fs::read_dir(d.path()).unwrap().count(),
            2,
            "stray files"
        );
    }
}

#[test]
fn empty_and_tiny_files() {
    let d = tempfile::tempdir().unwrap();
    let mut eng = Engine::new(Options::default()).unwrap();
    eng.write_file(&d.path().join("empty"), vec![], 0).unwrap();
    assert_eq!(std::fs::read(d.path().join("empty")).unwrap().len(), 0);
    let segs = vec![Segment {
        offset: 1,
        source: Source::Bytes(vec![5]),
        crc_id: None,
    }];
    eng.write_file(&d.path().join("tiny"), segs, 2).unwrap();
    assert_eq!(std::fs::read(d.path().join("tiny")).unwrap(), vec![0, 5]);
}

fn only(d: &Path) -> Vec<String> {
    std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

#[test]
fn injected_eio_keeps_old_file_and_leaves_no_temp() {
    let big = pattern(900_000, 1);
    let odd = pattern(10, 2);
    for mut opts in combos() {
        opts.fault = Some(Fault {
            offset: 300_000,
            errno: libc::EIO,
        });
        let d = tempfile::tempdir().unwrap();
        let target = d.path().join("ckpt");
        std::fs::write(&target, b"previous").unwrap();
        let (segs, _, len) = sample(&big, &odd);
        let mut eng = Engine::new(opts.clone()).unwrap();
        let e = eng.write_file(&target, segs, len).unwrap_err();
        assert_eq!(e.errno, Some(libc::EIO), "{opts:?}");
        assert!(e.to_string().contains("offset"), "{e}");
        assert_eq!(std::fs::read(&target).unwrap(), b"previous");
        assert_eq!(only(d.path()), vec!["ckpt"]);
        // The engine is still usable after the failure.
        eng.set_fault(None, false);
        let (segs, expect, len) = sample(&big, &odd);
        eng.write_file(&target, segs, len).unwrap();
        assert!(std::fs::read(&target).unwrap() == expect);
    }
}

#[test]
fn refused_direct_falls_back_to_buffered() {
    let big = pattern(500_000, 3);
    let odd = pattern(99, 4);
    let d = tempfile::tempdir().unwrap();
    let mut eng = Engine::new(Options::default()).unwrap();
    eng.set_fault(None, true);
    let (segs, expect, len) = sample(&big, &odd);
    let st = eng.write_file(&d.path().join("f"), segs, len).unwrap();
    assert!(!st.direct);
    assert!(st.direct_note.unwrap().contains("refused"));
    assert!(std::fs::read(d.path().join("f")).unwrap() == expect);
}

#[test]
fn missing_directory_is_enoent_with_path() {
    let mut eng = Engine::new(Options::default()).unwrap();
    let e = eng
        .write_file(Path::new("/nonexistent-dir/x.pt"), vec![], 10)
        .unwrap_err();
    assert_eq!(e.errno, Some(libc::ENOENT));
    assert!(e.to_string().contains("/nonexistent-dir"), "{e}");
}

#[test]
fn bad_options_are_rejected() {
    for o in [
        Options {
            block_size: 1000,
            ..Options::default()
        },
        Options {
            arena_bytes: 4096,
            ..Options::default()
        },
        Options {
            queue_depth: 0,
            ..Options::default()
        },
    ] {
        assert!(Engine::new(o).is_err());
    }
}

#[test]
fn streamed_session_equals_one_shot() {
    let big = pattern(2_000_000, 5);
    let odd = pattern(33_333, 6);
    for opts in combos() {
        let d = tempfile::tempdir().unwrap();
        let (segs, expect, len) = sample(&big, &odd);
        let mut eng = Engine::new(opts.clone()).unwrap();
        let mut s = eng.begin(&d.path().join("s.bin"), 1 << 20).unwrap();
        let mut segs = segs;
        segs.sort_by_key(|s| s.offset);
        let tail = segs.split_off(3);
        let head = segs.split_off(1);
        eng.write(&mut s, segs).unwrap();
        eng.write(&mut s, head).unwrap();
        assert!(s.written() > 0 && s.written() % s.block() as u64 == 0);
        // Going back before what was given is refused.
        let back = vec![Segment {
            offset: 0,
            source: Source::Bytes(vec![1]),
            crc_id: None,
        }];
        assert!(eng.write(&mut s, back).is_err());
        let st = eng.finish(s, tail, len).unwrap();
        assert_eq!(st.crcs, vec![crc32fast::hash(&big), crc32fast::hash(&odd)]);
        assert!(
            std::fs::read(d.path().join("s.bin")).unwrap() == expect,
            "{opts:?}"
        );
    }
}

#[test]
fn a_session_reserves_the_rest_once_it_knows_it() {
    use std::os::unix::fs::MetadataExt;
    let big = pattern(3_000_000, 9);
    let d = tempfile::tempdir().unwrap();
    let target = d.path().join("r.bin");
    let mut eng = Engine::new(Options::default()).unwrap();
    let mut s = eng.begin(&target, 4096).unwrap();
    let temp = || d.path().join(&only(d.path())[0]);
    let (first, rest) = big.split_at(1 << 20);
    let seg = |offset: u64, b: &[u8]| Segment {
        offset,
        source: Source::Bytes(b.to_vec()),
        crc_id: None,
    };
    eng.write(&mut s, vec![seg(0, first)]).unwrap();
    s.reserve(big.len() as u64).unwrap();
    // Reserved on disk (a file system without fallocate reserves nothing;
    // this test's directory is on one with it, or on tmpfs, where only the
    // free space is checked).
    let blocks = std::fs::metadata(temp()).unwrap().blocks() * 512;
    assert!(
        blocks >= big.len() as u64 || fastpersist::commit::fallocate_zero_fills(d.path()).unwrap(),
        "{blocks} bytes reserved"
    );
    // Less than what is reserved, or all of it again: nothing to do.
    s.reserve(10).unwrap();
    s.reserve(big.len() as u64).unwrap();
    let e = s.reserve(u64::MAX).unwrap_err();
    assert!(e.to_string().contains("cannot reserve"), "{e}");
    eng.write(&mut s, vec![seg(first.len() as u64, rest)])
        .unwrap();
    eng.finish(s, vec![], big.len() as u64).unwrap();
    assert!(std::fs::read(&target).unwrap() == big);
    assert_eq!(only(d.path()), vec!["r.bin".to_string()]);
}

#[test]
fn dropped_session_leaves_nothing() {
    let d = tempfile::tempdir().unwrap();
    let mut eng = Engine::new(Options::default()).unwrap();
    let big = pattern(1_000_000, 1);
    // SAFETY: `big` outlives the session.
    let m = unsafe { MemRef::new(big.as_ptr(), big.len()) };
    let mut s = eng.begin(&d.path().join("x"), 0).unwrap();
    eng.write(
        &mut s,
        vec![Segment {
            offset: 0,
            source: Source::Mem(m),
            crc_id: None,
        }],
    )
    .unwrap();
    drop(s);
    assert!(only(d.path()).is_empty());
}

#[test]
fn reads_records_back_on_every_backend() {
    let big = pattern(3_000_001, 8);
    let odd = pattern(12_345, 9);
    for opts in combos() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("r.bin");
        let (segs, expect, len) = sample(&big, &odd);
        let mut eng = Engine::new(opts.clone()).unwrap();
        eng.write_file(&p, segs, len).unwrap();
        // Three records: the big one, the odd one, and the last 7 bytes.
        let ranges = [
            (4096u64, big.len()),
            (4096 + big.len() as u64 + 17, odd.len()),
            (len - 7, 7),
        ];
        let mut bufs: Vec<Vec<u8>> = ranges.iter().map(|&(_, n)| vec![0xAB; n]).collect();
        let reqs = read_requests(&ranges, &mut bufs);
        let st = eng.read_into(&p, &reqs).unwrap();
        for (&(off, n), b) in ranges.iter().zip(&bufs) {
            assert!(b[..] == expect[off as usize..off as usize + n], "{opts:?}");
        }
        assert_eq!(st.crcs[0], crc32fast::hash(&big));
        assert_eq!(st.crcs[1], crc32fast::hash(&odd));
        assert_eq!(st.file_len, len);
    }
}

#[test]
fn read_past_end_and_overlap_are_refused() {
    use fastpersist::{MutMemRef, ReadReq};
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("r.bin");
    std::fs::write(&p, vec![1u8; 10_000]).unwrap();
    let mut eng = Engine::new(Options::default()).unwrap();
    let mut buf_a = vec![0u8; 100];
    let mut buf_b = vec![0u8; 100];
    // SAFETY: buffers outlive the calls.
    let (ra, rb) = unsafe {
        (
            MutMemRef::new(buf_a.as_mut_ptr(), 100),
            MutMemRef::new(buf_b.as_mut_ptr(), 100),
        )
    };
    let e = eng
        .read_into(
            &p,
            &[ReadReq {
                offset: 9_950,
                dst: ra,
            }],
        )
        .unwrap_err();
    assert!(e.to_string().contains("past the end"), "{e}");
    let e = eng
        .read_into(
            &p,
            &[
                ReadReq { offset: 0, dst: ra },
                ReadReq {
                    offset: 50,
                    dst: rb,
                },
            ],
        )
        .unwrap_err();
    assert!(e.to_string().contains("overlap"), "{e}");
    let e = eng.read_into(&dir.path().join("missing"), &[]).unwrap_err();
    assert_eq!(e.errno, Some(libc::ENOENT));
}

#[test]
fn discard_reads_only_checksum() {
    use fastpersist::{MutMemRef, ReadReq};
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("r.bin");
    let data = pattern(5_000_000, 3);
    std::fs::write(&p, &data).unwrap();
    let mut eng = Engine::new(Options::default()).unwrap();
    let st = eng
        .read_into(
            &p,
            &[ReadReq {
                offset: 7,
                dst: MutMemRef::discard(4_000_000),
            }],
        )
        .unwrap();
    assert_eq!(st.crcs, vec![crc32fast::hash(&data[7..4_000_007])]);
}

/// Segments of `data` cut into `piece`-byte memory regions at offset 0.
fn pieces(data: &[u8], piece: usize) -> Vec<Vec<Segment>> {
    data.chunks(piece)
        .enumerate()
        .map(|(i, c)| {
            // SAFETY: `data` outlives every session these segments are given to.
            let m = unsafe { MemRef::new(c.as_ptr(), c.len()) };
            vec![Segment {
                offset: (i * piece) as u64,
                source: Source::Mem(m),
                crc_id: Some(0),
            }]
        })
        .collect()
}

#[test]
fn streamed_writes_in_flight_across_calls_and_sessions() {
    // Writes of session A may still be in flight when its `write` returns;
    // another session (and a read) using the same engine waits for them
    // first, and both files come out right.
    let a = pattern(3_000_017, 11);
    let b = pattern(1_234_567, 12);
    for opts in combos() {
        let d = tempfile::tempdir().unwrap();
        let mut eng = Engine::new(opts.clone()).unwrap();
        let mut sa = eng.begin(&d.path().join("a"), a.len() as u64).unwrap();
        let mut parts = pieces(&a, 100_003).into_iter();
        for p in parts.by_ref().take(10) {
            eng.write(&mut sa, p).unwrap();
        }
        let mut sb = eng.begin(&d.path().join("b"), b.len() as u64).unwrap();
        for p in pieces(&b, 77_777) {
            eng.write(&mut sb, p).unwrap();
        }
        for p in parts {
            eng.write(&mut sa, p).unwrap();
        }
        let stb = eng.finish(sb, vec![], b.len() as u64).unwrap();
        let sta = eng.finish(sa, vec![], a.len() as u64).unwrap();
        assert_eq!(sta.crcs, vec![crc32fast::hash(&a)], "{opts:?}");
        assert_eq!(stb.crcs, vec![crc32fast::hash(&b)], "{opts:?}");
        assert!(std::fs::read(d.path().join("a")).unwrap() == a, "{opts:?}");
        assert!(std::fs::read(d.path().join("b")).unwrap() == b, "{opts:?}");
    }
}

#[test]
fn streamed_write_failure_reaches_its_own_session() {
    let a = pattern(2_000_000, 13);
    let b = pattern(500_000, 14);
    for mut opts in combos() {
        opts.fault = Some(Fault {
            offset: 150_000,
            errno: libc::EIO,
        });
        let d = tempfile::tempdir().unwrap();
        let target = d.path().join("a");
        std::fs::write(&target, b"previous").unwrap();
        let mut eng = Engine::new(opts.clone()).unwrap();
        let mut sa = eng.begin(&target, a.len() as u64).unwrap();
        // The failing write is submitted by one of these calls; its
        // completion may only be seen later (here, by session B's begin).
        let mut failed = None;
        let mut parts = pieces(&a, 200_000).into_iter();
        for p in parts.by_ref().take(2) {
            if let Err(e) = eng.write(&mut sa, p) {
                failed = Some(e);
                break;
            }
        }
        eng.set_fault(None, false);
        // Session B is not blamed for A's failure.
        let mut sb = eng.begin(&d.path().join("b"), 0).unwrap();
        for p in pieces(&b, 123_456) {
            eng.write(&mut sb, p).unwrap();
        }
        eng.finish(sb, vec![], b.len() as u64).unwrap();
        assert!(std::fs::read(d.path().join("b")).unwrap() == b, "{opts:?}");
        let e = if let Some(e) = failed {
            e
        } else {
            let mut err = None;
            for p in parts {
                if let Err(e) = eng.write(&mut sa, p) {
                    err = Some(e);
                    break;
                }
            }
            match err {
                Some(e) => e,
                None => eng.finish(sa, vec![], a.len() as u64).unwrap_err(),
            }
        };
        assert_eq!(e.errno, Some(libc::EIO), "{opts:?}: {e}");
        assert_eq!(std::fs::read(&target).unwrap(), b"previous");
    }
}

#[test]
fn aborted_streamed_session_leaves_nothing_and_engine_reusable() {
    let a = pattern(1_500_000, 15);
    for opts in combos() {
        let d = tempfile::tempdir().unwrap();
        let mut eng = Engine::new(opts.clone()).unwrap();
        let mut s = eng.begin(&d.path().join("a"), 0).unwrap();
        for p in pieces(&a, 300_000).into_iter().take(3) {
            eng.write(&mut s, p).unwrap();
        }
        eng.abort(s);
        assert!(only(d.path()).is_empty(), "{opts:?}");
        let mut s = eng.begin(&d.path().join("a"), 0).unwrap();
        for p in pieces(&a, 300_000) {
            eng.write(&mut s, p).unwrap();
        }
        eng.finish(s, vec![], a.len() as u64).unwrap();
        assert!(std::fs::read(d.path().join("a")).unwrap() == a);
    }
}

#[test]
fn reads_through_fd_follow_the_inode_on_every_backend() {
    use fastpersist::{MutMemRef, ReadReq};
    use std::os::fd::AsRawFd;
    let old = pattern(2_000_003, 21);
    let new = pattern(2_000_003, 22);
    for opts in combos() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.bin");
        std::fs::write(&p, &old).unwrap();
        let file = std::fs::File::open(&p).unwrap();
        // The path now names another file: reads through the fd still see
        // the first one.
        let other = dir.path().join("other.bin");
        std::fs::write(&other, &new).unwrap();
        std::fs::rename(&other, &p).unwrap();
        let mut eng = Engine::new(opts.clone()).unwrap();
        let mut buf = vec![0u8; 1_000_000];
        let reqs = [
            ReadReq {
                offset: 12_345,
                // SAFETY: `buf` is ours alone until read_into_fd returns.
                dst: unsafe { MutMemRef::new(buf.as_mut_ptr(), buf.len()) },
            },
            ReadReq {
                offset: 1_500_000,
                dst: MutMemRef::discard(500_003),
            },
        ];
        let st = eng.read_into_fd(file.as_raw_fd(), &reqs).unwrap();
        assert!(buf[..] == old[12_345..1_012_345], "{opts:?}");
        assert_eq!(st.crcs[0], crc32fast::hash(&old[12_345..1_012_345]));
        assert_eq!(st.crcs[1], crc32fast::hash(&old[1_500_000..]));
        assert_eq!(st.file_len, old.len() as u64);
        if !opts.direct {
            assert!(!st.direct);
        }
        // The caller's descriptor is still open and its offset unmoved.
        let mut f = &file;
        let mut first = [0u8; 4];
        std::io::Read::read_exact(&mut f, &mut first).unwrap();
        assert_eq!(first, old[..4]);
        // Same answers as by path (of the new file).
        let by_path = eng
            .read_into(
                &p,
                &[ReadReq {
                    offset: 1_500_000,
                    dst: MutMemRef::discard(500_003),
                }],
            )
            .unwrap();
        assert_eq!(by_path.crcs[0], crc32fast::hash(&new[1_500_000..]));
    }
}

#[test]
fn read_through_bad_fds_is_refused() {
    use fastpersist::{MutMemRef, ReadReq};
    use std::os::fd::AsRawFd;
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("w.bin");
    std::fs::write(&p, vec![3u8; 8192]).unwrap();
    let mut eng = Engine::new(Options::default()).unwrap();
    let req = [ReadReq {
        offset: 0,
        dst: MutMemRef::discard(100),
    }];
    let wronly = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    let e = eng.read_into_fd(wronly.as_raw_fd(), &req).unwrap_err();
    assert_eq!(e.errno, Some(libc::EBADF), "{e}");
    let e = eng.read_into_fd(-1, &req).unwrap_err();
    assert_eq!(e.errno, Some(libc::EBADF), "{e}");
    let e = eng.read_into_fd(1 << 30, &req).unwrap_err();
    assert_eq!(e.errno, Some(libc::EBADF), "{e}");
    let file = std::fs::File::open(&p).unwrap();
    let e = eng
        .read_into_fd(
            file.as_raw_fd(),
            &[ReadReq {
                offset: 8000,
                dst: MutMemRef::discard(1000),
            }],
        )
        .unwrap_err();
    assert!(e.to_string().contains("past the end"), "{e}");
}

#[test]
fn absurd_options_are_rejected_by_name() {
    for (o, name) in [
        (
            Options {
                arena_bytes: usize::MAX,
                ..Options::default()
            },
            "arena_bytes",
        ),
        (
            Options {
                block_size: usize::MAX - 4095,
                ..Options::default()
            },
            "block_size",
        ),
        (
            Options {
                queue_depth: usize::MAX,
                ..Options::default()
            },
            "queue_depth",
        ),
        (
            Options {
                pool_threads: usize::MAX,
                ..Options::default()
            },
            "pool_threads",
        ),
    ] {
        let e = Engine::new(o).err().expect("refused");
        assert_eq!(e.kind, fastpersist::ErrorKind::InvalidOption);
        assert!(e.to_string().contains(name), "{e}");
    }
}

#[test]
fn overflowing_offsets_and_lengths_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("huge");
    let mut eng = Engine::new(Options::default()).unwrap();
    let mut s = eng.begin(&p, 0).unwrap();
    let e = eng
        .write(
            &mut s,
            vec![Segment {
                offset: u64::MAX - 1,
                source: Source::Bytes(vec![1; 10]),
                crc_id: None,
            }],
        )
        .unwrap_err();
    assert_eq!(e.kind, fastpersist::ErrorKind::InvalidLayout, "{e}");
    eng.abort(s);
    let e = eng.begin(&p, u64::MAX).err().expect("refused");
    assert_eq!(e.kind, fastpersist::ErrorKind::InvalidOption, "{e}");
    for len in [u64::MAX, u64::MAX - 10, 1 << 63] {
        // An option, layout or EFBIG error, depending on where it is caught.
        let e = eng.write_file(&p, vec![], len).unwrap_err();
        assert!(
            e.kind != fastpersist::ErrorKind::Os || e.errno == Some(libc::EFBIG),
            "{e}"
        );
    }
    assert!(only(dir.path()).is_empty());
    // The engine is still fine.
    eng.write_file(&p, vec![], 5).unwrap();
    assert_eq!(std::fs::read(&p).unwrap(), vec![0; 5]);
}

#[test]
fn failed_directory_fsync_is_not_durable_but_the_file_is_in_place() {
    let big = pattern(700_000, 31);
    let odd = pattern(77, 32);
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("ckpt");
    std::fs::write(&target, b"previous").unwrap();
    let mut eng = Engine::new(Options::default()).unwrap();
    eng.set_dir_fsync_fault(Some(libc::EIO));
    let (segs, expect, len) = sample(&big, &odd);
    let e = eng.write_file(&target, segs, len).unwrap_err();
    assert_eq!(e.kind, fastpersist::ErrorKind::NotDurable, "{e}");
    assert_eq!(e.errno, Some(libc::EIO));
    assert!(std::fs::read(&target).unwrap() == expect);
    assert_eq!(only(dir.path()), vec!["ckpt"]);
    // Not durable only when durability is asked for.
    let mut eng = Engine::new(Options {
        durable: false,
        ..Options::default()
    })
    .unwrap();
    eng.set_dir_fsync_fault(Some(libc::EIO));
    let (segs, _, len) = sample(&big, &odd);
    eng.write_file(&target, segs, len).unwrap();
}

#[test]
fn special_targets_are_refused_by_sessions() {
    let dir = tempfile::tempdir().unwrap();
    let null = dir.path().join("null");
    std::os::unix::fs::symlink("/dev/null", &null).unwrap();
    let mut eng = Engine::new(Options::default()).unwrap();
    let e = eng.begin(&null, 0).err().expect("refused");
    assert_eq!(e.errno, Some(libc::EOPNOTSUPP), "{e}");
    assert!(e.to_string().contains("character device"), "{e}");
    assert_eq!(only(dir.path()), vec!["null"]);
    assert!(std::fs::symlink_metadata(&null).unwrap().is_symlink());
}

#[test]
fn refused_on_gathered_commits_nothing_and_keeps_the_old_file() {
    let big = pattern(300_000, 11);
    let odd = pattern(5_003, 12);
    for opts in combos() {
        let d = tempfile::tempdir().unwrap();
        let target = d.path().join("r.bin");
        std::fs::write(&target, b"previous").unwrap();
        let (segs, _, len) = sample(&big, &odd);
        let mut eng = Engine::new(opts.clone()).unwrap();
        let mut s = eng.begin(&target, len).unwrap();
        let mut segs = segs;
        segs.sort_by_key(|s| s.offset);
        let tail = segs.split_off(2);
        eng.write(&mut s, segs).unwrap();
        let mut calls = 0;
        let e = eng
            .finish_with(s, tail, len, &mut || {
                calls += 1;
                Err(fastpersist::Error::cancelled("refused"))
            })
            .unwrap_err();
        assert_eq!(calls, 1, "{opts:?}");
        assert_eq!(e.kind, fastpersist::ErrorKind::Cancelled, "{opts:?}");
        assert_eq!(std::fs::read(&target).unwrap(), b"previous", "{opts:?}");
        assert_eq!(only(d.path()), vec!["r.bin".to_string()], "{opts:?}");
        // The engine is still usable.
        let (segs, expect, len) = sample(&big, &odd);
        eng.write_file(&target, segs, len).unwrap();
        assert!(std::fs::read(&target).unwrap() == expect, "{opts:?}");
    }
}

#[test]
fn streamed_write_keeps_no_reference_to_caller_memory_past_the_call() {
    // Small odd-sized pieces at 4096-aligned offsets through one reused
    // slot, with 16 KiB blocks: several pieces share a block that no call
    // completes. Each slot is scribbled over as soon as `write` returns; the
    // file must still hold what each call was given.
    for opts in combos() {
        let d = tempfile::tempdir().unwrap();
        let mut eng = Engine::new(opts.clone()).unwrap();
        eng.set_min_block(Some(16 << 10)).unwrap();
        let path = d.path().join("s.bin");
        let mut s = eng.begin(&path, 0).unwrap();
        assert_eq!(s.block(), 16 << 10);
        let mut slot = vec![0u8; 5000];
        let mut expect = vec![];
        let mut off = 0u64;
        let mut hashers = vec![];
        for i in 0..40usize {
            let n = 1 + (i * 997) % 5000;
            let data = pattern(n, i as u8);
            slot[..n].copy_from_slice(&data);
            expect.resize(off as usize, 0);
            expect.extend_from_slice(&data);
            hashers.push(crc32fast::hash(&data));
            // SAFETY: `slot` outlives the call; the session must not read it after.
            let m = unsafe { MemRef::new(slot.as_ptr(), n) };
            eng.write(
                &mut s,
                vec![Segment {
                    offset: off,
                    source: Source::Mem(m),
                    crc_id: Some(i as u32),
                }],
            )
            .unwrap();
            slot.fill(0xEE);
            off = (off + n as u64).div_ceil(4096) * 4096;
        }
        let len = expect.len() as u64;
        let st = eng.finish(s, vec![], len).unwrap();
        assert_eq!(st.crcs, hashers, "{opts:?}");
        assert!(std::fs::read(&path).unwrap() == expect, "{opts:?}");
    }
}

/// Wait for process `pid` for at most `secs` seconds; its exit status, or
/// None when it had to be killed.
fn wait_child(pid: libc::pid_t, secs: u64) -> Option<i32> {
    let t0 = std::time::Instant::now();
    loop {
        let mut status = 0;
        // SAFETY: waitpid on our own child; `status` is a valid out pointer.
        let rc = unsafe { libc::waitpid(pid, &raw mut status, libc::WNOHANG) };
        if rc == pid {
            return libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status));
        }
        if t0.elapsed().as_secs() >= secs {
            // SAFETY: signalling and reaping our own child.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &raw mut status, 0);
            }
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

#[test]
fn fork_child_leaves_the_parents_engine_and_file_alone() {
    // A fork child gets a copy of an engine whose writes are in flight
    // (its ring shared with the parent, its pool threads absent) and of the
    // session's temporary file: using them is an error, dropping them
    // neither hangs nor takes the parent's completions nor removes the file.
    let a = pattern(3_000_017, 21);
    for io_uring in [true, false] {
        let opts = Options {
            io_uring,
            block_size: 64 << 10,
            arena_bytes: 256 << 10,
            queue_depth: 3,
            ..Options::default()
        };
        let d = tempfile::tempdir().unwrap();
        let mut eng = Engine::new(opts.clone()).unwrap();
        let mut sa = eng.begin(&d.path().join("a"), a.len() as u64).unwrap();
        let mut parts = pieces(&a, 100_003).into_iter();
        for p in parts.by_ref().take(10) {
            eng.write(&mut sa, p).unwrap();
        }
        let other = d.path().join("child");
        // SAFETY: the child only makes system calls, allocates and exits
        // with _exit (no unwinding, no test harness).
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let forked = |r: &Result<(), fastpersist::Error>| {
                r.as_ref()
                    .is_err_and(|e| e.kind == fastpersist::ErrorKind::Forked)
            };
            let begin = eng.begin(&other, 10).map(drop);
            let write = eng.write(&mut sa, vec![]);
            let ok = forked(&begin) && forked(&write) && !other.exists();
            drop(sa);
            drop(eng);
            // SAFETY: ends the child without running the harness.
            unsafe { libc::_exit(i32::from(!ok)) };
        }
        assert_eq!(wait_child(pid, 30), Some(0), "{opts:?}");
        let temps = only(d.path());
        assert_eq!(
            temps.len(),
            1,
            "the child removed the parent's file: {temps:?}"
        );
        for p in parts {
            eng.write(&mut sa, p).unwrap();
        }
        let st = eng.finish(sa, vec![], a.len() as u64).unwrap();
        assert_eq!(st.crcs, vec![crc32fast::hash(&a)], "{opts:?}");
        assert!(std::fs::read(d.path().join("a")).unwrap() == a, "{opts:?}");
        assert_eq!(only(d.path()), vec!["a".to_string()]);
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]

    /// Any records (sizes, gaps that are merged or skipped, records kept or
    /// only checksummed) read back the same bytes and CRC32s whether the
    /// buffers are scattered on the calling thread or on several scatter
    /// threads, with O_DIRECT and buffered, on io_uring and the pool.
    #[test]
    fn reads_scatter_the_same_on_any_number_of_threads(
        recs in proptest::collection::vec((0usize..150_000, 0u64..400_000, proptest::bool::weighted(0.85)), 1..24),
        seed in 0u8..255,
        io_uring in proptest::bool::ANY,
        direct in proptest::bool::ANY,
    ) {
        use fastpersist::{MutMemRef, ReadReq};
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("r.bin");
        let mut ranges = vec![];
        let mut off = 0u64;
        for &(n, gap, keep) in &recs {
            off += gap;
            ranges.push((off, n, keep));
            off += n as u64;
        }
        let content = pattern(off as usize + 3, seed);
        std::fs::write(&p, &content).unwrap();
        let mut got = vec![];
        for gather_threads in [1, 2, 4] {
            let mut eng = Engine::new(Options {
                io_uring,
                direct,
                block_size: 64 << 10,
                arena_bytes: 512 << 10,
                queue_depth: 4,
                gather_threads,
                ..Options::default()
            })
            .unwrap();
            let mut bufs: Vec<Vec<u8>> = ranges.iter().map(|&(_, n, _)| vec![0xAB; n]).collect();
            let reqs: Vec<ReadReq> = ranges
                .iter()
                .zip(bufs.iter_mut())
                .map(|(&(offset, n, keep), b)| ReadReq {
                    offset,
                    // SAFETY: each buffer is exclusively ours until read_into returns.
                    dst: if keep { unsafe { MutMemRef::new(b.as_mut_ptr(), b.len()) } } else { MutMemRef::discard(n) },
                })
                .collect();
            let st = eng.read_into(&p, &reqs).unwrap();
            for (&(o, n, keep), (b, crc)) in ranges.iter().zip(bufs.iter().zip(&st.crcs)) {
                let want = &content[o as usize..o as usize + n];
                proptest::prop_assert_eq!(*crc, crc32fast::hash(want));
                if keep {
                    proptest::prop_assert!(b[..] == want[..], "threads {}", gather_threads);
                } else {
                    proptest::prop_assert!(b.iter().all(|&x| x == 0xAB));
                }
            }
            got.push(st.crcs);
        }
        proptest::prop_assert!(got.windows(2).all(|w| w[0] == w[1]));
    }
}

#[test]
fn injected_eio_fails_a_read_and_the_engine_reads_again() {
    let content = pattern(2_000_000, 5);
    for mut opts in combos() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("r.bin");
        std::fs::write(&p, &content).unwrap();
        // Records spread over many arena buffers, so the failing read comes
        // while earlier buffers are being scattered.
        let ranges: Vec<(u64, usize)> = (0..20).map(|i| (i * 100_000, 90_000)).collect();
        let mut bufs: Vec<Vec<u8>> = ranges.iter().map(|&(_, n)| vec![0; n]).collect();
        let reqs = read_requests(&ranges, &mut bufs);
        opts.fault = Some(Fault {
            offset: 1_500_000,
            errno: libc::EIO,
        });
        let mut eng = Engine::new(opts.clone()).unwrap();
        let e = eng.read_into(&p, &reqs).unwrap_err();
        assert_eq!(e.errno, Some(libc::EIO), "{opts:?}");
        eng.set_fault(None, false);
        let st = eng.read_into(&p, &reqs).unwrap();
        for ((&(o, n), b), crc) in ranges.iter().zip(&bufs).zip(&st.crcs) {
            assert!(b[..] == content[o as usize..o as usize + n], "{opts:?}");
            assert_eq!(*crc, crc32fast::hash(&content[o as usize..o as usize + n]));
        }
    }
}

#[test]
fn a_read_to_an_unaligned_end_of_file_is_not_made_again_from_there() {
    // The last extent reaches past the end of a file whose length is not a
    // multiple of the block: its read comes back short at the end. Reading
    // on from there would be a direct read at an unaligned offset, which
    // file systems on the kernel's older direct-I/O code refuse (EINVAL)
    // before they look at the file's length; the fault stands for them.
    let content = pattern(300_007, 11);
    for mut opts in combos() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("r.bin");
        std::fs::write(&p, &content).unwrap();
        let ranges: Vec<(u64, usize)> = vec![(0, 1000), (200_000, 100_007)];
        let mut bufs: Vec<Vec<u8>> = ranges.iter().map(|&(_, n)| vec![0; n]).collect();
        let reqs = read_requests(&ranges, &mut bufs);
        opts.fault = Some(Fault {
            offset: Fault::UNALIGNED,
            errno: libc::EINVAL,
        });
        let mut eng = Engine::new(opts.clone()).unwrap();
        let st = eng
            .read_into(&p, &reqs)
            .unwrap_or_else(|e| panic!("{opts:?}: {e}"));
        for ((&(o, n), b), crc) in ranges.iter().zip(&bufs).zip(&st.crcs) {
            assert!(b[..] == content[o as usize..o as usize + n], "{opts:?}");
            assert_eq!(*crc, crc32fast::hash(&content[o as usize..o as usize + n]));
        }
    }
}

/// Stands for a runtime that may free or reuse caller memory whenever the
/// guard is not held: giving the guard back scribbles over the memory,
/// taking it puts the bytes back. A copy made outside the guard (by the
/// calling thread, or by a gather thread still at work after the guard was
/// given back) would write scribbles into the file.
struct Scribbling {
    mem: *mut u8,
    saved: Vec<u8>,
    held: bool,
    cycles: std::rc::Rc<std::cell::Cell<usize>>,
}

impl fastpersist::GatherGuard for Scribbling {
    fn lock(&mut self) -> fastpersist::Result<()> {
        if !self.held {
            // SAFETY: `mem` is the test's buffer of `saved.len()` bytes.
            unsafe {
                std::ptr::copy_nonoverlapping(self.saved.as_ptr(), self.mem, self.saved.len());
            }
            self.held = true;
        }
        Ok(())
    }
    fn check(&mut self, _crc_id: u32) -> fastpersist::Result<()> {
        assert!(self.held, "checked without the guard");
        Ok(())
    }
    fn unlock(&mut self) {
        if self.held {
            self.held = false;
            self.cycles.set(self.cycles.get() + 1);
            // SAFETY: as in `lock`; the hazard this test is about.
            unsafe { std::ptr::write_bytes(self.mem, 0xFF, self.saved.len()) };
        }
    }
}

#[test]
fn caller_memory_is_read_only_under_the_guard_also_by_gather_threads() {
    let data = pattern(4 << 20, 5);
    for opts in combos() {
        let mut mem = vec![0xFFu8; data.len()]; // scribbled until first locked
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("g.bin");
        // SAFETY: `mem` outlives the write; only the guard writes it.
        let m = unsafe { MemRef::new(mem.as_ptr(), mem.len()) };
        let segs = vec![Segment {
            offset: 0,
            source: Source::Mem(m),
            crc_id: Some(0),
        }];
        let cycles = std::rc::Rc::new(std::cell::Cell::new(0));
        let guard = Scribbling {
            mem: mem.as_mut_ptr(),
            saved: data.clone(),
            held: false,
            cycles: cycles.clone(),
        };
        let mut eng = Engine::new(opts.clone()).unwrap();
        let st = fastpersist::with_guard(Box::new(guard), || {
            eng.write_file(&p, segs, data.len() as u64)
        })
        .unwrap();
        assert!(
            std::fs::read(&p).unwrap() == data,
            "scribbles written with {opts:?}"
        );
        assert_eq!(st.crcs, vec![crc32fast::hash(&data)], "{opts:?}");
        assert!(
            cycles.get() > 1,
            "the guard was given back between extents: {opts:?}"
        );
        drop(mem);
    }
}

#[test]
fn gather_threads_change_between_calls_of_one_engine() {
    let big = pattern(3_000_011, 3);
    let odd = pattern(70_001, 5);
    let d = tempfile::tempdir().unwrap();
    let mut eng = Engine::new(Options::default()).unwrap();
    for (i, threads) in [1usize, 4, 2, 1].into_iter().enumerate() {
        eng.set_gather_threads(threads).unwrap();
        let (segs, expect, len) = sample(&big, &odd);
        let target = d.path().join(format!("{i}.bin"));
        let st = eng.write_file(&target, segs, len).unwrap();
        assert!(
            std::fs::read(&target).unwrap() == expect,
            "{threads} threads"
        );
        assert_eq!(st.crcs, vec![crc32fast::hash(&big), crc32fast::hash(&odd)]);
    }
    assert!(eng.set_gather_threads(0).is_err());
    assert!(eng.set_gather_threads(100_000).is_err());
}
