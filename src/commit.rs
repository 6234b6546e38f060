//! Crash-safe commit: write under a temporary name in the target directory,
//! then fsync, rename onto the final name and fsync the directory.
//!
//! Until the rename, an existing file at the final path is untouched; a
//! [`TempFile`] that is dropped without [`TempFile::commit`] unlinks itself,
//! so a failed save leaves nothing behind. A process killed mid-save leaves a
//! temporary file, which the checkpoint manager sweeps.
//!
//! # The temporary file
//!
//! - **Where**: in the target's directory, which [`TempFile`] opens
//!   (`O_DIRECTORY`) when it is created and holds open: the file is
//!   created (`openat`), renamed (`renameat`), removed (`unlinkat`) and the
//!   directory fsynced through that descriptor, so all of it happens in the
//!   same directory even if the directory is renamed meanwhile.
//! - **Name**: exactly `.<part>.<pid>.<n>.fptmp`, where `<pid>` is the
//!   decimal process id (at most 10 digits), `<n>` a decimal per-process
//!   counter (at most 20 digits; it starts at a value of its own in each
//!   process, from the clock, and a name already taken is passed over: a
//!   process restarted with the PID of one killed mid-save, as in a
//!   container, never meets that one's leftover name) and `<part>` the target's file name when
//!   it is at most [`TEMP_NAME_PART_MAX`] (216) bytes long, else its first
//!   bytes (199 at most, cut at a UTF-8 character boundary when the name is
//!   UTF-8) followed by `~` and 16 lowercase hex digits (the 64-bit FNV-1a
//!   hash of the whole name), 216 bytes or fewer in all. So every name fits
//!   NAME_MAX (255 bytes) and names stay unique. As a Python regular
//!   expression: `\.(?P<part>.+)\.(?P<pid>[0-9]{1,10})\.(?P<n>[0-9]{1,20})\.fptmp`
//!   with `re.fullmatch(..., re.DOTALL)` and `len(part.encode()) <= 216`;
//!   [`is_temp_name`] is that test.
//! - **Liveness**: the creating process holds an exclusive `flock` on the
//!   file until it commits, aborts or dies, which works across PID
//!   namespaces and (on NFS, through the emulated locks) across hosts.
//!   [`temp_file_in_use`] asks; a sweeper removes only files that match the
//!   name and are not in use.
//! - **Mode and owner**: when the target exists, the temporary file gets
//!   its owner, group and mode (all of `0o7777`: setuid, setgid and sticky
//!   bits too) before anything is written, and again before the rename, so
//!   a commit keeps them and never widens a checkpoint's permissions. Where
//!   the owner cannot be given (not root), the group is kept if it can be,
//!   else the group gets no access at all: the file is the writer's then.
//!   Its `user.*` extended attributes and access ACL are given to the new
//!   file too (as a write in place keeps them), where they can be.
//!   A new target is created with 0o666 less the umask, as `open()` does.
//! - **Targets**: a target that exists and is not a regular file (nor a
//!   symlink to one) is refused, nothing touched: directories (EISDIR),
//!   character and block devices, FIFOs and sockets (EOPNOTSUPP). A symlink
//!   is replaced by the new file, not written through; a dangling one too.
//! - **Durability**: the commit truncates to the true length, fsyncs,
//!   renames, then fsyncs the directory. When that last fsync fails the new
//!   file is already at the target: the error is
//!   [`ErrorKind::NotDurable`](crate::ErrorKind::NotDurable), not a plain
//!   write failure.
//! - **The replaced file**: a regular target of 16 MiB or more is held
//!   (an `O_PATH` descriptor) across the rename, so the rename only drops
//!   its name, and the descriptor is closed on a thread of its own: the
//!   file system frees (and discards) the old blocks there, not inside the
//!   save. Nothing is left in the directory; a process that dies first
//!   closes it with its other descriptors. A save that then finds the disk
//!   full waits for those frees and tries once more.

use crate::error::{Error, Result};
use std::ffi::{CStr, CString, OsStr};
use std::fs::{File, OpenOptions, Permissions};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// Every temporary file's name ends with this.
pub const TEMP_MARKER: &str = ".fptmp";

/// The longest name part of a temporary file name (see the module docs):
/// 255 (NAME_MAX) less the dot before it, `.<pid>` (11 bytes at most),
/// `.<n>` (21 at most) and the marker (6).
pub const TEMP_NAME_PART_MAX: usize = 255 - 1 - 11 - 21 - TEMP_MARKER.len();

/// The name part of a temporary file for a target named `name`.
pub fn temp_name_part(name: &[u8]) -> Vec<u8> {
    if name.len() <= TEMP_NAME_PART_MAX {
        return name.to_vec();
    }
    let hash = format!("~{:016x}", fnv1a64(name));
    let mut keep = TEMP_NAME_PART_MAX - hash.len();
    if let Ok(s) = std::str::from_utf8(name) {
        while !s.is_char_boundary(keep) {
            keep -= 1;
        }
    }
    let mut part = name[..keep].to_vec();
    part.extend_from_slice(hash.as_bytes());
    part
}

/// 64-bit FNV-1a: small, stable across versions and platforms.
fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The temporary file name for target name `name`, process `pid`, count `n`.
fn temp_name(name: &[u8], pid: u32, n: u64) -> Vec<u8> {
    let mut t = b".".to_vec();
    t.extend_from_slice(&temp_name_part(name));
    t.extend_from_slice(format!(".{pid}.{n}{TEMP_MARKER}").as_bytes());
    t
}

/// Whether `name` (a file name, not a path) has exactly the form of a
/// temporary file name: `.<part>.<pid>.<n>.fptmp` (see the module docs).
pub fn is_temp_name(name: &OsStr) -> bool {
    let b = name.as_bytes();
    let Some(rest) = b.strip_suffix(TEMP_MARKER.as_bytes()) else {
        return false;
    };
    let Some(rest) = rest.strip_prefix(b".") else {
        return false;
    };
    let mut fields = rest.rsplitn(3, |&c| c == b'.');
    let (Some(n), Some(pid), Some(part)) = (fields.next(), fields.next(), fields.next()) else {
        return false;
    };
    let digits =
        |f: &[u8], max: usize| !f.is_empty() && f.len() <= max && f.iter().all(u8::is_ascii_digit);
    digits(n, 20)
        && digits(pid, 10)
        && !part.is_empty()
        && part.len() <= TEMP_NAME_PART_MAX
        && b.len() <= 255
}

/// Whether some process holds the temporary file at `path` (its exclusive
/// `flock`, taken by [`TempFile::create`], held until commit, abort or the
/// process's death). Tries a non-blocking exclusive lock on a fresh
/// descriptor of its own (read-only; write-only where the file system
/// wants a writable descriptor for it, as NFS does): `true` if that would
/// block. A path that does not exist is not in use.
pub fn temp_file_in_use(path: &Path) -> Result<bool> {
    let open = |write: bool| {
        OpenOptions::new()
            .read(!write)
            .write(write)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
            .open(path)
    };
    let probe = |f: &File| {
        // SAFETY: flock on our own open descriptor; no memory is passed.
        let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc == 0 {
            // Closing `f` releases it.
            return Ok(false);
        }
        match std::io::Error::last_os_error().raw_os_error() {
            Some(libc::EWOULDBLOCK) => Ok(true),
            Some(e) => Err(e),
            None => Err(libc::EIO),
        }
    };
    let in_use = match open(false) {
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(false),
        Err(e) => {
            return Err(Error::from_io(
                &e,
                "cannot open to test its lock",
                Some(path),
            ))
        }
        Ok(f) => probe(&f),
    };
    match in_use {
        Err(libc::EBADF) => match open(true) {
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
            Err(e) => Err(Error::from_io(
                &e,
                "cannot open to test its lock",
                Some(path),
            )),
            Ok(f) => probe(&f).map_err(|e| Error::os(e, "cannot test its lock", Some(path))),
        },
        r => r.map_err(|e| Error::os(e, "cannot test its lock", Some(path))),
    }
}

fn c_name(name: &OsStr, path: &Path) -> Result<CString> {
    CString::new(name.as_bytes())
        .map_err(|_| Error::os(libc::EINVAL, "path contains a NUL byte", Some(path)))
}

/// What is at `name` in the directory `dir`, following symlinks: `None`
/// when nothing (or a dangling symlink) is there.
fn stat_at(dir: &File, name: &CStr) -> std::io::Result<Option<libc::stat>> {
    // SAFETY: `stat` is plain old data; all-zero is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `name` is NUL-terminated and `st` a writable stat buffer that
    // lives across the call; `dir` is our open directory.
    let rc = unsafe { libc::fstatat(dir.as_raw_fd(), name.as_ptr(), &raw mut st, 0) };
    if rc == 0 {
        return Ok(Some(st));
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::ENOENT) {
        return Ok(None);
    }
    Err(e)
}

/// What a replacing file keeps of the file it replaces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Keep {
    /// The mode bits, `0o7777`.
    mode: u32,
    uid: libc::uid_t,
    gid: libc::gid_t,
}

/// The mode bits and owner of an existing regular target, `None` when
/// there is none; an error for anything else there (see the module docs).
fn target_attrs(dir: &File, name: &CStr, target: &Path) -> Result<Option<Keep>> {
    let st = stat_at(dir, name)
        .map_err(|e| Error::from_io(&e, "cannot inspect the target", Some(target)))?;
    let Some(st) = st else {
        return Ok(None);
    };
    let kind = match st.st_mode & libc::S_IFMT {
        libc::S_IFREG => {
            return Ok(Some(Keep {
                mode: st.st_mode & 0o7777,
                uid: st.st_uid,
                gid: st.st_gid,
            }))
        }
        libc::S_IFDIR => {
            return Err(Error::os(
                libc::EISDIR,
                "target is a directory",
                Some(target),
            ))
        }
        libc::S_IFCHR => "a character device",
        libc::S_IFBLK => "a block device",
        libc::S_IFIFO => "a FIFO",
        libc::S_IFSOCK => "a socket",
        _ => "not a regular file",
    };
    Err(Error::os(
        libc::EOPNOTSUPP,
        format!("target is {kind}; only regular files are replaced"),
        Some(target),
    ))
}

static COUNTER: AtomicU64 = AtomicU64::new(0);
static COUNTER_START: OnceLock<u64> = OnceLock::new();

/// The next `<n>` of this process's temporary names: its counter from a
/// start of its own (the clock's nanoseconds, below 10^9).
fn next_temp_number() -> u64 {
    let start = *COUNTER_START.get_or_init(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::from(d.subsec_nanos()))
    });
    start + COUNTER.fetch_add(1, Ordering::Relaxed)
}

/// Open `path` with `opts`, adding O_DIRECT when `direct` and retrying
/// without it when the file system refuses it with EINVAL. Returns the file
/// and whether O_DIRECT is on. (`std` opens with O_CLOEXEC.)
pub fn open_direct(path: &Path, opts: &OpenOptions, direct: bool) -> std::io::Result<(File, bool)> {
    if direct {
        let mut with = opts.clone();
        with.custom_flags(libc::O_DIRECT);
        match with.open(path) {
            Ok(f) => return Ok((f, true)),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
            Err(e) => return Err(e),
        }
    }
    opts.open(path).map(|f| (f, false))
}

/// Split a target path into (directory, file name).
pub fn split_target(path: &Path) -> Result<(PathBuf, PathBuf)> {
    let name = path
        .file_name()
        .ok_or_else(|| Error::os(libc::EISDIR, "target has no file name", Some(path)))?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok((dir, PathBuf::from(name)))
}

pub struct TempFile {
    file: Option<File>,
    /// The target's directory, open since `create`: every name operation
    /// goes through it.
    dir: File,
    /// The temporary file's name in `dir` (`None` once renamed or removed).
    name: Option<CString>,
    /// The target's name in `dir`.
    target_name: CString,
    /// `<directory path>/<name>`, for messages and callers.
    tmp: PathBuf,
    target: PathBuf,
    direct: bool,
    /// Test hook: the directory fsync of the commit fails with this errno.
    dir_fsync_fault: Option<i32>,
    /// The process that created the file. A `fork()` child's copy is not
    /// its to write, commit or remove: the parent goes on writing it.
    pid: u32,
    /// The mode the file is given, when not the replaced file's (see
    /// [`TempFile::create_with_mode`]).
    mode: Option<u32>,
}

/// Attempts at a fresh temporary name when a concurrent sweep removed the
/// one just created before its lock was taken, or the name is taken (a
/// leftover of a process that had this PID).
const CREATE_TRIES: usize = 16;

impl TempFile {
    /// Create `.<name>.<pid>.<n>.fptmp` next to `target` (see the module
    /// docs), locked, with the target's mode when it exists, and with
    /// O_DIRECT when asked and the file system accepts it at open. Returns
    /// the file and, when O_DIRECT was asked for but refused, the reason.
    pub fn create(target: &Path, direct: bool) -> Result<(Self, Option<String>)> {
        Self::create_with_mode(target, direct, None)
    }

    /// [`TempFile::create`], and with `mode` the file gets exactly those
    /// mode bits and keeps the writer's owner, at its creation and at the
    /// commit, whatever the target is: what a writer that makes a new file
    /// and renames it onto the path leaves there (safetensors' own
    /// `save_file`). A target that is no regular file is refused all the
    /// same.
    pub fn create_with_mode(
        target: &Path,
        direct: bool,
        mode: Option<u32>,
    ) -> Result<(Self, Option<String>)> {
        if let Some(m) = mode {
            if m & !0o7777 != 0 {
                return Err(Error::option(format!(
                    "file mode {m:#o} has bits outside 0o7777"
                )));
            }
        }
        let (dir_path, name) = split_target(target)?;
        let dir = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY)
            .open(&dir_path)
            .map_err(|e| {
                let what = if e.raw_os_error() == Some(libc::ENOTDIR) {
                    "target's parent is not a directory"
                } else {
                    "target directory is not usable"
                };
                Error::from_io(&e, what, Some(&dir_path))
            })?;
        let target_name = c_name(name.as_os_str(), target)?;
        let keep = target_attrs(&dir, &target_name, target)?.filter(|_| mode.is_none());
        let mut last_err = None;
        for _ in 0..CREATE_TRIES {
            let n = next_temp_number();
            let tname = temp_name(name.as_os_str().as_bytes(), std::process::id(), n);
            let tmp = dir_path.join(OsStr::from_bytes(&tname));
            let cname = c_name(OsStr::from_bytes(&tname), &tmp)?;
            let initial = if keep.is_some() || mode.is_some() {
                0o600
            } else {
                0o666
            };
            let (fd, is_direct) = match create_at(&dir, &cname, initial, direct) {
                Ok(opened) => opened,
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                    last_err = Some(Error::from_io(
                        &e,
                        "cannot create the temporary file",
                        Some(&tmp),
                    ));
                    continue;
                }
                Err(e) => {
                    return Err(Error::from_io(
                        &e,
                        "cannot create the temporary file",
                        Some(&tmp),
                    ))
                }
            };
            let file = File::from(fd);
            match lock_and_check(&dir, &cname, &file, &tmp) {
                Ok(()) => {}
                Err(e) if e.errno == Some(libc::ESTALE) => {
                    // Removed by a sweep before we held the lock: the name
                    // is gone, try the next one.
                    last_err = Some(e);
                    continue;
                }
                Err(e) => {
                    // SAFETY: a NUL-terminated name relative to our open
                    // directory; it is the file we just created.
                    unsafe { libc::unlinkat(dir.as_raw_fd(), cname.as_ptr(), 0) };
                    return Err(e);
                }
            }
            let t = TempFile {
                file: Some(file),
                dir,
                name: Some(cname),
                target_name,
                tmp,
                target: target.to_path_buf(),
                direct: is_direct,
                dir_fsync_fault: None,
                pid: std::process::id(),
                mode,
            };
            if let Some(keep) = keep {
                // On failure, dropping `t` removes the file.
                let whole = t.keep(keep)?;
                t.keep_xattrs(whole);
            }
            if let Some(m) = mode {
                t.open_file()?
                    .set_permissions(Permissions::from_mode(m))
                    .map_err(|e| Error::from_io(&e, "cannot set the file's mode", Some(&t.tmp)))?;
            }
            let note = (direct && !is_direct)
                .then(|| "the file system refused O_DIRECT at open (EINVAL)".to_string());
            return Ok((t, note));
        }
        Err(last_err.unwrap_or_else(|| Error::os(libc::ESTALE, "no attempt", Some(target))))
    }

    /// Give the file the replaced file's owner, group and mode (see the
    /// module docs), where it does not have them yet. False when its group
    /// could not be given and the group lost its access instead.
    fn keep(&self, want: Keep) -> Result<bool> {
        let file = self.open_file()?;
        let fd = file.as_raw_fd();
        let now = fstat(fd)
            .ok_or_else(|| Error::last_os("cannot stat the temporary file", Some(&self.tmp)))?;
        let mut mode = want.mode;
        let mut whole = true;
        if (now.st_uid, now.st_gid) != (want.uid, want.gid) {
            // SAFETY: fchown on our own open descriptor; no memory is passed.
            if unsafe { libc::fchown(fd, want.uid, want.gid) } != 0 {
                // Not permitted (not root): the file stays the writer's.
                // Keep the group where we may, else give it no access.
                // SAFETY: as above; -1 leaves the owner as it is.
                let group = unsafe { libc::fchown(fd, libc::uid_t::MAX, want.gid) };
                if group != 0 && now.st_gid != want.gid {
                    mode &= !(0o070 | libc::S_ISGID);
                    whole = false;
                }
            }
        } else if now.st_mode & 0o7777 == mode {
            return Ok(true);
        }
        // After the chown, which clears the setuid and setgid bits.
        file.set_permissions(Permissions::from_mode(mode))
            .map_err(|e| Error::from_io(&e, "cannot set the target's mode", Some(&self.tmp)))?;
        Ok(whole)
    }

    /// Give the file the replaced file's user extended attributes
    /// (`user.*`) and, with `acl` (its owner and group could be given), its
    /// access ACL, which a write in place (`torch.save`) keeps: a
    /// teammate's access granted by an ACL is not lost. Read from the file
    /// a symbolic link at the target names, as its mode and owner are.
    /// Where they cannot be read or set (no permission, a file system
    /// without them), the file goes without.
    fn keep_xattrs(&self, acl: bool) {
        let Ok(file) = self.open_file() else {
            return;
        };
        let name = &self.target_name;
        // The target through our open directory (followed if a link, as
        // `target_attrs` follows it).
        let mut src = format!("/proc/self/fd/{}/", self.dir.as_raw_fd()).into_bytes();
        src.extend_from_slice(name.to_bytes());
        let Ok(src) = CString::new(src) else {
            return;
        };
        for attr in list_xattrs(&src) {
            let bytes = attr.to_bytes();
            if !(bytes.starts_with(b"user.") || (acl && bytes == b"system.posix_acl_access")) {
                continue;
            }
            if let Some(value) = get_xattr(&src, &attr) {
                // SAFETY: NUL-terminated name; `value` is a live buffer of
                // its length; our own open descriptor.
                unsafe {
                    libc::fsetxattr(
                        file.as_raw_fd(),
                        attr.as_ptr(),
                        value.as_ptr().cast(),
                        value.len(),
                        0,
                    )
                };
            }
        }
    }

    /// The open temporary file (`None` once committed).
    pub fn file(&self) -> Option<&File> {
        self.file.as_ref()
    }

    pub fn fd(&self) -> RawFd {
        self.file.as_ref().map_or(-1, AsRawFd::as_raw_fd)
    }

    pub fn temp_path(&self) -> &Path {
        &self.tmp
    }

    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// Test hook: the directory fsync of [`TempFile::commit`] fails with
    /// `errno` (after the rename, as a real failure would).
    #[doc(hidden)]
    pub fn set_dir_fsync_fault(&mut self, errno: Option<i32>) {
        self.dir_fsync_fault = errno;
    }
    /// Turn O_DIRECT off on the open file (after a refused probe write).
    pub fn clear_direct(&mut self) -> Result<()> {
        self.open_file()?;
        let fd = self.fd();
        // SAFETY: fcntl on our own open fd; no memory is passed.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: as above.
        if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_DIRECT) } < 0 {
            return Err(Error::last_os("cannot clear O_DIRECT", Some(&self.tmp)));
        }
        self.direct = false;
        Ok(())
    }

    /// Reserve `len` bytes so the write cannot fail half-way for lack of
    /// space, and fails early instead (ENOSPC). File systems without
    /// fallocate are fine. Where fallocate would write every byte itself
    /// (memory-backed and extent-less file systems: see [`zero_fills`]),
    /// the space is only checked (statfs), not reserved: zero-filling the
    /// file first would cost as much as the write.
    pub fn preallocate(&self, len: u64) -> Result<()> {
        self.open_file()?;
        if len == 0 {
            return Ok(());
        }
        let Ok(off_len) = libc::off_t::try_from(len) else {
            return Err(Error::os(
                libc::EFBIG,
                format!("cannot reserve {len} bytes"),
                Some(&self.tmp),
            ));
        };
        let fd = self.fd();
        if let Some(mut avail) = zero_fills(fd) {
            // What the file holds already needs no more room: a save
            // reserves at its start and again, for the whole file, at its
            // end, when most of it is written.
            let need = len.saturating_sub(allocated_bytes(fd));
            if avail < need && wait_for_frees(FREE_WAIT) {
                avail = zero_fills(fd).unwrap_or(avail);
            }
            if avail < need {
                return Err(Error::os(
                    libc::ENOSPC,
                    format!("cannot reserve {len} bytes: {avail} bytes free, {need} more needed"),
                    Some(&self.tmp),
                ));
            }
            return Ok(());
        }
        // SAFETY: fallocate on our own open fd; no memory is passed.
        let mut rc = unsafe { libc::fallocate(fd, 0, 0, off_len) };
        if rc != 0
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOSPC)
            && wait_for_frees(FREE_WAIT)
        {
            // Space of replaced files was still being freed: try again.
            // SAFETY: as above.
            rc = unsafe { libc::fallocate(fd, 0, 0, off_len) };
        }
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EOPNOTSUPP | libc::ENOSYS | libc::EINVAL) => {}
                _ => {
                    return Err(Error::from_io(
                        &e,
                        format!("cannot reserve {len} bytes"),
                        Some(&self.tmp),
                    ))
                }
            }
        }
        Ok(())
    }

    /// Write all of `data` at `offset` (a positional write: the file
    /// offset is not used). With O_DIRECT, the address, offset and length
    /// must meet the file system's alignment, or the write fails (EINVAL).
    pub fn write_all_at(&self, data: &[u8], offset: u64) -> Result<()> {
        let file = self.open_file()?;
        offset
            .checked_add(data.len() as u64)
            .filter(|&end| i64::try_from(end).is_ok())
            .ok_or_else(|| {
                Error::os(
                    libc::EFBIG,
                    format!("write of {} bytes at offset {offset}", data.len()),
                    Some(&self.tmp),
                )
            })?;
        file.write_all_at(data, offset).map_err(|e| {
            Error::from_io(
                &e,
                format!("write of {} bytes at offset {offset}", data.len()),
                Some(&self.tmp),
            )
        })
    }

    fn open_file(&self) -> Result<&File> {
        if std::process::id() != self.pid {
            return Err(Error::forked(
                "this temporary file",
                self.pid,
                Some(&self.tmp),
            ));
        }
        self.file.as_ref().ok_or_else(|| {
            Error::os(
                libc::EBADF,
                "the temporary file is already committed",
                Some(&self.tmp),
            )
        })
    }

    /// The final path.
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// Truncate to `len` (the true length) when given, give the file the
    /// target's mode if the target is (still or now) a regular file, fsync
    /// (if `durable`), rename onto the target and fsync the directory. The
    /// lock is held until the rename is done. A target that has become
    /// something else than a regular file meanwhile is refused. When the
    /// directory fsync fails the error is [`crate::ErrorKind::NotDurable`]:
    /// the new file is at the target.
    pub fn commit(mut self, len: Option<u64>, durable: bool) -> Result<()> {
        let file = self.open_file()?;
        if let Some(len) = len {
            file.set_len(len).map_err(|e| {
                Error::from_io(&e, "cannot truncate to the true length", Some(&self.tmp))
            })?;
        }
        let keep = target_attrs(&self.dir, &self.target_name, &self.target)?;
        if let (Some(keep), None) = (keep, self.mode) {
            // Again: the target may have changed, and a write by another
            // user than root clears the setuid and setgid bits.
            self.keep(keep)?;
        } else if let Some(m) = self
            .mode
            .filter(|m| m & (libc::S_ISUID | libc::S_ISGID) != 0)
        {
            // A write by another user than root cleared them.
            file.set_permissions(Permissions::from_mode(m))
                .map_err(|e| Error::from_io(&e, "cannot set the file's mode", Some(&self.tmp)))?;
        }
        let file = self.open_file()?;
        if durable {
            file.sync_all()
                .map_err(|e| Error::from_io(&e, "fsync failed", Some(&self.tmp)))?;
        }
        let name = self.name.as_deref().ok_or_else(|| {
            Error::os(
                libc::EBADF,
                "the temporary file is already committed",
                Some(&self.tmp),
            )
        })?;
        let dirfd = self.dir.as_raw_fd();
        // Hold the file being replaced, so the rename only drops its name
        // and its blocks are freed when this reference goes, off the
        // caller's path (see `free_later`).
        let replaced = hold_replaced(&self.dir, &self.target_name);
        // SAFETY: both names are NUL-terminated and relative to our open
        // directory; no other memory is passed.
        let rc = unsafe { libc::renameat(dirfd, name.as_ptr(), dirfd, self.target_name.as_ptr()) };
        if rc != 0 {
            return Err(Error::last_os(
                "cannot rename onto the target",
                Some(&self.target),
            ));
        }
        if let Some(fd) = replaced {
            free_later(fd);
        }
        // The rename happened: the temporary name is gone. Closing the file
        // now releases its lock.
        self.name = None;
        drop(self.file.take());
        if durable {
            let res = match self.dir_fsync_fault {
                Some(errno) => Err(std::io::Error::from_raw_os_error(errno)),
                None => self.dir.sync_all(),
            };
            res.map_err(|e| {
                Error::not_durable(e.raw_os_error().unwrap_or(libc::EIO), &self.target)
            })?;
        }
        Ok(())
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if std::process::id() != self.pid {
            // A fork child's copy: the file is the parent's, which is still
            // writing it and holds its lock. Only our descriptor is closed.
            self.name = None;
        }
        if let Some(name) = self.name.take() {
            // Removed while still locked, so no sweeper sees it unlocked.
            // SAFETY: a NUL-terminated name relative to our open directory.
            unsafe { libc::unlinkat(self.dir.as_raw_fd(), name.as_ptr(), 0) };
        }
        drop(self.file.take());
    }
}

/// Take the temporary file's exclusive lock (held until it is closed) and
/// check that `name` in `dir` still is that file: ESTALE when a sweep
/// removed it between its creation and the lock.
fn lock_and_check(dir: &File, name: &CStr, file: &File, tmp: &Path) -> Result<()> {
    // SAFETY: flock on our own open descriptor; no memory is passed.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(Error::last_os("cannot lock the temporary file", Some(tmp)));
    }
    let ours = file
        .metadata()
        .map_err(|e| Error::from_io(&e, "cannot stat the temporary file", Some(tmp)))?;
    let there = stat_at(dir, name).ok().flatten();
    if there.is_some_and(|st| st.st_dev == ours.dev() && st.st_ino == ours.ino()) {
        Ok(())
    } else {
        Err(Error::os(
            libc::ESTALE,
            "the temporary file was removed as soon as it was created",
            Some(tmp),
        ))
    }
}

/// The names of the extended attributes of `path` (followed if a link);
/// none where they cannot be listed.
fn list_xattrs(path: &CStr) -> Vec<CString> {
    // SAFETY: NUL-terminated path; `buf` is writable for its length.
    let names = sized_read(|buf| unsafe {
        libc::listxattr(path.as_ptr(), buf.as_mut_ptr().cast(), buf.len())
    });
    names
        .unwrap_or_default()
        .split(|&b| b == 0)
        .filter(|s| !s.is_empty())
        .filter_map(|s| CString::new(s).ok())
        .collect()
}

/// The value of the extended attribute `name` of `path` (followed if a
/// link), if it can be read.
fn get_xattr(path: &CStr, name: &CStr) -> Option<Vec<u8>> {
    // SAFETY: NUL-terminated path and name; `buf` is writable for its length.
    sized_read(|buf| unsafe {
        libc::getxattr(
            path.as_ptr(),
            name.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    })
}

/// What a call that fills a buffer (returning its length, or -1 with ERANGE
/// when the buffer is too small) gives, in a buffer grown until it fits
/// (at most 1 MiB); None on any other failure.
fn sized_read(mut call: impl FnMut(&mut [u8]) -> isize) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; 1024];
    loop {
        if let Ok(n) = usize::try_from(call(&mut buf)) {
            buf.truncate(n);
            return Some(buf);
        }
        if std::io::Error::last_os_error().raw_os_error() != Some(libc::ERANGE)
            || buf.len() >= 1 << 20
        {
            return None;
        }
        let grow = buf.len() * 4;
        buf.resize(grow, 0);
    }
}

/// Create `name` in `dir` exclusively with `mode` (less the umask), with
/// O_DIRECT when `direct` and the file system accepts it (else without).
///
/// The file is created without O_DIRECT, which is then turned on with
/// `F_SETFL` (the kernel makes the same check as at open): a file system
/// that refuses O_DIRECT at open (ramfs, tmpfs before Linux 6.6) creates the
/// file and only then fails `openat(O_CREAT | O_EXCL | O_DIRECT)` with
/// EINVAL, and a retry would find its own name taken.
fn create_at(
    dir: &File,
    name: &CStr,
    mode: libc::c_uint,
    direct: bool,
) -> std::io::Result<(OwnedFd, bool)> {
    let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC;
    // SAFETY: `name` is NUL-terminated and relative to our open directory;
    // openat has no other memory preconditions.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags, mode) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by openat and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    Ok(if direct && set_direct(fd.as_raw_fd()) {
        (fd, true)
    } else {
        (fd, false)
    })
}

/// Turn O_DIRECT on for the open file `fd`; false when the file system
/// refuses it (the file stays open as it was).
fn set_direct(fd: RawFd) -> bool {
    // SAFETY: fcntl on a descriptor we own; F_GETFL/F_SETFL take no pointers.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags | libc::O_DIRECT) == 0
    }
}

/// Write `data` to `path` atomically: a [`TempFile`] next to it, written,
/// then committed (fsync, rename, directory fsync when `durable`). Readers
/// of `path` see the old file or the new one, never a mix.
pub fn atomic_write(path: &Path, data: &[u8], durable: bool) -> Result<()> {
    let (tmp, _) = TempFile::create(path, false)?;
    tmp.write_all_at(data, 0)?;
    tmp.commit(Some(data.len() as u64), durable)
}

/// A file someone else created, opened for writing parts of it.
pub struct ExistingFile {
    file: File,
    path: PathBuf,
    /// Opened with O_DIRECT.
    pub direct: bool,
}

impl ExistingFile {
    pub fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    pub fn sync(&self) -> Result<()> {
        self.file
            .sync_all()
            .map_err(|e| Error::from_io(&e, "fsync failed", Some(&self.path)))
    }
}

/// Open an existing file for writing (with O_DIRECT when asked and
/// accepted), neither creating nor truncating it.
pub fn open_existing(path: &Path, direct: bool) -> Result<ExistingFile> {
    let (file, direct) =
        open_direct(path, OpenOptions::new().write(true), direct).map_err(|e| {
            Error::from_io(&e, "cannot open the file to write a part of it", Some(path))
        })?;
    Ok(ExistingFile {
        file,
        path: path.to_path_buf(),
        direct,
    })
}

/// fsync a directory so a rename in it is durable.
pub fn fsync_dir(dir: &Path) -> Result<()> {
    let d = File::open(dir)
        .map_err(|e| Error::from_io(&e, "cannot open the directory to fsync it", Some(dir)))?;
    d.sync_all()
        .map_err(|e| Error::from_io(&e, "directory fsync failed", Some(dir)))
}

/// Files smaller than this are freed in place (a thread would cost more).
const FREE_LATER_MIN: i64 = 16 << 20;

/// How long a save that finds the disk full waits for replaced files that
/// are still being freed.
const FREE_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// Replaced files whose blocks are being freed: (count, its condition).
static FREEING: (std::sync::Mutex<usize>, std::sync::Condvar) =
    (std::sync::Mutex::new(0), std::sync::Condvar::new());

/// A reference to the regular file at `name` in `dir` (none for anything
/// else, a missing or a small file). While it is held, a rename onto
/// `name` only unlinks the old name: the file system frees the old file's
/// blocks (and discards them, with online discard: 0.3 s for 2 GiB) when
/// the last reference goes. An `O_PATH` descriptor needs no permission on
/// the file and cannot read or write it.
fn hold_replaced(dir: &File, name: &CStr) -> Option<OwnedFd> {
    // SAFETY: a NUL-terminated name relative to our open directory.
    let fd = unsafe {
        libc::openat(
            dir.as_raw_fd(),
            name.as_ptr(),
            libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` was just opened and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let big = fstat(fd.as_raw_fd()).is_some_and(|st| {
        st.st_mode & libc::S_IFMT == libc::S_IFREG
            && st.st_nlink == 1
            && st.st_size >= FREE_LATER_MIN
    });
    big.then_some(fd)
}

/// `fstat` of an open descriptor; None where it fails.
fn fstat(fd: RawFd) -> Option<libc::stat> {
    // SAFETY: `stat` is plain old data; all-zero is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat on a descriptor the caller holds open, into a stat
    // buffer that lives across the call.
    (unsafe { libc::fstat(fd, &raw mut st) } == 0).then_some(st)
}

/// Drop `fd` (the last reference to a replaced file) on a thread of its
/// own, so freeing the file's blocks does not delay the save. A process
/// that dies first closes it anyway; the kernel frees the file then
/// (an unlinked, still-open file is on the file system's orphan list,
/// which a crash leaves for the next mount to clean). Nothing is left in
/// the directory either way.
fn free_later(fd: OwnedFd) {
    let (count, _) = &FREEING;
    *count
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) += 1;
    let spawned = std::thread::Builder::new()
        .name("fastpersist-free".into())
        .spawn(move || {
            drop(fd);
            freed();
        });
    if spawned.is_err() {
        // No thread: the descriptor was dropped with the closure; free now.
        freed();
    }
}

/// Remove the file at `path` (as `unlink` does: a missing one is an
/// error of kind `NotFound`); when it is a big regular file with no other
/// link, its blocks are freed on a background thread, off the caller's
/// path (see [`free_later`]): the name is gone when this returns, the
/// space a moment later ([`wait_for_frees`] waits for it).
pub fn remove_file(path: &Path) -> std::io::Result<()> {
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
    };
    let parent = if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    };
    let dir = File::open(parent)?;
    let name = CString::new(name.as_bytes())
        .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    let held = hold_replaced(&dir, &name);
    // SAFETY: a NUL-terminated name relative to our open directory.
    if unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), 0) } != 0 {
        return Err(std::io::Error::last_os_error()); // `held` (if any) is dropped: nothing freed
    }
    if let Some(fd) = held {
        free_later(fd);
    }
    Ok(())
}

fn freed() {
    let (count, done) = &FREEING;
    let mut n = count
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    *n = n.saturating_sub(1);
    done.notify_all();
}

/// Wait (at most `timeout`) until every replaced file handed to a
/// background thread is freed. Returns whether any was pending (so a
/// caller that ran out of space knows a retry may now succeed).
pub fn wait_for_frees(timeout: std::time::Duration) -> bool {
    let (count, done) = &FREEING;
    let n = count
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if *n == 0 {
        return false;
    }
    let _ = done.wait_timeout_while(n, timeout, |n| *n > 0);
    true
}

/// File systems on which `fallocate` writes the reserved bytes itself
/// instead of recording unwritten extents: tmpfs and hugetlbfs (it
/// allocates and zeroes every page), and FAT/exFAT (no unwritten extents,
/// clusters are zeroed). statfs magic numbers from `linux/magic.h`.
const ZERO_FILLING_FS: [i64; 4] = [0x0102_1994, 0x9584_58f6, 0x4d44, 0x2011_bab0];

/// Bytes of storage the open file `fd` holds (its allocated blocks).
fn allocated_bytes(fd: RawFd) -> u64 {
    fstat(fd).map_or(0, |st| {
        u64::try_from(st.st_blocks).unwrap_or(0).saturating_mul(512)
    })
}

/// For a file on a file system where fallocate zero-fills (see
/// [`ZERO_FILLING_FS`]): the bytes free to unprivileged users (`u64::MAX`
/// when unknown). `None` elsewhere: fallocate is cheap there and used.
pub(crate) fn zero_fills(fd: RawFd) -> Option<u64> {
    let mut st = std::mem::MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: fstatfs fills the struct we pass (sized for it) on success.
    if unsafe { libc::fstatfs(fd, st.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: fstatfs succeeded, so the struct is initialised.
    let st = unsafe { st.assume_init() };
    // f_type's and f_bavail's types vary by target.
    #[allow(clippy::useless_conversion, clippy::unnecessary_cast)]
    let kind = st.f_type as i64;
    if !ZERO_FILLING_FS.contains(&kind) {
        return None;
    }
    #[allow(clippy::useless_conversion)]
    let blocks = u64::try_from(st.f_bavail).unwrap_or(u64::MAX);
    let bsize = u64::try_from(st.f_bsize).unwrap_or(0);
    Some(blocks.saturating_mul(bsize))
}

/// Whether `fallocate` on the file system of `path` (a directory or a
/// file) writes every reserved byte itself ([`ZERO_FILLING_FS`]): there a
/// new file's space is allocated as it is written, which is work every
/// writer of a new file pays (benchmarks time their limit that way).
pub fn fallocate_zero_fills(path: &Path) -> std::io::Result<bool> {
    let f = std::fs::File::open(path)?;
    Ok(zero_fills(f.as_raw_fd()).is_some())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(d: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn dropped_temp_leaves_nothing_and_keeps_old_file() {
        let d = tempfile::tempdir().unwrap();
        let target = d.path().join("ckpt.pt");
        std::fs::write(&target, b"old").unwrap();
        {
            let (t, _) = TempFile::create(&target, false).unwrap();
            assert!(t.temp_path().exists());
        }
        assert_eq!(names(d.path()), vec!["ckpt.pt"]);
        assert_eq!(std::fs::read(&target).unwrap(), b"old");
    }

    #[test]
    fn commit_replaces_target() {
        use std::os::unix::fs::FileExt;
        let d = tempfile::tempdir().unwrap();
        let target = d.path().join("ckpt.pt");
        std::fs::write(&target, b"old old old").unwrap();
        let (t, _) = TempFile::create(&target, false).unwrap();
        t.file().unwrap().write_all_at(b"new", 0).unwrap();
        t.commit(Some(3), true).unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"new");
        assert_eq!(names(d.path()), vec!["ckpt.pt"]);
    }

    fn blocks(t: &TempFile) -> u64 {
        use std::os::unix::fs::MetadataExt;
        t.file().unwrap().metadata().unwrap().blocks()
    }

    #[test]
    fn preallocate_reserves_on_disk_but_only_checks_on_tmpfs() {
        // A disk-backed directory (the test's working directory): fallocate
        // records the extent (blocks counted, nothing written).
        let d = tempfile::tempdir_in(".").unwrap();
        let (t, _) = TempFile::create(&d.path().join("a.pt"), false).unwrap();
        let disk_zero_fills = zero_fills(t.fd()).is_some();
        t.preallocate(8 << 20).unwrap();
        if !disk_zero_fills {
            assert!(blocks(&t) >= (8 << 20) / 512, "fallocate reserved nothing");
        }
        // tmpfs: fallocate would allocate and zero every page; it is skipped
        // (no pages used), and a size beyond the free space fails at once.
        let Ok(shm) = tempfile::tempdir_in("/dev/shm") else {
            return;
        };
        let (t, _) = TempFile::create(&shm.path().join("b.pt"), false).unwrap();
        let Some(avail) = zero_fills(t.fd()) else {
            return; // /dev/shm is not tmpfs here
        };
        t.preallocate(64 << 20).unwrap();
        assert_eq!(blocks(&t), 0, "tmpfs pages were allocated");
        let e = t.preallocate(u64::MAX / 4).unwrap_err();
        assert_eq!(e.errno, Some(libc::ENOSPC), "{e} (free: {avail:?})");
    }

    #[test]
    fn removed_file_is_freed_off_the_call() {
        let d = tempfile::tempdir_in(".").unwrap();
        let big = d.path().join("big.bin");
        std::fs::write(&big, vec![3u8; 32 << 20]).unwrap();
        std::fs::write(d.path().join("small.bin"), b"tiny").unwrap();
        remove_file(&big).unwrap();
        remove_file(&d.path().join("small.bin")).unwrap();
        assert!(names(d.path()).is_empty(), "both names are gone at once");
        let e = remove_file(&big).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::NotFound);
        let sub = d.path().join("sub");
        std::fs::create_dir(&sub).unwrap();
        assert!(remove_file(&sub).is_err(), "a directory is not removed");
        assert!(sub.is_dir());
        // A second link: the file stays (under its other name), nothing held.
        std::fs::write(&big, vec![4u8; 32 << 20]).unwrap();
        std::fs::hard_link(&big, d.path().join("other")).unwrap();
        remove_file(&big).unwrap();
        assert_eq!(
            std::fs::read(d.path().join("other")).unwrap().len(),
            32 << 20
        );
        wait_for_frees(std::time::Duration::from_secs(30));
        let held = std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.unwrap().path()).ok())
            .any(|l| l.to_string_lossy().contains("big.bin (deleted)"));
        assert!(!held, "the background thread let the removed file go");
    }

    #[test]
    fn replaced_file_is_freed_off_the_commit() {
        use std::os::unix::fs::FileExt;
        let d = tempfile::tempdir_in(".").unwrap();
        let target = d.path().join("big.pt");
        std::fs::write(&target, vec![7u8; 32 << 20]).unwrap();
        let small = d.path().join("small.pt");
        std::fs::write(&small, b"tiny").unwrap();
        let dir = File::open(d.path()).unwrap();
        let name = CString::new("big.pt").unwrap();
        // Small files, missing files and directories are not held.
        assert!(hold_replaced(&dir, &CString::new("small.pt").unwrap()).is_none());
        assert!(hold_replaced(&dir, &CString::new("none.pt").unwrap()).is_none());
        // Held: the rename only unlinks the name; the old file keeps its
        // blocks until the reference goes.
        let held = hold_replaced(&dir, &name).expect("a big regular file is held");
        let (t, _) = TempFile::create(&target, false).unwrap();
        t.file().unwrap().write_all_at(b"new", 0).unwrap();
        std::fs::rename(t.temp_path(), &target).unwrap();
        let st = File::from(held.try_clone().unwrap()).metadata().unwrap();
        assert_eq!(st.nlink(), 0);
        assert!(st.blocks() >= (32 << 20) / 512, "freed inside the rename");
        drop(held);
        drop(t);
        // Through commit: the content is in place at once, and the old file
        // is gone (nothing left in the directory) once the frees are done.
        std::fs::write(&target, vec![1u8; 32 << 20]).unwrap();
        let (t, _) = TempFile::create(&target, false).unwrap();
        t.file().unwrap().write_all_at(b"newer", 0).unwrap();
        t.commit(Some(5), true).unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"newer");
        wait_for_frees(std::time::Duration::from_secs(30));
        assert_eq!(names(d.path()), vec!["big.pt", "small.pt"]);
        let deleted = std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.unwrap().path()).ok())
            .any(|l| l.to_string_lossy().contains("big.pt (deleted)"));
        assert!(!deleted, "the replaced file is still held");
    }

    #[test]
    fn missing_dir_and_directory_target() {
        let d = tempfile::tempdir().unwrap();
        let e = TempFile::create(&d.path().join("nope/ckpt.pt"), false)
            .err()
            .unwrap();
        assert_eq!(e.errno, Some(libc::ENOENT));
        let e = TempFile::create(d.path(), false).err().unwrap();
        assert_eq!(e.errno, Some(libc::EISDIR));
    }

    #[test]
    fn write_commit_without_truncate_and_atomic_write() {
        let d = tempfile::tempdir().unwrap();
        let target = d.path().join("index.json");
        let (t, _) = TempFile::create(&target, false).unwrap();
        assert_eq!(t.target(), target);
        t.write_all_at(b"0123456789", 0).unwrap();
        t.write_all_at(b"ab", 4).unwrap();
        t.commit(None, true).unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"0123ab6789");
        atomic_write(&target, b"{}", true).unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"{}");
        atomic_write(&target, b"", false).unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"");
        assert_eq!(names(d.path()), vec!["index.json"]);
        let (t, _) = TempFile::create(&target, false).unwrap();
        let e = t.write_all_at(b"x", u64::MAX).unwrap_err();
        assert_eq!(e.errno, Some(libc::EFBIG));
    }

    fn mode_of(p: &Path) -> u32 {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
    }

    /// The process umask, read without changing it (other test threads
    /// create files meanwhile).
    fn umask() -> u32 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("Umask:")).unwrap();
        u32::from_str_radix(line["Umask:".len()..].trim(), 8).unwrap()
    }

    #[test]
    fn temp_file_follows_its_directory_when_it_is_renamed() {
        let d = tempfile::tempdir().unwrap();
        let sub = d.path().join("run");
        std::fs::create_dir(&sub).unwrap();
        let moved = d.path().join("moved");
        // Dropped after the directory moved: no temporary file left in it.
        let (t, _) = TempFile::create(&sub.join("a.pt"), false).unwrap();
        std::fs::rename(&sub, &moved).unwrap();
        drop(t);
        assert!(names(&moved).is_empty(), "{:?}", names(&moved));
        // Committed after the directory moved: the file lands next to where
        // the temporary file was, in the moved directory.
        let (t, _) = TempFile::create(&moved.join("b.pt"), false).unwrap();
        std::fs::rename(&moved, &sub).unwrap();
        t.write_all_at(b"bee", 0).unwrap();
        t.commit(Some(3), true).unwrap();
        assert_eq!(names(&sub), vec!["b.pt"]);
        assert_eq!(std::fs::read(sub.join("b.pt")).unwrap(), b"bee");
    }

    #[test]
    fn long_target_names_get_short_unique_temp_names() {
        use std::os::unix::ffi::OsStrExt;
        let d = tempfile::tempdir().unwrap();
        for len in [200, 216, 217, 250, 255] {
            let name = "n".repeat(len - 3) + ".pt";
            let target = d.path().join(&name);
            let (a, _) = TempFile::create(&target, false).unwrap();
            // Same 240 first bytes, other end: another temporary name.
            let other = d.path().join("n".repeat(len - 4) + "x.pt");
            let (b, _) = TempFile::create(&other, false).unwrap();
            for t in [&a, &b] {
                let tn = t.temp_path().file_name().unwrap();
                assert!(tn.len() <= 255, "{len}: {} bytes", tn.len());
                assert!(tn.as_bytes().ends_with(TEMP_MARKER.as_bytes()));
            }
            let (an, bn) = (
                a.temp_path().file_name().unwrap(),
                b.temp_path().file_name().unwrap(),
            );
            let part = |n: &std::ffi::OsStr| {
                let s = n.to_str().unwrap();
                s[1..s.len() - TEMP_MARKER.len()]
                    .rsplitn(3, '.')
                    .nth(2)
                    .unwrap()
                    .to_string()
            };
            assert_ne!(part(an), part(bn), "{len}");
            if len <= 216 {
                assert_eq!(part(an), name);
            } else {
                assert_eq!(part(an).len(), 216);
                assert!(name.starts_with(&part(an)[..199]));
            }
            a.write_all_at(b"long", 0).unwrap();
            a.commit(None, true).unwrap();
            assert_eq!(std::fs::read(&target).unwrap(), b"long");
            drop(b);
        }
        assert_eq!(names(d.path()).len(), 5);
    }

    #[test]
    fn commit_keeps_the_target_mode_and_new_files_follow_the_umask() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        for mode in [0o600, 0o640, 0o604, 0o755] {
            let target = d.path().join(format!("m{mode:o}"));
            std::fs::write(&target, b"old").unwrap();
            std::fs::set_permissions(&target, std::fs::Permissions::from_mode(mode)).unwrap();
            let (t, _) = TempFile::create(&target, false).unwrap();
            // Never wider than the target while it is being written either.
            assert_eq!(mode_of(t.temp_path()), mode);
            t.commit(Some(0), true).unwrap();
            assert_eq!(mode_of(&target), mode, "{mode:o}");
        }
        let fresh = d.path().join("fresh");
        atomic_write(&fresh, b"x", true).unwrap();
        assert_eq!(mode_of(&fresh), 0o666 & !umask());
    }

    #[test]
    fn a_given_mode_is_the_files_whatever_the_target_and_umask() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let d = tempfile::tempdir().unwrap();
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        for (old, mode) in [
            (None, 0o600),
            (Some(0o644), 0o600),
            (Some(0o600), 0o640),
            (Some(0o4755), 0o2700),
        ] {
            let target = d.path().join(format!("g{mode:o}-{old:?}"));
            if let Some(old) = old {
                std::fs::write(&target, b"old").unwrap();
                if me == 0 {
                    std::os::unix::fs::chown(&target, Some(1234), Some(4321)).unwrap();
                }
                std::fs::set_permissions(&target, std::fs::Permissions::from_mode(old)).unwrap();
            }
            let (t, _) = TempFile::create_with_mode(&target, false, Some(mode)).unwrap();
            assert_eq!(mode_of(t.temp_path()), mode, "{mode:o} {old:?}");
            t.write_all_at(b"new", 0).unwrap();
            t.commit(Some(3), true).unwrap();
            let m = std::fs::metadata(&target).unwrap();
            assert_eq!((m.uid(), m.mode() & 0o7777), (me, mode), "{mode:o} {old:?}");
            assert_eq!(std::fs::read(&target).unwrap(), b"new");
        }
        let e = TempFile::create_with_mode(&d.path().join("x"), false, Some(0o10000))
            .err()
            .unwrap();
        assert!(e.to_string().contains("outside 0o7777"), "{e}");
        assert!(!d.path().join("x").exists());
    }

    #[test]
    fn commit_keeps_the_target_owner_group_and_special_mode_bits() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let d = tempfile::tempdir().unwrap();
        // SAFETY: geteuid and getegid have no preconditions.
        let (me, my_group) = unsafe { (libc::geteuid(), libc::getegid()) };
        // As root, another owner and group; else the writer's own.
        let (uid, gid) = if me == 0 {
            (1234, 4321)
        } else {
            (me, my_group)
        };
        for mode in [0o6750, 0o1640, 0o4700, 0o644] {
            let target = d.path().join(format!("m{mode:o}"));
            std::fs::write(&target, b"old").unwrap();
            std::os::unix::fs::chown(&target, Some(uid), Some(gid)).unwrap();
            // After the chown, which clears setuid and setgid.
            std::fs::set_permissions(&target, std::fs::Permissions::from_mode(mode)).unwrap();
            let (t, _) = TempFile::create(&target, false).unwrap();
            let m = std::fs::metadata(t.temp_path()).unwrap();
            assert_eq!(
                (m.uid(), m.gid(), m.mode() & 0o7777),
                (uid, gid, mode),
                "{mode:o}"
            );
            t.write_all_at(b"new", 0).unwrap();
            t.commit(Some(3), true).unwrap();
            let m = std::fs::metadata(&target).unwrap();
            assert_eq!(
                (m.uid(), m.gid(), m.mode() & 0o7777),
                (uid, gid, mode),
                "{mode:o}"
            );
            assert_eq!(std::fs::read(&target).unwrap(), b"new");
        }
    }

    #[test]
    fn special_targets_are_refused_and_left_alone() {
        use std::os::unix::ffi::OsStrExt;
        let d = tempfile::tempdir().unwrap();
        let fifo = d.path().join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
        let sock = d.path().join("sock");
        let _listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let null = d.path().join("null");
        std::os::unix::fs::symlink("/dev/null", &null).unwrap();
        let sub = d.path().join("dir");
        std::fs::create_dir(&sub).unwrap();
        let before = names(d.path());
        for target in [&fifo, &sock, &null, &sub] {
            let e = TempFile::create(target, false).err().expect("refused");
            assert!(e.errno.is_some(), "{e}");
            assert_eq!(names(d.path()), before, "{e}");
        }
        // A symlink to a regular file is fine (the link is replaced).
        let real = d.path().join("real");
        std::fs::write(&real, b"r").unwrap();
        let link = d.path().join("link");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        atomic_write(&link, b"new", true).unwrap();
        assert_eq!(std::fs::read(&link).unwrap(), b"new");
        assert_eq!(std::fs::read(&real).unwrap(), b"r");
    }

    #[test]
    fn temp_files_are_locked_while_alive() {
        let d = tempfile::tempdir().unwrap();
        let target = d.path().join("ckpt.pt");
        std::fs::write(&target, b"old").unwrap();
        assert!(!temp_file_in_use(&target).unwrap());
        assert!(!temp_file_in_use(&d.path().join("missing")).unwrap());
        let (t, _) = TempFile::create(&target, true).unwrap();
        let tmp = t.temp_path().to_path_buf();
        assert!(temp_file_in_use(&tmp).unwrap());
        // Probing does not take the lock away from its holder.
        assert!(temp_file_in_use(&tmp).unwrap());
        t.commit(Some(0), true).unwrap();
        assert!(!temp_file_in_use(&target).unwrap());
        assert!(!temp_file_in_use(&tmp).unwrap());
        let (t, _) = TempFile::create(&target, false).unwrap();
        let tmp = t.temp_path().to_path_buf();
        assert!(temp_file_in_use(&tmp).unwrap());
        drop(t);
        assert!(!temp_file_in_use(&tmp).unwrap());
        // A temporary file left by a dead process: same name, no lock.
        let stale = d.path().join(".ckpt.pt.4000000.7.fptmp");
        std::fs::write(&stale, b"partial").unwrap();
        assert!(is_temp_name(stale.file_name().unwrap()));
        assert!(!temp_file_in_use(&stale).unwrap());
    }

    #[test]
    fn a_temporary_name_already_taken_is_passed_over() {
        // Regression: a process restarted with the PID of one killed
        // mid-save (a container's) met that one's leftover name and failed
        // its save with EEXIST.
        let d = tempfile::tempdir().unwrap();
        let target = d.path().join("model.pt");
        let next = next_temp_number() + 1;
        let mut taken = Vec::new();
        for n in next..next + 3 {
            let name = temp_name(b"model.pt", std::process::id(), n);
            let p = d.path().join(OsStr::from_bytes(&name));
            std::fs::write(&p, b"a killed process's").unwrap();
            taken.push(p);
        }
        let (t, _) = TempFile::create(&target, false).unwrap();
        assert!(!taken.contains(&t.temp_path().to_path_buf()));
        t.write_all_at(b"new", 0).unwrap();
        t.commit(Some(3), false).unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"new");
        for p in taken {
            assert_eq!(std::fs::read(p).unwrap(), b"a killed process's");
        }
    }

    #[test]
    fn temp_name_pattern_is_exact() {
        let d = tempfile::tempdir().unwrap();
        for name in [
            "a",
            "ckpt-100.pt",
            "x.y.z",
            &"é".repeat(120),
            &"n".repeat(255),
        ] {
            let (t, _) = TempFile::create(&d.path().join(name), false).unwrap();
            assert!(is_temp_name(t.temp_path().file_name().unwrap()), "{name}");
        }
        for bad in [
            "ckpt.pt",
            ".ckpt.pt.fptmp",
            ".ckpt.pt.12.fptmp",
            "ckpt.pt.12.3.fptmp",
            "..12.3.fptmp",
            ".ckpt.pt.12.3.fptmp.x",
            ".ckpt.pt.1a.3.fptmp",
            ".ckpt.pt.12.-3.fptmp",
            ".ckpt.pt.12345678901.3.fptmp",
            ".ckpt.pt.12.123456789012345678901.fptmp",
            ".ckpt.pt.12.3.FPTMP",
        ] {
            assert!(!is_temp_name(OsStr::new(bad)), "{bad}");
        }
        let long = format!(".{}.1.2.fptmp", "n".repeat(TEMP_NAME_PART_MAX + 1));
        assert!(!is_temp_name(OsStr::new(&long)));
        let (a, b) = ("é".repeat(120), "é".repeat(121));
        assert_eq!(temp_name_part(a.as_bytes()).len(), 215); // cut at a char boundary
        let pa = String::from_utf8(temp_name_part(a.as_bytes())).unwrap();
        let pb = String::from_utf8(temp_name_part(b.as_bytes())).unwrap();
        assert_ne!(pa, pb);
        assert!(pa.starts_with(&"é".repeat(99)) && pa.contains('~'));
    }

    #[test]
    fn directory_fsync_failure_after_the_rename_is_not_durable() {
        let d = tempfile::tempdir().unwrap();
        let target = d.path().join("ckpt.pt");
        std::fs::write(&target, b"old").unwrap();
        let (mut t, _) = TempFile::create(&target, false).unwrap();
        t.set_dir_fsync_fault(Some(libc::EIO));
        t.write_all_at(b"new", 0).unwrap();
        let e = t.commit(Some(3), true).unwrap_err();
        assert_eq!(e.kind, crate::ErrorKind::NotDurable, "{e}");
        assert_eq!(e.errno, Some(libc::EIO));
        assert_eq!(e.path.as_deref(), Some(target.as_path()));
        assert!(e.to_string().contains("IS in place at the target"), "{e}");
        // The new file is in place; no temporary file is left.
        assert_eq!(std::fs::read(&target).unwrap(), b"new");
        assert_eq!(names(d.path()), vec!["ckpt.pt"]);
        // Failures before the rename stay plain OS errors.
        let (t, _) = TempFile::create(&target, false).unwrap();
        std::fs::remove_file(&target).unwrap();
        std::fs::create_dir(&target).unwrap();
        let e = t.commit(None, true).unwrap_err();
        assert_eq!(e.kind, crate::ErrorKind::Os);
        assert_eq!(e.errno, Some(libc::EISDIR));
        assert_eq!(names(d.path()), vec!["ckpt.pt"]);
    }
}
