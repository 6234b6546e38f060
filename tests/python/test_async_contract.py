"""The async contract in real training loops (issue 16): a tensor changed in
place between a save's call and the moment its bytes were gathered fails
the save (nothing committed, the previous file kept) or, when asked, warns;
staging slots are never overwritten while the session still reads them;
checkpoint collectives never share the training's group.

Deterministic, no timing: a save is held at a known point by queueing a
blocking task ahead of it on the saver's own worker thread."""

from __future__ import annotations

import contextlib
import os
import threading
import warnings

import fastpersist
import pytest
import torch
from fastpersist.async_save import AsyncSaver
from helpers import assert_same, bits

MODES = ["pipelined", "snapshot"]
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


@contextlib.contextmanager
def held(saver: AsyncSaver, mode: str):
    """Saves made inside the block start their background work only when
    the block ends (the worker they queue on is busy until then)."""
    gate = threading.Event()
    worker = saver._snap if mode == "snapshot" else saver._write
    worker.submit(gate.wait)
    try:
        yield
    finally:
        gate.set()


@pytest.fixture
def saver():
    s = AsyncSaver()
    yield s
    s.close()


def bn_model(device="cpu"):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4)).to(device)


def previous_file(path, model):
    fastpersist.write_state_dict(model.state_dict(), path)
    return path.read_bytes()


def no_temp_files(d):
    return not [n for n in os.listdir(d) if n.endswith(".fptmp")]


@pytest.mark.parametrize("mode", MODES)
def test_forward_before_the_fence_fails_the_save_and_keeps_the_previous_file(tmp_path, saver, mode):
    model = bn_model()
    p = tmp_path / "ckpt.pt"
    before = previous_file(p, model)
    with held(saver, mode):
        fut = saver.save(model.state_dict(), p, mode=mode)
        model(torch.randn(32, 8))  # the README's loop: the next forward, before the fence
    with pytest.raises(fastpersist.TensorChangedError, match=r"num_batches_tracked.*forward included"):
        fut.wait_snapshot(timeout=60)
    assert isinstance(fut.exception(timeout=60), fastpersist.StorageChangedError)
    assert p.read_bytes() == before and no_temp_files(tmp_path)


@pytest.mark.parametrize("mode", MODES)
def test_optimizer_step_without_a_fence_fails_the_save(tmp_path, saver, mode):
    model = torch.nn.Linear(300, 300)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 300)).sum().backward()
    p = tmp_path / "ckpt.pt"
    before = previous_file(p, model)
    with held(saver, mode):
        fut = saver.save({"model": model.state_dict(), "optim": opt.state_dict()}, p, mode=mode)
        opt.step()  # no wait_snapshot() at all
    with pytest.raises(fastpersist.TensorChangedError, match=r"\['model'\]\['weight'\]"):
        fut.result(timeout=60)
    assert p.read_bytes() == before and no_temp_files(tmp_path)


def fused_adam(params):
    try:
        return torch.optim.Adam(params, fused=True)
    except RuntimeError as e:  # torch < 2.4: fused kernels on CUDA only
        pytest.skip(f"no fused Adam on the CPU in this torch: {e}")


class DataSGD(torch.optim.Optimizer):
    """An optimizer of the older kind: it updates p.data, which torch's
    version counter does not see."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad.data, alpha=-group["lr"])


def optimizer_kinds():
    return {
        "fused": lambda params: fused_adam(params),
        "data": lambda params: DataSGD(params),
    }


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["fused", "data"])
def test_optimizer_steps_the_version_counter_misses_fail_the_save(tmp_path, saver, mode, kind):
    # Fused optimizer kernels and p.data updates write the parameters
    # without bumping their version counters: the step itself is watched.
    model = torch.nn.Linear(300, 300)
    opt = optimizer_kinds()[kind](model.parameters())
    model(torch.randn(4, 300)).sum().backward()
    v = model.weight._version
    p = tmp_path / "ckpt.pt"
    before = previous_file(p, model)
    with held(saver, mode):
        fut = saver.save({"model": model.state_dict(), "optim": opt.state_dict()}, p, mode=mode)
        opt.step()
        assert model.weight._version == v  # the counter did not move
    with pytest.raises(fastpersist.TensorChangedError, match=r"\['model'\]\['weight'\].*written by \w+\.step\(\)"):
        fut.result(timeout=60)
    assert p.read_bytes() == before and no_temp_files(tmp_path)


@pytest.mark.parametrize("mode", MODES)
def test_a_fused_step_on_saved_optimizer_state_fails_the_save(tmp_path, saver, mode):
    # The second step: the saved optimizer state (exp_avg, ...) is written too.
    model = torch.nn.Linear(64, 64, bias=False)
    opt = fused_adam(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    state = opt.state[model.weight]
    p = tmp_path / "ckpt.pt"
    with held(saver, mode):
        # The moments alone ("step", bumped by a foreach kernel, is seen anyway).
        fut = saver.save({"m": state["exp_avg"], "v": state["exp_avg_sq"]}, p, mode=mode)
        opt.step()
    with pytest.raises(fastpersist.TensorChangedError, match=r"\['(m|v)'\].*\(and 1 more\).*written by Adam"):
        fut.result(timeout=60)
    assert not p.exists()


@pytest.mark.parametrize("mode", MODES)
def test_steps_that_do_not_write_the_saved_tensors_are_allowed(tmp_path, saver, mode):
    # A frozen part (no gradient) is not written by the step; nor is
    # anything after the fence; and a finished save watches nothing.
    frozen, trained = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
    frozen.requires_grad_(False)
    opt = fused_adam(list(frozen.parameters()) + list(trained.parameters()))
    trained(frozen(torch.randn(4, 64))).sum().backward()
    expect = type(frozen.state_dict())((k, v.clone()) for k, v in frozen.state_dict().items())
    with held(saver, mode):
        fut = saver.save(frozen.state_dict(), tmp_path / "frozen.pt", mode=mode)
        opt.step()
    fut.result(timeout=60)
    assert_same(expect, torch.load(tmp_path / "frozen.pt"))
    fut = saver.save(trained.state_dict(), tmp_path / "trained.pt", mode=mode)
    expect = type(trained.state_dict())((k, v.clone()) for k, v in trained.state_dict().items())
    fut.wait_snapshot(timeout=60)
    opt.step()
    fut.result(timeout=60)
    assert_same(expect, torch.load(tmp_path / "trained.pt"))
    from fastpersist import pickling

    assert not pickling._WATCHING


def test_a_fused_step_on_another_thread_fails_a_synchronous_save(tmp_path, monkeypatch):
    # A synchronous save is watched too: here a step on another thread
    # runs between the call's walk and the gathering of the bytes.
    from fastpersist import writer

    model = torch.nn.Linear(256, 256)
    opt = fused_adam(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    real = writer.TorchZipLayout

    def layout_then_step(*a, **k):
        t = threading.Thread(target=opt.step)
        t.start()
        t.join()
        return real(*a, **k)

    monkeypatch.setattr(writer, "TorchZipLayout", layout_then_step)
    with pytest.raises(fastpersist.TensorChangedError, match="written by Adam.step"):
        fastpersist.write_state_dict(model.state_dict(), tmp_path / "a.pt")
    assert not (tmp_path / "a.pt").exists()


@pytest.mark.parametrize("mode", MODES)
def test_on_change_warn_commits_and_warns(tmp_path, saver, mode):
    w = torch.zeros(1000)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with held(saver, mode):
            fut = saver.save({"w": w}, tmp_path / "a.pt", mode=mode, on_change="warn")
            w.add_(1)
        fut.result(timeout=60)
    assert any(issubclass(x.category, fastpersist.TensorChangedWarning) and "['w']" in str(x.message) for x in seen)
    assert torch.load(tmp_path / "a.pt")["w"].numel() == 1000


def test_bad_on_change_is_refused(tmp_path, saver):
    with pytest.raises(ValueError, match="on_change"):
        saver.save({"w": torch.ones(2)}, tmp_path / "a.pt", on_change="ignore")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("mode", MODES)
def test_updates_after_the_fence_are_allowed(tmp_path, saver, mode):
    model = bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    expect = type(model.state_dict())((k, v.clone()) for k, v in model.state_dict().items())
    fut = saver.save(model.state_dict(), tmp_path / "a.pt", mode=mode)
    fut.wait_snapshot(timeout=60)  # the fence, before the forward
    model(torch.randn(32, 8)).sum().backward()
    opt.step()
    fut.result(timeout=60)
    assert_same(expect, torch.load(tmp_path / "a.pt"))


def test_views_and_detached_tensors_share_the_counter(tmp_path, saver):
    base = torch.zeros(4096)
    with held(saver, "pipelined"):
        fut = saver.save({"view": base[10:20].detach()}, tmp_path / "a.pt")
        base[100:200].add_(1)  # another view of the same storage
    with pytest.raises(fastpersist.TensorChangedError, match=r"\['view'\]"):
        fut.result(timeout=60)


class Holder:
    def __init__(self, t):
        self.t = t


class Gate:
    """Pickled after the Holder (its tensor is recorded by then): says so,
    then waits to be let go."""

    seen = threading.Event()
    go = threading.Event()

    def __reduce__(self):
        Gate.seen.set()
        Gate.go.wait(60)
        return (int, (0,))


def test_a_tensor_inside_an_object_is_checked_from_the_pickle(tmp_path, saver):
    t = torch.zeros(1 << 16)
    Gate.seen.clear()
    Gate.go.clear()
    fut = saver.save({"h": Holder(t), "g": Gate()}, tmp_path / "a.pt", mode="snapshot")
    assert Gate.seen.wait(60)
    t.add_(1)
    Gate.go.set()
    with pytest.raises(fastpersist.TensorChangedError, match="a tensor inside an object"):
        fut.result(timeout=60)


@pytest.mark.parametrize("mode", MODES)
def test_safetensors_pipelined_and_snapshot_are_checked(tmp_path, saver, mode):
    w = torch.zeros(1000)
    with held(saver, mode):
        fut = saver.save({"w": w}, tmp_path / "a.safetensors", mode=mode, format="safetensors")
        w.mul_(2)
    with pytest.raises(fastpersist.TensorChangedError, match="'w'"):
        fut.result(timeout=60)
    assert os.listdir(tmp_path) == []


def test_unchanged_tensors_write_as_before(tmp_path, saver):
    sd = {"a": torch.randn(100), "b": [torch.arange(5)], "n": 3}
    with held(saver, "pipelined"):
        fut = saver.save(sd, tmp_path / "a.pt")
        _ = sd["a"] * 2  # not in place
    fut.result(timeout=60)
    got = torch.load(tmp_path / "a.pt")
    assert bits(got["a"]) == bits(sd["a"])


@needs_cuda
@pytest.mark.parametrize("mode", MODES)
def test_cuda_forward_before_the_fence_fails_the_save(tmp_path, saver, mode):
    model = bn_model("cuda")
    p = tmp_path / "ckpt.pt"
    before = previous_file(p, model)
    with held(saver, mode):
        fut = saver.save(model.state_dict(), p, mode=mode)
        model(torch.randn(32, 8, device="cuda"))
    with pytest.raises(fastpersist.TensorChangedError, match="num_batches_tracked"):
        fut.wait_snapshot(timeout=60)
    assert p.read_bytes() == before and no_temp_files(tmp_path)


@needs_cuda
@pytest.mark.parametrize("mode", MODES)
def test_cuda_optimizer_step_without_a_fence_fails_the_save(tmp_path, saver, mode):
    model = torch.nn.Linear(1024, 1024, device="cuda")
    opt = torch.optim.Adam(model.parameters(), fused=True)
    model(torch.randn(4, 1024, device="cuda")).sum().backward()
    p = tmp_path / "ckpt.pt"
    with held(saver, mode):
        fut = saver.save({"model": model.state_dict(), "optim": opt.state_dict()}, p, mode=mode)
        opt.step()
    with pytest.raises(fastpersist.TensorChangedError):
        fut.result(timeout=60)
    assert not p.exists() and no_temp_files(tmp_path)


# --- Staging slots and large O_DIRECT blocks (16.3) ------------------------


@pytest.fixture
def big_blocks():
    """Sessions of the default engine write 16 KiB O_DIRECT blocks (as a
    file system asking for that alignment would have them)."""
    from fastpersist.options import EngineOptions, get_engine

    _, eng = get_engine(EngineOptions.resolve())
    eng.set_fault(min_block=16 << 10)
    yield
    eng.set_fault(None)


def small_odd_storages(device="cpu"):
    g = torch.Generator().manual_seed(7)
    return {
        f"t{i}": torch.randint(-100, 100, (int(n),), generator=g, dtype=torch.int16).to(device)
        for i, n in enumerate(torch.randint(1, 1500, (60,), generator=g))
    }


@pytest.mark.parametrize("how", ["sync", "pipelined"])
def test_tiny_staged_storages_with_large_blocks_are_not_overwritten(tmp_path, monkeypatch, big_blocks, how):
    # Every storage goes through the three staging slots (the CPU stand-in
    # copier); each is smaller than a block, so four of them share one
    # 16 KiB block and slot k is reused by chunk k+3 before its block is done.
    monkeypatch.setenv("FASTPERSIST_TEST_STAGE_CPU", "1")
    monkeypatch.setenv("FASTPERSIST_STAGE_CHUNK", str(4096))
    sd = small_odd_storages()
    p = tmp_path / "a.pt"
    if how == "sync":
        st = fastpersist.write_state_dict(sd, p)
    else:
        st = fastpersist.save_async(sd, p, mode=how).result(timeout=60)
    assert st.block >= 16 << 10 or not st.direct
    fastpersist.verify.verify_file(p)  # the CRCs match the bytes either way...
    assert_same(sd, torch.load(p))  # ...and these are the values given


# --- Registration device and unregistration (16.1, 16.7), on a fake CUDA ----


class FakeCuda:
    """Stands for torch.cuda's device switching and cudart: records the
    (thread's) current device of each host (un)registration."""

    def __init__(self, unregister_rc=0):
        self.local = threading.local()
        self.calls = []
        self.unregister_rc = unregister_rc

    def current(self):
        return getattr(self.local, "dev", 0)

    @contextlib.contextmanager
    def device(self, d):
        prev = self.current()
        self.local.dev = torch.device(d).index
        try:
            yield
        finally:
            self.local.dev = prev

    def cudart(self):
        fake = self

        class Rt:
            def cudaHostRegister(self, ptr, n, flags):
                fake.calls.append(("register", fake.current(), flags))
                return 0

            def cudaHostUnregister(self, ptr):
                fake.calls.append(("unregister", fake.current()))
                return fake.unregister_rc

        return Rt()


@pytest.mark.parametrize("rc", [0, 1])
def test_staging_is_unregistered_on_its_device_from_any_thread(monkeypatch, caplog, rc):
    from fastpersist import cuda_staging

    fake = FakeCuda(unregister_rc=rc)
    monkeypatch.setattr(torch.cuda, "device", fake.device)
    monkeypatch.setattr(torch.cuda, "cudart", fake.cudart)
    leaked = len(cuda_staging._leaked)
    st = cuda_staging.Staging(4096, register_cuda=True, device=torch.device("cuda", 1))
    buf = st._buf
    t = threading.Thread(target=st.close)  # e.g. the garbage collector on another thread
    t.start()
    t.join()
    # Registered portable (every context sees it pinned) under cuda:1, the
    # device of the call, and unregistered under it too.
    assert fake.calls == [("register", 1, 1), ("unregister", 1)]
    if rc:
        # Refused: the mapping is kept rather than unmapped while CUDA may
        # still treat it as pinned, and it is said.
        assert cuda_staging._leaked[-1] is buf and len(cuda_staging._leaked) == leaked + 1
        assert "cudaHostUnregister" in caplog.text
        cuda_staging._leaked.pop()
    else:
        assert len(cuda_staging._leaked) == leaked


def test_background_jobs_run_on_the_callers_device(monkeypatch):
    from fastpersist import async_save

    seen = []
    monkeypatch.setattr(async_save, "use_device", lambda d: seen.append(("use", d)))
    job = async_save._on(torch.device("cuda", 3), lambda x: seen.append(("job", x)))
    w = async_save._Worker("t", 0)
    w.submit(job, 5).result(timeout=60)
    w.stop()
    assert seen == [("use", torch.device("cuda", 3)), ("job", 5)]


# --- Checkpoint process groups (16.4) ---------------------------------------


def test_background_collectives_never_share_the_training_group(tmp_path):
    from dist_worker import state
    from test_distributed import run_ranks

    res = run_ranks("busy", 2, tmp_path)
    assert all(r["ok"] for r in res), res
    assert all(r["sum"] == 200 * 2.0 for r in res)  # every training all-reduce saw both ranks
    assert_same(state(0), torch.load(tmp_path / "ckpt.pt"))


def test_two_by_two_mesh_saves_with_data_parallel_subgroups(tmp_path):
    from dist_worker import state
    from test_distributed import run_ranks

    res = run_ranks("mesh", 4, tmp_path)
    assert all(r["ok"] for r in res), res
    for tp in (0, 1):
        assert_same(state(tp), torch.load(tmp_path / f"tp{tp}.pt"))


# --- The version check of saves with a group (16.2 with group=) ------------


@pytest.mark.parametrize("scenario", ["changed", "changed-sharded"])
def test_a_tensor_changed_on_one_rank_fails_the_group_save_everywhere(tmp_path, scenario):
    """Rank 1 updates a tensor before its background save has read it: no
    rank commits; rank 1 raises a TensorChangedError (also a
    DistributedCheckpointError), the other ranks a DistributedCheckpointError
    naming rank 1; the previous checkpoint is kept."""
    from dist_worker import state
    from test_distributed import run_ranks

    target = tmp_path / ("sharded" if scenario == "changed-sharded" else "ckpt.pt")
    if scenario == "changed":
        fastpersist.write_state_dict(state(5), target)
        before = {"ckpt.pt": target.read_bytes()}
    else:
        target.mkdir()
        before = {}
    res = run_ranks(scenario, 2, tmp_path)
    assert not any(r["ok"] for r in res), res
    assert all(r["distributed"] and "rank 1" in r["error"] and "TensorChangedError" in r["error"] for r in res), res
    assert [r["tensor_changed"] for r in res] == [False, True], res
    assert "['w']" in res[1]["error"]
    after = {n: (tmp_path / n).read_bytes() for n in before}
    assert after == before
    assert no_temp_files(tmp_path)
    if scenario == "changed-sharded":
        assert os.listdir(target) == []  # no shard and no index committed


def test_a_tensor_changed_on_one_rank_with_on_change_warn_commits(tmp_path):
    from dist_worker import state
    from test_distributed import run_ranks

    res = run_ranks("changed-warn", 2, tmp_path)
    assert all(r["ok"] for r in res), res
    assert res[0]["warnings"] == [] and any("['w']" in w for w in res[1]["warnings"]), res
    assert torch.load(tmp_path / "ckpt.pt")["n"] == state(0)["n"]


def test_a_failed_save_stops_watching_optimizer_steps(tmp_path):
    """A save that fails before its check (here: a directory in the way)
    no longer marks what optimizer steps write, even while its traceback
    (which holds its frames) is kept."""
    from fastpersist import pickling

    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").mkdir()
    try:
        fastpersist.write_state_dict(model.state_dict(), tmp_path / "d" / "x")
    except Exception as e:  # noqa: BLE001 - whichever error; kept alive below
        kept = e
    assert kept.__traceback__ is not None
    assert not pickling._WATCHING
    model(torch.randn(2, 8)).sum().backward()
    opt.step()


class OddOptimizer(torch.optim.Optimizer):
    """An optimizer of a shape the step hook does not expect: its state
    cannot be read. Its step writes nothing."""

    def __init__(self, params):
        super().__init__(params, {})

    @property
    def state(self):
        raise RuntimeError("no state here")

    @state.setter
    def state(self, value):
        pass

    def step(self, closure=None):
        return None


def test_the_step_hook_never_fails_an_optimizer_step(tmp_path, saver):
    # While a save is pending, the hook reads the optimizer's parameters and
    # state; an optimizer it cannot read still steps, and the save commits.
    model = torch.nn.Linear(8, 8)
    opt = OddOptimizer(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    with held(saver, "pipelined"):
        fut = saver.save(model.state_dict(), tmp_path / "a.pt")
        opt.step()
    fut.result(timeout=60)
    assert_same(model.state_dict(), torch.load(tmp_path / "a.pt"))


@pytest.mark.parametrize("where", ["versions", "note_pending", "submit"])
def test_an_interrupt_inside_save_keeps_no_slot(tmp_path, monkeypatch, where):
    """Regression: a KeyboardInterrupt (Ctrl-C) raised inside save() after
    its slot was taken and before the save was handed to its thread (the
    future made, registered, submitted) kept the slot: after max_pending
    such interrupts every later save blocked forever. Now the slot is given
    back (and a registered future cancelled: nothing is written)."""
    from fastpersist import async_save

    s = AsyncSaver(max_pending=1)
    calls = []

    def interrupt(real):
        def f(*a, **k):
            if not calls:
                calls.append(1)
                raise KeyboardInterrupt
            return real(*a, **k)

        return f

    if where == "versions":
        monkeypatch.setattr(async_save, "TensorVersions", interrupt(async_save.TensorVersions))
    elif where == "note_pending":
        monkeypatch.setattr(async_save, "note_pending", interrupt(async_save.note_pending))
    else:
        monkeypatch.setattr(s._write, "submit", interrupt(s._write.submit))
    try:
        with pytest.raises(KeyboardInterrupt):
            s.save({"w": torch.ones(4)}, tmp_path / "a.pt")
        assert not (tmp_path / "a.pt").exists()
        done = threading.Event()
        result = []

        def again():
            result.append(s.save({"w": torch.zeros(4)}, tmp_path / "b.pt").result(timeout=60))
            done.set()

        threading.Thread(target=again, daemon=True).start()
        assert done.wait(60), "the next save waited for a slot nobody holds"
        assert torch.equal(torch.load(tmp_path / "b.pt")["w"], torch.zeros(4))
        s.wait_all()
    finally:
        s.close()


def test_an_interrupt_as_a_save_takes_the_engine_lets_it_go(tmp_path, monkeypatch):
    """Regression: a KeyboardInterrupt landing just after a synchronous save
    took its engine's lock (inside the ``with``'s enter) kept the lock,
    recorded as the main thread's: that thread's saves went on (on fresh
    engines), but every background save with the same options, which share
    the engine, and the exit's drain then waited forever."""
    from fastpersist import options

    real = options._OwnedLock.acquire
    calls = []

    def acquire(self, *a, **k):
        got = real(self, *a, **k)
        if not calls and threading.current_thread() is threading.main_thread():
            calls.append(1)
            raise KeyboardInterrupt
        return got

    monkeypatch.setattr(options._OwnedLock, "acquire", acquire)
    with pytest.raises(KeyboardInterrupt):
        fastpersist.write_state_dict({"w": torch.ones(4)}, tmp_path / "a.pt")
    assert calls and not (tmp_path / "a.pt").exists()
    fut = fastpersist.save_async({"w": torch.zeros(4)}, tmp_path / "b.pt")
    fut.result(timeout=60)
    assert torch.equal(torch.load(tmp_path / "b.pt")["w"], torch.zeros(4))


@pytest.mark.parametrize("mode", ["pipelined", "snapshot"])
def test_containers_changed_after_the_snapshot_phase_do_not_reach_the_file(tmp_path, mode):
    """The contract for containers, as for tensors: once ``wait_snapshot()``
    returns, a dict or list of the object may change (a history appended
    to, a key added, a client_state reused) without reaching the file."""
    big = torch.randn(4 << 20)
    obj = {"w": big, "hist": [0, 1, 2], "meta": {"epoch": 1}}
    fut = fastpersist.save_async(obj, tmp_path / "a.pt", mode=mode)
    fut.wait_snapshot()
    obj["hist"].append(99)
    obj["meta"]["epoch"] = 2
    obj["new"] = 5
    fut.result()
    got = torch.load(tmp_path / "a.pt", weights_only=False)
    assert got["hist"] == [0, 1, 2] and got["meta"] == {"epoch": 1} and "new" not in got
    assert torch.equal(got["w"], big)
