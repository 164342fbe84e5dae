//! `include/slotpool.h` against the Rust exports:
//!
//! 1. cbindgen generates the signatures of every exported function (functions only, see
//!    `cbindgen.toml`); one C translation unit includes the hand-written header and then the
//!    generated one, and is compiled with `-Werror`: a parameter or return type that drifted is a
//!    "conflicting types" error (the same TU is also compiled as C++).
//! 2. The function names of both headers are the same set, and equal the `sp_*` symbols that
//!    `libslotpool.so` exports.
//! 3. The header alone compiles as strict C99 and C++11, and its version macros match the crate.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

fn header_path() -> PathBuf {
    repo_root().join("include/slotpool.h")
}

/// The text without `/* */` and `//` comments.
fn strip_comments(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    loop {
        let block = rest.find("/*");
        let line = rest.find("//");
        match (block, line) {
            (Some(b), l) if l.is_none_or(|l| b < l) => {
                out.push_str(&rest[..b]);
                let end = rest[b + 2..].find("*/").expect("unterminated comment");
                rest = &rest[b + 2 + end + 2..];
            }
            (_, Some(l)) => {
                out.push_str(&rest[..l]);
                rest = rest[l..].find('\n').map_or("", |n| &rest[l + n..]);
            }
            _ => {
                out.push_str(rest);
                return out;
            }
        }
    }
}

/// Names `sp_*` followed by `(`: the functions a header declares.
fn declared_functions(header: &str) -> BTreeSet<String> {
    let code = strip_comments(header);
    let bytes = code.as_bytes();
    let mut names = BTreeSet::new();
    let mut i = 0;
    while let Some(off) = code[i..].find("sp_") {
        let start = i + off;
        let boundary =
            start == 0 || !(bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_') {
            end += 1;
        }
        let after = code[end..].trim_start();
        if boundary && after.starts_with('(') {
            names.insert(code[start..end].to_string());
        }
        i = end.max(start + 1);
    }
    names
}

fn generate(out_dir: &Path) -> PathBuf {
    let crate_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let config =
        cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("cbindgen.toml");
    // Parse the sources directly (out-of-line modules are followed), without `cargo metadata`:
    // the test does not depend on the state of the rest of the workspace.
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(crate_dir.join("src/lib.rs"))
        .generate()
        .expect("cbindgen");
    let path = out_dir.join("slotpool_generated.h");
    bindings.write_to_file(&path);
    path
}

fn compile(cmd: &mut Command, what: &str) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn header_matches_the_rust_exports() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("header-check");
    std::fs::create_dir_all(&dir).unwrap();
    let generated = generate(&dir);
    let hand = std::fs::read_to_string(header_path()).unwrap();
    let gen_text = std::fs::read_to_string(&generated).unwrap();

    // 2. Same names both ways.
    let hand_fns = declared_functions(&hand);
    let gen_fns = declared_functions(&gen_text);
    assert!(
        gen_fns.len() >= 30,
        "cbindgen found {} functions",
        gen_fns.len()
    );
    let missing: Vec<_> = gen_fns.difference(&hand_fns).collect();
    let extra: Vec<_> = hand_fns.difference(&gen_fns).collect();
    assert!(
        missing.is_empty(),
        "exported but not in slotpool.h: {missing:?}"
    );
    assert!(
        extra.is_empty(),
        "in slotpool.h but not exported: {extra:?}"
    );

    if !have_tool("cc") {
        return;
    }
    // 1. Both headers in one translation unit, as C and as C++.
    let tu = dir.join("check.c");
    std::fs::write(
        &tu,
        "#include \"slotpool.h\"\n#include \"slotpool_generated.h\"\nint main(void) { return 0; }\n",
    )
    .unwrap();
    let include = repo_root().join("include");
    compile(
        Command::new("cc")
            .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-fsyntax-only"])
            .arg("-I")
            .arg(&include)
            .arg("-I")
            .arg(&dir)
            .arg(&tu),
        "cc: hand-written + generated header",
    );
    if have_tool("c++") {
        compile(
            Command::new("c++")
                .args([
                    "-std=c++17",
                    "-Wall",
                    "-Wextra",
                    "-Werror",
                    "-fsyntax-only",
                    "-x",
                    "c++",
                ])
                .arg("-I")
                .arg(&include)
                .arg("-I")
                .arg(&dir)
                .arg(&tu),
            "c++: hand-written + generated header",
        );
    }
}

#[test]
fn drift_is_detected() {
    // The check above must fail for a changed signature: compile a deliberately wrong
    // redeclaration against the header.
    if !have_tool("cc") {
        return;
    }
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("header-drift");
    std::fs::create_dir_all(&dir).unwrap();
    let tu = dir.join("drift.c");
    std::fs::write(
        &tu,
        "#include \"slotpool.h\"\nsp_status sp_alloc(int device, uint32_t size, uint64_t stream, void** out);\n",
    )
    .unwrap();
    let out = Command::new("cc")
        .args(["-std=c11", "-Wall", "-Werror", "-fsyntax-only", "-I"])
        .arg(repo_root().join("include"))
        .arg(&tu)
        .output()
        .unwrap();
    assert!(!out.status.success(), "a drifted signature compiled");
    assert!(String::from_utf8_lossy(&out.stderr).contains("conflicting types"));
}

#[test]
fn exported_symbols_are_exactly_the_header_functions() {
    let so = lib_dir().join("libslotpool.so");
    assert!(so.exists(), "{} missing", so.display());
    if !have_tool("nm") {
        return;
    }
    let out = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(&so)
        .output()
        .unwrap();
    assert!(out.status.success());
    let exported: BTreeSet<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .filter(|s| s.starts_with("sp_"))
        .map(str::to_string)
        .collect();
    let hand = declared_functions(&std::fs::read_to_string(header_path()).unwrap());
    assert_eq!(exported, hand, "nm -D libslotpool.so vs slotpool.h");
    if have_tool("readelf") {
        let out = Command::new("readelf").arg("-d").arg(&so).output().unwrap();
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("Library soname: [libslotpool.so.0]"),
            "SONAME is not libslotpool.so.0"
        );
    }
}

#[test]
fn header_is_strict_c99_and_cxx11_and_versioned() {
    let hand = std::fs::read_to_string(header_path()).unwrap();
    for (name, value) in [
        ("SP_VERSION_MAJOR", env!("CARGO_PKG_VERSION_MAJOR")),
        ("SP_VERSION_MINOR", env!("CARGO_PKG_VERSION_MINOR")),
        ("SP_VERSION_PATCH", env!("CARGO_PKG_VERSION_PATCH")),
    ] {
        assert!(
            hand.contains(&format!("#define {name} {value}\n")),
            "{name} is not {value}"
        );
    }
    if !have_tool("cc") {
        return;
    }
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("header-strict");
    std::fs::create_dir_all(&dir).unwrap();
    let tu = dir.join("alone.c");
    std::fs::write(
        &tu,
        "#include \"slotpool.h\"\nint main(void) { return 0; }\n",
    )
    .unwrap();
    let include = repo_root().join("include");
    compile(
        Command::new("cc")
            .args([
                "-std=c99",
                "-pedantic",
                "-Wall",
                "-Wextra",
                "-Werror",
                "-fsyntax-only",
                "-I",
            ])
            .arg(&include)
            .arg(&tu),
        "cc -std=c99 -pedantic",
    );
    if have_tool("c++") {
        compile(
            Command::new("c++")
                .args([
                    "-std=c++11",
                    "-pedantic",
                    "-Wall",
                    "-Wextra",
                    "-Werror",
                    "-fsyntax-only",
                ])
                .args(["-x", "c++", "-I"])
                .arg(&include)
                .arg(&tu),
            "c++ -std=c++11 -pedantic",
        );
    }
}

#[test]
fn comment_stripping_and_name_scan() {
    let h = "/* sp_fake(int) */ int sp_a(void); // sp_b(\nsp_status  sp_c (int x);\ntypedef struct sp_d { int sp_e; } sp_d;";
    let names = declared_functions(h);
    assert_eq!(
        names.into_iter().collect::<Vec<_>>(),
        vec!["sp_a".to_string(), "sp_c".to_string()]
    );
}

#[test]
fn status_codes_and_names_match_the_header() {
    // The header's `typedef enum sp_status { ... }` against slotpool-abi's one list of codes,
    // which sp_status_name's names come from.
    let hand = strip_comments(&std::fs::read_to_string(header_path()).unwrap());
    let start = hand
        .find("typedef enum sp_status {")
        .expect("sp_status in slotpool.h");
    let body = &hand[start..start + hand[start..].find('}').unwrap()];
    let declared: Vec<(String, i32)> = body
        .split(['{', ','])
        .filter_map(|item| {
            let (name, value) = item.split_once('=')?;
            Some((name.trim().to_string(), value.trim().parse().unwrap()))
        })
        .collect();
    let named: Vec<(String, i32)> = slotpool::sp_status::ALL
        .iter()
        .map(|code| (code.name().to_str().unwrap().to_string(), code.code()))
        .collect();
    assert_eq!(declared, named, "slotpool.h's sp_status vs slotpool-abi");
    assert!(declared.len() >= 12, "{declared:?}");
}

/// `(type, size, [(field, offset)])` of each listed `#[repr(C)]` type, as Rust lays it out.
macro_rules! layouts {
    ($($ty:ident { $($field:ident),* $(,)? })*) => {
        vec![$((
            stringify!($ty),
            size_of::<slotpool::$ty>(),
            vec![$((stringify!($field), std::mem::offset_of!(slotpool::$ty, $field))),*],
        )),*]
    };
}

#[test]
fn struct_layouts_and_enum_values_match_the_header() {
    // A C program prints the size and every field offset of each struct and the value of each
    // enum constant as the header declares them; slotpool-abi's types must say the same.
    let layouts = layouts! {
        sp_pool_id { a, b }
        sp_pool_options { no_split, use_on_oom, limit_bytes, pausable }
        sp_stat { current, peak, allocated, freed }
        sp_stat_array { all, small_pool, large_pool }
        sp_memory_stats {
            allocation, segment, active, inactive_split, allocated_bytes, reserved_bytes,
            active_bytes, inactive_split_bytes, requested_bytes, num_alloc_retries, num_ooms,
            num_sync_all_streams, num_device_alloc, num_device_free, oversize_allocations,
            oversize_segments, max_split_size, reserved_paused_bytes,
        }
        sp_backend_calls {
            alloc_segment, free_segment, reserve, release_reservation, create_page, release_page,
            map, unmap, create_event, record_event, query_event, synchronize,
        }
        sp_trace_event { action, device, addr, size, stream, time_us }
        sp_allocation { ptr, size, requested_size, stream }
        sp_segment_view {
            device, is_large, is_expandable, reserved0, address, total_size, stream, pool,
            block_count,
        }
        sp_block_view { address, size, requested_size, state }
    };
    use slotpool::{sp_block_state as B, sp_route_kind as R, sp_trace_action as T};
    let mut enums: Vec<(String, i32)> = slotpool::sp_status::ALL
        .iter()
        .map(|c| (c.name().to_str().unwrap().to_string(), c.code()))
        .collect();
    for (name, v) in [
        ("SP_ROUTE_ALL", R::SP_ROUTE_ALL.0),
        ("SP_ROUTE_CURRENT_THREAD", R::SP_ROUTE_CURRENT_THREAD.0),
        ("SP_ROUTE_STREAM", R::SP_ROUTE_STREAM.0),
        ("SP_ROUTE_CAPTURE", R::SP_ROUTE_CAPTURE.0),
        ("SP_TRACE_ALLOC", T::SP_TRACE_ALLOC.0),
        ("SP_TRACE_FREE_REQUESTED", T::SP_TRACE_FREE_REQUESTED.0),
        ("SP_TRACE_FREE_COMPLETED", T::SP_TRACE_FREE_COMPLETED.0),
        ("SP_TRACE_SEGMENT_ALLOC", T::SP_TRACE_SEGMENT_ALLOC.0),
        ("SP_TRACE_SEGMENT_FREE", T::SP_TRACE_SEGMENT_FREE.0),
        ("SP_TRACE_SEGMENT_MAP", T::SP_TRACE_SEGMENT_MAP.0),
        ("SP_TRACE_SEGMENT_UNMAP", T::SP_TRACE_SEGMENT_UNMAP.0),
        ("SP_TRACE_OOM", T::SP_TRACE_OOM.0),
        ("SP_BLOCK_INACTIVE", B::SP_BLOCK_INACTIVE.0),
        ("SP_BLOCK_ACTIVE_ALLOCATED", B::SP_BLOCK_ACTIVE_ALLOCATED.0),
        (
            "SP_BLOCK_ACTIVE_PENDING_FREE",
            B::SP_BLOCK_ACTIVE_PENDING_FREE.0,
        ),
    ] {
        enums.push((name.to_string(), v));
    }
    let mut want = Vec::new();
    let mut c = String::from(
        "#include <stddef.h>\n#include <stdio.h>\n#include \"slotpool.h\"\nint main(void) {\n",
    );
    for (ty, size, fields) in &layouts {
        want.push(format!("{ty} {size}"));
        c += &format!("  printf(\"{ty} %zu\\n\", sizeof({ty}));\n");
        for (f, off) in fields {
            want.push(format!("{ty}.{f} {off}"));
            c += &format!("  printf(\"{ty}.{f} %zu\\n\", offsetof({ty}, {f}));\n");
        }
    }
    for (name, v) in &enums {
        want.push(format!("{name} {v}"));
        c += &format!("  printf(\"{name} %d\\n\", (int){name});\n");
    }
    c += "  return 0;\n}\n";
    if !have_tool("cc") {
        return;
    }
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("header-layout");
    std::fs::create_dir_all(&dir).unwrap();
    let (src, exe) = (dir.join("layout.c"), dir.join("layout"));
    std::fs::write(&src, c).unwrap();
    compile(
        Command::new("cc")
            .args(["-std=c11", "-Wall", "-Werror", "-I"])
            .arg(repo_root().join("include"))
            .arg(&src)
            .arg("-o")
            .arg(&exe),
        "cc layout.c",
    );
    let out = Command::new(&exe).output().unwrap();
    assert!(out.status.success());
    let got: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    assert_eq!(got, want, "slotpool.h (left) vs slotpool-abi (right)");
    assert!(want.len() > 100, "{} facts compared", want.len());
}
