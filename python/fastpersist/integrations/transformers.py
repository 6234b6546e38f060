"""Hugging Face ``Trainer`` (and TRL's trainers, which subclass it).

>>> from transformers import Trainer
>>> from fastpersist.integrations.transformers import FastPersistTrainerMixin
>>> class MyTrainer(FastPersistTrainerMixin, Trainer):  # doctest: +SKIP
...     pass

The Trainer has no writer hook, so the mixin routes, for the length of each
``_save_checkpoint``, the calls the Trainer's own code saves through: the
model's safetensors shards (``save_pretrained``'s ``safe_save_file``),
``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``, ``rng_state*.pth`` and
``training_args.bin`` (the Trainer's ``torch.save``), and ``model.safetensors``
of a model that is not a ``PreTrainedModel`` (the Trainer's own
``safetensors.torch.save_file``). The folder layout,
index files and names are the Trainer's own; the files are the ones
``torch.load``/``safetensors`` read.

A checkpoint folder is committed as a whole: the saves return once the
tensors may change and training goes on; in the background, once every file
is durable, the whole folder is fsynced and only then is
``trainer_state.json`` put in place (written to a temporary name and
renamed). A folder without ``trainer_state.json`` is an incomplete one:
``train(resume_from_checkpoint=True)`` resumes from the newest complete
checkpoint, and an explicit path to an incomplete one is refused. A save
into a folder that already exists (an earlier run in the same
``output_dir``) first takes its ``trainer_state.json`` and CRC sidecar away
(durably), so the folder is incomplete until the new save commits, never a
mix of two runs that looks complete. Rotation (``save_total_limit``) runs
after that commit, so an older checkpoint is deleted only once a newer one
is durable; it counts complete checkpoints only (by step), never deletes
the one just committed or the best model's, and leaves incomplete folders
alone (a deleted checkpoint loses its ``trainer_state.json`` first, so one
half deleted is never complete). With ``push_to_hub``, the Trainer's push
of a checkpoint runs once it is committed (the save then waits for its
files, as the stock Trainer's does). A model bigger than
``save_pretrained``'s ``max_shard_size`` gets the Trainer's own shards
(``model-0000k-of-0000n.safetensors``) and ``model.safetensors.index.json``.

safetensors files carry no checksums, so before ``trainer_state.json`` the
commit writes ``fastpersist.crc32.json``: the CRC32 of every tensor of the
folder's safetensors files, computed while they were written. Resuming
(``resume_from_checkpoint``) reads the model weights (one file or the
shards), ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt`` and the RNG
state through :func:`fastpersist.read_state_dict`: every CRC32 is checked
(the torch files' own, the sidecar's for safetensors) and a damaged file
raises :class:`~fastpersist.CorruptCheckpointError` naming it, where
``torch.load`` and safetensors would load the damaged bytes. Checkpoints
written without fastpersist load as before (their zip CRCs checked too). A failed save is
raised at the next checkpoint, at the end of ``train`` (which waits for the
last one), or by :meth:`FastPersistTrainerMixin.fastpersist_wait`.

In ``"snapshot"`` mode the host buffers the first checkpoint's files are
copied into are made ahead of it, in the background, so it blocks training
no longer than later ones: at ``on_train_begin`` (a callback the mixin
adds) if the optimizer has its state (a resumed run), else right after the
optimizer's first step. It is a sizing hint only: what is saved does not
depend on it, and a state that grows later is saved all the same. Not with
DeepSpeed or FSDP (their saves are their own), nor on processes that do not
save the model.

Options: class attributes ``fastpersist_mode`` (``"snapshot"``),
``fastpersist_options`` (engine options) and ``fastpersist_prepare``
(True: the buffers made ahead, as above; False: at the first save), or the
keyword arguments of the same names to the trainer's constructor.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import weakref
from typing import Any, Callable, ClassVar, Dict, Iterator, List, Optional, Tuple

from .common import (
    CRC_SIDECAR,
    BackgroundSaves,
    after_first_step,
    check_version,
    fsync_dir,
    module_with,
    never_raises,
    optimizers_have_state,
    routed,
    safe_load_file_via,
    safe_save_file_via,
    sync_tree,
    torch_module_via,
    write_crc_sidecar,
)

__all__ = ["FastPersistTrainerMixin", "latest_complete_checkpoint"]

#: transformers versions this adapter is tested with (the extra pins them).
TESTED = ">=5.0,<6"
STATE_NAME = "trainer_state.json"
_PENDING_STATE = ".trainer_state.json.fastpersist-pending"
_CKPT = re.compile(r"checkpoint-([0-9]+)")
log = logging.getLogger("fastpersist")


def _framework() -> Tuple[Any, Any, Any]:
    import transformers
    from transformers import modeling_utils, trainer, trainer_utils

    # (module or class, the name it must have)
    needed: List[Tuple[Any, str]] = [
        (modeling_utils, "safe_save_file"),
        (trainer, "torch"),
        (trainer, "safetensors"),
        (trainer_utils, "torch"),
        (trainer_utils, "safe_load_file"),
        (trainer_utils, "PREFIX_CHECKPOINT_DIR"),
        (trainer.Trainer, "_save_checkpoint"),
        (trainer.Trainer, "_push_from_checkpoint"),
        (trainer.Trainer, "_get_output_dir"),
        (trainer.Trainer, "_finalize_training"),
        (trainer.Trainer, "_load_from_checkpoint"),
        (trainer.Trainer, "_load_optimizer_and_scheduler"),
        (trainer.Trainer, "_load_rng_state"),
    ]
    missing = [f"{m.__name__}.{n}" for m, n in needed if not hasattr(m, n)]
    check_version("transformers", transformers.__version__, TESTED, missing)
    return modeling_utils, trainer, trainer_utils


def _complete_checkpoints(output_dir: str) -> List[str]:
    """The ``checkpoint-<step>`` folders of ``output_dir`` that hold
    ``trainer_state.json`` (committed), oldest step first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        m = _CKPT.fullmatch(name)
        p = os.path.join(output_dir, name)
        if m and os.path.isfile(os.path.join(p, STATE_NAME)):
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def latest_complete_checkpoint(output_dir: str) -> Optional[str]:
    """The newest ``checkpoint-<step>`` folder of ``output_dir`` that holds
    ``trainer_state.json`` (committed), or None."""
    found = _complete_checkpoints(output_dir)
    return found[-1] if found else None


def _make_incomplete(folder: str) -> None:
    """Take ``folder``'s commit marker (``trainer_state.json``) away, then
    its CRC sidecar, each durably: from then on the folder is an incomplete
    checkpoint, whatever happens to its other files."""
    for name in (STATE_NAME, CRC_SIDECAR):
        try:
            os.unlink(os.path.join(folder, name))
        except FileNotFoundError:
            continue
        fsync_dir(folder)


def _by_age(folders: List[str]) -> List[str]:
    """``folders`` (in step order) oldest first as the Trainer's rotation
    orders them: by modification time, or by step where the times are
    within a second of each other (a file system whose times cannot be
    trusted, as ``trainer_utils.sort_checkpoints`` decides)."""
    try:
        timed = sorted((os.path.getmtime(p), p) for p in folders)
    except OSError:  # one went away meanwhile: step order
        return folders
    if len(timed) > 1 and timed[-1][0] - timed[0][0] < 1.0:
        return folders
    return [p for _, p in timed]


def _rotate(run_dir: str, limit: int, protected: List[Optional[str]]) -> None:
    """Delete the oldest complete checkpoints of ``run_dir`` until at most
    ``limit`` are left (or as many as are ``protected``: the one just
    committed, the best model's, the newest), never a protected one;
    incomplete folders are neither counted nor deleted. Oldest is by
    modification time, as the Trainer's own rotation has it (a rerun into
    an ``output_dir`` with an earlier run's higher-numbered checkpoints
    rotates those out first). A checkpoint loses its ``trainer_state.json``
    (durably) before its files; a folder that is a symbolic link is counted
    but never entered (the Trainer's ``rmtree`` of a link fails and leaves
    it)."""
    complete = _by_age(_complete_checkpoints(run_dir))
    keep = {os.path.abspath(p) for p in protected + complete[-1:] if p}
    left = len(complete)
    room = max(limit, len([p for p in complete if os.path.abspath(p) in keep]))
    for p in complete:
        if left <= room:
            break
        if os.path.abspath(p) in keep:
            continue
        left -= 1
        if os.path.islink(p):
            continue
        log.info("fastpersist: deleting older checkpoint %s (save_total_limit=%d)", p, limit)
        _make_incomplete(p)
        shutil.rmtree(p, ignore_errors=True)


def _safetensors_via(save: Optional[BackgroundSaves] = None, load: bool = False) -> Any:
    """A stand-in for the ``safetensors`` package as the Trainer's module
    sees it (``safetensors.torch.save_file`` for a model that is not a
    ``PreTrainedModel``, ``load_file`` when resuming)."""
    import safetensors
    import safetensors.torch

    names: Dict[str, Any] = {}
    if save is not None:
        names["save_file"] = safe_save_file_via(save)
    if load:
        names["load_file"] = safe_load_file_via()
    return module_with(safetensors, torch=module_with(safetensors.torch, **names))


#: Files of a checkpoint folder besides the model's and the optimizer's.
_SMALL_FILES = 4


def _nothing() -> None:
    pass


#: transformers' own callbacks whose ``on_save`` does nothing as set up
#: (class name -> whether it acts): W&B uploads only with
#: ``WANDB_LOG_MODEL=checkpoint``, Trackio's is empty.
_ON_SAVE_ACTS: Dict[str, Callable[[Any], bool]] = {
    "WandbCallback": lambda cb: _setting(getattr(cb, "_log_model", "checkpoint")) == "checkpoint",
    "TrackioCallback": lambda cb: False,
}


def _setting(v: Any) -> str:
    """An enum setting's value (``WandbLogModel.CHECKPOINT``: "checkpoint")."""
    return str(getattr(v, "value", v)).lower()


def _told_of_saves(handler: Any) -> bool:
    """Whether a callback of the Trainer's ``handler`` does something on
    ``on_save`` (overrides ``TrainerCallback.on_save``, and is not one of
    transformers' own set up to do nothing there): it reads the checkpoint
    folder just saved."""
    from transformers import TrainerCallback

    for cb in getattr(handler, "callbacks", ()):
        if getattr(type(cb), "on_save", None) is TrainerCallback.on_save:
            continue
        acts = _ON_SAVE_ACTS.get(type(cb).__name__)
        if acts is None or acts(cb):
            return True
    return False


def _prepare_callback(trainer: Any) -> Any:
    """The ``TrainerCallback`` that makes the snapshot buffers at the start
    of training (:meth:`FastPersistTrainerMixin._fastpersist_arm`)."""
    from transformers import TrainerCallback

    ref = weakref.ref(trainer)

    class FastPersistPrepare(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            t = ref()
            if t is not None:
                never_raises("preparing the snapshot buffers", t._fastpersist_arm)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            t = ref()
            if t is not None:
                t._fastpersist_end()

    return FastPersistPrepare()


class FastPersistTrainerMixin:
    """Put first in the bases: ``class MyTrainer(FastPersistTrainerMixin, Trainer)``."""

    fastpersist_mode: ClassVar[str] = "snapshot"
    fastpersist_options: ClassVar[Dict[str, Any]] = {}
    fastpersist_prepare: ClassVar[bool] = True

    def __init__(
        self,
        *args: Any,
        fastpersist_mode: Optional[str] = None,
        fastpersist_options: Optional[Dict[str, Any]] = None,
        fastpersist_prepare: Optional[bool] = None,
        **kwargs: Any,
    ) -> None:
        _framework()
        super().__init__(*args, **kwargs)
        mode = fastpersist_mode or self.fastpersist_mode
        options = dict(self.fastpersist_options if fastpersist_options is None else fastpersist_options)
        # A folder is one checkpoint: its saves are all in flight together.
        self._fastpersist = BackgroundSaves(mode, max_pending=64, what=f"{type(self).__name__}()", **options)
        self._fastpersist_prepare = bool(
            self.fastpersist_prepare if fastpersist_prepare is None else fastpersist_prepare
        )
        self._fastpersist_disarm: Optional[Callable[[], None]] = None
        self._fastpersist_pushes: Optional[List[str]] = None
        self.add_callback(_prepare_callback(self))  # type: ignore[attr-defined]

    # -- the snapshot buffers, made ahead of the first checkpoint ------------------

    def _fastpersist_arm(self) -> None:
        """At ``on_train_begin``: make the snapshot buffers of a checkpoint
        folder's files now if the optimizer has its state, else right after
        its first step (see the module doc)."""
        saves: BackgroundSaves = self._fastpersist
        if not self._fastpersist_prepare or saves.mode != "snapshot" or not saves.async_save:
            return
        if self._fastpersist_disarm is not None:
            return
        args: Any = self.args  # type: ignore[attr-defined]
        if (
            args.save_strategy == "no"  # no checkpoints: no buffers
            or not args.should_save
            or getattr(self, "is_deepspeed_enabled", False)
            or getattr(self, "is_fsdp_enabled", False)
        ):
            return
        model: Any = self.model  # type: ignore[attr-defined]
        optimizer: Any = None if args.save_only_model else getattr(self, "optimizer", None)
        optimizers = [optimizer] if optimizer is not None else []

        def prepare() -> None:
            files: List[Any] = [model.state_dict()]  # model.safetensors (one shard up to save_pretrained's 50 GB)
            if optimizer is not None:
                files.append(optimizer.state_dict())  # optimizer.pt
            # training_args.bin, scheduler.pt, scaler.pt, rng_state.pth: small files, in flight with the rest
            files += [{}] * _SMALL_FILES
            saves.prepare(files)

        if optimizers_have_state(optimizers):
            self._fastpersist_disarm = _nothing
            prepare()
        else:
            self._fastpersist_disarm = after_first_step(optimizers, prepare)

    def _fastpersist_end(self) -> None:
        disarm, self._fastpersist_disarm = self._fastpersist_disarm, None
        if disarm is not None:
            disarm()  # the next train() prepares again

    # -- saving ----------------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        modeling_utils, trainer_mod, trainer_utils = _framework()
        saves: BackgroundSaves = self._fastpersist
        saves.wait()  # the previous checkpoint is committed, or its failure is raised here
        args: Any = self.args  # type: ignore[attr-defined]
        state: Any = self.state  # type: ignore[attr-defined]
        run_dir = self._get_output_dir(trial=trial)  # type: ignore[attr-defined]
        folder = os.path.join(run_dir, f"{trainer_utils.PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        limit = args.save_total_limit
        deferred: List[Tuple[str, str]] = []
        real_save_to_json = state.save_to_json

        def save_to_json_later(json_path: str) -> None:
            # The commit marker: written now under another name, put in place once the rest is durable.
            pending = os.path.join(os.path.dirname(json_path), _PENDING_STATE)
            real_save_to_json(pending)
            deferred.append((pending, json_path))

        if args.should_save and os.path.isdir(folder):
            _make_incomplete(folder)  # an earlier run's: incomplete until this save commits
        state.save_to_json = save_to_json_later
        args.save_total_limit = None  # rotation runs after the commit
        pushes: List[str] = []
        self._fastpersist_pushes = pushes  # a push runs once the checkpoint is committed
        try:
            with (
                routed(modeling_utils, safe_save_file=safe_save_file_via(saves)),
                routed(trainer_mod, torch=torch_module_via(saves), safetensors=_safetensors_via(save=saves)),
            ):
                super()._save_checkpoint(model, trial)  # type: ignore[misc]
        except BaseException:
            saves.commit(folder)  # what was started is still waited for (and its error not lost)
            raise
        finally:
            del state.save_to_json
            args.save_total_limit = limit
            self._fastpersist_pushes = None
        should_save = bool(args.should_save)
        best = state.best_model_checkpoint

        def finalize(stats: List[Any]) -> None:
            if os.path.isdir(folder):
                write_crc_sidecar(folder, stats)
                sync_tree(folder)
            for pending, final in deferred:
                os.replace(pending, final)
                fsync_dir(os.path.dirname(final))
            if should_save and limit and limit > 0 and os.path.isfile(os.path.join(folder, STATE_NAME)):
                _rotate(run_dir, limit, [folder, best])

        saves.commit(folder, finalize, with_stats=True)
        if pushes or _told_of_saves(getattr(self, "callback_handler", None)):
            # The push uploads the folder, and callbacks' on_save (W&B's,
            # MLflow's artifact logging...), which the Trainer calls as this
            # returns, read it: its files are durable first (a failure
            # raised, nothing pushed or told).
            saves.wait()
            for p in pushes:
                super()._push_from_checkpoint(p)  # type: ignore[misc]

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        pushes = getattr(self, "_fastpersist_pushes", None)
        if pushes is None:
            super()._push_from_checkpoint(checkpoint_folder)  # type: ignore[misc]
            return
        # Called by the Trainer's _save_checkpoint while the files are written: pushed after the commit.
        from transformers.trainer_utils import HubStrategy

        args: Any = self.args  # type: ignore[attr-defined]
        in_progress = getattr(self, "push_in_progress", None)
        if not self.is_world_process_zero() or args.hub_strategy == HubStrategy.END:  # type: ignore[attr-defined]
            return  # the Trainer pushes nothing then (no wait for it)
        if not args.hub_always_push and in_progress is not None and not in_progress.is_done():
            return  # nor while the last push runs
        pushes.append(checkpoint_folder)

    def fastpersist_wait(self) -> None:
        """Wait until every checkpoint saved so far is committed; raise a
        failed save's error."""
        self._fastpersist.wait()

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        # Before the best model is loaded or the last checkpoints pruned.
        self._fastpersist.wait()
        return super()._finalize_training(*args, **kwargs)  # type: ignore[misc]

    # -- resuming --------------------------------------------------------------

    @contextlib.contextmanager
    def _fastpersist_reading(self) -> Iterator[None]:
        """The Trainer's loads (``torch.load``, safetensors' ``load_file``
        and the sharded loader's) read through fastpersist, CRCs checked."""
        _, trainer_mod, trainer_utils = _framework()

        with (
            routed(trainer_mod, torch=torch_module_via(load=True), safetensors=_safetensors_via(load=True)),
            routed(trainer_utils, torch=torch_module_via(load=True), safe_load_file=safe_load_file_via()),
        ):
            yield

    def _load_from_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        with self._fastpersist_reading():
            return super()._load_from_checkpoint(*args, **kwargs)  # type: ignore[misc]

    def _load_optimizer_and_scheduler(self, *args: Any, **kwargs: Any) -> Any:
        with self._fastpersist_reading():
            return super()._load_optimizer_and_scheduler(*args, **kwargs)  # type: ignore[misc]

    def _load_rng_state(self, *args: Any, **kwargs: Any) -> Any:
        with self._fastpersist_reading():
            return super()._load_rng_state(*args, **kwargs)  # type: ignore[misc]

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        self._fastpersist.wait()
        self._fastpersist_end()  # a train() that raised left its step hook: this one arms afresh
        if resume_from_checkpoint is True:
            out = self.args.output_dir  # type: ignore[attr-defined]
            resume_from_checkpoint = latest_complete_checkpoint(out)
            if resume_from_checkpoint is None:
                raise ValueError(f"No complete checkpoint found in output directory ({out})")
        elif isinstance(resume_from_checkpoint, (str, os.PathLike)):
            p = os.fspath(resume_from_checkpoint)
            if os.path.isdir(p) and not os.path.isfile(os.path.join(p, STATE_NAME)):
                raise ValueError(
                    f"{p} has no {STATE_NAME}: the checkpoint is incomplete (its save did not finish); "
                    "resume from an older one"
                )
        return super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]
