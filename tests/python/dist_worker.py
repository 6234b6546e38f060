"""One rank of a distributed test (run by test_distributed.py as a process)."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta


def state(seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    base = torch.randn(300_000, generator=g)
    return {
        "w": torch.randn(1000, 999, generator=g),
        "b": torch.randn(4097, generator=g).to(torch.bfloat16),
        "base": base,
        "view": base[10:5000],
        "n": seed,
        "many": [torch.randn(int(n), generator=g) for n in torch.randint(1, 5000, (50,), generator=g)],
    }


def main() -> None:  # noqa: C901 - one branch per scenario
    scenario, rank, world, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    import fastpersist
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    result = {"rank": rank, "ok": True}
    try:
        if scenario == "replicated":
            st = fastpersist.write_state_dict(state(0), os.path.join(out, "ckpt.pt"), group=dist.group.WORLD)
            result["bytes"] = st.bytes
        elif scenario == "async":
            f = fastpersist.save_async(state(0), os.path.join(out, "ckpt.pt"), group=dist.group.WORLD)
            f.wait_snapshot()
            result["bytes"] = f.result(timeout=120).bytes
        elif scenario == "busy":
            # Training collectives on the main thread while the save's own
            # collectives run in the background: never on the same group.
            import torch

            f = fastpersist.save_async(state(0), os.path.join(out, "ckpt.pt"), group=dist.group.WORLD)
            total = 0.0
            for _ in range(200):
                t = torch.ones(1000)
                dist.all_reduce(t)
                total += float(t[0])
            result["bytes"] = f.result(timeout=120).bytes
            result["sum"] = total
        elif scenario == "mesh":
            # 2 x 2: tensor-parallel rank tp = rank % 2, data-parallel groups
            # {0, 2} and {1, 3}; each data-parallel group saves its replica.
            dp = [dist.new_group([0, 2]), dist.new_group([1, 3])]
            tp = rank % 2
            for round_ in range(2):  # the second save reuses the checkpoint groups
                f = fastpersist.save_async(state(tp), os.path.join(out, f"tp{tp}.pt"), group=dp[tp])
                f.wait_snapshot()
                result["bytes"] = f.result(timeout=120).bytes
        elif scenario == "sharded":
            d = os.path.join(out, "sharded")
            for round_ in range(2):  # a second save replaces the first
                fastpersist.write_state_dict(state(100 * round_ + rank), d, group=dist.group.WORLD, sharded=True)
            mine = fastpersist.read_state_dict(d, group=dist.group.WORLD)
            result["n"] = mine["n"]
        elif scenario == "fail":
            # rank 1's part fails with EIO half-way; nothing may be committed
            from fastpersist.options import EngineOptions, get_engine
            from fastpersist.torch_zip import plan_torch_save

            if rank == 1:  # an offset inside rank 1's part (the second quarter of the file)
                at = plan_torch_save(state(0)).file_len * 3 // (2 * world)
                get_engine(EngineOptions.resolve())[1].set_fault(at, 5)
            fastpersist.write_state_dict(state(0), os.path.join(out, "ckpt.pt"), group=dist.group.WORLD)
        elif scenario == "sharded-apart":
            # The last rank is given another directory (or: the same path,
            # on a disk of its own): nothing may be committed, nor the
            # previous checkpoint lost.
            d = os.path.join(out, "sharded" if rank != world - 1 else "elsewhere")
            os.makedirs(d, exist_ok=True)
            try:
                fastpersist.write_state_dict(state(200 + rank), d, group=dist.group.WORLD, sharded=True)
                result["raised"] = None
            except fastpersist.DistributedCheckpointError as e:
                result["raised"] = str(e)
        elif scenario == "fail-sharded":
            obj = state(rank) if rank != world - 1 else {"f": lambda: 0}
            fastpersist.write_state_dict(obj, os.path.join(out, "sharded"), group=dist.group.WORLD, sharded=True)
        elif scenario in ("changed", "changed-sharded", "changed-warn"):
            # rank 1 updates a tensor in place (no fence) before its
            # background save has read it: the save fails on every rank
            # (or, with on_change="warn", commits with a warning).
            import threading
            import warnings

            from fastpersist.async_save import AsyncSaver

            sharded = scenario == "changed-sharded"
            path = os.path.join(out, "sharded" if sharded else "ckpt.pt")
            st = state(rank if sharded else 0)
            saver = AsyncSaver()
            gate = threading.Event()
            saver._write.submit(gate.wait)  # the save's background work waits for the update
            on_change = "warn" if scenario == "changed-warn" else "error"
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                f = saver.save(st, path, group=dist.group.WORLD, sharded=sharded, on_change=on_change)
                if rank == 1:
                    st["w"].add_(1)
                gate.set()
                try:
                    result["bytes"] = f.result(timeout=120).bytes
                finally:
                    result["warnings"] = [str(w.message) for w in seen if "changed" in str(w.message)]
                    saver.close()
        elif scenario == "mismatch":
            fastpersist.write_state_dict(state(rank), os.path.join(out, "ckpt.pt"), group=dist.group.WORLD)
        else:
            raise SystemExit(f"unknown scenario {scenario}")
    except Exception as e:  # noqa: BLE001 - reported to the test
        result = {
            "rank": rank,
            "ok": False,
            "type": type(e).__name__,
            "error": str(e),
            "tensor_changed": isinstance(e, fastpersist.TensorChangedError),
            "distributed": isinstance(e, fastpersist.DistributedCheckpointError),
        }
    with open(os.path.join(out, f"result-{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()  # no rank leaves while another still talks to it
    # Skip torch/gloo's C++ teardown: with several ranks it can race a peer's
    # closing sockets and abort ("terminate called without an active
    # exception") after all the work is done and reported.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
