"""Watches the snapshot staging buffers of fastpersist's background saves,
for the adapters' prepare tests: which were made ahead of the first save
(by ``AsyncSaver.prepare_many``) and which on a save's critical path."""

from __future__ import annotations

import os
import threading
from typing import Any, List, Tuple

import fastpersist.async_save as async_save


class PrepareSpy:
    """In ``events``, in order: ``("prepare", n_files)`` when an adapter
    asks for buffers, ``("save", file name)`` when it starts a save,
    ``("alloc-prepare", nbytes)`` / ``("alloc-save", nbytes)`` when a
    buffer is made ahead / by a snapshot."""

    def __init__(self, monkeypatch: Any) -> None:
        self.events: List[Tuple[str, Any]] = []
        local = threading.local()
        real_new = async_save._new_buffer
        real_reserve = async_save.SnapshotPool.reserve_many
        real_prepare = async_save.AsyncSaver.prepare_many
        real_save = async_save.AsyncSaver.save

        def new_buffer(nbytes: int, pin: bool) -> Any:
            self.events.append(("alloc-prepare" if getattr(local, "ahead", False) else "alloc-save", nbytes))
            return real_new(nbytes, pin)

        def reserve_many(pool: Any, requests: Any) -> None:
            local.ahead = True
            try:
                real_reserve(pool, requests)
            finally:
                local.ahead = False

        def prepare_many(saver: Any, objs: Any, **kw: Any) -> Any:
            objs = list(objs)
            self.events.append(("prepare", len(objs)))
            return real_prepare(saver, objs, **kw)

        def save(saver: Any, obj: Any, path: Any, **kw: Any) -> Any:
            self.events.append(("save", os.path.basename(os.fspath(path))))
            return real_save(saver, obj, path, **kw)

        monkeypatch.setattr(async_save, "_new_buffer", new_buffer)
        monkeypatch.setattr(async_save.SnapshotPool, "reserve_many", reserve_many)
        monkeypatch.setattr(async_save.AsyncSaver, "prepare_many", prepare_many)
        monkeypatch.setattr(async_save.AsyncSaver, "save", save)

    def kinds(self) -> List[str]:
        return [k for k, _ in self.events]

    def first_checkpoint(self, files: int = 1) -> List[str]:
        """The kinds of events up to the start of the save after the first
        checkpoint's ``files`` saves (or to the end)."""
        kinds = self.kinds()
        saves = [i for i, k in enumerate(kinds) if k == "save"]
        end = saves[files] if len(saves) > files else len(kinds)
        return kinds[:end]

    def prepared_before_first_save(self, files: int = 1) -> bool:
        """Buffers were asked for before the first save, and the first
        checkpoint's saves made none of their own."""
        kinds = self.first_checkpoint(files)
        return "save" in kinds and "prepare" in kinds[: kinds.index("save")] and "alloc-save" not in kinds
