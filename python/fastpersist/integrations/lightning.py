"""Lightning: a ``CheckpointIO`` plugin.

>>> from fastpersist.integrations.lightning import FastPersistCheckpointIO
>>> trainer = Trainer(plugins=[FastPersistCheckpointIO()])  # doctest: +SKIP

or, from a LightningCLI config::

    trainer:
      plugins:
        - class_path: fastpersist.integrations.lightning.FastPersistCheckpointIO
          init_args: {mode: snapshot}

One class serves both import trees: it is a ``CheckpointIO`` of
``lightning`` (``lightning.fabric``) and of ``pytorch_lightning``
(``lightning_fabric``), whichever are installed.

* ``save_checkpoint`` returns once the tensors may change: in
  ``"snapshot"`` mode once they are copied into reusable host buffers (on
  fastpersist's thread, no new allocation per save), in ``"pipelined"``
  mode once every byte is streamed out; the write and its durable commit
  continue in the background.
* ``remove_checkpoint`` (``ModelCheckpoint``'s top-k and ``save_last``)
  first waits for every save in flight, so an older checkpoint is deleted
  only once the newer one is durable; if that save failed, its error is
  raised there and nothing is deleted.
* A failed save is raised at the first of: the next ``save_checkpoint``
  (if it has finished by then), ``remove_checkpoint``,
  ``load_checkpoint``, :meth:`FastPersistCheckpointIO.wait` and
  ``teardown`` (end of ``fit``), which waits for everything.
* In ``"snapshot"`` mode the host buffer is made ahead of the first
  checkpoint, in the background (``prepare=False`` turns it off): at the
  start of ``fit`` (a ``ModelCheckpoint`` callback's ``on_train_start``)
  if the optimizers have their state, else right after their first step;
  the first save then blocks no longer than later ones.
* With ``ModelCheckpoint(save_last="link")``, ``last.ckpt`` is moved to a
  checkpoint only once that checkpoint is durable (the adapter wraps
  ``ModelCheckpoint._link_checkpoint``, which waits for the saves in
  flight: a save followed by a link waits for the disk); if its save
  failed, the error is raised there and ``last.ckpt`` still names the
  previous checkpoint.
* Loggers hear of a checkpoint (``after_save_checkpoint``: W&B's and
  MLflow's ``log_model``) once no checkpoint is in flight: at the next
  save, ``wait()``, ``remove_checkpoint`` or the stage's teardown that
  finds it so; never of one whose save failed.
* ``fabric.save`` (Fabric has no stage nor teardown) and the save of a
  SLURM auto-requeue return once the checkpoint is durable.
* A checkpoint still being saved counts as existing for ``ModelCheckpoint``
  (it then names the next one ``-v1``, as with a synchronous save, rather
  than replacing it): the adapter wraps ``ModelCheckpoint.file_exists``.
* ``load_checkpoint`` reads with :func:`fastpersist.read_state_dict`
  (checksums verified), honouring ``map_location`` (default: CPU, as
  Lightning's ``TorchCheckpointIO``) and ``weights_only`` (``None``: torch's
  default, True).
* Paths are local files (``file://`` URLs too): a remote fsspec URL
  (``s3://``, ``memory://``, ...) is refused by ``save_checkpoint``,
  ``load_checkpoint`` and ``remove_checkpoint`` with a ``ValueError``
  naming it (use Lightning's ``TorchCheckpointIO`` for those).
* The plugin pickles (``strategy="ddp_spawn"``, ``copy.deepcopy``): the
  copy has the same options and saves of its own. Pickling it while a
  checkpoint is in flight raises ``RuntimeError`` (call :meth:`wait` first).

Lightning's FSDP (sharded), ModelParallel and DeepSpeed strategies save
through ``torch.distributed.checkpoint`` or DeepSpeed, not CheckpointIO;
use fastpersist's DeepSpeed checkpoint engine for the latter.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..options import has_pending, make_dirs
from ..reader import read_state_dict
from ..writer import write_state_dict
from .common import BackgroundSaves, IntegrationError, after_first_step, never_raises, optimizers_have_state

__all__ = ["FastPersistCheckpointIO"]

#: The Lightning versions this adapter is tested with (the extra pins them).
TESTED = ">=2.5,<3"


def _bases() -> Tuple[type, ...]:
    bases: List[type] = []
    try:
        from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO as A

        bases.append(A)
    except ImportError:
        pass
    try:
        from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO as B

        bases.append(B)
    except ImportError:
        pass
    if not bases:
        raise IntegrationError(
            "fastpersist.integrations.lightning needs lightning or pytorch_lightning "
            f"{TESTED} (pip install 'fastpersist[lightning]')"
        )
    return tuple(bases)


_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*)://")


log = logging.getLogger("fastpersist")


def _local_path(path: Any) -> str:
    """``path`` as a local path (``file://`` stripped); a URL of another
    scheme (fsspec's ``s3://``, ``memory://``, ...) is a ValueError naming it."""
    p: str = os.fspath(path)
    m = _URL.match(p) if isinstance(p, str) else None
    if m is None:
        return p
    if m.group(1).lower() == "file":
        return p[m.end() :]
    raise ValueError(
        f"{p!r} is a remote ({m.group(1)}://) path: FastPersistCheckpointIO writes and reads local files only; "
        "use Lightning's TorchCheckpointIO (the default) for remote storage"
    )


def _weights_only_default() -> bool:
    # torch's own default for weights_only=None (True since torch 2.6).
    flag = os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "")
    return flag.strip().lower() not in ("1", "true", "yes", "on")


class _FastPersistIO:
    """The logic; :class:`FastPersistCheckpointIO` adds Lightning's bases."""

    def __init__(
        self,
        *,
        async_save: bool = True,
        mode: str = "snapshot",
        max_pending: int = 2,
        block_size: Optional[int] = None,
        arena_bytes: Optional[int] = None,
        queue_depth: Optional[int] = None,
        direct: Optional[bool] = None,
        io_uring: Optional[bool] = None,
        durable: bool = True,
        gather_threads: Optional[int] = None,
        prepare: bool = True,
    ) -> None:
        super().__init__()
        #: Make the snapshot staging buffer ahead of the first save (see :meth:`prepare`).
        self.prepare_ahead = bool(prepare)
        self._torn_down = False
        #: Saves from within a call that must find the file written when
        #: it returns (a SLURM requeue's), waited for at once while > 0.
        self._sync = 0
        #: Loggers' ``after_save_checkpoint`` calls held until the
        #: checkpoint each is about is durable: (its path, the call).
        self._to_notify: List[Tuple[str, Callable[[], None]]] = []
        #: The checkpoint in flight to each path (its outcome decides
        #: whether the loggers hear of it).
        self._in_flight: Dict[str, Any] = {}
        #: The exception being handled where the stage running was called
        #: (a retry inside the caller's ``except``): not Lightning's.
        self._outer: Optional[BaseException] = None
        self._disarm: Optional[Callable[[], None]] = None
        engine: Dict[str, Any] = {
            "gather_threads": gather_threads,
            "block_size": block_size,
            "arena_bytes": arena_bytes,
            "queue_depth": queue_depth,
            "direct": direct,
            "io_uring": io_uring,
            "durable": durable,
        }
        self.saves = BackgroundSaves(
            mode,
            async_save=async_save,
            max_pending=max_pending,
            what=f"{type(self).__name__}()",
            **{k: v for k, v in engine.items() if v is not None},
        )

    def prepare(self, checkpoint: Any, background: bool = True) -> None:
        """Make the host buffer that snapshots of checkpoints like
        ``checkpoint`` (a dict holding the model's and optimizers' state)
        are copied into now, faulted in, on fastpersist's snapshot thread
        (``background``), so the first ``save_checkpoint`` blocks no longer
        than later ones. Only the sizes count: a later checkpoint that
        differs is saved all the same. Nothing to do unless saves are
        asynchronous snapshots. ``fit`` calls it itself (see the class doc)."""
        self.saves.prepare([checkpoint], background=background)

    def _arm(self, trainer: Any) -> None:
        """At the start of training: prepare the snapshot buffer for the
        checkpoints this process writes, now if the optimizers have their
        state (a resumed run), else right after their first step. Only where
        Lightning's CheckpointIO writes from local state (the strategy's
        own state dicts are not collective) and only on the rank that writes."""
        if not self.prepare_ahead or self._disarm is not None or self.saves.mode != "snapshot":
            return
        if not self.saves.async_save or not trainer.is_global_zero or not _writes_local_state(trainer.strategy):
            return
        module = trainer.lightning_module
        optimizers = list(trainer.optimizers)

        def prepare() -> None:
            self.prepare({"state_dict": module.state_dict(), "optimizer_states": [o.state_dict() for o in optimizers]})

        if optimizers_have_state(optimizers):
            self._disarm = lambda: None
            prepare()
        else:
            self._disarm = after_first_step(optimizers, prepare)

    def save_checkpoint(self, checkpoint: Dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        """Start saving ``checkpoint`` to ``path``; returns once its tensors
        may change. ``storage_options`` may be a dict of engine options for
        this save."""
        self.saves.check()
        if storage_options is not None and not isinstance(storage_options, dict):
            raise TypeError(f"storage_options must be a dict of fastpersist engine options, not {storage_options!r}")
        p = _local_path(path)
        make_dirs(os.path.dirname(os.path.abspath(p)))
        if storage_options:
            # Other engine options for this one: saved now, after those in flight.
            self.saves.wait()
            write_state_dict(checkpoint, p, **{**self.saves.options, **storage_options})
            return
        self.saves.save(checkpoint, p)
        self._in_flight[os.path.abspath(p)] = self.saves.commit(p)

    def load_checkpoint(
        self, path: Any, map_location: Optional[Any] = None, weights_only: Optional[bool] = None
    ) -> Dict[str, Any]:
        p = _local_path(path)
        self.saves.wait()
        if not os.path.exists(p):
            raise FileNotFoundError(f"Checkpoint file not found: {p}")
        loaded: Dict[str, Any] = read_state_dict(
            p,
            map_location="cpu" if map_location is None else map_location,
            weights_only=_weights_only_default() if weights_only is None else weights_only,
        )
        return loaded

    def remove_checkpoint(self, path: Any) -> None:
        """Delete a checkpoint once every save in flight is durable (a
        failed one raises here and nothing is deleted)."""
        p = _local_path(path)
        self.wait()
        if os.path.islink(p) or os.path.isfile(p):
            os.unlink(p)
        elif os.path.isdir(p):
            shutil.rmtree(p)

    def wait(self) -> None:
        """Wait until every checkpoint saved so far is durable; raise a
        failed save's error."""
        self.saves.wait()
        self._notify_loggers()

    def _notify_loggers(self) -> None:
        """Make the loggers' held calls once no checkpoint is in flight: a
        call reads the callback's state (``last_model_path``,
        ``best_k_models``), which names the newest checkpoints, all durable
        then. The call about a checkpoint that failed is dropped."""
        if not self._to_notify:
            return
        if any(not c.done() for c in self._in_flight.values()) or any(has_pending(p) for p, _ in self._to_notify):
            return
        todo, self._to_notify = self._to_notify, []
        failed = {p for p, c in self._in_flight.items() if c.error() is not None}
        self._in_flight = {}
        for path, call in todo:
            if os.path.abspath(path) not in failed:
                call()

    def __getstate__(self) -> Dict[str, Any]:
        """The options, not the saves (``ddp_spawn``, ``copy.deepcopy``): a
        copy saves on its own. Refused while a checkpoint is in flight (its
        outcome would be nobody's)."""
        saves: BackgroundSaves = self.saves
        n = saves.in_flight()
        if n:
            raise RuntimeError(
                f"{type(self).__name__} cannot be pickled or copied while {n} checkpoint(s) are in flight: "
                "call its wait() first"
            )
        state = dict(self.__dict__)
        del state["saves"]
        state["_disarm"] = None  # optimizer hooks of this process
        state["_outer"] = None
        state["_in_flight"], state["_to_notify"], state["_sync"] = {}, [], 0  # (this process's saves and loggers)
        state["_saves_config"] = {
            "mode": saves.mode,
            "async_save": saves.async_save,
            "max_pending": saves.max_pending,
            "options": dict(saves.options),
            "fallbacks": saves.fallbacks,
        }
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        state = dict(state)
        cfg = state.pop("_saves_config")
        self.__dict__.update(state)
        self.saves = BackgroundSaves(
            cfg["mode"],
            async_save=cfg["async_save"],
            max_pending=cfg["max_pending"],
            what=f"{type(self).__name__}()",
            **cfg["options"],
        )
        self.saves.fallbacks = cfg["fallbacks"]

    def teardown(self) -> None:
        """Wait for every save (Lightning calls this at the end of a
        stage); raise a failed save's error, unless Lightning is tearing
        down because of another exception: that one goes on (with the save's
        failure logged and noted on it), and Lightning's cleanup with it."""
        disarm, self._disarm = self._disarm, None
        if disarm is not None:
            disarm()  # the next fit prepares again (its model may differ)
        #: Saves from now on (``on_fit_end``, ``teardown`` hooks, which
        #: Lightning runs after this) are waited for at once.
        self._torn_down = True
        handling = sys.exc_info()[1]
        if handling is self._outer or type(handling).__name__ == "_TunerExitException":
            handling = None  # not one Lightning raises: the caller's own, or one Lightning swallows
        if handling is not None:
            # Lightning finalized the loggers ("failed") before this: they
            # hear of nothing more.
            self._to_notify.clear()
        try:
            self.wait()
        except Exception as e:  # handed to the exception Lightning is raising
            self._to_notify.clear()
            if handling is None:
                raise
            log.error("fastpersist: a checkpoint failed while %s was raised: %r", type(handling).__name__, e)
            add_note = getattr(handling, "add_note", None)
            if add_note is not None:
                add_note(f"fastpersist: a checkpoint save failed as well: {type(e).__name__}: {e}")


def _wrap_method(modnames: Tuple[str, ...], cls_name: str, name: str, wrap: Callable[[Any], Any]) -> None:
    """Replace ``<cls_name>.<name>`` of each module of ``modnames`` (both
    import trees: ``lightning`` and ``pytorch_lightning``) by
    ``wrap(original)``, once per class."""
    import importlib

    for modname in modnames:
        try:
            cls = getattr(importlib.import_module(modname), cls_name)
        except (ImportError, AttributeError):
            continue
        orig = cls.__dict__.get(name)
        if orig is None or getattr(orig, "_fastpersist", False):
            continue
        new = wrap(orig)
        new._fastpersist = True
        setattr(cls, name, new)


def _wrap_model_checkpoint(name: str, wrap: Callable[[Any], Any]) -> None:
    """:func:`_wrap_method` of ``ModelCheckpoint.<name>``."""
    trees = ("lightning.pytorch.callbacks.model_checkpoint", "pytorch_lightning.callbacks.model_checkpoint")
    _wrap_method(trees, "ModelCheckpoint", name, wrap)


def _see_pending_saves() -> None:
    """Make ``ModelCheckpoint`` (both trees) see a checkpoint whose save is
    still in flight as existing, as it sees a synchronously written one.
    Otherwise two checkpoints that format to the same name (``filename``
    without ``{step}``) would both be called ``name.ckpt`` instead of
    ``name.ckpt`` and ``name-v1.ckpt``, and the second would replace the
    first. The original check runs as before; a second broadcast of rank
    0's answer about pending saves is added on every rank, so ranks agree."""

    def wrap(orig: Any) -> Callable[..., bool]:
        def file_exists(self: Any, filepath: Any, trainer: Any) -> bool:
            exists = bool(orig(self, filepath, trainer))
            io = getattr(getattr(trainer, "strategy", None), "checkpoint_io", None)
            if not isinstance(io, _FastPersistIO):
                return exists
            pending = trainer.strategy.broadcast(has_pending(os.fspath(filepath)))
            return bool(exists or pending)

        return file_exists

    _wrap_model_checkpoint("file_exists", wrap)


def _running(trainer: Any) -> bool:
    """Whether ``trainer`` is inside a stage (``fit``, ``validate``, ...)."""
    status = getattr(getattr(trainer, "state", None), "status", None)
    return getattr(status, "value", status) == "running"


def _durable_outside_a_stage() -> None:
    """``trainer.save_checkpoint(path)`` called outside a stage (before or
    after ``fit``, or in ``on_fit_end`` and ``teardown`` hooks, which
    Lightning runs after the CheckpointIO's teardown) returns once the
    checkpoint is durable on every rank, as with Lightning's own
    CheckpointIO: "save the final model, then reload it"
    (``load_from_checkpoint`` reads the file itself, not through the
    CheckpointIO, and no teardown comes to wait) finds the file, and a
    failed save raises there. Inside a stage, saves stay asynchronous and
    the stage's teardown waits. Each stage (``fit``, ``validate``, ...)
    starts asynchronous again."""
    import importlib

    for modname in ("lightning.pytorch.trainer.trainer", "pytorch_lightning.trainer.trainer"):
        try:
            cls = importlib.import_module(modname).Trainer
        except (ImportError, AttributeError):
            continue
        orig = cls.__dict__.get("save_checkpoint")
        if orig is not None and not getattr(orig, "_fastpersist", False):

            def save_checkpoint(self: Any, *args: Any, _orig: Any = orig, **kwargs: Any) -> Any:
                out = _orig(self, *args, **kwargs)
                io = _io_of(self)
                if io is not None and (io._torn_down or io._sync or not _running(self)):
                    _durable_everywhere(self.strategy, io)
                return out

            _replace(cls, "save_checkpoint", save_checkpoint, orig)
        for stage in ("fit", "validate", "test", "predict"):
            run = cls.__dict__.get(stage)
            if run is None or getattr(run, "_fastpersist", False):
                continue

            def start(self: Any, *args: Any, _run: Any = run, **kwargs: Any) -> Any:
                io = _io_of(self)
                if io is None:
                    return _run(self, *args, **kwargs)
                io._torn_down = False
                io._outer = sys.exc_info()[1]
                try:
                    return _run(self, *args, **kwargs)
                finally:
                    io._outer = None  # (not kept, nor the frames of its traceback, past the stage)

            _replace(cls, stage, start, run)


def _durable_everywhere(strategy: Any, io: _FastPersistIO) -> None:
    """Wait for ``io``'s saves, then agree across the ranks (``strategy``'s
    broadcast): the rank that writes (global rank 0) tells the others
    whether it failed, and every rank raises then (none is left waiting in
    a barrier)."""
    err: Optional[BaseException] = None
    try:
        io.wait()
    except Exception as e:  # noqa: BLE001 - told to every rank below
        err = e
    said = strategy.broadcast(f"{type(err).__name__}: {err}" if err is not None else None, src=0)
    if err is not None:
        raise err
    if said is not None:
        from ..collectives import DistributedCheckpointError

        raise DistributedCheckpointError(f"the checkpoint was not saved on rank 0: {said}")


def _io_of(trainer: Any) -> Optional[_FastPersistIO]:
    """The trainer's CheckpointIO when it is fastpersist's."""
    io = getattr(getattr(trainer, "strategy", None), "checkpoint_io", None)
    return io if isinstance(io, _FastPersistIO) else None


def _replace(cls: type, name: str, new: Callable[..., Any], orig: Callable[..., Any]) -> None:
    functools.update_wrapper(new, orig)
    new._fastpersist = True  # type: ignore[attr-defined]
    setattr(cls, name, new)


def _link_when_durable() -> None:
    """``ModelCheckpoint(save_last="link")`` moves ``last.ckpt`` to the
    checkpoint just saved as soon as ``save_checkpoint`` returns; the
    adapter wraps ``ModelCheckpoint._link_checkpoint`` (both trees) so that,
    with fastpersist's CheckpointIO, it first waits for the saves in flight
    (a failed one raises there, and the link stays where it was)."""

    def wrap(orig: Any) -> Any:
        func = orig.__func__ if isinstance(orig, staticmethod) else orig

        def _link_checkpoint(trainer: Any, filepath: str, linkpath: str) -> None:
            io = getattr(getattr(trainer, "strategy", None), "checkpoint_io", None)
            if isinstance(io, _FastPersistIO):
                io.wait()
            func(trainer, filepath, linkpath)

        return staticmethod(_link_checkpoint) if isinstance(orig, staticmethod) else _link_checkpoint

    _wrap_model_checkpoint("_link_checkpoint", wrap)


_NONE = object()


def _loggers_told_when_durable() -> None:
    """``ModelCheckpoint`` tells the loggers of a checkpoint
    (``after_save_checkpoint``: W&B, MLflow, ... upload it, or scan the
    folder for checkpoints to upload) as soon as ``save_checkpoint``
    returns, when an asynchronous save's file is not there yet: they found
    nothing, or a temporary file. With fastpersist's CheckpointIO each
    such call is held, and made at the next save, ``wait()``,
    ``remove_checkpoint`` or the stage's teardown that finds no checkpoint
    in flight (a call reads the callback's state, which names the newest
    checkpoints: all durable then). The call about a checkpoint whose save
    failed is dropped, and so are those held when a stage fails (Lightning
    has finalized the loggers by its teardown)."""

    def wrap(orig: Any) -> Callable[..., None]:
        def _save_checkpoint(self: Any, trainer: Any, filepath: str) -> None:
            io = _io_of(trainer)
            if io is None:
                orig(self, trainer, filepath)
                return
            io._notify_loggers()
            held = []
            for logger in trainer.loggers:
                real = getattr(logger, "after_save_checkpoint", None)
                own = vars(logger).get("after_save_checkpoint", _NONE) if hasattr(logger, "__dict__") else _NONE
                if real is None:
                    continue

                def later(callback: Any, _real: Any = real, _path: str = os.fspath(filepath)) -> None:
                    io._to_notify.append((_path, functools.partial(_real, callback)))

                try:
                    logger.after_save_checkpoint = later  # (an attribute of this instance, for this call)
                except AttributeError:
                    continue  # (told at once)
                held.append((logger, own))
            try:
                orig(self, trainer, filepath)
            finally:
                for logger, own in held:
                    if own is _NONE:
                        del logger.after_save_checkpoint
                    else:
                        logger.after_save_checkpoint = own  # (its own hook, put back)
            io._notify_loggers()  # (a synchronous save's: at once)

        return _save_checkpoint

    _wrap_model_checkpoint("_save_checkpoint", wrap)


def _durable_for_a_requeue() -> None:
    """Lightning's SLURM auto-requeue (``SIGUSR1``) saves ``hpc_ckpt_<n>.ckpt``
    and requeues the job at once; SLURM kills this one soon after. With
    fastpersist's CheckpointIO that save returns once it is durable, so the
    requeued job finds it (not a temporary file)."""

    def wrap(orig: Any) -> Any:
        @functools.wraps(orig)
        def handler(self: Any, *args: Any, **kwargs: Any) -> Any:
            io = _io_of(self.trainer)
            if io is None:
                return orig(self, *args, **kwargs)
            io.saves.settle()  # (the loggers hear of what is durable before Lightning finalizes them)
            io._notify_loggers()
            io._to_notify.clear()
            io._sync += 1
            try:
                return orig(self, *args, **kwargs)
            finally:
                io._sync -= 1

        return handler

    trees = (
        "lightning.pytorch.trainer.connectors.signal_connector",
        "pytorch_lightning.trainer.connectors.signal_connector",
    )
    _wrap_method(trees, "_SignalConnector", "_slurm_sigusr_handler_fn", wrap)


def _durable_fabric_saves() -> None:
    """``Fabric.save`` has no stage and no teardown to wait at: with
    fastpersist's CheckpointIO it returns once the checkpoint is durable on
    every rank (a failed save raises there, as with Fabric's own
    CheckpointIO), not only logged at exit."""

    def wrap(orig: Any) -> Any:
        @functools.wraps(orig)
        def save(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = orig(self, *args, **kwargs)
            strategy = getattr(self, "_strategy", None)
            io = getattr(strategy, "checkpoint_io", None)
            if isinstance(io, _FastPersistIO):
                _durable_everywhere(strategy, io)
            return out

        return save

    _wrap_method(("lightning.fabric.fabric", "lightning_fabric.fabric"), "Fabric", "save", wrap)


def _writes_local_state(strategy: Any) -> bool:
    """Whether ``strategy`` saves through its CheckpointIO the state dicts
    of the local module and optimizers (single device, DDP), as opposed to
    gathered or sharded ones (FSDP, ModelParallel, DeepSpeed: collective
    calls, or no CheckpointIO at all)."""
    for base in type(strategy).__mro__:
        if base.__name__ == "Strategy" and base.__module__.endswith("strategies.strategy"):
            return all(
                getattr(type(strategy), n, None) is getattr(base, n, None)
                for n in ("lightning_module_state_dict", "optimizer_state", "save_checkpoint")
            )
    return False


def _prepare_at_train_start() -> None:
    """Lightning hands a CheckpointIO nothing before its first save, so the
    adapter wraps ``ModelCheckpoint.on_train_start`` (both trees): when the
    trainer's CheckpointIO is fastpersist's, it prepares the snapshot buffer
    (:meth:`FastPersistCheckpointIO.prepare`) from the trainer's module and
    optimizers, after the optimizers' first step if they have no state yet."""

    def wrap(orig: Any) -> Callable[..., None]:
        def on_train_start(self: Any, trainer: Any, pl_module: Any) -> None:
            orig(self, trainer, pl_module)
            io = getattr(getattr(trainer, "strategy", None), "checkpoint_io", None)
            if isinstance(io, _FastPersistIO):
                never_raises("preparing the snapshot buffer", lambda: io._arm(trainer))

        return on_train_start

    _wrap_model_checkpoint("on_train_start", wrap)


# The bases (Lightning's CheckpointIO from either package name) are found at
# import, which mypy cannot follow.
class FastPersistCheckpointIO(_FastPersistIO, *_bases()):  # type: ignore[misc]
    """A Lightning ``CheckpointIO`` that writes through fastpersist (see the
    module doc). ``mode``: ``"snapshot"`` (default) or ``"pipelined"``;
    ``async_save=False`` saves synchronously; ``max_pending`` bounds
    checkpoints between call and commit (and so snapshot memory); the rest
    are engine options of :func:`fastpersist.write_state_dict`.
    ``prepare`` (default True): in ``"snapshot"`` mode, make the host
    buffer snapshots are copied into ahead of the first checkpoint, in the
    background, so it blocks training no longer than later ones (at the
    start of ``fit`` with a ``ModelCheckpoint`` callback if the optimizers
    have their state, else right after their first step; or call
    :meth:`prepare`); ``prepare=False`` makes it at the first save."""


_see_pending_saves()
_prepare_at_train_start()
_link_when_durable()
_durable_outside_a_stage()
_loggers_told_when_durable()
_durable_for_a_requeue()
_durable_fabric_saves()
