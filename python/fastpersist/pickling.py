"""torch.save's pickle, both ways.

Writing: :func:`pickle_obj` pickles an object exactly as
``torch.serialization._save`` does (same persistent ids, same bytes), with a
fast reducer for plain dense tensors; :func:`find_storages` finds, before
pickling, the storages of the tensors inside plain containers, keyed as the
pickler will key them, so their bytes can be on their way to disk while the
pickle is made.

:class:`TensorVersions` keeps the version counters of a save's tensors
from its call, to tell whether any was changed in place before its bytes
had all been gathered.

Reading: :func:`unpickle` replays a pickle with storages already read, with
torch's ``weights_only`` unpickler by default (plain state dicts: the Rust
core's reader, the same objects); :class:`LocationScan` notes where each
storage was saved without constructing anything.

It imports only :mod:`fastpersist.errors` and the Rust core (the fast
paths of :func:`pickle_obj` and :func:`unpickle`).
"""

from __future__ import annotations

import copyreg
import functools
import inspect
import io
import logging
import os
import pickle
import re
import sys
import threading
import warnings
import weakref
from collections import OrderedDict
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Union

import torch

from . import _core
from .errors import (
    CorruptCheckpointError,
    NoDataError,
    SerializationError,
    TensorChangedError,
    TensorChangedWarning,
    UnpicklableError,
)

__all__ = [
    "PICKLE_PROTOCOL",
    "resolve_weights_only",
    "MapLocation",
    "check_extent",
    "find_storages",
    "survey_storages",
    "Survey",
    "find_path",
    "TensorVersions",
    "ON_CHANGE",
    "pickle_obj",
    "unpickle",
    "unpickle_before_data",
    "LocationScan",
    "restore_location",
    "storage_element_size",
    "element_size",
    "load_keeps_every_storage",
    "weights_only_message",
    "is_legacy_torch",
    "LEGACY_MAGIC",
    "load_plain",
]

#: torch.save's default pickle protocol.
PICKLE_PROTOCOL = 2

MapLocation = Union[None, str, torch.device, Callable[..., Any], Dict[str, str]]


def _describe(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        return f"tensor(shape={tuple(obj.shape)}, dtype={obj.dtype}, device={obj.device}, layout={obj.layout})"
    return type(obj).__qualname__


def find_path(obj: Any, pred: Any, prefix: str = "") -> Optional[str]:
    """Key path (``['a'][3]``) of the first value inside containers that
    satisfies ``pred``; used to name the culprit in error messages."""
    stack: List[Tuple[str, Any]] = [(prefix, obj)]
    seen: set = set()
    while stack:
        path, o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        try:
            if pred(o):
                return path or "<root>"
        except Exception:  # noqa: BLE001 - a predicate on odd objects
            pass
        if isinstance(o, dict):
            stack.extend((f"{path}[{k!r}]", v) for k, v in reversed(list(o.items())))
        elif isinstance(o, (list, tuple)):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(o))))
    return None


def _is_meta_storage(o: Any) -> bool:
    return (torch.is_storage(o) or isinstance(o, torch.storage.TypedStorage)) and o.device.type == "meta"


def _is_zero_tensor(o: Any) -> bool:
    return isinstance(o, torch.Tensor) and _zero(o)


def _zero(t: torch.Tensor) -> bool:
    """``t._is_zerotensor()``, asked only of tensors without a data pointer
    (zero tensors have none): that call releases the GIL, which costs tens
    of microseconds whenever another thread waits for it (the engine's
    copies of caller memory, running while the pickle is made), thousands
    of times per checkpoint of small tensors."""
    try:
        if t.data_ptr() != 0:
            return False
    except (RuntimeError, ValueError):  # no storage (some subclasses): torch's own answer
        pass
    try:
        return bool(t._is_zerotensor())
    except ValueError:  # an UninitializedParameter (a lazy module's): no data, not a zero tensor
        return False


def _has_data(t: torch.Tensor) -> bool:
    """``t`` has a storage of its own whose bytes can be written: not a
    wrapper subclass (TwoTensor, DTensor: their data lives in inner
    tensors, reached through their own reduction), not a zero tensor,
    not on the meta device."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return not t.is_meta and not _zero(t)  # is_meta: no device object made
    if t.device.type == "meta" or _zero(t):
        return False
    try:
        t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, ValueError):  # (ValueError: a lazy module's UninitializedParameter)
        return False
    return True


class _StorageRef:
    """What the fast tensor reducer puts where torch puts a TypedStorage."""

    __slots__ = ("dtype", "storage")

    def __init__(self, storage: Any, dtype: torch.dtype) -> None:
        self.storage = storage
        self.dtype = dtype


_storage_type_cache: Dict[torch.dtype, Any] = {}


def _storage_type(dtype: torch.dtype) -> Any:
    t = _storage_type_cache.get(dtype)
    if t is None:
        typed = torch.storage.TypedStorage(dtype=dtype, device="cpu", _internal=True)
        t = _storage_type_cache[dtype] = getattr(torch, typed._pickle_storage_type())
    return t


def _v3_dtypes() -> frozenset:
    new = getattr(torch.storage, "_new_dtypes", None)
    return frozenset(new()) if new is not None else frozenset()


_V3_DTYPES = _v3_dtypes()

#: ``torch.Tensor.has_names`` where this torch has named tensors (removed in
#: later torch): torch.save refuses a named tensor, and so does the reducer.
_HAS_NAMES: Any = getattr(torch.Tensor, "has_names", None)
_get_metadata = getattr(torch._utils, "get_tensor_metadata", None)
# Types persistent_id can dismiss at once (it is called for every object).
_PLAIN = frozenset(
    {str, int, float, bool, type(None), tuple, list, dict, bytes, torch.Tensor, torch.Size, torch.dtype, torch.device}
)


def check_unnamed(t: torch.Tensor) -> None:
    """Refuse a named tensor as torch.save refuses it (where this torch has
    them): a writer of raw bytes would drop its names."""
    if _HAS_NAMES is not None and _HAS_NAMES(t):
        raise RuntimeError(
            "NYI: Named tensors don't support serialization. Please drop names via "
            "`tensor = tensor.rename(None)` before serialization."
        )


def check_extent(t: torch.Tensor, what: str = "") -> None:
    """A tensor must lie inside its storage before anything reads it (a
    copy, ``.cpu()``, a region of a plan): one whose storage was resized or
    freed under it would be read past its end (other memory in the file, or
    a crash). ``what`` names it in the error. Meta tensors have no bytes."""
    n = t.numel()
    if n == 0:
        return
    if t.is_contiguous():
        last = t.storage_offset() + n - 1
    else:
        last = t.storage_offset() + sum((k - 1) * st for k, st in zip(t.shape, t.stride()))
    need = span_bytes(last + 1, t.dtype)
    have = t.untyped_storage().nbytes()
    if need > have and t.device.type != "meta":
        named = f"{what}: " if what else ""
        raise SerializationError(
            f"{named}a {tuple(t.shape)} {t.dtype} tensor needs {need} bytes of its storage, which holds {have}: "
            "the storage was resized or freed under it"
        )


class _Pickler(pickle.Pickler):
    """torch.save's pickler (same persistent ids, same bytes), with a fast
    reducer for plain dense tensors: torch's generic ``__reduce_ex__`` costs
    tens of microseconds a tensor, which dominates checkpoints made of
    thousands of small tensors."""

    def __init__(
        self,
        file: Any,
        known: Optional[Dict[int, Tuple[str, Any]]] = None,
        versions: Optional[TensorVersions] = None,
    ) -> None:
        super().__init__(file, protocol=PICKLE_PROTOCOL)
        self.versions = versions
        self.storages: Dict[str, Any] = {}
        #: storage ``_cdata`` -> key; seeded with the storages found up front.
        self._keys: Dict[int, str] = {c: k for c, (k, _) in (known or {}).items()}
        self._dtypes: Dict[int, torch.dtype] = {}

    def reducer_override(self, o: Any) -> Any:
        if self.versions is not None and isinstance(o, torch.Tensor):
            self.versions.add(o)  # a tensor inside an object: its version from now on
        if (
            type(o) is torch.Tensor
            and o.layout is torch.strided
            and o.device.type == "cpu"
            and o.dtype not in _V3_DTYPES
            and not o.is_quantized
            and not o.is_nested  # strided nested tensors: torch's own reduction
            and not o.__dict__
            and not o._backward_hooks  # torch's reduction warns they are not saved
            and not (_HAS_NAMES is not None and _HAS_NAMES(o))  # torch's reduction refuses names
            and not _zero(o)
        ):
            check_extent(o)
            # Exactly what Tensor._reduce_ex_internal returns for this case.
            args: tuple = (
                _StorageRef(o.untyped_storage(), o.dtype),
                o.storage_offset(),
                tuple(o.size()),
                o.stride(),
                o.requires_grad,
                OrderedDict(),
            )
            if _get_metadata is not None:
                meta = _get_metadata(o)
                if meta:
                    args = args + (meta,)
            return (torch._utils._rebuild_tensor_v2, args)
        # Everything else (subclasses, wrapper subclasses, meta tensors, which
        # torch saves as shape and dtype only, ...): torch's own reduction.
        return NotImplemented

    def persistent_id(self, o: Any) -> Any:
        t = type(o)
        if t is _StorageRef:
            storage, dtype = o.storage, o.dtype
            return self._storage_id(o, storage, dtype, _storage_type(dtype), storage.nbytes() // element_size(dtype))
        if t in _PLAIN:
            return None
        if isinstance(o, torch.storage.TypedStorage):
            return self._storage_id(o, o._untyped_storage, o.dtype, getattr(torch, o._pickle_storage_type()), o._size())
        if torch.is_storage(o):
            return self._storage_id(o, o, torch.uint8, torch.serialization.normalize_storage_type(type(o)), o.nbytes())
        return None

    def _storage_id(self, o: Any, storage: Any, dtype: torch.dtype, storage_type: Any, numel: int) -> tuple:
        """Mirror of the storage branch of torch.serialization._save's persistent_id."""
        if storage.device.type == "meta":
            # torch.save raises NotImplementedError when it copies it out.
            raise NoDataError(
                "a storage on the meta device has no data to save (torch.save: Cannot copy out of meta tensor; "
                "no data!); meta *tensors* are saved (shape and dtype only)"
            )
        ptr = storage.data_ptr()
        if ptr != 0:
            prev = self._dtypes.setdefault(ptr, dtype)
            if prev != dtype:
                raise SerializationError(
                    "Cannot save multiple tensors or storages that view the same data "
                    f"as different types ({prev} and {dtype})"
                )
        key = self._keys.setdefault(storage._cdata, str(len(self._keys)))
        fake = getattr(o, "_fake_device", None)
        location = str(fake) if fake is not None else torch.serialization.location_tag(storage)
        self.storages[key] = storage
        return ("storage", storage_type, key, location, numel)


_elem_sizes: Dict[torch.dtype, int] = {}


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype`` (looked up once per dtype: asking a
    tensor made for it costs microseconds, paid per item by callers that
    size thousands of items)."""
    n = _elem_sizes.get(dtype)
    if n is None:
        n = _elem_sizes[dtype] = torch.empty((), dtype=dtype).element_size()
    return n


#: Values a byte of torch's packed quantized types hold (their
#: ``element_size`` is 1: a storage of them counts bytes, a tensor values).
_PER_BYTE: Dict[torch.dtype, int] = {
    d: n for d, n in ((getattr(torch, "quint4x2", None), 2), (getattr(torch, "quint2x4", None), 4)) if d is not None
}


def span_bytes(span: Any, dtype: Optional[torch.dtype], itemsize: int = 1) -> Any:
    """The bytes of a storage that ``span`` elements (an int, or a SymInt) of ``dtype`` take
    (``itemsize`` a byte each where ``dtype`` is None): a byte for several
    values of a packed quantized type (quint4x2: two; quint2x4: four)."""
    per = _PER_BYTE.get(dtype) if dtype is not None else None
    if per is not None:
        return -(-span // per)
    return span * (element_size(dtype) if dtype is not None else itemsize)


#: Whether :func:`pickle_obj` tries its fast path first (tests turn it off
#: to compare with the pickler).
FAST_PICKLE = True

#: The "storage" of the persistent ids (the very string ``_storage_id``
#: returns: identifier-like literals are interned, so the pickle's memo
#: shares it with equal strings of the object exactly as the pickler does).
_STORAGE_TAG = "storage"

_global_raw_cache: Dict[int, Tuple[Any, Optional[bytes]]] = {}


def _global_raw(obj: Any) -> Optional[bytes]:
    """The bytes ``_Pickler`` writes for the class or function ``obj`` the
    first time (``GLOBAL module\\nname\\n``), None where it writes anything
    else (an extension code, say)."""
    hit = _global_raw_cache.get(id(obj))
    if hit is not None and hit[0] is obj:
        return hit[1]
    buf = io.BytesIO()
    _Pickler(buf).dump(obj)
    b = buf.getvalue()
    raw: Optional[bytes] = b[2:-3] if b[:3] == b"\x80\x02c" and b[-3:] == b"q\x00." else None
    _global_raw_cache[id(obj)] = (obj, raw)
    return raw


def _fast_dtype(dtype: torch.dtype) -> Optional[Tuple[Any, bytes, int]]:
    """(storage class, its GLOBAL bytes, element size) of the tensors of
    ``dtype`` the tensor reducer handles; None for the others."""
    if dtype in _V3_DTYPES:
        return None
    st = _storage_type(dtype)
    raw = _global_raw(st)
    return None if raw is None else (st, raw, element_size(dtype))


#: The host device. Comparing a device with it takes tens of nanoseconds;
#: a device's ``.type`` is made anew on every call, ten times as long
#: (per storage, thousands of times per checkpoint of small tensors).
CPU_DEVICE = torch.device("cpu")

_CPU_PROBE: Any = None


def _metadata_fn() -> Any:
    """``_get_metadata``, or the C function it wraps where it is torch's own
    wrapper (an isinstance test, which every tensor the fast path meets
    passes, and the call): the wrapper's Python frame and isinstance are
    half its cost."""
    fn = _get_metadata
    inner = getattr(torch._C, "_get_tensor_metadata", None)
    code = getattr(fn, "__code__", None)
    if fn is None or inner is None or code is None or fn is not getattr(torch._utils, "get_tensor_metadata", None):
        return fn
    plain = {"isinstance", "torch", "Tensor", "AssertionError", "type", "__name__", "_C", "_get_tensor_metadata"}
    return inner if set(code.co_names) <= plain and code.co_argcount == 1 else fn


def _fast_context() -> Optional[tuple]:
    """What the fast path (``_core.fast_pickle``) writes as the slow path
    does, looked up now (a test or a plugin may have changed torch's
    registries); None where it cannot be: a location tagger ahead of
    torch's CPU one, a reducer registered for OrderedDict, extension codes
    (``copyreg.add_extension``: globals written as EXT opcodes)."""
    global _CPU_PROBE
    ser = torch.serialization
    registry = getattr(ser, "_package_registry", None)
    cpu_tag = getattr(ser, "_cpu_tag", None)
    if not registry or cpu_tag is None or registry[0][1] is not cpu_tag:
        return None
    if OrderedDict in copyreg.dispatch_table or getattr(copyreg, "_extension_registry", None):
        return None
    if _CPU_PROBE is None:
        _CPU_PROBE = torch.UntypedStorage(0)
    location = ser.location_tag(_CPU_PROBE)
    rebuild = torch._utils._rebuild_tensor_v2
    rebuild_raw = _global_raw(rebuild)
    odict_raw = _global_raw(OrderedDict)
    if type(location) is not str or rebuild_raw is None or odict_raw is None:
        return None
    return (
        torch.Tensor,
        OrderedDict,
        torch.strided,
        _STORAGE_TAG,
        location,
        (rebuild, rebuild_raw),
        odict_raw,
        _metadata_fn(),
        _fast_dtype,
        _HAS_NAMES,
    )


def _fast_pickle(
    obj: Any, known: Optional[Dict[int, Tuple[str, Any]]], versions: Optional[TensorVersions]
) -> Optional[Tuple[bytes, Dict[str, Any]]]:
    """:func:`pickle_obj`'s result written by the Rust core, or None where
    ``obj`` holds anything it leaves to the pickler (or raised)."""
    try:
        ctx = _fast_context()
    except Exception:  # noqa: BLE001 - another torch: the pickler, as before
        return None
    if ctx is None:
        return None
    add = None
    if versions is not None:
        # TensorVersions.add records a tensor its _seen does not hold yet:
        # the others are not passed to it. Any other add gets every tensor.
        seen = versions._seen if type(versions).add is TensorVersions.add else None
        add = (versions.add, seen if type(seen) is dict else {})
    return _core.fast_pickle(obj, ctx, known, add)


def pickle_obj(
    obj: Any, known: Optional[Dict[int, Tuple[str, Any]]] = None, versions: Optional[TensorVersions] = None
) -> Tuple[bytes, Dict[str, Any]]:
    """Pickle ``obj`` exactly as ``torch.serialization._save`` does, returning
    the pickle and the storages it refers to, by key. ``known`` storages
    (``_cdata`` -> (key, storage)) keep their keys. Tensors the pickler
    meets that ``versions`` does not know yet are added to it.

    Objects made only of exact dicts, lists, tuples, strings, ints, floats,
    bools, None, OrderedDicts (``state_dict()``'s) and plain dense CPU
    tensors take a fast path (:data:`FAST_PICKLE`): the same bytes, written
    by the Rust core without a Python call per object. Anything else, and
    any error, goes through the pickler as before."""
    if FAST_PICKLE:
        done = _fast_pickle(obj, known, versions)
        if done is not None:
            return done
    buf = io.BytesIO()
    pickler = _Pickler(buf, known, versions)
    try:
        pickler.dump(obj)
    except NoDataError as e:
        where = find_path(obj, _is_meta_storage)
        if where is not None:
            raise NoDataError(f"{where}: {e}") from None
        raise
    except SerializationError:
        raise
    except Exception as e:
        where = find_path(obj, _is_zero_tensor) if _is_zero_tensor_error(e) else None
        what = f"{where}: a zero tensor" if where is not None else _describe(obj)
        if type(e) not in _REFUSALS:
            # The saved objects' own error (a __getstate__ or __reduce__ that
            # raises, a structure too deep): torch.save raises it as it is.
            add_note = getattr(e, "add_note", None)
            if add_note is not None:
                add_note(f"fastpersist: while pickling {what}")
            raise
        cls = UnpicklableError if isinstance(e, AttributeError) else SerializationError
        err = cls(f"cannot serialize {what}: {type(e).__name__}: {e}")
        # pickle's own refusal, after the objects' own pickling code ran:
        # torch.save refuses it alike (a caller trying torch.save after it
        # would run that code again for the same refusal).
        err.torch_refuses = True
        raise err from e
    return buf.getvalue(), pickler.storages


#: The errors pickle and torch refuse an object with (exactly these classes,
#: not the saved objects' own subclasses): raised as a SerializationError,
#: which is each of them.
_REFUSALS = (TypeError, AttributeError, ValueError, RuntimeError, pickle.PicklingError)


def _is_zero_tensor_error(e: BaseException) -> bool:
    return isinstance(e, RuntimeError) and "ZeroTensor" in str(e)


class Survey(NamedTuple):
    """What :func:`survey_storages` found: ``storages`` as
    :func:`find_storages` returns them, their bytes in all, and those not on
    the CPU (a layout's hints: the space to reserve, the devices to stage
    from). ``ordered``: how many of ``storages`` (the first ones) come
    before the first object the walk does not see into but the pickler may
    find storages in (another class's object, a tensor subclass, a tensor
    with attributes); those, and only those, the pickler is sure to meet
    first and in this order, so only they can take their keys (and places
    in the file) before pickling. None: all of them."""

    storages: Dict[int, Tuple[str, Any]]
    nbytes: int
    off_cpu: List[Any]
    ordered: Optional[int] = None
    #: A survey stopped early (``limit``): the finding of the remaining
    #: storages (``_core.SurveyRest``), which :meth:`whole` completes.
    rest: Optional[Any] = None

    def first(self) -> Dict[int, Tuple[str, Any]]:
        """The storages the pickler meets first, in order (``ordered``)."""
        if self.ordered is None or self.ordered >= len(self.storages):
            return self.storages
        return dict(list(self.storages.items())[: self.ordered])

    def whole(self) -> Survey:
        """The survey gone to the end: this one, or, for one stopped early,
        its storages and those found now after them (the same keys and
        order as one walk to the end; the versions were all recorded by the
        first part). Hands the GIL to engine threads as the walks do."""
        if self.rest is None:
            return self
        return Survey(*self.rest.finish(_survey_context()))


def _atoms() -> tuple:
    """Exact types whose objects hold no storage (besides those the walks
    check themselves: None, str, int, float, bool, bytes)."""
    names = ("dtype", "device", "layout", "memory_format", "Size", "qscheme")
    return (complex, bytearray) + tuple(getattr(torch, n) for n in names if isinstance(getattr(torch, n, None), type))


_ATOMS = _atoms()


def _may_hold_storages(o: Any) -> bool:
    """Whether the pickler may find storages in ``o``, an object the walks
    do not enter (not a dict, list, tuple or tensor): not for atoms, numpy
    arrays without Python objects, numpy scalars; any other object may
    hold tensors."""
    if o is None or type(o) in (str, int, float, bool, bytes) or type(o) in _ATOMS:
        return False
    np = sys.modules.get("numpy")
    if np is not None:
        if type(o) is np.ndarray:
            return bool(o.dtype.hasobject)
        if isinstance(o, np.generic):
            return False
    return True


#: Whether the containers are walked by the extension (``_core.survey``);
#: off, the same walk in Python.
FAST_SURVEY = True


def _survey_context() -> tuple:
    return (
        torch.Tensor,
        torch.nn.Parameter,
        OrderedDict,
        torch.strided,
        _has_data,
        _version,
        _ATOMS,
        _may_hold_storages,
    )


def _fast_survey(
    obj: Any, versions: Optional[TensorVersions], find: bool, limit: Optional[Tuple[int, int]] = None
) -> Optional[Survey]:
    """The walk in the extension, where it records versions as
    :meth:`TensorVersions.add` would (no subclass's own ``add``)."""
    if not FAST_SURVEY:
        return None
    seen = None
    if versions is not None:
        seen = versions._seen
        if type(versions).add is not TensorVersions.add or type(seen) is not dict:
            return None
    return Survey(*_core.survey(obj, _survey_context(), seen, find, limit))


def survey_storages(
    obj: Any, versions: Optional[TensorVersions] = None, limit: Optional[Tuple[int, int]] = None
) -> Survey:
    """The storages of the dense tensors inside plain containers (dict,
    list, tuple), keyed as torch.save will key them: by first encounter in
    pickling order. Found before pickling, so their bytes can be on their
    way to disk while the pickle is made. Storages inside other objects,
    and those of wrapper subclasses' inner tensors (a wrapper's own storage
    holds no data), are found by the pickler later. With ``versions``,
    every tensor met (dict keys included) is also recorded there: one walk
    of the containers for both. ``limit`` (``(bytes, storages)``): once at
    least that many storages holding that many bytes are found, the walk
    only records versions, and the rest of the storages are found by
    :meth:`Survey.whole` (the extension's walk; the Python walk goes to the
    end)."""
    fast = _fast_survey(obj, versions, True, limit)
    if fast is not None:
        return fast
    walk = _SurveyWalk()
    stack: List[Any] = [obj]
    seen: set = set()
    while stack:
        o = stack.pop()
        t = type(o)
        if t is dict or t is OrderedDict or t is list or t is tuple:
            if id(o) in seen:
                continue
            seen.add(id(o))
            if t is list or t is tuple:
                stack.extend(reversed(o))
            else:
                if t is OrderedDict and o.__dict__:
                    stack.append(o.__dict__)  # pickled after the items (state_dict()'s _metadata)
                for k, v in reversed(list(o.items())):
                    stack.append(v)
                    stack.append(k)
        elif isinstance(o, torch.Tensor):
            walk.tensor(o, versions)
        elif _may_hold_storages(o):
            walk.end_order()
    return walk.survey()


class _SurveyWalk:
    """What the Python walk of :func:`survey_storages` has found so far."""

    def __init__(self) -> None:
        self.found: Dict[int, Tuple[str, Any]] = {}
        self.nbytes = 0
        self.off_cpu: List[Any] = []
        self.ordered: Optional[int] = None

    def end_order(self) -> None:
        """The pickler may meet other storages here: the storages found so
        far are the ones it meets first (``Survey.ordered``)."""
        if self.ordered is None:
            self.ordered = len(self.found)

    def tensor(self, o: torch.Tensor, versions: Optional[TensorVersions]) -> None:
        exact = type(o) is torch.Tensor or type(o) is torch.nn.Parameter
        strided = o.layout is torch.strided and not o.is_nested  # a nested tensor's layout is strided too
        if not exact or not strided:
            # A subclass's reduction is its own; a sparse or nested tensor's
            # pickles the tensors it is made of, which this walk does not enter.
            self.end_order()
        if versions is not None:
            versions.add(o)
        if strided and _has_data(o):
            st = o.untyped_storage()
            if st._cdata not in self.found:
                self.nbytes += st.nbytes()
                if st.device != CPU_DEVICE:
                    self.off_cpu.append(st)
                self.found[st._cdata] = (str(len(self.found)), st)
        if exact and (o.__dict__ or o.is_quantized):
            # torch pickles a tensor's attributes after its storage, and a
            # quantized tensor's per-channel scales and zero points.
            self.end_order()

    def survey(self) -> Survey:
        n = len(self.found)
        return Survey(self.found, self.nbytes, self.off_cpu, n if self.ordered is None else self.ordered)


def find_storages(obj: Any, versions: Optional[TensorVersions] = None) -> Dict[int, Tuple[str, Any]]:
    """:func:`survey_storages`' storages."""
    return survey_storages(obj, versions).storages


log = logging.getLogger("fastpersist")

#: What a save does when a tensor was changed in place before its bytes were
#: all gathered: raise :class:`TensorChangedError` (nothing is committed), or
#: warn (:class:`TensorChangedWarning`) and commit.
ON_CHANGE = ("error", "warn")


def _version(t: torch.Tensor) -> Optional[int]:
    try:
        return t._version
    except RuntimeError:  # an inference tensor: no version counter
        return None


def _storage_key(t: torch.Tensor) -> Optional[Tuple[int, str]]:
    """The address and device of ``t``'s storage (shared by its views and
    detached copies); None where it has none to compare (empty, or a
    wrapper)."""
    try:
        ptr = t.untyped_storage().data_ptr()
        return (ptr, str(t.device)) if ptr else None
    except Exception:  # noqa: BLE001 - a wrapper subclass, a meta tensor: nothing to match
        return None


# The saves between their call and their check (TensorVersions), which an
# optimizer step marks as written (:func:`_optimizer_step_pre_hook`).
_WATCHING: weakref.WeakSet[TensorVersions] = weakref.WeakSet()
_STEP_HOOK: List[Any] = []
_STEP_HOOK_LOCK = threading.RLock()  # (reentrant: a signal handler's save)


def _optimizer_step_pre_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
    """Runs before every ``torch.optim.Optimizer.step()`` of the process
    once a save has been made. While saves are pending, the tensors the
    step is about to write (each parameter with a gradient, and its state)
    are marked written in every pending save that holds them: fused kernels
    (``fused=True`` Adam, AdamW, SGD, Adagrad) and optimizers that update
    ``p.data`` change them without bumping their version counters."""
    if not _WATCHING or _compiling():
        # Compiled steps write back through copy_, which the counter sees.
        return
    try:
        keys = _step_writes(optimizer)
    except Exception:  # an optimizer of an unexpected shape: never fail its step
        log.debug("fastpersist: cannot tell what %s.step() writes", type(optimizer).__name__, exc_info=True)
        return
    if keys:
        who = f"{type(optimizer).__name__}.step()"
        for versions in list(_WATCHING):
            versions._written_by(keys, who)


def _step_writes(optimizer: Any) -> set:
    """The storage keys of what ``optimizer.step()`` writes: each parameter
    with a gradient, and the tensors of its state."""
    keys = set()
    state = getattr(optimizer, "state", None)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, torch.Tensor) or p.grad is None:
                continue
            keys.add(_storage_key(p))
            st = state.get(p) if isinstance(state, dict) else None
            if isinstance(st, dict):
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        keys.add(_storage_key(v))
    keys.discard(None)
    return keys


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    is_compiling = getattr(compiler, "is_compiling", None)
    return bool(is_compiling()) if is_compiling is not None else False


def _watch(versions: TensorVersions) -> None:
    with _STEP_HOOK_LOCK:
        _WATCHING.add(versions)
        if not _STEP_HOOK:
            # Installed once, at the first save, and kept: removing it from
            # a background thread could race a step iterating the hooks.
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            _STEP_HOOK.append(register_optimizer_step_pre_hook(_optimizer_step_pre_hook))


class TensorVersions:
    """The version counters of a save's tensors as they were at the call,
    checked once every byte of them has been gathered (:meth:`check`).

    torch bumps a tensor's version counter on every in-place operation
    (``add_``, ``copy_``, foreach kernels, a forward's
    ``num_batches_tracked += 1``), when the operation is issued (CUDA:
    queued on the stream; CPU: once the kernel has run). Views and
    ``detach()``-ed tensors (what ``state_dict()`` returns) share the
    counter of their base, so an update through any of them is seen.
    A CPU operation still running when the check comes (issued after the
    call without the fence) bumps the counter only as it returns, so it
    can go unseen: the fence is the guarantee, this check the net.
    Optimizer steps are seen whatever kernel they use: fused optimizer
    kernels (``fused=True``) and optimizers that update ``p.data`` write
    without bumping the counter, so every ``Optimizer.step()`` while the
    save is pending marks the tensors it writes (a global step pre-hook,
    installed at the first save). Not seen: other writes that bypass the
    counter (``tensor.data.add_()`` outside an optimizer step, numpy or
    DLPack views, kernels whose schema does not declare the write, such as
    eager BatchNorm's ``running_mean``/``running_var``, which are covered
    by ``num_batches_tracked`` changing in the same forward).

    Made on the caller's thread at the call: the tensors in plain
    containers (dict, list, tuple) are recorded then; tensors inside other
    objects are recorded when the pickler meets them (:meth:`add`).

    With ``storages=True`` the same walk also finds ``obj``'s storages
    (:func:`survey_storages`, in pickling order), so a synchronous save
    walks its containers once; :meth:`survey_of` hands them to the layout
    of that same object. With ``limit`` too, only the first storages are
    found at the call (every version is still recorded then): the layout
    finds the rest (:meth:`Survey.whole`) once the first are on their way
    to disk."""

    def __init__(
        self,
        obj: Any = None,
        on_change: str = "error",
        storages: bool = False,
        limit: Optional[Tuple[int, int]] = None,
    ) -> None:
        if on_change not in ON_CHANGE:
            raise ValueError(f"on_change must be one of {ON_CHANGE}, not {on_change!r}")
        self.on_change = on_change
        self._seen: Dict[int, Tuple[torch.Tensor, int]] = {}
        self._survey: Optional[Tuple[Any, Survey]] = None
        # Written by an optimizer step while pending: id -> who wrote it;
        # _by_storage indexes the first _indexed entries of _seen.
        self._written: Dict[int, str] = {}
        self._by_storage: Dict[Tuple[int, str], List[int]] = {}
        self._indexed = 0
        _watch(self)
        if storages:
            self._survey = (obj, survey_storages(obj, self, limit))
        elif obj is not None:
            self._walk(obj)

    def survey_of(self, obj: Any) -> Optional[Survey]:
        """The storages found at the call (``storages=True``), when ``obj``
        is the object walked then (a shard of it, or any other: None); each
        call returns new containers."""
        if self._survey is None or self._survey[0] is not obj:
            return None
        found = self._survey[1]
        return Survey(dict(found.storages), found.nbytes, list(found.off_cpu), found.ordered, found.rest)

    def _walk(self, obj: Any) -> None:
        if _fast_survey(obj, self, False) is not None:
            return
        stack: List[Any] = [obj]
        seen: set = set()
        tensor = torch.Tensor
        while stack:
            o = stack.pop()
            t = type(o)
            if t is dict or t is OrderedDict or t is list or t is tuple:
                if id(o) in seen:
                    continue
                seen.add(id(o))
                if t is OrderedDict and o.__dict__:
                    stack.append(o.__dict__)  # its attributes, after its items
                # Reversed: popped (and recorded) in the order of the object.
                stack.extend(reversed(list(o.values() if t is dict or t is OrderedDict else o)))
            elif isinstance(o, tensor):
                self.add(o)

    def add(self, t: torch.Tensor) -> None:
        """Record ``t``'s version now, unless it is already recorded."""
        if id(t) not in self._seen:
            v = _version(t)
            if v is not None:
                self._seen[id(t)] = (t, v)

    def __len__(self) -> int:
        return len(self._seen)

    def unwatch(self) -> None:
        """Stop watching optimizer steps (the save has ended, whichever way)."""
        _WATCHING.discard(self)

    def release(self) -> None:
        """Let go of the recorded tensors (a failed save: its error, kept by
        the caller, must not keep them alive through this object)."""
        self.unwatch()
        self._seen = {}
        self._survey = None
        self._by_storage = {}
        self._indexed = 0

    def _written_by(self, keys: set, who: str) -> None:
        """Mark the recorded tensors whose storage is one of ``keys`` as
        written by ``who`` (an optimizer step, on the stepping thread)."""
        seen = self._seen
        if self._indexed != len(seen):  # new tensors since (the pickler's)
            index: Dict[Tuple[int, str], List[int]] = {}
            items = list(seen.items())
            for i, (t, _) in items:
                k = _storage_key(t)
                if k is not None:
                    index.setdefault(k, []).append(i)
            self._by_storage, self._indexed = index, len(items)
        for k in keys & self._by_storage.keys():
            for i in self._by_storage[k]:
                self._written.setdefault(i, who)

    def changed(self) -> List[Tuple[torch.Tensor, int, int]]:
        """(tensor, version recorded, version now) of each tensor changed since."""
        return [(t, v, t._version) for t, v in self._seen.values() if t._version != v]

    def written(self) -> List[Tuple[torch.Tensor, str]]:
        """(tensor, who) of each recorded tensor an optimizer step wrote
        since, in the order they were recorded (the save's)."""
        written = self._written
        if not written:
            return []
        return [(t, written[i]) for i, (t, _) in list(self._seen.items()) if i in written]

    def check(self, obj: Any = None, what: str = "the save") -> None:
        """Raise :class:`TensorChangedError` (``on_change="error"``) or warn
        when a recorded tensor was changed in place since it was recorded;
        ``obj`` (the saved object) is searched to name the tensor."""
        self.unwatch()
        bad = self.changed()
        written = [] if bad else self.written()
        if not bad and not written:
            return
        t = bad[0][0] if bad else written[0][0]
        where = find_path(obj, lambda o: o is t) if obj is not None else None
        name = f"tensor {where}" if where is not None else "a tensor inside an object"
        count = len(bad) if bad else len(written)
        more = f" (and {count - 1} more)" if count > 1 else ""
        if bad:
            how = f"(version {bad[0][1]} at the call, {bad[0][2]} once its bytes were gathered)"
        else:
            how = (
                f"(written by {written[0][1]}, whose kernels do not bump torch's version counter: "
                "a fused optimizer, or one that updates p.data)"
            )
        msg = f"{name} ({_describe(t)}){more} was changed in place while {what} read it {how}"
        fence = (
            "fence with future.wait_snapshot() before any in-place update of the saved tensors, "
            "forward included (optimizer.step(), BatchNorm statistics, ...)"
        )
        if self.on_change == "warn":
            warnings.warn(
                f"{msg}; the file was committed anyway (on_change='warn') and may mix old and new values: {fence}",
                TensorChangedWarning,
                stacklevel=2,
            )
            log.warning("fastpersist: %s; committed anyway (on_change='warn')", msg)
            return
        raise TensorChangedError(f"{msg}: nothing was committed and the previous file is untouched; {fence}")


# ---------------------------------------------------------------------------
# Reading


#: The first pickle of torch's legacy (non-zip) files (torch.serialization.MAGIC_NUMBER).
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


class _NoGlobals(pickle._Unpickler):
    """Loads plain data only (no class, no function, no persistent id).
    Python's unpickler, not C's: its memo is a dict, where C's is an
    array sized by the largest index a PUT names (a few bytes of pickle
    could ask for gigabytes); these pickles are small."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a global ({module}.{name}) where plain data was expected")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("a persistent id where plain data was expected")


def load_plain(f: Any) -> Any:
    """The next pickle of ``f``, plain data only (ints, strings, lists, dicts)."""
    return _NoGlobals(f, encoding="utf-8").load()


def is_legacy_torch(head: bytes) -> bool:
    """Whether a file starting with ``head`` is torch's legacy format
    (``torch.save(..., _use_new_zipfile_serialization=False)``): its first
    pickle is torch's magic number (any pickle protocol), or a tar archive
    (torch's oldest format, which torch.load still reads)."""
    if head[257:262] == b"ustar":
        return True
    if head[:1] != b"\x80":
        return False
    try:
        magic = load_plain(io.BytesIO(head))
    except Exception:  # noqa: BLE001 - not a pickle: not a legacy file
        return False
    return type(magic) is int and magic == LEGACY_MAGIC


def restore_location(map_location: MapLocation) -> Callable[[Any, str], Any]:
    get = getattr(torch.serialization, "_get_restore_location", None)
    if get is not None:
        restore: Callable[[Any, str], Any] = get(map_location)
        return restore
    return lambda storage, location: torch.serialization.default_restore_location(  # pragma: no cover
        storage, location if map_location is None else str(map_location)
    )


class _Anything:
    """Stands for every class and function while a pickle is scanned."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Anything:
        return _Anything()

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


_storage_stand_ins: Dict[str, type] = {}
_STORAGE_MODULES = ("torch", "torch.cuda", "torch.storage")


def _stand_in(module: str, name: str) -> type:
    """``_Anything``, or for torch's storage classes (``torch.FloatStorage``;
    ``torch.cuda.FloatStorage`` in files of torch before 1.x saved from the
    GPU; ``torch.storage.UntypedStorage``, as torch.save names it) a
    subclass that remembers the class name (so a scan knows each storage's
    dtype)."""
    if module not in _STORAGE_MODULES or not name.endswith("Storage") or not name.isidentifier():
        return _Anything
    cls = _storage_stand_ins.get(name)
    if cls is None:
        cls = _storage_stand_ins[name] = type(name, (_Anything,), {"storage_name": name})
    return cls


def storage_element_size(type_name: str) -> int:
    """Bytes per element of torch's storage class ``type_name`` (e.g.
    ``FloatStorage``: 4; ``UntypedStorage``: 1); ValueError for others."""
    if type_name in ("UntypedStorage", "ByteStorage"):
        return 1
    size = _storage_element_sizes(type_name)
    if size is None:
        raise ValueError(f"{type_name} is not a torch storage type")
    return size


@functools.lru_cache(maxsize=256)
def _storage_element_sizes(type_name: str) -> Optional[int]:
    dtype = _storage_type_dtype(type_name)
    return element_size(dtype) if dtype is not None else None


@functools.lru_cache(maxsize=256)
def _storage_type_dtype(type_name: str) -> Optional[torch.dtype]:
    """The dtype of torch's typed storage class ``type_name``, or None."""
    cls = getattr(torch, type_name, None) if type_name.endswith("Storage") and type_name.isidentifier() else None
    return _class_dtype(cls) if isinstance(cls, type) else None


@functools.lru_cache(maxsize=64)
def _class_dtype(cls: type) -> Optional[torch.dtype]:
    """``cls.dtype`` for torch's typed storage classes (``torch.FloatStorage``,
    ...), None for other classes. Their ``dtype`` is behind torch's
    "TypedStorage is deprecated" warning, which torch.load never shows for
    it: asking for it is not the user's doing, so it is silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dtype = getattr(cls, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


def _storage_dtype(storage_type: Any) -> torch.dtype:
    """The dtype of a storage type named by a pickle: torch's typed storage
    classes when the pickle is loaded with globals, torch's ``StorageType``
    stand-ins under ``weights_only``."""
    if storage_type is torch.UntypedStorage:
        return torch.uint8
    dtype = _class_dtype(storage_type) if isinstance(storage_type, type) else getattr(storage_type, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{storage_type!r} is not a torch storage type")
    return dtype


def tensor_span(offset: Any, size: Any, stride: Any) -> Optional[int]:
    """How many elements of its storage a tensor at ``offset`` with
    ``size`` and ``stride`` reaches (0 when it holds none), or None when
    they are not ints (torch's rebuild then raises its own error)."""
    try:
        if type(offset) is not int or len(size) != len(stride):
            return None
        if not all(type(n) is int for n in size) or not all(type(n) is int for n in stride):
            return None
    except TypeError:
        return None
    if any(n == 0 for n in size):
        return 0
    span: int = offset + sum((n - 1) * st for n, st in zip(size, stride)) + 1
    return span


#: torch's rebuild functions that lay a tensor over a storage: (storage,
#: offset, size, stride, ...), and how many arguments each needs.
_REBUILD_ARGS = {"_rebuild_tensor": 4, "_rebuild_tensor_v2": 6, "_rebuild_tensor_v3": 7, "_rebuild_qtensor": 7}
_TENSOR_REBUILDS = frozenset(("torch._utils", n) for n in _REBUILD_ARGS)


class _ScannedStorage(_Anything):
    """What a scan's ``persistent_load`` gives for a storage: its key and
    the bytes of one element of the type this reference names."""

    def __init__(self, key: str, itemsize: int, dtype: Optional[torch.dtype] = None) -> None:
        self.key = key
        self.itemsize = itemsize
        #: The type's dtype, where torch has it (packed types count their reach
        #: in values, several a byte).
        self.dtype = dtype


def _checked_span(offset: Any, size: Any, stride: Any) -> int:
    """:func:`tensor_span` of arguments a tensor rebuild hands torch's
    ``set_``, raising ValueError for those it refuses: an offset that is
    not a non-negative int, a size or stride that is not a tuple (or list)
    of as many non-negative ints."""
    if type(offset) is not int or offset < 0:
        raise ValueError(f"a tensor's storage offset is {offset!r}, not a non-negative int")
    for what, v in (("size", size), ("stride", stride)):
        if not isinstance(v, (tuple, list)) or not all(type(n) is int and n >= 0 for n in v):
            raise ValueError(f"a tensor's {what} is {v!r}, not a tuple of non-negative ints")
    if len(size) != len(stride):
        raise ValueError(f"a tensor's size {tuple(size)} and stride {tuple(stride)} differ in length")
    span = tensor_span(offset, size, stride)
    assert span is not None  # (ints, checked above)
    return span


class LocationScan:
    """Replays a pickle's opcodes with every global replaced by a stand-in,
    so nothing is constructed or imported, and notes each storage's
    location, (:attr:`storages`) the (storage type name, element count)
    of its reference that needs the most bytes and (:attr:`first`) of its
    first reference (torch writes one persistent id per reference; its
    loaders allocate, or check the record, by the first), and
    (:attr:`reach`) the most bytes of each storage a tensor laid over it
    reaches. What torch's loaders refuse raises (a damaged pickle): a
    storage type that is not one of torch's storage classes, a location
    that is not a string or an element count that is not a non-negative
    int, a tensor rebuild given too few arguments or an offset, size or
    stride ``set_`` refuses.

    An unpickler of CPython's: the C one where the pickle's memo is
    bounded (``_core.pickle_memo_bound``: no index past a few per byte of
    pickle), else Python's, whose memo is a dict, as torch's
    ``weights_only`` loader's. C's sizes an array by the largest index a
    PUT names, so one LONG_BINPUT in a small valid file could take
    gigabytes (2**27: 2 GiB) where torch.load takes none; Python's is
    several times slower (10,000 tensors: some 0.3 s)."""

    load: Callable[[], Any]

    def __new__(cls, data: bytes) -> LocationScan:
        kind = cls
        if cls is LocationScan:
            bound = _core.pickle_memo_bound(data)
            fits = bound is not None and bound <= max(MEMO_BOUND, 2 * len(data))
            kind = _CScan if fits else _PyScan
        return super(LocationScan, kind).__new__(kind)  # the unpickler of its kind

    #: Persistent ids as torch's legacy format writes them (views' 6-tuples,
    #: module sources); a zip's pickle names 5-tuple storages only.
    legacy = False

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data), encoding="utf-8")  # type: ignore[call-arg]  # the unpickler's
        self.locations: Dict[str, str] = {}
        self.storages: Dict[str, Tuple[str, int]] = {}
        self.first: Dict[str, Tuple[str, int]] = {}
        #: The fewest bytes a reference to each storage as another storage
        #: type than its first describes (torch.load makes each such
        #: reference's storage from the record: it must hold exactly that).
        self.retyped: Dict[str, int] = {}
        self.reach: Dict[str, int] = {}
        self._others: Dict[Tuple[str, str], type] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _TENSOR_REBUILDS:
            return functools.partial(self._tensor, name)
        cls = _stand_in(module, name)
        if cls is _Anything:  # named, for messages
            cls = self._others.get((module, name)) or self._others.setdefault(
                (module, name), type("_Anything", (_Anything,), {"global_name": f"{module}.{name}"})
            )
        return cls

    def _tensor(self, name: str, *args: Any) -> Any:
        if len(args) < _REBUILD_ARGS[name]:
            raise TypeError(f"{name} is given {len(args)} arguments, it takes {_REBUILD_ARGS[name]}")
        storage, offset, size, stride = args[:4]
        if isinstance(storage, _ScannedStorage):
            itemsize, dtype = storage.itemsize, storage.dtype
            if name == "_rebuild_tensor_v3":  # (a dtype of its own, over untyped storage: elements of it)
                itemsize, dtype = _scanned_itemsize(args[6], itemsize), None
            reach = span_bytes(_checked_span(offset, size, stride), dtype, itemsize)
            self.reach[storage.key] = max(self.reach.get(storage.key, 0), reach)
        return _Anything()

    def persistent_load(self, pid: Any) -> Any:
        # zip files: ("storage", type, key, location, numel); legacy files
        # add view metadata (the view's own storage is its root's).
        if not self.legacy and not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            # torch.load's zip loader asserts this much of every persistent id
            raise TypeError(f"the persistent id {pid!r} is not a storage's (a 5-tuple)")
        if isinstance(pid, tuple) and len(pid) in (5, 6) and pid[0] == "storage":
            key = str(pid[2])
            type_name = getattr(pid[1], "storage_name", None)
            if not isinstance(type_name, str):
                what = getattr(pid[1], "global_name", None) or type(pid[1]).__name__
                raise TypeError(f"storage {key!r} is of type {what}, not one of torch's storage classes")
            itemsize = storage_element_size(type_name)  # ValueError: a class torch does not have
            location, numel = pid[3], pid[4]
            if not isinstance(location, str):
                raise TypeError(f"storage {key!r} has the location {location!r}, not a string")
            if type(numel) is not int or numel < 0:
                raise ValueError(f"storage {key!r} has {numel!r} elements, not a non-negative int")
            self.locations[key] = location
            self.first.setdefault(key, (type_name, numel))
            if self.first[key][0] != type_name:
                self.retyped[key] = min(self.retyped.get(key, numel * itemsize), numel * itemsize)
            prev = self.storages.get(key)
            if prev is None or numel * itemsize > prev[1] * storage_element_size(prev[0]):
                self.storages[key] = (type_name, numel)
            return _ScannedStorage(key, itemsize, _storage_type_dtype(type_name))
        if isinstance(pid, tuple) and len(pid) == 4 and pid[0] == "module" and isinstance(pid[1], type):
            return pid[1]  # a legacy save of a module object: its class (and its source, to compare)
        return _Anything()


#: Memo entries a scan by the C unpickler may ask for whatever the pickle's
#: size (16 bytes each).
MEMO_BOUND = 1 << 16


class _CScan(LocationScan, pickle.Unpickler):
    """:class:`LocationScan` on the C unpickler."""


class _PyScan(LocationScan, pickle._Unpickler):
    """:class:`LocationScan` on Python's unpickler."""


class _RestoreError(Exception):
    """Carries an error raised by ``map_location`` through the unpickler."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class _DataPending(Exception):
    """Raised by a loader made for storages whose bytes are still being
    read, for a storage whose restore might read them."""


class _StorageLoader:
    """``persistent_load`` for torch's storage ids: hands out the storages
    read from the file, each checked against what the pickle needs and
    moved by ``map_location`` unless already ``placed``. ``pending``: the
    storages' bytes are still being read, so only host storages saved on
    the CPU, which no restore touches, are handed out (anything else:
    :class:`_DataPending`).

    A record referenced again gets what the installed ``torch.load`` gives
    it (:func:`load_keeps_every_storage`): the storage handed out before;
    where torch keeps only storages with a data pointer, a storage of its
    own when the first had none (an empty one, or one restored to
    ``meta``); where torch keeps every storage, a reference of another
    dtype gets the same bytes under that dtype. A reference whose size is
    not the record's is refused, as torch.load refuses it."""

    def __init__(
        self, storages: Dict[str, Any], path: str, map_location: MapLocation, placed: set, pending: bool = False
    ) -> None:
        self.storages = storages
        self.path = path
        self.placed = placed
        self.restore = restore_location(map_location)
        self.pending = pending and map_location is None
        self.typed: Dict[str, Any] = {}
        # Records handed out and not kept: a later reference gets its own.
        self.handed: set = set()
        # Every storage handed out, its key and size then (see check_sizes).
        self.given: List[Tuple[Any, str, int]] = []

    def check_sizes(self) -> None:
        """Raise :class:`CorruptCheckpointError` when a tensor the pickle
        laid over a storage reached past the record's bytes. Storages made
        for a read can be resized, and ``set_`` grows them to fit what the
        pickle claims (torch.load's cannot be: it refuses such a file), so
        the file's own bytes would come back padded with memory it never
        held."""
        for st, key, n in self.given:
            if st.nbytes() != n:
                raise CorruptCheckpointError(
                    f"{self.path}: a tensor in the pickle reaches past storage {key!r}, which holds {n} bytes"
                )

    def __call__(self, saved_id: Any) -> Any:
        if not isinstance(saved_id, tuple) or len(saved_id) != 5 or saved_id[0] != "storage":
            raise CorruptCheckpointError(f"{self.path}: the pickle names an unknown persistent id {saved_id!r}")
        _, storage_type, key, location, numel = saved_id
        key = str(key)  # (torch.load names the record f"data/{key}": an int key too)
        kept = self.typed.get(key)
        if kept is not None and (kept.dtype == _storage_dtype(storage_type) or not load_keeps_every_storage()):
            return kept  # the older rule hands it out whatever the dtype asked for
        if key not in self.storages:
            raise CorruptCheckpointError(
                f"{self.path}: the pickle refers to storage {key!r}, which the file does not hold"
            )
        dtype = _storage_dtype(storage_type)
        st = self.storages[key]
        need = int(numel) * element_size(dtype)
        if need != st.nbytes():
            # torch.load makes every reference's storage from the record,
            # which must hold exactly its bytes (one that asks for fewer
            # would have a copy of its own: a small file's references
            # could ask for a copy of a large record each).
            raise CorruptCheckpointError(
                f"{self.path}: record 'data/{key}' holds {st.nbytes()} bytes, the pickle needs {need} for storage "
                f"{key!r}" + ("" if need > st.nbytes() else " (a record holds exactly its storage's bytes)")
            )
        if kept is not None:
            # torch keeps every storage; this reference asks for another dtype
            return torch.storage.TypedStorage(wrap_storage=kept._untyped_storage, dtype=dtype, _internal=True)
        if self.pending and (location != "cpu" or st.device != CPU_DEVICE):
            raise _DataPending(key)  # (a copy of bytes not read yet: after the read)
        if key in self.handed and st.nbytes() == 0:
            # Its own empty storage (one restored to a device without data,
            # such as meta, is made anew by the restore: no copy of the bytes).
            st = torch.UntypedStorage(0, device=st.device)
        if key not in self.placed:
            try:
                st = self.restore(st, location)
                # What a map_location callable returned: no storage is its
                # error (torch.load's TypeError), not the file's.
                ts = torch.storage.TypedStorage(wrap_storage=st, dtype=dtype, _internal=True)
            except Exception as e:
                raise _RestoreError(e) from e
        else:
            ts = torch.storage.TypedStorage(wrap_storage=st, dtype=dtype, _internal=True)
        self.given.append((st, key, st.nbytes()))
        if kept is None:
            if ts._data_ptr() != 0 or load_keeps_every_storage():
                self.typed[key] = ts
            else:
                self.handed.add(key)
        return ts


@functools.cache
def load_keeps_every_storage() -> bool:
    """Whether the installed ``torch.load`` hands every reference to a
    record the storage it made for the first (torch 2.15 does), or keeps
    only storages with a data pointer (torch 2.11 does: a reference to an
    empty storage, or to one restored to ``meta``, gets a storage of its
    own). Asked of ``torch.save``/``torch.load`` themselves (unpatched),
    once per process, and only by a load that meets such a storage twice."""
    save, load = inspect.unwrap(torch.save), inspect.unwrap(torch.load)
    empty = torch.empty(0)
    buf = io.BytesIO()
    save([empty, empty[:0]], buf)  # two tensors (one would be memoized), one storage
    buf.seek(0)
    # Asked in the middle of a load: torch versions that keep map_location
    # in a thread-local (which :func:`unpickle` sets) delete it when they end.
    state = _location_state()
    kept = getattr(state, "map_location", _MISSING)
    try:
        a, b = load(buf, weights_only=True)
    finally:
        if state is not None and kept is not _MISSING:
            state.map_location = kept
    return bool(a.untyped_storage()._cdata == b.untyped_storage()._cdata)


_MISSING = object()


def _location_state() -> Any:
    """The thread-local where torch.load keeps its ``map_location`` while it
    unpickles, for rebuilds that place a tensor without a storage to go by
    (wrapper subclasses such as DTensor, tensors made from numpy):
    ``torch.serialization._serialization_tls`` (torch >= 2.4), else
    ``torch._utils._thread_local_state``; None where torch has neither."""
    tls = getattr(torch.serialization, "_serialization_tls", None)
    if tls is not None and hasattr(tls, "map_location"):
        return tls
    return getattr(torch._utils, "_thread_local_state", None)


def _torch_wo_message() -> Optional[Callable[[str], str]]:
    """torch.load's own ``_get_wo_message`` (a function nested in
    ``torch.serialization.load``), rebuilt from its code object so a
    refusal reads exactly as torch's does in the installed version. Its
    free variables are constants that ``load`` stores before defining it
    (``DOCS_MESSAGE``); they are taken from ``load``'s bytecode. None where
    that cannot be done (another torch): :func:`weights_only_message` then
    composes torch 2.6's message itself."""
    import dis
    import types

    try:
        load = _unwrap(torch.serialization.load)
        code = next(
            c for c in load.__code__.co_consts if isinstance(c, types.CodeType) and c.co_name == "_get_wo_message"
        )
        ins = list(dis.get_instructions(load))
        values: Dict[str, Any] = {}
        for prev, cur in zip(ins, ins[1:]):
            if cur.opname == "STORE_DEREF" and prev.opname == "LOAD_CONST" and isinstance(prev.argval, str):
                values.setdefault(cur.argval, prev.argval)
        cells = tuple(types.CellType(values[name]) for name in code.co_freevars)
        fn = types.FunctionType(code, vars(torch.serialization), "_get_wo_message", None, cells)
        fn("probe")
        return fn
    except Exception:  # noqa: BLE001 - another torch: the fallback below
        return None


def _unwrap(fn: Any) -> Any:
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


#: torch's message function, found on first use (None: not found).
_wo_message: Any = ...


def weights_only_message(message: str) -> str:
    """The message ``torch.load`` gives when its ``weights_only`` unpickler
    refuses a file with ``message`` ("Weights only load failed. ..." and
    torch's guidance)."""
    global _wo_message
    if _wo_message is ...:
        _wo_message = _torch_wo_message()
    if _wo_message is not None:
        return str(_wo_message(message))
    unsafe = getattr(torch.serialization, "UNSAFE_MESSAGE", "")
    docs = (
        "\n\nCheck the documentation of torch.load to learn more about types accepted by default with "
        "weights_only https://pytorch.org/docs/stable/generated/torch.load.html."
    )
    if re.search(r"GLOBAL (\S+) was not an allowed global by default.", message):
        return (
            "Weights only load failed. This file can still be loaded, to do so you have two options, "
            "\033[1mdo those steps only if you trust the source of the checkpoint\033[0m. "
            f"\n\t(1) {unsafe}\n\t(2) Alternatively, to load with `weights_only=True` please check "
            "the recommended steps in the following error message.\n\tWeightsUnpickler error: " + message + docs
        )
    if re.search(r"(\S+) must be (\S+) to load", message):
        return f"Weights only load failed. {message}\n {unsafe}\n"
    out = f"Weights only load failed. {unsafe}\n"
    if not re.search(r"whose module (\S+) is blocked", message):
        out += (
            "Please file an issue with the following so that we can make "
            "`weights_only=True` compatible with your use case: WeightsUnpickler error: "
        )
    return out + "\n\n" + message + docs


#: Whether :func:`unpickle` tries its fast path first (tests turn it off
#: to compare with the unpickler).
FAST_UNPICKLE = True

# What the fast path does in place of torch's rebuild functions: it stands
# aside when any of them was replaced since (a patch would not run).
_REBUILD_V2 = torch._utils._rebuild_tensor_v2
_REBUILD = torch._utils._rebuild_tensor
_RESTORE_FAKE = getattr(torch._utils, "_restore_device_fake_mode", None)


def _storage_class_names() -> List[str]:
    """Names of torch's typed storage classes (``FloatStorage``, ...)."""
    table = getattr(torch.storage, "_dtype_to_storage_type_map", None)
    return sorted(set(table().values())) if table is not None else []


#: The values torch.load takes for "set" in TORCH_FORCE_(NO_)WEIGHTS_ONLY_LOAD.
_TRUE_VALUES = ("1", "y", "yes", "true")


def resolve_weights_only(weights_only: Optional[bool]) -> bool:
    """``weights_only`` as torch.load resolves it: None (not given) is
    torch's default, True; ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` makes every
    load weights-only; ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` one that did
    not say (with torch's warning); both set is torch's RuntimeError."""
    force = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE_VALUES
    force_no = os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE_VALUES
    if force and force_no:
        raise RuntimeError(
            "Only one of `TORCH_FORCE_WEIGHTS_ONLY_LOAD` or `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD` "
            "should be set, but both were set."
        )
    if force:
        return True
    if weights_only is None:
        if force_no:
            warnings.warn(
                "Environment variable TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD detected, since the `weights_only` "
                "argument was not explicitly passed, forcing weights_only=False.",
                UserWarning,
                stacklevel=3,
            )
            return False
        return True
    return bool(weights_only)


def _fast_unpickle_context(weights_only: bool) -> Optional[tuple]:
    """What the fast path (``_core.fast_unpickle``) needs to make the
    objects the slow path's unpickler makes, looked up now: the globals it
    resolves (``collections.OrderedDict``, ``torch._utils._rebuild_tensor_v2``,
    torch's typed storage classes), as ``pickle.Unpickler`` resolves them
    or, for ``weights_only``, as torch's allowlist does (its ``StorageType``
    stand-ins for the storage classes). None where it cannot be: a rebuild
    function replaced, a fake tensor mode active (torch's rebuild gives its
    tensors a fake device), one of those modules blocked."""
    u = torch._utils
    if u._rebuild_tensor_v2 is not _REBUILD_V2 or u._rebuild_tensor is not _REBUILD:
        return None
    if getattr(u, "_restore_device_fake_mode", None) is not _RESTORE_FAKE or hasattr(OrderedDict, "__setstate__"):
        return None
    if _RESTORE_FAKE is not None and torch._guards.detect_fake_mode(None) is not None:
        return None
    wanted = [("collections", "OrderedDict"), ("torch._utils", "_rebuild_tensor_v2")]
    wanted += [("torch", name) for name in _storage_class_names()]
    resolved: List[Tuple[bytes, bytes, Any]] = []
    if weights_only:
        from torch import _weights_only_unpickler as wou

        blocked = getattr(wou, "_blocklisted_modules", ())
        if any(m in blocked for m, _ in wanted):
            return None
        allowed = wou._get_allowed_globals()
        for module, name in wanted:
            obj = allowed.get(f"{module}.{name}")
            if obj is not None:
                resolved.append((module.encode(), name.encode(), obj))
    else:
        for module, name in wanted:
            obj = getattr(sys.modules.get(module), name, None)
            if obj is not None:
                resolved.append((module.encode(), name.encode(), obj))
    if resolved[:2] != [
        (b"collections", b"OrderedDict", OrderedDict),
        (b"torch._utils", b"_rebuild_tensor_v2", _REBUILD_V2),
    ]:
        return None
    return (resolved, _REBUILD_V2, OrderedDict, torch.storage.TypedStorage, torch.empty)


def _fast_unpickle(pkl: bytes, weights_only: bool, load: Callable[[Any], Any]) -> Any:
    """:func:`unpickle`'s object made by the Rust core, or None where the
    pickle holds anything it leaves to the unpickler (or something other
    than ``load`` raised). ``load``'s exceptions are raised as they are:
    the unpickler would make the same call at the same point."""
    if not FAST_UNPICKLE:
        return None
    try:
        ctx = _fast_unpickle_context(weights_only)
    except Exception:  # noqa: BLE001 - another torch: the unpickler, as before
        return None
    if ctx is None:
        return None
    return _core.fast_unpickle(pkl, ctx, load)


class _MissingGlobal(_RestoreError):
    """Carries the error of a global the pickle names that cannot be
    imported (a class since removed): torch.load raises it as it is."""


class _Unpickler(pickle.Unpickler):
    """The unpickler of ``weights_only=False`` loads: globals as pickle
    finds them, torch's tensor rebuilds checked first (a tensor reaching
    past its storage's record is refused before ``set_`` would grow the
    storage to fit it)."""

    def find_class(self, module: str, name: str) -> Any:
        # torch.load's own rules first: any name with "Storage" in it is
        # torch's StorageType stand-in (a storage class torch no longer
        # has still loads), and modules torch moved are looked up where
        # they are now (files of torch < 1.9 name torch.tensor).
        if type(name) is str and "Storage" in name and _STORAGE_TYPE is not None:
            try:
                return _STORAGE_TYPE(name)
            except KeyError:
                pass
        module = _MOVED_MODULES.get(module, module)
        try:
            found = super().find_class(module, name)
        except (ImportError, AttributeError) as e:
            raise _MissingGlobal(e) from e
        if (module, name) in _TENSOR_REBUILDS and callable(found):
            return _fitting(found)
        return found


#: torch.load's stand-in for the storage classes a pickle names.
_STORAGE_TYPE: Any = getattr(torch.serialization, "StorageType", None)

#: Modules torch.load looks up elsewhere (its ``load_module_mapping``).
_MOVED_MODULES = {"torch.tensor": "torch._tensor"}


def _scanned_itemsize(dtype: Any, default: int) -> int:
    """Bytes per element of the dtype a scanned pickle names (its stand-in
    global, ``torch.uint16``), or ``default`` for anything else."""
    module, _, name = str(getattr(dtype, "global_name", "")).partition(".")
    found = getattr(torch, name, None) if module == "torch" and name.isidentifier() else None
    return found.itemsize if isinstance(found, torch.dtype) else default


def _fitting(rebuild: Callable[..., Any]) -> Callable[..., Any]:
    """``rebuild`` (storage, offset, size, stride, ...), refusing a tensor
    that reaches past its storage (in bytes: ``_rebuild_tensor_v3`` views
    an untyped storage as elements of a dtype of its own)."""
    v3 = getattr(rebuild, "__name__", "") == "_rebuild_tensor_v3"

    @functools.wraps(rebuild)
    def checked(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any, **kw: Any) -> Any:
        span = tensor_span(offset, size, stride)
        if span is not None and isinstance(storage, torch.storage.TypedStorage):
            dtype = (rest[2] if len(rest) > 2 else kw.get("dtype")) if v3 else storage.dtype
            need = span_bytes(span, dtype if isinstance(dtype, torch.dtype) else storage.dtype)
            held = storage._untyped_storage.nbytes()
            if need > held:
                raise CorruptCheckpointError(
                    f"a tensor of {tuple(size)} at offset {offset} ({need} bytes of {dtype}) "
                    f"reaches past its storage of {held} bytes"
                )
        return rebuild(storage, offset, size, stride, *rest, **kw)

    return checked


def _unpickler(pkl: bytes, weights_only: bool) -> Any:
    if weights_only:
        from torch import _weights_only_unpickler

        return _weights_only_unpickler.Unpickler(io.BytesIO(pkl), encoding="utf-8")
    return _Unpickler(io.BytesIO(pkl), encoding="utf-8")


def _check_reach(pkl: bytes, storages: Dict[str, Any], path: str) -> None:
    """Before torch's weights-only unpickler, whose rebuilds ``set_`` a
    tensor over the storages read with no check (and a storage made for a
    read can be resized: ``set_`` would grow it to whatever a pickle
    claims, terabytes from a small file): every tensor the scan finds
    within its storage's bytes. A pickle the scan refuses is left to the
    unpickler, which names what is wrong."""
    scan = LocationScan(pkl)
    try:
        scan.load()
    except Exception:  # noqa: BLE001 - whatever the scan refuses
        return
    for key, reach in scan.reach.items():
        st = storages.get(key)
        type_name, numel = scan.first.get(key, ("", -1))
        if st is None or numel * storage_element_size(type_name or "UntypedStorage") != st.nbytes():
            continue  # missing, or not the size the pickle says: the loader names it as the fast path does
        if reach > st.nbytes():
            raise CorruptCheckpointError(
                f"{path}: a tensor in the pickle reaches {reach} bytes into storage {key!r}, which holds {st.nbytes()}"
            )


def _well_formed(pkl: bytes) -> bool:
    """Whether the pickle replays as torch's loaders want it (the scan:
    nothing constructed): an error loading a well-formed pickle is its
    objects' own, one of an ill-formed pickle is damage."""
    try:
        LocationScan(pkl).load()
    except Exception:  # noqa: BLE001 - whatever the scan refuses
        return False
    return True


def unpickle_before_data(pkl: bytes, storages: Dict[str, Any], path: str, weights_only: bool) -> Tuple[Any, bool]:
    """:func:`unpickle`'s object for ``map_location=None``, made while the
    storages' bytes are still being read (the caller waits for the read
    before anyone may use it), and whether :func:`unpickle` should try the
    fast path again. Made only by the fast path (plain state dicts, whose
    objects read no storage bytes as they are made) from host storages
    saved on the CPU (no restore); else None, and anything else (a pickle
    the fast path leaves to the unpickler: not tried again; damage) is left
    to :func:`unpickle` once the bytes are in."""
    if not FAST_UNPICKLE:
        return None, False
    loader = _StorageLoader(storages, path, None, set(), pending=True)
    try:
        obj = _fast_unpickle(pkl, weights_only, loader)
        loader.check_sizes()
    except Exception:  # noqa: BLE001 - a storage to restore, or damage: the unpickle after the read
        return None, True
    return obj, False


def unpickle(
    pkl: bytes,
    storages: Dict[str, Any],
    path: str,
    map_location: MapLocation,
    weights_only: bool,
    placed: Optional[set] = None,
    fast: bool = True,
    intact: bool = False,
) -> Any:
    """Replay the pickle with ``storages``; those in ``placed`` are already
    where ``map_location`` sends them (torch's restore is skipped).
    ``fast=False``: the fast path already declined this pickle.
    ``intact``: the pickle's bytes are those written (their CRC32 checked):
    an error it raises is the saved objects' own (a ``__setstate__``, a
    ``map_location`` that returns no storage), raised as torch.load raises
    it, not as damage.

    Pickles of plain state dicts (dicts, lists, tuples, strings, numbers,
    OrderedDicts, plain tensors, as torch.save and :func:`pickle_obj` write
    them) take a fast path (:data:`FAST_UNPICKLE`): the same objects, made
    by the Rust core without the unpickler's Python frames."""
    unpickler = _unpickler(pkl, weights_only)
    loader = _StorageLoader(storages, path, map_location, placed or set())
    unpickler.persistent_load = loader
    state = _location_state()
    old = getattr(state, "map_location", None) if state is not None else None
    if state is not None:
        state.map_location = map_location
    try:
        # Plain state dicts: the Rust core's reader (see _fast_unpickle),
        # else (None) the unpickler, with the same loader: it hands out the
        # storages the fast path already asked for again, without restoring
        # them again (empty ones aside: the loader does not keep those).
        obj = _fast_unpickle(pkl, weights_only, loader) if fast else None
        if obj is None:
            if weights_only:
                _check_reach(pkl, storages, path)
            obj = unpickler.load()
        loader.check_sizes()
    except CorruptCheckpointError as e:
        if not str(e).startswith(path):
            raise CorruptCheckpointError(f"{path}: {e}") from None
        raise
    except _RestoreError as e:  # map_location="cuda" without a GPU, a class gone: torch's own error
        raise e.error from None
    except NotImplementedError:
        raise  # what torch.load raises too (a quantized tensor restored to meta, say)
    except pickle.UnpicklingError as e:
        if weights_only:  # torch.load's words, exactly
            raise pickle.UnpicklingError(weights_only_message(str(e))) from None
        raise pickle.UnpicklingError(f"{path}: {e}") from None
    except Exception as e:  # a damaged pickle can raise anything (unless intact: see above)
        if intact and _well_formed(pkl):
            raise  # the saved objects' own error (a __setstate__), as torch.load raises it
        raise CorruptCheckpointError(
            f"{path}: the pickle (data.pkl) cannot be loaded: {type(e).__name__}: {e}"
        ) from None
    finally:
        if state is not None:
            state.map_location = old
    _validate_sparse(weights_only)
    return obj


@functools.cache
def _sparse_validator() -> Tuple[Optional[Callable[..., None]], bool]:
    """torch's check of the sparse tensors a load made, and whether it takes
    ``weights_only`` (newer torch checks them always under weights_only: an
    index out of bounds reads out of bounds later)."""
    validate = getattr(torch._utils, "_validate_loaded_sparse_tensors", None)
    if validate is None:
        return None, False
    try:
        return validate, "weights_only" in inspect.signature(validate).parameters
    except (TypeError, ValueError):
        return validate, False


def _validate_sparse(weights_only: bool) -> None:
    """What torch.load does after the unpickle: the sparse tensors made are
    checked (raising what torch raises)."""
    validate, takes = _sparse_validator()
    if validate is None:
        return
    if takes:
        validate(weights_only=weights_only)
    else:
        validate()
