"""The Lightning CheckpointIO plugin, driven by a real Trainer (CPU)."""

from __future__ import annotations

import errno
import os
import sys

import fastpersist
import pytest
import torch
from fastpersist.verify import verify_file
from helpers import bits, written_by_fastpersist

pl = pytest.importorskip(
    "lightning.pytorch", reason="lightning is not installed (pip install 'fastpersist[lightning]')"
)
from fastpersist.integrations.lightning import FastPersistCheckpointIO  # noqa: E402

BATCHES = 4  # per epoch


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.losses: list = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(BATCHES * 16, 8, generator=g)
        ds = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
        return torch.utils.data.DataLoader(ds, batch_size=16, shuffle=False)


def trainer(tmp_path, io, callbacks=(), **kw):
    kw.setdefault("max_epochs", 3)
    kw.setdefault("plugins", [io])
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        callbacks=list(callbacks),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        deterministic=True,
        **kw,
    )


class Recording(FastPersistCheckpointIO):
    """Records, after each removal by ModelCheckpoint, the checkpoints on
    disk that verify."""

    def __init__(self, directory, **kw) -> None:
        super().__init__(**kw)
        self.directory = directory
        self.valid_after_remove: list = []

    def remove_checkpoint(self, path) -> None:
        super().remove_checkpoint(path)
        self.valid_after_remove.append(sum(1 for p in ckpts(self.directory) if _verifies(p)))


def ckpts(d):
    return sorted(os.path.join(d, n) for n in os.listdir(d) if n.endswith(".ckpt")) if os.path.isdir(d) else []


def _verifies(p) -> bool:
    try:
        verify_file(p)
        return True
    except Exception:
        return False


def top_k(d, k, **kw):
    return pl.callbacks.ModelCheckpoint(
        dirpath=d, every_n_train_steps=1, save_top_k=k, monitor="step", mode="max", **kw
    )


@pytest.mark.parametrize("mode", ["snapshot", "pipelined"])
def test_topk_fit_then_resume_matches_a_run_that_never_stopped(tmp_path, mode):
    ref = Tiny()
    trainer(tmp_path / "ref", FastPersistCheckpointIO(mode=mode)).fit(ref)

    d = str(tmp_path / "ck")
    io = Recording(d, mode=mode)
    first = Tiny()
    trainer(tmp_path / "a", io, [top_k(d, 2)], max_epochs=1).fit(first)
    files = ckpts(d)
    assert len(files) == 2 and all(_verifies(p) for p in files)
    assert io.valid_after_remove and min(io.valid_after_remove) >= 1  # top-k never left zero
    assert not [n for n in os.listdir(d) if n.endswith(".fptmp")]

    newest = max(files, key=lambda p: torch.load(p, weights_only=True)["global_step"])
    resumed = Tiny()
    trainer(tmp_path / "b", FastPersistCheckpointIO(mode=mode)).fit(resumed, ckpt_path=newest)
    assert first.losses + resumed.losses == ref.losses
    for (k, a), (_, b) in zip(ref.state_dict().items(), resumed.state_dict().items()):
        assert bits(a) == bits(b), k


def test_checkpoint_is_what_torch_load_reads_and_lightning_loads(tmp_path):
    d = str(tmp_path / "ck")
    m = Tiny()
    trainer(tmp_path, FastPersistCheckpointIO(), [top_k(d, 1)], max_epochs=1).fit(m)
    (path,) = ckpts(d)
    got = torch.load(path, weights_only=True)
    assert got["global_step"] == BATCHES and set(got["state_dict"]) == set(m.state_dict())
    # Lightning's own loader reads it too.
    again = Tiny.load_from_checkpoint(path, weights_only=True)
    for k, v in m.state_dict().items():
        assert bits(again.state_dict()[k]) == bits(v)


def test_disk_full_surfaces_at_remove_and_the_previous_checkpoint_survives(tmp_path, engine_fault):
    d = str(tmp_path / "ck")

    class FillDisk(pl.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            # Lightning runs ModelCheckpoint after the other callbacks: at
            # step 3 the checkpoints of steps 1 and 2 are on disk (top-2) and
            # the step-3 save, which would remove step 1's, is next.
            if trainer.global_step == 3:
                io.wait()
                engine_fault(0, errno.ENOSPC)

    io = FastPersistCheckpointIO()
    t = trainer(tmp_path, io, [top_k(d, 2), FillDisk()], max_epochs=1)
    with pytest.raises(fastpersist.WriteError) as ei:
        t.fit(Tiny())
    assert ei.value.errno == errno.ENOSPC
    engine_fault(None)  # the disk has room again: reads through the engine pass
    files = ckpts(d)
    steps = sorted(torch.load(p, weights_only=True)["global_step"] for p in files)
    assert steps == [1, 2]  # nothing was deleted for the failed step-3 save
    assert all(_verifies(p) for p in files)
    assert not [n for n in os.listdir(d) if n.endswith(".fptmp")]


def test_teardown_raises_a_failed_save(tmp_path, engine_fault):
    io = FastPersistCheckpointIO()
    engine_fault(0, errno.ENOSPC)
    io.save_checkpoint({"w": torch.ones(1000)}, tmp_path / "a.ckpt")
    with pytest.raises(fastpersist.WriteError):
        io.teardown()
    io.teardown()  # reported once
    assert not os.path.exists(tmp_path / "a.ckpt")


def test_remove_waits_for_the_save_in_flight(tmp_path):
    io = FastPersistCheckpointIO()
    old = tmp_path / "old.ckpt"
    io.save_checkpoint({"w": torch.zeros(10)}, old)
    io.wait()
    big = torch.randn(16 << 20)  # 64 MiB: still being written when remove is called
    io.save_checkpoint({"w": big}, tmp_path / "new.ckpt")
    big.fill_(0)  # allowed: save_checkpoint returned after the snapshot
    io.remove_checkpoint(old)
    assert not old.exists()
    verify_file(tmp_path / "new.ckpt")  # durable and whole before the old one went
    assert not torch.load(tmp_path / "new.ckpt", weights_only=True)["w"].eq(0).all()


def test_load_honours_map_location_and_weights_only(tmp_path):
    io = FastPersistCheckpointIO(async_save=False)
    p = tmp_path / "a.ckpt"
    io.save_checkpoint({"w": torch.arange(4.0), "obj": torch.nn.Identity()}, p)
    with pytest.raises(Exception, match="weights_only|Unsupported|not allowed|WeightsUnpickler"):
        io.load_checkpoint(p)  # None is torch's default: True
    seen = []

    def where(storage, loc):
        seen.append(loc)
        return storage

    got = io.load_checkpoint(p, map_location=where, weights_only=False)
    assert seen and isinstance(got["obj"], torch.nn.Identity) and torch.equal(got["w"], torch.arange(4.0))
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(tmp_path / "missing.ckpt")


def test_both_import_trees():
    from lightning.fabric.plugins import CheckpointIO

    assert isinstance(FastPersistCheckpointIO(), CheckpointIO)
    fabric = pytest.importorskip("lightning_fabric.plugins", reason="pytorch_lightning is not installed")
    assert isinstance(FastPersistCheckpointIO(), fabric.CheckpointIO)
    ptl = pytest.importorskip("pytorch_lightning", reason="pytorch_lightning is not installed")
    t = ptl.Trainer(accelerator="cpu", plugins=[FastPersistCheckpointIO()], logger=False)
    assert isinstance(t.strategy.checkpoint_io, FastPersistCheckpointIO)


def test_bad_options_fail_at_construction():
    with pytest.raises(ValueError):
        FastPersistCheckpointIO(mode="later")
    with pytest.raises(ValueError):
        FastPersistCheckpointIO(block_size=0)


def test_from_a_lightning_cli_config(tmp_path):
    """The plugin named in a LightningCLI YAML config (class_path and
    init_args) is the Trainer's CheckpointIO, and the checkpoints of a fit
    are fastpersist's (its content-derived serialization id)."""
    pytest.importorskip(
        "jsonargparse", reason="LightningCLI needs jsonargparse (pip install 'lightning[pytorch-extra]')"
    )

    from lightning.pytorch.cli import LightningCLI

    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        f"""
trainer:
  accelerator: cpu
  devices: 1
  max_epochs: 1
  logger: false
  enable_progress_bar: false
  enable_model_summary: false
  default_root_dir: {tmp_path}
  plugins:
    - class_path: fastpersist.integrations.lightning.FastPersistCheckpointIO
      init_args:
        mode: pipelined
        block_size: 262144
"""
    )
    cli = LightningCLI(Tiny, run=False, args=["--config", str(cfg)], save_config_callback=None)
    io = cli.trainer.strategy.checkpoint_io
    assert isinstance(io, FastPersistCheckpointIO)
    assert io.saves.mode == "pipelined" and io.saves.options["block_size"] == 262144
    cli.trainer.fit(cli.model)
    io.wait()
    saved = [p for p in ckpts(os.path.join(tmp_path, "checkpoints")) if _verifies(p)]
    if not saved:  # Lightning's default ModelCheckpoint folder
        saved = [
            os.path.join(r, f)
            for r, _, fs in os.walk(tmp_path)
            for f in fs
            if f.endswith(".ckpt") and _verifies(os.path.join(r, f))
        ]
    assert saved, "no checkpoint written"
    assert written_by_fastpersist(saved[0])
    state = FastPersistCheckpointIO().load_checkpoint(saved[0])
    assert state["epoch"] == 0 and "state_dict" in state


def test_checkpoints_with_one_name_get_versions_as_with_synchronous_saves(tmp_path):
    """ModelCheckpoint names a second checkpoint of the same formatted name
    ``-v1`` because the first file exists; with a save still in flight the
    file does not exist yet. The adapter makes pending saves count, so no
    checkpoint replaces another: the same files as Lightning's own IO."""
    got = {}
    for name, io in (("torch", None), ("fastpersist", FastPersistCheckpointIO(mode="pipelined"))):
        d = tmp_path / name
        cb = pl.callbacks.ModelCheckpoint(
            dirpath=d, filename="fixed", every_n_train_steps=1, save_top_k=3, monitor="step", mode="max"
        )
        t = pl.Trainer(
            accelerator="cpu",
            devices=1,
            plugins=[io] if io is not None else None,
            callbacks=[cb],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=d,
            max_epochs=1,
        )
        t.fit(Tiny())
        if io is not None:
            io.wait()
        got[name] = sorted(os.listdir(d))
        assert len(cb.best_k_models) == 3
        assert all(_verifies(p) for p in cb.best_k_models)
    assert got["fastpersist"] == got["torch"] == ["fixed-v1.ckpt", "fixed-v2.ckpt", "fixed.ckpt"]


# -- the snapshot buffer made ahead of the first checkpoint ---------------------------


def test_snapshot_buffer_is_made_before_the_first_save_and_resume_still_matches(tmp_path, monkeypatch):
    """Fresh run: the optimizer has no state at ``on_train_start``, so the
    buffer is made right after its first step, before the step-1 save,
    which then makes none of its own. Resumed run: the optimizer state is
    loaded, so it is made at the start. Both runs' checkpoints are exact."""
    from prepare_spy import PrepareSpy

    ref = Tiny()
    trainer(tmp_path / "ref", FastPersistCheckpointIO(async_save=False), max_epochs=2).fit(ref)

    spy = PrepareSpy(monkeypatch)
    d = str(tmp_path / "ck")
    first = Tiny()
    steps = []

    class Steps(pl.Callback):
        def on_train_batch_start(self, trainer, *args) -> None:
            steps.append(len(spy.events))

    io = FastPersistCheckpointIO()
    trainer(tmp_path / "a", io, [top_k(d, 1), Steps()], max_epochs=1).fit(first)
    assert spy.prepared_before_first_save(), spy.events
    assert spy.kinds()[: steps[1]].count("prepare") == 1 and "prepare" not in spy.kinds()[: steps[0]]
    (path,) = ckpts(d)
    got = torch.load(path, weights_only=True)
    assert got["global_step"] == BATCHES
    for k, v in first.state_dict().items():
        assert bits(got["state_dict"][k]) == bits(v), k

    spy.events.clear()
    steps.clear()
    resumed = Tiny()
    d2 = str(tmp_path / "ck2")
    trainer(tmp_path / "b", FastPersistCheckpointIO(), [top_k(d2, 1), Steps()], max_epochs=2).fit(
        resumed, ckpt_path=path
    )
    kinds = spy.kinds()
    assert kinds[: steps[0]].count("prepare") == 1, spy.events  # at the start: the optimizer state was loaded
    assert kinds[0] == "prepare" and spy.prepared_before_first_save(), spy.events
    assert first.losses + resumed.losses == ref.losses
    (last,) = ckpts(d2)
    for (k, a), (_, b) in zip(ref.state_dict().items(), torch.load(last, weights_only=True)["state_dict"].items()):
        assert bits(a) == bits(b), k


def test_prepare_false_makes_the_buffer_at_the_first_save(tmp_path, monkeypatch):
    from prepare_spy import PrepareSpy

    spy = PrepareSpy(monkeypatch)
    io = FastPersistCheckpointIO(prepare=False)
    trainer(tmp_path, io, [top_k(str(tmp_path / "ck"), 1)], max_epochs=1).fit(Tiny())
    assert "prepare" not in spy.kinds() and "alloc-save" in spy.first_checkpoint(), spy.events
    spy.events.clear()
    trainer(tmp_path, FastPersistCheckpointIO(mode="pipelined"), [top_k(str(tmp_path / "p"), 1)], max_epochs=1).fit(
        Tiny()
    )
    assert "prepare" not in spy.kinds()  # pipelined saves need no staging buffer


class Growing(Tiny):
    """Adds a 4 MiB buffer to its state at the third step: the checkpoints
    after it are bigger than the buffer prepared at the first step."""

    def training_step(self, batch, batch_idx):
        if batch_idx == 2:
            self.register_buffer("extra", torch.arange(1 << 20, dtype=torch.float32))
        return super().training_step(batch, batch_idx)


def test_a_state_that_grows_after_prepare_is_saved_whole(tmp_path, monkeypatch):
    from prepare_spy import PrepareSpy

    spy = PrepareSpy(monkeypatch)
    d = str(tmp_path / "ck")
    m = Growing()
    trainer(tmp_path, FastPersistCheckpointIO(), [top_k(d, 1)], max_epochs=1).fit(m)
    assert spy.prepared_before_first_save() and "alloc-save" in spy.kinds()  # the bigger state made its own
    (path,) = ckpts(d)
    verify_file(path)
    got = torch.load(path, weights_only=True)["state_dict"]
    assert set(got) == set(m.state_dict()) and "extra" in got
    for k, v in m.state_dict().items():
        assert bits(got[k]) == bits(v), k


@pytest.mark.parametrize(
    "kw, error",
    [({"max_pending": 0}, ValueError), ({"max_pending": "2"}, TypeError), ({"async_save": "no"}, TypeError)],
)
def test_checkpoint_io_arguments_are_checked_at_construction(kw, error):
    """Regression: max_pending=0 or "2" was taken and failed at the first
    save (the saver is made then); async_save="no" was taken as true."""
    with pytest.raises(error, match=next(iter(kw))):
        FastPersistCheckpointIO(**kw)


def test_save_last_link_moves_only_to_a_durable_checkpoint(tmp_path, engine_fault):
    """Regression: with ``ModelCheckpoint(save_last="link")`` Lightning
    moved ``last.ckpt`` to the new checkpoint as soon as
    ``save_checkpoint`` returned, while it was still being written; when
    that save failed, ``last.ckpt`` pointed at a missing file and
    ``fit(ckpt_path="last")`` trained from scratch. The link now moves
    once its target is durable: the failure is raised first and
    ``last.ckpt`` still names the step-2 checkpoint, which resumes."""
    d = str(tmp_path / "ck")

    class FillDisk(pl.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            if trainer.global_step == 3:  # before ModelCheckpoint saves step 3
                io.wait()
                engine_fault(0, errno.ENOSPC)

    io = FastPersistCheckpointIO()
    t = trainer(tmp_path, io, [top_k(d, -1, save_last="link"), FillDisk()], max_steps=6)
    with pytest.raises(fastpersist.WriteError):
        t.fit(Tiny())
    engine_fault(None)
    last = os.path.join(d, "last.ckpt")
    assert os.path.islink(last) and os.path.exists(last), os.listdir(d)
    assert torch.load(last, weights_only=True)["global_step"] == 2
    again = trainer(tmp_path, FastPersistCheckpointIO(), [top_k(d, -1, save_last="link")], max_steps=4)
    resumed = Tiny()
    again.fit(resumed, ckpt_path="last")
    assert len(resumed.losses) == 2  # steps 3 and 4: resumed from step 2, not from scratch
    assert torch.load(last, weights_only=True)["global_step"] == 4


def test_checkpoint_io_pickles_with_its_options_and_not_with_saves_in_flight(tmp_path):
    """Regression: the plugin could not be pickled (its saves hold a
    lock), so ``strategy="ddp_spawn"`` and ``copy.deepcopy`` failed with
    "cannot pickle '_thread.lock' object". A copy keeps the options and
    saves on its own; pickling while a checkpoint is in flight (its
    failure would be lost) is refused with a clear error."""
    import copy
    import pickle

    io = FastPersistCheckpointIO(mode="pipelined", max_pending=3, block_size=262144, prepare=False)
    for other in (pickle.loads(pickle.dumps(io)), copy.deepcopy(io)):
        assert isinstance(other, FastPersistCheckpointIO) and other.saves is not io.saves
        assert (other.saves.mode, other.saves.max_pending, other.saves.options) == ("pipelined", 3, io.saves.options)
        assert not other.prepare_ahead
        other.save_checkpoint({"w": torch.arange(10.0)}, tmp_path / "copy.ckpt")
        other.teardown()
        assert torch.equal(torch.load(tmp_path / "copy.ckpt", weights_only=True)["w"], torch.arange(10.0))
    io.save_checkpoint({"w": torch.ones(10)}, tmp_path / "a.ckpt")
    with pytest.raises(RuntimeError, match="in flight"):
        pickle.dumps(io)
    io.wait()
    assert pickle.loads(pickle.dumps(io)).saves.mode == "pipelined"


def test_ddp_spawn_fit_saves_through_fastpersist(tmp_path):
    """Regression: ``strategy="ddp_spawn"`` pickles the plugin into the
    spawned processes, which failed before training started."""
    d = str(tmp_path / "ck")
    t = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        plugins=[FastPersistCheckpointIO()],
        callbacks=[top_k(d, 1)],
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    t.fit(Tiny())
    (path,) = ckpts(d)
    assert written_by_fastpersist(path) and torch.load(path, weights_only=True)["global_step"] == 2


@pytest.mark.parametrize("url", ["memory://bucket/a.ckpt", "s3://bucket/ck/a.ckpt"])
def test_remote_paths_are_refused_not_written_to_a_local_folder(tmp_path, monkeypatch, url):
    """Regression: a remote (fsspec) path was written to a local folder
    named after its scheme ("memory:", "s3:"). fastpersist writes local
    files: save, load and remove refuse a URL with a ValueError naming it;
    ``file://`` paths are local and taken."""
    monkeypatch.chdir(tmp_path)
    io = FastPersistCheckpointIO()
    with pytest.raises(ValueError, match=url.replace(".", r"\.")):
        io.save_checkpoint({"w": torch.ones(4)}, url)
    with pytest.raises(ValueError, match="TorchCheckpointIO"):
        io.load_checkpoint(url)
    with pytest.raises(ValueError, match="remote"):
        io.remove_checkpoint(url)
    io.teardown()
    assert os.listdir(tmp_path) == []
    io.save_checkpoint({"w": torch.ones(4)}, f"file://{tmp_path}/local.ckpt")
    assert torch.equal(io.load_checkpoint(f"file://{tmp_path}/local.ckpt")["w"], torch.ones(4))
    io.remove_checkpoint(f"file://{tmp_path}/local.ckpt")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("mode", ["snapshot", "pipelined"])
def test_a_checkpoint_saved_after_fit_is_there_when_save_checkpoint_returns(tmp_path, mode, monkeypatch):
    """Regression: ``trainer.save_checkpoint(p)`` after ``fit`` returned at
    once with the save in flight, and nothing waited for it (no teardown
    comes): the usual "save the final model, then reload it" with
    ``load_from_checkpoint`` (which reads the file itself) or torch.load
    failed with FileNotFoundError. Outside a stage the save is now durable
    when the call returns; inside ``fit`` it stays in the background."""
    io = FastPersistCheckpointIO(mode=mode)
    in_fit = []
    real = io.saves.wait

    class Watch(pl.Callback):
        def on_train_epoch_end(self, t, m):
            waits = []
            monkeypatch.setattr(io.saves, "wait", lambda: waits.append(1) or real())
            t.save_checkpoint(tmp_path / "mid.ckpt")
            in_fit.append(len(waits))
            monkeypatch.setattr(io.saves, "wait", real)

    m = Tiny()
    t = trainer(tmp_path, io, [Watch()], max_epochs=1, enable_checkpointing=False)
    t.fit(m)
    assert in_fit == [0]  # not waited for inside fit
    p = tmp_path / "final.ckpt"
    t.save_checkpoint(p)
    assert torch.load(p, weights_only=True)["global_step"] == BATCHES
    again = Tiny.load_from_checkpoint(p, weights_only=True)
    for k, v in m.state_dict().items():
        assert bits(again.state_dict()[k]) == bits(v)


@pytest.mark.parametrize("fail", [False, True])
def test_a_save_in_on_fit_end_is_durable_when_fit_returns_and_its_failure_raises(tmp_path, engine_fault, fail):
    """Regression: Lightning runs ``on_fit_end`` (and ``teardown`` hooks)
    after the CheckpointIO's teardown, while the trainer still counts as
    running: a ``trainer.save_checkpoint`` there was left in flight when
    ``fit`` returned (the file not there yet) and its failure was only
    logged at exit. Saves after the teardown are now waited for at once,
    as Lightning's own CheckpointIO writes them."""
    p = tmp_path / "final.ckpt"

    class AtEnd(pl.Callback):
        def on_fit_end(self, t, m):
            if fail:
                engine_fault(0, errno.ENOSPC)
            t.save_checkpoint(p)

    m = Tiny()
    t = trainer(tmp_path, FastPersistCheckpointIO(), [AtEnd()], max_epochs=1, enable_checkpointing=False)
    if fail:
        with pytest.raises(fastpersist.WriteError):
            t.fit(m)
        assert not p.exists()
        return
    t.fit(m)
    assert torch.load(p, weights_only=True)["global_step"] == BATCHES
    # The next stage's saves are in the background again.
    in_flight = []

    class Mid(pl.Callback):
        def on_train_epoch_end(self, t, m):
            t.save_checkpoint(tmp_path / "mid.ckpt")
            in_flight.append(t.strategy.checkpoint_io.saves.in_flight())

    t2 = trainer(tmp_path, FastPersistCheckpointIO(mode="pipelined"), [Mid()], max_epochs=1, enable_checkpointing=False)
    t2.fit(Tiny())
    assert torch.load(tmp_path / "mid.ckpt", weights_only=True)["global_step"] == BATCHES


def test_a_failed_save_does_not_replace_the_exception_lightning_is_raising(tmp_path, engine_fault):
    """Regression: when training raised while a checkpoint save failed in
    the background, the CheckpointIO's teardown (run by Lightning as it
    handles the exception) raised the save's WriteError: the user's
    exception became its ``__context__`` and the rest of Lightning's
    cleanup (loops, loggers, signal handlers) was skipped. The training's
    exception now comes out, with the save's failure noted on it."""

    class Breaks(Tiny):
        def training_step(self, batch, batch_idx):
            if self.global_step == 2:
                raise ValueError("the loss is nan")
            return super().training_step(batch, batch_idx)

    class SaveThatFails(pl.Callback):
        def on_train_batch_start(self, t, m, batch, i):
            if t.global_step == 2:  # the only save: it fails in the background
                engine_fault(0, errno.ENOSPC)
                t.save_checkpoint(tmp_path / "doomed.ckpt")

    t = trainer(tmp_path, FastPersistCheckpointIO(), [SaveThatFails()], max_epochs=1, enable_checkpointing=False)
    with pytest.raises(ValueError, match="the loss is nan") as e:
        t.fit(Breaks())
    notes = getattr(e.value, "__notes__", [])
    assert any("checkpoint save failed" in n for n in notes) or sys.version_info < (3, 11)
    assert t.state.status.value == "interrupted"


_DDP_SCRIPT = r"""
import os, sys
import torch
import lightning.pytorch as pl
from fastpersist.integrations.lightning import FastPersistCheckpointIO

class Wide(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(2048, 2048)
    def training_step(self, batch, i):
        return self.net(batch[0]).pow(2).mean()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)
    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 2048)), batch_size=4)

root = sys.argv[1]
t = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", plugins=[FastPersistCheckpointIO()], logger=False,
               enable_progress_bar=False, enable_model_summary=False, default_root_dir=root, max_steps=1,
               enable_checkpointing=False)
t.fit(Wide())
p = os.path.join(root, "final.ckpt")
t.save_checkpoint(p)
print(f"rank {t.global_rank} sees {os.path.exists(p)}", flush=True)
Wide.load_from_checkpoint(p)
t.strategy.barrier()
"""


def test_ddp_save_checkpoint_after_fit_is_there_on_every_rank(tmp_path):
    """Regression: with DDP, Lightning's save_checkpoint ends with a
    barrier after its synchronous write; the wait for fastpersist's save
    came after that barrier, so rank 1 returned before rank 0's file
    existed and its load failed with FileNotFoundError. Every rank now
    waits at a barrier after the save is durable."""
    import subprocess

    script = tmp_path / "ddp_save.py"
    script.write_text(_DDP_SCRIPT)
    r = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    import re

    # (the two processes' lines may run together)
    assert sorted(re.findall(r"rank (\d) sees (\w+)", r.stdout)) == [("0", "True"), ("1", "True")], r.stdout


def test_teardown_inside_the_callers_own_except_still_raises_a_failed_save(tmp_path, engine_fault):
    """Regression (review): the teardown took any exception being handled
    for one Lightning was raising, so a fit run inside the caller's own
    ``except`` (a retry) had its failed save only logged. Only an exception
    raised since the stage began counts."""
    p = tmp_path / "final.ckpt"

    class AtEnd(pl.Callback):
        def on_train_end(self, t, m):
            engine_fault(0, errno.ENOSPC)
            t.save_checkpoint(p)  # in flight when the teardown waits

    t = trainer(tmp_path, FastPersistCheckpointIO(), [AtEnd()], max_epochs=1, enable_checkpointing=False)
    try:
        raise KeyError("the first attempt failed")
    except KeyError:
        with pytest.raises(fastpersist.WriteError):
            t.fit(Tiny())  # the retry
    assert not p.exists()


_DDP_FAIL_SCRIPT = _DDP_SCRIPT.replace(
    "t.save_checkpoint(p)\n",
    "import errno\n"
    "from fastpersist.options import EngineOptions, get_engine\n"
    "get_engine(EngineOptions.resolve())[1].set_fault(0, errno.ENOSPC)\n"
    "try:\n"
    "    t.save_checkpoint(p)\n"
    "    print(f'rank {t.global_rank} saved', flush=True)\n"
    "except Exception as e:\n"
    "    print(f'rank {t.global_rank} raised {type(e).__name__}', flush=True)\n"
    "sys.exit(0)\n",
)


def test_ddp_a_save_after_fit_that_fails_raises_on_every_rank(tmp_path):
    """Regression (review): after a stage, rank 0's failed save raised
    there, before the barrier every rank waits at: the other ranks waited
    in it until the group's timeout. Every rank now learns rank 0's outcome
    and raises."""
    import re
    import subprocess

    assert "sys.exit(0)" in _DDP_FAIL_SCRIPT
    script = tmp_path / "ddp_fail.py"
    script.write_text(_DDP_FAIL_SCRIPT)
    r = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    got = sorted(re.findall(r"rank (\d) (saved|raised \w+)", r.stdout))
    assert got == [("0", "raised WriteError"), ("1", "raised DistributedCheckpointError")], r.stdout + r.stderr[-3000:]


def test_an_interrupted_wait_still_reports_the_failure_before_a_removal(tmp_path, monkeypatch):
    """Regression (found in a hunt): ``BackgroundSaves.wait()`` took the
    checkpoints in flight out of its list before it waited for them; a
    Ctrl-C during that wait dropped them, every later wait returned at
    once, and ``remove_checkpoint`` (which deletes an older checkpoint only
    once the newer one is durable) deleted the last good checkpoint while
    the newer one had failed. Those not waited for are put back."""
    import fastpersist.integrations.common as common

    a, b = tmp_path / "epoch=0.ckpt", tmp_path / "epoch=1.ckpt"
    io = FastPersistCheckpointIO(mode="snapshot")
    io.save_checkpoint({"w": torch.ones(4)}, a)
    io.wait()
    b.mkdir()  # the newer checkpoint's commit fails: its target is a directory
    io.save_checkpoint({"w": torch.zeros(1000)}, b)
    real, calls = common.future_error, []

    def interrupted(f, timeout=None):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt  # Ctrl-C while remove_checkpoint waits
        return real(f, timeout)

    monkeypatch.setattr(common, "future_error", interrupted)
    with pytest.raises(KeyboardInterrupt):
        io.remove_checkpoint(a)
    monkeypatch.undo()
    with pytest.raises(fastpersist.WriteError):
        io.remove_checkpoint(a)  # the newer one failed: the older one stays
    assert a.is_file()


def test_an_interrupted_wait_keeps_a_failure_it_had_not_raised_yet(tmp_path, monkeypatch):
    """Regression (found in a read of the fix above): a wait interrupted
    after it had found one checkpoint's failure, while it waited for the
    next, put back only the one it waited for: the failure was dropped,
    and the next wait returned as if both were durable."""
    import fastpersist.integrations.common as common

    saves = common.BackgroundSaves(mode="snapshot")
    (tmp_path / "a.pt").mkdir()  # the first checkpoint's commit fails: its target is a directory
    saves.save({"w": torch.ones(10)}, str(tmp_path / "a.pt"))
    saves.commit("a")
    saves.save({"w": torch.ones(10)}, str(tmp_path / "b.pt"))
    saves.commit("b")
    saves.settle()
    real, calls = common.future_error, []

    def interrupted(f, timeout=None):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C while waiting for the second
        return real(f, timeout)

    monkeypatch.setattr(common, "future_error", interrupted)
    with pytest.raises(KeyboardInterrupt):
        saves.wait()
    monkeypatch.undo()
    with pytest.raises(fastpersist.WriteError):
        saves.wait()
    saves.close()


def test_loggers_are_told_of_a_checkpoint_once_it_is_durable(tmp_path):
    """Regression (found in a hunt): ``ModelCheckpoint`` tells the loggers
    of a checkpoint (W&B's and MLflow's ``log_model``, which scan the
    folder for checkpoints to upload) as soon as ``save_checkpoint``
    returns, when an asynchronous save's file is not there yet: a logger
    that scans found nothing. Its call is now held until the checkpoint is
    durable."""
    from lightning.pytorch.loggers.logger import Logger

    d = tmp_path / "ck"
    seen: list = []

    class Scanning(Logger):
        name, version = "scan", 0
        experiment = None

        def log_metrics(self, *a, **k) -> None:
            pass

        def log_hyperparams(self, *a, **k) -> None:
            pass

        def after_save_checkpoint(self, checkpoint_callback) -> None:
            files = [p for p in ckpts(d) if _verifies(p)]
            seen.append((os.path.basename(checkpoint_callback._last_checkpoint_saved), len(files)))

    io = FastPersistCheckpointIO()
    t = trainer(tmp_path, io, [top_k(str(d), -1)], max_epochs=1)
    t.loggers = [Scanning()]
    t.fit(Tiny())
    assert len(seen) == BATCHES, seen
    # Each call finds its own checkpoint durable, and every one before it.
    assert all(n >= i for i, (_, n) in enumerate(seen, 1)), seen


def test_a_slurm_requeue_finds_its_checkpoint_written(tmp_path, monkeypatch):
    """Regression (found in a hunt): Lightning's SLURM auto-requeue saves
    ``hpc_ckpt_<n>.ckpt`` and requeues the job at once (SLURM then kills
    this one); the asynchronous save was still a temporary file when the
    requeue ran. That save now returns once it is durable."""
    import signal

    from lightning.pytorch.plugins.environments import SLURMEnvironment

    found: list = []

    def requeue(cmd, *a, **k):  # what scontrol would find when the job is requeued
        found.append(sorted(n for n in os.listdir(tmp_path) if "hpc_ckpt" in n))
        return 0

    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_JOB_NAME", "test")
    monkeypatch.setattr("lightning.pytorch.trainer.connectors.signal_connector.call", requeue)

    class Signal(pl.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            if trainer.global_step == 2 and not found:
                os.kill(os.getpid(), signal.SIGUSR1)

    io = FastPersistCheckpointIO()
    t = trainer(tmp_path, io, [Signal()], max_epochs=1, plugins=[io, SLURMEnvironment(auto_requeue=True)])
    old = signal.getsignal(signal.SIGUSR1)
    try:
        t.fit(Tiny())
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert found == [["hpc_ckpt_1.ckpt"]], found
    assert _verifies(tmp_path / "hpc_ckpt_1.ckpt")


def test_a_fabric_save_that_fails_raises(tmp_path, engine_fault):
    """Regression (found in a hunt): Fabric has no stage and no teardown to
    wait at: a failed asynchronous ``fabric.save`` was only logged at exit
    (the script ended with status 0 and no checkpoint). ``fabric.save`` now
    returns once the checkpoint is durable, and a failure raises there."""
    import lightning as L

    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[FastPersistCheckpointIO()])
    model = torch.nn.Linear(8, 8)
    fabric.save(tmp_path / "a.ckpt", {"model": model})
    assert _verifies(tmp_path / "a.ckpt")  # (there when save returns)
    engine_fault(0, errno.ENOSPC)
    with pytest.raises(fastpersist.WriteError):
        fabric.save(tmp_path / "b.ckpt", {"model": model})
    assert not (tmp_path / "b.ckpt").exists()


class _Recorder:
    """A logger's events, in order."""

    @staticmethod
    def logger(events: list) -> pl.loggers.Logger:
        from lightning.pytorch.loggers.logger import Logger

        class Rec(Logger):
            name, version = "rec", 0

            @property
            def experiment(self):
                return None

            def log_metrics(self, *a, **k) -> None:
                pass

            def log_hyperparams(self, *a, **k) -> None:
                pass

            def after_save_checkpoint(self, cb) -> None:
                p = cb._last_checkpoint_saved
                events.append(("after_save", os.path.basename(p), os.path.isfile(p)))

            def finalize(self, status) -> None:
                events.append(("finalize", status))

        return Rec()


@pytest.mark.parametrize("how", ["a callback raises", "a save fails"])
def test_loggers_hear_of_no_failed_save_and_nothing_after_they_finalize(tmp_path, engine_fault, how):
    """Regression (found in review): the loggers' held calls went out after
    Lightning had finalized them as "failed" (a stage that raised), and a
    logger was told of a checkpoint whose save had failed (the file never
    there)."""
    d = str(tmp_path / "ck")
    events: list = []

    class Cb(pl.Callback):
        def on_train_batch_end(self, trainer, *a) -> None:
            if trainer.global_step == 3:
                if how == "a save fails":
                    io.wait()
                    engine_fault(0, errno.ENOSPC)
                else:
                    raise RuntimeError("the user's own error")

    io = FastPersistCheckpointIO()
    t = trainer(tmp_path, io, [Cb(), top_k(d, 2)], max_epochs=1)
    t.loggers = [_Recorder.logger(events)]
    with pytest.raises((RuntimeError, fastpersist.WriteError)):
        t.fit(Tiny())
    engine_fault(None)
    done = events.index(("finalize", "failed"))
    assert all(e[0] == "finalize" for e in events[done:]), events
    assert all(e[2] for e in events if e[0] == "after_save"), events  # (each told of a file that is there)


def test_a_loggers_own_hook_on_its_instance_is_kept_and_called(tmp_path):
    """Regression (found in review): a hook set on a logger instance
    (``logger.after_save_checkpoint = ...``) was replaced for the save's
    call, then deleted: never called, and gone."""
    from lightning.pytorch.loggers import CSVLogger

    d = str(tmp_path / "ck")
    logger = CSVLogger(str(tmp_path / "logs"))
    calls: list = []
    logger.after_save_checkpoint = lambda cb: calls.append(os.path.isfile(cb._last_checkpoint_saved))
    t = trainer(tmp_path, FastPersistCheckpointIO(), [top_k(d, -1)], max_epochs=1)
    t.loggers = [logger]
    t.fit(Tiny())
    assert calls == [True] * BATCHES, calls
    assert "after_save_checkpoint" in vars(logger)
