"""Bad input and faults: a clear exception, and never a file or a lost one."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import fastpersist
import pytest
import torch
from conftest import is_root
from helpers import bits, make, small_tmpfs


def listing(d):
    return sorted(os.listdir(d))


def test_missing_directory(tmp_path):
    with pytest.raises(fastpersist.WriteError) as ei:
        fastpersist.write_state_dict({"a": 1}, tmp_path / "nope" / "x.pt")
    assert ei.value.errno == errno.ENOENT
    assert "nope" in str(ei.value)
    assert isinstance(ei.value, OSError)


def test_target_is_a_directory(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(fastpersist.WriteError) as ei:
        fastpersist.write_state_dict({"a": 1}, tmp_path / "d")
    assert ei.value.errno == errno.EISDIR


def test_not_a_path(tmp_path):
    import io

    with pytest.raises(TypeError, match="file path"):
        fastpersist.write_state_dict({"a": 1}, io.BytesIO())
    with pytest.raises(TypeError):
        fastpersist.write_state_dict({"a": 1}, 42)


def test_unpicklable_object_leaves_nothing(tmp_path):
    (tmp_path / "x.pt").write_bytes(b"previous")
    with pytest.raises(fastpersist.SerializationError, match="cannot serialize"):
        fastpersist.write_state_dict({"f": lambda: 1, "t": make((3,), torch.float32)}, tmp_path / "x.pt")
    assert listing(tmp_path) == ["x.pt"]
    assert (tmp_path / "x.pt").read_bytes() == b"previous"


class _VersionError(Exception):
    pass


class _Raises:
    """An object whose pickling raises ``error``."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __getstate__(self):
        raise self.error


def _deep(n: int) -> list:
    out: list = []
    cur = out
    for _ in range(n):
        cur.append([])
        cur = cur[0]
    return out


@pytest.mark.parametrize(
    "obj",
    [
        _Raises(_VersionError("config cannot be saved now")),
        _Raises(KeyError("missing")),
        _Raises(OSError(errno.EIO, "the device went away")),
        _Raises(NotImplementedError("not yet")),
        _deep(100_000),
    ],
    ids=["custom", "KeyError", "OSError", "NotImplementedError", "too deep"],
)
@pytest.mark.parametrize("how", ["write", "pipelined", "snapshot"])
def test_an_objects_own_error_while_pickling_is_raised_as_itself(tmp_path, obj, how):
    """Regression: an error the saved objects raise while pickled (a
    ``__getstate__`` that raises, a structure too deep) came out of
    write_state_dict and save_async as SerializationError, which is none of
    them, where torch.save raises it as it is: ``except VersionError`` (or
    ``RecursionError``) around a save missed it. pickle's own refusals stay
    SerializationError (each of their classes)."""
    state = {"t": torch.ones(3), "x": obj}
    with pytest.raises(Exception) as want:
        torch.save(state, tmp_path / "torch.pt")
    (tmp_path / "x.pt").write_bytes(b"previous")
    with pytest.raises(type(want.value)) as got:
        if how == "write":
            fastpersist.write_state_dict(state, tmp_path / "x.pt")
        else:
            fastpersist.save_async(state, tmp_path / "x.pt", mode=how).result()
    assert type(got.value) is type(want.value)
    if isinstance(want.value, RecursionError):
        # Where the limit trips (in the C pickler, which adds " while
        # pickling an object", or in a Python call it makes) depends on the
        # depth of the caller's stack, not on the save.
        assert str(got.value).startswith("maximum recursion depth exceeded"), got.value
    else:
        assert str(got.value) == str(want.value)
    assert (tmp_path / "x.pt").read_bytes() == b"previous"
    assert sorted(os.listdir(tmp_path)) == sorted(["x.pt", *(["torch.pt"] if (tmp_path / "torch.pt").exists() else [])])


def test_meta_storage_is_named(tmp_path):
    # A meta *tensor* is saved as torch.save saves it (shape, no data:
    # test_fidelity_torch.py); a meta *storage* has nothing to save.
    sd = {"ok": torch.zeros(2), "layers": [{"w": torch.empty(3, device="meta").untyped_storage()}]}
    with pytest.raises(fastpersist.SerializationError, match=r"\['layers'\]\[0\]\['w'\].*meta"):
        fastpersist.write_state_dict(sd, tmp_path / "m.pt")
    assert listing(tmp_path) == []


def test_mixed_dtype_views_of_one_storage(tmp_path):
    a = torch.zeros(8)
    with pytest.raises(fastpersist.SerializationError, match="different types"):
        fastpersist.write_state_dict({"a": a, "b": a.view(torch.int32)}, tmp_path / "m.pt")
    assert listing(tmp_path) == []


def test_bad_options(tmp_path):
    with pytest.raises(ValueError, match="block_size"):
        fastpersist.write_state_dict({}, tmp_path / "o.pt", block_size=1000)
    with pytest.raises(ValueError, match="arena_bytes"):
        fastpersist.write_state_dict({}, tmp_path / "o.pt", arena_bytes=4096, block_size=8192)
    with pytest.raises(ValueError, match="queue_depth"):
        fastpersist.write_state_dict({}, tmp_path / "o.pt", queue_depth=0)
    assert listing(tmp_path) == []


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_an_io_error_reading_is_a_read_error_naming_the_file(tmp_path, engine_fault, fmt):
    """A read that meets EIO raises ReadError (still a WriteError, the class
    it had, and an OSError) with the errno and the checkpoint's name, also
    where the engine reads through an open descriptor."""
    p = tmp_path / "ckpt"
    fastpersist.write_state_dict({"t": make((4 << 20,), torch.float32)}, p, format=fmt)
    engine_fault(8 << 20, errno.EIO)
    for read in (fastpersist.read_state_dict, fastpersist.verify.verify_file):
        with pytest.raises(fastpersist.ReadError) as ei:
            read(p)
        assert isinstance(ei.value, fastpersist.WriteError) and isinstance(ei.value, OSError)
        assert ei.value.errno == errno.EIO and ei.value.filename == str(p), ei.value


@pytest.mark.parametrize("uring", [True, False])
@pytest.mark.parametrize("direct", [True, False])
def test_injected_eio_surfaces_and_keeps_previous(tmp_path, engine_fault, uring, direct):
    p = tmp_path / "ckpt.pt"
    fastpersist.write_state_dict({"v": 1}, p)
    before = p.read_bytes()
    engine_fault(5 << 20, errno.EIO, direct=direct, io_uring=uring)
    with pytest.raises(fastpersist.WriteError) as ei:
        fastpersist.write_state_dict({"t": make((4 << 20,), torch.float32)}, p, direct=direct, io_uring=uring)
    assert ei.value.errno == errno.EIO
    # The path the caller gave (as torch.save names it), not the temporary
    # file (found in a hunt), which is named in the message.
    assert "offset" in str(ei.value) and ei.value.filename == str(p) and ".fptmp" in str(ei.value)
    assert p.read_bytes() == before
    assert listing(tmp_path) == ["ckpt.pt"]


@pytest.mark.parametrize("uring", [True, False])
@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_a_read_that_stops_short_before_the_end_goes_on(tmp_path, engine_fault, uring, direct, fmt):
    """Regression: io_uring took any short read for the end of the file and
    zero-filled the rest of the buffer; a file system that returns short
    reads mid-file (NFS, FUSE) gave zeros: a safetensors checkpoint (no
    CRC32s of its own) loaded wrong values, a torch one was called corrupt.
    A short read now goes on from where it stopped (only a read of no bytes
    is the end), as the thread pool's pread always did; a write that stops
    short goes on too."""
    sd = {"a": make((1 << 20,), torch.float32, 1), "b": make((777,), torch.float16, 2)}
    p = tmp_path / f"x.{fmt}"
    for cut in (1 << 20, (3 << 20) + 4096):  # inside the data, block-aligned as O_DIRECT returns them
        engine_fault(cut, 0, direct=direct, io_uring=uring)
        fastpersist.write_state_dict(sd, p, format=fmt, direct=direct, io_uring=uring)
        got = fastpersist.read_state_dict(p, direct=direct, io_uring=uring)
        assert all(bits(got[k]) == bits(v) for k, v in sd.items())
        if not direct:  # a buffered read may stop anywhere
            engine_fault(cut + 17, 0, direct=direct, io_uring=uring)
            got = fastpersist.read_state_dict(p, direct=direct, io_uring=uring)
            assert all(bits(got[k]) == bits(v) for k, v in sd.items())


def test_refused_o_direct_falls_back_with_one_warning(tmp_path, engine_fault):
    engine_fault(None, refuse_direct=True)
    sd = {"t": make((300_000,), torch.float32)}
    fastpersist.options._warned.clear()
    with pytest.warns(fastpersist.FallbackWarning, match="O_DIRECT"):
        st = fastpersist.write_state_dict(sd, tmp_path / "a.pt")
    assert not st.direct
    assert bits(torch.load(tmp_path / "a.pt")["t"]) == bits(sd["t"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fastpersist.write_state_dict(sd, tmp_path / "b.pt")  # no second warning


@pytest.mark.parametrize("env,field", [("FASTPERSIST_DIRECT", "direct"), ("FASTPERSIST_IO_URING", "io_uring")])
def test_env_forces_fallbacks(tmp_path, monkeypatch, env, field):
    monkeypatch.setenv(env, "0")
    sd = {"t": make((100_000,), torch.bfloat16)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fastpersist.FallbackWarning)
        st = fastpersist.write_state_dict(sd, tmp_path / "e.pt")
    assert getattr(st, field) is False
    assert bits(torch.load(tmp_path / "e.pt")["t"]) == bits(sd["t"])


@pytest.mark.parametrize("env", ["FASTPERSIST_DIRECT", "FASTPERSIST_IO_URING", "FASTPERSIST_ZERO_COPY"])
@pytest.mark.parametrize("value,on", [("garbage", None), ("of", None), ("OFF", False), (" yes ", True), ("1", True)])
def test_an_on_off_environment_variable_is_read_or_refused_by_name(tmp_path, monkeypatch, env, value, on):
    """Regression (found in a hunt): any value not spelled 0/false/no/off
    meant on (``FASTPERSIST_DIRECT=of``, a typo, kept O_DIRECT), where the
    same word given as an option is refused. A value that is neither on nor
    off is a ValueError naming the variable."""
    from fastpersist.options import EngineOptions

    monkeypatch.setenv(env, value)
    field = env[len("FASTPERSIST_") :].lower()
    if on is None:
        with pytest.raises(ValueError, match=env):
            EngineOptions.resolve()
        with pytest.raises(ValueError, match=env):
            fastpersist.write_state_dict({"t": torch.ones(4)}, tmp_path / "x.pt")
        assert not (tmp_path / "x.pt").exists()
    else:
        assert getattr(EngineOptions.resolve(), field) is on


@pytest.mark.parametrize("value", ["garbage", "of", "2"])
def test_the_fused_copy_variable_is_read_or_refused_as_every_on_off_variable(monkeypatch, value):
    """Regression: FASTPERSIST_FUSED_COPY was off only for "0" (the core
    reads it): "off", "false" or "no" left the fused copy on, and any
    other value was taken silently."""
    from fastpersist.options import EngineOptions

    monkeypatch.setenv("FASTPERSIST_FUSED_COPY", value)
    with pytest.raises(ValueError, match="FASTPERSIST_FUSED_COPY"):
        EngineOptions.resolve()


def test_the_fused_copy_is_off_for_every_spelling_of_off(tmp_path):
    """The core reads the variable once per process: each spelling in a
    process of its own."""
    probe = "import fastpersist; print(fastpersist._core.copy_kernel() is not None)"
    got = {}
    for value in ("0", "off", " False ", "NO", "1", "on"):
        env = {**os.environ, "FASTPERSIST_FUSED_COPY": value}
        r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        got[value] = r.stdout.strip()
    if got["1"] != "True":
        pytest.skip("this CPU has no fused copy")
    assert got == {"0": "False", "off": "False", " False ": "False", "NO": "False", "1": "True", "on": "True"}


@pytest.mark.parametrize(
    "env,value,want",
    [
        ("FASTPERSIST_ARENA_BYTES", "32MiB", 32 << 20),
        ("FASTPERSIST_ARENA_BYTES", "64 M", 64 << 20),
        ("FASTPERSIST_BLOCK_SIZE", "1MiB", 1 << 20),
        ("FASTPERSIST_BLOCK_SIZE", "0x100000", 1 << 20),
        ("FASTPERSIST_QUEUE_DEPTH", "010", 10),
        ("FASTPERSIST_QUEUE_DEPTH", " 8 ", 8),
        ("FASTPERSIST_QUEUE_DEPTH", "8MiB", None),
        ("FASTPERSIST_QUEUE_DEPTH", "\u0661\u0662", None),
        ("FASTPERSIST_ARENA_BYTES", "1e3", None),
        ("FASTPERSIST_BLOCK_SIZE", "7", None),
        ("FASTPERSIST_QUEUE_DEPTH", "5000", None),
        ("FASTPERSIST_ARENA_BYTES", "4096", None),
        ("FASTPERSIST_GATHER_THREADS", "1000", None),
    ],
)
def test_a_count_variable_is_read_in_its_spellings_or_refused_by_name(monkeypatch, env, value, want):
    """Regression: sizes with units (the README's own
    ``FASTPERSIST_ARENA_BYTES=32MiB``) and decimals with a leading zero
    were refused as "not an integer"; a value past the engine's own limits
    was refused naming the option (``block_size 7 must be ...``), not the
    variable it came from."""
    from fastpersist.options import EngineOptions

    monkeypatch.setenv(env, value)
    field = env[len("FASTPERSIST_") :].lower()
    if want is None:
        with pytest.raises(ValueError, match=env):
            EngineOptions.resolve()
    else:
        assert getattr(EngineOptions.resolve(), field) == want


def test_a_stage_chunk_too_large_names_its_variable(monkeypatch):
    from fastpersist.cuda_staging import stage_chunk

    monkeypatch.setenv("FASTPERSIST_STAGE_CHUNK", "64MiB")
    assert stage_chunk() == 64 << 20
    monkeypatch.setenv("FASTPERSIST_STAGE_CHUNK", "1TiB")
    with pytest.raises(ValueError, match="FASTPERSIST_STAGE_CHUNK"):
        stage_chunk()


def test_a_background_niceness_out_of_range_names_its_variable(monkeypatch):
    from fastpersist.async_save import AsyncSaver

    monkeypatch.setenv("FASTPERSIST_BACKGROUND_NICE", "100")
    with pytest.raises(ValueError, match="FASTPERSIST_BACKGROUND_NICE"):
        AsyncSaver()


@pytest.mark.skipif(not is_root(), reason="needs root to mount ramfs")
@pytest.mark.parametrize("how", ["write", "pipelined", "snapshot", "safetensors"])
def test_a_file_system_that_refuses_o_direct_at_open_gets_buffered_writes(tmp_path, how):
    """Regression: ramfs (and tmpfs before Linux 6.6) creates the file of
    ``openat(O_CREAT | O_EXCL | O_DIRECT)`` and only then refuses O_DIRECT
    with EINVAL; the retry without O_DIRECT found its own temporary file
    and failed with EEXIST, so every save failed and left an empty
    temporary file. The file is now created without O_DIRECT and O_DIRECT
    turned on after, where the file system takes it."""
    mnt = tmp_path / "ram"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount ramfs: {r.stderr.decode().strip()}")
    try:
        p = mnt / ("ckpt.safetensors" if how == "safetensors" else "ckpt.pt")
        for step in range(2):  # a new file, then one replaced
            sd = {"w": make((70_000,), torch.float32, step), "b": make((3,), torch.int64, step)}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", fastpersist.FallbackWarning)
                if how in ("write", "safetensors"):
                    st = fastpersist.write_state_dict(sd, p, format="safetensors" if how == "safetensors" else "torch")
                    assert not st.direct
                else:
                    fastpersist.save_async(sd, p, mode=how).result()
            assert listing(mnt) == [p.name]
            got = fastpersist.read_state_dict(p)
            assert all(bits(got[k]) == bits(v) for k, v in sd.items())
    finally:
        fastpersist._core.wait_for_frees(30.0)
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.skipif(not is_root(), reason="needs root to mount a small file system")
@pytest.mark.parametrize("uring", [True, False])
def test_disk_full_enospc(tmp_path, uring):
    with small_tmpfs(tmp_path) as small:
        mnt = Path(small)
        p = mnt / "ckpt.pt"
        fastpersist.write_state_dict({"small": make((1000,), torch.float32)}, p, io_uring=uring)
        before = p.read_bytes()
        with pytest.raises(fastpersist.WriteError) as ei:
            fastpersist.write_state_dict({"big": make((1 << 20,), torch.float32)}, p, io_uring=uring)
        assert ei.value.errno == errno.ENOSPC
        assert p.read_bytes() == before
        assert listing(mnt) == ["ckpt.pt"]


@pytest.mark.skipif(not is_root(), reason="needs root to mount a small file system")
@pytest.mark.parametrize("how", ["write", "pipelined", "snapshot"])
def test_a_save_that_fits_a_nearly_full_tmpfs_is_not_refused(tmp_path, how):
    """Regression: on tmpfs (no fallocate: room is checked instead) the
    whole file's room was checked again at the end of the save, when most
    of it was written, without counting what the file already held: a
    4 MiB save needed about 8 MiB free and failed with ENOSPC."""
    with small_tmpfs(tmp_path, size="6m") as small:
        mnt = Path(small)
        p = mnt / "ckpt.pt"
        sd = {"w": make((1 << 20,), torch.float32)}  # 4 MiB
        if how == "write":
            fastpersist.write_state_dict(sd, p)
        else:
            fastpersist.save_async(sd, p, mode=how).result(timeout=60)
        assert bits(torch.load(p)["w"]) == bits(sd["w"])
        assert listing(mnt) == ["ckpt.pt"]


@pytest.mark.skipif(not is_root(), reason="needs root for an immutable directory")
def test_no_permission(tmp_path):
    d = tmp_path / "locked"
    d.mkdir()
    if subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i unsupported here")
    try:
        with pytest.raises(fastpersist.WriteError) as ei:
            fastpersist.write_state_dict({"a": 1}, d / "x.pt")
        assert ei.value.errno in (errno.EPERM, errno.EACCES)
        assert "locked" in str(ei.value)
    finally:
        subprocess.run(["chattr", "-i", str(d)], check=False)
    assert listing(d) == []


def test_no_permission_as_user(tmp_path):
    if is_root():
        pytest.skip("root ignores directory permissions (covered by the immutable-directory test)")
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        with pytest.raises(fastpersist.WriteError) as ei:
            fastpersist.write_state_dict({"a": 1}, d / "x.pt")
        assert ei.value.errno == errno.EACCES
    finally:
        d.chmod(0o700)


IO_URING_SYSCTL = "/proc/sys/kernel/io_uring_disabled"


@pytest.mark.skipif(
    not (is_root() and os.access(IO_URING_SYSCTL, os.W_OK)), reason="needs root and the io_uring sysctl"
)
def test_io_uring_disabled_by_kernel(tmp_path):
    """With kernel.io_uring_disabled=2, io_uring_setup fails (EPERM): the
    engine falls back to the pwrite pool, warns, and writes a good file."""
    old = open(IO_URING_SYSCTL).read().strip()
    code = textwrap.dedent(f"""
        import warnings, torch, fastpersist
        sd = {{"t": torch.arange(100000, dtype=torch.float32)}}
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            st = fastpersist.write_state_dict(sd, {str(tmp_path / "u.pt")!r})
        assert not st.io_uring, st
        assert any("io_uring is unavailable" in str(x.message) for x in w), [str(x.message) for x in w]
        assert torch.equal(torch.load({str(tmp_path / "u.pt")!r})["t"], sd["t"])
        print("ok")
    """)
    try:
        try:
            with open(IO_URING_SYSCTL, "w") as f:
                f.write("2")
        except OSError as e:
            pytest.skip(f"cannot set {IO_URING_SYSCTL}: {e}")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    finally:
        with open(IO_URING_SYSCTL, "w") as f:
            f.write(old)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def _option_takers(tmp_path):
    from fastpersist.integrations.common import BackgroundSaves

    makers = {
        "fastpersist.patch()": lambda **kw: fastpersist.patch(**kw).undo(),
        "FastPersistAccelerate()": lambda **kw: BackgroundSaves(what="FastPersistAccelerate()", **kw),
        "save_async()": lambda **kw: fastpersist.save_async({"a": torch.ones(2)}, tmp_path / "a.pt", **kw),
        "Checkpointer()": lambda **kw: fastpersist.Checkpointer(str(tmp_path / "ck"), **kw),
    }
    try:
        from fastpersist.dcp import FastPersistReader, FastPersistWriter
    except ImportError:  # pragma: no cover - torch without distributed
        pass
    else:
        makers["FastPersistWriter()"] = lambda **kw: FastPersistWriter(str(tmp_path / "dcp"), **kw)
        makers["FastPersistReader()"] = lambda **kw: FastPersistReader(str(tmp_path / "dcp"), **kw)
    return makers


@pytest.mark.parametrize(
    "what",
    [
        "fastpersist.patch()",
        "FastPersistAccelerate()",
        "save_async()",
        "Checkpointer()",
        "FastPersistWriter()",
        "FastPersistReader()",
    ],
)
def test_an_unknown_option_is_named_with_the_call_that_took_it(tmp_path, what):
    """Regression: every call that takes engine options as keywords raised
    a TypeError about an internal function (EngineOptions.resolve()) for a
    name it does not take; a bad value stays a ValueError, at the call."""
    makers = _option_takers(tmp_path)
    if what not in makers:
        pytest.skip("torch.distributed is not available")
    make_one = makers[what]
    with pytest.raises(TypeError) as ei:
        make_one(queue_dpeth=8)
    msg = str(ei.value)
    assert msg.startswith(what) and "'queue_dpeth'" in msg and "queue_depth" in msg, msg
    assert "resolve" not in msg
    with pytest.raises(ValueError, match="queue_depth must be positive"):
        make_one(queue_depth=0)
    assert not os.path.exists(tmp_path / "a.pt")


def test_the_dcp_writer_names_its_own_durability_option(tmp_path):
    FastPersistWriter = pytest.importorskip("fastpersist.dcp").FastPersistWriter
    with pytest.raises(TypeError, match="sync_files"):
        FastPersistWriter(str(tmp_path), durable=False)


def _saver():
    from fastpersist.async_save import AsyncSaver

    return AsyncSaver()


def _group_takers(tmp_path):
    sd = {"w": torch.ones(4)}
    p = str(tmp_path / "a.pt")
    return {
        "write_state_dict()": lambda g: fastpersist.write_state_dict(sd, p, group=g),
        "read_state_dict()": lambda g: fastpersist.read_state_dict(p, group=g),
        "save_async()": lambda g: fastpersist.save_async(sd, p, group=g).result(timeout=60),
        "AsyncSaver.save()": lambda g: _saver().save(sd, p, group=g).result(timeout=60),
        "Checkpointer()": lambda g: fastpersist.Checkpointer(str(tmp_path / "ck"), group=g),
    }


@pytest.fixture
def gloo_world(tmp_path):
    """A process group of this process alone (gloo), destroyed after."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


GROUP_TAKERS = ["write_state_dict()", "read_state_dict()", "save_async()", "AsyncSaver.save()", "Checkpointer()"]


def _check_group_refusals(tmp_path, what, error, match):
    d = tmp_path / "files"
    d.mkdir()
    if what == "read_state_dict()":
        fastpersist.write_state_dict({"w": torch.ones(4)}, d / "a.pt")
    before = sorted(os.listdir(d))
    call = _group_takers(d)[what]
    for bad in ("x", [0, 1], 3):
        with pytest.raises(error, match=match) as ei:
            call(bad)
        assert str(ei.value).startswith(what), str(ei.value)
    assert sorted(os.listdir(d)) == before


@pytest.mark.parametrize("what", GROUP_TAKERS)
def test_a_group_before_init_is_named_at_the_call(tmp_path, what):
    """Regression: group="x" (or a rank list) raised a bare KeyError from
    inside torch.distributed, once the save was under way."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        pytest.skip("torch.distributed is initialized in this process")
    _check_group_refusals(tmp_path, what, ValueError, r"init_process_group\); got (str|list|int)")


@pytest.mark.parametrize("what", GROUP_TAKERS)
def test_a_group_that_is_not_a_process_group_is_named_at_the_call(tmp_path, gloo_world, what):
    _check_group_refusals(tmp_path, what, TypeError, r"group must be a torch.distributed ProcessGroup")


def test_read_state_dict_refuses_stats_it_cannot_append_to_before_reading(tmp_path):
    """Regression: stats={} read the whole file, then failed with an
    AttributeError from inside the reader."""
    fastpersist.write_state_dict({"w": torch.ones(4)}, tmp_path / "a.pt")
    for bad in ({}, "x", 5):
        with pytest.raises(TypeError, match="stats must be a list"):
            fastpersist.read_state_dict(tmp_path / "a.pt", stats=bad)
    got = []
    fastpersist.read_state_dict(tmp_path / "a.pt", stats=got)
    assert len(got) == 1


@pytest.mark.parametrize("how", ["write_state_dict", "save_async", "safetensors"])
def test_a_file_path_ending_with_a_separator_is_refused(tmp_path, how):
    """Regression: write_state_dict("x.pt/") dropped the separator and wrote
    the file x.pt (torch.save refuses such a name)."""
    sd = {"w": torch.ones(4)}
    target = str(tmp_path / "x.pt") + os.sep
    calls = {
        "write_state_dict": lambda: fastpersist.write_state_dict(sd, target),
        "save_async": lambda: fastpersist.save_async(sd, target).result(timeout=60),
        "safetensors": lambda: fastpersist.write_state_dict(sd, target, format="safetensors"),
    }
    with pytest.raises(ValueError, match="ends with a path separator"):
        calls[how]()
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(os.environ.get("FASTPERSIST_IO_URING") == "0", reason="needs io_uring")
def test_a_ring_that_cannot_be_waited_on_retires_its_engine(tmp_path, engine_fault):
    """Regression: when the io_uring ring could not be waited on with
    requests in flight, the engine forgot them and went on using the ring
    and the arena, whose buffers the kernel might still read or write: a
    later save's bytes could be overwritten by a stale read. The engine is
    now retired (every call raises), and the next save gets a new one."""
    from fastpersist.options import EngineOptions, get_engine

    opts = EngineOptions.resolve(io_uring=True)
    _, eng = get_engine(opts)
    if not eng.uses_io_uring:
        pytest.skip("io_uring is not available here")
    sd = {"w": make((600_000,), torch.float32, 1)}
    p = tmp_path / "x.pt"
    engine_fault((1 << 64) - 1, errno.EBADF, io_uring=True)  # every wait on the ring fails
    with pytest.raises(OSError) as e:
        fastpersist.write_state_dict(sd, p, io_uring=True)
    assert e.value.errno == errno.EBADF
    assert eng.retired and listing(tmp_path) == []
    with pytest.raises(RuntimeError, match="retired"):
        eng.read_into_fd(0, [])
    st = fastpersist.write_state_dict(sd, p, io_uring=True)  # a new engine
    assert st.io_uring and get_engine(opts)[1] is not eng
    assert bits(fastpersist.read_state_dict(p)["w"]) == bits(sd["w"])


@pytest.mark.parametrize("errno_", [errno.ECANCELED, errno.EINTR, errno.EAGAIN])
def test_a_request_the_kernel_cancels_for_a_signal_is_submitted_again(tmp_path, engine_fault, errno_):
    """Regression: io_uring cancels a request whose worker thread cannot be
    made while a signal is pending for the submitting thread (a handled
    SIGUSR1, a DataLoader's SIGCHLD: about one save in 30 with one
    SIGUSR1 each); the save failed with WriteError ECANCELED. Such a
    request (an injected transient error hits its first try only) is
    submitted again; reads likewise."""
    from fastpersist.options import EngineOptions, get_engine

    if not get_engine(EngineOptions.resolve())[1].uses_io_uring:
        pytest.skip("io_uring is not used here")
    sd = {"w": torch.arange(1 << 20, dtype=torch.float32)}
    p = tmp_path / "x.pt"
    engine_fault(1 << 20, errno_)
    fastpersist.write_state_dict(sd, p)
    assert torch.equal(fastpersist.read_state_dict(p)["w"], sd["w"])
    assert torch.equal(torch.load(p)["w"], sd["w"])


@pytest.mark.skipif(not is_root(), reason="drops to another user, for RLIMIT_NPROC to apply")
def test_threads_the_system_will_not_start_fail_that_call_only():
    """Regression (found in a hunt): a worker thread the system would not
    start (EAGAIN under RLIMIT_NPROC) panicked while the engine was held,
    and the poisoned engine failed every later call of the process: saves
    with ValueError, and reads of valid checkpoints as
    CorruptCheckpointError (so ``Checkpointer.load_latest()`` skipped every
    checkpoint and returned None). Now that call fails, or runs on the
    threads that did start, and the next calls work."""
    import shutil
    import tempfile

    tmp_path = tempfile.mkdtemp(prefix="fp-nproc-")  # (pytest's is root's alone)
    os.chmod(tmp_path, 0o777)
    code = textwrap.dedent(
        f"""
        import os, resource, torch, fastpersist
        d = {str(tmp_path)!r}
        sd = {{f"w{{i}}": torch.randn(1 << 20) for i in range(8)}}
        good = os.path.join(d, "good.pt")
        fastpersist.write_state_dict(sd, good)
        with fastpersist.Checkpointer(os.path.join(d, "ck"), every=1) as ck:
            ck.save(1, {{"s": 1}}).result()
        os.system("chmod -R 777 " + d)
        os.setgroups([]); os.setresgid(65534, 65534, 65534)
        resource.setrlimit(resource.RLIMIT_NPROC, (1, 4096))
        os.setresuid(65534, 65534, 65534)
        for opts in ({{}}, {{"io_uring": False}}):
            try:
                fastpersist.write_state_dict(sd, os.path.join(d, "x.pt"), **opts)
            except OSError as e:
                print("refused:", e)
            try:
                fastpersist.read_state_dict(good, **opts)
            except OSError as e:
                print("refused:", e)
        resource.setrlimit(resource.RLIMIT_NPROC, (4096, 4096))
        for opts in ({{}}, {{"io_uring": False}}):
            assert torch.equal(fastpersist.read_state_dict(good, **opts)["w3"], sd["w3"])
            fastpersist.write_state_dict(sd, os.path.join(d, "y.pt"), **opts)
        assert fastpersist.Checkpointer(os.path.join(d, "ck")).load_latest()[0] == 1
        print("ok")
        """
    )
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (out.stdout[-2000:], out.stderr[-3000:])


def test_a_session_dropped_unfinished_writes_into_no_other_file(tmp_path):
    """Regression (found in a review): a write session dropped without
    ``abort()`` (a caller's exception between ``begin`` and its ``try``)
    closed its file while its writes were in flight; a write the engine
    made again (a short or interrupted one: EAGAIN here) went by the
    descriptor number to the file opened with it since. The session's
    writes are now settled when it is dropped, as ``abort()`` does."""
    from fastpersist import _core

    code = textwrap.dedent(
        f"""
        import ctypes, errno, os
        from fastpersist import _core
        d = {str(tmp_path)!r}
        eng = _core.Engine(arena_bytes=64 << 20, block_size=1 << 20, io_uring=True, direct=True,
                           durable=True, flush_every=1 << 20, pool_threads=1, queue_depth=64)
        eng.set_fault(40 << 20, errno.EAGAIN)
        s = eng.begin(os.path.join(d, "ckpt.pt"), 48 << 20)
        for i in range(48):
            idx, addr = s.take_buffer()
            ctypes.memset(addr, 0xAB, 1 << 20)
            s.write_buffer(idx, i << 20, 1 << 20)
        del s
        victims = [os.open(os.path.join(d, f"victim{{i}}"), os.O_RDWR | os.O_CREAT, 0o644) for i in range(4)]
        for v in victims:
            os.write(v, b"victim data\\n")
        try:
            eng.crc_ranges(os.path.join(d, "victim0"), [(0, 1)])  # (settles what is in flight)
        except OSError:
            pass
        for v in victims:
            os.close(v)
        print(sorted((n, os.path.getsize(os.path.join(d, n))) for n in os.listdir(d)))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == str([(f"victim{i}", 12) for i in range(4)]), out.stdout
    del _core


@pytest.mark.parametrize("how", ["copy_memory", "crc32_ranges", "engine", "engine-threads", "engine-pool"])
def test_memory_freed_under_a_read_is_a_storage_changed_error_not_a_crash(tmp_path, how):
    """Regression (found in a review): torch gives the GIL up inside
    ``Tensor.resize_()``, so a resize another thread began before a save
    checked a storage can free (munmap) the memory while the save reads
    it: the snapshot copy (``copy_memory``), the distributed checksums
    (``crc32_ranges``) and the engine's gather crashed the process
    (SIGSEGV), where ``torch.save`` reads through the kernel and goes on.
    Here the memory is unmapped before the read, which meets the same
    fault deterministically: now StorageChangedError, nothing written."""
    code = textwrap.dedent(
        f"""
        import ctypes, os, faulthandler
        faulthandler.enable()  # (as pytest does: installed before fastpersist's handler)
        import fastpersist
        from fastpersist import _core
        from fastpersist.plan import MemoryGuard
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        n = 8 << 20
        # PROT_READ|WRITE, MAP_PRIVATE|ANONYMOUS, far below where the kernel
        # places new mappings (threads' stacks): the hole left stays a hole.
        addr = libc.mmap(0x200000000000, n, 3, 0x22, -1, 0)
        ctypes.memset(addr, 7, n)
        assert libc.munmap(addr + n // 2, n // 2) == 0  # the second half freed, as a resize would
        class Storage:  # what the guard watches: unchanged, as when the check ran
            def data_ptr(self): return addr
            def nbytes(self): return n
        g = MemoryGuard(); g.watch(0, Storage(), "w")
        dst = bytearray(n)
        path = os.path.join({str(tmp_path)!r}, "x.bin")
        how = {how!r}
        try:
            if how == "copy_memory":
                _core.copy_memory(ctypes.addressof(ctypes.c_char.from_buffer(dst)), addr, n, g, 0)
            elif how == "crc32_ranges":
                _core.crc32_ranges([(addr, n, 0)], g)
            else:
                eng = _core.Engine(arena_bytes=16 << 20, block_size=1 << 20, gather_threads=3 if how == "engine-threads" else 1,
                                   io_uring=how != "engine-pool", direct=True, durable=True, flush_every=0, pool_threads=2, queue_depth=8)
                eng.write_file(path, [], [(0, addr, n, 0)], [(n, 0)], n + 4)
            print("no error")
        except fastpersist.StorageChangedError as e:
            print("StorageChangedError", os.path.exists(path), e)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.startswith("StorageChangedError False"), out.stdout


@pytest.mark.parametrize("how", ["fault", "fault-faulthandler-after", "kill"])
def test_a_crash_that_is_not_a_vanished_read_still_crashes(tmp_path, how):
    """Regression (found in a review of the handler above): a fault of
    other code, with Python's faulthandler enabled after fastpersist's
    handler, went back and forth between the two for ever (endless
    tracebacks, never exiting); a SIGSEGV sent by ``kill`` was swallowed.
    The process dies of the signal, as it would without fastpersist."""
    code = textwrap.dedent(
        f"""
        import ctypes, faulthandler, os, signal, torch, fastpersist
        p = os.path.join({str(tmp_path)!r}, "x.pt")
        fastpersist.write_state_dict({{"t": torch.ones(1 << 20)}}, p)  # the handler is installed
        if {how!r} == "fault-faulthandler-after":
            faulthandler.enable()
        fastpersist.write_state_dict({{"t": torch.ones(1 << 20)}}, p)
        if {how!r} == "kill":
            os.kill(os.getpid(), signal.SIGSEGV)
        else:
            ctypes.string_at(0)
        print("survived")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == -11, (out.returncode, out.stdout[-500:], out.stderr[-1500:])
    assert out.stderr.count("Fatal Python error") <= 1
