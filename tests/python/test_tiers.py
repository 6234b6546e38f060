"""The object-store tier (issue 20, part 1), against a real S3-compatible
server started on 127.0.0.1 (moto's server mode, a separate process): not a
mocked fsspec."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import fastpersist
import pytest
import torch
from fastpersist.checkpoint_manager import ckpt_name
from helpers import cli_exe

pytest.importorskip("s3fs", reason="the object-store tier is tested with s3fs (pip install 'fastpersist[s3]')")
pytest.importorskip("moto", reason="needs moto[server] for a local S3-compatible server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(env_extra: dict) -> tuple:
    port = _free_port()
    env = {**os.environ, **env_extra}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc, url
        except OSError:
            if proc.poll() is not None:
                pytest.skip("moto's server did not start")
            time.sleep(0.2)
    proc.kill()
    pytest.skip("moto's server did not start in time")


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on 127.0.0.1 and a fresh bucket; yields the
    storage_options that reach it."""
    proc, url = _start_server({})
    creds = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in creds}
    os.environ.update(creds)
    opts = {"client_kwargs": {"endpoint_url": url}, "skip_instance_cache": True}
    import s3fs

    s3fs.S3FileSystem(**opts).mkdir("ckpts")
    try:
        yield {"url": url, "opts": opts}
    finally:
        proc.kill()
        proc.wait()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(300_000, generator=g), "b": torch.arange(step, step + 10)}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _two_of_one_size(tmp_path) -> tuple:
    """Two checkpoints of different values and the same size."""
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    fastpersist.write_state_dict({"w": torch.zeros(1000)}, a)
    fastpersist.write_state_dict({"w": torch.ones(1000)}, b)
    assert a.stat().st_size == b.stat().st_size
    return a, b


def _rotted(store, name: str, data: bytes, marker_of: str = "") -> None:
    """Put ``data`` as ``name`` with the marker of ``marker_of`` (default:
    its own), its identity rewritten to the new object's: damage the store
    does not see (bit rot under the same ETag)."""
    store.fs.pipe_file(store._path(name), data)
    marker = json.loads(store.fs.cat_file(store._path(marker_of or name) + ".fpcommit"))
    marker["identity"] = fastpersist.tiers._identity(store.fs.info(store._path(name)))
    store.fs.pipe_file(store._path(name) + ".fpcommit", json.dumps(marker).encode())


def test_upload_marker_last_and_listing(tmp_path, s3):
    p = tmp_path / "ckpt-000000000001.pt"
    fastpersist.write_state_dict({"step": 1, "state": _state(1)}, p)
    store = fastpersist.tiers.ObjectStore("s3://ckpts/listing", s3["opts"])
    st = fastpersist.upload(p, "s3://ckpts/listing", storage_options=s3["opts"])
    assert st.bytes == p.stat().st_size and st.url.endswith(p.name)
    assert store.committed() == {p.name: p.stat().st_size}
    # Data without its marker (an upload cut short) is not a checkpoint.
    store.fs.put_file(str(p), store.root + "/ckpt-000000000002.pt")
    # A marker whose object is shorter than recorded neither.
    store.fs.pipe_file(store.root + "/ckpt-000000000003.pt", b"short")
    store.fs.pipe_file(store.root + "/ckpt-000000000003.pt.fpcommit", b'{"size": 999}')
    assert list(store.committed()) == [p.name]
    # Downloading verifies CRCs before committing locally.
    out = tmp_path / "back" / p.name
    out.parent.mkdir()
    store.download(p.name, str(out))
    assert out.read_bytes() == p.read_bytes()
    # A damaged object is refused and nothing is left locally.
    bad = bytearray(p.read_bytes())
    bad[len(bad) // 2] ^= 0xFF
    _rotted(store, "ckpt-000000000004.pt", bytes(bad), marker_of=p.name)
    with pytest.raises(fastpersist.CorruptCheckpointError, match="downloaded"):
        store.download("ckpt-000000000004.pt", str(tmp_path / "back" / "x.pt"))
    # One without its marker is not offered (its upload did not complete).
    with pytest.raises(FileNotFoundError, match="no commit marker"):
        store.download("ckpt-000000000002.pt", str(tmp_path / "back" / "x.pt"))
    assert sorted(os.listdir(tmp_path / "back")) == [p.name]
    # A damaged local file is never uploaded.
    (tmp_path / "bad.pt").write_bytes(bytes(bad))
    with pytest.raises(fastpersist.tiers.TierError, match="damaged"):
        store.upload(str(tmp_path / "bad.pt"))
    # Deleting: marker first, then data.
    store.delete("ckpt-000000000004.pt")
    store.delete(p.name)
    assert store.committed() == {}
    with pytest.raises(ValueError):
        store.download("../etc/passwd", str(out))


def test_checkpointer_uploads_retains_and_recovers_from_the_store(tmp_path, s3):
    url = "s3://ckpts/run1"
    local = tmp_path / "local"
    with fastpersist.Checkpointer(local, stage_dir=url, storage_options=s3["opts"], keep_last=2, every=1) as ck:
        for step in range(1, 6):
            ck.save(step, _state(step))
            ck.wait()
    store = fastpersist.tiers.ObjectStore(url, s3["opts"])
    assert sorted(store.committed()) == [ckpt_name(4), ckpt_name(5)]  # retention applied remotely
    rows = fastpersist.checkpoint_manager.list_checkpoints(str(local), url, s3["opts"])
    assert [s for s, _ in rows] == [5, 4]
    assert {c.tier for _, cs in rows for c in cs} == {"local", "object"}
    # The node is lost: the local directory is gone; recovery from the store.
    import shutil

    shutil.rmtree(local)
    ck = fastpersist.Checkpointer(local, stage_dir=url, storage_options=s3["opts"])
    step, state = ck.load_latest()
    ck.close()
    assert step == 5 and _same(state, _state(5))
    assert (local / ckpt_name(5)).exists()  # fetched, verified, committed locally
    # A damaged local copy: the store's copy replaces it.
    p = local / ckpt_name(5)
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 2] ^= 0x55
    p.write_bytes(bytes(raw))
    ck = fastpersist.Checkpointer(local, stage_dir=url, storage_options=s3["opts"])
    step, state = ck.load_latest()
    ck.close()
    assert step == 5 and _same(state, _state(5))
    events = [line for line in (local / "checkpoints.jsonl").read_text().splitlines() if '"fetched"' in line]
    assert len(events) == 2


def test_killed_mid_upload_is_not_taken_and_is_redone(tmp_path, s3):
    url = "s3://ckpts/run2"
    local = tmp_path / "local"
    code = textwrap.dedent(
        f"""
        import os, signal, torch, fastpersist
        from fastpersist import tiers
        opts = {s3["opts"]!r}
        orig = tiers.ObjectStore.upload
        def upload(self, src, name=None):
            # The data goes up; the process dies before the marker.
            self.fs.put_file(src, self._path(name or os.path.basename(src)))
            os.kill(os.getpid(), signal.SIGKILL)
        tiers.ObjectStore.upload = upload
        ck = fastpersist.Checkpointer({str(local)!r}, stage_dir={url!r}, storage_options=opts)
        ck.save(7, {{"w": torch.arange(100_000.0)}})
        ck.wait()
        """
    )
    r = subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True, env=os.environ.copy())
    assert r.returncode == -signal.SIGKILL, r.stderr.decode()[-2000:]
    store = fastpersist.tiers.ObjectStore(url, s3["opts"])
    assert store.committed() == {}  # the data is there, not the marker
    assert store.fs.exists(store.root + "/" + ckpt_name(7))
    # Restart: the local checkpoint newer than any uploaded one goes up again.
    with fastpersist.Checkpointer(local, stage_dir=url, storage_options=s3["opts"]) as ck:
        ck.wait()
    assert list(store.committed()) == [ckpt_name(7)]


def test_wrong_credentials_are_a_clear_error_and_keep_the_local_checkpoint(tmp_path):
    # A server that checks credentials (moto's IAM auth), none of ours valid.
    proc, url = _start_server({"INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    try:
        opts = {
            "client_kwargs": {"endpoint_url": url, "region_name": "us-east-1"},
            "key": "AKIAWRONGWRONGWRONG0",
            "secret": "wrong",
            "skip_instance_cache": True,
        }
        p = tmp_path / "ckpt-000000000001.pt"
        fastpersist.write_state_dict({"step": 1, "state": _state(1)}, p)
        with pytest.raises(fastpersist.tiers.TierError, match="upload of"):
            fastpersist.upload(p, "s3://ckpts/x", storage_options=opts)
        local = tmp_path / "local"
        with fastpersist.Checkpointer(local, stage_dir="s3://ckpts/x", storage_options=opts, keep_last=1) as ck:
            for step in (1, 2):
                ck.save(step, _state(step))
                ck.wait()
        # Nothing reached the store, so no local checkpoint was given up.
        assert sorted(n for n in os.listdir(local) if n.startswith("ckpt-")) == [ckpt_name(1), ckpt_name(2)]
        log = (local / "checkpoints.jsonl").read_text()
        assert log.count('"stage_failed"') == 2
    finally:
        proc.kill()
        proc.wait()


def test_cli_ls_lists_committed_uploads(tmp_path, s3):
    p = tmp_path / ckpt_name(3)
    fastpersist.write_state_dict({"step": 3, "state": _state(3)}, p)
    fastpersist.upload(p, "s3://ckpts/cli", storage_options=s3["opts"])
    store = fastpersist.tiers.ObjectStore("s3://ckpts/cli", s3["opts"])
    store.fs.put_file(str(p), store.root + "/" + ckpt_name(4))  # no marker: not listed
    # The endpoint and keys from the environment, as boto reads them.
    env = {**os.environ, "AWS_ENDPOINT_URL": s3["url"]}
    r = subprocess.run([cli_exe(), "ls", "s3://ckpts/cli"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"s3://ckpts/cli/{ckpt_name(3)}" in r.stdout and ckpt_name(4) not in r.stdout
    assert str(p.stat().st_size) in r.stdout


def test_ls_shows_the_tiers_and_their_telemetry(tmp_path, s3):
    url = "s3://ckpts/tele"
    local = tmp_path / "local"
    with fastpersist.Checkpointer(local, stage_dir=url, storage_options=s3["opts"], every=1) as ck:
        for step in (1, 2):
            ck.save(step, _state(step))
            ck.wait()
    import json

    staged = [json.loads(x) for x in (local / "checkpoints.jsonl").read_text().splitlines() if '"staged"' in x]
    assert [e["step"] for e in staged] == [1, 2]
    assert all(e["tier"] == "object" and e["bytes"] > 0 and e["gbps"] > 0 and e["lag_steps"] == 0 for e in staged)
    env = {**os.environ, "AWS_ENDPOINT_URL": s3["url"]}
    r = subprocess.run(
        [cli_exe(), "ls", str(local), "--stage-dir", url, "--verify"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stdout.splitlines() if x.strip().startswith(("1 ", "2 "))]
    assert len(lines) == 2 and all("local+object" in x and "verified" in x for x in lines), r.stdout


# --- Uploads in parts: O_DIRECT reads, bounded memory, aborted on failure ---


def _big_checkpoint(tmp_path, mib: int = 13):
    p = tmp_path / "ckpt-000000000009.pt"
    fastpersist.write_state_dict({"step": 9, "state": {"w": torch.randn(mib << 18)}}, p)
    return p


def _resident_bytes(path) -> int:
    r = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"fincore unavailable: {r.stderr.decode().strip()}")
    return int(r.stdout.split()[0])


def test_upload_in_parts_with_bounded_memory(tmp_path, s3):
    p = _big_checkpoint(tmp_path)
    store = fastpersist.tiers.ObjectStore("s3://ckpts/parts", s3["opts"], part_bytes=5 << 20, concurrency=2)
    calls, reads, lock = [], [], threading.Lock()
    state = {"in_flight": 0, "most": 0, "sent": 0}
    call_s3, read_part = store.fs.call_s3, store._read_part

    def counting_call(method, **kw):
        calls.append(method)
        if method != "upload_part":
            return call_s3(method, **kw)
        with lock:
            state["in_flight"] += 1
            state["most"] = max(state["most"], state["in_flight"])
        try:
            time.sleep(0.05)  # slow network: the reader must wait, not run ahead
            return call_s3(method, **kw)
        finally:
            with lock:
                state["in_flight"] -= 1
                state["sent"] += 1

    def counting_read(fd, off, n, whole):
        with lock:
            reads.append((off, state["sent"]))
        return read_part(fd, off, n, whole)

    store.fs.call_s3, store._read_part = counting_call, counting_read
    st = store.upload(str(p))
    size = p.stat().st_size
    assert st.bytes == size
    parts = -(-size // (5 << 20))
    assert parts >= 3 and calls.count("upload_part") == parts
    assert calls[0] == "create_multipart_upload" and "complete_multipart_upload" in calls
    assert state["most"] <= 2
    # Part k is read only once parts k-2 and before have been sent: never
    # more than `concurrency` parts in memory.
    assert all(sent >= k - 2 for k, (_, sent) in enumerate(reads)), reads
    out = tmp_path / "back.pt"
    store.download(p.name, str(out))
    assert out.read_bytes() == p.read_bytes()


def test_upload_reads_with_o_direct_and_leaves_no_page_cache(tmp_path, s3):
    p = _big_checkpoint(tmp_path, mib=16)
    fd = os.open(p, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    if _resident_bytes(p) > 1 << 20:
        pytest.skip("this file system keeps the file in memory (tmpfs?)")
    fastpersist.upload(p, "s3://ckpts/direct", storage_options=s3["opts"], part_bytes=5 << 20)
    # Only the zip directory and the pickle were read through the page cache.
    assert _resident_bytes(p) < 1 << 20


def test_a_failed_part_aborts_the_upload_and_commits_nothing(tmp_path, s3):
    p = _big_checkpoint(tmp_path)
    store = fastpersist.tiers.ObjectStore("s3://ckpts/abort", s3["opts"], part_bytes=5 << 20, concurrency=2)
    call_s3 = store.fs.call_s3

    def failing(method, **kw):
        if method == "upload_part" and kw["PartNumber"] == 2:
            raise ConnectionError("connection reset by peer")
        return call_s3(method, **kw)

    store.fs.call_s3 = failing
    with pytest.raises(fastpersist.tiers.TierError, match="connection reset"):
        store.upload(str(p))
    assert store.committed() == {}
    assert not store.fs.exists(store.root + "/" + p.name)
    pending = call_s3("list_multipart_uploads", Bucket="ckpts").get("Uploads", [])
    assert [u for u in pending if u["Key"].startswith("abort/")] == []
    assert p.exists()  # the local checkpoint is kept


def test_part_options_are_checked(s3):
    with pytest.raises(ValueError, match="5 MiB"):
        fastpersist.tiers.ObjectStore("s3://ckpts/x", s3["opts"], part_bytes=1 << 20)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="concurrency"):
            fastpersist.tiers.ObjectStore("s3://ckpts/x", s3["opts"], concurrency=bad)


def test_other_stores_get_the_parts_through_their_writer(tmp_path):
    p = _big_checkpoint(tmp_path, mib=3)
    store = fastpersist.tiers.ObjectStore("memory://fp-parts", part_bytes=1 << 20)
    assert not store.multipart
    store.upload(str(p))
    assert store.committed() == {p.name: p.stat().st_size}
    assert store.fs.cat_file(store.root + "/" + p.name) == p.read_bytes()


@pytest.mark.parametrize("where", ["dir", "dir/", "file://dir", "cwd"])
def test_an_upload_onto_the_file_itself_is_refused_and_the_file_kept(tmp_path, monkeypatch, where):
    """Regression: uploading a checkpoint to the directory it is in (a
    local store) opened it for writing, truncating the very file being
    read, and raised only after: the checkpoint was lost."""
    p = tmp_path / "ckpt.pt"
    sd = {"w": torch.arange(1000.0)}
    fastpersist.write_state_dict(sd, p)
    before = p.read_bytes()
    monkeypatch.chdir(tmp_path)
    url = {"dir": str(tmp_path), "dir/": str(tmp_path) + "/", "file://dir": f"file://{tmp_path}", "cwd": "."}[where]
    with pytest.raises(ValueError, match="itself"):
        fastpersist.upload(str(p), url)
    assert p.read_bytes() == before
    assert torch.equal(fastpersist.read_state_dict(p)["w"], sd["w"])


def test_an_upload_needs_a_url(tmp_path):
    p = tmp_path / "ckpt.pt"
    fastpersist.write_state_dict({"w": torch.ones(3)}, p)
    with pytest.raises(ValueError, match="url"):
        fastpersist.upload(str(p), "")
    with pytest.raises(TypeError, match="url"):
        fastpersist.upload(str(p), None)


def test_an_upload_to_another_local_directory_works(tmp_path):
    p = tmp_path / "a" / "ckpt.pt"
    p.parent.mkdir()
    fastpersist.write_state_dict({"w": torch.ones(3)}, p)
    (tmp_path / "b").mkdir()
    fastpersist.upload(str(p), str(tmp_path / "b"))
    assert (tmp_path / "b" / "ckpt.pt").read_bytes() == p.read_bytes()


@pytest.mark.parametrize("fmt", ["safetensors", "legacy"])
def test_a_damaged_object_without_crcs_of_its_own_is_refused(tmp_path, s3, fmt):
    """Regression: a download was checked only by verify_file, which checks
    CRC32s of torch zip records alone: a bit flipped in the data of a
    safetensors or legacy-format object came down, replaced the local file
    and loaded wrong values. The commit marker now records the whole
    object's CRC32 (combined from the parts read for the upload), and a
    download is committed only when its bytes have it."""
    sd = {"w": torch.randn(100_000)}
    p = tmp_path / ("a.safetensors" if fmt == "safetensors" else "a.pt")
    if fmt == "safetensors":
        fastpersist.write_state_dict(sd, p, format="safetensors")
    else:
        torch.save(sd, p, _use_new_zipfile_serialization=False)
    store = fastpersist.tiers.ObjectStore(f"s3://ckpts/nocrc-{fmt}", s3["opts"])
    store.upload(str(p))
    bad = bytearray(p.read_bytes())
    bad[-1000] ^= 0x10  # in the tensor data, the same size
    _rotted(store, p.name, bytes(bad))
    assert list(store.committed()) == [p.name]  # listed by its size: the download finds the damage
    local = tmp_path / "local" / p.name
    local.parent.mkdir()
    local.write_bytes(b"mine")
    with pytest.raises(fastpersist.CorruptCheckpointError, match="CRC32"):
        store.download(p.name, str(local))
    assert local.read_bytes() == b"mine" and os.listdir(local.parent) == [p.name]


def test_a_failed_upload_to_a_local_store_keeps_the_committed_copy(tmp_path, monkeypatch):
    """Regression: a store on the local file system was written through
    fsspec's in-place writer: uploading a name again truncated the committed
    object at once, and a failure half-way (a read error, the store full)
    left it cut short, raised fsspec's "Cannot discard if set to autocommit"
    instead of the error, and the name was no longer listed. Now the object
    is written beside itself and renamed over it once complete."""
    root = tmp_path / "store"
    root.mkdir()
    store = fastpersist.tiers.ObjectStore(str(root), part_bytes=1 << 20)
    p = tmp_path / "ck.pt"
    fastpersist.write_state_dict({"w": torch.randn(600_000)}, p)
    store.upload(str(p))
    first = p.read_bytes()
    fastpersist.write_state_dict({"w": torch.randn(700_000)}, p)
    real = store._read_part
    calls = []

    def failing(fd, off, n, whole):
        calls.append(off)
        if len(calls) == 2:
            raise OSError(errno.EIO, "injected read error")
        return real(fd, off, n, whole)

    monkeypatch.setattr(store, "_read_part", failing)
    with pytest.raises(fastpersist.tiers.TierError, match="injected read error"):
        store.upload(str(p))
    assert store.committed() == {"ck.pt": len(first)}
    assert (root / "ck.pt").read_bytes() == first
    assert sorted(os.listdir(root)) == ["ck.pt", "ck.pt.fpcommit"]  # no temporary file left
    monkeypatch.setattr(store, "_read_part", real)
    store.upload(str(p))
    assert (root / "ck.pt").read_bytes() == p.read_bytes()
    back = tmp_path / "back.pt"
    store.download("ck.pt", str(back))
    assert back.read_bytes() == p.read_bytes()


def test_a_local_store_makes_its_folder_as_fsspec_does(tmp_path):
    """Regression: uploads to a store on the local file system went through
    fsspec's writer, which makes missing folders with ``auto_mkdir=True``;
    the rename beside the object (since a failed re-upload cut the committed
    copy short) did not, and raised a TierError. The folder is made where
    fsspec would make it; elsewhere a missing one is FileNotFoundError, as
    before."""
    p = tmp_path / "x.pt"
    fastpersist.write_state_dict({"w": torch.ones(3)}, p)
    made = fastpersist.tiers.ObjectStore(str(tmp_path / "new" / "store"), {"auto_mkdir": True})
    made.upload(str(p))
    assert sorted(os.listdir(tmp_path / "new" / "store")) == ["x.pt", "x.pt.fpcommit"]
    missing = fastpersist.tiers.ObjectStore(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError):
        missing.upload(str(p))
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("where", ["s3", "local"])
def test_a_name_uploaded_again_whose_marker_never_came_is_not_listed(tmp_path, s3, monkeypatch, where):
    """Regression: uploading a committed name again replaced its object
    before its marker; when the new marker never came (the process killed,
    the connection lost) the old marker still listed the name, and its
    download failed its CRC32: a good checkpoint at that name listed as
    committed but lost. A marker now records the identity of the object it
    commits (S3's ETag, a local file's inode and mtime), and a name whose
    object was written again after its marker is neither listed nor
    downloaded; uploading it again commits it."""
    if where == "s3":
        store = fastpersist.tiers.ObjectStore(f"s3://ckpts/again-{os.getpid()}", s3["opts"])
    else:
        (tmp_path / "store").mkdir()
        store = fastpersist.tiers.ObjectStore(str(tmp_path / "store"))
    a, b = _two_of_one_size(tmp_path)
    name = ckpt_name(10)
    store.upload(str(a), name)
    first = json.loads(store.fs.cat_file(store._path(name) + ".fpcommit"))

    def lost(*args, **kwargs):
        raise ConnectionError("connection lost")

    monkeypatch.setattr(store, "_put_small", lost)  # (the marker's write)
    with pytest.raises(fastpersist.tiers.TierError, match="commit marker"):
        store.upload(str(b), name)
    monkeypatch.undo()
    assert json.loads(store.fs.cat_file(store._path(name) + ".fpcommit")) == first  # the old marker is left
    assert store.committed() == {}
    other = tmp_path / "other.pt"
    with pytest.raises(FileNotFoundError, match="written again"):
        store.download(name, str(other))
    assert not other.exists()
    store.upload(str(b), name)
    assert store.committed() == {name: b.stat().st_size}
    store.download(name, str(other))
    assert other.read_bytes() == b.read_bytes()
    assert first["identity"], first  # the store said what the object is


def test_a_name_s3fs_reads_as_another_key_is_refused(s3, tmp_path):
    """Regression: s3fs reads "?versionId=" in a path as a version, so the
    object and its marker of ``a?versionId=3.pt`` both went to the key
    ``a``: the marker overwrote the data (and any object called ``a``)."""
    store = fastpersist.tiers.ObjectStore(f"s3://ckpts/odd-{os.getpid()}", s3["opts"])
    p = tmp_path / "a.pt"
    fastpersist.write_state_dict({"w": torch.arange(10.0)}, p)
    store.fs.pipe_file(store.root + "/a", b"theirs")
    for name in ("a?versionId=3.pt", "a.pt?versionId=x"):
        with pytest.raises(ValueError, match="cannot name an object on S3"):
            store.upload(str(p), name)
        with pytest.raises(ValueError, match="cannot name an object on S3"):
            store.download(name, str(tmp_path / "x.pt"))
    assert store.fs.cat_file(store.root + "/a") == b"theirs"
    for name in ("q?x.pt", "sp ace.pt", "hash#1.pt", "pct%20.pt"):  # odd, but stored under their own key
        store.upload(str(p), name)
        assert name in store.committed()


def test_a_run_that_went_back_sets_the_later_objects_aside(tmp_path, s3):
    """Regression (object tier): after a rollback, run A's later checkpoint
    stayed committed in the store and load_latest took it. A commit of an
    earlier step now sets the later objects aside.

    Regression: only the commit marker moved aside; the data stayed under
    the checkpoint's name, so when the new run reached that step again its
    upload replaced the old run's object (and a second go-back replaced the
    set-aside marker): what was promised kept was lost. The object now
    moves to ``<name>.abandoned`` (``-1``, ``-2``, ... when taken) with its
    marker, committed under that name (downloadable, never counted)."""
    url = f"s3://ckpts/went-back-{os.getpid()}"
    local = tmp_path / "local"

    def run(tag, *steps):
        with fastpersist.Checkpointer(local, stage_dir=url, storage_options=s3["opts"], every=1, keep_last=5) as ck:
            for s in steps:
                ck.save(s, {"run": tag, "x": torch.tensor([s])})
                ck.wait()

    run("A", 100, 200, 300)
    run("B", 210)
    store = fastpersist.tiers.ObjectStore(url, s3["opts"])
    aside = ckpt_name(300) + ".abandoned"
    assert sorted(store.committed()) == [ckpt_name(100), ckpt_name(200), ckpt_name(210), aside]
    run("B", 300)  # the new run reaches the step again
    run("C", 250)  # and goes back again
    assert sorted(store.committed()) == [ckpt_name(s) for s in (100, 200, 210, 250)] + [aside, aside + "-1"]
    for name, want in ((aside, "A"), (aside + "-1", "B")):
        store.download(name, str(tmp_path / "inspect.pt"))
        got = fastpersist.read_state_dict(tmp_path / "inspect.pt", weights_only=False)
        assert (got["step"], got["state"]["run"], got["state"]["x"].item()) == (300, want, 300)
    import shutil

    shutil.rmtree(local)  # node loss: the store decides
    with fastpersist.Checkpointer(local, stage_dir=url, storage_options=s3["opts"]) as ck:
        step, state = ck.load_latest(weights_only=False)
    assert (step, state["run"]) == (250, "C")


def test_a_marker_names_its_object_whatever_the_etags_quotes():
    """Review: services quote ETags differently in listings and in the
    answers to uploads; a marker written with one spelling must still
    commit its object listed with the other, and a local file's inode and
    mtime count only where the store gives them."""
    marker = {"size": 10, "identity": fastpersist.tiers._identity({"ETag": '"abc"'})}
    assert marker["identity"] == {"ETag": "abc"}
    assert fastpersist.tiers._commits(marker, {"size": 10, "ETag": "abc"})
    assert fastpersist.tiers._commits(marker, {"size": 10, "ETag": '"abc"'})
    assert not fastpersist.tiers._commits(marker, {"size": 10, "ETag": '"abd"'})
    assert not fastpersist.tiers._commits(marker, {"size": 11, "ETag": "abc"})
    assert fastpersist.tiers._identity({"ETag": "x", "mtime": 1.5, "ino": 3}) == {"ETag": "x"}
    assert fastpersist.tiers._identity({"mtime": 1.5, "ino": 3}, local=True) == {"mtime": 1.5, "ino": 3}


def test_a_failed_upload_through_a_streaming_store_keeps_the_committed_copy(tmp_path, monkeypatch):
    """Regression: stores written through fsspec's streaming writer got the
    parts under the checkpoint's own name; memory:// publishes an object as
    it is opened (and a buffered writer's close publishes what it has), so a
    re-upload that failed midway replaced the committed copy with a part of
    the new one: the name was no longer committed, its checkpoint lost. The
    parts now go to an object of their own, moved onto the name once whole,
    and removed when the upload fails."""
    p = tmp_path / ckpt_name(4)
    fastpersist.write_state_dict({"step": 4, "state": _state(4)}, p)
    store = fastpersist.tiers.ObjectStore(f"memory://fp-stream-{os.getpid()}/run", part_bytes=64 << 10)
    store.upload(str(p))
    committed = store.committed()
    assert committed == {p.name: p.stat().st_size}
    real, calls = fastpersist.tiers.ObjectStore._read_part, []

    def failing(self, fd, off, n, whole):
        calls.append(off)
        if len(calls) == 3:
            raise OSError(errno.EIO, "Input/output error")  # the local disk fails mid-upload
        return real(self, fd, off, n, whole)

    monkeypatch.setattr(fastpersist.tiers.ObjectStore, "_read_part", failing)
    with pytest.raises(fastpersist.tiers.TierError, match="Input/output error"):
        store.upload(str(p))
    monkeypatch.undo()
    assert store.committed() == committed
    assert sorted(posixpath_names(store)) == [p.name, p.name + ".fpcommit"]  # nothing of the failed upload
    store.download(p.name, str(tmp_path / "back.pt"))
    assert (tmp_path / "back.pt").read_bytes() == p.read_bytes()


def posixpath_names(store) -> list:
    store.fs.invalidate_cache(store.root)
    return [e.rsplit("/", 1)[-1] for e in store.fs.ls(store.root, detail=False)]


def test_two_uploads_of_one_name_to_a_local_store_never_list_a_checkpoint_that_fails(tmp_path, monkeypatch):
    """Regression: a local store's marker took its object's identity (inode,
    mtime) by reading the name back after the rename; another upload of the
    name renamed in between gave the first upload's marker (its size and
    CRC32) the second one's identity: the name was listed as committed and
    every download failed its CRC32 (and retention counted it). The
    identity is now the file the upload made, taken before it is renamed."""
    (tmp_path / "store").mkdir()
    store = fastpersist.tiers.ObjectStore(str(tmp_path / "store"))
    a, b = _two_of_one_size(tmp_path)
    name = ckpt_name(9)
    racing = []

    def race_first(real):
        def call(*args, **kwargs):
            if not racing:  # upload A is past its rename: upload B runs now, whole
                racing.append(True)
                monkeypatch.undo()
                store.upload(str(b), name)
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(store.fs, "info", race_first(store.fs.info))  # (where the identity was read back)
    monkeypatch.setattr(store, "_put_small", race_first(store._put_small))  # (the marker's write)
    store.upload(str(a), name)
    assert racing
    listed = store.committed()
    for n in listed:  # whatever is listed downloads, whole
        store.download(n, str(tmp_path / "back.pt"))
        assert (tmp_path / "back.pt").read_bytes() == b.read_bytes()
    store.upload(str(b), name)  # uploaded again, it is committed
    assert store.committed() == {name: b.stat().st_size}


def test_a_marker_nested_too_deep_to_parse_is_a_damaged_marker(tmp_path):
    """Regression: a commit marker of JSON nested past the decoder's
    recursion raised RecursionError out of the listing and the download."""
    (tmp_path / "store").mkdir()
    store = fastpersist.tiers.ObjectStore(str(tmp_path / "store"))
    p = tmp_path / "one.pt"
    fastpersist.write_state_dict({"w": torch.zeros(1000)}, p)
    store.upload(str(p), ckpt_name(1))
    store.upload(str(p), ckpt_name(2))
    (tmp_path / "store" / (ckpt_name(2) + ".fpcommit")).write_bytes(b"[" * 100_000)
    assert store.committed() == {ckpt_name(1): p.stat().st_size}
    with pytest.raises(fastpersist.CorruptCheckpointError, match="damaged commit marker"):
        store.download(ckpt_name(2), str(tmp_path / "back.pt"))


def test_a_local_stores_marker_is_never_written_through_a_link(tmp_path):
    """Regression: a store seeded from another run's with links (``ln -s
    ../run1/* run2/``) had its commit markers written through the links:
    run1's marker then described run2's object, and run1's committed
    checkpoint was no longer listed nor downloadable."""
    run1, run2 = tmp_path / "run1", tmp_path / "run2"
    run1.mkdir()
    run2.mkdir()
    p1, p2 = tmp_path / "one.pt", tmp_path / "two.pt"
    fastpersist.write_state_dict({"w": torch.zeros(1000)}, p1)
    fastpersist.write_state_dict({"w": torch.ones(2000)}, p2)
    name = ckpt_name(5)
    s1, s2 = fastpersist.tiers.ObjectStore(str(run1)), fastpersist.tiers.ObjectStore(str(run2))
    s1.upload(str(p1), name)
    marker = (run1 / (name + ".fpcommit")).read_bytes()
    for n in os.listdir(run1):
        os.symlink(run1 / n, run2 / n)
    s2.upload(str(p2), name)
    assert (run1 / (name + ".fpcommit")).read_bytes() == marker
    assert s1.committed() == {name: p1.stat().st_size}
    assert s2.committed() == {name: p2.stat().st_size}
    s1.download(name, str(tmp_path / "back.pt"))
    assert (tmp_path / "back.pt").read_bytes() == p1.read_bytes()
    assert not (run2 / (name + ".fpcommit")).is_symlink()


def test_a_download_onto_its_own_object_is_refused(tmp_path):
    """Regression: downloading a local store's object onto itself replaced
    it with a copy (a new inode): its marker no longer committed it, and
    the checkpoint dropped out of the store."""
    (tmp_path / "store").mkdir()
    store = fastpersist.tiers.ObjectStore(str(tmp_path / "store"))
    p = tmp_path / "x.pt"
    fastpersist.write_state_dict({"w": torch.ones(10)}, p)
    store.upload(str(p), ckpt_name(3))
    with pytest.raises(ValueError, match="itself"):
        store.download(ckpt_name(3), str(tmp_path / "store" / ckpt_name(3)))
    assert store.committed() == {ckpt_name(3): p.stat().st_size}


def test_a_missing_bucket_is_an_error_naming_it_not_an_empty_store(tmp_path, s3, capsys):
    """Regression: a mistyped bucket read as a store with nothing in it:
    ``Checkpointer(..., stage_dir="s3://typo/job").load_latest()`` returned
    None (start from scratch) and ``fastpersist ls`` listed nothing; an
    upload raised a bare FileNotFoundError naming no URL, and ``s3://``
    blamed the file name. A missing prefix is still an empty store."""
    p = tmp_path / ckpt_name(1)
    fastpersist.write_state_dict({"w": torch.ones(10)}, p)
    typo = fastpersist.tiers.ObjectStore("s3://no-such-bucket-fp/job", s3["opts"])
    with pytest.raises(fastpersist.tiers.TierError, match="'no-such-bucket-fp' does not exist"):
        typo.committed()
    with pytest.raises(fastpersist.tiers.TierError, match="s3://no-such-bucket-fp/job.*'no-such-bucket-fp' does not"):
        typo.upload(str(p))
    with fastpersist.Checkpointer(
        tmp_path / "local", stage_dir="s3://no-such-bucket-fp/job", storage_options=s3["opts"]
    ) as ck:
        with pytest.raises(fastpersist.tiers.TierError, match="does not exist"):
            ck.load_latest()
    assert fastpersist.tiers.ObjectStore(f"s3://ckpts/nothing-yet-{os.getpid()}", s3["opts"]).committed() == {}
    with pytest.raises(ValueError, match="names no bucket"):
        fastpersist.tiers.ObjectStore("s3://", s3["opts"])
    with pytest.raises(IsADirectoryError, match=str(tmp_path)):
        fastpersist.tiers.ObjectStore(f"s3://ckpts/dir-{os.getpid()}", s3["opts"]).upload(str(tmp_path))


def test_retention_removes_what_unfinished_uploads_and_deletions_left(tmp_path, s3, monkeypatch):
    """Regression: a deletion whose marker went but whose data did not (one
    transient error) left a checkpoint-sized object that nothing listed nor
    removed again; a process killed during a multipart upload left its
    parts stored (and billed) for ever. Retention now removes, for steps
    older than the oldest it keeps, objects no marker commits, markers
    without their object and unfinished multipart uploads; anything of
    another name stays."""
    url = f"s3://ckpts/sweep-{os.getpid()}"
    store = fastpersist.tiers.ObjectStore(url, s3["opts"])
    bucket, prefix, _ = store.fs.split_path(store.root)
    call = store.fs.call_s3
    # A killed process's upload of step 2, and one of another name.
    left = call("create_multipart_upload", Bucket=bucket, Key=f"{prefix}/{ckpt_name(2)}")["UploadId"]
    call(
        "upload_part", Bucket=bucket, Key=f"{prefix}/{ckpt_name(2)}", UploadId=left, PartNumber=1, Body=b"x" * (5 << 20)
    )
    theirs = call("create_multipart_upload", Bucket=bucket, Key=f"{prefix}/notes.bin")["UploadId"]
    store.fs.pipe_file(store._path("ckpt-1.pt"), b"not a step of ours")
    store.fs.pipe_file(store._path(ckpt_name(1) + ".fpcommit") + ".bak", b"theirs")
    local = tmp_path / "local"
    real, failures = store.fs.rm_file, []

    def flaky(path, *args, **kwargs):
        if path.endswith(ckpt_name(3)) and not failures:
            failures.append(path)
            raise ConnectionError("connection reset by peer")
        return real(path, *args, **kwargs)

    with fastpersist.Checkpointer(local, stage_dir=url, storage_options=s3["opts"], every=1, keep_last=1) as ck:
        monkeypatch.setattr(ck.store.fs, "rm_file", flaky)
        for s in (3, 4, 5):
            ck.save(s, {"x": torch.tensor([s])})
            ck.wait()
    assert failures
    names = sorted(posixpath_names(store))
    assert names == sorted([ckpt_name(5), ckpt_name(5) + ".fpcommit", "ckpt-1.pt", ckpt_name(1) + ".fpcommit.bak"])
    uploads = call("list_multipart_uploads", Bucket=bucket, Prefix=prefix + "/").get("Uploads", [])
    assert [u["UploadId"] for u in uploads] == [theirs]
    call("abort_multipart_upload", Bucket=bucket, Key=f"{prefix}/notes.bin", UploadId=theirs)


def test_a_copied_store_keeps_its_checkpoints(tmp_path):
    """Regression: a commit marker records the identity its object had (a
    local store's inode and mtime, S3's ETag); in a store copied or
    restored from a backup (new inodes; ETags of other part sizes) no
    marker matched: load_latest() found nothing and the run started over,
    and the next save's retention swept every older checkpoint as an upload
    that never completed. Objects whose marker has their size are now
    listed, restored after their CRC32s check, and never swept; one whose
    bytes are not those its marker recorded is still refused. Retention
    does not count them (their bytes are not known to be whole): they go
    once ``keep_last`` confirmed checkpoints are newer."""
    import shutil

    store1, store2 = tmp_path / "store1", tmp_path / "store2"
    store1.mkdir()
    with fastpersist.Checkpointer(tmp_path / "l1", stage_dir=f"local://{store1}", every=1, keep_last=3) as ck:
        for s in (1, 2, 3):
            ck.save(s, _state(s))
            ck.wait()  # (each one staged)
    shutil.copytree(store1, store2)  # data and mtimes kept, new inodes
    ck = fastpersist.Checkpointer(tmp_path / "l2", stage_dir=f"local://{store2}", every=1, keep_last=3)
    step, state = ck.load_latest()
    assert step == 3 and _same(state, _state(3))
    ck.save(4, _state(4))
    ck.wait()
    names = sorted(n for n in os.listdir(store2) if n.endswith(".pt"))
    assert names == [ckpt_name(s) for s in (1, 2, 3, 4)], names  # one confirmed: none removed
    for s in (5, 6):
        ck.save(s, _state(s))
        ck.wait()
    ck.close()
    names = sorted(n for n in os.listdir(store2) if n.endswith(".pt"))
    assert names == [ckpt_name(s) for s in (4, 5, 6)], names  # keep_last=3 confirmed
    for s in (4, 5, 6):
        os.unlink(store2 / ckpt_name(s))
        os.unlink(store2 / (ckpt_name(s) + ".fpcommit"))
    for s in (2, 3):
        shutil.copy2(store1 / ckpt_name(s), store2 / ckpt_name(s))
        shutil.copy2(store1 / (ckpt_name(s) + ".fpcommit"), store2 / (ckpt_name(s) + ".fpcommit"))
    names = sorted(n for n in os.listdir(store2) if n.endswith(".pt"))
    store = fastpersist.tiers.ObjectStore(f"local://{store2}")
    assert sorted(store.committed(unconfirmed=True)) == names
    # An unconfirmed object whose bytes differ from its marker's: refused by its CRC32.
    p = store2 / ckpt_name(3)
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    os.unlink(p)
    p.write_bytes(bytes(raw))
    shutil.rmtree(tmp_path / "l2")
    ck = fastpersist.Checkpointer(tmp_path / "l2", stage_dir=f"local://{store2}")
    assert ck.load_latest()[0] == 2  # step 3's copy is damaged: the one before it
    ck.close()


def test_an_upload_again_killed_before_its_marker_is_not_counted_by_retention(tmp_path):
    """Regression: an object uploaded again under a committed name (a run
    that went back and reached the step again) whose process died before
    the new marker: the old marker has its size, so it was counted as a
    kept checkpoint, and retention deleted an older whole one in its place,
    though its bytes (checked only at its download) are not the marker's."""
    store = tmp_path / "store"
    store.mkdir()
    url = f"local://{store}"
    with fastpersist.Checkpointer(tmp_path / "l", stage_dir=url, every=1, keep_last=2) as ck:
        for s in (1, 2, 3):
            ck.save(s, _state(s))
            ck.wait()
        assert sorted(n for n in os.listdir(store) if n.endswith(".pt")) == [ckpt_name(2), ckpt_name(3)]
        p = store / ckpt_name(3)
        raw = bytearray(p.read_bytes())
        raw[len(raw) // 2] ^= 0xFF  # the new upload's bytes, its marker never written
        os.unlink(p)
        p.write_bytes(bytes(raw))
        ck.save(4, _state(4))
        ck.wait()
    assert sorted(n for n in os.listdir(store) if n.endswith(".pt")) == [ckpt_name(s) for s in (2, 3, 4)]
    shutil.rmtree(tmp_path / "l")
    os.unlink(store / ckpt_name(4))
    step, state = fastpersist.Checkpointer(tmp_path / "l", stage_dir=url).load_latest()
    assert step == 2 and _same(state, _state(2))


def test_a_killed_uploads_temporary_file_in_a_local_store_is_swept(tmp_path):
    """Regression: a local store's upload writes a temporary file beside
    the object (``.<name>.<pid>.<n>.fptmp``) and renames it in; a killed
    upload's stayed in the store for ever (sweep passed it by). It is
    removed once its step is older than every checkpoint kept, no process
    writes it, and it is TEMP_MIN_AGE old; others' files are left."""
    from fastpersist import _core

    store = tmp_path / "store"
    store.mkdir()
    old = time.time() - 3600
    left = {
        f".{ckpt_name(1)}.999999.1{_core.TEMP_MARKER}": True,  # a killed upload's: swept
        f".{ckpt_name(1)}.fpcommit.999999.2{_core.TEMP_MARKER}": True,  # its marker's: swept
        f".{ckpt_name(9)}.999999.3{_core.TEMP_MARKER}": False,  # a step still to come: kept
        f".notes.txt.999999.4{_core.TEMP_MARKER}": False,  # not a checkpoint's: kept
    }
    for n in left:
        (store / n).write_bytes(b"partial")
        os.utime(store / n, (old, old))
    young = store / f".{ckpt_name(2)}.999999.5{_core.TEMP_MARKER}"
    young.write_bytes(b"partial")  # too young to tell from an upload in flight: kept
    with fastpersist.Checkpointer(tmp_path / "l", stage_dir=f"local://{store}", every=1, keep_last=1) as ck:
        for s in (3, 4):
            ck.save(s, _state(s))
            ck.wait()
    names = set(os.listdir(store))
    for n, swept in left.items():
        assert (n not in names) == swept, (n, sorted(names))
    assert young.name in names


@pytest.mark.parametrize("how", ["transient", "down", "gone"])
def test_a_restore_from_the_store_never_takes_an_older_step_for_an_unavailable_one(tmp_path, monkeypatch, how):
    """Regression (found in a hunt): a restore from the object tier took any
    error downloading the newest checkpoint for damage and returned an older
    one (one read timeout: 200 instead of 300), and the resumed run's first
    save then set the store's 300 aside as abandoned; an object removed
    between the listing and its download (a trainer's retention) made
    ``load_latest()`` return None while a newer one was committed. A store
    that fails to answer is asked again, then its error is raised; an
    object gone since the listing makes the listing start again."""
    import fastpersist.checkpoint_manager as cm

    monkeypatch.setattr(cm, "FETCH_BACKOFF", 0.01, raising=False)
    store, url, _ = _run_a(tmp_path, keep_last=3, local="node1", state=_state)
    ck = fastpersist.Checkpointer(tmp_path / "node2", stage_dir=url, every=1, keep_last=3)
    real, calls = ck.store.download, []

    def download(name, *a, **k):
        calls.append(name)
        if how == "transient" and len(calls) == 1:
            raise fastpersist.tiers.TierError(f"download of {name} failed: ReadTimeoutError")
        if how == "down":
            raise fastpersist.tiers.TierError(f"download of {name} failed: ConnectionError")
        if how == "gone" and len(calls) == 1:
            with fastpersist.Checkpointer(tmp_path / "node1", stage_dir=url, every=1, keep_last=1) as trainer:
                trainer.save(400, _state(400))  # ... and its retention removes 300
                trainer.wait()
            assert not (store / ckpt_name(300)).exists()
            return real(name, *a, **k)
        return real(name, *a, **k)

    ck.store.download = download
    if how == "down":
        with pytest.raises(fastpersist.tiers.TierError, match="ConnectionError"):
            ck.load_latest()
        assert calls == [ckpt_name(300)] * cm.FETCH_TRIES
        return
    step, state = ck.load_latest()
    assert (step, _same(state, _state(step))) == ((300, True) if how == "transient" else (400, True))
    ck.close()


class _Outage:
    """Makes the object stores' listings (``"list"``) or moves (``"move"``)
    fail while ``down``."""

    def __init__(self, monkeypatch, what: str) -> None:
        self.down = False
        store_cls = fastpersist.tiers.ObjectStore
        name = {"list": "scan", "move": "set_aside"}[what]
        real = getattr(store_cls, name)

        def failing(store, *a, **k):
            if self.down:
                raise fastpersist.tiers.TierError(f"{name} of {store.url} failed: ConnectTimeoutError (injected)")
            return real(store, *a, **k)

        monkeypatch.setattr(store_cls, name, failing)


def _store_names(store) -> list:
    return sorted(n for n in os.listdir(store) if ".pt" in n and not n.endswith(".fpcommit"))


def _run_a(
    tmp_path, keep_last: int, local: str = "local", state=lambda s: {"run": "A", "x": torch.tensor([s])}
) -> tuple:
    """A local store, and run A's checkpoints of steps 100, 200 and 300
    (``state(step)``) saved in ``tmp_path / local`` and staged there:
    (store folder, its URL, the local directory)."""
    store = tmp_path / "store"
    store.mkdir()
    url, where = f"local://{store}", tmp_path / local
    with fastpersist.Checkpointer(where, stage_dir=url, every=1, keep_last=keep_last) as ck:
        for s in (100, 200, 300):
            ck.save(s, state(s))
            ck.wait()
    return store, url, where


@pytest.mark.parametrize("what", ["list", "move"])
def test_going_back_while_the_store_fails_is_finished_before_anything_past_it_is_staged(tmp_path, monkeypatch, what):
    """Regression (found in a hunt): a going back whose staged part failed
    (the store could not be listed, or a checkpoint not moved) released its
    record and was never tried again. The abandoned run's newest object
    stayed committed: ``load_latest()`` took it over the new run's
    checkpoints (after a node loss too), and retention counted it and
    deleted the new run's uploads. Now the record is kept, the stager tries
    again before each stage and stages nothing past the step until it is
    done, and meanwhile those objects are neither restored nor counted."""
    store, url, local = _run_a(tmp_path, keep_last=2)
    assert _store_names(store) == [ckpt_name(200), ckpt_name(300)]
    outage = _Outage(monkeypatch, what)
    ck = fastpersist.Checkpointer(local, stage_dir=url, every=1, keep_last=2)
    outage.down = True
    ck.save(150, {"run": "B", "x": torch.tensor([150])})  # goes back past 200 and 300
    ck.wait()
    records = [n for n in os.listdir(local) if n.startswith(".went-back")]
    assert records, "the record of an unfinished going back is kept"
    ck.save(160, {"run": "B", "x": torch.tensor([160])})
    ck.wait()
    assert ckpt_name(160) not in _store_names(store)  # nothing past 150 while 200 and 300 are there
    outage.down = False
    if what == "move":
        assert ckpt_name(150) in _store_names(store)  # (150 itself is staged, and not deleted by retention)
    step, state = ck.load_latest(weights_only=False)
    assert (step, state["run"]) == (160, "B")  # not 300 (the run gone back on)
    ck.save(170, {"run": "B", "x": torch.tensor([170])})
    ck.wait()
    ck.close()
    names = _store_names(store)
    assert ckpt_name(170) in names and {ckpt_name(200), ckpt_name(300)}.isdisjoint(names), names
    assert {ckpt_name(200) + ".abandoned", ckpt_name(300) + ".abandoned"} <= set(names), names
    assert not [n for n in os.listdir(local) if n.startswith(".went-back")]
    shutil.rmtree(local)  # node loss: the store decides
    with fastpersist.Checkpointer(local, stage_dir=url) as ck:
        step, state = ck.load_latest(weights_only=False)
    assert (step, state["run"]) == (170, "B")


def test_going_back_after_the_store_could_not_be_listed_at_the_start_lists_it_then(tmp_path, monkeypatch):
    """Regression (found in a hunt): a Checkpointer that could not list the
    store when it was made knew no staged step, so a going back never looked
    at the store: the abandoned run's later objects stayed committed and a
    node loss restored from them. Such a going back lists the store."""
    store, url, local = _run_a(tmp_path, keep_last=3)
    outage = _Outage(monkeypatch, "list")
    outage.down = True
    ck = fastpersist.Checkpointer(local, stage_dir=url, every=1, keep_last=3)
    outage.down = False
    ck.save(150, {"run": "B", "x": torch.tensor([150])})
    ck.wait()
    ck.close()
    names = _store_names(store)
    assert {ckpt_name(200), ckpt_name(300)}.isdisjoint(names) and ckpt_name(150) in names, names
    shutil.rmtree(local)
    with fastpersist.Checkpointer(local, stage_dir=url) as ck:
        step, state = ck.load_latest(weights_only=False)
    assert (step, state["run"]) == (150, "B")


def test_a_record_a_dead_process_left_is_taken_on_when_the_store_fails(tmp_path, monkeypatch):
    """Regression (found in a hunt): a record of going back that a dead
    process left, found while the store could not move its objects, was
    kept, unlocked, while the new run staged on: once the run reached a
    recorded step again and uploaded it, the next Checkpointer carried the
    record out over that upload (the new run's checkpoint set aside as
    abandoned). The Checkpointer now takes the record on: it finishes it
    before its first stage past the step."""
    store, url, local = _run_a(tmp_path, keep_last=5)
    # What a process that went back to 150 left when it died: its local
    # part done, the staged part not.
    for s in (200, 300):
        os.rename(local / ckpt_name(s), local / (ckpt_name(s) + ".abandoned"))
    (local / ".went-back-150.json").write_text(json.dumps({"step": 150, "later": [], "staged": [200, 300]}))
    outage = _Outage(monkeypatch, "move")
    outage.down = True
    ck = fastpersist.Checkpointer(local, stage_dir=url, every=1, keep_last=5)
    outage.down = False
    for s in (150, 200):  # the new run reaches 200 again
        ck.save(s, {"run": "C", "x": torch.tensor([s])})
        ck.wait()
    ck.close()
    assert not (local / ".went-back-150.json").exists()
    shutil.rmtree(local)  # node loss
    with fastpersist.Checkpointer(local, stage_dir=url) as ck:
        step, state = ck.load_latest(weights_only=False)
    assert (step, state["run"]) == (200, "C")


def test_a_set_aside_killed_between_the_move_and_its_marker_is_finished(tmp_path):
    """Regression (found in a hunt): ``ObjectStore.set_aside`` moves the
    data, then writes the new name's marker; a process killed in between
    left ``<name>.abandoned`` with no marker (not committed: not
    downloadable, never swept) and the old marker without its object, and
    a killed marker write left its temporary file for ever. Retention's
    sweep now finishes the move, and sweeps such a temporary file once its
    step is older than every checkpoint kept."""
    from fastpersist import _core

    store, url, local = _run_a(tmp_path, keep_last=5)
    aside = ckpt_name(300) + ".abandoned"
    os.rename(local / ckpt_name(300), local / aside)  # a going back past 300 ...
    os.rename(store / ckpt_name(300), store / aside)  # ... killed here: the marker is still the old name's
    stale = store / f".{ckpt_name(200)}.abandoned.fpcommit.999999.1{_core.TEMP_MARKER}"
    stale.write_bytes(b"{")  # (a killed marker write of an older set-aside)
    old = time.time() - 3600
    os.utime(stale, (old, old))
    with fastpersist.Checkpointer(local, stage_dir=url, every=1, keep_last=2) as ck:
        for s in (400, 500):
            ck.save(s, {"run": "A", "x": torch.tensor([s])})
            ck.wait()
    listed = fastpersist.tiers.ObjectStore(url).committed()
    assert aside in listed and ckpt_name(300) not in listed, sorted(listed)
    assert not (store / (ckpt_name(300) + ".fpcommit")).exists()
    assert not stale.exists()
    fastpersist.tiers.ObjectStore(url).download(aside, str(tmp_path / "inspect.pt"))
    got = fastpersist.read_state_dict(tmp_path / "inspect.pt", weights_only=False)
    assert (got["step"], got["state"]["run"]) == (300, "A")


def test_a_record_carried_out_at_the_start_forgets_the_steps_it_set_aside(tmp_path):
    """Regression (found in review): a Checkpointer that carried out a dead
    process's record at its start still counted the steps it set aside as
    staged: the step gone back to, committed locally but never staged, was
    not caught up, and the next save below those steps went back again."""
    store, url, local = _run_a(tmp_path, keep_last=5)
    for s in (200, 300):
        os.rename(local / ckpt_name(s), local / (ckpt_name(s) + ".abandoned"))
    (local / ".went-back-150.json").write_text(json.dumps({"step": 150, "later": [], "staged": [200, 300]}))
    shutil.copy(local / ckpt_name(100), local / ckpt_name(150))  # (committed, never staged)
    ck = fastpersist.Checkpointer(local, stage_dir=url, every=1, keep_last=5)
    ck.wait()
    assert sorted(ck._staged) == [100, 150] and ckpt_name(150) in _store_names(store)
    ck.save(160, {"run": "B", "x": torch.tensor([160])})
    ck.wait()
    ck.close()
    assert not [n for n in os.listdir(local) if n.startswith(".went-back")]


@pytest.mark.parametrize("who", ["evaluator", "live trainer"])
def test_no_checkpointer_restores_what_a_record_of_going_back_still_holds(tmp_path, monkeypatch, who):
    """Regression (found in review): only the process holding a record of
    going back passed by the staging tier's steps it names. An evaluator
    made during the outage took a dead process's record on (its lock kept
    for life) and the restarted trainer, finding it locked, restored the
    abandoned run; an evaluator beside a live trainer restored the
    abandoned step and downloaded it into the trainer's directory, where
    the restarted trainer resumed from it. Every Checkpointer now reads the
    records it finds (another's too) and passes those steps by, and a
    record is taken on only by a stage."""
    store, url, local = _run_a(tmp_path, keep_last=5)
    outage = _Outage(monkeypatch, "move")
    outage.down = True
    tr = fastpersist.Checkpointer(local, stage_dir=url, every=1, keep_last=5)
    tr.save(150, {"run": "B", "x": torch.tensor([150])})  # goes back; the store's 200 and 300 stay
    tr.wait()
    if who == "evaluator":
        tr.close()  # (dies: its record stays)
    ev = fastpersist.Checkpointer(local, stage_dir=url)
    step, state = ev.load_latest(weights_only=False)
    assert (step, state["run"]) == (150, "B")
    assert ckpt_name(300) not in os.listdir(local)
    outage.down = False
    again = fastpersist.Checkpointer(local, stage_dir=url, every=1, keep_last=5)
    step, state = again.load_latest(weights_only=False)
    assert (step, state["run"]) == (150, "B")
    for ck in (again, ev, tr):
        ck.close()


GROUP_RESTORE_CHILD = textwrap.dedent(
    """
    import os, sys
    import torch, torch.distributed as dist, fastpersist
    from fastpersist.checkpoint_manager import ckpt_name
    from fastpersist.tiers import ObjectStore, TierError

    tmp = sys.argv[1]
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", world_size=1, rank=0)
    down = [False]
    real = ObjectStore.set_aside

    def failing(self, *a, **k):
        if down[0]:
            raise TierError("set_aside failed (injected)")
        return real(self, *a, **k)

    ObjectStore.set_aside = failing
    store, local = os.path.join(tmp, "store"), os.path.join(tmp, "local")
    os.makedirs(os.path.join(store, "rank-0"))
    kw = dict(stage_dir=f"local://{store}", every=1, keep_last=5, group=dist.group.WORLD)
    with fastpersist.Checkpointer(local, **kw) as ck:
        for s in (100, 200, 300):
            ck.save(s, {"run": "A", "x": torch.tensor([s])})
            ck.wait()
    down[0] = True
    ck = fastpersist.Checkpointer(local, **kw)
    for s in (150, 200):
        ck.save(s, {"run": "B", "x": torch.tensor([s])})
        ck.wait()
    with open(os.path.join(local, ckpt_name(200)), "r+b") as f:  # B's own 200 is damaged
        f.seek(os.path.getsize(f.name) // 2)
        f.write(bytes(64))
    step, state = ck.load_latest(weights_only=False)
    print("RESTORED", step, state["run"])
    ck.close()
    dist.destroy_process_group()
    """
)


def test_a_group_restore_never_fetches_what_a_going_back_still_holds(tmp_path):
    """Regression (found in review): a group restore fetched a step from the
    staging tier when this rank's copy was damaged, though that step's
    object was the abandoned run's, which an unfinished going back still
    had to set aside: it restored the run gone back on."""
    r = subprocess.run([sys.executable, "-c", GROUP_RESTORE_CHILD, str(tmp_path)], capture_output=True, text=True)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESTORED")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    assert lines[-1] == "RESTORED 150 B", lines
