"""The fast path of pickling.pickle_obj (Rust, _core.fast_pickle): the very
bytes, storages and recorded versions of the pickler it stands in for, on
objects made of the common types; everything else is left to the pickler."""

from __future__ import annotations

import pickle
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any, Callable, List, Optional

import fastpersist
import numpy as np
import pytest
import torch
from fastpersist import pickling
from fastpersist.errors import SerializationError
from fastpersist.pickling import TensorVersions, find_storages, pickle_obj
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def _outcome(obj: Any, known: Optional[dict], versions: Optional[TensorVersions], fast: bool) -> tuple:
    old = pickling.FAST_PICKLE
    pickling.FAST_PICKLE = fast
    try:
        data, storages = pickle_obj(obj, known, versions)
    except Exception as e:  # noqa: BLE001 - compared below
        return ("error", type(e), str(e))
    finally:
        pickling.FAST_PICKLE = old
    # Tensors the pickling made (a Parameter's data, say) are new objects
    # each time: told by their shape and dtype.
    mine = set(TensorVersions(obj)._seen)
    seen = (
        [(i if i in mine else (tuple(t.shape), t.dtype), v) for i, (t, v) in versions._seen.items()]
        if versions is not None
        else None
    )
    return ("ok", data, [(k, id(s)) for k, s in storages.items()], seen)


def assert_same(
    obj: Any,
    known: Optional[Callable[[Any], dict]] = find_storages,
    versions: Optional[Callable[[Any], TensorVersions]] = TensorVersions,
    fast_taken: Optional[bool] = True,
) -> tuple:
    """pickle_obj's result (bytes, storages by key and identity, versions
    recorded, or the error raised) is the same with and without the fast
    path; ``fast_taken``: whether the fast path must (True) or must not
    (False) have written it."""
    k = known(obj) if known is not None else None
    fast = _outcome(obj, k, versions(obj) if versions is not None else None, True)
    slow = _outcome(obj, k, versions(obj) if versions is not None else None, False)
    assert fast[0] == slow[0], (fast, slow)
    if fast[0] == "ok":
        assert fast[1] == slow[1], _first_difference(fast[1], slow[1])
    assert fast[1:] == slow[1:]
    if fast_taken is not None:
        v = versions(obj) if versions is not None else None
        direct = pickling._fast_pickle(obj, k, v)
        assert (direct is not None) is fast_taken
        if direct is not None:
            assert direct[0] == slow[1]
    return slow


def _first_difference(a: bytes, b: bytes) -> str:
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"first difference at byte {i}: fast {a[max(0, i - 20) : i + 20]!r} slow {b[max(0, i - 20) : i + 20]!r}"


# ---------------------------------------------------------------------------
# Random objects of the supported types

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]

# String objects that may appear several times (one object each), among
# them the very strings the pickler writes itself ("storage", "cpu",
# storage keys): the memo shares them.
SHARED_STRINGS = ["storage", "cpu", "0", "1", "weight", "", "é\u20ac", "\ud800x"]


def _base(dtype: torch.dtype, n: int) -> torch.Tensor:
    t = torch.arange(n, dtype=torch.float64)
    if dtype is torch.bool:
        return t.remainder(2).bool()
    if dtype is torch.complex64:
        return torch.complex(t, -t).to(dtype)
    return t.to(dtype)


@st.composite
def tensor_pools(draw: Any) -> List[torch.Tensor]:
    """Tensors, among them views sharing a storage at other offsets, shapes
    and strides, non-contiguous ones, 0-dim and empty ones."""
    pool: List[torch.Tensor] = []
    for _ in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from(DTYPES))
        n = draw(st.integers(0, 24))
        base = _base(dtype, n)
        if dtype.is_floating_point and draw(st.booleans()):
            base.requires_grad_(True)
        pool.append(base)
        for _ in range(draw(st.integers(0, 3))):
            pool.append(draw(_view_of(base)))
    pool.append(torch.tensor(draw(st.integers(-5, 5))))  # 0-dim
    return pool


@st.composite
def _view_of(draw: Any, base: torch.Tensor) -> torch.Tensor:
    n = base.numel()
    src = base.detach()
    kind = draw(st.sampled_from(["strided", "slice", "scalar", "empty", "conj", "grad"]))
    if kind == "conj" and base.dtype is torch.complex64:
        return src.conj()
    if kind == "grad" and base.dtype.is_floating_point:
        return src[: n // 2].requires_grad_(True)
    if kind == "slice" and n:
        i = draw(st.integers(0, n - 1))
        return src[i : draw(st.integers(i, n))]
    if kind == "scalar" and n:
        return src[draw(st.integers(0, n - 1))]
    if kind == "empty":
        return src[n:]
    if not n:
        return src
    ndim = draw(st.integers(0, 3))
    size = [draw(st.integers(0, 4)) for _ in range(ndim)]
    stride = [draw(st.integers(0, 3)) for _ in range(ndim)]
    offset = draw(st.integers(0, n - 1))
    if all(size) and offset + sum((a - 1) * b for a, b in zip(size, stride)) >= n:
        return src
    return src.as_strided(size, stride, offset)


def _atoms(pool: List[torch.Tensor], strings: List[str]) -> Any:
    return st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.sampled_from([0, 255, 256, 65535, 65536, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**63, -(2**63), -1]),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=8),
        st.sampled_from(strings),
        st.sampled_from(pool),
    )


def _keys(strings: List[str]) -> Any:
    return st.one_of(st.text(max_size=6), st.integers(-300, 300), st.sampled_from(strings), st.none())


def _ordered(items: list, metadata: Any) -> OrderedDict:
    od: OrderedDict = OrderedDict(items)
    if metadata is not None:
        od._metadata = metadata  # type: ignore[attr-defined]
    return od


@st.composite
def objects(draw: Any) -> Any:
    pool = draw(tensor_pools())
    strings = SHARED_STRINGS
    leaf = _atoms(pool, strings)

    def extend(children: Any) -> Any:
        keys = _keys(strings)
        return st.one_of(
            st.lists(children, max_size=5),
            st.lists(children, max_size=5).map(tuple),
            st.dictionaries(keys, children, max_size=5),
            st.builds(
                _ordered,
                st.lists(st.tuples(keys, children), max_size=5),
                st.one_of(
                    st.none(),
                    st.dictionaries(st.text(max_size=3), st.dictionaries(st.just("version"), st.integers(0, 2))),
                    st.dictionaries(st.text(max_size=3), st.sampled_from(pool)),  # tensors in an attribute
                ),
            ),
        )

    obj = draw(st.recursive(leaf, extend, max_leaves=25))
    if draw(st.integers(0, 9)) == 0:
        # A container past one batch of 1000 items.
        n = draw(st.sampled_from([999, 1000, 1001, 2000, 2001]))
        item = draw(leaf)
        kind = draw(st.sampled_from(["list", "dict", "odict"]))
        big: Any = [item] * n if kind == "list" else {i: item for i in range(n)}
        obj = [obj, big if kind != "odict" else OrderedDict(big)]
    return obj


def _renamed_keys(obj: Any) -> dict:
    """Known keys other than the pickler's own (as a save's plan may give)."""
    return {c: (f"k{i}", s) for i, (c, (_, s)) in enumerate(find_storages(obj).items())}


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    obj=objects(),
    known=st.sampled_from(["found", "none", "renamed"]),
    versions=st.sampled_from(["walk", "empty", "none"]),
)
def test_same_bytes_as_the_pickler(obj: Any, known: str, versions: str) -> None:
    known_fn = {"found": find_storages, "none": None, "renamed": _renamed_keys}[known]
    versions_fn = {"walk": TensorVersions, "empty": lambda o: TensorVersions(), "none": None}[versions]
    assert_same(obj, known_fn, versions_fn)


# ---------------------------------------------------------------------------
# Edges, spelled out


@pytest.mark.parametrize("n", [0, 1, 2, 999, 1000, 1001, 1999, 2000, 2001])
@pytest.mark.parametrize("kind", [list, dict, OrderedDict, tuple])
def test_batches(n: int, kind: type) -> None:
    t = torch.ones(2)
    items = [(f"k{i}", t if i % 7 == 0 else i) for i in range(n)]
    obj = kind(items) if kind in (dict, OrderedDict) else kind(v for _, v in items)
    assert_same({"x": obj, "y": obj})


@pytest.mark.parametrize(
    "value",
    [0, 1, -1, 255, 256, 65535, 65536, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**63 - 1, 2**63, -(2**63),
     -(2**63) - 1, 2**64, -(2**64), 2**2040, -(2**2040), 2**4000, -(2**4000) + 1, 10**600],
)  # fmt: skip
def test_ints(value: int) -> None:
    assert_same([value, -value, {"v": value}])


def test_floats_and_strings() -> None:
    s = "shared"
    assert_same([0.0, -0.0, float("nan"), float("inf"), -1.5e300, 5e-324, s, s, "\ud800", "é" * 300, "a" * 70000, ""])


def test_recursive_containers() -> None:
    a: list = []
    a.append(a)
    d: dict = {}
    d["self"] = d
    inner: list = []
    t = (inner, torch.ones(1))
    inner.append(t)
    big: list = []
    tt = (big, 1, 2, 3, 4)
    big.append(tt)
    assert_same([a, d, t, tt])


def test_module_state_dict() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2, bias=False))
    model(torch.randn(5, 3))
    sd = model.state_dict()
    assert sd._metadata  # type: ignore[attr-defined]
    assert_same(sd)
    assert_same({"model": sd, "step": 3, "lrs": [0.1, 0.01]})


def test_tensor_metadata_argument() -> None:
    c = torch.complex(torch.arange(4.0), torch.ones(4))
    assert pickling._get_metadata is None or pickling._get_metadata(c.conj())
    assert_same({"conj": c.conj(), "neg": torch._neg_view(torch.arange(3.0))})


def test_views_and_shared_tensors() -> None:
    base = torch.arange(24.0)
    assert_same(
        {
            "base": base,
            "again": base,
            "slice": base[3:9],
            "t": base.view(4, 6).t(),
            "strided": base.as_strided((2, 3), (5, 2), 1),
            "zero_stride": base.as_strided((3, 3), (0, 1), 4),
            "scalar": base[5],
            "empty": base[24:],
            "nothing": torch.empty(0),
            "grad": torch.ones(3, requires_grad=True),
            "bf16": torch.ones(2, dtype=torch.bfloat16),
            "bool": torch.tensor([True, False]),
        }
    )


def test_globals_already_in_the_memo() -> None:
    """A tensor after another's storage type and OrderedDict were written."""
    assert_same([torch.ones(1), torch.ones(1, dtype=torch.int64), torch.ones(2), OrderedDict(a=1)])


def test_memo_past_256_entries() -> None:
    strings = [f"s{i}" for i in range(400)]
    assert_same({"s": strings, "again": strings[::-1], "t": [torch.ones(1) for _ in range(90)]})


# ---------------------------------------------------------------------------
# What the fast path leaves to the pickler


class _Thing:
    def __init__(self) -> None:
        self.x = 1


class _Dict(dict):
    pass


class _Tensor(torch.Tensor):
    pass


def _odict_with_attribute() -> OrderedDict:
    od: OrderedDict = OrderedDict(a=1)
    od.other = 2  # type: ignore[attr-defined]
    return od


def _tensor_with_attribute() -> torch.Tensor:
    t = torch.ones(2)
    t.note = "x"  # type: ignore[attr-defined]
    return t


UNSUPPORTED: List[Any] = [
    lambda: torch.nn.Parameter(torch.ones(2)),
    lambda: _Thing(),
    lambda: _Dict(a=1),
    lambda: {1, 2},
    lambda: b"bytes",
    lambda: torch.ones(2).as_subclass(_Tensor),
    lambda: torch.empty(3, device="meta"),
    lambda: torch.ones(3).untyped_storage(),
    lambda: torch.Size([1, 2]),
    lambda: torch.float32,
    lambda: torch.device("cpu"),
    lambda: torch.ones(2).to_sparse(),
    pytest.param(
        lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8),
        marks=pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor"),
    ),
    lambda: torch.ones(2, dtype=torch.uint16),
    lambda: _odict_with_attribute(),
    lambda: _tensor_with_attribute(),
    lambda: 3 + 4j,
    lambda: True.__class__,
]


@pytest.mark.parametrize("make", UNSUPPORTED)
def test_anything_else_goes_to_the_pickler(make: Callable[[], Any]) -> None:
    odd = make()
    sd = {"a": torch.ones(2), "b": [1, {"deep": (2, odd)}], "c": torch.zeros(3)}
    assert_same(sd, fast_taken=False)


def test_deep_nesting_goes_to_the_pickler() -> None:
    obj: Any = [torch.ones(1)]
    for _ in range(300):
        obj = [obj]
    assert_same(obj, fast_taken=False)


def test_an_extension_code_turns_the_fast_path_off(monkeypatch: pytest.MonkeyPatch) -> None:
    import copyreg

    monkeypatch.setitem(copyreg._extension_registry, ("collections", "OrderedDict"), 0x7FFF)  # type: ignore[attr-defined]
    monkeypatch.setitem(copyreg._inverted_registry, 0x7FFF, ("collections", "OrderedDict"))  # type: ignore[attr-defined]
    assert_same({"a": torch.ones(2)}, fast_taken=False)


def test_a_location_tagger_ahead_of_torchs_turns_the_fast_path_off(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = list(torch.serialization._package_registry)
    tagger = lambda s: "elsewhere" if s.device.type == "cpu" else None  # noqa: E731
    monkeypatch.setattr(torch.serialization, "_package_registry", [(0, tagger, registry[0][2]), *registry])
    slow = assert_same({"a": torch.ones(2)}, fast_taken=False)
    assert b"elsewhere" in slow[1]


@pytest.fixture
def dumps(monkeypatch: pytest.MonkeyPatch) -> List[Any]:
    """The objects the pickler (the slow path) was asked to dump."""
    pickle_obj([torch.ones(1), OrderedDict()])  # the fast path's lookups, done once
    seen: List[Any] = []
    dump = pickle.Pickler.dump

    def spy(self: Any, obj: Any) -> None:
        seen.append(obj)
        dump(self, obj)

    monkeypatch.setattr(pickling._Pickler, "dump", spy)
    return seen


def test_a_state_dict_takes_the_fast_path(dumps: List[Any]) -> None:
    sd = {f"layer{i}.weight": torch.randn(4, 4) for i in range(50)}
    data, storages = pickle_obj(sd, find_storages(sd), TensorVersions(sd))
    assert dumps == []
    assert list(storages) == [str(i) for i in range(50)]
    param = {"w": torch.nn.Parameter(torch.ones(1))}
    pickle_obj(param)
    assert dumps == [param]
    pickling.FAST_PICKLE = False
    try:
        assert pickle_obj(sd)[0] == data
    finally:
        pickling.FAST_PICKLE = True
    assert dumps[-1] is sd


def test_versions_added_as_the_pickler_adds_them() -> None:
    a, b = torch.ones(2), torch.zeros(3)
    sd = {"a": a, "b": [b, a]}
    fast, slow = TensorVersions(), TensorVersions()
    assert pickling._fast_pickle(sd, None, fast) is not None
    pickling.FAST_PICKLE = False
    try:
        pickle_obj(sd, None, slow)
    finally:
        pickling.FAST_PICKLE = True
    assert [t for t, _ in fast._seen.values()] == [a, b] == [t for t, _ in slow._seen.values()]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(obj=objects(), key_tensor=st.booleans())
def test_one_walk_finds_the_storages_and_records_the_versions(obj: Any, key_tensor: bool) -> None:
    """TensorVersions(obj, storages=True) walks the containers once and gets
    what find_storages and the versions' own walk get (a tensor used as a
    dict key, which the pickler pickles, is recorded too)."""
    key = torch.ones(2)
    if key_tensor:
        obj = {key: obj}
    one = TensorVersions(obj, storages=True)
    survey = one.survey_of(obj)
    assert survey is not None
    found = survey.storages
    expected = find_storages(obj)
    assert [(c, k, s._cdata) for c, (k, s) in found.items()] == [(c, k, s._cdata) for c, (k, s) in expected.items()]
    walked = TensorVersions(obj)._seen
    extra = {key_id: v for key_id, v in one._seen.items() if key_id not in walked}
    assert {i: (id(t), v) for i, (t, v) in walked.items()} == {
        i: (id(t), v) for i, (t, v) in one._seen.items() if i in walked
    }
    assert list(extra) == ([id(key)] if key_tensor else [])
    # Only for the object walked, and only when asked.
    assert one.survey_of([obj]) is None
    assert TensorVersions(obj).survey_of(obj) is None
    again = one.survey_of(obj)
    assert again is not None and again.storages is not found  # a dict of its own each time


def _odd_tensors() -> List[Any]:
    """Tensors the survey asks the Python helpers about, or skips: meta,
    empty, sparse, without a version counter, a Parameter, subclasses."""

    class Sub(torch.Tensor):
        pass

    with torch.inference_mode():
        inference = torch.ones(3)
    odd = [
        torch.empty(3, device="meta"),
        torch.empty(0),
        torch.zeros(4)[4:],
        torch.ones(2, 2).to_sparse(),
        torch.eye(3).to_sparse_csr(),
        torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
        torch.quantize_per_channel(torch.ones(2, 2), torch.tensor([0.1, 0.2]), torch.tensor([0, 0]), 0, torch.quint8),
        inference,
        torch.nn.Parameter(torch.ones(3)),
        torch.arange(4.0).as_subclass(Sub),
        torch.ones(2, dtype=torch.bfloat16),
    ]
    try:
        from torch.testing._internal.two_tensor import TwoTensor

        odd.append(TwoTensor(torch.ones(2), torch.zeros(2)))
    except ImportError:  # pragma: no cover - old torch
        pass
    stated = torch.ones(3)
    stated.note = torch.zeros(2)  # pickled after its storage
    # Objects the walk does not enter: some cannot hold storages, some may.
    odd += [stated, _Thing(), np.arange(3), np.array([None]), np.float32(1), torch.float16, torch.Size([2]), 1j]
    return odd


ODD = _odd_tensors()


def _surveyed(obj: Any, find: bool, fast: bool) -> tuple:
    """What a survey found and recorded, the extension's or Python's."""
    old = pickling.FAST_SURVEY
    pickling.FAST_SURVEY = fast
    try:
        versions = TensorVersions()
        if find:
            got = pickling.survey_storages(obj, versions)
            found = (
                [(c, k, s._cdata) for c, (k, s) in got.storages.items()],
                got.nbytes,
                [s._cdata for s in got.off_cpu],
                got.ordered,
            )
        else:
            versions._walk(obj)
            found = None
    finally:
        pickling.FAST_SURVEY = old
    return found, [(i, id(t), v) for i, (t, v) in versions._seen.items()]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(obj=objects(), extra=st.lists(st.sampled_from(range(len(ODD))), max_size=4), shape=st.integers(0, 4))
def test_the_extensions_survey_is_the_python_walk(obj: Any, extra: List[int], shape: int) -> None:
    """_core.survey finds the same storages (same keys, same order), their
    bytes and those off the CPU, and records the same versions in the same
    order, as the Python walk, in both modes (storages and keys, or versions
    of the values only)."""
    odd = [ODD[i] for i in extra]
    if shape == 1:
        keys = [t for t in odd if isinstance(t, Hashable)][:1]
        obj = {t: obj for t in keys} if keys else obj  # a tensor as a dict key
    elif shape == 2:
        od = OrderedDict([("a", odd), ("b", obj), ("c", 3)])
        od.move_to_end("a")  # OrderedDict order, not the dict's
        obj = od
    elif shape == 3:
        loop: List[Any] = [obj, odd]
        loop.append(loop)  # a container inside itself
        obj = loop
    else:
        obj = [obj, odd, tuple(odd)]
    for find in (True, False):
        assert _surveyed(obj, find, True) == _surveyed(obj, find, False)


def _with_metadata(od: OrderedDict, metadata: Any) -> OrderedDict:
    od._metadata = metadata  # type: ignore[attr-defined]
    return od


def test_the_survey_says_which_storages_the_pickler_meets_first() -> None:
    """``ordered``: the storages met before the first object the pickler
    may find other storages in; atoms (numbers, strings, dtypes, devices,
    sizes, numpy arrays of numbers) do not end them."""
    a, b, c = torch.ones(2), torch.zeros(3), torch.ones(4)
    stated = torch.ones(5)
    stated.note = c
    cases = [
        ({"a": a, "b": b}, 2),
        (
            {
                "n": 1,
                "s": "x",
                "d": torch.float16,
                "v": torch.device("cpu"),
                "z": torch.Size([1]),
                "np": np.arange(2),
                "f": np.float64(2),
                "a": a,
                "b": b,
            },
            2,
        ),  # fmt: skip
        ({"a": a, "obj": _Thing(), "b": b}, 1),
        ({"obj": _Thing(), "a": a}, 0),
        ({"a": a, "np": np.array([a], dtype=object), "b": b}, 1),
        ({"a": a, "s": stated, "b": b}, 2),  # its own storage, then its attributes
        ({"a": a, "sub": torch.ones(2).as_subclass(_Tensor), "b": b}, 1),
        ({"a": a, "d": _Dict(x=b), "c": c}, 1),  # a dict subclass is not entered
        ({"od": _with_metadata(OrderedDict(a=a), {"m": {"t": b}}), "c": c}, 3),  # its attributes after its items
        # Reductions that pickle other tensors: a sparse tensor's indices and
        # values, a nested tensor's buffer and sizes (before the next
        # storage); a quantized tensor's per-channel scales (after its own).
        ({"a": a, "s": torch.eye(2).to_sparse(), "b": b}, 1),
        ({"s": torch.eye(2).to_sparse_csr(), "a": a}, 0),
        ({"a": a, "n": torch.nested.nested_tensor([b, c]), "c": c}, 1),
        (
            {"a": a, "q": torch.quantize_per_channel(c.view(2, 2), b[:2] + 0.5, b[:2].long(), 0, torch.quint8), "b": b},
            2,
        ),
    ]
    for obj, ordered in cases:
        for fast in (True, False):
            old = pickling.FAST_SURVEY
            pickling.FAST_SURVEY = fast
            try:
                got = pickling.survey_storages(obj)
            finally:
                pickling.FAST_SURVEY = old
            assert got.ordered == ordered, (obj, fast)
            assert list(got.first()) == list(got.storages)[:ordered]


def test_the_survey_without_versions_and_with_an_overridden_add() -> None:
    a, b = torch.ones(2), torch.zeros(3)
    sd = {"a": a, "b": [b, a, (b,)], "c": OrderedDict(x=a)}
    got = pickling.survey_storages(sd)
    assert [s._cdata for _, s in got.storages.values()] == [a.untyped_storage()._cdata, b.untyped_storage()._cdata]
    assert got.nbytes == 8 + 12 and got.off_cpu == []

    class Recording(TensorVersions):
        def add(self, t: torch.Tensor) -> None:
            self.calls.append(t)
            super().add(t)

    v = Recording.__new__(Recording)
    v.calls = []
    Recording.__init__(v, sd, storages=True)  # its own add: every tensor met goes to it
    assert [id(t) for t in v.calls] == [id(a), id(b), id(a), id(b), id(a)]
    survey = v.survey_of(sd)
    assert survey is not None
    mine = survey.storages
    assert [(k, s._cdata) for k, s in mine.values()] == [(k, s._cdata) for k, s in got.storages.values()]


def test_a_save_walks_its_containers_once(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """write_state_dict finds the storages and records the versions in one
    walk of the object at the call (it walked it twice before)."""
    walks: List[str] = []
    real_find, real_walk = pickling.survey_storages, TensorVersions._walk

    def find(obj: Any, versions: Optional[TensorVersions] = None, limit: Any = None) -> pickling.Survey:
        walks.append("find")
        return real_find(obj, versions, limit)

    def walk(self: TensorVersions, obj: Any) -> None:
        walks.append("versions")
        real_walk(self, obj)

    monkeypatch.setattr(pickling, "survey_storages", find)
    monkeypatch.setattr(fastpersist.torch_zip, "survey_storages", find)
    monkeypatch.setattr(TensorVersions, "_walk", walk)
    sd = {"a": torch.arange(10.0), "b": [torch.ones(3), {"c": torch.zeros(2, 2)}], "step": 3}
    fastpersist.write_state_dict(sd, tmp_path / "a.pt")
    assert walks == ["find"]
    got = fastpersist.read_state_dict(tmp_path / "a.pt")
    assert torch.equal(got["b"][1]["c"], sd["b"][1]["c"]) and got["step"] == 3
    # A tensor changed in place during the save is still caught.
    sd["a"].add_(1)
    walks.clear()
    versions = TensorVersions(sd, storages=True)
    sd["b"][0].add_(1)
    with pytest.raises(fastpersist.TensorChangedError, match=r"\['b'\]\[0\]"):
        versions.check(sd)


def test_an_overridden_add_gets_the_pickler_calls() -> None:
    """A TensorVersions whose add is its own gets every tensor the pickler
    meets first, as the pickler's reducer passes them."""

    class Recording(TensorVersions):
        def add(self, t: torch.Tensor) -> None:
            self.calls.append(t)
            super().add(t)

    a, b = torch.ones(2), torch.zeros(3)
    sd = {"a": a, "b": [b, a, (b,)], "c": OrderedDict(x=a)}
    calls = []
    for fast in (True, False):
        v = Recording.__new__(Recording)
        v.calls = []
        Recording.__init__(v, sd)
        v.calls.clear()
        if fast:
            assert pickling._fast_pickle(sd, None, v) is not None
        else:
            assert _outcome(sd, None, v, False)[0] == "ok"
        calls.append([id(t) for t in v.calls])
    assert calls[0] == calls[1] == [id(a), id(b)]


def test_a_fast_path_that_cannot_start_leaves_it_to_the_pickler(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> None:
        raise AttributeError("another torch")

    monkeypatch.setattr(pickling, "_fast_context", broken)
    assert_same({"a": torch.ones(2)}, fast_taken=False)


def test_other_threads_run_during_a_long_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    """The walk lets go of the GIL now and then (the engine's copies wait
    for it): a thread waiting for the GIL runs in the middle of the walk.
    The walk is seen through its metadata function, here a C method that
    notes each tensor without running Python code (so without the
    interpreter's own switch points)."""
    import sys
    import threading

    walked: List[Any] = []
    monkeypatch.setattr(pickling, "_metadata_fn", lambda: walked.append)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    sd = {f"t{i}": torch.ones(1) for i in range(20000)}
    seen: List[int] = []
    started, stop = threading.Event(), threading.Event()

    def other() -> None:
        started.set()
        while not stop.is_set():
            seen.append(len(walked))

    thread = threading.Thread(target=other)
    try:
        thread.start()
        started.wait()
        assert pickling._fast_pickle(sd, None, None) is not None
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(old)
    assert len(walked) == len(sd)
    assert any(0 < n < len(sd) for n in seen)


# ---------------------------------------------------------------------------
# Errors, as before


def test_a_shrunk_storage_raises_as_before() -> None:
    t = torch.zeros(10)
    t.untyped_storage().resize_(8)
    slow = assert_same({"t": t}, fast_taken=False)
    assert slow[0] == "error" and slow[1] is SerializationError and "needs 40 bytes" in slow[2]
    with pytest.raises(SerializationError, match="the storage was resized or freed under it"):
        pickle_obj({"t": t})


def test_a_zero_tensor_raises_as_before() -> None:
    z = torch._efficientzerotensor(3)
    slow = assert_same({"ok": torch.ones(1), "z": z}, fast_taken=False)
    assert slow[0] == "error"
    with pytest.raises(SerializationError, match="a zero tensor"):
        pickle_obj({"ok": torch.ones(1), "z": z})


def test_one_memory_as_two_dtypes_raises_as_before() -> None:
    c = torch.zeros(2, dtype=torch.complex64)
    slow = assert_same({"c": c, "real": c.real}, fast_taken=False)
    assert slow[0] == "error" and "as different types" in slow[2]


def test_an_exception_in_versions_add_raises_as_before() -> None:
    class Broken(TensorVersions):
        def add(self, t: torch.Tensor) -> None:
            raise ValueError("no")

    slow = assert_same({"a": torch.ones(1)}, None, lambda o: Broken(), fast_taken=False)
    assert slow[0] == "error" and slow[1] is SerializationError and "ValueError: no" in slow[2]


# ---------------------------------------------------------------------------
# End to end


def test_written_file_loads_with_weights_only(tmp_path: Any, dumps: List[Any]) -> None:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    base = torch.arange(12.0)
    sd = {
        "model": model.state_dict(),
        "views": [base, base[2:5], base.view(3, 4).t()],
        "c": torch.complex(torch.ones(2), torch.zeros(2)).conj(),
        "bf16": torch.ones(3, dtype=torch.bfloat16),
        "step": 7,
        "big": 2**80,
        "name": "run",
    }
    path = tmp_path / "a.pt"
    fastpersist.write_state_dict(sd, path)
    assert dumps == []
    got = torch.load(path, weights_only=True)
    assert got.keys() == sd.keys() and got["step"] == 7 and got["big"] == 2**80 and got["name"] == "run"
    for name, t in sd["model"].items():
        assert torch.equal(got["model"][name], t) and got["model"][name].dtype == t.dtype
    assert got["model"]._metadata == sd["model"]._metadata
    assert all(torch.equal(a, b) for a, b in zip(got["views"], sd["views"]))
    assert got["views"][1].untyped_storage().data_ptr() == got["views"][0].untyped_storage().data_ptr()
    assert got["c"].is_conj() and torch.equal(got["c"], sd["c"])
    assert torch.equal(got["bf16"], sd["bf16"])
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    fresh.load_state_dict(got["model"])


def _data_pkl(path: Any) -> bytes:
    import zipfile

    with zipfile.ZipFile(path) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))


@pytest.mark.parametrize(
    "obj",
    [
        {"0": torch.ones(2)},
        {"tag": "1", "a": torch.ones(2), "b": torch.zeros(3)},
        {"9": [torch.ones(1)] * 3, **{str(i): torch.full((2,), float(i)) for i in range(12)}},
        {"10": torch.ones(2), "kind": "storage", "device": "cpu"},
    ],
    ids=["key-0", "value-1", "digits", "longer"],
)
def test_storage_keys_pickle_as_torch_save_makes_them(tmp_path: Any, obj: Any) -> None:
    """Regression: the survey made storage keys as Python strings from Rust
    ones, and CPython hands out its one cached object for a one-character
    string: a "0".."9" pickled before the storage of that key was met by the
    fast pickler's memo (a back-reference where torch.save, whose keys are
    ``str(len(id_map))``, fresh objects, writes the string out). The keys
    are now made as torch makes them, and data.pkl is torch.save's."""
    torch.save(obj, tmp_path / "torch.pt")
    fastpersist.write_state_dict(obj, tmp_path / "fp.pt")
    assert _data_pkl(tmp_path / "fp.pt") == _data_pkl(tmp_path / "torch.pt")
