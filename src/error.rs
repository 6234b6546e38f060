//! Error type of the core: every failure carries what was being done, the
//! path involved and, for operating-system failures, the errno.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

/// What went wrong, coarsely: the binding maps each kind to a Python exception.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// An operating-system call failed (open, write, fsync, rename...): has an errno.
    Os,
    /// The caller's layout is inconsistent (overlapping segments, a checksum
    /// slot placed before the bytes it covers, ...).
    InvalidLayout,
    /// An option is out of range.
    InvalidOption,
    /// The commit renamed the new file onto the target, but the directory
    /// fsync that makes the rename durable failed (has an errno): the new
    /// file IS in place at the target, its durability is not confirmed.
    NotDurable,
    /// The caller refused to go on (a streamed write's `on_gathered`
    /// callback failed): nothing was committed.
    Cancelled,
    /// An engine or temporary file made by another process (this one is a
    /// `fork()` child of it) was used: its ring, threads, locks and file
    /// belong to that process, which goes on using them.
    Forked,
    /// fastpersist itself went wrong, not the file, the options or the
    /// system: a worker thread ended early, or a consumer of a handed read
    /// broke its contract.
    Internal,
    /// Caller memory being read was freed meanwhile (a storage resized by
    /// another thread, see [`crate::vanish`]): nothing was committed.
    Vanished,
}

#[derive(Debug)]
pub struct Error {
    pub kind: ErrorKind,
    /// errno for [`ErrorKind::Os`].
    pub errno: Option<i32>,
    /// The file or directory the failing operation was about.
    pub path: Option<PathBuf>,
    /// What was being done, e.g. "write at offset 4096 (len 1048576)".
    pub context: String,
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn os(errno: i32, context: impl Into<String>, path: Option<&Path>) -> Self {
        Error {
            kind: ErrorKind::Os,
            errno: Some(errno),
            path: path.map(Path::to_path_buf),
            context: context.into(),
        }
    }

    pub fn from_io(err: &io::Error, context: impl Into<String>, path: Option<&Path>) -> Self {
        Self::os(err.raw_os_error().unwrap_or(libc::EIO), context, path)
    }

    /// The current `errno`, right after a failed libc call.
    pub fn last_os(context: impl Into<String>, path: Option<&Path>) -> Self {
        Self::from_io(&io::Error::last_os_error(), context, path)
    }

    pub fn layout(msg: impl Into<String>) -> Self {
        Error {
            kind: ErrorKind::InvalidLayout,
            errno: None,
            path: None,
            context: msg.into(),
        }
    }

    /// The directory fsync after a commit's rename failed with `errno`.
    pub fn not_durable(errno: i32, target: &Path) -> Self {
        Error {
            kind: ErrorKind::NotDurable,
            errno: Some(errno),
            path: Some(target.to_path_buf()),
            context: "the new file IS in place at the target but its durability is not \
                      confirmed (directory fsync failed)"
                .into(),
        }
    }

    /// The caller's callback refused the commit (`why`).
    pub fn cancelled(why: impl Into<String>) -> Self {
        Error {
            kind: ErrorKind::Cancelled,
            errno: None,
            path: None,
            context: why.into(),
        }
    }

    /// `what`, made by process `owner`, was used in this process (a fork
    /// child of it).
    pub fn forked(what: &str, owner: u32, path: Option<&Path>) -> Self {
        Error {
            kind: ErrorKind::Forked,
            errno: None,
            path: path.map(Path::to_path_buf),
            context: format!(
                "{what} belongs to process {owner}; this process ({}) is a fork of it \
                 and cannot use it (it makes its own)",
                std::process::id()
            ),
        }
    }

    /// See [`ErrorKind::Vanished`].
    pub fn vanished(msg: impl Into<String>) -> Self {
        Error {
            kind: ErrorKind::Vanished,
            errno: None,
            path: None,
            context: msg.into(),
        }
    }

    /// See [`ErrorKind::Internal`].
    pub fn internal(msg: impl Into<String>) -> Self {
        Error {
            kind: ErrorKind::Internal,
            errno: None,
            path: None,
            context: msg.into(),
        }
    }

    pub fn option(msg: impl Into<String>) -> Self {
        Error {
            kind: ErrorKind::InvalidOption,
            errno: None,
            path: None,
            context: msg.into(),
        }
    }

    /// Human-readable description of the errno (strerror).
    pub fn strerror(&self) -> String {
        match self.errno {
            Some(e) => io::Error::from_raw_os_error(e).to_string(),
            None => String::new(),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.context)?;
        if let Some(p) = &self.path {
            write!(f, " [{}]", p.display())?;
        }
        if self.errno.is_some() {
            write!(f, ": {}", self.strerror())?;
        }
        Ok(())
    }
}

impl std::error::Error for Error {}
