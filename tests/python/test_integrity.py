"""Integrity: nothing lost, nothing crashes, nothing outside fastpersist's
own files touched. Each test is a regression test of a defect found on
1c9dc26 (the issue's numbering in the names)."""

from __future__ import annotations

import json
import os
import pickle
import re
import stat
import struct
import subprocess
import sys
import textwrap
import time

import fastpersist
import numpy as np
import pytest
import torch
from fastpersist.checkpoint_manager import ckpt_name
from helpers import assert_same, bits


def _old(path) -> None:
    """Make a file look like a leftover of a save long ago."""
    t = time.time() - 24 * 3600
    os.utime(path, (t, t))


# 1. Snapshot copies keyed by address: two storages at the same address.


@pytest.mark.parametrize("n", [1 << 18, 1 << 24])
def test_15_1_snapshot_of_storages_sharing_an_address(tmp_path, n):
    arr = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    a = torch.from_numpy(arr)
    b = torch.from_numpy(arr[:4096])  # a second storage at the same address
    assert a.data_ptr() == b.data_ptr() and a.untyped_storage()._cdata != b.untyped_storage()._cdata
    sd = {"a": a, "b": b}
    f = fastpersist.save_async(sd, tmp_path / "s.pt", mode="snapshot")
    f.result(timeout=120)
    back = torch.load(tmp_path / "s.pt")
    assert bits(back["a"]) == bits(a) and bits(back["b"]) == bits(b)


def test_15_1_checkpointer_snapshot_restores_the_right_state(tmp_path):
    arr = np.arange(1 << 16, dtype=np.float32)
    sd = {"a": torch.from_numpy(arr), "b": torch.from_numpy(arr[:100])}
    with fastpersist.Checkpointer(tmp_path, every=1, mode="snapshot") as ck:
        ck.step(1, sd)
    step, st = fastpersist.Checkpointer(tmp_path).load_latest()
    assert step == 1
    assert_same(st, {"a": sd["a"], "b": sd["b"]})


# 3. Retention ranks by step only.


def test_15_3_retention_never_deletes_the_newest_valid(tmp_path):
    def sd(i):
        return {"w": torch.full((1000,), float(i))}

    with fastpersist.Checkpointer(tmp_path, every=1, keep_last=1) as ck:
        ck.save(20, sd(20)).result()
        ck.wait()
    # a damaged newer checkpoint (e.g. from another run, or bit rot)
    fastpersist.write_state_dict({"step": 30, "state": sd(30)}, tmp_path / ckpt_name(30))
    raw = bytearray((tmp_path / ckpt_name(30)).read_bytes())
    raw[4096 + 10] ^= 0xFF
    (tmp_path / ckpt_name(30)).write_bytes(bytes(raw))
    with fastpersist.Checkpointer(tmp_path, every=1, keep_last=1) as ck:
        ck.save(25, sd(25)).result()
        ck.wait()
    names = sorted(os.listdir(tmp_path))
    assert ckpt_name(25) in names  # the newest valid checkpoint survives
    step, st = fastpersist.Checkpointer(tmp_path).load_latest()
    assert step == 25 and torch.all(st["w"] == 25)


def test_15_3_damaged_files_do_not_count_toward_keep_last(tmp_path):
    with fastpersist.Checkpointer(tmp_path, every=1, keep_last=2) as ck:
        for s in (1, 2, 3):
            ck.save(s, {"i": s}).result()
            ck.wait()
            if s == 3:
                p = tmp_path / ckpt_name(3)
                p.write_bytes(p.read_bytes()[:-30])  # truncated: damaged
        ck.save(4, {"i": 4}).result()
        ck.wait()
    # valid: 4 and 2 (3 is damaged and newer than 2: kept, but not counted)
    steps = sorted(int(n[5:-3]) for n in os.listdir(tmp_path) if n.startswith("ckpt-"))
    assert 2 in steps and 4 in steps and 1 not in steps


# 4. Sharded: an error after the index is committed is not a rollback.


def test_15_4_cleanup_errors_after_the_index_do_not_delete_the_new_shards(tmp_path):
    code = textwrap.dedent(
        f"""
        import os, socket, warnings, torch, torch.distributed as dist, fastpersist
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=0, world_size=1)
        d = {str(tmp_path / "sh")!r}
        fastpersist.write_state_dict({{"v": torch.ones(10)}}, d, group=dist.group.WORLD, sharded=True)
        os.makedirs(os.path.join(d, "shard-notes"))          # the user's own directory
        open(os.path.join(d, "shard-readme.txt"), "w").close()  # the user's own file
        # an old shard name that is a directory: removing it fails after the commit
        os.makedirs(os.path.join(d, "shard-1-00000-of-00001.pt"))
        os.utime(os.path.join(d, "shard-1-00000-of-00001.pt"), (1e9, 1e9))  # (no save's in flight)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            fastpersist.write_state_dict({{"v": torch.full((10,), 2.0)}}, d, group=dist.group.WORLD, sharded=True)
        assert any("cannot remove" in str(x.message) for x in w), [str(x.message) for x in w]
        back = fastpersist.read_state_dict(d)
        assert torch.all(back[0]["v"] == 2), back
        assert os.path.isdir(os.path.join(d, "shard-notes"))
        assert os.path.exists(os.path.join(d, "shard-readme.txt"))
        print("OK")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr


def test_names_that_only_begin_like_fastpersists_are_never_deleted(tmp_path):
    """Regression: the sharded save's cleanup matched its shard names with
    ``^...$``, whose ``$`` also matches before a trailing newline, and
    deleted a user's file named like a shard plus a newline. Every name
    fastpersist deletes by (shards, checkpoints, temporary files) must be
    its own, whole."""
    d = tmp_path / "sh"
    ck = tmp_path / "ck"
    code = textwrap.dedent(
        f"""
        import os, socket, torch, torch.distributed as dist, fastpersist
        from fastpersist.checkpoint_manager import ckpt_name
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=0, world_size=1)
        d, ck = {str(d)!r}, {str(ck)!r}
        fastpersist.write_state_dict({{"v": torch.ones(10)}}, d, group=dist.group.WORLD, sharded=True)
        user = [n + "\\n" for n in os.listdir(d) if n.startswith("shard-")]
        user += ["shard-abc-00000-of-00001.pt\\n"]
        for n in user:
            open(os.path.join(d, n), "w").write("the user's")
        fastpersist.write_state_dict({{"v": torch.full((10,), 2.0)}}, d, group=dist.group.WORLD, sharded=True)
        left = os.listdir(d)
        assert all(n in left for n in user), (user, left)
        os.makedirs(ck)
        mine = [ckpt_name(1) + "\\n", "." + ckpt_name(1) + ".1.2.fptmp\\n"]
        for n in mine:
            open(os.path.join(ck, n), "w").write("the user's")
            os.utime(os.path.join(ck, n), (1, 1))
        with fastpersist.Checkpointer(ck, every=1, keep_last=1) as c:
            for step in range(1, 4):
                c.save(step, {{"i": step}}).result()
                c.wait()
        left = os.listdir(ck)
        assert all(n in left for n in mine), (mine, left)
        print("OK")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr


# 5. Snapshot saves in flight at interpreter exit.


@pytest.mark.parametrize("mode", ["snapshot", "pipelined"])
def test_15_5_saves_in_flight_at_exit_are_committed(tmp_path, mode):
    p = tmp_path / "exit.pt"
    code = textwrap.dedent(
        f"""
        import torch, fastpersist
        sd = {{f"w{{i}}": torch.full((4 << 20,), float(i)) for i in range(8)}}  # 128 MiB
        fastpersist.save_async(sd, {str(p)!r}, mode={mode!r})
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    back = torch.load(p)
    assert len(back) == 8 and torch.all(back["w7"] == 7)


# 8. Shard names from index.json are joined unchecked.


@pytest.mark.parametrize("name", ["../../outside-secret.pt", "/etc/passwd", "sub/shard-1-00000-of-00001.pt", "x.pt"])
def test_15_8_index_cannot_name_files_outside_the_directory(tmp_path, name):
    secret = tmp_path / "outside-secret.pt"
    torch.save({"secret": 1}, secret)
    d = tmp_path / "a" / "b" / "ckpt"
    d.mkdir(parents=True)
    (d / "index.json").write_text(
        json.dumps(
            {
                "format": "fastpersist-sharded",
                "version": 1,
                "world_size": 1,
                "save_id": "1",
                "shards": [{"rank": 0, "file": name, "bytes": 1}],
            }
        )
    )
    with pytest.raises(fastpersist.CorruptCheckpointError, match="not a shard file name"):
        fastpersist.read_state_dict(d)


@pytest.mark.parametrize(
    "index",
    [
        '{"world_size":1,"shards":[{"rank":Infinity,"file":"shard-1-00000-of-00001.pt"}]}',
        '{"world_size":1e400,"shards":[{"rank":0,"file":"shard-1-00000-of-00001.pt"}]}',
        '{"world_size":1.0,"shards":[{"rank":0,"file":"shard-1-00000-of-00001.pt"}]}',
        '{"world_size":1,"shards":[{"rank":true,"file":"shard-1-00000-of-00001.pt"}]}',
        '{"world_size":2,"shards":[{"rank":0,"file":"shard-1-00000-of-00002.pt"},'
        '{"rank":0,"file":"shard-1-00001-of-00002.pt"}]}',
        '{"x":' + "[" * 100000 + "]" * 100000 + "}",
    ],
    ids=["rank-infinity", "world-1e400", "world-float", "rank-bool", "rank-twice", "deep"],
)
def test_a_hostile_shard_index_is_corrupt(tmp_path, index):
    """Regression: an index.json whose counts are not integers (Infinity,
    1e400) raised a bare OverflowError, a deeply nested one RecursionError;
    a rank listed twice was taken."""
    d = tmp_path / "ckpt"
    d.mkdir()
    for n in ("shard-1-00000-of-00001.pt", "shard-1-00000-of-00002.pt", "shard-1-00001-of-00002.pt"):
        torch.save({"a": torch.ones(2)}, d / n)
    (d / "index.json").write_text(index)
    with pytest.raises(fastpersist.CorruptCheckpointError):
        fastpersist.read_state_dict(d)


@pytest.mark.parametrize("kind", ["link-out", "link-in", "folder"])
def test_a_shard_is_a_file_of_its_directory(tmp_path, kind):
    """Regression (found in a hunt): a shard that was a link was followed
    out of the checkpoint's directory (whatever it pointed at was read), and
    a shard that was a folder was read as a sharded checkpoint of its own
    (a list inside the list). A link out of the directory is refused; one
    within it is read; a folder is an error naming it."""
    name = "shard-1-00000-of-00001.pt"
    d = tmp_path / "ckpt"
    d.mkdir()
    outside = tmp_path / "outside.pt"
    torch.save({"secret": torch.ones(2)}, outside)
    if kind == "link-out":
        os.symlink(outside, d / name)
    elif kind == "link-in":
        torch.save({"a": torch.ones(2)}, d / "real.pt")
        os.symlink("real.pt", d / name)
    else:
        (d / name).mkdir()
        torch.save({"a": torch.ones(2)}, d / name / name)
        (d / name / "index.json").write_text(
            json.dumps({"world_size": 1, "shards": [{"rank": 0, "file": name, "bytes": 1}]})
        )
    (d / "index.json").write_text(json.dumps({"world_size": 1, "shards": [{"rank": 0, "file": name, "bytes": 1}]}))
    if kind == "link-in":
        assert fastpersist.read_state_dict(d)[0]["a"].tolist() == [1.0, 1.0]
        return
    err = fastpersist.CorruptCheckpointError if kind == "link-out" else IsADirectoryError
    with pytest.raises(err, match="outside it" if kind == "link-out" else name):
        fastpersist.read_state_dict(d)


def test_a_shard_swapped_for_a_link_after_its_check_is_not_followed(tmp_path, monkeypatch):
    """Regression: a shard was checked (a file of its directory, not a link
    out of it) and then opened again by its path, so a link swapped in
    between was followed out of the directory. The checked file is read."""
    import fastpersist.distributed as fpd

    name = "shard-1-00000-of-00001.pt"
    d = tmp_path / "ckpt"
    d.mkdir()
    torch.save({"a": torch.ones(2)}, d / name)
    (d / "index.json").write_text(json.dumps({"world_size": 1, "shards": [{"rank": 0, "file": name, "bytes": 1}]}))
    outside = tmp_path / "outside.pt"
    torch.save({"secret": torch.zeros(2)}, outside)
    checked = fpd.open_beneath

    def then_swapped(directory, n):
        fd = checked(directory, n)
        if n == name:
            os.replace(d / name, tmp_path / "moved.pt")
            os.symlink(outside, d / name)
        return fd

    monkeypatch.setattr(fpd, "open_beneath", then_swapped)
    assert fastpersist.read_state_dict(d)[0]["a"].tolist() == [1.0, 1.0]


def test_a_sharded_index_that_is_a_fifo_or_a_link_out_is_not_read(tmp_path):
    """Regression: a sharded checkpoint's index was opened by path: a FIFO
    at its name held the read (and verify) for ever, and a link was
    followed out of the directory."""
    from fastpersist.verify import verify_file

    name = "shard-1-00000-of-00001.pt"
    d = tmp_path / "ckpt"
    d.mkdir()
    torch.save({"a": torch.ones(2)}, d / name)
    os.mkfifo(d / "index.json")
    for check in (fastpersist.read_state_dict, verify_file):
        with pytest.raises(fastpersist.CorruptCheckpointError, match="FIFO"):
            check(d)
    os.unlink(d / "index.json")
    outside = tmp_path / "index.json"
    outside.write_text(json.dumps({"world_size": 1, "shards": [{"rank": 0, "file": name, "bytes": 1}]}))
    os.symlink(outside, d / "index.json")
    with pytest.raises(fastpersist.CorruptCheckpointError, match="outside it"):
        fastpersist.read_state_dict(d)


def test_verify_checks_a_sharded_checkpoint_whole(tmp_path, capsys):
    """Regression: verify of a sharded checkpoint's directory said "Is a
    directory", and of its index.json CORRUPT: a valid checkpoint could
    not be checked. Its index and every shard are verified now."""
    from fastpersist import cli
    from fastpersist.verify import verify_file

    d = tmp_path / "ckpt"
    d.mkdir()
    names = [f"shard-1-{r:05d}-of-00002.pt" for r in range(2)]
    for r, n in enumerate(names):
        fastpersist.write_state_dict({"w": torch.full((1000,), float(r))}, d / n)
    (d / "index.json").write_text(
        json.dumps({"world_size": 2, "shards": [{"rank": r, "file": n, "bytes": 1} for r, n in enumerate(names)]})
    )
    res = verify_file(d)
    assert res.format == "sharded" and res.records == 2 * verify_file(d / names[0]).records
    assert cli.main(["verify", str(d)]) == 0
    # (Its line said "safetensors has no checksums": every shard's CRC32s are checked.)
    out = capsys.readouterr().out
    assert "OK" in out and "sharded" in out and "safetensors" not in out, out
    raw = bytearray((d / names[1]).read_bytes())
    raw[raw.find(struct.pack("<f", 1.0) * 4)] ^= 1
    (d / names[1]).write_bytes(bytes(raw))
    with pytest.raises(fastpersist.CorruptCheckpointError, match=names[1]):
        verify_file(d)
    assert cli.main(["verify", str(d)]) == 1


# 9. Name patterns too broad.


def test_15_9_retention_and_sweep_touch_only_their_own_names(tmp_path):
    mine = ["ckpt-5.pt", "ckpt-00005.pt", "ckpt-5.pt.bak", "results.fptmp", ".notes.fptmp", ".ckpt-5.pt.x.y.fptmp"]
    for n in mine:
        (tmp_path / n).write_bytes(b"user data")
        _old(tmp_path / n)
    with fastpersist.Checkpointer(tmp_path, every=1, keep_last=1) as ck:
        for s in range(1, 4):
            ck.save(s, {"i": s}).result()
            ck.wait()
    left = set(os.listdir(tmp_path))
    assert set(mine) <= left
    assert ckpt_name(3) in left and ckpt_name(1) not in left


# 10. The temp sweep must not delete a live writer's file in another PID namespace.


def test_15_10_sweep_keeps_locked_and_young_temp_files(tmp_path):
    import fcntl

    live = tmp_path / f".{ckpt_name(7)}.1.0.fptmp"  # pid 1: "alive" only in another namespace
    live.write_bytes(b"in progress")
    _old(live)
    fd = os.open(live, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a writer holds the lock, whatever its pid says
    young = tmp_path / f".{ckpt_name(8)}.999999999.0.fptmp"  # dead pid, but just written
    young.write_bytes(b"x")
    dead = tmp_path / f".{ckpt_name(9)}.999999999.1.fptmp"
    dead.write_bytes(b"x")
    _old(dead)
    try:
        fastpersist.Checkpointer(tmp_path, every=1).close()
        assert live.exists() and young.exists()
        assert not dead.exists()
    finally:
        os.close(fd)


@pytest.mark.parametrize("link", ["replicas", "rank"])
def test_a_link_at_a_replica_folder_is_neither_swept_nor_listed(tmp_path, link):
    """Regression: a link at ``replicas/`` or ``replicas/rank-<r>`` was
    followed: every Checkpointer's sweep removed old temporary files of
    fastpersist's names wherever it pointed, and ``fastpersist ls`` listed
    (and with --verify read) the files there as replicas."""
    from fastpersist import cli

    outside = tmp_path / "outside"
    (outside / "rank-1").mkdir(parents=True)
    d = tmp_path / "ck"
    d.mkdir()
    target = outside / "rank-1" if link == "rank" else outside
    if link == "rank":
        (d / "replicas").mkdir()
        os.symlink(target, d / "replicas" / "rank-1")
    else:
        os.symlink(outside, d / "replicas")
    stale = outside / "rank-1" / f".{ckpt_name(9)}.999999999.1.fptmp"
    stale.write_bytes(b"x")
    _old(stale)
    fastpersist.write_state_dict({"step": 3, "state": {}}, outside / "rank-1" / ckpt_name(3))
    fastpersist.Checkpointer(d, every=1).close()
    assert stale.exists()
    assert fastpersist.replicas.held_ranks(str(d)) == []
    assert cli.main(["ls", str(d)]) == 0


# 12-14. Hostile input.


def _safetensors(header: bytes, data: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + data


@pytest.mark.parametrize(
    "header",
    [
        b'{"a":{"dtype":"F32","shape":[Infinity],"data_offsets":[0,4]}}',
        b'{"a":{"dtype":"F32","shape":[1e400],"data_offsets":[0,4]}}',
        b'{"a":{"dtype":"F32","shape":[1180591620717411303424,0],"data_offsets":[0,0]}}',
        b'{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,0]}}',
        b'{"a":{"dtype":"F32","shape":"abc","data_offsets":[0,4]}}',
        b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0]}}',
        b'{"a":{"dtype":"F32","shape":[true],"data_offsets":[0,4]}}',
        b'{"a":5}',
        b"[" * 200_000 + b"]" * 200_000,
        b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    ],
    # Short ids: pytest puts the test's id in PYTEST_CURRENT_TEST, and an
    # environment string over 128 KiB makes the CLI's exec fail (E2BIG).
    ids=lambda h: h.decode()[:40] + (f"...({len(h)} bytes)" if len(h) > 40 else ""),
)
def test_15_12_hostile_safetensors_headers(tmp_path, header):
    p = tmp_path / "h.safetensors"
    p.write_bytes(_safetensors(header, b"\0" * 16))
    with pytest.raises(fastpersist.CorruptCheckpointError):
        fastpersist.read_state_dict(p)
    with pytest.raises(fastpersist.CorruptCheckpointError):
        fastpersist.verify.verify_file(p)
    from helpers import cli_exe

    r = subprocess.run([cli_exe(), "verify", str(p)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr + r.stdout, r.stderr


def test_15_12_load_latest_falls_back_past_a_hostile_file(tmp_path):
    with fastpersist.Checkpointer(tmp_path, every=1) as ck:
        ck.save(1, {"i": 1}).result()
    (tmp_path / ckpt_name(2)).write_bytes(
        _safetensors(b'{"a":{"dtype":"F32","shape":[Infinity],"data_offsets":[0,4]}}')
    )
    assert fastpersist.Checkpointer(tmp_path).load_latest()[0] == 1


def _zip_with_overlapping_records(path, copies: int) -> None:
    """A torch file (8 MiB of data) whose central directory lists its data
    record ``copies`` more times: every record lies inside the file, and
    together they claim far more memory than the file holds."""
    torch.save({"w": torch.zeros(2 << 20)}, path)
    raw = bytearray(open(path, "rb").read())
    eocd = raw.rfind(b"PK\x05\x06")
    n, cd_size, cd_off = struct.unpack_from("<HII", raw, eocd + 10)
    cd = bytes(raw[cd_off : cd_off + cd_size])
    p = 0
    entry = b""
    while p < len(cd):
        nlen, xlen, clen = struct.unpack_from("<HHH", cd, p + 28)
        e = cd[p : p + 46 + nlen + xlen + clen]
        if e[46 : 46 + nlen].endswith(b"/data/0"):
            entry = e
        p += len(e)
    assert entry
    new_cd = cd + entry * copies
    total = n + copies
    tail = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, min(total, 0xFFFF), min(total, 0xFFFF), len(new_cd), cd_off, 0)
    with open(path, "wb") as f:
        f.write(bytes(raw[:cd_off]) + new_cd + tail)


def test_15_13_directory_validated_before_anything_is_allocated(tmp_path):
    p = tmp_path / "overlap.pt"
    _zip_with_overlapping_records(p, 3000)
    code = textwrap.dedent(
        f"""
        import resource, fastpersist
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
        try:
            fastpersist.read_state_dict({str(p)!r})
        except fastpersist.CorruptCheckpointError as e:
            print("CORRUPT", e)
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "CORRUPT" in r.stdout, (r.stdout, r.stderr)


def test_15_14_verify_checks_what_a_load_checks(tmp_path):
    # a pickle naming a storage the file does not hold
    p = tmp_path / "absent.pt"
    torch.save({"w": torch.arange(10.0)}, p)
    import zipfile

    with zipfile.ZipFile(p) as z:
        names = z.namelist()
        files = {n: z.read(n) for n in names}
    q = tmp_path / "bad.pt"
    with zipfile.ZipFile(q, "w", compression=zipfile.ZIP_STORED) as z:
        for n in names:
            if not n.endswith("/data/0"):
                z.writestr(n, files[n])
    with pytest.raises(fastpersist.CorruptCheckpointError):
        fastpersist.read_state_dict(q)
    with pytest.raises(fastpersist.CorruptCheckpointError, match="does not hold"):
        fastpersist.verify.verify_file(q)
    # a record shorter than the pickle's numel
    r = tmp_path / "short.pt"
    with zipfile.ZipFile(r, "w", compression=zipfile.ZIP_STORED) as z:
        for n in names:
            z.writestr(n, files[n][:8] if n.endswith("/data/0") else files[n])
    with pytest.raises(fastpersist.CorruptCheckpointError):
        fastpersist.read_state_dict(r)
    with pytest.raises(fastpersist.CorruptCheckpointError, match="needs"):
        fastpersist.verify.verify_file(r)


# 17. Negative options.


@pytest.mark.parametrize("opts", [{"block_size": -4096}, {"arena_bytes": -1}, {"queue_depth": -5}, {"arena_bytes": 0}])
def test_15_17_negative_options_raise_value_error(tmp_path, opts):
    with pytest.raises(ValueError, match=next(iter(opts))):
        fastpersist.write_state_dict({"a": torch.ones(3)}, tmp_path / "x.pt", **opts)
    assert not os.listdir(tmp_path)


def test_15_17_negative_environment_options_name_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTPERSIST_QUEUE_DEPTH", "-5")
    with pytest.raises(ValueError, match="FASTPERSIST_QUEUE_DEPTH"):
        fastpersist.write_state_dict({"a": torch.ones(3)}, tmp_path / "x.pt")


def test_15_6_huge_arena_is_an_error_not_a_crash(tmp_path):
    code = textwrap.dedent(
        f"""
        import torch, fastpersist
        try:
            fastpersist.write_state_dict({{"a": torch.ones(3)}}, {str(tmp_path / "x.pt")!r}, arena_bytes=2**64 - 1)
        except (ValueError, OSError) as e:
            print("RAISED", type(e).__name__)
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "RAISED" in r.stdout, (r.returncode, r.stderr)
    env = {**os.environ, "FASTPERSIST_ARENA_BYTES": "0xffffffffffffffff"}
    r = subprocess.run(
        [sys.executable, "-c", code.replace(", arena_bytes=2**64 - 1", "")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 0 and "RAISED" in r.stdout, (r.returncode, r.stderr)


# The engine cache is bounded.


def test_engine_cache_is_bounded(tmp_path):
    from fastpersist.options import MAX_OPTION_SETS, cached_option_sets

    for i in range(MAX_OPTION_SETS + 3):
        fastpersist.write_state_dict({"a": torch.ones(3)}, tmp_path / "x.pt", queue_depth=8 + i)
    assert len(cached_option_sets()) <= MAX_OPTION_SETS


# 2. Reads while another process replaces the file atomically.


@pytest.mark.parametrize("verify", [True, False])
def test_15_2_reads_while_the_file_is_replaced_see_one_save(tmp_path, verify):
    p = tmp_path / "live.pt"
    fastpersist.write_state_dict({"step": 0, "w": torch.full((1 << 18,), 0.0)}, p)
    writer = textwrap.dedent(
        f"""
        import time, torch, fastpersist
        t = time.time(); s = 1
        while time.time() - t < 8:
            fastpersist.write_state_dict({{"step": s, "w": torch.full((1 << 18,), float(s))}}, {str(p)!r})
            s += 1
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", writer])
    try:
        n = 0
        while proc.poll() is None and n < 150:
            got = fastpersist.read_state_dict(p, verify=verify)
            assert torch.all(got["w"] == got["step"]), got["step"]
            n += 1
        for name in ("inspect_file", "verify_file"):
            getattr(fastpersist.verify, name)(p)
    finally:
        proc.kill()
        proc.wait()
    assert n > 10


# 7. A storage resized or freed while a save reads it: raise, never crash.


def _run(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (a crash there fails the test
    instead of killing the test run)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout
    )


def test_15_7_storage_freed_before_the_engine_reaches_it_raises_and_keeps_the_old_file(tmp_path):
    # While the head (storages found up front) is being written by a helper
    # thread, the pickler runs an object's __reduce__ that frees a storage
    # the engine has not reached yet: the engine's check (under the GIL)
    # refuses it, the previous file stays, no temp file is left.
    p = tmp_path / "ckpt.pt"
    r = _run(
        f"""
        import os, torch, fastpersist
        p = {str(p)!r}
        fastpersist.write_state_dict({{"x": torch.ones(4)}}, p)
        before = open(p, "rb").read()
        a = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB: freed with munmap

        class Free:
            def __reduce__(self):
                a.untyped_storage().resize_(0)
                return (int, (1,))

        sd = {{"big": torch.ones(512 << 20, dtype=torch.uint8), "a": a, "free": Free()}}
        try:
            fastpersist.write_state_dict(sd, p)
        except fastpersist.StorageChangedError as e:
            assert "resized or freed" in str(e), e
            print("RAISED")
        assert open(p, "rb").read() == before
        assert os.listdir(os.path.dirname(p)) == ["ckpt.pt"], os.listdir(os.path.dirname(p))
        """
    )
    assert r.returncode == 0 and "RAISED" in r.stdout, (r.returncode, r.stdout, r.stderr[-3000:])


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_15_7_guard_refuses_a_changed_storage_before_reading_it(tmp_path, monkeypatch, fmt):
    # The check itself, made deterministic: the storage gets new memory
    # between planning and the engine's read (planning is wrapped to do it).
    from fastpersist import torch_zip, writer

    p = tmp_path / "ckpt.pt"
    fastpersist.write_state_dict({"x": torch.ones(4)}, p, format=fmt)
    before = p.read_bytes()
    t = torch.ones(1 << 20, dtype=torch.uint8)
    if fmt == "torch":
        real_parts = torch_zip.TorchZipLayout.head_parts

        def head_parts(self, *a):
            for part in real_parts(self, *a):
                t.untyped_storage().resize_(16)  # laid out, not yet handed to the engine
                yield part

        monkeypatch.setattr(torch_zip.TorchZipLayout, "head_parts", head_parts)
    else:
        real_plan = writer.plan_safetensors

        def plan(obj, metadata):
            out = real_plan(obj, metadata)
            t.untyped_storage().resize_(16)
            return out

        monkeypatch.setattr(writer, "plan_safetensors", plan)
    with pytest.raises(fastpersist.StorageChangedError, match="resized or freed"):
        fastpersist.write_state_dict({"t": t}, p, format=fmt)
    assert p.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]


def test_15_7_storage_resized_after_its_bytes_were_gathered_keeps_what_was_gathered(tmp_path):
    # The resize comes after the storage was read (while the pickle is
    # made): the file holds the bytes as they were gathered, whole.
    p = tmp_path / "ckpt.pt"
    t = torch.arange(1 << 20, dtype=torch.int32)
    keep = t.clone()

    class Late:
        def __reduce__(self):
            time.sleep(0.5)  # the head (t's bytes) is written meanwhile
            t.untyped_storage().resize_(0)
            return (int, (1,))

    fastpersist.write_state_dict({"t": t, "late": Late()}, p)
    assert torch.equal(torch.load(p, weights_only=False)["t"], keep)


def test_15_7_queued_pipelined_save_of_a_freed_storage_raises(tmp_path):
    # A pipelined save waits behind another (here one whose write is blocked
    # on a FIFO with no reader); meanwhile the caller frees a tensor it gave:
    # the save refuses the tensor that no longer fits its storage.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    p = tmp_path / "b.pt"
    r = _run(
        f"""
        import os, torch, fastpersist
        first = fastpersist.save_async({{"a": torch.ones(4)}}, {str(fifo)!r}, mode="snapshot")
        t = torch.ones(64 << 20, dtype=torch.uint8)
        second = fastpersist.save_async({{"t": t}}, {str(p)!r})
        t.untyped_storage().resize_(0)
        with open({str(fifo)!r}, "rb") as f:  # lets the first save go
            f.read()
        first.result(timeout=60)
        try:
            second.result(timeout=60)
        except fastpersist.SerializationError as e:
            assert "resized or freed" in str(e), e
            print("RAISED")
        assert not os.path.exists({str(p)!r})
        """
    )
    assert r.returncode == 0 and "RAISED" in r.stdout, (r.returncode, r.stdout, r.stderr[-3000:])


def test_15_7_racing_resizes_never_crash(tmp_path):
    # Resizes at arbitrary moments (right after a pipelined save_async
    # returns; from another thread during write_state_dict): every save
    # either raises (StorageChangedError, or SerializationError when the
    # tensor no longer fits its storage when planned) or writes exactly what
    # it was given.
    r = _run(
        f"""
        import os, threading, time, torch, fastpersist
        d = {str(tmp_path)!r}
        outcomes = []
        for i in range(12):
            p = os.path.join(d, f"c{{i}}.pt")
            t = torch.full((48 << 20,), i % 7, dtype=torch.uint8)
            keep = t.clone()
            if i % 2:
                h = fastpersist.save_async({{"t": t}}, p, mode="pipelined")
                t.untyped_storage().resize_(0)
                wait = h.result
            else:
                th = threading.Timer(0.002 * i, lambda: t.untyped_storage().resize_(0))
                th.start()
                wait = lambda: fastpersist.write_state_dict({{"t": t}}, p)
            try:
                wait()
                outcomes.append("saved")
                assert torch.equal(torch.load(p)["t"], keep)
            except (fastpersist.StorageChangedError, fastpersist.SerializationError):
                outcomes.append("raised")
                assert not os.path.exists(p)
        print(outcomes)
        """
    )
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-3000:])


# 19. Memory left behind: staging released while in flight, snapshot
# buffers reused before their copies end, failed reads holding storages.


def test_15_19_release_staging_during_a_save_frees_its_buffer_afterwards(tmp_path, monkeypatch):
    from fastpersist.cuda_staging import staging_bytes

    monkeypatch.setenv("FASTPERSIST_TEST_STAGE_CPU", "1")  # CPU storages take the staging path
    monkeypatch.setenv("FASTPERSIST_STAGE_INTO_ARENA", "0")  # through the staging slots
    fastpersist.release_staging()

    class ReleaseNow:
        def __reduce__(self):  # runs while the head is being staged
            fastpersist.release_staging()
            return (int, (1,))

    sd = {"a": torch.ones(8 << 20), "r": ReleaseNow()}
    fastpersist.write_state_dict(sd, tmp_path / "s.pt")
    assert staging_bytes() == 0
    assert torch.equal(torch.load(tmp_path / "s.pt", weights_only=False)["a"], sd["a"])
    fastpersist.write_state_dict({"a": sd["a"]}, tmp_path / "t.pt")
    assert staging_bytes() > 0  # kept for reuse when no release intervened
    fastpersist.release_staging()


def test_15_19_snapshot_pool_release_during_a_save_frees_the_buffer_afterwards(tmp_path):
    saver = fastpersist.async_save.AsyncSaver()
    try:
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        h = saver.save({"a": torch.ones(1 << 20)}, fifo, mode="snapshot")
        h.wait_snapshot(timeout=60)
        saver.pool.release()  # the buffer is in use by the write blocked on the FIFO
        with open(fifo, "rb") as f:
            f.read()
        h.result(timeout=60)
        assert saver.pool.nbytes == 0
    finally:
        saver.close()


def test_15_19_failed_snapshot_buffer_is_not_reused_when_its_copies_may_run(tmp_path, monkeypatch):
    from fastpersist import async_save

    def broken(self):
        raise RuntimeError("the copy stream failed")

    monkeypatch.setattr(async_save._CopyStreams, "synchronize", broken)
    saver = async_save.AsyncSaver()
    try:
        h = saver.save({"a": torch.ones(1 << 20)}, tmp_path / "s.pt", mode="snapshot")
        with pytest.raises(RuntimeError, match="copy stream failed"):
            h.result(timeout=60)
        assert saver.pool.nbytes == 0  # dropped, not back in the pool
        assert not (tmp_path / "s.pt").exists()
    finally:
        saver.close()


def _held(exc: BaseException) -> list:
    """Tensors and storages that fastpersist's frames in ``exc``'s traceback
    (and in those of its cause and context) still hold."""
    found, todo, seen = [], [exc], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            if "fastpersist" not in tb.tb_frame.f_code.co_filename.replace("test_", ""):
                tb = tb.tb_next  # the test's own frames, the standard library's
                continue
            for v in tb.tb_frame.f_locals.values():
                items = list(v.values()) if isinstance(v, dict) else list(v) if isinstance(v, (list, tuple)) else [v]
                for x in items:
                    for y in x if isinstance(x, (list, tuple)) else [x]:
                        n = (
                            y.nbytes
                            if isinstance(y, torch.Tensor)
                            else y.nbytes()
                            if isinstance(y, torch.UntypedStorage)
                            else 0
                        )
                        if n >= 1 << 20:
                            found.append((tb.tb_frame.f_code.co_name, type(y).__name__))
            tb = tb.tb_next
        todo += [e.__cause__, e.__context__]
    return found


@pytest.mark.parametrize("staged", [False, True])
def test_15_19_failed_read_does_not_hold_its_storages(tmp_path, monkeypatch, staged):
    if staged:
        monkeypatch.setenv("FASTPERSIST_TEST_STAGE_CPU", "1")  # the device path, on the CPU
    p = tmp_path / "c.pt"
    fastpersist.write_state_dict({"a": torch.ones(4 << 20), "b": torch.ones(4 << 20)}, p)
    with open(p, "r+b") as f:  # flip a byte of the last tensor's data
        data = f.read()
        f.seek(data.rindex(b"\x00\x00\x80\x3f") - 4096)
        f.write(b"\x01")
    with pytest.raises(fastpersist.CorruptCheckpointError) as info:
        fastpersist.read_state_dict(p, map_location="cpu")
    assert _held(info.value) == []
    fastpersist.release_staging()


def test_15_19_failed_save_future_does_not_hold_the_tensors(tmp_path):
    class Boom:
        def __reduce__(self):
            raise RuntimeError("cannot pickle this")

    sd = {"a": torch.ones(4 << 20), "boom": Boom()}
    for mode in ("pipelined", "snapshot"):
        h = fastpersist.save_async(sd, tmp_path / f"{mode}.pt", mode=mode)
        with pytest.raises(Exception, match="cannot pickle"):
            h.result(timeout=60)
        assert _held(h.exception()) == [], mode


# Directory-level attacks, fuzzed, under a memory limit: records outside the
# file, overlapping and duplicated records, lying zip64 fields, huge counts.


def _cd_entries(raw: bytes) -> tuple:
    """(EOCD offset, central directory offset, [(entry offset, entry bytes)])."""
    eocd = raw.rfind(b"PK\x05\x06")
    _n, cd_size, cd_off = struct.unpack_from("<HII", raw, eocd + 10)
    out, p = [], cd_off
    while p < cd_off + cd_size:
        nlen, xlen, clen = struct.unpack_from("<HHH", raw, p + 28)
        out.append((p, raw[p : p + 46 + nlen + xlen + clen]))
        p += 46 + nlen + xlen + clen
    return eocd, cd_off, out


def _attack(raw: bytes, kind: str, k: int, value: int, copies: int) -> bytes:
    eocd, cd_off, entries = _cd_entries(raw)
    p, entry = entries[k % len(entries)]
    b = bytearray(raw)
    if kind == "offset":  # a record's local header anywhere, past the end included
        struct.pack_into("<I", b, p + 42, value & 0xFFFFFFFF)
    elif kind == "sizes":  # sizes that lie (0xFFFFFFFF without a zip64 field too)
        struct.pack_into("<II", b, p + 20, value & 0xFFFFFFFF, value & 0xFFFFFFFF)
    elif kind == "zip64":  # a zip64 field claiming 2^40..2^64 bytes, appended to the entry
        nlen, xlen, clen = struct.unpack_from("<HHH", entry, 28)
        big = (value % (1 << 24)) << 40
        extra = struct.pack("<HHQQQ", 1, 24, big, big, big)
        e = bytearray(entry[: 46 + nlen + xlen] + extra + entry[46 + nlen + xlen :])
        struct.pack_into("<II", e, 20, 0xFFFFFFFF, 0xFFFFFFFF)
        struct.pack_into("<I", e, 42, 0xFFFFFFFF)
        struct.pack_into("<H", e, 30, xlen + len(extra))
        b = bytearray(raw[:p] + bytes(e) + raw[p + len(entry) :])
        eocd += len(extra)
        cd_size = struct.unpack_from("<I", b, eocd + 12)[0] + len(extra)
        struct.pack_into("<I", b, eocd + 12, cd_size)
    elif kind == "duplicate":  # one entry listed many more times: overlapping records
        cd_end = entries[-1][0] + len(entries[-1][1])
        b = bytearray(raw[:cd_end] + entry * copies + raw[cd_end:])
        eocd += len(entry) * copies
        n = len(entries) + copies
        struct.pack_into("<HHI", b, eocd + 8, min(n, 0xFFFF), min(n, 0xFFFF), cd_end - cd_off + len(entry) * copies)
    elif kind == "counts":  # the end record claims other counts, sizes, offsets
        struct.pack_into("<HHII", b, eocd + 8, value & 0xFFFF, (value >> 16) & 0xFFFF, value & 0xFFFFFFFF, copies)
    return bytes(b)


def test_15_directory_level_attacks_fuzzed_under_a_memory_limit(tmp_path):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    base = tmp_path / "base.pt"
    fastpersist.write_state_dict({"a": torch.arange(3000.0), "b": torch.ones(4096), "c": [torch.zeros(7)]}, base)
    raw = base.read_bytes()
    made = []

    @given(
        kind=st.sampled_from(["offset", "sizes", "zip64", "duplicate", "counts"]),
        k=st.integers(0, 20),
        value=st.one_of(st.integers(0, 1 << 32), st.sampled_from([0, 1, len(raw), 0xFFFFFFFF, 0xFFFF])),
        copies=st.integers(1, 5000),
    )
    @settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def make(kind, k, value, copies):
        f = tmp_path / f"h{len(made)}.pt"
        f.write_bytes(_attack(raw, kind, k, value, copies))
        made.append(str(f))

    make()
    code = textwrap.dedent(
        f"""
        import resource, fastpersist
        from fastpersist.verify import verify_file
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
        for f in {made!r}:
            for call in (lambda: fastpersist.read_state_dict(f), lambda: verify_file(f)):
                try:
                    call()
                except fastpersist.CorruptCheckpointError:
                    pass
        print("ALL", len({made!r}))
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ALL" in r.stdout, (r.stdout, r.stderr[-3000:])


def _rezip(src, dst, edit):
    """``src``'s records rewritten into ``dst`` (stored, as torch writes
    them) with ``edit(name, data)`` applied to each."""
    import zipfile

    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, edit(info.filename, zin.read(info.filename)))


@pytest.mark.parametrize("writer", ["torch", "fastpersist"])
@pytest.mark.parametrize(
    "claim",
    [
        (b"J\x00\x00\x00\x04\x85", b"K\x01\x85"),  # size (2**26,): 256 MiB of a 16-byte record
        (b"K\x04\x85", b"J\x00\x00\x00\x04\x85"),  # stride 2**26
    ],
    ids=["size", "stride"],
)
def test_a_tensor_reaching_past_its_record_is_corrupt_not_grown(tmp_path, writer, claim):
    """Regression: a pickle whose tensor claims more elements (a larger
    size or stride) than its storage's record holds was loaded: the read's
    storage was grown by ``set_`` to fit the claim (a huge allocation), and
    the tensor came back as the file's bytes padded with memory the file
    never held; ``verify`` called the file OK. torch.load refuses it (its
    storages cannot be resized)."""
    src, bad = tmp_path / "a.pt", tmp_path / "bad.pt"
    sd = {"a": torch.arange(4, dtype=torch.float32)}
    torch.save(sd, src) if writer == "torch" else fastpersist.write_state_dict(sd, src)

    def edit(name, data):
        if name.endswith("data.pkl"):  # the size and stride tuples, each memoized (BINPUT)
            out, n = re.subn(rb"K\x04\x85(q.)K\x01\x85", lambda m: claim[0] + m[1] + claim[1], data, flags=re.DOTALL)
            assert n == 1
            return out
        return data

    _rezip(src, bad, edit)
    with pytest.raises(RuntimeError):
        torch.load(bad, weights_only=True)
    from fastpersist.verify import verify_file

    for kw in ({}, {"weights_only": False}, {"map_location": "cpu"}, {"verify": False}):
        with pytest.raises(fastpersist.CorruptCheckpointError, match="reach"):
            fastpersist.read_state_dict(bad, **kw)
    with pytest.raises(fastpersist.CorruptCheckpointError, match="reaches"):
        verify_file(bad)
    r = subprocess.run([sys.executable, "-m", "fastpersist", "verify", str(bad)], capture_output=True, text=True)
    assert r.returncode == 1, r.stdout + r.stderr


def test_a_damaged_legacy_file_is_corrupt_not_a_bare_error(tmp_path):
    """Regression: single-bit flips in a legacy (non-zip) torch file made
    read_state_dict raise bare KeyError, AssertionError, TypeError,
    ValueError, UnicodeDecodeError from inside torch.load, and verify
    passed some files that fail to load (a protocol number not torch's, a
    rebuild given too few arguments). A load's error is now torch's own only
    for an intact file; damage is CorruptCheckpointError, and verify agrees.
    (A storage location no backend takes stays torch's error: the check
    cannot tell a damaged one from a backend that is not installed.)"""
    from fastpersist.verify import verify_file

    sd = {"w": torch.randn(16, 8), "b": torch.arange(10), "n": {"x": torch.ones(3, dtype=torch.bfloat16)}, "s": 5}
    src = tmp_path / "legacy.pt"
    torch.save(sd, src, _use_new_zipfile_serialization=False)
    raw = src.read_bytes()
    q = tmp_path / "flipped.pt"
    bare = []
    for pos in range(0, min(len(raw), 900), 2):
        for bit in (0, 2, 5, 7):
            b = bytearray(raw)
            b[pos] ^= 1 << bit
            q.write_bytes(b)
            try:
                fastpersist.read_state_dict(q)
                continue
            except fastpersist.CorruptCheckpointError:
                continue
            except Exception as e:  # noqa: BLE001 - the test sorts them
                if "Weights only load failed" in str(e):
                    continue  # torch's refusal of a global the flip made up, in its words
                if "don't know how to restore data location" in str(e):
                    continue  # a location no backend here takes ("cpw"): torch's words (a backend not installed?)
                bare.append((pos, bit, type(e).__name__, str(e)[:80]))
                continue
    assert not bare, bare[:10]
    # verify agrees with the load where the load fails
    b = bytearray(raw)
    b[raw.index(b"\xe9\x03") + 1] ^= 0x04  # the protocol number 1001 -> 1005
    q.write_bytes(b)
    with pytest.raises(fastpersist.CorruptCheckpointError):
        verify_file(q)
    with pytest.raises(fastpersist.CorruptCheckpointError):
        fastpersist.read_state_dict(q)


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_an_io_error_writing_a_special_file_is_a_write_error(tmp_path, fmt):
    """Regression: a save to a device or FIFO (written in place, as torch
    does) raised the bare OSError of its write (ENOSPC from /dev/full, EPIPE
    from a FIFO whose reader left), not the documented WriteError."""
    import errno

    from helpers import full_device

    full = full_device(tmp_path)
    with pytest.raises(fastpersist.WriteError) as ei:
        fastpersist.write_state_dict({"a": torch.ones(300_000)}, full, format=fmt)
    assert ei.value.errno == errno.ENOSPC and ei.value.filename == full
    assert stat.S_ISCHR(os.stat(full).st_mode)  # written into, never replaced


def _legacy_file(path, obj) -> bytes:
    torch.save(obj, path, _use_new_zipfile_serialization=False)
    return path.read_bytes()


@pytest.mark.parametrize("fmt", ["legacy", "zip"])
def test_an_unknown_storage_class_is_corrupt_for_verify(tmp_path, fmt):
    """Regression: a storage class name torch does not have (one bit
    flipped: ``FloatStorage`` -> ``FloapStorage``) made verify_file raise a
    bare ValueError, and ``fastpersist verify`` die with a traceback
    without checking the paths after it. It is CorruptCheckpointError."""
    from fastpersist.verify import verify_file

    src, bad = tmp_path / "src.pt", tmp_path / "bad.pt"
    sd = {"w": torch.ones(4), "v": torch.arange(3)}
    if fmt == "legacy":
        bad.write_bytes(_legacy_file(src, sd).replace(b"FloatStorage", b"FloapStorage"))
    else:
        torch.save(sd, src)
        _rezip(src, bad, lambda n, d: d.replace(b"FloatStorage", b"FloapStorage") if n.endswith("data.pkl") else d)
    with pytest.raises(fastpersist.CorruptCheckpointError, match="FloapStorage"):
        verify_file(bad)


def test_verify_takes_every_storage_class_torch_writes(tmp_path):
    """What torch.save names a storage's class in each format
    (``torch.storage.UntypedStorage`` for an untyped storage, the typed
    classes for tensors) verifies."""
    from fastpersist.verify import verify_file

    p = tmp_path / "s.pt"
    torch.save({"s": torch.arange(5.0).untyped_storage(), "t": torch.ones(2, dtype=torch.bfloat16)}, p)
    assert verify_file(p).format == "torch"


def _one_digit_changed(raw: bytes) -> bytes:
    """The first storage key of a legacy file's object pickle (a
    BINUNICODE of digits: an address) with its last digit changed."""
    m = next(m for m in re.finditer(rb"X([\x08-\x18])\x00\x00\x00(\d+)", raw) if len(m[2]) == m[1][0])
    b = bytearray(raw)
    i = m.end(2) - 1
    b[i] = ord("0") if b[i] != ord("0") else ord("1")
    return bytes(b)


@pytest.mark.parametrize(
    "damage",
    [
        "storage key",  # the pickle names a storage the file does not hold
        "offset",  # a tensor reaching past its storage (offset 0 -> 64)
        "size tuple",  # a size given as an int (its TUPLE1 gone)
    ],
)
def test_a_damaged_legacy_pickle_fails_verify(tmp_path, damage):
    """Regression: verify called legacy files OK whose object pickle names
    a storage the file does not hold (torch.load then hands out a storage
    it never fills: uninitialized memory), lays a tensor past its storage,
    or gives a tensor a size that is not a tuple (torch.load refuses
    both); the structure check now refuses all three."""
    from fastpersist.verify import verify_file

    src, bad = tmp_path / "src.pt", tmp_path / "bad.pt"
    w = torch.arange(64, dtype=torch.float32)
    raw = _legacy_file(src, {"w": w, "v": w[8:16], "b": torch.arange(10)})
    assert verify_file(src) == ("torch-legacy", 2)
    pat = b"QK\x00K\x0a\x85"  # BINPERSID, offset 0, size (10,) of "b"
    assert raw.count(pat) == 1
    if damage == "storage key":
        out = _one_digit_changed(raw)
    elif damage == "offset":
        out = raw.replace(pat, b"QK\x40K\x0a\x85")
    else:
        out = raw.replace(pat, pat[:-1])
    bad.write_bytes(out)
    with pytest.raises(fastpersist.CorruptCheckpointError):
        verify_file(bad)


@pytest.mark.parametrize(
    "claim",
    [
        (b"K\x04", b"K\x01\x85"),  # size 4, an int
        (b"K\x04\x85", b"J\xff\xff\xff\xff\x85"),  # stride (-1,)
        (b"J\xfc\xff\xff\xff\x85", b"K\x01\x85"),  # size (-4,)
        (b"K\x04\x85", b"K\x01K\x01\x86"),  # size and stride of different lengths
    ],
    ids=["size-int", "stride-negative", "size-negative", "lengths"],
)
def test_a_zip_pickle_with_rebuild_arguments_torch_refuses_fails_verify(tmp_path, claim):
    """Regression: verify called a zip checkpoint OK (CRCs consistent: a
    crafted pickle) whose tensor rebuild gives a size as an int, a
    negative size or stride, or sizes and strides of different lengths;
    torch.load refuses each."""
    from fastpersist.verify import verify_file

    src, bad = tmp_path / "a.pt", tmp_path / "bad.pt"
    torch.save({"a": torch.arange(4, dtype=torch.float32)}, src)

    def edit(name, data):
        if name.endswith("data.pkl"):
            out, n = re.subn(rb"K\x04\x85(q.)K\x01\x85", lambda m: claim[0] + m[1] + claim[1], data, flags=re.DOTALL)
            assert n == 1
            return out
        return data

    _rezip(src, bad, edit)
    with pytest.raises(Exception):  # noqa: B017 - whatever torch raises
        torch.load(bad, weights_only=True)
    with pytest.raises(fastpersist.CorruptCheckpointError):
        verify_file(bad)
    with pytest.raises(fastpersist.CorruptCheckpointError):
        fastpersist.read_state_dict(bad)


def test_an_intact_legacy_file_gets_torchs_own_error(tmp_path):
    """Regression: when torch.load raised its own error reading an intact
    legacy file (a ``map_location`` that raises, ``"cuda"`` without CUDA),
    read_state_dict reported the file corrupt ("Ran out of input"): the
    structure check read through a duplicate of the descriptor, whose
    offset torch.load had left at the end of the file. torch's error now
    stands, as torch.load raises it."""
    p = tmp_path / "legacy.pt"
    torch.save({"b": torch.arange(10), "n": {"w": torch.ones(3)}}, p, _use_new_zipfile_serialization=False)

    def refuse(storage, location):
        raise ValueError("this map_location refuses")

    with pytest.raises(ValueError) as ei:
        fastpersist.read_state_dict(p, map_location=refuse)
    assert type(ei.value) is ValueError and str(ei.value) == "this map_location refuses"
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError) as ei:
            fastpersist.read_state_dict(p, map_location="cuda")
        assert not isinstance(ei.value, fastpersist.CorruptCheckpointError) and "CUDA" in str(ei.value)
    assert fastpersist.read_state_dict(p)["n"]["w"].tolist() == [1.0] * 3


def test_a_legacy_file_naming_a_storage_it_does_not_hold_is_not_loaded(tmp_path):
    """Regression: one digit of a storage key changed in a legacy file's
    pickle: torch.load hands out a storage it never fills, and
    read_state_dict returned its uninitialized memory as the tensor. The
    structure check runs after a successful legacy load too."""
    src, bad = tmp_path / "src.pt", tmp_path / "bad.pt"
    w = torch.arange(64, dtype=torch.float32)
    bad.write_bytes(_one_digit_changed(_legacy_file(src, {"w": w, "v": w[8:16]})))
    torch.load(bad)  # torch loads it (unfilled memory)
    for kw in ({}, {"weights_only": False}, {"map_location": "cpu"}):
        with pytest.raises(fastpersist.CorruptCheckpointError, match="does not hold"):
            fastpersist.read_state_dict(bad, **kw)


def test_a_legacy_save_of_a_module_object_reads_and_verifies(tmp_path):
    """Regression: a legacy save of a whole module (``weights_only=False``
    files, whose pickle names the module's class by a persistent id) was
    called not well-formed by verify ("NEWOBJ class argument must be a
    type"); the structure check, which a legacy read now also runs, takes it."""
    from fastpersist.verify import verify_file

    p = tmp_path / "m.pt"
    m = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU())
    torch.save(m, p, _use_new_zipfile_serialization=False)
    assert verify_file(p) == ("torch-legacy", 2)
    got = fastpersist.read_state_dict(p, weights_only=False)
    assert_same(got.state_dict(), m.state_dict())


def _with_memo_put(pkl: bytes, index: int) -> bytes:
    """A protocol-2 pickle with one LONG_BINPUT of ``index`` after its
    first opcode after PROTO (the object it memoizes is never fetched)."""
    import pickletools

    ops = [pos for _, _, pos in pickletools.genops(pkl)]
    assert pkl[:1] == b"\x80" and len(ops) > 2
    return pkl[: ops[2]] + b"r" + index.to_bytes(4, "little") + pkl[ops[2] :]


def test_a_huge_memo_index_costs_no_memory(tmp_path):
    """Regression: a pickle with one LONG_BINPUT of a large index (valid,
    CRCs consistent; torch.load loads it in a few MB) made the scans of
    verify, of a legacy file's structure check and of a read whose pickle
    mentions "cuda" grow memory by 16 bytes per index (CPython's C
    unpickler sizes its memo array by the index: 2**27, 2 GiB); near
    2**31 verify failed with MemoryError and called the file corrupt. The
    scans keep their memo in a dict; checked under a 4 GiB address-space
    limit with an index of 2**30 (16 GiB)."""
    import io
    import pickletools

    index = 1 << 30
    src, zp, lp = tmp_path / "src.pt", tmp_path / "memo.pt", tmp_path / "legacy.pt"
    sd = {"cuda_w": torch.arange(6.0), "n": [torch.ones(2, dtype=torch.int64)]}
    torch.save(sd, src)
    _rezip(src, zp, lambda n, d: _with_memo_put(d, index) if n.endswith("data.pkl") else d)
    # legacy: the magic number's, the object's and the storage keys' pickles
    f = io.BytesIO(_legacy_file(tmp_path / "l0.pt", sd))
    pickles = []
    for _ in range(5):
        start = f.tell()
        for _ in pickletools.genops(f):
            pass
        pickles.append(f.getvalue()[start : f.tell()])
    for i in (0, 3, 4):
        pickles[i] = _with_memo_put(pickles[i], index)
    lp.write_bytes(b"".join(pickles) + f.read())
    for p in (zp, lp):
        assert_same(torch.load(p), sd)
    code = textwrap.dedent(
        f"""
        import resource, zipfile, fastpersist, torch
        from fastpersist.pickling import LocationScan
        from fastpersist.verify import verify_file
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
        z = zipfile.ZipFile({str(zp)!r})
        pkl = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
        scan = LocationScan(pkl)
        scan.load()
        assert sorted(scan.locations.values()) == ["cpu", "cpu"], scan.locations
        assert fastpersist.detect_format({str(lp)!r}) == "torch-legacy"
        for p in ({str(zp)!r}, {str(lp)!r}):
            print(verify_file(p))
            sd = fastpersist.read_state_dict(p)
            assert torch.equal(sd["cuda_w"], torch.arange(6.0)), sd
        print("ALL")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ALL" in r.stdout, (r.stdout, r.stderr[-3000:])


@pytest.mark.parametrize("edit", ["retyped", "fewer-elements"])
def test_a_record_longer_than_its_storage_is_corrupt(tmp_path, edit):
    """Regression: a data record longer than the storage the pickle
    describes (CRCs consistent: the storage class changed from
    ``FloatStorage`` to ``ByteStorage``, or its element count made
    smaller) was loaded, its bytes reinterpreted, and verify called it
    OK; torch.load refuses every such file (a record must hold exactly
    the storage's bytes). Both now name the record."""
    from fastpersist.verify import verify_file

    src, bad = tmp_path / "a.pt", tmp_path / "bad.pt"
    torch.save({"w": torch.arange(8, dtype=torch.float32)}, src)

    def change(name, data):
        if not name.endswith("data.pkl"):
            return data
        if edit == "retyped":  # 8 elements, 1 byte each
            assert data.count(b"torch\nFloatStorage") == 1
            return data.replace(b"torch\nFloatStorage", b"torch\nByteStorage")
        # the storage's element count 8 -> 6 (the tensor: 4 elements)
        out, n = re.subn(
            rb"K\x08t(q.)QK\x00K\x08\x85", lambda m: b"K\x06t" + m[1] + b"QK\x00K\x04\x85", data, flags=re.DOTALL
        )
        assert n == 1
        return out

    _rezip(src, bad, change)
    with pytest.raises(RuntimeError, match="record size"):
        torch.load(bad, weights_only=True)
    for kw in ({}, {"weights_only": False}, {"map_location": "cpu"}, {"verify": False}):
        with pytest.raises(fastpersist.CorruptCheckpointError, match="data/0"):
            fastpersist.read_state_dict(bad, **kw)
    with pytest.raises(fastpersist.CorruptCheckpointError, match="data/0"):
        verify_file(bad)


def _retyped_reference(path, elements: int, count: int = 1) -> None:
    """A torch.save file of one 1024-float record whose pickle then refers
    to the same record ``count`` times more as a HalfStorage of
    ``elements`` elements (one memoized persistent id), written by torch's
    own zip writer (right CRCs)."""
    import zipfile

    src = path.with_suffix(".src")
    torch.save({"w": torch.arange(1024.0)}, src)
    with zipfile.ZipFile(src) as z:
        recs = [(i.filename.split("/", 1)[1], z.read(i.filename)) for i in z.infolist()]
    pkl = dict(recs)["data.pkl"]

    def text(s: str) -> bytes:
        return b"X" + struct.pack("<I", len(s)) + s.encode()

    pid = b"(" + text("storage") + b"ctorch\nHalfStorage\n" + text("0") + text("cpu")
    pid += b"J" + struct.pack("<i", elements) + b"tr\xff\xff\x00\x00"  # LONG_BINPUT 65535
    body = text("again") + b"](" + pid + b"Q" + b"j\xff\xff\x00\x00Q" * (count - 1) + b"es"
    w = torch._C.PyTorchFileWriter(str(path))
    for name, data in recs:
        if name not in ("version", ".data/version"):
            data = pkl[:-1] + body + b"." if name == "data.pkl" else data
            w.write_record(name, data, len(data))
    w.write_end_of_file()


def test_a_reference_of_another_size_to_a_record_is_refused_as_torch_refuses_it(tmp_path):
    """Regression: a second reference to a record as another dtype and a
    smaller size got a copy of the record of its own; a 4 MiB file with a
    thousand such references (6 bytes of pickle each) took 2.6 GB, where
    torch.load refuses the file (the record is not the size it asks for).
    A negative size was taken too; verify called such files OK."""
    from fastpersist.verify import verify_file

    # torch before 2.12 hands every later reference the first one's storage
    # (its dtype and size, no copy); torch since makes each from the record,
    # which must then hold exactly what the reference asks for.
    def same(got, want):
        assert torch.equal(got["w"], want["w"]) and len(got["again"]) == len(want["again"])
        for a, b in zip(got["again"], want["again"]):
            assert a.dtype == b.dtype and a.nbytes() == b.nbytes() and a.data_ptr() != 0

    for elements in (1023, 4000, -1):
        p = tmp_path / f"r{elements}.pt"
        _retyped_reference(p, elements, count=50)
        try:
            want = torch.load(p)
        except (RuntimeError, TypeError):
            with pytest.raises(fastpersist.CorruptCheckpointError, match="holds 4096 bytes"):
                fastpersist.read_state_dict(p)
        else:
            same(fastpersist.read_state_dict(p), want)
        with pytest.raises(fastpersist.CorruptCheckpointError):
            verify_file(p)
    # The record's own size under another dtype: as torch.load gives it.
    p = tmp_path / "same.pt"
    _retyped_reference(p, 2048, count=3)
    got = fastpersist.read_state_dict(p)
    same(got, torch.load(p))
    assert all(a.nbytes() == 4096 for a in got["again"])
    verify_file(p)


def test_a_tensor_claiming_more_than_its_record_is_refused_before_anything_is_allocated(tmp_path):
    """Regression: with weights_only=True, a pickle the fast path refuses
    went to torch's weights-only unpickler, whose rebuild grew the storage
    read from the file to what the pickle claimed (a 1 KB file: 4 GiB, or
    an allocator's RuntimeError naming nothing) before the size check."""
    import zipfile

    from fastpersist.verify import verify_file

    src, p = tmp_path / "src.pt", tmp_path / "big.pt"
    torch.save({"w": torch.zeros(3)}, src)
    with zipfile.ZipFile(src) as z:
        recs = [(i.filename.split("/", 1)[1], z.read(i.filename)) for i in z.infolist()]
    w = torch._C.PyTorchFileWriter(str(p))
    for name, data in recs:
        if name == "data.pkl":
            i = data.index(b"QK\x00K\x03\x85")  # offset 0, size (3,)
            data = data[:i] + b"QK\x00\x8a\x08" + (1 << 40).to_bytes(8, "little") + b"\x85" + data[i + 6 :]
        if name not in ("version", ".data/version"):
            w.write_record(name, data, len(data))
    w.write_end_of_file()
    with pytest.raises(RuntimeError, match="not resizable"):
        torch.load(p, weights_only=True)
    for weights_only in (True, False):
        with pytest.raises(fastpersist.CorruptCheckpointError, match="reach"):
            fastpersist.read_state_dict(p, weights_only=weights_only)
    with pytest.raises(fastpersist.CorruptCheckpointError):
        verify_file(p)


def _zip_of(path, records) -> None:
    w = torch._C.PyTorchFileWriter(str(path))
    for name, data in records:
        w.write_record(name, data, len(data))
    w.write_end_of_file()


def test_verify_checks_the_pickle_and_records_torch_load_reads(tmp_path):
    """Regression: verify checked the first record whose name ends in
    data.pkl (``xdata.pkl``), not the one torch.load reads, and took a
    persistent id that is not a storage's; both files were "OK"."""
    import zipfile

    from fastpersist.verify import verify_file

    src = tmp_path / "src.pt"
    torch.save({"w": torch.ones(4)}, src)
    with zipfile.ZipFile(src) as z:
        recs = [(i.filename.split("/", 1)[1], z.read(i.filename)) for i in z.infolist()]
    key = b"X\x01\x00\x00\x000"  # the storage key '0' in the pickle
    bad = [(n, d.replace(key, b"X\x01\x00\x00\x007") if n == "data.pkl" else d) for n, d in recs]
    other = tmp_path / "other.pt"
    _zip_of(other, [("xdata.pkl", pickle.dumps({}, 2))] + [r for r in bad if r[0] not in ("version", ".data/version")])
    pid = tmp_path / "pid.pt"
    plain = [r for r in recs if not r[0].startswith("data") and r[0] not in ("version", ".data/version")]
    _zip_of(pid, plain + [("data.pkl", b"\x80\x02}X\x01\x00\x00\x00aK\x05Qs.")])
    for p in (other, pid):
        with pytest.raises(Exception):  # noqa: B017 - torch's loader refuses it in its words
            torch.load(p)
        with pytest.raises(fastpersist.CorruptCheckpointError):
            fastpersist.read_state_dict(p)
        with pytest.raises(fastpersist.CorruptCheckpointError):
            verify_file(p)


def test_verify_of_a_legacy_file_never_reserves_what_a_string_claims(tmp_path):
    """Regression: verify scanned a legacy file's pickle through a buffered
    file, which allocates the length an opcode claims before reading: a
    200-byte file claiming a string of 1 TiB ran out of memory."""
    from fastpersist.verify import verify_file

    head = pickle.dumps(0x1950A86A20F9469CFC6C, 2) + pickle.dumps(1001, 2)
    head += pickle.dumps({"protocol_version": 1001, "little_endian": True, "type_sizes": {"int": 4}}, 2)
    p = tmp_path / "legacy.pt"
    p.write_bytes(head + b"\x80\x04\x8e" + struct.pack("<Q", 1 << 40) + b"a" * 64 + b"." + pickle.dumps([], 2))
    with pytest.raises(fastpersist.CorruptCheckpointError) as e:
        verify_file(p)
    assert "MemoryError" not in str(e.value) and str(1 << 40) in str(e.value)


def test_globals_are_found_where_torch_load_finds_them(tmp_path):
    """Regression: with weights_only=False, a storage class named under a
    module that has none (torch.load's rule: any "...Storage" name is its
    StorageType) and the module torch.tensor (files of torch < 1.9; torch
    maps it to torch._tensor) raised ModuleNotFoundError where torch.load
    reads the file."""
    import zipfile

    src = tmp_path / "src.pt"
    torch.save({"w": torch.arange(3.0)}, src)
    with zipfile.ZipFile(src) as z:
        recs = [(i.filename.split("/", 1)[1], z.read(i.filename)) for i in z.infolist()]
    pkl = dict(recs)["data.pkl"]
    for name, new in (
        ("storage", pkl.replace(b"ctorch\nFloatStorage\n", b"cnot_a_module\nFloatStorage\n")),
        ("moved", pkl[:-1] + b"X\x01\x00\x00\x00cctorch.tensor\nTensor\ns."),
    ):
        assert new != pkl
        p = tmp_path / f"{name}.pt"
        _zip_of(p, [(n, new if n == "data.pkl" else d) for n, d in recs if n not in ("version", ".data/version")])
        want = torch.load(p, weights_only=False)
        got = fastpersist.read_state_dict(p, weights_only=False)
        assert got.keys() == want.keys() and torch.equal(got["w"], want["w"])
        if name == "moved":
            assert got["c"] is want["c"] is torch.Tensor


def test_directories_a_save_makes_are_fsynced_into_their_parents(tmp_path, monkeypatch):
    """Regression: the directories a Checkpointer, a sharded or DCP save, a
    replica holder or an adapter makes were never fsynced into their
    parents: on a file system that does not order metadata, a power loss
    could take a new directory, with every checkpoint committed in it."""
    import fastpersist.options as fo

    synced = []
    real = fo.fsync_dir

    def spy(path):
        synced.append(os.path.abspath(path))
        return real(path)

    monkeypatch.setattr(fo, "fsync_dir", spy)
    ck_dir, stage = tmp_path / "a" / "b" / "ck", tmp_path / "s" / "stage"
    with fastpersist.Checkpointer(ck_dir, stage_dir=stage, every=1):
        pass
    for d in (ck_dir, ck_dir.parent, ck_dir.parent.parent, stage, stage.parent):
        assert str(d.parent) in synced and str(d) in synced, (d, synced)
    synced.clear()
    fo.make_dirs(str(ck_dir))  # already there: nothing to make, nothing to sync
    assert synced == []


def _handed_to_torch(path, version: bytes = b"3\n", byteorder: bytes = b"little") -> None:
    """A torch.save zip that the reader hands to torch.load (a version
    record spelled otherwise, or the other byte order), every CRC32 right,
    then one bit of a data record flipped (its CRC32 now wrong)."""
    import io
    import zipfile

    t = torch.arange(8, dtype=torch.float32)
    buf = io.BytesIO()
    torch.save({"w": t}, buf)
    with zipfile.ZipFile(buf) as z:
        recs = {n: z.read(n) for n in z.namelist()}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as out:
        for n, data in recs.items():
            if n.endswith("/version"):
                data = version
            elif n.endswith("/byteorder"):
                data = byteorder
            elif n.endswith("/data/0") and byteorder == b"big":
                data = t.numpy().byteswap().tobytes()  # what a big-endian torch.save writes
            out.writestr(n, data)
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
    raw = bytearray(open(path, "rb").read())
    at = info.header_offset + 30 + struct.unpack_from("<HH", raw, info.header_offset + 26)[0]
    at += struct.unpack_from("<HH", raw, info.header_offset + 26)[1]
    raw[at + 13] ^= 0x40
    open(path, "wb").write(raw)


@pytest.mark.parametrize(
    "kind", [{"version": b"3\r\n"}, {"version": b" 3\n"}, {"version": b"+3\n"}, {"byteorder": b"big"}], ids=repr
)
def test_a_read_handed_to_torch_load_still_checks_every_crc(tmp_path, kind):
    """Regression (found in a hunt): a file the reader hands to torch.load
    (a version record torch reads as 3 and the reader's check does not, a
    big-endian file) was checked only for its pickle's and small records'
    CRC32s: a damaged data record loaded, wrong, and ``ReadStats.verified``
    said True. torch.load checks none: every record is checked first."""
    p = tmp_path / "handed.pt"
    _handed_to_torch(p, **kind)
    with pytest.raises(fastpersist.CorruptCheckpointError, match="data/0.*CRC32"):
        fastpersist.read_state_dict(p, verify=True)
    fastpersist.read_state_dict(p, verify=False)  # (read unchecked when asked)


class _Pid:
    """Pickles as a persistent id (a storage reference)."""

    def __init__(self, *pid) -> None:
        self.pid = pid


class _Call:
    """Pickles as ``fn(*args)``."""

    def __init__(self, fn, *args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _crafted_zip(path, obj, records: dict) -> None:
    """A torch.save-shaped zip of the pickle of ``obj`` (``_Pid``s as
    persistent ids) and the data ``records``, every CRC32 right."""
    import io
    import zipfile

    class Pickler(pickle.Pickler):
        def persistent_id(self, o):
            return o.pid if isinstance(o, _Pid) else None

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump(obj)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", buf.getvalue())
        z.writestr("archive/byteorder", "little")
        for k, v in records.items():
            z.writestr(f"archive/data/{k}", v)
        z.writestr("archive/version", "3\n")


@pytest.mark.parametrize("dtype", [torch.uint16, torch.complex128, torch.float8_e4m3fn])
def test_a_tensor_of_a_dtype_of_its_own_is_measured_in_its_elements(tmp_path, dtype):
    """Regression (found in a hunt): torch.save writes tensors of dtypes
    with no storage class (uint16-64, float8, complex32, ...) with
    ``_rebuild_tensor_v3`` over an untyped storage; the checks measured
    their reach in the storage's 1-byte elements. A tensor claiming twice
    its record's bytes passed ``verify``, and a read let torch's ``set_``
    grow the storage it had read up to 16x before refusing it. Now each is
    measured in its own dtype's elements: verify and the read refuse it
    at once, and an intact one still reads."""
    import collections

    from fastpersist.verify import verify_file

    n = 6 // dtype.itemsize if dtype.itemsize <= 6 else 1
    nbytes = n * dtype.itemsize
    storage = _Pid("storage", torch.UntypedStorage, "0", "cpu", nbytes)
    hooks = collections.OrderedDict()
    for claimed, ok in ((n, True), (2 * n, False)):
        p = tmp_path / f"v3-{claimed}.pt"
        tensor = _Call(torch._utils._rebuild_tensor_v3, storage, 0, (claimed,), (1,), False, hooks, dtype)
        _crafted_zip(p, {"t": tensor}, {"0": bytes(range(nbytes))})
        if ok:
            verify_file(p)
            for weights_only in (True, False):
                import warnings

                with warnings.catch_warnings():
                    warnings.simplefilter("error")  # (torch.load warns of nothing: TypedStorage deprecation)
                    got = fastpersist.read_state_dict(p, weights_only=weights_only)["t"]
                assert got.dtype == dtype and got.shape == (n,)
                assert bytes(got.view(torch.uint8).numpy()) == bytes(range(nbytes))
            continue
        with pytest.raises(fastpersist.CorruptCheckpointError):
            verify_file(p)
        for weights_only in (True, False):
            with pytest.raises(fastpersist.CorruptCheckpointError, match="reaches"):
                fastpersist.read_state_dict(p, weights_only=weights_only)


@pytest.mark.parametrize("key", [0, "a/0"], ids=repr)
def test_storage_keys_are_read_and_verified_as_torch_load_reads_them(tmp_path, key):
    """Regression (found in a hunt): torch.load reads the record
    ``data/{key}`` for any storage key; the reader looked an int key up as
    is (and called the file damaged) while verify passed it, and verify
    called a key holding "/" missing while the reader read it."""
    from fastpersist.verify import verify_file

    storage = _Pid("storage", torch.FloatStorage, key, "cpu", 2)
    tensor = _Call(
        torch._utils._rebuild_tensor_v2, storage, 0, (2,), (1,), False, __import__("collections").OrderedDict()
    )
    p = tmp_path / "keys.pt"
    _crafted_zip(p, {"t": tensor}, {str(key): torch.tensor([1.0, 2.0]).numpy().tobytes()})
    assert torch.load(p)["t"].tolist() == [1.0, 2.0]
    verify_file(p)
    for weights_only in (True, False):
        assert fastpersist.read_state_dict(p, weights_only=weights_only)["t"].tolist() == [1.0, 2.0]
