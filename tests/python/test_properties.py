"""Property tests (hypothesis): the partitioner, and random state dicts."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile

import fastpersist
import pytest
import torch
from fastpersist import _core
from helpers import all_dtypes, assert_same, make
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


@st.composite
def layouts(draw):
    n = draw(st.integers(0, 30))
    segs, off = [], 0
    for _ in range(n):
        off += draw(st.integers(0, 10_000))
        ln = draw(st.integers(1, 50_000))
        segs.append((off, ln))
        off += ln
    file_len = off + draw(st.integers(0, 9000))
    block = draw(st.sampled_from([512, 4096, 65536]))
    max_len = block * draw(st.integers(1, 64))
    parts = draw(st.integers(1, 8))
    return segs, file_len, block, max_len, parts


@given(layouts())
@settings(max_examples=300, deadline=None)
def test_partitioner_covers_every_byte_once(case):
    segs, file_len, block, max_len, parts = case
    out = _core.partition(segs, file_len, block, max_len, parts)
    padded = -(-file_len // block) * block
    assert len(out) == parts
    sizes = [hi - lo for (lo, hi), _ in out]
    assert max(sizes) - min(sizes) <= block  # balanced within one block
    assert out[0][0][0] == 0 and out[-1][0][1] == padded
    covered = bytearray(padded)
    seg_bytes = [0] * len(segs)
    prev_hi = 0
    for (lo, hi), extents in out:
        assert lo == prev_hi and lo % block == 0
        prev_hi = hi
        for off, ln, pieces in extents:
            assert off % block == 0 and ln % block == 0 and 0 < ln <= max_len
            assert lo <= off and off + ln <= hi
            for i in range(off, off + ln, block):
                covered[i] += 1  # per block is enough: extents are block multiples
            for seg, seg_off, buf_off, pl in pieces:
                s_off, s_len = segs[seg]
                assert s_off + seg_off == off + buf_off  # lands where it belongs
                assert buf_off + pl <= ln and seg_off + pl <= s_len
                seg_bytes[seg] += pl
    assert all(covered[i] == 1 for i in range(0, padded, block))
    assert seg_bytes == [ln for _, ln in segs]  # every segment byte exactly once


DTYPES = all_dtypes()


@st.composite
def tensors(draw, pool):
    kind = draw(st.sampled_from(["new", "new", "view", "noncontig", "scalar", "empty"]))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**31))
    if kind == "scalar":
        return make((), dtype, seed)
    if kind == "empty":
        return make((0, draw(st.integers(0, 5))), dtype, seed)
    if kind in ("view", "noncontig") and pool:
        base = draw(st.sampled_from(pool))
        if base.dim() >= 1 and base.shape[0] > 1:
            if kind == "view":
                lo = draw(st.integers(0, base.shape[0] - 1))
                return base[lo:]
            return base[::2]
    shape = tuple(draw(st.lists(st.integers(1, 40), min_size=1, max_size=3)))
    t = make(shape, dtype, seed)
    pool.append(t)
    return t


@st.composite
def state_dicts(draw):
    pool: list = []
    leaf = st.one_of(
        tensors(pool),
        st.integers(-(10**12), 10**12),
        st.floats(allow_nan=False),
        st.text(max_size=8),
        st.none(),
        st.booleans(),
    )
    tree = st.recursive(
        leaf,
        lambda kids: st.one_of(
            st.lists(kids, max_size=4),
            st.tuples(kids, kids),
            st.dictionaries(st.text(min_size=1, max_size=6), kids, max_size=4),
        ),
        max_leaves=25,
    )
    return draw(st.dictionaries(st.text(min_size=1, max_size=10), tree, min_size=1, max_size=6))


@given(state_dicts(), st.sampled_from([(True, True), (False, False), (True, False)]))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_random_state_dicts_round_trip(sd, backends):
    direct, uring = backends
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "r.pt")
        fastpersist.write_state_dict(sd, p, direct=direct, io_uring=uring, block_size=64 << 10, arena_bytes=256 << 10)
        with zipfile.ZipFile(p) as z:
            assert z.testzip() is None
        assert_same(sd, torch.load(p, weights_only=True))
        assert_same(sd, torch.load(p, mmap=True, weights_only=True))
        assert os.listdir(d) == ["r.pt"]


@pytest.mark.parametrize(
    "args",
    [
        "[(0, 10)], 4096, 4096, 4096, 2**40",
        "[(0, 2**62)], 2**62, 4096, 4096, 1",
        "[(0, 10)], 2**60, 4096, 1, 1",
        "[(0, 10)], 4096, 4096, 4096, 0",
    ],
    ids=["parts", "segment", "extents", "no-parts"],
)
def test_partition_refuses_sizes_it_cannot_hold(args):
    """Regression (found in a review): ``_core.partition`` with a huge
    ``parts``, segment or extent count aborted the interpreter (an
    allocation failure), where ``split_ranges`` raises ValueError."""
    code = f"from fastpersist import _core\ntry:\n    _core.partition({args})\nexcept ValueError as e:\n    print('ValueError', e)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("ValueError"), (out.returncode, out.stdout, out.stderr[-500:])
