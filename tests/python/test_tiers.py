"""The object-store tier (issue 20, part 1), against a real S3-compatible
server started on 127.0.0.1 (moto's server mode, a separate process): not a
mocked fsspec."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
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
    store.fs.pipe_file(store.root + "/ckpt-000000000004.pt", bytes(bad))
    with pytest.raises(fastpersist.CorruptCheckpointError, match="downloaded"):
        store.download("ckpt-000000000004.pt", str(tmp_path / "back" / "x.pt"))
    assert sorted(os.listdir(tmp_path / "back")) == [p.name]
    # A damaged local file is never uploaded.
    (tmp_path / "bad.pt").write_bytes(bytes(bad))
    with pytest.raises(fastpersist.tiers.TierError, match="damaged"):
        store.upload(str(tmp_path / "bad.pt"))
    # Deleting: marker first, then data.
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
