//! Copy and CRC32 in one pass over memory.
//!
//! Every byte a save gathers, and every byte a read scatters, is copied once
//! and checksummed once. Done as two passes (copy a step, checksum the
//! copy), the copy is the cost: an ordinary store first reads the
//! destination's cache line in (write-allocate), so a copy moves three
//! bytes across the memory bus for each byte copied, and it leaves the
//! cache full of bytes nothing will read again (a write's arena buffer goes
//! to the device by DMA; a read's destination is far larger than the cache).
//!
//! [`copy_checksummed`] loads each 128-byte block of the source once into
//! registers, stores it to the destination with non-temporal stores (no
//! read of the destination, no cache pollution) and folds the same
//! registers into eight 128-bit CRC32 accumulator lanes by carry-less
//! multiplication (Gopal et al., "Fast CRC computation for generic
//! polynomials using PCLMULQDQ", Intel 2009; fold by 8 at a 1024-bit
//! distance), held in two 512-bit registers (AVX-512 VPCLMULQDQ), four
//! 256-bit ones (AVX2 VPCLMULQDQ) or eight 128-bit ones (PCLMULQDQ),
//! whichever this CPU has; the wide kernels need rustc 1.89 (`build.rs`).
//! The checksum is therefore of exactly the bytes stored, as before: a
//! source changed by someone else during the copy cannot make the checksum
//! disagree with the copy.
//!
//! The eight accumulators are a 128-byte message with the same CRC32
//! register as everything folded so far (folding keeps the polynomial's
//! residue modulo the CRC polynomial), so the last reduction is crc32fast's
//! own update over those 128 bytes and the few bytes past the last whole
//! block: no Barrett reduction of our own.
//!
//! On a CPU without PCLMULQDQ and SSE4.1 (or not x86_64), and for pieces
//! shorter than [`MIN_FUSED`], the copy and checksum run as before, a step
//! at a time.

use crc32fast::Hasher;

/// Pieces shorter than this are copied and checksummed the plain way: the
/// fused loop's set-up, alignment and final reduction are not worth it.
pub const MIN_FUSED: usize = 4096;

/// Whether `FASTPERSIST_FUSED_COPY` turned the one-pass and non-temporal
/// copies off (read once): 0, false, no or off, any case, as every on/off
/// variable is spelled (the binding refuses other values where it can
/// name the variable).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn switched_off() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFF.get_or_init(|| {
        std::env::var_os("FASTPERSIST_FUSED_COPY").is_some_and(|v| v.to_str().is_some_and(off_word))
    })
}

/// An on/off variable's "off": 0, false, no or off (any case, spaces
/// around it aside).
fn off_word(v: &str) -> bool {
    matches!(
        v.trim().to_ascii_lowercase().as_str(),
        "0" | "false" | "no" | "off"
    )
}

/// Whether this CPU runs the fused loop (`FASTPERSIST_FUSED_COPY=0` turns
/// it off, for comparisons).
pub fn fused_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        x86::kernel().is_some()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The fused loop's instruction set on this CPU: "avx512", "avx2" (both
/// VPCLMULQDQ), "sse" (PCLMULQDQ), or None (the two-pass copy).
pub fn fused_kernel() -> Option<&'static str> {
    #[cfg(target_arch = "x86_64")]
    {
        x86::kernel().map(x86::Kernel::name)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}

/// Copy `src` into `dst` (as long) and feed `h` the copied bytes: in one
/// pass with non-temporal stores where [`fused_available`] and the piece
/// is at least [`MIN_FUSED`] long, else `step` bytes at a time, each step
/// checksummed right after it is copied, while it is in cache.
///
/// # Panics
///
/// If the two slices differ in length.
pub fn copy_checksummed(dst: &mut [u8], src: &[u8], h: &mut Hasher, step: usize) {
    assert_eq!(dst.len(), src.len(), "copy_checksummed: lengths differ");
    #[cfg(target_arch = "x86_64")]
    if src.len() >= MIN_FUSED && fused_available() {
        fused(dst, src, h);
        return;
    }
    copy_checksummed_in_steps(dst, src, h, step);
}

/// Copy `src` into `dst` (as long) with non-temporal stores where it is at
/// least [`MIN_FUSED`] long on x86_64 (SSE2, which every x86_64 CPU has):
/// for copies nothing reads back soon, such as a snapshot that then goes
/// to the device by DMA. No checksum.
///
/// # Panics
///
/// If the two slices differ in length.
pub fn copy_nontemporal(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_nontemporal: lengths differ");
    #[cfg(target_arch = "x86_64")]
    if src.len() >= MIN_FUSED && !switched_off() {
        let head = to_line(dst);
        let lines = (src.len() - head) / 64 * 64;
        dst[..head].copy_from_slice(&src[..head]);
        x86::stream_copy(&mut dst[head..head + lines], &src[head..head + lines]);
        dst[head + lines..].copy_from_slice(&src[head + lines..]);
        return;
    }
    dst.copy_from_slice(src);
}

/// The two-pass copy and checksum, `step` bytes at a time.
pub fn copy_checksummed_in_steps(dst: &mut [u8], src: &[u8], h: &mut Hasher, step: usize) {
    for (d, s) in dst.chunks_mut(step.max(1)).zip(src.chunks(step.max(1))) {
        d.copy_from_slice(s);
        h.update(d);
    }
}

/// The bytes of `dst` before its first 64-byte (cache line) boundary, at
/// most its length: copied the plain way, so that the non-temporal stores
/// after them are aligned and write whole lines.
#[cfg(target_arch = "x86_64")]
fn to_line(dst: &[u8]) -> usize {
    ((dst.as_ptr() as usize).wrapping_neg() % 64).min(dst.len())
}

/// The fused loop's unit: eight 16-byte lanes.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const BLOCK: usize = 128;

#[cfg(target_arch = "x86_64")]
fn fused(dst: &mut [u8], src: &[u8], h: &mut Hasher) {
    let total = h.total_len() + src.len() as u64;
    let head = to_line(dst);
    dst[..head].copy_from_slice(&src[..head]);
    let mut running = h.clone();
    // The head and tail are checksummed from the copy, as the loop's
    // blocks are from the registers it stored.
    running.update(&dst[..head]);
    let blocks = (src.len() - head) / BLOCK * BLOCK;
    if blocks >= BLOCK {
        let (d, s) = (&mut dst[head..head + blocks], &src[head..head + blocks]);
        let folded = x86::fold_copy(d, s, running.clone().finalize());
        // The folded accumulators, as a message processed from a zero
        // register (crc32fast's "crc" is the register inverted).
        let mut rest = Hasher::new_with_initial(!0);
        rest.update(&folded);
        running = Hasher::new_with_initial(rest.finalize());
    }
    let tail = head + blocks;
    dst[tail..].copy_from_slice(&src[tail..]);
    running.update(&dst[tail..]);
    *h = Hasher::new_with_initial_len(running.finalize(), total);
}

// The intrinsics take lanes as `*const __m128i` (and wider) whatever their
// alignment (the `loadu`/`storeu` forms read and write unaligned; the stream
// stores' addresses are aligned by construction), and the CRC register goes
// into a lane as its bits (`u32 as i32`).
#[cfg(target_arch = "x86_64")]
#[allow(clippy::cast_ptr_alignment, clippy::cast_possible_wrap)]
mod x86 {
    use std::arch::x86_64::{
        __m128i, _mm_clmulepi64_si128, _mm_cvtsi32_si128, _mm_loadu_si128, _mm_set_epi64x,
        _mm_sfence, _mm_storeu_si128, _mm_stream_si128, _mm_xor_si128,
    };
    #[cfg(fp_vpclmulqdq)]
    use std::arch::x86_64::{
        __m256i, _mm256_clmulepi64_epi128, _mm256_loadu_si256, _mm256_set_epi64x,
        _mm256_setzero_si256, _mm256_storeu_si256, _mm256_stream_si256, _mm256_xor_si256,
        _mm256_zextsi128_si256, _mm512_clmulepi64_epi128, _mm512_loadu_si512, _mm512_set_epi64,
        _mm512_storeu_si512, _mm512_stream_si512, _mm512_ternarylogic_epi64, _mm512_xor_si512,
        _mm512_zextsi128_si512,
    };
    use std::sync::OnceLock;

    use super::BLOCK;

    /// Fold constants for a distance of 1024 bits (one [`BLOCK`]: each
    /// 128-bit lane is folded onto the lane a block later): x^(1024+32) and
    /// x^(1024-32) modulo the CRC32 polynomial, reflected (the pair
    /// crc32fast's 8-stream AVX2 kernel uses).
    const K_LO: i64 = 0x1_e88e_f372;
    const K_HI: i64 = 0x1_4a7f_e880;

    /// The instruction set the fused loop runs on.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub(super) enum Kernel {
        /// PCLMULQDQ on eight 128-bit registers, 16-byte stores.
        Sse,
        /// VPCLMULQDQ on four 256-bit registers, 32-byte stores.
        #[cfg(fp_vpclmulqdq)]
        Avx2,
        /// VPCLMULQDQ on two 512-bit registers, whole-cache-line stores.
        #[cfg(fp_vpclmulqdq)]
        Avx512,
    }

    impl Kernel {
        pub(super) fn name(self) -> &'static str {
            match self {
                Kernel::Sse => "sse",
                #[cfg(fp_vpclmulqdq)]
                Kernel::Avx2 => "avx2",
                #[cfg(fp_vpclmulqdq)]
                Kernel::Avx512 => "avx512",
            }
        }
    }

    /// The widest kernel this CPU runs, found once; None without PCLMULQDQ
    /// and SSE4.1, or with `FASTPERSIST_FUSED_COPY=0`.
    pub(super) fn kernel() -> Option<Kernel> {
        static KERNEL: OnceLock<Option<Kernel>> = OnceLock::new();
        *KERNEL.get_or_init(|| {
            if super::switched_off() {
                return None;
            }
            supported().last()
        })
    }

    /// Every kernel this CPU runs, narrowest first.
    pub(super) fn supported() -> impl Iterator<Item = Kernel> {
        let sse = is_x86_feature_detected!("pclmulqdq") && is_x86_feature_detected!("sse4.1");
        let all = [
            (Kernel::Sse, sse),
            #[cfg(fp_vpclmulqdq)]
            (
                Kernel::Avx2,
                sse && is_x86_feature_detected!("vpclmulqdq") && is_x86_feature_detected!("avx2"),
            ),
            #[cfg(fp_vpclmulqdq)]
            (
                Kernel::Avx512,
                sse && is_x86_feature_detected!("vpclmulqdq")
                    && is_x86_feature_detected!("avx512f"),
            ),
        ];
        all.into_iter().filter_map(|(k, ok)| ok.then_some(k))
    }

    /// Copy `src` into `dst` with non-temporal stores and return the CRC32
    /// fold accumulators of the bytes, started from the crc32fast state
    /// `crc`, as the 128-byte message whose CRC32 register (from zero)
    /// equals that of the bytes copied. Ends with a store fence, so the
    /// copy is visible to other threads and devices as ordinary stores are.
    ///
    /// # Panics
    ///
    /// Unless the CPU has a [`kernel`], the slices are as long, a whole
    /// number of blocks (at least one), and `dst` is 64-byte aligned.
    pub(super) fn fold_copy(dst: &mut [u8], src: &[u8], crc: u32) -> [u8; BLOCK] {
        fold_copy_with(kernel().expect("fold_copy without a kernel"), dst, src, crc)
    }

    /// [`fold_copy`] on a given kernel.
    ///
    /// # Panics
    ///
    /// Unless the CPU runs `kernel` ([`supported`]), the slices are as
    /// long, a whole number of blocks (at least one), and `dst` is 64-byte
    /// aligned.
    pub(super) fn fold_copy_with(
        kernel: Kernel,
        dst: &mut [u8],
        src: &[u8],
        crc: u32,
    ) -> [u8; BLOCK] {
        assert!(
            supported().any(|k| k == kernel),
            "this CPU lacks the {kernel:?} kernel"
        );
        let len = src.len();
        assert!(
            dst.len() == len && len >= BLOCK && len % BLOCK == 0 && dst.as_ptr() as usize % 64 == 0
        );
        let (d, s) = (dst.as_mut_ptr(), src.as_ptr());
        // SAFETY: `supported()` checked the CPU features each function
        // enables; the assertion above gives the length, block and
        // alignment conditions; a `&mut` and a `&` slice never overlap.
        unsafe {
            match kernel {
                Kernel::Sse => fold_copy_sse(d, s, len, crc),
                #[cfg(fp_vpclmulqdq)]
                Kernel::Avx2 => fold_copy_avx2(d, s, len, crc),
                #[cfg(fp_vpclmulqdq)]
                Kernel::Avx512 => fold_copy_avx512(d, s, len, crc),
            }
        }
    }

    /// Copy `src` into `dst` with non-temporal stores, then a store fence.
    ///
    /// # Panics
    ///
    /// Unless the slices are as long, a whole number of 64-byte lines,
    /// and `dst` is 64-byte aligned.
    pub(super) fn stream_copy(dst: &mut [u8], src: &[u8]) {
        let len = src.len();
        assert!(dst.len() == len && len % 64 == 0 && dst.as_ptr() as usize % 64 == 0);
        let (d, s) = (dst.as_mut_ptr(), src.as_ptr());
        let mut off = 0;
        while off < len {
            for i in 0..4 {
                // SAFETY: SSE2 is part of x86_64; `off + 64 <= len`, so the
                // 16 bytes at `off + 16 i` lie in both slices (which, a
                // `&mut` and a `&`, do not overlap); the load is unaligned,
                // the store's address 16-byte aligned.
                unsafe {
                    let v = _mm_loadu_si128(s.add(off + 16 * i).cast::<__m128i>());
                    _mm_stream_si128(d.add(off + 16 * i).cast::<__m128i>(), v);
                }
            }
            off += 64;
        }
        // SAFETY: SSE2 is part of x86_64.
        unsafe { _mm_sfence() };
    }

    /// [`fold_copy`] on eight 128-bit lanes.
    ///
    /// # Safety
    ///
    /// The CPU has PCLMULQDQ, SSE2 and SSE4.1; `src` is readable and `dst`
    /// writable for `len` bytes, a whole number of blocks (at least one);
    /// the two do not overlap; `dst` is 16-byte aligned.
    #[target_feature(enable = "pclmulqdq,sse2,sse4.1")]
    unsafe fn fold_copy_sse(dst: *mut u8, src: *const u8, len: usize, crc: u32) -> [u8; BLOCK] {
        let mut acc = [_mm_cvtsi32_si128(0); 8];
        let k = _mm_set_epi64x(K_HI, K_LO);
        let mut off = 0;
        while off < len {
            // SAFETY: `off + BLOCK <= len`: both pointers stay in bounds.
            let (s, d) = unsafe { (src.add(off), dst.add(off)) };
            for (i, a) in acc.iter_mut().enumerate() {
                // SAFETY: 16 bytes at `16 i` inside this block; the load is
                // unaligned, the store's address 16-byte aligned.
                let v = unsafe { _mm_loadu_si128(s.add(16 * i).cast::<__m128i>()) };
                // SAFETY: as above.
                unsafe { _mm_stream_si128(d.add(16 * i).cast::<__m128i>(), v) };
                *a = if off == 0 {
                    v
                } else {
                    let lo = _mm_clmulepi64_si128(*a, k, 0x00);
                    let hi = _mm_clmulepi64_si128(*a, k, 0x11);
                    _mm_xor_si128(_mm_xor_si128(v, lo), hi)
                };
            }
            if off == 0 {
                // The register (the inverted crc32fast state) enters at
                // the first four bytes.
                acc[0] = _mm_xor_si128(acc[0], _mm_cvtsi32_si128(!crc as i32));
            }
            off += BLOCK;
        }
        _mm_sfence();
        let mut out = [0u8; BLOCK];
        for (i, a) in acc.iter().enumerate() {
            // SAFETY: `out` holds eight 16-byte lanes; unaligned store.
            unsafe { _mm_storeu_si128(out.as_mut_ptr().add(16 * i).cast::<__m128i>(), *a) };
        }
        out
    }

    /// [`fold_copy`] on four 256-bit registers (two lanes each).
    ///
    /// # Safety
    ///
    /// As [`fold_copy_sse`], and the CPU has AVX2 and VPCLMULQDQ; `dst` is
    /// 32-byte aligned.
    #[cfg(fp_vpclmulqdq)]
    #[allow(clippy::incompatible_msrv)] // built only by rustc >= 1.89 (build.rs)
    #[target_feature(enable = "pclmulqdq,sse2,sse4.1,avx,avx2,vpclmulqdq")]
    unsafe fn fold_copy_avx2(dst: *mut u8, src: *const u8, len: usize, crc: u32) -> [u8; BLOCK] {
        let mut acc = [_mm256_setzero_si256(); 4];
        let k = _mm256_set_epi64x(K_HI, K_LO, K_HI, K_LO);
        let mut off = 0;
        while off < len {
            // SAFETY: `off + BLOCK <= len`: both pointers stay in bounds.
            let (s, d) = unsafe { (src.add(off), dst.add(off)) };
            for (i, a) in acc.iter_mut().enumerate() {
                // SAFETY: 32 bytes at `32 i` inside this block; the load is
                // unaligned, the store's address 32-byte aligned.
                let v = unsafe { _mm256_loadu_si256(s.add(32 * i).cast::<__m256i>()) };
                // SAFETY: as above.
                unsafe { _mm256_stream_si256(d.add(32 * i).cast::<__m256i>(), v) };
                *a = if off == 0 {
                    v
                } else {
                    let lo = _mm256_clmulepi64_epi128(*a, k, 0x00);
                    let hi = _mm256_clmulepi64_epi128(*a, k, 0x11);
                    _mm256_xor_si256(_mm256_xor_si256(v, lo), hi)
                };
            }
            if off == 0 {
                // The register (the inverted crc32fast state) enters at
                // the first four bytes.
                acc[0] = _mm256_xor_si256(
                    acc[0],
                    _mm256_zextsi128_si256(_mm_cvtsi32_si128(!crc as i32)),
                );
            }
            off += BLOCK;
        }
        _mm_sfence();
        let mut out = [0u8; BLOCK];
        for (i, a) in acc.iter().enumerate() {
            // SAFETY: `out` holds four 32-byte lanes; unaligned store.
            unsafe { _mm256_storeu_si256(out.as_mut_ptr().add(32 * i).cast::<__m256i>(), *a) };
        }
        out
    }

    /// [`fold_copy`] on two 512-bit registers (four lanes each).
    ///
    /// # Safety
    ///
    /// As [`fold_copy_sse`], and the CPU has AVX-512F and VPCLMULQDQ; `dst`
    /// is 64-byte aligned.
    #[cfg(fp_vpclmulqdq)]
    #[allow(clippy::incompatible_msrv)] // built only by rustc >= 1.89 (build.rs)
    #[target_feature(enable = "pclmulqdq,sse2,sse4.1,avx,avx2,avx512f,vpclmulqdq")]
    unsafe fn fold_copy_avx512(dst: *mut u8, src: *const u8, len: usize, crc: u32) -> [u8; BLOCK] {
        let k = _mm512_set_epi64(K_HI, K_LO, K_HI, K_LO, K_HI, K_LO, K_HI, K_LO);
        // SAFETY: the first block is in bounds (len >= BLOCK); unaligned
        // loads, 64-byte aligned stores.
        let (mut a0, mut a1) = unsafe {
            let a0 = _mm512_loadu_si512(src.cast());
            let a1 = _mm512_loadu_si512(src.add(64).cast());
            _mm512_stream_si512(dst.cast(), a0);
            _mm512_stream_si512(dst.add(64).cast(), a1);
            (a0, a1)
        };
        a0 = _mm512_xor_si512(a0, _mm512_zextsi128_si512(_mm_cvtsi32_si128(!crc as i32)));
        let mut off = BLOCK;
        while off < len {
            // SAFETY: `off + BLOCK <= len`: both pointers stay in bounds;
            // unaligned loads, 64-byte aligned stores.
            let (v0, v1) = unsafe {
                let (s, d) = (src.add(off), dst.add(off));
                let v0 = _mm512_loadu_si512(s.cast());
                let v1 = _mm512_loadu_si512(s.add(64).cast());
                _mm512_stream_si512(d.cast(), v0);
                _mm512_stream_si512(d.add(64).cast(), v1);
                (v0, v1)
            };
            // 0x96: a ^ b ^ c.
            a0 = _mm512_ternarylogic_epi64(
                _mm512_clmulepi64_epi128(a0, k, 0x00),
                _mm512_clmulepi64_epi128(a0, k, 0x11),
                v0,
                0x96,
            );
            a1 = _mm512_ternarylogic_epi64(
                _mm512_clmulepi64_epi128(a1, k, 0x00),
                _mm512_clmulepi64_epi128(a1, k, 0x11),
                v1,
                0x96,
            );
            off += BLOCK;
        }
        _mm_sfence();
        let mut out = [0u8; BLOCK];
        // SAFETY: `out` holds two 64-byte lanes; unaligned stores.
        unsafe {
            _mm512_storeu_si512(out.as_mut_ptr().cast(), a0);
            _mm512_storeu_si512(out.as_mut_ptr().add(64).cast(), a1);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_is_spelled_as_every_on_off_variable_is() {
        for v in ["0", "false", "No", " OFF ", "off\n"] {
            assert!(off_word(v), "{v:?}");
        }
        for v in ["1", "true", "on", "yes", "", "of", "00"] {
            assert!(!off_word(v), "{v:?}");
        }
    }

    fn pattern(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    /// The fused copy gives the bytes and the checksum (value and length,
    /// so `combine` still works) of the plain one, for every length around
    /// the block and threshold edges, every destination misalignment, and a
    /// hasher that already holds bytes.
    #[test]
    fn fused_matches_plain() {
        let src = pattern(3 * MIN_FUSED + 3 * BLOCK + 77, 7);
        let lens = [
            0,
            1,
            63,
            64,
            127,
            128,
            129,
            MIN_FUSED - 1,
            MIN_FUSED,
            MIN_FUSED + 1,
            MIN_FUSED + BLOCK - 1,
            2 * MIN_FUSED + 65,
            src.len() - 64,
        ];
        for &len in &lens {
            for mis in [0usize, 1, 15, 16, 33, 63] {
                for prior in [&b""[..], b"fastpersist"] {
                    let mut want = Hasher::new();
                    want.update(prior);
                    want.update(&src[..len]);
                    let mut h = Hasher::new();
                    h.update(prior);
                    let mut buf = vec![0xAAu8; len + 64];
                    copy_checksummed(&mut buf[mis..mis + len], &src[..len], &mut h, 1 << 16);
                    assert_eq!(&buf[mis..mis + len], &src[..len], "len {len} mis {mis}");
                    assert!(
                        buf[..mis].iter().all(|&b| b == 0xAA),
                        "wrote before the destination"
                    );
                    assert!(
                        buf[mis + len..].iter().all(|&b| b == 0xAA),
                        "wrote past the destination"
                    );
                    assert_eq!(h.total_len(), want.total_len());
                    assert_eq!(
                        h.clone().finalize(),
                        want.clone().finalize(),
                        "len {len} mis {mis}"
                    );
                    // A fused piece combines as a plain one does.
                    let mut a = Hasher::new();
                    a.update(b"head");
                    a.combine(&h);
                    let mut b = Hasher::new();
                    b.update(b"head");
                    b.combine(&want);
                    assert_eq!(a.finalize(), b.finalize());
                }
            }
        }
    }

    #[test]
    fn nontemporal_copy_is_a_copy() {
        let src = pattern(3 * MIN_FUSED + 77, 3);
        for len in [0, 5, MIN_FUSED - 1, MIN_FUSED, MIN_FUSED + 63, src.len()] {
            for mis in [0usize, 1, 17, 63] {
                let mut buf = vec![0xAAu8; len + 64];
                copy_nontemporal(&mut buf[mis..mis + len], &src[..len]);
                assert_eq!(&buf[mis..mis + len], &src[..len], "len {len} mis {mis}");
                assert!(buf[..mis]
                    .iter()
                    .chain(&buf[mis + len..])
                    .all(|&b| b == 0xAA));
            }
        }
    }

    proptest::proptest! {
        /// Any length, destination offset, step and prior content: the
        /// fused copy's bytes and checksum are the plain two-pass ones.
        #[test]
        fn fused_equals_two_pass(
            len in 0usize..40_000,
            mis in 0usize..64,
            prior in 0usize..200,
            step in 1usize..70_000,
            seed in 1u64..u64::MAX,
        ) {
            let src = pattern(len + prior, seed);
            let (before, src) = src.split_at(prior);
            let mut want = Hasher::new();
            want.update(before);
            let mut h = want.clone();
            want.update(src);
            let mut buf = vec![0u8; len + 64];
            copy_checksummed(&mut buf[mis..mis + len], src, &mut h, step);
            proptest::prop_assert_eq!(&buf[mis..mis + len], src);
            proptest::prop_assert_eq!(h.total_len(), want.total_len());
            proptest::prop_assert_eq!(h.finalize(), want.finalize());
        }
    }

    /// Each kernel this CPU runs (not only the widest, which the other
    /// tests take) folds to crc32fast's checksum.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn every_kernel_matches_crc32fast() {
        for kernel in x86::supported() {
            for blocks in [1usize, 2, 3, 8, 33] {
                let src = pattern(blocks * BLOCK, blocks as u64);
                let mut dst = vec![0u8; src.len() + 64];
                let off = (dst.as_ptr() as usize).wrapping_neg() % 64;
                let folded =
                    x86::fold_copy_with(kernel, &mut dst[off..off + src.len()], &src, 0x1234_5678);
                let mut rest = Hasher::new_with_initial(!0);
                rest.update(&folded);
                let mut want = Hasher::new_with_initial(0x1234_5678);
                want.update(&src);
                assert_eq!(
                    rest.finalize(),
                    want.finalize(),
                    "{kernel:?}, {blocks} blocks"
                );
                assert_eq!(&dst[off..off + src.len()], &src[..], "{kernel:?}");
            }
        }
    }
}
