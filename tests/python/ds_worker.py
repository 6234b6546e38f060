"""Runs DeepSpeed scenarios for test_deepspeed.py in a process of its own
(one gloo rank on the CPU accelerator); prints one JSON line of results."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import sys
import zipfile

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1")

import deepspeed  # noqa: E402
import fastpersist  # noqa: E402
import torch  # noqa: E402
from fastpersist.integrations.deepspeed import FastPersistCheckpointEngine, initialize, use_fastpersist  # noqa: E402
from fastpersist.options import EngineOptions, get_engine  # noqa: E402

STEPS = 8


def engine(fastpersist_section=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    cfg = {
        "train_batch_size": 16,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}},
        "zero_optimization": {"stage": 1},
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
    with zipfile.ZipFile(path) as z:
        names = [n for n in z.namelist() if n.endswith("/.storage_alignment")]
        return bool(names) and z.read(names[0]) == b"4096"


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
    step(eng, 3)  # commits step 2
    get_engine(EngineOptions.resolve())[1].set_fault(0, errno.ENOSPC)
    step(eng, 4)
    eng.save_checkpoint(d)
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


if __name__ == "__main__":
    main(sys.argv[1])
