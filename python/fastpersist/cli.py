"""The ``fastpersist`` command line.

    fastpersist inspect PATH [--json]     records or tensors: names, dtypes, shapes, bytes, alignment
    fastpersist verify [--json] PATH...   every CRC32 and the structure; exit 0 only when all is well
    fastpersist ls DIR [--verify] [--stage-dir DIR]
                                          checkpoints of a Checkpointer directory: step, size, tier, status
                                          (and the replicas it holds for other ranks)
    fastpersist bench [--size] [--dir] [--rounds] [--progress]
                                          write and read benchmarks against fio and torch

Exit status: 0 success, 1 a checkpoint is corrupt, 2 bad usage or a file that
cannot be opened.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import stat
import sys
import tempfile
from typing import Dict, List, Optional, Tuple

EXIT_OK, EXIT_CORRUPT, EXIT_USAGE = 0, 1, 2


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def cmd_inspect(args: argparse.Namespace) -> int:
    from .verify import inspect_file

    fmt, recs = inspect_file(args.path)
    if fmt == "torch-legacy":
        return _inspect_legacy(args)
    if args.json:
        doc: Dict[str, object] = {"format": fmt, "records": [r.__dict__ for r in recs]}
        if fmt == "torch":  # (as the text lists them; the legacy format's JSON has them too)
            tensors = _torch_tensors(args.path)
            doc["tensors"] = None if tensors is None else [_tensor_row(*t) for t in tensors]
        json.dump(doc, sys.stdout, indent=1)
        print()
        return EXIT_OK
    total = sum(r.bytes for r in recs)
    print(
        f"{args.path}: {fmt} checkpoint, {len(recs)} {'records' if fmt == 'torch' else 'tensors'}, "
        f"{_human(total)} of data, {_human(os.path.getsize(args.path))} on disk"
    )
    if fmt == "torch":
        print(f"{'record':<40} {'offset':>12} {'bytes':>12} {'align':>6} {'crc32':>9}")
        for r in recs:
            print(f"{r.name:<40} {r.offset:>12} {r.bytes:>12} {r.alignment:>6} {r.crc32:08x}")
        tensors = _torch_tensors(args.path)
        if tensors:
            print(f"\n{'tensor':<40} {'dtype':<16} {'shape':<20} {'bytes':>12}")
            for key, dtype, shape, nbytes in tensors:
                print(f"{key:<40} {dtype:<16} {shape!s:<20} {nbytes:>12}")
    else:
        print(f"{'tensor':<40} {'dtype':<16} {'shape':<20} {'bytes':>12} {'align':>6}")
        for r in recs:
            print(f"{r.name:<40} {r.dtype or '':<16} {list(r.shape or ())!s:<20} {r.bytes:>12} {r.alignment:>6}")
    return EXIT_OK


def _tensor_row(key: str, dtype: str, shape: object, nbytes: int) -> Dict[str, object]:
    """One tensor of ``inspect --json``'s ``tensors``."""
    return {"key": key, "dtype": dtype, "shape": shape, "bytes": nbytes}


def _inspect_legacy(args: argparse.Namespace) -> int:
    """torch's legacy (non-zip) format has no records to list: its tensors,
    from a weights-only load."""
    tensors = _torch_tensors(args.path, mmap=False)
    if args.json:
        rows = None if tensors is None else [_tensor_row(*t) for t in tensors]
        json.dump({"format": "torch-legacy", "records": [], "tensors": rows}, sys.stdout, indent=1)
        print()
        return EXIT_OK
    on_disk = _human(os.path.getsize(args.path))
    if tensors is None:
        print(
            f"{args.path}: torch-legacy checkpoint (no checksums in this format), {on_disk} on disk; "
            "its objects cannot be loaded weights-only, so its tensors are not listed"
        )
        return EXIT_OK
    total = sum(n for _, _, _, n in tensors)
    print(
        f"{args.path}: torch-legacy checkpoint (no checksums in this format), {len(tensors)} tensors, "
        f"{_human(total)} of data, {on_disk} on disk"
    )
    print(f"{'tensor':<40} {'dtype':<16} {'shape':<20} {'bytes':>12}")
    for key, dtype, shape, nbytes in tensors:
        print(f"{key:<40} {dtype:<16} {shape!s:<20} {nbytes:>12}")
    return EXIT_OK


def _torch_tensors(path: str, mmap: bool = True) -> Optional[list]:
    """Key paths, dtypes and shapes of the tensors of a torch checkpoint,
    from a lazy (mmap) load, or a plain one (``mmap=False``: torch's legacy
    format); None when it cannot be loaded weights-only."""
    import torch

    try:
        obj = torch.load(path, mmap=mmap, weights_only=True, map_location="cpu")
    except Exception:  # noqa: BLE001 - inspect still shows the records
        return None
    out = []
    stack = [("", obj)]
    seen: set = set()  # each container walked once: a pickle can make cycles, and share one container many times
    while stack:
        key, o = stack.pop()
        if isinstance(o, (dict, list, tuple)):
            if id(o) in seen:
                continue
            seen.add(id(o))
        if isinstance(o, torch.Tensor):
            out.append(
                (key or "<root>", str(o.dtype).replace("torch.", ""), list(o.shape), o.numel() * o.element_size())
            )
        elif isinstance(o, dict):
            stack.extend((f"{key}.{k}" if key else str(k), v) for k, v in reversed(list(o.items())))
        elif isinstance(o, (list, tuple)):
            stack.extend((f"{key}[{i}]", v) for i, v in reversed(list(enumerate(o))))
    return out


def cmd_verify(args: argparse.Namespace) -> int:
    results = []
    for path in args.paths:
        results.append(_verify_one(path))
        if not args.json:
            print(_verify_line(results[-1]), flush=True)  # (each file as it is checked)
    if args.json:
        json.dump(results, sys.stdout, indent=1)
        print()
    return max((_VERIFY_STATUS[str(r["status"])] for r in results), default=EXIT_OK)


#: ``verify``'s exit status of each file's outcome (the command's: the worst).
_VERIFY_STATUS = {"ok": EXIT_OK, "corrupt": EXIT_CORRUPT, "error": EXIT_USAGE}


def _verify_one(path: str) -> Dict[str, object]:
    """One file's outcome of ``verify``, as ``--json`` gives it: ``path``,
    ``status`` (ok, corrupt, error: it could not be read as a checkpoint),
    ``format``, ``records`` checked and ``unchecked`` ones (ok only),
    ``message`` (what is wrong; not ok only)."""
    from .errors import CorruptCheckpointError, UnsupportedFormatError
    from .verify import verify_file

    try:
        res = verify_file(path)
    except CorruptCheckpointError as e:
        return {"path": path, "status": "corrupt", "message": str(e)}
    except UnsupportedFormatError as e:
        return {"path": path, "status": "error", "message": str(e)}
    except OSError as e:
        return {"path": path, "status": "error", "message": f"{path}: {e.strerror or e}"}
    return {
        "path": path,
        "status": "ok",
        "format": res.format,
        "records": res.records,
        "unchecked": list(res.unchecked),
    }


def _verify_line(r: Dict[str, object]) -> str:
    """``verify``'s line for one file's outcome."""
    if r["status"] == "corrupt":
        return f"CORRUPT {r['message']}"
    if r["status"] == "error":
        return f"ERROR   {r['message']}"
    path, fmt, n, unchecked = r["path"], r["format"], r["records"], r["unchecked"]
    assert isinstance(unchecked, list)
    if fmt == "torch-legacy":
        return f"OK      {path}: {fmt}, {n} storages (no checksums in this format: structure only)"
    note = " (safetensors has no checksums: structure and readability only)" if fmt == "safetensors" else ""
    if unchecked:
        note += (
            f"; {len(unchecked)} records NOT CHECKED (the writer recorded no CRC32: "
            + ", ".join(unchecked[:5])
            + (", ..." if len(unchecked) > 5 else "")
            + ")"
        )
    return f"OK      {path}: {fmt}, {n} records verified{note}"


def _ls_store(url: str) -> int:
    """The checkpoints whose upload completed under an object store prefix
    (credentials from the usual fsspec/boto configuration)."""
    from .tiers import ObjectStore, TierError

    try:
        rows = ObjectStore(url).committed()
    except (TierError, ValueError) as e:  # (a missing bucket, a URL naming none)
        print(f"fastpersist: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(f"{'size':>12}  name")
    for name, size in sorted(rows.items()):
        print(f"{size:>12}  {url.rstrip('/')}/{name}")
    return EXIT_OK


def cmd_ls(args: argparse.Namespace) -> int:
    from .checkpoint_manager import LOG_NAME, list_checkpoints
    from .tiers import TierError, is_url

    if is_url(args.dir):
        return _ls_store(args.dir)
    if not os.path.isdir(args.dir):
        print(f"fastpersist: {args.dir}: not a directory", file=sys.stderr)
        return EXIT_USAGE
    events: dict = {}
    staged: dict = {}
    peer: dict = {}
    log_path = os.path.join(args.dir, LOG_NAME)
    for ev in _log_events(log_path):
        into = {"commit": events, "staged": staged, "replicated": peer}.get(str(ev.get("event")))
        if into is not None:
            into[ev["step"]] = ev
    try:
        rows = list_checkpoints(args.dir, args.stage_dir, unreadable=True)
    except (TierError, ValueError) as e:  # --stage-dir: a missing bucket, a URL naming none
        print(f"fastpersist: {e}", file=sys.stderr)
        return EXIT_USAGE
    temps = [n for n in os.listdir(args.dir) if n.endswith(".fptmp")]
    print(
        f"{'step':>12} {'size':>10} {'tier':<13} {'status':<10} {'stall ms':>9} {'write s':>8} {'GB/s':>6}"
        f" {'staged s':>9} {'GB/s':>6} {'lag':>5} {'peer s':>8} {'GB/s':>6} {'lag':>5}"
    )
    status_rc = EXIT_OK
    for step, copies in rows:
        # "peer": a holder acknowledged its replica (per the log; the
        # holder's retention may have removed it since).
        tiers = "+".join([c.tier for c in copies] + (["peer"] if step in peer else []))
        files = [c for c in copies if c.tier != "object"]
        status = "committed" if not files or _regular(files[0].path) else "UNREADABLE"
        if args.verify and files:
            status = _verified(files[0].path)
            if status != "verified":
                status_rc = EXIT_CORRUPT
        ev = events.get(step, {})
        stall, write, gbps = _num(ev, "stall_s", ".1f", 1e3), _num(ev, "write_s", ".3f"), _num(ev, "gbps", ".2f")
        st_s, st_g, lag = _tier_cols(staged.get(step, {}))
        p_s, p_g, p_lag = _tier_cols(peer.get(step, {}))
        print(
            f"{step:>12} {_human(copies[0].bytes):>10} {tiers:<13} {status:<10} {stall:>9} {write:>8} {gbps:>6}"
            f" {st_s:>9} {st_g:>6} {lag:>5} {p_s:>8} {p_g:>6} {p_lag:>5}"
        )
    for _ in temps:
        print(f"{'-':>12} {'-':>10} {'local':<13} {'temporary (an unfinished save)'}")
    if not rows:
        print("(no checkpoints)")
    return max(status_rc, _ls_replicas(args.dir, args.verify))


def _tier_cols(ev: dict) -> Tuple[str, str, str]:
    """Seconds, GB/s and lag of one transfer event, "-" where unknown."""
    return _num(ev, "seconds", ".3f"), _num(ev, "gbps", ".2f"), _num(ev, "lag_steps", "d")


def _num(ev: dict, key: str, fmt: str, scale: float = 1) -> str:
    """A number of a log event, formatted; "-" where absent or not a number
    (the log is appended to, a line may be damaged)."""
    v = ev.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (fmt == "d" and not isinstance(v, int)):
        return "-"
    try:
        return format(v * scale if scale != 1 else v, fmt)
    except OverflowError:  # an int past a float's range, for a float's format
        return "-"


def _log_events(path: str) -> List[dict]:
    """The events of a Checkpointer's log that name a step; a line that
    does not parse (a damaged or foreign line) is skipped."""
    from .options import parse_json

    out: List[dict] = []
    try:
        # (without waiting for a writer: a FIFO at the name is no log)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return out
    except OSError as e:
        print(f"fastpersist: {path}: {e.strerror or e} (the log is not shown)", file=sys.stderr)
        return out
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        print(f"fastpersist: {path} is not a regular file (the log is not shown)", file=sys.stderr)
        return out
    with open(fd, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                ev = parse_json(line)
            except ValueError:
                continue
            if isinstance(ev, dict) and isinstance(ev.get("step"), int) and not isinstance(ev["step"], bool):
                out.append(ev)
    return out


def _regular(path: str) -> bool:
    """Whether ``path`` is a regular file (a folder or FIFO at a
    checkpoint's name is none: ``latest()`` passes it by)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _verified(path: str) -> str:
    """``ls --verify``'s status of one file: verified, CORRUPT, FOREIGN (a
    whole file, not a Checkpointer's payload: ``latest()`` passes it by) or
    UNREADABLE (not a checkpoint file it can read: a directory, a FIFO, an
    I/O error)."""
    from .checkpoint_manager import is_payload
    from .errors import CorruptCheckpointError, UnsupportedFormatError
    from .verify import verify_file

    try:
        top = verify_file(path).top_level
    except CorruptCheckpointError:
        return "CORRUPT"
    except (OSError, UnsupportedFormatError):
        return "UNREADABLE"
    return "verified" if is_payload(top) else "FOREIGN"


def _ls_replicas(directory: str, verify: bool) -> int:
    """The peer tier held in ``directory``: other ranks' replicas."""
    from .checkpoint_manager import list_replicas
    from .replicas import replica_dir

    rc = EXIT_OK
    for rank, infos in sorted(list_replicas(directory).items()):
        d = replica_dir(directory, rank)
        print(f"replicas held for rank {rank} ({d}):")
        for step in sorted(infos, reverse=True):
            status = "committed"
            if verify:
                status = _verified(infos[step].path)
                if status != "verified":
                    rc = EXIT_CORRUPT
            print(f"{step:>12} {_human(infos[step].bytes):>10} {'peer':<13} {status:<10}")
        for name in sorted(os.listdir(d)):
            if name.endswith(".fptmp"):
                print(f"{'-':>12} {'-':>10} {'peer':<13} temporary (an unfinished transfer)")
    return rc


def _bench_room(size: int, directory: str) -> str:
    """What the machine lacks for a benchmark of ``size`` bytes in
    ``directory``, or "": the state and one copy read back in memory, the
    checkpoint and torch.save's file on disk (checked before any of it is
    made, not found out by a killed process or a full disk)."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        avail = None
    if avail is not None and 2 * size > avail:
        return f"needs about {2 * size >> 20} MiB of memory (the state and a copy read back); {avail >> 20} MiB is free"
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if 2 * size > free:
        return f"needs about {2 * size >> 20} MiB free in {directory} (two checkpoints); {free >> 20} MiB is free"
    return ""


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    import fastpersist

    from . import bench

    size = bench.parse_size(args.size)
    base = args.dir or os.getcwd()
    short = _bench_room(size, base)
    if short:
        print(f"fastpersist: bench --size {args.size}: {short}", file=sys.stderr)
        return EXIT_USAGE
    with tempfile.TemporaryDirectory(prefix="fastpersist-cli-bench-", dir=base) as d:
        sd = bench.gpt_state_dict(size)
        nbytes = bench.nbytes(sd)
        path = os.path.join(d, "ckpt.pt")
        ref = os.path.join(d, "torch.pt")
        steps = ["fio write", "fastpersist write", "torch.save", "fio read", "fastpersist read", "torch.load"]
        prog = bench.Progress(args.rounds * len(steps), "bench", force=args.progress)
        times: Dict[str, List[float]] = {s: [] for s in steps}

        def save_torch() -> None:
            with open(ref, "wb") as f:
                torch.save(sd, f)
                f.flush()
                os.fsync(f.fileno())

        for _ in range(args.rounds):
            for s in steps:
                os.sync()
                if s == "fio write" or s == "fio read":
                    bw = bench.fio_limit(d, nbytes, "write" if s == "fio write" else "read")
                    times[s].append(nbytes / (bw * 1e9) if bw else float("nan"))
                elif s == "fastpersist write":
                    bench.clear(path)
                    times[s].append(bench.timed(lambda: fastpersist.write_state_dict(sd, path)))
                elif s == "torch.save":
                    bench.clear(ref)
                    times[s].append(bench.timed(save_torch))
                elif s == "fastpersist read":
                    bench.drop_cache(path)
                    times[s].append(bench.timed(lambda: fastpersist.read_state_dict(path)))
                else:
                    bench.drop_cache(ref)
                    times[s].append(bench.timed(lambda: torch.load(ref, weights_only=True)))
                prog.step(s)
        print(f"{_human(nbytes)} GPT-like state dict in {d}, medians of {args.rounds}")
        for kind in ("write", "read"):
            lim_t = bench.median(times[f"fio {kind}"])
            lim = nbytes / lim_t / 1e9 if not math.isnan(lim_t) else float("nan")
            print(f"  {kind}: fio limit {lim:.2f} GB/s")
            for s in steps:
                if s.startswith("fio") or (kind == "write") != (s in ("fastpersist write", "torch.save")):
                    continue
                g = nbytes / bench.median(times[s]) / 1e9
                print(f"    {s:<20} {g:6.2f} GB/s  {g / lim:5.2f} of the limit")
    return EXIT_OK


# Argument types: a bad value is a usage error (exit status 2, with the
# usage line), not a traceback and the "corrupt checkpoint" status.


def _size(text: str) -> str:
    from .bench import parse_size

    try:
        n = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"the size must be positive, not {text!r}")
    return text


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {n}")
    return n


def _file_arg(text: str) -> str:
    """A path argument the system can name: not empty, no NUL byte."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path names no file")
    if "\0" in text:
        raise argparse.ArgumentTypeError(f"a path cannot hold a NUL byte: {text!r}")
    return text


def _directory(text: str) -> str:
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"not a directory: {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fastpersist", description="Fast, durable checkpoints.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("inspect", help="show the records or tensors of a checkpoint")
    p.add_argument("path", type=_file_arg)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("verify", help="check every CRC32 and the structure")
    p.add_argument("paths", nargs="+", metavar="PATH", type=_file_arg)
    p.add_argument("--json", action="store_true", help="machine-readable output: one object per file")
    p.set_defaults(fn=cmd_verify)
    p = sub.add_parser("ls", help="list the checkpoints of a Checkpointer directory or an object store URL")
    p.add_argument(
        "dir", type=_file_arg, help="a Checkpointer directory, or a URL (s3://bucket/prefix): committed uploads"
    )
    p.add_argument("--stage-dir", default=None, help="the shared tier, if staging is used")
    p.add_argument("--verify", action="store_true", help="check every checkpoint's CRC32s")
    p.set_defaults(fn=cmd_ls)
    p = sub.add_parser("bench", help="write and read benchmarks (fio limits, torch)")
    p.add_argument("--size", default="1GiB", type=_size, help="state dict size (default 1GiB)")
    p.add_argument("--dir", default=None, type=_directory, help="directory on the disk to test (default: cwd)")
    p.add_argument("--rounds", type=_positive, default=3)
    p.add_argument("--progress", action="store_true", help="show progress even when not on a terminal")
    p.set_defaults(fn=cmd_bench)
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from .errors import CorruptCheckpointError, UnsupportedFormatError
    from .options import EngineOptions

    try:
        # The environment's options, checked before any file: a bad value is
        # a usage error (status 1 would say a checkpoint is corrupt).
        EngineOptions.resolve()
    except (ValueError, TypeError) as e:
        print(f"fastpersist: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return int(args.fn(args))
    except CorruptCheckpointError as e:
        print(f"fastpersist: corrupt checkpoint: {e}", file=sys.stderr)
        return EXIT_CORRUPT
    except UnsupportedFormatError as e:  # a valid file of another kind (TorchScript)
        print(f"fastpersist: {e}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # the reader of the output went away (| head): nothing more to say
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except OSError as e:  # a file that cannot be opened or read: missing, a loop, a socket, ...
        named = e.filename if e.filename is not None else getattr(args, "path", None) or getattr(args, "dir", None)
        where = f"{os.fsdecode(named)}: " if named is not None else ""
        print(f"fastpersist: {where}{e.strerror or e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
