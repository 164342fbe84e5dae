//! The configuration in effect, written back in the syntax it is read in (`key:value,...`, the
//! keys of `Config::KEYS`): what `sp_snapshot_json` reports as `allocator_settings.conf`, and
//! what PyTorch's snapshots show as the allocator settings under the torch shim. Parsing the
//! text over the defaults gives the same configuration back.

use std::fmt::Write;

use slotpool_core::{Config, GrowthMode};

const MIB: u64 = 1 << 20;

/// `config` as a configuration string. Every setting is written except those at "none" (no
/// limit, no fraction, no reservation size, the device's page size, no garbage collection,
/// unlimited splitting, plain rounding), which parse back from their absence.
pub fn effective_conf(config: &Config) -> String {
    let mut out = String::new();
    let mut put = |key: &str, value: &dyn std::fmt::Display| {
        let sep = if out.is_empty() { "" } else { "," };
        let _ = write!(out, "{sep}{key}:{value}");
    };
    let growth = match config.growth {
        GrowthMode::Vmm => "vmm",
        GrowthMode::Classic => "classic",
    };
    put("growth", &growth);
    let policy = &config.policy;
    if policy.max_split_size != u64::MAX {
        put("max_split_size_mb", &(policy.max_split_size / MIB));
    }
    put(
        "max_non_split_rounding_mb",
        &(policy.max_non_split_rounding / MIB),
    );
    put("large_segment_size_mb", &(policy.large_segment_size / MIB));
    if policy.roundup_power2_divisions.iter().any(|&d| d != 0) {
        let list: Vec<String> = policy
            .roundup_power2_divisions
            .iter()
            .map(u64::to_string)
            .collect();
        put(
            "roundup_power2_divisions",
            &format_args!("[{}]", list.join(",")),
        );
    }
    if let Some(limit) = config.memory_limit {
        put("memory_limit_mb", &(limit / MIB));
    }
    if let Some(fraction) = config.memory_fraction {
        put("per_process_memory_fraction", &fraction);
    }
    if let Some(reservation) = config.vmm_reservation {
        put("vmm_reservation_mb", &(reservation / MIB));
    }
    put("vmm_slack_percent", &config.vmm_slack_percent);
    put("vmm_slack_base_mb", &(config.vmm_slack_base / MIB));
    if let Some(page) = config.vmm_page_size {
        put("vmm_page_mb", &(page / MIB));
    }
    if let Some(threshold) = config.gc_threshold {
        put("garbage_collection_threshold", &threshold);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::{DEFAULT_CONF, parse_conf};

    fn round_trip(conf: &str) -> String {
        let config = Config::parse(conf).unwrap();
        let text = effective_conf(&config);
        assert_eq!(
            Config::parse(&text).unwrap(),
            config,
            "{conf:?} -> {text:?}"
        );
        text
    }

    #[test]
    fn the_text_parses_back_to_the_same_configuration() {
        let defaults = round_trip("");
        assert!(defaults.starts_with("growth:vmm,"), "{defaults}");
        assert!(!defaults.contains("max_split_size_mb"), "{defaults}");
        round_trip(DEFAULT_CONF);
        let text = round_trip(
            "growth:classic,max_split_size_mb:128,roundup_power2_divisions:[256:1,512:2,>:4],\
             memory_limit_mb:4096,per_process_memory_fraction:0.37,vmm_reservation_mb:8192,\
             vmm_slack_percent:12.5,vmm_slack_base_mb:32,vmm_page_mb:32,\
             garbage_collection_threshold:0.6,max_non_split_rounding_mb:64,\
             large_segment_size_mb:40",
        );
        for key in Config::KEYS.iter().filter(|k| **k != "expandable_segments") {
            assert!(
                text.contains(&format!("{key}:")),
                "{key} missing from {text}"
            );
        }
        assert!(text.contains("max_split_size_mb:128"), "{text}");
        assert!(text.contains("garbage_collection_threshold:0.6"), "{text}");
    }

    #[test]
    fn what_the_runtime_applies_is_what_is_reported() {
        // The defaults beneath SLOTPOOL_CONF beneath conf: the later one wins.
        let (config, _) = parse_conf("vmm_page_mb:32,growth:classic", "growth:vmm").unwrap();
        let text = effective_conf(&config);
        assert!(text.starts_with("growth:vmm,"), "{text}");
        assert!(text.contains("vmm_page_mb:32"), "{text}");
        assert!(text.contains("vmm_slack_percent:8"), "{text}");
    }
}
