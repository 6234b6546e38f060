"""What the adapters share to make snapshot staging buffers ahead of the
first save: ``SnapshotPool.reserve_many``, ``AsyncSaver.prepare_many``,
``BackgroundSaves.prepare`` and ``after_first_step``."""

from __future__ import annotations

import logging

import fastpersist.async_save as async_save
import pytest
import torch
from fastpersist.async_save import AsyncSaver, SnapshotPool
from fastpersist.integrations.common import (
    PREPARE_MARGIN,
    BackgroundSaves,
    after_first_step,
    optimizers_have_state,
    tensors_in,
)
from helpers import assert_same

MiB = 1 << 20
# Up to a page before each storage of 1 MiB or more, which a snapshot places
# at its file offset's place within a page (zero copy).
LENT_SLACK = async_save.LEND_PAGE


@pytest.fixture
def made(monkeypatch):
    """The sizes of the pool buffers made from now on."""
    sizes: list = []
    real = async_save._new_buffer

    def new_buffer(nbytes, pin):
        sizes.append(nbytes)
        return real(nbytes, pin)

    monkeypatch.setattr(async_save, "_new_buffer", new_buffer)
    return sizes


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 1, 0], [1, 2, 0]])
def test_reserve_many_gives_every_snapshot_of_a_checkpoint_its_own_buffer(made, order):
    pool = SnapshotPool()
    sizes = [5 * MiB, 3 * MiB + 1, 0]
    pool.reserve_many([(n, False) for n in sizes])
    assert sorted(made) == sorted(sizes) and pool.nbytes == 5 * MiB + 4 * MiB + 1 * MiB
    made.clear()
    bufs = [pool.acquire(sizes[i]) for i in order]  # in flight together, in any order
    assert made == [] and all(b.numel() >= sizes[i] for b, i in zip(bufs, order))
    for b in bufs:
        pool.put_back(b)
    pool.reserve_many([(n, False) for n in sizes])  # ready already: nothing made
    assert made == [] and pool.nbytes == 10 * MiB


def test_reserve_many_replaces_smaller_idle_buffers_and_keeps_those_it_counts(made):
    pool = SnapshotPool()
    pool.reserve_many([(1 * MiB, False), (2 * MiB, False)])
    made.clear()
    pool.reserve_many([(2 * MiB, False), (6 * MiB, False)])  # the 2 MiB buffer counts, the 1 MiB one is replaced
    assert made == [6 * MiB] and pool.nbytes == 8 * MiB
    with pytest.raises(ValueError, match="nbytes"):
        pool.reserve_many([(-1, False)])


def test_prepare_many_then_a_bigger_state_is_saved_whole(tmp_path, made):
    saver = AsyncSaver()
    try:
        small = {"w": torch.randn(256 << 10)}  # 1 MiB
        fut = saver.prepare_many([small, {"step": 1}], background=True)
        fut.result()
        assert sorted(made) == [0, 1 * MiB + LENT_SLACK]  # a page to place the storage by (zero copy)
        made.clear()
        first = saver.save(small, tmp_path / "a.pt", mode="snapshot")
        first.result()
        assert made == []  # the prepared buffer was used
        big = {"w": torch.randn(1 << 20), "extra": [torch.arange(1000)]}  # grew after prepare
        saver.save(big, tmp_path / "b.pt", mode="snapshot").result()
        assert made  # its snapshot made the buffer it needed
        assert_same(torch.load(tmp_path / "a.pt", weights_only=True), small)
        assert_same(torch.load(tmp_path / "b.pt", weights_only=True), big)
        with pytest.raises(ValueError, match="format"):
            saver.prepare_many([small], format="pickle")
    finally:
        saver.close()


def test_background_saves_prepare_only_for_asynchronous_snapshots(tmp_path, made):
    for saves in (BackgroundSaves("pipelined"), BackgroundSaves("snapshot", async_save=False)):
        assert saves.prepare([{"w": torch.ones(10)}]) is None and saves._saver is None
    saves = BackgroundSaves("snapshot")
    try:
        state = {"w": torch.randn(1 << 20), "opt": {"state": {0: {"m": torch.zeros(1 << 20)}}}}
        saves.prepare([state, {"rng": torch.zeros(5056, dtype=torch.uint8)}]).result()
        assert sorted(made) == [PREPARE_MARGIN + 5056, 8 * MiB + 2 * LENT_SLACK + PREPARE_MARGIN]
        made.clear()
        saves.save(state, tmp_path / "a.pt")
        saves.save({"rng": torch.zeros(5056, dtype=torch.uint8)}, tmp_path / "rng.pt")
        saves.commit("a").result()
        assert made == []
        assert_same(torch.load(tmp_path / "a.pt", weights_only=True), state)
    finally:
        saves.close()


def test_a_failed_prepare_is_logged_and_the_saves_go_on(tmp_path, monkeypatch, caplog):
    saves = BackgroundSaves("snapshot")
    try:

        def refuse(pool, requests):
            raise MemoryError("no room")

        monkeypatch.setattr(SnapshotPool, "reserve_many", refuse)
        with caplog.at_level(logging.WARNING, logger="fastpersist"):
            fut = saves.prepare([{"w": torch.ones(10)}])
            assert isinstance(fut.exception(), MemoryError)
            saves.save({"w": torch.ones(10)}, tmp_path / "a.pt")
            saves.commit("a").result()
        # The failure was logged by the snapshot thread before it took the save (its callbacks run first).
        assert any("ahead of the first save" in r.getMessage() for r in caplog.records)
        assert torch.equal(torch.load(tmp_path / "a.pt", weights_only=True)["w"], torch.ones(10))
    finally:
        saves.close()


def test_tensors_in_walks_containers_once():
    t = torch.ones(2)
    shared = [t]
    obj = {"a": shared, "b": (shared, {"c": torch.zeros(1)}), "n": 3, "s": "x"}
    got = tensors_in(obj)
    assert len(got) == 2 and any(x is t for x in got)


def test_after_first_step_runs_once_after_a_step_and_a_failure_is_only_logged(caplog):
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([p], lr=0.1)
    assert not optimizers_have_state([opt])
    seen = []
    after_first_step([opt], lambda: seen.append(bool(opt.state)))
    for _ in range(3):
        p.grad = torch.ones(3)
        opt.step()
    assert seen == [True] and optimizers_have_state([opt])

    calls = []
    remove = after_first_step([opt], lambda: calls.append(1))
    remove()
    opt.step()
    assert calls == []

    def boom():
        raise RuntimeError("sizing failed")

    after_first_step([opt], boom)
    with caplog.at_level(logging.WARNING, logger="fastpersist"):
        opt.step()  # not raised into the training loop
    assert any("sizing failed" in r.getMessage() for r in caplog.records)
    assert optimizers_have_state([torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1)]) is False
    assert optimizers_have_state([])
