"""The mode of committed files: a ``file_mode`` block reaches the threads of
background saves, and the adapters' safetensors saves leave what
safetensors leaves (a new file of its mode; links and special files to
safetensors itself)."""

from __future__ import annotations

import os
import stat

import fastpersist
import pytest
import torch
from fastpersist.integrations.common import BackgroundSaves, safe_save_file_via
from fastpersist.options import file_mode


def _mode(p) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


@pytest.mark.parametrize(
    "mode,fmt",
    [("pipelined", "torch"), ("snapshot", "torch"), ("pipelined", "safetensors"), ("snapshot", "safetensors")],
)
def test_a_background_save_keeps_the_callers_file_mode(tmp_path, mode, fmt):
    sd = {"a": torch.arange(1000.0), "b": torch.ones(3, dtype=torch.int8)}
    new, old = tmp_path / "new", tmp_path / "old"
    old.write_bytes(b"x")
    os.chmod(old, 0o644)
    with file_mode(0o600):
        futs = [fastpersist.save_async(sd, p, mode=mode, format=fmt) for p in (new, old)]
    for f in futs:
        f.result(timeout=60)
    assert _mode(new) == 0o600 and _mode(old) == 0o600
    # Outside the block, a replaced file keeps its mode and a save made
    # later on the same threads is not given the block's.
    os.chmod(old, 0o640)
    fastpersist.save_async(sd, old, mode=mode, format=fmt).result(timeout=60)
    assert _mode(old) == 0o640


def _safetensors_mode(tmp_path) -> int:
    from safetensors.torch import save_file

    save_file({"x": torch.ones(1)}, tmp_path / "probe")
    m = _mode(tmp_path / "probe")
    os.unlink(tmp_path / "probe")
    return m


@pytest.mark.parametrize("async_save", [True, False])
def test_adapters_safetensors_saves_leave_what_safetensors_leaves(tmp_path, async_save):
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    theirs = _safetensors_mode(tmp_path)
    saves = BackgroundSaves("snapshot", async_save=async_save)
    save_file = safe_save_file_via(saves)
    sd = {"w": torch.arange(12.0).reshape(3, 4)}
    try:
        replaced = tmp_path / "replaced.safetensors"
        replaced.write_bytes(b"old")
        os.chmod(replaced, 0o644)
        save_file(sd, tmp_path / "new.safetensors")
        save_file(sd, replaced, metadata={"format": "pt"})
        # A symlink at the path: safetensors replaces the link, never its target.
        target = tmp_path / "target"
        target.write_bytes(b"keep")
        (tmp_path / "link.safetensors").symlink_to(target)
        save_file(sd, tmp_path / "link.safetensors")
        saves.commit("c").result()
    finally:
        saves.close()
    assert saves.fallbacks == 1
    assert _mode(tmp_path / "new.safetensors") == theirs
    assert _mode(replaced) == theirs
    assert target.read_bytes() == b"keep"
    assert not os.path.islink(tmp_path / "link.safetensors")
    for name in ("new.safetensors", "replaced.safetensors", "link.safetensors"):
        assert torch.equal(load_file(tmp_path / name)["w"], sd["w"])
