"""DeepSpeed: a checkpoint engine.

Selected from the DeepSpeed config (a ``"fastpersist"`` section, read by
:func:`initialize`, a drop-in for ``deepspeed.initialize``)::

    config = {..., "fastpersist": {"mode": "snapshot", "decoupled": true}}
    engine, optimizer, _, _ = fastpersist.integrations.deepspeed.initialize(model=model, config=config, ...)

or set on an engine: ``use_fastpersist(engine, mode="pipelined")``.

:class:`FastPersistCheckpointEngine` implements DeepSpeed's
``CheckpointEngine`` (``create``, ``save``, ``load``, ``commit``):

* ``save`` starts a background save and returns once the tensors may change
  (``mode="snapshot"``: copied into reusable host buffers), or at once
  (``mode="pipelined"``: the live tensors are streamed out while the next
  forward and backward run; nothing may change them before the commit,
  which holds for parameters and optimizer state, not for tensors that a
  forward pass updates in place such as BatchNorm's running statistics).
* ``commit`` is where every file of the tag is durable: it waits for the
  tag's saves, then all ranks agree (a failure on any rank raises
  :class:`fastpersist.DistributedCheckpointError` on every rank), then rank 0
  writes ``latest`` atomically and durably. DeepSpeed writes ``latest``
  only after ``commit`` returns, so ``latest`` never names a tag that is not
  durable. A failed save raises its error from ``commit``. A save that
  fails before its file is written (an unpicklable ``client_state``, say),
  or a ``save_checkpoint`` that raises part way, has raised already: its
  tag is dropped, never committed (its commit writes no ``latest``, and
  tells DeepSpeed to write none; with several ranks, every rank raises
  :class:`fastpersist.DistributedCheckpointError` there instead).
* ``decoupled=True`` (default): ``save_checkpoint`` returns without waiting
  for the disk and training goes on while the tag is written. DeepSpeed
  asks for the pending checkpoint (``get_commit_info``) in every
  ``engine.step()`` just before the optimizer step; that is the fence:
  it waits until every save of the tag has finished its snapshot phase
  (``"pipelined"``: every byte streamed out of the live tensors, which
  the optimizer step then updates in place; each tensor's version counter
  is checked too, so an in-place change made before the fence, by a
  forward pass for instance, fails the save rather than writing a mix).
  The durable part (fsync, rename) goes on across optimizer steps: the tag
  is handed to DeepSpeed for ``commit`` (and its ``latest``) at the first
  step at which every rank's saves are done, so ``commit`` does not wait
  for the disk and ``latest`` still names only durable tags. The next
  ``save_checkpoint`` and ``engine.destroy()`` (or
  :meth:`~FastPersistCheckpointEngine.cleanup`) commit a tag still pending,
  waiting for it; so does ``load_checkpoint`` before it reads ``latest``
  (on an engine set up by :func:`use_fastpersist` or :func:`initialize`),
  so a tag saved just before is the one loaded, and so does the
  interpreter's exit (a script that saves at its end and exits without
  ``destroy()``: its last tag is committed then; with several ranks, only
  while the process group is still up). With ``decoupled=False``,
  ``save_checkpoint`` commits before it returns.
* In ``"snapshot"`` mode the host buffers this rank's files are copied
  into are made ahead of the first checkpoint, in the background
  (:meth:`FastPersistCheckpointEngine.prepare_for`, called by
  :func:`use_fastpersist` and :func:`initialize`): right after the
  optimizer's first step (its state exists from then on; at once if it
  has it already). ``"prepare": false`` turns it off.
* ``load`` reads with :func:`fastpersist.read_state_dict` (checksums
  verified; DeepSpeed checkpoints hold Python objects, so
  ``weights_only=False``: load only checkpoints you trust); files in
  torch's legacy (non-zip) format, which DeepSpeed's default engine
  writes, are read with ``torch.load``.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import weakref
from typing import Any, Callable, Dict, List, Optional

from .. import _core
from ..async_save import future_error
from ..collectives import checkpoint_group, describe_error, fail_all, gather
from ..errors import CorruptCheckpointError
from ..options import make_dirs, put_marker, remove_durably
from ..reader import detect_format, read_state_dict
from .common import BackgroundSaves, after_first_step, check_version, never_raises, optimizers_have_state

__all__ = ["FastPersistCheckpointEngine", "use_fastpersist", "initialize", "CONFIG_KEY"]

#: DeepSpeed versions this adapter is tested with (the extra pins them).
TESTED = ">=0.19,<0.20"
#: The section of the DeepSpeed config that selects and configures this engine.
CONFIG_KEY = "fastpersist"
log = logging.getLogger("fastpersist")


def _base() -> type:
    import deepspeed

    try:
        from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine
    except ImportError:
        check_version("deepspeed", deepspeed.__version__, TESTED, ["checkpoint_engine.CheckpointCommitInfo"])
        raise
    needed = ("commit", "is_decoupled", "get_commit_info")
    missing = [f"CheckpointEngine.{n}" for n in needed if not hasattr(CheckpointEngine, n)]
    check_version("deepspeed", deepspeed.__version__, TESTED, missing)
    del CheckpointCommitInfo
    base: type = CheckpointEngine
    return base


def _section(config_params: Any) -> Dict[str, Any]:
    raw = getattr(config_params, "_param_dict", None) or {}
    sec = raw.get(CONFIG_KEY) or {}
    if not isinstance(sec, dict):
        raise ValueError(f"the DeepSpeed config's {CONFIG_KEY!r} section must be an object, not {sec!r}")
    return dict(sec)


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


#: What the files a failed save of a reused tag did write are renamed with
#: (:func:`_set_aside_torn`).
FAILED_SUFFIX = ".failed"


#: Marks a tag that ``latest`` names while this rank saves it again (a
#: tag reused from save to save): ``<marker>-<rank>`` in the folder of its
#: files, made before the first of them is replaced, removed once they are
#: all durable (or set aside). A process killed in between leaves it, and a
#: load of the tag's files is refused: they may mix two saves.
PENDING = ".fastpersist-save-pending"


def _names_latest(info: Any) -> bool:
    """Whether ``latest`` in ``info.save_dir`` names ``info.tag``."""
    try:
        with open(os.path.join(info.save_dir, "latest")) as f:
            return f.read().strip() == str(info.tag)
    except OSError:
        return False


def _set_aside_torn(info: Any, futures: List[Any]) -> None:
    """A save of ``info.tag`` failed. When ``latest`` names that very tag (a
    tag reused from save to save, such as ``"last"``), the files this rank's
    save did write are set aside (renamed ``<file>.failed``): the tag would
    otherwise mix new files with the old ones the failed saves did not
    replace (new model states, old optimizer states), and load without an
    error. Loading it now fails, naming the missing file, as it does after
    a failed torch.save in place; the files are kept for inspection: the
    newest failure's as ``<file>.failed``, the one before as
    ``<file>.failed-1`` (no more: a failure that recurs, a full disk, must
    not keep a copy of the tag per try)."""
    if not _names_latest(info):
        return  # a new tag: latest still names the previous one, which is whole
    for fut in futures:
        if not fut.done() or future_error(fut) is not None:
            continue
        aside = fut.path + FAILED_SUFFIX
        try:
            if os.path.lexists(aside):
                os.replace(aside, aside + "-1")  # (the failure before this one's; an older one goes)
            os.rename(fut.path, aside)
        except FileNotFoundError:
            continue
        except OSError as e:
            log.error("fastpersist: cannot set aside %s of the failed checkpoint %s: %s", fut.path, info.tag, e)
            continue
        log.error(
            "fastpersist: checkpoint %s (named by latest) failed part-way: %s is set aside as %s so the tag does "
            "not load mixed with its older files",
            info.tag,
            fut.path,
            aside,
        )


class FastPersistCheckpointEngine(_base()):  # type: ignore[misc]
    """A DeepSpeed ``CheckpointEngine`` that writes through fastpersist (see
    the module doc). Options come from the config's ``"fastpersist"``
    section, overridden by keyword arguments: ``mode`` (``"snapshot"``),
    ``decoupled`` (True), ``prepare`` (True: the snapshot buffers made
    ahead of the first checkpoint, see :meth:`prepare_for`), and engine
    options of :func:`fastpersist.write_state_dict`."""

    def __init__(
        self,
        config_params: Any = None,
        *,
        mode: Optional[str] = None,
        decoupled: Optional[bool] = None,
        prepare: Optional[bool] = None,
        **options: Any,
    ) -> None:
        super().__init__(config_params)
        sec = _section(config_params)
        sec_mode = sec.pop("mode", "snapshot")
        sec_decoupled = sec.pop("decoupled", True)
        sec_prepare = sec.pop("prepare", True)
        self.name = "FastPersistCheckpointEngine"
        self.mode = mode or sec_mode
        self.decoupled = bool(sec_decoupled if decoupled is None else decoupled)
        #: Make the snapshot buffers ahead of the first checkpoint (:meth:`prepare_for`).
        self.prepare_ahead = bool(sec_prepare if prepare is None else prepare)
        self.saves = BackgroundSaves(self.mode, max_pending=64, what=f"{type(self).__name__}()", **{**sec, **options})
        self.commit_info: Any = None
        #: Why the saves since the last commit cannot make a checkpoint (a save that raised), or None.
        self._dropped: Optional[str] = None
        #: The world size when the pending tag was created (its commit is collective if more than 1).
        self._world = 1
        self._disarm: Optional[Callable[[], None]] = None
        #: The pending tag reuses the one latest names (None: not known yet).
        self._reused: Optional[bool] = None
        #: This rank's markers (:data:`PENDING`) of the pending tag.
        self._markers: List[str] = []
        _engines.add(self)

    def prepare_for(self, engine: Any) -> None:
        """Make the host buffers that this rank's checkpoint files are
        snapshotted into now, in the background (``"snapshot"`` mode), so
        the first ``save_checkpoint`` blocks no longer than later ones: the
        model states file (on the rank that writes it: the module's and, without
        ZeRO, the optimizer's state) and the ZeRO optimizer states file. Now
        if the optimizer has its state, else right after its first step
        (torch's optimizers, also inside ZeRO, make it there). Only the sizes count: a later
        checkpoint that differs (``client_state``) is saved all the same.
        :func:`use_fastpersist` calls it unless ``prepare`` is False. Not
        for ZeRO stage 3, MoE and pipeline engines (gathered or per-layer
        state)."""
        if not self.prepare_ahead or self.mode != "snapshot" or self._disarm is not None:
            return
        if not _local_state(engine):
            return
        module = engine.module
        optimizer = getattr(engine, "optimizer", None)
        zero = bool(engine.zero_optimization())
        files: List[Callable[[], Any]] = []
        if getattr(engine, "save_non_zero_checkpoint", False):
            files.append(
                lambda: {
                    "module": module.state_dict(),
                    "optimizer": optimizer.state_dict() if optimizer is not None and not zero else None,
                }
            )
        if getattr(engine, "save_zero_checkpoint", False) and optimizer is not None:
            files.append(lambda: {"optimizer_state_dict": optimizer.state_dict()})
        if not files:
            return

        def prepare() -> None:
            self.saves.prepare([f() for f in files])

        optimizers = [optimizer] if optimizer is not None else []
        if optimizers_have_state(optimizers):
            self._disarm = _nothing
            prepare()
        else:
            self._disarm = after_first_step(optimizers, prepare)

    def create(self, info: Any) -> None:
        if self.commit_info is not None:  # a tag saved and never committed: commit it first
            self.commit(self.commit_info)
        self.commit_info = info
        self._reused = None
        dist = _dist()
        self._world = dist.get_world_size() if dist is not None else 1

    def drop_pending(self, why: str) -> None:
        """The tag being saved cannot be complete (``why``: a save of it
        raised): its commit writes no ``latest``. The first reason is kept."""
        if self._dropped is None:
            self._dropped = why

    def commit_pending(self) -> None:
        """Commit the tag still pending, if any, and (with several ranks)
        wait until every rank has: ``latest`` names it from then on."""
        if self.commit_info is None:
            return
        self.commit(self.commit_info)
        dist = _dist()
        if dist is not None and dist.get_world_size() > 1:
            gather(None, checkpoint_group(None))  # rank 0 has written latest before any rank reads it

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        if not exist_ok and os.path.exists(path):
            os.makedirs(path)  # FileExistsError, as os.makedirs raises it
        make_dirs(path)

    def _mark(self, path: str) -> None:
        """Before a file of a tag that ``latest`` names is replaced: mark
        its folder (:data:`PENDING`), durably, once per folder."""
        info = self.commit_info
        if info is None:
            return
        if self._reused is None:
            self._reused = _names_latest(info)
        folder = os.path.dirname(os.path.abspath(path))
        dist = _dist()
        marker = os.path.join(folder, f"{PENDING}-{dist.get_rank() if dist is not None else 0}")
        if not self._reused or marker in self._markers:
            return
        put_marker(marker)
        self._markers.append(marker)

    def _unmark(self) -> None:
        """The pending tag's files are durable, or set aside: its markers go."""
        markers, self._markers = self._markers, []
        for m in markers:
            try:
                remove_durably(m)
            except OSError as e:
                log.error("fastpersist: cannot remove %s: %s (loads of that tag are refused)", m, e)

    def save(self, state_dict: Any, path: str) -> None:
        self._mark(path)
        # Pipelined and decoupled: the fence is the commit, before the optimizer step.
        try:
            self.saves.save(state_dict, path, fence=not (self.decoupled and self.mode == "pipelined"))
        except BaseException as e:
            # Raised here, and dropped from the tag's saves: the tag must not be committed without it.
            self.drop_pending(f"the save of {path} failed ({describe_error(e)})")
            raise

    def load(self, path: str, map_location: Any = None) -> Any:
        if self.commit_info is not None:  # a tag saved and not yet committed: commit it first
            self.commit(self.commit_info)
        self.saves.wait()
        folder = os.path.dirname(os.path.abspath(path))
        try:
            torn = sorted(n for n in os.listdir(folder) if n.startswith(PENDING + "-"))
        except OSError:
            torn = []
        if torn:
            raise CorruptCheckpointError(
                f"{folder}: a save of this checkpoint did not finish ({torn[0]} is there: the process was killed "
                "while it replaced the files of a tag that latest named); its files may mix two saves. Load "
                "another tag, or remove the marker if the files are known to be whole"
            )
        try:
            detect_format(path)
        except CorruptCheckpointError:
            import torch

            return torch.load(path, map_location=map_location, weights_only=False)  # torch's legacy format
        return read_state_dict(path, map_location=map_location, weights_only=False)

    def commit(self, info: Any) -> bool:
        """Every file of ``info.tag`` is durable on every rank when this
        returns; then rank 0 has written ``latest`` (if ``info.save_latest``).
        Returns False, writing no ``latest``, for a tag dropped because one
        of its saves raised already (:meth:`drop_pending`)."""
        pending = self.saves.commit(str(info.tag))
        try:
            err = pending.error()  # (the saves' outcome: agreed on by all ranks below)
        except BaseException:
            # Interrupted while it waited (Ctrl-C): not the saves' outcome,
            # and no file of the tag is set aside for it. The tag stays
            # pending, as if this commit had not been called: the next one
            # (at exit, before a load, at engine.destroy()) waits for its
            # saves and decides.
            self.saves.reopen(pending)
            raise
        self.saves.reported(pending)  # raised here (or below), not again at the next load or cleanup
        self.commit_info = None
        dropped, self._dropped = self._dropped, None
        try:
            return self._agree(info, pending, err, dropped)
        finally:
            self._unmark()  # durable, or set aside: no load of the tag mixes two saves

    def _agree(self, info: Any, pending: Any, err: Optional[BaseException], dropped: Optional[str]) -> bool:
        """:meth:`commit` once this rank's saves of ``info`` are done (``err``:
        the first that failed; ``dropped``: why the tag cannot be whole)."""
        dist = _dist()
        if dist is not None and dist.get_world_size() > 1:
            mine = err if err is not None else dropped
            statuses = gather(describe_error(mine) if isinstance(mine, BaseException) else mine, checkpoint_group(None))
            try:
                fail_all(statuses, f"checkpoint {info.tag}")
            except BaseException as agreed:
                _set_aside_torn(info, pending.futures)
                raise agreed from err
        elif err is not None:
            _set_aside_torn(info, pending.futures)
            raise err
        if dropped is not None:
            # Its failure was raised where it happened (save_checkpoint); the training goes on.
            _set_aside_torn(info, pending.futures)
            log.error("fastpersist: checkpoint %s is not committed (%s); latest is left as it was", info.tag, dropped)
            info.save_latest = False  # nor may DeepSpeed write it
            return False
        if info.save_latest and (dist is None or dist.get_rank() == 0):
            _core.atomic_write(os.path.join(info.save_dir, "latest"), str(info.tag).encode(), durable=True)
        if self.decoupled:
            # DeepSpeed's engine writes ``latest`` after a decoupled commit by truncating and writing it in
            # place (a crash in between leaves it empty): it is written, atomically and durably, already.
            info.save_latest = False
        return True

    def is_decoupled(self) -> bool:
        return self.decoupled

    def get_commit_info(self) -> Any:
        """The pending tag, once it can be committed without waiting; else
        None. DeepSpeed calls this in ``engine.step()`` right before the
        optimizer step, so it is the fence: it first waits until every save
        of the tag has left the tensors (:meth:`BackgroundSaves.fence`)."""
        info = self.commit_info
        if info is None or not self.decoupled:
            return info
        self.saves.fence()
        ready = self.saves.settled()
        dist = _dist()
        if dist is not None and dist.get_world_size() > 1:
            ready = all(gather(ready, checkpoint_group(None)))  # every rank commits at the same step, or none
        return info if ready else None

    def cleanup(self) -> None:
        """Commit a checkpoint still pending (``engine.destroy()`` calls this)."""
        disarm, self._disarm = self._disarm, None
        if disarm is not None:
            disarm()
        if self.commit_info is not None:
            self.commit(self.commit_info)
        self.saves.wait()

    def _commit_at_exit(self) -> None:
        info = self.commit_info
        if info is None:
            return
        if self._world > 1 and _dist() is None:
            log.error(
                "fastpersist: checkpoint %s was saved and not committed: the process group is gone at exit, so "
                "the ranks cannot agree on it; latest is left as it was (call engine.destroy() before exiting)",
                info.tag,
            )
            return
        log.warning("fastpersist: committing checkpoint %s, still pending at exit", info.tag)
        self.commit(info)

    def preserves_storage_sharing(self) -> bool:
        return True  # torch.save's format: views keep sharing their storage


#: Every engine made, for the commit of a tag still pending at exit.
_engines: weakref.WeakSet[FastPersistCheckpointEngine] = weakref.WeakSet()


def _commit_pending_in(load_dir: str, loading: Optional[FastPersistCheckpointEngine]) -> None:
    """Before an engine reads ``latest`` in ``load_dir``: commit the tags
    other engines of this process still have pending there (an engine that
    saved, and another made to load what it saved): ``latest`` named the
    tag before, and the tag's folder is marked as a save in progress."""
    try:
        where = os.path.realpath(load_dir)
    except (OSError, ValueError):
        return
    for eng in list(_engines):
        info = eng.commit_info
        if eng is loading or info is None:
            continue
        try:
            same = os.path.realpath(info.save_dir) == where
        except (OSError, ValueError, AttributeError):
            same = False
        if same:
            eng.commit_pending()


@atexit.register
def _commit_at_exit() -> None:
    """Commit the tags still pending at exit (a script that saved at its end
    and exited without ``engine.destroy()``). Registered after the saves'
    own drain at exit (:mod:`fastpersist.async_save`), so it runs first,
    while they can still complete."""
    for eng in list(_engines):
        try:
            eng._commit_at_exit()
        except BaseException as e:  # noqa: BLE001 - at exit: reported, nothing to raise into
            log.error("fastpersist: a checkpoint pending at exit was NOT committed: %r", e)


def _wrap_engine(engine: Any) -> None:
    """``engine.load_checkpoint`` commits a pending tag before DeepSpeed
    reads ``latest``; a ``save_checkpoint`` that raises drops its tag
    (:meth:`FastPersistCheckpointEngine.drop_pending`). Once per engine,
    whatever checkpoint engine it has later."""
    if engine.__dict__.get("_fastpersist_wrapped"):
        return
    ref = weakref.ref(engine)  # no cycle through the engine's own attributes
    cls = type(engine)

    def ours() -> Optional[FastPersistCheckpointEngine]:
        eng = ref()
        ce = getattr(eng, "checkpoint_engine", None)
        return ce if isinstance(ce, FastPersistCheckpointEngine) else None

    real_load = engine.__dict__.get("load_checkpoint")
    real_save = engine.__dict__.get("save_checkpoint")

    @functools.wraps(cls.load_checkpoint)
    def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
        ce = ours()
        if ce is not None:
            ce.commit_pending()  # before DeepSpeed reads latest
        load_dir = args[0] if args else kwargs.get("load_dir")
        if isinstance(load_dir, (str, os.PathLike)):
            _commit_pending_in(os.fspath(load_dir), ce)
        if real_load is not None:
            return real_load(*args, **kwargs)
        return cls.load_checkpoint(ref(), *args, **kwargs)

    @functools.wraps(cls.save_checkpoint)
    def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
        ce = ours()
        before = ce.commit_info if ce is not None else None
        try:
            if real_save is not None:
                return real_save(*args, **kwargs)
            return cls.save_checkpoint(ref(), *args, **kwargs)
        except BaseException as e:
            ce = ours()
            if ce is not None and ce.commit_info is not None and ce.commit_info is not before:
                ce.drop_pending(f"save_checkpoint raised {describe_error(e)}")  # the tag this call made
            raise

    engine.load_checkpoint = load_checkpoint
    engine.save_checkpoint = save_checkpoint
    engine._fastpersist_wrapped = True


def use_fastpersist(engine: Any, **options: Any) -> FastPersistCheckpointEngine:
    """Make ``engine.save_checkpoint``/``load_checkpoint`` use fastpersist
    (options as for :class:`FastPersistCheckpointEngine`); in ``"snapshot"``
    mode the snapshot buffers are made ahead of the first checkpoint
    (:meth:`FastPersistCheckpointEngine.prepare_for`) unless ``prepare=False``
    (or ``"prepare": false`` in the config section). ``load_checkpoint``
    then commits a tag still pending before it reads ``latest``, and a
    ``save_checkpoint`` that raises leaves its tag uncommitted."""
    old = getattr(engine, "checkpoint_engine", None)
    if old is not None and old.is_decoupled():
        old.cleanup()
    new = FastPersistCheckpointEngine(getattr(engine, "_config", None), **options)
    engine.checkpoint_engine = new
    _wrap_engine(engine)
    never_raises("preparing the snapshot buffers", lambda: new.prepare_for(engine))
    return new


def _nothing() -> None:
    pass


def _local_state(engine: Any) -> bool:
    """Whether ``engine`` saves the local module's and optimizer's state
    dicts (ZeRO stages 0-2, no MoE, not a pipeline engine): its state dicts
    can then be sized on this rank alone, with no collective call."""
    base: Any = next((c for c in type(engine).__mro__ if c.__name__ == "DeepSpeedEngine"), None)
    if base is None or getattr(type(engine), "module_state_dict", None) is not base.module_state_dict:
        return False
    if getattr(engine, "has_moe_layers", False):
        return False
    return int(engine.zero_optimization_stage()) < 3


def initialize(*args: Any, **kwargs: Any) -> Any:
    """``deepspeed.initialize``, then :func:`use_fastpersist` when the config
    has a ``"fastpersist"`` section. Returns what ``deepspeed.initialize`` does."""
    import deepspeed

    out = deepspeed.initialize(*args, **kwargs)
    engine = out[0]
    if CONFIG_KEY in (getattr(engine._config, "_param_dict", None) or {}):
        use_fastpersist(engine)
    return out
