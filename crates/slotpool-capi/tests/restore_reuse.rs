//! A restore after a block was freed and re-allocated at the same address and size since the
//! checkpoint: the new block is freed by the restore and the checkpoint's block re-created, with
//! its own requested size, both listed in the delta. (The sequence driver keeps this case out of
//! its restores until it passes: `tests/sequences/model.rs`, `restorable`.)

mod common;

use std::ffi::c_void;
use std::ptr::{null, null_mut};

use common::*;
use slotpool::*;

#[test]
fn a_block_reallocated_at_the_same_address_is_freed_and_recreated_by_a_restore() {
    let _only = exclusive(SHARED);
    let p = sp_pool_id { a: 0, b: 41_001 };
    // SAFETY: NULL options and count are allowed.
    ok(unsafe { sp_pool_create_or_incref(SHARED, p, null(), null_mut()) });
    let alloc = |size: usize| {
        let mut out: *mut c_void = null_mut();
        // SAFETY: valid out-pointer.
        ok(unsafe { sp_pool_alloc(SHARED, p, size, 0, &mut out) });
        out
    };
    let old = alloc(1000);
    let mut cp = null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { sp_checkpoint_take(SHARED, p, &mut cp) });
    ok(sp_free(old));
    let new = alloc(900);
    assert_eq!(new, old, "the freed block's address is reused");
    let mut d = null_mut();
    // SAFETY: a live handle; valid out-pointer.
    ok(unsafe { sp_checkpoint_restore(cp, null(), 0, &mut d) });
    let entry = |freed: bool| {
        let (mut ptr, mut size) = (null_mut(), 0);
        // SAFETY: a live delta; valid out-pointers.
        ok(unsafe {
            if freed {
                sp_delta_freed(d, 0, &mut ptr, &mut size)
            } else {
                sp_delta_created(d, 0, &mut ptr, &mut size)
            }
        });
        ptr
    };
    assert_eq!(
        sp_delta_freed_count(d),
        1,
        "the block allocated since is freed"
    );
    assert_eq!(
        sp_delta_created_count(d),
        1,
        "the checkpoint's block is re-created"
    );
    assert_eq!((entry(true), entry(false)), (new, old));
    let (mut base, mut size, mut requested, mut dev) = (null_mut(), 0, 0, 0);
    // SAFETY: valid out-pointers.
    ok(unsafe { sp_allocation_info(old, &mut base, &mut size, &mut requested, &mut dev) });
    assert_eq!(
        requested, 1000,
        "the re-created block has the checkpoint's requested size"
    );
    // SAFETY: live handles.
    unsafe {
        ok(sp_delta_free(d));
        ok(sp_checkpoint_free(cp));
    }
    ok(sp_free(old));
    ok(sp_check_invariants(SHARED));
}
