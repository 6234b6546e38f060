"""What the framework adapters share.

* :class:`BackgroundSaves`: saves started through :func:`fastpersist.save_async`
  that return once the tensors may change (the snapshot phase), grouped into
  checkpoints (:meth:`BackgroundSaves.commit`: one file, or a folder of
  files with a ``finalize`` step run once all of them are durable), with
  defined points where a failed save surfaces (:meth:`~BackgroundSaves.check`
  without waiting, :meth:`~BackgroundSaves.wait` after waiting).
* :meth:`BackgroundSaves.prepare`: the snapshot staging buffers of a
  checkpoint's files made ahead of its first save (in the background), so
  that save blocks no longer than later ones; :func:`after_first_step`
  defers it to an optimizer's first step, when its state exists.
* :func:`sync_tree`: fsync every file of a folder written by a framework's
  own code (configs, JSON), then the folders: a folder checkpoint is durable
  as a whole.
* :func:`routed`: replace, for the length of one call, the names a
  framework's module saves or loads through (``torch``, ``safe_save_file``,
  ``safe_load_file``) with ones that go through fastpersist
  (:func:`torch_save_via`, :func:`safe_save_file_via`,
  :func:`torch_load_via`, :func:`safe_load_file_via`). A name that is
  missing means a framework version outside the tested range: a clear
  error, never a silent miss.
* CRC32 sidecar (:func:`write_crc_sidecar`): safetensors has no checksums,
  so a folder checkpoint records the CRC32 of every tensor of its
  safetensors files (computed while they were written) in
  ``fastpersist.crc32.json``; :func:`safe_load_file_via` checks them on
  load and raises :class:`~fastpersist.CorruptCheckpointError` naming the
  file and tensor. Torch zip files carry their own CRCs, checked by
  :func:`~fastpersist.read_state_dict`.

No framework is imported here.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import os
import threading
import types
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch

from .. import _core
from ..async_save import MODES, AsyncSaver, CheckpointFuture, check_max_pending, future_error
from ..errors import CorruptCheckpointError
from ..options import EngineOptions, WriteStats, file_mode, fsync_dir, parse_json
from ..patching import load_file_route, save_file_route, torch_load_route, torch_save_route
from ..reader import detect_format, read_state_dict
from ..writer import write_state_dict

__all__ = [
    "BackgroundSaves",
    "PendingCheckpoint",
    "IntegrationError",
    "sync_tree",
    "fsync_dir",
    "routed",
    "torch_save_via",
    "safe_save_file_via",
    "torch_load_via",
    "torch_module_via",
    "safe_load_file_via",
    "module_with",
    "write_crc_sidecar",
    "CRC_SIDECAR",
    "check_version",
    "PREPARE_MARGIN",
    "tensors_in",
    "optimizers_have_state",
    "after_first_step",
    "never_raises",
]

log = logging.getLogger("fastpersist")


class IntegrationError(RuntimeError):
    """A framework adapter cannot work with the installed framework version."""


def check_version(framework: str, version: str, tested: str, missing: List[str]) -> None:
    """Raise :class:`IntegrationError` naming what is missing from
    ``framework`` (its internals this adapter relies on), the installed
    version and the tested range."""
    if missing:
        raise IntegrationError(
            f"fastpersist's {framework} adapter needs {', '.join(missing)}, which {framework} {version} "
            f"does not have; it is tested with {framework} {tested} (pip install 'fastpersist[{framework}]')"
        )


class PendingCheckpoint:
    """The saves of one checkpoint. :meth:`result` waits for them and
    raises the first failure; when they all commit, ``finalize`` (if any)
    runs once, on a thread of its own that is not a daemon, so an exiting
    interpreter still finishes it. With ``with_stats``, ``finalize`` is
    called with the :class:`~fastpersist.WriteStats` of every save."""

    def __init__(
        self,
        name: str,
        futures: List[CheckpointFuture],
        finalize: Optional[Callable[..., None]],
        with_stats: bool = False,
    ) -> None:
        self.name = name
        self.futures = futures
        self._with_stats = with_stats
        self._error: Optional[BaseException] = None
        self._done = threading.Event()
        if finalize is None:
            self._finalize = None
            self._thread = None
        else:
            self._finalize = finalize
            self._thread = threading.Thread(target=self._run, name="fastpersist-commit", daemon=False)
            self._thread.start()

    def _wait_saves(self) -> Optional[BaseException]:
        first: Optional[BaseException] = None
        for f in self.futures:
            e = future_error(f)
            if e is not None and first is None:
                first = e
            elif e is not None:
                log.error("fastpersist: %s: %s was not saved either: %r", self.name, f.path, e)
        return first

    def _run(self) -> None:
        try:
            self._error = self._wait_saves()
            if self._error is None and self._finalize is not None:
                if self._with_stats:
                    self._finalize([f.result() for f in self.futures])
                else:
                    self._finalize()
        except BaseException as e:  # noqa: BLE001 - reported by result()
            self._error = e
        finally:
            self._done.set()

    def done(self) -> bool:
        if self._thread is None:
            return all(f.done() for f in self.futures)
        return self._done.is_set()

    def error(self) -> Optional[BaseException]:
        """Wait until the checkpoint is committed; why it was not, or None.
        What interrupts the wait (Ctrl-C) is raised: it is not the
        checkpoint's outcome."""
        if self._thread is None:
            return self._wait_saves()
        self._done.wait()
        return self._error

    def result(self) -> None:
        """Wait until the checkpoint is committed; raise why it was not."""
        err = self.error()
        if err is not None:
            raise err


class BackgroundSaves:
    """Background saves for an adapter, grouped into checkpoints.

    ``mode`` is that of :func:`~fastpersist.save_async`; with
    ``async_save=False`` every save is synchronous (:func:`write_state_dict`).
    ``max_pending`` bounds saves between their call and their commit (and so
    snapshot memory). ``engine_options`` are those of
    :func:`~fastpersist.write_state_dict`, checked here (``what``: the
    adapter call they were given to, named by the error for one it does not
    take).
    """

    def __init__(
        self,
        mode: str = "snapshot",
        *,
        async_save: bool = True,
        max_pending: int = 2,
        what: str = "fastpersist",
        **engine_options: Any,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        if not isinstance(async_save, bool):
            raise TypeError(f"async_save must be True or False, not {async_save!r}")
        check_max_pending(max_pending)  # here, not at the first save (the saver is made then)
        EngineOptions.given(what, engine_options)  # bad options fail here, not at the first save
        self.mode = mode
        self.async_save = async_save
        self.max_pending = max_pending
        self.options = dict(engine_options)
        #: Saves routed to ``torch.save`` because fastpersist cannot take them (file objects, custom picklers).
        self.fallbacks = 0
        self._saver: Optional[AsyncSaver] = None
        self._lock = threading.Lock()
        self._current: List[CheckpointFuture] = []
        self._pending: List[PendingCheckpoint] = []

    def _get_saver(self) -> AsyncSaver:
        with self._lock:
            if self._saver is None:
                self._saver = AsyncSaver(max_pending=self.max_pending)
            return self._saver

    def prepare(self, files: Sequence[Any], *, background: bool = True) -> Optional[concurrent.futures.Future]:
        """Make the staging buffers for a checkpoint whose files hold
        ``files`` (one object per file saved together) now, ahead of the
        first save, so that save blocks no longer than later ones
        (:meth:`~fastpersist.AsyncSaver.prepare_many`). Only the tensors'
        sizes count, each file with :data:`PREPARE_MARGIN` bytes of room
        for the small tensors a framework adds; a later state that is
        bigger is saved all the same (its snapshot makes its own buffer).
        Nothing to do (None) unless saves are asynchronous snapshots.
        With ``background`` (default) the buffers are made on the
        snapshot thread, ahead of any save, and a failure is logged, not
        raised: what is saved never depends on it."""
        if not self.async_save or self.mode != "snapshot":
            return None
        margin = torch.empty(PREPARE_MARGIN, dtype=torch.uint8)
        sizing = [tensors_in(f) + [margin] for f in files]
        fut = self._get_saver().prepare_many(sizing, background=background)
        if fut is not None:
            fut.add_done_callback(_log_prepare_failure)
        return fut

    def save(
        self,
        obj: Any,
        path: Any,
        *,
        format: str = "torch",
        metadata: Optional[Dict[str, str]] = None,
        fence: bool = True,
    ) -> None:
        """Save ``obj`` to ``path``; returns once its tensors may change
        (with ``fence=False`` at once: the caller must not change them before
        the checkpoint's :meth:`PendingCheckpoint.result`). An error found
        before that point is raised here; later ones at the commit. The save
        belongs to the checkpoint :meth:`commit` closes."""
        opts = dict(self.options)
        if format != "torch":
            opts["format"] = format
        if metadata is not None:
            opts["metadata"] = metadata
        if not self.async_save:
            stats = write_state_dict(obj, path, **opts)
            done = CheckpointFuture(stats.path, "sync")
            done._succeed(stats)  # its stats reach the checkpoint's finalize like those of background saves
            with self._lock:
                self._current.append(done)
            return
        fut = self._get_saver().save(obj, path, mode=self.mode, **opts)
        with self._lock:
            self._current.append(fut)
        if fence:
            try:
                fut.wait_snapshot()  # raises a failure of the snapshot phase (nothing is written then)
            except BaseException:
                with self._lock:
                    if fut in self._current:
                        self._current.remove(fut)  # reported here, not again at the commit
                raise

    def commit(
        self, name: str, finalize: Optional[Callable[..., None]] = None, *, with_stats: bool = False
    ) -> PendingCheckpoint:
        """Close the checkpoint made of the saves since the last commit;
        ``finalize`` runs once they are all durable (in the background),
        with their :class:`~fastpersist.WriteStats` if ``with_stats``."""
        with self._lock:
            futures, self._current = self._current, []
        pending = PendingCheckpoint(name, futures, finalize, with_stats)
        with self._lock:
            self._pending.append(pending)
        return pending

    def reopen(self, pending: PendingCheckpoint) -> None:
        """Take back the commit of ``pending`` (one with no ``finalize``),
        whose caller was interrupted before it had its outcome: its saves
        are the checkpoint not yet committed again."""
        if pending._thread is not None:
            raise ValueError("a checkpoint with a finalize step cannot be reopened")
        with self._lock:
            self._pending = [p for p in self._pending if p is not pending]
            self._current[:0] = pending.futures

    def reported(self, pending: PendingCheckpoint) -> None:
        """``pending``'s outcome was reported by its caller (its result
        waited for and raised there): :meth:`check` and :meth:`wait` do
        not raise it again."""
        with self._lock:
            self._pending = [p for p in self._pending if p is not pending]

    def fence(self) -> None:
        """Wait until the saves not yet committed have all finished their
        snapshot phase (every byte copied, or streamed out of the live
        tensors in ``"pipelined"`` mode): the tensors may change after it.
        Raises nothing: a failed save is reported at its commit."""
        with self._lock:
            current = list(self._current)
        for f in current:
            try:
                f.wait_snapshot()
            except Exception:  # noqa: BLE001 - reported by the commit, the defined point
                pass

    def settle(self) -> None:
        """Wait until every save not yet committed has finished (durable,
        or failed); raises nothing (a failure is reported at its commit)."""
        with self._lock:
            current = list(self._current)
        concurrent.futures.wait(current)

    def settled(self) -> bool:
        """Whether every save not yet committed has finished (durable, or
        failed), so a :meth:`commit` now would not wait."""
        with self._lock:
            return all(f.done() for f in self._current)

    def in_flight(self) -> int:
        """Checkpoints not yet committed (and not yet reported)."""
        with self._lock:
            return len(self._pending) + (1 if self._current else 0)

    def check(self) -> None:
        """Raise the error of a checkpoint that failed, without waiting
        for those still in flight. Each failure is raised once."""
        with self._lock:
            finished = [p for p in self._pending if p.done()]
            self._pending = [p for p in self._pending if not p.done()]
        self._raise_first(finished)

    def wait(self) -> None:
        """Wait for every checkpoint in flight (saves not yet grouped by a
        :meth:`commit` are committed as one); raise the first failure."""
        if self._current:
            self.commit("checkpoint")
        with self._lock:
            pending, self._pending = self._pending, []
        self._raise_first(pending)

    def _raise_first(self, pending: List[PendingCheckpoint]) -> None:
        """Wait for ``pending``; raise the first failure (the rest logged).
        A wait interrupted (Ctrl-C) puts back those not waited for, and a
        failure not raised yet: a later :meth:`wait` still waits for them
        and raises their failures."""
        first: Optional[BaseException] = None
        first_at = 0
        for i, p in enumerate(pending):
            try:
                e = p.error()
            except BaseException:
                with self._lock:
                    self._pending[:0] = pending[first_at if first is not None else i :]
                raise
            if e is None:
                continue
            if first is None:
                first, first_at = e, i
            else:
                log.error("fastpersist: checkpoint %s failed too: %r", p.name, e)
        if first is not None:
            raise first

    def close(self) -> None:
        """Wait for everything (raising a failure), then end the threads."""
        try:
            self.wait()
        finally:
            with self._lock:
                saver, self._saver = self._saver, None
            if saver is not None:
                saver.close()


#: Room for small tensors a framework adds to a file (counters, RNG state,
#: metrics) beyond those :meth:`BackgroundSaves.prepare` is shown.
PREPARE_MARGIN = 64 << 10


def _log_prepare_failure(fut: concurrent.futures.Future) -> None:
    e = future_error(fut)
    if e is not None:
        log.warning("fastpersist: the staging buffers could not be made ahead of the first save (%r)", e)


def tensors_in(obj: Any) -> List[torch.Tensor]:
    """The tensors in ``obj``'s dicts, lists and tuples (nested), collected
    on the calling thread: a list that a background thread may read while
    the containers change."""
    out: List[torch.Tensor] = []
    stack = [obj]
    seen = set()
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif isinstance(o, (dict, list, tuple)):
            if id(o) in seen:
                continue
            seen.add(id(o))
            stack.extend(o.values() if isinstance(o, dict) else o)
    return out


def _torch_optimizer(opt: Any) -> Optional[torch.optim.Optimizer]:
    """The innermost ``torch.optim.Optimizer`` of a framework's wrappers (``.optimizer``), or None."""
    found: Optional[torch.optim.Optimizer] = None
    for _ in range(8):  # the innermost: a wrapper's step() may run no hooks of its own
        if isinstance(opt, torch.optim.Optimizer):
            found = opt
        inner = getattr(opt, "optimizer", None)
        if inner is None or inner is opt:
            break
        opt = inner
    return found


def optimizers_have_state(optimizers: Sequence[Any]) -> bool:
    """Whether every optimizer has its state (torch optimizers make it at
    their first step; a checkpoint made before then is smaller than later ones)."""
    for opt in optimizers:
        inner = _torch_optimizer(opt)
        if inner is not None and any(len(g["params"]) for g in inner.param_groups) and not inner.state:
            return False
    return True


def never_raises(what: str, fn: Callable[[], None]) -> None:
    """Run ``fn`` (making staging buffers ahead of time, a sizing hint);
    a failure is logged as a warning, never raised into the training loop."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - a hint never stops training
        log.warning("fastpersist: %s failed: %r (the first save makes its buffer instead)", what, e)


def after_first_step(optimizers: Sequence[Any], fn: Callable[[], None]) -> Callable[[], None]:
    """Call ``fn`` once, on the training thread, right after the first
    ``step()`` of any of ``optimizers`` (torch's step post-hooks, removed
    once it ran). Returns a function that removes them without calling ``fn``."""
    handles: List[Any] = []
    fired = threading.Lock()

    def remove() -> None:
        for h in handles:
            h.remove()
        handles.clear()

    def hook(*_: Any) -> None:
        if not fired.acquire(blocking=False):
            return
        remove()
        never_raises("preparing the snapshot buffers", fn)

    for opt in optimizers:
        inner = _torch_optimizer(opt)
        if inner is not None:
            handles.append(inner.register_step_post_hook(hook))
    return remove


def sync_tree(root: str) -> None:
    """Make ``root`` and everything under it durable: every regular file
    (whoever wrote it), every folder, and ``root``'s entry in its parent."""
    for dirpath, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            p = os.path.join(dirpath, name)
            if os.path.islink(p) or not os.path.isfile(p):
                continue
            fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)
    fsync_dir(os.path.dirname(os.path.abspath(root)) or ".")


def torch_save_via(saves: BackgroundSaves) -> Callable[..., None]:
    """A ``torch.save`` that writes paths through ``saves``; what
    fastpersist cannot write as torch.save would (a file object, a custom
    pickler, :func:`fastpersist.patching.torch_save_route`) goes to the real
    ``torch.save`` (counted in ``saves.fallbacks``)."""
    real = torch.save

    def save(*args: Any, **kwargs: Any) -> None:
        target, _ = torch_save_route(real, args, kwargs)  # the decision fastpersist.patch() makes
        if target is not None:
            saves.save(*target)
            return
        saves.fallbacks += 1
        real(*args, **kwargs)

    return save


def safe_save_file_via(saves: BackgroundSaves) -> Callable[..., None]:
    """A ``safetensors.torch.save_file`` that writes paths through ``saves``,
    leaving what safetensors leaves (a new file of its mode: the decision
    :func:`fastpersist.patching.save_file_route` makes); anything else (a
    link or special file at the path, tensors safetensors refuses) goes to
    the real ``save_file`` (counted in ``saves.fallbacks``)."""
    import safetensors.torch

    real = safetensors.torch.save_file

    def save_file(tensors: Dict[str, torch.Tensor], filename: Any, metadata: Optional[Dict[str, str]] = None) -> None:
        call, _ = save_file_route(real, (tensors, filename), {"metadata": metadata})
        if call is None:
            saves.fallbacks += 1
            real(tensors, filename, metadata=metadata)
            return
        with file_mode(call["mode"]):  # carried to the background save's threads
            saves.save(call["obj"], call["path"], format="safetensors", metadata=call["metadata"])

    return save_file


class _ModuleWith(types.ModuleType):
    """A module as one framework module sees it, with some names of its own."""

    def __init__(self, real: types.ModuleType, names: Dict[str, Any]) -> None:
        super().__init__(real.__name__)
        self._real = real
        for n, v in names.items():
            setattr(self, n, v)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def module_with(real: types.ModuleType, **names: Any) -> types.ModuleType:
    """A stand-in for ``real`` (as a framework module's global) whose
    ``names`` are the given ones; everything else is ``real``'s."""
    return _ModuleWith(real, names)


def torch_module_via(saves: Optional[BackgroundSaves] = None, *, load: bool = False) -> types.ModuleType:
    """A stand-in for a module's ``torch`` global whose ``save`` writes
    through ``saves`` (if given) and whose ``load`` reads through
    fastpersist (if ``load``); everything else is torch's."""
    names: Dict[str, Any] = {}
    if saves is not None:
        names["save"] = torch_save_via(saves)
    if load:
        names["load"] = torch_load_via()
    return module_with(torch, **names)


def torch_load_via() -> Callable[..., Any]:
    """A ``torch.load`` that reads paths of torch zip files with
    :func:`~fastpersist.read_state_dict`, every record's CRC32 checked: a
    damaged file raises :class:`~fastpersist.CorruptCheckpointError` naming
    it, never loads. Calls it cannot take as torch.load would (file
    objects, ``mmap=True``, custom pickle modules, legacy files:
    :func:`fastpersist.patch`'s decision) go to the real ``torch.load``."""
    real = torch.load

    def load(*args: Any, **kwargs: Any) -> Any:
        call, why = torch_load_route(real, args, kwargs)
        if call is None:
            log.debug("fastpersist: torch.load left to torch (%s)", why)
            return real(*args, **kwargs)
        return read_state_dict(call["path"], map_location=call["map_location"], weights_only=call["weights_only"])

    return load


#: The CRC32 sidecar of a folder checkpoint's safetensors files.
CRC_SIDECAR = "fastpersist.crc32.json"
_SIDECAR_FORMAT = "fastpersist.safetensors.crc32"


def write_crc_sidecar(folder: str, stats: List[WriteStats]) -> Optional[str]:
    """Record, durably, the CRC32 of every tensor of the safetensors files
    among ``stats`` that lie in ``folder`` (by name), in
    ``folder/fastpersist.crc32.json``. Returns its path, or None when
    there are no such files."""
    root = os.path.abspath(folder)
    files: Dict[str, Any] = {}
    for st in stats:
        p = os.path.abspath(st.path)
        if os.path.dirname(p) != root or not p.endswith(".safetensors"):
            continue
        files[os.path.basename(p)] = {"bytes": st.bytes, "crc32": dict(st.crc32)}
    if not files:
        return None
    out = os.path.join(root, CRC_SIDECAR)
    body = json.dumps({"format": _SIDECAR_FORMAT, "version": 1, "files": files}, indent=1, sort_keys=True)
    _core.atomic_write(out, body.encode())
    return out


def _sidecar_entry(path: str) -> Optional[Dict[str, Any]]:
    """The record of ``path`` in the CRC32 sidecar of its folder; None if
    there is no sidecar or it does not list the file."""
    path = os.path.abspath(path)
    side = os.path.join(os.path.dirname(path), CRC_SIDECAR)
    try:
        with open(side, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    try:
        doc = parse_json(raw)
        files = doc["files"] if doc.get("format") == _SIDECAR_FORMAT else None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptCheckpointError(f"{side}: not a readable fastpersist CRC32 sidecar ({e})") from None
    if not isinstance(files, dict):
        raise CorruptCheckpointError(f"{side}: not a fastpersist CRC32 sidecar")
    entry = files.get(os.path.basename(path))
    if entry is not None and not isinstance(entry, dict):
        raise CorruptCheckpointError(f"{side}: the entry of {os.path.basename(path)!r} is malformed")
    return entry


def check_safetensors_crcs(path: str, tensors: Dict[str, torch.Tensor], entry: Dict[str, Any]) -> None:
    """Compare the tensors read from ``path`` (on the CPU) with the CRC32s
    the sidecar ``entry`` recorded; raise
    :class:`~fastpersist.CorruptCheckpointError` naming the file and
    tensor on any difference."""
    try:
        want: Dict[str, int] = {str(k): int(v) for k, v in entry["crc32"].items()}
        size = int(entry["bytes"])
    except (KeyError, TypeError, ValueError, AttributeError):
        raise CorruptCheckpointError(f"{path}: its entry in {CRC_SIDECAR} is malformed") from None
    got_size = os.path.getsize(path)
    if got_size != size:
        raise CorruptCheckpointError(f"{path}: {got_size} bytes, {size} when written ({CRC_SIDECAR})")
    if set(want) != set(tensors):
        odd = sorted(set(want) ^ set(tensors))[:5]
        raise CorruptCheckpointError(f"{path}: its tensors differ from those written ({CRC_SIDECAR}): {odd}")
    names = list(tensors)
    ranges = []
    for n in names:
        t = tensors[n]
        ranges.append((t.data_ptr(), t.numel() * t.element_size(), -1))
    for n, crc in zip(names, _core.crc32_ranges(ranges)):
        if crc != want[n]:
            raise CorruptCheckpointError(
                f"{path}: tensor {n!r} fails its CRC32 check (recorded {want[n]:08x}, data has {crc:08x})"
            )


def safe_load_file_via() -> Callable[..., Dict[str, torch.Tensor]]:
    """A ``safetensors.torch.load_file`` that reads with
    :func:`~fastpersist.read_state_dict`; a file a CRC32 sidecar lists
    (:data:`CRC_SIDECAR`) is checked against it, and any damage raises
    :class:`~fastpersist.CorruptCheckpointError` naming the file. Other
    files are read as :func:`fastpersist.patch` reads them (calls it cannot
    take go to safetensors)."""
    from safetensors.torch import load_file as real

    def load_file(*args: Any, **kwargs: Any) -> Dict[str, torch.Tensor]:
        call, why = load_file_route(real, args, kwargs)
        path = call["path"] if call is not None else None
        given = args[0] if args else kwargs.get("filename")
        if path is None and isinstance(given, (str, os.PathLike)) and os.path.isfile(given):
            path = os.fspath(given)
        entry = _sidecar_entry(path) if path is not None else None
        if entry is not None and path is not None:
            if detect_format(path) != "safetensors":
                raise CorruptCheckpointError(f"{path}: not a safetensors file any more ({CRC_SIDECAR} lists it)")
            out: Dict[str, torch.Tensor] = read_state_dict(path)
            check_safetensors_crcs(path, out, entry)
            device = call["map_location"] if call is not None else kwargs.get("device", "cpu")
            if str(device) != "cpu":
                out = {k: v.to(device) for k, v in out.items()}
            return out
        if call is None:
            log.debug("fastpersist: load_file left to safetensors (%s)", why)
            return real(*args, **kwargs)
        loaded: Dict[str, torch.Tensor] = read_state_dict(call["path"], map_location=call["map_location"])
        return loaded

    return load_file


@contextlib.contextmanager
def routed(module: types.ModuleType, **names: Any) -> Iterator[None]:
    """Within the block, ``module.<name>`` is ``names[name]``. Not for
    concurrent use of the same module from other threads."""
    old = {n: getattr(module, n) for n in names}
    try:
        for n, v in names.items():
            setattr(module, n, v)
        yield
    finally:
        for n, v in old.items():
            setattr(module, n, v)
