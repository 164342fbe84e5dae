//! The `slotpool` binary, run as a user would.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn slotpool(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_slotpool"))
        .args(args)
        .output()
        .expect("run slotpool")
}

fn gpt2() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../benches/traces/gpt2_train.trace.csv.gz")
        .display()
        .to_string()
}

fn temp_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("slotpool-cli-bin-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn replay_json() {
    for mode in ["vmm", "classic"] {
        let out = slotpool(&["replay", &gpt2(), "--mode", mode, "--json"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8(out.stdout).unwrap();
        assert_eq!(stdout.lines().count(), 1, "one JSON object: {stdout}");
        let json: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        for key in [
            "trace",
            "mode",
            "events",
            "skipped_frees",
            "peak_allocated",
            "peak_reserved",
            "ratio",
            "torch_peak_reserved",
            "ns_per_alloc",
            "ns_per_free",
        ] {
            assert!(json.get(key).is_some(), "missing {key}: {json}");
        }
        assert!(json.get("timeline").is_none());
        assert_eq!(json["trace"], "gpt2_train");
        assert_eq!(json["mode"], mode);
        assert_eq!(json["events"], 22_081);
        assert_eq!(json["skipped_frees"], 0);
        let ratio = json["ratio"].as_f64().unwrap();
        assert!(ratio >= 1.0, "{ratio}");
        assert!(json["torch_peak_reserved"].as_u64().unwrap() > 15_000_000_000);
        // No progress bar when asked for JSON (and stderr is not a terminal here anyway).
        assert!(
            out.stderr.is_empty(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn replay_json_timeline_and_plot() {
    let dir = temp_dir("plot");
    let svg = dir.join("out.svg");
    let out = slotpool(&[
        "replay",
        &gpt2(),
        "--json",
        "--timeline",
        "--plot",
        svg.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let timeline = json["timeline"].as_array().unwrap();
    assert!(!timeline.is_empty() && timeline.len() <= 2000);
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.contains("<svg") && text.contains(r#"id="reserved""#));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn replay_table() {
    let out = slotpool(&["replay", &gpt2()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    println!("{stdout}");
    for label in [
        "trace",
        "events",
        "peak allocated",
        "peak reserved",
        "ratio",
        "torch peak reserved",
        "torch ratio",
        "ns/alloc",
        "ns/free",
    ] {
        assert!(
            stdout.lines().any(|l| l.starts_with(label)),
            "no {label} row:\n{stdout}"
        );
    }
    assert!(stdout.contains("22,081"));
    assert!(stdout.contains(" GB"));
    // Values start in one column.
    let cols: Vec<usize> = stdout
        .lines()
        .map(|l| {
            l.find("  ")
                .map(|i| i + l[i..].find(|c: char| c != ' ').unwrap())
                .unwrap()
        })
        .collect();
    assert!(cols.windows(2).all(|w| w[0] == w[1]), "{cols:?}");
}

#[test]
fn errors_exit_2() {
    let dir = temp_dir("errors");
    let bad = dir.join("bad.csv");
    std::fs::write(&bad, "action,addr,size,stream\nalloc,1,2,0\nalloc,x,2,0\n").unwrap();
    let out = slotpool(&["replay", bad.to_str().unwrap(), "--json"]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(stderr.starts_with("error: "), "{stderr}");
    assert!(
        stderr.contains("bad.csv") && stderr.contains("line 3"),
        "{stderr}"
    );
    assert!(out.stdout.is_empty());

    let out = slotpool(&["replay", dir.join("missing.csv").to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).starts_with("error: "));

    // Usage errors (clap) also exit 2.
    let out = slotpool(&["replay", &gpt2(), "--mode", "turbo"]);
    assert_eq!(out.status.code(), Some(2));
    let out = slotpool(&[]);
    assert_eq!(out.status.code(), Some(2));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn skipped_frees_warn_on_stderr() {
    let dir = temp_dir("warn");
    let p = dir.join("t.csv");
    std::fs::write(
        &p,
        "action,addr,size,stream\nfree_completed,5,10,0\nalloc,1,10,0\n",
    )
    .unwrap();
    let out = slotpool(&["replay", p.to_str().unwrap(), "--json"]);
    assert!(out.status.success());
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["skipped_frees"], 1);
    assert!(String::from_utf8_lossy(&out.stderr).contains("warning: 1 free(s)"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn replay_takes_a_configuration_and_refuses_a_bad_one() {
    let trace = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../benches/traces/gpt2_train.trace.csv.gz"
    );
    let run = |conf: &str| {
        Command::new(env!("CARGO_BIN_EXE_slotpool"))
            .args(["replay", trace, "--json", "--conf", conf])
            .output()
            .expect("run slotpool")
    };
    let peak = |out: &Output| -> u64 {
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        v["peak_reserved"].as_u64().expect("peak_reserved")
    };
    let exact = run("vmm_slack_percent:0");
    let slack = run("vmm_slack_percent:8");
    assert!(exact.status.success() && slack.status.success());
    // Slack keeps idle pages mapped instead of moving them: more reserved, fewer driver calls.
    assert!(
        peak(&slack) > peak(&exact),
        "{} vs {}",
        peak(&slack),
        peak(&exact)
    );
    // Larger pages: the simulated device is built with them, and growth needs a quarter of the
    // map calls.
    let maps = |out: &Output| -> u64 {
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        v["backend_calls"]["map"].as_u64().expect("map calls")
    };
    let large = run("vmm_slack_percent:8,vmm_page_mb:8");
    let small = run("vmm_slack_percent:8,vmm_page_mb:2");
    assert!(large.status.success() && small.status.success());
    assert!(
        maps(&large) * 3 < maps(&small),
        "{} vs {}",
        maps(&large),
        maps(&small)
    );
    let bad = run("no_such_key:1");
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--conf"));
}

// ---------------------------------------------------------------------------------------------
// Honest flags, configuration layers, warnings, inputs

fn trace_file(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../benches/traces")
        .join(name)
        .display()
        .to_string()
}

/// Runs slotpool with `env` set (and SLOTPOOL_CONF / SLOTPOOL_LOG cleared unless given) and
/// `stdin` piped in.
fn slotpool_with(args: &[&str], env: &[(&str, &str)], stdin: Option<Vec<u8>>) -> Output {
    use std::io::Write;
    use std::process::Stdio;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_slotpool"));
    cmd.args(args)
        .env_remove("SLOTPOOL_CONF")
        .env_remove("SLOTPOOL_LOG")
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("run slotpool");
    if let Some(bytes) = stdin {
        let mut pipe = child.stdin.take().unwrap();
        std::thread::spawn(move || {
            let _ = pipe.write_all(&bytes);
        });
    }
    child.wait_with_output().expect("wait for slotpool")
}

fn stderr_of(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn json_of(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "{}", stderr_of(out));
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

/// A refused invocation: exit status 2, nothing on stdout, one line on stderr naming `words`.
fn assert_refused(out: &Output, words: &[&str]) {
    let err = stderr_of(out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(err.starts_with("error: "), "{err}");
    for w in words {
        assert!(err.contains(w), "no {w:?} in {err}");
    }
}

#[test]
fn conflicting_flags_are_refused() {
    let g = gpt2();
    let v = trace_file("graph_variants_separate.trace.csv.gz");
    let none: &[(&str, &str)] = &[];
    for (args, env, words) in [
        (
            vec!["replay", &v, "--variants", "group", "--mode", "classic"],
            none,
            &["--variants", "--mode"][..],
        ),
        (
            vec![
                "replay",
                &v,
                "--variants",
                "shared",
                "--conf",
                "growth:classic",
            ],
            none,
            &["--variants", "--conf"],
        ),
        (
            vec!["replay", &v, "--variants", "separate"],
            &[("SLOTPOOL_CONF", "growth:classic")][..],
            &["--variants", "SLOTPOOL_CONF"],
        ),
        (
            vec!["replay", &g, "--mode", "vmm", "--conf", "growth:classic"],
            none,
            &["--mode vmm", "--conf", "classic"],
        ),
        (
            vec![
                "replay",
                &g,
                "--mode",
                "classic",
                "--conf",
                "expandable_segments:True",
            ],
            none,
            &["--mode classic", "--conf", "vmm"],
        ),
    ] {
        assert_refused(&slotpool_with(&args, env, None), words);
    }
    // Agreeing layers are fine, and --mode wins over the environment's growth.
    let out = slotpool_with(
        &[
            "replay",
            &g,
            "--json",
            "--mode",
            "classic",
            "--conf",
            "growth:classic",
        ],
        none,
        None,
    );
    assert_eq!(json_of(&out)["config"]["growth"], "classic");
    let out = slotpool_with(
        &["replay", &g, "--json", "--mode", "vmm"],
        &[("SLOTPOOL_CONF", "growth:classic")],
        None,
    );
    let json = json_of(&out);
    assert_eq!(
        (&json["mode"], &json["config"]["growth"]),
        (&"vmm".into(), &"vmm".into())
    );
}

#[test]
fn json_echoes_the_configuration_and_slotpool_conf_is_a_layer() {
    let g = gpt2();
    let plain = json_of(&slotpool_with(&["replay", &g, "--json"], &[], None));
    let config = plain["config"].as_object().expect("config object");
    for key in [
        "growth",
        "max_split_size_mb",
        "max_non_split_rounding_mb",
        "large_segment_size_mb",
        "roundup_power2_divisions",
        "memory_limit_mb",
        "per_process_memory_fraction",
        "vmm_reservation_mb",
        "vmm_slack_percent",
        "vmm_slack_base_mb",
        "vmm_page_mb",
        "garbage_collection_threshold",
    ] {
        assert!(config.contains_key(key), "no {key} in {config:?}");
    }
    assert_eq!(plain["warnings"], serde_json::json!([]));
    let env = [(
        "SLOTPOOL_CONF",
        "vmm_slack_percent:8,memory_limit_mb:100000",
    )];
    let slack = json_of(&slotpool_with(&["replay", &g, "--json"], &env, None));
    assert_eq!(slack["config"]["vmm_slack_percent"], "8");
    assert_eq!(slack["config"]["memory_limit_mb"], "100000");
    assert!(slack["peak_reserved"].as_u64() > plain["peak_reserved"].as_u64());
    // --conf over SLOTPOOL_CONF: the key it gives wins, the others stay.
    let over = json_of(&slotpool_with(
        &["replay", &g, "--json", "--conf", "vmm_slack_percent:0"],
        &env,
        None,
    ));
    assert_eq!(over["config"]["vmm_slack_percent"], "0");
    assert_eq!(over["config"]["memory_limit_mb"], "100000");
    assert_eq!(over["peak_reserved"], plain["peak_reserved"]);
    // A bad SLOTPOOL_CONF is named.
    let bad = slotpool_with(&["replay", &g], &[("SLOTPOOL_CONF", "bogus:1")], None);
    assert_refused(&bad, &["SLOTPOOL_CONF", "bogus"]);
    // The variant replay echoes its configuration too.
    let v = trace_file("graph_variants_single0.trace.csv.gz");
    let out = slotpool_with(
        &[
            "replay",
            &v,
            "--variants",
            "group",
            "--conf",
            "vmm_page_mb:8",
        ],
        &[],
        None,
    );
    assert_eq!(json_of(&out)["config"]["vmm_page_mb"], "8");
}

#[test]
fn slotpool_log_turns_logging_on_without_colours() {
    let g = gpt2();
    let quiet = slotpool_with(&["replay", &g, "--json"], &[], None);
    assert!(quiet.stderr.is_empty(), "{}", stderr_of(&quiet));
    let out = slotpool_with(&["replay", &g, "--json"], &[("SLOTPOOL_LOG", "info")], None);
    assert!(out.status.success());
    let err = stderr_of(&out);
    assert!(
        err.contains("configuration") && err.contains("growth:vmm"),
        "{err}"
    );
    assert!(!err.contains('\u{1b}'), "ANSI codes on a pipe: {err:?}");
    serde_json::from_slice::<serde_json::Value>(&out.stdout).expect("stdout stays JSON");
}

#[test]
fn marker_traces_replayed_plainly_warn() {
    let v = trace_file("graph_variants_separate.trace.csv.gz");
    let out = slotpool_with(&["replay", &v, "--json"], &[], None);
    let json = json_of(&out);
    let warnings = json["warnings"].as_array().unwrap();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    let w = warnings[0].as_str().unwrap();
    assert!(
        w.contains("4 variant and 8 capture markers") && w.contains("--variants"),
        "{w}"
    );
    let err = stderr_of(&out);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert_eq!(err.trim_end(), format!("warning: {w}"));
    // The table says it too; --variants does not warn.
    let table = slotpool_with(&["replay", &v], &[], None);
    assert!(stderr_of(&table).contains("--variants"));
    let grouped = slotpool_with(&["replay", &v, "--variants", "group"], &[], None);
    assert_eq!(json_of(&grouped)["warnings"], serde_json::json!([]));
    assert!(grouped.stderr.is_empty(), "{}", stderr_of(&grouped));
}

#[test]
fn dash_reads_standard_input() {
    let g = gpt2();
    let from_file = json_of(&slotpool_with(&["replay", &g, "--json"], &[], None));
    for bytes in [std::fs::read(&g).unwrap(), {
        use std::io::Read;
        let mut text = Vec::new();
        flate2::read::GzDecoder::new(std::fs::File::open(&g).unwrap())
            .read_to_end(&mut text)
            .unwrap();
        text
    }] {
        let out = slotpool_with(&["replay", "-", "--json"], &[], Some(bytes));
        let json = json_of(&out);
        assert_eq!(json["events"], 22_081);
        assert_eq!(json["source"], "<stdin>");
        assert_eq!(json["peak_reserved"], from_file["peak_reserved"]);
        assert_eq!(
            json["torch_peak_reserved"],
            from_file["torch_peak_reserved"]
        );
    }
    let pickle = std::fs::read(trace_file("snapshots/plain.pickle.gz")).unwrap();
    let out = slotpool_with(&["replay", "-", "--json"], &[], Some(pickle));
    assert_eq!(json_of(&out)["events"], 964);
    let out = slotpool_with(&["replay", "-"], &[], Some(b"not a trace".to_vec()));
    assert_refused(&out, &["<stdin>", "unknown trace format"]);
}

#[test]
fn device_is_checked() {
    let g = gpt2();
    let p = trace_file("snapshots/plain.pickle.gz");
    assert_refused(
        &slotpool_with(&["replay", &g, "--device", "1"], &[], None),
        &["device 1", "one device, 0"],
    );
    assert_refused(
        &slotpool_with(&["replay", &p, "--device", "5"], &[], None),
        &["device 5", "plain.pickle.gz", "one device, 0"],
    );
    // Not a device number: clap's usage error (its first line says what is wrong).
    for bad in ["--device=-1", "--device=x"] {
        let out = slotpool_with(&["replay", &p, bad], &[], None);
        assert_eq!(out.status.code(), Some(2));
        let err = stderr_of(&out);
        let first = err.lines().next().unwrap_or_default();
        assert!(
            first.starts_with("error: ") && first.contains("--device"),
            "{err}"
        );
    }
    let ok = slotpool_with(&["replay", &p, "--device", "0", "--json"], &[], None);
    assert_eq!(json_of(&ok)["events"], 964);
    let ok = slotpool_with(&["replay", &g, "--device", "0", "--json"], &[], None);
    assert_eq!(json_of(&ok)["events"], 22_081);
}

#[test]
fn unknown_commands_and_actions_list_the_valid_ones() {
    assert_refused(
        &slotpool_with(&["frobnicate"], &[], None),
        &["frobnicate", "replay"],
    );
    let dir = temp_dir("actions");
    let p = dir.join("t.csv");
    std::fs::write(&p, "action,addr,size,stream\nalloc,1,2,0\nmalloc,1,2,0\n").unwrap();
    let out = slotpool_with(&["replay", p.to_str().unwrap()], &[], None);
    assert_refused(
        &out,
        &[
            "line 3",
            "`malloc`",
            "alloc, free_requested, free_completed",
            "capture_end",
        ],
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn help_documents_the_trace_format_and_the_layers() {
    let out = slotpool_with(&["replay", "--help"], &[], None);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    for w in [
        "TRACE FORMATS",
        "action,addr,size,stream",
        "_dump_snapshot",
        "variant_begin",
        "SLOTPOOL_CONF, then --conf, then --mode",
        "SLOTPOOL_LOG",
        "`-` reads standard input",
    ] {
        assert!(text.contains(w), "no {w:?} in --help:\n{text}");
    }
}

#[test]
fn plot_draws_pytorch_and_the_phases() {
    let dir = temp_dir("plot-torch");
    let svg = |trace: &str, name: &str| {
        let path = dir.join(name);
        let out = slotpool_with(
            &["replay", trace, "--plot", path.to_str().unwrap()],
            &[],
            None,
        );
        assert!(out.status.success(), "{}", stderr_of(&out));
        std::fs::read_to_string(&path).unwrap()
    };
    // gpt2_train keeps segment allocations only: the curve is drawn and labelled so.
    let text = svg(&gpt2(), "gpt2.svg");
    assert!(text.contains(r#"id="torch_reserved""#));
    assert!(text.contains("records no releases"));
    assert!(!text.contains(r#"class="capture""#));
    // A snapshot records releases.
    let text = svg(&trace_file("snapshots/plain.pickle.gz"), "plain.svg");
    assert!(text.contains(r#"id="torch_reserved""#) && text.contains("segment events"));
    assert!(!text.contains("records no releases"));
    // The variant trace: 8 captures shaded, 4 variants marked.
    let text = svg(
        &trace_file("graph_variants_separate.trace.csv.gz"),
        "variants.svg",
    );
    assert_eq!(text.matches(r#"class="capture""#).count(), 8);
    assert_eq!(text.matches(r#"class="variant""#).count(), 4);
    assert!(text.contains("variant 3"));
    let _ = std::fs::remove_dir_all(&dir);
}
