"""The benchmarks' yardstick: how the fio limit is measured."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any, List

import pytest
from fastpersist import _core, bench

SHM = "/dev/shm"


def _fs_type(path: str) -> str:
    return subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True).stdout.strip()


def test_zero_filling_file_systems_are_told_apart(tmp_path):
    if _fs_type(SHM) != "tmpfs":
        pytest.skip("/dev/shm is not tmpfs here")
    assert _core.fallocate_zero_fills(SHM)
    assert bench.fio_allocates_as_it_writes(SHM)
    if _fs_type(str(tmp_path)) in ("ext2/ext3", "xfs", "btrfs"):
        assert not _core.fallocate_zero_fills(tmp_path)
        assert not bench.fio_allocates_as_it_writes(str(tmp_path))


def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(OSError) as e:
        _core.fallocate_zero_fills(tmp_path / "missing")
    assert e.value.errno == 2
    # The benchmark does not fail on it: it keeps fio's defaults.
    assert not bench.fio_allocates_as_it_writes(str(tmp_path / "missing"))


def _capture_fio(monkeypatch) -> List[List[str]]:
    calls: List[List[str]] = []

    def fake_run(args: List[str], **kw: Any) -> subprocess.CompletedProcess:
        calls.append(list(args))
        out = json.dumps({"jobs": [{"write": {"bw_bytes": 1e9}, "read": {"bw_bytes": 1e9}}]})
        return subprocess.CompletedProcess(args, 0, stdout=out, stderr="")

    monkeypatch.setattr(bench, "ensure_fio", lambda: "fio")
    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    return calls


def test_fio_allocates_as_it_writes_where_fallocate_zero_fills(monkeypatch, tmp_path):
    """On tmpfs fio's default preallocation zero-fills every page before
    its clock starts, so its timed write is an overwrite that no writer of
    a new file can match (5.5 against 2 GB/s here): the limit must time the
    allocation too."""
    if _fs_type(SHM) != "tmpfs":
        pytest.skip("/dev/shm is not tmpfs here")
    calls = _capture_fio(monkeypatch)
    assert bench.fio_run(SHM, 1 << 20, "write", "1M", 4) == 1.0
    assert "--fallocate=none" in calls[-1]
    lim = bench.Limit()
    lim.measure(SHM, 1 << 20)
    assert lim.as_dict()["fio_preallocates"] is False
    assert "without preallocation" in lim.note()


def test_fio_keeps_its_preallocation_elsewhere(monkeypatch, tmp_path):
    monkeypatch.setattr(bench._core, "fallocate_zero_fills", lambda p: False)
    calls = _capture_fio(monkeypatch)
    bench.fio_run(str(tmp_path), 1 << 20, "write", "1M", 4)
    assert not any(a.startswith("--fallocate") for a in calls[-1])
    lim = bench.Limit()
    lim.measure(str(tmp_path), 1 << 20)
    assert lim.as_dict()["fio_preallocates"] is True
    assert "preallocation" not in lim.note()
    assert not os.listdir(tmp_path)


def test_free_page_reporting_is_read_turned_off_and_set_back(tmp_path, monkeypatch):
    """The read benchmark's --keep-freed-memory: the kernel's free page
    reporting order is read, set above any block for the run (root), and set
    back after, also when the run fails; without root, or without
    reporting, nothing is written and the note says why."""
    from fastpersist import bench

    order = tmp_path / "page_reporting_order"
    assert bench.page_reporting_order(str(order)) is None  # no such parameter
    order.write_text("garbage\n")
    assert bench.page_reporting_order(str(order)) is None
    order.write_text("11\n")
    assert bench.page_reporting_order(str(order)) is None and bench.free_page_reporting_note(str(order)) == ""
    order.write_text("9\n")
    assert bench.page_reporting_order(str(order)) == 9
    assert "order 9" in bench.free_page_reporting_note(str(order))

    monkeypatch.setattr(bench.os, "geteuid", lambda: 0)
    with pytest.raises(RuntimeError, match="a failed run"):
        with bench.FreedMemoryKept(str(order)) as kept:
            assert order.read_text().strip() == "11" and "turned off" in kept.note
            raise RuntimeError("a failed run")
    assert order.read_text().strip() == "9"

    monkeypatch.setattr(bench.os, "geteuid", lambda: 1000)
    with bench.FreedMemoryKept(str(order)) as kept:
        assert order.read_text().strip() == "9" and "not root" in kept.note
    order.write_text("11\n")
    monkeypatch.setattr(bench.os, "geteuid", lambda: 0)
    with bench.FreedMemoryKept(str(order)) as kept:
        assert "no free page reporting" in kept.note
    assert order.read_text().strip() == "11"


def test_timed_frees_the_result_after_the_clock_stops(monkeypatch):
    """A reader's result (gigabytes of new storages) is freed after its time
    is taken, not inside it: freeing is not reading, and a caller keeps
    what it read."""
    from fastpersist import bench

    clock = []
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock.append("tick") or float(len(clock)))

    class Result:
        def __del__(self) -> None:
            clock.append("freed")

    assert bench.timed(Result) == 1.0
    assert clock == ["tick", "tick", "freed"]


def test_freed_memory_is_kept_by_default_only_as_root(tmp_path, monkeypatch):
    """The read and DCP benchmarks turn free page reporting off for their
    run where they are root, unless told not to; told to, they try anywhere
    (and say why not)."""
    from fastpersist import bench

    order = tmp_path / "page_reporting_order"
    order.write_text("9\n")
    monkeypatch.setattr(bench.os, "geteuid", lambda: 0)
    with bench.freed_memory(None, str(order)) as kept:
        assert order.read_text().strip() == "11" and "turned off" in kept.note
    assert order.read_text().strip() == "9"
    with bench.freed_memory(False, str(order)) as kept:
        assert order.read_text().strip() == "9" and "order 9" in kept.note
    monkeypatch.setattr(bench.os, "geteuid", lambda: 1000)
    with bench.freed_memory(None, str(order)) as kept:
        assert order.read_text().strip() == "9" and "--keep-freed-memory" in kept.note
    with bench.freed_memory(True, str(order)) as kept:
        assert order.read_text().strip() == "9" and "not root" in kept.note


def test_warm_memory_holds_all_of_it_at_once(monkeypatch):
    """Warming fills every chunk while all are alive (freed and refilled
    chunks would warm one chunk's pages only)."""
    from fastpersist import bench

    alive, peak = [], []
    real = bench.torch.UntypedStorage

    class Counted:
        def __init__(self, n: int) -> None:
            self.st = real(n)
            alive.append(n)
            peak.append(sum(alive))

        def nbytes(self) -> int:
            return self.st.nbytes()

        def __del__(self) -> None:
            alive.remove(self.st.nbytes())

    monkeypatch.setattr(bench.torch, "UntypedStorage", Counted)
    monkeypatch.setattr(bench.torch, "ByteTensor", lambda st: bench.torch.zeros(1))  # filled: not what is counted
    bench.warm_memory(10 << 10, chunk=4 << 10)
    assert max(peak) == 10 << 10 and not alive


def test_fio_reads_an_existing_file_read_only_and_leaves_it(monkeypatch, tmp_path):
    """The read benchmark's second limit: fio reads the checkpoint itself
    (the very blocks a reader reads), read-only, and never writes, lays out
    or removes it; a file shorter than one block is not measured."""
    calls = _capture_fio(monkeypatch)
    monkeypatch.setattr(bench._HUGE, "path", lambda: None)  # no hugetlbfs set-up in a test
    f = tmp_path / "ckpt.pt"
    f.write_bytes(b"x" * (3 << 20))
    assert bench.fio_read_file(str(f), "1M", 4) == 1.0
    (cmd,) = calls
    assert "--readonly" in cmd and "--rw=read" in cmd
    assert f"--filename={f}" in cmd and "--size=3145728" in cmd
    assert not any(a.startswith(("--rw=write", "--fallocate")) for a in cmd)
    assert f.read_bytes() == b"x" * (3 << 20) and os.listdir(tmp_path) == ["ckpt.pt"]
    assert bench.fio_read_file(str(f), "4M", 16) is None and len(calls) == 1
    runs = bench.fio_read_file_limits(str(f))
    # Huge pages unavailable, and 4 MiB blocks longer than the file.
    assert list(runs) == [bench.fio_config_name("1M", 32, False)]
    assert all("--readonly" in c for c in calls)
