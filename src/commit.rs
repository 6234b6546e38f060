//! Crash-safe commit: write under a temporary name in the target directory,
//! then fsync, rename onto the final name and fsync the directory.
//!
//! Until the rename, an existing file at the final path is untouched; a
//! [`TempFile`] that is dropped without [`TempFile::commit`] unlinks itself,
//! so a failed save leaves nothing behind. A process killed mid-save leaves a
//! file matching [`TEMP_MARKER`], which the checkpoint manager sweeps.

use crate::error::{Error, Result};
use std::fs::{File, OpenOptions};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Every temporary file's name contains this.
pub const TEMP_MARKER: &str = ".fptmp";

static COUNTER: AtomicU64 = AtomicU64::new(0);

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
        let mut opts = OpenOptions::new();
        opts.write(true).create_new(true).mode(0o644);
        let (file, is_direct) = open_direct(&tmp, &opts, direct)
            .map_err(|e| Error::from_io(&e, "cannot create the temporary file", Some(&tmp)))?;
        let note = (direct && !is_direct)
            .then(|| "the file system refused O_DIRECT at open (EINVAL)".to_string());
        Ok((
            TempFile {
                file: Some(file),
                dir,
                tmp,
                target: target.to_path_buf(),
                direct: is_direct,
            },
            note,
        ))
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

    /// Turn O_DIRECT off on the open file (after a refused probe write).
    pub fn clear_direct(&mut self) -> Result<()> {
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
    /// fallocate are fine.
    pub fn preallocate(&self, len: u64) -> Result<()> {
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
        // SAFETY: fallocate on our own open fd; no memory is passed.
        let rc = unsafe { libc::fallocate(self.fd(), 0, 0, off_len) };
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

    /// Truncate to `len` (the true length) when given, fsync (if
    /// `durable`), rename onto the target and fsync the directory.
    pub fn commit(mut self, len: Option<u64>, durable: bool) -> Result<()> {
        let file = self.file.take().ok_or_else(|| {
            Error::os(
                libc::EBADF,
                "the temporary file is already committed",
                Some(&self.tmp),
            )
        })?;
        if let Some(len) = len {
            file.set_len(len).map_err(|e| {
                Error::from_io(&e, "cannot truncate to the true length", Some(&self.tmp))
            })?;
        }
        if durable {
            file.sync_all()
                .map_err(|e| Error::from_io(&e, "fsync failed", Some(&self.tmp)))?;
        }
        drop(file);
        std::fs::rename(&self.tmp, &self.target)
            .map_err(|e| Error::from_io(&e, "cannot rename onto the target", Some(&self.target)))?;
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
        drop(self.file.take());
        if !self.tmp.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.tmp);
        }
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
}
