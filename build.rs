//! Compile-time switches that depend on the compiler, not the target.
//!
//! `fp_vpclmulqdq`: rustc 1.89 stabilized the x86 VPCLMULQDQ and AVX-512
//! intrinsics that `crc_copy`'s wide kernels use; older compilers (down to
//! the crate's rust-version) build the 128-bit kernel alone.

use std::{env, process::Command};

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rustc-check-cfg=cfg(fp_vpclmulqdq)");
    if rustc_minor().is_some_and(|m| m >= 89) {
        println!("cargo:rustc-cfg=fp_vpclmulqdq");
    }
}

/// The minor version of the compiler cargo builds with (`rustc 1.M.p`).
fn rustc_minor() -> Option<u32> {
    let out = Command::new(env::var_os("RUSTC")?)
        .arg("--version")
        .output()
        .ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    text.split('.').nth(1)?.parse().ok()
}
