//! The Rust programs of `examples/` run here as tests (each asserts what it shows), so that an
//! example that no longer builds or no longer does what its comment says fails `cargo test`.

#[path = "../examples/hello.rs"]
mod hello;

#[path = "../examples/checkpoint.rs"]
mod checkpoint;

#[path = "../examples/variants.rs"]
mod variants;

#[test]
fn hello_allocates_frees_and_reuses() {
    hello::main().unwrap();
}

#[test]
fn checkpoint_restores_the_pool_around_a_kept_allocation() {
    checkpoint::main().unwrap();
}

#[test]
fn a_variant_group_holds_the_largest_variant() {
    variants::main().unwrap();
}
