//! A hand-written SVG line plot: GB/s against message size on a log2 x axis, with the baseline
//! dashed. No plotting crate: axes, ticks, grid, lines, markers and a legend are a few dozen
//! SVG elements.

use std::fmt::Write as _;

use super::results::format_size;

/// One line of the plot.
pub struct Series {
    /// Legend text.
    pub label: String,
    /// `(bytes, GB/s)` points.
    pub points: Vec<(u64, f64)>,
    /// Drawn dashed (baselines).
    pub dashed: bool,
    /// Drawn thin and without markers (per-GPU lines under a sum).
    pub thin: bool,
}

const WIDTH: f64 = 860.0;
const HEIGHT: f64 = 500.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 200.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 55.0;
const COLORS: &[&str] = &[
    "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf",
    "#7f7f7f", "#bcbd22",
];

/// Renders the plot. The y axis starts at 0 and ends at a round number above the largest value.
pub fn render(title: &str, series: &[Series]) -> String {
    let xs: Vec<f64> = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| (p.0.max(1) as f64).log2()))
        .collect();
    let (xmin, xmax) = xs
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &x| {
            (lo.min(x), hi.max(x))
        });
    let (xmin, xmax) = if xmin.is_finite() && xmax > xmin {
        (xmin, xmax)
    } else if xmin.is_finite() {
        (xmin - 1.0, xmin + 1.0)
    } else {
        (12.0, 26.0)
    };
    let ymax_data = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(0.0_f64, f64::max);
    let (ystep, ymax) = nice_axis(ymax_data);
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let px = |x: f64| LEFT + (x - xmin) / (xmax - xmin) * plot_w;
    let py = |y: f64| TOP + plot_h - y / ymax * plot_h;

    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="15">{}</text>"#,
        LEFT + plot_w / 2.0,
        escape(title)
    );
    // Horizontal grid and y labels.
    let mut y = 0.0;
    while y <= ymax + ystep / 2.0 {
        let yy = py(y);
        let _ = writeln!(
            svg,
            r##"<line x1="{LEFT}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#e5e5e5"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            LEFT + plot_w,
            LEFT - 6.0,
            yy + 4.0,
            trim_number(y)
        );
        y += ystep;
    }
    // Vertical grid and x labels at powers of two (every other one when crowded).
    let (first, last) = (xmin.ceil() as i64, xmax.floor() as i64);
    let every = if last - first > 12 { 2 } else { 1 };
    for e in first..=last {
        let xx = px(e as f64);
        let _ = writeln!(
            svg,
            r##"<line x1="{xx:.1}" y1="{TOP}" x2="{xx:.1}" y2="{:.1}" stroke="#f0f0f0"/>"##,
            TOP + plot_h
        );
        if (e - first) % every == 0 {
            let _ = writeln!(
                svg,
                r#"<text x="{xx:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                TOP + plot_h + 18.0,
                format_size(1u64 << e.clamp(0, 62))
            );
        }
    }
    let _ = writeln!(
        svg,
        r##"<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#333"/>"##
    );
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">message size (log2 scale)</text>"#,
        LEFT + plot_w / 2.0,
        HEIGHT - 12.0
    );
    let _ = writeln!(
        svg,
        r#"<text transform="translate(18 {:.1}) rotate(-90)" text-anchor="middle">GB/s (10^9 bytes/s)</text>"#,
        TOP + plot_h / 2.0
    );
    // Lines, markers, legend.
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let mut pts: Vec<(f64, f64)> = s
            .points
            .iter()
            .map(|&(b, g)| (px((b.max(1) as f64).log2()), py(g.max(0.0))))
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let path: Vec<String> = pts.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
        let dash = if s.dashed {
            r#" stroke-dasharray="6 4""#
        } else {
            ""
        };
        let width = if s.thin { 1.0 } else { 2.2 };
        let _ = writeln!(
            svg,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="{width}"{dash}/>"#,
            path.join(" ")
        );
        if !s.thin {
            for (x, y) in &pts {
                let _ = writeln!(
                    svg,
                    r#"<circle cx="{x:.1}" cy="{y:.1}" r="2.8" fill="{color}"/>"#
                );
            }
        }
        let ly = TOP + 10.0 + i as f64 * 20.0;
        let lx = LEFT + plot_w + 15.0;
        let _ = writeln!(
            svg,
            r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="{width}"{dash}/><text x="{}" y="{}">{}</text>"#,
            lx + 28.0,
            lx + 34.0,
            ly + 4.0,
            escape(&s.label)
        );
    }
    svg.push_str("</svg>\n");
    svg
}

/// A round tick step and axis maximum (about five ticks) covering `max`.
fn nice_axis(max: f64) -> (f64, f64) {
    if max.is_nan() || max <= 0.0 || !max.is_finite() {
        return (0.2, 1.0);
    }
    let rough = max / 5.0;
    let mag = 10f64.powf(rough.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= rough)
        .unwrap_or(10.0 * mag);
    (step, (max / step).ceil() * step)
}

fn trim_number(v: f64) -> String {
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axis_is_round() {
        assert_eq!(nice_axis(9.3), (2.0, 10.0));
        assert_eq!(nice_axis(0.0), (0.2, 1.0));
        let (step, max) = nice_axis(123.0);
        assert!(max >= 123.0 && step > 0.0);
    }

    #[test]
    fn renders_lines_and_legend() {
        let svg = render(
            "t <1>",
            &[
                Series {
                    label: "tcpx".into(),
                    points: vec![(4096, 1.0), (8192, 2.0), (1 << 20, 5.0)],
                    dashed: false,
                    thin: false,
                },
                Series {
                    label: "raw TCP".into(),
                    points: vec![(4096, 1.5), (1 << 20, 6.0)],
                    dashed: true,
                    thin: false,
                },
            ],
        );
        assert!(svg.starts_with("<svg"));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("stroke-dasharray"));
        assert!(svg.contains("t &lt;1&gt;"));
        assert!(svg.contains(">4KiB<") && svg.contains(">1MiB<"));
    }
}
