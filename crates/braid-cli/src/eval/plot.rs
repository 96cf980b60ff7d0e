//! Line charts of per-step series (one line per setting) as PNGs.

use std::sync::OnceLock;

use plotters::prelude::*;

/// One line: its label and its points `(step, value)`.
pub type Series = (String, Points);

/// Points `(step, value)`.
pub type Points = Vec<(f64, f64)>;

/// Draws `series` to `path` with a logarithmic y axis; non-positive and non-finite values are left out,
/// and a series left with no points is left out of the chart.
pub fn lines(path: &str, title: &str, y_desc: &str, series: &[Series]) -> Result<(), String> {
    static FONT: OnceLock<Result<(), String>> = OnceLock::new();
    FONT.get_or_init(crate::plot::load_font).clone()?;
    // Each series keeps its colour (its index in `series`) even when others are left out.
    let kept: Vec<(usize, &str, Points)> = series
        .iter()
        .enumerate()
        .map(|(i, (name, pts))| {
            let pts: Vec<(f64, f64)> = pts
                .iter()
                .copied()
                .filter(|(x, y)| x.is_finite() && y.is_finite() && *y > 0.0)
                .collect();
            (i, name.as_str(), pts)
        })
        .filter(|(_, _, pts)| !pts.is_empty())
        .collect();
    let (mut xmax, mut ymin, mut ymax) = (1f64, f64::MAX, f64::MIN_POSITIVE);
    for (_, _, pts) in &kept {
        for (x, y) in pts {
            xmax = xmax.max(*x);
            ymin = ymin.min(*y);
            ymax = ymax.max(*y);
        }
    }
    if kept.is_empty() {
        return Err(format!("{path}: nothing to plot"));
    }
    if ymax <= ymin {
        ymax = ymin * 2.0;
    }
    let root = BitMapBackend::new(path, (1000, 650)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 24))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        // The y axis holds log10 of the values on a linear scale, labelled with the values: ticks then fall
        // inside the range even when it spans less than a decade.
        .build_cartesian_2d(0f64..xmax, (ymin * 0.9).log10()..(ymax * 1.1).log10())
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc(y_desc)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_labels(8)
        .y_label_formatter(&|y| format!("{:.3}", 10f64.powf(*y)))
        .draw()
        .map_err(|e| e.to_string())?;
    for (i, name, pts) in &kept {
        let color = Palette99::pick(*i).to_rgba();
        chart
            .draw_series(LineSeries::new(
                pts.iter().map(|(x, y)| (*x, y.log10())),
                color.stroke_width(2),
            ))
            .map_err(|e| e.to_string())?
            .label(name.to_string())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| format!("{path}: {e}"))
}
