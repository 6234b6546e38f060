"""``fastpersist.patch()``: route ``torch.save``/``torch.load`` and
``safetensors.torch.save_file``/``load_file`` through fastpersist, for code
that cannot be edited (a trainer calling ``torch.save``).

While a patch is active, the module attributes ``torch.save``,
``torch.serialization.save``, ``torch.load``, ``torch.serialization.load``
and, when safetensors is installed, ``safetensors.torch.save_file`` and
``load_file`` are wrappers. A call fastpersist can carry out exactly as the
original would (a path, the default pickler and protocol, the zip format;
for loads no ``mmap``, no pickle arguments, a torch zip or safetensors file)
is *routed*: written with :func:`~fastpersist.write_state_dict` or read with
:func:`~fastpersist.read_state_dict`, giving what the original gives (a
routed ``torch.save`` file is one ``torch.load`` reads). Any other call
falls back to the original function, unchanged; so does an object
fastpersist refuses before writing anything (its refusal is then the
original's). :class:`PatchStats` counts both, with the reasons.

Names bound before the patch (``from torch import save``) keep the
original. Patches nest: the attributes are restored when the last active
patch ends, on any exit; calls made by fastpersist itself while it carries
out a routed call go to the originals.
"""

from __future__ import annotations

import copyreg
import functools
import inspect
import os
import pickle
import re
import shutil
import stat
import tempfile
import threading
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from . import _core
from .errors import CorruptCheckpointError, FastPersistError, SerializationError, UnsupportedDtypeError, WriteError
from .options import EngineOptions, file_mode, parent_exists, resolve_target
from .reader import detect_format, read_state_dict
from .torch_zip import STORAGE_ALIGNMENT
from .writer import write_state_dict

__all__ = ["patch", "Patch", "PatchStats", "torch_save_route"]

#: The data of fastpersist's torch files is aligned to this (torch's own
#: ``storage_alignment`` must divide it for a routed file to be torch's).
_ALIGNMENT = STORAGE_ALIGNMENT


@dataclass
class PatchStats:
    """What an active patch did. Counted under a lock (calls from any thread)."""

    #: Calls carried out by fastpersist, by function (``"torch.save"``,
    #: ``"torch.load"``, ``"safetensors.torch.save_file"``, ``"safetensors.torch.load_file"``).
    routed_calls: Counter = field(default_factory=Counter)
    #: Calls passed to the original function, by function.
    fallback_calls: Counter = field(default_factory=Counter)
    #: Why calls fell back (``"torch.load: mmap=True"``), with counts.
    reasons: Counter = field(default_factory=Counter)

    @property
    def routed(self) -> int:
        """Calls carried out by fastpersist."""
        return sum(self.routed_calls.values())

    @property
    def fallbacks(self) -> int:
        """Calls passed to the original function."""
        return sum(self.fallback_calls.values())


# --- which calls fastpersist carries out ---------------------------------------------------------


@functools.cache
def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(fn)


def _bind(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Optional[inspect.BoundArguments]:
    try:
        ba = _signature(fn).bind(*args, **kwargs)
    except TypeError:
        return None  # the original raises its own TypeError
    ba.apply_defaults()
    return ba


def _is_default(value: Any, default: Any) -> bool:
    return value is default or (type(value) is type(default) and value == default)


def _non_default(fn: Callable[..., Any], ba: inspect.BoundArguments, handled: Tuple[str, ...]) -> Optional[str]:
    """The first argument not in ``handled`` that differs from ``fn``'s default."""
    for name, p in _signature(fn).parameters.items():
        if name in handled:
            continue
        value = ba.arguments.get(name)
        if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            if value:
                return f"{name}={value!r}"
        elif not _is_default(value, p.default):
            return f"{name}={value!r}"
    return None


def _file_name(path: str) -> bool:
    """Whether ``path`` names a file (not empty, no trailing separator),
    which fastpersist would otherwise refuse with its own ValueError."""
    return path != "" and not path.endswith(os.sep) and not (os.altsep and path.endswith(os.altsep))


def _path(f: Any) -> Optional[str]:
    """``f`` as a path fastpersist takes, or None: a file object, bytes, or
    no file name (the original then raises its own error)."""
    if not isinstance(f, (str, os.PathLike)):
        return None
    p = os.fspath(f)
    return p if isinstance(p, str) and _file_name(p) else None


def _torch_state() -> Optional[str]:
    """A torch mode under which serialization behaves differently."""
    tls = getattr(torch.serialization, "_serialization_tls", None)
    if tls is not None and getattr(tls, "skip_data", False):
        return "torch.serialization.skip_data is active"
    active_fake = getattr(getattr(torch, "_guards", None), "active_fake_mode", None)
    if active_fake is not None and active_fake() is not None:
        return "a FakeTensorMode is active"
    return None


#: torch.Tensor's own reduction, as torch defines it.
_TENSOR_REDUCE_EX = torch.Tensor.__reduce_ex__


def _own_tensor_pickling() -> Optional[str]:
    """A reduction of plain tensors of the program's own, which torch.save's
    pickler uses (copyreg's dispatch table is consulted first, then
    ``__reduce_ex__``) and fastpersist's tensor reducer would pass by."""
    if torch.Tensor in copyreg.dispatch_table:
        return "a copyreg reduction of torch.Tensor"
    if torch.Tensor.__reduce_ex__ is not _TENSOR_REDUCE_EX:
        return "torch.Tensor.__reduce_ex__ replaced"
    return None


def _config(section: str, name: str, default: Any) -> Any:
    try:
        from torch.utils.serialization import config
    except ImportError:
        return default
    return getattr(getattr(config, section, None), name, default)


def torch_save_route(save: Callable[..., Any], args: tuple, kwargs: dict) -> Tuple[Optional[Tuple[Any, str]], str]:
    """For a call ``save(*args, **kwargs)`` of ``torch.save`` (``save`` is
    the function it would run): ``((obj, path), "")`` when fastpersist
    writes what it would (a path in an existing directory; every other
    argument at torch's default: pickle module, protocol, zip format, byte
    order record; a file that replacing by rename leaves as torch's write
    in place leaves it, :func:`_replacing_differs`), else ``(None, why)``."""
    ba = _bind(save, args, kwargs)
    if ba is None or "obj" not in ba.arguments or "f" not in ba.arguments:
        return None, "arguments torch.save does not take"
    path = _path(ba.arguments["f"])
    if path is None:
        return None, "a file object, or not a file name"
    odd = _non_default(save, ba, ("obj", "f"))
    if odd is not None:
        return None, odd
    odd = _torch_state() or _own_tensor_pickling()
    if odd is not None:
        return None, odd
    align = _config("save", "storage_alignment", 64)
    if not isinstance(align, int) or align <= 0 or _ALIGNMENT % align:
        return None, f"storage_alignment={align!r}"
    if not parent_exists(path) or os.path.isdir(path):
        return None, "no such directory, or a directory"  # torch's own error
    odd = _replacing_differs(path)
    if odd is not None:
        return None, odd
    return (ba.arguments["obj"], path), ""


_EFFECTIVE = os.access in os.supports_effective_ids


def _replacing_differs(path: str) -> Optional[str]:
    """Why replacing the file at ``path`` by a new one (a temporary file in
    its directory, renamed onto it, with its owner, group and mode) would
    not end as torch.save's write in place does, None when it would."""
    try:
        directory = os.path.dirname(resolve_target(path))  # where fastpersist makes its file
    except (OSError, ValueError) as e:
        return f"the target cannot be inspected ({e})"
    try:
        st: Optional[os.stat_result] = os.stat(path)  # what torch's open() finds, links followed
    except FileNotFoundError:
        st = None  # torch.save creates it
    except OSError as e:
        return f"the target cannot be inspected ({e})"
    if not os.access(directory, os.W_OK | os.X_OK, effective_ids=_EFFECTIVE):
        return "a directory no file can be made in (torch.save writes the file in place)"
    if st is None or not stat.S_ISREG(st.st_mode):
        return None
    if st.st_nlink > 1:
        return "a file with other hard links (torch.save's write is seen through all of them)"
    if not os.access(path, os.W_OK, effective_ids=_EFFECTIVE):
        return "a file that cannot be written (torch.save's error)"
    euid = os.geteuid()
    if euid != 0 and (st.st_uid != euid or st.st_gid not in (os.getegid(), *os.getgroups())):
        return "a file of another owner or group (torch.save keeps them; a new file cannot have them)"
    return None


_ENV_WEIGHTS_ONLY = ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")


def _torch_load_route(load: Callable[..., Any], args: tuple, kwargs: dict) -> Tuple[Optional[Dict[str, Any]], str]:
    """For a call of ``torch.load``: read_state_dict's arguments, or why not."""
    ba = _bind(load, args, kwargs)
    if ba is None or "f" not in ba.arguments:
        return None, "arguments torch.load does not take"
    path = _path(ba.arguments["f"])
    if path is None:
        return None, "a file object, or not a file name"
    a = ba.arguments
    if a.get("mmap") or (a.get("mmap") is None and _config("load", "mmap", False)):
        return None, "mmap=True"
    pickle_module = a.get("pickle_module")
    if pickle_module is not None and pickle_module is not pickle:
        return None, "a custom pickle_module"
    odd = _non_default(load, ba, ("f", "map_location", "pickle_module", "weights_only", "mmap"))
    if odd is not None:
        return None, odd
    if any(os.environ.get(v) for v in _ENV_WEIGHTS_ONLY):
        return None, "TORCH_FORCE_(NO_)WEIGHTS_ONLY_LOAD is set"
    weights_only = a.get("weights_only")
    if weights_only is None:
        default = getattr(torch.serialization, "_default_to_weights_only", None)
        if default is None:
            return None, "this torch's weights_only default is unknown"
        weights_only = bool(default(pickle_module))
    if weights_only and pickle_module is not None:
        return None, "weights_only with a pickle_module"  # torch refuses it
    map_location = a.get("map_location")
    if not (map_location is None or isinstance(map_location, (str, torch.device, dict)) or callable(map_location)):
        return None, f"map_location={map_location!r}"
    odd = _torch_state()
    if odd is not None:
        return None, odd
    if path.endswith(".safetensors") or not _is_torch_zip(path):
        return None, "not a torch zip file"
    return {"path": path, "map_location": map_location, "weights_only": weights_only}, ""


def _is_torch_zip(path: str) -> bool:
    """Whether ``path`` is a regular file of torch's zip format, as
    read_state_dict tells formats: a safetensors file whose header length
    reads as a zip signature (0x04034B50 bytes) is not one, and torch.load
    refuses it."""
    try:
        # (and a local header first: torch's reader takes an empty zip,
        # "PK\x05\x06", for no zip at all, and raises its own error)
        return os.path.isfile(path) and _starts_with(path, b"PK\x03\x04") and detect_format(path) == "torch"
    except (OSError, CorruptCheckpointError):
        return False


def _starts_with(path: str, magic: bytes) -> bool:
    with open(path, "rb") as f:
        return f.read(len(magic)) == magic


def _is_torchscript(path: str) -> bool:
    try:
        with zipfile.ZipFile(path) as z:
            return any(n == "constants.pkl" or n.endswith("/constants.pkl") for n in z.namelist())
    except (OSError, zipfile.BadZipFile, ValueError):
        return False


def save_file_route(save_file: Callable[..., Any], args: tuple, kwargs: dict) -> Tuple[Optional[Dict[str, Any]], str]:
    """For a call ``save_file(*args, **kwargs)`` of safetensors'
    ``save_file``: ``({"obj", "path", "metadata", "mode"}, "")`` when
    fastpersist leaves at the path what it would (written in safetensors
    format, committed with ``mode`` through :func:`~fastpersist.options.file_mode`),
    else ``(None, why)``: the call goes to ``save_file``."""
    ba = _bind(save_file, args, kwargs)
    if ba is None or "tensors" not in ba.arguments or "filename" not in ba.arguments:
        return None, "arguments save_file does not take"
    path = _path(ba.arguments["filename"])
    if path is None:
        return None, "not a path, or not a file name"
    odd = _non_default(save_file, ba, ("tensors", "filename", "metadata"))
    if odd is not None:
        return None, odd
    tensors = ba.arguments["tensors"]
    if not isinstance(tensors, dict):
        return None, "not a dict"
    for v in tensors.values():
        # fastpersist writes a non-contiguous tensor's copy; safetensors refuses it.
        if not isinstance(v, torch.Tensor) or v.layout is not torch.strided or not v.is_contiguous():
            return None, "a value safetensors refuses"
    if not parent_exists(path) or os.path.isdir(path):
        return None, "no such directory, or a directory"
    mode, odd = _save_file_target(save_file, path)
    if mode is None:
        return None, odd
    return {"obj": tensors, "path": path, "metadata": ba.arguments.get("metadata"), "mode": mode}, ""


def _umask() -> Optional[int]:
    """The process umask, read without changing it (other threads may be
    creating files); None where the kernel does not say (before Linux 4.7)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return None


@functools.lru_cache(maxsize=8)
def _save_file_mode(save_file: Callable[..., Any], umask: int) -> Optional[int]:
    """The mode of the file ``save_file`` leaves at its path under ``umask``
    when it replaces whatever was there by a new file (safetensors 0.8:
    a temporary file of mode 0600, renamed onto the path), found by
    watching it save twice in a private directory: None when it does
    something else (writes an existing file in place, keeps its mode)."""
    d = tempfile.mkdtemp(prefix=".fastpersist-probe-")
    try:
        new, old = os.path.join(d, "new"), os.path.join(d, "old")
        with open(old, "wb"):
            pass
        os.chmod(old, 0o604)  # a mode no writer picks of itself
        before = os.stat(old)
        save_file({}, new)
        save_file({}, old)
        made, replaced = os.lstat(new), os.lstat(old)
    except Exception:  # noqa: BLE001 - whatever went wrong, its way is unknown
        return None
    finally:
        shutil.rmtree(d, ignore_errors=True)
    mode = stat.S_IMODE(made.st_mode)
    if not stat.S_ISREG(replaced.st_mode) or replaced.st_ino == before.st_ino or stat.S_IMODE(replaced.st_mode) != mode:
        return None
    return mode


def _save_file_target(save_file: Callable[..., Any], path: str) -> Tuple[Optional[int], str]:
    """The mode of the file ``save_file`` leaves at ``path``, where
    fastpersist can leave the same there (its commit given that mode:
    :func:`~fastpersist.options.file_mode`), else None and why not.
    save_file makes a new file of its own mode and owner and renames it onto
    the path (a symlink there is replaced, not followed; hard links to an
    old file keep it): so does fastpersist's commit, onto a regular file or
    no file; a link or a special file it would follow or write into."""
    umask = _umask()
    if umask is None:
        return None, "the process umask is unknown"
    mode = _save_file_mode(save_file, umask)
    if mode is None:
        return None, "this safetensors does not replace the file with a new one"
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return mode, ""
    except OSError as e:
        return None, f"the path cannot be inspected ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return None, "a symbolic link (safetensors replaces it)"
    if not stat.S_ISREG(st.st_mode):
        return None, "not a regular file (safetensors replaces it)"
    return mode, ""


#: A CUDA device index as safetensors spells it and torch writes it back (ASCII, no sign or zeros in front).
_CUDA_INDEX = re.compile(r"cuda:(0|[1-9][0-9]{0,5})")


def _device(device: Any, path: str) -> Optional[str]:
    """safetensors' ``device`` as the map_location that places tensors where
    ``load_file`` places them, None where fastpersist cannot say (the call
    then goes to load_file, which gives its own result or error). Only the
    spellings whose meaning is known: ``"cpu"``; ``"cuda"`` (safetensors'
    first CUDA device, not torch's current one), ``"cuda:N"`` and an index
    ``N`` (of CUDA, the accelerator) for a CUDA device torch has; and only
    those the installed safetensors accepts (:func:`_safetensors_accepts`):
    a ``torch.device``, ``"cpu:0"`` and others are its own to refuse."""
    if isinstance(device, str):
        if device == "cpu":
            location = "cpu"
        elif device == "cuda":
            location = "cuda:0"
        elif _CUDA_INDEX.fullmatch(device):
            location = device
        else:
            return None
    elif type(device) is int and device >= 0:  # not a bool, nor an int subclass
        accelerator = getattr(torch, "accelerator", None)
        current = accelerator.current_accelerator() if accelerator is not None else None
        if current is None or current.type != "cuda":
            return None
        location = f"cuda:{device}"
    else:
        return None
    if location != "cpu" and int(location[len("cuda:") :]) >= torch.cuda.device_count():
        return None  # no such device: load_file's own error
    return location if _safetensors_accepts(device, path) else None


#: The device values the installed safetensors was seen to accept, by type and value.
_ACCEPTED: set = set()


def _safetensors_accepts(device: Any, path: str) -> bool:
    """Whether the installed safetensors takes ``device`` (what ``load_file``
    hands it to: ``safe_open``, which parses it when opening ``path``).
    Asked once per value; a refusal is not kept (it may be the file's)."""
    key = (type(device), device)
    if key in _ACCEPTED:
        return True
    try:
        from safetensors import safe_open

        with safe_open(path, framework="pt", device=device):
            pass
    except Exception:  # noqa: BLE001 - refused (safetensors' own error follows), or the file's fault
        return False
    _ACCEPTED.add(key)
    return True


def _load_file_route(load_file: Callable[..., Any], args: tuple, kwargs: dict) -> Tuple[Optional[Dict[str, Any]], str]:
    ba = _bind(load_file, args, kwargs)
    if ba is None or "filename" not in ba.arguments:
        return None, "arguments load_file does not take"
    path = _path(ba.arguments["filename"])
    if path is None:
        return None, "not a path, or not a file name"
    if ba.arguments.get("backend", "mmap") not in ("mmap", "pread"):
        return None, f"backend={ba.arguments['backend']!r}"
    odd = _non_default(load_file, ba, ("filename", "device", "backend"))
    if odd is not None:
        return None, odd
    try:
        if not os.path.isfile(path) or detect_format(path) != "safetensors":
            return None, "not a safetensors file"
    except (OSError, CorruptCheckpointError):
        return None, "not a safetensors file"
    device = _device(ba.arguments.get("device", "cpu"), path)
    if device is None:
        return None, f"device={ba.arguments.get('device')!r}"
    return {"path": path, "map_location": device}, ""


# --- the routed calls --------------------------------------------------------------------------------


class _Fallback(Exception):
    """Raised by a routed call that the original must carry out instead
    (``call``: how, when not with the caller's arguments)."""

    def __init__(self, why: str, call: Optional[Callable[[], Any]] = None) -> None:
        super().__init__(why)
        self.why = why
        self.call = call


def _save_replacing(original: Callable[..., Any], args: tuple, kwargs: dict, path: str) -> Any:
    """``original(*args, **kwargs)`` (torch.save) writing into a temporary
    file beside ``path``, committed over it when the call returns: torch's
    own errors, and a failure (an object torch refuses too) leaves the file
    that was at ``path`` as it was, where torch truncates it first. The
    file is torch's as it writes one to a file object (its records under
    ``archive/``: a temporary name is no archive name). Called only where
    :func:`torch_save_route` found that replacing the file ends as torch's
    write in place does."""
    ba = _bind(original, args, kwargs)
    assert ba is not None  # the route bound them
    with _core.TempFile(resolve_target(path)) as tmp:
        with open(os.dup(tmp.fd), "r+b", closefd=True) as f:
            ba.arguments["f"] = f
            result = original(*ba.args, **ba.kwargs)
            length = f.tell()
        tmp.commit(length)
    return result


def _torch_save(original: Callable[..., Any], args: tuple, kwargs: dict, options: Dict[str, Any]) -> None:
    target, why = torch_save_route(original, args, kwargs)
    if target is None:
        raise _Fallback(why)
    try:
        write_state_dict(target[0], target[1], **options)
    except SerializationError as e:  # raised before any file exists: torch.save may take it
        if e.torch_refuses and e.__cause__ is not None:
            # pickle's refusal, torch.save's too: raised as torch.save raises
            # it (the objects' pickling code, which may have side effects, is
            # not run a second time)
            raise e.__cause__ from None
        why = f"fastpersist cannot write it ({type(e).__name__})"
        raise _Fallback(why, lambda: _save_replacing(original, args, kwargs, target[1])) from None
    except WriteError as e:  # torch.save's I/O failures are RuntimeErrors
        raise _also(e, RuntimeError) from e


def _torch_load(original: Callable[..., Any], args: tuple, kwargs: dict, options: Dict[str, Any]) -> Any:
    call, why = _torch_load_route(original, args, kwargs)
    if call is None:
        raise _Fallback(why)
    try:
        return read_state_dict(
            call["path"], map_location=call["map_location"], weights_only=call["weights_only"], **_read(options)
        )
    except FastPersistError:  # a file fastpersist does not read, or a damaged one
        if _is_torchscript(call["path"]):
            raise _Fallback("a TorchScript archive") from None
        raise


def _save_file(original: Callable[..., Any], args: tuple, kwargs: dict, options: Dict[str, Any]) -> None:
    call, why = save_file_route(original, args, kwargs)
    if call is None:
        raise _Fallback(why)
    try:
        with file_mode(call["mode"]):
            write_state_dict(call["obj"], call["path"], format="safetensors", metadata=call["metadata"], **options)
    except (SerializationError, UnicodeEncodeError) as e:  # safetensors gives its own refusal
        raise _Fallback(f"fastpersist cannot write it ({type(e).__name__})") from None
    except WriteError as e:  # safetensors' I/O failures are SafetensorErrors
        from safetensors import SafetensorError

        raise _also(e, SafetensorError) from e


_ALSO: Dict[Tuple[type, type], type] = {}


def _also(e: WriteError, base: type) -> BaseException:
    """``e`` as an exception that is also a ``base``, the class the patched
    function raises for the same failure, so code that catches either
    catches it (a ``WriteError``, an ``OSError``, with its errno and file
    name, and a ``RuntimeError`` for torch.save)."""
    cls = _ALSO.get((type(e), base))
    if cls is None:
        cls = _ALSO[(type(e), base)] = type(type(e).__name__, (type(e), base), {"__module__": type(e).__module__})
    out: BaseException = cls(e.errno, e.strerror, e.filename) if e.errno is not None else cls(*e.args)
    return out


def _load_file(original: Callable[..., Any], args: tuple, kwargs: dict, options: Dict[str, Any]) -> Any:
    call, why = _load_file_route(original, args, kwargs)
    if call is None:
        raise _Fallback(why)
    try:
        return read_state_dict(call["path"], map_location=call["map_location"], **_read(options))
    except (CorruptCheckpointError, UnsupportedDtypeError) as e:  # safetensors gives its own error
        raise _Fallback(f"fastpersist cannot read it ({type(e).__name__})") from None


def _read(options: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in options.items() if k in ("direct", "io_uring")}


# --- installing the wrappers -------------------------------------------------------------------------

_lock = threading.RLock()
#: Active patches, oldest first; the newest one's options are used.
_active: List[Patch] = []
#: (module, attribute, original, wrapper) while installed.
_installed: List[Tuple[Any, str, Any, Any]] = []
_local = threading.local()


def _targets() -> List[Tuple[Any, str, str, Callable[..., Any]]]:
    out: List[Tuple[Any, str, str, Callable[..., Any]]] = [
        (torch, "save", "torch.save", _torch_save),
        (torch.serialization, "save", "torch.save", _torch_save),
        (torch, "load", "torch.load", _torch_load),
        (torch.serialization, "load", "torch.load", _torch_load),
    ]
    try:
        import safetensors.torch as st
    except ImportError:
        return out
    return [
        *out,
        (st, "save_file", "safetensors.torch.save_file", _save_file),
        (st, "load_file", "safetensors.torch.load_file", _load_file),
    ]


def _count(name: str, why: Optional[str]) -> None:
    with _lock:
        for p in _active:
            if why is None:
                p.stats.routed_calls[name] += 1
            else:
                p.stats.fallback_calls[name] += 1
                p.stats.reasons[f"{name}: {why}"] += 1


def _wrap(name: str, original: Callable[..., Any], route: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _lock:
            options = dict(_active[-1].options) if _active else None
        if options is None or getattr(_local, "busy", False):
            return original(*args, **kwargs)
        _local.busy = True
        try:
            result = route(original, args, kwargs, options)
        except _Fallback as e:
            why, call = e.why, e.call
        except BaseException:
            _count(name, None)  # carried out by fastpersist, and failed there
            raise
        else:
            _count(name, None)
            return result
        finally:
            _local.busy = False
        _count(name, why)
        return original(*args, **kwargs) if call is None else call()

    wrapper.__fastpersist_original__ = original  # type: ignore[attr-defined]
    return wrapper


def _install() -> None:
    made: Dict[int, Any] = {}
    for module, attr, name, route in _targets():
        current = getattr(module, attr)
        if id(current) not in made:  # torch.save is torch.serialization.save: one wrapper
            made[id(current)] = _wrap(name, current, route)
        setattr(module, attr, made[id(current)])
        _installed.append((module, attr, current, made[id(current)]))


def _uninstall() -> None:
    while _installed:
        module, attr, original, wrapper = _installed.pop()
        # Patched again on top of ours (a mock): left alone; ours then calls through.
        if getattr(module, attr) is wrapper:
            setattr(module, attr, original)


class Patch:
    """An active routing of torch's and safetensors' save/load functions
    through fastpersist (see :func:`patch`). ``undo()`` ends it (again:
    nothing); as a context manager it ends at the block's exit, whatever
    the exit, and ``with`` gives its :class:`PatchStats`."""

    def __init__(self, options: Dict[str, Any]) -> None:
        EngineOptions.given("fastpersist.patch()", options)  # bad options fail here, not at the first save
        self.options = dict(options)
        #: What this patch routed and passed on while it was active.
        self.stats = PatchStats()

    @property
    def active(self) -> bool:
        with _lock:
            return self in _active

    def start(self) -> Patch:
        """Make the patch active (again); returns it."""
        with _lock:
            if self not in _active:
                if not _active:
                    _install()
                _active.append(self)
        return self

    def undo(self) -> None:
        """End the patch; the original functions are back once no patch is active."""
        with _lock:
            if self in _active:
                _active.remove(self)
                if not _active:
                    _uninstall()

    def __enter__(self) -> PatchStats:
        self.start()
        return self.stats

    def __exit__(self, *exc: Any) -> None:
        self.undo()

    def __repr__(self) -> str:
        s, state = self.stats, "active" if self.active else "undone"
        return f"<fastpersist.Patch {state}: {s.routed} routed, {s.fallbacks} fallbacks>"


def patch(**options: Any) -> Patch:
    """Route ``torch.save``, ``torch.load`` and safetensors' ``save_file`` and
    ``load_file`` through fastpersist, from now until ``undo()`` or the end
    of a ``with`` block::

        with fastpersist.patch() as stats:
            trainer.train()                 # its torch.save calls write through fastpersist
        print(stats.routed, stats.fallbacks, stats.reasons)

        p = fastpersist.patch()
        ...
        p.undo()

    ``options`` are :func:`~fastpersist.write_state_dict`'s engine options
    (``durable``, ``direct``, ...; ``direct`` and ``io_uring`` also for
    loads). Calls fastpersist cannot carry out exactly as the original
    (file objects, ``mmap=True``, custom pickle modules, the legacy format,
    other arguments) go to the original function."""
    return Patch(options).start()


# The routing decisions of torch.load and load_file, shared with the framework adapters' loaders
# (fastpersist.integrations.common), as torch_save_route is with their savers.
torch_load_route = _torch_load_route
load_file_route = _load_file_route
__all__ += ["torch_load_route", "load_file_route"]
