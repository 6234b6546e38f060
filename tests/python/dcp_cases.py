"""Ranks of the DCP tests (test_dcp.py), started with torch.multiprocessing
spawn: gloo on the CPU, or nccl (with gloo for CPU work) when every rank
has a GPU."""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any, Dict

import torch


def full_tensors() -> Dict[str, torch.Tensor]:
    """The unsharded values every scenario saves (the same on every rank)."""
    g = torch.Generator().manual_seed(7)
    return {
        "a": torch.randn(64, 48, generator=g),
        "b": torch.randn(40, 100, generator=g).to(torch.bfloat16),
        "big": torch.randn(256, 1024, generator=g),  # 1 MiB: aligned records
        "r": torch.randn(33, generator=g),
        "plain": torch.arange(1000, dtype=torch.int64),
    }


def device_type(world: int) -> str:
    return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "cpu"


def init(rank: int, world: int, port: int) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dev = device_type(world)
    backend = "cpu:gloo,cuda:nccl" if dev == "cuda" else "gloo"
    if dev == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    return init_device_mesh(dev, (world,))


def sharded(mesh: Any, layout: Dict[str, Any], values: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor

    return {k: distribute_tensor(values[k].to(mesh.device_type), mesh, [p]) for k, p in layout.items()}


def save_layout() -> Dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard

    return {"a": Shard(0), "b": Shard(1), "big": Shard(0), "r": Replicate()}


def load_layout() -> Dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard

    return {"a": Shard(1), "b": Shard(0), "big": Replicate(), "r": Shard(0)}


def save_ranks(rank: int, world: int, port: int, path: str, fail_rank: int) -> None:
    """Save the DTensors sharded one way, then (with ``fail_rank`` >= 0) a
    second save in which that rank's write fails half-way."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from fastpersist.dcp import FastPersistWriter

    mesh = init(rank, world, port)
    try:
        full = full_tensors()
        sd: Dict[str, Any] = sharded(mesh, save_layout(), full)
        sd["plain"] = full["plain"].to(mesh.device_type)
        sd["step"] = 7
        dcp.save(sd, storage_writer=FastPersistWriter(path))
        if fail_rank >= 0:
            from fastpersist.options import EngineOptions, get_engine

            if rank == fail_rank:
                get_engine(EngineOptions.resolve())[1].set_fault(8192, 5)
            sd2 = sharded(mesh, save_layout(), {k: v + 1 for k, v in full.items()})
            try:
                dcp.save(sd2, storage_writer=FastPersistWriter(path))
            except dcp.CheckpointException as e:
                assert "Input/output error" in str(e), str(e)
            else:
                raise AssertionError("the save with a failing rank succeeded")
            finally:
                get_engine(EngineOptions.resolve())[1].set_fault(None)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def load_ranks(rank: int, world: int, port: int, path: str) -> None:
    """Load on ``world`` ranks with another placement, through both readers."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from fastpersist.dcp import FastPersistReader

    mesh = init(rank, world, port)
    try:
        full = full_tensors()
        for reader in (FastPersistReader(path), dcp.FileSystemReader(path)):
            zeros = {k: torch.zeros_like(v) for k, v in full.items()}
            sd: Dict[str, Any] = sharded(mesh, load_layout(), zeros)
            sd["plain"] = torch.zeros_like(full["plain"]).to(mesh.device_type)
            sd["step"] = 0
            dcp.load(sd, storage_reader=reader)
            for k in load_layout():
                got = sd[k].full_tensor().cpu()
                assert torch.equal(got, full[k]), (type(reader).__name__, k)
            assert torch.equal(sd["plain"].cpu(), full["plain"]), type(reader).__name__
            assert sd["step"] == 7
        if isinstance(reader, FastPersistReader):
            assert reader.verified
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(fn: Any, world: int, *args: Any) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_then_exit, args=(fn, world, port, *args), nprocs=world, join=True)


def _then_exit(rank: int, fn: Any, *args: Any) -> None:
    """Run ``fn(rank, *args)``; once it has returned (its process group
    destroyed), leave without the interpreter's finalization, where gloo's
    worker threads can still hold work with Python references and abort
    the process ("terminate called without an active exception",
    pytorch/pytorch#179291). An exception still fails the rank as before."""
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
