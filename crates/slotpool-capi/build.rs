//! Gives `libslotpool.so` its SONAME, `libslotpool.so.0`: the major version of the C ABI (the
//! `0` of `SP_VERSION_MAJOR`; a program linked with `-lslotpool` records it and runs against any
//! 0.x library). The loader also recognises a copy that is already loaded by this name, so the
//! torch shim, the LD_PRELOAD library and a program linked with `-lslotpool` share one allocator.
//! `scripts/install.sh` installs the file as `libslotpool.so.0.1.0` with the links
//! `libslotpool.so.0` and `libslotpool.so`.

fn main() {
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        let major = std::env::var("CARGO_PKG_VERSION_MAJOR").unwrap_or_else(|_| "0".into());
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libslotpool.so.{major}");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
