"""Save a small model's state dict with fastpersist and load it back two ways.

    python examples/save_and_load.py [OUTPUT_DIR]

Writes ``model.pt`` (a temporary directory by default) with
``fastpersist.write_state_dict``, reads it with ``fastpersist.read_state_dict``
(every record's CRC32 checked) and with plain ``torch.load``, and checks that
both give back exactly the tensors that were saved and that a fresh model
loaded from the file computes the same outputs. Exits with status 1 on any
mismatch.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import fastpersist
import torch


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.GELU(),
        torch.nn.LayerNorm(256),
        torch.nn.Linear(256, 256),
        torch.nn.BatchNorm1d(256),  # buffers too: running stats and an int64 counter
        torch.nn.Linear(256, 10),
    )


def compare(name: str, expected: dict, got: dict) -> list:
    """Differences between two state dicts (keys, dtypes, shapes, values)."""
    errors = []
    if list(expected) != list(got):
        errors.append(f"{name}: keys differ: {sorted(set(expected) ^ set(got))}")
    for k, t in expected.items():
        u = got.get(k)
        if not isinstance(u, torch.Tensor):
            errors.append(f"{name}: {k} is {type(u).__name__}, not a tensor")
        elif u.dtype != t.dtype or u.shape != t.shape or not torch.equal(u, t):
            errors.append(f"{name}: {k} differs ({u.dtype} {tuple(u.shape)} vs {t.dtype} {tuple(t.shape)})")
    return errors


def run(out_dir: str) -> int:
    torch.manual_seed(0)
    model = make_model()
    model(torch.randn(32, 64))  # one training-mode pass: BatchNorm's running stats move
    model.eval()
    state = model.state_dict()
    state["head.bf16"] = torch.randn(10, 256).to(torch.bfloat16)  # any dtype torch.save accepts
    path = os.path.join(out_dir, "model.pt")

    stats = fastpersist.write_state_dict(state, path)
    print(
        f"fastpersist {fastpersist.__version__}: wrote {len(state)} tensors, {stats.bytes} bytes to {path} "
        f"in {stats.seconds * 1e3:.1f} ms (O_DIRECT: {stats.direct}, io_uring: {stats.io_uring})"
    )

    errors = []
    loaded = fastpersist.read_state_dict(path)
    errors += compare("read_state_dict", state, loaded)
    print(f"read_state_dict: {len(loaded)} tensors, CRC32 of every record verified")

    plain = torch.load(path, weights_only=True)
    errors += compare("torch.load", state, plain)
    print(f"torch.load: {len(plain)} tensors")

    fresh = make_model().eval()
    loaded.pop("head.bf16")
    fresh.load_state_dict(loaded)
    x = torch.randn(8, 64)
    with torch.no_grad():
        same = torch.equal(model(x), fresh(x))
    if not same:
        errors.append("a model loaded from the file computes different outputs")
    print(f"a fresh model loaded from the file computes {'the same' if same else 'DIFFERENT'} outputs")

    for e in errors:
        print("MISMATCH:", e, file=sys.stderr)
    print("FAILED" if errors else "OK: all tensors identical")
    return 1 if errors else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", nargs="?", help="where to write (default: a temporary directory, removed after)")
    args = ap.parse_args()
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        return run(args.out_dir)
    with tempfile.TemporaryDirectory(prefix="fastpersist-example-") as d:
        return run(d)


if __name__ == "__main__":
    sys.exit(main())
