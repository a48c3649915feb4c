//! `watch`'s live view (`ratatui`, crossterm backend): per channel its frames/s and each
//! consumer's lag as sparklines, the GPUs' utilization and memory as bars (when NVML answers),
//! the quota budgets, and the hand-off latency histogram. Shown when stdout is a terminal and
//! neither `--plain` nor `--json` is given; `q`, Esc or Ctrl-C leaves it.
//!
//! [`App`] keeps the history the sparklines need and is filled from a [`Sample`] with
//! [`App::update`]; [`draw`] renders it on any backend, so tests render it on ratatui's
//! `TestBackend` and read the screen.

use crate::latency::{BUCKETS, LatencyBuckets};
use crate::quota::device_name;
use crate::state::{self, Sample};
use crate::text::bytes;
use cuda_ipc::identity::Liveness;
use ratatui::Frame;
use ratatui::layout::{Constraint, Direction, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{BarChart, Block, Borders, Gauge, Paragraph, Sparkline, Wrap};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Samples kept per sparkline.
const HISTORY: usize = 120;

/// One consumer's row.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ConsumerPane {
    /// `consumer 0 (pid 4242)`.
    pub label: String,
    /// Lag (frames behind the head) per refresh, oldest first.
    pub lag: VecDeque<u64>,
    /// Frames received per second at the last refresh.
    pub received_per_s: Option<f64>,
}

/// One channel's pane.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ChannelPane {
    /// The channel name.
    pub name: String,
    /// `producer 4241 alive, 4 × 31.6 MiB`.
    pub summary: String,
    /// Frames per second per refresh, oldest first (rounded).
    pub fps: VecDeque<u64>,
    /// Frames per second at the last refresh.
    pub fps_now: Option<f64>,
    /// Its consumers, by slot.
    pub consumers: Vec<ConsumerPane>,
}

/// One GPU's bars.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GpuPane {
    /// `GPU 0 NVIDIA H200`.
    pub label: String,
    /// Utilization in percent.
    pub utilization: Option<u32>,
    /// Memory used and total, bytes.
    pub memory: (u64, u64),
    /// The participants on it and the memory each holds: `producer of frames: 1.0 GiB`.
    pub processes: Vec<String>,
}

/// One quota budget's bar.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct QuotaPane {
    /// `uid 1000 on host`.
    pub label: String,
    /// Used and budget bytes (`None`: unlimited).
    pub used: u64,
    /// The budget.
    pub budget: Option<u64>,
    /// Live holders.
    pub holders: usize,
}

/// What the live view shows.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct App {
    /// The refresh interval, ms.
    pub interval_ms: u64,
    /// Refreshes so far.
    pub refresh: u64,
    /// Channels, in the listing's order.
    pub channels: Vec<ChannelPane>,
    /// GPUs (empty without NVML).
    pub gpus: Vec<GpuPane>,
    /// Why there are no GPU bars, when NVML is missing.
    pub nvml_missing: Option<String>,
    /// Participants NVML's processes could not be matched to, with why.
    pub unmatched: Vec<String>,
    /// Budgets.
    pub quotas: Vec<QuotaPane>,
    /// Every consumer's hand-off latency, added up.
    pub latency: LatencyBuckets,
    /// Registries, segments that cannot be read, dead peers: one line each.
    pub notes: Vec<String>,
}

fn push(h: &mut VecDeque<u64>, v: u64) {
    if h.len() == HISTORY {
        h.pop_front();
    }
    h.push_back(v);
}

impl App {
    /// Takes in one sample (whose listing has `watch`'s rates in it).
    pub fn update(&mut self, s: &Sample) {
        self.refresh += 1;
        let mut channels = Vec::new();
        for c in &s.listing.channels {
            let snap = &c.snapshot;
            let mut pane = self
                .channels
                .iter()
                .find(|p| p.name == snap.name)
                .cloned()
                .unwrap_or_else(|| ChannelPane {
                    name: snap.name.clone(),
                    ..Default::default()
                });
            pane.summary = format!(
                "producer {} {}, {} × {}, head {}",
                snap.producer.pid,
                crate::text::liveness(snap.producer_liveness),
                snap.buffers.len(),
                bytes(snap.buffer_bytes),
                snap.head
            );
            pane.fps_now = c.frames_per_s;
            push(&mut pane.fps, c.frames_per_s.unwrap_or(0.0).round() as u64);
            let mut consumers = Vec::new();
            for (k, x) in snap.consumers.iter().enumerate() {
                let label = format!("consumer {} (pid {})", x.index, x.identity.pid);
                let mut cp = pane
                    .consumers
                    .iter()
                    .find(|p| p.label == label)
                    .cloned()
                    .unwrap_or(ConsumerPane {
                        label,
                        ..Default::default()
                    });
                push(&mut cp.lag, x.lag);
                cp.received_per_s = c.received_per_s.get(k).copied().flatten();
                consumers.push(cp);
            }
            pane.consumers = consumers;
            if snap.producer_liveness == Liveness::Dead {
                self.notes.retain(|n| !n.contains(&snap.name));
                self.notes.push(format!(
                    "channel {}: the producer is dead; `cuda-ipc gc` removes it",
                    snap.name
                ));
            }
            channels.push(pane);
        }
        self.channels = channels;
        self.nvml_missing = s.gpu.missing().map(str::to_string);
        self.gpus = s
            .gpu
            .gpus()
            .iter()
            .map(|g| GpuPane {
                label: format!("GPU {} {}", g.index, g.name),
                utilization: g.utilization_percent,
                memory: (g.memory_used, g.memory_total),
                processes: s
                    .matching
                    .processes
                    .iter()
                    .filter(|p| p.gpu == g.index)
                    .map(|p| {
                        let who = if p.participants.is_empty() {
                            format!("pid {} (not a participant)", p.process.pid)
                        } else {
                            p.participants
                                .iter()
                                .map(|x| x.role.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        };
                        format!("{who}: {}", p.process.used_bytes.map_or("?".into(), bytes))
                    })
                    .collect(),
            })
            .collect();
        self.unmatched = if self.nvml_missing.is_some() {
            Vec::new()
        } else {
            s.matching
                .unmatched
                .iter()
                .map(|(p, why)| format!("{} (pid {}): {why}", p.role, p.pid))
                .collect()
        };
        self.quotas = s
            .quotas
            .iter()
            .map(|q| QuotaPane {
                label: format!("{} on {}", q.scope, device_name(&q.device)),
                used: q.used,
                budget: q.budget,
                holders: q.holders.len(),
            })
            .collect();
        let mut lat = LatencyBuckets::default();
        for h in s.latency.values() {
            lat.merge(h);
        }
        self.latency = lat;
        self.notes.retain(|n| n.starts_with("channel "));
        for r in &s.listing.registries {
            self.notes.push(format!(
                "registry {}: {} records, {} participants, last seq {}",
                r.snapshot.name,
                r.snapshot.records.len(),
                r.snapshot.participants.len(),
                r.snapshot.last_seq
            ));
        }
        for e in &s.listing.errors {
            self.notes
                .push(format!("{} {}: cannot read: {}", e.kind, e.name, e.error));
        }
        for (n, e) in &s.quota_errors {
            self.notes
                .push(format!("quota ledger {n}: cannot read: {e}"));
        }
        for u in &self.unmatched {
            self.notes
                .push(format!("not matched to a GPU process: {u}"));
        }
    }
}

fn titled(title: &str) -> Block<'_> {
    Block::default()
        .borders(Borders::ALL)
        .title(Line::from(title).style(Style::default().add_modifier(Modifier::BOLD)))
}

fn rate(r: Option<f64>) -> String {
    r.map_or_else(|| "-".to_string(), |v| format!("{v:.1}"))
}

/// Renders `app` into `f`.
pub fn draw(f: &mut Frame, app: &App) {
    let area = f.area();
    let rows = Layout::default()
        .direction(Direction::Vertical)
        .constraints([
            Constraint::Length(1),
            Constraint::Min(6),
            Constraint::Length((app.notes.len().clamp(1, 4) as u16) + 2),
        ])
        .split(area);
    f.render_widget(
        Paragraph::new(format!(
            "cuda-ipc watch: every {} ms, refresh {}; q quits (--plain for lines)",
            app.interval_ms, app.refresh
        )),
        rows[0],
    );
    let cols = Layout::default()
        .direction(Direction::Horizontal)
        .constraints([Constraint::Percentage(55), Constraint::Percentage(45)])
        .split(rows[1]);
    draw_channels(f, app, cols[0]);
    let right = Layout::default()
        .direction(Direction::Vertical)
        .constraints([
            Constraint::Percentage(40),
            Constraint::Percentage(20),
            Constraint::Percentage(40),
        ])
        .split(cols[1]);
    draw_gpus(f, app, right[0]);
    draw_quotas(f, app, right[1]);
    draw_latency(f, app, right[2]);
    let notes: Vec<Line> = if app.notes.is_empty() {
        vec![Line::from("nothing to report")]
    } else {
        app.notes.iter().map(|n| Line::from(n.as_str())).collect()
    };
    f.render_widget(
        Paragraph::new(notes)
            .wrap(Wrap { trim: true })
            .block(titled("Notes")),
        rows[2],
    );
}

fn draw_channels(f: &mut Frame, app: &App, area: Rect) {
    let block = titled("Channels: frames/s and lag per consumer");
    let inner = block.inner(area);
    f.render_widget(block, area);
    if app.channels.is_empty() {
        f.render_widget(Paragraph::new("no cuda-ipc channels in /dev/shm"), inner);
        return;
    }
    // Per channel: a title line, its frames/s sparkline (2 rows), then 2 rows per consumer.
    let mut constraints = Vec::new();
    for c in &app.channels {
        constraints.push(Constraint::Length(1));
        constraints.push(Constraint::Length(2));
        for _ in &c.consumers {
            constraints.push(Constraint::Length(1));
            constraints.push(Constraint::Length(1));
        }
    }
    constraints.push(Constraint::Min(0));
    let rows = Layout::default()
        .direction(Direction::Vertical)
        .constraints(constraints)
        .split(inner);
    let mut i = 0;
    for c in &app.channels {
        f.render_widget(
            Paragraph::new(Line::from(format!(
                "{}: {} frames/s; {}",
                c.name,
                rate(c.fps_now),
                c.summary
            )))
            .style(Style::default().add_modifier(Modifier::BOLD)),
            rows[i],
        );
        let fps: Vec<u64> = c.fps.iter().copied().collect();
        f.render_widget(
            Sparkline::default()
                .data(&fps)
                .style(Style::default().fg(Color::Green)),
            rows[i + 1],
        );
        i += 2;
        for x in &c.consumers {
            f.render_widget(
                Paragraph::new(format!(
                    "  {}: lag {} frames, {} received/s",
                    x.label,
                    x.lag.back().copied().unwrap_or(0),
                    rate(x.received_per_s)
                )),
                rows[i],
            );
            let lag: Vec<u64> = x.lag.iter().copied().collect();
            f.render_widget(
                Sparkline::default()
                    .data(&lag)
                    .style(Style::default().fg(Color::Yellow)),
                rows[i + 1],
            );
            i += 2;
        }
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        (a as f64 / b as f64).clamp(0.0, 1.0)
    }
}

fn draw_gpus(f: &mut Frame, app: &App, area: Rect) {
    let block = titled("GPUs (NVML)");
    let inner = block.inner(area);
    f.render_widget(block, area);
    if let Some(why) = &app.nvml_missing {
        f.render_widget(
            Paragraph::new(why.as_str()).wrap(Wrap { trim: true }),
            inner,
        );
        return;
    }
    if app.gpus.is_empty() {
        f.render_widget(Paragraph::new("NVML sees no GPU"), inner);
        return;
    }
    let mut constraints = Vec::new();
    for g in &app.gpus {
        constraints.push(Constraint::Length(1));
        constraints.push(Constraint::Length(1));
        constraints.push(Constraint::Length(1));
        constraints.push(Constraint::Length(g.processes.len() as u16));
    }
    constraints.push(Constraint::Min(0));
    let rows = Layout::default()
        .direction(Direction::Vertical)
        .constraints(constraints)
        .split(inner);
    for (k, g) in app.gpus.iter().enumerate() {
        let r = &rows[k * 4..k * 4 + 4];
        f.render_widget(Paragraph::new(g.label.as_str()), r[0]);
        let u = g.utilization.unwrap_or(0);
        f.render_widget(
            Gauge::default()
                .ratio(f64::from(u.min(100)) / 100.0)
                .label(format!(
                    "utilization {}",
                    g.utilization.map_or("?".into(), |u| format!("{u}%"))
                ))
                .gauge_style(Style::default().fg(Color::Cyan)),
            r[1],
        );
        f.render_widget(
            Gauge::default()
                .ratio(ratio(g.memory.0, g.memory.1))
                .label(format!(
                    "memory {} of {}",
                    bytes(g.memory.0),
                    bytes(g.memory.1)
                ))
                .gauge_style(Style::default().fg(Color::Magenta)),
            r[2],
        );
        let lines: Vec<Line> = g
            .processes
            .iter()
            .map(|p| Line::from(format!("  {p}")))
            .collect();
        f.render_widget(Paragraph::new(lines), r[3]);
    }
}

fn draw_quotas(f: &mut Frame, app: &App, area: Rect) {
    let block = titled("Quota budgets");
    let inner = block.inner(area);
    f.render_widget(block, area);
    if app.quotas.is_empty() {
        f.render_widget(Paragraph::new("no budgets set (cuda-ipc quota set)"), inner);
        return;
    }
    let rows = Layout::default()
        .direction(Direction::Vertical)
        .constraints(
            app.quotas
                .iter()
                .map(|_| Constraint::Length(1))
                .chain([Constraint::Min(0)]),
        )
        .split(inner);
    for (k, q) in app.quotas.iter().enumerate() {
        let label = match q.budget {
            Some(b) => format!(
                "{}: {} of {}, {} holders",
                q.label,
                bytes(q.used),
                bytes(b),
                q.holders
            ),
            None => format!(
                "{}: {} used, no limit, {} holders",
                q.label,
                bytes(q.used),
                q.holders
            ),
        };
        f.render_widget(
            Gauge::default()
                .ratio(q.budget.map_or(0.0, |b| ratio(q.used, b)))
                .label(label)
                .gauge_style(Style::default().fg(Color::Blue)),
            rows[k],
        );
    }
}

/// The bar label of bucket `i`: its upper bound (`1us`, `2ms`, `inf`).
fn bucket_label(i: usize) -> String {
    let us = LatencyBuckets::upper_us(i);
    if us.is_infinite() {
        "inf".into()
    } else if us < 1000.0 {
        format!("{us}us")
    } else if us < 1e6 {
        format!("{}ms", (us / 1000.0).round())
    } else {
        format!("{}s", (us / 1e6).round())
    }
}

fn draw_latency(f: &mut Frame, app: &App, area: Rect) {
    let h = &app.latency;
    let n = h.count();
    let title = match (h.quantile_upper_us(0.5), h.quantile_upper_us(0.99)) {
        (Some(p50), Some(p99)) => format!(
            "Hand-off latency: {n} frames, p50 < {}, p99 < {}",
            bucket_label_us(p50),
            bucket_label_us(p99)
        ),
        _ => "Hand-off latency: no hand-offs recorded".to_string(),
    };
    let block = titled(&title);
    let inner = block.inner(area);
    f.render_widget(block, area);
    // The buckets from the first to the last non-empty one (1 µs to 1 ms when all are empty).
    let first = h.counts.iter().position(|c| *c > 0).unwrap_or(0);
    let last = h
        .counts
        .iter()
        .rposition(|c| *c > 0)
        .unwrap_or(10)
        .max(first);
    let labels: Vec<String> = (0..BUCKETS).map(bucket_label).collect();
    let data: Vec<(&str, u64)> = (first..=last)
        .map(|i| (labels[i].as_str(), h.counts[i]))
        .collect();
    f.render_widget(
        BarChart::default()
            .data(&data)
            .bar_width(5)
            .bar_gap(1)
            .bar_style(Style::default().fg(Color::Green))
            .value_style(Style::default().add_modifier(Modifier::BOLD)),
        inner,
    );
}

fn bucket_label_us(us: f64) -> String {
    (0..BUCKETS)
        .find(|i| LatencyBuckets::upper_us(*i) == us)
        .map_or_else(|| "inf".into(), bucket_label)
}

/// Runs the live view until `q`, Esc or Ctrl-C, or `count` refreshes.
pub fn run(
    name: Option<&str>,
    interval_ms: u64,
    count: Option<u64>,
) -> Result<crate::Outcome, Box<dyn std::error::Error>> {
    use ratatui::crossterm::event::{self, Event, KeyCode, KeyModifiers};
    let mut terminal = ratatui::try_init()?;
    let mut app = App {
        interval_ms,
        ..Default::default()
    };
    let mut rates = crate::listing::Rates::default();
    let interval = Duration::from_millis(interval_ms);
    let mut last = crate::Outcome::Ok;
    let result = (|| -> Result<(), Box<dyn std::error::Error>> {
        loop {
            let started = Instant::now();
            let mut s = state::sample(name, true);
            rates.add(&mut s.listing, started);
            last = if s.listing.has_problems() {
                crate::Outcome::Problems
            } else {
                crate::Outcome::Ok
            };
            app.update(&s);
            terminal.draw(|f| draw(f, &app))?;
            if count.is_some_and(|c| app.refresh >= c) {
                return Ok(());
            }
            let deadline = started + interval;
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                if event::poll(left)?
                    && let Event::Key(k) = event::read()?
                {
                    let ctrl_c =
                        k.code == KeyCode::Char('c') && k.modifiers.contains(KeyModifiers::CONTROL);
                    if matches!(k.code, KeyCode::Char('q') | KeyCode::Esc) || ctrl_c {
                        return Ok(());
                    }
                }
            }
        }
    })();
    ratatui::restore();
    result.map(|()| last)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ratatui::Terminal;
    use ratatui::backend::TestBackend;

    fn screen(app: &App, w: u16, h: u16) -> String {
        let mut t = Terminal::new(TestBackend::new(w, h)).unwrap();
        t.draw(|f| draw(f, app)).unwrap();
        let buf = t.backend().buffer().clone();
        let mut out = String::new();
        for y in 0..buf.area.height {
            for x in 0..buf.area.width {
                out.push_str(buf[(x, y)].symbol());
            }
            out.push('\n');
        }
        out
    }

    fn app() -> App {
        let mut latency = LatencyBuckets::default();
        latency.counts[4] = 900;
        latency.counts[7] = 100;
        latency.sum_us = 900 * 12 + 100 * 100;
        App {
            interval_ms: 500,
            refresh: 3,
            channels: vec![ChannelPane {
                name: "frames".into(),
                summary: "producer 4241 alive, 4 × 31.6 MiB, head 1200".into(),
                fps: [10, 60, 59, 61].into_iter().collect(),
                fps_now: Some(60.0),
                consumers: vec![ConsumerPane {
                    label: "consumer 0 (pid 4242)".into(),
                    lag: [0, 2, 1].into_iter().collect(),
                    received_per_s: Some(59.5),
                }],
            }],
            gpus: vec![GpuPane {
                label: "GPU 0 NVIDIA H200".into(),
                utilization: Some(42),
                memory: (3 << 30, 141 << 30),
                processes: vec!["producer of frames: 512.0 MiB".into()],
            }],
            nvml_missing: None,
            unmatched: vec![],
            quotas: vec![QuotaPane {
                label: "uid 1000 on host".into(),
                used: 400,
                budget: Some(600),
                holders: 1,
            }],
            latency,
            notes: vec!["registry r: 2 records, 1 participants, last seq 9".into()],
        }
    }

    #[test]
    fn the_live_view_shows_every_pane_with_its_figures() {
        let s = screen(&app(), 140, 40);
        for want in [
            "cuda-ipc watch: every 500 ms, refresh 3",
            "Channels: frames/s and lag per consumer",
            "frames: 60.0 frames/s; producer 4241 alive",
            "consumer 0 (pid 4242): lag 1 frames, 59.5 received/s",
            "GPUs (NVML)",
            "GPU 0 NVIDIA H200",
            "utilization 42%",
            "memory 3.0 GiB of 141.0 GiB",
            "producer of frames: 512.0 MiB",
            "Quota budgets",
            "uid 1000 on host: 400 B of 600 B, 1 holders",
            "Hand-off latency: 1000 frames, p50 < 16us, p99 < 128us",
            "900",
            "Notes",
            "registry r: 2 records",
        ] {
            assert!(s.contains(want), "missing {want:?} in\n{s}");
            if std::env::var_os("SHOW_SCREEN").is_some() {
                println!("{s}");
            }
        }
        // The sparklines draw bars.
        assert!(s.contains('█') || s.contains('▇'), "{s}");
    }

    #[test]
    fn without_nvml_or_channels_the_panes_say_so_plainly() {
        let a = App {
            interval_ms: 1000,
            refresh: 1,
            nvml_missing: Some("NVML not found: libnvidia-ml.so could not be loaded".into()),
            ..Default::default()
        };
        let s = screen(&a, 120, 30);
        for want in [
            "no cuda-ipc channels in /dev/shm",
            "NVML not found: libnvidia-ml.so could not",
            "no budgets set",
            "Hand-off latency: no hand-offs recorded",
            "nothing to report",
        ] {
            assert!(s.contains(want), "missing {want:?} in\n{s}");
            if std::env::var_os("SHOW_SCREEN").is_some() {
                println!("{s}");
            }
        }
    }

    #[test]
    fn a_real_host_channel_fills_the_panes_and_keeps_the_newest_history() {
        use cuda_ipc::channel::{ChannelOptions, Consumer, ConsumerOptions, Producer};
        let name = format!("cli-tui-test-{}", std::process::id());
        let mut tx = Producer::create_host(&name, &ChannelOptions::new(64).buffers(4)).unwrap();
        let rx = Consumer::attach(&name, &ConsumerOptions::new()).unwrap();
        let mut a = App::default();
        let mut rates = crate::listing::Rates::default();
        for round in 0..3u64 {
            for _ in 0..2 {
                tx.acquire(None).unwrap().publish(b"").unwrap();
            }
            // The consumer takes one frame a round, so it falls one frame further behind.
            drop(rx.recv().unwrap());
            let mut s = state::sample(Some(&name), false);
            rates.add(&mut s.listing, Instant::now() + Duration::from_secs(round));
            a.update(&s);
        }
        assert_eq!(a.channels.len(), 1);
        let c = &a.channels[0];
        assert_eq!(c.name, name);
        assert_eq!(c.fps.len(), 3);
        assert_eq!(c.consumers.len(), 1);
        assert_eq!(c.consumers[0].lag, VecDeque::from(vec![1, 2, 3]));
        assert!(c.summary.contains("alive"), "{}", c.summary);
        assert_eq!(a.nvml_missing.as_deref(), Some("NVML not asked"));
        // One hand-off recorded per frame taken (publish → take), from the channel's own histogram.
        assert_eq!(a.latency.count(), 3);
        let screen = screen(&a, 120, 30);
        assert!(screen.contains(&format!("{name}: ")), "{screen}");
        assert!(screen.contains("lag 3 frames"), "{screen}");
        assert!(
            screen.contains("Hand-off latency: 3 frames, p50 <"),
            "{screen}"
        );
        drop(rx);
        tx.close(Duration::from_secs(1)).unwrap();
        let mut h = VecDeque::new();
        for v in 0..(HISTORY as u64 + 3) {
            push(&mut h, v);
        }
        assert_eq!(h.len(), HISTORY);
        assert_eq!(h.front(), Some(&3));
    }
}
