"""DeepSpeed with fastpersist's checkpoint engine, on the CPU.

    DS_ACCELERATOR=cpu python examples/deepspeed_engine.py [OUTPUT_DIR]

One process (gloo); DeepSpeed JIT-builds its CPU comm op on first use (needs
ninja and a C++ compiler; a minute or two, once). The config's
``"fastpersist"`` section selects the engine; checkpoints commit at the next
``engine.step()``, before the optimizer step.
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("DS_ACCELERATOR", "cpu")
ONE_RANK = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"}
for k, v in ONE_RANK.items():
    os.environ.setdefault(k, v)

import torch  # noqa: E402
from fastpersist.integrations import deepspeed as fpds  # noqa: E402


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="fp-deepspeed-")
    model = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.GELU(), torch.nn.Linear(256, 1))
    config = {
        "train_batch_size": 32,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 1},
        "fastpersist": {"mode": "snapshot", "decoupled": True},
    }
    engine, *_ = fpds.initialize(model=model, model_parameters=model.parameters(), config=config)
    for step in range(1, 9):
        loss = engine(torch.randn(32, 16)).pow(2).mean()
        engine.backward(loss)
        engine.step()  # commits the checkpoint saved at the previous step
        if step % 4 == 0:
            engine.save_checkpoint(out)
    engine.destroy()  # commits the last one
    with open(os.path.join(out, "latest")) as f:
        print("latest:", f.read(), sorted(os.listdir(out)))
    engine.load_checkpoint(out)


if __name__ == "__main__":
    main()
