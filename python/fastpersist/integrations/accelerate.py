"""Hugging Face Accelerate: ``save_state``/``load_state`` through fastpersist.

>>> from fastpersist.integrations.accelerate import register
>>> fp = register(accelerator)          # doctest: +SKIP
>>> accelerator.save_state("ckpt")      # returns once the tensors may change
>>> fp.wait()                           # durable (or raises the failure)

``register`` installs a save-state pre-hook that writes each model's
weights (``model.safetensors``, ``model_1.safetensors``, ...; or
``pytorch_model*.bin`` with ``safe_serialization=False``) and a
load-state pre-hook that reads them back with
:func:`fastpersist.read_state_dict` (checksums verified), honouring
``load_state``'s model-load arguments as Accelerate does (``strict=False``
loads what matches; arguments other than ``strict`` and ``backend`` leave
the weights to Accelerate's own loader). For the length of
each ``save_state`` it also routes the optimizer, scheduler, sampler, scaler
and RNG files that Accelerate writes through fastpersist. File names and
formats are Accelerate's own: ``load_state`` works with or without the hooks.

In ``"snapshot"`` mode the host buffers the files are copied into are made
ahead of the first ``save_state``, in the background (at ``register`` and
each ``accelerator.prepare`` if the optimizers have their state, else right
after their first step), so it blocks no longer than later ones;
``register(accelerator, prepare=False)`` turns that off.

A ``save_state`` folder is one checkpoint: once every file is durable the
whole folder is fsynced, in the background. Until then it holds a marker
(``.fastpersist-save-pending``, made durably before any of its files): a
folder whose save never finished (the process killed while it was in the
background) keeps it, and ``load_state()`` with automatic naming takes the
newest folder without it (a ``load_state(folder)`` of such a folder raises
:class:`~fastpersist.CorruptCheckpointError`). The next ``save_state``,
``load_state`` and ``end_training`` first wait for it and raise a failed
save's error. With ``ProjectConfiguration(automatic_checkpoint_naming=True,
total_limit=n)`` old folders are deleted only after the new one is durable
(Accelerate itself deletes before it saves). FSDP, DeepSpeed and
Megatron-LM models are saved by their own code paths, not by these hooks
(use fastpersist's DeepSpeed checkpoint engine for DeepSpeed).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..errors import CorruptCheckpointError
from ..options import make_dirs, put_marker, remove_durably
from ..reader import read_state_dict
from .common import (
    BackgroundSaves,
    after_first_step,
    check_version,
    never_raises,
    optimizers_have_state,
    routed,
    sync_tree,
    torch_module_via,
)

__all__ = ["register", "FastPersistAccelerate"]

#: accelerate versions this adapter is tested with (the extra pins them).
TESTED = ">=1.0,<2"
#: In a ``save_state`` folder from before its first file until the whole
#: folder is durable.
PENDING = ".fastpersist-save-pending"
log = logging.getLogger("fastpersist")


def _framework() -> Any:
    import accelerate
    from accelerate import checkpointing

    missing = [
        f"{m.__name__}.{n}"
        for m, n in [
            (checkpointing, "save"),
            (checkpointing, "torch"),
            (accelerate.Accelerator, "register_save_state_pre_hook"),
            (accelerate.Accelerator, "register_load_state_pre_hook"),
        ]
        if not hasattr(m, n)
    ]
    check_version("accelerate", accelerate.__version__, TESTED, missing)
    return checkpointing


def _weights_name(i: int, safe: bool) -> str:
    from accelerate.utils import SAFE_WEIGHTS_NAME, WEIGHTS_NAME

    name: str = SAFE_WEIGHTS_NAME if safe else WEIGHTS_NAME
    return name.replace(".", f"_{i}.") if i > 0 else name


class FastPersistAccelerate:
    """What :func:`register` installed on one ``Accelerator``."""

    def __init__(self, accelerator: Any, mode: str = "snapshot", prepare: bool = True, **engine_options: Any) -> None:
        self.checkpointing = _framework()
        self.accelerator = accelerator
        self.saves = BackgroundSaves(mode, max_pending=64, what=f"{type(self).__name__}()", **engine_options)
        #: Make the snapshot buffers ahead of the first ``save_state`` (see :meth:`prepare_buffers`).
        self.prepare_ahead = bool(prepare)
        self._disarm: Optional[Callable[[], None]] = None
        self._safe = True
        #: Folders of the save_state running marked as pending (:data:`PENDING`).
        self._marked: List[str] = []
        #: The model-load arguments of the ``load_state`` call running (for the load hook).
        self._load_kwargs: Dict[str, Any] = {}
        self._orig: Dict[str, Callable[..., Any]] = {
            n: getattr(accelerator, n) for n in ("save_state", "load_state", "end_training", "prepare")
        }
        self._handles = [
            accelerator.register_save_state_pre_hook(self._save_weights),
            accelerator.register_load_state_pre_hook(self._load_weights),
        ]
        accelerator.save_state = self._save_state
        accelerator.load_state = self._load_state
        accelerator.end_training = self._end_training
        accelerator.prepare = self._prepare
        never_raises("preparing the snapshot buffers", self.prepare_buffers)

    # -- the snapshot buffers, made ahead of the first save_state ------------------------

    def prepare_buffers(self) -> None:
        """Make the host buffers that ``save_state``'s files are
        snapshotted into (the models' weights, the optimizers' states and
        a small buffer for each of the other files) now, in the background,
        so the first ``save_state`` blocks no longer than later ones: at
        once if the optimizers have their state, else right after their
        first step. :func:`register` and every ``accelerator.prepare``
        call it (``prepare=False`` turns that off). Only the sizes count: a
        later state that differs is saved all the same. Nothing to do in
        ``"pipelined"`` mode, before any model is prepared, on processes
        that write no weights, or where another code path saves the models
        (FSDP, DeepSpeed, Megatron-LM, XLA)."""
        disarm, self._disarm = self._disarm, None
        if disarm is not None:
            disarm()
        acc = self.accelerator
        if not self.prepare_ahead or self.saves.mode != "snapshot" or not self.saves.async_save:
            return
        if not acc._models or getattr(acc.distributed_type, "name", "") in _OWN_SAVES:
            return
        if not self._writes_here(acc.project_configuration.save_on_each_node):
            return
        models = list(acc._models)
        optimizers = list(acc._optimizers)
        small = len(acc._schedulers) + 2 * len(acc._dataloaders) + len(acc._custom_objects) + 2  # + scaler, RNG

        def prepare() -> None:
            files: List[Any] = [acc.unwrap_model(m).state_dict() for m in models]
            files += [o.state_dict() for o in optimizers]
            self.saves.prepare(files + [{}] * small)

        if optimizers_have_state(optimizers):
            self._disarm = _nothing
            prepare()
        else:
            self._disarm = after_first_step(optimizers, prepare)

    def _prepare(self, *args: Any, **kwargs: Any) -> Any:
        out = self._orig["prepare"](*args, **kwargs)
        never_raises("preparing the snapshot buffers", self.prepare_buffers)  # what it prepared is saved too
        return out

    # -- the wrapped methods -------------------------------------------------------

    def _hooks_last(self) -> None:
        """Put this adapter's save and load hooks after the user's: a hook
        registered after :func:`register` that saves (or loads) some models
        its own way and pops them from ``weights`` (``models``), as
        diffusers' training scripts do, finds them there, and the adapter
        takes what is left, as Accelerate itself would."""
        acc = self.accelerator
        for table, handle in zip(("_save_model_state_pre_hook", "_load_model_state_pre_hook"), self._handles):
            hooks = getattr(acc, table, None)
            key = getattr(handle, "id", None)
            if isinstance(hooks, OrderedDict) and key in hooks:
                hooks.move_to_end(key)

    def _save_state(self, output_dir: Optional[str] = None, safe_serialization: bool = True, **kwargs: Any) -> Any:
        self.saves.wait()  # the previous checkpoint is durable, or its failure is raised here
        self._hooks_last()
        acc = self.accelerator
        cfg = acc.project_configuration
        limit = cfg.total_limit if cfg.automatic_checkpoint_naming else None
        self._safe = safe_serialization
        if limit is not None:
            cfg.total_limit = None  # pruned after the commit
        try:
            with routed(self.checkpointing, save=self._save_file, torch=torch_module_via(self.saves)):
                location = self._orig["save_state"](output_dir, safe_serialization=safe_serialization, **kwargs)
        except BaseException:
            self._marked = []  # left pending: that save did not finish
            self.saves.commit(str(output_dir))
            raise
        finally:
            if limit is not None:
                cfg.total_limit = limit
        folder = os.fspath(location)
        prune = acc.is_main_process and limit is not None
        parent = os.path.dirname(os.path.abspath(folder))
        marked, self._marked = self._marked, []

        def finalize() -> None:
            if os.path.isdir(folder):
                sync_tree(folder)
            for d in marked:  # the folder is whole and durable: no longer pending
                remove_durably(os.path.join(d, PENDING))
            if prune and limit is not None:
                _prune(parent, limit, folder)

        self.saves.commit(folder, finalize)
        return location

    def _load_state(
        self,
        input_dir: Optional[str] = None,
        load_kwargs: Optional[Dict[str, Any]] = None,
        **load_model_func_kwargs: Any,
    ) -> Any:
        self.saves.wait()
        self._hooks_last()
        input_dir = self._whole_folder(input_dir)
        self._load_kwargs = dict(load_model_func_kwargs)  # Accelerate hands the hooks only the models and folder
        try:
            return self._orig["load_state"](input_dir, load_kwargs, **load_model_func_kwargs)
        finally:
            self._load_kwargs = {}

    def _whole_folder(self, input_dir: Optional[str]) -> Optional[str]:
        """The folder ``load_state`` reads: ``input_dir``, refused when its
        save never finished; with none and automatic naming, the newest
        ``checkpoint_<n>`` whose save finished (Accelerate would take the
        newest, whole or not)."""
        if input_dir is not None:
            d = os.path.expanduser(os.fspath(input_dir))
            if os.path.isfile(os.path.join(d, PENDING)):
                raise CorruptCheckpointError(
                    f"{d}: its save_state did not finish (the process ended while it was written in the "
                    f"background: {PENDING} is still there)"
                )
            return input_dir
        acc = self.accelerator
        cfg = acc.project_configuration
        root = os.path.join(acc.project_dir, "checkpoints") if cfg.automatic_checkpoint_naming else None
        if root is None or not os.path.isdir(root):
            return None  # Accelerate says what is missing
        found = _numbered(root)
        whole = [(n, p) for n, p in found if not os.path.isfile(os.path.join(p, PENDING))]
        if found and not whole:
            raise CorruptCheckpointError(
                f"{root}: no checkpoint folder whose save_state finished (each holds {PENDING}: the process ended "
                "while it was written in the background)"
            )
        if not whole or whole[-1] == found[-1]:
            return None  # the newest is whole (or there is none): Accelerate finds it itself
        for n, p in found:
            if n > whole[-1][0]:
                log.warning("fastpersist: %s is skipped: its save_state did not finish", p)
        return whole[-1][1]

    def _end_training(self, *args: Any, **kwargs: Any) -> Any:
        self.saves.wait()
        return self._orig["end_training"](*args, **kwargs)

    # -- hooks and routed saves --------------------------------------------------

    def _writes_here(self, save_on_each_node: bool = False) -> bool:
        acc = self.accelerator
        return bool(acc.is_local_main_process if save_on_each_node else acc.is_main_process)

    def _save_file(self, obj: Any, f: Any, save_on_each_node: bool = False, safe_serialization: bool = False) -> None:
        """``accelerate.utils.save``, through fastpersist."""
        if not self._writes_here(save_on_each_node):
            return
        if safe_serialization:
            from accelerate.utils import clean_state_dict_for_safetensors

            self.saves.save(clean_state_dict_for_safetensors(obj), f, format="safetensors", metadata={"format": "pt"})
        else:
            self.saves.save(obj, f)

    def _mark_pending(self, folder: str, save_on_each_node: bool) -> None:
        """Mark ``folder`` as a save in progress, durably, before any of its
        files (see :data:`PENDING`); the save's finalize takes it away."""
        if not self._writes_here(save_on_each_node) or folder in self._marked:
            return
        make_dirs(folder)
        put_marker(os.path.join(folder, PENDING))
        self._marked.append(folder)

    def _save_weights(self, models: List[Any], weights: List[Any], output_dir: str) -> None:
        save_on_each_node = self.accelerator.project_configuration.save_on_each_node
        # Accelerate runs the save hooks before it writes any file of the folder.
        self._mark_pending(os.fspath(output_dir), save_on_each_node)
        for i, state in enumerate(weights):
            path = os.path.join(output_dir, _weights_name(i, self._safe))
            self._save_file(state, path, save_on_each_node, self._safe)
        weights.clear()  # saved: Accelerate skips them

    def _load_weights(self, models: List[Any], input_dir: str) -> None:
        paths = [os.path.join(input_dir, _weights_name(i, True)) for i in range(len(models))]
        if not models or not all(os.path.isfile(p) for p in paths):
            return  # not ours (or another format): Accelerate loads them
        kwargs = self._load_kwargs
        if set(kwargs) - _LOAD_MODEL_KWARGS:
            return  # arguments only Accelerate's loader knows (or refuses, as it would): it loads them
        strict = bool(kwargs.get("strict", True))
        for model, p in zip(models, paths):
            _load_into(model, read_state_dict(p), strict=strict)
        models.clear()  # loaded: Accelerate skips them

    # -- control -----------------------------------------------------------------------

    def wait(self) -> None:
        """Wait until every ``save_state`` so far is durable; raise a failed save's error."""
        self.saves.wait()

    def unregister(self) -> None:
        """Wait for saves in flight, then put the Accelerator back as it was."""
        disarm, self._disarm = self._disarm, None
        if disarm is not None:
            disarm()
        try:
            self.saves.close()
        finally:
            for h in self._handles:
                h.remove()
            for n, fn in self._orig.items():
                setattr(self.accelerator, n, fn)


#: The model-load arguments of ``load_state`` that the load hook takes as
#: safetensors' ``load_model`` (Accelerate's loader of these files) does;
#: ``backend`` (how safetensors reads the file) means nothing to fastpersist's reader.
_LOAD_MODEL_KWARGS = frozenset({"strict", "backend"})


def _load_into(model: Any, state: Dict[str, Any], strict: bool = True) -> None:
    """``load_state_dict`` that accepts the keys safetensors files drop for
    tied weights (they share storage with a key that is present); with
    ``strict=False``, missing and unexpected keys are accepted (what
    matches is loaded), as safetensors' ``load_model`` does."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    if not strict:
        return
    if missing:
        own = model.state_dict()
        loaded = {own[k].untyped_storage().data_ptr() for k in state if k in own}
        missing = [k for k in missing if own[k].untyped_storage().data_ptr() not in loaded]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint does not match the model: missing {missing}, unexpected {unexpected}")


#: The folders accelerate's automatic naming makes (``checkpoint_<n>``):
#: the only ones pruned, a user's other folders beside them never.
_NUMBERED = re.compile(r"checkpoint_([0-9]+)")


def _numbered(parent: str) -> List[Tuple[int, str]]:
    """The ``checkpoint_<n>`` folders of ``parent`` as ``(n, path)``, oldest first."""
    found = []
    for name in os.listdir(parent):
        m = _NUMBERED.fullmatch(name)
        if m and os.path.isdir(os.path.join(parent, name)):
            found.append((int(m.group(1)), os.path.join(parent, name)))
    return sorted(found)


def _prune(parent: str, keep: int, committed: str) -> None:
    """After the commit of ``committed``: delete the oldest (by number)
    other ``checkpoint_<n>`` folders, leaving ``keep`` with it, as
    Accelerate's own pruning before a save leaves them. The folder just
    committed is never one (an earlier run's folders may have higher
    numbers), and folders whose save did not finish (``PENDING``) are
    neither counted nor deleted: ``keep`` loadable checkpoints remain."""
    mine = os.path.realpath(committed)
    found = [
        (n, p)
        for n, p in _numbered(parent)
        if os.path.realpath(p) != mine and not os.path.lexists(os.path.join(p, PENDING))
    ]
    for _, p in found[: max(0, len(found) - (keep - 1))]:
        shutil.rmtree(p, ignore_errors=True)


def register(
    accelerator: Any, *, mode: str = "snapshot", prepare: bool = True, **engine_options: Any
) -> FastPersistAccelerate:
    """Make ``accelerator.save_state``/``load_state`` write and read through
    fastpersist (see the module doc). ``mode`` is that of
    :func:`fastpersist.save_async`; ``prepare`` (default True): in
    ``"snapshot"`` mode, make the snapshot buffers ahead of the first
    ``save_state`` (:meth:`FastPersistAccelerate.prepare_buffers`), False:
    at the first save; ``engine_options`` those of
    :func:`fastpersist.write_state_dict`. Returns a handle with ``wait()``
    and ``unregister()``."""
    return FastPersistAccelerate(accelerator, mode, prepare, **engine_options)


#: Distributed types whose models are saved by their own code paths, not these hooks.
_OWN_SAVES = ("DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA")


def _nothing() -> None:
    pass
