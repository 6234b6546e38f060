"""The safetensors format: layout for writing, header parsing for reading.

A safetensors file is an 8-byte little-endian header length, a JSON header
(name -> dtype, shape, data_offsets; optional ``__metadata__`` of strings)
and the tensors' bytes back to back, covering the data area exactly. We
write what ``safetensors.torch.save_file`` writes, byte for byte, except the
header padding: safetensors pads the header with spaces to a multiple of 8,
we pad it so the data starts at a 4096-byte boundary (the O_DIRECT bulk is
then aligned). Tensors are in safetensors' order (its dtype order, widest
first, then by name), so every tensor is aligned to its dtype; names and
metadata are raw UTF-8. Reading accepts exactly what safetensors accepts.
"""

from __future__ import annotations

import json
import math
import struct
from collections import defaultdict
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch

from . import _core
from .errors import (
    CorruptCheckpointError,
    NoDataError,
    NoSafetensorsDtypeError,
    SerializationError,
    SharedTensorsError,
    UnsupportedDtypeError,
)
from .pickling import check_extent
from .plan import DATA_ALIGNMENT, Blob, Plan, Region

__all__ = [
    "plan_safetensors",
    "parse_header",
    "is_safetensors",
    "torch_shape",
    "torch_dtype_error",
    "shared_groups",
    "Entry",
    "DTYPES",
    "BITS",
]

#: safetensors' dtype codes in the order of its ``Dtype`` enum (files list
#: tensors by decreasing position here, then by name), each with its bits
#: per element and the torch dtype it maps to (None: torch has none). F4 is
#: torch's ``float4_e2m1fn_x2``: one torch element is two F4 values, so the
#: header's last dimension is twice torch's.
_CODES: Tuple[Tuple[str, int, Optional[str]], ...] = (
    ("BOOL", 8, "bool"),
    ("F4", 4, "float4_e2m1fn_x2"),
    ("F6_E2M3", 6, None),
    ("F6_E3M2", 6, None),
    ("U8", 8, "uint8"),
    ("I8", 8, "int8"),
    ("F8_E5M2", 8, "float8_e5m2"),
    ("F8_E4M3", 8, "float8_e4m3fn"),
    ("F8_E8M0", 8, "float8_e8m0fnu"),
    ("F8_E4M3FNUZ", 8, "float8_e4m3fnuz"),
    ("F8_E5M2FNUZ", 8, "float8_e5m2fnuz"),
    ("I16", 16, "int16"),
    ("U16", 16, "uint16"),
    ("F16", 16, "float16"),
    ("BF16", 16, "bfloat16"),
    ("I32", 32, "int32"),
    ("U32", 32, "uint32"),
    ("F32", 32, "float32"),
    ("C64", 64, "complex64"),
    ("F64", 64, "float64"),
    ("I64", 64, "int64"),
    ("U64", 64, "uint64"),
)
#: safetensors dtype code -> bits per element (every code of the format).
BITS: Dict[str, int] = {code: bits for code, bits, _ in _CODES}
_RANK = {code: i for i, (code, _, _) in enumerate(_CODES)}
#: safetensors dtype code -> torch dtype (those this torch has).
DTYPES: Dict[str, torch.dtype] = {
    code: getattr(torch, name) for code, _, name in _CODES if name is not None and hasattr(torch, name)
}
_BY_DTYPE = {v: k for k, v in DTYPES.items()}
#: Largest header we accept when reading (safetensors' own limit is 100 MB).
MAX_HEADER = 100_000_000


def _check_entry(name: Any, t: Any) -> None:
    if not isinstance(name, str):
        raise SerializationError(f"safetensors keys must be str, got {name!r}")
    if name == "__metadata__":
        raise SerializationError("'__metadata__' is reserved in safetensors")
    if not isinstance(t, torch.Tensor):
        raise SerializationError(f"[{name!r}]: safetensors holds only tensors, not {type(t).__name__}")
    if t.layout is not torch.strided:
        raise SerializationError(
            f"[{name!r}]: safetensors cannot hold {t.layout} tensors (make it dense with .to_dense() first)"
        )
    if t.device.type == "meta":
        raise NoDataError(f"[{name!r}]: a tensor on the meta device has no data to save")
    check_extent(t, f"[{name!r}]")
    if t.dtype not in _BY_DTYPE:
        raise NoSafetensorsDtypeError(f"[{name!r}]: safetensors has no dtype for {t.dtype}")
    if _BY_DTYPE[t.dtype] == "F4" and t.dim() == 0:
        raise SerializationError(
            f"[{name!r}]: a 0-dim {t.dtype} tensor has no safetensors shape (F4 counts the two values of "
            "each element along the last dimension); reshape it to (1,)"
        )


def _check_metadata(metadata: Any) -> Optional[Dict[str, str]]:
    """The metadata as safetensors takes it: None, or a dict of str to str
    (``{}`` is written, as safetensors writes it). TypeError otherwise."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict):  # (safetensors refuses any other mapping too)
        raise SerializationError(f"safetensors metadata must be a dict of str to str, not {type(metadata).__name__}")
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise SerializationError(
                f"safetensors metadata must map str to str; got {k!r}: {type(v).__name__} (convert values with str())"
            )
    return dict(metadata)


def _span(t: torch.Tensor) -> int:
    """Bytes from a tensor's first element to the end of its last one."""
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()


def shared_groups(tensors: Mapping[str, torch.Tensor]) -> List[List[str]]:
    """Groups of names whose tensors' bytes overlap (a tie, a view of
    another entry), sorted; tensors of one storage that do not overlap are
    not shared (as safetensors decides). Empty tensors share nothing."""
    by_storage: Dict[Tuple[str, int, int], List[Tuple[int, int, str]]] = defaultdict(list)
    for name, t in tensors.items():
        if t.numel() == 0 or t.device.type == "meta":
            continue
        st = t.untyped_storage()
        if st.nbytes() == 0:
            continue
        start = t.data_ptr()
        # (safetensors' key: two storages at one address with different
        # sizes, torch.from_numpy of an array and of its slice, are not one)
        by_storage[(str(t.device), st.data_ptr(), st.nbytes())].append((start, start + _span(t), name))
    groups: List[List[str]] = []
    for spans in by_storage.values():
        spans.sort()
        group: List[str] = []
        end = 0
        for b, e, name in spans:
            if group and b < end:
                group.append(name)
                end = max(end, e)
                continue
            if len(group) > 1:
                groups.append(sorted(group))
            group, end = [name], e
        if len(group) > 1:
            groups.append(sorted(group))
    return sorted(groups)


def _refuse_shared(tensors: Mapping[str, torch.Tensor]) -> None:
    groups = shared_groups(tensors)
    if groups:
        raise SharedTensorsError(
            f"some tensors share memory: {groups}. A safetensors file stores each name as its own copy, so the "
            "sharing (a tied weight) would be lost on reload, and safetensors refuses it too. Keep one name per "
            "group and tie them again after loading (safetensors.torch.save_model/load_model do this for a "
            "module), .clone() the ones meant to be independent, or save with format='torch', which keeps sharing."
        )


def _host_contiguous(t: torch.Tensor) -> torch.Tensor:
    # A conjugate or negative view holds the values it shows only once
    # resolved (its storage holds the unconjugated, unnegated ones).
    t = t.detach().resolve_conj().resolve_neg()
    if t.device.type != "cpu":
        t = t.cpu()
    return t if t.is_contiguous() else t.contiguous()


def _header_shape(code: str, shape: torch.Size) -> List[int]:
    out = list(shape)
    if code == "F4":
        out[-1] *= 2
    return out


def plan_safetensors(tensors: Mapping[str, Any], metadata: Optional[Mapping[str, str]] = None) -> Plan:
    """Describe the safetensors file of a flat ``{name: tensor}`` dict:
    safetensors' own bytes but for the header padding. Refuses what
    safetensors refuses (except non-contiguous tensors, written as their
    contiguous copy), with :class:`SerializationError` (and
    :class:`SharedTensorsError` for tensors that share memory)."""
    if not isinstance(tensors, Mapping):
        raise SerializationError(f"format='safetensors' takes a flat dict of tensors, not {type(tensors).__name__}")
    for name, t in tensors.items():
        _check_entry(name, t)
    _refuse_shared(tensors)
    meta = _check_metadata(metadata)
    items: List[Tuple[str, torch.Tensor]] = list(tensors.items())
    items.sort(key=lambda kv: (-_RANK[_BY_DTYPE[kv[1].dtype]], kv[0]))

    plan = Plan()
    header: Dict[str, Any] = {}
    if meta is not None:
        header["__metadata__"] = meta
    sources = []
    off = 0
    for name, given in items:
        t = _host_contiguous(given)
        n = t.numel() * t.element_size()
        code = _BY_DTYPE[t.dtype]
        header[name] = {"dtype": code, "shape": _header_shape(code, t.shape), "data_offsets": [off, off + n]}
        sources.append((off, t, n))
        off += n
    # serde_json's text: raw UTF-8, the same escapes as json's with ensure_ascii off.
    body = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    start = 8 + len(body)
    pad = (-start) % DATA_ALIGNMENT
    body += b" " * pad
    data_start = 8 + len(body)
    plan.blobs.append(Blob(0, struct.pack("<Q", len(body)) + body))
    for crc_id, (t_off, t, n) in enumerate(sources):
        plan.keepalive.append(t)
        plan.guard.watch(crc_id, t.untyped_storage(), f"tensor {items[crc_id][0]!r}")
        plan.storage_keys.append(items[crc_id][0])
        if n:
            plan.regions.append(Region(data_start + t_off, t.data_ptr(), n, crc_id))
        plan.storage_bytes += n
    plan.file_len = data_start + off
    plan.end = plan.file_len
    return plan


def is_safetensors(head: bytes, file_len: int) -> bool:
    """Whether the first bytes of a file look like safetensors."""
    if len(head) < 9:
        return False
    (n,) = struct.unpack_from("<Q", head)
    if not 2 <= n <= min(MAX_HEADER, file_len - 8):
        return False
    # JSON may start with whitespace, and safetensors' own parser takes it
    # (a header whose whitespace runs past the bytes read: parse_header
    # tells).
    text = head[8 : 8 + n].lstrip(b" \t\n\r")
    return text[:1] == b"{" or (not text and len(head) < 8 + n)


#: Largest dimension accepted when reading (torch sizes are int64).
_MAX_DIM = (1 << 63) - 1


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in a safetensors header")


def _json_int(text: str) -> Any:
    """A JSON integer as safetensors' parser (serde) reads it: ``-0`` is
    the float -0.0 (no integer where one is wanted), others ints; one past
    64 bits is read as a float, and one past a float's range refused
    ("number out of range"), wherever it is, in a field ignored or not."""
    if text == "-0":
        return -0.0
    v = int(text)
    if not -(1 << 63) <= v < 1 << 64:
        _json_float(text)
    return v


def _json_float(text: str) -> float:
    """A JSON number with a fraction or exponent as serde reads it: past a
    float's range (``1e400``) refused, not infinity."""
    v = float(text)
    if math.isinf(v):
        raise ValueError(f"number out of range: {text[:40]}")
    return v


def _int(x: Any, what: str, most: int = _MAX_DIM) -> int:
    if type(x) is not int or not 0 <= x <= most:
        raise ValueError(f"{what} {x!r} is not a non-negative 64-bit integer")
    return x


class Entry(NamedTuple):
    """One tensor of a safetensors header, checked."""

    name: str
    #: safetensors dtype code (``"F32"``, ``"F6_E2M3"``...).
    code: str
    #: The torch dtype, None where this torch has none.
    dtype: Optional[torch.dtype]
    #: The header's shape (F4: in 4-bit values).
    shape: List[int]
    #: Offsets relative to the start of the data area.
    begin: int
    end: int


def torch_shape(e: Entry) -> Optional[List[int]]:
    """The shape of the torch tensor for ``e`` (F4: two values per
    element), None where torch cannot represent it."""
    if e.dtype is None:
        return None
    if e.code == "F4":
        if not e.shape or e.shape[-1] % 2:
            return None
        return [*e.shape[:-1], e.shape[-1] // 2]
    return e.shape


def torch_dtype_error(e: Entry, path: str = "") -> UnsupportedDtypeError:
    """Why tensor ``e`` of a valid file cannot be made a torch tensor."""
    where = f"{path}: " if path else ""
    if e.dtype is None:
        why = f"torch {torch.__version__} has no dtype for safetensors' {e.code}"
    else:
        why = f"{e.dtype} packs two F4 values per element, so the last dimension of {e.shape} must be even"
    return UnsupportedDtypeError(
        f"{where}tensor {e.name!r}: {why} (safetensors' torch binding cannot load it either); "
        "fastpersist.verify.inspect_file lists it, safetensors' numpy or raw byte APIs read it"
    )


def _fields(info: Any, most: int) -> Tuple[str, List[int], int, int]:
    """A tensor entry's dtype, shape and offsets, each of its type (numbers
    up to ``most``); KeyError, TypeError or ValueError naming what is not."""
    if not isinstance(info, dict):
        raise TypeError("the entry is not a JSON object")
    code = info["dtype"]
    if not isinstance(code, str) or code not in BITS:
        raise KeyError(code)
    shape_raw, offsets = info["shape"], info["data_offsets"]
    if not isinstance(shape_raw, list) or not isinstance(offsets, list) or len(offsets) != 2:
        raise TypeError("shape must be a list and data_offsets a list of two integers")
    shape = [_int(x, "dimension", most) for x in shape_raw]
    begin, end = (_int(x, "offset", most) for x in offsets)
    return code, shape, begin, end


def _entry(name: str, info: Any, data_len: int, where: str) -> Entry:
    """One tensor's header entry, checked: every value of the right type
    and range, and its offsets exactly its bytes inside the data area."""
    try:
        code, shape, begin, end = _fields(info, _MAX_DIM)
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{where}tensor {name!r}: bad header entry ({e!r})") from None
    bits = BITS[code]
    numel = 1
    for d in shape:
        numel *= d
        if numel > _USIZE_MAX:  # safetensors' checked product, left to right
            raise CorruptCheckpointError(f"{where}tensor {name!r}: shape {shape} overflows computing its size")
    if numel * bits > _USIZE_MAX:
        raise CorruptCheckpointError(f"{where}tensor {name!r}: shape {shape} overflows computing its size")
    if numel * bits % 8:
        raise CorruptCheckpointError(f"{where}tensor {name!r}: {numel} {code} values are not a whole number of bytes")
    nbytes = numel * bits // 8
    if not (0 <= begin <= end <= data_len) or end - begin != nbytes:
        raise CorruptCheckpointError(
            f"{where}tensor {name!r}: data_offsets [{begin}, {end}] do not match its "
            f"{nbytes} bytes inside the {data_len}-byte data area"
        )
    if numel == 0 and not _makeable(shape):
        raise CorruptCheckpointError(f"{where}tensor {name!r}: shape {shape} is not one torch can make")
    return Entry(name, code, DTYPES.get(code), shape, begin, end)


_USIZE_MAX = (1 << 64) - 1


def empty_of_shape(shape: List[int], dtype: torch.dtype, device: Any = None) -> torch.Tensor:
    """A tensor of ``shape`` without elements, as safetensors makes one (a
    view of an empty buffer: ``[0, 2**40, 2**40]`` has strides torch.empty
    could not compute)."""
    return torch.empty(0, dtype=dtype, device=device).reshape(shape)


def _makeable(shape: List[int]) -> bool:
    """Whether torch can make a tensor of ``shape`` without elements."""
    try:
        empty_of_shape(shape, torch.uint8, "meta")
    except (RuntimeError, ValueError, OverflowError, TypeError):
        return False
    return True


class _Obj(dict):
    """A JSON object of a header, with the keys it gave more than once and
    the values the later ones hid (serde reads each; Python keeps the last)."""

    __slots__ = ("hidden", "repeated")
    repeated: Sequence[str]
    hidden: Sequence[Tuple[str, Any]]


def _pairs(pairs: List[Tuple[str, Any]]) -> _Obj:
    d = _Obj()
    # (appended to: a tuple copied at every repeat took minutes for a
    # header of a million repeats)
    repeated: List[str] = []
    hidden: List[Tuple[str, Any]] = []
    for k, v in pairs:
        if k in d:
            repeated.append(k)
            hidden.append((k, d[k]))
        d[k] = v
    d.repeated, d.hidden = (repeated, hidden) if repeated else ((), ())
    return d


#: serde_json's nesting limit: a header whose arrays and objects nest this
#: deep (the outer object counted) is refused.
_MAX_DEPTH = 128

#: The fields of a tensor entry (serde refuses one given twice; other
#: fields are ignored, repeated or not).
_FIELDS = ("dtype", "shape", "data_offsets")


def _check_text(header: Dict[str, Any], where: str) -> None:
    """The header as safetensors' parser (serde_json) takes it: every string
    valid UTF-8 text (JSON's ``\\u`` escapes can spell lone surrogates,
    which Python's parser takes and serde's refuses), nesting under
    ``_MAX_DEPTH``, ``__metadata__`` and a tensor's fields each given once
    (Python's parser keeps the last; a reader that kept the first would
    see other tensors)."""
    bad = "safetensors header is not valid JSON: "
    if "__metadata__" in getattr(header, "repeated", ()):
        raise CorruptCheckpointError(f"{where}{bad}duplicate field '__metadata__'")
    # A tensor given twice: serde reads both entries (the map keeps the
    # last), so the hidden one must be a well-typed entry too.
    for name, info in [*header.items(), *getattr(header, "hidden", ())]:
        if name == "__metadata__":
            continue
        twice = [f for f in getattr(info, "repeated", ()) if f in _FIELDS]
        if twice:
            raise CorruptCheckpointError(f"{where}{bad}tensor {name!r}: duplicate field {twice[0]!r}")
    _check_hidden(header, where)
    stack: List[Tuple[Any, int]] = [(header, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise CorruptCheckpointError(f"{where}{bad}{v!r} is not valid UTF-8 text") from None
        elif isinstance(v, (dict, list)):
            if depth >= _MAX_DEPTH:
                raise CorruptCheckpointError(f"{where}{bad}nested {_MAX_DEPTH} deep (serde_json's limit)")
            items = [x for kv in (*v.items(), *getattr(v, "hidden", ())) for x in kv] if isinstance(v, dict) else v
            stack.extend((x, depth + 1) for x in items)


def _check_hidden(header: Dict[str, Any], where: str) -> None:
    """The values a key given again hid: a tensor's entry of its types, a
    ``__metadata__`` value a string (serde reads each before the map keeps
    the last)."""
    for name, info in getattr(header, "hidden", ()):
        try:
            _fields(info, _USIZE_MAX)
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(
                f"{where}tensor {name!r}: bad header entry given before its last ({e!r})"
            ) from None
    for k, v in getattr(header.get("__metadata__"), "hidden", ()):
        if not isinstance(v, str):
            raise CorruptCheckpointError(f"{where}safetensors __metadata__ value of {k!r} is not a string: {v!r}")


def _metadata(header: Dict[str, Any], where: str) -> Optional[Dict[str, str]]:
    meta = header.pop("__metadata__", None)
    if meta is None:
        return None
    if not isinstance(meta, dict):
        raise CorruptCheckpointError(f"{where}safetensors __metadata__ is not a JSON object")
    for k, v in meta.items():
        if not isinstance(v, str):
            raise CorruptCheckpointError(f"{where}safetensors __metadata__ value of {k!r} is not a string: {v!r}")
    return dict(meta)


def _check_coverage(entries: List[Entry], data_len: int, where: str) -> None:
    """The tensors cover the data area back to back, as the format requires
    (safetensors refuses holes, overlaps and bytes after the last tensor)."""
    pos = 0
    for e in sorted(entries, key=lambda e: (e.begin, e.end)):
        if e.begin != pos:
            what = "leaving a hole before it" if e.begin > pos else "overlapping the tensor before it"
            raise CorruptCheckpointError(
                f"{where}tensor {e.name!r}: data_offsets [{e.begin}, {e.end}] start at {e.begin}, not at {pos}, "
                f"{what} (tensors must cover the data area back to back)"
            )
        pos = e.end
    if pos != data_len:
        raise CorruptCheckpointError(
            f"{where}{data_len - pos} bytes after the last tensor: a safetensors data area holds only its tensors"
        )


def parse_header(raw: bytes, file_len: int, path: str = "") -> Tuple[int, List[Entry], Optional[Dict[str, str]]]:
    """Validate a safetensors header as safetensors does: returns (data
    start, entries with offsets relative to the data start, metadata or
    None). Raises :class:`CorruptCheckpointError` naming the problem."""
    where = f"{path}: " if path else ""
    if len(raw) < 8:
        raise CorruptCheckpointError(f"{where}file too short for a safetensors header")
    (n,) = struct.unpack_from("<Q", raw)
    if n > MAX_HEADER or 8 + n > file_len or len(raw) < 8 + n:
        raise CorruptCheckpointError(f"{where}safetensors header length {n} does not fit the file")
    text = raw[8 : 8 + n]
    if _core.json_depth(text, _MAX_DEPTH) >= _MAX_DEPTH:
        # (before the decoder, which recurses once per level: past a raised
        # recursion limit, a header nested a million deep overflows the stack)
        raise CorruptCheckpointError(
            f"{where}safetensors header is not valid JSON: nested {_MAX_DEPTH} deep (serde_json's limit)"
        )
    try:
        # UTF-8 only (json.loads of bytes would guess UTF-16 or UTF-32 too)
        header = json.loads(
            text.decode("utf-8"),
            parse_constant=_no_constant,
            parse_int=_json_int,
            parse_float=_json_float,
            object_pairs_hook=_pairs,
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}safetensors header is not valid JSON: {type(e).__name__}: {e}") from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{where}safetensors header is not a JSON object")
    _check_text(header, where)
    meta = _metadata(header, where)
    data_start = 8 + n
    data_len = file_len - data_start
    entries = [_entry(name, info, data_len, where) for name, info in header.items()]
    _check_coverage(entries, data_len, where)
    return data_start, entries, meta
