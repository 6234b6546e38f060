"""The fastpersist command line: output and exit codes."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import fastpersist
import pytest
import torch
from fastpersist.torch_zip import STORAGE_ALIGNMENT
from helpers import cli_exe, make

EXE = cli_exe()


def run(*args, cwd=None):
    return subprocess.run([EXE, *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=600)


@pytest.fixture
def ckpt(tmp_path):
    p = tmp_path / "c.pt"
    fastpersist.write_state_dict({"layer": {"w": make((64, 8), torch.bfloat16)}, "n": 1}, p)
    return p


def test_inspect(ckpt):
    r = run("inspect", ckpt)
    assert r.returncode == 0, r.stderr
    assert "archive/data/0" in r.stdout and "layer.w" in r.stdout and "bfloat16" in r.stdout
    j = json.loads(run("inspect", ckpt, "--json").stdout)
    assert j["format"] == "torch"
    rec = {x["name"]: x for x in j["records"]}["archive/data/0"]
    assert rec["bytes"] == 64 * 8 * 2 and rec["alignment"] % STORAGE_ALIGNMENT == 0
    # The tensors the text lists (regression: the JSON of a torch zip had none).
    assert j["tensors"] == [{"key": "layer.w", "dtype": "bfloat16", "shape": [64, 8], "bytes": 64 * 8 * 2}]


def test_inspect_lists_the_tensors_of_a_legacy_torch_file(tmp_path):
    """Regression: inspect of torch's legacy (non-zip) format said
    "0 tensors, 0 B of data" and printed an empty table."""
    p = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(3, 4), "b": torch.zeros(5, dtype=torch.int64)}, p, _use_new_zipfile_serialization=False)
    r = run("inspect", p)
    assert r.returncode == 0, r.stderr
    assert "torch-legacy checkpoint" in r.stdout and "2 tensors, 88 B of data" in r.stdout, r.stdout
    assert "float32" in r.stdout and "[3, 4]" in r.stdout and "int64" in r.stdout
    j = json.loads(run("inspect", p, "--json").stdout)
    assert j["format"] == "torch-legacy" and j["records"] == []
    assert {t["key"]: (t["dtype"], t["shape"], t["bytes"]) for t in j["tensors"]} == {
        "w": ("float32", [3, 4], 48),
        "b": ("int64", [5], 40),
    }
    # One that a weights-only load refuses: said so, not "0 tensors".
    odd = tmp_path / "odd.pt"
    torch.save({"w": torch.ones(3), "c": fastpersist.ReadStats}, odd, _use_new_zipfile_serialization=False)
    r = run("inspect", odd)
    assert r.returncode == 0, r.stderr
    assert "cannot be loaded weights-only" in r.stdout and "0 tensors" not in r.stdout, r.stdout
    assert json.loads(run("inspect", odd, "--json").stdout)["tensors"] is None


def test_verify_ok_corrupt_missing(ckpt, tmp_path):
    assert run("verify", ckpt).returncode == 0
    raw = bytearray(ckpt.read_bytes())
    rec = {x["name"]: x for x in json.loads(run("inspect", ckpt, "--json").stdout)["records"]}["archive/data/0"]
    raw[rec["offset"] + 5] ^= 1  # inside data/0
    bad = tmp_path / "bad.pt"
    bad.write_bytes(bytes(raw))
    r = run("verify", ckpt, bad)
    assert r.returncode == 1
    assert "CORRUPT" in r.stdout and "archive/data/0" in r.stdout and "OK" in r.stdout
    r = run("verify", tmp_path / "missing.pt")
    assert r.returncode == 2 and "No such file" in r.stdout
    trunc = tmp_path / "trunc.pt"
    trunc.write_bytes(bytes(raw[:1000]))
    assert run("verify", trunc).returncode == 1
    assert run("inspect", trunc).returncode == 1


def test_verify_json_gives_each_files_outcome(ckpt, tmp_path):
    """``verify --json``: one object per file, in the order given, with the
    same exit status as the text."""
    raw = bytearray(ckpt.read_bytes())
    rec = {x["name"]: x for x in json.loads(run("inspect", ckpt, "--json").stdout)["records"]}["archive/data/0"]
    raw[rec["offset"] + 5] ^= 1
    bad = tmp_path / "bad.pt"
    bad.write_bytes(bytes(raw))
    st = tmp_path / "m.safetensors"
    fastpersist.write_state_dict({"a": make((3, 4), torch.float16)}, st, format="safetensors")
    r = run("verify", "--json", ckpt, bad, tmp_path / "missing.pt", st)
    assert r.returncode == 2, r.stderr
    ok, corrupt, missing, safe = json.loads(r.stdout)
    assert ok["status"] == "ok" and ok["path"] == str(ckpt) and ok["format"] == "torch"
    assert ok["records"] > 0 and ok["unchecked"] == []
    assert corrupt["status"] == "corrupt" and "archive/data/0" in corrupt["message"]
    assert missing["status"] == "error" and "No such file" in missing["message"]
    assert safe["status"] == "ok" and safe["format"] == "safetensors"
    r = run("verify", "--json", ckpt, bad)
    assert r.returncode == 1 and [x["status"] for x in json.loads(r.stdout)] == ["ok", "corrupt"]
    r = run("verify", "--json", ckpt)
    assert r.returncode == 0 and len(json.loads(r.stdout)) == 1


def test_verify_and_inspect_safetensors(tmp_path):
    p = tmp_path / "m.safetensors"
    fastpersist.write_state_dict({"a": make((3, 4), torch.float16)}, p, format="safetensors")
    r = run("verify", p)
    assert r.returncode == 0 and "no checksums" in r.stdout
    r = run("inspect", p)
    assert r.returncode == 0 and "float16" in r.stdout and "[3, 4]" in r.stdout
    raw = bytearray(p.read_bytes())
    struct.pack_into("<Q", raw, 0, len(raw) * 2)  # header length past the end
    p.write_bytes(bytes(raw))
    assert run("verify", p).returncode == 1


def test_usage_errors():
    assert run().returncode == 2
    assert run("frobnicate").returncode == 2


@pytest.mark.parametrize(
    "args, says",
    [
        (["--size", "abc"], "bad size"),
        (["--size=-5MiB"], "bad size"),
        (["--size", "0"], "must be positive"),
        (["--rounds", "0"], "must be at least 1"),
        (["--rounds", "x"], "not a whole number"),
        (["--dir", "NOFILE"], "not a directory"),
        (["--size", "1000TiB"], "of memory"),
    ],
)
def test_bench_arguments_are_usage_errors(tmp_path, args, says):
    """Regression: a bad --size or --dir printed a traceback and exited 1
    (the "corrupt checkpoint" status); --rounds 0 printed a table of nan
    and exited 0; --size 0 ran anyway; a size past the machine's memory
    was made until the allocation failed (a traceback, status 1)."""
    args = [str(tmp_path / "missing") if a == "NOFILE" else a for a in args]
    r = run("bench", *args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert says in r.stderr and "Traceback" not in r.stderr


def test_python_dash_m_runs_the_command_line(ckpt):
    import sys

    r = subprocess.run([sys.executable, "-m", "fastpersist", "verify", str(ckpt)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_bench_runs(tmp_path):
    r = run("bench", "--size", "8MiB", "--rounds", "1", "--dir", tmp_path, "--progress")
    assert r.returncode == 0, r.stderr
    assert "fastpersist write" in r.stdout and "fastpersist read" in r.stdout
    assert "bench [" in r.stderr  # the progress bar
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("kind", ["torchscript", "symlink-loop", "socket", "directory", "name-too-long"])
@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_files_that_cannot_be_read_are_a_usage_error_with_their_name(tmp_path, kind, command):
    """Regression: ``inspect`` of a TorchScript archive, a symbolic link
    loop, a socket or a name too long printed a traceback and exited 1
    ("corrupt"); a directory was reported without its name (here and by
    ``read_state_dict``). The CLI's contract: 0 OK, 1 corrupt, 2 bad usage
    or a file that cannot be opened, one line naming it."""
    import socket

    if kind == "torchscript":
        p = tmp_path / "script.pt"
        torch.jit.script(torch.nn.Linear(2, 2)).save(str(p))
    elif kind == "symlink-loop":
        p = tmp_path / "a"
        os.symlink(tmp_path / "b", p)
        os.symlink(p, tmp_path / "b")
    elif kind == "socket":
        p = tmp_path / "s"
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(p))
        s.close()
    elif kind == "directory":
        p = tmp_path / "d"
        p.mkdir()
    else:
        p = tmp_path / ("x" * 300)
    r = run(command, p)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr + r.stdout
    assert p.name in r.stderr + r.stdout
    if kind == "directory":
        with pytest.raises(IsADirectoryError) as ei:
            fastpersist.read_state_dict(p)
        assert ei.value.filename == str(p)


def test_verify_reports_a_damaged_pickle_and_goes_on(ckpt, tmp_path):
    """Regression: a legacy file naming a storage class torch does not have
    (``FloapStorage``) made ``verify`` die with a traceback, leaving the
    paths after it unchecked. It is reported CORRUPT, and the next path is
    checked."""
    bad = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(4)}, bad, _use_new_zipfile_serialization=False)
    bad.write_bytes(bad.read_bytes().replace(b"FloatStorage", b"FloapStorage"))
    r = run("verify", bad, ckpt)
    assert r.returncode == 1 and "Traceback" not in r.stderr, (r.stdout, r.stderr)
    lines = r.stdout.splitlines()
    assert lines[0].startswith("CORRUPT") and "FloapStorage" in lines[0], r.stdout
    assert lines[1].startswith("OK") and str(ckpt) in lines[1], r.stdout


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_fifo_is_refused_at_once_not_waited_on(tmp_path, command):
    """Regression: ``verify`` (and ``read_state_dict``) of a FIFO with no
    writer hung in ``open``, waiting for one; with a writer it failed on
    the first seek. A FIFO is refused at once (no checkpoint can be read at
    offsets from one), a usage error naming it."""
    p = tmp_path / "pipe"
    os.mkfifo(p)
    r = subprocess.run([EXE, command, str(p)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr + r.stdout and "pipe" in r.stderr + r.stdout
    code = f"import fastpersist\ntry:\n    fastpersist.read_state_dict({str(p)!r})\nexcept OSError as e:\n    print('OSError', e.filename)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == f"OSError {p}", out.stdout + out.stderr


@pytest.mark.parametrize("shape", ["cycle", "shared"])
def test_inspect_walks_each_container_once(tmp_path, shape):
    """Regression: inspect's walk of the loaded object followed a list that
    holds itself for ever (growing memory), and a list shared at every
    level (2**40 paths from a small file) as many times as it is reached."""
    if shape == "cycle":
        box: list = [torch.ones(2)]
        box.append(box)
    else:
        box = [torch.ones(2)]
        for _ in range(40):
            box = [box, box]
    p = tmp_path / "c.pt"
    torch.save({"w": torch.zeros(3), "box": box}, p)
    r = subprocess.run(
        [sys.executable, "-m", "fastpersist", "inspect", str(p)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert "w " in r.stdout and "float32" in r.stdout


@pytest.mark.parametrize("cmd", [["inspect", ""], ["verify", ""], ["ls", ""], ["inspect", "a\0b"]])
def test_a_path_that_names_no_file_is_a_usage_error(cmd):
    """Regression: an empty path gave a ValueError traceback and status 1,
    the status that means "corrupt"."""
    from fastpersist import cli

    with pytest.raises(SystemExit) as e:
        cli.main(cmd)
    assert e.value.code == 2


@pytest.mark.parametrize(
    "line",
    [
        b"5",
        b'{"event":"commit"}',
        b'{"event":"commit","step":1,"stall_s":"x","gbps":null}',
        b"\xff\xfe",
        b"[1]",
        b"[" * 100_000,  # nested past the decoder's recursion
        b'{"event":"commit","step":1,"stall_s":1' + b"0" * 400 + b"}",  # an int past a float's range
    ],
)
def test_ls_skips_a_damaged_log_line(tmp_path, capsys, line):
    """Regression: a log line that is not an event with a step (a number,
    no step, a string where a number goes, bytes that are not UTF-8, JSON
    nested too deep to parse, an int too large for a float) gave a
    traceback and status 1 instead of the listing."""
    from fastpersist import cli

    fastpersist.write_state_dict({"a": torch.ones(2)}, tmp_path / "ckpt-000000000001.pt")
    (tmp_path / "checkpoints.jsonl").write_bytes(line + b"\n")
    assert cli.main(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "committed" in out and out.splitlines()[1].split()[0] == "1"


def test_ls_verify_lists_every_checkpoint_when_one_cannot_be_read(tmp_path, capsys):
    """Regression: one checkpoint name that is not a readable file (a
    directory, a FIFO) stopped the listing with status 2 after its header."""
    from fastpersist import cli

    fastpersist.write_state_dict({"step": 1, "state": {"a": torch.ones(2)}}, tmp_path / "ckpt-000000000001.pt")
    os.mkdir(tmp_path / "ckpt-000000000002.pt")
    os.mkfifo(tmp_path / "ckpt-000000000003.pt")
    assert cli.main(["ls", "--verify", str(tmp_path)]) == 1
    rows = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines()[1:]}
    assert "verified" in rows["1"] and "UNREADABLE" in rows["2"] and "UNREADABLE" in rows["3"], rows
    # Without --verify too (was: "committed"), status 0.
    assert cli.main(["ls", str(tmp_path)]) == 0
    rows = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines()[1:]}
    assert "committed" in rows["1"] and "UNREADABLE" in rows["2"] and "UNREADABLE" in rows["3"], rows


def test_ls_verify_marks_a_whole_file_that_is_no_checkpointers_payload(tmp_path, capsys):
    """Regression: ``ls --verify`` said "verified" of a whole torch file at
    a checkpoint's name that is not a Checkpointer's payload, which
    ``latest()`` and retention pass by."""
    from fastpersist import cli

    with fastpersist.Checkpointer(tmp_path, every=1) as ck:
        ck.step(1, {"a": torch.ones(2)})
    fastpersist.write_state_dict({"a": torch.ones(2)}, tmp_path / "ckpt-000000000002.pt")
    assert cli.main(["ls", "--verify", str(tmp_path)]) == 1
    rows = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines()[1:]}
    assert "verified" in rows["1"] and "FOREIGN" in rows["2"], rows
    assert fastpersist.Checkpointer(tmp_path).latest().step == 1


@pytest.mark.parametrize("cmd", ["verify", "ls"])
def test_a_bad_environment_variable_is_a_usage_error(tmp_path, monkeypatch, capsys, cmd):
    """Regression: a bad FASTPERSIST_* value gave a traceback and status 1
    (which says a checkpoint is corrupt) for a valid checkpoint."""
    from fastpersist import cli

    p = tmp_path / "ckpt-000000000001.pt"
    fastpersist.write_state_dict({"a": torch.ones(2)}, p)
    monkeypatch.setenv("FASTPERSIST_DIRECT", "of")
    assert cli.main([cmd, str(p if cmd == "verify" else tmp_path)]) == 2
    assert "FASTPERSIST_DIRECT" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_ls_lists_checkpoints_whose_log_is_no_regular_file(tmp_path, capsys, kind):
    """Regression: a FIFO at the log's name held ``ls`` for ever (a plain
    open waits for a writer); a folder there failed the listing (status
    2). The listing is shown without the log."""
    from fastpersist import cli

    fastpersist.write_state_dict({"step": 1, "state": {}}, tmp_path / "ckpt-000000000001.pt")
    log = tmp_path / "checkpoints.jsonl"
    os.mkfifo(log) if kind == "fifo" else log.mkdir()
    assert cli.main(["ls", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[1].split()[0] == "1" and "checkpoints.jsonl" in err


def test_a_closed_output_pipe_ends_quietly(tmp_path):
    """Regression: ``fastpersist inspect big | head -1`` printed
    "fastpersist: : Broken pipe" and status 2."""
    p = tmp_path / "m.safetensors"
    fastpersist.write_state_dict({f"t{i}": torch.ones(1) for i in range(20000)}, p, format="safetensors")
    r = subprocess.run(
        f"{sys.executable} -m fastpersist inspect {p} | head -1",
        shell=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "safetensors checkpoint" in r.stdout and r.stderr == "", r.stderr
