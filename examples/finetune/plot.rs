//! The run's curves as one SVG drawn with `plotters` (its SVG backend: text stays text, so no
//! font files are needed): the training loss as a line and the validation loss as dots on top;
//! below, the step time and the peak resident memory per step.

use std::path::Path;

use plotters::prelude::*;

/// What to plot, all per optimizer step: `(step, value)`.
pub struct Curves<'a> {
    /// Training loss.
    pub train: &'a [(f64, f64)],
    /// Validation loss.
    pub val: &'a [(f64, f64)],
    /// Step time in seconds.
    pub seconds: &'a [(f64, f64)],
    /// Peak resident set in MB.
    pub peak_rss_mb: &'a [(f64, f64)],
    /// Validation exact-match accuracy in [0, 1] (right axis of the loss panel).
    pub val_accuracy: &'a [(f64, f64)],
}

/// `[lo, hi]` of the finite values, widened so a flat curve still gets a band.
fn range(points: &[&(f64, f64)], floor_zero: bool) -> std::ops::Range<f64> {
    let ys = points.iter().map(|p| p.1).filter(|y| y.is_finite());
    let (lo, hi) = ys.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), y| (a.min(y), b.max(y)));
    let (lo, hi) = if lo.is_finite() { (lo, hi) } else { (0.0, 1.0) };
    let pad = ((hi - lo) * 0.05).max(hi.abs() * 1e-3).max(1e-6);
    let lo = if floor_zero { 0.0 } else { lo - pad };
    lo..hi + pad
}

/// Draw `c` into `path` (written to a temporary file, then renamed).
pub fn curves(path: &Path, c: &Curves) -> Result<(), String> {
    let finite = |s: &[(f64, f64)]| s.iter().copied().filter(|p| p.1.is_finite()).collect::<Vec<_>>();
    let (train, val, secs, rss, acc) = (finite(c.train), finite(c.val), finite(c.seconds), finite(c.peak_rss_mb), finite(c.val_accuracy));
    if train.is_empty() && val.is_empty() {
        return Err("no finite losses to plot".into());
    }
    let last = train.iter().chain(&val).chain(&secs).chain(&acc).map(|p| p.0).fold(1.0, f64::max);
    let xs = 0.0..last;
    let tmp = path.with_extension("svg.partial");
    {
        let e = |e: DrawingAreaErrorKind<std::io::Error>| format!("{}: {e}", tmp.display());
        let root = SVGBackend::new(&tmp, (900, 760)).into_drawing_area();
        root.fill(&WHITE).map_err(e)?;
        let (top, bottom) = root.split_vertically(460);

        let losses: Vec<&(f64, f64)> = train.iter().chain(&val).collect();
        let mut chart = ChartBuilder::on(&top)
            .caption("loss", ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .right_y_label_area_size(if acc.is_empty() { 0 } else { 60 })
            .build_cartesian_2d(xs.clone(), range(&losses, false))
            .map_err(e)?
            .set_secondary_coord(xs.clone(), 0.0..1.0);
        chart.configure_mesh().x_desc("step").y_desc("loss").light_line_style(RGBColor(236, 236, 236)).draw().map_err(e)?;
        if !acc.is_empty() {
            chart.configure_secondary_axes().y_desc("validation exact match").draw().map_err(e)?;
        }
        let blue = RGBColor(31, 119, 180);
        let orange = RGBColor(230, 120, 20);
        chart
            .draw_series(LineSeries::new(train.iter().copied(), blue.stroke_width(2)))
            .map_err(e)?
            .label("train")
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], blue.stroke_width(2)));
        chart
            .draw_series(val.iter().map(|&p| Circle::new(p, 4, orange.filled())))
            .map_err(e)?
            .label("validation")
            .legend(move |(x, y)| Circle::new((x + 10, y), 4, orange.filled()));
        if !acc.is_empty() {
            let green = RGBColor(44, 160, 44);
            chart
                .draw_secondary_series(LineSeries::new(acc.iter().copied(), green.stroke_width(2)).point_size(3))
                .map_err(e)?
                .label("validation exact match (right axis)")
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], green.stroke_width(2)));
        }
        chart.configure_series_labels().background_style(WHITE.mix(0.85)).border_style(BLACK).draw().map_err(e)?;

        let secs_ref: Vec<&(f64, f64)> = secs.iter().collect();
        let rss_ref: Vec<&(f64, f64)> = rss.iter().collect();
        let mut chart = ChartBuilder::on(&bottom)
            .caption("step time and peak memory", ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .right_y_label_area_size(70)
            .build_cartesian_2d(xs.clone(), range(&secs_ref, true))
            .map_err(e)?
            .set_secondary_coord(xs, range(&rss_ref, true));
        chart.configure_mesh().x_desc("step").y_desc("seconds per step").light_line_style(RGBColor(236, 236, 236)).draw().map_err(e)?;
        chart.configure_secondary_axes().y_desc("peak RSS (MB)").draw().map_err(e)?;
        let green = RGBColor(44, 160, 44);
        let red = RGBColor(214, 39, 40);
        chart
            .draw_series(LineSeries::new(secs.iter().copied(), green.stroke_width(2)))
            .map_err(e)?
            .label("step time")
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], green.stroke_width(2)));
        chart
            .draw_secondary_series(LineSeries::new(rss.iter().copied(), red.stroke_width(2)))
            .map_err(e)?
            .label("peak RSS")
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], red.stroke_width(2)));
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(e)?;
        root.present().map_err(e)?;
    }
    std::fs::rename(&tmp, path).map_err(|e| format!("{}: {e}", path.display()))
}
