//! `sp_config_get_f64` / `sp_config_get_str`: the configuration in effect, key by key.

use std::ffi::c_char;

use slotpool_core::layers::setting_number;
use slotpool_core::{Config, KeyOwner};
use slotpool_sim::SimOptions;

use crate::error::{Error, Result, ffi, sp_status};
use crate::out::{put, put_opt, required};
use crate::runtime;

use super::str_arg;

/// The key that reads the whole configuration string.
const WHOLE: &str = "conf";

/// The value of `key` in effect, as text (`None`: unset). Once the library is initialised, its
/// configuration; before, the one lazy initialisation would use (the defaults under
/// `SLOTPOOL_CONF`), without initialising.
fn value(key: &str) -> Result<Option<String>> {
    let (config, sim) = match runtime::current()? {
        Some(rt) => (rt.config.clone(), rt.sim),
        None => {
            let env = slotpool_core::layers::env_conf().unwrap_or_default();
            runtime::parse_conf(&env, "")?
        }
    };
    Ok(lookup(&config, &sim, key)?)
}

/// `key` in `config` (or the simulated backend's `sim`); `"conf"` is all of `config`.
fn lookup(
    config: &Config,
    sim: &SimOptions,
    key: &str,
) -> std::result::Result<Option<String>, slotpool_core::ConfigError> {
    if key == WHOLE {
        return Ok(Some(config.to_string()));
    }
    if key.starts_with(sim.prefix()) {
        return sim
            .settings()
            .into_iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| Some(v))
            .ok_or_else(|| {
                slotpool_core::ConfigError(format!(
                    "unknown key {key:?}; known sim keys: {}",
                    slotpool_sim::keys::SIM_KEYS.join(", ")
                ))
            });
    }
    config.value(key)
}

/// Writes the value in effect of the numeric or boolean configuration key `key` to `out`, in the
/// key's own units (booleans 0 / 1; an unset key with no limit reads 0). `SP_ERR_CONFIG` for an
/// unknown key or one whose value is no number (`growth`). Never initialises the library.
///
/// # Safety
///
/// `key` must be NULL (an error) or NUL-terminated; `out` NULL (an error) or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_config_get_f64(key: *const c_char, out: *mut f64) -> sp_status {
    ffi(|| {
        let out = required(out, "out")?;
        // SAFETY: NULL or NUL-terminated by the caller's contract.
        let key = unsafe { str_arg(key, "key") }?;
        let v = setting_number(key, value(key)?.as_deref())?;
        // SAFETY: non-null and valid for a write by the caller's contract.
        unsafe { put(out, v) };
        Ok(())
    })
}

/// Writes the value in effect of configuration key `key` as text in the conf syntax (`""` for
/// an unset key; `"conf"`: the whole configuration string): at most `cap` bytes to `buf`, NUL
/// included, and the full length without the NUL to `len` (may be NULL). `SP_OK` also when
/// truncated. Never initialises the library.
///
/// # Safety
///
/// `key` must be NULL (an error) or NUL-terminated; `buf` NULL when `cap` is 0, else valid for
/// `cap` writes; `len` NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_config_get_str(
    key: *const c_char,
    buf: *mut c_char,
    cap: usize,
    len: *mut usize,
) -> sp_status {
    ffi(|| {
        if cap > 0 && buf.is_null() {
            return Err(Error::InvalidArgument(format!(
                "buf is NULL with cap {cap}"
            )));
        }
        // SAFETY: NULL or NUL-terminated by the caller's contract.
        let key = unsafe { str_arg(key, "key") }?;
        let text = value(key)?.unwrap_or_default();
        if cap > 0 {
            let n = text.len().min(cap - 1);
            // SAFETY: `buf` is non-null and valid for `cap` > `n` writes by the caller's
            // contract, and does not overlap `text`.
            unsafe {
                std::ptr::copy_nonoverlapping(text.as_ptr().cast::<c_char>(), buf, n);
                buf.add(n).write(0);
            }
        }
        // SAFETY: NULL or valid for a write by the caller's contract.
        unsafe { put_opt(len, text.len()) };
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_read_from_the_config_and_the_sim() {
        let (c, s) = runtime::parse_conf("", "memory_limit_mb:100,sim_devices:2").unwrap();
        assert_eq!(lookup(&c, &s, "conf").unwrap(), Some(c.to_string()));
        assert_eq!(
            lookup(&c, &s, "memory_limit_mb").unwrap().as_deref(),
            Some("100")
        );
        assert_eq!(lookup(&c, &s, "sim_devices").unwrap().as_deref(), Some("2"));
        assert_eq!(lookup(&c, &s, "max_split_size_mb").unwrap(), None);
        assert!(
            lookup(&c, &s, "sim_bogus")
                .unwrap_err()
                .0
                .contains("sim_bogus")
        );
        assert!(lookup(&c, &s, "bogus").unwrap_err().0.contains("bogus"));
    }
}
