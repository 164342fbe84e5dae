//! The configuration a program runs with, layer by layer, and reading a setting back.
//!
//! | order | layer | source name in messages |
//! |---|---|---|
//! | 1 | the program defaults, [`Config::default`] | |
//! | 2 | [`ENV_CONF`] (`SLOTPOOL_CONF`) | `SLOTPOOL_CONF` |
//! | 3 | the program's own string: `sp_init`'s `conf`, the replay's `--conf`, `slotpool_torch.install(conf=)` | `conf`, `--conf` |
//!
//! Each layer is a `key:value,...` string applied key by key over the ones before, so a later
//! layer wins for the keys it names and keeps the others. Keys under a prefix that another part
//! of slotpool owns (the simulated device's `sim_*`, see [`KeyOwner`]) go to that owner; every
//! other key is [`Config`]'s. Nothing is applied unless every layer parses.
//!
//! The names of the environment variables are slotpool-abi's (re-exported here as
//! [`ENV_CONF`], [`ENV_LOG`], [`ENV_BACKEND`]); the keys and their defaults are listed in
//! `docs/configuration.md`.

use crate::config::{Config, ConfigError, split_pairs};

/// The configuration string beneath each program's own (layer 2).
pub const ENV_CONF: &str = slotpool_abi::env::CONF;
/// A `tracing` filter that turns logging to stderr on.
pub const ENV_LOG: &str = slotpool_abi::env::LOG;
/// The backend the C ABI initialises lazily with (`cuda`, `sim`, `auto`).
pub const ENV_BACKEND: &str = slotpool_abi::env::BACKEND;

/// Configuration keys that another part of slotpool owns: every key that starts with
/// [`KeyOwner::prefix`] goes to [`KeyOwner::set`] instead of [`Config`].
pub trait KeyOwner {
    /// The prefix of the owner's keys (`"sim_"`).
    fn prefix(&self) -> &'static str;
    /// Applies one `key:value` pair. An unknown key or a bad value is an error naming the key.
    fn set(&mut self, key: &str, value: &str) -> Result<(), ConfigError>;
    /// Every key the owner has, with its value now in the syntax [`KeyOwner::set`] takes.
    fn settings(&self) -> Vec<(&'static str, String)>;
}

/// One layer: its text and the name messages give it.
#[derive(Clone, Copy, Debug)]
pub struct Layer<'a> {
    pub source: &'a str,
    pub text: &'a str,
}

/// `SLOTPOOL_CONF`'s text, the second layer (unset: `None`).
pub fn env_conf() -> Option<String> {
    std::env::var(ENV_CONF).ok()
}

impl Config {
    /// Applies `layers` in order over `self`, the keys of `owner` (if any) to it. A layer that
    /// does not parse is an error naming its source, and `self` is then unchanged; `owner` is
    /// given its keys as they parse, so pass a fresh one and drop it on error.
    pub fn apply_layers(
        &mut self,
        layers: &[Layer<'_>],
        mut owner: Option<&mut dyn KeyOwner>,
    ) -> Result<(), ConfigError> {
        let mut next = self.clone();
        for layer in layers {
            let named = |e: ConfigError| ConfigError(format!("{}: {}", layer.source, e.0));
            let mut own = Vec::new();
            for (key, value) in split_pairs(layer.text).map_err(named)? {
                match owner.as_deref_mut() {
                    Some(o) if key.starts_with(o.prefix()) => o.set(&key, &value).map_err(named)?,
                    _ => own.push(format!("{key}:{value}")),
                }
            }
            next.apply(&own.join(",")).map_err(named)?;
        }
        *self = next;
        Ok(())
    }

    /// The configuration a program runs with: the defaults, then `layers` (see the module).
    pub fn layered(
        layers: &[Layer<'_>],
        owner: Option<&mut dyn KeyOwner>,
    ) -> Result<Config, ConfigError> {
        let mut c = Config::default();
        c.apply_layers(layers, owner)?;
        Ok(c)
    }

    /// The value in effect of `key` in the syntax [`Config::apply`] takes, or `None` where the
    /// setting is unset (no limit, off, the device's own). `expandable_segments` reads as
    /// `True` / `False`. An unknown key is an error listing the known ones.
    pub fn value(&self, key: &str) -> Result<Option<String>, ConfigError> {
        if key == "expandable_segments" {
            let vmm = self.growth == crate::config::GrowthMode::Vmm;
            return Ok(Some(if vmm { "True" } else { "False" }.to_string()));
        }
        self.settings()
            .into_iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v)
            .ok_or_else(|| {
                ConfigError(format!(
                    "unknown key {key:?}; known keys: {}",
                    Config::KEYS.join(", ")
                ))
            })
    }
}

/// A setting's text as a number, in the key's own units: booleans (`True`, `true`, `1`) are 1
/// and 0, an unset setting is 0; text that is no number (`vmm`, a list) is an error naming
/// `key`.
pub fn setting_number(key: &str, value: Option<&str>) -> Result<f64, ConfigError> {
    let Some(v) = value else { return Ok(0.0) };
    match v {
        "True" | "true" => Ok(1.0),
        "False" | "false" => Ok(0.0),
        _ => v.parse::<f64>().map_err(|_| {
            ConfigError(format!(
                "{key} is {v:?}, not a number: read it as text (sp_config_get_str)"
            ))
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::GrowthMode;

    const MIB: u64 = 1 << 20;

    #[derive(Default)]
    struct Prefixed(Vec<(String, String)>);

    impl KeyOwner for Prefixed {
        fn prefix(&self) -> &'static str {
            "x_"
        }
        fn set(&mut self, key: &str, value: &str) -> Result<(), ConfigError> {
            if key == "x_bad" {
                return Err(ConfigError(format!("{key}: refused")));
            }
            self.0.push((key.into(), value.into()));
            Ok(())
        }
        fn settings(&self) -> Vec<(&'static str, String)> {
            Vec::new()
        }
    }

    fn layers<'a>(env: &'a str, conf: &'a str) -> [Layer<'a>; 2] {
        [
            Layer {
                source: ENV_CONF,
                text: env,
            },
            Layer {
                source: "conf",
                text: conf,
            },
        ]
    }

    #[test]
    fn later_layers_win_key_by_key_over_the_defaults() {
        assert_eq!(
            Config::layered(&layers("", ""), None).unwrap(),
            Config::default()
        );
        let c = Config::layered(
            &layers("growth:classic,memory_limit_mb:10", "growth:vmm"),
            None,
        )
        .unwrap();
        assert_eq!(c.growth, GrowthMode::Vmm, "conf wins over the environment");
        assert_eq!(
            c.memory_limit,
            Some(10 * MIB),
            "and keeps what it does not name"
        );
        assert_eq!(c.vmm_page_size, Config::default().vmm_page_size);
    }

    #[test]
    fn owned_keys_go_to_their_owner_and_lists_stay_whole() {
        let mut o = Prefixed::default();
        let c = Config::layered(
            &layers(
                "x_a:1, roundup_power2_divisions:[256:1,>:4]",
                "x_b:2,growth:classic",
            ),
            Some(&mut o),
        )
        .unwrap();
        assert_eq!(
            o.0,
            vec![("x_a".into(), "1".into()), ("x_b".into(), "2".into())]
        );
        assert_eq!(c.growth, GrowthMode::Classic);
        assert_eq!(c.policy.roundup_power2_divisions[0], 1);
        assert_eq!(c.policy.roundup_power2_divisions[15], 4);
        assert!(
            Config::layered(&layers("x_a:1", ""), None).is_err(),
            "no owner"
        );
    }

    #[test]
    fn a_bad_layer_is_named_and_nothing_is_applied() {
        let mut base = Config::default();
        let e = base
            .apply_layers(&layers("memory_limit_mb:10", "bogus:1"), None)
            .unwrap_err();
        assert!(e.0.starts_with("conf: ") && e.0.contains("bogus"), "{e}");
        assert_eq!(base, Config::default());
        let mut o = Prefixed::default();
        let e = Config::layered(&layers("x_bad:1", ""), Some(&mut o)).unwrap_err();
        assert!(e.0.starts_with("SLOTPOOL_CONF: x_bad"), "{e}");
        let e = Config::layered(&layers("growth:[", ""), None).unwrap_err();
        assert!(e.0.starts_with("SLOTPOOL_CONF: "), "{e}");
    }

    #[test]
    fn values_read_back_in_the_conf_syntax() {
        let c = Config::parse("memory_limit_mb:100,growth:classic").unwrap();
        assert_eq!(c.value("memory_limit_mb").unwrap().as_deref(), Some("100"));
        assert_eq!(c.value("growth").unwrap().as_deref(), Some("classic"));
        assert_eq!(
            c.value("expandable_segments").unwrap().as_deref(),
            Some("False")
        );
        assert_eq!(c.value("max_split_size_mb").unwrap(), None);
        let e = c.value("bogus").unwrap_err();
        assert!(e.0.contains("bogus") && e.0.contains("growth"), "{e}");
        // Every key reads back, and a set value parses back to the same configuration.
        for key in Config::KEYS {
            if let Some(v) = c.value(key).unwrap() {
                let mut d = c.clone();
                d.apply(&format!("{key}:{v}")).unwrap();
                assert_eq!(d, c, "{key}:{v}");
            }
        }
    }

    #[test]
    fn numbers_in_the_keys_units() {
        assert_eq!(setting_number("k", Some("4")).unwrap(), 4.0);
        assert_eq!(setting_number("k", Some("0.25")).unwrap(), 0.25);
        assert_eq!(setting_number("k", Some("True")).unwrap(), 1.0);
        assert_eq!(setting_number("k", Some("false")).unwrap(), 0.0);
        assert_eq!(setting_number("k", None).unwrap(), 0.0);
        let e = setting_number("growth", Some("vmm")).unwrap_err();
        assert!(e.0.contains("growth"), "{e}");
        assert!(setting_number("d", Some("[1,2]")).is_err());
    }
}
