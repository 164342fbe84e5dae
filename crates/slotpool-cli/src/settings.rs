//! The configuration a replay runs with, layered as the library layers it, and the flag
//! combinations that are refused.
//!
//! Layers, each over the one before: the program defaults ([`replay_defaults`]), the
//! `SLOTPOOL_CONF` environment variable, `--conf` (the library's layers,
//! [`slotpool_core::layers`]), then `--mode` for the growth mode. A layer that does not parse is
//! an error naming it. `--mode`
//! and a `--conf` that sets the growth mode (`growth:` or `expandable_segments:`) must agree, and
//! a variant replay (`--variants`) runs in vmm growth only: a combination that says otherwise is
//! refused rather than one side silently winning.

pub use slotpool_core::layers::{ENV_CONF, ENV_LOG};
use slotpool_core::{Config, GrowthMode, Layer};

/// The configuration a replay starts from, before `SLOTPOOL_CONF` and `--conf`.
pub fn replay_defaults() -> Config {
    Config::default()
}

/// What the command line and the environment ask for.
#[derive(Debug, Clone, Default)]
pub struct Layers<'a> {
    /// `SLOTPOOL_CONF` (empty or unset: nothing).
    pub env: Option<&'a str>,
    /// `--conf`.
    pub conf: Option<&'a str>,
    /// `--mode`.
    pub mode: Option<GrowthMode>,
    /// Whether `--variants` was given.
    pub variants: bool,
}

/// The growth mode as the command line names it.
pub fn growth_name(g: GrowthMode) -> &'static str {
    match g {
        GrowthMode::Vmm => "vmm",
        GrowthMode::Classic => "classic",
    }
}

/// The growth mode that `conf` sets, if it sets one: parsed over both modes, it gives the same
/// one back only if it sets it.
fn growth_set_by(conf: &str) -> Option<GrowthMode> {
    let over = |g: GrowthMode| {
        let mut c = Config {
            growth: g,
            ..Config::default()
        };
        c.apply(conf).ok().map(|()| c.growth)
    };
    match (over(GrowthMode::Vmm), over(GrowthMode::Classic)) {
        (Some(a), Some(b)) if a == b => Some(a),
        _ => None,
    }
}

/// The configuration in effect, or a one-line reason why the layers cannot be combined.
pub fn resolve(defaults: Config, layers: &Layers<'_>) -> Result<Config, String> {
    let mut config = defaults;
    let text = [
        Layer {
            source: ENV_CONF,
            text: layers.env.unwrap_or(""),
        },
        Layer {
            source: "--conf",
            text: layers.conf.unwrap_or(""),
        },
    ];
    config.apply_layers(&text, None).map_err(|e| e.0)?;
    let conf_growth = layers.conf.and_then(growth_set_by);
    if let (Some(mode), Some(conf)) = (layers.mode, conf_growth)
        && mode != conf
    {
        return Err(format!(
            "--mode {} conflicts with --conf, which sets growth {}; give one of them",
            growth_name(mode),
            growth_name(conf)
        ));
    }
    if let Some(mode) = layers.mode {
        config.growth = mode;
    }
    if layers.variants && config.growth != GrowthMode::Vmm {
        let source = if layers.mode.is_some() {
            "--mode"
        } else if conf_growth.is_some() {
            "--conf"
        } else {
            ENV_CONF
        };
        return Err(format!(
            "--variants replays in vmm growth only, and {source} asks for classic; drop one of \
             them"
        ));
    }
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layers<'a>(env: &'a str, conf: Option<&'a str>, mode: Option<GrowthMode>) -> Layers<'a> {
        Layers {
            env: Some(env),
            conf,
            mode,
            variants: false,
        }
    }

    #[test]
    fn later_layers_win() {
        let d = replay_defaults();
        let c = resolve(d.clone(), &layers("vmm_slack_percent:8", None, None)).unwrap();
        assert_eq!(c.vmm_slack_percent, 8.0);
        let c = resolve(
            d.clone(),
            &layers(
                "vmm_slack_percent:8,memory_limit_mb:10",
                Some("vmm_slack_percent:2"),
                None,
            ),
        )
        .unwrap();
        assert_eq!(c.vmm_slack_percent, 2.0);
        assert_eq!(c.memory_limit, Some(10 << 20));
        // The command line's --mode wins over the environment's growth.
        let c = resolve(
            d.clone(),
            &layers("growth:classic", None, Some(GrowthMode::Vmm)),
        )
        .unwrap();
        assert_eq!(c.growth, GrowthMode::Vmm);
        assert_eq!(resolve(d.clone(), &Layers::default()).unwrap(), d);
    }

    #[test]
    fn bad_layers_are_named() {
        let d = replay_defaults();
        let e = resolve(d.clone(), &layers("bogus:1", None, None)).unwrap_err();
        assert!(
            e.starts_with("SLOTPOOL_CONF: ") && e.contains("bogus"),
            "{e}"
        );
        let e = resolve(d, &layers("", Some("growth:fast"), None)).unwrap_err();
        assert!(e.starts_with("--conf: "), "{e}");
    }

    #[test]
    fn mode_and_conf_growth_must_agree() {
        let d = replay_defaults();
        for (conf, mode, ok) in [
            ("growth:vmm", GrowthMode::Classic, false),
            ("expandable_segments:False", GrowthMode::Vmm, false),
            ("growth:classic", GrowthMode::Classic, true),
            ("vmm_slack_percent:8", GrowthMode::Classic, true),
            ("growth:classic,growth:vmm", GrowthMode::Vmm, true),
        ] {
            let r = resolve(d.clone(), &layers("", Some(conf), Some(mode)));
            assert_eq!(r.is_ok(), ok, "{conf} with {mode:?}: {r:?}");
            if let Err(e) = r {
                assert!(e.contains("--mode") && e.contains("--conf"), "{e}");
            }
        }
        assert_eq!(growth_set_by("vmm_page_mb:8"), None);
        assert_eq!(growth_set_by("growth:classic"), Some(GrowthMode::Classic));
    }

    #[test]
    fn variants_need_vmm() {
        let d = replay_defaults();
        let v = |env, conf, mode| Layers {
            variants: true,
            ..layers(env, conf, mode)
        };
        assert!(resolve(d.clone(), &v("", None, None)).is_ok());
        assert!(resolve(d.clone(), &v("", None, Some(GrowthMode::Vmm))).is_ok());
        for (env, conf, mode, source) in [
            ("", None, Some(GrowthMode::Classic), "--mode"),
            ("", Some("growth:classic"), None, "--conf"),
            ("growth:classic", None, None, "SLOTPOOL_CONF"),
        ] {
            let e = resolve(d.clone(), &v(env, conf, mode)).unwrap_err();
            assert!(e.contains("--variants") && e.contains(source), "{e}");
        }
        // The command line's vmm wins over the environment's classic.
        assert!(resolve(d, &v("growth:classic", Some("growth:vmm"), None)).is_ok());
    }
}
