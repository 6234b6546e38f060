"""The one-pass copy and CRC32 (``src/crc_copy.rs``): the files and the reads
are the same with it and without it (``FASTPERSIST_FUSED_COPY=0``, read
once per process, hence a process per setting)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest
from fastpersist import _core

_CHILD = textwrap.dedent(
    """
    import hashlib, json, os, sys, zipfile
    import torch, fastpersist
    from fastpersist import _core

    out = sys.argv[1]
    g = torch.Generator().manual_seed(7)
    big = torch.randn(5 << 20, generator=g)  # 20 MiB: many 4 MiB extents
    state = {
        "big": big,
        "odd": torch.randn((1 << 18) + 13, generator=g),  # ends mid-block
        "view": big[12345:12345 + 70000],  # saved as big's storage, shared
        "small": [torch.randn(n, generator=g) for n in (1, 100, 1023, 1024, 1025, 5000)],
        "bytes": torch.randint(0, 255, (3 << 20,), dtype=torch.uint8, generator=g),
        "step": 3,
    }
    shas, reads = {}, {}
    for how in ("sync", "pipelined", "snapshot"):
        p = os.path.join(out, how + ".pt")
        if how == "sync":
            fastpersist.write_state_dict(state, p)
        else:
            fastpersist.save_async(state, p, mode=how).result(timeout=120)
        assert zipfile.ZipFile(p).testzip() is None
        with open(p, "rb") as f:
            shas[how] = hashlib.sha256(f.read()).hexdigest()
        back = fastpersist.read_state_dict(p)  # every CRC checked
        reads[how] = bool(
            torch.equal(back["big"], big)
            and torch.equal(back["odd"], state["odd"])
            and torch.equal(back["view"], state["view"])
            and back["view"].untyped_storage().data_ptr() == back["big"].untyped_storage().data_ptr()
            and all(torch.equal(a, b) for a, b in zip(back["small"], state["small"]))
            and torch.equal(back["bytes"], state["bytes"])
        )
    print(json.dumps({"kernel": _core.copy_kernel(), "shas": shas, "reads": reads}))
    """
)


def _run(tmp_path, fused: bool) -> dict:
    out = tmp_path / ("fused" if fused else "two-pass")
    out.mkdir()
    env = dict(os.environ)
    env.pop("FASTPERSIST_FUSED_COPY", None)
    if not fused:
        env["FASTPERSIST_FUSED_COPY"] = "0"
    r = subprocess.run([sys.executable, "-c", _CHILD, str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_files_and_reads_are_the_same_with_and_without_the_one_pass_copy(tmp_path):
    two_pass = _run(tmp_path, fused=False)
    one_pass = _run(tmp_path, fused=True)
    assert two_pass["kernel"] is None  # the switch is honoured
    if platform.machine() == "x86_64" and "pclmulqdq" in open("/proc/cpuinfo").read():
        assert one_pass["kernel"] in ("sse", "avx2", "avx512")
    assert all(two_pass["reads"].values()) and all(one_pass["reads"].values())
    # Byte for byte the same files, whichever copy wrote them.
    assert one_pass["shas"] == two_pass["shas"]
    # The three ways of saving write the same file.
    assert len(set(one_pass["shas"].values())) == 1


def test_copy_kernel_names_the_instruction_set():
    k = _core.copy_kernel()
    assert k is None or k in ("sse", "avx2", "avx512")
    if os.environ.get("FASTPERSIST_FUSED_COPY") == "0":
        assert k is None
    elif platform.machine() != "x86_64":
        assert k is None
    else:
        flags = open("/proc/cpuinfo").read().split()
        if "pclmulqdq" not in flags or "sse4_1" not in flags:
            pytest.skip("no PCLMULQDQ/SSE4.1")
        assert k is not None
        if "vpclmulqdq" in flags and "avx512f" in flags:
            assert k == "avx512"
