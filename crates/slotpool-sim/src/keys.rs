//! The simulated device's configuration keys (`sim_*`), as a program built on the C ABI sets them
//! in `sp_init`'s `conf` or `SLOTPOOL_CONF`. [`SimOptions`] owns them
//! ([`slotpool_core::KeyOwner`]); its defaults are those of a simulated backend started from a
//! configuration string, which differ from [`SimConfig::default`]'s (a test's device) where a C
//! caller cannot do what a Rust test does: streams complete at once, and memory keeps accounts
//! only unless `sim_bytes:1`.

use slotpool_core::{ConfigError, KeyOwner};

use slotpool_core::DeviceResult;

use crate::SimDevice;
use crate::config::{Backing, SimConfig};

/// Most simulated devices (`sim_devices`).
pub const MAX_SIM_DEVICES: usize = 64;
/// Device `i` has its addresses moved up by `i << DEVICE_ADDRESS_SHIFT`
/// ([`SimDevice::with_address_offset`]), so that pointers of different devices never coincide.
pub const DEVICE_ADDRESS_SHIFT: u32 = 56;
const MIB: u64 = 1 << 20;

/// The keys [`SimOptions`] owns.
pub const SIM_KEYS: &[&str] = &[
    "sim_memory_mb",
    "sim_devices",
    "sim_auto_complete",
    "sim_bytes",
];

/// A simulated backend's options (the `sim_*` keys).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimOptions {
    /// Memory of each simulated device (`sim_memory_mb`).
    pub memory: u64,
    /// Number of simulated devices (`sim_devices`).
    pub devices: usize,
    /// Streams complete the moment work is queued (`sim_auto_complete`; a C caller cannot
    /// complete them otherwise).
    pub auto_complete: bool,
    /// Device memory holds host-backed bytes (`sim_bytes:1`); else only its accounts are kept.
    pub bytes: bool,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions {
            memory: SimConfig::default().total_memory,
            devices: 1,
            auto_complete: true,
            bytes: false,
        }
    }
}

/// A `0|1` configuration value.
fn flag(value: &str) -> Option<bool> {
    match value {
        "1" | "true" | "True" => Some(true),
        "0" | "false" | "False" => Some(false),
        _ => None,
    }
}

impl SimOptions {
    /// The configuration of each device, with physical pages of `page_size` bytes.
    pub fn device_config(&self, page_size: u64) -> SimConfig {
        SimConfig {
            total_memory: self.memory,
            page_size,
            backing: if self.bytes {
                Backing::Bytes
            } else {
                Backing::Accounting
            },
            auto_complete: self.auto_complete,
        }
    }
}

impl SimOptions {
    /// Device `i` of the backend, with physical pages of `page_size` bytes and its own range of
    /// addresses.
    pub fn device(&self, i: usize, page_size: u64) -> DeviceResult<SimDevice> {
        SimDevice::with_address_offset(
            self.device_config(page_size),
            (i as u64) << DEVICE_ADDRESS_SHIFT,
        )
    }
}

impl KeyOwner for SimOptions {
    fn prefix(&self) -> &'static str {
        "sim_"
    }

    fn set(&mut self, key: &str, value: &str) -> Result<(), ConfigError> {
        let bad = |what: &str| ConfigError(format!("{key}: {what} (got {value:?})"));
        match key {
            "sim_memory_mb" => {
                let mb: u64 = value
                    .parse()
                    .map_err(|_| bad("expected a whole number of MiB"))?;
                self.memory = mb
                    .checked_mul(MIB)
                    .filter(|&b| b > 0 && b <= 1 << 56)
                    .ok_or_else(|| bad("must be between 1 and 2^36"))?;
            }
            "sim_devices" => {
                let n: usize = value.parse().map_err(|_| bad("expected a number"))?;
                if !(1..=MAX_SIM_DEVICES).contains(&n) {
                    return Err(bad(&format!("must be between 1 and {MAX_SIM_DEVICES}")));
                }
                self.devices = n;
            }
            "sim_auto_complete" => {
                self.auto_complete = flag(value).ok_or_else(|| bad("expected 0 or 1"))?;
            }
            "sim_bytes" => self.bytes = flag(value).ok_or_else(|| bad("expected 0 or 1"))?,
            _ => {
                return Err(ConfigError(format!(
                    "unknown key {key:?}; known sim keys: {}",
                    SIM_KEYS.join(", ")
                )));
            }
        }
        Ok(())
    }

    fn settings(&self) -> Vec<(&'static str, String)> {
        vec![
            ("sim_memory_mb", (self.memory / MIB).to_string()),
            ("sim_devices", self.devices.to_string()),
            (
                "sim_auto_complete",
                u8::from(self.auto_complete).to_string(),
            ),
            ("sim_bytes", u8::from(self.bytes).to_string()),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use slotpool_core::{Config, Layer};

    fn parse(conf: &str) -> Result<SimOptions, ConfigError> {
        let mut o = SimOptions::default();
        Config::layered(
            &[Layer {
                source: "conf",
                text: conf,
            }],
            Some(&mut o),
        )?;
        Ok(o)
    }

    #[test]
    fn keys_parse_and_read_back() {
        let o = parse("sim_devices:3,sim_memory_mb:64,sim_bytes:1,growth:classic").unwrap();
        assert_eq!((o.devices, o.memory, o.bytes), (3, 64 * MIB, true));
        assert!(o.auto_complete, "a C caller's streams complete at once");
        let keys: Vec<&str> = o.settings().iter().map(|s| s.0).collect();
        assert_eq!(keys, SIM_KEYS);
        let text: Vec<String> = o
            .settings()
            .iter()
            .map(|(k, v)| format!("{k}:{v}"))
            .collect();
        assert_eq!(parse(&text.join(",")).unwrap(), o, "settings parse back");
        assert_eq!(o.device_config(4 * MIB).backing, Backing::Bytes);
        assert_eq!(
            SimOptions::default().device_config(2 * MIB).backing,
            Backing::Accounting,
            "accounts only by default"
        );
    }

    #[test]
    fn devices_have_disjoint_addresses() {
        use slotpool_core::Device;
        let o = SimOptions::default();
        let (d0, d1) = (o.device(0, 2 * MIB).unwrap(), o.device(1, 2 * MIB).unwrap());
        let (p0, p1) = (
            d0.alloc_segment(2 * MIB).unwrap(),
            d1.alloc_segment(2 * MIB).unwrap(),
        );
        assert_eq!(p1 - p0, 1 << DEVICE_ADDRESS_SHIFT);
        d1.free_segment(p1, 2 * MIB).unwrap();
        assert!(d0.free_segment(p1, 2 * MIB).is_err(), "not device 0's");
        d0.free_segment(p0, 2 * MIB).unwrap();
        assert!(SimDevice::with_address_offset(o.device_config(2 * MIB), 4096).is_err());
        assert!(SimDevice::with_address_offset(o.device_config(2 * MIB), !(2 * MIB - 1)).is_err());
    }

    #[test]
    fn bad_values_name_the_key() {
        for bad in [
            "sim_devices:0",
            "sim_devices:65",
            "sim_memory_mb:x",
            "sim_memory_mb:0",
            "sim_auto_complete:2",
            "sim_bytes:yes",
            "sim_bogus:1",
        ] {
            let e = parse(bad).unwrap_err();
            let key = bad.split(':').next().unwrap();
            assert!(e.0.contains(key), "{bad}: {e}");
        }
    }
}
