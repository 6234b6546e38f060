"""write_state_dict: files torch.load reads, bit for bit, for every input."""

from __future__ import annotations

import io
import os
import zipfile

import fastpersist
import pytest
import torch
from helpers import all_dtypes, assert_same, bits, byte_runs, first_part_sent, gc_runs_inside_fastpersist, make
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs


def roundtrip(obj, path, **kw):
    st = fastpersist.write_state_dict(obj, path, **kw)
    assert st.bytes == os.path.getsize(path)
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None
    full = torch.load(path, weights_only=False)
    mapped = torch.load(path, mmap=True, weights_only=True)
    assert_same(obj, full)
    assert_same(obj, mapped)
    return st, full


def torch_save_bytes(obj) -> dict:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    with zipfile.ZipFile(buf) as z:
        return {i.filename.split("/", 1)[1]: z.read(i) for i in z.infolist()}


@pytest.mark.parametrize("dtype", all_dtypes(), ids=str)
def test_every_dtype(tmp_path, dtype):
    sd = {"t": make((37, 5), dtype), "scalar": make((), dtype), "empty": make((0, 3), dtype)}
    roundtrip(sd, tmp_path / "x.pt")


def test_views_sharing_and_layouts(tmp_path):
    base = make((64, 33), torch.float32, 1)
    sd = {
        "base": base,
        "row_view": base[5:9],  # storage offset
        "col_view": base[:, 3],  # non-contiguous
        "transposed": base.t(),
        "expanded": make((1, 4), torch.int64).expand(3, 4),
        "channels_last": make((2, 3, 4, 5), torch.bfloat16).to(memory_format=torch.channels_last),
        "nested": {"list": [1, 2.5, "s", None, (3, make((3,), torch.int8))], "b": b"bytes"},
    }
    _, loaded = roundtrip(sd, tmp_path / "v.pt")
    # Sharing survives: the views live in the loaded base's storage.
    p = loaded["base"].untyped_storage().data_ptr()
    for k in ("row_view", "col_view", "transposed"):
        assert loaded[k].untyped_storage().data_ptr() == p, k
    loaded["base"][5, 0] = 12345.0
    assert loaded["row_view"][0, 0] == 12345.0


def _pickle_zoo():
    base = make((8, 6), torch.float32, 3)
    lin = torch.nn.Linear(3, 2)
    conj = torch.randn(3, dtype=torch.complex64).conj()
    return {
        "w": make((16, 16), torch.float16),
        "b": make((7,), torch.float32),
        "n": 3,
        "views": [base, base[2:], base[:, 1], base.t()],
        "grad": torch.ones(3, requires_grad=True),
        "param": lin.weight,
        "module_sd": lin.state_dict(),
        "dtypes": {str(d): make((3,), d) for d in all_dtypes()},
        "conj": conj,
        "neg": torch.randn(3, dtype=torch.complex64).conj().imag,
        "scalar": make((), torch.int64),
        "empty": torch.empty(0, 4),
        "size": torch.Size([2, 3]),
        "dtype": torch.bfloat16,
        "nested": {"a": [1, (2.5, "x")], "b": None},
    }


def test_same_records_as_torch_save(tmp_path):
    """Same record names, pickle and storage bytes as torch.save."""
    sd = _pickle_zoo()
    fastpersist.write_state_dict(sd, tmp_path / "a.pt")
    with zipfile.ZipFile(tmp_path / "a.pt") as z:
        ours = {i.filename.split("/", 1)[1]: z.read(i) for i in z.infolist()}
        offs = {i.filename.split("/", 1)[1]: i.header_offset for i in z.infolist()}
        raw = open(tmp_path / "a.pt", "rb").read()
    theirs = torch_save_bytes(sd)
    assert set(ours) == set(theirs)
    for name in theirs:
        if name != ".data/serialization_id":
            assert ours[name] == theirs[name], name
    assert ours[".storage_alignment"] == b"64"  # torch's own default
    # Storage records start at 64-byte aligned offsets.
    for name in ours:
        if name.startswith("data/"):
            off = offs[name]
            name_len, extra_len = (
                int.from_bytes(raw[off + 26 : off + 28], "little"),
                int.from_bytes(raw[off + 28 : off + 30], "little"),
            )
            assert (off + 30 + name_len + extra_len) % 64 == 0, name


def test_bare_storage_loads_like_torch_save(tmp_path):
    st = make((10,), torch.uint8).untyped_storage()
    fastpersist.write_state_dict({"s": st}, tmp_path / "a.pt")
    torch.save({"s": st}, tmp_path / "b.pt")
    ours, theirs = torch.load(tmp_path / "a.pt")["s"], torch.load(tmp_path / "b.pt")["s"]
    assert type(ours) is type(theirs)
    assert bytes(ours.untyped_storage() if hasattr(ours, "untyped_storage") else ours) == bytes(st)


def test_optimizer_state_dict(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 1}
    roundtrip(state, tmp_path / "train.pt")


def test_sparse_tensors(tmp_path):
    i = torch.tensor([[0, 1, 1], [2, 0, 2]])
    coo = torch.sparse_coo_tensor(i, torch.tensor([3.0, 4.0, 5.0]), (2, 3))
    csr = torch.eye(4).to_sparse_csr()
    fastpersist.write_state_dict({"coo": coo, "csr": csr}, tmp_path / "s.pt")
    got = torch.load(tmp_path / "s.pt", weights_only=True)
    assert torch.equal(got["coo"].to_dense(), coo.to_dense())
    assert torch.equal(got["csr"].to_dense(), csr.to_dense())


def test_overwrite_larger_file_leaves_no_stale_bytes(tmp_path):
    p = tmp_path / "c.pt"
    fastpersist.write_state_dict({"big": make((1 << 20,), torch.float32)}, p)
    big = os.path.getsize(p)
    st = fastpersist.write_state_dict({"small": make((3,), torch.float32)}, p)
    assert os.path.getsize(p) == st.bytes < big
    assert list(torch.load(p)) == ["small"]
    assert os.listdir(tmp_path) == ["c.pt"]


def test_storage_over_4gib_uses_zip64(tmp_path):
    """A 4 GiB + 8 KiB storage: zip64 sizes and offsets."""
    n = (4 << 30) + 8192
    try:
        big = torch.empty(n, dtype=torch.uint8)
    except RuntimeError:
        pytest.skip("not enough memory")
    big[:4096] = 7
    big[-4096:] = 9
    small = make((1000,), torch.float32)
    p = tmp_path / "huge.pt"
    st = fastpersist.write_state_dict({"big": big, "after": small}, p)
    assert st.bytes > n
    with zipfile.ZipFile(p) as z:
        info = {i.filename.split("/", 1)[1]: i for i in z.infolist()}
        assert info["data/0"].file_size == n
        assert info["data/1"].header_offset > 0xFFFFFFFF
        with z.open(info["data/1"]) as f:  # CRC checked when read to the end
            assert f.read() == bits(small)
    got = torch.load(p, mmap=True, weights_only=True)
    assert bits(got["after"]) == bits(small)
    assert got["big"][0] == 7 and got["big"][-1] == 9
    del got, big


def test_stats(tmp_path):
    st = fastpersist.write_state_dict({"x": make((1000,), torch.float64)}, str(tmp_path / "s.pt"))
    assert st.storage_bytes == 8000
    assert st.bytes > 8000 and st.seconds > 0 and st.gbps > 0
    assert st.io_uring and st.direct
    assert set(st.crc32) == {"0"}
    import zlib

    assert st.crc32["0"] == zlib.crc32(bits(make((1000,), torch.float64)))


def test_pathlike_and_relative_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fastpersist.write_state_dict({"a": 1}, "rel.pt")
    assert torch.load("rel.pt") == {"a": 1}
    fastpersist.write_state_dict({"a": 2}, tmp_path / "p.pt")
    assert torch.load(tmp_path / "p.pt") == {"a": 2}


def test_concurrent_saves_from_threads(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    sds = [{"i": i, "t": make((4096 + i,), torch.float32, i)} for i in range(8)]
    with ThreadPoolExecutor(4) as ex:
        list(ex.map(lambda i: fastpersist.write_state_dict(sds[i], tmp_path / f"{i}.pt"), range(8)))
    for i in range(8):
        assert_same(sds[i], torch.load(tmp_path / f"{i}.pt"))


def test_overwrite_leaves_only_the_new_file_and_frees_the_old(tmp_path):
    """A big replaced checkpoint is freed on a background thread (held across
    the rename): the new file is in place when the call returns, nothing
    else is left in the directory, and the old file's blocks are released."""
    p = tmp_path / "ckpt.pt"
    sd = {"w": torch.arange(8 << 20, dtype=torch.float32)}  # 32 MiB
    fastpersist.write_state_dict(sd, p)
    sd2 = {"w": sd["w"] + 1}
    fastpersist.write_state_dict(sd2, p)
    assert torch.equal(torch.load(p)["w"], sd2["w"])
    fastpersist._core.wait_for_frees(30.0)
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            held.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass  # the listing's own descriptor, closed by now
    assert [h for h in held if h.startswith(str(tmp_path))] == [], held
    with pytest.raises(ValueError, match="timeout"):
        fastpersist._core.wait_for_frees(-1.0)


@pytest.mark.parametrize("guarded", [True, False])
def test_gather_threads_write_the_same_file(tmp_path, monkeypatch, guarded):
    """21.3: gathering on several threads (copies and checksums spread over
    workers; under the GIL guard only the checksums) writes exactly the file
    one thread writes, for many records with their CRC slots."""
    g = torch.Generator().manual_seed(3)
    sd = {f"t{i}": torch.randn(int(torch.randint(1, 300_000, (1,), generator=g)), generator=g) for i in range(40)}
    sd["big"] = torch.randn(3 << 20, generator=g)
    if not guarded:
        from fastpersist import plan

        monkeypatch.setattr(plan.MemoryGuard, "__bool__", lambda self: False)
    files = []
    for n in (1, 2, 5):
        p = tmp_path / f"g{n}.pt"
        st = fastpersist.write_state_dict(sd, p, gather_threads=n, block_size=256 << 10, arena_bytes=2 << 20)
        files.append(p.read_bytes())
        assert st.crc32 == fastpersist.write_state_dict(sd, tmp_path / "ref.pt", gather_threads=1).crc32
    assert files[0] == files[1] == files[2]
    got = torch.load(tmp_path / "g5.pt")
    assert all(torch.equal(got[k], v) for k, v in sd.items())
    fastpersist.read_state_dict(tmp_path / "g5.pt")  # every CRC verified


def test_gather_threads_option_is_checked(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="gather_threads must be positive"):
        fastpersist.write_state_dict({"a": torch.ones(3)}, tmp_path / "a.pt", gather_threads=0)
    monkeypatch.setenv("FASTPERSIST_GATHER_THREADS", "-2")
    with pytest.raises(ValueError, match="FASTPERSIST_GATHER_THREADS"):
        fastpersist.write_state_dict({"a": torch.ones(3)}, tmp_path / "a.pt")
    monkeypatch.setenv("FASTPERSIST_GATHER_THREADS", "3")
    fastpersist.write_state_dict({"a": torch.ones(3)}, tmp_path / "a.pt")
    with pytest.raises(ValueError, match="gather_threads must be in 1..=256"):
        fastpersist.write_state_dict({"a": torch.ones(3)}, tmp_path / "a.pt", gather_threads=1000)


def test_no_garbage_collection_while_a_save_plans(tmp_path):
    """A save of many tensors allocates objects that all live until it ends:
    the cyclic collector is paused meanwhile (full collections of the heap
    cost 0.27 s of a 1.3 s save of 10,000 tensors and freed nothing), and
    restored afterwards, also after a failed save."""
    import gc

    sd = {f"t{i}": torch.full((3,), float(i)) for i in range(3000)}
    with gc_runs_inside_fastpersist() as runs:
        fastpersist.write_state_dict(sd, tmp_path / "many.pt")
        during = list(runs)
        assert gc.isenabled()
        with pytest.raises(fastpersist.SerializationError):
            fastpersist.write_state_dict({"f": lambda: 0, **sd}, tmp_path / "bad.pt")
        assert gc.isenabled()
        gc.disable()  # a caller's own choice is kept
        fastpersist.write_state_dict({"a": torch.ones(2)}, tmp_path / "a.pt")
        assert not gc.isenabled()
        gc.enable()
    # At most the entry of the call itself (the pause is being set up, in
    # options.without_gc's wrapper).
    inside = [r for r in during if r[1] not in ("write_state_dict", "paused")]
    assert inside == [] and len(during) <= 1, f"{len(during)} collections during the save: {during[:5]}"
    assert torch.equal(torch.load(tmp_path / "many.pt")["t2999"], sd["t2999"])


def test_head_parts_are_the_head(tmp_path):
    """Laid out in parts, the head is the same pieces as laid out whole, and
    the file is byte for byte the same."""
    from fastpersist.torch_zip import TorchZipLayout

    sd = {f"t{i}": torch.full((1000 + i,), float(i)) for i in range(300)}
    whole = TorchZipLayout(sd).head()
    parts = list(TorchZipLayout(sd).head_parts(first=64 << 10))
    assert len(parts) > 3
    joined = fastpersist.plan.Batch()
    for part in parts:
        assert part.regions and part.end > (joined.end if joined.blobs else -1)
        joined.extend(part)
    assert (joined.regions, joined.slots, joined.end) == (whole.regions, whole.slots, whole.end)
    assert byte_runs(joined.blobs) == byte_runs(whole.blobs)  # the same bytes where the blobs are
    with pytest.raises(RuntimeError, match="not laid out"):
        TorchZipLayout(sd).tail()  # the head first
    fastpersist.write_state_dict(sd, tmp_path / "a.pt")
    assert torch_save_bytes(sd)["data.pkl"] == zipfile.ZipFile(tmp_path / "a.pt").read("archive/data.pkl")
    roundtrip(sd, tmp_path / "b.pt")
    assert (tmp_path / "a.pt").read_bytes() == (tmp_path / "b.pt").read_bytes()


def test_head_is_written_while_the_rest_is_laid_out(tmp_path, monkeypatch):
    """The first part of the head reaches the engine before the head's later
    storages are laid out (then the pickle): the disk starts at once. The
    layout of a later storage waits (up to 30 s) for the first write to
    begin; laid out whole first, it would wait in vain."""

    from fastpersist import torch_zip

    sd = {f"t{i}": torch.full((1 << 18,), float(i)) for i in range(64)}  # 1 MiB each
    first_sent = first_part_sent(monkeypatch)
    waited: list = []
    real_add = torch_zip.TorchZipLayout._add_storages

    def add_storages(self, items, host=False):
        if len(self.storage_keys) <= 40 < len(self.storage_keys) + len(items):
            waited.append(first_sent.wait(30))
        return real_add(self, items, host)

    monkeypatch.setattr(torch_zip.TorchZipLayout, "_add_storages", add_storages)
    roundtrip(sd, tmp_path / "a.pt")
    assert waited == [True]


def test_the_layout_hands_the_gil_to_the_engine_waiting_for_it(tmp_path, monkeypatch):
    """While the caller lays out the head, the engine thread writing the
    parts laid out before waits for the GIL to gather them; the layout loop
    hands it over (``_core.let_engines_in``) rather than making it wait for
    the interpreter's switch interval. Here the layout, once the first part
    was sent, keeps offering the GIL until the engine thread takes it (up to
    30 s): an offer that no waiting engine ever takes would spin in vain."""
    import time

    from fastpersist import _core, torch_zip

    assert _core.let_engines_in() is False  # no engine waits: nothing to hand over
    sd = {f"t{i}": torch.full((1 << 12,), float(i)) for i in range(4096)}  # 16 KiB each
    first_sent = first_part_sent(monkeypatch)
    taken: list = []

    class Core:
        def __getattr__(self, name):
            return getattr(_core, name)

        @staticmethod
        def let_engines_in():
            if first_sent.is_set() and not taken:
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    if _core.let_engines_in():
                        taken.append(True)
                        break
                else:
                    taken.append(False)
            return _core.let_engines_in()

    monkeypatch.setattr(torch_zip, "_core", Core())
    roundtrip(sd, tmp_path / "a.pt")
    assert taken == [True]


def test_head_parts_are_written_while_the_caller_keeps_the_gil(tmp_path, monkeypatch):
    """The head's parts go to the session's write-behind thread, which runs
    no Python: it needs the GIL only to gather caller memory, and takes it
    from the layout's offers (``_core.let_engines_in``). Here, once every
    part of the head is handed over, the caller keeps the GIL (switch
    interval 1000 s) and only offers it that way, until every part is
    written (up to 30 s). A writer thread that ran Python between parts
    would wait for the switch interval and never get there."""
    import sys
    import time

    from fastpersist import _core, torch_zip, writer

    sd = {f"t{i}": torch.full((1 << 12,), float(i)) for i in range(4096)}  # 16 KiB each: 4 head parts
    real_put, real_tail = writer.PartWriter.put, torch_zip.TorchZipLayout.tail
    sessions: list = []
    written: list = []

    def put(self, part):
        real_put(self, part)
        sessions.append(self._session)

    def tail(self):
        deadline = time.monotonic() + 30
        while sessions[-1].behind_pending and time.monotonic() < deadline:
            _core.let_engines_in()
        written.append(sessions[-1].behind_pending == 0)
        return real_tail(self)

    monkeypatch.setattr(writer.PartWriter, "put", put)
    monkeypatch.setattr(torch_zip.TorchZipLayout, "tail", tail)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000)
    try:
        roundtrip(sd, tmp_path / "a.pt")
    finally:
        sys.setswitchinterval(interval)
    assert len(sessions) >= 4 and written == [True]


def _behind_session(tmp_path, name="f.bin", **opts):
    from fastpersist.options import EngineOptions, get_engine

    _, eng = get_engine(EngineOptions.resolve(**opts))
    path = tmp_path / name
    return path, eng.begin(str(path), 1 << 20)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    pieces=hs.lists(hs.tuples(hs.integers(0, 3), hs.integers(1, 70_000), hs.booleans()), min_size=1, max_size=12),
    cuts=hs.lists(hs.integers(0, 12), max_size=4),
    mixed=hs.booleans(),
)
def test_write_behind_writes_the_parts_in_order(tmp_path, pieces, cuts, mixed):
    """Any file cut into parts and given to ``write_behind`` (some parts by
    ``write`` between them, which waits for those before) is the file
    written whole: the same bytes, and the same CRC32 in its slots."""
    from fastpersist.plan import Blob, Region, Slot

    data, parts, keep, off = bytearray(), [], [], 0
    bounds = sorted({min(c, len(pieces)) for c in cuts} | {0, len(pieces)})
    crc_ids = 0
    for lo, hi in zip(bounds, bounds[1:]):
        blobs, regions, slots = [], [], []
        for gap, n, from_memory in pieces[lo:hi]:
            off += gap
            data += bytes(gap)
            chunk = bytes((off + i) % 251 for i in range(n))
            if from_memory:
                t = torch.frombuffer(bytearray(chunk), dtype=torch.uint8)
                keep.append(t)
                regions.append(Region(off, t.data_ptr(), n, crc_ids))
                off += n
                data += chunk
                slots.append(Slot(off, crc_ids))
                data += fastpersist._core.crc32(chunk).to_bytes(4, "little")
                off += 4
                crc_ids += 1
            else:
                blobs.append(Blob(off, chunk))
                off += n
                data += chunk
        parts.append((blobs, regions, slots))
    path, session = _behind_session(tmp_path)
    for i, (blobs, regions, slots) in enumerate(parts):
        if mixed and i % 3 == 2:
            session.write(blobs, regions, slots)
        else:
            session.write_behind(blobs, regions, slots)
    session.finish([], [], [], len(data))
    assert session.behind_pending == 0 and not session.behind_failed
    assert path.read_bytes() == bytes(data)


@pytest.mark.parametrize("io_uring", [False, True])
def test_a_failed_part_written_behind_raises_and_commits_nothing(tmp_path, engine_fault, io_uring):
    """An I/O error in a part on the write-behind thread is raised and
    nothing is committed: the previous file stays, no file is left behind.
    Writes that complete within their part (the pwrite pool) fail there:
    later parts are dropped, ``behind_failed`` says so and ``join_behind``
    raises. With io_uring a write may still be in flight when its part is
    done: then the next call of the session raises it, at the latest
    ``finish``."""
    import errno
    import time

    from fastpersist.plan import Region

    t = torch.ones(4 << 20, dtype=torch.uint8)  # 4 MiB a part
    path = tmp_path / "f.bin"
    path.write_bytes(b"previous")
    engine_fault(6 << 20, errno.EIO, io_uring=io_uring)
    _, session = _behind_session(tmp_path, io_uring=io_uring)
    for i in range(4):
        session.write_behind([], [Region(i * t.numel(), t.data_ptr(), t.numel(), -1)], [])
    if not io_uring:
        deadline = time.monotonic() + 30
        while not session.behind_failed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert session.behind_failed
        with pytest.raises(OSError) as e:
            session.join_behind()
        assert e.value.errno == errno.EIO
        assert session.behind_pending == 0
    with pytest.raises(OSError if io_uring else ValueError) as e:
        session.finish([], [], [], 4 * t.numel())
    assert e.value.errno == errno.EIO if io_uring else "already failed" in str(e.value)
    session.abort()
    assert path.read_bytes() == b"previous"
    assert sorted(os.listdir(tmp_path)) == ["f.bin"]


def test_a_bad_part_written_behind_is_refused_by_name(tmp_path):
    """A part the engine refuses (here: it starts before the end of the
    parts given so far) fails on the write-behind thread with the engine's
    own message; what follows is dropped and nothing is left behind."""
    import time

    from fastpersist.plan import Blob

    path, session = _behind_session(tmp_path)
    session.write_behind([Blob(0, b"x" * 10_000)], [], [])
    session.write_behind([Blob(5_000, b"y" * 10)], [], [])
    session.write_behind([Blob(20_000, b"z" * 10)], [], [])
    deadline = time.monotonic() + 30
    while session.behind_pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert session.behind_failed and session.behind_pending == 0
    with pytest.raises(ValueError, match="5000"):
        session.join_behind()
    session.abort()
    assert os.listdir(tmp_path) == []


def test_a_malformed_part_is_a_type_error_naming_the_piece(tmp_path):
    """``write_behind`` reads its pieces one by one (handing the GIL to a
    waiting engine thread between batches of them): a piece of the wrong
    shape, or a string for a sequence, is a TypeError naming the argument
    and the piece, and nothing is handed to the thread."""
    from fastpersist.plan import Blob

    path, session = _behind_session(tmp_path)
    pieces = [Blob(i * 10, b"x" * 10) for i in range(1000)]
    pieces[700] = (7000, "not bytes")
    with pytest.raises(TypeError, match=r"blobs\[700\]"):
        session.write_behind(pieces, [], [])
    with pytest.raises(TypeError, match=r"regions\[0\]"):
        session.write_behind([], [(0, 1)], [])
    with pytest.raises(TypeError, match="slots must be a sequence of tuples, not a string"):
        session.write_behind([], [], "abc")
    with pytest.raises(TypeError):
        session.write_behind(None, [], [])
    assert session.behind_pending == 0 and not session.behind_failed
    session.write_behind(pieces[:700], [], [])
    session.join_behind()
    session.abort()
    assert os.listdir(tmp_path) == []


def test_a_failed_head_part_stops_the_layout(tmp_path, engine_fault, monkeypatch):
    """Once a head part written behind has failed, the next part handed
    over raises its error: the caller does not lay out (and pickle) the rest
    of a checkpoint that cannot be saved. (The pwrite pool: each part's
    writes complete within it.)"""
    import errno
    import time

    from fastpersist import writer

    sd = {f"t{i}": torch.full((1 << 18,), float(i)) for i in range(128)}  # 1 MiB each: several head parts
    p = tmp_path / "a.pt"
    fastpersist.write_state_dict({"x": torch.ones(2)}, p)
    before = p.read_bytes()
    engine_fault(0, errno.EIO, io_uring=False)
    real_put = writer.PartWriter.put
    puts: list = []

    def put(self, part):
        puts.append(part)
        real_put(self, part)
        if len(puts) == 1:  # the first part: wait until its write failed
            deadline = time.monotonic() + 30
            while not self._session.behind_failed and time.monotonic() < deadline:
                time.sleep(0.01)

    monkeypatch.setattr(writer.PartWriter, "put", put)
    with pytest.raises(OSError) as e:
        fastpersist.write_state_dict(sd, p, io_uring=False)
    assert e.value.errno == errno.EIO
    assert len(puts) == 2  # the second part raised; no third was laid out
    assert p.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["a.pt"]


def test_abort_drops_the_parts_not_begun(tmp_path):
    """``abort`` (and so a save given up on an exception of its own,
    KeyboardInterrupt included) does not wait for the parts given to
    ``write_behind`` that the thread has not begun: they are dropped. Here
    the thread cannot begin any before the abort (it waits for the GIL,
    which this thread keeps: switch interval 1000 s); the temporary file,
    read through a descriptor opened before, holds none of their bytes."""
    import sys

    from fastpersist.plan import Region

    n = 8 << 20
    t = torch.ones(n, dtype=torch.uint8)
    _, session = _behind_session(tmp_path)
    (tmp,) = os.listdir(tmp_path)
    fd = os.open(tmp_path / tmp, os.O_RDONLY)
    try:
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1000)
        try:
            for i in range(16):
                session.write_behind([], [Region(i * n, t.data_ptr(), n, -1)], [])
            session.abort()
        finally:
            sys.setswitchinterval(interval)
        assert session.behind_pending == 0
        assert os.listdir(tmp_path) == []
        for i in (0, 15):
            assert os.pread(fd, 4096, i * n) in (b"", bytes(4096))
    finally:
        os.close(fd)


def test_an_interrupted_save_raises_its_own_exception_and_keeps_the_old_file(tmp_path):
    """A KeyboardInterrupt while the pickle is made (the head's parts on the
    write-behind thread meanwhile) propagates as it is: the parts not begun
    are dropped, the previous file stays, no file is left behind."""

    class Interrupt:
        def __reduce__(self):
            raise KeyboardInterrupt

    p = tmp_path / "a.pt"
    fastpersist.write_state_dict({"x": torch.ones(2)}, p)
    before = p.read_bytes()
    sd = {f"t{i}": torch.full((1 << 18,), float(i)) for i in range(256)}  # 1 MiB each: several head parts
    sd["stop"] = Interrupt()
    with pytest.raises(KeyboardInterrupt):
        fastpersist.write_state_dict(sd, p)
    assert p.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["a.pt"]
    roundtrip({"t": torch.ones(3)}, tmp_path / "b.pt")  # the engine saves as usual after


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_fork_child_leaves_the_parents_write_behind_alone(tmp_path):
    """A process forked while a session's write-behind thread holds parts
    (here it cannot begin any: the parent keeps the GIL up to the fork,
    switch interval 1000 s) has no such thread. In the child, ``join_behind``
    and ``write`` raise that the session is the parent's instead of waiting
    forever for a thread that is not there, and ``abort`` and dropping it
    return at once and remove nothing; the parent then writes and commits
    the file as usual."""
    import gc
    import sys
    import time

    from fastpersist.plan import Region

    n = 1 << 20
    t = torch.ones(n, dtype=torch.uint8)
    path, session = _behind_session(tmp_path)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000)
    try:
        for i in range(4):
            session.write_behind([], [Region(i * n, t.data_ptr(), n, -1)], [])
        pid = os.fork()
        if pid == 0:  # the child: only os._exit leaves it
            code = 3
            try:
                raised = []
                for call in (session.join_behind, lambda: session.write([], [], [])):
                    try:
                        call()
                    except RuntimeError as e:
                        raised.append("fork" in str(e))
                session.abort()
                del session
                gc.collect()
                left = [f for f in os.listdir(tmp_path) if f.endswith(".fptmp")]
                code = 0 if raised == [True, True] and len(left) == 1 else 2
            finally:
                os._exit(code)
    finally:
        sys.setswitchinterval(interval)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the fork child hung on the parent's write-behind thread")
    assert os.waitstatus_to_exitcode(done[1]) == 0
    session.finish([], [], [], 4 * n)
    assert path.read_bytes() == b"\x01" * (4 * n)


def test_engine_calls_during_a_write_behind_do_not_deadlock(tmp_path):
    """The engine's own methods (``uses_io_uring``, ``locked``,
    ``set_fault``, ``set_gather_threads``) called while the session's
    write-behind thread writes a part: the thread holds the engine's lock
    and takes the GIL for each slice it gathers, so a method that waited for
    the lock while holding the GIL would wait forever. In a fresh
    interpreter, with a time limit."""
    import subprocess
    import sys
    import textwrap

    code = f"""
        import os, time, torch
        from fastpersist.options import EngineOptions, get_engine
        from fastpersist.plan import MemoryGuard, Region
        _, eng = get_engine(EngineOptions.resolve())
        t = torch.ones(256 << 20, dtype=torch.uint8)
        guard = MemoryGuard()
        guard.watch(0, t.untyped_storage(), "t")
        s = eng.begin({str(tmp_path / "f.bin")!r}, t.numel())
        for call in (lambda: eng.uses_io_uring, lambda: eng.locked, lambda: eng.set_fault(None),
                     lambda: eng.set_gather_threads(2)):
            s.write_behind([], [Region(0, t.data_ptr(), t.numel(), 0)], [], guard)
            time.sleep(0.005)  # the thread is inside its part now
            call()
            s.join_behind()
            s.abort()
            s = eng.begin({str(tmp_path / "f.bin")!r}, t.numel())
        s.abort()
        print("DONE")
    """
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "DONE" in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])


@pytest.mark.parametrize("how", ["abort", "drop"])
def test_a_session_given_up_with_parts_behind_removes_its_file(tmp_path, how):
    """A session aborted (or dropped unfinished) while parts are on its
    write-behind thread: the thread writes them first, then the temporary
    file is removed; nothing appears at the path, and the engine saves
    again as usual."""
    import gc

    from fastpersist.plan import Region

    t = torch.ones(8 << 20, dtype=torch.uint8)
    path, session = _behind_session(tmp_path)
    for i in range(8):
        session.write_behind([], [Region(i * t.numel(), t.data_ptr(), t.numel(), -1)], [])
    if how == "abort":
        session.abort()
        assert session.behind_pending == 0
    else:
        del session
        gc.collect()
    assert os.listdir(tmp_path) == []
    roundtrip({"t": t}, tmp_path / "b.pt")


_AT_FORK: list = []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_fork_child_has_no_engine_waiting_for_the_gil(tmp_path):
    """A child forked while an engine thread of the parent waits for the GIL
    (the parent keeps the GIL in a loop of Python until one waits; the
    count is taken in a before-fork hook, with the GIL held up to the fork)
    sees none waiting: its layout loops would otherwise wait 1 ms at every
    offer, for an engine thread that does not exist there."""
    import threading
    import time

    from fastpersist import _core

    if not _AT_FORK:
        _AT_FORK.append(None)
        os.register_at_fork(before=lambda: _AT_FORK.append(_core.engines_waiting()))
    seen = []
    for attempt in range(20):
        sd = {f"t{i}": torch.full((1 << 12,), float(i)) for i in range(4096)}
        t = threading.Thread(target=fastpersist.write_state_dict, args=(sd, tmp_path / f"{attempt}.pt"))
        t.start()
        deadline = time.monotonic() + 30
        while _core.engines_waiting() == 0 and time.monotonic() < deadline and t.is_alive():
            pass
        pid = os.fork()
        if pid == 0:
            os._exit(10 + _core.engines_waiting() + 2 * _core.let_engines_in())
        _, status = os.waitpid(pid, 0)
        t.join()
        seen.append((_AT_FORK[-1], os.waitstatus_to_exitcode(status)))
        if _AT_FORK[-1]:
            break
    assert seen[-1] == (1, 10), seen  # one waited in the parent; none in the child


@pytest.mark.parametrize("where", ["value", "nested list", "tuple"])
def test_a_tensor_changed_in_place_during_a_synchronous_save_is_caught(tmp_path, monkeypatch, where):
    """write_state_dict records the version counters of every tensor at the
    call; one changed in place before its bytes are gathered (here: from the
    layout of the head, before the pickler meets any tensor, as another
    thread could) raises TensorChangedError naming it, and nothing is
    committed."""
    from fastpersist import torch_zip

    target = torch.arange(1000, dtype=torch.float32)
    sd = {"a": torch.ones(10), "w": target} if where == "value" else {"a": torch.ones(10)}
    if where == "nested list":
        sd["l"] = [torch.zeros(3), {"w": target}]
    elif where == "tuple":
        sd["t"] = (torch.zeros(3), target)
    real = torch_zip.TorchZipLayout._add_storages
    calls = []

    def add_storages(self, items, host=False):
        if not calls:  # the head's first part: before the pickler meets any tensor
            target.add_(1)  # bumps the version counter
        calls.append(len(items))
        return real(self, items, host)

    p = tmp_path / "a.pt"
    fastpersist.write_state_dict({"old": torch.ones(2)}, p)
    monkeypatch.setattr(torch_zip.TorchZipLayout, "_add_storages", add_storages)
    with pytest.raises(fastpersist.TensorChangedError, match="changed in place"):
        fastpersist.write_state_dict(sd, p)
    assert list(torch.load(p)) == ["old"]


def test_durable_none_is_the_default_not_off(tmp_path, monkeypatch):
    """Regression: durable=None (documented as "the default") read as False
    and turned off every fsync; a string such as "no" read as True."""
    from fastpersist.options import EngineOptions

    assert EngineOptions.resolve(durable=None).durable is True
    assert EngineOptions.resolve(durable=False).durable is False
    for bad in ("no", 2, 0.0):
        with pytest.raises(TypeError, match="durable must be True, False or None"):
            fastpersist.write_state_dict({"a": torch.ones(2)}, tmp_path / "a.pt", durable=bad)
    with pytest.raises(TypeError, match="direct must be True, False or None"):
        fastpersist.write_state_dict({"a": torch.ones(2)}, tmp_path / "a.pt", direct="no")
    monkeypatch.setenv("FASTPERSIST_DIRECT", "0")
    assert EngineOptions.resolve(direct=None).direct is False
    assert not os.path.exists(tmp_path / "a.pt")


class _Opaque:
    """An object the survey does not enter: the pickler may meet storages in it."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def _many(n: int = 40) -> dict:
    base = torch.arange(400.0)
    sd: dict = {f"t{i}": torch.full((16 + i,), float(i)) for i in range(n)}
    sd["view"] = base[10:20]  # shares base's storage, met first here
    sd["nested"] = [base, {"again": sd["t3"]}, (torch.zeros(3, dtype=torch.int8),)]
    sd["late"] = torch.ones(7)
    return sd


@pytest.mark.parametrize("limit", [(0, 1), (0, 5), (64, 2), (1 << 40, 1 << 30)])
@pytest.mark.parametrize("opaque", [False, True])
def test_a_survey_stopped_early_writes_the_same_file(tmp_path, monkeypatch, limit, opaque):
    """write_state_dict finds only the first storages at the call
    (writer.SURVEY_FIRST) and the rest while those are written: the file is
    byte for byte the one a survey gone to the end lays out (same keys,
    order and places), also when an object the survey cannot see into
    comes among the rest (the pickler numbers what follows)."""
    from fastpersist import writer

    sd = _many()
    if opaque:
        sd = {**dict(list(sd.items())[:20]), "obj": _Opaque(torch.ones(5)), **dict(list(sd.items())[20:])}
    monkeypatch.setattr(writer, "SURVEY_FIRST", None)
    fastpersist.write_state_dict(sd, tmp_path / "whole.pt")
    monkeypatch.setattr(writer, "SURVEY_FIRST", limit)
    fastpersist.write_state_dict(sd, tmp_path / "early.pt")
    assert (tmp_path / "early.pt").read_bytes() == (tmp_path / "whole.pt").read_bytes()
    got = torch.load(tmp_path / "early.pt", weights_only=False)
    assert_same(got["nested"], sd["nested"])
    assert got["view"].untyped_storage().data_ptr() == got["nested"][0].untyped_storage().data_ptr()


def test_a_survey_stopped_early_reserves_the_rest_before_writing_it(tmp_path, monkeypatch):
    """The head's first part past the storages found at the call carries the
    reservation of the whole head (the session was begun knowing only the
    first), and the write-behind thread makes it before writing that part."""
    from fastpersist import writer

    parts = []
    real = writer.PartWriter.put

    def put(self, part):
        parts.append((part.reserve, part.end))
        return real(self, part)

    monkeypatch.setattr(writer.PartWriter, "put", put)
    monkeypatch.setattr(writer, "SURVEY_FIRST", (0, 4))
    sd = {f"t{i}": torch.full((1 << 14,), float(i)) for i in range(64)}
    fastpersist.write_state_dict(sd, tmp_path / "a.pt")
    reserved = [(r, end) for r, end in parts if r]
    assert len(reserved) == 1, parts
    # At least the storages' bytes, and no less than where that part ends.
    assert reserved[0][0] >= 64 * (1 << 16) and reserved[0][0] >= reserved[0][1]
    assert_same(torch.load(tmp_path / "a.pt"), sd)


def test_a_survey_stopped_early_still_records_every_version_at_the_call(tmp_path, monkeypatch):
    """Only the finding of storages waits: a tensor among the rest changed
    in place after the call (here, while the first part is laid out) is
    still caught, and nothing is committed."""
    from fastpersist import torch_zip, writer

    sd = {f"t{i}": torch.full((100,), float(i)) for i in range(20)}
    target = sd["t17"]
    real = torch_zip.TorchZipLayout._add_storages
    calls = []

    def add_storages(self, items, host=False):
        if not calls:
            target.add_(1)
        calls.append(len(items))
        return real(self, items, host)

    monkeypatch.setattr(writer, "SURVEY_FIRST", (0, 2))
    monkeypatch.setattr(torch_zip.TorchZipLayout, "_add_storages", add_storages)
    p = tmp_path / "a.pt"
    with pytest.raises(fastpersist.TensorChangedError, match="t17"):
        fastpersist.write_state_dict(sd, p)
    assert not p.exists()


def test_file_mode_gives_the_files_committed_in_the_block_that_mode(tmp_path):
    """options.file_mode(mode): the files this thread's saves commit in the
    block get exactly ``mode`` and the writer's owner, new or replacing a
    file of another mode (and owner); other threads' saves, and saves after
    the block, keep the replaced file's mode or follow the umask."""
    import stat
    import threading

    from fastpersist.options import file_mode

    def mode_of(p):
        return stat.S_IMODE(os.stat(p).st_mode)

    old = tmp_path / "old.pt"
    fastpersist.write_state_dict({"a": torch.ones(2)}, old)
    os.chmod(old, 0o644)
    if os.geteuid() == 0:
        os.chown(old, 1234, 4321)
    other = tmp_path / "other.pt"
    fastpersist.write_state_dict({"a": torch.ones(2)}, other)
    os.chmod(other, 0o640)
    seen = []
    with file_mode(0o600):
        fastpersist.write_state_dict({"a": torch.zeros(2)}, tmp_path / "new.pt")
        fastpersist.write_state_dict({"a": torch.zeros(2)}, old, format="safetensors")
        t = threading.Thread(target=lambda: seen.append(fastpersist.write_state_dict({"b": torch.ones(1)}, other)))
        t.start()
        t.join()
    assert mode_of(tmp_path / "new.pt") == 0o600
    assert mode_of(old) == 0o600 and os.stat(old).st_uid == os.geteuid()
    assert seen and mode_of(other) == 0o640  # another thread: the replaced file's mode
    fastpersist.write_state_dict({"a": torch.ones(2)}, old)
    assert mode_of(old) == 0o600  # after the block: the replaced file's, as always
    with pytest.raises(ValueError, match="outside 0o7777"):
        with file_mode(0o10000):
            fastpersist.write_state_dict({"a": torch.ones(2)}, tmp_path / "bad.pt")
    assert not (tmp_path / "bad.pt").exists()
