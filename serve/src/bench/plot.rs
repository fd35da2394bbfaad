//! The benchmark's SVG chart: acceptance per depth, and speedup over `ar` per category.

use plotters::prelude::*;

use super::report::BenchReport;

/// Renders `report` as an SVG document.
pub fn svg(report: &BenchReport) -> anyhow::Result<String> {
    let mut text = String::new();
    draw(report, &mut text).map_err(|e| anyhow::anyhow!("drawing the benchmark chart: {e}"))?;
    Ok(text)
}

type DrawResult = std::result::Result<(), Box<dyn std::error::Error>>;

fn draw(report: &BenchReport, out: &mut String) -> DrawResult {
    let root = SVGBackend::with_string(out, (960, 400)).into_drawing_area();
    root.fill(&WHITE)?;
    let (left, right) = root.split_horizontally(480);
    let depths: Vec<(String, f64)> = report
        .per_depth_acceptance
        .iter()
        .enumerate()
        .map(|(d, &a)| (format!("{}", d + 1), a))
        .collect();
    bars(
        &left,
        &format!("{}: acceptance per depth", report.method),
        "depth",
        &depths,
        1.0,
        None,
    )?;
    let speedups: Vec<(String, f64)> = report
        .per_category
        .iter()
        .filter_map(|(name, c)| c.speedup_vs_ar.map(|s| (name.clone(), s)))
        .collect();
    let top = speedups.iter().map(|s| s.1).fold(1.0, f64::max) * 1.15;
    bars(
        &right,
        &format!("{}: speedup vs ar", report.method),
        "category",
        &speedups,
        top,
        Some(1.0),
    )?;
    root.present()?;
    Ok(())
}

/// A bar chart of `values` (label, height) on `area`, with an optional dashed reference line.
fn bars<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    x_label: &str,
    values: &[(String, f64)],
    y_max: f64,
    reference: Option<f64>,
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    let n = values.len().max(1);
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(48)
        .y_label_area_size(40)
        .build_cartesian_2d((0..n).into_segmented(), 0.0..y_max)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_desc(x_label)
        .x_labels(n)
        .x_label_formatter(&|x| match x {
            SegmentValue::CenterOf(i) => values.get(*i).map(|v| v.0.clone()).unwrap_or_default(),
            _ => String::new(),
        })
        .draw()?;
    chart.draw_series(values.iter().enumerate().map(|(i, (_, v))| {
        let mut bar = Rectangle::new(
            [
                (SegmentValue::Exact(i), 0.0),
                (SegmentValue::Exact(i + 1), *v),
            ],
            BLUE.mix(0.6).filled(),
        );
        bar.set_margin(0, 0, 8, 8);
        bar
    }))?;
    if let Some(y) = reference {
        chart.draw_series(LineSeries::new(
            vec![(SegmentValue::Exact(0), y), (SegmentValue::Exact(n), y)],
            RED.stroke_width(1),
        ))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::{Comparison, Summary};

    fn summary(tokens_per_s: f64) -> Summary {
        Summary {
            prompts: 1,
            new_tokens: 10,
            seconds: 10.0 / tokens_per_s,
            tokens_per_s,
            prompt_tokens: 20,
            prefill_tokens_per_s: 200.0,
            decode_tokens_per_s: tokens_per_s,
            tau: 2.0,
            mean_accepted: 1.0,
        }
    }

    #[test]
    fn the_chart_names_every_category_and_depth() {
        let comparison = Comparison {
            method: summary(30.0),
            ar: Some(summary(20.0)),
            speedup_vs_ar: Some(1.5),
        };
        let report = BenchReport {
            method: "eagle".into(),
            settings: serde_json::json!({}),
            tau: 2.0,
            tokens_per_s: 30.0,
            speedup_vs_ar: Some(1.5),
            predicted_speedup: Some(1.7),
            per_depth_acceptance: vec![0.7, 0.5, 0.3],
            host: None,
            overall: comparison.clone(),
            per_category: [
                ("coding".to_string(), comparison.clone()),
                ("rag".to_string(), comparison),
            ]
            .into_iter()
            .collect(),
            identical_to_ar: Some(0),
            rows_curve: None,
            profile: None,
            per_prompt: Vec::new(),
        };
        let svg = svg(&report).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..40]);
        for label in [
            "coding",
            "rag",
            "acceptance per depth",
            "speedup vs ar",
            ">\n3\n<",
        ] {
            assert!(svg.contains(label), "{label} missing");
        }
    }
}
