"""Checkpoint tiers beyond the node: object storage through fsspec.

A checkpoint is uploaded data first, then a small *commit marker* next to it
(``<name>.fpcommit``, JSON: size, format and the number of records that
verified before the upload): a listing takes only checkpoints whose marker exists and
whose object has the recorded size, so an upload cut short (a killed
process, a lost connection) is never taken for a whole checkpoint. Deletion
goes the other way: marker first, then data. Downloads land in the local
directory through the core's durable commit, after the CRCs are verified.

Uploads are fsspec's own (``put_file``: multipart for large files on S3,
with s3fs's bounded concurrency); credentials and endpoints come from the
usual fsspec/boto configuration (environment, ``~/.aws``,
``storage_options``), never from fastpersist's files.

>>> fastpersist.upload("ckpt-100.pt", "s3://bucket/run1/")  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import posixpath
import time
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

from . import _core
from .errors import CorruptCheckpointError, FastPersistError
from .verify import verify_file

__all__ = ["ObjectStore", "TransferStats", "TierError", "upload", "is_url", "MARKER_SUFFIX"]

#: Suffix of the commit marker written after a checkpoint's data.
MARKER_SUFFIX = ".fpcommit"


class TierError(FastPersistError, OSError):
    """A transfer to or from a remote tier failed (credentials refused, the
    bucket missing, the connection lost). The local checkpoint is kept."""


@dataclass(frozen=True)
class TransferStats:
    """One upload or download."""

    #: Where the bytes went.
    url: str
    bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def is_url(path: Any) -> bool:
    """Whether ``path`` names a remote location (``scheme://...``, other
    than ``file://``)."""
    s = os.fspath(path) if not isinstance(path, str) else path
    return isinstance(s, str) and "://" in s and not s.startswith("file://")


def _fs(url: str, storage_options: Optional[Mapping[str, Any]]) -> Tuple[Any, str]:
    try:
        import fsspec
    except ImportError as e:  # pragma: no cover - fsspec comes with torch
        raise TierError(f"a remote tier needs fsspec (pip install fsspec s3fs): {e}") from None
    try:
        fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    except (ImportError, ValueError) as e:
        raise TierError(f"cannot open {url}: {e} (for s3:// install s3fs: pip install 'fastpersist[s3]')") from None
    return fs, root.rstrip("/")


class ObjectStore:
    """One prefix of an object store (any fsspec URL: ``s3://bucket/run1``,
    ``gs://...``, ``memory://...``) holding checkpoint files and their
    commit markers."""

    def __init__(self, url: str, storage_options: Optional[Mapping[str, Any]] = None) -> None:
        self.url = url.rstrip("/")
        self.fs, self.root = _fs(url, storage_options)

    def _path(self, name: str) -> str:
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"{name!r} is not a checkpoint file name")
        return posixpath.join(self.root, name)

    def url_of(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except FileNotFoundError:
            raise
        except Exception as e:  # every backend has its own errors
            raise TierError(f"{what} failed: {type(e).__name__}: {e}") from e

    def upload(self, local: str, name: Optional[str] = None) -> TransferStats:
        """Upload the checkpoint at ``local`` as ``name`` (default: its file
        name), data first, then its marker. The local file is verified first
        (a damaged checkpoint is never uploaded)."""
        name = name or os.path.basename(local)
        t0 = time.perf_counter()
        try:
            info = verify_file(local)
        except CorruptCheckpointError as e:
            raise TierError(f"{local} is damaged and was not uploaded: {e}") from e
        size = os.path.getsize(local)
        dst = self._path(name)
        self._call(f"upload of {local} to {self.url_of(name)}", self.fs.put_file, local, dst)
        fmt, records = info
        marker = {
            "size": size,
            "time": time.time(),
            "fastpersist": _core.__version__,
            "format": fmt,
            "records": records,
        }
        self._call(f"commit marker of {self.url_of(name)}", self.fs.pipe_file, dst + MARKER_SUFFIX, _json(marker))
        return TransferStats(self.url_of(name), size, time.perf_counter() - t0)

    def committed(self) -> Dict[str, int]:
        """Names of the checkpoints whose upload completed -> their sizes
        (a marker whose object is missing or of another size is ignored)."""
        self.fs.invalidate_cache(self.root)  # other processes upload and delete too
        try:
            entries = self._call(f"listing of {self.url}", self.fs.ls, self.root, True)
        except FileNotFoundError:
            return {}
        sizes = {
            posixpath.basename(e["name"].rstrip("/")): e.get("size") for e in entries if e.get("type") != "directory"
        }
        out: Dict[str, int] = {}
        for name in sizes:
            if not name.endswith(MARKER_SUFFIX):
                continue
            data = name[: -len(MARKER_SUFFIX)]
            if data not in sizes:
                continue
            try:
                marker = json.loads(self._call("marker read", self.fs.cat_file, self._path(name)))
            except (FileNotFoundError, ValueError):
                continue
            if isinstance(marker, dict) and marker.get("size") == sizes[data]:
                out[data] = int(sizes[data])
        return out

    def download(self, name: str, local: str) -> TransferStats:
        """Fetch ``name`` into ``local`` (committed durably, and only after
        its CRCs verify; an existing ``local`` is replaced only then)."""
        t0 = time.perf_counter()
        src = self._path(name)
        with _core.TempFile(local) as tmp:
            with self._call(f"download of {self.url_of(name)}", self.fs.open, src, "rb") as f:
                off = 0
                while True:
                    chunk = self._call(f"download of {self.url_of(name)}", f.read, 16 << 20)
                    if not chunk:
                        break
                    os.pwrite(tmp.fd, chunk, off)
                    off += len(chunk)
            os.fsync(tmp.fd)
            try:
                verify_file(tmp.temp_path)
            except CorruptCheckpointError as e:
                raise CorruptCheckpointError(f"{self.url_of(name)} (downloaded) is damaged: {e}") from None
            tmp.commit(off, durable=True)
        return TransferStats(local, off, time.perf_counter() - t0)

    def delete(self, name: str) -> None:
        """Remove a checkpoint: its marker first (it is no longer listed),
        then its data."""
        for p in (self._path(name) + MARKER_SUFFIX, self._path(name)):
            try:
                self._call(f"delete of {p}", self.fs.rm_file, p)
            except FileNotFoundError:
                pass


def _json(obj: Any) -> bytes:
    return json.dumps(obj, default=str, sort_keys=True).encode()


def upload(
    path: Any, url: str, *, name: Optional[str] = None, storage_options: Optional[Mapping[str, Any]] = None
) -> TransferStats:
    """Upload the checkpoint at ``path`` under the prefix ``url`` (any fsspec
    URL), data first and its commit marker last; returns what was moved.
    Raises :class:`TierError` when the store refuses (credentials, bucket)."""
    return ObjectStore(url, storage_options).upload(os.fspath(path), name)
