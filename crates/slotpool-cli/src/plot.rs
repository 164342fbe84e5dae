//! A hand-written SVG of a replay: slotpool's allocated and reserved GB over operations, beside
//! PyTorch's reserved GB from the trace's segment events, with the trace's capture and variant
//! phases marked.

use std::fmt::Write as _;
use std::io;
use std::path::Path;

use crate::replay::ReplayReport;
use crate::trace_timeline::{PhaseKind, TraceTimeline};

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

const TORCH_COLOUR: &str = "#2ca02c";

/// The SVG document: polylines of slotpool's allocated and reserved bytes (`id="allocated"`,
/// `id="reserved"`) and of PyTorch's reserved bytes (`id="torch_reserved"`, when the trace has
/// segment events), shaded capture phases (`class="capture"`), variant starts
/// (`class="variant"`), axes with labels, a legend and a title with the trace name, mode and
/// ratios.
pub fn render_svg(report: &ReplayReport) -> String {
    let pts = &report.timeline;
    let side = &report.trace_timeline;
    let x_max = pts.last().map_or(1, |p| p.0.max(1)) as f64;
    let torch_peak = side.torch_reserved.iter().map(|p| p.1).max().unwrap_or(0);
    let y_peak = pts
        .iter()
        .map(|p| p.1.max(p.2))
        .max()
        .unwrap_or(0)
        .max(torch_peak) as f64
        / GB;
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
        r#"<text x="{}" y="24" text-anchor="middle" font-size="16">{}{}: peak reserved {:.2} GB / allocated {:.2} GB = {:.3}</text>"#,
        WIDTH / 2.0,
        escape(&report.trace),
        escape(&mode),
        report.peak_reserved as f64 / GB,
        report.peak_allocated as f64 / GB,
        report.ratio
    );
    if report.torch_peak_reserved > 0 {
        let _ = writeln!(
            s,
            r#"<text x="{}" y="44" text-anchor="middle">PyTorch in the trace: peak reserved {:.2} GB = {:.3} of its allocated</text>"#,
            WIDTH / 2.0,
            report.torch_peak_reserved as f64 / GB,
            report.torch_ratio
        );
    }
    phases(&mut s, side, &sx, TOP, plot_h);

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

    // The series.
    let polyline = |s: &mut String, id: &str, colour: &str, dash: &str, points: &[(u64, u64)]| {
        let _ = write!(
            s,
            r#"<polyline id="{id}" fill="none" stroke="{colour}" stroke-width="1.5"{dash} points=""#
        );
        for &(x, y) in points {
            let _ = write!(s, "{:.1},{:.1} ", sx(x as f64), sy(y as f64 / GB));
        }
        let _ = writeln!(s, r#""/>"#);
    };
    if !side.torch_reserved.is_empty() {
        let dash = r#" stroke-dasharray="6 3""#;
        polyline(
            &mut s,
            "torch_reserved",
            TORCH_COLOUR,
            dash,
            &side.torch_reserved,
        );
    }
    let reserved: Vec<(u64, u64)> = pts.iter().map(|p| (p.0, p.2)).collect();
    let allocated: Vec<(u64, u64)> = pts.iter().map(|p| (p.0, p.1)).collect();
    polyline(&mut s, "reserved", "#d62728", "", &reserved);
    polyline(&mut s, "allocated", "#1f77b4", "", &allocated);

    // Legend.
    let mut entries = vec![
        ("#d62728", "", "slotpool reserved".to_string()),
        ("#1f77b4", "", "allocated".to_string()),
    ];
    if !side.torch_reserved.is_empty() {
        entries.push((TORCH_COLOUR, "6 3", torch_label(side)));
    } else {
        entries.push((
            "none",
            "",
            "PyTorch reserved: the trace has no segment events".into(),
        ));
    }
    if side.phases.iter().any(|p| p.kind == PhaseKind::Capture) {
        entries.push(("#ff7f0e", "", "capture phases (shaded)".into()));
    }
    if side.phases.iter().any(|p| p.kind == PhaseKind::Variant) {
        let note =
            "variant markers ignored: every capture stays in the default pool (see --variants)";
        entries.push(("none", "", note.into()));
    }
    let lx = LEFT + 16.0;
    for (i, (colour, dash, label)) in entries.iter().enumerate() {
        let y = TOP + 12.0 + 18.0 * i as f64;
        let _ = writeln!(
            s,
            r#"<line x1="{lx}" y1="{y}" x2="{}" y2="{y}" stroke="{colour}" stroke-width="2" stroke-dasharray="{dash}"/><text x="{}" y="{}">{}</text>"#,
            lx + 24.0,
            lx + 30.0,
            y + 4.0,
            escape(label)
        );
    }
    s.push_str("</svg>\n");
    s
}

/// What PyTorch's curve is, said plainly.
fn torch_label(side: &TraceTimeline) -> String {
    if side.torch_releases {
        "PyTorch reserved (the trace's segment events)".into()
    } else {
        "PyTorch reserved (the trace's segment allocations; it records no releases)".into()
    }
}

/// Shaded capture phases and a labelled line at each variant's start.
fn phases(s: &mut String, side: &TraceTimeline, sx: &dyn Fn(f64) -> f64, top: f64, h: f64) {
    for p in &side.phases {
        let (x0, x1) = (sx(p.start as f64), sx(p.end as f64));
        match p.kind {
            PhaseKind::Capture => {
                let _ = writeln!(
                    s,
                    r##"<rect class="capture" x="{x0:.1}" y="{top:.1}" width="{:.1}" height="{h:.1}" fill="#ff7f0e" fill-opacity="0.15"><title>capture</title></rect>"##,
                    (x1 - x0).max(1.0)
                );
            }
            PhaseKind::Variant => {
                let _ = writeln!(
                    s,
                    r##"<line class="variant" x1="{x0:.1}" y1="{top:.1}" x2="{x0:.1}" y2="{:.1}" stroke="#9467bd" stroke-dasharray="2 2"/><text x="{:.1}" y="{:.1}" fill="#9467bd">variant {}</text>"##,
                    top + h,
                    x0 + 3.0,
                    top + h - 6.0,
                    p.variant
                );
            }
        }
    }
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
