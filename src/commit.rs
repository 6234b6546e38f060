//! Crash-safe commit: write under a temporary name in the target directory,
//! then fsync, rename onto the final name and fsync the directory.
//!
//! Until the rename, an existing file at the final path is untouched; a
//! [`TempFile`] that is dropped without [`TempFile::commit`] unlinks itself,
//! so a failed save leaves nothing behind. A process killed mid-save leaves a
//! file matching [`TEMP_MARKER`], which the checkpoint manager sweeps.

use crate::error::{Error, Result};
use std::ffi::{CStr, CString};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Every temporary file's name contains this.
pub const TEMP_MARKER: &str = ".fptmp";

static COUNTER: AtomicU64 = AtomicU64::new(0);

fn cstr(p: &Path) -> Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| Error::os(libc::EINVAL, "path contains a NUL byte", Some(p)))
}

/// Open `c` with `flags` (and `mode` when creating), adding O_DIRECT when
/// `direct` and retrying without it when the file system refuses it with
/// EINVAL. Returns the fd and whether O_DIRECT is on, or the errno.
pub fn open_direct(
    c: &CStr,
    flags: i32,
    mode: libc::c_uint,
    direct: bool,
) -> std::result::Result<(OwnedFd, bool), i32> {
    let open = |flags: i32| {
        // SAFETY: `c` is a valid NUL-terminated path; open has no other
        // memory preconditions.
        unsafe { libc::open(c.as_ptr(), flags, mode) }
    };
    let errno = || {
        std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO)
    };
    let mut is_direct = direct;
    let mut fd = if direct {
        open(flags | libc::O_DIRECT)
    } else {
        open(flags)
    };
    if fd < 0 && direct && errno() == libc::EINVAL {
        is_direct = false;
        fd = open(flags);
    }
    if fd < 0 {
        return Err(errno());
    }
    // SAFETY: fd was just returned by open and is owned by nobody else.
    Ok((unsafe { OwnedFd::from_raw_fd(fd) }, is_direct))
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
    fd: Option<OwnedFd>,
    dir: PathBuf,
    tmp: PathBuf,
    target: PathBuf,
    direct: bool,
}

impl TempFile {
    /// Create `.<name>.<pid>.<n>.fptmp` next to `target`, with O_DIRECT when
    /// asked and the file system accepts it at open. Returns the file and,
    /// when O_DIRECT was asked for but refused, the reason.
    pub fn create(target: &Path, direct: bool) -> Result<(Self, Option<String>)> {
        let (dir, name) = split_target(target)?;
        let meta = std::fs::metadata(&dir)
            .map_err(|e| Error::from_io(&e, "target directory is not usable", Some(&dir)))?;
        if !meta.is_dir() {
            return Err(Error::os(
                libc::ENOTDIR,
                "target's parent is not a directory",
                Some(&dir),
            ));
        }
        if std::fs::metadata(target).is_ok_and(|m| m.is_dir()) {
            return Err(Error::os(
                libc::EISDIR,
                "target is a directory",
                Some(target),
            ));
        }
        let tmp = dir.join(format!(
            ".{}.{}.{}{}",
            name.display(),
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed),
            TEMP_MARKER
        ));
        let c = cstr(&tmp)?;
        let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC;
        let (fd, is_direct) = open_direct(&c, flags, 0o644, direct)
            .map_err(|errno| Error::os(errno, "cannot create the temporary file", Some(&tmp)))?;
        let note = (direct && !is_direct)
            .then(|| "the file system refused O_DIRECT at open (EINVAL)".to_string());
        Ok((
            TempFile {
                fd: Some(fd),
                dir,
                tmp,
                target: target.to_path_buf(),
                direct: is_direct,
            },
            note,
        ))
    }

    pub fn fd(&self) -> RawFd {
        self.fd.as_ref().map_or(-1, |f| f.as_raw_fd())
    }

    pub fn temp_path(&self) -> &Path {
        &self.tmp
    }

    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// Turn O_DIRECT off on the open file (after a refused probe write).
    pub fn clear_direct(&mut self) -> Result<()> {
        let fd = self.fd();
        // SAFETY: fcntl on our own open fd.
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
    /// fallocate are fine.
    pub fn preallocate(&self, len: u64) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        // SAFETY: fallocate on our own open fd.
        let rc = unsafe { libc::fallocate(self.fd(), 0, 0, len as libc::off_t) };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) | Some(libc::EINVAL) => {}
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

    /// Truncate to the true length, fsync (if `durable`), rename onto the
    /// target and fsync the directory.
    pub fn commit(mut self, len: u64, durable: bool) -> Result<()> {
        let fd = self.fd();
        // SAFETY: ftruncate on our own open fd.
        if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
            return Err(Error::last_os(
                "cannot truncate to the true length",
                Some(&self.tmp),
            ));
        }
        // SAFETY: fsync on our own open fd.
        if durable && unsafe { libc::fsync(fd) } != 0 {
            return Err(Error::last_os("fsync failed", Some(&self.tmp)));
        }
        drop(self.fd.take());
        let from = cstr(&self.tmp)?;
        let to = cstr(&self.target)?;
        // SAFETY: both are valid NUL-terminated paths.
        if unsafe { libc::rename(from.as_ptr(), to.as_ptr()) } != 0 {
            return Err(Error::last_os(
                "cannot rename onto the target",
                Some(&self.target),
            ));
        }
        // The rename happened: from now on the temporary name is gone.
        self.tmp = PathBuf::new();
        if durable {
            fsync_dir(&self.dir)?;
        }
        Ok(())
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        drop(self.fd.take());
        if !self.tmp.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// A file someone else created, opened for writing parts of it.
pub struct ExistingFile {
    fd: OwnedFd,
    path: PathBuf,
    /// Opened with O_DIRECT.
    pub direct: bool,
}

impl ExistingFile {
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    pub fn sync(&self) -> Result<()> {
        // SAFETY: fsync on our own open fd.
        if unsafe { libc::fsync(self.fd()) } != 0 {
            return Err(Error::last_os("fsync failed", Some(&self.path)));
        }
        Ok(())
    }
}

/// Open an existing file for writing (with O_DIRECT when asked and
/// accepted), neither creating nor truncating it.
pub fn open_existing(path: &Path, direct: bool) -> Result<ExistingFile> {
    let c = cstr(path)?;
    let (fd, direct) =
        open_direct(&c, libc::O_WRONLY | libc::O_CLOEXEC, 0, direct).map_err(|errno| {
            Error::os(
                errno,
                "cannot open the file to write a part of it",
                Some(path),
            )
        })?;
    Ok(ExistingFile {
        fd,
        path: path.to_path_buf(),
        direct,
    })
}

/// fsync a directory so a rename in it is durable.
pub fn fsync_dir(dir: &Path) -> Result<()> {
    let c = cstr(dir)?;
    // SAFETY: valid path; the fd is closed below.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(Error::last_os(
            "cannot open the directory to fsync it",
            Some(dir),
        ));
    }
    // SAFETY: fd was just opened and is owned here.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: fsync on an open fd.
    if unsafe { libc::fsync(owned.as_raw_fd()) } != 0 {
        return Err(Error::last_os("directory fsync failed", Some(dir)));
    }
    Ok(())
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
        let d = tempfile::tempdir().unwrap();
        let target = d.path().join("ckpt.pt");
        std::fs::write(&target, b"old old old").unwrap();
        let (t, _) = TempFile::create(&target, false).unwrap();
        // SAFETY: writing 3 bytes from a live slice to our own fd.
        let n = unsafe { libc::pwrite(t.fd(), b"new".as_ptr().cast(), 3, 0) };
        assert_eq!(n, 3);
        t.commit(3, true).unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"new");
        assert_eq!(names(d.path()), vec!["ckpt.pt"]);
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
}
