//! The opcodes of CPython's C pickler (`Modules/_pickle.c`) at protocol 2,
//! torch.save's protocol, byte for byte: the writer behind the fast path of
//! `fastpersist.pickling.pickle_obj`.
//!
//! [`Emitter`] writes opcodes and keeps the pickler's memo. The memo is
//! keyed by object identity (the caller passes each Python object's
//! address, and keeps the object alive until the pickle is done, as the C
//! pickler's memo does); objects the pickler memoizes but that can never be
//! met again (the temporaries of a tensor's reduction) take a memo index
//! without a key. [`batches`] says how the C pickler cuts a container's
//! items into `MARK ... SETITEMS`/`APPENDS` batches, and
//! [`Emitter::tensor_begin`] writes what torch.save writes for a plain dense
//! tensor (`torch._utils._rebuild_tensor_v2` and its arguments, the storage
//! as a persistent id).
//!
//! Pure Rust: the walk over Python objects lives in the binding.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::ops::Range;

/// The pickle protocol torch.save uses (`torch.serialization.DEFAULT_PROTOCOL`).
pub const PROTOCOL: u8 = 2;
/// Items per `MARK ... SETITEMS`/`APPENDS` batch (`_pickle.c`'s `BATCHSIZE`).
pub const BATCHSIZE: usize = 1000;

/// Pickle opcodes (`pickle.py`'s names), shared by the writer and the
/// reader (`crate::unpickle`).
pub(crate) mod op {
    pub(crate) const MARK: u8 = b'(';
    pub(crate) const STOP: u8 = b'.';
    pub(crate) const POP: u8 = b'0';
    pub(crate) const POP_MARK: u8 = b'1';
    pub(crate) const BININT: u8 = b'J';
    pub(crate) const BININT1: u8 = b'K';
    pub(crate) const BININT2: u8 = b'M';
    pub(crate) const NONE: u8 = b'N';
    pub(crate) const BINPERSID: u8 = b'Q';
    pub(crate) const REDUCE: u8 = b'R';
    pub(crate) const BINUNICODE: u8 = b'X';
    pub(crate) const APPEND: u8 = b'a';
    pub(crate) const BUILD: u8 = b'b';
    pub(crate) const EMPTY_DICT: u8 = b'}';
    pub(crate) const APPENDS: u8 = b'e';
    pub(crate) const BINGET: u8 = b'h';
    pub(crate) const LONG_BINGET: u8 = b'j';
    pub(crate) const EMPTY_LIST: u8 = b']';
    pub(crate) const BINPUT: u8 = b'q';
    pub(crate) const LONG_BINPUT: u8 = b'r';
    pub(crate) const SETITEM: u8 = b's';
    pub(crate) const TUPLE: u8 = b't';
    pub(crate) const EMPTY_TUPLE: u8 = b')';
    pub(crate) const SETITEMS: u8 = b'u';
    pub(crate) const BINFLOAT: u8 = b'G';
    pub(crate) const PROTO: u8 = 0x80;
    pub(crate) const TUPLE1: u8 = 0x85;
    pub(crate) const TUPLE2: u8 = 0x86;
    pub(crate) const TUPLE3: u8 = 0x87;
    pub(crate) const NEWTRUE: u8 = 0x88;
    pub(crate) const NEWFALSE: u8 = 0x89;
    pub(crate) const LONG1: u8 = 0x8a;
    pub(crate) const LONG4: u8 = 0x8b;
    pub(crate) const GLOBAL: u8 = b'c';
}

use op::{
    APPEND, APPENDS, BINFLOAT, BINGET, BININT, BININT1, BININT2, BINPERSID, BINPUT, BINUNICODE,
    BUILD, EMPTY_DICT, EMPTY_LIST, EMPTY_TUPLE, LONG1, LONG4, LONG_BINGET, LONG_BINPUT, MARK,
    NEWFALSE, NEWTRUE, NONE, POP, POP_MARK, PROTO, REDUCE, SETITEM, SETITEMS, STOP, TUPLE, TUPLE1,
    TUPLE2, TUPLE3,
};

/// What the C pickler refuses (it raises) and the fast path leaves to it:
/// a memo past 2**32 entries, a string or an int too long for protocol 2.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooLarge(pub &'static str);

/// Hashes object addresses (already unique): a multiply, no SipHash.
#[derive(Default)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_usize(&mut self, n: usize) {
        self.0 = (n as u64)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .rotate_left(29);
    }
}

/// A map keyed by object identity (addresses).
pub type IdMap<V> = HashMap<usize, V, BuildHasherDefault<IdHasher>>;

/// An empty [`IdMap`] with room for `n` entries.
pub fn id_map<V>(n: usize) -> IdMap<V> {
    IdMap::with_capacity_and_hasher(n, BuildHasherDefault::default())
}

/// A string the pickle may meet twice: its identity and its UTF-8 bytes
/// (`surrogatepass`, as the C pickler encodes).
#[derive(Debug, Clone, Copy)]
pub struct Str<'a> {
    pub id: usize,
    pub utf8: &'a [u8],
}

/// A class or function, pickled by reference: its identity and the bytes
/// the C pickler writes for it the first time (`GLOBAL module\nname\n`).
#[derive(Debug, Clone, Copy)]
pub struct Global<'a> {
    pub id: usize,
    pub raw: &'a [u8],
}

/// What torch.save pickles for a plain dense tensor: the reduction
/// `(_rebuild_tensor_v2, (storage, offset, size, stride, requires_grad,
/// OrderedDict()[, metadata]))`, the storage as the persistent id
/// `("storage", storage_type, key, location, numel)`.
#[derive(Debug, Clone, Copy)]
pub struct TensorReduce<'a> {
    /// `torch._utils._rebuild_tensor_v2`.
    pub rebuild: Global<'a>,
    /// The `"storage"` of the persistent id.
    pub storage_tag: Str<'a>,
    /// The storage class (`torch.FloatStorage`, ...).
    pub storage_type: Global<'a>,
    /// The storage's key (its record name in the archive).
    pub key: Str<'a>,
    /// The storage's location tag (`"cpu"`).
    pub location: Str<'a>,
    /// The storage's length in elements of the tensor's dtype.
    pub numel: i64,
    pub offset: i64,
    pub size: &'a [i64],
    pub stride: &'a [i64],
    pub requires_grad: bool,
    /// `collections.OrderedDict` (the empty backward hooks).
    pub odict: Global<'a>,
}

/// How a container's items are written: exact dicts (`batch_dict_exact`),
/// exact lists (`batch_list_exact`), and the items of a reduction's
/// iterator (`batch_dict`: an OrderedDict's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Items {
    DictExact,
    ListExact,
    DictIter,
}

/// One batch: the items it holds, and whether it is framed by `MARK ...
/// SETITEMS`/`APPENDS` (else one item and `SETITEM`/`APPEND`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    pub items: Range<usize>,
    pub marked: bool,
}

/// The batches the C pickler writes for `n` items of `kind`. Its three
/// loops differ at the edges: an exact dict of a multiple of 1000 items
/// ends with an empty `MARK SETITEMS`; an iterator's last batch of one item
/// is a bare `SETITEM`; a list of 1001 items ends with `MARK x APPENDS`.
pub fn batches(kind: Items, n: usize) -> Vec<Batch> {
    let mut out = Vec::with_capacity(n / BATCHSIZE + 2);
    if n == 0 {
        return out;
    }
    if n == 1 && kind != Items::DictIter {
        out.push(Batch {
            items: 0..1,
            marked: false,
        });
        return out;
    }
    let mut start = 0;
    match kind {
        Items::DictExact => loop {
            let end = (start + BATCHSIZE).min(n);
            out.push(Batch {
                items: start..end,
                marked: true,
            });
            if end - start < BATCHSIZE {
                break;
            }
            start = end;
        },
        Items::ListExact => {
            while start < n {
                let end = (start + BATCHSIZE).min(n);
                out.push(Batch {
                    items: start..end,
                    marked: true,
                });
                start = end;
            }
        }
        Items::DictIter => loop {
            let left = n - start;
            if left == 0 {
                break;
            }
            if left == 1 {
                out.push(Batch {
                    items: start..n,
                    marked: false,
                });
                break;
            }
            let end = start + left.min(BATCHSIZE);
            out.push(Batch {
                items: start..end,
                marked: true,
            });
            if end - start < BATCHSIZE {
                break;
            }
            start = end;
        },
    }
    out
}

/// The opcode writer and the memo of one pickle.
pub struct Emitter {
    out: Vec<u8>,
    memo: IdMap<u32>,
    next: u32,
}

impl Default for Emitter {
    fn default() -> Self {
        Self::new()
    }
}

impl Emitter {
    /// A pickle started: `PROTO 2`.
    pub fn new() -> Self {
        Self {
            out: vec![PROTO, PROTOCOL],
            memo: IdMap::default(),
            next: 0,
        }
    }

    /// The pickle, ended with `STOP`.
    pub fn finish(mut self) -> Vec<u8> {
        self.out.push(STOP);
        self.out
    }

    /// A pickle started, room made for `bytes` and `memo` entries.
    pub fn with_capacity(bytes: usize, memo: usize) -> Self {
        let mut e = Self::new();
        e.out.reserve(bytes);
        e.memo.reserve(memo);
        e
    }

    /// Bytes written so far.
    pub fn bytes(&self) -> &[u8] {
        &self.out
    }

    /// Entries in the memo (memoized objects and temporaries).
    pub fn memo_len(&self) -> u32 {
        self.next
    }

    /// Whether object `id` is in the memo.
    pub fn memoized(&self, id: usize) -> bool {
        self.memo.contains_key(&id)
    }

    /// `memo_get`: if `id` is memoized, write `BINGET`/`LONG_BINGET` and
    /// return true.
    pub fn get(&mut self, id: usize) -> bool {
        match self.memo.get(&id) {
            Some(&idx) => {
                self.write_get(idx);
                true
            }
            None => false,
        }
    }

    fn write_get(&mut self, idx: u32) {
        if let Ok(i) = u8::try_from(idx) {
            self.out.extend_from_slice(&[BINGET, i]);
        } else {
            self.out.push(LONG_BINGET);
            self.out.extend_from_slice(&idx.to_le_bytes());
        }
    }

    /// `memo_put`: the next memo index to `id` (None: a temporary nothing
    /// refers to again), written as `BINPUT`/`LONG_BINPUT`.
    pub fn put(&mut self, id: Option<usize>) -> Result<(), TooLarge> {
        let idx = self.next;
        self.next = idx
            .checked_add(1)
            .ok_or(TooLarge("memo id too large for LONG_BINPUT"))?;
        if let Some(id) = id {
            self.memo.insert(id, idx);
        }
        if let Ok(i) = u8::try_from(idx) {
            self.out.extend_from_slice(&[BINPUT, i]);
        } else {
            self.out.push(LONG_BINPUT);
            self.out.extend_from_slice(&idx.to_le_bytes());
        }
        Ok(())
    }

    pub fn none(&mut self) {
        self.out.push(NONE);
    }

    pub fn bool(&mut self, b: bool) {
        self.out.push(if b { NEWTRUE } else { NEWFALSE });
    }

    /// An int that fits a C long (`save_long`): `BININT1`/`BININT2`/`BININT`
    /// within 32 bits, else `LONG1`.
    pub fn int(&mut self, v: i64) {
        if let Ok(v) = i32::try_from(v) {
            let b = v.to_le_bytes();
            if b[2] != 0 || b[3] != 0 {
                self.out.push(BININT);
                self.out.extend_from_slice(&b);
            } else if b[1] != 0 {
                self.out.extend_from_slice(&[BININT2, b[0], b[1]]);
            } else {
                self.out.extend_from_slice(&[BININT1, b[0]]);
            }
            return;
        }
        let nbits = if v < 0 {
            // Bits of |v| (_PyLong_NumBits), i64::MIN included.
            64 - v.unsigned_abs().leading_zeros()
        } else {
            64 - v.leading_zeros()
        } as usize;
        let n = (nbits >> 3) + 1;
        let le = i128::from(v).to_le_bytes();
        // Infallible: n <= 9 bytes here.
        let _ = self.long(&le[..n], v < 0);
    }

    /// An int of any size as `LONG1`/`LONG4`, from its `(bits >> 3) + 1`
    /// little-endian two's-complement bytes (`int.to_bytes(..., signed=True)`
    /// with `bits` the bit length of its magnitude), as `save_long` takes
    /// them; a redundant sign byte of a negative int is dropped there.
    pub fn long(&mut self, le: &[u8], negative: bool) -> Result<(), TooLarge> {
        let mut n = le.len();
        if le.iter().all(|&b| b == 0) {
            // Zero: an empty byte string (save_long's sign == 0).
            self.out.extend_from_slice(&[LONG1, 0]);
            return Ok(());
        }
        if negative && n > 1 && le[n - 1] == 0xff && le[n - 2] & 0x80 != 0 {
            n -= 1;
        }
        if let Ok(n8) = u8::try_from(n) {
            self.out.extend_from_slice(&[LONG1, n8]);
        } else {
            let n32 = i32::try_from(n).map_err(|_| TooLarge("int too large to pickle"))?;
            self.out.push(LONG4);
            self.out.extend_from_slice(&n32.to_le_bytes());
        }
        self.out.extend_from_slice(&le[..n]);
        Ok(())
    }

    pub fn float(&mut self, v: f64) {
        self.out.push(BINFLOAT);
        self.out.extend_from_slice(&v.to_be_bytes());
    }

    /// A string (`save_unicode`): `BINGET` when memoized, else `BINUNICODE`
    /// and a memo entry.
    pub fn str(&mut self, s: Str<'_>) -> Result<(), TooLarge> {
        if self.get(s.id) {
            return Ok(());
        }
        let n = u32::try_from(s.utf8.len()).map_err(|_| TooLarge("string too large to pickle"))?;
        self.out.push(BINUNICODE);
        self.out.extend_from_slice(&n.to_le_bytes());
        self.out.extend_from_slice(s.utf8);
        self.put(Some(s.id))
    }

    /// A class or function (`save_global`): `BINGET` when memoized, else
    /// its bytes and a memo entry.
    pub fn global(&mut self, g: Global<'_>) -> Result<(), TooLarge> {
        if self.get(g.id) {
            return Ok(());
        }
        self.out.extend_from_slice(g.raw);
        self.put(Some(g.id))
    }

    /// `EMPTY_DICT` and its memo entry (`save_dict`).
    pub fn empty_dict(&mut self, id: usize) -> Result<(), TooLarge> {
        self.out.push(EMPTY_DICT);
        self.put(Some(id))
    }

    /// `EMPTY_LIST` and its memo entry (`save_list`).
    pub fn empty_list(&mut self, id: usize) -> Result<(), TooLarge> {
        self.out.push(EMPTY_LIST);
        self.put(Some(id))
    }

    pub fn empty_tuple(&mut self) {
        self.out.push(EMPTY_TUPLE);
    }

    pub fn mark(&mut self) {
        self.out.push(MARK);
    }

    /// Opens a batch of `kind`: `MARK` when the batch is framed.
    pub fn begin_batch(&mut self, b: &Batch) {
        if b.marked {
            self.mark();
        }
    }

    /// Closes a batch of `kind`: `SETITEMS`/`APPENDS` when framed, else
    /// `SETITEM`/`APPEND`.
    pub fn end_batch(&mut self, kind: Items, b: &Batch) {
        let list = kind == Items::ListExact;
        self.out.push(match (list, b.marked) {
            (true, true) => APPENDS,
            (true, false) => APPEND,
            (false, true) => SETITEMS,
            (false, false) => SETITEM,
        });
    }

    /// Ends a tuple of `len` elements already written (`save_tuple`; for
    /// more than 3, after a `MARK`): `id` None for a temporary. A tuple
    /// that is in the memo once its elements are written was recursive:
    /// its elements are popped and the memoized tuple fetched instead.
    pub fn end_tuple(&mut self, len: usize, id: Option<usize>) -> Result<(), TooLarge> {
        debug_assert!(len > 0);
        if let Some(idx) = id.and_then(|id| self.memo.get(&id).copied()) {
            if len <= 3 {
                self.out.extend(std::iter::repeat_n(POP, len));
            } else {
                self.out.push(POP_MARK);
            }
            self.write_get(idx);
            return Ok(());
        }
        self.out.push(match len {
            1 => TUPLE1,
            2 => TUPLE2,
            3 => TUPLE3,
            _ => TUPLE,
        });
        self.put(id)
    }

    /// A fresh tuple of ints (a tensor's size or stride).
    pub fn int_tuple(&mut self, v: &[i64]) -> Result<(), TooLarge> {
        if v.is_empty() {
            self.empty_tuple();
            return Ok(());
        }
        if v.len() > 3 {
            self.mark();
        }
        for &x in v {
            self.int(x);
        }
        self.end_tuple(v.len(), None)
    }

    pub fn reduce(&mut self) {
        self.out.push(REDUCE);
    }

    pub fn build(&mut self) {
        self.out.push(BUILD);
    }

    /// The start of a tensor's reduction as torch.save writes it: the
    /// rebuild function, then its arguments up to the empty backward hooks;
    /// the caller writes the seventh argument (the tensor's metadata), if
    /// any, and ends with [`Emitter::tensor_end`].
    pub fn tensor_begin(&mut self, t: &TensorReduce<'_>) -> Result<(), TooLarge> {
        self.global(t.rebuild)?;
        self.mark();
        // The storage: its persistent id, a fresh 5-tuple.
        self.mark();
        self.str(t.storage_tag)?;
        self.global(t.storage_type)?;
        self.str(t.key)?;
        self.str(t.location)?;
        self.int(t.numel);
        self.end_tuple(5, None)?;
        self.out.push(BINPERSID);
        self.int(t.offset);
        self.int_tuple(t.size)?;
        self.int_tuple(t.stride)?;
        self.bool(t.requires_grad);
        // OrderedDict(): reduced to (OrderedDict, ()), nothing more.
        self.global(t.odict)?;
        self.empty_tuple();
        self.reduce();
        self.put(None)
    }

    /// The end of the reduction of tensor `id` (not yet memoized), with
    /// or without the metadata argument.
    pub fn tensor_end(&mut self, id: usize, metadata: bool) -> Result<(), TooLarge> {
        self.end_tuple(if metadata { 7 } else { 6 }, None)?;
        self.reduce();
        self.put(Some(id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ints(vals: &[i64]) -> Vec<u8> {
        let mut e = Emitter::new();
        for &v in vals {
            e.int(v);
        }
        e.finish()
    }

    #[test]
    fn ints_choose_the_opcodes_of_save_long() {
        // pickle.dumps(v, 2)[2:-1] in CPython 3.11.
        let cases: &[(i64, &[u8])] = &[
            (0, b"K\x00"),
            (255, b"K\xff"),
            (256, b"M\x00\x01"),
            (65535, b"M\xff\xff"),
            (65536, b"J\x00\x00\x01\x00"),
            (-1, b"J\xff\xff\xff\xff"),
            (-128, b"J\x80\xff\xff\xff"),
            (-(1 << 31), b"J\x00\x00\x00\x80"),
            ((1 << 31) - 1, b"J\xff\xff\xff\x7f"),
            (1 << 31, b"\x8a\x05\x00\x00\x00\x80\x00"),
            (-(1 << 31) - 1, b"\x8a\x05\xff\xff\xff\x7f\xff"),
            (i64::MIN, b"\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80"),
            (i64::MAX, b"\x8a\x08\xff\xff\xff\xff\xff\xff\xff\x7f"),
            (-(1 << 32), b"\x8a\x05\x00\x00\x00\x00\xff"),
        ];
        for &(v, want) in cases {
            let got = ints(&[v]);
            assert_eq!(&got[2..got.len() - 1], want, "{v}");
        }
    }

    #[test]
    fn long_takes_bytes_of_any_size() {
        let mut e = Emitter::new();
        // 2**70: bits 71 -> 9 bytes + 0 sign byte.
        let mut le = vec![0u8; 9];
        le[8] = 0x40;
        e.long(&le, false).unwrap();
        // -(2**71): its own 256's complement in 9 bytes, plus a sign byte dropped.
        let mut neg = vec![0u8; 10];
        neg[8] = 0x80;
        neg[9] = 0xff;
        e.long(&neg, true).unwrap();
        // 256**300: LONG4.
        let mut big = vec![0u8; 301];
        big[300] = 1;
        e.long(&big, false).unwrap();
        let out = e.finish();
        let mut want = b"\x80\x02\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x40".to_vec();
        want.extend_from_slice(b"\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x80");
        want.extend_from_slice(b"\x8b\x2d\x01\x00\x00");
        want.extend_from_slice(&big);
        want.push(b'.');
        assert_eq!(out, want);
    }

    #[test]
    fn strings_are_memoized_by_identity() {
        let mut e = Emitter::new();
        let a = Str { id: 1, utf8: b"ab" };
        let b = Str { id: 2, ..a };
        e.str(a).unwrap();
        e.str(b).unwrap();
        e.str(a).unwrap();
        // pickle.dumps([s, s2, s], 2) items, s2 an equal string of its own.
        assert_eq!(
            e.finish(),
            b"\x80\x02X\x02\x00\x00\x00abq\x00X\x02\x00\x00\x00abq\x01h\x00."
        );
    }

    #[test]
    fn memo_indices_past_255_are_long() {
        let mut e = Emitter::new();
        for id in 0..300 {
            e.put(Some(id + 10)).unwrap();
        }
        assert!(e.get(10));
        assert!(e.get(299 + 10));
        let out = e.finish();
        assert_eq!(&out[2 + 2 * 256..2 + 2 * 256 + 5], b"r\x00\x01\x00\x00");
        let n = out.len();
        assert_eq!(&out[n - 8..], b"h\x00j\x2b\x01\x00\x00.");
    }

    #[test]
    fn batches_follow_the_three_loops() {
        let spans = |kind, n| {
            batches(kind, n)
                .into_iter()
                .map(|b| (b.items.start, b.items.end, b.marked))
                .collect::<Vec<_>>()
        };
        for kind in [Items::DictExact, Items::ListExact, Items::DictIter] {
            assert!(spans(kind, 0).is_empty());
        }
        assert_eq!(spans(Items::DictExact, 1), [(0, 1, false)]);
        assert_eq!(spans(Items::ListExact, 1), [(0, 1, false)]);
        assert_eq!(spans(Items::DictIter, 1), [(0, 1, false)]);
        assert_eq!(spans(Items::DictExact, 2), [(0, 2, true)]);
        assert_eq!(
            spans(Items::DictExact, 1000),
            [(0, 1000, true), (1000, 1000, true)]
        );
        assert_eq!(spans(Items::ListExact, 1000), [(0, 1000, true)]);
        assert_eq!(spans(Items::DictIter, 1000), [(0, 1000, true)]);
        assert_eq!(
            spans(Items::DictExact, 1001),
            [(0, 1000, true), (1000, 1001, true)]
        );
        assert_eq!(
            spans(Items::ListExact, 1001),
            [(0, 1000, true), (1000, 1001, true)]
        );
        assert_eq!(
            spans(Items::DictIter, 1001),
            [(0, 1000, true), (1000, 1001, false)]
        );
        assert_eq!(
            spans(Items::DictIter, 2002),
            [(0, 1000, true), (1000, 2000, true), (2000, 2002, true)]
        );
    }

    #[test]
    fn a_dict_of_two_items() {
        // pickle.dumps({"a": 1, "b": 2.5}, 2)
        let mut e = Emitter::new();
        e.empty_dict(100).unwrap();
        let b = &batches(Items::DictExact, 2)[0];
        e.begin_batch(b);
        e.str(Str { id: 1, utf8: b"a" }).unwrap();
        e.int(1);
        e.str(Str { id: 2, utf8: b"b" }).unwrap();
        e.float(2.5);
        e.end_batch(Items::DictExact, b);
        assert_eq!(
            e.finish(),
            b"\x80\x02}q\x00(X\x01\x00\x00\x00aq\x01K\x01X\x01\x00\x00\x00bq\x02G@\x04\x00\x00\x00\x00\x00\x00u."
        );
    }

    #[test]
    fn a_recursive_tuple_is_fetched_from_the_memo() {
        // l = []; t = (l,); l.append(t); pickle.dumps(t, 2)
        let mut e = Emitter::new();
        e.empty_list(1).unwrap();
        // inner t: l is memoized
        assert!(e.get(1));
        e.end_tuple(1, Some(2)).unwrap();
        e.end_batch(
            Items::ListExact,
            &Batch {
                items: 0..1,
                marked: false,
            },
        );
        e.end_tuple(1, Some(2)).unwrap();
        assert_eq!(e.finish(), b"\x80\x02]q\x00h\x00\x85q\x01a0h\x01.");
    }

    #[test]
    fn a_tensor_as_torch_save_writes_it() {
        // torch.save({"w": torch.zeros(2, 3)})'s data.pkl, after the dict's
        // first opcodes (pickling.pickle_obj's slow path, torch 2.15).
        let t = TensorReduce {
            rebuild: Global {
                id: 10,
                raw: b"ctorch._utils\n_rebuild_tensor_v2\n",
            },
            storage_tag: Str {
                id: 11,
                utf8: b"storage",
            },
            storage_type: Global {
                id: 12,
                raw: b"ctorch\nFloatStorage\n",
            },
            key: Str { id: 13, utf8: b"0" },
            location: Str {
                id: 14,
                utf8: b"cpu",
            },
            numel: 6,
            offset: 0,
            size: &[2, 3],
            stride: &[3, 1],
            requires_grad: false,
            odict: Global {
                id: 15,
                raw: b"ccollections\nOrderedDict\n",
            },
        };
        let mut e = Emitter::new();
        e.empty_dict(1).unwrap();
        e.str(Str { id: 2, utf8: b"w" }).unwrap();
        e.tensor_begin(&t).unwrap();
        e.tensor_end(3, false).unwrap();
        e.end_batch(
            Items::DictExact,
            &Batch {
                items: 0..1,
                marked: false,
            },
        );
        let want: &[u8] = b"\x80\x02}q\x00X\x01\x00\x00\x00wq\x01ctorch._utils\n_rebuild_tensor_v2\nq\x02((X\x07\x00\x00\x00storageq\x03ctorch\nFloatStorage\nq\x04X\x01\x00\x00\x000q\x05X\x03\x00\x00\x00cpuq\x06K\x06tq\x07QK\x00K\x02K\x03\x86q\x08K\x03K\x01\x86q\t\x89ccollections\nOrderedDict\nq\n)Rq\x0btq\x0cRq\rs.";
        assert_eq!(e.finish(), want);
    }
}
