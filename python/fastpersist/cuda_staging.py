"""Device-to-host staging: tensor storages that live on a GPU are copied, in
chunks, on a dedicated CUDA stream with non-blocking copies into page-locked
host memory (a Rust mapping registered with ``cudaHostRegister``), and each
chunk is handed to the write session as soon as its copy's event has fired.

While chunk k is being written to disk (the session call releases the GIL),
chunk k+1 is already being copied; three staging slots are enough for that
(the session may hold on to the unaligned end of chunk k until the next call
has consumed it). Staging memory is ``3 * chunk`` bytes, whatever the model.

The copy stream first waits on an event recorded on the caller's current
stream at the time of the save, so the file holds the tensor values as of
the call, and the caller's stream is never blocked by the write.

Nothing here runs, or initialises CUDA, unless a storage is on a CUDA device.
The copier is an interface so the pipeline's bookkeeping can be tested
without a GPU (``ThreadCopier``).
"""

from __future__ import annotations

import ctypes
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, List, Optional, Tuple

import torch

from . import _core

__all__ = ["Staging", "CudaCopier", "ThreadCopier", "DEFAULT_CHUNK", "SLOTS", "stream_device_region"]

DEFAULT_CHUNK = 16 << 20
SLOTS = 3


def _bytes_view(storage: Any) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class Staging:
    """``SLOTS`` chunks of page-locked host memory from the Rust core."""

    def __init__(self, chunk: int = DEFAULT_CHUNK, register_cuda: bool = True) -> None:
        self.chunk = chunk
        self._buf = _core.HostBuffer(chunk * SLOTS)
        n = self._buf.nbytes
        raw = (ctypes.c_uint8 * n).from_address(self._buf.ptr)
        self.tensor = torch.frombuffer(raw, dtype=torch.uint8)
        self._registered = False
        self._next = 0
        if register_cuda:
            rc = torch.cuda.cudart().cudaHostRegister(self._buf.ptr, n, 0)
            if int(rc) != 0:
                raise RuntimeError(f"cudaHostRegister of {n} bytes failed (error {int(rc)})")
            self._registered = True

    def slot(self, i: int) -> Tuple[torch.Tensor, int]:
        """Slot ``i``: a uint8 tensor view and its address."""
        off = (i % SLOTS) * self.chunk
        return self.tensor[off:off + self.chunk], self._buf.ptr + off

    def take(self) -> int:
        """The next chunk number. Numbering runs across storages, so a slot
        is reused only three chunks later, after the write call following
        its own has consumed whatever the session kept of it."""
        i = self._next
        self._next += 1
        return i

    def close(self) -> None:
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self._buf.ptr)
            self._registered = False
        self.tensor = None  # type: ignore[assignment]
        self._buf = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class CudaCopier:
    """Non-blocking device-to-host copies on a stream of their own."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        # Order after everything the caller has queued so far.
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))
        self.stream.wait_event(ready)

    def copy(self, dst: torch.Tensor, storage: Any, start: int, end: int) -> Any:
        with torch.cuda.stream(self.stream):
            dst[: end - start].copy_(_bytes_view(storage)[start:end], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return ev

    def wait(self, handle: Any) -> None:
        handle.synchronize()


class ThreadCopier:
    """Stand-in for tests: copies host memory on a worker thread."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1)

    def copy(self, dst: torch.Tensor, storage: Any, start: int, end: int) -> Future:
        src = _bytes_view(storage)[start:end]
        return self._pool.submit(lambda: dst[: end - start].copy_(src))

    def wait(self, handle: Future) -> None:
        handle.result()


def stream_device_region(write: Any, region: Tuple[int, Any, int, int], staging: Staging, copier: Any) -> None:
    """Write one device storage (file offset, storage, length, checksum id)
    through the staging slots: ``write(regions)`` is the session's write."""
    file_off, storage, n, crc_id = region
    chunks: List[Tuple[int, int, int]] = [(staging.take(), a, min(a + staging.chunk, n))
                                          for a in range(0, n, staging.chunk)]
    pending: Optional[Any] = None
    for j, (k, a, b) in enumerate(chunks):
        if j == 0:
            pending = copier.copy(staging.slot(k)[0], storage, a, b)
        copier.wait(pending)
        if j + 1 < len(chunks):
            # Chunk k+1's slot last held chunk k-2, which the write of chunk
            # k-1 consumed: it is free, and the copy overlaps this write.
            nk, na, nb = chunks[j + 1]
            pending = copier.copy(staging.slot(nk)[0], storage, na, nb)
        write([(file_off + a, staging.slot(k)[1], b - a, crc_id)])


class DeviceContext:
    """Staging memory and one copier per device, made at the save call."""

    def __init__(self, devices: List[torch.device], test_on_cpu: bool = False,
                 chunk: int = DEFAULT_CHUNK) -> None:
        self.test_on_cpu = test_on_cpu
        self.staging = Staging(chunk, register_cuda=not test_on_cpu)
        self.copiers: dict = {}
        for d in devices:
            self.copier(d)

    def copier(self, device: torch.device) -> Any:
        key = str(device)
        c = self.copiers.get(key)
        if c is None:
            c = self.copiers[key] = ThreadCopier() if self.test_on_cpu else CudaCopier(device)
        return c

    def close(self) -> None:
        self.staging.close()
