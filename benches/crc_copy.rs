//! The per-byte work of a gather or scatter: copy and CRC32 of 128 MiB in
//! pieces of several sizes, one pass (`crc_copy::copy_checksummed`: non-
//! temporal stores, folded CRC) against the two-pass copy (64 KiB steps,
//! each copied then checksummed from cache), best of 7 rounds each.
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
}
