//! fastpersist core: durable, fast checkpoint files on Linux.
//!
//! Pure Rust, no Python. The modules, bottom up:
//!
//! - [`error`]: the error type (what was done, path, errno) and its kinds;
//! - [`align`]: the direct-I/O alignment of a file system (`statx`);
//! - [`layout`]: a file described as segments, and the hybrid alignment
//!   partitioner that cuts it into block-aligned extents and balanced parts;
//! - [`arena`]: aligned, locked staging memory;
//! - [`crc_copy`]: copy and CRC32 in one pass (non-temporal stores);
//! - [`guard`]: exclusive access to caller memory while it is gathered;
//! - `sink` (crate-private): the io_uring ring and the `pwrite`/`pread`
//!   fallback pool that take arena buffers to and from the kernel;
//! - [`commit`]: the temporary file and the durable commit (fsync, rename,
//!   directory fsync);
//! - [`engine`]: [`Engine`] and [`Options`], the arena, sink and free-buffer
//!   list that saves and reads share, and who owns the writes in flight;
//! - [`writer`]: write sessions (`begin`/`write`/`finish`) and `write_part`;
//! - [`held`]: arena buffers a session's caller fills itself (device-to-host
//!   copies straight into the arena), checksummed and written where they lie;
//! - [`reader`]: many records of one file into caller memory;
//! - [`handoff`]: reads handed over in the arena buffers they land in (to a
//!   consumer that copies them on, e.g. to a GPU), checksummed in place;
//! - [`pickle`]: CPython's protocol-2 pickle opcodes, byte for byte (the
//!   fast path of the Python side's torch.save pickle);
//! - [`unpickle`]: a reader of those opcodes (the fast path of the Python
//!   side's unpickle of plain state dicts);
//! - [`zip`]: torch.save's zip headers, byte for byte (local headers with
//!   torch's alignment padding, descriptors, central directory, end records);
//! - [`json`]: how deep JSON text nests, before a parser recurses into it.
//!
//! The Python extension lives in `python.rs`, behind the `python` feature.

// Offsets are u64 and lengths usize throughout: the crate assumes they
// convert without loss (Linux on 64-bit machines, where io_uring lives).
#[cfg(not(all(target_os = "linux", target_pointer_width = "64")))]
compile_error!("fastpersist supports 64-bit Linux only");

pub mod align;
pub mod arena;
pub mod commit;
pub mod crc_copy;
pub mod engine;
pub mod error;
pub mod gather;
pub mod guard;
pub mod handoff;
pub mod held;
pub mod json;
pub mod layout;
mod lend;
pub mod pickle;
pub mod reader;
pub(crate) mod sink;
pub mod unpickle;
pub(crate) mod vanish;
pub mod writer;
pub mod zip;

#[cfg(feature = "python")]
mod python;

pub use engine::{Engine, Options};
pub use error::{Error, ErrorKind, Result};
pub use guard::{with_guard, GatherGuard};
pub use layout::{Extent, Layout, MemRef, Piece, Segment, Source};
pub use reader::{MutMemRef, ReadPiece, ReadReq, ReadStats};
pub use sink::Fault;
pub use writer::{Session, WriteStats};
