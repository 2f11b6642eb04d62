//! The churn benchmark's plot: an SVG with its latency, CPU and memory over time.

use std::path::Path;

use plotters::prelude::*;

use super::BenchError;

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
