"""The DeepSpeed checkpoint engine: through DeepSpeed's CheckpointEngine
interface in this process, and through a real ``deepspeed.initialize``
engine (CPU accelerator, one gloo rank) in a process of its own."""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import shutil
import socket
import subprocess
import sys

import fastpersist
import pytest
import torch

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'fastpersist[deepspeed]')")
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine  # noqa: E402
from fastpersist.integrations.deepspeed import FastPersistCheckpointEngine  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def info(d, tag, latest=True):
    return CheckpointCommitInfo(tag=tag, save_dir=str(d), save_latest=latest)


def test_engine_interface_latest_only_after_every_file_is_durable(tmp_path):
    eng = FastPersistCheckpointEngine()
    assert isinstance(eng, CheckpointEngine) and eng.is_decoupled()
    i = info(tmp_path, "global_step2")
    eng.create(i)
    eng.makedirs(tmp_path / "global_step2", exist_ok=True)
    big = torch.randn(8 << 20)
    want = big.clone()
    eng.save({"module": {"w": big}, "step": 2}, str(tmp_path / "global_step2" / "model.pt"))
    big.zero_()  # snapshot mode: save returned after the copy
    assert not (tmp_path / "latest").exists()
    eng.saves.settle()  # get_commit_info hands the tag out once its saves are done (durable or failed)
    assert eng.get_commit_info() == i
    assert eng.commit(i) is True
    assert not i.save_latest  # written already, atomically: DeepSpeed must not rewrite it in place
    assert (tmp_path / "latest").read_text() == "global_step2"
    fastpersist.verify.verify_file(tmp_path / "global_step2" / "model.pt")
    got = eng.load(str(tmp_path / "global_step2" / "model.pt"), map_location="cpu")
    assert got["step"] == 2 and torch.equal(got["module"]["w"], want)


def test_engine_interface_failed_save_raises_at_commit_and_latest_stays(tmp_path, engine_fault):
    eng = FastPersistCheckpointEngine(decoupled=False)
    eng.create(info(tmp_path, "a"))
    eng.save({"w": torch.ones(100)}, str(tmp_path / "a.pt"))
    eng.commit(info(tmp_path, "a"))
    engine_fault(0, errno.ENOSPC)
    eng.create(info(tmp_path, "b"))
    eng.save({"w": torch.ones(100)}, str(tmp_path / "b.pt"))
    with pytest.raises(fastpersist.WriteError) as ei:
        eng.commit(info(tmp_path, "b"))
    assert ei.value.errno == errno.ENOSPC
    assert (tmp_path / "latest").read_text() == "a"
    assert not (tmp_path / "b.pt").exists()
    # Regression: raised once. The next load and the cleanup raised the
    # same error again, after the script had handled it.
    engine_fault(None)
    assert torch.equal(eng.load(str(tmp_path / "a.pt"))["w"], torch.ones(100))
    eng.create(info(tmp_path, "c"))
    eng.save({"w": torch.zeros(100)}, str(tmp_path / "c.pt"))
    assert eng.commit(info(tmp_path, "c")) is True
    eng.cleanup()
    assert (tmp_path / "latest").read_text() == "c"


def test_engine_interface_a_save_that_fails_early_is_never_committed(tmp_path):
    """Regression: a save that failed in its snapshot phase (raised by
    ``save``) was dropped from the tag's saves while the tag stayed
    pending, so the next commit committed the tag with the files that
    did succeed and wrote ``latest`` naming it. Now the tag is dropped:
    its commit writes no ``latest`` and tells DeepSpeed not to write it."""
    eng = FastPersistCheckpointEngine()
    a = info(tmp_path, "a")
    eng.create(a)
    eng.save({"w": torch.ones(100)}, str(tmp_path / "a.pt"))
    eng.saves.settle()
    eng.commit(eng.get_commit_info())
    assert (tmp_path / "latest").read_text() == "a"
    b = info(tmp_path, "b")
    eng.create(b)
    eng.makedirs(tmp_path / "b", exist_ok=True)
    eng.save({"w": torch.ones(100)}, str(tmp_path / "b" / "model.pt"))
    with pytest.raises(fastpersist.SerializationError):
        eng.save({"hook": lambda: None}, str(tmp_path / "b" / "optim.pt"))
    eng.saves.settle()
    pending = eng.get_commit_info()
    assert pending == b  # DeepSpeed's step() commits it ...
    assert eng.commit(pending) is False  # ... which writes no latest
    assert not b.save_latest  # and DeepSpeed writes none either
    assert (tmp_path / "latest").read_text() == "a"
    assert eng.get_commit_info() is None
    # The next tag commits as usual.
    c = info(tmp_path, "c")
    eng.create(c)
    eng.save({"w": torch.ones(100)}, str(tmp_path / "c.pt"))
    eng.cleanup()
    assert (tmp_path / "latest").read_text() == "c"


def test_reads_torch_legacy_format(tmp_path):
    p = tmp_path / "old.pt"
    torch.save({"w": torch.arange(3)}, p, _use_new_zipfile_serialization=False)
    assert torch.equal(FastPersistCheckpointEngine().load(str(p))["w"], torch.arange(3))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _ds_port():
    """A free port for one DeepSpeed run. DeepSpeed's CPU accelerator leaves
    its shared-memory allreduce buffers (64 MiB each, named after the
    address and port) in /dev/shm when the run ends: this run's are removed
    afterwards, so a test session does not fill the machine's memory."""
    port = _free_port()
    try:
        yield str(port)
    finally:
        for f in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
            with contextlib.suppress(OSError):
                os.unlink(f)


def _run_ds_worker(tmp_path, *args: str) -> dict:
    """Run ``ds_worker.py`` (one process, DeepSpeed's CPU accelerator) and
    return the results it prints; skips where its comm op cannot be built."""
    if shutil.which("ninja") is None and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "ninja")):
        pytest.skip("DeepSpeed's CPU accelerator JIT-builds its comm op with ninja, which is not installed")
    with _ds_port() as port:
        env = dict(os.environ, DS_ACCELERATOR="cpu", MASTER_PORT=port)
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        r = subprocess.run(
            [sys.executable, os.path.join(HERE, "ds_worker.py"), str(tmp_path), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=1500,
        )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stdout[-3000:] + r.stderr[-5000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    return out


def test_real_deepspeed_engine_on_cpu(tmp_path):
    out = _run_ds_worker(tmp_path)
    for mode in ("snapshot", "pipelined"):
        assert out[f"{mode}_engine"] == "FastPersistCheckpointEngine"
        assert out[f"{mode}_latest"] == "global_step4"
        assert out[f"{mode}_files_ours"]
        assert out[f"{mode}_losses"] == out["ref_losses"], mode
        assert out[f"{mode}_digest"] == out["ref_digest"], mode
    # Pipelined and decoupled: save_checkpoint returns before the optimizer file is read; the optimizer
    # step waits until it is read (never before), and goes on while it is made durable; latest names
    # the tag only once it is durable; the file holds the state as of the save.
    assert out["overlap_log"] == [
        "save_checkpoint returned",
        "latest before the read: -",
        "reading optimizer state",
        "optimizer state read",
        "optimizer step 3",
        "optimizer step 4",
    ], out["overlap_log"]
    assert out["overlap_latest_after_step3"] is None
    assert out["overlap_latest_after_step4"] == "global_step2"
    assert out["overlap_optim_is_the_saved_state"] and out["overlap_optim_changed_since"]
    assert out["overlap_module_is_the_saved_state"] and out["overlap_files_ours"]
    assert out["sync_latest"] == "global_step1" and out["sync_loaded_step"]
    assert out["full_error"] == errno.ENOSPC
    assert out["full_latest"] == "global_step2"
    assert out["full_loaded"] == "global_step2"
    assert out["engine_class_ok"]


def test_real_deepspeed_engine_two_ranks_commit_at_the_same_step(tmp_path):
    """Rank 1's save is durable only after step 3 (held at a gate), rank 0's
    before it: neither rank commits at step 3 (one that did would wait in
    the commit's collective for a rank gone on to the optimizer step: a
    hang), both at step 4, and only then does ``latest`` name the tag."""
    if shutil.which("ninja") is None and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "ninja")):
        pytest.skip("DeepSpeed's CPU accelerator JIT-builds its comm op with ninja, which is not installed")
    shm = contextlib.ExitStack()
    port = shm.enter_context(_ds_port())
    procs, logs = [], []
    for rank in (0, 1):
        env = dict(
            os.environ,
            DS_ACCELERATOR="cpu",
            MASTER_PORT=port,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_SIZE="2",
        )
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        log = open(tmp_path / f"rank{rank}.log", "w+")  # noqa: SIM115 - closed below; a pipe could fill and block
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, os.path.join(HERE, "ds_worker.py"), str(tmp_path), "two-ranks"],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    results = []
    try:
        for p, log in zip(procs, logs):
            p.wait(timeout=600)
            log.seek(0)
            text = log.read()
            lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
            assert p.returncode == 0 and lines, text[-6000:]
            results.append(json.loads(lines[-1][len("RESULT ") :]))
    finally:
        for p, log in zip(procs, logs):
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
        shm.close()
    for out in results:
        assert out["committed_at_steps"] == [4], out
        assert out["latest_after_step3"] is None and out["latest_after_step4"] == "global_step2", out


def test_real_deepspeed_engine_makes_the_snapshot_buffers_before_the_first_checkpoint(tmp_path):
    """ZeRO 1 (a model states and an optimizer states file) and no ZeRO
    (one file): the buffers are asked for right after the first optimizer
    step (the state exists from then on), before the first checkpoint,
    whose saves then make none of their own; with ``"prepare": false`` they
    do. Both checkpoints load back exactly, the second grown after the
    prepare by a 4 MiB ``client_state`` tensor."""
    out = _run_ds_worker(tmp_path, "prepare")
    assert out["zero1_files"] == 2 and out["zero0_files"] == 1
    for name in ("zero1", "zero0"):
        assert (out[f"{name}_after_init"], out[f"{name}_after_step1"]) == (0, 1), out
        assert out[f"{name}_prepared"], out[f"{name}_first"]
    assert out["off_after_step1"] == 0 and not out["off_prepared"] and "alloc-save" in out["off_first"]
    for name in ("zero1", "zero0", "off"):
        assert out[f"{name}_loaded"] and out[f"{name}_grown"], (name, out)


def test_real_deepspeed_engine_load_right_after_save_loads_that_tag(tmp_path):
    """Regression (decoupled): ``load_checkpoint`` right after
    ``save_checkpoint`` read ``latest`` before the pending tag was
    committed, loading an older tag (or nothing); it now commits the tag
    first."""
    out = _run_ds_worker(tmp_path, "pending")
    assert (out["load_path"], out["load_client"], out["load_latest"]) == ("last", 3, "last"), out
    assert out["load_exact"] and out["load_step2_exact"], out


def test_real_deepspeed_engine_a_save_that_fails_early_is_never_committed(tmp_path):
    """Regression (decoupled): a save that failed before its files were
    written (an unpicklable ``client_state``) was committed by the next
    ``step()``, with ``latest`` naming a tag without its model states file,
    and so was one whose ``save_checkpoint`` raised after some files were
    saved; now the step goes on and ``latest`` keeps naming the tag before."""
    out = _run_ds_worker(tmp_path, "early")
    assert out["early_latest_before"] == "global_step1" and out["early_error"] == "SerializationError", out
    assert out["early_step_error"] is None, out
    assert "injected" in out["partial_error"], out
    assert out["early_latest"] == out["partial_latest"] == out["early_latest_after_destroy"] == "global_step1", out


def test_real_deepspeed_engine_commits_the_last_tag_at_exit(tmp_path):
    """Regression (decoupled): a script that saved at its end and exited
    without ``engine.destroy()`` never committed its last tag: ``latest``
    kept naming the one before. The tag is committed at exit now."""
    out = _run_ds_worker(tmp_path, "exit")
    assert out["latest_before_exit"] == "global_step2", out
    assert (tmp_path / "exit" / "latest").read_text() == "global_step3"
    got = torch.load(tmp_path / "exit" / "global_step3" / "mp_rank_00_model_states.pt", weights_only=False)
    assert got["global_steps"] == 3


def test_engine_interface_prepare_option(tmp_path):
    assert FastPersistCheckpointEngine().prepare_ahead
    assert not FastPersistCheckpointEngine(prepare=False).prepare_ahead
    eng = FastPersistCheckpointEngine(mode="pipelined")
    eng.prepare_for(object())  # nothing to do for pipelined saves (no staging buffer)
    assert eng.saves._saver is None
    eng = FastPersistCheckpointEngine()
    eng.prepare_for(object())  # not a DeepSpeed engine: nothing sized
    assert eng.saves._saver is None


KILLED_MID_SAVE = """
import os, sys, torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo
from fastpersist.integrations.deepspeed import FastPersistCheckpointEngine
d = sys.argv[1]
eng = FastPersistCheckpointEngine(decoupled=False)
info = CheckpointCommitInfo(tag="last", save_dir=d, save_latest=True)
eng.create(info)
eng.save({"round": 2, "w": torch.full((1000,), 2.0)}, os.path.join(d, "last", "model.pt"))
eng.saves.settle()  # the new model states are in place; the optimizer states are not saved yet
os._exit(9)  # killed
"""


def test_a_reused_tag_whose_save_is_killed_part_way_does_not_load_mixed(tmp_path):
    """Regression: with a tag reused from save to save (``tag="last"``), a
    process killed after some of the tag's files were replaced left
    ``latest`` naming a tag that mixed new model states with old optimizer
    states, which loaded without an error (a save that failed sets its
    files aside; a killed one could not). A save of the tag latest names
    now marks its folder first; the marker left by a killed process makes
    the load refuse the tag, naming why."""
    d = tmp_path / "last"
    d.mkdir()
    eng = FastPersistCheckpointEngine(decoupled=False)
    eng.create(info(tmp_path, "last"))
    for name in ("model.pt", "optim.pt"):
        eng.save({"round": 1, "w": torch.full((1000,), 1.0)}, str(d / name))
    assert eng.commit(info(tmp_path, "last")) is True
    eng.create(info(tmp_path, "last"))
    for name in ("model.pt", "optim.pt"):  # a save that completes leaves no marker
        eng.save({"round": 2, "w": torch.full((1000,), 2.0)}, str(d / name))
    assert eng.commit(info(tmp_path, "last")) is True
    assert sorted(os.listdir(d)) == ["model.pt", "optim.pt"]
    r = subprocess.run([sys.executable, "-c", KILLED_MID_SAVE, str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 9, r.stderr
    assert (tmp_path / "latest").read_text() == "last"
    assert torch.load(d / "model.pt", weights_only=True)["round"] == 2
    with pytest.raises(fastpersist.CorruptCheckpointError, match="did not finish"):
        eng.load(str(d / "optim.pt"))


def _save_last(tmp_path, eng, rounds, engine_fault):
    """Save the reused tag ``"last"`` once per ``(round, fail)``: the model
    states in place first, then the optimizer states, which fail (ENOSPC)
    where ``fail``. Returns the tag's folder."""
    d = tmp_path / "last"
    d.mkdir(exist_ok=True)
    for round_, fail in rounds:
        eng.create(info(tmp_path, "last"))
        eng.save({"round": round_, "w": torch.full((1000,), float(round_))}, str(d / "model.pt"))
        eng.saves.settle()  # the model states are in place
        if fail:
            engine_fault(0, errno.ENOSPC)
        eng.save({"round": round_, "opt": torch.full((1000,), float(round_))}, str(d / "optim.pt"))
        if fail:
            with pytest.raises(fastpersist.WriteError):
                eng.commit(info(tmp_path, "last"))
            engine_fault(None)
        else:
            assert eng.commit(info(tmp_path, "last")) is True
    return d


def test_a_second_failure_of_a_reused_tag_keeps_the_files_of_the_first(tmp_path, engine_fault):
    """Regression: the files a failed save of a reused tag had written are
    set aside (``<file>.failed``) and kept for inspection; a second failure
    renamed its own over them. The newest two failures' are kept (not one
    per try: a failure that recurs, a full disk, would fill it)."""
    eng = FastPersistCheckpointEngine(decoupled=False)
    d = _save_last(tmp_path, eng, ((1, False), (2, True), (3, True)), engine_fault)
    assert sorted(os.listdir(d)) == ["model.pt.failed", "model.pt.failed-1", "optim.pt"]
    assert torch.load(d / "model.pt.failed", weights_only=True)["round"] == 3
    assert torch.load(d / "model.pt.failed-1", weights_only=True)["round"] == 2
    _save_last(tmp_path, eng, ((4, True),), engine_fault)
    assert sorted(os.listdir(d)) == ["model.pt.failed", "model.pt.failed-1", "optim.pt"]
    assert torch.load(d / "model.pt.failed", weights_only=True)["round"] == 4
    assert torch.load(d / "model.pt.failed-1", weights_only=True)["round"] == 3


def test_a_reused_tag_whose_save_fails_part_way_does_not_load_mixed(tmp_path, engine_fault):
    """Regression: with a tag reused from save to save (``tag="last"``), a
    save that failed after some of its files were in place left ``latest``
    naming a tag that mixed new files (model states) with old ones
    (optimizer states), which loaded without an error. The files the
    failed save did write are now set aside (``.failed``): loading the
    tag fails, naming the missing file, as after a failed torch.save in
    place."""
    eng = FastPersistCheckpointEngine(decoupled=False)
    d = _save_last(tmp_path, eng, ((1, False), (2, True)), engine_fault)
    assert (tmp_path / "latest").read_text() == "last"
    assert sorted(os.listdir(d)) == ["model.pt.failed", "optim.pt"]
    assert torch.load(d / "optim.pt", weights_only=True)["round"] == 1  # not replaced
    with pytest.raises(FileNotFoundError):
        eng.load(str(d / "model.pt"))
    # A new tag that fails leaves latest's tag alone.
    eng.create(info(tmp_path, "other"))
    (tmp_path / "other").mkdir()
    eng.save({"w": torch.ones(10)}, str(tmp_path / "other" / "model.pt"))
    eng.saves.settle()
    engine_fault(0, errno.ENOSPC)
    eng.save({"w": torch.ones(10)}, str(tmp_path / "other" / "optim.pt"))
    with pytest.raises(fastpersist.WriteError):
        eng.commit(info(tmp_path, "other"))
    assert sorted(os.listdir(tmp_path / "other")) == ["model.pt"]


def test_an_interrupted_commit_leaves_the_tag_pending_and_sets_nothing_aside(tmp_path, monkeypatch):
    """Regression (found in a hunt): a Ctrl-C while ``commit()`` waited for
    a reused tag's saves was taken for their failure: every file the saves
    had committed durably was set aside (``.failed``), and the tag that
    ``latest`` names no longer loaded. The tag now stays pending, as if
    the commit had not been called: the next commit (here, at a load)
    waits for its saves and commits it."""
    import fastpersist.integrations.common as common

    d = tmp_path / "last"
    d.mkdir()
    eng = FastPersistCheckpointEngine(decoupled=False)

    def save(v):
        eng.create(info(tmp_path, "last"))
        for n in ("model.pt", "optim.pt"):
            eng.save({"v": v, "w": torch.full((100,), float(v))}, str(d / n))

    save(1)
    assert eng.commit(info(tmp_path, "last")) is True
    save(2)
    eng.saves.settle()
    real, calls = common.future_error, []

    def interrupted(f, timeout=None):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt  # Ctrl-C while commit() waits
        return real(f, timeout)

    monkeypatch.setattr(common, "future_error", interrupted)
    with pytest.raises(KeyboardInterrupt):
        eng.commit(info(tmp_path, "last"))
    monkeypatch.undo()
    assert not [n for n in os.listdir(d) if n.endswith(".failed")], sorted(os.listdir(d))
    assert eng.commit_info is not None  # still pending
    eng.commit_pending()
    assert sorted(os.listdir(d)) == ["model.pt", "optim.pt"]
    for n in ("model.pt", "optim.pt"):
        assert eng.load(str(d / n))["v"] == 2


class _TwoLineEngine:
    """What ``use_fastpersist`` wraps of a DeepSpeed engine: a
    ``save_checkpoint`` that leaves its tag to the decoupled commit, and a
    ``load_checkpoint`` that reads ``latest``."""

    checkpoint_engine = None

    def save_checkpoint(self, save_dir, tag):
        ce = self.checkpoint_engine
        ce.create(info(save_dir, tag))
        ce.makedirs(os.path.join(save_dir, tag), exist_ok=True)
        ce.save({"tag": tag, "w": torch.full((1000,), float(tag[-1]))}, os.path.join(save_dir, tag, "model.pt"))

    def load_checkpoint(self, load_dir, tag=None):
        with open(os.path.join(load_dir, "latest")) as f:
            tag = tag or f.read().strip()
        return self.checkpoint_engine.load(os.path.join(load_dir, tag, "model.pt"), map_location="cpu")["tag"]


def test_a_load_commits_what_another_engine_of_the_process_has_pending_there(tmp_path):
    """Regression (found in a hunt): an engine's ``load_checkpoint``
    committed only its own pending tag before reading ``latest``: a second
    engine made in the process to load what the first had just saved read
    the tag before (one checkpoint older, no error), or, for a reused tag,
    refused it as a save killed part way. Tags other engines have pending
    in that directory are committed first."""
    from fastpersist.integrations.deepspeed import use_fastpersist

    saver, loader = _TwoLineEngine(), _TwoLineEngine()
    use_fastpersist(saver, prepare=False)
    use_fastpersist(loader, prepare=False)
    saver.save_checkpoint(str(tmp_path), "step1")
    saver.checkpoint_engine.commit_pending()
    saver.save_checkpoint(str(tmp_path), "step2")  # pending: its commit comes at the next save or load
    assert loader.load_checkpoint(str(tmp_path)) == "step2"
    saver.save_checkpoint(str(tmp_path), "step2")  # a reused tag, pending again
    assert loader.load_checkpoint(str(tmp_path)) == "step2"
    other = tmp_path / "other"
    saver.save_checkpoint(str(other), "step3")  # another directory's pending tag is left to its engine
    loader.load_checkpoint(str(tmp_path))
    assert saver.checkpoint_engine.commit_info is not None
    saver.checkpoint_engine.commit_pending()
