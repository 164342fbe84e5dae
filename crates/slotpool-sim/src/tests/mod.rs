//! Unit tests, one file per concept.

mod access;
mod capture;
mod faults;
mod host;
mod memory;
mod runs;
mod streams;
mod work;

use slotpool_core::DeviceError;

use crate::{Backing, SimConfig, SimDevice};

/// Page size of the test devices.
const PS: u64 = 2 << 20;
/// One mebibyte.
const MIB: u64 = 1 << 20;

/// A device with `total` bytes, real bytes, manual completion.
fn device(total: u64) -> SimDevice {
    let config = SimConfig {
        total_memory: total,
        ..SimConfig::default()
    };
    SimDevice::new(config).expect("valid config")
}

/// A 64 MiB device.
fn dev() -> SimDevice {
    device(64 * MIB)
}

/// A device with accounting only.
fn accounting(total: u64) -> SimDevice {
    let config = SimConfig {
        total_memory: total,
        backing: Backing::Accounting,
        ..SimConfig::default()
    };
    SimDevice::new(config).expect("valid config")
}

/// Asserts that `result` is a contract violation that the device counted, mentioning `needle`.
#[track_caller]
fn assert_violation<T: std::fmt::Debug>(
    d: &SimDevice,
    result: Result<T, DeviceError>,
    needle: &str,
) {
    let counted = d.contract_violations();
    match result {
        Err(DeviceError::InvalidArgument(why)) => {
            assert!(why.contains(needle), "{why:?} does not mention {needle:?}");
            assert_eq!(d.last_violation().as_deref(), Some(why.as_str()));
        }
        other => panic!("expected InvalidArgument mentioning {needle:?}, got {other:?}"),
    }
    assert!(counted > 0, "violation not counted");
}
