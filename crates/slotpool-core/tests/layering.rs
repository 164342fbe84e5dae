//! The core's top-level modules form a chain: each may use only the modules ranked below it, so
//! no two of them import each other, directly or around a loop. Read from the source: every
//! `crate::` path outside comments, strings and test code, named by the module it starts with
//! (or, for a name that `lib.rs` re-exports, the module it comes from).
//!
//! A new module takes its place in [`CHAIN`]; an import against the chain fails this test with
//! the file and the path that takes it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The core's top-level modules, lowest first: a module may use only those before it.
const CHAIN: &[&str] = &[
    // Leaves: types and containers with no state machine of their own.
    "device",
    "policy",
    "pool",
    "sync",
    "stats",
    "peak",
    "id_slab",
    "paged",
    "block",
    "counted",
    "error",
    "history",
    "route",
    "config",
    "layers",
    "block_slab",
    "free_index",
    "live_map",
    "snapshot",
    "checkpoint",
    "env",
    // The `&mut self` state machines, fed by an `Env`.
    "arena",
    "shard",
    // The thread-safe allocator over them.
    "allocator",
];

/// Paths against the chain that are allowed, each with its reason: (module, path after
/// `crate::`). Each must still be taken somewhere, so that it leaves the list once it is not.
/// None is: no module uses one ranked above it.
const ALLOWED: &[(&str, &str, &str)] = &[];

/// One `crate::` path: the module that takes it, the file, and the path.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Use {
    from: String,
    file: String,
    path: String,
}

/// `text` without comments and string literals (each replaced by a space; line breaks kept).
fn code_only(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
            i += 2;
            while i < b.len() && !(b[i] == b'*' && b.get(i + 1) == Some(&b'/')) {
                if b[i] == b'\n' {
                    out.push('\n');
                }
                i += 1;
            }
            i += 2;
            out.push(' ');
        } else if b[i] == b'"' {
            // A raw string `r"..."` / `r#"..."#` has no escapes; a plain one does.
            let raw = i > 0 && (b[i - 1] == b'r' || b[i - 1] == b'#');
            let hashes = if raw {
                b[..i].iter().rev().take_while(|&&c| c == b'#').count()
            } else {
                0
            };
            i += 1;
            loop {
                if i >= b.len() {
                    break;
                }
                if !raw && b[i] == b'\\' {
                    i += 2;
                    continue;
                }
                if b[i] == b'"' && b[i + 1..].iter().take(hashes).all(|&c| c == b'#') {
                    i += 1 + hashes;
                    break;
                }
                if b[i] == b'\n' {
                    out.push('\n');
                }
                i += 1;
            }
            out.push_str("\"\"");
        } else if b[i] == b'\'' && b.get(i + 1) == Some(&b'\\') {
            // An escaped character literal such as '\"'.
            let close = b[i + 3..]
                .iter()
                .position(|&c| c == b'\'')
                .map_or(b.len(), |p| i + 4 + p);
            out.push_str("' '");
            i = close;
        } else if b[i] == b'\'' && b.get(i + 2) == Some(&b'\'') {
            // A one-character literal such as '{' (lifetimes have no closing quote).
            out.push_str("' '");
            i += 3;
        } else {
            let c = text[i..].chars().next().unwrap();
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// `code` without `#[cfg(test)] mod NAME { ... }` blocks.
fn without_test_modules(code: &str) -> String {
    let mut out = String::new();
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let after = &rest[at + "#[cfg(test)]".len()..];
        let trimmed = after.trim_start();
        let is_mod_block = (trimmed.starts_with("mod ") || trimmed.starts_with("pub mod "))
            && trimmed
                .find('{')
                .is_some_and(|b| !trimmed[..b].contains(';'));
        if !is_mod_block {
            out.push_str("#[cfg(test)]");
            rest = after;
            continue;
        }
        let open = after.find('{').unwrap();
        let mut depth = 0;
        let mut end = after.len();
        for (k, c) in after[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + k + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

fn ident_at(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// `a::b::C` at the start of `s` (a path whose segments are identifiers).
fn path_at(s: &str) -> String {
    let mut out = String::new();
    let mut rest = s;
    loop {
        let id = ident_at(rest);
        if id.is_empty() {
            break;
        }
        if !out.is_empty() {
            out.push_str("::");
        }
        out.push_str(id);
        rest = &rest[id.len()..];
        match rest.strip_prefix("::") {
            Some(r) if r.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_') => rest = r,
            _ => break,
        }
    }
    out
}

/// The paths after each `crate::` of `code`; a group `crate::{a::B, c}` gives each member.
fn crate_paths(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().next_back();
        rest = &rest[at + "crate::".len()..];
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            continue; // `slotpool_core::...` and the like
        }
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 1;
            let mut start = 0;
            let mut member = |m: &str| {
                if !m.trim().is_empty() {
                    out.push(path_at(m.trim()));
                }
            };
            for (k, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            member(&group[start..k]);
                            break;
                        }
                    }
                    ',' if depth == 1 => {
                        member(&group[start..k]);
                        start = k + 1;
                    }
                    _ => {}
                }
            }
        } else {
            out.push(path_at(rest));
        }
    }
    out
}

/// The modules `lib.rs` declares, and the module each name it re-exports at the root comes
/// from.
fn root(lib: &str) -> (Vec<String>, BTreeMap<String, String>) {
    let code = code_only(lib);
    let mut mods = Vec::new();
    let mut names = BTreeMap::new();
    for stmt in code.split(';') {
        // Attributes (`#![forbid(..)]`, `#[cfg(..)]`) ride on the statement after them.
        let stmt: Vec<&str> = stmt
            .lines()
            .filter(|l| !l.trim_start().starts_with('#'))
            .collect();
        let stmt = stmt.join("\n");
        let s = stmt.trim();
        let s = s.strip_prefix("pub ").unwrap_or(s);
        if let Some(m) = s.strip_prefix("mod ") {
            mods.push(m.trim().to_string());
        } else if let Some(u) = s.strip_prefix("use ") {
            let u = u.trim();
            let module = ident_at(u).to_string();
            let tail = u[module.len()..].trim_start_matches("::");
            let listed = tail.trim_start_matches('{').trim_end_matches('}');
            for item in listed.split(',') {
                let last = item.trim().rsplit("::").next().unwrap_or("");
                let name = ident_at(last.trim());
                if !name.is_empty() {
                    names.insert(name.to_string(), module.clone());
                }
            }
        }
    }
    (mods, names)
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Every `crate::` path of the product code under `src` (test files and test modules aside).
fn uses(src: &Path) -> Vec<Use> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    files.sort();
    let mut out = Vec::new();
    for f in files {
        let rel = f.strip_prefix(src).unwrap();
        let name = rel.to_string_lossy().replace('\\', "/");
        if name == "lib.rs"
            || rel.file_name().is_some_and(|n| n == "tests.rs")
            || rel.components().any(|c| c.as_os_str() == "tests")
        {
            continue;
        }
        let first = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy();
        let from = first.trim_end_matches(".rs").to_string();
        let code = without_test_modules(&code_only(&std::fs::read_to_string(&f).unwrap()));
        for path in crate_paths(&code) {
            out.push(Use {
                from: from.clone(),
                file: name.clone(),
                path,
            });
        }
    }
    out
}

/// The uses against `chain`: a module using itself is fine, one ranked below it too. Returns
/// the violations and, for each allowed path, whether some use took it.
fn against_chain(
    chain: &[&str],
    allowed: &[(&str, &str, &str)],
    names: &BTreeMap<String, String>,
    uses: &[Use],
) -> (Vec<String>, Vec<bool>) {
    let rank = |m: &str| chain.iter().position(|c| *c == m);
    let mut bad = Vec::new();
    let mut taken = vec![false; allowed.len()];
    for u in uses {
        let head = ident_at(&u.path);
        let to = if rank(head).is_some() {
            head.to_string()
        } else if let Some(m) = names.get(head) {
            m.clone()
        } else {
            continue; // a macro or a name of the root itself
        };
        if to == u.from {
            continue;
        }
        let (Some(rf), Some(rt)) = (rank(&u.from), rank(&to)) else {
            bad.push(format!(
                "{}: module {} or {to} is not in CHAIN",
                u.file, u.from
            ));
            continue;
        };
        if rt < rf {
            continue;
        }
        if let Some(k) = allowed
            .iter()
            .position(|(m, p, _)| *m == u.from && *p == u.path)
        {
            taken[k] = true;
            continue;
        }
        bad.push(format!(
            "{}: `crate::{}` makes {} (rank {rf}) use {to} (rank {rt})",
            u.file, u.path, u.from
        ));
    }
    (bad, taken)
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

#[test]
fn the_core_modules_form_a_chain() {
    let src = src();
    let (mods, names) = root(&std::fs::read_to_string(src.join("lib.rs")).unwrap());
    let mut listed: Vec<&str> = CHAIN.to_vec();
    listed.sort_unstable();
    let mut declared: Vec<&str> = mods.iter().map(String::as_str).collect();
    declared.sort_unstable();
    assert_eq!(
        declared, listed,
        "every module lib.rs declares has one place in CHAIN"
    );
    let uses = uses(&src);
    assert!(
        uses.len() > 100,
        "the reader found only {} crate paths",
        uses.len()
    );
    let (bad, taken) = against_chain(CHAIN, ALLOWED, &names, &uses);
    assert!(
        bad.is_empty(),
        "imports against the chain:\n{}",
        bad.join("\n")
    );
    for ((m, p, why), t) in ALLOWED.iter().zip(taken) {
        assert!(
            t,
            "{m} no longer uses crate::{p} ({why}): drop it from ALLOWED"
        );
    }
}

/// The reader sees what it must and nothing else: a back edge in code is caught (in a group,
/// through a root re-export), the same path in a comment, a string or a test module is not.
#[test]
fn a_back_edge_is_caught() {
    let names: BTreeMap<String, String> = [("Allocator".to_string(), "allocator".to_string())]
        .into_iter()
        .collect();
    let source = r##"
        //! [`crate::allocator::Allocator`] in a doc comment
        use crate::{device::DevicePtr, pool::PoolId};
        /* crate::allocator in a block comment */
        const S: &str = "crate::allocator::Allocator";
        const R: &str = r#"crate::allocator"#;
        fn f(x: crate::Allocator) {}
        #[cfg(test)]
        mod tests {
            use crate::allocator::Allocator;
            fn g() { let _ = '{'; }
        }
        fn h() -> crate::shard::Shard { todo!() }
    "##;
    let code = without_test_modules(&code_only(source));
    let paths = crate_paths(&code);
    assert_eq!(
        paths,
        [
            "device::DevicePtr",
            "pool::PoolId",
            "Allocator",
            "shard::Shard"
        ]
    );
    let uses: Vec<Use> = paths
        .into_iter()
        .map(|path| Use {
            from: "shard".into(),
            file: "shard/x.rs".into(),
            path,
        })
        .collect();
    let chain = ["device", "pool", "shard", "allocator"];
    let (bad, _) = against_chain(&chain, &[], &names, &uses);
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert!(bad[0].contains("`crate::Allocator` makes shard (rank 2) use allocator (rank 3)"));
    // A leaf using a module above it is caught the same way.
    let leaf = [Use {
        from: "device".into(),
        file: "device.rs".into(),
        path: "pool::PoolId".into(),
    }];
    assert_eq!(against_chain(&chain, &[], &names, &leaf).0.len(), 1);
    // An allowed path passes and is reported taken.
    let allowed = [("shard", "Allocator", "test")];
    let (bad, taken) = against_chain(&chain, &allowed, &names, &uses);
    assert!(bad.is_empty() && taken == [true], "{bad:?}");
}
