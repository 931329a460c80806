// SPDX-License-Identifier: MIT
//! Puts the directory flashkda-sys linked against (DEP_FLASHKDA_LIB_DIR) on
//! the rpath of this crate's tests, so they run without
//! LD_LIBRARY_PATH. Programs depending on this crate choose their own rpath.

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_FLASHKDA_LIB_DIR");
    if let Ok(dir) = std::env::var("DEP_FLASHKDA_LIB_DIR") {
        println!("cargo:rustc-link-arg-tests=-Wl,-rpath,{dir}");
    }
}
