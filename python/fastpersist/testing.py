"""Testing helpers: does fastpersist save *your* state exactly as torch would?

:func:`assert_roundtrip` writes an object with
:func:`~fastpersist.write_state_dict`, reads it back with both
:func:`~fastpersist.read_state_dict` and ``torch.load``, and compares all
three exactly: types, dtypes, shapes, strides and storage offsets (torch
keeps them), ``requires_grad``, storage sharing, and every byte (NaN
payloads included).

The hypothesis strategies (:func:`tensors`, :func:`state_dicts`,
:func:`optimizer_states`) generate what checkpoints hold: every dtype torch
can save, views at offsets into shared storages, non-contiguous strides,
nested containers, optimizer state, wrapper tensor subclasses. hypothesis is
an optional dependency (``pip install fastpersist[testing]``), imported only
when a strategy is made::

    from hypothesis import given
    from fastpersist.testing import assert_roundtrip, state_dicts

    @given(state_dicts())
    def test_checkpoint(tmp_path_factory, sd):
        assert_roundtrip(sd, tmp_path_factory.mktemp("ck") / "ck.pt")
"""

from __future__ import annotations

import io
import math
import os
import struct
import sys
import warnings
from collections import Counter, OrderedDict
from typing import Any, Dict, List, Optional, Tuple

import torch

from .pickling import element_size
from .reader import read_state_dict
from .writer import write_state_dict

__all__ = [
    "assert_roundtrip",
    "assert_same_state",
    "saveable_dtypes",
    "dtypes",
    "tensors",
    "state_dicts",
    "optimizer_states",
]

_saveable: Optional[List[torch.dtype]] = None


def saveable_dtypes() -> List[torch.dtype]:
    """Every dtype of the installed torch whose plain tensors torch.save
    writes and torch.load reads back bit for bit (quantized dtypes, which
    need quantization parameters, and the sub-byte ``int1``..``uint7``,
    which torch.save refuses, are left out). Probed once. torch cannot
    make or load tensors of some experimental dtypes (bits16, bcomplex32)
    while ``torch.use_deterministic_algorithms(True)`` is in force."""
    global _saveable
    if _saveable is None:
        found = {getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "experimental" dtypes
            out = [dt for dt in sorted(found, key=str) if _saves(dt)]
        _saveable = out
    return list(_saveable)


def _saves(dt: torch.dtype) -> bool:
    """torch.save and torch.load keep a plain tensor of ``dt`` bit for bit."""
    if "qint" in str(dt) or "quint" in str(dt):
        return False
    try:
        size = torch.empty((), dtype=dt).element_size()
        raw = torch.arange(3 * size, dtype=torch.uint8)
        buf = io.BytesIO()
        torch.save(raw.view(dt), buf)
        buf.seek(0)
        return bool(torch.equal(torch.load(buf).view(torch.uint8), raw))
    except Exception:  # noqa: BLE001 - a dtype torch cannot save
        return False


# ---------------------------------------------------------------------------
# Exact comparison


def _number_bits(x: Any) -> bytes:
    """A float's or a complex number's bits (NaN payloads and signed zeros
    told apart)."""
    if isinstance(x, complex):
        return struct.pack("<dd", x.real, x.imag)
    return struct.pack("<d", x)


def _is_numpy(x: Any) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(x, (np.ndarray, np.generic))


def _is_numpy_scalar(x: Any) -> bool:
    """A numpy scalar (a value: no identity a load keeps)."""
    np = sys.modules.get("numpy")
    return np is not None and isinstance(x, np.generic)


def _storage_bytes(st: Any) -> bytes:
    if st.device.type != "cpu":
        st = st.cpu()
    return bytes(torch.empty(0, dtype=torch.uint8).set_(st).numpy().tobytes()) if st.nbytes() else b""


def _wrapper_parts(t: torch.Tensor) -> Optional[Tuple[List[str], Any]]:
    """A wrapper subclass's ``__tensor_flatten__()`` (its inner tensors'
    attribute names and its context); None for any other tensor."""
    if type(t) is torch.Tensor:
        return None
    flatten = getattr(t, "__tensor_flatten__", None)
    return None if flatten is None else flatten()


#: Objects compared with ``==`` (after their types).
_ATOMS = (bool, int, str, bytes, bytearray, range, torch.dtype, torch.device)
#: Exactly these types are values, whose identity pickling does not keep
#: (or that are one object per value): never compared by identity.
_VALUES = (type(None), bool, int, float, complex, str, bytes, range, torch.dtype, torch.device, tuple)


class _NoKey(Exception):
    """A set member that is an object, not a value: matched by comparison."""


def _member_key(x: Any) -> Any:
    """A set member as something that is equal only for
    a member of the same type and value: ``==`` makes ``1``, ``True`` and
    ``1.0`` one member, and ``0.0`` and ``-0.0``; floats by their bits.
    _NoKey for anything else (a tensor or a plain object, whose hash is its
    identity, which a load does not keep)."""
    if type(x) in (float, complex):
        return (type(x), _number_bits(x))
    if type(x) in (tuple, frozenset):
        keys = [_member_key(e) for e in x]
        return (type(x), tuple(keys) if type(x) is tuple else frozenset(keys))
    if x is None or type(x) in _ATOMS:
        return (type(x), x)
    raise _NoKey


#: The parts of a sparse tensor, by layout.
_SPARSE_PARTS = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


class _Comparison:
    """One walk of an expected and an actual object side by side."""

    def __init__(self, check_device: bool) -> None:
        self.check_device = check_device
        self.exp_to_got: Dict[int, int] = {}
        self.got_to_exp: Dict[int, int] = {}
        #: Objects met so far (by id, each side to the other's), and the
        #: objects themselves (so no id is reused by a later object).
        self.met: Dict[int, Tuple[int, str]] = {}
        self.met_got: Dict[int, int] = {}
        self.keep: List[Any] = []

    def fail(self, where: str, what: str) -> None:
        raise AssertionError(f"{where or '<root>'}: {what}")

    def _met(self, exp: Any, got: Any, where: str) -> bool:
        """Whether this pair was compared already (a container inside
        itself); fails where one side has one object twice and the other
        two objects (torch.load keeps ``x[0] is x[1]``: tied weights)."""
        e, g = id(exp), id(got)
        first = self.met.get(e)
        if first is not None:
            if first[0] != g:
                self.fail(where, f"a different object, expected the object at {first[1] or '<root>'} again")
            return True
        if self.met_got.get(g, e) != e:
            self.fail(where, "the object at another place again, expected a different object")
        self.met[e] = (g, where)
        self.met_got[g] = e
        self.keep.append((exp, got))
        return False

    def same(self, exp: Any, got: Any, where: str) -> None:
        if type(exp) is not type(got):
            self.fail(where, f"type {type(got).__qualname__}, expected {type(exp).__qualname__}")
        # (an array met twice is one array after a load, as a tensor is)
        if type(exp) not in _VALUES and not _is_numpy_scalar(exp) and self._met(exp, got, where):
            return
        if isinstance(exp, torch.Tensor):
            if exp.is_nested or got.is_nested:
                self.nested(exp, got, where)
            else:
                self.tensor(exp, got, where)
        elif isinstance(exp, (dict, list, tuple)):
            self.container(exp, got, where)
        elif isinstance(exp, (set, frozenset)):
            self.members(exp, got, where)
        elif not self.value(exp, got, where):
            if _is_numpy(exp):
                self.numpy(exp, got, where)
            else:
                self.state(exp, got, where)

    def value(self, exp: Any, got: Any, where: str) -> bool:
        """Numbers, atoms and storages (and their subclasses' attributes);
        False for anything else."""
        if isinstance(exp, (float, complex)):
            if _number_bits(exp) != _number_bits(got):
                self.fail(
                    where, f"{got!r} (bits {_number_bits(got).hex()}), expected {exp!r} ({_number_bits(exp).hex()})"
                )
        elif exp is None or isinstance(exp, _ATOMS):
            if exp != got:
                self.fail(where, f"{got!r}, expected {exp!r}")
        elif isinstance(exp, torch.storage.TypedStorage):
            if exp.dtype != got.dtype:
                self.fail(where, f"storage of {got.dtype}, expected {exp.dtype}")
            self.storage(exp._untyped_storage, got._untyped_storage, where)
            return True
        elif isinstance(exp, torch.UntypedStorage):
            self.storage(exp, got, where)
            return True
        else:
            return False
        self.attributes(exp, got, where)
        return True

    def container(self, exp: Any, got: Any, where: str) -> None:
        if isinstance(exp, dict):
            if len(exp) != len(got) or list(exp.keys()) != list(got.keys()):
                self.fail(where, f"keys {list(got.keys())!r}, expected {list(exp.keys())!r}")
            # Keys by type and value too (== makes 1, True and 1.0 one key).
            for i, (k, g) in enumerate(zip(exp, got)):
                self.same(k, g, f"{where}<key {i}: {k!r}>")
                self.same(exp[k], got[g], f"{where}[{k!r}]")
            if type(exp) is OrderedDict:
                # A state_dict's `_metadata` (load_state_dict's version
                # migrations); other subclasses' attributes are their state.
                self.same(dict(vars(exp)), dict(vars(got)), f"{where}.__dict__")
        else:
            if len(exp) != len(got):
                self.fail(where, f"length {len(got)}, expected {len(exp)}")
            for i, (a, b) in enumerate(zip(exp, got)):
                self.same(a, b, f"{where}[{i}]")
        if type(exp) not in (dict, OrderedDict, list, tuple):
            self.state(exp, got, where)  # a defaultdict's factory, a subclass's attributes

    def attributes(self, exp: Any, got: Any, where: str) -> None:
        """A subclass of a value type (an ``int`` or ``str`` subclass, say):
        its attributes, which pickling keeps."""
        a, b = getattr(exp, "__dict__", None), getattr(got, "__dict__", None)
        if a or b:
            self.same(dict(a or {}), dict(b or {}), f"{where}.__dict__")

    def members(self, exp: Any, got: Any, where: str) -> None:
        """A set's members: values by type and value (:func:`_member_key`),
        objects (tensors, instances: hashed by identity, which a load does
        not keep) each matched to one that compares the same."""
        keyed: Tuple[List[Any], List[Any]] = ([], [])
        objects: Tuple[List[Any], List[Any]] = ([], [])
        for side, items in enumerate((exp, got)):
            for x in items:
                try:
                    keyed[side].append(_member_key(x))
                except _NoKey:
                    objects[side].append(x)
        if Counter(keyed[0]) != Counter(keyed[1]) or len(objects[0]) != len(objects[1]):
            self.fail(where, f"members {got!r}, expected {exp!r} (compared by type and value)")
        left = list(objects[1])
        for i, e in enumerate(objects[0]):
            match = next((g for g in left if self._alike(e, g)), None)
            if match is None:
                self.fail(where, f"no member like the expected {e!r}")
            left.remove(match)
            self.same(e, match, f"{where}<member {i}>")
        if type(exp) not in (set, frozenset):
            self.state(exp, got, where)  # a subclass's attributes

    def _alike(self, exp: Any, got: Any) -> bool:
        """Whether ``got`` compares the same as ``exp`` on its own (a set's
        members have no order to pair them by)."""
        try:
            _Comparison(self.check_device).same(exp, got, "")
        except AssertionError:
            return False
        return True

    def state(self, exp: Any, got: Any, where: str) -> None:
        """Any other object: what pickling it keeps (``__reduce_ex__``'s
        arguments and state, so identity-compared objects such as modules
        and objects whose ``==`` a tensor would break are compared by what
        they hold), else ``==``."""
        try:
            a, b = exp.__reduce_ex__(2), got.__reduce_ex__(2)
        except Exception:  # noqa: BLE001 - an object pickle cannot take apart
            if exp != got:
                self.fail(where, f"{got!r}, expected {exp!r}")
            return
        if not isinstance(a, tuple) or not isinstance(b, tuple):  # a global's name
            if a != b:
                self.fail(where, f"{got!r}, expected {exp!r}")
            return
        if a[0] is not b[0]:
            self.fail(where, f"made by {b[0]!r}, expected {a[0]!r}")
        self.same(a[1], b[1], f"{where}<args>")
        if len(a) > 2 or len(b) > 2:
            self.same(a[2] if len(a) > 2 else None, b[2] if len(b) > 2 else None, f"{where}<state>")
        # The items a deque or another container subclass pickles (its
        # listitems and dictitems iterators).
        for i, what in ((3, "items"), (4, "dict items")):
            x, y = a[i] if len(a) > i else None, b[i] if len(b) > i else None
            if x is not None or y is not None:
                self.same(list(x or ()), list(y or ()), f"{where}<{what}>")

    def numpy(self, exp: Any, got: Any, where: str) -> None:
        if exp.dtype != got.dtype or getattr(exp, "shape", None) != getattr(got, "shape", None):
            self.fail(where, f"numpy {got.dtype} {getattr(got, 'shape', ())}, expected {exp.dtype} {exp.shape}")
        if exp.dtype.hasobject:
            self.same(exp.tolist(), got.tolist(), where)
        elif exp.tobytes() != got.tobytes():
            self.fail(where, "numpy values differ")

    def wrapper(self, exp: torch.Tensor, got: torch.Tensor, where: str, parts: Tuple[Any, Any]) -> None:
        """A wrapper subclass (``parts``: its inner tensors' names and its
        context, from ``__tensor_flatten__``)."""
        names, ctx = parts
        got_names, got_ctx = _wrapper_parts(got) or ((), None)
        if list(names) != list(got_names) or ctx != got_ctx:
            self.fail(where, f"wrapper {got_names!r} {got_ctx!r}, expected {names!r} {ctx!r}")
        for n in names:
            self.same(getattr(exp, n), getattr(got, n), f"{where}.{n}")
        # Its other attributes (a scale, ...), which a load keeps too.
        own = [{k: v for k, v in t.__dict__.items() if k not in names} for t in (exp, got)]
        if own[0] or own[1]:
            self.same(own[0], own[1], f"{where}.__dict__")

    def tensor(self, exp: torch.Tensor, got: torch.Tensor, where: str) -> None:
        for attr in ("dtype", "shape", "layout", "requires_grad"):
            if getattr(exp, attr) != getattr(got, attr):
                self.fail(where, f"{attr} {getattr(got, attr)}, expected {getattr(exp, attr)}")
        if self.check_device and exp.device != got.device:
            self.fail(where, f"device {got.device}, expected {exp.device}")
        parts = _wrapper_parts(exp)
        if parts is not None:
            self.wrapper(exp, got, where, parts)
            return
        if exp.__dict__ or got.__dict__:
            self.same(dict(exp.__dict__), dict(got.__dict__), f"{where}.__dict__")
        if exp.layout is not torch.strided:
            self.sparse(exp, got, where)
            return
        if exp.is_quantized:
            self.quantizer(exp, got, where)
        if exp.stride() != got.stride() or exp.storage_offset() != got.storage_offset():
            self.fail(
                where,
                f"stride {got.stride()} offset {got.storage_offset()}, "
                f"expected {exp.stride()} offset {exp.storage_offset()}",
            )
        if exp.is_conj() != got.is_conj() or exp.is_neg() != got.is_neg():
            self.fail(where, "conjugate/negative bit differs")
        if exp.device.type == "meta":
            return
        self.storage(exp.untyped_storage(), got.untyped_storage(), where)

    def nested(self, exp: torch.Tensor, got: torch.Tensor, where: str) -> None:
        """A nested tensor (no sizes, strides or storage of its own to ask
        for): its kind, then its parts. A jagged one (a wrapper subclass
        whose sizes hold nested ints, new in every process) by its inner
        tensors (values, offsets, lengths) and ragged dimension; a strided
        one by its components, each a view of its buffer."""
        for attr in ("is_nested", "dtype", "layout", "requires_grad"):
            if getattr(exp, attr) != getattr(got, attr):
                self.fail(where, f"{attr} {getattr(got, attr)}, expected {getattr(exp, attr)}")
        if exp.dim() != got.dim():
            self.fail(where, f"{got.dim()} dimensions, expected {exp.dim()}")
        if self.check_device and exp.device != got.device:
            self.fail(where, f"device {got.device}, expected {exp.device}")
        parts = _wrapper_parts(exp)
        if parts is None:
            self.same(list(exp.unbind()), list(got.unbind()), f"{where}.unbind()")
            return
        for n in ("_values", "_offsets", "_lengths"):  # the rest is a cache of these
            self.same(getattr(exp, n, None), getattr(got, n, None), f"{where}.{n}")
        self.same(getattr(exp, "_ragged_idx", None), getattr(got, "_ragged_idx", None), f"{where}._ragged_idx")

    def sparse(self, exp: torch.Tensor, got: torch.Tensor, where: str) -> None:
        for part in _SPARSE_PARTS.get(exp.layout, ()):
            self.same(getattr(exp, part)(), getattr(got, part)(), f"{where}.{part}()")
        if exp.is_sparse and exp.is_coalesced() != got.is_coalesced():
            self.fail(where, f"is_coalesced() {got.is_coalesced()}, expected {exp.is_coalesced()}")

    def quantizer(self, exp: torch.Tensor, got: torch.Tensor, where: str) -> None:
        if exp.qscheme() != got.qscheme():
            self.fail(where, f"qscheme {got.qscheme()}, expected {exp.qscheme()}")
        if exp.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            for name in ("q_scale", "q_zero_point"):
                self.same(getattr(exp, name)(), getattr(got, name)(), f"{where}.{name}()")
        else:
            for name in ("q_per_channel_scales", "q_per_channel_zero_points", "q_per_channel_axis"):
                self.same(getattr(exp, name)(), getattr(got, name)(), f"{where}.{name}()")

    def storage(self, exp: Any, got: Any, where: str) -> None:
        e, g = exp._cdata, got._cdata
        if self.exp_to_got.setdefault(e, g) != g or self.got_to_exp.setdefault(g, e) != e:
            self.fail(where, "storage sharing differs (a storage shared in one is not shared in the other)")
        if exp.nbytes() != got.nbytes():
            self.fail(where, f"storage of {got.nbytes()} bytes, expected {exp.nbytes()}")
        a, b = _storage_bytes(exp), _storage_bytes(got)
        if a != b:
            at = next(i for i in range(len(a)) if a[i] != b[i])
            self.fail(
                where, f"storage bytes differ from byte {at}: {b[at : at + 8].hex()}, expected {a[at : at + 8].hex()}"
            )


def assert_same_state(expected: Any, got: Any, *, check_device: bool = True) -> None:
    """Assert that ``got`` is exactly ``expected`` as torch.save/torch.load
    keep it: same types and container keys (in order), tensors with the
    same dtype, shape, strides, storage offset, ``requires_grad``, device
    (unless ``check_device`` is False), storage bytes (NaN payloads
    included) and the same storage sharing; floats compared bit for bit;
    wrapper subclasses through their inner tensors. Raises AssertionError
    naming the first difference by its key path."""
    _Comparison(check_device).same(expected, got, "")


def _torch_load_kwargs(read_kwargs: Dict[str, Any]) -> Dict[str, Any]:
    return {k: read_kwargs[k] for k in ("map_location", "weights_only") if k in read_kwargs}


def assert_roundtrip(obj: Any, path: Any, *, write_kwargs: Optional[Dict[str, Any]] = None, **read_kwargs: Any) -> Any:
    """Write ``obj`` with :func:`~fastpersist.write_state_dict` (with
    ``write_kwargs``), read it back with :func:`~fastpersist.read_state_dict`
    (with ``read_kwargs``: ``weights_only``, ``map_location``, ...) and with
    ``torch.load`` (the same ``map_location`` and ``weights_only``), and
    assert that both equal ``obj`` exactly (:func:`assert_same_state`; the
    device is compared only without ``map_location``). Returns what
    ``read_state_dict`` gave.

    With ``write_kwargs={"format": "safetensors"}`` the file is compared as
    safetensors keeps it: a plain dict in name order (its header is sorted),
    each tensor contiguous in a storage of its own; the second reader is
    ``safetensors.torch.load_file`` (where safetensors is installed)."""
    write_state_dict(obj, path, **(write_kwargs or {}))
    check_device = read_kwargs.get("map_location") is None
    got = read_state_dict(path, **read_kwargs)
    if (write_kwargs or {}).get("format") == "safetensors":
        _check_safetensors_roundtrip(obj, got, path, read_kwargs, check_device)
        return got
    _same_as_read(obj, got, "read_state_dict", path, check_device)
    ref = torch.load(path, **_torch_load_kwargs(read_kwargs))
    _same_as_read(obj, ref, "torch.load", path, check_device)
    return got


def _same_as_read(expected: Any, got: Any, reader: str, path: Any, check_device: bool) -> None:
    """:func:`assert_same_state`, its error naming the reader that gave ``got``."""
    try:
        assert_same_state(expected, got, check_device=check_device)
    except AssertionError as e:
        raise AssertionError(f"{reader}({os.fspath(path)!r}): {e}") from None


def _as_safetensors(d: Any) -> Dict[str, Any]:
    """``d`` as a safetensors file gives it back: a dict in name order,
    each tensor a contiguous copy (a storage of its own)."""
    return {k: v.detach().clone(memory_format=torch.contiguous_format) for k, v in sorted(d.items())}


def _check_safetensors_roundtrip(
    obj: Any, got: Any, path: Any, read_kwargs: Dict[str, Any], check_device: bool
) -> None:
    expected = _as_safetensors(obj)
    _same_as_read(expected, _as_safetensors(got), "read_state_dict", path, check_device)
    try:
        from safetensors.torch import load_file
    except ImportError:  # pragma: no cover - depends on the environment
        return
    device = read_kwargs.get("map_location")
    if device is None or isinstance(device, (str, torch.device)):
        ref = load_file(os.fspath(path), device=str(device) if device is not None else "cpu")
    else:  # a dict or a function (read_state_dict takes them; load_file takes one device): bytes compared on the CPU
        ref, check_device = load_file(os.fspath(path), device="cpu"), False
    _same_as_read(expected, _as_safetensors(ref), "safetensors.torch.load_file", path, check_device)


# ---------------------------------------------------------------------------
# hypothesis strategies (hypothesis imported on first use)


def _st() -> Any:
    try:
        from hypothesis import strategies
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("fastpersist.testing's strategies need hypothesis: pip install 'fastpersist[testing]'") from e
    return strategies


def dtypes() -> Any:
    """A strategy for every dtype torch can save (:func:`saveable_dtypes`)."""
    return _st().sampled_from(saveable_dtypes())


def _from_bytes(raw: bytes, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor of ``dtype`` holding ``raw`` (whole elements), bit for bit."""
    size = element_size(dtype)
    if dtype is torch.bool:
        raw = bytes(b & 1 for b in raw)  # a bool byte holds 0 or 1
    n = len(raw) // size
    buf = torch.frombuffer(bytearray(raw[: n * size]), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
    return buf.clone().view(dtype)


def _shape(draw: Any, st: Any, max_dims: int = 3, max_side: int = 5) -> Tuple[int, ...]:
    return tuple(draw(st.lists(st.integers(0, max_side), max_size=max_dims)))


def _view(draw: Any, st: Any, base: torch.Tensor) -> torch.Tensor:
    """A view of the 1-D ``base``: at an offset, reshaped, maybe transposed,
    strided or expanded (strides torch keeps as they are)."""
    n = base.numel()
    start = draw(st.integers(0, n))
    step = draw(st.integers(1, 3))
    flat = base[start::step]
    m = flat.numel()
    # a shape whose product is at most m
    dims: List[int] = []
    left = m
    for _ in range(draw(st.integers(0, 3))):
        d = draw(st.integers(0, min(left, 4))) if left else 0
        dims.append(d)
        left = left // d if d else left
    numel = math.prod(dims) if dims else 1
    if numel > m:
        return flat
    t = flat[:numel].reshape(dims) if dims else flat[:1].reshape(()) if m else flat
    if t.dim() >= 2 and draw(st.booleans()):
        t = t.transpose(0, t.dim() - 1)
    if t.dim() >= 1 and draw(st.booleans()):
        t = t.unsqueeze(0).expand(draw(st.integers(1, 3)), *t.shape)  # a stride of 0
    return t


_GRAD_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def tensors(dtype: Any = None, max_bytes: int = 256) -> Any:
    """A strategy for CPU tensors of any saveable dtype (or ``dtype``, a
    dtype or a strategy of dtypes) made from random bytes (every bit
    pattern: NaNs with payloads, subnormals, infinities), as views at
    random offsets with non-contiguous or zero strides, some with
    ``requires_grad`` (floating point ones)."""
    st = _st()
    dts = dtypes() if dtype is None else dtype if not isinstance(dtype, torch.dtype) else st.just(dtype)

    @st.composite
    def build(draw: Any) -> torch.Tensor:
        dt = draw(dts)
        base = _from_bytes(draw(st.binary(max_size=max_bytes)), dt)
        t = _view(draw, st, base) if base.numel() and draw(st.booleans()) else base.reshape(-1)
        if dt in _GRAD_DTYPES and draw(st.booleans()):
            t = t.detach().requires_grad_(True)
        return t

    return build()


def _leaves(st: Any) -> Any:
    return st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=8),
    )


def optimizer_states(max_params: int = 4) -> Any:
    """A strategy for ``optimizer.state_dict()``-shaped objects (Adam's
    layout: per-parameter ``step``, ``exp_avg``, ``exp_avg_sq``; param
    groups with hyperparameters and parameter indices)."""
    st = _st()

    @st.composite
    def build(draw: Any) -> Dict[str, Any]:
        n = draw(st.integers(0, max_params))
        state: Dict[int, Any] = {}
        for i in range(n):
            shape = _shape(draw, st)
            dt = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
            avg = _from_bytes(draw(st.binary(min_size=2 * 64, max_size=2 * 64)), dt)[: math.prod(shape)]
            if avg.numel() < math.prod(shape):
                shape = (avg.numel(),)
            state[i] = {
                "step": torch.tensor(float(draw(st.integers(0, 10**6)))),
                "exp_avg": avg.reshape(shape),
                "exp_avg_sq": avg.reshape(shape).abs() if draw(st.booleans()) else avg.reshape(shape).clone(),
            }
        group = {
            "lr": draw(st.floats(0, 1)),
            "betas": (0.9, draw(st.floats(0.9, 1.0))),
            "eps": 1e-8,
            "weight_decay": draw(st.floats(0, 0.1)),
            "amsgrad": draw(st.booleans()),
            "params": list(range(n)),
        }
        return {"state": state, "param_groups": [group]}

    return build()


def state_dicts(
    *,
    max_leaves: int = 12,
    max_bytes: int = 256,
    wrapper_subclasses: bool = False,
    optimizer: bool = True,
    nested_tensors: bool = False,
) -> Any:
    """A strategy for checkpoint-like objects: nested dicts (plain and
    ordered), lists and tuples of tensors (:func:`tensors`; several are
    views of one shared storage) and plain values, and optionally an
    optimizer state (:func:`optimizer_states`) and wrapper tensor
    subclasses (``TwoTensor`` from torch's test utilities, when present:
    reading them needs ``weights_only=False`` or torch's
    ``safe_globals``) and nested tensors (``nested_tensors``: strided and
    jagged ones, of views of the shared storages; reading them needs
    ``weights_only=False``)."""
    st = _st()
    two: Optional[type] = None
    if wrapper_subclasses:
        try:
            from torch.testing._internal.two_tensor import TwoTensor
        except ImportError:
            pass
        else:
            two = TwoTensor

    @st.composite
    def build(draw: Any) -> Dict[str, Any]:
        # storages shared by several views, one dtype each (torch refuses
        # one storage viewed as two dtypes)
        bases = draw(st.lists(tensors(max_bytes=max_bytes), min_size=1, max_size=4))
        bases = [b.detach().reshape(-1) if b.is_contiguous() else b.detach().contiguous().reshape(-1) for b in bases]

        @st.composite
        def tensor_leaf(draw2: Any) -> Any:
            base = draw2(st.sampled_from(bases))
            t = _view(draw2, st, base) if base.numel() and draw2(st.booleans()) else base
            if two is not None and t.dtype.is_floating_point and draw2(st.integers(0, 4)) == 0:
                # TwoTensor's halves share shape, strides and offset (0)
                a = (
                    t
                    if t.is_contiguous() and t.storage_offset() == 0
                    else t.clone(memory_format=torch.contiguous_format)
                )
                other = draw2(st.sampled_from([b for b in bases if b.dtype == t.dtype]))
                if other.numel() >= t.numel():
                    b = other[: t.numel()].reshape(t.shape).clone(memory_format=torch.contiguous_format)
                    if a.stride() == b.stride():
                        return two(a, b)
            if nested_tensors and t.dim() >= 1 and t.dtype in _GRAD_DTYPES and draw2(st.integers(0, 2)) == 0:
                # components of ragged lengths (the first dimension)
                parts = [t[i:].detach() for i in range(max(min(t.shape[0], 3), 1))]
                layout = draw2(st.sampled_from([torch.strided, torch.jagged]))
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # "prototype stage"
                    return torch.nested.nested_tensor(parts, layout=layout)
            return t

        leaf = st.one_of(tensor_leaf(), _leaves(st))
        tree = st.recursive(
            leaf,
            lambda children: st.one_of(
                st.dictionaries(st.text(max_size=6), children, max_size=4),
                st.dictionaries(st.text(max_size=6), children, max_size=4).map(OrderedDict),
                st.lists(children, max_size=4),
                st.lists(children, max_size=4).map(tuple),
            ),
            max_leaves=max_leaves,
        )
        out: Dict[str, Any] = {"model": draw(st.dictionaries(st.text(max_size=8), tensor_leaf(), max_size=6))}
        out["extra"] = draw(tree)
        if optimizer and draw(st.booleans()):
            out["optimizer"] = draw(optimizer_states())
        return out

    return build()
