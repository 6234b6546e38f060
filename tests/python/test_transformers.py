"""The Hugging Face Trainer mixin, driven by a real Trainer with a tiny GPT-2 (CPU)."""

from __future__ import annotations

import errno
import json
import os
import re
import time
import zipfile

import fastpersist
import fastpersist.integrations.common
import pytest
import torch
from helpers import bits, written_by_fastpersist

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'fastpersist[transformers]')"
)
pytest.importorskip("accelerate", reason="the Trainer needs accelerate")
from fastpersist.integrations.common import CRC_SIDECAR  # noqa: E402
from fastpersist.integrations.transformers import FastPersistTrainerMixin, latest_complete_checkpoint  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

STEPS = 8


class FPTrainer(FastPersistTrainerMixin, Trainer):
    pass


def model():
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.1)
    return GPT2LMHeadModel(cfg)


def data():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (64, 16), generator=g)
    return [{"input_ids": x, "labels": x} for x in ids]


def run_args(out, **kw) -> dict:
    """The arguments every test run shares (CPU, seeded, a save every 2
    steps, logs every step), with ``kw`` on top."""
    base = dict(
        output_dir=str(out),
        save_steps=2,
        per_device_train_batch_size=4,
        logging_steps=1,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    base.update(kw)
    return base


def args(out, **kw):
    return TrainingArguments(**run_args(out, **{"max_steps": STEPS, "save_total_limit": 2, **kw}))


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


def losses(trainer):
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def test_resume_matches_a_run_that_never_stopped_and_rotation_keeps_the_limit(tmp_path):
    ref = FPTrainer(model=model(), args=args(tmp_path / "ref", save_strategy="no"), train_dataset=data())
    ref.train()

    out = tmp_path / "run"
    a = FPTrainer(model=model(), args=args(out), train_dataset=data(), callbacks=[StopAt(4)])
    a.train()
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-4"]
    ck = out / "checkpoint-4"
    names = set(os.listdir(ck))
    for n in ["model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"]:
        assert n in names, names
    assert not [n for n in names if "fptmp" in n or "pending" in n]
    for n in ["optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin"]:
        assert written_by_fastpersist(ck / n), n
    assert (ck / "model.safetensors").read_bytes()[8:4096].endswith(b" ")  # header padded to 4096: ours
    assert a._fastpersist.fallbacks == 0
    assert torch.load(ck / "optimizer.pt", weights_only=True)["state"]

    b = FPTrainer(model=model(), args=args(out), train_dataset=data())
    b.train(resume_from_checkpoint=True)
    assert sorted(os.listdir(out)) == ["checkpoint-6", "checkpoint-8"]  # rotated to the limit
    want, got = losses(ref), {**losses(a), **losses(b)}
    assert [got[s] for s in range(1, STEPS + 1)] == [want[s] for s in range(1, STEPS + 1)]
    for (k, x), (_, y) in zip(ref.model.state_dict().items(), b.model.state_dict().items()):
        assert bits(x) == bits(y), k


def test_disk_full_surfaces_and_the_previous_checkpoint_survives(tmp_path, engine_fault):
    class FillDisk(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 4:  # before the Trainer saves step 4
                t.fastpersist_wait()
                engine_fault(0, errno.ENOSPC)

    out = tmp_path / "run"
    t = FPTrainer(model=model(), args=args(out, save_total_limit=1), train_dataset=data(), callbacks=[FillDisk()])
    with pytest.raises(fastpersist.WriteError) as ei:
        t.train()
    assert ei.value.errno == errno.ENOSPC
    # checkpoint-2 is complete and was not rotated away; checkpoint-4 never got its trainer_state.json.
    assert latest_complete_checkpoint(str(out)) == str(out / "checkpoint-2")
    assert not (out / "checkpoint-4" / "trainer_state.json").exists()
    engine_fault_cleared = FPTrainer(model=model(), args=args(out), train_dataset=data())
    with pytest.raises(ValueError, match="incomplete"):
        engine_fault_cleared.train(resume_from_checkpoint=str(out / "checkpoint-4"))


def test_files_are_the_ones_the_trainer_reads_without_fastpersist(tmp_path):
    out = tmp_path / "run"
    FPTrainer(model=model(), args=args(out, max_steps=2), train_dataset=data()).train()
    plain = Trainer(model=model(), args=args(out, max_steps=4), train_dataset=data())
    plain.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert plain.state.global_step == 4


def test_a_failed_save_into_an_existing_folder_leaves_it_incomplete(tmp_path, monkeypatch):
    """Regression: a ``checkpoint-<step>`` folder that already existed (an
    earlier run in the same output_dir) kept its old ``trainer_state.json``
    and CRC sidecar while a new save wrote into it, so a failed new save
    left a mix of the two runs that still counted as complete. The folder
    is now incomplete from the start of the new save until its commit."""
    out = tmp_path / "run"
    ck = out / "checkpoint-2"
    FPTrainer(model=model(), args=args(out, max_steps=2), train_dataset=data()).train()
    assert latest_complete_checkpoint(str(out)) == str(ck) and (ck / CRC_SIDECAR).is_file()

    real = fastpersist.integrations.common.BackgroundSaves.save

    def failing(self, obj, path, **kw):
        if str(path).endswith("optimizer.pt"):
            raise OSError(errno.ENOSPC, "No space left on device (injected)", str(path))
        return real(self, obj, path, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fastpersist.integrations.common.BackgroundSaves, "save", failing)
        t = FPTrainer(model=model(), args=args(out, max_steps=2, seed=1), train_dataset=data())
        with pytest.raises(OSError, match="injected"):
            t.train()
        t.fastpersist_wait()
    assert latest_complete_checkpoint(str(out)) is None
    assert not (ck / "trainer_state.json").exists() and not (ck / CRC_SIDECAR).exists()
    with pytest.raises(ValueError, match="incomplete"):
        FPTrainer(model=model(), args=args(out, max_steps=3), train_dataset=data()).train(
            resume_from_checkpoint=str(ck)
        )

    # A save into it that succeeds commits it again.
    FPTrainer(model=model(), args=args(out, max_steps=2), train_dataset=data()).train()
    assert latest_complete_checkpoint(str(out)) == str(ck) and (ck / CRC_SIDECAR).is_file()


def test_rotation_keeps_complete_checkpoints_over_an_incomplete_newer_folder(tmp_path):
    """Regression: rotation ran the Trainer's ``rotate_checkpoints``, which
    always keeps the highest-numbered folder, complete or not: with an
    incomplete ``checkpoint-4`` left by a killed run, every checkpoint the
    resumed run committed was deleted right after its commit. Rotation now
    counts complete checkpoints only, never deletes the one just committed
    and leaves incomplete folders alone."""
    out = tmp_path / "run"
    FPTrainer(model=model(), args=args(out, max_steps=2), train_dataset=data()).train()
    # What a process killed during the step-4 save leaves: files, no trainer_state.json.
    killed = out / "checkpoint-4"
    killed.mkdir()
    (killed / "config.json").write_text("{}")

    seen = []

    class Watch(TrainerCallback):
        def on_save(self, args, state, control, **kw):
            t.fastpersist_wait()  # committed, and rotated
            seen.append(sorted(n for n in os.listdir(out) if (out / n / "trainer_state.json").is_file()))

    t = FPTrainer(
        model=model(),
        args=args(out, max_steps=3, save_steps=1, save_total_limit=1),
        train_dataset=data(),
        callbacks=[Watch()],
    )
    t.train(resume_from_checkpoint=True)
    assert seen == [["checkpoint-3"]], seen
    assert latest_complete_checkpoint(str(out)) == str(out / "checkpoint-3")
    assert sorted(os.listdir(out)) == ["checkpoint-3", "checkpoint-4"]  # the incomplete folder is not ours to rotate
    assert not (killed / "trainer_state.json").exists()


def test_push_to_hub_uploads_a_checkpoint_once_it_is_committed(tmp_path, monkeypatch):
    """Regression: with ``push_to_hub=True`` the Trainer pushed the
    checkpoint folder from inside ``_save_checkpoint``, while its files
    were still being written: the upload had no weights, no optimizer and
    no ``trainer_state.json``. The push now runs once the checkpoint is
    committed (the Hub API is stubbed: its upload lists the folder)."""
    import types

    uploads = []

    class FakeApi:
        def create_repo(self, name, **kw):
            return types.SimpleNamespace(repo_id=f"me/{name}")

        def upload_folder(self, *, folder_path, path_in_repo=None, **kw):
            uploads.append((path_in_repo or ".", sorted(os.listdir(folder_path))))
            return types.SimpleNamespace(done=lambda: True, is_done=lambda: True)

    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: FakeApi())
    out = tmp_path / "run"
    a = args(out, max_steps=4, push_to_hub=True, hub_strategy="checkpoint", hub_always_push=True)
    FPTrainer(model=model(), args=a, train_dataset=data()).train()
    pushed = [files for where, files in uploads if where == "last-checkpoint"]
    assert len(pushed) == 2, uploads
    for files in pushed:
        for n in ["model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json", CRC_SIDECAR]:
            assert n in files, files
        assert not [n for n in files if "fptmp" in n or "pending" in n], files
    for where, files in uploads:
        if where == ".":
            assert "model.safetensors" in files, files  # copied from the committed checkpoint


class ShardedGPT2(GPT2LMHeadModel):
    """save_pretrained with a small ``max_shard_size`` (the Trainer passes none): 7 shards."""

    def save_pretrained(self, *a, **kw):
        kw.setdefault("max_shard_size", "20KB")
        return super().save_pretrained(*a, **kw)


def sharded_model():
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.1)
    return ShardedGPT2(cfg)


def test_sharded_model_files_and_index_are_the_stock_trainers_and_resume_matches(tmp_path):
    stock = Trainer(
        model=sharded_model(), args=args(tmp_path / "stock", max_steps=4, save_steps=4), train_dataset=data()
    )
    stock.train()
    out = tmp_path / "run"
    a = FPTrainer(model=sharded_model(), args=args(out, max_steps=4, save_steps=4), train_dataset=data())
    a.train()
    want, got = tmp_path / "stock" / "checkpoint-4", out / "checkpoint-4"
    shards = sorted(n for n in os.listdir(got) if n.endswith(".safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(os.listdir(got)) == sorted(os.listdir(want) + [CRC_SIDECAR])
    index = "model.safetensors.index.json"
    assert (got / index).read_text() == (want / index).read_text()  # same weight map, sizes, byte for byte
    from safetensors.torch import load_file

    for n in shards:
        assert (got / n).read_bytes()[8:4096].endswith(b" "), n  # header padded to 4096: written by fastpersist
        x, y = load_file(got / n), load_file(want / n)
        assert x.keys() == y.keys() and all(bits(x[k]) == bits(y[k]) for k in x), n

    # Resume from the sharded checkpoint (checkpoint-2 of a run stopped at 2) matches a run that never stopped.
    run2 = tmp_path / "run2"
    FPTrainer(model=sharded_model(), args=args(run2, max_steps=4), train_dataset=data(), callbacks=[StopAt(2)]).train()
    assert (run2 / "checkpoint-2" / index).is_file()
    b = FPTrainer(model=sharded_model(), args=args(run2, max_steps=4), train_dataset=data())
    b.train(resume_from_checkpoint=True)
    assert [losses(b)[s] for s in (3, 4)] == [losses(stock)[s] for s in (3, 4)]
    for (k, x), (_, y) in zip(stock.model.state_dict().items(), b.model.state_dict().items()):
        assert bits(x) == bits(y), k


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def data_offset(path, record):
    """File offset of the first byte of a zip record."""
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(record)
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        n, m = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
    return info.header_offset + 30 + n + m


@pytest.mark.parametrize(
    "victim",
    ["optimizer.pt", "scheduler.pt", "rng_state.pth", "model-00002-of-00007.safetensors", "model.safetensors"],
)
def test_resume_reads_through_fastpersist_and_a_damaged_file_is_named(tmp_path, victim):
    sharded = victim.startswith("model-")
    make = sharded_model if sharded else model
    out = tmp_path / "run"
    FPTrainer(model=make(), args=args(out, max_steps=2), train_dataset=data()).train()
    ck = out / "checkpoint-2"
    side = json.loads((ck / CRC_SIDECAR).read_text())
    assert sorted(side["files"]) == sorted(n for n in os.listdir(ck) if n.endswith(".safetensors"))

    # Undamaged: every file the resume reads goes through fastpersist's reader, CRCs checked.
    seen = []
    real = fastpersist.integrations.common.read_state_dict

    def spy(path, **kw):
        seen.append(os.path.basename(path))
        return real(path, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fastpersist.integrations.common, "read_state_dict", spy)
        t = FPTrainer(model=make(), args=args(out, max_steps=3), train_dataset=data())
        t.train(resume_from_checkpoint=str(ck))
    assert t.state.global_step == 3
    weights = sorted(side["files"])
    assert set(seen) >= {"optimizer.pt", "scheduler.pt", "rng_state.pth", *weights}, seen

    path = ck / victim
    if victim.endswith(".safetensors"):
        n = int.from_bytes(path.read_bytes()[:8], "little")
        flip_byte(path, 8 + n + 5)  # a byte of tensor data: safetensors itself would load it
    else:
        with zipfile.ZipFile(path) as z:
            record = max(z.infolist(), key=lambda i: ("/data/" in i.filename, i.file_size)).filename
        flip_byte(path, data_offset(path, record) + 5)  # torch.load checks no CRC: it would load this
    t = FPTrainer(model=make(), args=args(out, max_steps=4), train_dataset=data())
    with pytest.raises(fastpersist.CorruptCheckpointError, match=re.escape(victim)):
        t.train(resume_from_checkpoint=str(ck))


def test_a_checkpoint_written_by_the_stock_trainer_still_resumes(tmp_path):
    out = tmp_path / "run"
    Trainer(model=model(), args=args(out, max_steps=2), train_dataset=data()).train()
    assert not (out / "checkpoint-2" / CRC_SIDECAR).exists()
    t = FPTrainer(model=model(), args=args(out, max_steps=3), train_dataset=data())
    t.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert t.state.global_step == 3


def test_trl_sft_trainer_saves_through_fastpersist_and_resumes_as_if_it_never_stopped(tmp_path):
    pytest.importorskip("trl", reason="TRL is not installed")
    datasets = pytest.importorskip("datasets", reason="TRL needs datasets")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    class FPSFTTrainer(FastPersistTrainerMixin, SFTTrainer):
        pass

    words = [f"w{i}" for i in range(60)]
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    g = torch.Generator().manual_seed(0)
    texts = [" ".join(words[j] for j in torch.randint(0, 60, (12,), generator=g).tolist()) for _ in range(64)]
    train = datasets.Dataset.from_dict({"text": texts})

    def trainer(out, cls=FPSFTTrainer, **kw):
        cfg = SFTConfig(**run_args(out, **{"max_steps": 6, "max_length": 16, **kw}))
        return cls(model=model(), args=cfg, train_dataset=train, processing_class=tokenizer)

    ref = trainer(tmp_path / "ref", cls=SFTTrainer, save_strategy="no")
    ref.train()
    out = tmp_path / "run"
    a = trainer(out)
    a.add_callback(StopAt(4))
    a.train()
    ck = out / "checkpoint-4"
    assert written_by_fastpersist(ck / "optimizer.pt") and (ck / CRC_SIDECAR).is_file()
    assert a._fastpersist.fallbacks == 0
    b = trainer(out)
    b.train(resume_from_checkpoint=True)
    assert b.state.global_step == 6
    want, got = losses(ref), {**losses(a), **losses(b)}
    assert [got[s] for s in range(1, 7)] == [want[s] for s in range(1, 7)]
    for (k, x), (_, y) in zip(ref.model.state_dict().items(), b.model.state_dict().items()):
        assert bits(x) == bits(y), k


def test_crc_sidecar_checks_safetensors_loads(tmp_path):
    from fastpersist.integrations.common import safe_load_file_via, write_crc_sidecar

    t = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, 5, dtype=torch.bfloat16)}
    p = tmp_path / "model.safetensors"
    stats = fastpersist.write_state_dict(t, p, format="safetensors")
    other = fastpersist.write_state_dict(t, tmp_path / "sub.pt")  # not a safetensors file: not listed
    assert write_crc_sidecar(str(tmp_path), [stats, other]) == str(tmp_path / CRC_SIDECAR)
    assert list(json.loads((tmp_path / CRC_SIDECAR).read_text())["files"]) == ["model.safetensors"]
    load = safe_load_file_via()
    got = load(str(p))
    assert got.keys() == t.keys() and all(bits(got[k]) == bits(t[k]) for k in t)

    flip_byte(p, os.path.getsize(p) - 1)  # the last byte of "b"
    with pytest.raises(fastpersist.CorruptCheckpointError, match=r"model\.safetensors: tensor 'b' fails its CRC32"):
        load(str(p))
    flip_byte(p, os.path.getsize(p) - 1)
    with open(p, "ab") as f:
        f.write(b"\0")
    with pytest.raises(fastpersist.CorruptCheckpointError, match="model.safetensors"):
        load(str(p))
    os.truncate(p, stats.bytes)
    assert load(str(p)).keys() == t.keys()
    for damaged in ("{not json", "[" * 100_000):  # (nested too deep: was a RecursionError)
        (tmp_path / CRC_SIDECAR).write_text(damaged)
        with pytest.raises(fastpersist.CorruptCheckpointError, match=CRC_SIDECAR):
            load(str(p))
    os.remove(tmp_path / CRC_SIDECAR)  # no sidecar: read as fastpersist.patch() reads it, unchecked
    assert load(str(p)).keys() == t.keys()


class PlainLM(torch.nn.Module):
    """Not a PreTrainedModel: the Trainer saves its state dict with safetensors' save_file itself."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(64, 16)
        self.out = torch.nn.Linear(16, 64)

    def forward(self, input_ids, labels=None):
        logits = self.out(self.emb(input_ids))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits}


def test_a_model_that_is_not_a_pretrained_model_is_saved_and_resumed_through_fastpersist(tmp_path):
    ref = FPTrainer(model=PlainLM(), args=args(tmp_path / "ref", max_steps=4, save_strategy="no"), train_dataset=data())
    ref.train()
    out = tmp_path / "run"
    FPTrainer(model=PlainLM(), args=args(out, max_steps=4), train_dataset=data(), callbacks=[StopAt(2)]).train()
    ck = out / "checkpoint-2"
    assert (ck / "model.safetensors").read_bytes()[8:4096].endswith(b" ")  # written by fastpersist
    assert list(json.loads((ck / CRC_SIDECAR).read_text())["files"]) == ["model.safetensors"]
    b = FPTrainer(model=PlainLM(), args=args(out, max_steps=4), train_dataset=data())
    b.train(resume_from_checkpoint=True)
    assert [losses(b)[s] for s in (3, 4)] == [losses(ref)[s] for s in (3, 4)]
    for (k, x), (_, y) in zip(ref.model.state_dict().items(), b.model.state_dict().items()):
        assert bits(x) == bits(y), k


# -- the snapshot buffers made ahead of the first checkpoint ---------------------------

FILES = 5  # model.safetensors, training_args.bin, optimizer.pt, scheduler.pt, rng_state.pth


def test_snapshot_buffers_are_made_before_the_first_checkpoint_and_resume_still_matches(tmp_path, monkeypatch):
    """Fresh run: made right after the optimizer's first step (AdamW has no
    state before it), before the step-2 checkpoint, whose five files then
    make no buffer of their own. Resumed run: the optimizer state is loaded
    before ``on_train_begin``, so they are made there. The resumed run
    matches one that never stopped."""
    from prepare_spy import PrepareSpy

    ref = FPTrainer(model=model(), args=args(tmp_path / "ref", save_strategy="no"), train_dataset=data())
    ref.train()

    spy = PrepareSpy(monkeypatch)
    seen = []

    class Where(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            seen.append((state.global_step, spy.kinds().count("prepare")))

    out = tmp_path / "run"
    a = FPTrainer(model=model(), args=args(out), train_dataset=data(), callbacks=[StopAt(4), Where()])
    a.train()
    assert seen[:2] == [(0, 0), (1, 1)], seen  # after the first step, before the second
    assert spy.prepared_before_first_save(FILES), spy.events
    assert spy.kinds().count("save") == 2 * FILES

    spy.events.clear()
    seen.clear()
    b = FPTrainer(model=model(), args=args(out), train_dataset=data(), callbacks=[Where()])
    b.train(resume_from_checkpoint=True)
    assert seen[0] == (4, 1), seen  # before the first resumed step: the optimizer state was loaded
    assert spy.kinds()[0] == "prepare" and spy.prepared_before_first_save(FILES), spy.events
    want, got = losses(ref), {**losses(a), **losses(b)}
    assert [got[s] for s in range(1, STEPS + 1)] == [want[s] for s in range(1, STEPS + 1)]
    for (k, x), (_, y) in zip(ref.model.state_dict().items(), b.model.state_dict().items()):
        assert bits(x) == bits(y), k


def test_fastpersist_prepare_false_makes_the_buffers_at_the_first_checkpoint(tmp_path, monkeypatch):
    from prepare_spy import PrepareSpy

    spy = PrepareSpy(monkeypatch)
    t = FPTrainer(model=model(), args=args(tmp_path, max_steps=2), train_dataset=data(), fastpersist_prepare=False)
    t.train()
    assert "prepare" not in spy.kinds() and "alloc-save" in spy.first_checkpoint(FILES), spy.events
    spy.events.clear()
    FPTrainer(model=model(), args=args(tmp_path / "no", max_steps=2, save_strategy="no"), train_dataset=data()).train()
    assert spy.kinds() == []  # no checkpoints: no buffers


def test_a_model_that_grows_after_prepare_is_saved_whole(tmp_path, monkeypatch):
    """A 4 MiB buffer added to the model at step 3: the step-4 checkpoint's
    model file is bigger than the buffer made at step 1, and saved whole."""
    from prepare_spy import PrepareSpy
    from safetensors.torch import load_file

    spy = PrepareSpy(monkeypatch)

    class Grow(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kw):
            if state.global_step == 2:
                model.register_buffer("extra", torch.arange(1 << 20, dtype=torch.float32))

    t = FPTrainer(model=model(), args=args(tmp_path, max_steps=4), train_dataset=data(), callbacks=[Grow()])
    t.train()
    assert spy.prepared_before_first_save(FILES) and "alloc-save" in spy.kinds()
    got = load_file(tmp_path / "checkpoint-4" / "model.safetensors")
    assert torch.equal(got["extra"], torch.arange(1 << 20, dtype=torch.float32))
    for k, v in t.model.state_dict().items():
        if k in got:
            assert bits(got[k]) == bits(v), k


def _age(folder, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(folder, (t, t))


def test_a_rerun_into_the_same_output_dir_rotates_out_the_earlier_runs_checkpoints_first(tmp_path):
    """Regression: rotation ordered checkpoints by step number, where the
    Trainer orders them by modification time: a fresh run into an
    ``output_dir`` holding an earlier, longer run's checkpoints deleted its
    own new checkpoints and kept the earlier run's ``checkpoint-8``, which
    ``resume_from_checkpoint=True`` then took. The folders left are now the
    stock Trainer's."""
    left = {}
    for cls in (Trainer, FPTrainer):
        out = tmp_path / cls.__name__
        cls(model=model(), args=args(out), train_dataset=data()).train()
        assert sorted(os.listdir(out)) == ["checkpoint-6", "checkpoint-8"]
        for d in os.listdir(out):
            _age(out / d, 3600)  # an earlier run's
        t = cls(model=model(), args=args(out, max_steps=6), train_dataset=data())
        t.train()
        if cls is FPTrainer:
            t.fastpersist_wait()
        left[cls] = sorted(os.listdir(out))
    assert left[FPTrainer] == left[Trainer] == ["checkpoint-4", "checkpoint-6"], left


def test_rotation_never_enters_a_checkpoint_folder_that_is_a_link(tmp_path):
    """Regression: a ``checkpoint-<n>`` that is a symbolic link to a folder
    elsewhere (an archived checkpoint) was rotated through the link: its
    ``trainer_state.json`` and CRC sidecar outside ``output_dir`` were
    removed. As with the Trainer's own rotation (whose ``rmtree`` of a link
    fails), the link is counted and left, and nothing behind it is touched."""
    archive = tmp_path / "archive" / "checkpoint-1"
    archive.mkdir(parents=True)
    (archive / "trainer_state.json").write_text("{}")
    (archive / CRC_SIDECAR).write_text("{}")
    (archive / "model.safetensors").write_bytes(b"mine")
    out = tmp_path / "run"
    out.mkdir()
    os.symlink(archive, out / "checkpoint-1")
    _age(archive, 3600)
    t = FPTrainer(model=model(), args=args(out, max_steps=4, save_total_limit=1), train_dataset=data())
    t.train()
    t.fastpersist_wait()
    assert sorted(os.listdir(archive)) == sorted(["trainer_state.json", CRC_SIDECAR, "model.safetensors"])
    assert (out / "checkpoint-1").is_symlink()
    assert latest_complete_checkpoint(str(out)) == str(out / "checkpoint-4")


def test_a_callbacks_on_save_finds_the_checkpoint_complete(tmp_path):
    """Regression (found in a hunt): the Trainer calls ``on_save`` as soon as
    ``_save_checkpoint`` returns, and callbacks that upload the folder
    (W&B's ``log_model="checkpoint"``, MLflow's ``log_artifacts``) found it
    half written (no optimizer, scheduler, RNG state or trainer_state.json).
    With such a callback the save is durable before it returns."""
    out = tmp_path / "run"
    seen: dict = {}

    class Upload(TrainerCallback):
        def on_save(self, args, state, control, **kw):
            folder = out / f"checkpoint-{state.global_step}"
            seen[state.global_step] = sorted(n for n in os.listdir(folder) if not n.startswith("."))
            return control

    t = FPTrainer(model=model(), args=args(out, max_steps=4), train_dataset=data(), callbacks=[Upload()])
    t.train()
    plain = tmp_path / "plain"
    Trainer(model=model(), args=args(plain, max_steps=2), train_dataset=data()).train()
    stock = sorted(n for n in os.listdir(plain / "checkpoint-2") if not n.startswith("."))
    assert set(seen) == {2, 4}
    for step, names in seen.items():
        assert set(stock) <= set(names), (step, names, stock)


def test_a_callback_set_up_to_do_nothing_on_save_keeps_saves_in_the_background():
    """transformers' W&B callback acts on ``on_save`` only with
    ``WANDB_LOG_MODEL=checkpoint`` and Trackio's never (found in review:
    either made every save wait); any other callback that overrides
    ``on_save`` makes the save durable before it runs."""
    from types import SimpleNamespace

    from fastpersist.integrations.transformers import _told_of_saves

    def handler(*cbs):
        return SimpleNamespace(callbacks=list(cbs))

    def named(name, **attrs):
        cls = type(name, (TrainerCallback,), {"on_save": lambda self, *a, **k: None})
        cb = cls()
        cb.__dict__.update(attrs)
        return cb

    class Mode(str, __import__("enum").Enum):
        CHECKPOINT = "checkpoint"
        FALSE = "false"

    assert not _told_of_saves(handler(TrainerCallback(), named("WandbCallback", _log_model=Mode.FALSE)))
    assert not _told_of_saves(handler(named("TrackioCallback")))
    assert _told_of_saves(handler(named("WandbCallback", _log_model=Mode.CHECKPOINT)))
    assert _told_of_saves(handler(named("MLflowCallback")))
