// SPDX-License-Identifier: MIT
//! Links libflashkda.so.0.
//!
//! FLASHKDA_LIB_DIR names the directory holding libflashkda.so.0 (a build
//! tree or an install prefix's lib/); FLASHKDA_LIBRARY, the path of the
//! library itself, is accepted too. Without either the system linker and
//! loader search their usual paths. The directory is exported to dependent
//! build scripts as DEP_FLASHKDA_LIB_DIR, so they can add it as an rpath.

use std::env;
use std::path::PathBuf;

fn library_dir() -> Option<PathBuf> {
    if let Some(dir) = env::var_os("FLASHKDA_LIB_DIR") {
        return Some(PathBuf::from(dir));
    }
    let library = PathBuf::from(env::var_os("FLASHKDA_LIBRARY")?);
    library.parent().map(|dir| dir.to_path_buf())
}

fn main() {
    println!("cargo:rerun-if-env-changed=FLASHKDA_LIB_DIR");
    println!("cargo:rerun-if-env-changed=FLASHKDA_LIBRARY");
    if let Some(dir) = library_dir() {
        let dir = dir.canonicalize().unwrap_or(dir);
        println!("cargo:rustc-link-search=native={}", dir.display());
        println!("cargo:lib_dir={}", dir.display());
        // For this crate's own tests; dependents add it from DEP_FLASHKDA_LIB_DIR.
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
    }
    // The runtime name, so that no unversioned development symlink is needed.
    println!("cargo:rustc-link-lib=dylib:+verbatim=libflashkda.so.0");
}
