//! What a run reports: `metrics.jsonl` (one JSON object per log or eval event), `loss.svg`
//! (rewritten at each evaluation), and progress on the terminal (an `indicatif` bar on a TTY,
//! plain lines otherwise).

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use plotters::prelude::*;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// "train" (a logged step) or "eval".
    pub event: String,
    pub step: usize,
    pub train_loss: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_ppl: Option<f64>,
    pub lr: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_per_sec: Option<f64>,
    pub elapsed_s: f64,
    /// In a job of several ranks: its size; `tokens_per_sec` is then the whole job's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ranks: Option<usize>,
    /// In a job of several ranks, each rank's seconds (in rank order) since the last logged step
    /// spent summing gradients once all ranks were there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allreduce_s: Option<Vec<f64>>,
    /// ... and waiting for the other ranks to get there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_s: Option<Vec<f64>>,
}

pub struct Metrics {
    path: PathBuf,
    pub events: Vec<Event>,
}

impl Metrics {
    pub const FILE: &'static str = "metrics.jsonl";

    /// Opens `OUT/metrics.jsonl`. A fresh run starts it empty; a resumed run keeps the events up
    /// to the checkpoint's step and drops any logged after it (they will be logged again).
    pub fn open(out: &Path, resume_step: Option<usize>) -> Result<Self> {
        let path = out.join(Self::FILE);
        let events: Vec<Event> = match resume_step {
            None => vec![],
            Some(step) => std::fs::read_to_string(&path)
                .unwrap_or_default()
                .lines()
                .filter_map(|l| serde_json::from_str::<Event>(l).ok())
                .filter(|e| e.step <= step)
                .collect(),
        };
        let mut text = String::new();
        for e in &events {
            text.push_str(&serde_json::to_string(e)?);
            text.push('\n');
        }
        gpt::files::write_atomic(&path, text.as_bytes())?;
        Ok(Self { path, events })
    }

    pub fn log(&mut self, event: Event) -> Result<()> {
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(&self.path)
            .with_context(|| format!("appending to {}", self.path.display()))?;
        writeln!(file, "{}", serde_json::to_string(&event)?)?;
        self.events.push(event);
        Ok(())
    }

    /// Draws train (logged steps and evaluations) and val loss against the step into an SVG.
    pub fn plot(&self, path: &Path) -> Result<()> {
        let series = |kind: &str, loss: fn(&Event) -> Option<f64>| -> Vec<(f64, f64)> {
            let events = self.events.iter().filter(|e| e.event == kind);
            events.filter_map(|e| Some((e.step as f64, loss(e)?))).collect()
        };
        let train = series("train", |e| e.train_loss);
        let eval_train = series("eval", |e| e.train_loss);
        let val = series("eval", |e| e.val_loss);
        let all = || train.iter().chain(&eval_train).chain(&val);
        let x_max = all().map(|p| p.0).fold(1.0, f64::max);
        let y_max = all().map(|p| p.1).fold(0.0, f64::max) * 1.05 + 1e-3;
        let y_min = all().map(|p| p.1).fold(f64::INFINITY, f64::min).min(y_max) * 0.95;

        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, (900, 540)).into_drawing_area();
            let draw = |e: DrawingAreaErrorKind<std::io::Error>| anyhow::anyhow!("drawing the loss plot: {e}");
            root.fill(&WHITE).map_err(draw)?;
            let mut chart = ChartBuilder::on(&root)
                .caption("loss", ("sans-serif", 24))
                .margin(16)
                .x_label_area_size(40)
                .y_label_area_size(56)
                .build_cartesian_2d(0.0..x_max, y_min..y_max)
                .map_err(draw)?;
            chart
                .configure_mesh()
                .x_desc("step")
                .y_desc("cross-entropy (nats/token)")
                .draw()
                .map_err(draw)?;
            for (points, color, label) in [
                (&train, BLUE.mix(0.5), "train (logged steps)"),
                (&eval_train, BLUE.mix(1.0), "train (eval)"),
                (&val, RED.mix(1.0), "val (eval)"),
            ] {
                chart
                    .draw_series(LineSeries::new(points.iter().copied(), color.stroke_width(2)))
                    .map_err(draw)?
                    .label(label)
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
            }
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .draw()
                .map_err(draw)?;
            root.present().map_err(draw)?;
        }
        Ok(gpt::files::write_atomic(path, svg.as_bytes())?)
    }
}

/// A progress bar on a terminal, plain log lines elsewhere; nothing at all when hidden (ranks
/// of a job other than rank 0).
pub struct Progress {
    bar: Option<ProgressBar>,
    hidden: bool,
}

impl Progress {
    pub fn hidden() -> Self {
        Self {
            bar: None,
            hidden: true,
        }
    }

    pub fn new(start: usize, total: usize) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new(total as u64).with_position(start as u64);
            let style =
                ProgressStyle::with_template("{bar:30.cyan/blue} {pos}/{len} {msg} [{elapsed_precise}, ETA {eta}]")
                    .unwrap_or_else(|_| ProgressStyle::default_bar());
            bar.set_style(style);
            bar
        });
        Self { bar, hidden: false }
    }

    /// The step's figures, and `more` after them.
    pub fn step(&self, step: usize, loss: f64, lr: f64, tokens_per_sec: f64, more: &str, log_line: bool) {
        let msg = format!("loss {loss:.4} lr {lr:.2e} {:.1}k tok/s{more}", tokens_per_sec / 1e3);
        match &self.bar {
            Some(bar) => {
                bar.set_position(step as u64);
                bar.set_message(msg);
            }
            None if log_line && !self.hidden => eprintln!("step {step}: {msg}"),
            None => {}
        }
    }

    /// A line that stays above the bar.
    pub fn println(&self, line: &str) {
        match &self.bar {
            Some(bar) => bar.println(line),
            None if !self.hidden => eprintln!("{line}"),
            None => {}
        }
    }

    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
