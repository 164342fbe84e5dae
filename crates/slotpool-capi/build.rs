//! Gives `libslotpool.so` its SONAME, so that the loader recognises a copy that is already loaded
//! (the torch shim and the LD_PRELOAD library then share one allocator).

fn main() {
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libslotpool.so");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
