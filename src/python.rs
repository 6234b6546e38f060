//! The thin PyO3 binding: converts Python values to core types, releases
//! the GIL around all I/O, and maps core errors to Python exceptions.
//! No logic lives here.

// PyO3 extracts arguments as owned values (PathBuf, Vec): taking them by
// reference is not an option for #[pyfunction]/#[pymethods] signatures.
#![allow(clippy::needless_pass_by_value)]

use crate::align;
use crate::commit::TempFile;
use crate::engine::{Engine, Options};
use crate::error::{Error, ErrorKind};
use crate::guard::{with_guard, GatherGuard};
use crate::handoff::Consumer;
use crate::layout::{Layout, MemRef, Segment, Source};
use crate::reader::{MutMemRef, ReadPiece, ReadReq, ReadStats};
use crate::sink::Fault;
use crate::writer::{Session, WriteStats};
use pyo3::create_exception;
use pyo3::exceptions::{PyOSError, PyOverflowError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{
    PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyMemoryView, PyString, PyTuple, PyType,
};
use std::os::fd::RawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

create_exception!(
    fastpersist._core,
    WriteError,
    PyOSError,
    "An I/O error while writing a checkpoint; carries errno and filename."
);

create_exception!(
    fastpersist._core,
    DurabilityError,
    WriteError,
    "The commit renamed the new file onto the target, but the directory fsync \
     that makes the rename durable failed: the new file IS in place at the target, \
     its durability is not confirmed. Carries errno and filename (the target)."
);

create_exception!(
    fastpersist._core,
    ReadError,
    WriteError,
    "An I/O error while reading a checkpoint; carries errno and filename. A \
     WriteError too, the class such errors had before."
);

/// `e`, naming the file `fd` is open on when it names none.
fn fd_named(mut e: Error, fd: RawFd) -> Error {
    if e.path.is_none() {
        e.path = std::fs::read_link(format!("/proc/self/fd/{fd}")).ok();
    }
    e
}

/// `e` as the OSError subclass `T`: errno, message and, where `e` names
/// one, the file.
fn os_error<T: pyo3::PyTypeInfo>(e: Error) -> PyErr {
    let errno = e.errno.unwrap_or(libc::EIO);
    let msg = format!("{} ({})", e.strerror(), e.context);
    match e.path {
        Some(p) => PyErr::new::<T, _>((errno, msg, p.display().to_string())),
        None => PyErr::new::<T, _>((errno, msg)),
    }
}

/// [`to_py`] for a read: an OS error is a `ReadError`.
fn to_py_read(e: Error) -> PyErr {
    match e.kind {
        ErrorKind::Os => os_error::<ReadError>(e),
        _ => to_py(e),
    }
}

fn to_py(e: Error) -> PyErr {
    match e.kind {
        ErrorKind::NotDurable => os_error::<DurabilityError>(e),
        ErrorKind::Os => os_error::<WriteError>(e),
        ErrorKind::InvalidLayout | ErrorKind::InvalidOption => PyValueError::new_err(e.to_string()),
        // The callback's own exception is raised instead (see `finish`).
        ErrorKind::Cancelled | ErrorKind::Forked | ErrorKind::Internal => {
            PyRuntimeError::new_err(e.to_string())
        }
        ErrorKind::Vanished => storage_changed(e.to_string()),
    }
}

/// `fastpersist.StorageChangedError(msg)` (a RuntimeError, if that module
/// cannot be imported).
fn storage_changed(msg: String) -> PyErr {
    Python::with_gil(|py| {
        match py
            .import("fastpersist.errors")
            .and_then(|m| m.getattr("StorageChangedError"))
        {
            Ok(cls) => match cls.call1((msg.clone(),)) {
                Ok(v) => PyErr::from_value(v),
                Err(_) => PyRuntimeError::new_err(msg),
            },
            Err(_) => PyRuntimeError::new_err(msg),
        }
    })
}

/// The GIL as a [`GatherGuard`]: caller memory (tensor storages) is read
/// (by this thread or by gather threads) only while this thread holds the
/// GIL, after the storage was found as planned in `guard._owners` (a
/// `fastpersist.plan.MemoryGuard`); no Python thread can begin a resize of
/// a storage in between (torch gives the GIL up inside `resize_()`, so one
/// begun by another thread before the check is not excluded: see
/// `MemoryGuard`). Released whenever the engine waits for the device. What
/// a failed check found is kept in `err`, for the caller to raise.
struct GilGuard {
    guard: PyObject,
    state: Option<pyo3::ffi::PyGILState_STATE>,
    checked: std::collections::HashSet<u32>,
    err: GuardErr,
}

/// Engine threads waiting for the GIL to gather caller memory (in
/// [`GilGuard::lock`]); [`let_engines_in`] hands it to them.
static GIL_WAITERS: AtomicUsize = AtomicUsize::new(0);

/// The longest [`let_engines_in`] stays out of the GIL for a waiting engine
/// thread that does not take it (another Python thread may have).
const HANDOFF_MAX: std::time::Duration = std::time::Duration::from_millis(1);

/// Hand the GIL to an engine thread waiting for it, if one is: called by a
/// thread that lays out or pickles a file while an engine thread writes
/// its earlier parts. The interpreter itself would make that thread wait
/// for its switch interval (5 ms by default) on every gather, while the
/// device drains the writes in flight; here it waits only until this
/// thread's next call. Does nothing (an atomic load) when none waits;
/// returns whether one did.
fn let_engines_in(py: Python<'_>) -> bool {
    if GIL_WAITERS.load(Ordering::SeqCst) == 0 {
        return false;
    }
    py.allow_threads(|| {
        let t = std::time::Instant::now();
        while GIL_WAITERS.load(Ordering::SeqCst) > 0 && t.elapsed() < HANDOFF_MAX {
            std::thread::yield_now();
        }
    });
    true
}

/// Items extracted between two [`let_engines_in`] calls by
/// [`extract_handing_off`].
const HANDOFF_ITEMS: usize = 256;

/// Records laid out between two [`let_engines_in`] calls by
/// [`zip_storage_records`] (as `fastpersist.plan.HANDOFF_RECORDS` for the
/// layout loops written in Python).
const HANDOFF_RECORDS: usize = 32;

/// The items of the Python sequence `seq` (the `what` argument), extracted
/// with the GIL handed to a waiting engine thread every [`HANDOFF_ITEMS`]
/// ([`let_engines_in`]). A part of 5,000 records is 20,000 pieces,
/// milliseconds of extraction during which a write-behind thread gathering
/// the previous part would wait for the GIL while the device drains.
fn extract_handing_off<'py, T: FromPyObject<'py>>(
    py: Python<'py>,
    seq: &Bound<'py, PyAny>,
    what: &str,
) -> PyResult<Vec<T>> {
    if seq.is_instance_of::<pyo3::types::PyString>() || seq.is_instance_of::<PyBytes>() {
        return Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "{what} must be a sequence of tuples, not a string"
        )));
    }
    let mut out = Vec::with_capacity(seq.len().unwrap_or(0));
    for (i, item) in seq.try_iter()?.enumerate() {
        if i % HANDOFF_ITEMS == HANDOFF_ITEMS - 1 {
            let_engines_in(py);
        }
        out.push(item?.extract().map_err(|e: PyErr| {
            pyo3::exceptions::PyTypeError::new_err(format!("{what}[{i}]: {}", e.value(py)))
        })?);
    }
    Ok(out)
}

/// In a `fork()` child: no engine thread of the parent exists here, so none
/// waits (a count inherited from a thread caught waiting at the fork would
/// make every [`let_engines_in`] wait its full [`HANDOFF_MAX`]).
extern "C" fn no_waiters_in_child() {
    GIL_WAITERS.store(0, Ordering::SeqCst);
}

/// Register [`no_waiters_in_child`] once per process.
fn reset_waiters_at_fork() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: registers a handler that only stores to an atomic
        // (async-signal-safe, as a fork child handler must be).
        unsafe { libc::pthread_atfork(None, None, Some(no_waiters_in_child)) };
    });
}

/// How many engine threads wait for the GIL now (diagnostics and tests).
#[pyfunction]
fn engines_waiting() -> usize {
    GIL_WAITERS.load(Ordering::SeqCst)
}

/// Python's name for [`let_engines_in`], for layout loops written in Python.
#[pyfunction]
#[pyo3(name = "let_engines_in")]
fn let_engines_in_py(py: Python<'_>) -> bool {
    let_engines_in(py)
}

impl GatherGuard for GilGuard {
    fn lock(&mut self) -> Result<(), Error> {
        if self.state.is_none() {
            GIL_WAITERS.fetch_add(1, Ordering::SeqCst);
            // SAFETY: paired with `PyGILState_Release` in `unlock` on this
            // same thread (the guard is thread-local and `with_guard`
            // unlocks before removing it); the thread has a Python thread
            // state (it released the GIL in `allow_threads`).
            self.state = Some(unsafe { pyo3::ffi::PyGILState_Ensure() });
            GIL_WAITERS.fetch_sub(1, Ordering::SeqCst);
        }
        Ok(())
    }

    fn check(&mut self, crc_id: u32) -> Result<(), Error> {
        if self.checked.contains(&crc_id) {
            return Ok(()); // checked since the GIL was taken: no resize begun since
        }
        // No Python code runs here, also when the storage has changed (the
        // GIL must not move while gather threads read under it): the
        // exception is made by `guard.check` after the engine returned.
        let failure = Python::with_gil(|py| match owner_unchanged(self.guard.bind(py), crc_id) {
            Ok(true) => None,
            Ok(false) => Some(GuardFailure::Changed(self.guard.clone_ref(py), crc_id)),
            Err(e) => Some(GuardFailure::Raised(e)),
        });
        if let Some(f) = failure {
            if let Ok(mut slot) = self.err.lock() {
                slot.get_or_insert(f);
            }
            return Err(Error::cancelled(format!(
                "the storage of checksum {crc_id} changed while it was being saved"
            )));
        }
        self.checked.insert(crc_id);
        Ok(())
    }

    fn unlock(&mut self) {
        if let Some(state) = self.state.take() {
            self.checked.clear();
            // SAFETY: `state` came from `PyGILState_Ensure` on this thread.
            unsafe { pyo3::ffi::PyGILState_Release(state) };
        }
    }
}

/// Whether the storage behind checksum `crc_id` of `guard` (a
/// `MemoryGuard`: `_owners` maps ids to (storage, data pointer, size,
/// name)) still has the pointer and size it was planned with. Runs no
/// Python bytecode (dict lookups and the storage's C methods), so the GIL
/// cannot pass to another thread between this check and the reads that
/// follow it.
fn owner_unchanged(guard: &Bound<'_, PyAny>, crc_id: u32) -> PyResult<bool> {
    let owners = guard.getattr("_owners")?;
    let Some(entry) = owners.downcast::<PyDict>()?.get_item(crc_id)? else {
        return Ok(true);
    };
    let storage = entry.get_item(0)?;
    let ptr: usize = entry.get_item(1)?.extract()?;
    let n: usize = entry.get_item(2)?.extract()?;
    let now_ptr: usize = storage.call_method0("data_ptr")?.extract()?;
    let now_n: usize = storage.call_method0("nbytes")?.extract()?;
    Ok(now_ptr == ptr && now_n == n)
}

/// [`owner_unchanged`], with a changed storage reported by `guard.check`
/// (StorageChangedError, naming the tensor).
fn check_owner(guard: &Bound<'_, PyAny>, crc_id: u32) -> PyResult<()> {
    if owner_unchanged(guard, crc_id)? {
        return Ok(());
    }
    guard.call_method1("check", (vec![crc_id],))?; // raises StorageChangedError
    Err(changed_err(crc_id))
}

fn changed_err(crc_id: u32) -> PyErr {
    PyRuntimeError::new_err(format!(
        "the storage of checksum {crc_id} changed while it was being saved"
    ))
}

/// What a [`GilGuard`]'s failed check leaves for the caller.
enum GuardFailure {
    /// An exception raised while checking.
    Raised(PyErr),
    /// The storage of this checksum id (of this `MemoryGuard`) changed:
    /// its `check` makes the exception, once the engine has returned.
    Changed(PyObject, u32),
}

/// Where a [`GilGuard`] leaves what its failed check found.
type GuardErr = std::sync::Arc<Mutex<Option<GuardFailure>>>;

/// Run an engine call (inside `allow_threads`) with the GIL guard of
/// `guard` (a `MemoryGuard`, or None: no guard) installed.
fn guarded<R>(guard: Option<PyObject>, err: &GuardErr, f: impl FnOnce() -> R) -> R {
    match guard {
        None => f(),
        Some(g) => with_guard(
            Box::new(GilGuard {
                guard: g,
                state: None,
                checked: std::collections::HashSet::new(),
                err: err.clone(),
            }),
            f,
        ),
    }
}

/// The exception for what a guard's check found, else the engine's error.
fn guard_err(err: &GuardErr, e: Error) -> PyErr {
    match err.lock().ok().and_then(|mut s| s.take()) {
        Some(GuardFailure::Raised(pe)) => pe,
        Some(GuardFailure::Changed(guard, crc_id)) => Python::with_gil(|py| {
            match guard.call_method1(py, "check", (vec![crc_id],)) {
                Err(pe) => pe,                // StorageChangedError, naming the tensor
                Ok(_) => changed_err(crc_id), // changed back since
            }
        }),
        None => to_py(e),
    }
}

/// A Python int of any size, for an argument whose range is checked here:
/// a negative or huge value is then a ValueError naming the argument, never
/// an OverflowError from the conversion. Values beyond i128 saturate.
#[derive(Debug, Clone, Copy)]
struct IntArg(i128);

impl<'py> FromPyObject<'py> for IntArg {
    fn extract_bound(ob: &Bound<'py, PyAny>) -> PyResult<Self> {
        match ob.extract::<i128>() {
            Ok(v) => Ok(IntArg(v)),
            Err(e) if e.is_instance_of::<PyOverflowError>(ob.py()) => {
                Ok(IntArg(if ob.lt(0)? { i128::MIN } else { i128::MAX }))
            }
            Err(e) => Err(e),
        }
    }
}

impl IntArg {
    /// The value as `T` (an integer type), or a ValueError naming `name`
    /// when it is negative or does not fit.
    fn get<T: TryFrom<i128>>(self, name: &str) -> PyResult<T> {
        match T::try_from(self.0) {
            Ok(v) if self.0 >= 0 => Ok(v),
            _ => Err(PyValueError::new_err(format!(
                "{name} must be a non-negative integer that fits in {} bits, got {}",
                std::mem::size_of::<T>() * 8,
                match self.0 {
                    i128::MIN => "a huge negative number".to_string(),
                    i128::MAX => "a huge number".to_string(),
                    v => v.to_string(),
                }
            ))),
        }
    }
}

/// The bytes of a bytes-like object: `bytes` as is, anything else with the
/// buffer protocol (bytearray, memoryview, array...) copied into a `bytes`
/// (so nobody can change it while the GIL is released).
fn bytes_like<'py>(data: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
    if let Ok(b) = data.downcast::<PyBytes>() {
        return Ok(b.clone());
    }
    let view = PyMemoryView::from(data)?;
    Ok(data
        .py()
        .get_type::<PyBytes>()
        .call1((view,))?
        .downcast_into::<PyBytes>()?)
}

fn stats_dict<'py>(py: Python<'py>, s: &WriteStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("bytes", s.bytes)?;
    d.set_item("seconds", s.seconds)?;
    d.set_item("direct", s.direct)?;
    d.set_item("io_uring", s.io_uring)?;
    d.set_item("registered", s.registered)?;
    d.set_item("locked", s.locked)?;
    d.set_item("block", s.block)?;
    d.set_item("direct_note", s.direct_note.clone())?;
    d.set_item("uring_note", s.uring_note.clone())?;
    d.set_item("crcs", s.crcs.clone())?;
    d.set_item("open_seconds", s.open_seconds)?;
    d.set_item("io_seconds", s.io_seconds)?;
    d.set_item("commit_seconds", s.commit_seconds)?;
    d.set_item("zero_copy_bytes", s.zero_copy_bytes)?;
    Ok(d)
}

fn read_stats_dict<'py>(py: Python<'py>, s: &ReadStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("bytes", s.bytes)?;
    d.set_item("seconds", s.seconds)?;
    d.set_item("file_len", s.file_len)?;
    d.set_item("direct", s.direct)?;
    d.set_item("io_uring", s.io_uring)?;
    d.set_item("crcs", s.crcs.clone())?;
    Ok(d)
}

/// A Python object as the consumer of a handed read: its exception is kept
/// and raised as it is once the read has stopped.
struct PyConsumer {
    obj: PyObject,
    err: Option<PyErr>,
}

impl PyConsumer {
    fn call<T>(
        &mut self,
        f: impl FnOnce(Python<'_>, &PyObject) -> PyResult<T>,
    ) -> crate::error::Result<T> {
        Python::with_gil(|py| f(py, &self.obj)).map_err(|e| {
            self.err.get_or_insert(e);
            Error::cancelled("the read's consumer raised")
        })
    }
}

impl Consumer for PyConsumer {
    fn filled(
        &mut self,
        buf: usize,
        addr: usize,
        len: usize,
        pieces: &[ReadPiece],
    ) -> crate::error::Result<()> {
        let pieces: Vec<(usize, usize, usize, usize)> = pieces
            .iter()
            .map(|p| (p.req, p.start, p.len, p.at))
            .collect();
        self.call(|py, obj| {
            obj.call_method1(py, "filled", (buf, addr, len, pieces))
                .map(drop)
        })
    }

    fn released(&mut self, out: &mut Vec<usize>, wait: bool) -> crate::error::Result<()> {
        let got = self.call(|py, obj| {
            obj.call_method1(py, "released", (wait,))?
                .extract::<Vec<usize>>(py)
        })?;
        out.extend(got);
        Ok(())
    }
}

/// Page-aligned, locked host memory for CUDA staging: the Python layer
/// registers it with `cudaHostRegister` (and unregisters it before it is
/// freed). Used where an engine's own arena cannot be (see
/// `Engine.at_close`, `WriteSession.take_buffer`, `Engine.read_handed`).
#[pyclass(module = "fastpersist._core", name = "HostBuffer", frozen)]
struct PyHostBuffer {
    arena: crate::arena::Arena,
}

#[pymethods]
impl PyHostBuffer {
    #[new]
    fn new(nbytes: IntArg) -> PyResult<Self> {
        let nbytes: usize = nbytes.get("nbytes")?;
        let page = crate::arena::page_size();
        let n = nbytes
            .max(page)
            .checked_next_multiple_of(page)
            .ok_or_else(|| PyValueError::new_err(format!("nbytes {nbytes} is too large")))?;
        let arena = crate::arena::Arena::new(n, 1, true).map_err(|mut e| {
            e.context = format!("nbytes: {}", e.context);
            to_py(e)
        })?;
        Ok(PyHostBuffer { arena })
    }

    #[getter]
    fn ptr(&self) -> usize {
        self.arena.as_ptr() as usize
    }

    #[getter]
    fn nbytes(&self) -> usize {
        self.arena.len()
    }
}

/// A reusable writer: staging arena, io_uring ring, fallback pool.
#[pyclass(module = "fastpersist._core", name = "Engine", frozen)]
struct PyEngine {
    inner: Mutex<Engine>,
    /// The [`thread_token`] of the thread holding `inner` (0: none). A call
    /// from that thread (Python code it runs while it holds the engine: a
    /// read's consumer, a save's callback) is refused, not left waiting on
    /// itself for ever.
    owner: AtomicU64,
    /// [`Engine::retired`], read without the engine's lock.
    retired: Arc<AtomicI32>,
    /// The process that made the engine, checked before `inner` is locked
    /// (in a fork child the lock may be held by a thread that is not there).
    pid: u32,
    arena_ptr: usize,
    arena_bytes: usize,
    block_size: usize,
    /// Called before the arena is unmapped (`at_close`).
    at_close: Mutex<Vec<PyObject>>,
    /// Sessions dropped unfinished while the engine was in use: aborted
    /// (their writes in flight settled, then their files closed and
    /// removed) by the next user of the engine, or with it (after `inner`,
    /// whose ring and pool are gone by then).
    orphans: Mutex<Vec<Session>>,
}

impl Drop for PyEngine {
    /// The `at_close` callbacks run (with the GIL, as the engine is freed)
    /// before the arena is unmapped: memory registered with CUDA is
    /// unregistered while it is still mapped. A fork child's copy runs
    /// none (its arena is not the one registered, and CUDA does not work
    /// there).
    fn drop(&mut self) {
        if std::process::id() != self.pid {
            return;
        }
        let calls = self
            .at_close
            .get_mut()
            .map(std::mem::take)
            .unwrap_or_default();
        if calls.is_empty() {
            return;
        }
        Python::with_gil(|py| {
            for cb in calls {
                if let Err(e) = cb.call0(py) {
                    e.write_unraisable(py, None);
                }
            }
        });
    }
}

#[pymethods]
impl PyEngine {
    #[new]
    #[pyo3(signature = (*, block_size=IntArg(4<<20), arena_bytes=IntArg(128<<20),
        queue_depth=IntArg(16), direct=true, io_uring=true, register_buffers=true,
        lock_memory=true, pool_threads=IntArg(4), durable=true, flush_every=IntArg(256<<20),
        gather_threads=None, zero_copy=true))]
    #[allow(clippy::too_many_arguments, clippy::fn_params_excessive_bools)] // the Python signature
    fn new(
        block_size: IntArg,
        arena_bytes: IntArg,
        queue_depth: IntArg,
        direct: bool,
        io_uring: bool,
        register_buffers: bool,
        lock_memory: bool,
        pool_threads: IntArg,
        durable: bool,
        flush_every: IntArg,
        gather_threads: Option<IntArg>,
        zero_copy: bool,
    ) -> PyResult<Self> {
        let gather_threads = match gather_threads {
            Some(n) => n.get("gather_threads")?,
            None => crate::gather::default_gather_threads(),
        };
        let opts = Options {
            gather_threads,
            block_size: block_size.get("block_size")?,
            arena_bytes: arena_bytes.get("arena_bytes")?,
            queue_depth: queue_depth.get("queue_depth")?,
            direct,
            io_uring,
            register_buffers,
            lock_memory,
            pool_threads: pool_threads.get("pool_threads")?,
            durable,
            flush_every: flush_every.get("flush_every")?,
            zero_copy,
            fault: None,
            refuse_direct: false,
        };
        let block_size = opts.block_size;
        let eng = Engine::new(opts).map_err(to_py)?;
        Ok(PyEngine {
            arena_ptr: eng.arena().as_ptr() as usize,
            arena_bytes: eng.arena().len(),
            block_size,
            at_close: Mutex::new(Vec::new()),
            orphans: Mutex::new(Vec::new()),
            pid: eng.owner_pid(),
            retired: eng.retired(),
            inner: Mutex::new(eng),
            owner: AtomicU64::new(0),
        })
    }

    /// Address of the staging arena (for cudaHostRegister).
    #[getter]
    fn arena_ptr(&self) -> usize {
        self.arena_ptr
    }

    #[getter]
    fn arena_bytes(&self) -> usize {
        self.arena_bytes
    }

    /// Call `callback()` once, when the engine is freed, before its arena
    /// is unmapped (to unregister it from CUDA). Not in a fork child.
    fn at_close(&self, callback: PyObject) -> PyResult<()> {
        self.at_close
            .lock()
            .map_err(|_| PyRuntimeError::new_err("engine poisoned"))?
            .push(callback);
        Ok(())
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.block_size
    }

    // Every method takes the engine's lock without the GIL: a save's
    // write-behind thread may hold the lock while it waits for the GIL to
    // gather.

    /// Whether the engine is retired: its io_uring ring could not be waited
    /// on with requests in flight, which may still use its buffers. Every
    /// call then raises; make a new engine.
    #[getter]
    fn retired(&self) -> bool {
        self.retired.load(Ordering::SeqCst) != 0
    }

    #[getter]
    fn uses_io_uring(&self, py: Python<'_>) -> PyResult<bool> {
        self.refuse_reentry()?;
        Ok(py.allow_threads(|| self.engine().is_ok_and(|e| e.uses_io_uring())))
    }

    #[getter]
    fn locked(&self, py: Python<'_>) -> PyResult<bool> {
        self.refuse_reentry()?;
        Ok(py.allow_threads(|| self.engine().is_ok_and(|e| e.arena().locked())))
    }

    /// Gather and scatter on `threads` threads from the next call on (the
    /// engine is otherwise the same: one engine, one arena, serves saves
    /// that want different thread counts).
    fn set_gather_threads(&self, py: Python<'_>, threads: usize) -> PyResult<()> {
        py.allow_threads(|| self.engine()?.set_gather_threads(threads))
            .map_err(to_py)
    }

    /// Files begun from the next call on get exactly `mode` (and the
    /// writer's owner) whatever the target was; None: a replaced file's
    /// owner, group and mode are kept, a new one follows the umask.
    #[pyo3(signature = (mode))]
    fn set_file_mode(&self, py: Python<'_>, mode: Option<u32>) -> PyResult<()> {
        py.allow_threads(|| self.engine()?.set_file_mode(mode))
            .map_err(to_py)
    }

    /// Test hooks: make the write (or read) that covers `offset` fail with
    /// `errno`; with `errno` 0, one that covers it past its start stops
    /// short there (the rest is for the engine to do);
    /// with `refuse_direct`, act as if the file system refused O_DIRECT.
    /// With `dir_fsync_errno`, the directory fsync after each commit's
    /// rename fails with it (DurabilityError).
    /// With `min_block`, sessions begun from then on use O_DIRECT blocks
    /// of at least that many bytes (a file system with a larger alignment).
    #[pyo3(signature = (offset=None, errno=libc::EIO, refuse_direct=false, dir_fsync_errno=None, min_block=None))]
    #[allow(clippy::too_many_arguments)] // the Python signature
    fn set_fault(
        &self,
        py: Python<'_>,
        offset: Option<u64>,
        errno: i32,
        refuse_direct: bool,
        dir_fsync_errno: Option<i32>,
        min_block: Option<usize>,
    ) -> PyResult<()> {
        py.allow_threads(|| {
            if let Ok(mut e) = self.engine() {
                e.set_fault(offset.map(|offset| Fault { offset, errno }), refuse_direct);
                e.set_dir_fsync_fault(dir_fsync_errno);
                e.set_min_block(min_block)?;
            }
            Ok(())
        })
        .map_err(to_py)
    }

    /// Write a file and commit it. `blobs`: (offset, bytes); `regions`:
    /// (offset, address, length, checksum id or -1), memory the caller keeps
    /// alive and valid for the whole call; `slots`: (offset, checksum id).
    /// With `guard` (a `MemoryGuard`), each region is read only while this
    /// thread holds the GIL, after `guard.check([crc_id])` passed.
    #[pyo3(signature = (path, blobs, regions, slots, file_len, guard=None))]
    #[allow(clippy::too_many_arguments)]
    fn write_file<'py>(
        &self,
        py: Python<'py>,
        path: PathBuf,
        blobs: Vec<(u64, Bound<'py, PyBytes>)>,
        regions: Vec<(u64, usize, usize, i64)>,
        slots: Vec<(u64, u32)>,
        file_len: u64,
        guard: Option<PyObject>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let segments = build_segments(blobs, regions, slots)?;
        let err = GuardErr::default();
        let stats = py.allow_threads(|| {
            guarded(guard, &err, || {
                self.engine()?.write_file(&path, segments, file_len)
            })
        });
        stats_dict(py, &stats.map_err(|e| guard_err(&err, e))?)
    }

    /// Read records of `path` into caller memory: `reqs` is a list of
    /// (file offset, address, length); the caller keeps each destination
    /// alive and untouched for the whole call. Returns the bytes read, the
    /// file length and each record's CRC32.
    fn read_into<'py>(
        &self,
        py: Python<'py>,
        path: PathBuf,
        reqs: Vec<(u64, usize, usize)>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let rs = read_requests(reqs)?;
        let st = py.allow_threads(move || self.engine()?.read_into(&path, &rs));
        read_stats_dict(py, &st.map_err(to_py_read)?)
    }

    /// `read_into` through an open descriptor: reads the file `fd` refers
    /// to (the same inode even if its path is replaced meanwhile), never
    /// closing `fd` nor moving its file offset. `merge_gap`: requests are
    /// read as one only across gaps of at most this many bytes (default
    /// 256 KiB; 0 for scattered small requests such as zip local headers).
    #[pyo3(signature = (fd, reqs, merge_gap=None))]
    fn read_into_fd<'py>(
        &self,
        py: Python<'py>,
        fd: IntArg,
        reqs: Vec<(u64, usize, usize)>,
        merge_gap: Option<IntArg>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let fd: RawFd = fd.get("fd")?;
        let gap: Option<u64> = merge_gap.map(|g| g.get("merge_gap")).transpose()?;
        let rs = read_requests(reqs)?;
        let st = py.allow_threads(move || {
            let mut eng = self.engine()?;
            match gap {
                Some(g) => eng.read_into_fd_gap(fd, &rs, g),
                None => eng.read_into_fd(fd, &rs),
            }
        });
        read_stats_dict(py, &st.map_err(|e| to_py_read(fd_named(e, fd)))?)
    }

    /// Read `(file offset, length)` ranges of the open file `fd` (as
    /// `read_into_fd` does) into the engine's arena buffers and hand each
    /// completed one to `consumer` where it lies, instead of copying it:
    /// `consumer.filled(buf, addr, length, pieces)` (pieces: (range index,
    /// start within the range, length, offset in the buffer)), which may
    /// read the buffer until `consumer.released(wait)` returns its index
    /// (a list of buffers it is done with; with `wait`, at least one while
    /// it holds any). Returns the read's stats with each range's CRC32.
    /// On an error the consumer must be done with every buffer it holds
    /// before the engine is used again. The caller holds the engine (one
    /// file at a time) for the call.
    #[pyo3(signature = (fd, ranges, consumer, merge_gap=None))]
    fn read_handed<'py>(
        &self,
        py: Python<'py>,
        fd: IntArg,
        ranges: Vec<(u64, usize)>,
        consumer: PyObject,
        merge_gap: Option<IntArg>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let fd: RawFd = fd.get("fd")?;
        let gap: u64 = match merge_gap {
            Some(g) => g.get("merge_gap")?,
            None => crate::reader::MERGE_GAP,
        };
        let mut c = PyConsumer {
            obj: consumer,
            err: None,
        };
        let st = py.allow_threads(|| self.engine()?.read_handed(fd, &ranges, gap, &mut c));
        if let Some(e) = c.err {
            return Err(e);
        }
        read_stats_dict(py, &st.map_err(|e| to_py_read(fd_named(e, fd)))?)
    }

    /// `crc_ranges` through an open descriptor (see `read_into_fd`).
    fn crc_ranges_fd(
        &self,
        py: Python<'_>,
        fd: IntArg,
        ranges: Vec<(u64, usize)>,
    ) -> PyResult<Vec<u32>> {
        let fd: RawFd = fd.get("fd")?;
        let rs = discard_requests(ranges);
        let st = py.allow_threads(move || self.engine()?.read_into_fd(fd, &rs));
        Ok(st.map_err(|e| to_py_read(fd_named(e, fd)))?.crcs)
    }

    /// CRC32 of each `(offset, length)` range of `path`, read with the
    /// engine but not kept (for verifying files of any size in bounded memory).
    fn crc_ranges(
        &self,
        py: Python<'_>,
        path: PathBuf,
        ranges: Vec<(u64, usize)>,
    ) -> PyResult<Vec<u32>> {
        let rs = discard_requests(ranges);
        let st = py.allow_threads(move || self.engine()?.read_into(&path, &rs));
        Ok(st.map_err(to_py_read)?.crcs)
    }

    /// Write part `index` of `parts` of a file into the existing file `path`
    /// (see `Engine::write_part` in the core); checksum slots must already be
    /// filled in as bytes.
    #[pyo3(signature = (path, blobs, regions, file_len, index, parts, guard=None))]
    #[allow(clippy::too_many_arguments)]
    fn write_part<'py>(
        &self,
        py: Python<'py>,
        path: PathBuf,
        blobs: Vec<(u64, Bound<'py, PyBytes>)>,
        regions: Vec<(u64, usize, usize, i64)>,
        file_len: u64,
        index: usize,
        parts: usize,
        guard: Option<PyObject>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let segments = build_segments(blobs, regions, Vec::new())?;
        let err = GuardErr::default();
        let st = py.allow_threads(|| {
            guarded(guard, &err, || {
                self.engine()?
                    .write_part(&path, segments, file_len, (index, parts))
            })
        });
        stats_dict(py, &st.map_err(|e| guard_err(&err, e))?)
    }

    /// Start a streamed write of `path` (see `WriteSession`).
    #[pyo3(signature = (path, size_hint=IntArg(0)))]
    fn begin(slf: &Bound<'_, Self>, path: PathBuf, size_hint: IntArg) -> PyResult<PySession> {
        let size_hint: u64 = size_hint.get("size_hint")?;
        let this = slf.get();
        let session = slf
            .py()
            .allow_threads(|| this.engine()?.begin(&path, size_hint))
            .map_err(to_py)?;
        Ok(PySession {
            block: session.block(),
            engine: slf.clone().unbind(),
            session: Arc::new(Mutex::new(Some(session))),
            behind: Mutex::new(None),
            state: Arc::default(),
        })
    }
}

impl PyEngine {
    fn engine(&self) -> Result<EngineGuard<'_>, Error> {
        if std::process::id() != self.pid {
            return Err(Error::forked("this engine", self.pid, None));
        }
        if self.held_here() {
            return Err(Error::internal(
                "this engine is in use by this thread: it was called from code the engine runs \
                 (a read's consumer or a save's callback); use another engine there",
            ));
        }
        let guard = self.inner.lock().map_err(|_| {
            // A bug panicked while the engine was held: its state is not
            // to be trusted. Retired, so the next call gets a new engine;
            // this one's error is no option or layout error (a reader
            // would take those for a damaged file).
            self.retired.store(libc::EIO, Ordering::SeqCst);
            Error::internal("the engine was given up after an internal error (a panic); the next call makes a new one")
        })?;
        Ok(self.hold(guard))
    }

    /// [`PyEngine::engine`] when nobody holds it now; None when somebody
    /// does (or it is poisoned: left to `engine`).
    fn try_engine(&self) -> Option<EngineGuard<'_>> {
        if std::process::id() != self.pid || self.held_here() {
            return None;
        }
        let guard = self.inner.try_lock().ok()?;
        Some(self.hold(guard))
    }

    /// The engine, just locked by this thread: marked as held here, and
    /// the sessions dropped unfinished while somebody else held it aborted.
    fn hold<'a>(&'a self, guard: std::sync::MutexGuard<'a, Engine>) -> EngineGuard<'a> {
        self.owner.store(thread_token(), Ordering::SeqCst);
        let mut held = EngineGuard {
            guard,
            owner: &self.owner,
        };
        let orphans = match self.orphans.lock() {
            Ok(mut o) if !o.is_empty() => std::mem::take(&mut *o),
            _ => return held,
        };
        for s in orphans {
            held.abort(s);
        }
        held
    }

    /// A session dropped unfinished: aborted now if the engine is free,
    /// else by its next user (it keeps its file open until then, so no
    /// write still in flight can reach another file by its descriptor).
    fn abort_dropped(&self, session: Session) {
        if let Some(mut e) = self.try_engine() {
            e.abort(session);
        } else {
            if let Ok(mut o) = self.orphans.lock() {
                o.push(session);
            }
            // The holder may have let the engine go before the push: then
            // nobody would abort it until the engine's next use.
            drop(self.try_engine());
        }
    }

    /// Whether this thread holds the engine (and runs Python code under it).
    fn held_here(&self) -> bool {
        self.owner.load(Ordering::SeqCst) == thread_token()
    }

    fn refuse_reentry(&self) -> PyResult<()> {
        if self.held_here() {
            return Err(to_py(self.engine().err().unwrap_or_else(|| {
                Error::internal("this engine is in use by this thread")
            })));
        }
        Ok(())
    }
}

/// A number for the calling thread, unique in the process (never 0).
fn thread_token() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local!(static TOKEN: u64 = NEXT.fetch_add(1, Ordering::Relaxed));
    TOKEN.with(|t| *t)
}

/// The engine, locked by the thread in `owner` until dropped.
struct EngineGuard<'a> {
    guard: std::sync::MutexGuard<'a, Engine>,
    owner: &'a AtomicU64,
}

impl std::ops::Deref for EngineGuard<'_> {
    type Target = Engine;
    fn deref(&self) -> &Engine {
        &self.guard
    }
}

impl std::ops::DerefMut for EngineGuard<'_> {
    fn deref_mut(&mut self) -> &mut Engine {
        &mut self.guard
    }
}

impl Drop for EngineGuard<'_> {
    fn drop(&mut self) {
        // Before the lock is let go (the guard field drops after this).
        self.owner.store(0, Ordering::SeqCst);
    }
}

/// A file being written in order: `write` the parts as they become known
/// (each call writes the whole blocks it can), then `finish` to commit.
/// Dropping or `abort`ing an unfinished session removes the file.
#[pyclass(module = "fastpersist._core", name = "WriteSession", frozen)]
struct PySession {
    engine: Py<PyEngine>,
    /// The file's O_DIRECT block size (read without the session's lock,
    /// which the write-behind thread holds while it writes a part).
    block: usize,
    session: Arc<Mutex<Option<Session>>>,
    /// The thread writing the parts given to `write_behind`, while it runs.
    behind: Mutex<Option<Behind>>,
    /// What the session and its write-behind thread share.
    state: Arc<BehindState>,
}

/// The state a [`PySession`] shares with its write-behind thread.
#[derive(Default)]
struct BehindState {
    /// Set once a part given to `write_behind` failed (its error waits for
    /// `join_behind`).
    failed: AtomicBool,
    /// Parts given to `write_behind` and not yet written (or dropped after
    /// a failure).
    pending: AtomicUsize,
    /// Set when the session is given up: the write-behind thread drops the
    /// parts it has not begun.
    cancel: AtomicBool,
}

impl Drop for PySession {
    /// A session dropped with parts still on its write-behind thread (its
    /// caller gave up without `abort`): the thread drops the parts it has
    /// not begun and ends first, so the file is removed only after its last
    /// write.
    fn drop(&mut self) {
        self.state.cancel.store(true, Ordering::SeqCst);
        let mine = self.mine();
        let behind = self.behind.get_mut().ok().and_then(Option::take);
        if let Some(behind) = behind {
            // Dropped by code the engine runs (a read's consumer collecting
            // garbage): the thread may wait for the engine this thread
            // holds; it ends on its own, and the file goes with the session
            // after its last write.
            if mine && !self.engine.get().held_here() {
                Python::with_gil(|py| py.allow_threads(|| drop(behind.join())));
            } else {
                behind.forget();
            }
        }
        // Dropped unfinished (its caller gave up without `abort`): its
        // writes in flight are settled before its file is closed, as
        // `abort` does. Else a write the engine makes again (a short or
        // interrupted one) would go by the file's descriptor number to
        // whatever file was opened with that number since.
        // (Never waits for the engine: a drop at interpreter exit must not
        // hang on a thread that holds it and will not run again.)
        if mine {
            let session = if self.engine.get().held_here() {
                // The write-behind thread, forgotten, may still hold it.
                self.session.try_lock().ok().and_then(|mut g| g.take())
            } else {
                self.session.lock().ok().and_then(|mut g| g.take())
            };
            if let Some(s) = session {
                let engine = self.engine.get();
                Python::with_gil(|py| py.allow_threads(|| engine.abort_dropped(s)));
            }
        }
    }
}

/// `Engine::write` of `segments` to the session in `session` (unless it is
/// finished), under `guard`; what a failed check found goes to `err`. Called
/// without the GIL (by `write`, or on the write-behind thread).
fn write_locked(
    session: &Mutex<Option<Session>>,
    engine: &PyEngine,
    segments: Vec<Segment>,
    guard: Option<PyObject>,
    lend: bool,
    err: &GuardErr,
    reserve: u64,
) -> Result<(), Error> {
    let mut lock = session
        .lock()
        .map_err(|_| Error::option("session poisoned"))?;
    let s = lock
        .as_mut()
        .ok_or_else(|| Error::option("this write session is already finished"))?;
    if reserve > 0 {
        s.reserve(reserve)?;
    }
    s.set_lending(lend);
    let res = guarded(guard, err, || engine.engine()?.write(s, segments));
    s.set_lending(true);
    res
}

/// A part of a file for the write-behind thread: its segments, the
/// `MemoryGuard` its caller memory is read under, and how much of the file
/// to reserve before it is written (0: nothing more).
type BehindPart = (Vec<Segment>, Option<PyObject>, u64);

/// What the write-behind thread ends with: the first failure, and what a
/// guard's failed check found for it.
type BehindEnd = Result<(), (Error, GuardErr)>;

/// The write-behind thread of a [`PySession`] and the way to hand it parts.
struct Behind {
    parts: std::sync::mpsc::Sender<BehindPart>,
    thread: std::thread::JoinHandle<BehindEnd>,
}

impl Behind {
    /// Wait for the thread to end, once it has written what it was given.
    /// Only in the process that started it (see [`PySession::mine`]).
    fn join(self) -> std::thread::Result<BehindEnd> {
        drop(self.parts);
        self.thread.join()
    }

    /// In a fork child: the thread is the parent's and does not exist here
    /// (a join would wait forever); nothing of it is freed.
    fn forget(self) {
        drop(self.parts);
        std::mem::forget(self.thread);
    }
}

impl PySession {
    /// Start the write-behind thread. It writes the parts it is given in
    /// order, each under its guard, and runs no Python: between parts it
    /// waits on a channel, not for the GIL. (A Python thread would take the
    /// GIL back after each part; a caller laying out the next part in long
    /// native calls gives it up only to engine threads waiting to gather,
    /// and the device drained meanwhile.) After a failure it drops what
    /// follows and keeps the failure for [`PySession::join_behind`]; once
    /// the session is aborted (or dropped) it drops the parts not begun.
    fn spawn_behind(&self, py: Python<'_>) -> PyResult<Behind> {
        let (tx, rx) = std::sync::mpsc::channel::<BehindPart>();
        let engine = self.engine.clone_ref(py);
        let session = Arc::clone(&self.session);
        let state = Arc::clone(&self.state);
        let thread = std::thread::Builder::new()
            .name("fastpersist-behind".into())
            .spawn(move || {
                // A Python thread state for the whole run (the guard takes the
                // GIL on it to gather), without the GIL meanwhile. Counted as
                // an engine waiting for the GIL, which the caller's layout
                // loops hand over at once.
                GIL_WAITERS.fetch_add(1, Ordering::SeqCst);
                Python::with_gil(|py| {
                    GIL_WAITERS.fetch_sub(1, Ordering::SeqCst);
                    py.allow_threads(|| {
                        let mut end: BehindEnd = Ok(());
                        for (segments, guard, reserve) in rx {
                            if end.is_err() || state.cancel.load(Ordering::SeqCst) {
                                state.pending.fetch_sub(1, Ordering::SeqCst);
                                continue; // drop what follows a failure, or an abort
                            }
                            let err = GuardErr::default();
                            let res = write_locked(
                                &session,
                                engine.get(),
                                segments,
                                guard,
                                true,
                                &err,
                                reserve,
                            );
                            if let Err(e) = res {
                                state.failed.store(true, Ordering::SeqCst);
                                end = Err((e, err));
                            }
                            state.pending.fetch_sub(1, Ordering::SeqCst);
                        }
                        if state.cancel.load(Ordering::SeqCst) {
                            // Given up (aborted, or dropped by code the
                            // engine ran, which could not take the session
                            // while this thread held it): aborted here, its
                            // writes settled before its file is closed.
                            let s = session.lock().ok().and_then(|mut g| g.take());
                            if let Some(s) = s {
                                engine.get().abort_dropped(s);
                            }
                        }
                        end
                    })
                })
            })
            .map_err(|e| {
                to_py(Error::from_io(
                    &e,
                    "cannot start the write-behind thread",
                    None,
                ))
            })?;
        Ok(Behind { parts: tx, thread })
    }

    /// Whether this process made the session. A fork child's copy is its
    /// parent's: the parent's threads may hold its locks at the fork, and
    /// its write-behind thread does not exist here.
    fn mine(&self) -> bool {
        std::process::id() == self.engine.get().pid
    }

    /// An error unless this process made the session (see [`Self::mine`]).
    fn check_mine(&self) -> PyResult<()> {
        if self.mine() {
            return Ok(());
        }
        Err(to_py(Error::forked(
            "this write session",
            self.engine.get().pid,
            None,
        )))
    }

    /// Wait until the write-behind thread (if one runs) has written every
    /// part given to it, and raise its failure.
    fn join_behind(&self, py: Python<'_>) -> PyResult<()> {
        self.check_mine()?;
        let behind = self
            .behind
            .lock()
            .map_err(|_| PyRuntimeError::new_err("session poisoned"))?
            .take();
        let Some(behind) = behind else {
            return Ok(());
        };
        match py.allow_threads(|| behind.join()) {
            Ok(Ok(())) => Ok(()),
            Ok(Err((e, err))) => Err(guard_err(&err, e)),
            Err(_) => Err(PyRuntimeError::new_err("the write-behind thread panicked")),
        }
    }
}

#[pymethods]
impl PySession {
    /// Add segments (at or after everything given so far) and write them.
    /// On return no reference to the regions' memory is kept (bytes past
    /// the last whole block are copied into the session), so the caller
    /// may reuse it. `guard`: as for `Engine.write_file`. `lend=False`:
    /// every byte is copied into the arena, none written from where it lies
    /// (memory handed over one piece per call, such as a staging slot: lent
    /// writes end with their call, gathered ones stay in flight).
    #[pyo3(signature = (blobs, regions, slots, guard=None, lend=true))]
    fn write<'py>(
        &self,
        py: Python<'py>,
        blobs: &Bound<'py, PyAny>,
        regions: &Bound<'py, PyAny>,
        slots: &Bound<'py, PyAny>,
        guard: Option<PyObject>,
        lend: bool,
    ) -> PyResult<()> {
        self.check_mine()?;
        let segments = session_segments(py, blobs, regions, slots)?;
        PySession::join_behind(self, py)?;
        let err = GuardErr::default();
        py.allow_threads(|| {
            write_locked(
                &self.session,
                self.engine.get(),
                segments,
                guard,
                lend,
                &err,
                0,
            )
        })
        .map_err(|e| guard_err(&err, e))
    }

    /// Reserve the file's first `nbytes` bytes (whole blocks), as `begin`
    /// reserved its size hint: for a session begun before the whole file's
    /// size was known. After the parts given to `write_behind` so far.
    fn reserve(&self, py: Python<'_>, nbytes: IntArg) -> PyResult<()> {
        self.check_mine()?;
        let n: u64 = nbytes.get("nbytes")?;
        PySession::join_behind(self, py)?;
        py.allow_threads(|| {
            let lock = self
                .session
                .lock()
                .map_err(|_| Error::option("session poisoned"))?;
            lock.as_ref()
                .ok_or_else(|| Error::option("this write session is already finished"))?
                .reserve(n)
        })
        .map_err(to_py)
    }

    /// `write`, on the session's write-behind thread: the segments are
    /// taken now (the caller's memory must stay as it is until
    /// `join_behind` returns; the guard is consulted as it is read), and
    /// this returns at once. Parts are written in the order given; a
    /// failure is raised by `join_behind` (and by `write`, `finish`), and
    /// `behind_failed` says whether one happened so far. `reserve`: as
    /// `reserve(nbytes)`, on that thread, before this part is written.
    #[pyo3(signature = (blobs, regions, slots, guard=None, reserve=IntArg(0)))]
    fn write_behind<'py>(
        &self,
        py: Python<'py>,
        blobs: &Bound<'py, PyAny>,
        regions: &Bound<'py, PyAny>,
        slots: &Bound<'py, PyAny>,
        guard: Option<PyObject>,
        reserve: IntArg,
    ) -> PyResult<()> {
        self.check_mine()?;
        let reserve: u64 = reserve.get("reserve")?;
        let segments = session_segments(py, blobs, regions, slots)?;
        let mut behind = self
            .behind
            .lock()
            .map_err(|_| PyRuntimeError::new_err("session poisoned"))?;
        if behind.is_none() {
            *behind = Some(self.spawn_behind(py)?);
        }
        self.state.pending.fetch_add(1, Ordering::SeqCst);
        let sent = behind
            .as_ref()
            .map(|b| b.parts.send((segments, guard, reserve)));
        if let Some(Err(_)) = sent {
            self.state.pending.fetch_sub(1, Ordering::SeqCst);
            // Only a panicked thread stops listening: join_behind says so.
            drop(behind);
            PySession::join_behind(self, py)?;
            return Err(PyRuntimeError::new_err(
                "the write-behind thread ended early",
            ));
        }
        Ok(())
    }

    /// Wait until every part given to `write_behind` is written (its
    /// caller memory gathered); raise the first failure.
    #[pyo3(name = "join_behind")]
    fn join_behind_py(&self, py: Python<'_>) -> PyResult<()> {
        PySession::join_behind(self, py)
    }

    /// Whether a part given to `write_behind` has failed so far.
    #[getter]
    fn behind_failed(&self) -> bool {
        self.state.failed.load(Ordering::SeqCst)
    }

    /// Parts given to `write_behind` not yet written (their caller memory
    /// not yet gathered; writes may still be in flight after).
    #[getter]
    fn behind_pending(&self) -> usize {
        self.state.pending.load(Ordering::SeqCst)
    }

    /// Add the last segments, write the rest and commit the file. When
    /// given, `on_gathered()` is called (with the GIL) as soon as no caller
    /// memory will be read any more, before the writes complete.
    #[pyo3(signature = (blobs, regions, slots, file_len, on_gathered=None, guard=None))]
    #[allow(clippy::too_many_arguments)]
    fn finish<'py>(
        &self,
        py: Python<'py>,
        blobs: &Bound<'py, PyAny>,
        regions: &Bound<'py, PyAny>,
        slots: &Bound<'py, PyAny>,
        file_len: u64,
        on_gathered: Option<PyObject>,
        guard: Option<PyObject>,
    ) -> PyResult<Bound<'py, PyDict>> {
        self.check_mine()?;
        let segments = session_segments(py, blobs, regions, slots)?;
        PySession::join_behind(self, py)?;
        let engine = self.engine.get();
        let mut callback_err: Option<PyErr> = None;
        let err = GuardErr::default();
        let stats = py.allow_threads(|| {
            let session = self
                .session
                .lock()
                .map_err(|_| Error::option("session poisoned"))?
                .take()
                .ok_or_else(|| Error::option("this write session is already finished"))?;
            let mut notify = || {
                let Some(cb) = &on_gathered else {
                    return Ok(());
                };
                Python::with_gil(|py| cb.call0(py).map(drop)).map_err(|e| {
                    callback_err.get_or_insert(e);
                    Error::cancelled("on_gathered() raised: nothing was committed")
                })
            };
            guarded(guard, &err, || {
                engine
                    .engine()?
                    .finish_with(session, segments, file_len, &mut notify)
            })
        });
        if let Some(e) = callback_err {
            return Err(e);
        }
        stats_dict(py, &stats.map_err(|e| guard_err(&err, e))?)
    }

    /// Give up: remove the temporary file. Idempotent. Parts given to
    /// `write_behind` and not begun are dropped; the one being written, if
    /// any, ends first.
    fn abort(&self, py: Python<'_>) {
        if !self.mine() {
            return; // a fork child's copy: the file and its writes are the parent's
        }
        // Its outcome no longer matters, but the file is removed only once
        // no write of the session is left.
        self.state.cancel.store(true, Ordering::SeqCst);
        let _ = PySession::join_behind(self, py);
        let engine = self.engine.get();
        py.allow_threads(|| {
            if let Ok(mut g) = self.session.lock() {
                if let Some(s) = g.take() {
                    match engine.engine() {
                        Ok(mut e) => e.abort(s),
                        Err(_) => drop(s),
                    }
                }
            }
        });
    }

    /// O_DIRECT block size of the file being written.
    #[getter]
    fn block(&self) -> usize {
        self.block
    }

    /// Take a free arena buffer for the caller to fill (a device-to-host
    /// copy straight into the arena): `(index, address)`, `Engine.block_size`
    /// bytes at `address`. Waits for a write in flight when none is free.
    /// Hand it to `write_buffer` or `give_back`; a session that ends gives
    /// back what it still holds. After the parts given to `write_behind`.
    fn take_buffer(&self, py: Python<'_>) -> PyResult<(usize, usize)> {
        let engine = self.engine.get();
        let b = self.with_session(py, Engine::take_buffer)?;
        Ok((b, engine.arena_ptr + b * engine.block_size))
    }

    /// Write buffer `index` (from `take_buffer`), which holds the file's
    /// `nbytes` bytes at `offset` (at or after everything given so far),
    /// placed in the buffer at `offset % block`; their CRC32 goes into
    /// checksum `crc_id`. The engine fills the buffer's head with the rest
    /// of that block, checksums the bytes where they lie and writes the
    /// whole blocks from there (in flight on return, as `write` leaves
    /// them). The buffer is no longer the caller's, whatever the outcome.
    #[pyo3(signature = (index, offset, nbytes, crc_id=None))]
    fn write_buffer(
        &self,
        py: Python<'_>,
        index: usize,
        offset: IntArg,
        nbytes: IntArg,
        crc_id: Option<u32>,
    ) -> PyResult<()> {
        let offset: u64 = offset.get("offset")?;
        let nbytes: usize = nbytes.get("nbytes")?;
        self.with_session(py, |e, s| e.write_buffer(s, index, offset, nbytes, crc_id))
    }

    /// Give back buffer `index`, taken and not written.
    fn give_back(&self, py: Python<'_>, index: usize) -> PyResult<()> {
        self.with_session(py, |e, s| e.give_back(s, index))
    }
}

impl PySession {
    /// Run `f` on the engine and the unfinished session, without the GIL,
    /// after the parts given to `write_behind`.
    fn with_session<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Engine, &mut Session) -> Result<T, Error> + Send,
    ) -> PyResult<T> {
        self.check_mine()?;
        PySession::join_behind(self, py)?;
        let engine = self.engine.get();
        py.allow_threads(|| {
            let mut lock = self
                .session
                .lock()
                .map_err(|_| Error::option("session poisoned"))?;
            let s = lock
                .as_mut()
                .ok_or_else(|| Error::option("this write session is already finished"))?;
            f(&mut *engine.engine()?, s)
        })
        .map_err(to_py)
    }
}

/// Read requests `(file offset, address, length)` into caller memory.
fn read_requests(reqs: Vec<(u64, usize, usize)>) -> PyResult<Vec<ReadReq>> {
    reqs.into_iter()
        .map(|(offset, ptr, len)| {
            if ptr == 0 && len > 0 {
                return Err(PyValueError::new_err(format!(
                    "destination for offset {offset} has a null address"
                )));
            }
            // SAFETY: the Python caller (fastpersist.reader) allocated each
            // destination for this read, holds it for the whole call and
            // does not touch it until the call returns.
            let dst = unsafe { MutMemRef::new(ptr as *mut u8, len) };
            Ok(ReadReq { offset, dst })
        })
        .collect()
}

/// Requests `(file offset, length)` to checksum without keeping the bytes.
fn discard_requests(ranges: Vec<(u64, usize)>) -> Vec<ReadReq> {
    ranges
        .into_iter()
        .map(|(offset, len)| ReadReq {
            offset,
            dst: MutMemRef::discard(len),
        })
        .collect()
}

/// The one durable-commit primitive: a temporary file next to `target`
/// (`.<name>.<pid>.<n>.fptmp`, see the core's `commit` module), written
/// with `write` or through `fd`, then `commit`ted: truncated to `length`
/// when given, fsynced, renamed onto `target`, directory fsynced. Until
/// then an existing `target` is untouched. `abort()` (or leaving a `with`
/// block without committing, or dropping the object) removes it.
#[pyclass(module = "fastpersist._core", name = "TempFile", frozen)]
struct PyTempFile {
    inner: Mutex<Option<TempFile>>,
    /// The open file's descriptor, -1 once committed or aborted.
    fd: AtomicI32,
    temp_path: PathBuf,
    target: PathBuf,
    direct: bool,
}

#[pymethods]
impl PyTempFile {
    #[new]
    #[pyo3(signature = (target, *, direct=false))]
    fn new(py: Python<'_>, target: PathBuf, direct: bool) -> PyResult<Self> {
        let (tmp, _) = py
            .allow_threads(|| TempFile::create(&target, direct))
            .map_err(to_py)?;
        Ok(PyTempFile {
            fd: AtomicI32::new(tmp.fd()),
            temp_path: tmp.temp_path().to_path_buf(),
            target: tmp.target().to_path_buf(),
            direct: tmp.is_direct(),
            inner: Mutex::new(Some(tmp)),
        })
    }

    /// The open file's descriptor (owned by this object: do not close it);
    /// -1 once committed or aborted.
    #[getter]
    fn fd(&self) -> i32 {
        self.fd.load(Ordering::Acquire)
    }

    #[getter]
    fn temp_path(&self) -> PathBuf {
        self.temp_path.clone()
    }

    #[getter]
    fn target(&self) -> PathBuf {
        self.target.clone()
    }

    /// Whether the file is open with O_DIRECT (asked for and accepted).
    #[getter]
    fn direct(&self) -> bool {
        self.direct
    }

    /// Reserve `nbytes` (ENOSPC now rather than half-way through).
    fn preallocate(&self, py: Python<'_>, nbytes: IntArg) -> PyResult<()> {
        let n: u64 = nbytes.get("nbytes")?;
        py.allow_threads(|| self.with_open(|t| t.preallocate(n)))
    }

    /// Write all of `data` (any bytes-like object) at `offset`, a positional
    /// write (the descriptor's file offset does not move); the GIL is
    /// released. With `direct`, address, offset and length must meet the
    /// O_DIRECT alignment.
    fn write(&self, py: Python<'_>, data: &Bound<'_, PyAny>, offset: IntArg) -> PyResult<()> {
        let offset: u64 = offset.get("offset")?;
        let data = bytes_like(data)?;
        let bytes = data.as_bytes();
        py.allow_threads(|| self.with_open(|t| t.write_all_at(bytes, offset)))
    }

    /// Truncate to `length` when given, fsync (with `durable`), rename onto
    /// the target, fsync the directory. On failure before the rename the
    /// temporary file is removed and the target untouched; a failure of the
    /// directory fsync after it raises DurabilityError (the new file IS at
    /// the target). Either way the object is finished.
    #[pyo3(signature = (length=None, durable=true))]
    fn commit(&self, py: Python<'_>, length: Option<IntArg>, durable: bool) -> PyResult<()> {
        let length: Option<u64> = length.map(|l| l.get("length")).transpose()?;
        py.allow_threads(|| {
            let tmp = self.take()?;
            tmp.commit(length, durable).map_err(to_py)
        })
    }

    /// Test hook: the directory fsync of `commit` fails with
    /// `dir_fsync_errno` (DurabilityError); None clears it.
    #[pyo3(signature = (dir_fsync_errno=None))]
    fn set_fault(&self, dir_fsync_errno: Option<i32>) -> PyResult<()> {
        let mut guard = self
            .inner
            .lock()
            .map_err(|_| PyValueError::new_err("TempFile poisoned by an earlier panic"))?;
        let tmp = guard
            .as_mut()
            .ok_or_else(|| PyValueError::new_err("the TempFile is already committed or aborted"))?;
        tmp.set_dir_fsync_fault(dir_fsync_errno);
        Ok(())
    }

    /// Remove the temporary file (idempotent; nothing happens after commit).
    fn abort(&self, py: Python<'_>) {
        py.allow_threads(|| drop(self.take()));
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Leaving a `with` block without committing aborts. Exceptions propagate.
    #[pyo3(signature = (exc_type=None, exc_value=None, traceback=None))]
    fn __exit__(
        &self,
        py: Python<'_>,
        exc_type: Option<PyObject>,
        exc_value: Option<PyObject>,
        traceback: Option<PyObject>,
    ) -> bool {
        drop((exc_type, exc_value, traceback));
        self.abort(py);
        false
    }
}

impl PyTempFile {
    /// Run `f` on the open temporary file (GIL released by the caller).
    fn with_open<T>(&self, f: impl FnOnce(&TempFile) -> Result<T, Error>) -> PyResult<T> {
        let guard = self
            .inner
            .lock()
            .map_err(|_| PyValueError::new_err("TempFile poisoned by an earlier panic"))?;
        let tmp = guard
            .as_ref()
            .ok_or_else(|| PyValueError::new_err("the TempFile is already committed or aborted"))?;
        f(tmp).map_err(to_py)
    }

    /// Take the temporary file out (it is committed or dropped next).
    fn take(&self) -> PyResult<TempFile> {
        let tmp = self
            .inner
            .lock()
            .map_err(|_| PyValueError::new_err("TempFile poisoned by an earlier panic"))?
            .take()
            .ok_or_else(|| PyValueError::new_err("the TempFile is already committed or aborted"))?;
        self.fd.store(-1, Ordering::Release);
        Ok(tmp)
    }
}

/// Write `data` (bytes-like) to `path` atomically through a TempFile:
/// readers see the old file or the new one, never a mix; durable (file and
/// directory fsynced) unless `durable=False`. GIL released.
#[pyfunction]
#[pyo3(signature = (path, data, *, durable=true))]
fn atomic_write(
    py: Python<'_>,
    path: PathBuf,
    data: &Bound<'_, PyAny>,
    durable: bool,
) -> PyResult<()> {
    let data = bytes_like(data)?;
    let bytes = data.as_bytes();
    py.allow_threads(|| crate::commit::atomic_write(&path, bytes, durable))
        .map_err(to_py)
}

/// The byte ranges `(start, end)` of the `parts` balanced, block-aligned
/// parts of a file of `file_len` bytes padded to whole `block`s (a power of
/// two): the partition `Engine.write_part` writes.
#[pyfunction]
fn split_ranges(file_len: IntArg, block: IntArg, parts: IntArg) -> PyResult<Vec<(u64, u64)>> {
    let file_len: u64 = file_len.get("file_len")?;
    let block: usize = block.get("block")?;
    let parts: usize = parts.get("parts")?;
    if parts == 0 || parts > MAX_PARTS {
        return Err(PyValueError::new_err(format!(
            "parts must be in 1..={MAX_PARTS}, got {parts}"
        )));
    }
    let layout = Layout::new(Vec::new(), file_len, block).map_err(to_py)?;
    Ok(layout
        .split(parts)
        .into_iter()
        .map(|r| (r.start, r.end))
        .collect())
}

/// Whether some process holds the temporary file at `path` (the exclusive
/// lock a TempFile keeps until commit, abort or its process's death): a
/// sweeper removes only temporary files that are not in use. A missing
/// path is not in use.
#[pyfunction]
fn temp_file_in_use(py: Python<'_>, path: PathBuf) -> PyResult<bool> {
    py.allow_threads(|| crate::commit::temp_file_in_use(&path))
        .map_err(to_py)
}

/// Whether `fallocate` on the file system of `path` (a directory or a
/// file) writes every byte it reserves (tmpfs, hugetlbfs, FAT): a new
/// file's pages or clusters are then allocated as it is written.
#[pyfunction]
fn fallocate_zero_fills(py: Python<'_>, path: PathBuf) -> PyResult<bool> {
    py.allow_threads(|| crate::commit::fallocate_zero_fills(&path))
        .map_err(|e| crate::error::Error::from_io(&e, "cannot stat the file system", Some(&path)))
        .map_err(to_py)
}

/// Remove the file at `path` (as `os.unlink`); a big file's blocks are
/// freed on a background thread, so the caller does not wait for the file
/// system to free (and discard) them.
#[pyfunction]
fn remove_file(py: Python<'_>, path: std::path::PathBuf) -> PyResult<()> {
    py.allow_threads(|| crate::commit::remove_file(&path))
        .map_err(|e| match e.raw_os_error() {
            Some(code) => {
                let msg = e.to_string();
                let msg = msg.split(" (os error").next().unwrap_or(&msg).to_string();
                PyOSError::new_err((code, msg, path.display().to_string()))
            }
            None => PyOSError::new_err(e.to_string()),
        })
}

/// Wait (at most `timeout` seconds) until the files that commits replaced
/// are freed (their blocks are released on background threads). Returns
/// whether any was still being freed.
#[pyfunction]
fn wait_for_frees(py: Python<'_>, timeout: f64) -> PyResult<bool> {
    let t = std::time::Duration::try_from_secs_f64(timeout).map_err(|_| {
        PyValueError::new_err(format!(
            "timeout must be a number of seconds >= 0, got {timeout}"
        ))
    })?;
    Ok(py.allow_threads(|| crate::commit::wait_for_frees(t)))
}

/// Whether `name` (a file name, not a path) has exactly the form of a
/// temporary file name, `.<part>.<pid>.<n>.fptmp` (see the core's `commit`
/// module docs).
#[pyfunction]
fn is_temp_name(name: PathBuf) -> bool {
    crate::commit::is_temp_name(name.as_os_str())
}

/// The `<part>` of the temporary file names of a target named `name` (a
/// file name's bytes): the name, or when longer than `TEMP_NAME_PART_MAX`
/// its first bytes and a hash of it (see the core's `commit` module docs).
#[pyfunction]
fn temp_name_part<'py>(py: Python<'py>, name: &[u8]) -> Bound<'py, PyBytes> {
    PyBytes::new(py, &crate::commit::temp_name_part(name))
}

/// More parts than any job has ranks: a bound on the list `split_ranges` makes.
const MAX_PARTS: usize = 1 << 20;
/// The most segment bytes `partition` (a test helper) allocates.
const MAX_PARTITION_BYTES: usize = 1 << 30;

/// The segments of a session call's pieces, read with the GIL handed to a
/// waiting engine thread as they are ([`extract_handing_off`]): the
/// session's write-behind thread may be gathering the parts before.
fn session_segments<'py>(
    py: Python<'py>,
    blobs: &Bound<'py, PyAny>,
    regions: &Bound<'py, PyAny>,
    slots: &Bound<'py, PyAny>,
) -> PyResult<Vec<Segment>> {
    build_segments(
        extract_handing_off(py, blobs, "blobs")?,
        extract_handing_off(py, regions, "regions")?,
        extract_handing_off(py, slots, "slots")?,
    )
}

fn build_segments(
    blobs: Vec<(u64, Bound<'_, PyBytes>)>,
    regions: Vec<(u64, usize, usize, i64)>,
    slots: Vec<(u64, u32)>,
) -> PyResult<Vec<Segment>> {
    let mut segs = Vec::with_capacity(blobs.len() + regions.len() + slots.len());
    for (offset, b) in blobs {
        segs.push(Segment {
            offset,
            source: Source::Bytes(b.as_bytes().to_vec()),
            crc_id: None,
        });
    }
    for (offset, ptr, len, crc) in regions {
        if ptr == 0 && len > 0 {
            return Err(PyValueError::new_err(format!(
                "memory region at file offset {offset} has a null address"
            )));
        }
        let crc_id = u32::try_from(crc).ok();
        // SAFETY: the Python caller (fastpersist.serialization) holds a
        // reference to every tensor storage named here for the whole call,
        // so the memory stays allocated and readable while we write.
        let m = unsafe { MemRef::new(ptr as *const u8, len) };
        segs.push(Segment {
            offset,
            source: Source::Mem(m),
            crc_id,
        });
    }
    for (offset, id) in slots {
        segs.push(Segment {
            offset,
            source: Source::Crc32(id),
            crc_id: None,
        });
    }
    Ok(segs)
}

/// Partition a file of `(offset, length)` segments: returns, for each of
/// `parts` parts, its byte range and its extents `(offset, length, pieces)`,
/// pieces being `(segment index, offset in segment, offset in extent, length)`.
/// Segment indices refer to the segments sorted by offset.
#[pyfunction]
#[pyo3(signature = (segments, file_len, block, max_len, parts=1))]
#[allow(clippy::type_complexity)]
fn partition(
    segments: Vec<(u64, usize)>,
    file_len: u64,
    block: usize,
    max_len: usize,
    parts: usize,
) -> PyResult<
    Vec<(
        (u64, u64),
        Vec<(u64, usize, Vec<(usize, u64, usize, usize)>)>,
    )>,
> {
    // A helper for tests, which holds its segments' bytes: sizes it could
    // not hold are refused, not an abort of the process.
    if parts == 0 || parts > MAX_PARTS {
        return Err(PyValueError::new_err(format!(
            "parts must be in 1..={MAX_PARTS}, got {parts}"
        )));
    }
    let total = segments
        .iter()
        .try_fold(0usize, |acc, &(_, len)| acc.checked_add(len))
        .filter(|&t| t <= MAX_PARTITION_BYTES);
    if total.is_none() {
        return Err(PyValueError::new_err(format!(
            "the segments may hold at most {MAX_PARTITION_BYTES} bytes in all"
        )));
    }
    if max_len == 0 || file_len / max_len as u64 > MAX_PARTS as u64 {
        return Err(PyValueError::new_err(format!(
            "max_len {max_len} makes more than {MAX_PARTS} extents of {file_len} bytes"
        )));
    }
    let segs = segments
        .into_iter()
        .map(|(offset, len)| Segment {
            offset,
            source: Source::Bytes(vec![0; len]),
            crc_id: None,
        })
        .collect();
    let layout = Layout::new(segs, file_len, block).map_err(to_py)?;
    let mut out = vec![];
    for r in layout.split(parts) {
        let exts = layout
            .extents(r.clone(), max_len)
            .map_err(to_py)?
            .map(|e| {
                let pieces = layout
                    .pieces(e)
                    .into_iter()
                    .map(|p| (p.segment, p.seg_offset, p.buf_offset, p.len))
                    .collect();
                (e.offset, e.len, pieces)
            })
            .collect();
        out.push(((r.start, r.end), exts));
    }
    Ok(out)
}

/// The instruction set of the one-pass copy and CRC32 that gathers and
/// scatters use ("avx512", "avx2", "sse"), or None where they copy and
/// checksum in two passes (another CPU, or `FASTPERSIST_FUSED_COPY=0`).
#[pyfunction]
fn copy_kernel() -> Option<&'static str> {
    crate::crc_copy::fused_kernel()
}

/// Raise the ValueError that making an engine with these options would
/// (block size, arena size against the block and the machine's memory,
/// queue depth, gather threads), without making one: options are refused
/// where they are given, not at the first save.
#[pyfunction]
#[pyo3(signature = (*, block_size, arena_bytes, queue_depth, gather_threads))]
fn check_engine_options(
    block_size: IntArg,
    arena_bytes: IntArg,
    queue_depth: IntArg,
    gather_threads: IntArg,
) -> PyResult<()> {
    let opts = Options {
        block_size: block_size.get("block_size")?,
        arena_bytes: arena_bytes.get("arena_bytes")?,
        queue_depth: queue_depth.get("queue_depth")?,
        gather_threads: gather_threads.get("gather_threads")?,
        ..Options::default()
    };
    opts.validate().map_err(to_py)
}

/// `(mem_align, offset_align, block, from_statx)` for a directory.
#[pyfunction]
fn dio_alignment(path: PathBuf) -> (u32, u32, usize, bool) {
    let a = align::probe(&path);
    (a.mem_align, a.offset_align, a.block, a.from_statx)
}

/// CRC32 of each `(address, length, checksum id)` range of memory (inside
/// tensor storages the caller keeps alive). Without `guard`, releases the
/// GIL; with it (a `MemoryGuard`), holds the GIL and checks each range's
/// storage just before reading it, so no Python thread can resize it in
/// between.
#[pyfunction]
#[pyo3(signature = (ranges, guard=None))]
fn crc32_ranges(
    py: Python<'_>,
    ranges: Vec<(usize, usize, i64)>,
    guard: Option<Bound<'_, PyAny>>,
) -> PyResult<Vec<u32>> {
    if ranges.iter().any(|&(p, n, _)| p == 0 && n > 0) {
        return Err(PyValueError::new_err("null address"));
    }
    let refs: Vec<(MemRef, i64)> = ranges
        .into_iter()
        // SAFETY: the Python caller (fastpersist.distributed) passes ranges
        // inside tensor storages it holds for the whole call (and, with a
        // guard, checked just before each is read, under the GIL).
        .map(|(p, n, id)| (unsafe { MemRef::new(p as *const u8, n) }, id))
        .collect();
    crate::vanish::install();
    // (Memory freed under a read, by a resize another thread began: see
    // crate::vanish.)
    let hash = |m: &MemRef| {
        crate::vanish::read(m.addr(), m.len(), || crc32fast::hash(m.slice(0, m.len())))
    };
    let Some(guard) = guard else {
        let sums: Vec<(u32, bool)> =
            py.allow_threads(|| refs.iter().map(|(m, _)| hash(m)).collect());
        if sums.iter().any(|&(_, vanished)| vanished) {
            return Err(to_py(crate::vanish::error()));
        }
        return Ok(sums.into_iter().map(|(c, _)| c).collect());
    };
    let mut out = Vec::with_capacity(refs.len());
    for (m, id) in &refs {
        if let Ok(id) = u32::try_from(*id) {
            check_owner(&guard, id)?;
        }
        let (crc, vanished) = hash(m);
        if vanished {
            return Err(to_py(crate::vanish::error()));
        }
        out.push(crc);
    }
    Ok(out)
}

/// Advise transparent huge pages for, and fault in now, the memory at
/// `addr..addr+nbytes`: a fresh host buffer (one the caller owns, private
/// and anonymous, such as a new CPU tensor's) that is about to be filled,
/// so the fill does not fault page by page. The bytes are not changed.
#[pyfunction]
fn prepare_memory(py: Python<'_>, addr: IntArg, nbytes: IntArg) -> PyResult<()> {
    let addr: usize = addr.get("addr")?;
    let nbytes: usize = nbytes.get("nbytes")?;
    // SAFETY: the caller hands over memory it owns, private and anonymous
    // (see the doc above); the call only advises and populates it.
    py.allow_threads(|| unsafe { crate::arena::prepare_memory(addr, nbytes) });
    Ok(())
}

/// Copy `n` bytes of checksum `crc_id`'s memory at address `src` to
/// address `dst` (non-overlapping memory the caller holds), holding the
/// GIL, right after checking with `guard` (a `MemoryGuard`) that the
/// storage is as planned: no Python thread can resize it in between.
#[pyfunction]
fn copy_memory(
    dst: usize,
    src: usize,
    n: usize,
    guard: &Bound<'_, PyAny>,
    crc_id: u32,
) -> PyResult<()> {
    if n == 0 {
        return Ok(());
    }
    if dst == 0 || src == 0 {
        return Err(PyValueError::new_err("null address"));
    }
    if dst.max(src) - dst.min(src) < n {
        return Err(PyValueError::new_err("the ranges overlap"));
    }
    check_owner(guard, crc_id)?;
    // SAFETY: the caller (fastpersist.async_save, writer) passes two ranges
    // of `n` bytes inside storages it holds, checked above not to overlap;
    // the source storage was just checked and, with the GIL held, no resize
    // can begin before the copy ends (one another thread began before the
    // check may free it under the copy: crate::vanish covers the read).
    let (d, s) = unsafe {
        (
            std::slice::from_raw_parts_mut(dst as *mut u8, n),
            std::slice::from_raw_parts(src as *const u8, n),
        )
    };
    crate::vanish::install();
    // A snapshot goes to the device by DMA (lent), not back through the
    // cache: non-temporal stores.
    let ((), vanished) = crate::vanish::read(src, n, || crate::crc_copy::copy_nontemporal(d, s));
    if vanished {
        return Err(to_py(crate::vanish::error()));
    }
    Ok(())
}

/// CRC32 of the concatenation A+B from crc(A), crc(B) and len(B).
#[pyfunction]
fn crc32_combine(crc_a: u32, crc_b: u32, len_b: u64) -> u32 {
    let mut a = crc32fast::Hasher::new_with_initial_len(crc_a, 0);
    let b = crc32fast::Hasher::new_with_initial_len(crc_b, len_b);
    a.combine(&b);
    a.finalize()
}

/// CRC32 (same polynomial as zlib), SIMD-accelerated; releases the GIL.
#[pyfunction]
fn crc32(py: Python<'_>, data: &[u8]) -> u32 {
    py.allow_threads(|| crc32fast::hash(data))
}

/// The zip layer's alignment limit (the padding length is 16 bits), as a
/// ValueError.
fn zip_align_check(align: u64) -> PyResult<()> {
    if !align.is_power_of_two() || align > (1 << 15) {
        return Err(PyValueError::new_err(format!(
            "record alignment must be a power of two of at most 32768, got {align}"
        )));
    }
    Ok(())
}

/// The zip format's limit on a record name (a 16-bit length), as a
/// ValueError.
fn zip_name_check(name_len: usize) -> PyResult<()> {
    if name_len > usize::from(u16::MAX) {
        return Err(PyValueError::new_err(format!(
            "a zip record name holds at most 65535 bytes, got {name_len}"
        )));
    }
    Ok(())
}

/// The local header of a torch zip record (`fastpersist.torch_zip`): the
/// fixed part, `name` and the extra field, padded so that the data, which
/// follows it, is aligned to `align`.
#[pyfunction]
fn zip_local_header<'py>(
    py: Python<'py>,
    name: &[u8],
    header_off: u64,
    size: u64,
    align: u64,
) -> PyResult<Bound<'py, PyBytes>> {
    zip_align_check(align)?;
    zip_name_check(name.len())?;
    Ok(PyBytes::new(
        py,
        &crate::zip::local_header(name, header_off, size, align),
    ))
}

/// Where the data of a record starts, from its header's offset (the length
/// of `zip_local_header` for a name of `name_len` bytes), without making it.
#[pyfunction]
fn zip_local_header_len(name_len: usize, header_off: u64, size: u64, align: u64) -> PyResult<u64> {
    zip_align_check(align)?;
    zip_name_check(name_len)?;
    Ok(crate::zip::local_header_len(
        name_len, header_off, size, align,
    ))
}

/// The sizes that end the data descriptor of a record.
#[pyfunction]
fn zip_descriptor_sizes(py: Python<'_>, header_off: u64, size: u64) -> Bound<'_, PyBytes> {
    PyBytes::new(py, &crate::zip::descriptor_sizes(header_off, size))
}

/// Makes instances of a named tuple class from a tuple of its fields as the
/// class's own constructor does (`tuple.__new__(cls, fields)`), without the
/// Python frame of its generated `__new__`.
fn named_tuple_maker<'py>(
    py: Python<'py>,
) -> PyResult<impl Fn(&Bound<'py, PyAny>, Bound<'py, PyTuple>) -> PyResult<PyObject>> {
    let tuple_new = py.get_type::<PyTuple>().getattr("__new__")?;
    Ok(
        move |cls: &Bound<'py, PyAny>, fields: Bound<'py, PyTuple>| {
            Ok(tuple_new.call1((cls, fields))?.unbind())
        },
    )
}

/// The records of tensor storages, laid out one after the other from
/// `cursor`: for each `(name, size, address, crc_id, staged)`, its local
/// header (data aligned to `align`), its data (a region of `size` bytes at
/// `address`, checksummed as `crc_id`; none when `staged`, whose bytes come
/// from a device) and its data descriptor, whose CRC32 is a slot.
/// `pieces`: the `Blob`, `Region` and `Slot` classes of
/// `fastpersist.plan` (named tuples). Returns (blobs, regions, slots, the
/// header and data offset of each record, the end).
///
/// Pieces are made few and cheap, as 10,000 small tensors make 50,000 of
/// them while the engine waits for the GIL: a record's descriptor sizes and
/// the next record's header are one blob, the padding is one shared bytes
/// object per length (most of a 4096-aligned header), and the named tuples
/// are built by `tuple.__new__` as their own constructor does, without its
/// Python frame.
#[pyfunction]
#[allow(clippy::type_complexity)]
fn zip_storage_records<'py>(
    py: Python<'py>,
    cursor: u64,
    align: u64,
    records: &Bound<'py, PyAny>,
    pieces: (Bound<'py, PyAny>, Bound<'py, PyAny>, Bound<'py, PyAny>),
) -> PyResult<(
    Vec<PyObject>,
    Vec<PyObject>,
    Vec<PyObject>,
    Vec<(u64, u64)>,
    u64,
)> {
    zip_align_check(align)?;
    // An engine thread may be gathering the parts laid out before.
    let records: Vec<(Bound<'py, PyBytes>, u64, usize, u32, bool)> =
        extract_handing_off(py, records, "records")?;
    let (blob, region, slot) = pieces;
    let make = named_tuple_maker(py)?;
    let signature = PyBytes::new(py, &crate::zip::DESCRIPTOR_SIG.to_le_bytes());
    let mut pads: std::collections::HashMap<usize, Bound<'py, PyBytes>> =
        std::collections::HashMap::new();
    let mut blobs = Vec::with_capacity(records.len() * 3);
    let mut regions = Vec::with_capacity(records.len());
    let mut slots = Vec::with_capacity(records.len());
    let mut offsets = Vec::with_capacity(records.len());
    let mut at = cursor;
    // Bytes laid out but not yet a blob, starting at `run_at`.
    let mut run: Vec<u8> = Vec::new();
    let mut run_at = cursor;
    let too_far = || PyOverflowError::new_err("the file would be longer than 2**64 bytes");
    for (i, (name, size, address, crc_id, staged)) in records.into_iter().enumerate() {
        if i % HANDOFF_RECORDS == HANDOFF_RECORDS - 1 {
            let_engines_in(py);
        }
        let name = name.as_bytes();
        zip_name_check(name.len())?;
        let (head, pad) = crate::zip::local_header_split(name, at, size, align);
        let header_off = at;
        run.extend_from_slice(&head);
        blobs.push(make(
            &blob,
            (run_at, PyBytes::new(py, &run)).into_pyobject(py)?,
        )?);
        run.clear();
        let pad_at = header_off + head.len() as u64;
        if pad > 0 {
            let bytes = match pads.entry(pad) {
                std::collections::hash_map::Entry::Occupied(e) => e.get().clone(),
                std::collections::hash_map::Entry::Vacant(e) => e
                    .insert(PyBytes::new(py, &vec![crate::zip::PAD_BYTE; pad]))
                    .clone(),
            };
            blobs.push(make(&blob, (pad_at, bytes).into_pyobject(py)?)?);
        }
        let data_off = pad_at.checked_add(pad as u64).ok_or_else(too_far)?;
        if size > 0 && !staged {
            regions.push(make(
                &region,
                (data_off, address, size, crc_id).into_pyobject(py)?,
            )?);
        }
        at = data_off.checked_add(size).ok_or_else(too_far)?;
        if crate::zip::has_descriptor(size) {
            blobs.push(make(&blob, (at, &signature).into_pyobject(py)?)?);
            slots.push(make(&slot, (at + 4, crc_id).into_pyobject(py)?)?);
            run.extend_from_slice(&crate::zip::descriptor_sizes(header_off, size));
            run_at = at + 8;
            at = run_at.checked_add(run.len() as u64).ok_or_else(too_far)?;
        } else {
            run_at = at; // (an empty record ends at its header's padding)
        }
        offsets.push((header_off, data_off));
    }
    if !run.is_empty() {
        blobs.push(make(
            &blob,
            (run_at, PyBytes::new(py, &run)).into_pyobject(py)?,
        )?);
    }
    Ok((blobs, regions, slots, offsets, at))
}

/// The `n` entries of the central directory `cd` (at file offset
/// `cd_offset`) as `(name, local header offset, size, crc32, name as
/// stored)`, when the file is plainly well-formed
/// (`zip::plain_central_entries`); None for anything else, which the
/// Python reader parses itself to name what is wrong.
#[pyfunction]
fn zip_central_entries<'py>(
    py: Python<'py>,
    cd: &Bound<'py, PyBytes>,
    n: u64,
    cd_offset: u64,
) -> PyResult<Option<Bound<'py, PyList>>> {
    let Some(entries) = crate::zip::plain_central_entries(cd.as_bytes(), n, cd_offset) else {
        return Ok(None);
    };
    let out = PyList::empty(py);
    for e in entries {
        out.append((
            e.name,
            e.header_offset,
            e.size,
            e.crc32,
            PyBytes::new(py, e.name.as_bytes()),
        ))?;
    }
    Ok(Some(out))
}

/// The central directory of a torch zip from `cursor`, and the end records:
/// for each `(name, header offset, size, crc, crc_id)`, its entry, whose
/// CRC32 is a slot for checksum `crc_id` when that is given, else `crc`.
/// `pieces`: the `Blob` and `Slot` classes. Returns (blobs, slots, end).
#[pyfunction]
#[allow(clippy::type_complexity)]
fn zip_central_directory<'py>(
    py: Python<'py>,
    cursor: u64,
    entries: &Bound<'py, PyAny>,
    pieces: (Bound<'py, PyAny>, Bound<'py, PyAny>),
) -> PyResult<(Vec<PyObject>, Vec<PyObject>, u64)> {
    use crate::zip::CENTRAL_CRC_AT;
    // An engine thread may be gathering the file's head meanwhile.
    let entries: Vec<(Bound<'py, PyBytes>, u64, u64, Option<u32>, Option<u32>)> =
        extract_handing_off(py, entries, "entries")?;
    let (blob, slot) = pieces;
    let make = named_tuple_maker(py)?;
    let mut blobs = Vec::with_capacity(entries.len() + 1);
    let mut slots = Vec::new();
    let mut run: Vec<u8> = Vec::new(); // consecutive bytes not yet a blob
    let mut run_at = cursor;
    let mut at = cursor;
    let n = entries.len() as u64;
    for (i, (name, header_off, size, crc, crc_id)) in entries.into_iter().enumerate() {
        if i % HANDOFF_RECORDS == HANDOFF_RECORDS - 1 {
            let_engines_in(py);
        }
        let name = name.as_bytes();
        zip_name_check(name.len())?;
        let entry = crate::zip::central_entry(name, header_off, size, crc.unwrap_or(0));
        match crc_id {
            Some(id) => {
                run.extend_from_slice(&entry[..CENTRAL_CRC_AT]);
                blobs.push(make(
                    &blob,
                    (run_at, PyBytes::new(py, &run)).into_pyobject(py)?,
                )?);
                slots.push(make(
                    &slot,
                    (at + CENTRAL_CRC_AT as u64, id).into_pyobject(py)?,
                )?);
                run.clear();
                run.extend_from_slice(&entry[CENTRAL_CRC_AT + 4..]);
                run_at = at + CENTRAL_CRC_AT as u64 + 4;
            }
            None => run.extend_from_slice(&entry),
        }
        at += entry.len() as u64;
    }
    run.extend_from_slice(&crate::zip::end_records(n, cursor, at - cursor));
    at = run_at + run.len() as u64;
    blobs.push(make(
        &blob,
        (run_at, PyBytes::new(py, &run)).into_pyobject(py)?,
    )?);
    Ok((blobs, slots, at))
}

/// `RawWriteStats` and `RawReadStats`: the keys and value types of the
/// dicts the writes and reads return, as `typing.TypedDict`s (so Python code
/// can import them for annotations without a `TYPE_CHECKING` guard).
fn add_stats_types(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let typing = py.import("typing")?;
    let builtins = py.import("builtins")?;
    let int = builtins.getattr("int")?;
    let float = builtins.getattr("float")?;
    let bool_ = builtins.getattr("bool")?;
    let opt_str = typing
        .getattr("Optional")?
        .get_item(builtins.getattr("str")?)?;
    let list_int = typing.getattr("List")?.get_item(&int)?;
    let typed_dict = |name: &str, fields: &[(&str, &Bound<'_, PyAny>)]| -> PyResult<()> {
        let d = PyDict::new(py);
        for (k, v) in fields {
            d.set_item(k, v)?;
        }
        let t = typing.getattr("TypedDict")?.call1((name, d))?;
        t.setattr("__module__", "fastpersist._core")?;
        m.add(name, t)
    };
    typed_dict(
        "RawWriteStats",
        &[
            ("bytes", &int),
            ("seconds", &float),
            ("direct", &bool_),
            ("io_uring", &bool_),
            ("registered", &bool_),
            ("locked", &bool_),
            ("block", &int),
            ("direct_note", &opt_str),
            ("uring_note", &opt_str),
            ("crcs", &list_int),
            ("open_seconds", &float),
            ("io_seconds", &float),
            ("commit_seconds", &float),
            ("zero_copy_bytes", &int),
        ],
    )?;
    typed_dict(
        "RawReadStats",
        &[
            ("bytes", &int),
            ("seconds", &float),
            ("file_len", &int),
            ("direct", &bool_),
            ("io_uring", &bool_),
            ("crcs", &list_int),
        ],
    )
}

// ---------------------------------------------------------------------------
// The fast path of fastpersist.pickling.survey_storages and of
// TensorVersions' walk: the plain containers of a saved object (dict,
// OrderedDict, list, tuple: exact types) in the order of those walks, each
// tensor's version recorded, each storage with data found once, in the
// order the pickler meets it. Tensors of other types, and those whose data
// pointer is 0, are asked of the Python helpers, so the answers are theirs.

/// What `pickling._survey_context()` hands over.
#[derive(FromPyObject)]
struct SurveyCtx<'py>(
    /// torch.Tensor
    Bound<'py, PyAny>,
    /// torch.nn.Parameter
    Bound<'py, PyAny>,
    /// collections.OrderedDict
    Bound<'py, PyAny>,
    /// torch.strided
    Bound<'py, PyAny>,
    /// pickling._has_data
    Bound<'py, PyAny>,
    /// pickling._version
    Bound<'py, PyAny>,
    /// types whose objects hold no storage (their exact type is checked)
    Bound<'py, PyTuple>,
    /// pickling._may_hold_storages, asked of any other object that is
    /// not a tensor
    Bound<'py, PyAny>,
);

/// Whether `o` is an atom: an object of a type that holds no storage
/// (exact type checks only, cheaper than asking whether it is a tensor).
fn is_atom<'py>(ctx: &SurveyCtx<'py>, o: &Bound<'py, PyAny>, ty: &Bound<'py, PyType>) -> bool {
    o.is_none()
        || o.is_exact_instance_of::<PyString>()
        || o.is_exact_instance_of::<PyInt>()
        || o.is_exact_instance_of::<PyFloat>()
        || o.is_exact_instance_of::<PyBool>()
        || o.is_exact_instance_of::<PyBytes>()
        || ctx.6.iter().any(|atom| ty.is(&atom))
}

/// Containers pushed in the order the walks pop them: a sequence's items,
/// a mapping's values, or (`keys`) its keys and values, key first.
fn push_children<'py>(
    stack: &mut Vec<Bound<'py, PyAny>>,
    o: &Bound<'py, PyAny>,
    mapping: bool,
    keys: bool,
) -> PyResult<()> {
    let py = o.py();
    let start = stack.len();
    if !mapping {
        for item in o.try_iter()? {
            stack.push(item?);
        }
    } else if let Ok(d) = o.downcast_exact::<PyDict>() {
        for (k, v) in d.iter() {
            if keys {
                stack.push(k);
            }
            stack.push(v);
        }
    } else {
        // An OrderedDict: its own order (`move_to_end` keeps the dict's).
        for item in o.call_method0(pyo3::intern!(py, "items"))?.try_iter()? {
            let item = item?;
            let (k, v): (Bound<'py, PyAny>, Bound<'py, PyAny>) = item.extract()?;
            if keys {
                stack.push(k);
            }
            stack.push(v);
        }
        // Then its attributes (state_dict()'s `_metadata`), which its
        // reduction pickles after the items: tensors there come before
        // those of the containers that follow.
        if let Ok(d) = o.getattr(pyo3::intern!(py, "__dict__")) {
            if d.is_truthy()? {
                stack.push(d);
            }
        }
    }
    // Reversed: popped (and met) in the container's order.
    stack[start..].reverse();
    Ok(())
}

/// Whether tensor `t` (of type `exact`: Tensor or Parameter) has a storage
/// whose bytes can be written: `pickling._has_data`, answered here when
/// its data pointer is not 0, else by the helper.
fn tensor_has_data<'py>(
    ctx: &SurveyCtx<'py>,
    t: &Bound<'py, PyAny>,
    exact: bool,
) -> PyResult<bool> {
    let py = t.py();
    if exact {
        // Memory at an address: data (a meta tensor's address is 0, and
        // the Python check below sees to those with none).
        if let Ok(p) = t.call_method0(pyo3::intern!(py, "data_ptr")) {
            if p.extract::<usize>().is_ok_and(|p| p != 0) {
                return Ok(true);
            }
        }
    }
    ctx.4.call1((t,))?.is_truthy()
}

/// How large a memo the pickle in `data` can ask of an unpickler (see
/// `crate::unpickle::memo_bound`); None when it is not a complete pickle.
#[pyfunction]
fn pickle_memo_bound(py: Python<'_>, data: &[u8]) -> Option<u64> {
    py.allow_threads(|| crate::unpickle::memo_bound(data))
}

/// The deepest nesting of arrays and objects in JSON text `data`, counted
/// up to `limit` (see `crate::json::max_depth`).
#[pyfunction]
fn json_depth(py: Python<'_>, data: &[u8], limit: usize) -> usize {
    py.allow_threads(|| crate::json::max_depth(data, limit))
}

/// What a survey has found so far: the storages with data, keyed by
/// `_cdata`, as `(key, storage)` with keys "0", "1", ... in the order met;
/// their bytes; those not on the CPU; and where the first object the walk
/// does not see into but the pickler may find storages in came.
struct Found<'py> {
    storages: Bound<'py, PyDict>,
    total: u64,
    off_cpu: Bound<'py, PyList>,
    ordered: Option<usize>,
}

impl<'py> Found<'py> {
    fn new(py: Python<'py>) -> Self {
        Found {
            storages: PyDict::new(py),
            total: 0,
            off_cpu: PyList::empty(py),
            ordered: None,
        }
    }

    /// The finding part of the walk for a leaf `o` (not a container, not an
    /// atom): a `tensor` (of an `exact` type, Tensor or Parameter, or a
    /// subclass) or another object.
    fn leaf(
        &mut self,
        ctx: &SurveyCtx<'py>,
        o: &Bound<'py, PyAny>,
        exact: bool,
        tensor: bool,
    ) -> PyResult<()> {
        let py = o.py();
        if !tensor {
            // An object the walk does not enter: the pickler may meet
            // storages in it (pickling._may_hold_storages says).
            if self.ordered.is_none() && ctx.7.call1((o,))?.is_truthy()? {
                self.ordered = Some(self.storages.len());
            }
            return Ok(());
        }
        // A (strided) nested tensor's layout is `strided` too.
        let strided = o.getattr(pyo3::intern!(py, "layout"))?.is(&ctx.3)
            && !o.getattr(pyo3::intern!(py, "is_nested"))?.is_truthy()?;
        if (!exact || !strided) && self.ordered.is_none() {
            // A subclass's reduction is its own, and a sparse or nested
            // tensor's pickles the tensors it is made of (indices and
            // values, buffer and sizes), which the walk does not enter:
            // the pickler meets other storages here.
            self.ordered = Some(self.storages.len());
        }
        if strided && tensor_has_data(ctx, o, exact)? {
            let st = o.call_method0(pyo3::intern!(py, "untyped_storage"))?;
            let cdata = st.getattr(pyo3::intern!(py, "_cdata"))?;
            if !self.storages.contains(&cdata)? {
                self.total += st
                    .call_method0(pyo3::intern!(py, "nbytes"))?
                    .extract::<u64>()?;
                // The tensor's device is its storage's (a bool: no device
                // object made).
                if !o.getattr(pyo3::intern!(py, "is_cpu"))?.is_truthy()? {
                    self.off_cpu.append(&st)?;
                }
                // As torch.save makes its keys (`str(len(id_map))`): a new
                // string, never the interpreter's cached one-character one,
                // which an equal string pickled before would share (and the
                // pickler's memo then meet).
                let key = self.storages.len().into_pyobject(py)?.str()?;
                self.storages.set_item(cdata, (key, st))?;
            }
        }
        if exact
            && self.ordered.is_none()
            && (has_attributes(o)? || o.getattr(pyo3::intern!(py, "is_quantized"))?.is_truthy()?)
        {
            // torch pickles a tensor's attributes after its storage, and a
            // quantized tensor's per-channel scales and zero points.
            self.ordered = Some(self.storages.len());
        }
        Ok(())
    }

    fn result(&self) -> SurveyResult<'py> {
        let n = self.storages.len();
        (
            self.storages.clone(),
            self.total,
            self.off_cpu.clone(),
            self.ordered.unwrap_or(n),
        )
    }
}

/// The storages found, their bytes, those not on the CPU, and how many of
/// the storages come first in pickling order (see [`survey`]).
type SurveyResult<'py> = (Bound<'py, PyDict>, u64, Bound<'py, PyList>, usize);

/// What [`survey`] returns: a [`SurveyResult`] and the rest of the survey
/// (None when it went to the end).
type SurveyFirst<'py> = (
    Bound<'py, PyDict>,
    u64,
    Bound<'py, PyList>,
    usize,
    Option<SurveyRest>,
);

/// Counts the leaves a walk has handled and hands the GIL over every
/// [`TENSORS_PER_RELEASE`] of them (as the pickler's walk: a thread waiting
/// for it takes it here; the walk holds its own references).
struct Releases(u32);

impl Releases {
    fn tick(&mut self, py: Python<'_>) {
        self.0 += 1;
        if self.0 == TENSORS_PER_RELEASE {
            self.0 = 0;
            if !let_engines_in(py) {
                py.allow_threads(|| ());
            }
        }
    }
}

/// The rest of a survey stopped early (`limit`): the leaves whose storages
/// are still to be found, in the order the walk met them (their versions
/// are recorded already), and what was found before them. [`Self::finish`]
/// finds them: the same storages, keys and order as one walk to the end.
#[pyclass(module = "fastpersist._core", name = "SurveyRest")]
struct SurveyRest {
    storages: Py<PyDict>,
    total: u64,
    off_cpu: Py<PyList>,
    ordered: Option<usize>,
    /// `(leaf, exact, tensor)`, as `Found::leaf` takes them.
    leaves: Vec<(PyObject, bool, bool)>,
}

#[pymethods]
impl SurveyRest {
    /// Find the storages of the leaves left; returns what [`survey`] returns
    /// (the storage dict is the one the first part returned, extended).
    /// Once done, a second call returns the same.
    fn finish<'py>(&mut self, py: Python<'py>, ctx: SurveyCtx<'py>) -> PyResult<SurveyResult<'py>> {
        let mut found = Found {
            storages: self.storages.bind(py).clone(),
            total: self.total,
            off_cpu: self.off_cpu.bind(py).clone(),
            ordered: self.ordered,
        };
        let leaves = std::mem::take(&mut self.leaves);
        let mut releases = Releases(0);
        let mut done = 0;
        let mut res = Ok(());
        for (o, exact, tensor) in &leaves {
            res = found.leaf(&ctx, o.bind(py), *exact, *tensor);
            if res.is_err() {
                break;
            }
            done += 1;
            releases.tick(py);
        }
        self.total = found.total;
        self.ordered = found.ordered;
        if let Err(e) = res {
            // What was not handled stays for another call.
            self.leaves = leaves.into_iter().skip(done).collect();
            return Err(e);
        }
        Ok(found.result())
    }

    /// Leaves whose storages are still to be found.
    fn __len__(&self) -> usize {
        self.leaves.len()
    }
}

/// The walk of `find_storages` (`find`: dict keys included; the storages
/// with data, keyed by `_cdata`, as `(key, storage)` with keys "0", "1", ...
/// in the order met) or of `TensorVersions._walk` (values only, nothing
/// found). With `seen` (a TensorVersions' `_seen`), each tensor not in it
/// yet is recorded there as `id -> (tensor, version)`, unless it has no
/// version counter. Returns the storages, their bytes, those not on the
/// CPU, how many of the storages come before the first object the walk
/// does not see into but the pickler may find storages in (an object of
/// another class, a tensor subclass, a tensor with attributes): those
/// storages, and only those, are met by the pickler first and in this
/// order; and the rest of the survey, or None. With `limit` (`(bytes,
/// storages)`), once at least that many storages holding at least that
/// many bytes are found, the walk goes on recording versions but leaves
/// the finding of the remaining storages to the returned `SurveyRest`
/// (what the storages found so far need is known, and their writing can
/// start while the rest is found).
#[pyfunction]
#[pyo3(signature = (obj, ctx, seen, find, limit=None))]
fn survey<'py>(
    py: Python<'py>,
    obj: &Bound<'py, PyAny>,
    ctx: SurveyCtx<'py>,
    seen: Option<Bound<'py, PyDict>>,
    find: bool,
    limit: Option<(u64, usize)>,
) -> PyResult<SurveyFirst<'py>> {
    let mut found = Found::new(py);
    let mut rest: Option<Vec<(PyObject, bool, bool)>> = None;
    let mut containers: std::collections::HashSet<usize> = std::collections::HashSet::new();
    let mut stack = vec![obj.clone()];
    let mut releases = Releases(0);
    while let Some(o) = stack.pop() {
        let ty = o.get_type();
        let mapping = o.is_exact_instance_of::<PyDict>() || ty.is(&ctx.2);
        if mapping || o.is_exact_instance_of::<PyList>() || o.is_exact_instance_of::<PyTuple>() {
            if containers.insert(o.as_ptr() as usize) {
                push_children(&mut stack, &o, mapping, find)?;
            }
            continue;
        }
        let exact = ty.is(&ctx.0) || ty.is(&ctx.1);
        if !exact && is_atom(&ctx, &o, &ty) {
            continue;
        }
        let tensor = exact || o.is_instance(&ctx.0)?;
        if tensor {
            if let Some(seen) = &seen {
                let id = o.as_ptr() as usize;
                if !seen.contains(id)? {
                    let v = if exact {
                        match o.getattr(pyo3::intern!(py, "_version")) {
                            Ok(v) => Some(v),
                            Err(e) if e.is_instance_of::<PyRuntimeError>(py) => None,
                            Err(e) => return Err(e),
                        }
                    } else {
                        let v = ctx.5.call1((&o,))?;
                        (!v.is_none()).then_some(v)
                    };
                    if let Some(v) = v {
                        seen.set_item(id, (&o, v))?;
                    }
                }
            }
        }
        if find {
            if rest.is_none()
                && limit.is_some_and(|(bytes, n)| found.total >= bytes && found.storages.len() >= n)
            {
                rest = Some(Vec::new());
            }
            match &mut rest {
                Some(leaves) => leaves.push((o.clone().unbind(), exact, tensor)),
                None => found.leaf(&ctx, &o, exact, tensor)?,
            }
        }
        if tensor {
            releases.tick(py);
        }
    }
    let (storages, total, off_cpu, ordered) = found.result();
    let rest = rest.map(|leaves| SurveyRest {
        storages: storages.clone().unbind(),
        total,
        off_cpu: off_cpu.clone().unbind(),
        ordered: found.ordered,
        leaves,
    });
    Ok((storages, total, off_cpu, ordered, rest))
}

/// Whether tensor `t` has attributes of its own (a non-empty `__dict__`),
/// which torch.save pickles with it.
fn has_attributes(t: &Bound<'_, PyAny>) -> PyResult<bool> {
    match t.getattr(pyo3::intern!(t.py(), "__dict__")) {
        Ok(d) => d.is_truthy(),
        Err(_) => Ok(false),
    }
}

// The fast path of fastpersist.pickling.pickle_obj: a walk over the plain
// objects of a state dict that writes, through crate::pickle, the bytes the
// slow path (a pickle.Pickler with torch.save's persistent ids and a tensor
// reducer) would write. Anything else stops the walk, and the slow path
// pickles the object instead.

/// What `pickling._fast_context()` hands over: the objects the slow path
/// pickles (by identity), and how to learn a dtype's storage class.
#[derive(FromPyObject)]
struct PickleCtx<'py>(
    /// torch.Tensor
    Bound<'py, PyAny>,
    /// collections.OrderedDict
    Bound<'py, PyAny>,
    /// torch.strided
    Bound<'py, PyAny>,
    /// the "storage" of persistent ids
    Bound<'py, PyString>,
    /// the location tag of CPU storages ("cpu")
    Bound<'py, PyString>,
    /// torch._utils._rebuild_tensor_v2 and its GLOBAL bytes
    (Bound<'py, PyAny>, Vec<u8>),
    /// the GLOBAL bytes of OrderedDict
    Vec<u8>,
    /// torch._utils.get_tensor_metadata, or None
    Option<Bound<'py, PyAny>>,
    /// dtype -> (storage class, its GLOBAL bytes, element size), or None
    /// for dtypes the tensor reducer leaves to torch
    Bound<'py, PyAny>,
    /// torch.Tensor.has_names where torch has named tensors, else None:
    /// torch's reduction refuses a tensor with names
    Option<Bound<'py, PyAny>>,
);

/// Why the walk stopped: an object the fast path does not write, or a
/// Python exception (the slow path meets it again and reports it as before).
enum Stop {
    Unsupported,
    Py(PyErr),
}

impl From<PyErr> for Stop {
    fn from(e: PyErr) -> Self {
        Stop::Py(e)
    }
}

impl From<crate::pickle::TooLarge> for Stop {
    fn from(_: crate::pickle::TooLarge) -> Self {
        Stop::Unsupported
    }
}

type Walked<T = ()> = Result<T, Stop>;

/// Deeper nesting is left to the slow path (and its recursion limit).
const MAX_DEPTH: usize = 200;

struct DtypeInfo<'py> {
    dtype: Bound<'py, PyAny>,
    storage_type: Bound<'py, PyAny>,
    raw: Vec<u8>,
    elem: i64,
}

struct StorageKey<'py> {
    obj: Bound<'py, PyAny>,
    /// Its UTF-8, once it is first written.
    utf8: Option<Bound<'py, PyBytes>>,
}

struct PickleWalk<'py> {
    py: Python<'py>,
    ctx: PickleCtx<'py>,
    e: crate::pickle::Emitter,
    /// Objects memoized by identity: kept alive until the pickle is done,
    /// as the C pickler's memo keeps them, so no address is reused.
    keep: Vec<Bound<'py, PyAny>>,
    /// `TensorVersions.add` and its `_seen` (id -> record): tensors
    /// already seen are not passed to it (it would do nothing).
    add: Option<(Bound<'py, PyAny>, Bound<'py, PyDict>)>,
    /// storage `_cdata` -> key (the slow path's `_keys`).
    keys: crate::pickle::IdMap<StorageKey<'py>>,
    /// storage data pointer -> dtype (the slow path's `_dtypes`).
    ptr_dtypes: crate::pickle::IdMap<usize>,
    dtypes: Vec<DtypeInfo<'py>>,
    storages: Bound<'py, PyDict>,
    storage_tag: Bound<'py, PyBytes>,
    location: Bound<'py, PyBytes>,
    depth: usize,
    /// Tensors written since the GIL was last let go.
    since_release: u32,
}

/// Tensors between two moments the walk lets go of the GIL: the
/// interpreter lets other threads run every few milliseconds (the switch
/// interval), and the engine's copies wait for the GIL; a walk of
/// thousands of tensors must not hold it throughout.
const TENSORS_PER_RELEASE: u32 = 128;

fn utf8_of<'py>(s: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
    let s = s.downcast::<PyString>()?;
    match s.encode_utf8() {
        Ok(b) => Ok(b),
        // Lone surrogates: the C pickler writes them as "surrogatepass".
        Err(_) => Ok(s
            .call_method1(pyo3::intern!(s.py(), "encode"), ("utf-8", "surrogatepass"))?
            .downcast_into::<PyBytes>()?),
    }
}

impl<'py> PickleWalk<'py> {
    fn save(&mut self, o: &Bound<'py, PyAny>) -> Walked {
        if o.is_none() {
            self.e.none();
            return Ok(());
        }
        if o.is_exact_instance_of::<PyBool>() {
            self.e.bool(o.is_truthy()?);
            return Ok(());
        }
        if o.is_exact_instance_of::<PyInt>() {
            return self.int(o);
        }
        if let Ok(f) = o.downcast_exact::<PyFloat>() {
            self.e.float(f.value());
            return Ok(());
        }
        let id = o.as_ptr() as usize;
        if self.e.get(id) {
            return Ok(());
        }
        if o.is_exact_instance_of::<PyString>() {
            let utf8 = utf8_of(o)?;
            self.e.str(crate::pickle::Str {
                id,
                utf8: utf8.as_bytes(),
            })?;
            self.keep.push(o.clone());
            return Ok(());
        }
        if self.depth >= MAX_DEPTH {
            return Err(Stop::Unsupported);
        }
        self.depth += 1;
        let r = self.save_container(o, id);
        self.depth -= 1;
        r
    }

    fn save_container(&mut self, o: &Bound<'py, PyAny>, id: usize) -> Walked {
        if let Ok(d) = o.downcast_exact::<PyDict>() {
            self.e.empty_dict(id)?;
            self.keep.push(o.clone());
            let items: Vec<_> = d.iter().collect();
            self.items(crate::pickle::Items::DictExact, &items)?;
            if d.len() != items.len() {
                return Err(Stop::Unsupported); // changed size while pickled
            }
            return Ok(());
        }
        if let Ok(l) = o.downcast_exact::<PyList>() {
            self.e.empty_list(id)?;
            self.keep.push(o.clone());
            let items: Vec<_> = l.iter().collect();
            let kind = crate::pickle::Items::ListExact;
            for b in crate::pickle::batches(kind, items.len()) {
                self.e.begin_batch(&b);
                for item in &items[b.items.clone()] {
                    self.save(item)?;
                }
                self.e.end_batch(kind, &b);
            }
            if l.len() != items.len() {
                return Err(Stop::Unsupported);
            }
            return Ok(());
        }
        if let Ok(t) = o.downcast_exact::<PyTuple>() {
            let n = t.len();
            if n == 0 {
                self.e.empty_tuple();
                return Ok(());
            }
            if n > 3 {
                self.e.mark();
            }
            for item in t.iter() {
                self.save(&item)?;
            }
            self.e.end_tuple(n, Some(id))?;
            self.keep.push(o.clone());
            return Ok(());
        }
        let ty = o.get_type_ptr().cast::<pyo3::ffi::PyObject>();
        if ty == self.ctx.0.as_ptr() {
            return self.tensor(o, id);
        }
        if ty == self.ctx.1.as_ptr() {
            return self.ordered_dict(o, id);
        }
        Err(Stop::Unsupported)
    }

    fn items(
        &mut self,
        kind: crate::pickle::Items,
        items: &[(Bound<'py, PyAny>, Bound<'py, PyAny>)],
    ) -> Walked {
        for b in crate::pickle::batches(kind, items.len()) {
            self.e.begin_batch(&b);
            for (k, v) in &items[b.items.clone()] {
                self.save(k)?;
                self.save(v)?;
            }
            self.e.end_batch(kind, &b);
        }
        Ok(())
    }

    fn int(&mut self, o: &Bound<'py, PyAny>) -> Walked {
        if let Ok(v) = o.extract::<i64>() {
            self.e.int(v);
            return Ok(());
        }
        // Past 64 bits: its bytes as save_long takes them.
        let py = self.py;
        let negative = o.lt(0)?;
        let bits: usize = o.call_method0(pyo3::intern!(py, "bit_length"))?.extract()?;
        let n = (bits >> 3) + 1;
        let signed = PyDict::new(py);
        signed.set_item(pyo3::intern!(py, "signed"), true)?;
        let le = o.call_method(pyo3::intern!(py, "to_bytes"), (n, "little"), Some(&signed))?;
        self.e.long(
            le.downcast::<PyBytes>().map_err(PyErr::from)?.as_bytes(),
            negative,
        )?;
        Ok(())
    }

    fn ordered_dict(&mut self, o: &Bound<'py, PyAny>, id: usize) -> Walked {
        let py = self.py;
        // OrderedDict.__reduce__: (OrderedDict, (), state, None, iter(items)),
        // state the instance __dict__ (None when empty); nn.Module.state_dict()
        // sets `_metadata`.
        let state = o.getattr(pyo3::intern!(py, "__dict__"))?;
        let state = state
            .downcast_exact::<PyDict>()
            .map_err(|_| Stop::Unsupported)?;
        let has_state = match state.len() {
            0 => false,
            1 if state.contains(pyo3::intern!(py, "_metadata"))? => true,
            _ => return Err(Stop::Unsupported),
        };
        let odict_raw = std::mem::take(&mut self.ctx.6);
        let g = self.e.global(crate::pickle::Global {
            id: self.ctx.1.as_ptr() as usize,
            raw: &odict_raw,
        });
        self.ctx.6 = odict_raw;
        g?;
        self.e.empty_tuple();
        self.e.reduce();
        self.e.put(Some(id))?;
        self.keep.push(o.clone());
        let mut items = Vec::new();
        for item in o.call_method0(pyo3::intern!(py, "items"))?.try_iter()? {
            let item = item?;
            let pair = item
                .downcast_exact::<PyTuple>()
                .map_err(|_| Stop::Unsupported)?;
            if pair.len() != 2 {
                return Err(Stop::Unsupported);
            }
            items.push((pair.get_item(0)?, pair.get_item(1)?));
        }
        self.items(crate::pickle::Items::DictIter, &items)?;
        if has_state {
            let state = state.clone().into_any();
            self.save(&state)?;
            self.e.build();
        }
        Ok(())
    }

    fn dtype_info(&mut self, dtype: &Bound<'py, PyAny>) -> Walked<usize> {
        if let Some(i) = self.dtypes.iter().position(|d| d.dtype.is(dtype)) {
            return Ok(i);
        }
        let info = self.ctx.8.call1((dtype,))?;
        if info.is_none() {
            return Err(Stop::Unsupported);
        }
        let (storage_type, raw, elem): (Bound<'py, PyAny>, Vec<u8>, i64) = info.extract()?;
        if elem <= 0 {
            return Err(Stop::Unsupported);
        }
        self.dtypes.push(DtypeInfo {
            dtype: dtype.clone(),
            storage_type,
            raw,
            elem,
        });
        Ok(self.dtypes.len() - 1)
    }

    /// The tests of `_Pickler.reducer_override` for a tensor whose type
    /// is exactly torch.Tensor: strided, on the CPU, a dtype it reduces
    /// itself, not quantized, not nested, no attributes (the zero tensor test is
    /// `tensor`'s). Returns its dtype's index in `dtypes`.
    fn plain_tensor(&mut self, t: &Bound<'py, PyAny>) -> Walked<usize> {
        let py = self.py;
        if !t.getattr(pyo3::intern!(py, "layout"))?.is(&self.ctx.2)
            || !t.getattr(pyo3::intern!(py, "is_cpu"))?.extract::<bool>()?
        {
            return Err(Stop::Unsupported);
        }
        let dtype = t.getattr(pyo3::intern!(py, "dtype"))?;
        let di = self.dtype_info(&dtype)?;
        let attrs = t.getattr(pyo3::intern!(py, "__dict__"))?;
        if t.getattr(pyo3::intern!(py, "is_quantized"))?
            .extract::<bool>()?
            || t.getattr(pyo3::intern!(py, "is_nested"))?
                .extract::<bool>()?
            || attrs.len()? != 0
        {
            return Err(Stop::Unsupported);
        }
        if let Some(has_names) = &self.ctx.9 {
            if has_names.call1((t,))?.is_truthy()? {
                return Err(Stop::Unsupported); // the slow path raises as torch does
            }
        }
        Ok(di)
    }

    /// `_storage_id`'s key of `storage` (its data at `data`, seen as dtype
    /// `di`): the known or
    /// earlier key, else a new one (`str(len(keys))`); the storage noted
    /// in `storages` under it. Memory seen as two dtypes stops the walk
    /// (the slow path raises).
    fn storage_key(
        &mut self,
        storage: &Bound<'py, PyAny>,
        data: usize,
        di: usize,
    ) -> Walked<usize> {
        let py = self.py;
        let dtype = self.dtypes[di].dtype.as_ptr() as usize;
        if data != 0 && *self.ptr_dtypes.entry(data).or_insert(dtype) != dtype {
            return Err(Stop::Unsupported);
        }
        let cdata: usize = storage.getattr(pyo3::intern!(py, "_cdata"))?.extract()?;
        if !self.keys.contains_key(&cdata) {
            let n = self.keys.len();
            let Ok(n_obj) = n.into_pyobject(py);
            let obj = n_obj.str()?.into_any();
            self.keys.insert(cdata, StorageKey { obj, utf8: None });
        }
        let key = self.keys.get_mut(&cdata).ok_or(Stop::Unsupported)?;
        self.storages.set_item(&key.obj, storage)?;
        if key.utf8.is_none() && !self.e.memoized(key.obj.as_ptr() as usize) {
            key.utf8 = Some(utf8_of(&key.obj)?);
        }
        Ok(cdata)
    }

    /// `_Pickler.reducer_override` for a tensor (its type exactly
    /// torch.Tensor) and `persistent_id` for its storage.
    fn tensor(&mut self, t: &Bound<'py, PyAny>, id: usize) -> Walked {
        let py = self.py;
        if let Some((add, seen)) = &self.add {
            if !seen.contains(id)? {
                add.call1((t,))?;
            }
        }
        let di = self.plain_tensor(t)?;
        let storage = t.call_method0(pyo3::intern!(py, "untyped_storage"))?;
        let data: usize = storage
            .call_method0(pyo3::intern!(py, "data_ptr"))?
            .extract()?;
        // `_zero`: a tensor with data is no zero tensor, and its data
        // pointer is past its storage's: not null when that one is not.
        if data == 0 {
            let ptr: usize = t.call_method0(pyo3::intern!(py, "data_ptr"))?.extract()?;
            if ptr == 0
                && t.call_method0(pyo3::intern!(py, "_is_zerotensor"))?
                    .extract::<bool>()?
            {
                return Err(Stop::Unsupported);
            }
        }
        let offset: i64 = t
            .call_method0(pyo3::intern!(py, "storage_offset"))?
            .extract()?;
        let size = int_tuple(&t.getattr(pyo3::intern!(py, "shape"))?)?; // size(), without its argument parsing
        let stride = int_tuple(&t.call_method0(pyo3::intern!(py, "stride"))?)?;
        let nbytes: i64 = storage
            .call_method0(pyo3::intern!(py, "nbytes"))?
            .extract()?;
        let elem = self.dtypes[di].elem;
        if !size.contains(&0) && !within(offset, &size, &stride, elem, nbytes) {
            return Err(Stop::Unsupported); // _check_extent raises: the slow path says so
        }
        let cdata = self.storage_key(&storage, data, di)?;
        let requires_grad: bool = t.getattr(pyo3::intern!(py, "requires_grad"))?.extract()?;
        if t.getattr(pyo3::intern!(py, "_backward_hooks"))?
            .is_truthy()?
        {
            // torch's reduction warns that the hooks are not saved.
            return Err(Stop::Unsupported);
        }
        let meta = match &self.ctx.7 {
            Some(f) => Some(f.call1((t,))?),
            None => None,
        };
        let meta = match meta {
            Some(m) if m.is_truthy()? => Some(m),
            _ => None,
        };
        let d = &self.dtypes[di];
        let key = &self.keys[&cdata];
        let reduce = crate::pickle::TensorReduce {
            rebuild: crate::pickle::Global {
                id: self.ctx.5 .0.as_ptr() as usize,
                raw: &self.ctx.5 .1,
            },
            storage_tag: crate::pickle::Str {
                id: self.ctx.3.as_ptr() as usize,
                utf8: self.storage_tag.as_bytes(),
            },
            storage_type: crate::pickle::Global {
                id: d.storage_type.as_ptr() as usize,
                raw: &d.raw,
            },
            key: crate::pickle::Str {
                id: key.obj.as_ptr() as usize,
                utf8: key.utf8.as_ref().map_or(&[], |b| b.as_bytes()),
            },
            location: crate::pickle::Str {
                id: self.ctx.4.as_ptr() as usize,
                utf8: self.location.as_bytes(),
            },
            numel: nbytes / d.elem,
            offset,
            size: &size,
            stride: &stride,
            requires_grad,
            odict: crate::pickle::Global {
                id: self.ctx.1.as_ptr() as usize,
                raw: &self.ctx.6,
            },
        };
        self.e.tensor_begin(&reduce)?;
        if let Some(m) = &meta {
            self.save(m)?;
        }
        self.e.tensor_end(id, meta.is_some())?;
        self.keep.push(t.clone());
        self.since_release += 1;
        if self.since_release == TENSORS_PER_RELEASE {
            self.since_release = 0;
            // A thread waiting for the GIL takes it here, as at the
            // interpreter's switch points (an engine thread writing the
            // head of this file at once: handed over, the GIL has been let
            // go already); no Python object is touched.
            if !let_engines_in(self.py) {
                self.py.allow_threads(|| ());
            }
        }
        Ok(())
    }
}

/// The ints of a tuple (torch.Size, a stride).
fn int_tuple(t: &Bound<'_, PyAny>) -> Walked<Vec<i64>> {
    let t = t.downcast::<PyTuple>().map_err(|_| Stop::Unsupported)?;
    let mut out = Vec::with_capacity(t.len());
    for i in 0..t.len() {
        out.push(t.get_item(i)?.extract()?);
    }
    Ok(out)
}

/// `_check_extent`: the tensor lies inside its storage's `nbytes`.
fn within(offset: i64, size: &[i64], stride: &[i64], elem: i64, nbytes: i64) -> bool {
    if size.len() != stride.len() {
        return false;
    }
    let last = size
        .iter()
        .zip(stride)
        .map(|(&n, &s)| i128::from(n - 1) * i128::from(s))
        .sum::<i128>()
        + i128::from(offset);
    (last + 1) * i128::from(elem) <= i128::from(nbytes)
}

/// torch.save's pickle of `obj` (`fastpersist.pickling.pickle_obj`'s bytes
/// and storages by key), when `obj` is made only of exact dicts, lists,
/// tuples, strings, ints, floats, bools, None, OrderedDicts (no instance
/// attribute but `_metadata`) and plain dense CPU tensors; None for anything
/// else (and on any exception), for the slow path to pickle. `ctx`: see
/// `pickling._fast_context`; `known`: storage `_cdata` -> (key, storage),
/// keys kept; `add`: `(TensorVersions.add, TensorVersions._seen)`, add
/// called with each tensor first met whose id `_seen` does not hold (as the
/// slow path's reducer calls it, less the calls that would do nothing).
#[pyfunction]
#[pyo3(signature = (obj, ctx, known=None, add=None))]
#[allow(clippy::type_complexity)]
fn fast_pickle<'py>(
    py: Python<'py>,
    obj: &Bound<'py, PyAny>,
    ctx: PickleCtx<'py>,
    known: Option<Bound<'py, PyDict>>,
    add: Option<(Bound<'py, PyAny>, Bound<'py, PyDict>)>,
) -> PyResult<Option<(Bound<'py, PyBytes>, Bound<'py, PyDict>)>> {
    match fast_pickle_walk(py, obj, ctx, known, add) {
        Ok(done) => Ok(Some(done)),
        Err(Stop::Unsupported) => Ok(None),
        // Exceptions are the slow path's to raise; KeyboardInterrupt and
        // other BaseExceptions are not swallowed.
        Err(Stop::Py(e)) if e.is_instance_of::<pyo3::exceptions::PyException>(py) => Ok(None),
        Err(Stop::Py(e)) => Err(e),
    }
}

fn fast_pickle_walk<'py>(
    py: Python<'py>,
    obj: &Bound<'py, PyAny>,
    ctx: PickleCtx<'py>,
    known: Option<Bound<'py, PyDict>>,
    add: Option<(Bound<'py, PyAny>, Bound<'py, PyDict>)>,
) -> Walked<(Bound<'py, PyBytes>, Bound<'py, PyDict>)> {
    // Room for a state dict of `hint` tensors (a key, a name, a tensor each).
    let hint = obj
        .downcast_exact::<PyDict>()
        .map_or(0, PyDictMethods::len)
        .max(known.as_ref().map_or(0, PyDictMethods::len));
    let mut keys = crate::pickle::IdMap::default();
    keys.reserve(hint);
    if let Some(known) = known {
        for (c, v) in known.iter() {
            let (k, _): (Bound<'py, PyAny>, Bound<'py, PyAny>) = v.extract()?;
            keys.insert(c.extract::<usize>()?, StorageKey { obj: k, utf8: None });
        }
    }
    let storage_tag = utf8_of(&ctx.3)?;
    let location = utf8_of(&ctx.4)?;
    let mut w = PickleWalk {
        py,
        ctx,
        e: crate::pickle::Emitter::with_capacity(128 * hint + 4096, 4 * hint + 256),
        keep: Vec::with_capacity(3 * hint + 64),
        add,
        keys,
        ptr_dtypes: crate::pickle::id_map(hint),
        dtypes: Vec::new(),
        storages: PyDict::new(py),
        storage_tag,
        location,
        depth: 0,
        since_release: 0,
    };
    w.save(obj)?;
    let PickleWalk { e, storages, .. } = w;
    Ok((PyBytes::new(py, &e.finish()), storages))
}

// ---------------------------------------------------------------------------
// The fast path of fastpersist.pickling.unpickle: crate::unpickle reads the
// opcodes torch.save writes for plain state dicts, and `UnpickleBuild` makes
// the objects the slow path's unpickler (pickle.Unpickler, or torch's
// weights_only unpickler) would make from them. Anything else is refused,
// and the slow path unpickles the data instead.
//
// weights_only: the objects made here are dicts, lists, tuples, strings,
// ints, floats, bools, None, OrderedDicts (with a `__dict__` state from
// BUILD) and tensors rebuilt by `torch._utils._rebuild_tensor_v2` from the
// storages `persistent_load` hands out; the only globals resolved are those
// `pickling._fast_unpickle_context` lists, which for weights_only=True are
// the very objects of torch's allowlist (`_get_allowed_globals`). torch's
// weights_only unpickler allows every one of them, so one fast path serves
// both modes; whatever it might refuse never gets past this reader.

/// What `pickling._fast_unpickle_context()` hands over.
#[derive(FromPyObject)]
struct UnpickleCtx<'py>(
    /// (module, name, object): the GLOBALs resolved, to the objects the
    /// slow path's unpickler resolves them to
    Vec<(Vec<u8>, Vec<u8>, Bound<'py, PyAny>)>,
    /// torch._utils._rebuild_tensor_v2
    Bound<'py, PyAny>,
    /// collections.OrderedDict
    Bound<'py, PyAny>,
    /// torch.storage.TypedStorage
    Bound<'py, PyAny>,
    /// torch.empty
    Bound<'py, PyAny>,
);

/// Why a builder call failed.
enum Unpicked {
    /// Outside the fast path: the slow path unpickles.
    Refused,
    /// `persistent_load` raised: raised as is (the slow path would make
    /// the same call at the same point and raise the same).
    Load(PyErr),
    /// Anything else raised: the slow path meets it again and reports it
    /// in its own words.
    Py(PyErr),
}

impl From<PyErr> for Unpicked {
    fn from(e: PyErr) -> Self {
        Unpicked::Py(e)
    }
}

struct UnpickleBuild<'py> {
    py: Python<'py>,
    ctx: UnpickleCtx<'py>,
    load: Bound<'py, PyAny>,
    /// `(0,)`, torch.empty's shape.
    empty_shape: Bound<'py, PyTuple>,
    /// Tensors made since the GIL was last let go.
    since_release: u32,
}

/// Whether `o` is an int (not a bool).
fn exact_int(o: &Bound<'_, PyAny>) -> bool {
    o.is_exact_instance_of::<PyInt>()
}

/// Whether `o` is a tuple of ints.
fn int_items(o: &Bound<'_, PyAny>) -> bool {
    o.downcast_exact::<PyTuple>()
        .is_ok_and(|t| t.iter().all(|x| exact_int(&x)))
}

/// Whether a tensor at `offset` with `size` and `stride` (ints, tuples of
/// ints) of `dtype` lies within `untyped`'s bytes (true for values the
/// check cannot read: torch's `set_` refuses those itself).
fn fits_storage(
    offset: &Bound<'_, PyAny>,
    size: &Bound<'_, PyAny>,
    stride: &Bound<'_, PyAny>,
    dtype: &Bound<'_, PyAny>,
    untyped: &Bound<'_, PyAny>,
) -> PyResult<bool> {
    let py = offset.py();
    let (Ok(offset), Ok(size), Ok(stride)) = (
        offset.extract::<i64>(),
        size.extract::<Vec<i64>>(),
        stride.extract::<Vec<i64>>(),
    ) else {
        return Ok(true);
    };
    if size.len() != stride.len() || size.contains(&0) {
        return Ok(true);
    }
    let span = size
        .iter()
        .zip(&stride)
        .fold(i128::from(offset) + 1, |acc, (&n, &s)| {
            acc + (i128::from(n) - 1) * i128::from(s)
        });
    let elem: i128 = dtype.getattr(pyo3::intern!(py, "itemsize"))?.extract()?;
    let nbytes: i128 = untyped
        .call_method0(pyo3::intern!(py, "nbytes"))?
        .extract()?;
    Ok(span.saturating_mul(elem) <= nbytes)
}

impl<'py> UnpickleBuild<'py> {
    /// `_rebuild_tensor_v2(storage, offset, size, stride, requires_grad,
    /// backward_hooks[, metadata])` for what torch.save writes for a plain
    /// tensor (a TypedStorage from `persistent_load`, ints, tuples of ints,
    /// a bool, an empty OrderedDict, no metadata or empty metadata): what
    /// it does, less its Python frames; the caller checked that no fake
    /// mode is active (`_restore_device_fake_mode` then does nothing).
    fn tensor(&mut self, args: &Bound<'py, PyTuple>) -> Result<Bound<'py, PyAny>, Unpicked> {
        let py = self.py;
        let n = args.len();
        if n != 6 && n != 7 {
            return Err(Unpicked::Refused);
        }
        let storage = args.get_item(0)?;
        let offset = args.get_item(1)?;
        let size = args.get_item(2)?;
        let stride = args.get_item(3)?;
        let requires_grad = args.get_item(4)?;
        let hooks = args.get_item(5)?;
        if !storage.get_type().is(&self.ctx.3)
            || !exact_int(&offset)
            || !int_items(&size)
            || !int_items(&stride)
            || !requires_grad.is_exact_instance_of::<PyBool>()
            || !hooks.get_type().is(&self.ctx.2)
            || hooks.len()? != 0
        {
            return Err(Unpicked::Refused);
        }
        if n == 7 {
            // Metadata (conj/neg bits, ...) is set by set_tensor_metadata:
            // the slow path's. An empty dict is skipped there.
            let meta = args.get_item(6)?;
            if !meta
                .downcast_exact::<PyDict>()
                .is_ok_and(PyDictMethods::is_empty)
            {
                return Err(Unpicked::Refused);
            }
        }
        // _rebuild_tensor: torch.empty((0,), dtype=storage.dtype,
        // device=storage._untyped_storage.device).set_(...)
        let dtype = storage.getattr(pyo3::intern!(py, "dtype"))?;
        let untyped = storage.getattr(pyo3::intern!(py, "_untyped_storage"))?;
        if !fits_storage(&offset, &size, &stride, &dtype, &untyped)? {
            // `set_` would grow the storage to fit (a read's storages can be
            // resized, torch.load's cannot): refused before it allocates.
            return Err(PyValueError::new_err(format!(
                "a tensor of size {size} at offset {offset} reaches past its storage of {} bytes",
                untyped.call_method0(pyo3::intern!(py, "nbytes"))?
            ))
            .into());
        }
        let device = untyped.getattr(pyo3::intern!(py, "device"))?;
        let kwargs = PyDict::new(py);
        kwargs.set_item(pyo3::intern!(py, "dtype"), dtype)?;
        kwargs.set_item(pyo3::intern!(py, "device"), device)?;
        let t = self.ctx.4.call((&self.empty_shape,), Some(&kwargs))?;
        let t = t.call_method1(pyo3::intern!(py, "set_"), (untyped, offset, size, stride))?;
        // Both set as _rebuild_tensor_v2 sets them, False included: the
        // setters are what a TorchFunctionMode sees, as torch.empty and set_.
        t.setattr(pyo3::intern!(py, "requires_grad"), requires_grad)?;
        t.setattr(pyo3::intern!(py, "_backward_hooks"), hooks)?;
        self.since_release += 1;
        if self.since_release == TENSORS_PER_RELEASE {
            self.since_release = 0;
            // As the slow path's bytecode would, at a switch point: a
            // thread waiting for the GIL takes it here.
            py.allow_threads(|| ());
        }
        Ok(t)
    }
}

impl<'py> crate::unpickle::Builder for UnpickleBuild<'py> {
    type Obj = Bound<'py, PyAny>;
    type Err = Unpicked;

    fn none(&mut self) -> Result<Self::Obj, Unpicked> {
        Ok(self.py.None().into_bound(self.py))
    }

    fn bool(&mut self, v: bool) -> Result<Self::Obj, Unpicked> {
        Ok(PyBool::new(self.py, v).to_owned().into_any())
    }

    fn int(&mut self, v: i64) -> Result<Self::Obj, Unpicked> {
        let Ok(o) = v.into_pyobject(self.py);
        Ok(o.into_any())
    }

    fn long(&mut self, le: &[u8]) -> Result<Self::Obj, Unpicked> {
        let py = self.py;
        if le.len() <= 16 {
            let negative = le.last().is_some_and(|&b| b & 0x80 != 0);
            let mut b = [if negative { 0xff } else { 0 }; 16];
            b[..le.len()].copy_from_slice(le);
            let Ok(o) = i128::from_le_bytes(b).into_pyobject(py);
            return Ok(o.into_any());
        }
        let signed = PyDict::new(py);
        signed.set_item(pyo3::intern!(py, "signed"), true)?;
        Ok(py.get_type::<PyInt>().call_method(
            pyo3::intern!(py, "from_bytes"),
            (PyBytes::new(py, le), pyo3::intern!(py, "little")),
            Some(&signed),
        )?)
    }

    fn float(&mut self, v: f64) -> Result<Self::Obj, Unpicked> {
        Ok(PyFloat::new(self.py, v).into_any())
    }

    fn str(&mut self, utf8: &[u8]) -> Result<Self::Obj, Unpicked> {
        let py = self.py;
        if let Ok(s) = std::str::from_utf8(utf8) {
            return Ok(PyString::new(py, s).into_any());
        }
        // Lone surrogates: both unpicklers decode with "surrogatepass".
        Ok(PyBytes::new(py, utf8).call_method1(
            pyo3::intern!(py, "decode"),
            (
                pyo3::intern!(py, "utf-8"),
                pyo3::intern!(py, "surrogatepass"),
            ),
        )?)
    }

    fn empty_dict(&mut self) -> Result<Self::Obj, Unpicked> {
        Ok(PyDict::new(self.py).into_any())
    }

    fn empty_list(&mut self) -> Result<Self::Obj, Unpicked> {
        Ok(PyList::empty(self.py).into_any())
    }

    fn tuple(&mut self, items: Vec<Self::Obj>) -> Result<Self::Obj, Unpicked> {
        Ok(PyTuple::new(self.py, items)?.into_any())
    }

    fn global(&mut self, module: &[u8], name: &[u8]) -> Result<Self::Obj, Unpicked> {
        self.ctx
            .0
            .iter()
            .find(|(m, n, _)| m == module && n == name)
            .map(|(_, _, o)| o.clone())
            .ok_or(Unpicked::Refused)
    }

    fn reduce(&mut self, func: &Self::Obj, args: &Self::Obj) -> Result<Self::Obj, Unpicked> {
        let args = args
            .downcast_exact::<PyTuple>()
            .map_err(|_| Unpicked::Refused)?;
        if func.is(&self.ctx.1) {
            return self.tensor(args);
        }
        if func.is(&self.ctx.2) && args.is_empty() {
            return Ok(func.call0()?);
        }
        Err(Unpicked::Refused)
    }

    fn persistent(&mut self, pid: &Self::Obj) -> Result<Self::Obj, Unpicked> {
        // torch.save's storage ids only: ("storage", type, key, location,
        // numel); weights_only refuses ids of other kinds in its own words.
        let pid_t = pid
            .downcast_exact::<PyTuple>()
            .map_err(|_| Unpicked::Refused)?;
        if pid_t.len() != 5
            || !pid_t
                .get_item(0)?
                .downcast_exact::<PyString>()
                .is_ok_and(|s| s.to_cow().is_ok_and(|s| s == "storage"))
        {
            return Err(Unpicked::Refused);
        }
        self.load.call1((pid,)).map_err(Unpicked::Load)
    }

    fn set_items(&mut self, target: &Self::Obj, items: &[Self::Obj]) -> Result<(), Unpicked> {
        let pairs = items.chunks_exact(2);
        if let Ok(d) = target.downcast_exact::<PyDict>() {
            for kv in pairs {
                d.set_item(&kv[0], &kv[1])?;
            }
            return Ok(());
        }
        if !target.get_type().is(&self.ctx.2) {
            return Err(Unpicked::Refused);
        }
        for kv in pairs {
            target.set_item(&kv[0], &kv[1])?;
        }
        Ok(())
    }

    fn append_items(&mut self, target: &Self::Obj, items: &[Self::Obj]) -> Result<(), Unpicked> {
        let l = target
            .downcast_exact::<PyList>()
            .map_err(|_| Unpicked::Refused)?;
        for x in items {
            l.append(x)?;
        }
        Ok(())
    }

    fn build(&mut self, inst: &Self::Obj, state: &Self::Obj) -> Result<(), Unpicked> {
        // An OrderedDict's instance attributes (state_dict()'s `_metadata`):
        // both unpicklers set them in its __dict__.
        let state = state
            .downcast_exact::<PyDict>()
            .map_err(|_| Unpicked::Refused)?;
        if !inst.get_type().is(&self.ctx.2)
            || !state
                .keys()
                .iter()
                .all(|k| k.is_exact_instance_of::<PyString>())
        {
            return Err(Unpicked::Refused);
        }
        let d = inst.getattr(pyo3::intern!(self.py, "__dict__"))?;
        d.downcast_exact::<PyDict>()
            .map_err(|_| Unpicked::Refused)?
            .update(state.as_mapping())?;
        Ok(())
    }
}

/// The object of the pickle `data` (`fastpersist.pickling.unpickle`'s
/// result), when it holds only what torch.save writes for plain state
/// dicts (see `crate::unpickle`), its storages from `persistent_load`;
/// None for anything else, and when anything but `persistent_load` raised
/// an Exception, for the slow path to unpickle. `persistent_load`'s own
/// exceptions are raised as they are. `ctx`: see
/// `pickling._fast_unpickle_context`.
#[pyfunction]
fn fast_unpickle<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyAny>,
    ctx: UnpickleCtx<'py>,
    persistent_load: Bound<'py, PyAny>,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    let data = bytes_like(data)?;
    let mut b = UnpickleBuild {
        py,
        ctx,
        load: persistent_load,
        empty_shape: PyTuple::new(py, [0])?,
        since_release: 0,
    };
    match crate::unpickle::run(data.as_bytes(), &mut b) {
        Ok(obj) => Ok(Some(obj)),
        Err(
            crate::unpickle::Stop::Refused(_) | crate::unpickle::Stop::Builder(Unpicked::Refused),
        ) => Ok(None),
        // KeyboardInterrupt and other BaseExceptions are not swallowed.
        Err(crate::unpickle::Stop::Builder(Unpicked::Py(e)))
            if e.is_instance_of::<pyo3::exceptions::PyException>(py) =>
        {
            Ok(None)
        }
        Err(crate::unpickle::Stop::Builder(Unpicked::Load(e) | Unpicked::Py(e))) => Err(e),
    }
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    reset_waiters_at_fork();
    m.add_class::<PyEngine>()?;
    m.add_class::<PySession>()?;
    m.add_class::<PyHostBuffer>()?;
    m.add_class::<PyTempFile>()?;
    m.add("WriteError", m.py().get_type::<WriteError>())?;
    m.add("ReadError", m.py().get_type::<ReadError>())?;
    m.add("DurabilityError", m.py().get_type::<DurabilityError>())?;
    m.add_function(wrap_pyfunction!(partition, m)?)?;
    m.add_function(wrap_pyfunction!(dio_alignment, m)?)?;
    m.add_function(wrap_pyfunction!(copy_kernel, m)?)?;
    m.add_function(wrap_pyfunction!(check_engine_options, m)?)?;
    m.add_function(wrap_pyfunction!(let_engines_in_py, m)?)?;
    m.add_function(wrap_pyfunction!(engines_waiting, m)?)?;
    m.add_function(wrap_pyfunction!(crc32, m)?)?;
    m.add_function(wrap_pyfunction!(zip_local_header, m)?)?;
    m.add_function(wrap_pyfunction!(zip_local_header_len, m)?)?;
    m.add_function(wrap_pyfunction!(zip_descriptor_sizes, m)?)?;
    m.add_function(wrap_pyfunction!(zip_storage_records, m)?)?;
    m.add_function(wrap_pyfunction!(zip_central_directory, m)?)?;
    m.add_function(wrap_pyfunction!(zip_central_entries, m)?)?;
    m.add_function(wrap_pyfunction!(crc32_ranges, m)?)?;
    m.add_function(wrap_pyfunction!(copy_memory, m)?)?;
    m.add_function(wrap_pyfunction!(crc32_combine, m)?)?;
    m.add_function(wrap_pyfunction!(atomic_write, m)?)?;
    m.add_function(wrap_pyfunction!(split_ranges, m)?)?;
    m.add_function(wrap_pyfunction!(temp_file_in_use, m)?)?;
    m.add_function(wrap_pyfunction!(fallocate_zero_fills, m)?)?;
    m.add_function(wrap_pyfunction!(is_temp_name, m)?)?;
    m.add_function(wrap_pyfunction!(temp_name_part, m)?)?;
    m.add_function(wrap_pyfunction!(wait_for_frees, m)?)?;
    m.add_function(wrap_pyfunction!(remove_file, m)?)?;
    m.add_function(wrap_pyfunction!(prepare_memory, m)?)?;
    m.add_function(wrap_pyfunction!(fast_pickle, m)?)?;
    m.add_function(wrap_pyfunction!(survey, m)?)?;
    m.add_function(wrap_pyfunction!(pickle_memo_bound, m)?)?;
    m.add_function(wrap_pyfunction!(json_depth, m)?)?;
    m.add_class::<SurveyRest>()?;
    m.add_function(wrap_pyfunction!(fast_unpickle, m)?)?;
    m.add("TEMP_MARKER", crate::commit::TEMP_MARKER)?;
    m.add("TEMP_NAME_PART_MAX", crate::commit::TEMP_NAME_PART_MAX)?;
    add_stats_types(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
