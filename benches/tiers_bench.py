#!/usr/bin/env python3
"""Tiers benchmark: recovery time from each tier, and what staging costs.

Recovery: one GPT-like checkpoint is committed by a ``Checkpointer`` and
staged to a shared directory and to an object store; then, for each tier,
the local copy is made unusable in the way that tier exists for and
``Checkpointer.load_latest()`` is timed in a fresh Checkpointer (page cache
dropped first):

* local: the checkpoint is on the node's own disk;
* shared: the local directory was lost; it comes from ``stage_dir`` (copied
  in through the durable commit, verified, loaded);
* object: the local directory was lost; it comes from an S3-compatible store
  (downloaded, verified, committed, loaded). The store is moto's server on
  127.0.0.1, in memory: its figure is a floor of what S3 costs (no network
  latency, no bandwidth limit), not S3's.
* peer: two ranks (two processes, gloo over loopback, ``nodes=[0, 1]``,
  ``replicate=1``), each with its own checkpoint of ``--size``; rank 1's
  whole directory is lost and both ranks call ``load_latest()`` (rank 1's
  copy comes from rank 0's replica). Compared with the same two ranks
  recovering from their own directories ("local, 2 ranks").

Each is reported in seconds and as a ratio to the local recovery, medians of
``--rounds`` rounds (the tiers rotate in each round).

Training overhead: a CPU training loop (an MLP and AdamW) checkpointed every
``--every`` iterations with the Checkpointer, without staging, with a shared
``stage_dir`` and with an object-store ``stage_dir``; the median iteration
time of each as a ratio to the same loop without checkpoints. Then the same
loop on two ranks (two processes sharing this machine's cores), with and
without ``replicate=1``.

    python benches/tiers_bench.py [--size 1GiB] [--rounds 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

import fastpersist
import torch
from fastpersist.bench import drop_cache, gpt_state_dict, median, nbytes, parse_size

BUCKET = "fastpersist-bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Moto:
    """moto's S3 server on 127.0.0.1 (a separate process)."""

    def __init__(self) -> None:
        port = free_port()
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.url = f"http://127.0.0.1:{port}"
        self.opts = {"client_kwargs": {"endpoint_url": self.url}, "skip_instance_cache": True}
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                time.sleep(0.1)
        else:
            self.close()
            raise SystemExit("moto's server did not start (pip install 'moto[server]')")
        import s3fs

        s3fs.S3FileSystem(**self.opts).mkdir(BUCKET)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def recover(local: str, **kw: object) -> float:
    """Seconds for a fresh Checkpointer to load the newest checkpoint."""
    t0 = time.perf_counter()
    with fastpersist.Checkpointer(local, every=1, **kw) as ck:  # type: ignore[arg-type]
        got = ck.load_latest()
    seconds = time.perf_counter() - t0
    assert got is not None and got[0] == 1, "nothing recovered"
    return seconds


def bench_recovery(root: str, size: int, rounds: int, store: Optional[Moto]) -> Dict[str, List[float]]:
    sd = gpt_state_dict(size)
    local, shared = os.path.join(root, "local"), os.path.join(root, "shared")
    url = f"s3://{BUCKET}/recovery"
    with fastpersist.Checkpointer(local, every=1, stage_dir=shared) as ck:
        ck.save(1, sd)
    if store is not None:
        with fastpersist.Checkpointer(
            os.path.join(root, "up"), every=1, stage_dir=url, storage_options=store.opts
        ) as ck:
            ck.save(1, sd)
    del sd
    keep = os.path.join(root, "keep")
    shutil.copytree(local, keep)

    def fresh_local() -> None:
        shutil.rmtree(local, ignore_errors=True)
        os.makedirs(local)

    tiers: Dict[str, Callable[[], float]] = {}

    def t_local() -> float:
        fresh_local()
        for n in os.listdir(keep):
            shutil.copy(os.path.join(keep, n), os.path.join(local, n))
        drop_cache(local)
        return recover(local)

    def t_shared() -> float:
        fresh_local()
        drop_cache(shared)
        return recover(local, stage_dir=shared)

    tiers["local"] = t_local
    tiers["shared"] = t_shared
    if store is not None:

        def t_object() -> float:
            fresh_local()
            return recover(local, stage_dir=url, storage_options=store.opts)

        tiers["object"] = t_object
    out: Dict[str, List[float]] = {k: [] for k in tiers}
    order = list(tiers)
    for r in range(rounds):
        for k in order[r % len(order) :] + order[: r % len(order)]:
            out[k].append(tiers[k]())
    return out


def bench_overhead(
    root: str, iters: int, every: int, rounds: int, store: Optional[Moto], dim: int
) -> Dict[str, List[float]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(64, dim)
    model(x).sum().backward()
    opt.step()  # the optimizer state exists from here on

    def loop(ck: Optional[fastpersist.Checkpointer], start: int) -> List[float]:
        times = []
        for i in range(start, start + iters):
            t0 = time.perf_counter()
            opt.zero_grad()
            model(x).sum().backward()
            if ck is not None:
                ck.fence()
            opt.step()
            if ck is not None and i % every == 0:
                ck.save(i, {"model": model.state_dict(), "optim": opt.state_dict()})
            times.append(time.perf_counter() - t0)
        return times

    configs: Dict[str, Callable[[str], Optional[fastpersist.Checkpointer]]] = {
        "none": lambda d: None,
        "local": lambda d: fastpersist.Checkpointer(os.path.join(d, "l"), every=every),
        "local+shared": lambda d: fastpersist.Checkpointer(
            os.path.join(d, "l"), every=every, stage_dir=os.path.join(d, "s")
        ),
    }
    if store is not None:
        configs["local+object"] = lambda d: fastpersist.Checkpointer(
            os.path.join(d, "l"),
            every=every,
            stage_dir=f"s3://{BUCKET}/{os.path.basename(d)}",
            storage_options=store.opts,
        )
    out: Dict[str, List[float]] = {k: [] for k in configs}
    order = list(configs)
    step = 0
    for r in range(rounds):
        for k in order[r % len(order) :] + order[: r % len(order)]:
            d = tempfile.mkdtemp(prefix=f"ovh-{r}-", dir=root)
            ck = configs[k](d)
            try:
                out[k].append(median(loop(ck, step)))
            finally:
                if ck is not None:
                    ck.close()
            step += iters
            shutil.rmtree(d, ignore_errors=True)
    return out


def _mlp(dim: int) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(64, dim)
    model(x).sum().backward()
    opt.step()
    return model, opt, x


def worker(argv: List[str]) -> None:
    """One rank of the peer rounds: ``--worker JOB RANK PORT ROOT JSON``."""
    job, rank, port, root, args = argv[0], int(argv[1]), argv[2], argv[3], json.loads(argv[4])
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=600)
    )
    d = os.path.join(root, f"rank-{rank}")
    kw: Dict[str, Any] = {"group": dist.group.WORLD, "nodes": [0, 1]}
    out: Dict[str, Any] = {}
    if job == "save":
        sd = gpt_state_dict(args["size"], seed=rank)
        with fastpersist.Checkpointer(d, every=1, replicate=1, **kw) as ck:
            ck.save(1, sd)
    elif job == "recover":
        drop_cache(d) if os.path.isdir(d) else None
        dist.barrier()
        t0 = time.perf_counter()
        with fastpersist.Checkpointer(d, every=1, replicate=1, **kw) as ck:
            got = ck.load_latest()
        out["seconds"] = time.perf_counter() - t0
        out["step"] = got[0] if got else None
    elif job == "train":
        model, opt, x = _mlp(args["dim"])
        rep = args["replicate"]
        peer = {"replicate": 1, **kw} if rep else {"group": dist.group.WORLD}
        ck = fastpersist.Checkpointer(d, every=args["every"], **peer)
        times = []
        try:
            for i in range(args["iters"]):
                t0 = time.perf_counter()
                opt.zero_grad()
                model(x).sum().backward()
                ck.fence()
                opt.step()
                if i % args["every"] == 0:
                    ck.save(i, {"model": model.state_dict(), "optim": opt.state_dict()})
                times.append(time.perf_counter() - t0)
        finally:
            ck.close()
        out["median"] = median(times)
    with open(os.path.join(root, f"{job}-{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # skip gloo's teardown races


def run_pair(job: str, root: str, args: Dict[str, Any]) -> List[Dict[str, Any]]:
    port = str(free_port())
    procs = [
        subprocess.Popen([sys.executable, __file__, "--worker", job, str(r), port, root, json.dumps(args)])
        for r in range(2)
    ]
    for p in procs:
        if p.wait(timeout=1800) != 0:
            raise SystemExit(f"peer {job} worker failed")
    return [json.load(open(os.path.join(root, f"{job}-{r}.json"))) for r in range(2)]


def bench_peer(root: str, size: int, rounds: int) -> Dict[str, List[float]]:
    """Recovery of two ranks from their own directories, and with rank 1's
    directory lost (its checkpoint from rank 0's replica)."""
    os.makedirs(root, exist_ok=True)
    run_pair("save", root, {"size": size})
    keep = os.path.join(root, "keep")
    os.makedirs(keep)
    for r in range(2):
        shutil.copytree(os.path.join(root, f"rank-{r}"), os.path.join(keep, f"rank-{r}"))
    out: Dict[str, List[float]] = {"local, 2 ranks": [], "peer": []}
    for i in range(rounds):
        for k in list(out) if i % 2 == 0 else list(out)[::-1]:
            for r in range(2):
                shutil.rmtree(os.path.join(root, f"rank-{r}"), ignore_errors=True)
                if k != "peer" or r == 0:
                    shutil.copytree(os.path.join(keep, f"rank-{r}"), os.path.join(root, f"rank-{r}"))
            res = run_pair("recover", root, {})
            assert all(x["step"] == 1 for x in res), res
            out[k].append(res[1]["seconds"])
    return out


def bench_peer_overhead(root: str, iters: int, every: int, rounds: int, dim: int) -> Dict[str, List[float]]:
    out: Dict[str, List[float]] = {"2 ranks, local": [], "2 ranks, local+peer": []}
    for i in range(rounds):
        for k in list(out) if i % 2 == 0 else list(out)[::-1]:
            d = tempfile.mkdtemp(prefix="peer-train-", dir=root)
            res = run_pair("train", d, {"dim": dim, "iters": iters, "every": every, "replicate": "peer" in k})
            out[k].append(median([x["median"] for x in res]))
            shutil.rmtree(d, ignore_errors=True)
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GiB", help="GPT-like checkpoint size for recovery")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30, help="training iterations per round and configuration")
    ap.add_argument("--every", type=int, default=5, help="checkpoint interval of the training loop")
    ap.add_argument("--dim", type=int, default=1024, help="width of the training loop's 8-layer MLP")
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--no-object", action="store_true", help="skip the object-store tier (no moto)")
    ap.add_argument("--no-peer", action="store_true", help="skip the peer tier (two gloo processes)")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="fastpersist-tiers-", dir=args.dir)
    store = None
    if not args.no_object:
        try:
            store = Moto()
        except (SystemExit, ImportError) as e:
            print(f"object tier skipped: {e}")
    try:
        size = parse_size(args.size)
        print(
            f"recovery of a GPT-like checkpoint of {nbytes(gpt_state_dict(size)) / 2**30:.2f} GiB, {args.rounds} rounds"
        )
        rec = bench_recovery(os.path.join(root, "rec"), size, args.rounds, store)
        base = median(rec["local"])
        if not args.no_peer:
            peer = bench_peer(os.path.join(root, "peer"), size, args.rounds)
            shutil.rmtree(os.path.join(root, "peer"), ignore_errors=True)
            rec.update(peer)
        print(f"{'tier':<16} {'median s':>9} {'x local':>8}")
        for k, v in rec.items():
            print(f"{k:<16} {median(v):9.3f} {median(v) / base:8.2f}")
        if not args.no_peer:
            print(f"peer / local with the same 2 ranks: {median(rec['peer']) / median(rec['local, 2 ranks']):.2f}")
        shutil.rmtree(os.path.join(root, "rec"), ignore_errors=True)
        print(f"\ntraining loop (CPU), checkpoint every {args.every} iterations, {args.rounds} rounds of {args.iters}")
        ovh = bench_overhead(root, args.iters, args.every, args.rounds, store, args.dim)
        b = median(ovh["none"])
        print(f"{'staging':<20} {'median ms/iter':>15} {'x none':>7}")
        for k, v in ovh.items():
            print(f"{k:<20} {median(v) * 1e3:15.1f} {median(v) / b:7.3f}")
        if not args.no_peer:
            po = bench_peer_overhead(root, args.iters, args.every, args.rounds, args.dim)
            b2 = median(po["2 ranks, local"])
            for k, v in po.items():
                print(f"{k:<20} {median(v) * 1e3:15.1f} {median(v) / b2:7.3f} (x 2 ranks, local)")
    finally:
        if store is not None:
            store.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
