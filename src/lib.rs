//! fastpersist core: durable, fast checkpoint files on Linux.
//!
//! Pure Rust, no Python: [`layout`] (the hybrid alignment partitioner),
//! [`arena`] (aligned, locked staging memory), [`sink`] (io_uring ring and
//! the pwrite fallback pool), [`commit`] (temporary file, fsync, rename,
//! directory fsync) and [`writer`] (one save end to end). The Python
//! extension lives in `python.rs`, behind the `python` feature.

pub mod align;
pub mod arena;
pub mod commit;
pub mod error;
pub mod layout;
pub mod reader;
pub mod sink;
pub mod writer;

#[cfg(feature = "python")]
mod python;

pub use error::{Error, ErrorKind, Result};
pub use layout::{Extent, Layout, MemRef, Piece, Segment, Source};
pub use reader::{MutMemRef, ReadReq, ReadStats};
pub use writer::{Engine, Options, Session, WriteStats};
