"""fastpersist as PyTorch Distributed Checkpoint's storage (fastpersist.dcp):
real torch.distributed (a one-process gloo group here, spawned gloo ranks
for resharding), the stock reader on fastpersist's files, commit and
failure behaviour, CRC checks, async saves."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import json
import os
import pickle
import re
import socket
import time
from typing import Any, Dict, Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available in this build", allow_module_level=True)
dcp = pytest.importorskip("torch.distributed.checkpoint")

import dcp_cases  # noqa: E402
import fastpersist  # noqa: E402
from fastpersist.dcp import CorruptCheckpointError, FastPersistReader, FastPersistWriter, sidecar_name  # noqa: E402
from fastpersist.options import EngineOptions, get_engine  # noqa: E402
from helpers import first_part_sent, make  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    """A real one-process gloo group for the module (DCP then runs its
    collectives, coordinator included, through it)."""
    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def state() -> Dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(10_000, generator=g)
    return {
        "w": torch.randn(300, 301, generator=g),
        "big": torch.randn(512, 256, generator=g),  # 512 KiB: data on a 4096 boundary
        "bf16": torch.randn(77, generator=g).to(torch.bfloat16),
        "i8": make((5, 9), torch.int8, seed=1),
        "view": base[17:4000],  # a view into a larger storage
        "t": torch.randn(20, 30, generator=g).t(),  # not contiguous
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(2.5),
        "nested": {"x": torch.arange(9, dtype=torch.int64), "lst": [torch.ones(3), 4]},
        "step": 11,
        "name": "run-1",
    }


def blank(sd: Any) -> Any:
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    if isinstance(sd, dict):
        return {k: blank(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [blank(v) for v in sd]
    return None


def assert_equal(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.cpu(), b.cpu()), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def load(path: Any, reader: Any, like: Any) -> Any:
    out = blank(like)
    dcp.load(out, storage_reader=reader)
    return out


@contextlib.contextmanager
def raises(exc: type, match: str) -> Iterator[None]:
    """``exc`` matching ``match``, raised as it is or, from inside DCP's
    collective steps, reported (its message) in the CheckpointException DCP
    raises."""
    try:
        yield
    except dcp.CheckpointException as e:
        assert re.search(match, str(e)), str(e)
    except exc as e:
        assert re.search(match, str(e)), str(e)
    else:
        raise AssertionError(f"{exc.__name__} not raised")


def sidecar(path: Any) -> Dict[str, Any]:
    md = pickle.load(open(os.path.join(path, ".metadata"), "rb"))
    return json.load(open(os.path.join(path, sidecar_name(md.storage_meta.save_id))))


# ---------------------------------------------------------------------------
# Files and round trips


@pytest.mark.parametrize("threads", [1, 2])
def test_round_trip_both_readers(tmp_path, threads):
    sd = state()
    dcp.save(sd, storage_writer=FastPersistWriter(tmp_path, thread_count=threads))
    data = sorted(n for n in os.listdir(tmp_path) if n.endswith(".distcp"))
    assert len(data) == threads
    for reader in (dcp.FileSystemReader(tmp_path), FastPersistReader(tmp_path)):
        assert_equal(load(tmp_path, reader, sd), sd, type(reader).__name__)


def test_reads_into_destinations_are_not_split_by_the_temporary_buffer_bound(tmp_path, monkeypatch):
    """The reader bounds the temporary buffers one engine call fills
    (READ_BATCH_BYTES); it counted every item's bytes, also those read
    straight into their destination tensors, so a large checkpoint was read
    in many short engine calls, each draining the reads in flight. Items
    read into their destinations now cost the bound nothing (one call);
    items that need a temporary buffer still split calls at the bound."""
    import fastpersist.integrations.dcp as mod

    g = torch.Generator().manual_seed(5)
    sd = {f"w{i}": torch.randn(256, 256, generator=g) for i in range(6)}  # 256 KiB each
    dcp.save(sd, storage_writer=FastPersistWriter(tmp_path))
    calls = []
    real = mod.read_with

    def spy(eng, fd, reqs):
        calls.append(len(reqs))
        return real(eng, fd, reqs)

    monkeypatch.setattr(mod, "read_with", spy)
    monkeypatch.setattr(mod, "READ_BATCH_BYTES", 300 << 10)
    assert_equal(load(tmp_path, FastPersistReader(tmp_path), sd), sd)
    assert len(calls) == 1, calls
    # float64 destinations: each item is read into a temporary float32
    # chunk first (then copied), so the bound splits the calls.
    calls.clear()
    out = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in sd.items()}
    dcp.load(out, storage_reader=FastPersistReader(tmp_path))
    for k, v in sd.items():
        assert torch.equal(out[k], v.double()), k
    assert len(calls) == 3, calls


def test_the_small_pieces_of_many_items_share_temporary_chunks(tmp_path, monkeypatch):
    """Each item read into its destination also reads its blob's head and
    tail (a few hundred bytes, for the CRC32). They were two tensors made per
    item, 20,000 for a checkpoint of 10,000 small tensors; now they are cut
    from shared chunks. A damaged tail is still caught."""
    import fastpersist.integrations.dcp as mod

    g = torch.Generator().manual_seed(8)
    sd = {f"t{i}": torch.randn(16 + i, generator=g) for i in range(300)}
    dcp.save(sd, storage_writer=FastPersistWriter(tmp_path))
    kept = []
    real = mod.FastPersistReader._read_batch

    def spy(self, fd, path, batch, planner):
        kept.append((len(batch.pending), len(batch.keep)))
        return real(self, fd, path, batch, planner)

    monkeypatch.setattr(mod.FastPersistReader, "_read_batch", spy)
    assert_equal(load(tmp_path, FastPersistReader(tmp_path), sd), sd)
    assert sum(p for p, _ in kept) == len(sd), kept
    # 600 pieces of at most 512 bytes: a few chunks, not one tensor each.
    assert sum(k for _, k in kept) <= 4 * len(kept), kept
    # A byte flipped in the last item's tail (its central directory): caught.
    rel, entries = next(iter(sidecar(tmp_path)["files"].items()))
    offset, length = max(entries, key=lambda e: e[0])[:2]
    _flip(tmp_path / rel, offset + length - 30)
    with raises(CorruptCheckpointError, "'t299'.*CRC32"):
        load(tmp_path, FastPersistReader(tmp_path), sd)


def test_templates_outlive_many_shapes_and_stay_bounded(tmp_path, monkeypatch):
    """The writer's per-(dtype, shape) blob templates were all dropped
    whenever the cache passed 4096 entries, so every save of a state with
    more distinct shapes than that (the benchmark's 10,000 small tensors
    have about 5,300) laid out every blob again. The cache is now bounded
    by bytes, least recently used dropped first."""
    import fastpersist.integrations.dcp as mod

    made = []
    real = mod._make_template

    def counted(t, align, plain=False):
        made.append(tuple(t.shape))
        return real(t, align, plain)

    monkeypatch.setattr(mod, "_make_template", counted)
    monkeypatch.setattr(mod, "_templates", mod._Templates())
    sd = {f"t{i}": torch.full((1, i + 1), float(i)) for i in range(4200)}
    dcp.save(sd, storage_writer=FastPersistWriter(tmp_path / "a"))
    assert len(made) == 4200
    dcp.save(sd, storage_writer=FastPersistWriter(tmp_path / "b"))
    assert len(made) == 4200  # every template reused
    assert_equal(load(tmp_path / "b", dcp.FileSystemReader(tmp_path / "b"), sd), sd)

    monkeypatch.setattr(mod, "TEMPLATE_CACHE_BYTES", 100_000)
    tpls = mod._Templates()
    for i in range(200):
        tpls.get(torch.empty(2, i + 1), 64)
    tpls.get(torch.empty(2, 150), 64)  # used again: kept over older ones
    assert 0 < tpls._bytes <= 100_000
    assert tpls._bytes == sum(t.nbytes for t in tpls._cache.values())
    keys = [k[1][1] for k in tpls._cache]
    assert keys[-1] == 150 and 200 in keys and 1 not in keys


def test_metadata_is_stock(tmp_path):
    """.metadata holds DCP's own _StorageInfo (relative path, offset,
    length): it unpickles where fastpersist is not installed."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    dcp.save(state(), storage_writer=FastPersistWriter(tmp_path))
    raw = open(tmp_path / ".metadata", "rb").read()
    assert b"fastpersist" not in raw
    md = pickle.loads(raw)
    assert all(type(v) is _StorageInfo for v in md.storage_data.values())


def test_large_tensor_data_is_page_aligned(tmp_path):
    dcp.save(state(), storage_writer=FastPersistWriter(tmp_path))
    entries = [e for es in sidecar(tmp_path)["files"].values() for e in es]
    big = [e for e in entries if e[4] >= 64 << 10]
    assert big
    for offset, length, _crc, data_off, data_len, *_ in big:
        assert (offset + data_off) % 4096 == 0
        assert data_off + data_len <= length


def test_fastpersist_reads_stock_checkpoints(tmp_path):
    sd = state()
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path))
    reader = FastPersistReader(tmp_path)
    assert_equal(load(tmp_path, reader, sd), sd)
    assert not reader.verified  # no sidecar: read unchecked


def test_full_load_without_a_group(tmp_path):
    sd = state()
    dcp.save(sd, storage_writer=FastPersistWriter(tmp_path))
    out = blank(sd)
    dcp.load(out, storage_reader=FastPersistReader(tmp_path), no_dist=True)
    assert_equal(out, sd)


def test_checkpoint_id_and_reuse(tmp_path):
    """One writer and one reader for several checkpoints (DCP's reset)."""
    w, r = FastPersistWriter(tmp_path / "unused"), FastPersistReader(tmp_path / "unused")
    sds = []
    for i in range(2):
        sd = {"x": torch.full((100,), float(i))}
        dcp.save(sd, checkpoint_id=tmp_path / f"c{i}", storage_writer=w)
        sds.append(sd)
    for i, sd in enumerate(sds):
        out = blank(sd)
        dcp.load(out, checkpoint_id=tmp_path / f"c{i}", storage_reader=r)
        assert_equal(out, sd)


def test_device_storages_through_the_staging_path(tmp_path, monkeypatch):
    """The path CUDA tensors take (chunks through the staging slots), run on
    the CPU with the test hook that stages CPU storages."""
    monkeypatch.setenv("FASTPERSIST_TEST_STAGE_CPU", "1")
    sd = state()
    dcp.save(sd, storage_writer=FastPersistWriter(tmp_path))
    monkeypatch.delenv("FASTPERSIST_TEST_STAGE_CPU")
    for reader in (dcp.FileSystemReader(tmp_path), FastPersistReader(tmp_path)):
        assert_equal(load(tmp_path, reader, sd), sd, type(reader).__name__)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_round_trip(tmp_path):
    sd = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in state().items() if k != "nested"}
    dcp.save(sd, storage_writer=FastPersistWriter(tmp_path))
    for reader in (dcp.FileSystemReader(tmp_path), FastPersistReader(tmp_path)):
        out = load(tmp_path, reader, sd)
        for k, v in sd.items():
            if isinstance(v, torch.Tensor):
                assert out[k].is_cuda and torch.equal(out[k], v), k


# ---------------------------------------------------------------------------
# Commit, replacement, failures


def test_second_save_replaces_first_and_removes_its_files(tmp_path):
    sd = state()
    dcp.save(sd, storage_writer=FastPersistWriter(tmp_path))
    first = set(os.listdir(tmp_path))
    sd["w"] += 1
    dcp.save(sd, storage_writer=FastPersistWriter(tmp_path))
    second = set(os.listdir(tmp_path))
    assert first & second == {".metadata"}
    assert_equal(load(tmp_path, FastPersistReader(tmp_path), sd), sd)
    # a stock checkpoint at the path is replaced the same way
    d = tmp_path / "stock"
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(d))
    dcp.save(sd, storage_writer=FastPersistWriter(d))
    assert not [n for n in os.listdir(d) if n.endswith(".distcp") and n.count(".") == 1]


def test_replaced_files_are_found_while_the_data_is_written(tmp_path):
    """The replaced checkpoint's file list is read from its .metadata on a
    thread started at planning (it is pickled away with the writer, not
    carried: DCP's process-based async mode); its files are removed with
    ``_core.remove_file`` (the name now, a big file's blocks freed on a
    background thread)."""
    from fastpersist import _core
    from torch.distributed.checkpoint.planner import SavePlan

    sd = {"w": torch.randn(1 << 20)}  # one 4 MiB item
    dcp.save(sd, storage_writer=FastPersistWriter(tmp_path))
    first = set(os.listdir(tmp_path)) - {".metadata"}
    w = FastPersistWriter(tmp_path)
    w.set_up_storage_writer(True)
    w.prepare_local_plan(SavePlan([]))
    assert w._replaced is not None
    assert w._replaced.result(timeout=30)[0] == {n for n in first if n.endswith(".distcp")}
    assert pickle.loads(pickle.dumps(w))._replaced is None
    removed: list = []
    real = _core.remove_file

    def spy(path):
        removed.append(os.path.basename(path))
        return real(path)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_core, "remove_file", spy)
        dcp.save(sd, storage_writer=FastPersistWriter(tmp_path))
    assert set(removed) == first and not first & set(os.listdir(tmp_path))
    assert_equal(load(tmp_path, FastPersistReader(tmp_path), sd), sd)


def test_remove_file_is_unlink(tmp_path):
    from fastpersist import _core

    (tmp_path / "f").write_bytes(b"x" * (20 << 20))
    _core.remove_file(str(tmp_path / "f"))
    assert not (tmp_path / "f").exists()
    with pytest.raises(FileNotFoundError) as ei:
        _core.remove_file(tmp_path / "f")
    assert ei.value.filename == str(tmp_path / "f") and ei.value.errno == errno.ENOENT
    (tmp_path / "d").mkdir()
    with pytest.raises(IsADirectoryError):
        _core.remove_file(tmp_path / "d")
    assert (tmp_path / "d").is_dir()
    _core.wait_for_frees(30)


def test_failed_write_keeps_previous_checkpoint(tmp_path):
    sd = state()
    dcp.save(sd, storage_writer=FastPersistWriter(tmp_path))
    before = sorted(os.listdir(tmp_path))
    _, eng = get_engine(EngineOptions.resolve())
    eng.set_fault(8192, 5)
    try:
        with raises(OSError, "Input/output error"):
            dcp.save({k: v for k, v in sd.items() if k != "step"}, storage_writer=FastPersistWriter(tmp_path))
    finally:
        eng.set_fault(None)
    assert sorted(os.listdir(tmp_path)) == before  # no data file, no temporary file left
    assert_equal(load(tmp_path, FastPersistReader(tmp_path), sd), sd)
    assert_equal(load(tmp_path, dcp.FileSystemReader(tmp_path), sd), sd)


def test_a_failed_write_removes_the_files_it_wrote(tmp_path):
    """Regression: when a rank's write failed after some of its files were
    written (one file per item, the first ones done), those files stayed
    until the next save. They are this save's own and nothing names them."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class FailsLate(DefaultSavePlanner):
        def resolve_data(self, item):
            if item.index.fqn == "z":
                raise RuntimeError("injected: the planner fails on the last item")
            return super().resolve_data(item)

    sd = {"a": torch.ones(1000), "b": torch.ones(1000), "z": torch.ones(10)}
    with raises(RuntimeError, "injected"):
        dcp.save(
            sd,
            storage_writer=FastPersistWriter(tmp_path, single_file_per_rank=False, thread_count=1),
            planner=FailsLate(),
        )
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".distcp")], os.listdir(tmp_path)


def test_failed_commit_keeps_previous_checkpoint(tmp_path, monkeypatch):
    """The new data files are durable, but .metadata could not be written:
    the previous checkpoint still loads, and the failed save removes its own files."""

    sd = state()
    dcp.save(sd, storage_writer=FastPersistWriter(tmp_path))
    _fail_metadata(monkeypatch)
    sd2 = {**sd, "w": sd["w"] * 2}
    with raises(OSError, "No space left"):
        dcp.save(sd2, storage_writer=FastPersistWriter(tmp_path))
    monkeypatch.undo()
    assert_equal(load(tmp_path, FastPersistReader(tmp_path), sd), sd)
    dcp.save(sd2, storage_writer=FastPersistWriter(tmp_path))
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".distcp")]) == 1
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".crc32")]) == 1
    assert_equal(load(tmp_path, FastPersistReader(tmp_path), sd2), sd2)


def test_gc_paused_while_items_are_laid_out(tmp_path):
    """The per-item work of write_data and read_data runs with Python's
    cyclic GC paused (full collections of a heap of 10,000 items' objects
    cost more than the layout); it is enabled again afterwards."""
    import gc

    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

    seen = []

    class Save(DefaultSavePlanner):
        def resolve_data(self, item):
            seen.append(("save", gc.isenabled()))
            return super().resolve_data(item)

    class Load(DefaultLoadPlanner):
        def commit_tensor(self, req, tensor):
            seen.append(("load", gc.isenabled()))
            return super().commit_tensor(req, tensor)

    assert gc.isenabled()
    sd = state()
    dcp.save(sd, storage_writer=FastPersistWriter(tmp_path), planner=Save())
    assert gc.isenabled()
    out = blank(sd)
    dcp.load(out, storage_reader=FastPersistReader(tmp_path), planner=Load())
    assert gc.isenabled()
    assert_equal(out, sd)
    assert {k for k, _ in seen} == {"save", "load"}
    assert not any(enabled for _, enabled in seen), seen


def _full_collections_during(fn: Any) -> int:
    """How many full (generation 2) collections run while ``fn()`` runs."""
    import gc

    n = [0]

    def count(phase: str, info: Dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            n[0] += 1

    gc.callbacks.append(count)
    try:
        fn()
    finally:
        gc.callbacks.remove(count)
    return n[0]


def _churn() -> None:
    """Allocate, and keep until it returns, enough container objects to set
    off a full collection (more than a quarter of those surviving the last
    one, as DCP's plans of many items do)."""
    import gc

    keep = [[] for _ in range(len(gc.get_objects()) // 2 + 100_000)]
    del keep


def test_full_collections_deferred_between_the_storage_calls(tmp_path):
    """DCP's own work between the writer's (and reader's) calls, planning
    many items and pickling the plans, allocates enough objects to set off
    full collections of the whole heap (0.3 s each with torch imported;
    1.1-1.8 s of a 3.2 s save of 10,000 small tensors at one gloo rank).
    From the first call on a rank to its last they are deferred (the
    oldest generation's threshold raised), then the thresholds are as they
    were; ``defer_gc=False`` leaves them alone."""
    import gc

    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

    seen: Dict[str, Any] = {}

    class Save(DefaultSavePlanner):
        def create_global_plan(self, plans):  # DCP's code, between our calls
            seen["save"] = _full_collections_during(_churn)
            seen["save threshold"] = gc.get_threshold()
            return super().create_global_plan(plans)

    class Load(DefaultLoadPlanner):
        def create_global_plan(self, plans):
            seen["load"] = _full_collections_during(_churn)
            return super().create_global_plan(plans)

    gc.collect()
    before = gc.get_threshold()
    sd = state()
    for defer in (True, False):
        seen.clear()
        path = tmp_path / str(defer)
        dcp.save(sd, storage_writer=FastPersistWriter(path, defer_gc=defer), planner=Save())
        assert gc.get_threshold() == before
        out = blank(sd)
        dcp.load(out, storage_reader=FastPersistReader(path, defer_gc=defer), planner=Load())
        assert gc.get_threshold() == before
        assert_equal(out, sd)
        if defer:
            assert seen["save"] == 0 and seen["load"] == 0, seen
            assert seen["save threshold"][2] > before[2]
        else:
            assert seen["save"] >= 1 and seen["load"] >= 1, seen
            assert seen["save threshold"] == before


def test_a_deferral_ends_when_the_save_fails(tmp_path):
    """A save that fails in the writer ends its deferral at once; one that
    fails in DCP's own code between the writer's calls ends it when the
    writer next saves, is closed or is dropped (collections run late
    meanwhile, never not at all)."""
    import gc

    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class FailsInWriteData(DefaultSavePlanner):
        def resolve_data(self, item):
            raise ValueError("a planner that fails while the writer resolves items")

    class FailsInPlanning(DefaultSavePlanner):
        def create_global_plan(self, plans):
            raise ValueError("a planner that fails between the writer's calls")

    before = gc.get_threshold()
    sd = state()
    w = FastPersistWriter(tmp_path)
    with raises(ValueError, "while the writer resolves"):
        dcp.save(sd, storage_writer=w, planner=FailsInWriteData())
    assert gc.get_threshold() == before

    with raises(ValueError, "between the writer's calls"):
        dcp.save(sd, storage_writer=w, planner=FailsInPlanning())
    assert gc.get_threshold()[2] > before[2]
    dcp.save(sd, storage_writer=w)  # the next save ends it (no second deferral stacked)
    assert gc.get_threshold() == before
    assert_equal(load(tmp_path, FastPersistReader(tmp_path), sd), sd)

    with raises(ValueError, "between the writer's calls"):
        dcp.save(sd, storage_writer=w, planner=FailsInPlanning())
    w.close()
    assert gc.get_threshold() == before

    def fail_with_a_new_writer() -> None:
        with raises(ValueError, "between the writer's calls"):
            dcp.save(sd, storage_writer=FastPersistWriter(tmp_path), planner=FailsInPlanning())

    fail_with_a_new_writer()  # the writer and the exception's frames gone with the call
    gc.collect()
    assert gc.get_threshold() == before


def test_full_gc_deferrals_nest_and_leave_the_callers_thresholds():
    import gc

    from fastpersist.options import FullGcDeferral

    before = gc.get_threshold()
    a, b = FullGcDeferral(), FullGcDeferral()
    try:
        a.begin()
        a.begin()  # idempotent
        deferred = gc.get_threshold()
        assert deferred[:2] == before[:2] and deferred[2] > before[2]
        b.begin()
        a.end()
        a.end()
        assert gc.get_threshold() == deferred  # b still defers
        copy = pickle.loads(pickle.dumps(b))
        assert b.held and not copy.held
        b.end()
        assert gc.get_threshold() == before
        a.begin()
        gc.set_threshold(500, 5, 7)  # the caller's own, meanwhile: kept
        a.end()
        assert gc.get_threshold() == (500, 5, 7)
    finally:
        a.end()
        b.end()
        gc.set_threshold(*before)
    w = pickle.loads(pickle.dumps(FastPersistWriter("unused-path")))
    assert w.defer_gc and w._gc is None


def test_an_owner_finalized_inside_a_deferral_call_does_not_deadlock(monkeypatch):
    """A collection set off inside ``begin``/``end`` (by their own
    allocations; simulated here at ``gc.get_threshold``) may free a dropped
    writer caught in a reference cycle, whose finalizer ends its deferral,
    taking the module's lock again on the same thread."""
    import gc
    import threading
    import types
    import weakref

    from fastpersist import options
    from fastpersist.options import FullGcDeferral, full_gc_deferral

    before = gc.get_threshold()
    finalized = []

    class Owner:
        pass

    def get_threshold() -> Any:
        gc.collect()
        return gc.get_threshold()

    monkeypatch.setattr(
        options, "gc", types.SimpleNamespace(get_threshold=get_threshold, set_threshold=gc.set_threshold)
    )
    done = threading.Event()

    def run() -> None:
        d = FullGcDeferral()
        for _ in range(2):  # one owner freed inside begin, one inside end
            o = Owner()
            o.me = o  # a cycle: freed only by a collection
            full_gc_deferral(o)
            weakref.finalize(o, finalized.append, 1)
            del o
            d.begin()
            o = Owner()
            o.me = o
            full_gc_deferral(o)
            weakref.finalize(o, finalized.append, 2)
            del o
            d.end()
        done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert done.wait(30), "deadlocked"
    assert finalized == [1, 2, 1, 2]
    assert gc.get_threshold() == before


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.sampled_from(["begin", "end"]), st.integers(0, 3)),
            st.tuples(st.just("caller sets"), st.integers(1, 50)),
        ),
        max_size=30,
    )
)
def test_full_gc_deferrals_in_any_order(ops):
    """Any sequence of begins and ends of several deferrals, with the caller
    setting thresholds of its own in between: the oldest generation's
    threshold is deferred exactly while one is held and the caller has not
    set one since the first began; once none is held, it is the caller's
    last (or the original)."""
    import gc

    from fastpersist.options import FullGcDeferral

    original = gc.get_threshold()
    ds = [FullGcDeferral() for _ in range(4)]
    callers = original  # the thresholds the caller wants
    callers_since = False  # the caller set thresholds while one was held
    try:
        for op, arg in ops:
            if op == "caller sets":
                callers = (original[0], original[1], arg)
                gc.set_threshold(*callers)
                callers_since = any(d.held for d in ds)
            else:
                was_held = any(d.held for d in ds)
                getattr(ds[arg], op)()
                if not was_held and any(d.held for d in ds):
                    callers_since = False
            now = gc.get_threshold()
            assert now[:2] == original[:2]
            if not any(d.held for d in ds):
                assert now == callers
            elif callers_since:
                assert now == callers
            else:
                assert now[2] > callers[2]
    finally:
        for d in ds:
            d.end()
        gc.set_threshold(*original)


def test_data_file_is_written_while_later_items_are_resolved(tmp_path, monkeypatch):
    """The first part of a rank's data file reaches the engine before the
    later items are resolved (the disk starts at once): resolving item 40
    waits (up to 30 s) for the first write; laid out whole first, it would
    wait in vain. A planner that fails mid-way leaves the previous
    checkpoint and no stray file."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    sd = {f"t{i:02d}": torch.full((1 << 18,), float(i)) for i in range(64)}  # 1 MiB each
    first_sent = first_part_sent(monkeypatch)
    waited: list = []

    class Save(DefaultSavePlanner):
        def resolve_data(self, item):
            if item.index.fqn == "t40":
                waited.append(first_sent.wait(30))
            return super().resolve_data(item)

    dcp.save(sd, storage_writer=FastPersistWriter(tmp_path), planner=Save())
    assert waited == [True]
    assert_equal(load(tmp_path, dcp.FileSystemReader(tmp_path), sd), sd)
    before = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)}

    class Broken(DefaultSavePlanner):
        def resolve_data(self, item):
            if item.index.fqn == "t50":
                raise RuntimeError("planner broke at t50")
            return super().resolve_data(item)

    with raises(Exception, "planner broke at t50"):
        dcp.save(sd, storage_writer=FastPersistWriter(tmp_path), planner=Broken())
    assert {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)} == before


def test_overwrite_false_refuses(tmp_path):
    dcp.save(state(), storage_writer=FastPersistWriter(tmp_path))
    with raises(RuntimeError, "overwrite=False"):
        dcp.save(state(), storage_writer=FastPersistWriter(tmp_path, overwrite=False))


# ---------------------------------------------------------------------------
# Integrity and bad input


def _flip(path: Any, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize("where", ["data", "header", "tail"])
def test_crc_detects_a_flipped_byte(tmp_path, where):
    sd = state()
    dcp.save(sd, storage_writer=FastPersistWriter(tmp_path))
    rel, entries = next(iter(sidecar(tmp_path)["files"].items()))
    offset, length, _crc, data_off, data_len, *_ = max(entries, key=lambda e: e[4])  # the largest tensor
    at = {"data": data_off + data_len // 2, "header": 10, "tail": data_off + data_len + 20}[where]
    _flip(tmp_path / rel, offset + at)
    with raises(CorruptCheckpointError, "'big'.*CRC32"):
        load(tmp_path, FastPersistReader(tmp_path), sd)
    load(tmp_path, FastPersistReader(tmp_path, verify=False), sd) if where == "data" else None


def test_crc_detects_a_flipped_byte_in_a_byte_item(tmp_path):
    sd = state()
    dcp.save(sd, storage_writer=FastPersistWriter(tmp_path))
    rel, entries = next(iter(sidecar(tmp_path)["files"].items()))
    offset, length, *_ = next(e for e in entries if e[3] < 0)
    _flip(tmp_path / rel, offset + length // 2)
    with raises(CorruptCheckpointError, "CRC32"):
        load(tmp_path, FastPersistReader(tmp_path), sd)


def files(path: Any) -> Dict[str, bytes]:
    """Every file in the checkpoint directory, with its bytes."""
    return {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path))}


class _FutureMetadata:
    """Stands for a class that a newer writer pickled and this one lacks."""


def _unknown_class_pickle() -> bytes:
    raw = pickle.dumps(_FutureMetadata())
    return raw.replace(b"_FutureMetadata", b"_NoSuchMetadataV9")


@pytest.mark.parametrize(
    "content,match",
    [
        ("truncated", "damaged"),
        ("empty", "damaged"),
        ("garbage", "damaged"),
        ("unknown class", "damaged or unknown"),
        ("not metadata", "not DCP metadata"),
    ],
)
def test_damaged_and_unknown_metadata(tmp_path, content, match):
    sd = state()
    dcp.save(sd, storage_writer=FastPersistWriter(tmp_path))
    md = tmp_path / ".metadata"
    good = md.read_bytes()
    md.write_bytes(
        {
            "truncated": good[: len(good) // 2],
            "empty": b"",
            "garbage": b"PK\x03\x04 not a pickle" * 10,
            "unknown class": _unknown_class_pickle(),
            "not metadata": pickle.dumps({"not": "metadata"}),
        }[content]
    )
    before = files(tmp_path)
    with raises(CorruptCheckpointError, match):
        load(tmp_path, FastPersistReader(tmp_path), sd)
    assert files(tmp_path) == before  # nothing deleted or changed
    md.write_bytes(good)
    assert_equal(load(tmp_path, FastPersistReader(tmp_path), sd), sd)


def test_missing_metadata(tmp_path):
    """A directory with data files but no .metadata (a save that never
    committed) is not a checkpoint: a clear error, the files kept."""
    sd = state()
    dcp.save(sd, storage_writer=FastPersistWriter(tmp_path))
    os.unlink(tmp_path / ".metadata")
    before = files(tmp_path)
    with raises(FileNotFoundError, "not a DCP checkpoint: .metadata is missing"):
        load(tmp_path, FastPersistReader(tmp_path), sd)
    assert files(tmp_path) == before


def test_damaged_sidecar(tmp_path):
    sd = state()
    dcp.save(sd, storage_writer=FastPersistWriter(tmp_path))
    md = pickle.load(open(tmp_path / ".metadata", "rb"))
    car = tmp_path / sidecar_name(md.storage_meta.save_id)
    car.write_bytes(car.read_bytes()[:-7])
    before = files(tmp_path)
    with raises(CorruptCheckpointError, "damaged CRC32 sidecar"):
        load(tmp_path, FastPersistReader(tmp_path), sd)
    assert files(tmp_path) == before
    assert_equal(load(tmp_path, dcp.FileSystemReader(tmp_path), sd), sd)  # stock readers never open it


def test_a_sidecar_nested_too_deep_to_parse_is_a_damaged_sidecar(tmp_path):
    """A sidecar of JSON nested past the decoder's recursion is damaged,
    like any other that does not parse."""
    sd = state()
    dcp.save(sd, storage_writer=FastPersistWriter(tmp_path))
    md = pickle.load(open(tmp_path / ".metadata", "rb"))
    (tmp_path / sidecar_name(md.storage_meta.save_id)).write_bytes(b"[" * 100_000)
    with raises(CorruptCheckpointError, "damaged CRC32 sidecar"):
        load(tmp_path, FastPersistReader(tmp_path), sd)


def test_metadata_naming_a_file_outside_the_checkpoint(tmp_path):
    sd = state()
    (tmp_path / "outside").write_bytes(b"not yours")
    ck = tmp_path / "ck"
    dcp.save(sd, storage_writer=FastPersistWriter(ck))
    md = pickle.load(open(ck / ".metadata", "rb"))
    for k, v in md.storage_data.items():
        md.storage_data[k] = dataclasses.replace(v, relative_path="../outside")
    (ck / ".metadata").write_bytes(pickle.dumps(md))
    with raises(CorruptCheckpointError, "names a file outside it"):
        load(ck, FastPersistReader(ck), sd)
    assert (tmp_path / "outside").read_bytes() == b"not yours"


@pytest.mark.parametrize("kind", ["link-out", "dotted-name"])
def test_data_files_are_the_checkpoints_own(tmp_path, kind):
    """Regression (found in a hunt): a data file that was a link was
    followed out of the checkpoint's directory (what it points at was
    read); a name that only begins with ".." (``..data.distcp``, a file of
    the directory) was refused as outside it. A link out is refused; the
    name is read."""
    sd = state()
    ck = tmp_path / "ck"
    dcp.save(sd, storage_writer=FastPersistWriter(ck))
    data = sorted(n for n in os.listdir(ck) if n.endswith(".distcp"))
    if kind == "link-out":
        for n in data:
            os.rename(ck / n, tmp_path / n)  # (the same bytes: their CRC32s hold)
            os.symlink(tmp_path / n, ck / n)
        with raises(CorruptCheckpointError, "outside it"):
            load(ck, FastPersistReader(ck), sd)
        return
    md = pickle.load(open(ck / ".metadata", "rb"))
    for n in data:
        os.rename(ck / n, ck / (".." + n))
    for k, v in md.storage_data.items():
        md.storage_data[k] = dataclasses.replace(v, relative_path=".." + v.relative_path)
    (ck / ".metadata").write_bytes(pickle.dumps(md))
    for n in os.listdir(ck):
        if n not in (".metadata",) and not n.startswith(".."):
            os.unlink(ck / n)  # (the sidecar names the old names: a stock DCP checkpoint now)
    assert_equal(load(ck, FastPersistReader(ck), sd), sd)


def test_missing_rank_file(tmp_path):
    """One of several data files gone: the error names it; the checkpoint's
    other files stay as they were."""
    sd = state()
    dcp.save(sd, storage_writer=FastPersistWriter(tmp_path, thread_count=2))
    data = sorted(n for n in os.listdir(tmp_path) if n.endswith(".distcp"))
    assert len(data) == 2
    os.rename(tmp_path / data[1], tmp_path / "elsewhere")
    before = files(tmp_path)
    with raises(FileNotFoundError, re.escape(data[1]) + ": data file missing"):
        load(tmp_path, FastPersistReader(tmp_path), sd)
    assert files(tmp_path) == before
    os.rename(tmp_path / "elsewhere", tmp_path / data[1])
    assert_equal(load(tmp_path, FastPersistReader(tmp_path), sd), sd)


def test_truncated_rank_file(tmp_path):
    sd = state()
    dcp.save(sd, storage_writer=FastPersistWriter(tmp_path))
    data = next(n for n in os.listdir(tmp_path) if n.endswith(".distcp"))
    os.truncate(tmp_path / data, os.path.getsize(tmp_path / data) // 2)
    with raises(CorruptCheckpointError, "outside the file"):
        load(tmp_path, FastPersistReader(tmp_path), sd)


def test_path_that_is_not_a_directory(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"keep me")
    with raises(NotADirectoryError, "not a directory"):
        dcp.save(state(), storage_writer=FastPersistWriter(f))
    with raises(NotADirectoryError, "not a directory"):
        load(f, FastPersistReader(f), state())
    with raises(FileNotFoundError, "no checkpoint"):
        load(tmp_path / "nothing", FastPersistReader(tmp_path / "nothing"), state())
    assert f.read_bytes() == b"keep me"
    with pytest.raises(TypeError):
        FastPersistWriter(open(f, "rb"))
    with pytest.raises(ValueError):
        FastPersistWriter(tmp_path, queue_depth=0)


# ---------------------------------------------------------------------------
# Async saves


def test_async_save_with_fastpersist_stager(tmp_path):
    sd = state()
    expected = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
    w = FastPersistWriter(tmp_path)
    fut = dcp.async_save(sd, storage_writer=w)
    sd["w"].add_(1)  # after stage(): not in the checkpoint
    fut.result()
    assert_equal(load(tmp_path, FastPersistReader(tmp_path), expected), expected)
    pool = w._stager.pool
    held = pool.nbytes
    assert held > 0
    for _ in range(3):  # the staging buffers are reused, not grown
        dcp.async_save(sd, storage_writer=w).result()
    # At most two: DCP's executor thread may still hold the last staged
    # state dict for a moment after its result is set, and a buffer goes
    # back only once that is gone.
    assert held <= pool.nbytes <= 2 * held
    w.close()


def test_a_planner_that_reads_through_one_scratch_buffer_gets_every_item(tmp_path):
    """Regression (found in a hunt): the reader resolved every item of a
    read batch first, read them all into what ``resolve_tensor`` gave and
    committed them after; a planner handing out one scratch buffer (and
    copying it out at ``commit_tensor``, as DCP's planner allows) got the
    last item's data in every tensor, with every CRC32 passing. Items whose
    destinations share memory are now read and committed one after the
    other, and each item's destination is resolved once."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    resolved = []

    class Scratch(DefaultLoadPlanner):
        def __init__(self) -> None:
            super().__init__()
            self.scratch = torch.empty(1 << 16)

        def resolve_tensor(self, read_item):
            resolved.append(read_item.dest_index.fqn)
            dest = super().resolve_tensor(read_item)
            return self.scratch[: dest.numel()].view(dest.shape)

        def commit_tensor(self, read_item, tensor):
            super().resolve_tensor(read_item).copy_(tensor)

    class Split(Scratch):
        # Reads "t0" in two halves, as a resharded load does: items that are
        # not a whole saved chunk (copied in at their finish, not read in).
        def create_local_plan(self):
            plan = super().create_local_plan()
            items = []
            for it in plan.items:
                if it.dest_index.fqn == "t0":
                    h = it.lengths[0] // 2
                    items.append(dataclasses.replace(it, lengths=torch.Size([h])))
                    rest = torch.Size([it.lengths[0] - h])
                    items.append(
                        dataclasses.replace(
                            it, dest_offsets=torch.Size([h]), storage_offsets=torch.Size([h]), lengths=rest
                        )
                    )
                else:
                    items.append(it)
            return dataclasses.replace(plan, items=items)

    sd = {f"t{i}": torch.full((1000,), float(i)) for i in range(5)}
    sd["h"] = torch.arange(10, dtype=torch.float64)
    dcp.save(sd, storage_writer=FastPersistWriter(tmp_path))
    for planner, items in ((Scratch(), len(sd)), (Split(), len(sd) + 1)):
        del resolved[:]
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcp.load(out, storage_reader=FastPersistReader(tmp_path), planner=planner)
        assert_equal(out, sd)
        assert len(resolved) == items and set(resolved) == set(sd)


def test_items_dcp_stored_through_its_extensions_are_read_as_dcp_reads_them(tmp_path):
    """Regression (found in a hunt): items DCP's writer stored through a
    stream extension (``FileSystemWriter(_extensions=[...])``: compressed,
    their ``transform_descriptors`` in .metadata) were read raw: bytes items
    failed to unpickle and tensor items came back as the compressed bytes.
    They are read by DCP's own reader, which undoes the transform."""
    import gzip

    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension

    class Gzip(StreamTransformExtension):
        @staticmethod
        def registry_name():
            return "stream.gzip"

        @staticmethod
        def from_descriptor(version):
            return Gzip()

        def get_descriptor(self):
            return "stream.gzip/1"

        def transform_to(self, output):
            return gzip.GzipFile(fileobj=output, mode="wb")

        def transform_from(self, input):
            return gzip.GzipFile(fileobj=input, mode="rb")

    sd = {"w": torch.arange(1000, dtype=torch.float32), "blob": io.BytesIO(b"payload")}
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path, _extensions=[Gzip()]))
    reg = ExtensionRegistry()
    reg.register(Gzip)
    out = {"w": torch.zeros(1000), "blob": io.BytesIO()}
    dcp.load(out, storage_reader=FastPersistReader(tmp_path, _extension_registry=reg))
    assert torch.equal(out["w"], sd["w"]) and out["blob"].getvalue() == b"payload"


def test_a_rank_with_nothing_to_write_leaves_no_file(tmp_path):
    """Regression (found in a hunt): a rank with no items wrote an empty
    data file at every save; nothing named it, so each save left one more
    behind (until a sweep minutes later)."""
    for _ in range(3):
        dcp.save({}, storage_writer=FastPersistWriter(tmp_path))
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".distcp")], os.listdir(tmp_path)
    dcp.load({}, storage_reader=FastPersistReader(tmp_path))


def test_async_save_stages_dict_subclasses(tmp_path):
    """Regression (found in a hunt): the writer's stager rebuilt every dict
    as ``type(d)(items)``, so a defaultdict (an optimizer's state often is
    one) raised TypeError from ``dcp.async_save``, which DCP's own stager
    saves. A dict subclass is staged as a copy of its own type."""
    import collections

    sd = {"opt": collections.defaultdict(dict, {"step": torch.tensor(3.0)}), "w": torch.ones(4)}
    w = FastPersistWriter(tmp_path)
    dcp.async_save(sd, storage_writer=w).result()
    w.close()
    out = {"opt": {"step": torch.tensor(0.0)}, "w": torch.zeros(4)}
    dcp.load(out, storage_reader=FastPersistReader(tmp_path))
    assert float(out["opt"]["step"]) == 3.0 and torch.equal(out["w"], torch.ones(4))


def test_staged_and_viewed_tensors_are_written_from_where_they_lie(tmp_path, monkeypatch):
    # Every tensor DCP's async_save staged through the writer is a view into
    # the staging buffer, and state dicts hold views of their own (slices of
    # a flat buffer): a contiguous view is written in place, not copied once
    # more; a non-contiguous one is copied, as the record needs.
    from fastpersist.integrations import dcp as fdcp

    flat = torch.randn(1 << 16)
    sd = {
        "slice": flat[1000 : 1000 + 5000],
        "shaped": flat[8192 : 8192 + 4096].view(64, 64),
        "transposed": flat[: 64 * 32].view(64, 32).t(),
        "own": torch.randn(100),
    }
    expected = {k: v.clone() for k, v in sd.items()}
    regions: list = []
    real = fdcp._FileLayout.finish

    def spy(self):
        plan = real(self)
        regions.extend(plan.regions)
        return plan

    monkeypatch.setattr(fdcp._FileLayout, "finish", spy)
    dcp.save(sd, storage_writer=FastPersistWriter(tmp_path))
    addresses = {r.address for r in regions}
    assert sd["slice"].data_ptr() in addresses and sd["shaped"].data_ptr() in addresses
    assert sd["own"].data_ptr() in addresses and sd["transposed"].data_ptr() not in addresses
    assert_equal(load(tmp_path, FastPersistReader(tmp_path), expected), expected)
    assert_equal(load(tmp_path, dcp.FileSystemReader(tmp_path), expected), expected)
    # Staged: every region lies in the staging buffer.
    regions.clear()
    w = FastPersistWriter(tmp_path / "staged")
    dcp.async_save(sd, storage_writer=w).result()
    assert_equal(load(tmp_path / "staged", FastPersistReader(tmp_path / "staged"), expected), expected)
    bufs = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in w._stager.pool._free + w._stager.pool._used]
    assert regions and all(any(lo <= r.address < hi for lo, hi in bufs) for r in regions)
    w.close()


def test_staging_buffer_lives_as_long_as_the_staged_state_dict():
    # A staged tensor is a view of the staging buffer, and a view does not
    # keep its base's Python object alive: the buffer went back to the pool
    # as soon as stage() returned, so the next stage (an async_save called
    # before the last one was written) overwrote a staged state dict still
    # being written, into a checkpoint whose CRCs matched the wrong bytes.
    import gc

    from fastpersist.integrations.dcp import _Stager

    stager = _Stager()
    try:
        mine = {"a": torch.randn(1 << 18), "b": torch.randn(10), "n": 3}
        first = stager.stage(mine)
        second = stager.stage({"a": torch.zeros(1 << 18), "b": torch.zeros(10), "n": 4})
        assert first["a"].untyped_storage().data_ptr() != second["a"].untyped_storage().data_ptr()
        assert_equal(first, mine)
        assert stager.owns(first["a"].untyped_storage()) and not stager.owns(mine["a"].untyped_storage())
        del first, second
        gc.collect()
        assert stager.pool._used == [] and len(stager.pool._free) == 2
    finally:
        stager.close()


def test_async_saves_write_their_staged_copy_without_copying_it_again(tmp_path):
    # What the writer's own stager holds is the writer's memory: no guard
    # watches it, and the engine writes its whole blocks from where they lie
    # (zero copy). The caller's tensors in a synchronous save are read under
    # the GIL, copied.
    g = torch.Generator().manual_seed(5)
    sd = {"big": torch.randn(3 << 20, generator=g), "small": torch.randn(100, generator=g)}
    w = FastPersistWriter(tmp_path / "async")
    dcp.async_save(sd, storage_writer=w).result()
    assert sum(s.zero_copy_bytes for s in w.last_stats) >= 8 << 20
    w.close()
    s = FastPersistWriter(tmp_path / "sync")
    dcp.save(sd, storage_writer=s)
    assert sum(st.zero_copy_bytes for st in s.last_stats) == 0
    for path in ("async", "sync"):
        assert_equal(load(tmp_path / path, FastPersistReader(tmp_path / path), sd), sd)
        assert_equal(load(tmp_path / path, dcp.FileSystemReader(tmp_path / path), sd), sd)


def test_async_save_with_dcp_stager(tmp_path):
    staging = pytest.importorskip("torch.distributed.checkpoint.staging")
    if not hasattr(staging, "DefaultStager"):
        pytest.skip("this torch has no DefaultStager")
    sd = state()
    expected = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
    stager = staging.DefaultStager(staging.StagingOptions(False, False, False, False))
    try:
        fut = dcp.async_save(sd, storage_writer=FastPersistWriter(tmp_path), async_stager=stager)
        fut.result()
    finally:
        stager.close()
    assert_equal(load(tmp_path, FastPersistReader(tmp_path), expected), expected)


def test_writer_pickles_without_engines_or_pool(tmp_path):
    w = FastPersistWriter(tmp_path, block_size=1 << 20)
    w.stage({"x": torch.ones(10)})
    w2 = pickle.loads(pickle.dumps(w))
    assert w2._stager is None and w2.path == w.path and w2.opts == w.opts
    sd = {"x": torch.arange(10.0)}
    dcp.save(sd, storage_writer=w2)
    assert_equal(load(tmp_path, FastPersistReader(tmp_path), sd), sd)


def test_async_save_process_based(tmp_path):
    from torch.distributed.checkpoint import state_dict_saver

    kind = getattr(state_dict_saver, "AsyncCheckpointerType", None)
    if kind is None or not hasattr(kind, "PROCESS"):
        pytest.skip("this torch has no process-based async_save")
    sd = {"w": torch.randn(100, 100), "step": 3}
    fut = dcp.async_save(sd, storage_writer=FastPersistWriter(tmp_path), async_checkpointer_type=kind.PROCESS)
    fut.result(timeout=300)
    assert os.path.exists(
        os.path.join(tmp_path, sidecar_name(pickle.load(open(tmp_path / ".metadata", "rb")).storage_meta.save_id))
    )
    assert_equal(load(tmp_path, FastPersistReader(tmp_path), sd), sd)


def test_public_names_are_the_adapters():
    """fastpersist.dcp re-exports exactly integrations.dcp's public names."""
    import fastpersist.dcp as public
    import fastpersist.integrations.dcp as adapter

    assert public.__all__ == adapter.__all__
    assert {"FastPersistWriter", "FastPersistReader", "install", "uninstall", "CorruptCheckpointError"} <= set(
        public.__all__
    )
    for name in adapter.__all__:
        assert getattr(public, name) is getattr(adapter, name), name


# ---------------------------------------------------------------------------
# install()


def test_install_picks_fastpersist_for_plain_paths(tmp_path):
    sd = state()
    fastpersist.dcp.install()
    try:
        assert fastpersist.dcp.installed()
        dcp.save(sd, checkpoint_id=tmp_path / "a")
        assert any(n.endswith(".crc32") for n in os.listdir(tmp_path / "a"))
        out = blank(sd)
        dcp.load(out, checkpoint_id=tmp_path / "a")
        assert_equal(out, sd)
    finally:
        fastpersist.dcp.uninstall()
    assert not fastpersist.dcp.installed()
    dcp.save(sd, checkpoint_id=tmp_path / "b")
    assert not any(n.endswith(".crc32") for n in os.listdir(tmp_path / "b"))


# ---------------------------------------------------------------------------
# Several ranks: save with N, load with M and another placement


@pytest.mark.parametrize("save_world,load_world", [(4, 2)])
def test_reshard_across_rank_counts(tmp_path, save_world, load_world):
    pytest.importorskip("torch.distributed.tensor")
    path = str(tmp_path / "ckpt")
    # a second save, in which rank 1 fails half-way, must leave the first
    dcp_cases.spawn(dcp_cases.save_ranks, save_world, path, 1)
    md = pickle.load(open(os.path.join(path, ".metadata"), "rb"))
    used = {v.relative_path for v in md.storage_data.values()}
    assert len(used) == save_world
    # the ranks that did not fail committed their files; nothing names them
    # (the next successful save removes them)
    assert len(set(os.listdir(path)) - used - {".metadata", sidecar_name(md.storage_meta.save_id)}) == save_world - 1
    dcp_cases.spawn(dcp_cases.load_ranks, load_world, path)
    # and a full (unsharded) load in one process
    full = dcp_cases.full_tensors()
    out: Dict[str, Any] = {k: torch.zeros_like(v) for k, v in full.items()}
    out["step"] = 0
    reader = FastPersistReader(path)
    dcp.load(out, storage_reader=reader)
    assert reader.verified
    for k, v in full.items():
        assert torch.equal(out[k], v), k
    assert out["step"] == 7


# ---------------------------------------------------------------------------
# install() through a real caller: torchtitan's CheckpointManager, which
# hands DCP only a checkpoint_id (no storage writer or reader)


def _torchtitan() -> Any:
    """torchtitan's pieces, or a skip naming why they cannot run here."""
    try:
        from torchtitan.components.checkpoint import CheckpointManager
        from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
        from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig
        from torchtitan.models.llama3 import model_registry
    except Exception as e:  # noqa: BLE001 - not installed, or not for this torch
        pytest.skip(f"torchtitan is not usable here ({type(e).__name__}: {e})")
    return CheckpointManager, LRSchedulersContainer, OptimizersContainer, ParamGroupConfig, model_registry


def _titan_trainer(folder: Any, async_mode: str) -> Any:
    """A tiny torchtitan Llama 3 (its debug config, two layers) wrapped in
    FSDP2 on a CPU mesh (parameters and optimizer state are DTensors),
    AdamW after one step, and torchtitan's CheckpointManager."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    manager, schedulers, optimizers, group, registry = _torchtitan()
    cfg = registry("debugmodel", attn_backend="flex").model
    cfg.layers = cfg.layers[:2]
    torch.manual_seed(0)
    model = cfg.build()
    model.init_states()
    mesh = init_device_mesh("cpu", (1,))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = optimizers.Config(
        param_groups=[group(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})],
        implementation="for-loop",
    ).build(model_parts=[model])
    sched = schedulers.Config(warmup_steps=2).build(optimizers=opt, training_steps=10)
    _titan_step(model, opt, sched, 1.0)
    ck = manager.Config(enable=True, folder="ckpt", interval=1, keep_latest_k=0, async_mode=async_mode).build(
        dataloader=None,
        model_parts=[model],
        optimizers=opt,
        lr_schedulers=sched,
        states={},
        sd_adapter=None,
        base_folder=str(folder),
    )
    return ck, model, opt, sched


def _titan_step(model: Any, opt: Any, sched: Any, grad: float) -> None:
    for p in model.parameters():
        p.grad = torch.full_like(p, grad)
    opt.step()
    sched.step()


def _titan_state(model: Any, opt: Any, sched: Any) -> Dict[str, Any]:
    """Model and optimizer state as full CPU tensors, and the schedule."""

    def full(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        if isinstance(v, dict):
            return {k: full(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [full(x) for x in v]
        return v

    return {"model": full(model.state_dict()), "optim": full(opt.state_dict()), "sched": full(sched.state_dict())}


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_install_through_torchtitan_checkpoint_manager(tmp_path, monkeypatch, async_mode):
    """torchtitan's CheckpointManager calls dcp.save / dcp.async_save / dcp.load
    with a path only: with install() its checkpoints are fastpersist's (the
    engine's writer and reader ran, CRC sidecar, own file names) and load
    back identically; after uninstall() they are DCP's own again."""
    ck, model, opt, sched = _titan_trainer(tmp_path, async_mode)
    calls: Dict[str, Any] = {"write": 0, "read": 0, "verified": []}
    real_write, real_read = FastPersistWriter.write_data, FastPersistReader.read_data

    def write_data(self: Any, *a: Any) -> Any:
        calls["write"] += 1
        return real_write(self, *a)

    def read_data(self: Any, *a: Any) -> Any:
        calls["read"] += 1
        calls["verified"].append(self.verified)  # CRC32s checked against the sidecar
        return real_read(self, *a)

    monkeypatch.setattr(FastPersistWriter, "write_data", write_data)
    monkeypatch.setattr(FastPersistReader, "read_data", read_data)
    try:
        fastpersist.dcp.install()
        saved = _titan_state(model, opt, sched)
        assert ck.save(curr_step=1)
        ck.maybe_wait_for_saving()
        step1 = tmp_path / "ckpt" / "step-1"
        names = os.listdir(step1)
        assert calls["write"] == 1
        assert [n for n in names if n.endswith(".crc32")], names
        assert all(re.fullmatch(r"__0_0\.[0-9a-f]{16}\.distcp", n) for n in names if n.endswith(".distcp")), names
        _titan_step(model, opt, sched, -3.0)  # training moves on
        assert not torch.equal(_titan_state(model, opt, sched)["model"]["norm.weight"], saved["model"]["norm.weight"])
        assert ck.load(step=1)
        assert calls["read"] == 1 and calls["verified"] == [True]
        assert_equal(_titan_state(model, opt, sched), saved)
    finally:
        fastpersist.dcp.uninstall()
    # stock behaviour again: DCP's own writer and reader, its own names
    saved = _titan_state(model, opt, sched)
    assert ck.save(curr_step=2)
    ck.maybe_wait_for_saving()
    names = os.listdir(tmp_path / "ckpt" / "step-2")
    assert sorted(names) == [".metadata", "__0_0.distcp"], names
    _titan_step(model, opt, sched, 2.0)
    assert ck.load(step=2)
    assert calls["write"] == 1 and calls["read"] == 1
    assert_equal(_titan_state(model, opt, sched), saved)
    ck.close()


# ---------------------------------------------------------------------------
# Regressions: what a reader takes without parsing, what an overwrite removes


def test_conjugate_and_negative_views_load_with_their_values(tmp_path):
    """Regression: a contiguous conj/neg view was written from its storage
    (the values before the lazy conjugation or negation) with a blob whose
    pickle carried the flag; FastPersistReader took the data as it lay and
    loaded -x and conj(conj(c)). Now the record holds the values shown."""
    x = torch.arange(1.0, 7.0)
    c = torch.complex(torch.arange(4.0), torch.arange(4.0) + 1)
    sd = {"neg": torch._neg_view(x), "conj": c.conj(), "plain": x.clone()}
    dcp.save(sd, storage_writer=FastPersistWriter(tmp_path))
    want = {k: v.resolve_conj().resolve_neg() for k, v in sd.items()}
    for reader in (FastPersistReader(tmp_path), dcp.FileSystemReader(tmp_path)):
        out = {k: torch.zeros_like(v) for k, v in want.items()}
        dcp.load(out, storage_reader=reader)
        assert_equal(out, want, type(reader).__name__)
    # A conjugate view as the destination gets the values, not their conjugates.
    dest = torch.zeros(4, dtype=torch.complex64).conj()
    dcp.load({"conj": dest}, storage_reader=FastPersistReader(tmp_path))
    assert torch.equal(dest.resolve_conj(), want["conj"])


def _damage_sidecar(path: Any, edit: Any) -> None:
    md = pickle.load(open(os.path.join(path, ".metadata"), "rb"))
    car = os.path.join(path, sidecar_name(md.storage_meta.save_id))
    doc = json.load(open(car))
    for entries in doc["files"].values():
        for e in entries:
            if e[3] >= 0:
                edit(e)
    with open(car, "w") as f:
        json.dump(doc, f)


def test_the_fast_path_checks_what_it_takes_from_the_sidecar_and_metadata(tmp_path):
    """Regression: the reader took an item's data where the sidecar said it
    lay, as the dtype the .metadata named, checking only the whole item's
    CRC32 (the same however the item is split): a sidecar whose data offset
    was off by 4 loaded shifted values, a .metadata naming int32 for a
    float32 tensor loaded its bits as integers, both without an error. Now a
    blob head unlike the one recorded is corrupt, and a dtype or shape unlike
    the blob's is read by parsing the blob (as the stock reader does)."""
    sd = {"w": torch.arange(16, dtype=torch.float32), "big": torch.randn(1 << 15)}
    shifted = tmp_path / "shifted"
    dcp.save(sd, storage_writer=FastPersistWriter(shifted))
    _damage_sidecar(shifted, lambda e: e.__setitem__(3, e[3] + 4))
    with raises(CorruptCheckpointError, "not the blob head the CRC32 sidecar recorded"):
        load(shifted, FastPersistReader(shifted), sd)

    retyped = tmp_path / "retyped"
    dcp.save(sd, storage_writer=FastPersistWriter(retyped))
    p = retyped / ".metadata"
    md = pickle.load(open(p, "rb"))
    m = md.state_dict_metadata["w"]
    m.properties = dataclasses.replace(m.properties, dtype=torch.int32)
    p.write_bytes(pickle.dumps(md))
    out = {"w": torch.zeros(16), "big": torch.zeros(1 << 15)}
    dcp.load(out, storage_reader=FastPersistReader(retyped))
    assert_equal(out, sd)


def test_an_item_the_sidecar_does_not_name_is_corrupt(tmp_path):
    """Regression: the reader looked an item's CRC32 up by its offset and
    read an item whose entry was missing unchecked (a sidecar and a
    .metadata that disagree: a damaged sidecar, or a .metadata not of the
    sidecar's save). With a sidecar of this module's, every item with
    bytes must have its entry; without verify it is read as before."""
    sd = state()
    dcp.save(sd, storage_writer=FastPersistWriter(tmp_path))
    md = pickle.load(open(tmp_path / ".metadata", "rb"))
    car = tmp_path / sidecar_name(md.storage_meta.save_id)
    doc = json.load(open(car))
    rel = next(iter(doc["files"]))
    doc["files"][rel] = [e for e in doc["files"][rel] if e[1] == 0] + [e for e in doc["files"][rel] if e[1]][1:]
    car.write_text(json.dumps(doc))
    with raises(CorruptCheckpointError, "has no CRC32 in the sidecar"):
        load(tmp_path, FastPersistReader(tmp_path), sd)
    assert_equal(load(tmp_path, FastPersistReader(tmp_path, verify=False), sd), sd)


def test_a_sidecar_of_version_1_is_read_by_parsing_each_blob(tmp_path):
    """Entries without a head CRC and kind (fastpersist's first sidecars)
    are still checked against their CRC32s; their data is taken by parsing."""
    sd = state()
    dcp.save(sd, storage_writer=FastPersistWriter(tmp_path))
    _damage_sidecar(tmp_path, lambda e: e.__delitem__(slice(5, None)))
    assert_equal(load(tmp_path, FastPersistReader(tmp_path), sd), sd)


def test_a_save_never_removes_files_another_committed_metadata_names(tmp_path):
    """Regression (found in review): a collective save's commit removed
    another save's data files older than the age gate by their names
    alone, also those a committed per-rank checkpoint in the same
    directory (``__0.metadata``, ``use_collectives=False``) named: that
    checkpoint no longer loaded. Files any committed metadata file of the
    directory names are now never removed."""
    from fastpersist.integrations import dcp as fdcp

    sd = state()
    dcp.save(sd, storage_writer=FastPersistWriter(tmp_path), no_dist=True)
    os.rename(tmp_path / ".metadata", tmp_path / "__0.metadata")  # a per-rank checkpoint's
    old = time.time() - fastpersist.options.ABANDONED_SAVE_AGE - 60
    for n in os.listdir(tmp_path):
        os.utime(tmp_path / n, (old, old))
    named = fdcp._referenced(str(tmp_path), "__0.metadata")[0]
    assert named
    dcp.save(sd, storage_writer=FastPersistWriter(tmp_path), no_dist=True)
    assert named <= set(os.listdir(tmp_path)), sorted(os.listdir(tmp_path))


def test_an_overwrite_removes_only_data_files_the_old_metadata_names(tmp_path):
    """Regression: the replaced checkpoint's .metadata was trusted for what
    to remove: a damaged one naming ``train.log`` and ``.metadata`` had the
    user's file and the .metadata just committed removed. Now only names
    data files have are removed; and the old .metadata is read without
    running anything it names (a class outside DCP's metadata: nothing is
    removed on its account)."""
    sd = {"a": torch.randn(8), "b": torch.randn(8)}
    d = tmp_path / "ck"
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(d))
    (d / "train.log").write_text("mine")
    p = d / ".metadata"
    md = pickle.load(open(p, "rb"))
    k1, k2 = list(md.storage_data)
    md.storage_data[k1] = dataclasses.replace(md.storage_data[k1], relative_path="train.log")
    md.storage_data[k2] = dataclasses.replace(md.storage_data[k2], relative_path=".metadata")
    p.write_bytes(pickle.dumps(md))
    dcp.save(sd, storage_writer=FastPersistWriter(d))
    assert (d / "train.log").read_text() == "mine"
    assert_equal(load(d, FastPersistReader(d), sd), sd)

    # A .metadata that would run code when unpickled is not unpickled.
    class Boom:
        def __reduce__(self):
            return (os.remove, (str(d / "train.log"),))

    ours = [n for n in os.listdir(d) if n.endswith(".distcp") and n.count(".") == 2]
    p.write_bytes(pickle.dumps({"storage_data": Boom()}))
    old = time.time() - fastpersist.options.ABANDONED_SAVE_AGE - 60
    for n in ours:
        os.utime(d / n, (old, old))
    dcp.save(sd, storage_writer=FastPersistWriter(d))
    assert (d / "train.log").read_text() == "mine"
    # this module's own data files of another save, untouched for
    # ABANDONED_SAVE_AGE, are found by name all the same
    assert ours and not set(ours) & set(os.listdir(d))
    assert_equal(load(d, FastPersistReader(d), sd), sd)


def _stack_global_call(module: str, name: str, *args: str) -> bytes:
    """A protocol-4 pickle that calls ``module.name(*args)`` (a dotted
    ``name`` reaches what the module imports)."""

    def s(b: str) -> bytes:
        raw = b.encode()
        return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE

    assert len(args) == 2
    return b"\x80\x04" + s(module) + s(name) + b"\x93" + s(args[0]) + s(args[1]) + b"\x86R."


@pytest.mark.parametrize(
    "module,name",
    [
        ("torch.distributed.checkpoint.filesystem", "io.FileIO"),  # a dotted name: any class the module imports
        ("torch.distributed.checkpoint.filesystem", "Path"),  # a class imported there, not DCP's own
        ("torch", "serialization.io.FileIO"),
    ],
)
def test_the_replaced_metadata_never_reaches_other_classes(tmp_path, module, name):
    """Regression: the old .metadata of a directory saved into again is read
    to learn which files it used, without running code; but any class
    reachable from a DCP module passed, dotted names (protocol 4) included:
    ``io.FileIO(path, "w")`` through DCP's filesystem module truncated any
    file the process could write. Only DCP's own records of data (its
    dataclasses and enums) and torch's dtypes pass now."""
    victim = tmp_path / "precious.txt"
    victim.write_text("precious user data\n")
    d = tmp_path / "ck"
    d.mkdir()
    (d / ".metadata").write_bytes(_stack_global_call(module, name, str(victim), "w"))
    sd = {"a": torch.randn(4)}
    dcp.save(sd, storage_writer=FastPersistWriter(d))
    assert victim.read_text() == "precious user data\n"
    assert_equal(load(d, FastPersistReader(d), sd), sd)


def test_the_replaced_metadata_names_only_this_modules_sidecars(tmp_path):
    """Regression: the sidecar of the replaced checkpoint was named from its
    .metadata's save_id, whatever it held, and removed: a save_id of
    ``notes`` removed the user's ``.fastpersist-notes.crc32``, and ``x/victim``
    with a link ``.fastpersist-x`` removed a file outside the checkpoint.
    Only names this module gives its sidecars are removed (or read)."""
    d, outside = tmp_path / "ck", tmp_path / "elsewhere"
    outside.mkdir()
    sd = {"a": torch.randn(8, 8)}
    dcp.save(sd, storage_writer=FastPersistWriter(d))
    (d / ".fastpersist-notes.crc32").write_text("user notes")
    (outside / "victim.crc32").write_text("precious")
    os.symlink(outside, d / ".fastpersist-x")
    for save_id in ("notes", "x/victim"):
        md = pickle.load(open(d / ".metadata", "rb"))
        md.storage_meta.save_id = save_id
        (d / ".metadata").write_bytes(pickle.dumps(md))
        assert_equal(load(d, FastPersistReader(d), sd), sd)  # no sidecar of ours: read unverified
        dcp.save(sd, storage_writer=FastPersistWriter(d))
    assert (d / ".fastpersist-notes.crc32").read_text() == "user notes"
    assert (outside / "victim.crc32").read_text() == "precious"
    assert_equal(load(d, FastPersistReader(d), sd), sd)


def test_a_tensor_past_its_storage_is_refused_before_it_is_read(tmp_path):
    """Regression: an item whose storage was resized under it was written
    (and staged) from past the storage's end: other memory in the
    checkpoint, or a crash for a large one."""
    t = torch.ones(1000)
    t.untyped_storage().resize_(8)
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException) as e:  # which carries the rank's traceback
        dcp.save({"a": t}, storage_writer=FastPersistWriter(tmp_path / "c"))
    assert "SerializationError: DCP item 'a': a (1000,) torch.float32 tensor needs 4000 bytes" in str(e.value)
    with pytest.raises(fastpersist.SerializationError, match="needs 4000 bytes"):
        FastPersistWriter(tmp_path / "s").stage({"a": t})


def _fail_metadata(monkeypatch):
    from fastpersist import _core

    real = _core.atomic_write

    def fail(path, data, **kw):
        if os.path.basename(path) == ".metadata":
            raise OSError(28, "No space left on device", path)
        return real(path, data, **kw)

    monkeypatch.setattr(_core, "atomic_write", fail)


@pytest.mark.parametrize("error", [KeyboardInterrupt, "durability"])
def test_an_error_after_the_metadata_is_renamed_in_keeps_the_new_checkpoint(tmp_path, monkeypatch, error):
    """Regression: an interrupt (Ctrl-C) that arrived once ``.metadata``
    was renamed in, but before the commit returned, ran the clean-up of a
    failed commit: it removed the data files and the sidecar that the
    committed metadata names, and the directory held a checkpoint that
    could not be read. A failed directory fsync is the same case."""
    from fastpersist import _core

    sd = {"w": torch.full((1000,), 1.0), "step": 1}
    dcp.save(sd, storage_writer=FastPersistWriter(tmp_path))
    real = _core.atomic_write

    def late(path, data, **kw):
        real(path, data, **kw)
        if os.path.basename(path) == ".metadata":
            if error == "durability":
                raise _core.DurabilityError(errno.EIO, "directory fsync failed", path)
            raise error()

    monkeypatch.setattr(_core, "atomic_write", late)
    sd2 = {"w": torch.full((1000,), 2.0), "step": 2}
    with raises(BaseException, "KeyboardInterrupt" if error is KeyboardInterrupt else "directory fsync failed"):
        dcp.save(sd2, storage_writer=FastPersistWriter(tmp_path))
    monkeypatch.undo()
    assert_equal(load(tmp_path, FastPersistReader(tmp_path), sd), sd2)
    assert_equal(load(tmp_path, dcp.FileSystemReader(tmp_path), sd), sd2)
    dcp.save(sd, storage_writer=FastPersistWriter(tmp_path))
    assert_equal(load(tmp_path, FastPersistReader(tmp_path), sd), sd)


def test_a_failed_fsync_after_the_sidecar_is_not_reported_as_a_commit(tmp_path, monkeypatch):
    """Regression: a DurabilityError from the sidecar's write (renamed in,
    its directory fsync failed) was raised as it came, which says that the
    new checkpoint is in place: ``.metadata`` had not been written, the
    previous checkpoint was the one there."""
    from fastpersist import _core

    sd = {"w": torch.full((1000,), 1.0), "step": 1}
    dcp.save(sd, storage_writer=FastPersistWriter(tmp_path))
    committed = sorted(os.listdir(tmp_path))
    real = _core.atomic_write

    def fsync_fails(path, data, **kw):
        real(path, data, **kw)
        if os.path.basename(path).endswith(".crc32"):
            raise _core.DurabilityError(errno.EIO, "directory fsync failed", path)

    monkeypatch.setattr(_core, "atomic_write", fsync_fails)
    with raises(fastpersist.WriteError, "the checkpoint was not committed: directory fsync failed"):
        dcp.save({"w": torch.full((1000,), 2.0), "step": 2}, storage_writer=FastPersistWriter(tmp_path))
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == committed
    assert_equal(load(tmp_path, FastPersistReader(tmp_path), sd), sd)


@pytest.mark.parametrize("how", ["writer used again", "plan caching"])
def test_a_later_save_never_writes_the_committed_checkpoints_files(tmp_path, monkeypatch, how):
    """Regression: the data files' names came from the writer's save_id,
    renewed only by reset(), which DCP calls only when given a
    checkpoint_id; and DefaultSavePlanner(enable_plan_caching=True) hands
    back the first save's plan, names included. Either way a second save
    renamed its data files over the committed checkpoint's before its own
    .metadata: when that save failed, the checkpoint read the new bytes
    (torch's reader), failed its CRCs (fastpersist's), or lost its files to
    the failure's clean-up. Every save now writes files of its own names."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    writer = FastPersistWriter(tmp_path, single_file_per_rank=False, thread_count=2)

    def save(sd):
        w = writer if how == "writer used again" else FastPersistWriter(tmp_path)
        planner = DefaultSavePlanner(enable_plan_caching=True) if how == "plan caching" else None
        dcp.save(sd, storage_writer=w, planner=planner)

    sd = {"w": torch.full((1000,), 1.0), "b": torch.arange(10), "step": 1}
    save(sd)
    committed = {n: os.stat(tmp_path / n).st_ino for n in os.listdir(tmp_path)}
    sd2 = {"w": torch.full((1000,), 2.0), "b": torch.arange(10) * 2, "step": 2}
    _fail_metadata(monkeypatch)
    with raises(OSError, "No space left"):
        save(sd2)
    monkeypatch.undo()
    assert {n: os.stat(tmp_path / n).st_ino for n in os.listdir(tmp_path)} == committed  # nothing else left
    assert_equal(load(tmp_path, FastPersistReader(tmp_path), sd), sd)
    assert_equal(load(tmp_path, dcp.FileSystemReader(tmp_path), sd), sd)
    save(sd2)
    save(sd2)
    assert not set(os.listdir(tmp_path)) & set(committed) - {".metadata"}
    assert_equal(load(tmp_path, FastPersistReader(tmp_path), sd2), sd2)


def test_a_save_never_removes_the_files_of_another_save_in_flight(tmp_path, monkeypatch):
    """Regression: a commit removed every data file and sidecar of this
    module's names but another save's tag, as leftovers of failed saves;
    two saves to one directory then removed each other's files, and the
    .metadata committed last named a file that was gone (both checkpoints
    lost). Such files are removed only once untouched for ABANDONED_SAVE_AGE; a
    failed commit removes its own files at once."""
    import fastpersist.integrations.dcp as fdcp

    a, b = {"w": torch.full((1000,), 1.0)}, {"w": torch.full((1000,), 2.0)}
    real = fdcp.FastPersistWriter.finish
    order = []

    def a_finishes_late(self, metadata, results):
        if not order:  # save A: written, not committed; save B runs whole now
            order.append("B")
            dcp.save(b, storage_writer=FastPersistWriter(tmp_path))
        order.append("A")
        return real(self, metadata, results)

    monkeypatch.setattr(fdcp.FastPersistWriter, "finish", a_finishes_late)
    dcp.save(a, storage_writer=FastPersistWriter(tmp_path))
    monkeypatch.undo()
    assert order == ["B", "A", "A"]
    assert_equal(load(tmp_path, FastPersistReader(tmp_path), a), a)  # the last commit wins, whole
    assert_equal(load(tmp_path, dcp.FileSystemReader(tmp_path), a), a)
    # B's files, younger than ABANDONED_SAVE_AGE, stay; once older, a save removes them.
    orphans = [n for n in os.listdir(tmp_path) if n not in fdcp._referenced(str(tmp_path), ".metadata")[0]]
    orphans = [n for n in orphans if n.endswith(".distcp")]
    assert len(orphans) == 1
    old = time.time() - fastpersist.options.ABANDONED_SAVE_AGE - 60
    for n in os.listdir(tmp_path):
        os.utime(tmp_path / n, (old, old))
    dcp.save(b, storage_writer=FastPersistWriter(tmp_path))
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".distcp")]) == 1
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".crc32")]) == 1
    assert_equal(load(tmp_path, FastPersistReader(tmp_path), b), b)


def test_an_empty_bytes_item_beside_a_tensor_reads_back(tmp_path):
    """Regression: the CRC sidecar is keyed by (file, offset); an empty
    bytes item takes no room, so the next item began at its offset, one
    entry replaced the other, and the read called a valid checkpoint
    corrupt ("sidecar and .metadata disagree on its size")."""
    from torch.distributed.checkpoint._nested_dict import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    class RawSave(DefaultSavePlanner):
        def transform_object(self, write_item, object):
            if write_item.type == WriteItemType.BYTE_IO and isinstance(object, bytes):
                return io.BytesIO(object)
            return super().transform_object(write_item, object)

    class RawLoad(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], value.read())

    for blobs in ({"blob": b""}, {"a": b"", "b": b"", "c": b"xyz"}):
        d = tmp_path / str(len(blobs))
        sd = {**blobs, "t": torch.arange(10.0)}
        dcp.save(sd, storage_writer=FastPersistWriter(d), planner=RawSave())
        for reader in (FastPersistReader(d), dcp.FileSystemReader(d)):
            out = {**dict.fromkeys(blobs), "t": torch.zeros(10)}
            dcp.load(out, storage_reader=reader, planner=RawLoad())
            assert out == {**blobs, "t": out["t"]} and torch.equal(out["t"], sd["t"])


def test_a_sidecar_entry_of_the_wrong_length_is_a_corrupt_checkpoint(tmp_path):
    """Regression: a sidecar entry cut short raised a bare IndexError from
    the read, naming nothing."""
    dcp.save({"t": torch.arange(5.0)}, storage_writer=FastPersistWriter(tmp_path))
    (sc,) = [p for p in tmp_path.iterdir() if p.name.endswith(".crc32")]
    doc = json.loads(sc.read_text())
    for cut in (1, 4, 6):
        bad = {**doc, "files": {rel: [e[:cut] for e in es] for rel, es in doc["files"].items()}}
        sc.write_text(json.dumps(bad))
        with raises(CorruptCheckpointError, "damaged CRC32 sidecar.*not 5 or 7 numbers"):
            dcp.load({"t": torch.zeros(5)}, storage_reader=FastPersistReader(tmp_path))


def test_two_read_items_of_one_saved_item_are_both_read(tmp_path):
    """Regression: every read of a file went into one engine call, which
    refuses overlapping ranges: a load reading one saved item twice (tied
    weights through a load planner; two local shards cut from one saved
    chunk) failed with "records overlap", where torch's reader loads it."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

    class Tied(DefaultLoadPlanner):
        def create_local_plan(self):
            plan = super().create_local_plan()
            extra = [
                dataclasses.replace(r, dest_index=MetadataIndex("head", r.dest_index.offset, r.dest_index.index))
                for r in plan.items
                if r.dest_index.fqn == "embed"
            ]
            assert all(isinstance(r, ReadItem) for r in extra)
            return LoadPlan(plan.items + extra)

        def lookup_tensor(self, index):
            return self.state_dict[index.fqn]

    for size in (10, 100_000):
        src = {"embed": torch.arange(float(size)), "other": torch.ones(7)}
        for writer in (FastPersistWriter(tmp_path), dcp.FileSystemWriter(tmp_path)):
            dcp.save(src, storage_writer=writer)
            for reader in (FastPersistReader(tmp_path), dcp.FileSystemReader(tmp_path)):
                out = {"embed": torch.zeros(size), "head": torch.zeros(size), "other": torch.zeros(7)}
                dcp.load(out, storage_reader=reader, planner=Tied(allow_partial_load=True))
                assert torch.equal(out["head"], src["embed"]) and torch.equal(out["embed"], src["embed"])
                assert torch.equal(out["other"], src["other"])


@pytest.mark.skipif(not hasattr(torch.Tensor, "has_names"), reason="this torch has no named tensors")
@pytest.mark.parametrize("how", ["save", "async stage"])
def test_named_tensors_are_refused_as_torch_refuses_them(tmp_path, how):
    """Regression: DCP's own writer refuses a named tensor (torch.save of
    the item); fastpersist's wrote its bytes without its names, and a load
    gave back an unnamed tensor."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: named tensors are experimental
        t = torch.zeros(2, 3, names=("a", "b"))
    if how == "save":
        with raises(RuntimeError, "Named tensors don't support serialization"):
            dcp.save({"t": t}, storage_writer=FastPersistWriter(tmp_path))
        assert not (tmp_path / ".metadata").exists()
    else:
        with pytest.raises(RuntimeError, match="Named tensors don't support serialization"):
            FastPersistWriter(tmp_path).stage({"t": t})
