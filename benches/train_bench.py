#!/usr/bin/env python3
"""Training-loop benchmark: the cost of checkpointing every iteration.

A small GPT (torch.nn: embeddings, pre-norm transformer blocks, tied head),
AdamW, trained on generated tokens, on the CPU (default) or with
``--device cuda`` on a GPU (then the checkpoint is in GPU memory). Model and optimizer state are
checkpointed every iteration by each method in turn, in one run:

* none (the baseline)
* torch.save every iteration (synchronous, fsynced)
* torch DCP async_save (where it works without a process group)
* fastpersist.save_async, mode="snapshot" and mode="pipelined", fenced with
  ``wait_snapshot()`` before ``optimizer.step()`` (background threads at
  the default niceness, 10), and pipelined at normal priority (nice 0)
* fastpersist.Checkpointer(every="auto", max_overhead=0.035), which picks the
  interval itself (then: the interval chosen and the recovery time)

Methods alternate in blocks of ``--iters`` iterations over ``--rounds``
rounds; we report the median iteration time, its overhead over the
baseline, the p90, the checkpoint size, and the *paired* overhead: the
median over rounds of each round's median against the baseline's median in
the same round (a machine whose speed drifts between rounds moves both
blocks of a round alike; the overall medians mix rounds).

    python benches/train_bench.py [--layers 4] [--dim 384] [--iters 20] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import warnings
from typing import Callable, Dict, List, Optional

import fastpersist
import torch
import torch.nn as nn

warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed")
warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, ctx: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(ctx, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight
        self.register_buffer("mask", torch.triu(torch.full((ctx, ctx), float("-inf")), 1))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for b in self.blocks:
            x = b(x, self.mask[:t, :t])
        return self.head(self.ln(x))


def paired_overhead(base: List[List[float]], method: List[List[float]]) -> float:
    """The median over rounds of a round's median iteration against the
    baseline's median in the same round, minus one (rounds where either ran
    no timed iteration are left out; 0.0 where none is left)."""
    ratios = [statistics.median(m) / statistics.median(b) - 1 for b, m in zip(base, method) if b and m]
    return statistics.median(ratios) if ratios else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20, help="iterations per method per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cpu", help="where to train: cpu (default) or cuda")
    ap.add_argument(
        "--methods", default=None, help="comma-separated substrings of the methods to run (the baseline always runs)"
    )
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device(args.device)
    model = GPT(args.vocab, args.dim, args.layers, args.heads, args.ctx).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    data = torch.randint(0, args.vocab, (64, args.batch, args.ctx + 1), device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def state(step: int) -> dict:
        return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}

    with tempfile.TemporaryDirectory(prefix="fastpersist-train-", dir=args.dir or os.getcwd()) as d:
        pending: Dict[str, Optional[object]] = {"fut": None}

        def ckpt_none(step: int) -> None:
            pass

        def ckpt_torch(step: int) -> None:
            with open(os.path.join(d, "torch.pt"), "wb") as f:
                torch.save(state(step), f)
                f.flush()
                os.fsync(f.fileno())

        def ckpt_dcp(step: int) -> None:
            import torch.distributed.checkpoint as dcp

            prev = pending["fut"]
            if prev is not None:
                prev.result()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                pending["fut"] = dcp.async_save(
                    state(step), storage_writer=dcp.FileSystemWriter(os.path.join(d, f"dcp{step % 2}"), sync_files=True)
                )

        from fastpersist.async_save import AsyncSaver

        normal_priority = AsyncSaver(nice=0)

        def fp(mode: str, saver: Optional[AsyncSaver] = None) -> Callable[[int], None]:
            save = saver.save if saver is not None else fastpersist.save_async

            def ckpt(step: int) -> None:
                pending["fut"] = save(state(step), os.path.join(d, f"fp-{mode}.pt"), mode=mode)

            return ckpt

        manager = fastpersist.Checkpointer(os.path.join(d, "managed"), every="auto", max_overhead=0.035, keep_last=2)

        def ckpt_manager(step: int) -> None:
            manager.step(step, state(step))

        methods: Dict[str, Callable[[int], None]] = {
            "none": ckpt_none,
            "torch.save": ckpt_torch,
            "torch DCP async_save": ckpt_dcp,
            "fastpersist snapshot": fp("snapshot"),
            "fastpersist pipelined": fp("pipelined"),
            "fastpersist pipelined, nice 0": fp("pipelined", normal_priority),
            "fastpersist Checkpointer(auto)": ckpt_manager,
        }
        if args.methods:
            wanted = [w.strip() for w in args.methods.split(",")]
            methods = {k: v for k, v in methods.items() if k == "none" or any(w in k for w in wanted)}
        by_round: Dict[str, List[List[float]]] = {k: [] for k in methods}
        step = 0
        broken = set()
        for _ in range(args.rounds):
            for name, ckpt in methods.items():
                if name in broken:
                    continue
                by_round[name].append([])
                manager.pause()  # other methods ran since its last block
                for i in range(args.iters):
                    batch = data[step % len(data)]
                    t0 = time.perf_counter()
                    logits = model(batch[:, :-1])
                    loss = nn.functional.cross_entropy(logits.reshape(-1, args.vocab), batch[:, 1:].reshape(-1))
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    fut = pending["fut"]
                    if isinstance(fut, fastpersist.CheckpointFuture):
                        fut.wait_snapshot()  # the fence before the optimizer step
                    if ckpt is ckpt_manager:
                        manager.fence()
                    opt.step()
                    try:
                        ckpt(step)
                    except Exception as e:  # noqa: BLE001
                        print(f"{name}: failed ({type(e).__name__}: {e}); skipped")
                        broken.add(name)
                        break
                    sync()  # the iteration's GPU work is part of its time
                    if i > 0:  # the first iteration of a block warms up
                        by_round[name][-1].append(time.perf_counter() - t0)
                    step += 1
                fut = pending["fut"]
                if fut is not None:
                    fut.result()
                    pending["fut"] = None
        manager.close()
        t0 = time.perf_counter()
        restored = fastpersist.Checkpointer(os.path.join(d, "managed")).load_latest()
        recovery = time.perf_counter() - t0
        size = (
            os.path.getsize(os.path.join(d, "fp-pipelined.pt"))
            if os.path.exists(os.path.join(d, "fp-pipelined.pt"))
            else 0
        )
        times = {k: [t for block in rounds for t in block] for k, rounds in by_round.items()}
        base = statistics.median(times["none"])
        nparams = sum(p.numel() for p in model.parameters())
        print(
            f"GPT: {args.layers} layers, dim {args.dim}, {nparams / 1e6:.1f} M parameters, "
            f"checkpoint {size / 2**20:.0f} MiB (model + AdamW), batch {args.batch}x{args.ctx}, "
            f"{torch.get_num_threads()} threads, on {torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}"
        )
        print(f"{'method':<32} {'median ms':>10} {'p90 ms':>8} {'overhead':>9} {'paired':>8}")
        res = {"params": nparams, "checkpoint_bytes": size, "methods": {}}
        for name, ts in times.items():
            if not ts:
                continue
            med = statistics.median(ts)
            p90 = sorted(ts)[max(0, -(-9 * len(ts) // 10) - 1)]  # nearest rank
            paired = paired_overhead(by_round["none"], by_round[name])
            res["methods"][name] = {
                "median_s": med,
                "p90_s": p90,
                "overhead": med / base - 1,
                "paired_overhead": paired,
                "iters": ts,
            }
            print(
                f"{name:<32} {med * 1e3:>10.1f} {p90 * 1e3:>8.1f} {100 * (med / base - 1):>8.1f}% {100 * paired:>7.1f}%"
            )
        if times.get("fastpersist Checkpointer(auto)"):
            print(
                f"Checkpointer(auto): interval chosen {manager.tuner.interval} iterations "
                f"(clean iteration {1e3 * (manager.tuner.clean_time or 0):.0f} ms, checkpoint cost "
                f"{1e3 * (manager.tuner.cost or 0):.0f} ms, write {manager.tuner.write_time or 0:.2f} s); "
                f"recovery (load_latest of step {restored[0] if restored else None}) {recovery:.2f} s"
            )
            res["manager"] = {"interval": manager.tuner.interval, "recovery_s": recovery}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
