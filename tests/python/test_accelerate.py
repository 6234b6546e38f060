"""The Accelerate save_state/load_state hooks, driven by a real Accelerator (CPU)."""

from __future__ import annotations

import errno
import os

import fastpersist
import pytest
import torch
from helpers import bits, written_by_fastpersist

accelerate = pytest.importorskip(
    "accelerate", reason="accelerate is not installed (pip install 'fastpersist[accelerate]')"
)
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import ProjectConfiguration, set_seed  # noqa: E402
from fastpersist.integrations.accelerate import register  # noqa: E402

STEPS = 8


def setup(project_dir, limit=2):
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(
            project_dir=str(project_dir), automatic_checkpoint_naming=True, total_limit=limit
        ),
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    return acc, model, opt, sched


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def train(acc, model, opt, sched, steps, save_every=None):
    losses = []
    for step in steps:
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
        if save_every and step % save_every == 0:
            acc.save_state()
    return losses


def test_resume_matches_a_run_that_never_stopped(tmp_path):
    set_seed(0)
    ref = setup(tmp_path / "ref")
    want = train(*ref, range(1, STEPS + 1))

    set_seed(0)
    acc, *rest = setup(tmp_path / "run")
    fp = register(acc)
    first = train(acc, *rest, range(1, 5), save_every=2)
    fp.wait()
    ck = tmp_path / "run" / "checkpoints"
    assert sorted(os.listdir(ck)) == ["checkpoint_0", "checkpoint_1"]
    names = set(os.listdir(ck / "checkpoint_1"))
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl"} <= names, names
    for n in ["optimizer.bin", "scheduler.bin", "random_states_0.pkl"]:
        assert written_by_fastpersist(ck / "checkpoint_1" / n), n
    assert fp.saves.fallbacks == 0
    fp.unregister()

    set_seed(123)  # the checkpoint's RNG state must win
    acc2, model2, opt2, sched2 = setup(tmp_path / "run")
    fp2 = register(acc2)
    acc2.load_state()  # the newest: checkpoint_1 (step 4)
    acc2.project_configuration.iteration = 2
    second = train(acc2, model2, opt2, sched2, range(5, STEPS + 1), save_every=2)
    acc2.end_training()
    assert first + second == want
    for (k, a), (_, b) in zip(ref[1].state_dict().items(), model2.state_dict().items()):
        assert bits(a) == bits(b), k
    assert sorted(os.listdir(ck)) == ["checkpoint_2", "checkpoint_3"]  # total_limit, after the commits
    fp2.unregister()


def test_disk_full_surfaces_at_the_next_save_and_the_previous_survives(tmp_path, engine_fault):
    acc, model, opt, sched = setup(tmp_path / "run", limit=1)
    fp = register(acc)
    train(acc, model, opt, sched, range(1, 3), save_every=2)
    fp.wait()
    engine_fault(0, errno.ENOSPC)
    train(acc, model, opt, sched, range(3, 5), save_every=2)  # returns: the write fails in the background
    with pytest.raises(fastpersist.WriteError) as ei:
        acc.save_state()
    assert ei.value.errno == errno.ENOSPC
    engine_fault(None)  # the disk has room again: reads through the engine pass
    ck = tmp_path / "run" / "checkpoints"
    assert "checkpoint_0" in os.listdir(ck)  # total_limit=1 did not delete it for a failed save
    fastpersist.verify.verify_file(ck / "checkpoint_0" / "optimizer.bin")
    fp.unregister()


# -- the snapshot buffers made ahead of the first save_state ---------------------------

FILES = 4  # model.safetensors, optimizer.bin, scheduler.bin, random_states_0.pkl


def test_snapshot_buffers_are_made_before_the_first_save_state(tmp_path, monkeypatch):
    """Registered after ``accelerator.prepare``: AdamW has no state yet, so
    the buffers are made right after its first step, before the first
    ``save_state``, whose files then make none of their own; registered
    before ``prepare``, the same once ``prepare`` has run; the checkpoint
    loads back exactly."""
    from prepare_spy import PrepareSpy

    spy = PrepareSpy(monkeypatch)
    acc, model, opt, sched = setup(tmp_path / "run")
    fp = register(acc)
    assert "prepare" not in spy.kinds()
    train(acc, model, opt, sched, range(1, 2))
    assert spy.kinds().count("prepare") == 1
    train(acc, model, opt, sched, range(2, 3), save_every=2)
    fp.wait()
    assert spy.kinds().count("save") == FILES and spy.prepared_before_first_save(FILES), spy.events
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_opt = opt.state_dict()
    fp.unregister()

    spy.events.clear()
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc2 = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(tmp_path / "run")))
    fp2 = register(acc2)  # before prepare: nothing to size yet
    model2 = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, 3, 0.5)
    model2, opt2, sched2 = acc2.prepare(model2, opt2, sched2)
    assert "prepare" not in spy.kinds()
    acc2.load_state(str(tmp_path / "run" / "checkpoints" / "checkpoint_0"))
    for k, v in model2.state_dict().items():
        assert bits(v) == bits(want[k]), k
    got_opt = opt2.state_dict()["state"]
    for i, st in want_opt["state"].items():
        for k, v in st.items():
            assert bits(got_opt[i][k]) == bits(v), (i, k)
    fp2.prepare_buffers()  # the optimizer has its (loaded) state now: made at once
    assert spy.kinds()[0] == "prepare"
    fp2.unregister()
    assert acc2.prepare.__func__ is Accelerator.prepare  # put back


def test_prepare_false_and_a_state_that_grows_after_prepare(tmp_path, monkeypatch):
    from prepare_spy import PrepareSpy

    spy = PrepareSpy(monkeypatch)
    acc, model, opt, sched = setup(tmp_path / "off")
    fp = register(acc, prepare=False)
    train(acc, model, opt, sched, range(1, 3), save_every=2)
    fp.wait()
    assert "prepare" not in spy.kinds() and "alloc-save" in spy.first_checkpoint(FILES), spy.events
    fp.unregister()

    spy.events.clear()
    acc, model, opt, sched = setup(tmp_path / "grow")
    fp = register(acc)
    train(acc, model, opt, sched, range(1, 2))
    acc.unwrap_model(model).register_buffer("extra", torch.arange(1 << 20, dtype=torch.float32))  # 4 MiB more
    train(acc, model, opt, sched, range(2, 3), save_every=2)
    fp.wait()
    assert spy.kinds()[0] == "prepare" and "alloc-save" in spy.kinds()  # the bigger weights made their own
    from safetensors.torch import load_file

    got = load_file(tmp_path / "grow" / "checkpoints" / "checkpoint_0" / "model.safetensors")
    for k, v in acc.unwrap_model(model).state_dict().items():
        assert bits(got[k]) == bits(v), k
    fp.unregister()


def test_pruning_removes_only_the_checkpoint_folders(tmp_path):
    """Regression: ``total_limit`` pruning removed every folder beside the
    checkpoints whose name ended in digits (a user's ``best_model_7``, an
    ``export2024``), not only accelerate's ``checkpoint_<n>``."""
    acc, model, opt, sched = setup(tmp_path / "run", limit=1)
    ck = tmp_path / "run" / "checkpoints"
    user = ["best_model_7", "export2024", "checkpoint_99.old", "checkpoint_3\n"]
    for n in user:
        (ck / n).mkdir(parents=True)
    fp = register(acc)
    train(acc, model, opt, sched, range(1, 5), save_every=1)
    fp.wait()
    acc.end_training()
    left = sorted(os.listdir(ck))
    assert all(n in left for n in user), left
    assert [n for n in left if n not in user] == ["checkpoint_3"]
    fp.unregister()


def test_pruning_keeps_the_checkpoint_just_committed_and_counts_only_loadable_ones(tmp_path):
    """Regression: ``total_limit`` pruning ran after the commit over every
    ``checkpoint_<n>`` by number: a new run (iteration 0) in a project
    whose earlier run left ``checkpoint_6`` and ``checkpoint_7`` deleted
    the checkpoint it had just written, every time (stock Accelerate prunes
    before the save and keeps it); and a folder whose save never finished
    (which load_state refuses) was counted, so a complete checkpoint was
    deleted in its place. Now the folder just committed stays, the oldest
    others go, and unfinished folders are neither counted nor deleted."""
    from fastpersist.integrations.accelerate import PENDING

    ck = tmp_path / "run" / "checkpoints"
    for n in (6, 7):
        (ck / f"checkpoint_{n}").mkdir(parents=True)
        (ck / f"checkpoint_{n}" / "model.safetensors").write_bytes(b"an earlier run's")
    acc, model, opt, sched = setup(tmp_path / "run", limit=2)
    fp = register(acc)
    acc.save_state()  # checkpoint_0
    fp.wait()
    assert sorted(os.listdir(ck)) == ["checkpoint_0", "checkpoint_7"]  # as stock Accelerate leaves them
    (ck / "checkpoint_1").mkdir()
    (ck / "checkpoint_1" / PENDING).write_bytes(b"")  # a save that never finished
    acc.project_configuration.iteration = 2
    acc.save_state()  # checkpoint_2
    fp.wait()
    acc.end_training()
    fp.unregister()
    # Oldest by number, as stock Accelerate orders them; the unfinished one left and not counted.
    assert sorted(os.listdir(ck)) == ["checkpoint_1", "checkpoint_2", "checkpoint_7"], sorted(os.listdir(ck))


def test_the_pending_marker_is_not_made_through_a_link(tmp_path):
    """Regression: the pending marker was created through a link at its
    name (a dangling one made a file outside the folder)."""
    from accelerate.state import AcceleratorState, GradientState
    from fastpersist.integrations.accelerate import PENDING

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True)
    acc.prepare(torch.nn.Linear(4, 2))
    out = tmp_path / "ck"
    out.mkdir()
    os.symlink(tmp_path / "made-outside", out / PENDING)
    fp = register(acc)
    acc.save_state(str(out))
    fp.wait()
    fp.unregister()
    assert not (tmp_path / "made-outside").exists() and not os.path.lexists(out / PENDING)


def test_load_state_passes_strict_to_the_weights_load(tmp_path):
    """Regression: ``load_state(dir, strict=False)`` raised "checkpoint does
    not match the model" once :func:`register` was installed: the load hook
    always loaded the weights strictly, the call's model-load arguments
    never reached it. They do now, as in stock Accelerate: ``strict=False``
    loads what matches, and the default (strict) still refuses."""
    from accelerate.state import AcceleratorState, GradientState

    def make(extra_head):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        acc = Accelerator(cpu=True)
        torch.manual_seed(0)
        layers = [torch.nn.Linear(8, 4)] + ([torch.nn.Linear(4, 2)] if extra_head else [])
        return acc, acc.prepare(torch.nn.Sequential(*layers))

    acc, model = make(False)
    fp = register(acc)
    acc.save_state(str(tmp_path / "ck"))
    fp.unregister()
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    acc, model = make(True)  # a new head: load what the checkpoint has
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    fp = register(acc)
    seen = []
    real = fastpersist.integrations.accelerate.read_state_dict

    def spy(path, **kw):
        seen.append(os.path.basename(path))
        return real(path, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fastpersist.integrations.accelerate, "read_state_dict", spy)
        with pytest.raises(RuntimeError, match=r"1\.weight"):
            acc.load_state(str(tmp_path / "ck"))
        acc.load_state(str(tmp_path / "ck"), strict=False)
    assert "model.safetensors" in seen  # read (and checked) by fastpersist
    for k, v in saved.items():
        assert bits(model.state_dict()[k]) == bits(v), k
    assert not model.state_dict()["1.weight"].any()  # not in the checkpoint: left as it was
    fp.unregister()


def test_hooks_the_user_registers_after_register_see_the_models_first(tmp_path):
    """Regression: hooks registered after :func:`register` that save the
    models their own way and pop them from ``weights`` (diffusers' training
    scripts) failed with ``IndexError: pop from empty list``: the adapter's
    hook had already saved every model and emptied the list; on load it had
    emptied ``models`` before the user's hook. The adapter's hooks now run
    last, and the folder holds what it holds without fastpersist."""
    from accelerate.state import AcceleratorState, GradientState

    def run(fp: bool):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        acc = Accelerator(cpu=True)
        torch.manual_seed(0)
        first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
        first, second, opt = acc.prepare(first, second, torch.optim.SGD(first.parameters(), lr=0.1))
        handle = register(acc) if fp else None
        out = tmp_path / ("fp" if fp else "stock")
        loaded = []

        def save_hook(models, weights, output_dir):
            torch.save(acc.unwrap_model(models[0]).state_dict(), os.path.join(output_dir, "my_model.pt"))
            weights.pop(0)  # saved here: Accelerate saves the rest (``models`` is the Accelerator's own list)

        def load_hook(models, input_dir):
            model = models.pop(0)
            model.load_state_dict(torch.load(os.path.join(input_dir, "my_model.pt")))
            loaded.append(model)

        acc.register_save_state_pre_hook(save_hook)
        acc.register_load_state_pre_hook(load_hook)
        want = {k: v.clone() for k, v in second.state_dict().items()}
        acc.save_state(str(out))
        if handle is not None:
            handle.wait()
        with torch.no_grad():
            for p in list(first.parameters()) + list(second.parameters()):
                p.zero_()
        acc.load_state(str(out))
        assert loaded == [first] and first.weight.any()
        assert all(bits(second.state_dict()[k]) == bits(v) for k, v in want.items())
        if handle is not None:
            handle.unregister()
        return sorted(os.listdir(out))

    assert run(True) == run(False)


def test_load_state_skips_a_folder_whose_save_did_not_finish(tmp_path):
    """Regression: a save_state runs in the background; a process killed
    meanwhile left a newest ``checkpoint_<n>`` with some of its files, which
    ``load_state()`` (automatic naming: the newest folder) then took, and
    failed on or loaded in part. A folder is now marked pending, durably,
    before its first file, and unmarked once it is whole and durable:
    ``load_state()`` takes the newest whole folder and refuses a pending
    one by name."""
    import shutil

    PENDING = ".fastpersist-save-pending"
    assert getattr(fastpersist.integrations.accelerate, "PENDING", PENDING) == PENDING
    acc, model, opt, sched = setup(tmp_path, limit=5)
    fp = register(acc)
    seen = []
    real = fp.saves.save

    def spy(obj, f, **kw):
        seen.append(os.path.isfile(os.path.join(os.path.dirname(os.fspath(f)), PENDING)))
        return real(obj, f, **kw)

    fp.saves.save = spy
    states = []
    for step in range(2):
        train(acc, model, opt, sched, [step])
        states.append({k: v.clone() for k, v in model.state_dict().items()})
        acc.save_state()
    fp.wait()
    assert seen and all(seen)  # marked before every file
    root = tmp_path / "checkpoints"
    assert sorted(os.listdir(root)) == ["checkpoint_0", "checkpoint_1"]
    assert not [p for p in root.rglob(PENDING)]
    # What a process killed during the next save leaves: a newer folder, in part, still pending.
    killed = root / "checkpoint_2"
    shutil.copytree(root / "checkpoint_1", killed)
    for n in os.listdir(killed):
        if n.startswith("optimizer"):
            os.unlink(killed / n)
    (killed / PENDING).touch()
    train(acc, model, opt, sched, [5])
    acc.load_state()
    for k, v in states[1].items():
        assert bits(model.state_dict()[k]) == bits(v), k
    with pytest.raises(fastpersist.CorruptCheckpointError, match="did not finish"):
        acc.load_state(str(killed))
    # None finished: an error, not the newest torn folder (review).
    for d in ("checkpoint_0", "checkpoint_1"):
        (root / d / PENDING).touch()
    with pytest.raises(fastpersist.CorruptCheckpointError, match="no checkpoint folder whose save_state finished"):
        acc.load_state()
    fp.unregister()
