"""The safetensors format: layout for writing, header parsing for reading.

A safetensors file is an 8-byte little-endian header length, a JSON header
(name -> dtype, shape, data_offsets; optional ``__metadata__`` of strings)
and the tensors' bytes back to back. We pad the header with spaces so the
data starts at a 4096-byte boundary (the O_DIRECT bulk is then aligned), and
order tensors by decreasing element size, as safetensors does, so every
tensor is aligned to its dtype.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from .errors import CorruptCheckpointError, SerializationError
from .plan import DATA_ALIGNMENT, Blob, Plan, Region

__all__ = ["plan_safetensors", "parse_header", "is_safetensors", "DTYPES"]

_NAMES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2": "float8_e5m2",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "C64": "complex64",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
}
#: safetensors dtype name -> torch dtype (those this torch has).
DTYPES: Dict[str, torch.dtype] = {k: getattr(torch, v) for k, v in _NAMES.items() if hasattr(torch, v)}
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
        raise SerializationError(f"[{name!r}]: safetensors cannot hold {t.layout} tensors")
    if t.device.type == "meta":
        raise SerializationError(f"[{name!r}]: a tensor on the meta device has no data to save")
    if t.dtype not in _BY_DTYPE:
        raise SerializationError(f"[{name!r}]: safetensors has no dtype for {t.dtype}")


def _host_contiguous(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t if t.is_contiguous() else t.contiguous()


def plan_safetensors(tensors: Mapping[str, Any], metadata: Optional[Mapping[str, str]] = None) -> Plan:
    """Describe the safetensors file of a flat ``{name: tensor}`` dict."""
    if not isinstance(tensors, Mapping):
        raise SerializationError(f"format='safetensors' takes a flat dict of tensors, not {type(tensors).__name__}")
    for name, t in tensors.items():
        _check_entry(name, t)
    items: List[Tuple[str, torch.Tensor]] = list(tensors.items())
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise SerializationError("safetensors metadata must map str to str")
    items.sort(key=lambda kv: (-kv[1].element_size(), kv[0]))

    plan = Plan()
    header: Dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    sources = []
    off = 0
    for name, given in items:
        t = _host_contiguous(given)
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _BY_DTYPE[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + n]}
        sources.append((off, t, n))
        off += n
    body = json.dumps(header, separators=(",", ":")).encode()
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
    return 2 <= n <= min(MAX_HEADER, file_len - 8) and head[8:9] == b"{"


#: Largest dimension accepted when reading (torch sizes are int64).
_MAX_DIM = (1 << 63) - 1


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in a safetensors header")


def _int(x: Any, what: str) -> int:
    if type(x) is not int or not 0 <= x <= _MAX_DIM:
        raise ValueError(f"{what} {x!r} is not a non-negative 64-bit integer")
    return x


def _entry(name: str, info: Any, data_len: int, where: str) -> Tuple[str, torch.dtype, List[int], int, int]:
    """One tensor's header entry, checked: every value of the right type
    and range, and its offsets exactly its bytes inside the data area."""
    try:
        if not isinstance(info, dict):
            raise TypeError("the entry is not a JSON object")
        dtype = DTYPES[info["dtype"]]
        shape_raw, offsets = info["shape"], info["data_offsets"]
        if not isinstance(shape_raw, list) or not isinstance(offsets, list) or len(offsets) != 2:
            raise TypeError("shape must be a list and data_offsets a list of two integers")
        shape = [_int(x, "dimension") for x in shape_raw]
        begin, end = (_int(x, "offset") for x in offsets)
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{where}tensor {name!r}: bad header entry ({e!r})") from None
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if not (0 <= begin <= end <= data_len) or end - begin != nbytes:
        raise CorruptCheckpointError(
            f"{where}tensor {name!r}: data_offsets [{begin}, {end}] do not match its "
            f"{nbytes} bytes inside the {data_len}-byte data area"
        )
    if numel == 0 and any(d > (1 << 40) for d in shape):
        raise CorruptCheckpointError(f"{where}tensor {name!r}: shape {shape} is not one torch can make")
    return name, dtype, shape, begin, end


def parse_header(
    raw: bytes, file_len: int, path: str = ""
) -> Tuple[int, List[Tuple[str, torch.dtype, List[int], int, int]], Dict[str, str]]:
    """Validate a safetensors header: returns (data start, entries as
    (name, dtype, shape, begin, end) relative to the data start, metadata).
    Raises :class:`CorruptCheckpointError` naming the problem."""
    where = f"{path}: " if path else ""
    if len(raw) < 8:
        raise CorruptCheckpointError(f"{where}file too short for a safetensors header")
    (n,) = struct.unpack_from("<Q", raw)
    if n > MAX_HEADER or 8 + n > file_len or len(raw) < 8 + n:
        raise CorruptCheckpointError(f"{where}safetensors header length {n} does not fit the file")
    try:
        header = json.loads(raw[8 : 8 + n], parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}safetensors header is not valid JSON: {type(e).__name__}: {e}") from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{where}safetensors header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise CorruptCheckpointError(f"{where}safetensors __metadata__ is not a JSON object")
    data_start = 8 + n
    data_len = file_len - data_start
    entries = [_entry(name, info, data_len, where) for name, info in header.items()]
    spans = sorted((b, e, nm) for nm, _, _, b, e in entries if e > b)
    for (_, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CorruptCheckpointError(f"{where}tensors {n0!r} and {n1!r} overlap")
    return data_start, entries, meta
