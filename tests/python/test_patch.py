"""fastpersist.patch(): torch.save/torch.load and safetensors' save_file/load_file
routed through fastpersist, checked against real calls of both libraries."""

from __future__ import annotations

import inspect
import io
import os
import pickle
import struct
import zipfile
from pathlib import Path

import fastpersist
import pytest
import torch
from helpers import assert_same, make, written_by_fastpersist

safetensors_torch = pytest.importorskip("safetensors.torch")

# The originals, bound before any patch (as "from torch import save" would be).
SAVE, LOAD = torch.save, torch.load
SAVE_FILE, LOAD_FILE = safetensors_torch.save_file, safetensors_torch.load_file
TORCH_READS_SAFETENSORS = ".safetensors" in inspect.getsource(LOAD)


@pytest.fixture(autouse=True)
def no_patch_left():
    yield
    assert torch.save is SAVE and torch.serialization.save is SAVE
    assert torch.load is LOAD and torch.serialization.load is LOAD
    assert safetensors_torch.save_file is SAVE_FILE and safetensors_torch.load_file is LOAD_FILE


def state() -> dict:
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    base = make((6, 5), torch.float32, 1)
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "views": [base, base[2:4], base.t()],  # one storage
        "half": make((7,), torch.bfloat16, 2),
        "step": 12,
        "name": "run",
    }


def ours_wrote(path) -> bool:
    """fastpersist wrote it (its content-derived serialization id)."""
    return written_by_fastpersist(path)


def test_torch_save_and_load_are_routed(tmp_path):
    sd = state()
    SAVE(sd, tmp_path / "torch.pt")
    with fastpersist.patch() as stats:
        torch.save(sd, tmp_path / "fp.pt")
        got_torch_file = torch.load(tmp_path / "torch.pt")
        got_fp_file = torch.serialization.load(str(tmp_path / "fp.pt"), map_location="cpu")
    assert stats.routed_calls == {"torch.save": 1, "torch.load": 2} and stats.fallbacks == 0, stats
    assert ours_wrote(tmp_path / "fp.pt") and not ours_wrote(tmp_path / "torch.pt")
    ref = LOAD(tmp_path / "torch.pt")
    assert_same(LOAD(tmp_path / "fp.pt"), ref)  # the original reads a routed save
    assert_same(got_torch_file, ref)
    assert_same(got_fp_file, ref)
    views = got_fp_file["views"]
    assert views[1].untyped_storage().data_ptr() == views[0].untyped_storage().data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(views, sd["views"]))
    assert type(got_fp_file["optim"]["state"][0]["exp_avg"]) is torch.Tensor


def test_map_location_and_weights_only_as_torch(tmp_path):
    SAVE({"t": make((4,), torch.float32), "n": 3}, tmp_path / "a.pt")
    for loc in (None, "cpu", torch.device("cpu"), {"cpu": "cpu"}, lambda s, _: s):
        with fastpersist.patch() as stats:
            got = torch.load(tmp_path / "a.pt", map_location=loc)
        assert stats.routed == 1
        assert_same(got, LOAD(tmp_path / "a.pt", map_location=loc))

    # An object weights_only refuses: refused the same way by default, loaded with weights_only=False.
    SAVE({"obj": Thing(5)}, tmp_path / "obj.pt")
    try:
        LOAD(tmp_path / "obj.pt")
        expected = None
    except Exception as e:  # noqa: BLE001 - torch's own refusal, whatever this version raises
        expected = type(e)
    with fastpersist.patch() as stats:
        if expected is None:
            assert torch.load(tmp_path / "obj.pt")["obj"].v == 5
        else:
            with pytest.raises(expected):
                torch.load(tmp_path / "obj.pt")
        assert torch.load(tmp_path / "obj.pt", weights_only=False)["obj"].v == 5
    assert stats.routed == 2


class Thing:
    def __init__(self, v: int) -> None:
        self.v = v


class _PickleLike:
    """A custom pickle module (what dill would be)."""

    Pickler = pickle.Pickler
    Unpickler = pickle.Unpickler
    load = staticmethod(pickle.load)
    loads = staticmethod(pickle.loads)
    dump = staticmethod(pickle.dump)
    __name__ = "pickle_like"


def test_what_fastpersist_does_not_carry_out_falls_back(tmp_path):
    sd = {"t": make((5,), torch.float32), "k": "v"}
    SAVE(sd, tmp_path / "zip.pt")
    with fastpersist.patch() as stats:
        buf = io.BytesIO()
        torch.save(sd, buf)  # a file object
        assert_same(LOAD(io.BytesIO(buf.getvalue())), sd)
        assert_same(torch.load(io.BytesIO(buf.getvalue())), sd)
        torch.save(sd, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
        assert_same(torch.load(tmp_path / "legacy.pt"), sd)  # not a zip: torch's legacy reader
        torch.save(sd, tmp_path / "p4.pt", pickle_protocol=4)
        torch.save(sd, tmp_path / "custom.pt", pickle_module=_PickleLike)
        assert_same(torch.load(tmp_path / "custom.pt", pickle_module=_PickleLike, weights_only=False), sd)
        mapped = torch.load(tmp_path / "zip.pt", mmap=True)
        assert_same(mapped, sd)
        assert_same(torch.load(tmp_path / "zip.pt", weights_only=False, encoding="latin1"), sd)
        torch.save(sd, str(tmp_path / "explicit.pt"), pickle_module=pickle, pickle_protocol=2)  # the defaults
    reasons = " | ".join(stats.reasons)
    for why in (
        "a file object",
        "_use_new_zipfile_serialization=False",
        "pickle_protocol=4",
        "pickle_module=",
        "mmap=True",
    ):
        assert why in reasons, (why, reasons)
    assert "encoding" in reasons and "not a torch zip file" in reasons
    assert stats.routed_calls == {"torch.save": 1}, stats  # only the call with explicit defaults
    assert stats.fallback_calls == {"torch.save": 4, "torch.load": 5}, stats
    assert_same(LOAD(tmp_path / "p4.pt", weights_only=False), sd)
    assert not ours_wrote(tmp_path / "p4.pt") and ours_wrote(tmp_path / "explicit.pt")


def test_torch_errors_stay_torch_errors(tmp_path):
    with fastpersist.patch() as stats:
        with pytest.raises(RuntimeError, match="does not exist"):
            torch.save({"a": 1}, tmp_path / "missing" / "x.pt")
        with pytest.raises(FileNotFoundError):
            torch.load(tmp_path / "nothing.pt")
        with pytest.raises(RuntimeError):
            torch.save({"a": 1}, tmp_path)  # a directory
        with pytest.raises(TypeError):
            torch.save({"a": 1})  # a missing argument: the original's TypeError
    assert stats.routed == 0 and stats.fallbacks == 4


@pytest.mark.filterwarnings("ignore::FutureWarning")  # TorchScript is deprecated in newer torch
def test_torchscript_archive_goes_to_torch(tmp_path):
    m = torch.jit.script(torch.nn.Linear(2, 2))
    torch.jit.save(m, str(tmp_path / "ts.pt"))
    with fastpersist.patch() as stats, pytest.warns(UserWarning, match="TorchScript"):
        got = torch.load(tmp_path / "ts.pt", weights_only=False)
    assert isinstance(got, torch.jit.ScriptModule)
    assert stats.fallback_calls == {"torch.load": 1} and "TorchScript" in " ".join(stats.reasons)


def test_objects_fastpersist_refuses_are_saved_by_torch(tmp_path):
    sd = {"m": torch.empty(3, device="meta"), "t": torch.ones(2)}
    with fastpersist.patch() as stats:
        torch.save(sd, tmp_path / "meta.pt")
    assert stats.routed + stats.fallbacks == 1
    got = LOAD(tmp_path / "meta.pt")
    assert got["m"].device.type == "meta" and got["m"].shape == (3,) and torch.equal(got["t"], sd["t"])


def test_safetensors_save_file_and_load_file_are_routed(tmp_path):
    sd = {
        "w": make((16, 8), torch.bfloat16),
        "b": make((8,), torch.float32, 1),
        "i": make((3,), torch.int64, 2),
        "e": torch.empty(0, 2),
    }
    SAVE_FILE(sd, tmp_path / "st.safetensors", metadata={"k": "v"})
    # A file safetensors saved before (mode 0600): the new one fastpersist
    # gives its place ends as safetensors' would (a new file it would not).
    SAVE_FILE({}, tmp_path / "fp.safetensors")
    with fastpersist.patch() as stats:
        safetensors_torch.save_file(sd, tmp_path / "fp.safetensors", metadata={"k": "v"})
        got_st = safetensors_torch.load_file(tmp_path / "st.safetensors")
        got_fp = safetensors_torch.load_file(str(tmp_path / "fp.safetensors"), device="cpu")
        # Newer torch hands *.safetensors paths to load_file itself.
        via_torch = torch.load(tmp_path / "st.safetensors") if TORCH_READS_SAFETENSORS else None
    ref = LOAD_FILE(tmp_path / "st.safetensors")
    assert_same(got_st, ref)
    assert list(got_st) == list(ref)  # in file order, as safetensors gives them
    assert_same(got_fp, ref)
    assert_same(LOAD_FILE(tmp_path / "fp.safetensors"), ref)
    assert all(type(t) is torch.Tensor for t in got_fp.values())
    raw_st, raw_fp = (open(tmp_path / f"{n}.safetensors", "rb").read() for n in ("st", "fp"))
    (n_st,), (n_fp,) = struct.unpack("<Q", raw_st[:8]), struct.unpack("<Q", raw_fp[:8])
    assert (8 + n_fp) % 4096 == 0 and raw_fp[8 + n_fp :] == raw_st[8 + n_st :]
    assert raw_fp[8 : 8 + n_fp].rstrip(b" ") == raw_st[8 : 8 + n_st].rstrip(b" ")
    assert stats.routed_calls["safetensors.torch.save_file"] == 1
    assert stats.routed_calls["safetensors.torch.load_file"] == (3 if via_torch is not None else 2)
    if via_torch is not None:
        assert_same(via_torch, ref)


def test_safetensors_refusals_are_safetensors_own(tmp_path):
    base = torch.ones(4, 4)
    cases = [
        ({"t": base.t()}, None, ValueError, "non contiguous"),
        ({"a": base, "b": base[0]}, None, RuntimeError, "share memory"),
        ({"a": base}, {"k": 1}, TypeError, None),
        ({"a": 1}, None, ValueError, "expected torch.Tensor"),
    ]
    with fastpersist.patch() as stats:
        for sd, meta, exc, match in cases:
            with pytest.raises(exc, match=match):
                safetensors_torch.save_file(sd, tmp_path / "x.safetensors", metadata=meta)
        SAVE({"a": base}, tmp_path / "zip.pt")
        with pytest.raises(Exception) as e:  # noqa: B017 - safetensors' own error for a zip file
            safetensors_torch.load_file(tmp_path / "zip.pt")
        assert type(e.value).__module__.startswith("safetensors") or "header" in str(e.value).lower()
    assert stats.routed == 0 and stats.fallbacks == len(cases) + 1
    assert not (tmp_path / "x.safetensors").exists()


def test_function_form_nesting_and_exceptions(tmp_path):
    p = fastpersist.patch()
    assert p.active and torch.save is not SAVE and torch.save is torch.serialization.save
    with fastpersist.patch() as inner:
        torch.save({"a": torch.ones(1)}, tmp_path / "a.pt")
    assert torch.save is not SAVE  # the outer patch is still active
    torch.save({"a": torch.ones(1)}, tmp_path / "b.pt")
    assert inner.routed == 1 and p.stats.routed == 2
    p.undo()
    p.undo()  # again: nothing
    assert torch.save is SAVE and not p.active
    with pytest.raises(KeyError):
        with fastpersist.patch():
            raise KeyError("boom")
    assert torch.save is SAVE
    # Ended out of order.
    a, b = fastpersist.patch(), fastpersist.patch()
    a.undo()
    assert torch.save is not SAVE
    b.undo()
    assert "undone" in repr(b)
    with pytest.raises(ValueError, match="queue_depth"):
        fastpersist.patch(queue_depth=-1)


def test_names_bound_before_the_patch_are_not_affected(tmp_path):
    from torch import save as bound

    with fastpersist.patch() as stats:
        bound({"a": torch.ones(1)}, tmp_path / "a.pt")
    assert stats.routed == stats.fallbacks == 0 and not ours_wrote(tmp_path / "a.pt")


class _SavesWhilePickled:
    """Pickling it calls torch.save (a nested call during a routed save)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        torch.save({"inner": torch.ones(2)}, self.path)
        return (_SavesWhilePickled, (self.path,))


def test_calls_made_while_routing_go_to_the_originals(tmp_path):
    inner = str(tmp_path / "inner.pt")
    with fastpersist.patch() as stats:
        torch.save({"x": _SavesWhilePickled(inner), "t": torch.zeros(3)}, tmp_path / "outer.pt")
    assert stats.routed_calls == {"torch.save": 1} and stats.fallbacks == 0
    assert ours_wrote(tmp_path / "outer.pt") and not ours_wrote(inner)
    assert torch.equal(LOAD(inner)["inner"], torch.ones(2))
    assert LOAD(tmp_path / "outer.pt", weights_only=False)["x"].path == inner


def test_torch_save_is_routed_only_where_its_storage_alignment_divides_fastpersists(tmp_path):
    """torch.save aligns storage records to ``config.save.storage_alignment``
    (64 by default); fastpersist's are 64-aligned, which serves any
    alignment dividing 64. A larger one (page alignment for mmap users) is
    left to torch.save, which writes it."""
    ser = pytest.importorskip("torch.utils.serialization")
    save_cfg = ser.config.save
    sd = {"t": make((300,), torch.float32), "u": make((7,), torch.int16)}
    old = save_cfg.storage_alignment
    try:
        for align, routed in ((64, True), (32, True), (4096, False)):
            save_cfg.storage_alignment = align
            p = tmp_path / f"a{align}.pt"
            with fastpersist.patch() as stats:
                torch.save(sd, p)
            assert ours_wrote(p) == routed, align
            assert stats.routed_calls.get("torch.save", 0) == int(routed), stats
            with zipfile.ZipFile(p) as z:
                (name,) = [n for n in z.namelist() if n.endswith("/.storage_alignment")]
                assert z.read(name) == str(64 if routed else align).encode()
            assert_same(torch.load(p), sd)
    finally:
        save_cfg.storage_alignment = old


def test_dotdot_after_a_symlink_saves_where_torch_saves(tmp_path, monkeypatch):
    """Regression: ``link/../x.pt`` (``link`` to a directory elsewhere) was
    resolved as text first (``..`` dropping ``link``), so fastpersist (and
    torch.save under the patch) wrote ``./x.pt``, where the kernel, and
    torch.save, write beside the link's target; ``missing/../x.pt`` was
    written where torch.save raises."""
    (tmp_path / "work").mkdir()
    (tmp_path / "elsewhere" / "deep").mkdir(parents=True)
    os.symlink(tmp_path / "elsewhere" / "deep", tmp_path / "work" / "link")
    monkeypatch.chdir(tmp_path / "work")
    sd = {"t": torch.ones(2)}
    torch.save(sd, "link/../by_torch.pt")
    fastpersist.write_state_dict(sd, "link/../by_fastpersist.pt")
    fastpersist.save_async(sd, "link/../by_async.pt").result()
    with fastpersist.patch() as stats:
        torch.save(sd, "link/../by_patch.pt")
        assert torch.equal(torch.load("link/../by_torch.pt")["t"], sd["t"])
    assert stats.routed_calls["torch.save"] == 1
    assert sorted(os.listdir(tmp_path / "elsewhere")) == [
        "by_async.pt",
        "by_fastpersist.pt",
        "by_patch.pt",
        "by_torch.pt",
        "deep",
    ]
    assert sorted(os.listdir(tmp_path / "work")) == ["link"]
    with pytest.raises(RuntimeError):
        torch.save(sd, "missing/../x.pt")
    with pytest.raises(fastpersist.WriteError):
        fastpersist.write_state_dict(sd, "missing/../x.pt")
    with fastpersist.patch():
        with pytest.raises(RuntimeError):
            torch.save(sd, "missing/../x.pt")
    assert not os.path.exists("x.pt")


@pytest.mark.parametrize("target", ["/dev/full", "name-too-long", "empty", "trailing-separator"])
@pytest.mark.parametrize("fn", ["torch.save", "save_file"])
def test_failures_under_the_patch_are_of_the_class_the_original_raises(tmp_path, target, fn):
    """Regression: under the patch, a routed save's I/O failure (ENOSPC,
    ENAMETOOLONG) raised fastpersist's WriteError, an OSError, where
    torch.save raises a RuntimeError and safetensors a SafetensorError, so
    ``except RuntimeError`` around torch.save stopped catching it; an empty
    path or one ending in a separator raised ValueError."""
    from helpers import full_device
    from safetensors.torch import save_file

    path = {
        "/dev/full": full_device(tmp_path) if target == "/dev/full" else "",
        "name-too-long": str(tmp_path / ("x" * 300)),
        "empty": "",
        "trailing-separator": str(tmp_path / "x.pt") + os.sep,
    }[target]
    if target == "/dev/full" and fn == "save_file":
        # safetensors 0.8 writes a temporary file and renames it over the
        # target: as root, it would replace the device with a regular file.
        pytest.skip("safetensors replaces a device instead of writing it")
    sd = {"a": torch.ones(300_000)}

    def call():
        if fn == "torch.save":
            torch.save(sd, path)
        else:
            save_file(sd, path)

    try:
        call()
    except Exception as e:  # noqa: BLE001 - its class is the point
        want = e
    else:
        pytest.skip(f"{fn} does not fail here")
    with fastpersist.patch():
        with pytest.raises(Exception) as got:
            call()
    assert isinstance(got.value, type(want)), (type(got.value).__mro__, type(want))


def _outcome(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - its class and message are the point
        return e


@pytest.mark.filterwarnings("ignore")
def test_load_file_devices_safetensors_refuses_go_to_safetensors(tmp_path):
    """Regression: the patched load_file loaded with device values
    safetensors refuses with a SafetensorError ("device ... is invalid"):
    torch.device("cpu") gave tensors and "cpu:0" torch's RuntimeError. Only
    the spellings the installed safetensors accepts and fastpersist gives
    the same for ("cpu", a CUDA device torch has) are routed; anything else
    goes to load_file, which gives its own result or error."""
    path = tmp_path / "m.safetensors"
    SAVE_FILE({"w": torch.arange(3.0)}, path)
    devices = [torch.device("cpu"), "cpu:0", "cpu:1", "CPU", " cpu", "cpu:", -1, 2**70, 1.5, b"cpu", "meta"]
    devices += ["cuda", "cuda:0", "cuda:+0", "cuda:00", "cuda:-1", "cuda: 0", 0, True, torch.device("cuda"), None]
    for device in devices:
        want = _outcome(lambda: LOAD_FILE(path, device=device))
        with fastpersist.patch() as stats:
            got = _outcome(lambda: safetensors_torch.load_file(path, device=device))
        assert type(got) is type(want), (device, got, want)
        if isinstance(want, Exception):
            assert str(got) == str(want), device
            assert stats.routed == 0, device
        else:
            assert_same(got, want)
            assert {t.device for t in got.values()} == {t.device for t in want.values()}, device
    with fastpersist.patch() as stats:
        assert_same(safetensors_torch.load_file(path, device="cpu"), LOAD_FILE(path))
    assert stats.routed == 1


def _tree(d) -> dict:
    """What is in ``d``: links by their text, files by kind, mode, owner,
    links and what load_file reads from them (or their bytes)."""
    import stat

    out = {}
    for root, dirs, files in os.walk(d):
        for n in dirs + files:
            p = os.path.join(root, n)
            s = os.lstat(p)
            if stat.S_ISLNK(s.st_mode):
                out[os.path.relpath(p, d)] = ("link", os.readlink(p))
            elif stat.S_ISREG(s.st_mode):
                try:
                    content = {k: v.tolist() for k, v in LOAD_FILE(p).items()}
                except Exception:  # noqa: BLE001 - not a safetensors file
                    content = open(p, "rb").read()
                out[os.path.relpath(p, d)] = (stat.filemode(s.st_mode), s.st_uid, s.st_gid, s.st_nlink, content)
            else:
                out[os.path.relpath(p, d)] = (stat.filemode(s.st_mode), s.st_uid, s.st_gid)
    return dict(sorted(out.items()))


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_save_file_leaves_its_path_as_safetensors_leaves_it(tmp_path, umask):
    """Regression: the patched save_file treated its path as torch.save
    does where safetensors 0.8 writes a new file (mode 0600) and renames it
    onto the path: a new file got 0644 from the umask, an existing one kept
    its mode, a symlink was written through (its target, maybe in another
    directory, replaced) and a dangling one or a loop raised WriteError.
    Now whatever save_file leaves at its path, file or link, mode, owner
    and links, the patched one leaves too: new and regular files are
    fastpersist's, committed with save_file's mode (options.file_mode), and
    links go to save_file."""
    old = os.umask(umask)
    try:
        trees = {}
        for mode in ("original", "patched"):
            d = tmp_path / mode
            (d / "shared").mkdir(parents=True)
            (d / "shared" / "model.safetensors").write_text("old")
            for name, target in [("link", "shared/model.safetensors"), ("dangling", "missing/x"), ("loop", "loop.st")]:
                os.symlink(target, d / f"{name}.st")
            for name, m in [("mine", 0o600), ("wide", 0o644), ("odd", 0o4640)]:
                (d / f"{name}.st").write_text("old")
                os.chmod(d / f"{name}.st", m)
            os.link(d / "mine.st", d / "mine-too")
            if os.geteuid() == 0:
                (d / "theirs.st").write_text("old")
                os.chmod(d / "theirs.st", 0o600)
                os.chown(d / "theirs.st", 1234, 4321)
            names = ["new.st", "link.st", "dangling.st", "loop.st", "mine.st", "wide.st", "odd.st"]
            names += ["theirs.st"] if os.geteuid() == 0 else []
            with fastpersist.patch() as stats:
                for name in names:
                    sd = {"w": torch.arange(3.0) + len(name)}
                    if mode == "original":
                        SAVE_FILE(sd, d / name)
                    else:
                        safetensors_torch.save_file(sd, d / name)
            trees[mode] = _tree(d)
            if mode == "patched":
                # A new file, or a regular one replaced, whatever its mode,
                # owner or links, is fastpersist's, given save_file's mode;
                # links are safetensors' own.
                assert stats.routed_calls["safetensors.torch.save_file"] == len(names) - 3, stats
        assert trees["patched"] == trees["original"]
    finally:
        os.umask(old)


def test_torch_save_keeps_what_torchs_in_place_write_keeps(tmp_path):
    """Regression: the patched torch.save replaced the file by rename where
    torch.save writes it in place: a hard link to it kept the old content
    (torch's write is seen through every name), and the file's owner, group
    and setuid/setgid/sticky bits were lost. A file with other links goes
    to torch.save; the owner, group and mode are kept."""
    import stat

    results = {}
    for mode in ("original", "patched"):
        d = tmp_path / mode
        d.mkdir()
        linked, owned = d / "linked.pt", d / "owned.pt"
        for p in (linked, owned):
            p.write_text("old")
        os.link(linked, d / "latest.pt")
        os.chmod(owned, 0o2664 if os.geteuid() == 0 else 0o640)
        if os.geteuid() == 0:
            os.chown(owned, 1234, 4321)
            os.chmod(owned, 0o6664)  # chown clears setuid and setgid
        with fastpersist.patch() as stats:
            for p in (linked, owned):
                (SAVE if mode == "original" else torch.save)({"w": torch.ones(2)}, p)
        s = os.stat(owned)
        results[mode] = (
            LOAD(d / "latest.pt"),
            os.stat(linked).st_nlink,
            (s.st_uid, s.st_gid, stat.S_IMODE(s.st_mode)),
            LOAD(owned),
        )
        if mode == "patched":
            assert stats.fallback_calls["torch.save"] == 1 and stats.routed_calls["torch.save"] == 1, stats
            assert ours_wrote(owned)
    assert_same(results["patched"][0], results["original"][0])
    assert results["patched"][1:3] == results["original"][1:3]
    assert_same(results["patched"][3], results["original"][3])


@pytest.mark.skipif(os.geteuid() != 0, reason="drops to another user: needs root")
def test_torch_save_writes_in_place_where_no_file_can_be_made(tmp_path):
    """Regression: a writable file in a directory the user cannot write:
    torch.save writes it in place, the patched torch.save failed making its
    temporary file there (WriteError). A file the user cannot write is
    torch.save's error too, where the patched one replaced it."""
    import shutil
    import tempfile

    tmp_path = tempfile.mkdtemp()  # pytest's own is root's alone (0700)
    try:
        _in_place_as_nobody(Path(tmp_path))
    finally:
        shutil.rmtree(tmp_path)


def _in_place_as_nobody(tmp_path):
    import subprocess
    import sys
    import textwrap

    os.chmod(tmp_path, 0o755)
    for name in ("mine.pt", "root.pt"):
        (tmp_path / name).write_text("old")
        os.chmod(tmp_path / name, 0o644)
    os.chown(tmp_path / "mine.pt", 65534, 65534)
    script = textwrap.dedent(
        f"""
        import io, os, torch, fastpersist
        SAVE = torch.save
        warm = os.path.join({str(tmp_path)!r}, "warm", "x.pt")
        os.mkdir(os.path.dirname(warm))
        with fastpersist.patch():  # lazy imports, while the files (root's home) can be read
            torch.save({{"w": torch.ones(2)}}, io.BytesIO())
            torch.save({{"w": torch.ones(2)}}, warm)
            torch.load(warm)
        os.setgid(65534); os.setuid(65534)
        out = []
        for name in ("mine.pt", "root.pt"):
            with fastpersist.patch() as stats:
                try:
                    torch.save({{"w": torch.ones(2)}}, os.path.join({str(tmp_path)!r}, name))
                    out.append("ok")
                except Exception as e:
                    out.append(type(e).__name__)
            out.append(stats.fallbacks)
        try:
            SAVE({{"w": torch.ones(2)}}, os.path.join({str(tmp_path)!r}, "root.pt"))
        except Exception as e:
            out.append(type(e).__name__)
        print(out)
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[-2] == "['ok', 1, 'RuntimeError', 1, 'RuntimeError']", run.stdout
    assert_same(LOAD(tmp_path / "mine.pt"), {"w": torch.ones(2)})
    assert (tmp_path / "root.pt").read_text() == "old"
    assert os.stat(tmp_path / "mine.pt").st_uid == 65534


@pytest.mark.parametrize("how", ["copyreg", "reduce_ex"])
def test_a_tensor_reduction_of_the_programs_own_goes_to_torch_save(tmp_path, monkeypatch, how):
    """Regression: a reduction of plain tensors the program installed (a
    copyreg entry, a replaced Tensor.__reduce_ex__), which torch.save's
    pickler uses, was passed by: the routed save wrote a standard tensor
    record instead. Such a save goes to torch.save."""
    import copyreg

    import torch

    def as_list(t):
        return (torch.tensor, (t.tolist(),))

    if how == "copyreg":
        monkeypatch.setitem(copyreg.dispatch_table, torch.Tensor, as_list)
    else:
        monkeypatch.setattr(torch.Tensor, "__reduce_ex__", lambda self, proto: as_list(self))
    obj = {"t": torch.arange(3.0)}
    torch.save(obj, tmp_path / "torch.pt")
    with fastpersist.patch() as stats:
        torch.save(obj, tmp_path / "patched.pt")
    assert stats.routed == 0 and ("copyreg" in " ".join(stats.reasons) or "__reduce_ex__" in " ".join(stats.reasons))
    monkeypatch.undo()

    def pkl(p):
        with zipfile.ZipFile(p) as z:
            return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))

    assert pkl(tmp_path / "patched.pt") == pkl(tmp_path / "torch.pt")
    assert torch.equal(torch.load(tmp_path / "patched.pt", weights_only=False)["t"], obj["t"])


class _Refused:
    """An object whose pickling fails (torch.save raises, so does fastpersist)."""

    def __reduce__(self):
        raise RuntimeError("this object refuses to be pickled")


def test_a_save_torch_refuses_too_leaves_the_file_that_was_there(tmp_path):
    """Regression: an object fastpersist cannot write goes to torch.save,
    which truncates the file before it fails (an object torch refuses too:
    a named tensor, an unpicklable object); the checkpoint that was there
    was lost to a save that raised. The fallback now writes torch's bytes
    into a temporary file committed over the target only when torch.save
    returns."""
    obj = {"w": torch.ones(2), "bad": _Refused()}
    with pytest.raises(RuntimeError) as want:
        SAVE(obj, io.BytesIO())
    p = tmp_path / "ckpt.pt"
    SAVE({"w": torch.zeros(3)}, p)
    before = p.read_bytes()
    with fastpersist.patch() as stats:
        with pytest.raises(RuntimeError) as got:
            torch.save(obj, p)
    assert type(got.value) is type(want.value) and str(got.value) == str(want.value)
    # (pickle's own refusal: raised as torch.save raises it, without running
    # the objects' pickling code again in torch.save)
    assert stats.fallback_calls == {}, stats
    assert p.read_bytes() == before
    assert os.listdir(tmp_path) == ["ckpt.pt"]


def test_a_fallback_save_commits_torch_own_bytes(tmp_path, monkeypatch):
    """What a fallback for an object fastpersist cannot write commits is
    torch.save's file (as torch writes one to a file object) in place of
    the old one, its mode kept."""
    import fastpersist.patching as patching

    def refuse(*a, **k):
        raise fastpersist.SerializationError("refused for the test")

    monkeypatch.setattr(patching, "write_state_dict", refuse)
    obj = {"w": torch.arange(6.0), "step": 3}
    want = io.BytesIO()
    SAVE(obj, want)
    p = tmp_path / "ckpt.pt"
    p.write_text("old")
    os.chmod(p, 0o640)
    with fastpersist.patch() as stats:
        torch.save(obj, p)
    assert stats.fallback_calls == {"torch.save": 1}, stats
    assert p.read_bytes() == want.getvalue()
    assert oct(os.stat(p).st_mode & 0o777) == oct(0o640)
    assert os.listdir(tmp_path) == ["ckpt.pt"]


class _GrowsItsDict:
    """Adds a key to the dict being pickled: pickle's iteration refuses it
    (RuntimeError, "dictionary changed size during iteration")."""

    calls = 0

    def __init__(self, d):
        self.d = d

    def __reduce__(self):
        type(self).calls += 1
        self.d[f"added{type(self).calls}"] = 1
        return (int, (0,))


def test_a_refusal_pickle_meets_is_raised_not_tried_again_with_torch_save(tmp_path):
    """Regression: the patched torch.save, after fastpersist's pickling met
    pickle's refusal (raised as a SerializationError), handed the call to
    torch.save, which ran the objects' pickling code again; it succeeded
    the second time and wrote a file where torch.save raises."""
    d = {"t": torch.ones(2)}
    d["m"] = _GrowsItsDict(d)
    with pytest.raises(RuntimeError, match="changed size"):
        torch.save(d, tmp_path / "plain.pt")
    d = {"t": torch.ones(2)}
    d["m"] = _GrowsItsDict(d)
    _GrowsItsDict.calls = 0
    with fastpersist.patch():
        with pytest.raises(RuntimeError, match="changed size"):
            torch.save(d, tmp_path / "patched.pt")
    assert _GrowsItsDict.calls == 1
    assert not (tmp_path / "patched.pt").exists()


def test_a_safetensors_file_whose_header_length_reads_as_a_zip_signature_goes_to_torch_load(tmp_path):
    """Regression: a safetensors file whose header length is 0x04034B50
    bytes begins "PK\\x03\\x04"; the patched torch.load routed it to
    read_state_dict, which read it as safetensors, where torch.load raises
    (it is no zip). Only what read_state_dict takes for a torch zip is
    routed."""
    import json

    n = 0x04034B50
    body = json.dumps({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    header = body + b" " * (n - len(body))
    p = tmp_path / "looks_like_a_zip.pt"
    p.write_bytes(struct.pack("<Q", n) + header + struct.pack("<f", 1.0))
    try:
        assert p.read_bytes()[:4] == b"PK\x03\x04"
        assert fastpersist.detect_format(p) == "safetensors"
        with pytest.raises(RuntimeError) as theirs:
            torch.load(p)
        with fastpersist.patch() as stats:
            with pytest.raises(RuntimeError) as ours:
                torch.load(p)
        assert type(ours.value) is type(theirs.value) and "not a torch zip file" in " | ".join(stats.reasons)
    finally:
        p.unlink()
    # An empty zip (an end record alone): torch takes it for no zip at all.
    import zipfile

    e = tmp_path / "empty.pt"
    zipfile.ZipFile(e, "w").close()
    with pytest.raises(Exception) as theirs:
        torch.load(e)
    with fastpersist.patch():
        with pytest.raises(Exception) as ours:
            torch.load(e)
    assert type(ours.value) is type(theirs.value)
