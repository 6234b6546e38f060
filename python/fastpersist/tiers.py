"""Checkpoint tiers beyond the node: object storage through fsspec.

A checkpoint is uploaded data first, then a small *commit marker* next to it
(``<name>.fpcommit``, JSON: size, CRC32, format, the number of records that
verified before the upload, and the identity the store gives the object it
made: its ETag, generation, or inode and mtime): a listing takes only
checkpoints whose marker exists and whose object has the recorded size and
identity, so an upload cut short (a killed process, a lost connection) is
never taken for a whole checkpoint, nor is an object replaced after its
marker was written (a name uploaded again whose new marker never came, two
uploads of one name racing). A store copied or restored from a backup
gives its objects new identities: a Checkpointer still counts an object
whose marker has its size (``committed(unconfirmed=True)``), never sweeps
it, and restores it only once its CRC32s check. Deletion goes the other
way: marker first, then data. Downloads land in the local
directory through the core's durable commit, after the CRCs are verified.

The local file is opened once: verified through that descriptor, then read
part by part with the engine (O_DIRECT: a checkpoint's upload does not fill
the page cache and evict the training's data) and sent in parts. On S3
(s3fs) the parts go up as one multipart upload with at most
``concurrency`` parts in flight; memory is bounded by ``concurrency`` parts
of ``part_bytes`` whatever the checkpoint's size, and a failed upload is
aborted (no parts left behind). Other fsspec stores get the parts through
the store's own streaming writer (``fs.open(..., "wb")``), one at a time.
Credentials and endpoints come from the usual fsspec/boto configuration
(environment, ``~/.aws``, ``storage_options``), never from fastpersist's
files.

>>> fastpersist.upload("ckpt-100.pt", "s3://bucket/run1/")  # doctest: +SKIP
"""

from __future__ import annotations

import errno
import json
import logging
import os
import posixpath
import re
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple

from . import _core
from .errors import CorruptCheckpointError, FastPersistError
from .options import TEMP_MIN_AGE, open_for_read, parse_json, pwrite_all, read_range, remove_stale_temps
from .verify import verify_fd, verify_file

__all__ = [
    "ObjectStore",
    "StoreListing",
    "TransferStats",
    "TierError",
    "upload",
    "is_url",
    "MARKER_SUFFIX",
    "PART_BYTES",
    "CONCURRENCY",
]

log = logging.getLogger("fastpersist")

#: Suffix of the commit marker written after a checkpoint's data.
MARKER_SUFFIX = ".fpcommit"
#: Suffix of an object a streaming store writes before it is moved onto its
#: name (``.<name>.<random>.fpupload``).
UPLOAD_SUFFIX = ".fpupload"
#: Default bytes per uploaded part (S3 takes parts of 5 MiB to 5 GiB, at
#: most 10,000 of them: larger files get larger parts).
PART_BYTES = 32 << 20
#: Default parts in flight (and in memory) per upload.
CONCURRENCY = 4
_S3_MIN_PART = 5 << 20
_S3_MAX_PARTS = 10_000
#: What a store's listing says of an object that changes whenever the object
#: is written again (S3's ETag, GCS's generation, a local file's inode and
#: mtime); a marker records those its object had. ETags are compared
#: without their quotes (services quote them differently in listings and
#: in the answers to uploads).
_IDENTITY = ("ETag", "etag", "generation")
_LOCAL_IDENTITY = ("ino", "mtime")


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

    def __init__(
        self,
        url: str,
        storage_options: Optional[Mapping[str, Any]] = None,
        *,
        part_bytes: int = PART_BYTES,
        concurrency: int = CONCURRENCY,
    ) -> None:
        if isinstance(part_bytes, bool) or not isinstance(part_bytes, int) or part_bytes < 1:
            raise ValueError(f"part_bytes must be a positive int, not {part_bytes!r}")
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be a positive int, not {concurrency!r}")
        if not isinstance(url, str):
            raise TypeError(f"url must be an fsspec URL (a str), not {type(url).__name__}")
        if not url.strip():
            raise ValueError("url must name a place to store checkpoints (an fsspec URL or a directory), not ''")
        self.url = url.rstrip("/")
        self.fs, self.root = _fs(url, storage_options)
        self.multipart = _is_s3(self.fs)
        if self.multipart and not self.fs.split_path(self.root)[0]:
            raise ValueError(f"{url!r} names no bucket (s3://<bucket>/<prefix>)")
        if self.multipart and part_bytes < _S3_MIN_PART:
            raise ValueError(f"part_bytes must be at least 5 MiB on S3 (its smallest part), not {part_bytes}")
        #: Bytes per uploaded part, and parts in flight: an upload holds at
        #: most ``concurrency * part_bytes`` bytes of the file in memory.
        self.part_bytes = part_bytes
        self.concurrency = concurrency

    def _path(self, name: str) -> str:
        if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
            raise ValueError(f"{name!r} is not a checkpoint file name")
        p = posixpath.join(self.root, name)
        if self.multipart:
            # s3fs reads "?versionId=..." in a path as a version: the object
            # (and its marker) would land under another key.
            for q in (p, p + MARKER_SUFFIX):
                _, key, version = self.fs.split_path(q)
                if version is not None or posixpath.basename(key) != posixpath.basename(q):
                    raise ValueError(f"{name!r} cannot name an object on S3 (s3fs reads it as {key!r})")
        return p

    def url_of(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except FileNotFoundError:
            raise
        except Exception as e:  # every backend has its own errors
            raise TierError(f"{what} failed: {type(e).__name__}: {e}") from e

    def upload(self, local: str, name: Optional[str] = None) -> TransferStats:
        """Upload the checkpoint at ``local`` as ``name`` (default: its file
        name), data first, then its marker. The local file is verified first
        (a damaged checkpoint is never uploaded)."""
        name = name or os.path.basename(local)
        dst = self._path(name)
        if self._is_local_file(dst, local):
            # Opening it to write would truncate the very file being read.
            raise ValueError(f"{self.url_of(name)} is {local} itself: upload it elsewhere")
        t0 = time.perf_counter()
        fd = open_for_read(local)  # (a directory or a FIFO: an error naming it, at once)
        try:
            try:
                info = verify_fd(fd, local)
            except CorruptCheckpointError as e:
                raise TierError(f"{local} is damaged and was not uploaded: {e}") from e
            size = os.fstat(fd).st_size
            if self.multipart:
                put = self._put_multipart
            elif self._local():
                put = self._put_local
            else:
                put = self._put_stream
            whole = _Crc()
            try:
                made = self._call(f"upload of {local} to {self.url_of(name)}", put, fd, size, dst, whole)
            except FileNotFoundError as e:
                if self.multipart:  # (S3 writes make keys: the bucket is what is missing)
                    raise TierError(f"upload of {local} to {self.url_of(name)} failed: {self._no_bucket()}") from e
                raise
            if made is None:
                described = self._call(f"upload of {local} to {self.url_of(name)}", self.fs.info, dst)
                made = _identity(described, local=self._local())
        finally:
            os.close(fd)
        fmt, records = info
        marker = {
            "size": size,
            "crc32": whole.value,
            "identity": made,
            "time": time.time(),
            "fastpersist": _core.__version__,
            "format": fmt,
            "records": records,
        }
        self._call(f"commit marker of {self.url_of(name)}", self._put_small, dst + MARKER_SUFFIX, _json(marker))
        return TransferStats(self.url_of(name), size, time.perf_counter() - t0)

    def _put_small(self, path: str, data: bytes) -> None:
        """Write a small object (a commit marker) whole: on the local file
        system through the core's durable commit (a link at ``path`` is
        replaced, never written through into another run's files); elsewhere
        by the store."""
        if self._local():
            with _core.TempFile(path) as tmp:
                pwrite_all(tmp.fd, data, 0)
                tmp.commit(len(data), durable=True)
        else:
            self.fs.pipe_file(path, data)

    def _no_bucket(self) -> str:
        bucket = self.fs.split_path(self.root)[0]
        return f"the bucket {bucket!r} does not exist (or these credentials cannot see it)"

    def _check_bucket(self) -> None:
        """S3: a TierError naming the bucket when it does not exist (a
        missing prefix is only a store with nothing in it yet; a missing
        bucket is a typo that must not read as "no checkpoints")."""
        if not self.multipart:
            return
        bucket = self.fs.split_path(self.root)[0]
        try:
            self._call(f"listing of {self.url}", self.fs.call_s3, "head_bucket", Bucket=bucket)
        except FileNotFoundError:
            raise TierError(f"{self.url}: {self._no_bucket()}") from None

    def _local(self) -> bool:
        """Whether the store is on the local file system (``file://`` or a
        plain directory)."""
        protocol = self.fs.protocol
        return "file" in (protocol if isinstance(protocol, (tuple, list)) else (protocol,))

    def _is_local_file(self, dst: str, local: str) -> bool:
        """Whether ``dst`` of this store is the local file ``local``."""
        if not self._local():
            return False
        try:
            return os.path.samefile(dst, local)
        except OSError:  # either one missing: not the same file
            return False

    def _parts(self, size: int) -> List[Tuple[int, int]]:
        """(offset, bytes) of each part of a file of ``size`` bytes."""
        part = self.part_bytes
        if self.multipart and -(-size // part) > _S3_MAX_PARTS:
            part = -(-size // _S3_MAX_PARTS)
        return [(off, min(part, size - off)) for off in range(0, size, part)] or [(0, 0)]

    def _read_part(self, fd: int, offset: int, n: int, whole: _Crc) -> bytearray:
        """Bytes [offset, offset + n) of the open file, read by the engine
        (O_DIRECT where the file system allows it); parts are read in file
        order, and ``whole`` takes each one's CRC32."""
        buf = bytearray(n)
        whole.add(read_range(fd, offset, buf), n)
        return buf

    def _put_local(self, fd: int, size: int, dst: str, whole: _Crc) -> Optional[Dict[str, Any]]:
        """A store on the local file system: a temporary file beside the
        object, renamed over it once complete and durable (opening the object
        to write would truncate the committed copy of a name uploaded again,
        and a failed upload would leave it cut short)."""
        parent = posixpath.dirname(dst)
        if getattr(self.fs, "auto_mkdir", False):
            self.fs.makedirs(parent, exist_ok=True)  # as fsspec's own writer makes it
        elif not os.path.isdir(parent):
            raise FileNotFoundError(errno.ENOENT, "no such directory in the store", parent)
        with _core.TempFile(dst) as tmp:
            for off, n in self._parts(size):
                pwrite_all(tmp.fd, self._read_part(fd, off, n, whole), off)
            made = os.dup(tmp.fd)
            try:
                tmp.commit(size, durable=True)
                st = os.fstat(made)
            finally:
                os.close(made)
        # The identity of the file this upload made, not of whatever is at
        # the name when it is read back (another upload of the name may have
        # been renamed over it since: its marker must not commit that one).
        return {"ino": st.st_ino, "mtime": st.st_mtime}

    def _put_stream(self, fd: int, size: int, dst: str, whole: _Crc) -> Optional[Dict[str, Any]]:
        """Any other fsspec store: the parts, one at a time, through its
        writer into an object of a name of its own
        (``.<name>.<random>.fpupload``), moved onto the name once complete
        (some stores publish an object as it is opened, and a buffered
        writer's ``close`` publishes what it has: writing the name itself, a
        failed upload would replace the committed copy with a part of the
        new one)."""
        tmp = posixpath.join(posixpath.dirname(dst), f".{posixpath.basename(dst)}.{uuid.uuid4().hex}{UPLOAD_SUFFIX}")
        f = self.fs.open(tmp, "wb")
        done = False
        try:
            for off, n in self._parts(size):
                f.write(self._read_part(fd, off, n, whole))
            f.close()
            self.fs.mv(tmp, dst)
            done = True
        finally:
            if not done:
                discard = getattr(f, "discard", None)  # fsspec's buffered files: drop, don't publish
                try:
                    if callable(discard):
                        discard()
                    self.fs.rm_file(tmp)
                except FileNotFoundError:
                    pass
                except Exception as e:  # noqa: BLE001 - the upload's own error is the one to raise
                    log.warning("fastpersist: could not remove the failed upload %s: %s", tmp, e)
        return None

    def _put_multipart(self, fd: int, size: int, dst: str, whole: _Crc) -> Optional[Dict[str, Any]]:
        """S3: one multipart upload, at most ``concurrency`` parts read and
        in flight at once; aborted on any failure."""
        bucket, key, _ = self.fs.split_path(dst)
        call = self.fs.call_s3
        parts = self._parts(size)
        if len(parts) == 1:
            r = call("put_object", Bucket=bucket, Key=key, Body=bytes(self._read_part(fd, *parts[0], whole)))
            return _identity(r)  # the object this call made, whoever writes the key next
        upload_id = call("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
        room = threading.Semaphore(self.concurrency)
        failed = threading.Event()

        def send(number: int, body: bytearray) -> str:
            r = call("upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body)
            return str(r["ETag"])

        def done(f: Future) -> None:
            if f.exception() is not None:
                failed.set()
            room.release()

        futures: List[Future] = []
        try:
            with ThreadPoolExecutor(self.concurrency, thread_name_prefix="fastpersist-upload") as pool:
                for number, (off, n) in enumerate(parts, 1):
                    room.acquire()  # a part is read only when one of the bounded slots is free
                    if failed.is_set():
                        room.release()
                        break
                    fut = pool.submit(send, number, self._read_part(fd, off, n, whole))
                    fut.add_done_callback(done)
                    futures.append(fut)
            etags = [f.result() for f in futures]  # the first failure raises here
            r = call(
                "complete_multipart_upload",
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": [{"PartNumber": i, "ETag": e} for i, e in enumerate(etags, 1)]},
            )
        except BaseException:
            try:
                call("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
            except Exception as e:  # noqa: BLE001 - the upload's own error is the one to raise
                log.warning("fastpersist: could not abort the multipart upload of %s: %s", dst, e)
            raise
        return _identity(r)

    def scan(self) -> StoreListing:
        """One listing of the store (with each commit marker read): what
        :meth:`committed` and :meth:`sweep` take, for a caller that wants
        both from one listing."""
        committed, objects, unconfirmed = self._scan()
        return StoreListing(committed, objects, unconfirmed)

    def committed(self, unconfirmed: bool = False) -> Dict[str, int]:
        """Names of the checkpoints whose upload completed -> their sizes
        (a marker whose object is missing or of another size is ignored).
        With ``unconfirmed``, also those whose marker has their size but
        not the identity the store gives them now: a store copied or
        restored from a backup (new inodes, ETags of other part sizes), or
        an object written again after its marker; :meth:`download` with
        ``require_identity=False`` tells them apart by their CRC32s. A
        missing bucket is a TierError naming it."""
        committed, _, others = self._scan()
        return {**committed, **others} if unconfirmed else committed

    def _scan(self) -> Tuple[Dict[str, int], Dict[str, Mapping[str, Any]], Dict[str, int]]:
        """:meth:`committed`, every object of the prefix by name, and the
        unconfirmed ones (see :meth:`committed`)."""
        self.fs.invalidate_cache(self.root)  # other processes upload and delete too
        try:
            entries = self._call(f"listing of {self.url}", self.fs.ls, self.root, True)
        except FileNotFoundError:
            self._check_bucket()
            return {}, {}, {}
        objects = {posixpath.basename(e["name"].rstrip("/")): e for e in entries if e.get("type") != "directory"}
        out: Dict[str, int] = {}
        unconfirmed: Dict[str, int] = {}
        for name in objects:
            if not name.endswith(MARKER_SUFFIX):
                continue
            data = name[: -len(MARKER_SUFFIX)]
            if data not in objects:
                continue
            try:
                marker = parse_json(self._call("marker read", self.fs.cat_file, self._path(name)))
            except (FileNotFoundError, ValueError):
                continue
            if _commits(marker, objects[data]):
                out[data] = int(objects[data]["size"])
            elif _commits(marker, objects[data], identity=False):
                unconfirmed[data] = int(objects[data]["size"])
        return out, objects, unconfirmed

    def sweep(
        self,
        doomed: Callable[[str], bool],
        listing: Optional[StoreListing] = None,
        doomed_temp: Optional[Callable[[str], bool]] = None,
    ) -> List[str]:
        """Remove what uploads of the names ``doomed`` accepts left behind:
        an object no commit marker commits (an upload cut short, a name
        uploaded again whose new marker never came, a deletion whose second
        half failed) and a marker whose object is gone, a streaming upload's own object
        (``.<name>.<random>.fpupload``), on the local file system a killed
        upload's temporary file (once no process writes it and it is
        ``TEMP_MIN_AGE`` old) and, on S3, an unfinished multipart
        upload (a killed process's: its parts are stored, and billed, until
        aborted). Committed checkpoints (unconfirmed ones too: a copied
        store's are whole) and anything of another name are left alone.
        ``listing``: one :meth:`scan` made before (objects it does not list
        are not removed); ``doomed_temp``: which names' temporary files go
        (default ``doomed``). A move :meth:`set_aside` left half done is
        finished first. Returns what was removed (URLs)."""
        committed, objects, unconfirmed = listing if listing is not None else self._scan()
        finished = self._finish_moves(objects)
        if finished:
            for url in finished:
                log.warning("fastpersist: %s: finished a move to it that a killed process left half done", url)
            committed, objects, unconfirmed = self._scan()
        removed: List[str] = []
        temps: List[str] = []
        for name in sorted(objects):
            marks_one = name.endswith(MARKER_SUFFIX) and name[: -len(MARKER_SUFFIX)] in objects
            if name in committed or name in unconfirmed or marks_one:
                continue  # (an object's marker goes with its object)
            if self._local() and _core.is_temp_name(name):
                temps.append(name)  # (by the rules for temporary files, below)
                continue
            if name.startswith(".") and name.endswith(UPLOAD_SUFFIX):
                owner = name[1:].rsplit(".", 2)[0]
            elif name.endswith(MARKER_SUFFIX):
                owner = name[: -len(MARKER_SUFFIX)]  # a marker whose object is gone
            else:
                owner = name  # an object no marker commits
            if not doomed(owner):
                continue
            for p in (name + MARKER_SUFFIX, name) if name + MARKER_SUFFIX in objects else (name,):
                try:
                    self._call(f"delete of {self.url_of(p)}", self.fs.rm_file, self._path(p))
                except FileNotFoundError:
                    continue
                removed.append(self.url_of(p))
        if temps:
            owners = {n: o for n, o in ((n, _temp_owner(n)) for n in temps) if o is not None}
            temp_ok = doomed_temp or doomed
            gone = remove_stale_temps(self.root, lambda n: n in owners and temp_ok(owners[n]), TEMP_MIN_AGE)
            removed += [self.url_of(n) for n in gone]
        if self.multipart:
            removed += self._abort_uploads(doomed)
        return removed

    def _abort_uploads(self, doomed: Callable[[str], bool]) -> List[str]:
        bucket, prefix, _ = self.fs.split_path(self.root)
        prefix = prefix.rstrip("/")
        call, removed = self.fs.call_s3, []
        marks: Dict[str, Any] = {}
        while True:
            listed = self._call(
                f"listing of {self.url}'s uploads",
                call,
                "list_multipart_uploads",
                Bucket=bucket,
                Prefix=prefix + "/" if prefix else "",
                **marks,
            )
            for up in listed.get("Uploads", ()):
                key = str(up.get("Key", ""))
                name = posixpath.basename(key)
                if posixpath.dirname(key) != prefix or not doomed(name):
                    continue
                self._call(
                    f"abort of an upload of {self.url_of(name)}",
                    call,
                    "abort_multipart_upload",
                    Bucket=bucket,
                    Key=key,
                    UploadId=up["UploadId"],
                )
                removed.append(f"{self.url_of(name)} (an unfinished upload)")
            if not listed.get("IsTruncated"):
                return removed
            marks = {"KeyMarker": listed["NextKeyMarker"], "UploadIdMarker": listed["NextUploadIdMarker"]}

    def download(self, name: str, local: str, require_identity: bool = True) -> TransferStats:
        """Fetch the committed checkpoint ``name`` into ``local`` (committed
        durably, and only once its size and CRC32 are those its commit
        marker recorded and its own CRCs verify; an existing ``local`` is
        replaced only then). FileNotFoundError when ``name`` has no commit
        marker (its upload did not complete), or, with ``require_identity``,
        when the object is not the one its marker recorded (see
        :meth:`committed`); without, its CRC32s decide."""
        t0 = time.perf_counter()
        src = self._path(name)
        url = self.url_of(name)
        if self._is_local_file(src, local):
            # Replacing it would give the object a new identity: its marker
            # would no longer commit it.
            raise ValueError(f"{local} is {url} itself: download it elsewhere")
        try:
            marker = parse_json(self._call(f"commit marker of {url}", self.fs.cat_file, src + MARKER_SUFFIX))
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, "no committed checkpoint (no commit marker)", url) from None
        except ValueError as e:
            raise CorruptCheckpointError(f"{url}: damaged commit marker ({e})") from None
        if not isinstance(marker, dict) or not isinstance(marker.get("size"), int):
            raise CorruptCheckpointError(f"{url}: damaged commit marker (no size)")
        if not _commits(marker, self._call(f"download of {url}", self.fs.info, src), identity=require_identity):
            raise FileNotFoundError(
                errno.ENOENT,
                "no committed checkpoint (the object was written again after its commit marker: an upload of this "
                "name did not complete, or two raced)",
                url,
            )
        with _core.TempFile(local) as tmp:
            whole = _Crc()
            with self._call(f"download of {url}", self.fs.open, src, "rb") as f:
                off = 0
                while True:
                    chunk = self._call(f"download of {url}", f.read, 16 << 20)
                    if not chunk:
                        break
                    pwrite_all(tmp.fd, chunk, off)
                    whole.add(_core.crc32(chunk), len(chunk))
                    off += len(chunk)
            recorded = marker.get("crc32")
            if off != marker["size"] or (isinstance(recorded, int) and whole.value != recorded):
                raise CorruptCheckpointError(
                    f"{url} (downloaded) is damaged: {off} bytes with CRC32 {whole.value:#010x}, its commit marker "
                    f"recorded {marker['size']} bytes"
                    + (f" with CRC32 {recorded:#010x}" if isinstance(recorded, int) else "")
                )
            os.fsync(tmp.fd)
            try:
                verify_file(tmp.temp_path)
            except CorruptCheckpointError as e:
                raise CorruptCheckpointError(f"{url} (downloaded) is damaged: {e}") from None
            tmp.commit(off, durable=True)
        return TransferStats(local, off, time.perf_counter() - t0)

    def set_aside(self, name: str, suffix: str) -> Optional[str]:
        """Take ``name`` out of the checkpoints without deleting it: the
        object moves to ``<name><suffix>`` (``<name><suffix>-1``, ``-2``, ...
        when that is taken), with its commit marker, so the name is free
        for a new upload and what was there stays, committed under its new
        name (:meth:`download` takes it). Returns the new name, or None
        when ``name`` is not committed. The data moves first: an
        interrupted move leaves at most a marker without its object (not
        listed) or a copy without a marker."""
        src = self._path(name)
        try:
            raw = self._call(f"read of {src}{MARKER_SUFFIX}", self.fs.cat_file, src + MARKER_SUFFIX)
        except FileNotFoundError:
            return None
        _, objects, _ = self._scan()
        new, n = name + suffix, 1
        while new in objects or new + MARKER_SUFFIX in objects:
            new, n = f"{name}{suffix}-{n}", n + 1
        dst = self._path(new)
        self._call(f"move of {self.url_of(name)} to {self.url_of(new)}", self.fs.mv, src, dst)
        self._mark_moved(name, new, raw)
        return new

    def _mark_moved(self, name: str, new: str, raw: bytes) -> None:
        """The second half of a move of ``name`` to ``new`` (its data moved):
        the marker ``raw`` (``name``'s) written for ``new``, then ``name``'s
        removed."""
        src, dst = self._path(name), self._path(new)
        try:
            marker = parse_json(raw)
            if isinstance(marker, dict):
                # (a copy is another object: S3 gives it its own ETag)
                marker["identity"] = _identity(self._call("listing", self.fs.info, dst), local=self._local())
                raw = _json(marker)
        except ValueError:
            pass
        self._call(f"write of {self.url_of(new)}{MARKER_SUFFIX}", self._put_small, dst + MARKER_SUFFIX, raw)
        try:
            self._call(f"delete of {src}{MARKER_SUFFIX}", self.fs.rm_file, src + MARKER_SUFFIX)
        except FileNotFoundError:
            pass

    def _finish_moves(self, objects: Mapping[str, Mapping[str, Any]]) -> List[str]:
        """Finish the moves of :meth:`set_aside` that a killed process left
        half done (``objects``: a listing): a marker whose object is gone,
        beside an object of that name and a suffix (``<name>.<...>``) that
        no marker commits, of the size the marker records: the data moved,
        its marker did not. The marker is written for it, the old one
        removed. Returns the URLs of the objects so committed."""
        done: List[str] = []
        for mname in sorted(objects):
            name = mname[: -len(MARKER_SUFFIX)]
            if not mname.endswith(MARKER_SUFFIX) or not name or name in objects:
                continue
            moved = [
                o
                for o in objects
                if o.startswith(name + ".") and not o.endswith(MARKER_SUFFIX) and o + MARKER_SUFFIX not in objects
            ]
            if not moved:
                continue
            try:
                raw = self._call(f"read of {self.url_of(mname)}", self.fs.cat_file, self._path(mname))
                size = parse_json(raw).get("size")
            except (FileNotFoundError, ValueError, AttributeError):
                continue
            for o in sorted(moved, reverse=True):
                if isinstance(size, int) and objects[o].get("size") == size:
                    self._mark_moved(name, o, raw)
                    done.append(self.url_of(o))
                    break
        return done

    def delete(self, name: str) -> None:
        """Remove a checkpoint: its marker first (it is no longer listed),
        then its data."""
        for p in (self._path(name) + MARKER_SUFFIX, self._path(name)):
            try:
                self._call(f"delete of {p}", self.fs.rm_file, p)
            except FileNotFoundError:
                pass


class StoreListing(NamedTuple):
    """One listing of an :class:`ObjectStore` (:meth:`ObjectStore.scan`)."""

    #: Checkpoints whose marker commits them -> their sizes.
    committed: Dict[str, int]
    #: Every object of the prefix, by name -> the store's description.
    objects: Dict[str, Mapping[str, Any]]
    #: Checkpoints whose marker has their size, not their identity -> sizes.
    unconfirmed: Dict[str, int]


def _temp_owner(name: str) -> Optional[str]:
    """The object (or the marker's object) a local store's temporary file
    ``.<name>.<pid>.<n><TEMP_MARKER>`` is written for; None for any other
    name (a long name the core cut and hashed cannot be told)."""
    m = _TEMP_NAME.fullmatch(name)
    if m is None:
        return None
    owner = m.group(1)
    return owner[: -len(MARKER_SUFFIX)] if owner.endswith(MARKER_SUFFIX) else owner


_TEMP_NAME = re.compile(r"\.(.+)\.[0-9]+\.[0-9]+" + re.escape(_core.TEMP_MARKER))


def _identity(info: Mapping[str, Any], local: bool = False) -> Dict[str, Any]:
    """What ``info`` (a store's description of an object, or S3's answer to
    the call that made it) says that changes whenever the object is written
    again (a local file's inode and mtime only for a store on the local
    file system, whose listing and stat agree to the nanosecond)."""
    out: Dict[str, Any] = {}
    for k in _IDENTITY + (_LOCAL_IDENTITY if local else ()):
        v = info.get(k)
        if isinstance(v, (str, int, float)) and not isinstance(v, bool):
            out[k] = v.strip('"') if isinstance(v, str) else v
    return out


def _commits(marker: Any, info: Mapping[str, Any], identity: bool = True) -> bool:
    """Whether ``marker`` commits the object the store describes as
    ``info``: the size it recorded, and (with ``identity``) the identity
    (where both say one; markers from before identities were recorded have
    none)."""
    if not isinstance(marker, dict) or not isinstance(marker.get("size"), int) or marker["size"] != info.get("size"):
        return False
    made = marker.get("identity")
    if not identity or not isinstance(made, dict):
        return True
    have = _identity(info, local=True)
    return all(have[k] == v for k, v in made.items() if k in have)


def _is_s3(fs: Any) -> bool:
    """Whether ``fs`` is s3fs (multipart calls of its own are available)."""
    protocol = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "s3" in protocol and callable(getattr(fs, "call_s3", None)) and callable(getattr(fs, "split_path", None))


class _Crc:
    """The CRC32 of a whole file, from those of its consecutive pieces."""

    def __init__(self) -> None:
        self.value = 0

    def add(self, crc: int, n: int) -> None:
        self.value = _core.crc32_combine(self.value, crc, n)


def _json(obj: Any) -> bytes:
    return json.dumps(obj, default=str, sort_keys=True).encode()


def upload(
    path: Any,
    url: str,
    *,
    name: Optional[str] = None,
    storage_options: Optional[Mapping[str, Any]] = None,
    part_bytes: int = PART_BYTES,
    concurrency: int = CONCURRENCY,
) -> TransferStats:
    """Upload the checkpoint at ``path`` under the prefix ``url`` (any fsspec
    URL), data first and its commit marker last; returns what was moved.
    ``part_bytes`` and ``concurrency`` bound the memory it takes (see the
    module doc). Raises :class:`TierError` when the store refuses
    (credentials, bucket)."""
    store = ObjectStore(url, storage_options, part_bytes=part_bytes, concurrency=concurrency)
    return store.upload(os.fspath(path), name)
