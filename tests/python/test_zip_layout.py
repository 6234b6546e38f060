"""The zip headers the Rust core spells (``_core.zip_*``) against a
reference written with ``struct`` from the zip specification and miniz's
padding rule (what ``torch_zip`` did in Python before): byte for byte,
zip64 cases included (offsets and sizes past 4 GiB, more than 65535
entries), which no test file is large enough to reach."""

from __future__ import annotations

import struct

from fastpersist import _core
from fastpersist.plan import Blob, Region, Slot
from helpers import byte_runs
from hypothesis import given, settings
from hypothesis import strategies as st

U32, U16 = 0xFFFFFFFF, 0xFFFF


def flags(size: int) -> int:
    """Bit 3 (a data descriptor follows) only where data does, as torch's
    writer (miniz) writes an empty record; bit 11 (UTF-8 names)."""
    return 0x0808 if size else 0x0800


LOCAL = struct.Struct("<IHHHHHIIIHH")
CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")


def ref_local(name: bytes, off: int, size: int, align: int) -> bytes:
    z64 = b""
    if size >= U32 or off >= U32:
        fields = b""
        if size >= U32:
            fields += struct.pack("<QQ", 0, 0)
        if off >= U32:
            fields += struct.pack("<Q", off)
        z64 = struct.pack("<HH", 0x0001, len(fields)) + fields
    pad = (-(off + LOCAL.size + len(name) + len(z64) + 4)) % align
    extra = z64 + struct.pack("<HH", 0x4246, pad) + b"Z" * pad
    ver = 20 if size < U32 and off < U32 else 45
    return LOCAL.pack(0x04034B50, ver, flags(size), 0, 0, 0, 0, 0, 0, len(name), len(extra)) + name + extra


def ref_sizes(off: int, size: int) -> bytes:
    wide = size >= U32 or off >= U32
    return struct.pack("<QQ", size, size) if wide else struct.pack("<II", size, size)


def ref_central(name: bytes, off: int, size: int, crc: int) -> bytes:
    fields = b""
    if size >= U32:
        fields += struct.pack("<QQ", size, size)
    if off >= U32:
        fields += struct.pack("<Q", off)
    extra = struct.pack("<HH", 0x0001, len(fields)) + fields if fields else b""
    small = min(size, U32)
    head = CENTRAL.pack(
        0x02014B50, (3 << 8) | 45, 45 if fields else 20, flags(size), 0, 0, 0, crc, small, small, len(name), len(extra),
        0, 0, 0, 0, min(off, U32),
    )  # fmt: skip
    return head + name + extra


def ref_end(n: int, cd_start: int, cd_size: int) -> bytes:
    out = b""
    if n >= U16 or cd_size >= U32 or cd_start >= U32:
        e64 = cd_start + cd_size
        out += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, (3 << 8) | 45, 45, 0, 0, n, n, cd_size, cd_start)
        out += struct.pack("<IIQI", 0x07064B50, 0, e64, 1)
    return out + struct.pack(
        "<IHHHHIIH", 0x06054B50, 0, 0, min(n, U16), min(n, U16), min(cd_size, U32), min(cd_start, U32), 0
    )


def assemble(blobs, slots, crcs) -> bytes:
    """The bytes that blobs and filled-in slots make, from the first offset."""
    pieces = [(b.offset, b.data) for b in blobs] + [(s.offset, struct.pack("<I", crcs[s.crc_id])) for s in slots]
    pieces.sort()
    start = pieces[0][0]
    out = bytearray()
    for off, data in pieces:
        assert off == start + len(out), "pieces must be contiguous"
        out += data
    return bytes(out)


offsets = st.one_of(st.integers(0, 1 << 20), st.integers(U32 - 100, U32 + 100), st.integers(0, 1 << 50))
sizes = st.one_of(st.integers(0, 1 << 20), st.integers(U32 - 2, U32 + 2), st.integers(0, 1 << 45))
names = st.binary(min_size=1, max_size=80)
aligns = st.sampled_from([64, 128, 4096, 1 << 15])


@given(names, offsets, sizes, aligns)
@settings(max_examples=400, deadline=None)
def test_headers_match_the_reference(name, off, size, align):
    assert _core.zip_local_header(name, off, size, align) == ref_local(name, off, size, align)
    assert _core.zip_descriptor_sizes(off, size) == ref_sizes(off, size)
    assert _core.zip_local_header_len(len(name), off, size, align) == len(ref_local(name, off, size, align))


@given(st.lists(st.tuples(names, sizes, st.booleans()), min_size=1, max_size=20), offsets, aligns)
@settings(max_examples=150, deadline=None)
def test_storage_records_match_the_reference(recs, start, align):
    records = [(b"archive/data/%d/" % i + name, size, 0x1000 + i, i, staged) for i, (name, size, staged) in
               enumerate(recs)]  # fmt: skip
    blobs, regions, slots, offs, end = _core.zip_storage_records(start, align, records, (Blob, Region, Slot))
    at, want_regions, want = start, [], []
    crcs = {i: 0xA0000000 + i for i in range(len(records))}
    for (name, size, addr, crc_id, staged), (h_off, d_off) in zip(records, offs):
        head = ref_local(name, at, size, align)
        assert (h_off, d_off) == (at, at + len(head))
        if size and not staged:
            want_regions.append(Region(d_off, addr, size, crc_id))
        tail = struct.pack("<II", 0x08074B50, crcs[crc_id]) + ref_sizes(at, size) if size else b""
        at = d_off + size + len(tail)
        want.append((h_off, head, d_off + size, tail))
    assert regions == want_regions and all(type(r) is Region for r in regions)
    assert end == at
    # Everything but the data: each record's header, then its descriptor
    # (how the bytes are cut into pieces is the binding's business).
    got = [(b.offset, b.data) for b in blobs] + [(s.offset, struct.pack("<I", crcs[s.crc_id])) for s in slots]
    assert all(type(b) is Blob for b in blobs) and all(type(s) is Slot for s in slots)
    expected = [(h_off, head) for h_off, head, _, _ in want] + [(t_off, tail) for _, _, t_off, tail in want]
    assert byte_runs(got) == byte_runs(expected)


@given(st.lists(st.tuples(names, offsets, sizes, st.booleans()), min_size=0, max_size=30), offsets)
@settings(max_examples=150, deadline=None)
def test_central_directory_matches_the_reference(entries, start):
    ents = [(name, off, size, None if slot else 0x1234 + i, i if slot else None) for i, (name, off, size, slot) in
            enumerate(entries)]  # fmt: skip
    crcs = {i: 0xB0000000 + i for i in range(len(ents))}
    blobs, slots, end = _core.zip_central_directory(start, ents, (Blob, Slot))
    want = b"".join(ref_central(n, o, s, crcs[i] if cid is not None else crc) for i, (n, o, s, crc, cid) in
                    enumerate(ents))  # fmt: skip
    want += ref_end(len(ents), start, len(want))
    assert assemble(blobs, slots, crcs) == want
    assert blobs[0].offset == start and end == start + len(want)
    assert len(slots) == sum(cid is not None for *_, cid in ents)


def test_zip64_end_records_past_65535_entries():
    ents = [(b"n", i, 1, 7, None) for i in range(70_000)]
    blobs, slots, end = _core.zip_central_directory(0, ents, (Blob, Slot))
    data = assemble(blobs, slots, {})
    assert data.endswith(ref_end(70_000, 0, 70_000 * 47)) and not slots


def test_bad_alignment_and_long_names_are_value_errors():
    import pytest

    for align in (0, 3, 1 << 16):
        with pytest.raises(ValueError, match="alignment"):
            _core.zip_local_header(b"n", 0, 1, align)
    with pytest.raises(ValueError, match="65535"):
        _core.zip_local_header(b"n" * 70_000, 0, 1, 64)
    with pytest.raises(ValueError, match="65535"):
        _core.zip_storage_records(0, 64, [(b"n" * 70_000, 1, 1, 0, False)], (Blob, Region, Slot))
    # Records are read one by one (an engine thread let in between batches):
    # a malformed one is named.
    recs = [(b"n%d" % i, 1, 1, i, False) for i in range(300)]
    recs[299] = (b"bad", 1)
    with pytest.raises(TypeError, match=r"records\[299\]"):
        _core.zip_storage_records(0, 64, recs, (Blob, Region, Slot))
    with pytest.raises(TypeError, match=r"entries\[0\]"):
        _core.zip_central_directory(0, [(b"n", 0)], (Blob, Slot))


def _laid_out(obj, **kw) -> tuple:
    """Everything a TorchZipLayout of ``obj`` produces, head parts and tail."""
    import torch  # noqa: F401 - the layout's objects
    from fastpersist.torch_zip import TorchZipLayout

    z = TorchZipLayout(obj, **kw)
    parts = [(p.blobs, p.regions, p.slots, p.device, p.end) for p in z.head_parts()]
    tail = z.tail()
    parts.append((tail.blobs, tail.regions, tail.slots, tail.device, tail.end))
    owners = {i: (id(st), ptr, n, name) for i, (st, ptr, n, name) in z.guard._owners.items()}
    return (
        parts, z.records, z.entries, [id(s) for s in z.keepalive], owners, z.storage_keys, z.storage_bytes,
        z.cursor, z.file_len,
    )  # fmt: skip


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 200_000), min_size=0, max_size=400),
    shared=st.booleans(),
)
def test_host_storages_laid_out_in_chunks_as_one_by_one(sizes, shared) -> None:
    """Storages in host memory, none staged, are laid out a chunk at a time
    (the common case); the layout is the very one of the record-by-record
    path (taken when a stage predicate is given), across chunk and part
    boundaries: headers, regions, slots, records, entries, guard, keys."""
    import torch
    from fastpersist import torch_zip

    tensors = [torch.full((n // 4,), float(i)) for i, n in enumerate(sizes)]
    obj = {f"t{i}": t for i, t in enumerate(tensors)}
    if shared and tensors:
        obj["view"] = tensors[0][:1]  # a storage met twice
    assert _laid_out(obj) == _laid_out(obj, stage=lambda st: False)
    # Many records: the chunked path does run (more records than a chunk).
    assert torch_zip.HOST_CHUNK < 400


def test_a_state_dict_in_host_memory_takes_the_chunked_path(monkeypatch) -> None:
    import torch
    from fastpersist import torch_zip

    calls = []
    real = torch_zip.TorchZipLayout._host_records
    monkeypatch.setattr(
        torch_zip.TorchZipLayout,
        "_host_records",
        lambda self, items: calls.append(len(items)) or real(self, items),
    )
    obj = {f"t{i}": torch.ones(1000) for i in range(300)}
    _laid_out(obj)
    assert sum(calls) == 300
    calls.clear()
    _laid_out(obj, stage=lambda st: False)  # a stage predicate: one by one
    assert calls == []
