"""Runs DeepSpeed scenarios for test_deepspeed.py in a process of its own
(one gloo rank on the CPU accelerator); prints one JSON line of results.

``ds_worker.py DIR two-ranks`` is one of two ranks (RANK, WORLD_SIZE and
MASTER_PORT set by the caller): the ranks agree on the step at which a tag
is committed. ``ds_worker.py DIR pending``, ``early`` and ``exit``: a tag
still pending when ``load_checkpoint`` reads ``latest``, a save that fails
early, a script that exits with its last tag pending."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import sys
import threading

os.environ.setdefault("DS_ACCELERATOR", "cpu")
if sys.argv[2:] != ["two-ranks"]:  # one rank (also for "prepare", "pending", "early", "exit")
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")

import deepspeed  # noqa: E402
import fastpersist  # noqa: E402
import torch  # noqa: E402
from fastpersist.integrations.deepspeed import FastPersistCheckpointEngine, initialize, use_fastpersist  # noqa: E402
from fastpersist.options import EngineOptions, get_engine  # noqa: E402
from helpers import written_by_fastpersist  # noqa: E402

STEPS = 8


def engine(fastpersist_section=None, stage=1):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    cfg = {
        "train_batch_size": 16,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}},
        "zero_optimization": {"stage": stage},
    }
    if fastpersist_section is not None:
        cfg["fastpersist"] = fastpersist_section
    eng, *_ = initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return eng


def step(eng, i):
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(16, 8, generator=g)
    loss = torch.nn.functional.mse_loss(eng(x), x.sum(1, keepdim=True).sin())
    eng.backward(loss)
    eng.step()
    return loss.item()


def digest(eng):
    h = hashlib.sha256()
    for k, v in eng.module.state_dict().items():
        h.update(k.encode() + v.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def latest(d):
    with open(os.path.join(d, "latest")) as f:
        return f.read()


def ours(path):
    return written_by_fastpersist(path)


def tensors(obj, prefix=""):
    """{path: tensor} of every tensor in nested dicts/lists."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else []
    out = {}
    for k, v in items:
        out.update(tensors(v, f"{prefix}/{k}"))
    return out


def same(a, b):
    a, b = tensors(a), b
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def overlap(tmp, out):
    """Pipelined and decoupled, with the ZeRO optimizer file's save held at
    two gates: before it reads the tensors (gate 1, opened by a timer) and
    after it has read them, before its durable commit (gate 2, opened by
    this thread). The optimizer step must wait for the first gate only;
    ``latest`` must name the tag only once the file is durable."""
    import fastpersist.async_save as async_save

    d = os.path.join(tmp, "overlap")
    eng = engine({"mode": "pipelined"})
    for i in range(1, 3):
        step(eng, i)
    log = []
    gate1, gate2 = threading.Event(), threading.Event()
    real_write = async_save.write_torch_zip

    def gated(obj, path, opts, on_gathered=None, **kw):
        if "optim_states" not in path:
            return real_write(obj, path, opts, on_gathered=on_gathered, **kw)
        gate1.wait()
        log.append("reading optimizer state")

        def gathered():
            log.append("optimizer state read")
            on_gathered()  # the snapshot phase ends: the fence opens
            gate2.wait()  # ... and the durable commit waits here

        return real_write(obj, path, opts, on_gathered=gathered, **kw)

    real_step = eng._take_model_step

    def model_step(*a, **kw):
        log.append(f"optimizer step {eng.global_steps + 1}")
        return real_step(*a, **kw)

    async_save.write_torch_zip = gated
    eng._take_model_step = model_step
    try:
        module_then = {k: v.clone() for k, v in eng.module.state_dict().items()}
        optim_then = {k: v.detach().clone() for k, v in tensors(eng.optimizer.state_dict()).items()}
        eng.save_checkpoint(d)
        log.append("save_checkpoint returned")

        def open_gate1():
            log.append("latest before the read: " + (latest(d) if os.path.exists(os.path.join(d, "latest")) else "-"))
            gate1.set()

        def open_gate2():  # only if the optimizer step waits for the durable commit (it must not)
            if not gate2.is_set():
                log.append("gate 2 opened by the timer")
                gate2.set()

        timer = threading.Timer(1.0, open_gate1)
        timer.start()
        late = threading.Timer(60.0, open_gate2)
        late.daemon = True
        late.start()
        step(eng, 3)  # forward and backward run while the save waits; the optimizer step waits for the read
        out["overlap_latest_after_step3"] = latest(d) if os.path.exists(os.path.join(d, "latest")) else None
        gate2.set()
        late.cancel()
        eng.checkpoint_engine.saves.settle()
        step(eng, 4)  # the tag is durable now: committed in this step
        out["overlap_latest_after_step4"] = latest(d)
        timer.join()
    finally:
        async_save.write_torch_zip = real_write
        gate1.set()
        gate2.set()
    out["overlap_log"] = log
    tag = os.path.join(d, "global_step2")
    saved = torch.load(os.path.join(tag, "zero_pp_rank_0_mp_rank_00_optim_states.pt"), weights_only=False)
    out["overlap_optim_is_the_saved_state"] = same(saved["optimizer_state_dict"], optim_then)
    out["overlap_optim_changed_since"] = not same(eng.optimizer.state_dict(), optim_then)
    model = torch.load(os.path.join(tag, "mp_rank_00_model_states.pt"), weights_only=False)
    out["overlap_module_is_the_saved_state"] = same(model["module"], tensors(module_then))
    out["overlap_files_ours"] = all(ours(os.path.join(tag, n)) for n in os.listdir(tag))
    eng.destroy()


def main(tmp):
    out = {}
    ref = engine()
    out["ref_losses"] = [step(ref, i) for i in range(1, STEPS + 1)]
    out["ref_digest"] = digest(ref)

    for mode in ("snapshot", "pipelined"):
        d = os.path.join(tmp, mode)
        eng = engine({"mode": mode})
        out[f"{mode}_engine"] = type(eng.checkpoint_engine).__name__
        losses = []
        for i in range(1, 5):
            losses.append(step(eng, i))  # decoupled: the previous save commits inside step()
            if i % 2 == 0:
                eng.save_checkpoint(d)
        eng.destroy()  # commits the step-4 checkpoint
        out[f"{mode}_latest"] = latest(d)
        out[f"{mode}_files_ours"] = all(
            ours(os.path.join(d, "global_step4", n)) for n in os.listdir(os.path.join(d, "global_step4"))
        )
        again = engine({"mode": mode})
        again.load_checkpoint(d)
        losses += [step(again, i) for i in range(5, STEPS + 1)]
        out[f"{mode}_losses"] = losses
        out[f"{mode}_digest"] = digest(again)
        again.destroy()

    overlap(tmp, out)

    # Not decoupled, set on an engine: save_checkpoint commits before it returns.
    d = os.path.join(tmp, "sync")
    eng = engine()
    use_fastpersist(eng, decoupled=False)
    step(eng, 1)
    eng.save_checkpoint(d)
    out["sync_latest"] = latest(d)
    out["sync_loaded_step"] = eng.load_checkpoint(d)[1] is not None

    # Disk full: the step-4 save fails; its error comes out of the next step()
    # (the commit); latest still names step 2, which loads.
    d = os.path.join(tmp, "full")
    eng = engine({})
    for i in range(1, 3):
        step(eng, i)
    eng.save_checkpoint(d)
    eng.checkpoint_engine.saves.settle()
    step(eng, 3)  # commits step 2 (durable by now)
    assert latest(d) == "global_step2"
    get_engine(EngineOptions.resolve())[1].set_fault(0, errno.ENOSPC)
    step(eng, 4)
    eng.save_checkpoint(d)
    eng.checkpoint_engine.saves.settle()  # the save has failed: the next step() commits, and raises
    try:
        step(eng, 5)
        out["full_error"] = None
    except fastpersist.WriteError as e:
        out["full_error"] = e.errno
    get_engine(EngineOptions.resolve())[1].set_fault(None)
    out["full_latest"] = latest(d)
    again = engine({})
    path, _ = again.load_checkpoint(d)
    out["full_loaded"] = os.path.basename(os.path.dirname(path)) if path else None
    out["engine_class_ok"] = isinstance(again.checkpoint_engine, FastPersistCheckpointEngine)
    out["ds_version"] = deepspeed.__version__
    print("RESULT " + json.dumps(out), flush=True)


def two_ranks(tmp):
    """Rank 1's optimizer file is held after it has been read, before its
    durable commit: no rank may commit (nor write ``latest``) at step 3,
    although rank 0's files are durable; both commit at step 4."""
    import fastpersist.async_save as async_save

    rank = int(os.environ["RANK"])
    d = os.path.join(tmp, "two")
    eng = engine({"mode": "pipelined"})
    for i in range(1, 3):
        step(eng, i)
    gate = threading.Event()
    real_write = async_save.write_torch_zip

    def gated(obj, path, opts, on_gathered=None, **kw):
        if rank != 1 or "optim_states" not in path:
            return real_write(obj, path, opts, on_gathered=on_gathered, **kw)

        def gathered():
            on_gathered()
            gate.wait()

        return real_write(obj, path, opts, on_gathered=gathered, **kw)

    committed = []
    real_commit = eng.checkpoint_engine.commit

    def commit(info):
        committed.append(eng.global_steps + 1)
        return real_commit(info)

    async_save.write_torch_zip = gated
    eng.checkpoint_engine.commit = commit
    out = {"rank": rank}
    try:
        eng.save_checkpoint(d)
        if rank == 0:
            eng.checkpoint_engine.saves.settle()  # rank 0's files are durable before its step 3
        step(eng, 3)
        out["latest_after_step3"] = latest(d) if os.path.exists(os.path.join(d, "latest")) else None
        gate.set()
        eng.checkpoint_engine.saves.settle()
        step(eng, 4)
        out["latest_after_step4"] = latest(d)
    finally:
        gate.set()
        async_save.write_torch_zip = real_write
    out["committed_at_steps"] = committed
    eng.destroy()
    print("RESULT " + json.dumps(out), flush=True)


def prepare(tmp):
    """The snapshot buffers made ahead of the first checkpoint: with ZeRO
    at ``initialize`` (the optimizer state exists from the start), without
    it right after the first optimizer step; with ``"prepare": false`` at
    the first save. Checkpoints load back exactly, one grown by a 4 MiB
    ``client_state`` tensor after the prepare included."""
    import pytest
    from prepare_spy import PrepareSpy

    mp = pytest.MonkeyPatch()
    spy = PrepareSpy(mp)
    out = {}
    for name, stage, section in (
        ("zero1", 1, {"mode": "snapshot"}),
        ("zero0", 0, {"mode": "snapshot"}),
        ("off", 1, {"mode": "snapshot", "prepare": False}),
    ):
        spy.events.clear()
        d = os.path.join(tmp, name)
        eng = engine(section, stage=stage)
        out[f"{name}_after_init"] = spy.kinds().count("prepare")
        step(eng, 1)
        out[f"{name}_after_step1"] = spy.kinds().count("prepare")
        step(eng, 2)
        eng.save_checkpoint(d, client_state={"n": 1})
        files = spy.kinds().count("save")
        out[f"{name}_files"] = files
        out[f"{name}_first"] = spy.first_checkpoint(files)
        out[f"{name}_prepared"] = spy.prepared_before_first_save(files)
        want = digest(eng)
        extra = torch.arange(1 << 20, dtype=torch.float32)
        step(eng, 3)
        eng.save_checkpoint(d, tag="grown", client_state={"extra": extra})
        grown_digest = digest(eng)
        eng.destroy()
        again = engine({}, stage=stage)
        _, client = again.load_checkpoint(d, tag=f"global_step{2}")
        out[f"{name}_loaded"] = digest(again) == want and client.get("n") == 1
        _, client = again.load_checkpoint(d, tag="grown")
        out[f"{name}_grown"] = digest(again) == grown_digest and torch.equal(client["extra"], extra)
        again.destroy()
    mp.undo()
    print("RESULT " + json.dumps(out), flush=True)


def pending(tmp):
    """Decoupled (the default): ``save_checkpoint`` then ``load_checkpoint``
    at once (no ``step()`` between to commit the tag) loads that tag."""
    out = {}
    d = os.path.join(tmp, "save-load")
    eng = engine({})
    for i in range(1, 3):
        step(eng, i)
    want = digest(eng)
    eng.save_checkpoint(d, client_state={"n": 2})
    step(eng, 3)  # not committed here: its files may not be durable yet
    eng.save_checkpoint(d, tag="last", client_state={"n": 3})
    want_last = digest(eng)
    path, client = eng.load_checkpoint(d)
    out["load_path"] = os.path.basename(os.path.dirname(path)) if path else None
    out["load_client"] = client.get("n") if client else None
    out["load_exact"] = digest(eng) == want_last
    out["load_latest"] = latest(d)
    eng.destroy()
    again = engine({})
    again.load_checkpoint(d, tag="global_step2")
    out["load_step2_exact"] = digest(again) == want
    again.destroy()
    print("RESULT " + json.dumps(out), flush=True)


def early(tmp):
    """A save that fails before its files are written (``client_state``
    that cannot be pickled), or a ``save_checkpoint`` that raises after some
    of its files were saved, is never committed: the next ``step()`` goes
    on, ``latest`` still names the tag before."""
    out = {}
    d = os.path.join(tmp, "early")
    eng = engine({})
    step(eng, 1)
    eng.save_checkpoint(d)
    eng.checkpoint_engine.saves.settle()
    step(eng, 2)  # commits global_step1
    out["early_latest_before"] = latest(d)
    try:
        eng.save_checkpoint(d, client_state={"hook": lambda: None})
        out["early_error"] = None
    except fastpersist.SerializationError:
        out["early_error"] = "SerializationError"
    eng.checkpoint_engine.saves.settle()
    try:
        step(eng, 3)  # the training loop goes on: the failed tag is dropped, not committed
        out["early_step_error"] = None
    except Exception as e:  # noqa: BLE001 - reported
        out["early_step_error"] = repr(e)
    out["early_latest"] = latest(d)

    def broken(*a, **kw):
        raise RuntimeError("injected: the ZeRO optimizer state could not be saved")

    eng._save_zero_checkpoint = broken  # save_checkpoint raises after the model states file was saved
    try:
        eng.save_checkpoint(d, tag="partial")
        out["partial_error"] = None
    except RuntimeError as e:
        out["partial_error"] = str(e)
    del eng._save_zero_checkpoint
    eng.checkpoint_engine.saves.settle()
    step(eng, 4)
    out["partial_latest"] = latest(d)
    eng.destroy()
    out["early_latest_after_destroy"] = latest(d)
    print("RESULT " + json.dumps(out), flush=True)


def exit_pending(tmp):
    """A training script that saves at its end and exits, without
    ``engine.destroy()``: the last tag is committed at exit."""
    d = os.path.join(tmp, "exit")
    eng = engine({})
    for i in range(1, 4):
        step(eng, i)
        if i == 2:
            eng.save_checkpoint(d)  # committed at the next step
    eng.save_checkpoint(d)  # global_step3, pending at exit
    print("RESULT " + json.dumps({"latest_before_exit": latest(d)}), flush=True)


if __name__ == "__main__":
    if sys.argv[2:] == ["two-ranks"]:
        two_ranks(sys.argv[1])
    elif sys.argv[2:] == ["pending"]:
        pending(sys.argv[1])
    elif sys.argv[2:] == ["early"]:
        early(sys.argv[1])
    elif sys.argv[2:] == ["exit"]:
        exit_pending(sys.argv[1])
    elif sys.argv[2:] == ["prepare"]:
        prepare(sys.argv[1])
    else:
        main(sys.argv[1])
