//! Allocator configuration, parsed from PyTorch-style `key:value,key:[a,b]` strings (our own
//! variable, `SLOTPOOL_CONF`: PyTorch rejects unknown keys in its own).

use crate::policy::{ROUNDUP_BUCKETS, SizePolicy};

/// How the allocator obtains device memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub enum GrowthMode {
    /// One backend allocation per segment, with PyTorch's segment sizes.
    Classic,
    /// One virtual reservation per pool, stream and size class; physical 2 MiB pages mapped on
    /// demand and unmapped when they fall idle.
    #[default]
    Vmm,
}

/// Everything configurable about one device's allocator.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub growth: GrowthMode,
    pub policy: SizePolicy,
    /// Hard cap on physical bytes held (`None`: the device's memory). `memory_limit_mb:0` is
    /// `None`, as `Allocator::set_memory_limit(0)` removes the cap ([`limit_from_bytes`]).
    pub memory_limit: Option<u64>,
    /// Cap as a fraction of device memory (`set_per_process_memory_fraction`).
    pub memory_fraction: Option<f64>,
    /// Size of each vmm reservation (`None`: the device's total memory).
    pub vmm_reservation: Option<u64>,
    /// Idle mapped memory a vmm shard keeps before aliasing or moving idle pages, in percent of
    /// its live bytes (0, the default: physical memory follows live bytes, and page aliasing
    /// keeps a training loop's steady state free of page calls; a percentage prefers new pages
    /// within it, at that much more memory).
    pub vmm_slack_percent: f64,
    /// Idle mapped memory a vmm shard keeps on top of `vmm_slack_percent`, whatever its live
    /// bytes (default 64 MiB; only while the percentage is set). A workload with little live
    /// memory and large blocks of shifting sizes moves pages unless this covers a few blocks.
    pub vmm_slack_base: u64,
    /// Physical page size of vmm growth (default [`DEFAULT_VMM_PAGE`]; `None`: the device's
    /// granularity, 2 MiB). Growth costs
    /// about the same per driver call whatever the page size (H200: ~33 us to create, map and
    /// open a page of 2 to 128 MiB), so larger pages make growth proportionally cheaper, at the
    /// price of coarser physical accounting. A property of the device: applied where the
    /// backend is built (the C ABI's runtime, the replay), which checks it against the
    /// granularity.
    pub vmm_page_size: Option<u64>,
    /// PyTorch's `garbage_collection_threshold`: once a limit is set (a memory fraction or
    /// `memory_limit_mb`) and the device holds more than this fraction of it, a default-pool
    /// shard about to grow first releases its whole free classic large segments, oldest first
    /// (see `Shard::collect_garbage`). `None`: off, as in PyTorch.
    pub gc_threshold: Option<f64>,
}

/// The vmm page size every program starts from ([`Config::default`]): 4 MiB. With page
/// aliasing ([`crate::alias`]) a training loop makes no page call after its first iterations at
/// any page size, and 4 MiB pages halve the first iterations' growth calls and the stale slots a
/// shifting pattern leaves against the device's 2 MiB, for 0.1-0.2% more memory in rounding
/// (docs/design.md, "Memory at the program defaults").
pub const DEFAULT_VMM_PAGE: u64 = 4 * MIB;

/// The one set of defaults: `Config::default()` is what the replay without `--conf`, the C ABI,
/// `LD_PRELOAD` and `slotpool_torch` start from (configuration strings apply over it, key by key).
impl Default for Config {
    fn default() -> Self {
        Config {
            growth: GrowthMode::Vmm,
            policy: SizePolicy::default(),
            memory_limit: None,
            memory_fraction: None,
            vmm_reservation: None,
            vmm_slack_percent: 0.0,
            vmm_slack_base: 64 * MIB,
            vmm_page_size: Some(DEFAULT_VMM_PAGE),
            gc_threshold: None,
        }
    }
}

/// A configuration string was rejected; nothing was applied.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid slotpool configuration: {0}")]
pub struct ConfigError(pub String);

const MIB: u64 = 1 << 20;

/// Largest value of a `*_mb` key: 2^36 MiB, the 2^56 bytes of `MAX_REQUEST`. Anything above is
/// no size a device has (and near 2^44 MiB, no byte count a `u64` holds).
pub const MAX_MIB: u64 = crate::block::MAX_REQUEST / MIB;

/// Largest `roundup_power2_divisions` value: above it, no request up to `MAX_REQUEST` is large
/// enough to be divided (rounding divides sizes above 512 bytes times the divisions).
pub const MAX_DIVISIONS: u64 = crate::block::MAX_REQUEST / 512;

/// The cap a memory limit of `bytes` sets: 0 is no cap (`None`), anything else that many bytes.
/// The one meaning of a zero limit, for `memory_limit_mb` and `Allocator::set_memory_limit`.
pub fn limit_from_bytes(bytes: u64) -> Option<u64> {
    (bytes != 0).then_some(bytes)
}

impl Config {
    /// The keys [`Config::apply`] accepts.
    pub const KEYS: &'static [&'static str] = &[
        "growth",
        "expandable_segments",
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
    ];

    /// Parse a configuration string over the defaults.
    pub fn parse(s: &str) -> Result<Config, ConfigError> {
        let mut c = Config::default();
        c.apply(s)?;
        Ok(c)
    }

    /// Apply `key:value` pairs separated by commas; lists are `[a,b]` or `[256:1,>:4]`. Unknown
    /// keys are rejected by name, and on any error `self` is unchanged.
    pub fn apply(&mut self, s: &str) -> Result<(), ConfigError> {
        let mut next = self.clone();
        for (key, value) in split_pairs(s)? {
            next.set(&key, &value)?;
        }
        *self = next;
        Ok(())
    }

    fn set(&mut self, key: &str, value: &str) -> Result<(), ConfigError> {
        let bad = |what: &str| ConfigError(format!("{key}: {what} (got {value:?})"));
        let mb = |v: &str| -> Result<u64, ConfigError> {
            let n = v
                .parse::<u64>()
                .map_err(|_| bad("expected a whole number of MiB"))?;
            if n > MAX_MIB {
                return Err(bad(&format!("at most {MAX_MIB} MiB")));
            }
            Ok(n * MIB)
        };
        match key {
            "growth" => {
                self.growth = match value {
                    "vmm" => GrowthMode::Vmm,
                    "classic" => GrowthMode::Classic,
                    _ => return Err(bad("expected vmm or classic")),
                }
            }
            "expandable_segments" => {
                self.growth = match value {
                    "True" | "true" => GrowthMode::Vmm,
                    "False" | "false" => GrowthMode::Classic,
                    _ => return Err(bad("expected True or False")),
                }
            }
            "max_split_size_mb" => {
                let v = mb(value)?;
                if v < 20 * MIB {
                    return Err(bad("must be at least 20"));
                }
                self.policy.max_split_size = v;
            }
            "max_non_split_rounding_mb" => {
                let v = mb(value)?;
                if v < 20 * MIB {
                    return Err(bad("must be at least 20"));
                }
                self.policy.max_non_split_rounding = v;
            }
            "large_segment_size_mb" => {
                let v = mb(value)?;
                if v == 0 || v % (2 * MIB) != 0 {
                    return Err(bad("must be a positive multiple of 2"));
                }
                self.policy.large_segment_size = v;
            }
            "memory_limit_mb" => self.memory_limit = limit_from_bytes(mb(value)?),
            "vmm_reservation_mb" => {
                let v = mb(value)?;
                if v == 0 {
                    return Err(bad("must be positive"));
                }
                self.vmm_reservation = Some(v);
            }
            "vmm_slack_percent" => {
                let f: f64 = value.parse().map_err(|_| bad("expected a number"))?;
                if !(0.0..=1000.0).contains(&f) {
                    return Err(bad("must be in [0, 1000]"));
                }
                self.vmm_slack_percent = f;
            }
            "vmm_slack_base_mb" => {
                let v = mb(value)?;
                if v > 1 << 40 {
                    return Err(bad("must be at most 1048576"));
                }
                self.vmm_slack_base = v;
            }
            "vmm_page_mb" => {
                let v = mb(value)?;
                if !(2 * MIB..=1024 * MIB).contains(&v) || !v.is_power_of_two() {
                    return Err(bad("must be a power of two from 2 to 1024"));
                }
                self.vmm_page_size = Some(v);
            }
            "per_process_memory_fraction" => {
                let f: f64 = value.parse().map_err(|_| bad("expected a number"))?;
                if !(f > 0.0 && f <= 1.0) {
                    return Err(bad("must be in (0, 1]"));
                }
                self.memory_fraction = Some(f);
            }
            "garbage_collection_threshold" => {
                let f: f64 = value.parse().map_err(|_| bad("expected a number"))?;
                // PyTorch's range: 0 and 1 are refused.
                if !(f > 0.0 && f < 1.0) {
                    return Err(bad("must be in (0, 1)"));
                }
                self.gc_threshold = Some(f);
            }
            "roundup_power2_divisions" => {
                self.policy.roundup_power2_divisions =
                    parse_divisions(value).map_err(|w| bad(&w))?;
            }
            _ => {
                return Err(ConfigError(format!(
                    "unknown key {key:?}; known keys: {}",
                    Self::KEYS.join(", ")
                )));
            }
        }
        Ok(())
    }
}

impl Config {
    /// Every setting as `(key, value)`, the value in the syntax [`Config::apply`] takes (sizes in
    /// MiB), or `None` where the setting is unset (no limit, the device's size, off). One entry
    /// per key of [`Config::KEYS`] except `expandable_segments`, which is `growth` by another
    /// name. A size that is not a whole number of MiB (possible only in a `Config` built in
    /// code) is rendered with a fraction, which `apply` refuses.
    pub fn settings(&self) -> Vec<(&'static str, Option<String>)> {
        let mb = |bytes: u64| {
            if bytes.is_multiple_of(MIB) {
                (bytes / MIB).to_string()
            } else {
                (bytes as f64 / MIB as f64).to_string()
            }
        };
        let p = &self.policy;
        let divisions = &p.roundup_power2_divisions;
        let divisions = if divisions.iter().all(|&d| d == divisions[0]) {
            divisions[0].to_string()
        } else {
            let items: Vec<String> = divisions.iter().map(u64::to_string).collect();
            format!("[{}]", items.join(","))
        };
        let growth = match self.growth {
            GrowthMode::Vmm => "vmm",
            GrowthMode::Classic => "classic",
        };
        vec![
            ("growth", Some(growth.to_string())),
            (
                "max_split_size_mb",
                (p.max_split_size != u64::MAX).then(|| mb(p.max_split_size)),
            ),
            (
                "max_non_split_rounding_mb",
                Some(mb(p.max_non_split_rounding)),
            ),
            ("large_segment_size_mb", Some(mb(p.large_segment_size))),
            ("roundup_power2_divisions", Some(divisions)),
            ("memory_limit_mb", self.memory_limit.map(mb)),
            (
                "per_process_memory_fraction",
                self.memory_fraction.map(|f| f.to_string()),
            ),
            ("vmm_reservation_mb", self.vmm_reservation.map(mb)),
            (
                "vmm_slack_percent",
                Some(self.vmm_slack_percent.to_string()),
            ),
            ("vmm_slack_base_mb", Some(mb(self.vmm_slack_base))),
            ("vmm_page_mb", self.vmm_page_size.map(mb)),
            (
                "garbage_collection_threshold",
                self.gc_threshold.map(|f| f.to_string()),
            ),
        ]
    }
}

/// The settings that are set, as `key:value,...`: [`Config::parse`] of it gives the same
/// configuration back.
impl std::fmt::Display for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut first = true;
        for (key, value) in self.settings() {
            if let Some(value) = value {
                if !first {
                    f.write_str(",")?;
                }
                first = false;
                write!(f, "{key}:{value}")?;
            }
        }
        Ok(())
    }
}

pub(crate) fn split_pairs(s: &str) -> Result<Vec<(String, String)>, ConfigError> {
    let mut out = Vec::new();
    let mut depth = 0i32;
    let mut cur = String::new();
    let mut parts = Vec::new();
    for ch in s.chars() {
        match ch {
            '[' => depth += 1,
            ']' => depth -= 1,
            _ => {}
        }
        if depth < 0 {
            return Err(ConfigError(format!("unbalanced ']' in {s:?}")));
        }
        if ch == ',' && depth == 0 {
            parts.push(std::mem::take(&mut cur));
        } else {
            cur.push(ch);
        }
    }
    if depth != 0 {
        return Err(ConfigError(format!("unbalanced '[' in {s:?}")));
    }
    parts.push(cur);
    for part in parts {
        let part = part.trim();
        if part.is_empty() {
            continue;
        }
        let (k, v) = part
            .split_once(':')
            .ok_or_else(|| ConfigError(format!("expected key:value, got {part:?}")))?;
        out.push((k.trim().to_string(), v.trim().to_string()));
    }
    Ok(out)
}

/// `4` (every bucket), or `[256:1,512:2,>:4]` (bucket upper bounds in MiB; `>` the rest), or a
/// plain list `[1,2,4,...]` per bucket. Values are powers of two or 0.
fn parse_divisions(v: &str) -> Result<[u64; ROUNDUP_BUCKETS], String> {
    let check = |d: u64| {
        if d > MAX_DIVISIONS {
            Err(format!("{d} is above {MAX_DIVISIONS}"))
        } else if d == 0 || d.is_power_of_two() {
            Ok(d)
        } else {
            Err(format!("{d} is not a power of two"))
        }
    };
    let num = |t: &str| {
        t.trim()
            .parse::<u64>()
            .map_err(|_| format!("{t:?} is not a number"))
    };
    let mut out = [0u64; ROUNDUP_BUCKETS];
    if !v.starts_with('[') {
        let d = check(num(v)?)?;
        return Ok([d; ROUNDUP_BUCKETS]);
    }
    let inner = v
        .strip_prefix('[')
        .and_then(|x| x.strip_suffix(']'))
        .ok_or("unbalanced list")?;
    let items: Vec<&str> = inner
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .collect();
    if items.iter().all(|t| !t.contains(':')) {
        if items.len() > ROUNDUP_BUCKETS {
            return Err(format!("at most {ROUNDUP_BUCKETS} values"));
        }
        for (i, t) in items.iter().enumerate() {
            out[i] = check(num(t)?)?;
        }
        return Ok(out);
    }
    let mut last = 0usize;
    for t in items {
        let (k, d) = t
            .split_once(':')
            .ok_or_else(|| format!("{t:?} is not size:divisions"))?;
        let d = check(num(d)?)?;
        if k.trim() == ">" {
            for slot in out.iter_mut().skip(last) {
                *slot = d;
            }
            last = ROUNDUP_BUCKETS;
            continue;
        }
        let mb = num(k)?;
        if !mb.is_power_of_two() {
            return Err(format!("{mb} is not a power of two"));
        }
        let bucket = (mb.trailing_zeros() as usize).min(ROUNDUP_BUCKETS - 1);
        for slot in out.iter_mut().take(bucket + 1).skip(last) {
            *slot = d;
        }
        last = bucket + 1;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_known_keys() {
        let c = Config::parse(
            "growth:classic, max_split_size_mb:64,roundup_power2_divisions:[256:1,512:2,>:4],memory_limit_mb:100",
        )
        .unwrap();
        assert_eq!(c.growth, GrowthMode::Classic);
        assert_eq!(c.policy.max_split_size, 64 * MIB);
        assert_eq!(c.memory_limit, Some(100 * MIB));
        assert_eq!(c.policy.roundup_power2_divisions[0], 1);
        assert_eq!(c.policy.roundup_power2_divisions[8], 1);
        assert_eq!(c.policy.roundup_power2_divisions[9], 2);
        assert_eq!(c.policy.roundup_power2_divisions[15], 4);
        let c = Config::parse("roundup_power2_divisions:4,expandable_segments:True").unwrap();
        assert_eq!(c.policy.roundup_power2_divisions, [4; ROUNDUP_BUCKETS]);
        assert_eq!(c.growth, GrowthMode::Vmm);
        assert_eq!(
            Config::parse("vmm_page_mb:8").unwrap().vmm_page_size,
            Some(8 * MIB)
        );
        assert_eq!(Config::default().vmm_page_size, Some(DEFAULT_VMM_PAGE));
        assert_eq!(Config::default().vmm_slack_base, 64 * MIB);
        assert_eq!(
            Config::parse("vmm_slack_base_mb:256")
                .unwrap()
                .vmm_slack_base,
            256 * MIB
        );
    }

    #[test]
    fn renders_every_key_and_parses_back() {
        let keys: Vec<&str> = Config::default().settings().iter().map(|s| s.0).collect();
        let expected: Vec<&str> = Config::KEYS
            .iter()
            .copied()
            .filter(|k| *k != "expandable_segments")
            .collect();
        assert_eq!(keys, expected);
        for s in [
            "",
            "growth:classic",
            "max_split_size_mb:64,roundup_power2_divisions:[256:1,512:2,>:4],memory_limit_mb:100",
            "roundup_power2_divisions:4,per_process_memory_fraction:0.25,vmm_reservation_mb:4096",
            "vmm_slack_percent:7.5,vmm_slack_base_mb:128,vmm_page_mb:16",
            "garbage_collection_threshold:0.6,large_segment_size_mb:64,max_non_split_rounding_mb:32",
        ] {
            let c = Config::parse(s).unwrap();
            let text = c.to_string();
            assert_eq!(Config::parse(&text).unwrap(), c, "{s} rendered as {text}");
        }
        let c = Config::parse("memory_limit_mb:100,vmm_slack_percent:8").unwrap();
        let settings = c.settings();
        let get = |k: &str| settings.iter().find(|s| s.0 == k).unwrap().1.clone();
        assert_eq!(get("memory_limit_mb").as_deref(), Some("100"));
        assert_eq!(get("vmm_slack_percent").as_deref(), Some("8"));
        assert_eq!(get("max_split_size_mb"), None);
        assert_eq!(get("growth").as_deref(), Some("vmm"));
    }

    #[test]
    fn rejects_bad_input_and_changes_nothing() {
        let mut c = Config::default();
        let e = c.apply("growth:classic,bogus_key:1").unwrap_err();
        assert!(e.0.contains("bogus_key"), "{e}");
        assert_eq!(c, Config::default());
        assert!(Config::parse("max_split_size_mb:10").is_err());
        assert!(Config::parse("roundup_power2_divisions:3").is_err());
        assert!(Config::parse("roundup_power2_divisions:[1,2").is_err());
        assert!(Config::parse("per_process_memory_fraction:1.5").is_err());
        assert!(Config::parse("growth").is_err());
        for page in ["0", "1", "6", "2048", "x"] {
            assert!(
                Config::parse(&format!("vmm_page_mb:{page}")).is_err(),
                "{page}"
            );
        }
        assert!(Config::parse("vmm_slack_base_mb:-1").is_err());
        assert!(Config::parse("roundup_power2_divisions:[>:1152921504606846976]").is_err());
        assert!(Config::parse(&format!("roundup_power2_divisions:{MAX_DIVISIONS}")).is_ok());
        assert!(Config::parse("vmm_slack_base_mb:2000000").is_err());
        assert!(Config::parse("").is_ok());
    }

    /// MiB values whose bytes overflow (2^44 MiB is 2^64 bytes) or exceed `MAX_MIB` are refused
    /// by every `*_mb` key, naming it, and change nothing; they once wrapped (2^44 MiB to a
    /// 0-byte limit, 2^44 + 20 MiB to a 20 MiB split size).
    #[test]
    fn mib_values_that_overflow_are_refused_by_every_key() {
        let keys: Vec<&str> = Config::KEYS
            .iter()
            .copied()
            .filter(|k| k.ends_with("_mb"))
            .collect();
        assert_eq!(keys.len(), 7, "{keys:?}");
        for key in keys {
            for v in [
                "17592186044416",
                "17592186044436",
                "18446744073709551615",
                &(MAX_MIB + 1).to_string(),
            ] {
                let mut c = Config::default();
                let e = c.apply(&format!("{key}:{v}")).unwrap_err();
                assert!(
                    e.0.starts_with(key) && e.0.contains("at most"),
                    "{key}:{v}: {e}"
                );
                assert_eq!(c, Config::default(), "{key}:{v}");
            }
        }
        let c = Config::parse(&format!("memory_limit_mb:{MAX_MIB}")).unwrap();
        assert_eq!(c.memory_limit, Some(MAX_MIB * MIB));
        let c = Config::parse(&format!("max_split_size_mb:{MAX_MIB}")).unwrap();
        assert_eq!(c.policy.max_split_size, MAX_MIB * MIB);
    }

    /// A zero limit is no limit, in a configuration string as in `set_memory_limit(0)`.
    #[test]
    fn a_zero_memory_limit_is_no_limit() {
        assert_eq!(
            Config::parse("memory_limit_mb:0").unwrap().memory_limit,
            None
        );
        assert_eq!(limit_from_bytes(0), None);
        assert_eq!(limit_from_bytes(1), Some(1));
        assert_eq!(
            Config::parse("memory_limit_mb:1").unwrap().memory_limit,
            Some(MIB)
        );
    }
}
