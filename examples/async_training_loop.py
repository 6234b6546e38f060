"""A tiny CPU training loop checkpointed in the background, then resumed.

    python examples/async_training_loop.py [OUTPUT_DIR]

``fastpersist.Checkpointer`` in pipelined mode: ``ckpt.step(step, state)``
after each ``optimizer.step()`` starts a background save every ``--every``
iterations (no copy of the tensors: the write streams them to disk), and
``ckpt.fence()`` before the next ``optimizer.step()`` waits until that save
has read them, so the file holds the state as of its step. Then a new
Checkpointer on the same directory resumes with ``load_latest()``: the
restored model and optimizer must equal the ones saved, and training on from
there must give exactly the losses the first run had. Exits with status 1 on
any mismatch.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Dict, List, Tuple

import fastpersist
import torch

DIM, STEPS = 32, 40


def make() -> Tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def batch(step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The data of one step (a function of the step, so a resumed run sees the same)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(64, DIM, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, ckpt=None) -> float:
    x, y = batch(step)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    if ckpt is not None:
        ckpt.fence()  # the save in flight has read the tensors: they may change now
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def clone(o):
    return o.detach().clone() if isinstance(o, torch.Tensor) else o


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Dict:
    """A copy of what the checkpoint of this step must hold."""
    osd = opt.state_dict()
    return {
        "model": {k: clone(v) for k, v in model.state_dict().items()},
        "optim": {k: {n: clone(t) for n, t in st.items()} for k, st in osd["state"].items()},
    }


def differences(expected: Dict, model_sd: Dict, optim_sd: Dict) -> List[str]:
    errs = [f"model.{k}" for k, v in expected["model"].items() if not torch.equal(v, model_sd[k])]
    for k, st in expected["optim"].items():
        for n, t in st.items():
            u = optim_sd["state"][k][n]
            if not (torch.equal(t, u) if isinstance(t, torch.Tensor) else t == u):
                errs.append(f"optim.state[{k}].{n}")
    return errs


def run(out_dir: str, every: int) -> int:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # leave a core to the background save (and make the run reproducible)
    model, opt = make()
    saved: Dict[int, Dict] = {}  # what each checkpoint must hold
    losses: Dict[int, float] = {}

    with fastpersist.Checkpointer(out_dir, every=every, keep_last=2, mode="pipelined") as ckpt:
        for step in range(STEPS):
            losses[step] = train_step(model, opt, step, ckpt)
            state = {"model": model.state_dict(), "optim": opt.state_dict()}
            if ckpt.step(step, state) is not None:  # this step checkpoints (in the background)
                saved[step] = snapshot(model, opt)
    # leaving the with-block waited for the last save to be committed
    files = sorted(n for n in os.listdir(out_dir) if n.endswith(".pt"))
    print(
        f"trained {STEPS} steps (loss {losses[0]:.4f} -> {losses[STEPS - 1]:.4f}); "
        f"checkpointed steps {sorted(saved)}, kept {files} in {out_dir}"
    )

    errors: List[str] = []
    latest = fastpersist.Checkpointer(out_dir).load_latest()  # newest checkpoint whose CRCs verify
    if latest is None:
        print("MISMATCH: no checkpoint to resume from", file=sys.stderr)
        return 1
    step, state = latest
    if step != max(saved):
        errors.append(f"load_latest() gave step {step}, the last checkpoint was step {max(saved)}")
    else:
        model2, opt2 = make()
        model2.load_state_dict(state["model"])
        opt2.load_state_dict(state["optim"])
        errors += [
            f"{k} differs from the saved state"
            for k in differences(saved[step], model2.state_dict(), opt2.state_dict())
        ]
        print(f"resumed from step {step}: model and optimizer state equal to what was saved")
        resumed = {s: train_step(model2, opt2, s) for s in range(step + 1, STEPS)}
        bad = [s for s, loss in resumed.items() if loss != losses[s]]
        if bad:
            errors.append(f"the resumed run's losses differ at steps {bad}")
        print(
            f"trained steps {step + 1}..{STEPS - 1} again from the checkpoint: "
            f"{'the same' if not bad else 'DIFFERENT'} losses as the first run"
        )

    for e in errors:
        print("MISMATCH:", e, file=sys.stderr)
    print("FAILED" if errors else "OK: resumed exactly")
    return 1 if errors else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", nargs="?", help="checkpoint directory (default: a temporary directory, removed after)")
    ap.add_argument("--every", type=int, default=7, help="checkpoint interval in steps (default 7)")
    args = ap.parse_args()
    if args.out_dir:
        return run(args.out_dir, args.every)
    with tempfile.TemporaryDirectory(prefix="fastpersist-example-") as d:
        return run(d, args.every)


if __name__ == "__main__":
    sys.exit(main())
