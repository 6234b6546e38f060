"""How long a training step is blocked by a checkpoint, per framework: the
framework's default writer against fastpersist's adapter, on the same state
(a model's weights plus AdamW state, ``--size`` MiB in all).

    python benches/frameworks_bench.py [--size 512] [--rounds 3] [--dir DIR]

For each framework and writer: *blocked* is the time the save call keeps the
training thread; *durable* is the time until every byte is on the device
(the default writers never fsync: their time to durable includes an fsync of
what they wrote, done here). Reported as medians and as ratios default /
fastpersist, after one first save per writer, whose blocked time is printed
apart (it includes the writer's one-time set-up). fastpersist's adapters run
twice: as they are, and with their snapshot buffers made by the adapter's
prepare (as at the start of training: ``FastPersistCheckpointIO.prepare``,
``BackgroundSaves.prepare`` as the Trainer mixin and Accelerate hooks call it,
the DeepSpeed engine's ``saves.prepare`` as ``prepare_for`` calls it) before
the first save, waited for and not timed; the first save's blocked time with
and without it is printed as a ratio. The writers run through the
framework's own extension point:

* Lightning: ``TorchCheckpointIO``, ``AsyncCheckpointIO(TorchCheckpointIO)``
  and ``FastPersistCheckpointIO`` (``save_checkpoint``, then ``teardown``).
* Hugging Face Trainer / Accelerate: the files their checkpoint writes, by the
  calls they make (``safe_save_file`` for the weights, ``torch.save`` for the
  optimizer), against the same calls routed through fastpersist (what
  ``FastPersistTrainerMixin`` and ``register(accelerator)`` do).
* DeepSpeed: ``TorchCheckpointEngine`` and ``FastPersistCheckpointEngine``
  (``create``, ``save``, ``commit``); DeepSpeed's ``FastCheckpointEngine``
  when its aio op and config can be made here (else the reason is printed).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

#: fastpersist's adapter with its snapshot buffers made before the first save.
PREPARED = "fastpersist, prepared"


def state(mib: int) -> Tuple[Dict[str, torch.Tensor], Dict]:
    """Weights and AdamW state of about ``mib`` MiB (weights are a third)."""
    n = max(1, (mib << 20) // 12 // (1024 * 1024))
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(n)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    return model.state_dict(), opt.state_dict()


def fsync_tree(root: str) -> None:
    for d, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        fd = os.open(d, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def measure(
    save: Callable[[str], None],
    finish: Callable[[str], None],
    base: str,
    rounds: int,
    before: Optional[Callable[[], None]] = None,
) -> Tuple[float, float, float]:
    """Medians of (blocked, durable) over ``rounds`` after a first save, and
    the first save's blocked time on its own: a writer's first save pays
    for its set-up (fastpersist: the engine's arena and the snapshot
    pool's host buffer, allocated and faulted in once, unless ``before``,
    run first and not timed, made it), which a median of two rounds would
    mix in."""
    blocked: List[float] = []
    durable: List[float] = []
    first = 0.0
    if before is not None:
        before()
    for r in range(rounds + 1):
        d = os.path.join(base, f"r{r}")
        os.makedirs(d)
        t0 = time.perf_counter()
        save(d)
        t1 = time.perf_counter()
        finish(d)
        t2 = time.perf_counter()
        if r == 0:
            first = t1 - t0
        else:
            blocked.append(t1 - t0)
            durable.append(t2 - t0)
        shutil.rmtree(d)
    return statistics.median(blocked), statistics.median(durable), first


def lightning_rows(weights, optim, base, rounds):
    from fastpersist.integrations.lightning import FastPersistCheckpointIO
    from lightning.fabric.plugins import TorchCheckpointIO
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    ckpt = {"state_dict": weights, "optimizer_states": [optim], "global_step": 1}
    out = {}
    for name, make in [
        ("TorchCheckpointIO", TorchCheckpointIO),
        ("AsyncCheckpointIO", lambda: AsyncCheckpointIO(TorchCheckpointIO())),
        ("fastpersist", lambda: FastPersistCheckpointIO(prepare=False)),
        (PREPARED, FastPersistCheckpointIO),
    ]:
        io = make()

        def finish(d, io=io, name=name):
            io.teardown()
            if not name.startswith("fastpersist"):
                fsync_tree(d)

        before = (lambda io=io: io.prepare(ckpt, background=False)) if name == PREPARED else None
        out[name] = measure(
            lambda d, io=io: io.save_checkpoint(ckpt, os.path.join(d, "a.ckpt")), finish, base, rounds, before
        )
    return out


def hf_rows(weights, optim, base, rounds):
    from fastpersist.integrations.common import BackgroundSaves, safe_save_file_via, torch_save_via
    from safetensors.torch import save_file

    def default(d):
        save_file(weights, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
        torch.save(optim, os.path.join(d, "optimizer.pt"))

    out = {"safe_save_file + torch.save": measure(default, fsync_tree, base, rounds)}
    for name in ("fastpersist", PREPARED):
        saves = BackgroundSaves("snapshot", max_pending=64)
        st, ts = safe_save_file_via(saves), torch_save_via(saves)

        def fast(d, saves=saves, st=st, ts=ts):
            st(weights, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
            ts(optim, os.path.join(d, "optimizer.pt"))
            saves.commit(d)

        before = (lambda saves=saves: saves.prepare([weights, optim], background=False)) if name == PREPARED else None
        out[name] = measure(fast, lambda d, saves=saves: saves.wait(), base, rounds, before)
    return out


def _deepspeed_fast_engine():
    """DeepSpeed's own FastPersist engine, as its config would make it:
    ``"checkpoint": {"writer": {"type": "fast"}}`` parsed by DeepSpeed's
    own parsers, one data-parallel writer, its aio op built (libaio, ninja).
    Its I/O buffer is pinned with ``Tensor.pin_memory()``, which needs an
    NVIDIA driver: on a CPU-only machine it cannot be made (the reason is
    printed)."""
    import types

    from deepspeed.runtime.checkpoint_engine import FastCheckpointEngine
    from deepspeed.runtime.model_checkpointing.config import get_checkpoint_config
    from deepspeed.runtime.model_checkpointing.data_parallel_writer_factory import DataParallelWriterConfig
    from deepspeed.runtime.swap_tensor.aio_config import get_aio_config

    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    cfg = {"checkpoint": {"writer": {"type": "fast"}}}
    params = types.SimpleNamespace(checkpoint_config=get_checkpoint_config(cfg), aio_config=get_aio_config(cfg))
    dp = DataParallelWriterConfig(world_size=1, rank=0, global_rank=0, local_rank=0, pure_dp=True)
    return FastCheckpointEngine(params, dp, False)


def deepspeed_rows(weights, optim, base, rounds):
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo
    from fastpersist.integrations.deepspeed import FastPersistCheckpointEngine

    sd = {"module": weights, "optimizer": optim, "global_steps": 1}
    out = {}
    engines = [
        ("TorchCheckpointEngine", TorchCheckpointEngine()),
        ("fastpersist", FastPersistCheckpointEngine(prepare=False)),
        (PREPARED, FastPersistCheckpointEngine()),
    ]
    try:
        engines.insert(1, ("FastCheckpointEngine", _deepspeed_fast_engine()))
    except Exception as e:  # noqa: BLE001 - reported
        print(f"  (DeepSpeed FastCheckpointEngine unavailable here: {type(e).__name__}: {e})")
    for name, eng in engines:
        holder = {}

        def save(d, eng=eng, holder=holder):
            holder["info"] = info = CheckpointCommitInfo(tag="t", save_dir=d, save_latest=False)
            eng.create(info)
            eng.save(sd, os.path.join(d, "mp_rank_00_model_states.pt"))

        def finish(d, eng=eng, name=name, holder=holder):
            eng.commit(holder["info"])
            if not name.startswith("fastpersist"):
                fsync_tree(d)

        before = (lambda eng=eng: eng.saves.prepare([sd], background=False)) if name == PREPARED else None
        out[name] = measure(save, finish, base, rounds, before)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=512, help="state size in MiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    base = tempfile.mkdtemp(prefix="fp-frameworks-", dir=a.dir)
    weights, optim = state(a.size)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    nbytes += sum(
        v.numel() * v.element_size() for s in optim["state"].values() for v in s.values() if torch.is_tensor(v)
    )
    print(f"state: {nbytes / 2**20:.0f} MiB, {a.rounds} round(s), in {base}")
    suites = [("Lightning", lightning_rows), ("HF Trainer / Accelerate", hf_rows), ("DeepSpeed", deepspeed_rows)]
    try:
        for title, fn in suites:
            try:
                rows = fn(weights, optim, base, a.rounds)
            except ImportError as e:
                print(f"{title}: skipped ({e})")
                continue
            fp_b, fp_d, fp_f = rows["fastpersist"]
            print(f"{title}:")
            for name, (b, d, f) in rows.items():
                ratio = "" if name.startswith("fastpersist") else f"   blocked x{b / fp_b:.1f}, durable x{d / fp_d:.2f}"
                print(
                    f"  {name:30s} blocked {b * 1e3:8.1f} ms   durable {d * 1e3:8.1f} ms"
                    f"   (first save blocked {f * 1e3:7.1f} ms){ratio}"
                )
            if PREPARED in rows:
                pf = rows[PREPARED][2]
                print(
                    f"  first save blocked: {fp_f * 1e3:.1f} ms as is, {pf * 1e3:.1f} ms prepared"
                    f" (x{fp_f / pf:.1f} shorter)"
                )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
