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
    assert!(large.status.success());
    assert!(
        maps(&large) * 3 < maps(&slack),
        "{} vs {}",
        maps(&large),
        maps(&slack)
    );
    let bad = run("no_such_key:1");
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--conf"));
}
