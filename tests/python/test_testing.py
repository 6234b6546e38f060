"""fastpersist.testing: its strategies drive a property test of fastpersist
itself (write, then read with read_state_dict and torch.load, exactly), and
its comparison catches what it promises to catch."""

from __future__ import annotations

import dataclasses
import tempfile

import pytest
import torch
from fastpersist.testing import (
    assert_roundtrip,
    assert_same_state,
    optimizer_states,
    saveable_dtypes,
    state_dicts,
    tensors,
)
from hypothesis import HealthCheck, given, settings


@pytest.fixture(autouse=True, scope="module")
def _nondeterministic():
    """torch cannot make or load tensors of some experimental dtypes
    (bits16, bcomplex32) with deterministic algorithms on, and an earlier
    test (Lightning's ``deterministic=True``) may have left them on."""
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(False)
    yield
    torch.use_deterministic_algorithms(was, warn_only=warn_only)


_FAST = {"durable": False}  # no fsync: these files are thrown away
_SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))


@given(state_dicts())
@_SETTINGS
def test_state_dicts_roundtrip(sd):
    with tempfile.TemporaryDirectory() as d:
        assert_roundtrip(sd, f"{d}/ck.pt", write_kwargs=_FAST)


@given(state_dicts(wrapper_subclasses=True, optimizer=False))
@_SETTINGS
def test_state_dicts_with_wrapper_subclasses_roundtrip(sd):
    with tempfile.TemporaryDirectory() as d:
        assert_roundtrip(sd, f"{d}/ck.pt", write_kwargs=_FAST, weights_only=False)


@given(tensors())
@_SETTINGS
def test_single_tensors_roundtrip(t):
    with tempfile.TemporaryDirectory() as d:
        assert_roundtrip({"t": t, "again": t}, f"{d}/t.pt", write_kwargs=_FAST)


@given(optimizer_states())
@_SETTINGS
def test_optimizer_states_roundtrip(state):
    with tempfile.TemporaryDirectory() as d:
        assert_roundtrip(state, f"{d}/o.pt", write_kwargs=_FAST, verify=True)


def test_saveable_dtypes_cover_torchs():
    names = {str(d) for d in saveable_dtypes()}
    for n in ("float32", "bfloat16", "complex64", "bool", "uint8", "int64"):
        assert f"torch.{n}" in names
    for n in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"):
        if hasattr(torch, n):
            assert f"torch.{n}" in names


def test_comparison_sees_nan_payloads():
    a = torch.tensor([float("nan")], dtype=torch.float32)
    b = a.view(torch.int32).add(1).view(torch.float32)  # another NaN
    assert torch.isnan(b).all()
    with pytest.raises(AssertionError, match="storage bytes differ"):
        assert_same_state({"x": a}, {"x": b})


def test_comparison_sees_sharing_strides_and_types():
    base = torch.arange(6.0)
    with pytest.raises(AssertionError, match="sharing"):
        assert_same_state([base, base[1:]], [base.clone(), base.clone()[1:]])
    with pytest.raises(AssertionError, match="stride"):
        assert_same_state(base.reshape(2, 3).t(), base.reshape(2, 3).t().contiguous())
    with pytest.raises(AssertionError, match=r"\['a'\]: type"):
        assert_same_state({"a": (1,)}, {"a": [1]})
    with pytest.raises(AssertionError, match="bits"):
        assert_same_state(float("nan"), -float("nan"))
    assert_same_state({"a": [base, base[2:]]}, {"a": [base, base[2:]]})


def test_roundtrip_reports_which_reader_differs(tmp_path, monkeypatch):
    import fastpersist.testing as testing

    real = testing.read_state_dict
    monkeypatch.setattr(testing, "read_state_dict", lambda p, **kw: {"w": real(p, **kw)["w"] + 1})
    with pytest.raises(AssertionError, match=r"read_state_dict.*\['w'\]"):
        assert_roundtrip({"w": torch.zeros(3)}, tmp_path / "x.pt")


def test_roundtrip_of_a_safetensors_file_compares_it_as_safetensors_keeps_it(tmp_path, monkeypatch):
    """Regression: assert_roundtrip(..., write_kwargs={"format":
    "safetensors"}) failed on any dict not already in name order (the
    safetensors header is sorted) and then read the file with torch.load.
    Views and OrderedDicts are fine too; a wrong value is still caught,
    and named with the reader that gave it."""
    import collections

    import fastpersist.testing as testing

    base = torch.arange(12, dtype=torch.float32)
    sd = collections.OrderedDict([("b", base[2:8]), ("a", torch.ones(2, 3).t()), ("c", torch.zeros(0))])
    got = assert_roundtrip(sd, tmp_path / "x.safetensors", write_kwargs={"format": "safetensors"})
    assert list(got) == ["a", "b", "c"]
    real = testing.read_state_dict
    monkeypatch.setattr(testing, "read_state_dict", lambda p, **kw: {**real(p, **kw), "a": torch.ones(3, 2) * 2})
    with pytest.raises(AssertionError, match=r"read_state_dict.*\['a'\]"):
        assert_roundtrip(sd, tmp_path / "y.safetensors", write_kwargs={"format": "safetensors"})


@dataclasses.dataclass
class _Holder:
    w: torch.Tensor


def test_assert_same_state_compares_what_pickling_keeps(tmp_path):
    """Regression: assert_roundtrip failed on objects that round-trip
    exactly (a module, compared by identity; a numpy array or a dataclass
    holding a tensor, whose == raised; a complex NaN) and passed objects
    that differ (sparse CSR values, a quantized tensor's scale, a tensor's
    attributes, a defaultdict's factory)."""
    import collections

    import numpy as np
    from fastpersist.testing import assert_roundtrip, assert_same_state

    torch.manual_seed(0)
    for i, obj in enumerate(
        [
            {"m": torch.nn.Linear(2, 2)},
            {"a": np.arange(3.0), "s": np.float32(1.5)},
            {"d": _Holder(torch.ones(2))},
            {"c": complex(float("nan"), 0.0)},
        ]
    ):
        assert_roundtrip(obj, tmp_path / f"{i}.pt", weights_only=False)

    def differ(a, b):
        with pytest.raises(AssertionError):
            assert_same_state({"x": a}, {"x": b})

    differ(torch.eye(3).to_sparse_csr(), (torch.eye(3) * 5).to_sparse_csr())
    differ(
        torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8),
        torch.quantize_per_tensor(torch.ones(4) * 2, 0.2, 0, torch.qint8),
    )
    t1, t2 = torch.ones(2), torch.ones(2)
    t1.note, t2.note = "a", "b"
    differ(t1, t2)
    differ(collections.defaultdict(list), collections.defaultdict(int))
    differ(np.array([1.0, 2.0]), np.array([1.0, 3.0]))
    differ(_Holder(torch.ones(2)), _Holder(torch.zeros(2)))
    differ(complex(1.0, 0.0), complex(1.0, -0.0))
    assert_same_state({"x": _Holder(torch.ones(2))}, {"x": _Holder(torch.ones(2))})


def test_comparison_sees_lost_attributes_and_key_and_member_types(tmp_path):
    """Regression: assert_same_state passed results that differ: an
    OrderedDict's own attributes were never compared (a state_dict whose
    ``_metadata``, which load_state_dict uses for version migrations, was
    lost passed), and dict keys and set members were compared with ``==``
    (``{1: x}`` passed as ``{True: x}`` and ``{1.0: x}``, ``{1, 2}`` as
    ``{1.0, 2.0}``). A module's state_dict still round-trips, ``_metadata``
    included."""
    import collections

    sd = torch.nn.BatchNorm1d(2).state_dict()
    assert sd._metadata
    with pytest.raises(AssertionError, match="_metadata"):
        assert_same_state(sd, collections.OrderedDict(sd))
    changed = collections.OrderedDict(sd)
    changed._metadata = {"": {"version": 1}}
    with pytest.raises(AssertionError, match="_metadata"):
        assert_same_state(sd, changed)
    one = torch.ones(1)
    for exp, got in [
        ({1: one}, {True: one}),
        ({1: "x"}, {1.0: "x"}),
        ({0.0: "x"}, {-0.0: "x"}),
        ({(1, "a"): "x"}, {(1.0, "a"): "x"}),
        ({"s": {1, 2}}, {"s": {1.0, 2.0}}),
        ({"s": frozenset({1})}, {"s": frozenset({True})}),
        ({"s": {(1, 2)}}, {"s": {(1, 2.0)}}),
    ]:
        with pytest.raises(AssertionError, match="type|bits"):
            assert_same_state(exp, got)
    with pytest.raises(AssertionError, match="members"):
        assert_same_state({"s": {1, 2}}, {"s": {1, 3}})
    assert_same_state(
        {1: "x", "s": {1, 2.5, (3, "a"), frozenset({True})}}, {1: "x", "s": {2.5, 1, (3, "a"), frozenset({True})}}
    )
    assert_roundtrip(
        {"sd": sd, "keys": {True: 2, 2.5: 3, -0.0: 4}, "s": {1, 2.0}}, tmp_path / "k.pt", weights_only=False
    )


def test_comparison_takes_nested_tensors_apart(tmp_path):
    """Regression: assert_same_state crashed on nested tensors (it asked for
    their strides and storage: "NestedTensorImpl doesn't support sizes").
    They are compared through their components (and dtype, layout,
    requires_grad), a difference in one is caught, and they round-trip."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "prototype stage"
        nt = torch.nested.nested_tensor([torch.arange(2.0), torch.arange(3.0)])
        other = torch.nested.nested_tensor([torch.arange(2.0), torch.arange(3.0) + 1])
        shorter = torch.nested.nested_tensor([torch.arange(2.0)])
        jagged = torch.nested.nested_tensor([torch.arange(2.0), torch.arange(3.0)], layout=torch.jagged)
    assert_same_state({"n": nt}, {"n": nt})
    assert_same_state({"n": nt}, {"n": nt.clone()})
    for got in (other, shorter, jagged):
        with pytest.raises(AssertionError):
            assert_same_state({"n": nt}, {"n": got})
    with pytest.raises(AssertionError):
        assert_same_state({"n": nt}, {"n": torch.ones(2)})
    assert_roundtrip({"n": nt, "w": torch.ones(2)}, tmp_path / "n.pt", weights_only=False)


@given(state_dicts(nested_tensors=True, optimizer=False))
@_SETTINGS
def test_state_dicts_with_nested_tensors_roundtrip(sd):
    with tempfile.TemporaryDirectory() as d:
        assert_roundtrip(sd, f"{d}/ck.pt", write_kwargs=_FAST, weights_only=False)


class _Step(int):
    pass


class _Plain:
    """A hashable object (by identity) holding a tensor."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def test_comparison_follows_identity_cycles_storages_sets_and_container_items(tmp_path):
    """Regression: assert_same_state raised RecursionError on a container
    inside itself, failed a TypedStorage and a set of tensors or objects
    against their exact torch.load, and passed objects that differ: deques
    of other items, int subclasses with other attributes, and one tensor
    twice against two tensors (torch.load keeps ``x[0] is x[1]``: tied
    weights)."""
    import collections

    from fastpersist.testing import assert_roundtrip, assert_same_state

    loop: list = [torch.ones(1)]
    loop.append(loop)
    own: dict = {"t": torch.ones(1)}
    own["self"] = own
    t = torch.arange(4.0)
    for i, obj in enumerate(
        [
            loop,
            own,
            {"s": torch.arange(3.0).storage()},  # (an UntypedStorage loads as a TypedStorage of bytes)
            {"set": {torch.ones(1), torch.zeros(2)}, "f": frozenset({_Plain(torch.ones(2)), 3})},
            {"tied": [t, t, t[1:]], "q": collections.deque([t, 2])},
        ]
    ):
        assert_roundtrip(obj, tmp_path / f"{i}.pt", weights_only=False)

    def differ(a, b):
        with pytest.raises(AssertionError):
            assert_same_state({"x": a}, {"x": b})

    differ(collections.deque([1, 2]), collections.deque([1, 3]))
    differ(collections.deque([torch.zeros(1)]), collections.deque([torch.ones(1)]))
    a, b = _Step(1), _Step(1)
    a.note, b.note = "a", "b"
    differ(a, b)
    differ([t, t], [t, t.view(4)])
    differ([t, t.view(4)], [t, t])
    differ({torch.ones(1)}, {torch.zeros(1)})
    differ(torch.arange(3.0).storage(), torch.arange(3).storage())
    other: list = [torch.ones(1)]
    other.append([torch.ones(1), []])
    differ(loop, other)


@pytest.mark.parametrize("where", [{"cpu": "cpu"}, lambda storage, loc: storage])
def test_assert_roundtrip_of_safetensors_with_a_map_location_safetensors_does_not_take(tmp_path, where):
    """Regression: a dict or function map_location, which read_state_dict
    takes, was handed to safetensors' load_file as a device name, which it
    refused: the helper failed instead of comparing."""
    from fastpersist.testing import assert_roundtrip

    sd = {"a": torch.arange(6.0), "b": torch.ones(2, 3, dtype=torch.int32)}
    assert_roundtrip(sd, tmp_path / "x.safetensors", write_kwargs={"format": "safetensors"}, map_location=where)


def test_comparison_sees_a_wrapper_subclass_attribute_and_numpy_identity():
    """Regression (found in a hunt): assert_same_state passed a wrapper
    subclass (TwoTensor) that lost an attribute of its own, and two
    separate numpy arrays where one array was met twice; torch.load keeps
    both."""
    import numpy as np

    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    t = two_tensor.TwoTensor(torch.ones(2), torch.zeros(2))
    t.scale = 0.5
    same = two_tensor.TwoTensor(torch.ones(2), torch.zeros(2))
    same.scale = 0.5
    assert_same_state(t, same)
    with pytest.raises(AssertionError, match="scale"):
        assert_same_state(t, two_tensor.TwoTensor(torch.ones(2), torch.zeros(2)))
    arr = np.arange(3)
    assert_same_state([arr, arr], [np.arange(3)] * 2)
    with pytest.raises(AssertionError, match="again"):
        assert_same_state([arr, arr], [np.arange(3), np.arange(3)])
    assert_same_state([np.float32(1.0)] * 2, [np.float32(1.0), np.float32(1.0)])  # (scalars: values)
