//! Bus bandwidth against message size, log-log, one line per series, as a PNG.

use plotters::prelude::*;

/// Fonts tried for labels, in order (`BRAID_PLOT_FONT` first).
const FONTS: [&str; 3] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
];

pub(crate) fn load_font() -> Result<(), String> {
    let candidates: Vec<String> = std::env::var("BRAID_PLOT_FONT")
        .ok()
        .into_iter()
        .chain(FONTS.iter().map(|s| s.to_string()))
        .collect();
    for path in &candidates {
        if let Ok(bytes) = std::fs::read(path) {
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            return plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
                .map_err(|_| format!("{path} is not a usable TrueType font"));
        }
    }
    Err(format!(
        "no TrueType font for the plot's labels (tried {}); install fonts-dejavu-core or set BRAID_PLOT_FONT",
        candidates.join(", ")
    ))
}

/// Writes `series` (name, points of (bytes, busbw GB/s)) of collective `what` to `path`.
pub fn busbw(
    path: &str,
    series: &[(String, Vec<(f64, f64)>)],
    what: &str,
    world: usize,
) -> Result<(), String> {
    load_font()?;
    let pts = series
        .iter()
        .flat_map(|(_, p)| p.iter())
        .filter(|(x, y)| *x > 0.0 && *y > 0.0);
    let (mut xmin, mut xmax, mut ymin, mut ymax) = (f64::MAX, 0f64, f64::MAX, 0f64);
    for (x, y) in pts {
        xmin = xmin.min(*x);
        xmax = xmax.max(*x);
        ymin = ymin.min(*y);
        ymax = ymax.max(*y);
    }
    if xmax <= 0.0 {
        return Err("nothing to plot".into());
    }
    let root = BitMapBackend::new(path, (1000, 650)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("braid {what}, {world} ranks: bus bandwidth"),
            ("sans-serif", 24),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d(
            (xmin..xmax * 1.2).log_scale(),
            (ymin * 0.8..ymax * 1.25).log_scale(),
        )
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("message size (bytes)")
        .y_desc("busbw (GB/s)")
        .x_label_formatter(&|x| human(*x))
        .draw()
        .map_err(|e| e.to_string())?;
    for (i, (name, points)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let pts: Vec<(f64, f64)> = points
            .iter()
            .copied()
            .filter(|(x, y)| *x > 0.0 && *y > 0.0)
            .collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label(name.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart
            .draw_series(pts.iter().map(|p| Circle::new(*p, 3, color.filled())))
            .map_err(|e| e.to_string())?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
}

fn human(x: f64) -> String {
    match x {
        x if x >= (1u64 << 30) as f64 => format!("{:.0}G", x / (1u64 << 30) as f64),
        x if x >= (1 << 20) as f64 => format!("{:.0}M", x / (1 << 20) as f64),
        x if x >= 1024.0 => format!("{:.0}K", x / 1024.0),
        x => format!("{x:.0}"),
    }
}
