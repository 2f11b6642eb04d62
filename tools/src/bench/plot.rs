//! The churn benchmark's plot: an SVG with its latency, CPU and memory over time.

use std::path::Path;

use plotters::prelude::*;

use super::error::BenchError;

fn failed(e: impl std::fmt::Display) -> BenchError {
    BenchError::Worker(format!("cannot draw the churn plot: {e}"))
}

/// Draws three panels into `path` under `title`: API event → commit latency per minute
/// (`(minute, p50 ms, p99 ms)`), and the agent's CPU share and RSS per sample
/// (`(minute, CPU %, RSS MiB)`).
pub fn churn(
    path: &Path,
    title: &str,
    latency: &[(f64, f64, f64)],
    samples: &[(f64, f64, f64)],
) -> Result<(), BenchError> {
    let root = SVGBackend::new(path, (900, 900)).into_drawing_area();
    root.fill(&WHITE).map_err(failed)?;
    let root = root.titled(title, ("sans-serif", 20)).map_err(failed)?;
    let panels = root.split_evenly((3, 1));
    let end = samples.last().map_or(1.0, |s| s.0).max(latency.len() as f64).max(1.0);

    let top = latency.iter().map(|l| l.2).fold(0.0, f64::max).max(1.0) * 1.15;
    let mut chart = ChartBuilder::on(&panels[0])
        .caption("API event → commit, per minute (ms)", ("sans-serif", 16))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..end, 0f64..top)
        .map_err(failed)?;
    chart.configure_mesh().x_desc("minute").draw().map_err(failed)?;
    chart
        .draw_series(LineSeries::new(latency.iter().map(|l| (l.0, l.1)), &BLUE))
        .map_err(failed)?
        .label("p50")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE));
    chart
        .draw_series(LineSeries::new(latency.iter().map(|l| (l.0, l.2)), &RED))
        .map_err(failed)?
        .label("p99")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED));
    chart.configure_series_labels().border_style(BLACK).draw().map_err(failed)?;

    for (panel, caption, pick) in
        [(&panels[1], "CPU (% of one core)", 1usize), (&panels[2], "resident memory (MiB)", 2usize)]
    {
        let value = |s: &(f64, f64, f64)| if pick == 1 { s.1 } else { s.2 };
        let top = samples.iter().map(value).fold(0.0, f64::max).max(1.0) * 1.15;
        let mut chart = ChartBuilder::on(panel)
            .caption(caption, ("sans-serif", 16))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..end, 0f64..top)
            .map_err(failed)?;
        chart.configure_mesh().x_desc("minute").draw().map_err(failed)?;
        chart.draw_series(LineSeries::new(samples.iter().map(|s| (s.0, value(s))), &BLACK)).map_err(failed)?;
    }
    root.present().map_err(failed)
}

/// The colours of the proxies, in the order given.
const COLOURS: [RGBColor; 4] = [BLUE, RED, RGBColor(0, 150, 0), MAGENTA];

/// One proxy's line in the head-to-head's churn plot.
pub struct ChurnSeries<'a> {
    pub name: String,
    /// (minutes since the start, p50 ms, p99 ms) per sampling interval.
    pub latency_samples: &'a [(f64, f64, f64)],
    /// (minutes since the start, CPU % of one core, RSS MiB).
    pub samples: &'a [(f64, f64, f64)],
}

/// The head-to-head's churn plot: for each proxy, API write → kernel commit per sampling
/// interval (p50 solid, p99 dashed), and its CPU share and RSS per sample.
pub fn head_to_head_churn(path: &Path, title: &str, series: &[ChurnSeries<'_>]) -> Result<(), BenchError> {
    let root = SVGBackend::new(path, (900, 1000)).into_drawing_area();
    root.fill(&WHITE).map_err(failed)?;
    let root = root.titled(title, ("sans-serif", 20)).map_err(failed)?;
    let panels = root.split_evenly((3, 1));
    let end = series.iter().map(|c| c.samples.last().map_or(0.0, |s| s.0)).fold(0.1, f64::max);

    let per_minute = |c: &ChurnSeries<'_>, p99: bool| -> Vec<(f64, f64)> {
        c.latency_samples.iter().map(|&(t, p50, p99_)| (t, if p99 { p99_ } else { p50 })).collect()
    };
    let top = series.iter().flat_map(|c| per_minute(c, true)).map(|p| p.1).fold(0.0, f64::max).max(1.0) * 1.15;
    let mut chart = ChartBuilder::on(&panels[0])
        .caption("API write → kernel commit, ms, per 10 s of writes (p50 solid, p99 dashed)", ("sans-serif", 16))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..end, 0f64..top)
        .map_err(failed)?;
    chart.configure_mesh().x_desc("minute").draw().map_err(failed)?;
    for (k, c) in series.iter().enumerate() {
        let colour = COLOURS[k % COLOURS.len()];
        chart
            .draw_series(LineSeries::new(per_minute(c, false), colour.stroke_width(2)))
            .map_err(failed)?
            .label(c.name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2)));
        chart.draw_series(DashedLineSeries::new(per_minute(c, true), 6, 4, colour.stroke_width(1))).map_err(failed)?;
    }
    chart.configure_series_labels().border_style(BLACK).background_style(WHITE).draw().map_err(failed)?;

    for (panel, caption, pick) in
        [(&panels[1], "CPU, % of one core (children included)", 1usize), (&panels[2], "resident memory (MiB)", 2usize)]
    {
        let value = |s: &(f64, f64, f64)| if pick == 1 { s.1 } else { s.2 };
        let top = series.iter().flat_map(|c| c.samples.iter().map(value)).fold(0.0, f64::max).max(1.0) * 1.15;
        let mut chart = ChartBuilder::on(panel)
            .caption(caption, ("sans-serif", 16))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..end, 0f64..top)
            .map_err(failed)?;
        chart.configure_mesh().x_desc("minute").draw().map_err(failed)?;
        for (k, c) in series.iter().enumerate() {
            let colour = COLOURS[k % COLOURS.len()];
            chart
                .draw_series(LineSeries::new(c.samples.iter().map(|s| (s.0, value(s))), colour.stroke_width(2)))
                .map_err(failed)?
                .label(c.name.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2)));
        }
        chart.configure_series_labels().border_style(BLACK).background_style(WHITE).draw().map_err(failed)?;
    }
    root.present().map_err(failed)
}
