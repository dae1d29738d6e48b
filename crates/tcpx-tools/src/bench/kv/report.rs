//! Rows of `tcpx-bench kv`: one per shape and phase in the steady state, then one per phase
//! for its first transfer; printed as a table for people and as JSON lines for machines
//! (`cargo xtask bench` gathers them into results.jsonl / csv next to the size sweep, told
//! apart by `"bench": "kv"`).

use std::time::Duration;

use serde::Serialize;

use super::{Op, Phase, Plan, Shape};
use crate::bench::report::or_dash;
use crate::bench::stats;

/// What the client measured in one phase of one shape.
#[derive(Clone, Debug)]
pub struct Measured {
    /// The phase.
    pub phase: Phase,
    /// Steady-state GB/s (10^9) of the measured transfers.
    pub gbps: f64,
    /// Per-transfer latencies of the measured transfers (post to completion).
    pub latencies: Vec<Duration>,
    /// The phase's first transfer, alone (none for raw TCP).
    pub first: Option<Duration>,
    /// Measured transfers.
    pub transfers: usize,
    /// Transfers of the phase that travelled packed (one-sided phases).
    pub packed: Option<u64>,
}

/// One line of the table and of `--json`.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// Always "kv" (tells these rows from the size sweep's in shared result files).
    pub bench: &'static str,
    /// `1024x16KiB`.
    pub shape: String,
    /// Blocks per transfer.
    pub blocks: usize,
    /// Bytes per block.
    pub block: usize,
    /// Bytes per transfer.
    pub bytes: usize,
    /// write, read, send or raw-tcp.
    pub op: &'static str,
    /// scattered (the blocks) or contiguous (the same bytes as one block).
    pub layout: &'static str,
    /// This row is the phase's first transfer, alone (not in the steady figures).
    pub first: bool,
    /// GB/s (10^9): steady state, or the first transfer's own.
    pub gbps: f64,
    /// Median time per transfer, µs (steady rows).
    pub p50_us: Option<f64>,
    /// 99th percentile, µs (steady rows).
    pub p99_us: Option<f64>,
    /// The first transfer's time, µs (first rows).
    pub first_us: Option<f64>,
    /// The first transfer's time over the steady p50 (first rows).
    pub first_vs_p50: Option<f64>,
    /// Transfers behind the figures.
    pub transfers: usize,
    /// GB/s of the same operation on one contiguous block (scattered rows).
    pub contiguous_gbps: Option<f64>,
    /// `gbps / contiguous_gbps`.
    pub vs_contiguous: Option<f64>,
    /// GB/s of raw TCP with as many streams, same bytes (`None` with `--baseline none`).
    pub baseline_gbps: Option<f64>,
    /// `gbps / baseline_gbps` (steady rows).
    pub ratio: Option<f64>,
    /// Transfers that travelled packed (one-sided rows).
    pub packed: Option<u64>,
    /// Channels (and raw-TCP streams).
    pub channels: usize,
    /// Transfers in flight.
    pub depth: usize,
    /// "host" or "cuda".
    pub memory: &'static str,
    /// Every byte was checked after the timed part.
    pub verified: bool,
}

/// The rows of one shape: steady rows in phase order, then the first transfers.
pub fn rows(plan: &Plan, shape: Shape, measured: &[Measured]) -> Vec<Row> {
    let gbps_of = |phase: Phase| {
        measured
            .iter()
            .find(|m| m.phase == phase)
            .map(|m| m.gbps)
            .filter(|&g| g > 0.0)
    };
    let raw = gbps_of(Phase::RawTcp);
    let base = |phase: Phase, gbps: f64, first: bool| Row {
        bench: "kv",
        shape: shape.to_string(),
        blocks: shape.blocks,
        block: shape.block,
        bytes: shape.bytes(),
        op: phase.op(),
        layout: phase.layout(),
        first,
        gbps,
        p50_us: None,
        p99_us: None,
        first_us: None,
        first_vs_p50: None,
        transfers: 0,
        contiguous_gbps: None,
        vs_contiguous: None,
        baseline_gbps: raw,
        ratio: None,
        packed: None,
        channels: plan.channels,
        depth: plan.depth,
        memory: plan.memory,
        verified: plan.verify && phase != Phase::RawTcp,
    };
    let mut steady = Vec::new();
    let mut firsts = Vec::new();
    for m in measured {
        let mut lat = m.latencies.clone();
        let p50 = (!lat.is_empty()).then(|| micros(stats::percentile(&mut lat, 50.0)));
        let p99 = (!lat.is_empty()).then(|| micros(stats::percentile(&mut lat, 99.0)));
        let contiguous = match m.phase {
            Phase::OneSided {
                op,
                scattered: true,
            } => gbps_of(Phase::OneSided {
                op,
                scattered: false,
            }),
            _ => None,
        };
        let mut row = base(m.phase, m.gbps, false);
        row.p50_us = p50;
        row.p99_us = p99;
        row.transfers = m.transfers;
        row.contiguous_gbps = contiguous;
        row.vs_contiguous = contiguous.map(|c| m.gbps / c);
        row.ratio = raw.map(|r| m.gbps / r);
        row.packed = m.packed;
        steady.push(row);
        if let Some(first) = m.first {
            let us = micros(first);
            let mut row = base(m.phase, stats::gbps(shape.bytes(), first), true);
            row.first_us = Some(us);
            row.first_vs_p50 = p50.filter(|&p| p > 0.0).map(|p| us / p);
            row.transfers = 1;
            firsts.push(row);
        }
    }
    steady.extend(firsts);
    steady
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// The table's name for a row: `write`, `read contiguous`, `send/recv`, `raw TCP`,
/// `first write`.
pub fn label(row: &Row) -> String {
    let what = match (row.op, row.layout) {
        ("send", _) => "send/recv".to_string(),
        ("raw-tcp", _) => "raw TCP".to_string(),
        (op, "contiguous") => format!("{op} contiguous"),
        (op, _) => op.to_string(),
    };
    if row.first {
        format!("first {what}")
    } else {
        what
    }
}

/// The column names.
pub fn header() -> String {
    format!(
        "{:>11} {:<22} {:>8} {:>10} {:>10} {:>9} {:>7} {:>9}",
        "shape", "transfer", "GB/s", "p50 µs", "p99 µs", "vs contig", "vs raw", "first/p50"
    )
}

/// One table line. A first row shows its one transfer's time under `p50 µs`.
pub fn line(row: &Row) -> String {
    let (p50, p99) = if row.first {
        (or_dash(row.first_us, 1), "-".to_string())
    } else {
        (or_dash(row.p50_us, 1), or_dash(row.p99_us, 1))
    };
    format!(
        "{:>11} {:<22} {:>8.2} {:>10} {:>10} {:>9} {:>7} {:>9}",
        row.shape,
        label(row),
        row.gbps,
        p50,
        p99,
        or_dash(row.vs_contiguous, 3),
        or_dash(row.ratio, 3),
        or_dash(row.first_vs_p50, 1)
    )
}

/// What the plan's rows mean, in two comment lines above the table.
pub fn preamble(plan: &Plan, path: &str) -> String {
    let ops: Vec<&str> = plan
        .ops
        .iter()
        .map(|op| match op {
            Op::Write => "WRITE with a notification",
            Op::Read => "READ",
        })
        .collect();
    format!(
        "# kv: {path}; {} in flight; GB/s = 10^9 B/s\n\
         # each transfer: N blocks of B bytes at shuffled, non-adjacent offsets on both sides, \
         by one-sided {}; contiguous: the same bytes as one block; send/recv: two-sided, each \
         acknowledged; raw TCP: {} streams, the same bytes back to back\n\
         # a fresh connection per shape; `first` rows: a phase's first transfer alone (not in \
         the steady figures), its time under p50; {}{}",
        plan.depth,
        ops.join(" and "),
        plan.channels,
        if plan.verify {
            "every byte checked after each phase's timed part (not in the figures)"
        } else {
            "not verified"
        },
        if plan.gap.is_zero() {
            String::new()
        } else {
            format!(
                "\n# each measured transfer starts {} µs after the previous one finished (--gap-us): \
                 GB/s over the transfers' own time",
                plan.gap.as_micros()
            )
        }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_and_first_rows() {
        let plan = Plan {
            shapes: vec![Shape::new(4, 1024).unwrap()],
            ops: vec![Op::Write],
            iters: 4,
            min_bytes: 0,
            warmup: 0,
            depth: 1,
            gap: Duration::ZERO,
            channels: 2,
            chunk: 1 << 19,
            baseline: true,
            verify: true,
            timeout: Duration::from_secs(1),
            memory: "host",
            gpu: 0,
        };
        let ms = |us: u64| Duration::from_micros(us);
        let one = |phase, gbps, first| Measured {
            phase,
            gbps,
            latencies: vec![ms(10), ms(20), ms(30)],
            first,
            transfers: 3,
            packed: None,
        };
        let scattered = Phase::OneSided {
            op: Op::Write,
            scattered: true,
        };
        let contiguous = Phase::OneSided {
            op: Op::Write,
            scattered: false,
        };
        let measured = [
            one(scattered, 1.0, Some(ms(200))),
            one(contiguous, 2.0, Some(ms(40))),
            one(Phase::Send, 2.0, Some(ms(20))),
            one(Phase::RawTcp, 4.0, None),
        ];
        let rows = rows(&plan, plan.shapes[0], &measured);
        assert_eq!(rows.len(), 7, "4 steady rows, 3 first rows");
        assert_eq!(rows[0].vs_contiguous, Some(0.5));
        assert_eq!(rows[0].ratio, Some(0.25));
        assert_eq!(rows[0].p50_us, Some(20.0));
        assert_eq!(rows[1].vs_contiguous, None);
        assert_eq!(label(&rows[3]), "raw TCP");
        assert!(!rows[3].verified);
        let first = &rows[4];
        assert!(first.first);
        assert_eq!(label(first), "first write");
        assert_eq!(first.first_vs_p50, Some(10.0));
        assert_eq!(first.p50_us, None);
        assert!(line(first).contains("200.0"), "{}", line(first));
        assert_eq!(
            line(&rows[0]).split_whitespace().count(),
            header().split_whitespace().count() - 4,
            "one cell per column (`p50 µs`, `p99 µs`, `vs contig` and `vs raw` are two words)"
        );
    }
}
