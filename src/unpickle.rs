//! A protocol-2 pickle reader for the opcodes torch.save writes for plain
//! state dicts: the fast path of `fastpersist.pickling.unpickle`, the
//! mirror of [`crate::pickle`].
//!
//! [`run`] is the unpickler's stack machine (stack, marks, memo) over an
//! allowlist of opcodes; a [`Builder`] makes the objects (the binding makes
//! Python objects, the tests make Rust values). Whatever is outside the
//! allowlist, and any inconsistency (truncated data, a stack underflow, a
//! memo entry never put, an item left over at `STOP`), is [`Stop::Refused`]:
//! the caller then runs the full unpickler, which reports the problem in its
//! own words. The reader never indexes past its input and never panics; its
//! stack and memo hold at most one entry per opcode read.
//!
//! The opcodes read are the intersection of what CPython's C unpickler and
//! torch's `weights_only` unpickler read alike, so that the objects made
//! (and any error a [`Builder`] callback raises) are what either of them
//! would make at the same point: no `SHORT_BINUNICODE`/`BINUNICODE8`
//! (protocol 4; `weights_only` refuses them), `PROTO` 2 only (`weights_only`
//! warns about others), targets of `SETITEM(S)`/`APPEND(S)` within the
//! current mark (`weights_only`'s frames).
//!
//! Pure Rust: the Python objects live in the binding.

// Opcodes, shared with the writer (`crate::pickle::op`).
use crate::pickle::op::{
    APPEND, APPENDS, BINFLOAT, BINGET, BININT, BININT1, BININT2, BINPERSID, BINPUT, BINUNICODE,
    BUILD, EMPTY_DICT, EMPTY_LIST, EMPTY_TUPLE, GLOBAL, LONG1, LONG_BINGET, LONG_BINPUT, MARK,
    NEWFALSE, NEWTRUE, NONE, PROTO, REDUCE, SETITEM, SETITEMS, STOP, TUPLE, TUPLE1, TUPLE2, TUPLE3,
};

/// Why [`run`] stopped without an object.
#[derive(Debug, PartialEq, Eq)]
pub enum Stop<E> {
    /// The pickle is outside what this reader reads, or malformed: the
    /// reason, for tests and debugging.
    Refused(&'static str),
    /// A [`Builder`] call failed.
    Builder(E),
}

/// Makes the objects of a pickle. Each call may fail with the builder's own
/// error, which [`run`] hands back as [`Stop::Builder`] at once.
pub trait Builder {
    /// An object (a reference to it: cloning it shares the object, as the
    /// unpickler's stack and memo share theirs).
    type Obj: Clone;
    type Err;

    fn none(&mut self) -> Result<Self::Obj, Self::Err>;
    fn bool(&mut self, v: bool) -> Result<Self::Obj, Self::Err>;
    fn int(&mut self, v: i64) -> Result<Self::Obj, Self::Err>;
    /// An int of 9 to 255 little-endian two's-complement bytes (`LONG1`).
    fn long(&mut self, le: &[u8]) -> Result<Self::Obj, Self::Err>;
    fn float(&mut self, v: f64) -> Result<Self::Obj, Self::Err>;
    /// A string from its UTF-8 bytes (decoded with `surrogatepass`).
    fn str(&mut self, utf8: &[u8]) -> Result<Self::Obj, Self::Err>;
    fn empty_dict(&mut self) -> Result<Self::Obj, Self::Err>;
    fn empty_list(&mut self) -> Result<Self::Obj, Self::Err>;
    fn tuple(&mut self, items: Vec<Self::Obj>) -> Result<Self::Obj, Self::Err>;
    /// The object `GLOBAL module\nname\n` names (the bytes without their
    /// newlines).
    fn global(&mut self, module: &[u8], name: &[u8]) -> Result<Self::Obj, Self::Err>;
    /// `func(*args)` (`REDUCE`).
    fn reduce(&mut self, func: &Self::Obj, args: &Self::Obj) -> Result<Self::Obj, Self::Err>;
    /// The object of persistent id `pid` (`BINPERSID`).
    fn persistent(&mut self, pid: &Self::Obj) -> Result<Self::Obj, Self::Err>;
    /// `target[k] = v` for each `k, v` of `items` (`SETITEM(S)`).
    fn set_items(&mut self, target: &Self::Obj, items: &[Self::Obj]) -> Result<(), Self::Err>;
    /// `target.extend(items)` (`APPEND(S)`).
    fn append_items(&mut self, target: &Self::Obj, items: &[Self::Obj]) -> Result<(), Self::Err>;
    /// `inst`'s state set from `state` (`BUILD`).
    fn build(&mut self, inst: &Self::Obj, state: &Self::Obj) -> Result<(), Self::Err>;
}

/// The input and the read position.
struct Input<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Input<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n)?;
        let s = self.data.get(self.pos..end)?;
        self.pos = end;
        Some(s)
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N)?.try_into().ok()
    }

    fn u8(&mut self) -> Option<u8> {
        Some(self.array::<1>()?[0])
    }

    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.array()?))
    }

    /// A line without its `\n`.
    fn line(&mut self) -> Option<&'a [u8]> {
        let rest = self.data.get(self.pos..)?;
        let n = rest.iter().position(|&b| b == b'\n')?;
        self.pos += n + 1;
        Some(&rest[..n])
    }
}

/// Memo indices further than this past the entries put in order are
/// refused: the C unpickler sizes its memo by the index (twice it), so the
/// slow path is left to meet an index of 2**32 as it does today.
const MEMO_GAP: usize = 1 << 16;

const TRUNCATED: &str = "truncated pickle";
const UNDERFLOW: &str = "stack underflow";

/// The stack machine's state: the stack, the start of each open mark
/// (the C unpickler's fences), the memo: dense where its indices come in
/// order (as every pickler writes them), a map for the others, so that it
/// holds no more entries than the pickle's `PUT`s.
struct Machine<B: Builder> {
    stack: Vec<B::Obj>,
    marks: Vec<usize>,
    memo: Vec<B::Obj>,
    sparse: std::collections::HashMap<u32, B::Obj>,
}

impl<B: Builder> Machine<B> {
    fn fence(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    /// The top item, within the current mark.
    fn pop(&mut self) -> Result<B::Obj, Stop<B::Err>> {
        if self.stack.len() <= self.fence() {
            return Err(Stop::Refused(UNDERFLOW));
        }
        self.stack.pop().ok_or(Stop::Refused(UNDERFLOW))
    }

    /// The top item, left on the stack, within the current mark.
    fn top(&self) -> Result<&B::Obj, Stop<B::Err>> {
        if self.stack.len() <= self.fence() {
            return Err(Stop::Refused(UNDERFLOW));
        }
        self.stack.last().ok_or(Stop::Refused(UNDERFLOW))
    }

    /// The items pushed since the last `MARK`, which is closed.
    fn pop_mark(&mut self) -> Result<Vec<B::Obj>, Stop<B::Err>> {
        let m = self.marks.pop().ok_or(Stop::Refused("no MARK to pop"))?;
        Ok(self.stack.split_off(m.min(self.stack.len())))
    }

    /// The last `n` items (within the current mark), oldest first.
    fn pop_n(&mut self, n: usize) -> Result<Vec<B::Obj>, Stop<B::Err>> {
        let len = self.stack.len();
        if len < n || len - n < self.fence() {
            return Err(Stop::Refused(UNDERFLOW));
        }
        Ok(self.stack.split_off(len - n))
    }

    fn put(&mut self, idx: u32) -> Result<(), Stop<B::Err>> {
        let v = self.top()?.clone();
        let i = idx as usize;
        match i.cmp(&self.memo.len()) {
            std::cmp::Ordering::Less => self.memo[i] = v,
            std::cmp::Ordering::Equal => self.memo.push(v),
            std::cmp::Ordering::Greater if i - self.memo.len() <= MEMO_GAP => {
                self.sparse.insert(idx, v);
            }
            std::cmp::Ordering::Greater => {
                return Err(Stop::Refused("memo index far out of order"))
            }
        }
        Ok(())
    }

    fn get(&mut self, idx: u32) -> Result<(), Stop<B::Err>> {
        let v = self
            .memo
            .get(idx as usize)
            .or_else(|| self.sparse.get(&idx))
            .ok_or(Stop::Refused("memo entry never put"))?
            .clone();
        self.stack.push(v);
        Ok(())
    }
}

/// A `LONG1` int: its `n` bytes sign-extended, when they fit an i64.
fn small_long(le: &[u8]) -> Option<i64> {
    if le.len() > 8 {
        return None;
    }
    let negative = le.last().is_some_and(|&b| b & 0x80 != 0);
    let mut b = [if negative { 0xff } else { 0 }; 8];
    b[..le.len()].copy_from_slice(le);
    Some(i64::from_le_bytes(b))
}

/// The object of a scalar opcode (`op`, its operand read from `inp`):
/// constants, ints, floats, strings, empty containers, globals.
fn scalar<B: Builder>(op: u8, inp: &mut Input<'_>, b: &mut B) -> Result<B::Obj, Stop<B::Err>> {
    let err = Stop::Builder;
    Ok(match op {
        NONE => b.none().map_err(err)?,
        NEWTRUE => b.bool(true).map_err(err)?,
        NEWFALSE => b.bool(false).map_err(err)?,
        BININT => {
            let v = i32::from_le_bytes(inp.array().ok_or(Stop::Refused(TRUNCATED))?);
            b.int(i64::from(v)).map_err(err)?
        }
        BININT1 => {
            let v = inp.u8().ok_or(Stop::Refused(TRUNCATED))?;
            b.int(i64::from(v)).map_err(err)?
        }
        BININT2 => {
            let v = u16::from_le_bytes(inp.array().ok_or(Stop::Refused(TRUNCATED))?);
            b.int(i64::from(v)).map_err(err)?
        }
        LONG1 => {
            let n = inp.u8().ok_or(Stop::Refused(TRUNCATED))?;
            let le = inp.take(n.into()).ok_or(Stop::Refused(TRUNCATED))?;
            match small_long(le) {
                Some(v) => b.int(v).map_err(err)?,
                None => b.long(le).map_err(err)?,
            }
        }
        BINFLOAT => {
            let v = f64::from_be_bytes(inp.array().ok_or(Stop::Refused(TRUNCATED))?);
            b.float(v).map_err(err)?
        }
        BINUNICODE => {
            let n = inp.u32().ok_or(Stop::Refused(TRUNCATED))?;
            let s = inp.take(n as usize).ok_or(Stop::Refused(TRUNCATED))?;
            b.str(s).map_err(err)?
        }
        EMPTY_DICT => b.empty_dict().map_err(err)?,
        EMPTY_LIST => b.empty_list().map_err(err)?,
        EMPTY_TUPLE => b.tuple(Vec::new()).map_err(err)?,
        GLOBAL => {
            let module = inp.line().ok_or(Stop::Refused(TRUNCATED))?;
            let name = inp.line().ok_or(Stop::Refused(TRUNCATED))?;
            b.global(module, name).map_err(err)?
        }
        _ => return Err(Stop::Refused("opcode outside the fast path")),
    })
}

/// The object of the pickle `data`, made by `b`; see the module comment
/// for what is read and what is [`Stop::Refused`]. Anything after `STOP`
/// is refused too.
pub fn run<B: Builder>(data: &[u8], b: &mut B) -> Result<B::Obj, Stop<B::Err>> {
    let mut inp = Input { data, pos: 0 };
    let mut m: Machine<B> = Machine {
        stack: Vec::with_capacity(64),
        marks: Vec::with_capacity(16),
        memo: Vec::new(),
        sparse: std::collections::HashMap::new(),
    };
    let err = Stop::Builder;
    loop {
        let op = inp.u8().ok_or(Stop::Refused(TRUNCATED))?;
        let obj = match op {
            PROTO => {
                if inp.u8() != Some(2) {
                    return Err(Stop::Refused("not protocol 2"));
                }
                continue;
            }
            STOP => {
                if !m.marks.is_empty() || m.stack.len() != 1 {
                    return Err(Stop::Refused("items left at STOP"));
                }
                if inp.pos != data.len() {
                    return Err(Stop::Refused("bytes after STOP"));
                }
                return m.stack.pop().ok_or(Stop::Refused(UNDERFLOW));
            }
            MARK => {
                m.marks.push(m.stack.len());
                continue;
            }
            TUPLE => {
                let items = m.pop_mark()?;
                b.tuple(items).map_err(err)?
            }
            TUPLE1 | TUPLE2 | TUPLE3 => {
                let items = m.pop_n(usize::from(op - TUPLE1 + 1))?;
                b.tuple(items).map_err(err)?
            }
            BINPUT => {
                let i = inp.u8().ok_or(Stop::Refused(TRUNCATED))?;
                m.put(i.into())?;
                continue;
            }
            LONG_BINPUT => {
                let i = inp.u32().ok_or(Stop::Refused(TRUNCATED))?;
                m.put(i)?;
                continue;
            }
            BINGET => {
                let i = inp.u8().ok_or(Stop::Refused(TRUNCATED))?;
                m.get(i.into())?;
                continue;
            }
            LONG_BINGET => {
                let i = inp.u32().ok_or(Stop::Refused(TRUNCATED))?;
                m.get(i)?;
                continue;
            }
            SETITEM => {
                let kv = m.pop_n(2)?;
                b.set_items(m.top()?, &kv).map_err(err)?;
                continue;
            }
            SETITEMS => {
                let kv = m.pop_mark()?;
                if kv.len() % 2 != 0 {
                    return Err(Stop::Refused("odd number of items for SETITEMS"));
                }
                b.set_items(m.top()?, &kv).map_err(err)?;
                continue;
            }
            APPEND => {
                let v = m.pop_n(1)?;
                b.append_items(m.top()?, &v).map_err(err)?;
                continue;
            }
            APPENDS => {
                let v = m.pop_mark()?;
                b.append_items(m.top()?, &v).map_err(err)?;
                continue;
            }
            REDUCE => {
                let args = m.pop()?;
                let func = m.pop()?;
                b.reduce(&func, &args).map_err(err)?
            }
            BINPERSID => {
                let pid = m.pop()?;
                b.persistent(&pid).map_err(err)?
            }
            BUILD => {
                let state = m.pop()?;
                b.build(m.top()?, &state).map_err(err)?;
                continue;
            }
            _ => scalar(op, &mut inp, b)?,
        };
        m.stack.push(obj);
    }
}

/// How large a memo the pickle in `data` (up to its `STOP`) can ask of an
/// unpickler: one more than the largest index a `PUT`, `BINPUT` or
/// `LONG_BINPUT` names, or the number of entries put, whichever is more
/// (`MEMOIZE` puts at the memo's length). CPython's C unpickler sizes its
/// memo array by the largest index it is given, so a few bytes naming
/// index 2**27 cost it gigabytes; a caller asks this first. Any opcode of
/// protocols 0 to 5 is walked over (its argument skipped, nothing made);
/// `None` when the data is not a complete pickle (truncated, an unknown
/// opcode, a text argument that is not one).
pub fn memo_bound(data: &[u8]) -> Option<u64> {
    let mut at = 0usize;
    let mut most = 0u64;
    let mut puts = 0u64;
    let take = |at: &mut usize, n: usize| -> Option<&[u8]> {
        let end = at.checked_add(n)?;
        let s = data.get(*at..end)?;
        *at = end;
        Some(s)
    };
    let uint = |b: &[u8]| b.iter().rev().fold(0u64, |v, &x| (v << 8) | u64::from(x));
    loop {
        let op = *take(&mut at, 1)?.first()?;
        match op {
            // No argument.
            b'(' | b'0' | b'1' | b'2' | b'N' | b']' | b'a' | b'e' | b'l' | b')' | b't' | b'}'
            | b'd' | b's' | b'u' | b'b' | b'R' | b'o' | b'Q' | 0x81 | 0x85 | 0x86 | 0x87 | 0x88
            | 0x89 | 0x8f | 0x90 | 0x91 | 0x92 | 0x93 | 0x97 | 0x98 => {}
            b'.' => return Some(most.max(puts)),
            0x94 => puts += 1, // MEMOIZE
            // Fixed-size arguments; the memo indices among them.
            b'q' => {
                most = most.max(uint(take(&mut at, 1)?) + 1);
                puts += 1;
            }
            b'r' => {
                most = most.max(uint(take(&mut at, 4)?) + 1);
                puts += 1;
            }
            b'K' | b'h' | 0x80 | 0x82 => {
                take(&mut at, 1)?;
            }
            b'M' | 0x83 => {
                take(&mut at, 2)?;
            }
            b'J' | b'j' | 0x84 => {
                take(&mut at, 4)?;
            }
            b'G' | 0x95 => {
                take(&mut at, 8)?;
            }
            // A length, then that many bytes.
            b'U' | b'C' | 0x8c | 0x8a => {
                let n = uint(take(&mut at, 1)?);
                take(&mut at, usize::try_from(n).ok()?)?;
            }
            b'T' | b'B' | b'X' | 0x8b => {
                let n = uint(take(&mut at, 4)?);
                take(&mut at, usize::try_from(n).ok()?)?;
            }
            0x8d | 0x8e | 0x96 => {
                let n = uint(take(&mut at, 8)?);
                take(&mut at, usize::try_from(n).ok()?)?;
            }
            // Text arguments, each ending with a newline.
            b'p' => {
                let line = text_line(data, &mut at)?;
                let idx: u64 = std::str::from_utf8(line).ok()?.trim().parse().ok()?;
                most = most.max(idx.checked_add(1)?);
                puts += 1;
            }
            b'I' | b'L' | b'F' | b'S' | b'V' | b'P' | b'g' => {
                text_line(data, &mut at)?;
            }
            b'c' | b'i' => {
                text_line(data, &mut at)?;
                text_line(data, &mut at)?;
            }
            _ => return None,
        }
    }
}

/// The bytes from `*at` to the next newline, and `*at` past it.
fn text_line<'a>(data: &'a [u8], at: &mut usize) -> Option<&'a [u8]> {
    let rest = data.get(*at..)?;
    let n = rest.iter().position(|&b| b == b'\n')?;
    *at += n + 1;
    Some(&rest[..n])
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::rc::Rc;

    /// Rust values for the tests: containers are shared (`Rc`), as the
    /// unpickler's objects are.
    #[derive(Debug, Clone)]
    enum V {
        None,
        Bool(bool),
        Int(i128),
        Float(f64),
        Str(String),
        Dict(Rc<RefCell<Vec<(V, V)>>>),
        List(Rc<RefCell<Vec<V>>>),
        Tuple(Rc<Vec<V>>),
        Global(String),
        OrderedDict(Rc<RefCell<Vec<(V, V)>>>),
        Storage(Rc<String>),
        Tensor(Rc<(V, V)>),
    }

    impl PartialEq for V {
        fn eq(&self, o: &Self) -> bool {
            match (self, o) {
                (V::None, V::None) => true,
                (V::Bool(a), V::Bool(b)) => a == b,
                (V::Int(a), V::Int(b)) => a == b,
                (V::Float(a), V::Float(b)) => a.to_bits() == b.to_bits(),
                (V::Str(a), V::Str(b)) | (V::Global(a), V::Global(b)) => a == b,
                (V::Dict(a), V::Dict(b)) | (V::OrderedDict(a), V::OrderedDict(b)) => {
                    *a.borrow() == *b.borrow()
                }
                (V::List(a), V::List(b)) => *a.borrow() == *b.borrow(),
                (V::Tuple(a), V::Tuple(b)) => a == b,
                (V::Storage(a), V::Storage(b)) => a == b,
                (V::Tensor(a), V::Tensor(b)) => a == b,
                _ => false,
            }
        }
    }

    /// What the binding's builder allows, in Rust values; `persisted`
    /// counts persistent loads.
    #[derive(Default)]
    struct Vals {
        persisted: usize,
        fail_persistent: bool,
    }

    impl Builder for Vals {
        type Obj = V;
        type Err = &'static str;
        fn none(&mut self) -> Result<V, Self::Err> {
            Ok(V::None)
        }
        fn bool(&mut self, v: bool) -> Result<V, Self::Err> {
            Ok(V::Bool(v))
        }
        fn int(&mut self, v: i64) -> Result<V, Self::Err> {
            Ok(V::Int(v.into()))
        }
        fn long(&mut self, le: &[u8]) -> Result<V, Self::Err> {
            if le.len() > 16 {
                return Err("long");
            }
            let neg = le.last().is_some_and(|&b| b & 0x80 != 0);
            let mut b = [if neg { 0xff } else { 0 }; 16];
            b[..le.len()].copy_from_slice(le);
            Ok(V::Int(i128::from_le_bytes(b)))
        }
        fn float(&mut self, v: f64) -> Result<V, Self::Err> {
            Ok(V::Float(v))
        }
        fn str(&mut self, utf8: &[u8]) -> Result<V, Self::Err> {
            Ok(V::Str(
                String::from_utf8(utf8.to_vec()).map_err(|_| "utf8")?,
            ))
        }
        fn empty_dict(&mut self) -> Result<V, Self::Err> {
            Ok(V::Dict(Rc::default()))
        }
        fn empty_list(&mut self) -> Result<V, Self::Err> {
            Ok(V::List(Rc::default()))
        }
        fn tuple(&mut self, items: Vec<V>) -> Result<V, Self::Err> {
            Ok(V::Tuple(Rc::new(items)))
        }
        fn global(&mut self, module: &[u8], name: &[u8]) -> Result<V, Self::Err> {
            match (module, name) {
                (b"collections", b"OrderedDict")
                | (b"torch._utils", b"_rebuild_tensor_v2")
                | (b"torch", b"FloatStorage") => Ok(V::Global(format!(
                    "{}.{}",
                    String::from_utf8_lossy(module),
                    String::from_utf8_lossy(name)
                ))),
                _ => Err("global"),
            }
        }
        fn reduce(&mut self, func: &V, args: &V) -> Result<V, Self::Err> {
            let (V::Global(f), V::Tuple(a)) = (func, args) else {
                return Err("reduce");
            };
            match (f.as_str(), a.len()) {
                ("collections.OrderedDict", 0) => Ok(V::OrderedDict(Rc::default())),
                ("torch._utils._rebuild_tensor_v2", 6) => {
                    Ok(V::Tensor(Rc::new((a[0].clone(), a[2].clone()))))
                }
                _ => Err("reduce"),
            }
        }
        fn persistent(&mut self, pid: &V) -> Result<V, Self::Err> {
            if self.fail_persistent {
                return Err("persistent_load raised");
            }
            let V::Tuple(t) = pid else {
                return Err("pid");
            };
            self.persisted += 1;
            match t.get(2) {
                Some(V::Str(k)) => Ok(V::Storage(Rc::new(k.clone()))),
                _ => Err("pid"),
            }
        }
        fn set_items(&mut self, target: &V, items: &[V]) -> Result<(), Self::Err> {
            let (V::Dict(d) | V::OrderedDict(d)) = target else {
                return Err("setitem");
            };
            for kv in items.chunks(2) {
                d.borrow_mut().push((kv[0].clone(), kv[1].clone()));
            }
            Ok(())
        }
        fn append_items(&mut self, target: &V, items: &[V]) -> Result<(), Self::Err> {
            let V::List(l) = target else {
                return Err("append");
            };
            l.borrow_mut().extend_from_slice(items);
            Ok(())
        }
        fn build(&mut self, inst: &V, state: &V) -> Result<(), Self::Err> {
            match (inst, state) {
                (V::OrderedDict(_), V::Dict(_)) => Ok(()),
                _ => Err("build"),
            }
        }
    }

    fn load(data: &[u8]) -> Result<V, Stop<&'static str>> {
        run(data, &mut Vals::default())
    }

    fn s(x: &str) -> V {
        V::Str(x.into())
    }

    fn list(items: Vec<V>) -> V {
        V::List(Rc::new(RefCell::new(items)))
    }

    /// torch.save({"w": torch.zeros(2, 3)})'s data.pkl (pickle.rs's test).
    const TENSOR_PKL: &[u8] = b"\x80\x02}q\x00X\x01\x00\x00\x00wq\x01ctorch._utils\n_rebuild_tensor_v2\nq\x02((X\x07\x00\x00\x00storageq\x03ctorch\nFloatStorage\nq\x04X\x01\x00\x00\x000q\x05X\x03\x00\x00\x00cpuq\x06K\x06tq\x07QK\x00K\x02K\x03\x86q\x08K\x03K\x01\x86q\t\x89ccollections\nOrderedDict\nq\n)Rq\x0btq\x0cRq\rs.";

    #[test]
    fn plain_values() {
        // pickle.dumps({"a": 1, "b": 2.5}, 2)
        let d = load(b"\x80\x02}q\x00(X\x01\x00\x00\x00aq\x01K\x01X\x01\x00\x00\x00bq\x02G@\x04\x00\x00\x00\x00\x00\x00u.").unwrap();
        let want = V::Dict(Rc::new(RefCell::new(vec![
            (s("a"), V::Int(1)),
            (s("b"), V::Float(2.5)),
        ])));
        assert_eq!(d, want);
        // pickle.dumps([None, True, False, -1, 65535, 2**40, -(2**70), ()], 2)
        let l = load(b"\x80\x02]q\x00(N\x88\x89J\xff\xff\xff\xffM\xff\xff\x8a\x06\x00\x00\x00\x00\x00\x01\x8a\t\x00\x00\x00\x00\x00\x00\x00\x00\xc0)e.").unwrap();
        assert_eq!(
            l,
            list(vec![
                V::None,
                V::Bool(true),
                V::Bool(false),
                V::Int(-1),
                V::Int(65535),
                V::Int(1 << 40),
                V::Int(-(1 << 70)),
                V::Tuple(Rc::new(vec![])),
            ])
        );
    }

    #[test]
    fn a_tensor_as_torch_save_writes_it() {
        let mut b = Vals::default();
        let d = run(TENSOR_PKL, &mut b).unwrap();
        let V::Dict(d) = d else { panic!() };
        let d = d.borrow();
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].0, s("w"));
        let V::Tensor(t) = &d[0].1 else { panic!() };
        assert_eq!(t.0, V::Storage(Rc::new("0".into())));
        assert_eq!(t.1, V::Tuple(Rc::new(vec![V::Int(2), V::Int(3)])));
        assert_eq!(b.persisted, 1);
    }

    #[test]
    fn the_memo_shares_objects() {
        // l = []; pickle.dumps([l, l], 2)
        let v = load(b"\x80\x02]q\x00(]q\x01h\x01e.").unwrap();
        let V::List(outer) = v else { panic!() };
        let outer = outer.borrow();
        let (V::List(a), V::List(b)) = (&outer[0], &outer[1]) else {
            panic!()
        };
        assert!(Rc::ptr_eq(a, b));
        // LONG_BINPUT / LONG_BINGET, indices out of order (a map, not
        // 2**32 slots), a later PUT to an index replacing the earlier one
        let v = load(b"\x80\x02]r\x01\x00\x00\x00(j\x01\x00\x00\x00e.");
        assert!(v.is_ok());
        let v = load(b"\x80\x02]r\x00\x00\x01\x00(j\x00\x00\x01\x00e.");
        assert!(v.is_ok());
        let v = load(b"\x80\x02]r\xff\xff\xff\xff(j\xff\xff\xff\xffe.");
        assert_eq!(v, Err(Stop::Refused("memo index far out of order")));
        let v = load(
            b"\x80\x02(K\x01r\x05\x00\x00\x00K\x02q\x00K\x03q\x05h\x05j\x05\x00\x00\x00h\x00t.",
        );
        assert_eq!(
            v,
            Ok(V::Tuple(Rc::new(vec![
                V::Int(1),
                V::Int(2),
                V::Int(3),
                V::Int(3),
                V::Int(3),
                V::Int(2)
            ])))
        );
    }

    #[test]
    fn builder_errors_stop_at_once() {
        let mut b = Vals {
            fail_persistent: true,
            ..Vals::default()
        };
        assert_eq!(
            run(TENSOR_PKL, &mut b),
            Err(Stop::Builder("persistent_load raised"))
        );
        assert_eq!(
            load(b"\x80\x02cos\nsystem\n."),
            Err(Stop::Builder("global"))
        );
    }

    #[test]
    fn malformed_pickles_are_refused() {
        let refused: &[&[u8]] = &[
            b"",
            b"\x80",
            b"\x80\x03N.",
            b"\x80\x02",
            b"\x80\x02N",
            b"\x80\x02NN.",
            b"\x80\x02(N.",
            b"\x80\x02.",
            b"\x80\x02N.x",
            b"\x80\x02h\x00.",
            b"\x80\x02Nq\x05h\x06.",
            b"\x80\x02q\x00N.",
            b"\x80\x02]r\xff\xff\xff\xffN.",
            b"\x80\x02t.",
            b"\x80\x02N(\x85.",
            b"\x80\x02N(\x86.",
            b"\x80\x02N\x87.",
            b"\x80\x02}(Nu.",
            b"\x80\x02}(s.",
            b"\x80\x02](a.",
            b"\x80\x02(e.",
            b"\x80\x02(u.",
            b"\x80\x02NR.",
            b"\x80\x02Q.",
            b"\x80\x02}(b.",
            b"\x80\x02X\x05\x00\x00\x00ab.",
            b"\x80\x02X\xff\xff\xff\xff.",
            b"\x80\x02\x8a\x05\x00.",
            b"\x80\x02cos\nsys",
            b"\x80\x02J\x00\x00.",
            b"\x80\x02G\x00\x00\x00.",
            b"\x80\x02\x8c\x01a.",
            b"\x80\x02I1\n.",
            b"\x80\x02\x94.",
        ];
        for &p in refused {
            assert!(
                matches!(load(p), Err(Stop::Refused(_))),
                "{p:?}: {:?}",
                load(p)
            );
        }
    }

    #[test]
    fn every_prefix_and_every_byte_flip_of_a_real_pickle_is_safe() {
        for n in 0..TENSOR_PKL.len() {
            assert!(load(&TENSOR_PKL[..n]).is_err(), "{n}");
        }
        for i in 0..TENSOR_PKL.len() {
            for x in [0u8, 1, 0x7f, 0x80, 0xff, b'(', b'q', b'h', b'.'] {
                let mut p = TENSOR_PKL.to_vec();
                p[i] = x;
                let _ = load(&p);
            }
        }
    }

    use proptest::prelude::*;

    proptest! {
        #[test]
        fn garbage_never_panics(data in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = load(&data);
        }

        #[test]
        fn opcode_soup_never_panics(
            ops in proptest::collection::vec(
                prop_oneof![
                    Just(&b"("[..]), Just(&b"t"[..]), Just(&b"\x85"[..]), Just(&b"\x86"[..]),
                    Just(&b"\x87"[..]), Just(&b"}"[..]), Just(&b"]"[..]), Just(&b")"[..]),
                    Just(&b"s"[..]), Just(&b"u"[..]), Just(&b"a"[..]), Just(&b"e"[..]),
                    Just(&b"N"[..]), Just(&b"K\x01"[..]), Just(&b"q\x00"[..]), Just(&b"q\x01"[..]),
                    Just(&b"h\x00"[..]), Just(&b"h\x01"[..]), Just(&b"R"[..]), Just(&b"Q"[..]),
                    Just(&b"b"[..]), Just(&b"ccollections\nOrderedDict\n"[..]),
                    Just(&b"X\x01\x00\x00\x00a"[..]), Just(&b"."[..]),
                ],
                0..64,
            )
        ) {
            let mut data = b"\x80\x02".to_vec();
            for op in ops {
                data.extend_from_slice(op);
            }
            let _ = load(&data);
        }
    }

    #[test]
    fn memo_bound_walks_every_protocol_and_names_the_largest_index() {
        use super::memo_bound;
        // protocol 2: BINPUT 0, two ints, APPENDS
        assert_eq!(memo_bound(b"\x80\x02]q\x00(K\x01K\x02e."), Some(1));
        // one LONG_BINPUT of a large index in a tiny pickle
        assert_eq!(
            memo_bound(b"\x80\x02]r\x00\x00\x00\x08."),
            Some((1 << 27) + 1)
        );
        // protocol 0: PUT as text
        assert_eq!(memo_bound(b"(lp0\nI1\naI2\na."), Some(1));
        assert_eq!(memo_bound(b"(lp70000\nI1\na."), Some(70001));
        // protocol 4: a frame, MEMOIZE, a short string
        assert_eq!(
            memo_bound(b"\x80\x04\x95\x08\x00\x00\x00\x00\x00\x00\x00]\x94\x8c\x01a\x94a."),
            Some(2)
        );
        // GLOBAL's two lines, BINUNICODE's length, BINFLOAT's 8 bytes
        assert_eq!(memo_bound(b"ccollections\nOrderedDict\nq\x05X\x01\x00\x00\x00xG\x00\x00\x00\x00\x00\x00\x00\x000."), Some(6));
        // not a complete pickle
        for bad in [
            &b""[..],
            b"\x80\x02]",
            b"\x80\x02]r\x00\x00",
            b"\xff.",
            b"X\xff\xff\xff\xff.",
            b"p-1\n.",
            b"cmod.",
        ] {
            assert_eq!(memo_bound(bad), None, "{bad:?}");
        }
        // bytes after STOP are not read
        assert_eq!(memo_bound(b"N.\xff\xff"), Some(0));
    }
}
