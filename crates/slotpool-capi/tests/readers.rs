//! The typed readers of the C ABI on good and bad input: configuration values
//! (`sp_config_get_f64` / `_str`), pool options and live allocations, and the `sp_snapshot`
//! handle against `sp_snapshot_json` with recorded history. Bad input gets its code and a
//! message and writes nothing.

mod common;

use std::ffi::{CStr, c_char};
use std::ptr::{null, null_mut};

use common::*;
use slotpool::*;

const INVALID: sp_status = sp_status::SP_ERR_INVALID_ARGUMENT;
const CONFIG: sp_status = sp_status::SP_ERR_CONFIG;

fn pool(b: u64) -> sp_pool_id {
    sp_pool_id { a: 0, b }
}

/// `sp_config_get_str(key)` through a buffer large enough.
fn text(key: &CStr) -> String {
    let mut buf = [0 as c_char; 1024];
    let mut len = usize::MAX;
    // SAFETY: a NUL-terminated key; `buf` holds buf.len() bytes; valid `len`.
    ok(unsafe { sp_config_get_str(key.as_ptr(), buf.as_mut_ptr(), buf.len(), &mut len) });
    // SAFETY: the call wrote a NUL-terminated string into `buf`.
    let s = unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_str()
        .unwrap()
        .to_string();
    assert_eq!(s.len(), len, "{key:?}");
    s
}

fn number(key: &CStr) -> f64 {
    let mut v = f64::NAN;
    // SAFETY: a NUL-terminated key; valid out-pointer.
    ok(unsafe { sp_config_get_f64(key.as_ptr(), &mut v) });
    v
}

#[test]
fn configuration_values_are_those_in_effect() {
    setup();
    // The whole string is the configuration the library runs with, which parses back to itself.
    let conf = text(c"conf");
    let (parsed, _) = runtime::parse_conf("", &conf).unwrap();
    assert_eq!(parsed, runtime::runtime().unwrap().config, "{conf}");
    assert_eq!(parsed.to_string(), conf);
    // Per key, in the conf syntax and as numbers in the key's units.
    let page = text(c"vmm_page_mb");
    assert_eq!(number(c"vmm_page_mb"), page.parse::<f64>().unwrap());
    assert_eq!(text(c"growth"), "vmm");
    assert_eq!(number(c"expandable_segments"), 1.0, "a boolean reads 1");
    assert_eq!(text(c"expandable_segments"), "True");
    assert_eq!(text(c"max_split_size_mb"), "", "unset: no limit");
    assert_eq!(number(c"max_split_size_mb"), 0.0, "an unset limit reads 0");
    assert_eq!(number(c"sim_devices"), 4.0, "the sim's keys too");
    assert_eq!(number(c"sim_memory_mb"), 4096.0);
}

#[test]
fn configuration_reads_refuse_bad_input_and_write_nothing() {
    setup();
    let mut v = 7.0;
    // SAFETY: NUL-terminated keys or NULL; valid or NULL out-pointers.
    unsafe {
        expect(sp_config_get_f64(c"no_such_key".as_ptr(), &mut v), CONFIG);
        assert!(last_error().contains("no_such_key"), "{}", last_error());
        expect(sp_config_get_f64(c"sim_nothing".as_ptr(), &mut v), CONFIG);
        expect(sp_config_get_f64(c"growth".as_ptr(), &mut v), CONFIG);
        assert!(last_error().contains("not a number"), "{}", last_error());
        expect(sp_config_get_f64(c"conf".as_ptr(), &mut v), CONFIG);
        expect(sp_config_get_f64(null(), &mut v), INVALID);
        expect(sp_config_get_f64(c"growth".as_ptr(), null_mut()), INVALID);
    }
    assert_eq!(v, 7.0, "nothing written");
    let mut buf = [b'x' as c_char; 8];
    let mut len = 99usize;
    // SAFETY: as above; `buf` holds 8 bytes.
    unsafe {
        expect(
            sp_config_get_str(c"bogus".as_ptr(), buf.as_mut_ptr(), buf.len(), &mut len),
            CONFIG,
        );
        expect(
            sp_config_get_str(null(), buf.as_mut_ptr(), buf.len(), &mut len),
            INVALID,
        );
        expect(
            sp_config_get_str(c"conf".as_ptr(), null_mut(), 4, &mut len),
            INVALID,
        );
    }
    assert_eq!((buf, len), ([b'x' as c_char; 8], 99), "nothing written");
    // Too small a buffer: truncated, NUL-terminated, the full length reported.
    let full = text(c"conf");
    // SAFETY: `buf` holds 8 bytes.
    ok(unsafe { sp_config_get_str(c"conf".as_ptr(), buf.as_mut_ptr(), buf.len(), &mut len) });
    assert_eq!(len, full.len());
    // SAFETY: the call NUL-terminated `buf`.
    let got = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().unwrap();
    assert_eq!(got, &full[..7]);
    // Only the length: cap 0 with NULL buf; and no length wanted.
    let mut n = 0usize;
    // SAFETY: cap 0 with a NULL buffer; valid `len` or NULL.
    unsafe {
        ok(sp_config_get_str(c"conf".as_ptr(), null_mut(), 0, &mut n));
        ok(sp_config_get_str(
            c"conf".as_ptr(),
            buf.as_mut_ptr(),
            1,
            null_mut(),
        ));
    }
    assert_eq!(n, full.len());
    assert_eq!(buf[0], 0, "cap 1 holds the NUL only");
}

#[test]
fn pool_options_read_back_as_set() {
    setup();
    let p = pool(61_001);
    let opts = sp_pool_options {
        no_split: 1,
        use_on_oom: 0,
        limit_bytes: 64 << 20,
        pausable: 1,
    };
    let mut got = sp_pool_options::default();
    // SAFETY: readable options; valid out-pointers.
    unsafe {
        ok(sp_pool_create_or_incref(SHARED, p, &opts, null_mut()));
        ok(sp_pool_options_get(SHARED, p, &mut got));
        assert_eq!(got, opts);
        let other = sp_pool_options {
            use_on_oom: 5,
            ..sp_pool_options::default()
        };
        ok(sp_pool_set_options(SHARED, p, &other));
        ok(sp_pool_options_get(SHARED, p, &mut got));
        assert_eq!(got.use_on_oom, 1, "flags read back as 1");
        assert_eq!((got.no_split, got.limit_bytes, got.pausable), (0, 0, 0));
        let before = got;
        expect(
            sp_pool_options_get(SHARED, pool(61_999), &mut got),
            sp_status::SP_ERR_UNKNOWN_POOL,
        );
        expect(sp_pool_options_get(SHARED, p, null_mut()), INVALID);
        expect(sp_pool_options_get(99, p, &mut got), INVALID);
        assert_eq!(got, before, "nothing written");
        ok(sp_pool_release(SHARED, p, null_mut()));
    }
}

#[test]
fn live_allocations_list_each_allocation_once() {
    setup();
    let p = pool(61_002);
    // SAFETY: NULL options and count.
    ok(unsafe { sp_pool_create_or_incref(SHARED, p, null(), null_mut()) });
    let mut ptrs = Vec::new();
    for (i, size) in [700usize, 3 << 20, 64, 100_000].into_iter().enumerate() {
        let mut out = null_mut();
        // SAFETY: valid out-pointer.
        ok(unsafe { sp_pool_alloc(SHARED, p, size, 5 + i as u64 % 2, &mut out) });
        ptrs.push((out as usize, size, 5 + i as u64 % 2));
    }
    ptrs.sort_unstable();
    let blank = sp_allocation {
        ptr: null_mut(),
        size: 0,
        requested_size: 0,
        stream: 0,
    };
    let mut out = [blank; 6];
    let mut total = 0usize;
    // SAFETY: `out` holds 6 entries.
    ok(unsafe { sp_pool_live_allocations(SHARED, p, out.as_mut_ptr(), out.len(), &mut total) });
    assert_eq!(total, 4);
    for (a, &(ptr, size, stream)) in out.iter().zip(&ptrs) {
        assert_eq!(
            (a.ptr as usize, a.requested_size, a.stream),
            (ptr, size as u64, stream)
        );
        let (mut base, mut rounded, mut req, mut dev) = (null_mut(), 0, 0, -1);
        // SAFETY: valid out-pointers.
        ok(unsafe { sp_allocation_info(a.ptr, &mut base, &mut rounded, &mut req, &mut dev) });
        assert_eq!(a.size, rounded as u64, "the block's rounded size");
    }
    assert_eq!(&out[4..], &[blank; 2], "nothing past the total");
    // Bad input: nothing written.
    let mut t = 99usize;
    // SAFETY: NULL out-pointers are refused before anything is written.
    unsafe {
        expect(
            sp_pool_live_allocations(SHARED, p, null_mut(), 1, &mut t),
            INVALID,
        );
        expect(
            sp_pool_live_allocations(SHARED, p, out.as_mut_ptr(), 1, null_mut()),
            INVALID,
        );
        expect(
            sp_pool_live_allocations(SHARED, pool(61_998), out.as_mut_ptr(), 6, &mut t),
            sp_status::SP_ERR_UNKNOWN_POOL,
        );
        expect(
            sp_pool_live_allocations(-3, p, out.as_mut_ptr(), 6, &mut t),
            INVALID,
        );
    }
    assert_eq!(t, 99);
    for (ptr, _, _) in ptrs {
        ok(sp_free(ptr as *mut _));
    }
    // SAFETY: cap 0 with NULL out.
    ok(unsafe { sp_pool_live_allocations(SHARED, p, null_mut(), 0, &mut total) });
    assert_eq!(total, 0);
    // SAFETY: a pool made above.
    ok(unsafe { sp_pool_release(SHARED, p, null_mut()) });
}

#[test]
fn the_snapshot_handle_agrees_with_the_json_including_history() {
    let _only = exclusive(QUIET);
    ok(sp_record_history(QUIET, 256));
    let mut ptrs = Vec::new();
    for size in [512usize, 2 << 20, 9000, 40 << 20] {
        ptrs.push(alloc(QUIET, size, 3));
    }
    ok(sp_free(ptrs.swap_remove(1)));
    for (device, traces) in [(QUIET, 1), (QUIET, 0), (-1, 1)] {
        let mut s = null_mut();
        // SAFETY: valid out-pointer.
        ok(unsafe { sp_snapshot_take(device, traces, &mut s) });
        let (mut json, mut len) = (null_mut(), 0);
        // SAFETY: valid out-pointers; the string is copied and freed at once.
        ok(unsafe { sp_snapshot_json(device, &mut json, &mut len) });
        // SAFETY: `json` holds `len` bytes.
        let text = unsafe { std::slice::from_raw_parts(json.cast::<u8>(), len) };
        let text = String::from_utf8_lossy(text).into_owned();
        // SAFETY: returned by sp_snapshot_json.
        ok(unsafe { sp_string_free(json) });
        views::snapshot_agrees(s, &text);
        let events = sp_snapshot_trace_count(s);
        if traces == 1 {
            assert!(
                events >= 7,
                "{events} events: 4 allocs, a free, their segments"
            );
        } else {
            assert_eq!(events, 0, "no history asked for");
        }
        // SAFETY: a live handle.
        ok(unsafe { sp_snapshot_free(s) });
    }
    let mut s = null_mut();
    // SAFETY: an unknown device is refused and leaves NULL.
    expect(unsafe { sp_snapshot_take(DEVICES, 0, &mut s) }, INVALID);
    assert!(s.is_null());
    // SAFETY: NULL out-pointer.
    expect(unsafe { sp_snapshot_take(QUIET, 0, null_mut()) }, INVALID);
    for p in ptrs {
        ok(sp_free(p));
    }
    ok(sp_record_history(QUIET, 0));
    ok(sp_clear_history(QUIET));
}

/// The rows of the keys table of `docs/configuration.md`: (key, default cell).
fn documented_defaults() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(repo_root().join("docs/configuration.md")).unwrap();
    let start = text.find("| key | default |").expect("the keys table");
    text[start..]
        .lines()
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            (cells[1].trim_matches('`').to_string(), cells[2].to_string())
        })
        .collect()
}

#[test]
fn the_configuration_table_gives_the_defaults_the_library_reads() {
    // The one table of keys and defaults, against what the library reads at its defaults.
    let (config, sim) = runtime::parse_conf("", "").unwrap();
    let rows = documented_defaults();
    let mut keys: Vec<&str> = rows.iter().map(|(k, _)| k.as_str()).collect();
    keys.sort_unstable();
    let mut all: Vec<&str> = slotpool_core::Config::KEYS
        .iter()
        .chain(slotpool_sim::keys::SIM_KEYS)
        .copied()
        .collect();
    all.sort_unstable();
    assert_eq!(keys, all, "every key once");
    for (key, cell) in &rows {
        let value = if key.starts_with("sim_") {
            use slotpool_core::KeyOwner;
            sim.settings()
                .into_iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v)
        } else {
            config.value(key).unwrap()
        };
        match value {
            Some(v) => assert_eq!(cell, &format!("`{v}`"), "{key}"),
            None => assert!(cell.starts_with("unset"), "{key}: {cell}"),
        }
    }
}
