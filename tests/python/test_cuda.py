"""The device staging path: on CPU through a stand-in copier (always), and
on CUDA when a GPU is present (skipped otherwise)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import fastpersist
from helpers import assert_same, make
from test_properties import state_dicts

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def test_import_does_not_initialise_cuda():
    code = "import torch, fastpersist; fastpersist.write_state_dict({'a': torch.ones(2)}, %r); " \
           "print(torch.cuda.is_initialized())" % os.path.join(tempfile.mkdtemp(), "x.pt")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.fixture
def staged_on_cpu(monkeypatch):
    """Every storage goes through the staging pipeline, in 3-block chunks,
    so chunks, slot reuse across storages and partial blocks all happen."""
    monkeypatch.setenv("FASTPERSIST_TEST_STAGE_CPU", "1")
    monkeypatch.setenv("FASTPERSIST_STAGE_CHUNK", str(3 * 4096))


def test_staged_file_is_byte_identical(tmp_path, staged_on_cpu, monkeypatch):
    base = make((70_001,), torch.float32, 1)
    sd = {"a": base, "v": base[5:], "odd": make((4099,), torch.int8), "tiny": make((3,), torch.float16),
          "big": make((300, 301), torch.bfloat16), "n": 4, "e": torch.empty(0)}
    fastpersist.write_state_dict(sd, tmp_path / "staged.pt")
    monkeypatch.delenv("FASTPERSIST_TEST_STAGE_CPU")
    fastpersist.write_state_dict(sd, tmp_path / "plain.pt")
    assert (tmp_path / "staged.pt").read_bytes() == (tmp_path / "plain.pt").read_bytes()


@given(state_dicts())
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_staged_random_state_dicts(staged_on_cpu, sd):
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "r.pt")
        fastpersist.write_state_dict(sd, p)
        assert_same(sd, fastpersist.read_state_dict(p))


def test_bad_chunk_size(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTPERSIST_TEST_STAGE_CPU", "1")
    monkeypatch.setenv("FASTPERSIST_STAGE_CHUNK", "1000")
    with pytest.raises(ValueError, match="FASTPERSIST_STAGE_CHUNK"):
        fastpersist.write_state_dict({"a": torch.ones(10)}, tmp_path / "x.pt")
    assert os.listdir(tmp_path) == []


@needs_cuda
def test_cuda_tensors_round_trip(tmp_path):
    sd = {"gpu": torch.randn(1000, 1001, device="cuda"), "cpu": torch.randn(10),
          "half": torch.randn(33, device="cuda").half(), "n": 1}
    sd["view"] = sd["gpu"][3:]
    fastpersist.write_state_dict(sd, tmp_path / "c.pt")
    got = torch.load(tmp_path / "c.pt", weights_only=True)
    assert got["gpu"].is_cuda and torch.equal(got["gpu"], sd["gpu"])
    assert torch.equal(got["cpu"], sd["cpu"]) and torch.equal(got["view"], sd["view"])
    back = fastpersist.read_state_dict(tmp_path / "c.pt", map_location="cuda")
    assert back["cpu"].is_cuda and torch.equal(back["gpu"], sd["gpu"])
    on_cpu = fastpersist.read_state_dict(tmp_path / "c.pt", map_location="cpu")
    assert not on_cpu["gpu"].is_cuda and torch.equal(on_cpu["gpu"], sd["gpu"].cpu())


@needs_cuda
def test_values_as_of_the_call(tmp_path):
    x = torch.zeros(16 << 20, device="cuda")
    x.add_(1)  # queued on the caller's stream
    f = fastpersist.save_async({"x": x}, tmp_path / "a.pt", mode="pipelined")
    f.wait_snapshot()
    x.add_(1)
    f.result(timeout=120)
    assert torch.all(torch.load(tmp_path / "a.pt")["x"] == 1)
