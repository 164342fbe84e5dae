//! A hand-written SVG of a replay: allocated and reserved GB over operations.

use std::fmt::Write as _;
use std::io;
use std::path::Path;

use crate::replay::ReplayReport;

const WIDTH: f64 = 960.0;
const HEIGHT: f64 = 540.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 30.0;
const TOP: f64 = 60.0;
const BOTTOM: f64 = 60.0;
const GB: f64 = 1e9;

/// Writes [`render_svg`] of `report` to `path` (through a `.svg.tmp` file renamed into place).
pub fn write_svg(report: &ReplayReport, path: impl AsRef<Path>) -> io::Result<()> {
    let path = path.as_ref();
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    std::fs::write(&tmp, render_svg(report))?;
    std::fs::rename(&tmp, path)
}

/// The SVG document: two polylines (`id="allocated"`, `id="reserved"`), axes with labels, and a
/// title with the trace name, mode and ratio.
pub fn render_svg(report: &ReplayReport) -> String {
    let pts = &report.timeline;
    let x_max = pts.last().map_or(1, |p| p.0.max(1)) as f64;
    let y_peak = pts.iter().map(|p| p.1.max(p.2)).max().unwrap_or(0) as f64 / GB;
    let y_step = nice_step(y_peak.max(1e-9) / 5.0);
    let y_max = ((y_peak / y_step).ceil() * y_step).max(y_step);
    let x_step = nice_step(x_max / 6.0).max(1.0);

    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let sx = |x: f64| LEFT + x / x_max * plot_w;
    let sy = |y: f64| TOP + plot_h - y / y_max * plot_h;

    let mut s = String::with_capacity(64 * 1024);
    let _ = writeln!(
        s,
        r#"<?xml version="1.0" encoding="UTF-8"?>
<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>"#
    );
    let mode = if report.mode.is_empty() {
        String::new()
    } else {
        format!(" ({})", report.mode)
    };
    let _ = writeln!(
        s,
        r#"<text x="{}" y="28" text-anchor="middle" font-size="16">{}{}: peak reserved {:.2} GB / allocated {:.2} GB = {:.3}</text>"#,
        WIDTH / 2.0,
        escape(&report.trace),
        escape(&mode),
        report.peak_reserved as f64 / GB,
        report.peak_allocated as f64 / GB,
        report.ratio
    );

    // Grid and y labels.
    let mut y = 0.0;
    while y <= y_max + y_step * 1e-6 {
        let py = sy(y);
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{py:.1}" x2="{:.1}" y2="{py:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            LEFT + plot_w,
            LEFT - 6.0,
            py + 4.0,
            fmt_tick(y, y_step)
        );
        y += y_step;
    }
    // x labels.
    let mut x = 0.0;
    while x <= x_max + x_step * 1e-6 {
        let px = sx(x);
        let _ = writeln!(
            s,
            r##"<line x1="{px:.1}" y1="{:.1}" x2="{px:.1}" y2="{:.1}" stroke="#000"/><text x="{px:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
            TOP + plot_h,
            TOP + plot_h + 5.0,
            TOP + plot_h + 20.0,
            fmt_count(x)
        );
        x += x_step;
    }
    // Axes and their titles.
    let _ = writeln!(
        s,
        r##"<polyline points="{LEFT},{TOP} {LEFT},{:.1} {:.1},{:.1}" fill="none" stroke="#000"/>
<text x="{:.1}" y="{:.1}" text-anchor="middle">operation (alloc or free)</text>
<text transform="translate(22 {:.1}) rotate(-90)" text-anchor="middle">GB</text>"##,
        TOP + plot_h,
        LEFT + plot_w,
        TOP + plot_h,
        LEFT + plot_w / 2.0,
        HEIGHT - 15.0,
        TOP + plot_h / 2.0
    );

    // The two series.
    for (id, colour, pick) in [
        ("reserved", "#d62728", 2usize),
        ("allocated", "#1f77b4", 1usize),
    ] {
        let _ = write!(
            s,
            r#"<polyline id="{id}" fill="none" stroke="{colour}" stroke-width="1.5" points=""#
        );
        for p in pts {
            let v = if pick == 1 { p.1 } else { p.2 };
            let _ = write!(s, "{:.1},{:.1} ", sx(p.0 as f64), sy(v as f64 / GB));
        }
        let _ = writeln!(s, r#""/>"#);
    }
    // Legend.
    let lx = LEFT + 16.0;
    let _ = writeln!(
        s,
        r##"<line x1="{lx}" y1="{}" x2="{}" y2="{}" stroke="#d62728" stroke-width="2"/><text x="{}" y="{}">reserved</text>
<line x1="{lx}" y1="{}" x2="{}" y2="{}" stroke="#1f77b4" stroke-width="2"/><text x="{}" y="{}">allocated</text>"##,
        TOP + 12.0,
        lx + 24.0,
        TOP + 12.0,
        lx + 30.0,
        TOP + 16.0,
        TOP + 30.0,
        lx + 24.0,
        TOP + 30.0,
        lx + 30.0,
        TOP + 34.0
    );
    s.push_str("</svg>\n");
    s
}

/// 1, 2 or 5 times a power of ten, at least `raw`.
fn nice_step(raw: f64) -> f64 {
    if !raw.is_finite() || raw <= 0.0 {
        return 1.0;
    }
    let mag = 10f64.powf(raw.log10().floor());
    for m in [1.0, 2.0, 5.0, 10.0] {
        if m * mag >= raw {
            return m * mag;
        }
    }
    10.0 * mag
}

fn fmt_tick(v: f64, step: f64) -> String {
    let decimals = if step >= 1.0 {
        0
    } else {
        (-step.log10().floor()) as usize
    };
    format!("{v:.decimals$}")
}

fn fmt_count(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.1}M", v / 1e6)
    } else if v >= 1e3 {
        format!("{:.0}k", v / 1e3)
    } else {
        format!("{v:.0}")
    }
}

fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c if c.is_control() => {}
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nice_steps() {
        assert_eq!(nice_step(0.3), 0.5);
        assert_eq!(nice_step(3.0), 5.0);
        assert_eq!(nice_step(1500.0), 2000.0);
        assert_eq!(nice_step(0.0), 1.0);
        assert_eq!(fmt_count(2000.0), "2k");
        assert_eq!(fmt_count(1_500_000.0), "1.5M");
        assert_eq!(fmt_tick(2.5, 0.5), "2.5");
        assert_eq!(escape("a<b>&\"c'"), "a&lt;b&gt;&amp;&quot;c&apos;");
    }
}
