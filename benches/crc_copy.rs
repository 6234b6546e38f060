//! The per-byte work of a gather or scatter: copy and CRC32 of 128 MiB in
//! pieces of several sizes, one pass (`crc_copy::copy_checksummed`: non-
//! temporal stores, folded CRC) against the two-pass copy (64 KiB steps,
//! each copied then checksummed from cache), best of 7 rounds each; then
//! how the one pass scales over threads (the gather's `gather_threads`):
//! 1 GiB in 4 MiB pieces split among 1, 2, 4, ... threads up to the cores
//! available, each on its own part, against a plain memcpy split the same
//! way (the memory's own ceiling), best of 5 rounds each.
//!
//!     cargo bench --bench crc_copy
use std::time::Instant;

use crc32fast::Hasher;
use fastpersist::crc_copy::{
    copy_checksummed, copy_checksummed_in_steps, copy_nontemporal, fused_kernel,
};

const TOTAL: usize = 128 << 20;
#[allow(clippy::cast_precision_loss)] // 128 MiB is exact in an f64
const TOTAL_F: f64 = TOTAL as f64;
const STEP: usize = 64 << 10;
/// Piece sizes: the one-pass copy starts at 4 KiB (`crc_copy::MIN_FUSED`).
const PIECES: [usize; 7] = [
    4 << 10,
    6 << 10,
    8 << 10,
    16 << 10,
    64 << 10,
    1 << 20,
    4 << 20,
];

fn gbps(f: &mut dyn FnMut()) -> f64 {
    (0..7)
        .map(|_| {
            let t = Instant::now();
            f();
            TOTAL_F / t.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

/// Bytes of the thread-scaling rows, and the piece each thread copies at a
/// time (the default write block).
const SCALE_TOTAL: usize = 1 << 30;
#[allow(clippy::cast_precision_loss)] // 1 GiB is exact in an f64
const SCALE_TOTAL_F: f64 = SCALE_TOTAL as f64;
const SCALE_PIECE: usize = 4 << 20;

/// Aggregate GB/s of `threads` threads, each running `work` over its own
/// contiguous share of `dst`/`src` (whole pieces), best of 5 rounds.
fn split_gbps(dst: &mut [u8], src: &[u8], threads: usize, work: fn(&mut [u8], &[u8])) -> f64 {
    let share = SCALE_TOTAL.div_ceil(threads).div_ceil(SCALE_PIECE) * SCALE_PIECE;
    (0..5)
        .map(|_| {
            let t = Instant::now();
            std::thread::scope(|scope| {
                for (d, s) in dst.chunks_mut(share).zip(src.chunks(share)) {
                    scope.spawn(move || work(d, s));
                }
            });
            SCALE_TOTAL_F / t.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

fn one_pass(dst: &mut [u8], src: &[u8]) {
    let mut h = Hasher::new();
    for (d, s) in dst.chunks_mut(SCALE_PIECE).zip(src.chunks(SCALE_PIECE)) {
        copy_checksummed(d, s, &mut h, STEP);
    }
    std::hint::black_box(h.finalize());
}

fn memcpy(dst: &mut [u8], src: &[u8]) {
    dst.copy_from_slice(src);
}

/// The thread-scaling rows: 1, 2, 4, ... threads, and the core count.
fn scaling() {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let mut counts: Vec<usize> = (0..usize::BITS)
        .map(|i| 1 << i)
        .take_while(|&n| n <= cores)
        .collect();
    if counts.last() != Some(&cores) {
        counts.push(cores);
    }
    let src: Vec<u8> = (0..SCALE_TOTAL).map(|i| (i * 7 + i / 4093) as u8).collect();
    let mut dst = vec![1u8; SCALE_TOTAL];
    println!("\nthread scaling, 1 GiB in 4 MiB pieces ({cores} cores available)");
    println!(
        "{:>8} {:>14} {:>12} {:>14} {:>16}",
        "threads", "one-pass GB/s", "per thread", "memcpy GB/s", "one-pass/memcpy"
    );
    let mut first = 0.0;
    for n in counts {
        let one = split_gbps(&mut dst, &src, n, one_pass);
        let plain = split_gbps(&mut dst, &src, n, memcpy);
        if n == 1 {
            first = one;
        }
        #[allow(clippy::cast_precision_loss)] // a thread count
        let per = one / n as f64;
        println!(
            "{n:>8} {one:>14.1} {per:>12.1} {plain:>14.1} {:>16.2}   (x{:.2} of one thread)",
            one / plain,
            one / first
        );
    }
}

fn main() {
    println!(
        "one-pass kernel: {}",
        fused_kernel().unwrap_or("none (two-pass)")
    );
    let src: Vec<u8> = (0..TOTAL).map(|i| (i * 7 + i / 4093) as u8).collect();
    let mut dst = vec![1u8; TOTAL];
    println!(
        "{:>10} {:>14} {:>14} {:>7}",
        "piece", "two-pass GB/s", "one-pass GB/s", "ratio"
    );
    for piece in PIECES {
        let two = gbps(&mut || {
            let mut h = Hasher::new();
            for (d, s) in dst.chunks_mut(piece).zip(src.chunks(piece)) {
                copy_checksummed_in_steps(d, s, &mut h, STEP);
            }
            std::hint::black_box(h.finalize());
        });
        let one = gbps(&mut || {
            let mut h = Hasher::new();
            for (d, s) in dst.chunks_mut(piece).zip(src.chunks(piece)) {
                copy_checksummed(d, s, &mut h, STEP);
            }
            std::hint::black_box(h.finalize());
        });
        println!("{:>10} {two:>14.1} {one:>14.1} {:>7.2}", piece, one / two);
    }
    let plain = gbps(&mut || dst.copy_from_slice(&src));
    let nt = gbps(&mut || copy_nontemporal(&mut dst, &src));
    println!(
        "copy alone (snapshots): memcpy {plain:.1} GB/s, non-temporal {nt:.1} GB/s ({:.2}x)",
        nt / plain
    );
    scaling();
}
