"""Issue 17, points 6-11: format="safetensors" behaves like safetensors.torch.

Every test compares with the real library: files written by safetensors are
read by fastpersist and the other way round, refusals are compared with
safetensors' own, and the bytes of a file equal safetensors' but for the
header padding that puts the data at 4096.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import fastpersist
import pytest
import torch
from fastpersist.errors import SerializationError, SharedTensorsError, UnsupportedDtypeError
from fastpersist.verify import inspect_file, verify_file
from helpers import bits, make

safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

F8_E8M0 = getattr(torch, "float8_e8m0fnu", None)
F4_X2 = getattr(torch, "float4_e2m1fn_x2", None)
needs_e8m0 = pytest.mark.skipif(F8_E8M0 is None, reason=f"torch {torch.__version__} has no float8_e8m0fnu")
needs_f4 = pytest.mark.skipif(F4_X2 is None, reason=f"torch {torch.__version__} has no float4_e2m1fn_x2")


def ours(tensors, path, **kw):
    return fastpersist.write_state_dict(tensors, path, format="safetensors", **kw)


def split(path):
    """(header JSON without its padding, data) of a safetensors file."""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    return raw[8 : 8 + n].rstrip(b" "), raw[8 + n :]


def handmade(path, header: dict, data: bytes) -> None:
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    open(path, "wb").write(struct.pack("<Q", len(body)) + body + data)


def refused_by_safetensors(path) -> bool:
    try:
        load_file(path)
    except Exception:  # noqa: BLE001 - SafetensorError and friends
        return True
    return False


# 6. float8_e8m0fnu (F8_E8M0), float4_e2m1fn_x2 (F4), F6 codes.


@pytest.mark.parametrize(
    "dtype,code",
    [pytest.param(F8_E8M0, "F8_E8M0", marks=needs_e8m0), pytest.param(F4_X2, "F4", marks=needs_f4)],
    ids=["float8_e8m0fnu", "float4_e2m1fn_x2"],
)
def test_17_6_new_dtypes_both_ways(tmp_path, dtype, code):
    sd = {"x": make((3, 4), dtype), "e": make((0, 2), dtype), "f": make((5,), torch.float32)}
    if dtype == F8_E8M0:
        sd["s"] = make((), dtype)
    ours(sd, tmp_path / "fp.safetensors")
    save_file(sd, tmp_path / "st.safetensors")
    header = json.loads(split(tmp_path / "fp.safetensors")[0])
    assert header["x"]["dtype"] == code
    # F4 counts values: two per float4_e2m1fn_x2 element.
    assert header["x"]["shape"] == ([3, 8] if code == "F4" else [3, 4])
    for got in (
        load_file(tmp_path / "fp.safetensors"),
        fastpersist.read_state_dict(tmp_path / "st.safetensors"),
        fastpersist.read_state_dict(tmp_path / "fp.safetensors"),
    ):
        assert set(got) == set(sd)
        for k, t in sd.items():
            assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
            assert got[k].view(torch.uint8).flatten().tolist() == t.view(torch.uint8).flatten().tolist(), k
    recs = {r.name: r for r in inspect_file(tmp_path / "st.safetensors")[1]}
    assert recs["x"].dtype == str(dtype).replace("torch.", "") and recs["x"].shape == (3, 4)


@needs_f4
def test_17_6_zero_dim_f4_refused_like_safetensors(tmp_path):
    t = make((), F4_X2)
    with pytest.raises(Exception):  # noqa: B017 - safetensors' SafetensorError
        save_file({"x": t}, tmp_path / "st.safetensors")
    with pytest.raises(SerializationError, match="0-dim"):
        ours({"x": t}, tmp_path / "fp.safetensors")
    assert not (tmp_path / "fp.safetensors").exists()


@pytest.mark.parametrize("code", ["F6_E2M3", "F6_E3M2"])
def test_17_6_f6_files_are_valid_but_not_torch_tensors(tmp_path, code):
    # Four 6-bit values are 3 bytes; torch has no 6-bit dtype.
    p = tmp_path / "f6.safetensors"
    handmade(
        p,
        {
            "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
            "x": {"dtype": code, "shape": [4], "data_offsets": [4, 7]},
        },
        b"\0\0\x80?" + b"\1\2\3",
    )
    with safe_open(p, "pt") as f:  # safetensors opens it and knows the dtype...
        assert f.get_slice("x").get_dtype() == code
        with pytest.raises(Exception, match="not understood"):  # ...and its torch binding cannot make a tensor
            f.get_tensor("x")
    recs = {r.name: r for r in inspect_file(p)[1]}
    assert recs["x"].dtype == code and recs["x"].shape == (4,) and recs["x"].bytes == 3
    assert verify_file(p) == ("safetensors", 2)
    with pytest.raises(UnsupportedDtypeError, match=f"'x'.*{code}"):
        fastpersist.read_state_dict(p)
    # Not a corrupt file: a caller skipping damaged files must not skip it.
    assert not issubclass(UnsupportedDtypeError, fastpersist.CorruptCheckpointError)
    # Three 6-bit values are not whole bytes: that file is corrupt, for both.
    q = tmp_path / "bad.safetensors"
    handmade(q, {"x": {"dtype": code, "shape": [3], "data_offsets": [0, 2]}}, b"\1\2")
    assert refused_by_safetensors(q)
    with pytest.raises(fastpersist.CorruptCheckpointError, match="whole number of bytes"):
        fastpersist.read_state_dict(q)


@needs_f4
def test_17_6_f4_with_an_odd_last_dimension(tmp_path):
    # Six F4 values (3 bytes) as [2, 3]: a valid file torch cannot shape.
    p = tmp_path / "odd.safetensors"
    handmade(p, {"x": {"dtype": "F4", "shape": [2, 3], "data_offsets": [0, 3]}}, b"\1\2\3")
    assert refused_by_safetensors(p)
    with pytest.raises(UnsupportedDtypeError, match="even"):
        fastpersist.read_state_dict(p)
    assert verify_file(p) == ("safetensors", 1)


# 7. Shared and aliased tensors.


def test_17_7_shared_tensors_refused_like_safetensors(tmp_path):
    base = make((4, 4), torch.float32)
    cases = {
        "same tensor twice": {"w": base, "tied": base, "other": make((2,), torch.float32)},
        "overlapping views": {"w": base, "row": base[1], "other": make((2,), torch.float32)},
    }
    for what, sd in cases.items():
        with pytest.raises(RuntimeError) as theirs:
            save_file(sd, tmp_path / "st.safetensors")
        with pytest.raises(RuntimeError) as mine:
            ours(sd, tmp_path / "fp.safetensors")
        assert isinstance(mine.value, type(theirs.value)), what
        assert isinstance(mine.value, (SharedTensorsError, SerializationError))
        msg = str(mine.value)
        group = sorted(k for k in sd if k != "other")
        assert str(group) in msg and "other" not in msg, (what, msg)
        assert "save_model" in msg and "clone" in msg and "format='torch'" in msg
        assert not (tmp_path / "fp.safetensors").exists()


def test_17_7_tied_module_weights(tmp_path):
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # a tie, as in language models
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    with pytest.raises(SharedTensorsError, match=r"\['emb.weight', 'head.weight'\]"):
        ours(model.state_dict(), tmp_path / "m.safetensors")
    # The way out the message gives: one name per group, tied again after loading.
    from safetensors.torch import load_model, save_model

    save_model(model, str(tmp_path / "st.safetensors"))
    sd = {k: v for k, v in model.state_dict().items() if k != "head.weight"}
    ours(sd, tmp_path / "fp.safetensors")
    fresh = torch.nn.ModuleDict({"emb": torch.nn.Embedding(10, 4), "head": torch.nn.Linear(4, 10, bias=False)})
    fresh.head.weight = fresh.emb.weight
    load_model(fresh, tmp_path / "fp.safetensors")
    assert torch.equal(fresh.head.weight, emb.weight) and fresh.head.weight is fresh.emb.weight


def test_17_7_disjoint_parts_of_one_storage_are_not_shared(tmp_path):
    base = make((8,), torch.float32)
    sd = {"lo": base[:4], "hi": base[4:], "empty": base[:0]}
    save_file(sd, tmp_path / "st.safetensors")  # safetensors accepts them: no tie is lost
    ours(sd, tmp_path / "fp.safetensors")
    got = fastpersist.read_state_dict(tmp_path / "fp.safetensors")
    assert all(bits(got[k]) == bits(v) for k, v in sd.items())
    # A tie between two CPU tensors is a tie however strided (fastpersist
    # writes non-contiguous tensors as their contiguous copy).
    with pytest.raises(SharedTensorsError):
        ours({"t": base.view(2, 4).t(), "col": base.view(2, 4)[:, 1]}, tmp_path / "x.safetensors")


def test_17_7_two_storages_at_one_address_are_shared_only_as_safetensors_decides(tmp_path):
    """Regression: torch.from_numpy of an array and of its slice are two
    storages at one address with different sizes; safetensors (which keys
    sharing by device, address and size) saves them, fastpersist raised
    SharedTensorsError."""
    np = pytest.importorskip("numpy")
    arr = np.arange(8, dtype=np.float32)
    sd = {"whole": torch.from_numpy(arr), "head": torch.from_numpy(arr[:3])}
    assert sd["whole"].untyped_storage().data_ptr() == sd["head"].untyped_storage().data_ptr()
    save_file(sd, tmp_path / "st.safetensors")
    ours(sd, tmp_path / "fp.safetensors")
    assert split(tmp_path / "fp.safetensors") == split(tmp_path / "st.safetensors")
    got = load_file(tmp_path / "fp.safetensors")
    assert all(bits(got[k]) == bits(v) for k, v in sd.items())


# 8. Exception types as safetensors'.


@pytest.mark.parametrize(
    "what,obj,base",
    [
        ("not a dict", [torch.zeros(1)], ValueError),
        ("not a tensor", {"a": 1}, ValueError),
        ("sparse", {"a": torch.eye(3).to_sparse()}, ValueError),
        ("meta", {"a": torch.empty(3, device="meta")}, NotImplementedError),
        # Regression (found in a hunt): a SerializationError, not the KeyError safetensors raises.
        ("no safetensors dtype", {"a": torch.zeros(2, dtype=torch.complex128)}, KeyError),
    ],
)
def test_17_8_refusals_have_safetensors_exception_types(tmp_path, what, obj, base):
    with pytest.raises(base):
        save_file(obj, tmp_path / "st.safetensors")
    with pytest.raises(base) as e:
        ours(obj, tmp_path / "fp.safetensors")
    assert isinstance(e.value, SerializationError)


@pytest.mark.parametrize(
    "metadata,match",
    [
        ("notadict", "dict of str to str, not str"),
        ({"a": 1}, "'a': int"),
        ({1: "a"}, "1: str"),
        ({"a": None}, "NoneType"),
        # Regression (found in a hunt): any mapping was taken; safetensors takes a dict only.
        (__import__("types").MappingProxyType({"k": "v"}), "not mappingproxy"),
        (__import__("collections").UserDict({"k": "v"}), "not UserDict"),
    ],
)
def test_17_8_bad_metadata_is_a_type_error(tmp_path, metadata, match):
    sd = {"a": torch.zeros(2)}
    with pytest.raises(TypeError):
        save_file(sd, tmp_path / "st.safetensors", metadata=metadata)
    with pytest.raises(TypeError, match=match) as e:
        ours(sd, tmp_path / "fp.safetensors", metadata=metadata)
    assert isinstance(e.value, SerializationError)
    with pytest.raises(TypeError, match=match):
        fastpersist.save_async(sd, tmp_path / "fp.safetensors", format="safetensors", metadata=metadata).result()
    assert not (tmp_path / "fp.safetensors").exists()
    with fastpersist.patch():
        with pytest.raises(TypeError):
            save_file(sd, tmp_path / "patched.safetensors", metadata=metadata)
    assert not (tmp_path / "patched.safetensors").exists()


def test_17_8_names_that_utf8_cannot_encode(tmp_path):
    sd = {"\ud800": torch.zeros(1)}
    with pytest.raises(UnicodeEncodeError):
        save_file(sd, tmp_path / "st.safetensors")
    with pytest.raises(UnicodeEncodeError):
        ours(sd, tmp_path / "fp.safetensors")


# 9. Empty metadata.


def test_17_9_empty_metadata_reads_back_empty(tmp_path):
    sd = {"a": torch.ones(2)}
    for meta, want in [({}, {}), (None, None), ({"k": "v"}, {"k": "v"})]:
        save_file(sd, tmp_path / "st.safetensors", metadata=meta)
        ours(sd, tmp_path / "fp.safetensors", metadata=meta)
        for name in ("st", "fp"):
            with safe_open(tmp_path / f"{name}.safetensors", "pt") as f:
                assert f.metadata() == want, (name, meta)
        assert split(tmp_path / "fp.safetensors")[0] == split(tmp_path / "st.safetensors")[0]


# 10. What the format forbids is refused when reading.


def _layout_cases():
    f = {"dtype": "F32", "shape": [1]}
    z = {"dtype": "F32", "shape": [0]}
    return {
        "hole between tensors": ({"a": {**f, "data_offsets": [0, 4]}, "b": {**f, "data_offsets": [8, 12]}}, 12),
        "hole before the first": ({"a": {**f, "data_offsets": [4, 8]}}, 8),
        "trailing bytes": ({"a": {**f, "data_offsets": [0, 4]}}, 8),
        "bytes but no tensor": ({}, 4),
        "overlap": (
            {"a": {**f, "data_offsets": [0, 4]}, "b": {"dtype": "F16", "shape": [2], "data_offsets": [2, 6]}},
            6,
        ),
        "empty tensor inside another": ({"a": {**f, "data_offsets": [0, 4]}, "z": {**z, "data_offsets": [2, 2]}}, 4),
        "metadata value a number": ({"__metadata__": {"k": 1}, "a": {**f, "data_offsets": [0, 4]}}, 4),
        "metadata value an object": ({"__metadata__": {"k": {"x": "y"}}, "a": {**f, "data_offsets": [0, 4]}}, 4),
        "metadata a list": ({"__metadata__": ["k"], "a": {**f, "data_offsets": [0, 4]}}, 4),
    }


@pytest.mark.parametrize("what", list(_layout_cases()))
def test_17_10_reader_refuses_what_safetensors_refuses(tmp_path, what):
    header, data_len = _layout_cases()[what]
    p = tmp_path / "bad.safetensors"
    handmade(p, header, bytes(range(data_len)))
    assert refused_by_safetensors(p), what
    with pytest.raises(fastpersist.CorruptCheckpointError):
        fastpersist.read_state_dict(p)
    with pytest.raises(fastpersist.CorruptCheckpointError):
        verify_file(p)


def test_17_10_reader_accepts_what_safetensors_accepts(tmp_path):
    f = {"dtype": "F32", "shape": [1]}
    cases = {
        "tensors listed out of offset order": {"b": {**f, "data_offsets": [4, 8]}, "a": {**f, "data_offsets": [0, 4]}},
        "empty tensors at the ends": {
            "z0": {"dtype": "I8", "shape": [0, 3], "data_offsets": [0, 0]},
            "a": {**f, "data_offsets": [0, 4]},
            "b": {**f, "data_offsets": [4, 8]},
            "z1": {"dtype": "I8", "shape": [0], "data_offsets": [8, 8]},
        },
        "null metadata": {"__metadata__": None, "a": {**f, "data_offsets": [0, 4]}, "b": {**f, "data_offsets": [4, 8]}},
    }
    for what, header in cases.items():
        p = tmp_path / "ok.safetensors"
        handmade(p, header, struct.pack("<2f", 1.5, -2.0))
        ref = load_file(p)
        got = fastpersist.read_state_dict(p)
        assert set(got) == set(ref), what
        assert all(bits(got[k]) == bits(ref[k]) and got[k].shape == ref[k].shape for k in ref), what
        assert verify_file(p)[0] == "safetensors"


# 11. safetensors' bytes, but for the header padding.


def _every_dtype():
    names = [
        "bool", "uint8", "int8", "float8_e5m2", "float8_e4m3fn", "float8_e8m0fnu", "float8_e4m3fnuz",
        "float8_e5m2fnuz", "int16", "uint16", "float16", "bfloat16", "int32", "uint32", "float32",
        "complex64", "float64", "int64", "uint64", "float4_e2m1fn_x2",
    ]  # fmt: skip
    return [getattr(torch, n) for n in names if hasattr(torch, n)]


def test_17_11_bytes_equal_safetensors_but_the_padding(tmp_path):
    sd = {}
    for i, dt in enumerate(_every_dtype()):
        # Names that sort differently from the dtype order, one per dtype, twice.
        sd[f"{chr(ord('z') - i)}.w"] = make((3, 2), dt, i)
        sd[f"{chr(ord('a') + i)}.b"] = make((2,), dt, i + 100)
    sd.update(
        {
            "émoji 🙂 名前": make((3,), torch.float32, 7),
            'quote" back\\slash\nnew\ttab\x01ctl\x7fdel/': make((2, 2), torch.int64, 8),
            "scalar": torch.tensor(1.5, dtype=torch.float64),
            "empty": torch.empty(0, 7, dtype=torch.float16),
            "Z": make((1,), torch.float32, 9),
            "a": make((1,), torch.float32, 10),
        }
    )
    for meta in (None, {"fmt": "pt", "ünïcode\n": "välue 🙂\x02"}):
        if meta is not None and len(meta) > 1:
            # safetensors writes metadata keys in hash order: compare one key at a time.
            metas = [{k: v} for k, v in meta.items()]
        else:
            metas = [meta]
        for m in metas:
            save_file(sd, tmp_path / "st.safetensors", metadata=m)
            ours(sd, tmp_path / "fp.safetensors", metadata=m)
            h_st, d_st = split(tmp_path / "st.safetensors")
            h_fp, d_fp = split(tmp_path / "fp.safetensors")
            assert h_fp == h_st
            assert d_fp == d_st
            (n,) = struct.unpack("<Q", open(tmp_path / "fp.safetensors", "rb").read(8))
            assert (8 + n) % 4096 == 0 and os.path.getsize(tmp_path / "fp.safetensors") == 8 + n + len(d_fp)


def test_17_11_non_contiguous_tensors_are_written_contiguous(tmp_path):
    # The one input fastpersist takes and safetensors refuses: the file is
    # the one safetensors writes for the contiguous copy.
    t = make((3, 5), torch.float32).t()
    with pytest.raises(ValueError, match="non contiguous"):
        save_file({"t": t}, tmp_path / "st.safetensors")
    save_file({"t": t.contiguous()}, tmp_path / "st.safetensors")
    ours({"t": t}, tmp_path / "fp.safetensors")
    assert split(tmp_path / "fp.safetensors") == split(tmp_path / "st.safetensors")


@pytest.mark.parametrize(
    "header",
    [
        b'{"a":{"dtype":"F32","shape":[0,1099511627776,1099511627776],"data_offsets":[0,0]}}',
        b'{"a":{"dtype":"F32","shape":[1099511627776,1099511627776,0],"data_offsets":[0,0]}}',
        b'{"a":{"dtype":"F32","shape":[0,4611686018427387904,4],"data_offsets":[0,0]}}',
        b'{"a":{"dtype":"F32","shape":[18446744073709551615,0],"data_offsets":[0,0]}}',
        b'{"\\ud800":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
        b'{"__metadata__":{"k":"\\udfff"},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
        b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"dtype":"I32"}}',
        b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"shape":[1]}}',
        b'{"__metadata__":{"k":"v"},"__metadata__":{"k":"w"},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
        b'{"__metadata__":{"k":"v","k":"w"},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
        b'{"a":{"dtype":"I32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
        b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1,"x":{"k":1,"k":2}}}',
        b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":"\\ud800"}}',
        b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"\\udc00":1}}',
        b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":' + b"[" * 125 + b"]" * 125 + b"}}",
        b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":' + b"[" * 126 + b"]" * 126 + b"}}",
        # A tensor given twice: serde reads the entry the later one hides.
        b'{"a":{"dtype":"BAD","shape":[1],"data_offsets":[0,4]},"a":'
        + b'{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'
        + b"}",
        b'{"a":5,"a":' + b'{"dtype":"F32","shape":[1],"data_offsets":[0,4]}' + b"}",
        b'{"a":{"dtype":"F32","dtype":"I8","shape":[1],"data_offsets":[0,4]},"a":'
        + b'{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'
        + b"}",
        b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"e":"\\ud800"},"a":'
        + b'{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'
        + b"}",
        b'{"a":' + b"[" * 200 + b"]" * 200 + b',"a":' + b'{"dtype":"F32","shape":[1],"data_offsets":[0,4]}' + b"}",
        b'{"a":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]},"a":'
        + b'{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'
        + b"}",
        b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1,"x":"\\udc00"}}',
        b'{"__metadata__":{"k":1,"k":"2"},"a":' + b'{"dtype":"F32","shape":[1],"data_offsets":[0,4]}' + b"}",
        b'{"__metadata__":{"k":"1","k":"2"},"a":' + b'{"dtype":"F32","shape":[1],"data_offsets":[0,4]}' + b"}",
        b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":'
        + b'{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'
        + b"}",
        # Numbers past a float's range, in a field safetensors ignores.
        b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1e400}}',
        b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":-1.8e308}}',
        b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":' + b"9" * 401 + b"}}",
        b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":-' + b"9" * 401 + b"}}",
        b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":' + b"9" * 300 + b',"y":1e-400}}',
        b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":18446744073709551616}}',
    ],
    ids=[
        "empty-huge-dims",
        "product-overflows",
        "strides-overflow",
        "dim-past-int64",
        "surrogate",
        "surrogate-meta",
        "dtype-twice",
        "shape-twice",
        "metadata-twice",
        "metadata-key-twice",
        "tensor-twice",
        "other-field-twice",
        "surrogate-in-other-field",
        "surrogate-other-field-name",
        "nested-127",
        "nested-128",
        "hidden-entry-bad-dtype",
        "hidden-entry-not-an-object",
        "hidden-entry-dtype-twice",
        "hidden-entry-surrogate",
        "hidden-entry-nested-200",
        "hidden-entry-float-dimension",
        "hidden-other-field-surrogate",
        "hidden-metadata-value-not-a-string",
        "hidden-metadata-value-a-string",
        "hidden-entry-valid",
        "float-past-range",
        "negative-float-past-range",
        "int-past-float-range",
        "negative-int-past-float-range",
        "big-int-and-underflow",
        "int-past-u64",
    ],
)
def test_headers_read_exactly_as_safetensors_reads_them(tmp_path, header):
    """Regression: shapes whose sizes overflow gave a bare RuntimeError
    from torch.empty (or loaded where safetensors refuses), and a name with
    a lone surrogate (a JSON escape safetensors' parser refuses) loaded,
    and crashed ``fastpersist inspect``; ``verify`` called such files OK.
    Likewise a tensor's field given twice (Python's parser keeps the last
    value: other bytes than a first-wins reader sees), ``__metadata__``
    twice, a lone surrogate or nesting past serde_json's limit anywhere."""
    p = tmp_path / "h.safetensors"
    data = b"\0" * (4 if b'"shape":[1]' in header else 0)
    p.write_bytes(struct.pack("<Q", len(header)) + header + data)
    try:
        want = load_file(p)
    except Exception:  # noqa: BLE001 - safetensors refuses it: so must fastpersist
        with pytest.raises(fastpersist.CorruptCheckpointError):
            fastpersist.read_state_dict(p)
        with pytest.raises(fastpersist.CorruptCheckpointError):
            verify_file(p)
        return
    got = fastpersist.read_state_dict(p)
    assert list(got) == list(want)
    for k in want:
        assert (got[k].shape, got[k].stride(), got[k].dtype) == (want[k].shape, want[k].stride(), want[k].dtype)
        assert torch.equal(got[k], want[k])
    verify_file(p)


def test_a_header_nested_a_million_deep_is_refused_under_a_raised_recursion_limit(tmp_path):
    """Regression: with the recursion limit raised (training stacks do),
    json.loads recursed into a header nested a million deep and the process
    died of a segmentation fault (read and verify); safetensors refuses it.
    The nesting is now counted before the decoder runs; the JSON readers of
    sidecars, markers and logs (options.parse_json) likewise."""
    code = (
        "import struct, sys, fastpersist\n"
        "from fastpersist.options import parse_json\n"
        "from fastpersist.verify import verify_file\n"
        "sys.setrecursionlimit(10**7)\n"
        f"p = {str(tmp_path / 'deep.safetensors')!r}\n"
        "h = b'{\"a\":' + b'[' * 1000000 + b']' * 1000000 + b'}'\n"
        "open(p, 'wb').write(struct.pack('<Q', len(h)) + h)\n"
        "for f in (fastpersist.read_state_dict, verify_file):\n"
        "    try:\n"
        "        f(p)\n"
        "    except fastpersist.CorruptCheckpointError as e:\n"
        "        assert '128 deep' in str(e), e\n"
        "    else:\n"
        "        raise AssertionError('read')\n"
        "try:\n"
        "    parse_json('[' * 1000000 + ']' * 1000000)\n"
        "except ValueError as e:\n"
        "    assert 'deep' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('parse_json')\n"
        "print('refused')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "refused" in r.stdout, (r.returncode, r.stderr[-2000:])


def test_a_header_repeating_a_field_a_million_times_reads_as_safetensors_reads_it(tmp_path):
    """Regression: each repeat of a key copied the tuple of the repeats so
    far: a header repeating an ignored field a million times (6 MB, which
    safetensors reads at once) took about an hour to parse. (The timeout
    is a hang guard: the fixed parse takes seconds.)"""
    p = tmp_path / "rep.safetensors"
    h = b'{"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]' + b',"z":1' * 1_000_000 + b"}}"
    p.write_bytes(struct.pack("<Q", len(h)) + h + struct.pack("<f", 1.5))
    assert load_file(p)["x"].item() == 1.5
    code = f"import fastpersist; print(fastpersist.read_state_dict({str(p)!r})['x'].item())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and r.stdout.strip() == "1.5", r.stderr[-2000:]


def test_a_header_that_starts_with_whitespace_reads_as_safetensors_reads_it(tmp_path):
    """Regression: a header with whitespace before its opening brace (JSON
    allows it, safetensors' parser takes it) was "neither a torch
    checkpoint nor a safetensors file"."""
    src = tmp_path / "a.safetensors"
    save_file({"w": torch.arange(6.0).reshape(2, 3)}, src)
    raw = src.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = b" \n\t" + raw[8 : 8 + n]
    p = tmp_path / "ws.safetensors"
    p.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + n :])
    want = load_file(p)
    got = fastpersist.read_state_dict(p)
    assert list(got) == list(want) and torch.equal(got["w"], want["w"])
    verify_file(p)
    # Regression: whitespace running past the first 512 bytes read was
    # "neither a torch checkpoint nor a safetensors file".
    header = b" " * 600 + raw[8 : 8 + n]
    p.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + n :])
    want = load_file(p)
    got = fastpersist.read_state_dict(p)
    assert list(got) == list(want) and torch.equal(got["w"], want["w"])
    assert verify_file(p).format == "safetensors"
    p.write_bytes(struct.pack("<Q", 1000) + b" " * 1000)  # whitespace only: not JSON
    with pytest.raises(Exception):
        load_file(p)
    with pytest.raises(fastpersist.CorruptCheckpointError, match="JSON"):
        fastpersist.read_state_dict(p)


def _shrunk(n: int) -> torch.Tensor:
    t = torch.ones(n)
    t.untyped_storage().resize_(8)
    return t


@pytest.mark.parametrize("how", ["sync", "pipelined", "snapshot"])
def test_a_tensor_past_its_storage_is_refused_before_it_is_read(tmp_path, how):
    """Regression: a tensor whose storage was resized under it was written
    from past the storage's end (other memory in the file; a crash for a
    large one) where format="torch" refused it."""
    p = tmp_path / "x.safetensors"
    with pytest.raises(SerializationError, match=r"\['a'\].*needs 4000 bytes of its storage, which holds 8"):
        if how == "sync":
            ours({"a": _shrunk(1000)}, p)
        else:
            fastpersist.save_async({"a": _shrunk(1000)}, p, format="safetensors", mode=how).result()
    assert not p.exists()


def test_conjugate_and_negative_views_are_written_with_the_values_they_show(tmp_path):
    """Regression: the storage's bytes were written (the values before the
    lazy conjugation or negation), as safetensors itself does."""
    c = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    sd = {"c": c.conj(), "n": torch._neg_view(torch.tensor([1.0, 2.0]))}
    ours(sd, tmp_path / "v.safetensors")
    got = load_file(tmp_path / "v.safetensors")
    assert torch.equal(got["c"], torch.tensor([1 - 2j, 3 + 4j], dtype=torch.complex64))
    assert torch.equal(got["n"], torch.tensor([-1.0, -2.0]))
