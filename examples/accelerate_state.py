"""Accelerate with fastpersist: ``save_state``/``load_state`` in the background.

python examples/accelerate_state.py [OUTPUT_DIR]
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from fastpersist.integrations.accelerate import register


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="fp-accelerate-")
    project = ProjectConfiguration(out, automatic_checkpoint_naming=True, total_limit=2)
    acc = Accelerator(cpu=True, project_config=project)
    model = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.GELU(), torch.nn.Linear(256, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    fp = register(acc)
    for step in range(1, 9):
        x = torch.randn(32, 16)
        loss = model(x).pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        if step % 2 == 0:
            acc.save_state()  # returns after the snapshot; the write overlaps the next steps
    fp.wait()
    print("checkpoints:", sorted(os.listdir(os.path.join(out, "checkpoints"))))
    acc.load_state()  # the newest, read back with checksums
    fp.unregister()


if __name__ == "__main__":
    main()
