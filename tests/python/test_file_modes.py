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


def _acl(*entries) -> bytes:
    """A POSIX access ACL as the kernel's ``system.posix_acl_access`` holds
    it: version 2, then (tag, perm, id) entries."""
    import struct

    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, perm, uid) for tag, perm, uid in entries)


_NO_ID = 0xFFFFFFFF
# user::rw- user:4321:rw- group::r-- mask::rw- other::---
_TEAM_ACL = _acl((0x01, 6, _NO_ID), (0x02, 6, 4321), (0x04, 4, _NO_ID), (0x10, 6, _NO_ID), (0x20, 0, _NO_ID))


@pytest.mark.parametrize("how", ["write", "safetensors", "pipelined", "snapshot", "patched torch.save"])
def test_a_replaced_file_keeps_its_user_attributes_and_acl_as_torch_save_keeps_them(tmp_path, how):
    """Regression: a save replacing a checkpoint wrote a new file and renamed
    it over the old one, which lost the old file's extended attributes:
    ``user.*`` tags and the access ACL (a teammate's access granted by
    ``setfacl``). torch.save writes in place and keeps both; the new file
    now gets them."""
    sd = {"w": torch.arange(1000.0)}
    ours, theirs = tmp_path / "ours.pt", tmp_path / "theirs.pt"
    for p in (ours, theirs):
        p.write_bytes(b"old")
        try:
            os.setxattr(p, "user.experiment", b"run-7")
            os.setxattr(p, "system.posix_acl_access", _TEAM_ACL)
        except OSError as e:
            pytest.skip(f"no user attributes or ACLs here: {e}")
    torch.save(sd, theirs)
    if how in ("write", "safetensors"):
        fastpersist.write_state_dict(sd, ours, format="safetensors" if how == "safetensors" else "torch")
    elif how == "patched torch.save":
        with fastpersist.patch():
            torch.save(sd, ours)
    else:
        fastpersist.save_async(sd, ours, mode=how).result(timeout=60)
    for p in (theirs, ours):
        assert os.getxattr(p, "user.experiment") == b"run-7", p
        assert os.getxattr(p, "system.posix_acl_access") == _TEAM_ACL, p
    assert _mode(ours) == _mode(theirs)


def test_a_replaced_link_gives_the_new_file_the_attributes_of_the_file_it_named(tmp_path):
    """Review: the mode and owner a replacing file keeps are the file a
    symbolic link at the target names; its extended attributes were read
    from the link itself (which has none). They come from the same file
    now."""
    real = tmp_path / "real.pt"
    real.write_bytes(b"old")
    try:
        os.setxattr(real, "user.experiment", b"run-9")
    except OSError as e:
        pytest.skip(f"no user attributes here: {e}")
    os.chmod(real, 0o640)
    link = tmp_path / "ours.pt"
    os.symlink(real.name, link)
    fastpersist.write_state_dict({"w": torch.ones(3)}, link)
    got = link if not link.is_symlink() else real
    assert os.getxattr(got, "user.experiment") == b"run-9"
    assert _mode(got) == 0o640
