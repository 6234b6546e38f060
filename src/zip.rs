//! torch.save's zip records, byte for byte: local headers (with the
//! padding field torch's writer uses to align the data), data descriptors,
//! central directory entries and the end records (zip64 where needed).
//!
//! The Python side (`fastpersist.torch_zip`) decides what goes in the file
//! and where; this module only spells the headers. CRC32s of tensor data
//! are not known when the headers are made, so each header that holds one
//! says where (a *slot* the engine fills while it writes).

/// Bit 3: sizes and CRC in a data descriptor; bit 11: UTF-8 names.
pub const FLAGS: u16 = 0x0808;
/// A record without data: UTF-8 names, no data descriptor (torch's writer,
/// miniz, writes none after an empty record, and torch's reader counts on
/// it where it works out where each record lies: `_get_offset` under
/// `calculate_storage_offsets`, `map_location="meta"`'s offsets, the
/// `TORCH_SERIALIZATION_DEBUG` check).
pub const EMPTY_FLAGS: u16 = 0x0800;

/// The general purpose flags of a record of `size` bytes.
#[must_use]
pub fn flags(size: u64) -> u16 {
    if has_descriptor(size) {
        FLAGS
    } else {
        EMPTY_FLAGS
    }
}

/// Whether a record of `size` bytes ends with a data descriptor (all but
/// empty ones, as torch's writer writes them).
#[must_use]
pub fn has_descriptor(size: u64) -> bool {
    size > 0
}
/// Fixed part of a local header.
pub const LOCAL_LEN: u64 = 30;
/// Signature of a data descriptor.
pub const DESCRIPTOR_SIG: u32 = 0x0807_4B50;
/// The padding field torch's writer (miniz) puts in local headers ("FB").
const PAD_TAG: u16 = 0x4246;

const U32: u64 = 0xFFFF_FFFF;
const U16: u64 = 0xFFFF;
/// "Version made by": Unix (3 << 8), zip 4.5 (45).
const MADE_BY: u16 = 0x032D;

/// A record needs zip64 fields when its size or header offset do not fit
/// 32 bits (miniz's rule, which torch's writer follows).
fn wide(header_off: u64, size: u64) -> bool {
    size >= U32 || header_off >= U32
}

fn put16(out: &mut Vec<u8>, v: u16) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// The low 32 bits, or 0xFFFFFFFF when the value needs zip64 (the zip
/// format's marker).
fn low32(v: u64) -> u32 {
    u32::try_from(v.min(U32)).unwrap_or(u32::MAX)
}

fn low16(v: u64) -> u16 {
    u16::try_from(v.min(U16)).unwrap_or(u16::MAX)
}

/// The local header of a record of `size` bytes named `name` at
/// `header_off`, its data aligned to `align` (a power of two): the fixed
/// part, the name and the extra field (zip64 when needed, then the padding
/// field), exactly as torch's writer pads it. The data starts right after:
/// at `header_off + returned length`.
///
/// # Panics
/// When `align` is not a power of two, or the name or padding do not fit
/// the 16-bit lengths of the format (names of torch checkpoints are short).
#[must_use]
pub fn local_header(name: &[u8], header_off: u64, size: u64, align: u64) -> Vec<u8> {
    let (mut out, pad) = local_header_split(name, header_off, size, align);
    out.resize(out.len() + pad, PAD_BYTE);
    out
}

/// The padding byte (torch's writer pads with 'Z').
pub const PAD_BYTE: u8 = b'Z';

/// [`local_header`] without its padding bytes, and how many there are:
/// the padding of a 4096-aligned record is most of its header, and the
/// same few lengths recur, so a caller can share them.
///
/// # Panics
/// As [`local_header`].
#[must_use]
pub fn local_header_split(name: &[u8], header_off: u64, size: u64, align: u64) -> (Vec<u8>, usize) {
    assert!(align.is_power_of_two(), "alignment must be a power of two");
    let name_len = u16::try_from(name.len()).expect("record name longer than 65535 bytes");
    let z64 = local_zip64(header_off, size);
    let pad16 = u16::try_from(pad_len(name.len(), z64.len(), header_off, align))
        .expect("padding longer than 65535 bytes");
    let extra_len = z64.len() + 4 + usize::from(pad16);
    let mut out = Vec::with_capacity(30 + name.len() + extra_len - usize::from(pad16));
    put32(&mut out, 0x0403_4B50);
    put16(&mut out, if wide(header_off, size) { 45 } else { 20 });
    put16(&mut out, flags(size));
    put16(&mut out, 0); // stored
    put16(&mut out, 0); // time
    put16(&mut out, 0); // date
    put32(&mut out, 0); // CRC, sizes: in the descriptor (an empty record's: all 0)
    put32(&mut out, 0);
    put32(&mut out, 0);
    put16(&mut out, name_len);
    put16(
        &mut out,
        u16::try_from(extra_len).expect("extra field longer than 65535 bytes"),
    );
    out.extend_from_slice(name);
    out.extend_from_slice(&z64);
    put16(&mut out, PAD_TAG);
    put16(&mut out, pad16);
    (out, usize::from(pad16))
}

/// The zip64 field of a local header (empty when the record needs none):
/// zeros for the sizes, which live in the data descriptor, and the header's
/// offset, each where it does not fit 32 bits.
fn local_zip64(header_off: u64, size: u64) -> Vec<u8> {
    let mut z64 = Vec::new();
    if wide(header_off, size) {
        let mut fields = Vec::new();
        if size >= U32 {
            put64(&mut fields, 0);
            put64(&mut fields, 0);
        }
        if header_off >= U32 {
            put64(&mut fields, header_off);
        }
        put16(&mut z64, 0x0001);
        put16(&mut z64, u16::try_from(fields.len()).unwrap_or(u16::MAX));
        z64.extend_from_slice(&fields);
    }
    z64
}

/// Bytes of padding that align the data of a record whose header at
/// `header_off` has a name of `name_len` bytes and `z64_len` bytes of zip64
/// field (torch's rule: the padding field's own 4 bytes come first).
fn pad_len(name_len: usize, z64_len: usize, header_off: u64, align: u64) -> u64 {
    let start = header_off + LOCAL_LEN + name_len as u64 + z64_len as u64 + 4;
    start.wrapping_neg() & (align - 1)
}

/// Length of [`local_header`] (where the data starts, from the header's
/// offset), without making it.
///
/// # Panics
/// When `align` is not a power of two.
#[must_use]
pub fn local_header_len(name_len: usize, header_off: u64, size: u64, align: u64) -> u64 {
    assert!(align.is_power_of_two(), "alignment must be a power of two");
    let z64_len = local_zip64(header_off, size).len();
    LOCAL_LEN + name_len as u64 + z64_len as u64 + 4 + pad_len(name_len, z64_len, header_off, align)
}

/// The sizes that end a record's data descriptor (after its signature and
/// CRC): 64-bit when the record needs zip64, as miniz writes them.
#[must_use]
pub fn descriptor_sizes(header_off: u64, size: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(16);
    if wide(header_off, size) {
        put64(&mut out, size);
        put64(&mut out, size);
    } else {
        put32(&mut out, low32(size));
        put32(&mut out, low32(size));
    }
    out
}

/// Offset of the CRC32 inside a central directory entry.
pub const CENTRAL_CRC_AT: usize = 16;

/// The central directory entry of a record; its CRC32 (bytes 16..20) is
/// `crc` (0 when it is filled in later, through a slot).
///
/// # Panics
/// When the name does not fit the format's 16-bit length.
#[must_use]
pub fn central_entry(name: &[u8], header_off: u64, size: u64, crc: u32) -> Vec<u8> {
    let mut fields = Vec::new();
    if size >= U32 {
        put64(&mut fields, size);
        put64(&mut fields, size);
    }
    if header_off >= U32 {
        put64(&mut fields, header_off);
    }
    let extra_len = if fields.is_empty() {
        0
    } else {
        4 + fields.len()
    };
    let mut out = Vec::with_capacity(46 + name.len() + extra_len);
    put32(&mut out, 0x0201_4B50);
    put16(&mut out, MADE_BY);
    put16(&mut out, if fields.is_empty() { 20 } else { 45 });
    put16(&mut out, flags(size));
    put16(&mut out, 0); // stored
    put16(&mut out, 0); // time
    put16(&mut out, 0); // date
    put32(&mut out, crc);
    put32(&mut out, low32(size));
    put32(&mut out, low32(size));
    put16(
        &mut out,
        u16::try_from(name.len()).expect("record name longer than 65535 bytes"),
    );
    put16(&mut out, u16::try_from(extra_len).unwrap_or(u16::MAX));
    put16(&mut out, 0); // comment
    put16(&mut out, 0); // disk
    put16(&mut out, 0); // internal attributes
    put32(&mut out, 0); // external attributes
    put32(&mut out, low32(header_off));
    out.extend_from_slice(name);
    if !fields.is_empty() {
        put16(&mut out, 0x0001);
        put16(&mut out, u16::try_from(fields.len()).unwrap_or(u16::MAX));
        out.extend_from_slice(&fields);
    }
    out
}

/// The end of the archive, after `entries` central entries of `cd_size`
/// bytes starting at `cd_start`: the zip64 end record and its locator when
/// any of those needs it, then the end record.
#[must_use]
pub fn end_records(entries: u64, cd_start: u64, cd_size: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(98);
    if entries >= U16 || cd_size >= U32 || cd_start >= U32 {
        let eocd64_off = cd_start + cd_size;
        put32(&mut out, 0x0606_4B50);
        put64(&mut out, 44);
        put16(&mut out, MADE_BY);
        put16(&mut out, 45);
        put32(&mut out, 0);
        put32(&mut out, 0);
        put64(&mut out, entries);
        put64(&mut out, entries);
        put64(&mut out, cd_size);
        put64(&mut out, cd_start);
        put32(&mut out, 0x0706_4B50);
        put32(&mut out, 0);
        put64(&mut out, eocd64_off);
        put32(&mut out, 1);
    }
    put32(&mut out, 0x0605_4B50);
    put16(&mut out, 0);
    put16(&mut out, 0);
    put16(&mut out, low16(entries));
    put16(&mut out, low16(entries));
    put32(&mut out, low32(cd_size));
    put32(&mut out, low32(cd_start));
    put16(&mut out, 0);
    out
}

// ---------------------------------------------------------------------------
// Reading: the central directory of a plainly well-formed checkpoint.

/// Fixed part of a central directory entry.
pub const CENTRAL_LEN: usize = 46;
const CENTRAL_SIG: u32 = 0x0201_4B50;
const UTF8_NAMES: u16 = 0x0800;

/// A central directory entry of a stored record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CentralEntry<'a> {
    /// The name as stored (UTF-8; ASCII where the UTF-8 flag is off).
    pub name: &'a str,
    /// Where its local header starts.
    pub header_offset: u64,
    /// Its size (stored: compressed and uncompressed sizes agree).
    pub size: u64,
    /// Its CRC32 as recorded.
    pub crc32: u32,
}

fn le16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn le32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// The zip64 values of an entry's extra field that stand for the fields
/// marked 0xFFFFFFFF (uncompressed size, compressed size, header offset,
/// in that order), as a reader that stops at the first zip64 field takes
/// them; None when they are not all there.
fn zip64_fields(extra: &[u8], usize_: u64, csize: u64, hoff: u64) -> Option<(u64, u64, u64)> {
    let mut p = 0usize;
    while p + 4 <= extra.len() {
        let tag = le16(extra, p)?;
        let len = usize::from(le16(extra, p + 2)?);
        let body = &extra[(p + 4).min(extra.len())..(p + 4 + len).min(extra.len())];
        if tag == 0x0001 {
            let mut vals = body
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])));
            let mut take = |v: u64| if v == U32 { vals.next() } else { Some(v) };
            let u = take(usize_)?;
            let c = take(csize)?;
            let h = take(hoff)?;
            return Some((u, c, h));
        }
        p += 4 + len;
    }
    None
}

/// Whether a record name is TorchScript's (`constants.pkl`, `code/...`
/// after the archive's folder), which torch.load tells apart.
fn torchscript_name(name: &str) -> bool {
    name.split_once('/')
        .is_some_and(|(_, rest)| rest == "constants.pkl" || rest.starts_with("code/"))
}

/// General purpose flags of a record torch's reader does not read:
/// encrypted (bit 0), compressed patch data (bit 5), strong encryption
/// (bit 6), masked local header (bit 13).
const UNREAD_FLAGS: u16 = 0x0001 | 0x0020 | 0x0040 | 0x2000;

/// The MS-DOS "directory" bit of a central entry's external attributes.
const DOS_DIRECTORY: u32 = 0x10;

/// The `n` entries of the central directory `cd`, which starts at file
/// offset `cd_offset`, when every one is plainly well-formed: signatures
/// right, nothing truncated, names UTF-8 (ASCII where the UTF-8 flag is
/// off, as a cp437 reader decodes them the same), every record stored
/// (not compressed) with its zip64 fields where marked, no TorchScript
/// record, none encrypted, on another disk or marked a folder, names
/// unique, and each record (its local header's fixed part and its data,
/// at the least) before the central directory and apart from the others.
/// None for anything else: the caller's full reader looks at those files
/// and names what is wrong.
#[must_use]
pub fn plain_central_entries(cd: &[u8], n: u64, cd_offset: u64) -> Option<Vec<CentralEntry<'_>>> {
    let mut entries = Vec::with_capacity(usize::try_from(n).ok()?.min(cd.len() / CENTRAL_LEN));
    let mut p = 0usize;
    for _ in 0..n {
        let fixed = cd.get(p..p + CENTRAL_LEN)?;
        if le32(fixed, 0)? != CENTRAL_SIG {
            return None;
        }
        let flags = le16(fixed, 8)?;
        let method = le16(fixed, 10)?;
        let crc32 = le32(fixed, 16)?;
        let (csize, usize_) = (u64::from(le32(fixed, 20)?), u64::from(le32(fixed, 24)?));
        let nlen = usize::from(le16(fixed, 28)?);
        let xlen = usize::from(le16(fixed, 30)?);
        let clen = usize::from(le16(fixed, 32)?);
        let hoff = u64::from(le32(fixed, 42)?);
        // Records torch's reader would not read as written (encrypted, on
        // another disk, marked a folder) are the Python parser's to name.
        if flags & UNREAD_FLAGS != 0
            || le16(fixed, 34)? != 0
            || le32(fixed, 38)? & DOS_DIRECTORY != 0
        {
            return None;
        }
        let name_at = p + CENTRAL_LEN;
        let end = name_at + nlen + xlen + clen;
        let raw = cd.get(name_at..name_at + nlen)?;
        let extra = cd.get(name_at + nlen..name_at + nlen + xlen)?;
        if end > cd.len() {
            return None;
        }
        if flags & UTF8_NAMES == 0 && !raw.is_ascii() {
            return None;
        }
        let name = std::str::from_utf8(raw).ok()?;
        let (usize_, csize, hoff) = if usize_ == U32 || csize == U32 || hoff == U32 {
            zip64_fields(extra, usize_, csize, hoff)?
        } else {
            (usize_, csize, hoff)
        };
        if method != 0 || csize != usize_ || torchscript_name(name) || name.ends_with('/') {
            return None;
        }
        entries.push(CentralEntry {
            name,
            header_offset: hoff,
            size: usize_,
            crc32,
        });
        p = end;
    }
    let mut names = std::collections::HashSet::with_capacity(entries.len());
    let mut spans = Vec::with_capacity(entries.len());
    for e in &entries {
        if !names.insert(e.name) {
            return None;
        }
        let end = e
            .header_offset
            .checked_add(LOCAL_LEN)?
            .checked_add(e.size)?;
        if end > cd_offset {
            return None;
        }
        spans.push((e.header_offset, end));
    }
    spans.sort_unstable();
    if spans.windows(2).any(|w| w[1].0 < w[0].1) {
        return None;
    }
    Some(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn u16_at(b: &[u8], at: usize) -> u16 {
        u16::from_le_bytes([b[at], b[at + 1]])
    }

    /// A central directory as fastpersist writes it: (name, header offset,
    /// size, crc) each.
    fn directory(recs: &[(&str, u64, u64, u32)]) -> Vec<u8> {
        recs.iter()
            .flat_map(|&(name, off, size, crc)| central_entry(name.as_bytes(), off, size, crc))
            .collect()
    }

    #[test]
    fn plain_central_entries_read_back_what_the_writer_spells() {
        let big = 5u64 << 30; // zip64 sizes and offsets
        let recs = [
            ("archive/data.pkl", 0u64, 100u64, 7u32),
            ("archive/data/0", 200, 4096, 8),
            ("archive/data/1", 8192, big, 9),
            ("archive/data/2", 8192 + big + 100, 10, 0),
        ];
        let cd = directory(&recs);
        let cd_off = 8192 + big + 4096;
        let got = plain_central_entries(&cd, 4, cd_off).unwrap();
        let want: Vec<CentralEntry> = recs
            .iter()
            .map(|&(name, header_offset, size, crc32)| CentralEntry {
                name,
                header_offset,
                size,
                crc32,
            })
            .collect();
        assert_eq!(got, want);
        // Fewer entries than the bytes hold: only those.
        assert_eq!(plain_central_entries(&cd, 2, cd_off).unwrap(), want[..2]);
        assert!(plain_central_entries(&[], 0, 0).unwrap().is_empty());
    }

    #[test]
    fn anything_odd_is_left_to_the_full_reader() {
        let ok = [("a/data/0", 0u64, 100u64, 1u32), ("a/data/1", 1000, 100, 2)];
        let cd = directory(&ok);
        assert!(plain_central_entries(&cd, 2, 2000).is_some());
        // Truncated, one entry too many, a bad signature.
        assert!(plain_central_entries(&cd[..cd.len() - 1], 2, 2000).is_none());
        assert!(plain_central_entries(&cd, 3, 2000).is_none());
        let mut bad = cd.clone();
        bad[0] ^= 1;
        assert!(plain_central_entries(&bad, 2, 2000).is_none());
        // Compressed (method 8), or the sizes disagree.
        let mut deflated = cd.clone();
        deflated[10] = 8;
        assert!(plain_central_entries(&deflated, 2, 2000).is_none());
        let mut sizes = cd.clone();
        sizes[20] ^= 1;
        assert!(plain_central_entries(&sizes, 2, 2000).is_none());
        // Encrypted, on another disk, marked a folder (torch's reader takes
        // such a record for one and reads no data from it).
        for (at, bit) in [(8, 0x01), (8, 0x40), (9, 0x20), (34, 0x01), (38, 0x10)] {
            let mut odd = cd.clone();
            odd[at] ^= bit;
            assert!(
                plain_central_entries(&odd, 2, 2000).is_none(),
                "byte {at} bit {bit:#x}"
            );
        }
        assert!(plain_central_entries(&directory(&[("a/data/", 0, 1, 0)]), 1, 100).is_none());
        // Names: not UTF-8; not ASCII without the UTF-8 flag.
        let mut latin = directory(&[("a/data/\u{e9}", 0, 1, 0)]);
        assert!(plain_central_entries(&latin, 1, 100).is_some());
        latin[9] &= !0x08; // flags: the UTF-8 bit (11) off
        assert!(plain_central_entries(&latin, 1, 100).is_none());
        let mut broken = directory(&[("a/data/xy", 0, 1, 0)]);
        broken[CENTRAL_LEN + 7] = 0xFF;
        assert!(plain_central_entries(&broken, 1, 100).is_none());
        // TorchScript, duplicate names, outside the data area, overlaps.
        assert!(
            plain_central_entries(&directory(&[("a/constants.pkl", 0, 1, 0)]), 1, 100).is_none()
        );
        assert!(plain_central_entries(&directory(&[("a/code/m.py", 0, 1, 0)]), 1, 100).is_none());
        assert!(
            plain_central_entries(&directory(&[("x", 0, 1, 0), ("x", 50, 1, 0)]), 2, 100).is_none()
        );
        assert!(plain_central_entries(&cd, 2, 1129).is_none());
        assert!(plain_central_entries(&cd, 2, 1130).is_some());
        assert!(
            plain_central_entries(&directory(&[("x", 0, 100, 0), ("y", 129, 1, 0)]), 2, 1000)
                .is_none()
        );
        assert!(
            plain_central_entries(&directory(&[("x", 0, 100, 0), ("y", 130, 1, 0)]), 2, 1000)
                .is_some()
        );
        // Offsets whose sum overflows.
        assert!(
            plain_central_entries(&directory(&[("x", u64::MAX - 10, 5, 0)]), 1, u64::MAX).is_none()
        );
        // A zip64 marker without its field.
        let mut marked = directory(&[("x", 0, 1, 0)]);
        marked[42..46].copy_from_slice(&[0xFF; 4]);
        assert!(plain_central_entries(&marked, 1, 100).is_none());
    }

    #[test]
    fn local_headers_align_the_data_as_torch_pads_them() {
        for (off, align) in [
            (0u64, 64u64),
            (100, 64),
            (4096, 4096),
            (12345, 4096),
            (5, 128),
        ] {
            let name = b"archive/data/7";
            let h = local_header(name, off, 1000, align);
            assert_eq!((off + h.len() as u64) % align, 0, "data aligned");
            assert_eq!(u16_at(&h, 26) as usize, name.len());
            assert_eq!(30 + name.len() + u16_at(&h, 28) as usize, h.len());
            assert_eq!(&h[30..30 + name.len()], name);
            // The padding field comes last: tag, length, then 'Z's.
            let pad_at = 30 + name.len();
            assert_eq!(u16_at(&h, pad_at), PAD_TAG);
            assert!(h[pad_at + 4..].iter().all(|&c| c == b'Z'));
        }
    }

    #[test]
    fn the_split_header_is_the_header_without_its_padding() {
        for off in [0u64, 77, 4095, 5 << 30] {
            let (head, pad) = local_header_split(b"archive/data/12", off, 100, 4096);
            let whole = local_header(b"archive/data/12", off, 100, 4096);
            assert_eq!(whole.len(), head.len() + pad);
            for size in [100, 5 << 30] {
                let h = local_header(b"archive/data/12", off, size, 4096);
                assert_eq!(local_header_len(15, off, size, 4096), h.len() as u64);
            }
            assert_eq!(&whole[..head.len()], &head[..]);
            assert!(whole[head.len()..].iter().all(|&c| c == PAD_BYTE));
        }
    }

    #[test]
    fn zip64_fields_where_the_size_or_offset_needs_them() {
        let small = local_header(b"n", 0, 10, 64);
        assert_eq!(u16_at(&small, 4), 20);
        let big = local_header(b"n", 0, 5 << 30, 64);
        assert_eq!(u16_at(&big, 4), 45);
        assert_eq!(u16_at(&big, 31), 0x0001);
        assert_eq!(u16_at(&big, 33), 16);
        let far = local_header(b"n", 5 << 30, 10, 64);
        assert_eq!(u16_at(&far, 33), 8);
        assert_eq!(&far[35..43], &(5u64 << 30).to_le_bytes());
        assert_eq!(descriptor_sizes(0, 10).len(), 8);
        assert_eq!(descriptor_sizes(5 << 30, 10).len(), 16);
        let c = central_entry(b"n", 5 << 30, 5 << 30, 7);
        assert_eq!(&c[16..20], &7u32.to_le_bytes());
        assert_eq!(&c[20..24], &u32::MAX.to_le_bytes());
        assert_eq!(&c[42..46], &u32::MAX.to_le_bytes());
        assert_eq!(c.len(), 46 + 1 + 4 + 24);
    }

    #[test]
    fn an_empty_record_says_it_has_no_data_descriptor() {
        // As torch's writer (miniz) marks them: bit 3 only where data follows.
        for off in [0, 5 << 30] {
            for (size, want) in [(0, 0x0800), (1, 0x0808)] {
                let local = local_header(b"archive/data/3", off, size, 64);
                let central = central_entry(b"archive/data/3", off, size, 0);
                assert_eq!((u16_at(&local, 6), u16_at(&central, 8)), (want, want));
            }
        }
        assert!(!has_descriptor(0) && has_descriptor(1));
    }

    #[test]
    fn end_records_switch_to_zip64_past_the_32_bit_limits() {
        assert_eq!(end_records(3, 100, 200).len(), 22);
        let e = end_records(70_000, 100, 200);
        assert_eq!(e.len(), 56 + 20 + 22);
        assert_eq!(u16_at(&e, 76 + 8), 0xFFFF);
        assert_eq!(&e[56 + 8..56 + 16], &300u64.to_le_bytes());
    }
}
