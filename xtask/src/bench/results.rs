//! Results: the clients' JSON lines as rows, the per-GPU and aggregate tables, and the files
//! under the run directory (`results.jsonl`, `results.csv`).

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::{Map, Value};

use super::pairs::PairOutcome;

/// Columns that come first in the CSV, in this order; other fields follow, sorted.
const CSV_FIRST: &[&str] = &[
    "run",
    "mode",
    "gpu",
    "bytes",
    "gbps",
    "p50_us",
    "p99_us",
    "baseline_gbps",
    "ratio",
    "channels",
    "memory",
];

/// One measured size of one pair.
#[derive(Clone, Debug)]
pub struct Row {
    /// The pair's GPU (`None` for a pair without `--gpu` or a single-process run).
    pub gpu: Option<u32>,
    /// Every field the client wrote, plus `run`, `mode` and `gpu`.
    pub fields: Map<String, Value>,
}

impl Row {
    /// A numeric field (0 when absent).
    pub fn num(&self, key: &str) -> f64 {
        self.fields.get(key).and_then(Value::as_f64).unwrap_or(0.0)
    }

    /// A numeric field to `decimals` places, `-` when absent or null (no baseline).
    pub fn opt(&self, key: &str, decimals: usize) -> String {
        self.fields
            .get(key)
            .and_then(Value::as_f64)
            .map_or_else(|| "-".to_string(), |v| format!("{v:.decimals$}"))
    }

    /// The message size in bytes.
    pub fn bytes(&self) -> u64 {
        self.fields
            .get("bytes")
            .and_then(Value::as_u64)
            .unwrap_or(0)
    }
}

/// Parses every client's JSON lines, tagging rows with the run, the mode and the pair's GPU.
pub fn parse(outcomes: &[PairOutcome], run: &str, mode: &str) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for outcome in outcomes {
        let mut n = 0;
        for (i, line) in outcome.json.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let value: Value = serde_json::from_str(line).with_context(|| {
                format!(
                    "line {} of the results of pair {} is not JSON: `{line}`",
                    i + 1,
                    outcome.pair.stem
                )
            })?;
            let Value::Object(mut fields) = value else {
                bail!(
                    "line {} of pair {}: expected a JSON object",
                    i + 1,
                    outcome.pair.stem
                );
            };
            if fields.get("bytes").and_then(Value::as_u64).is_none() {
                bail!(
                    "line {} of pair {} has no `bytes`",
                    i + 1,
                    outcome.pair.stem
                );
            }
            fields.insert("run".into(), run.into());
            fields.insert("mode".into(), mode.into());
            if let Some(gpu) = outcome.pair.gpu {
                fields.insert("gpu".into(), gpu.into());
            }
            rows.push(Row {
                gpu: outcome.pair.gpu,
                fields,
            });
            n += 1;
        }
        if n == 0 {
            bail!(
                "the client of pair {} wrote no result lines",
                outcome.pair.stem
            );
        }
    }
    Ok(rows)
}

/// Writes `results.jsonl` and `results.csv` into `dir`.
pub fn write_files(dir: &Path, rows: &[Row]) -> Result<()> {
    let mut jsonl = String::new();
    for row in rows {
        jsonl.push_str(&serde_json::to_string(&row.fields)?);
        jsonl.push('\n');
    }
    write(&dir.join("results.jsonl"), &jsonl)?;
    write(&dir.join("results.csv"), &csv(rows))
}

fn write(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).with_context(|| format!("write {}", path.display()))
}

/// The rows as CSV: known columns first, then every other field, sorted.
pub fn csv(rows: &[Row]) -> String {
    let mut columns: Vec<String> = CSV_FIRST.iter().map(|c| c.to_string()).collect();
    let extra: BTreeSet<&String> = rows
        .iter()
        .flat_map(|r| r.fields.keys())
        .filter(|k| !CSV_FIRST.contains(&k.as_str()))
        .collect();
    columns.extend(extra.into_iter().cloned());
    let mut out = columns.join(",");
    out.push('\n');
    for row in rows {
        let cells: Vec<String> = columns
            .iter()
            .map(|c| match row.fields.get(c) {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => csv_cell(s),
                Some(v) => csv_cell(&v.to_string()),
            })
            .collect();
        out.push_str(&cells.join(","));
        out.push('\n');
    }
    out
}

fn csv_cell(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// The sizes measured, ascending.
pub fn sizes(rows: &[Row]) -> Vec<u64> {
    let set: BTreeSet<u64> = rows.iter().map(Row::bytes).collect();
    set.into_iter().collect()
}

/// The GPUs of the rows, ascending (`None` sorts first).
pub fn gpus(rows: &[Row]) -> Vec<Option<u32>> {
    let set: BTreeSet<Option<u32>> = rows.iter().map(|r| r.gpu).collect();
    set.into_iter().collect()
}

/// The row of `gpu` at `bytes`.
pub fn find(rows: &[Row], gpu: Option<u32>, bytes: u64) -> Option<&Row> {
    rows.iter().find(|r| r.gpu == gpu && r.bytes() == bytes)
}

/// The per-size sums over GPUs of `gbps` and `baseline_gbps`.
pub fn sums(rows: &[Row]) -> Vec<(u64, f64, f64)> {
    sizes(rows)
        .into_iter()
        .map(|b| {
            let at = rows.iter().filter(|r| r.bytes() == b);
            let (g, base) = at.fold((0.0, 0.0), |(g, base), r| {
                (g + r.num("gbps"), base + r.num("baseline_gbps"))
            });
            (b, g, base)
        })
        .collect()
}

/// The one-pair table (what the client prints), for runs whose client output was not shown.
pub fn single_table(rows: &[Row]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:>10} {:>10} {:>10} {:>10} {:>12} {:>7}",
        "size", "GB/s", "p50 µs", "p99 µs", "baseline", "ratio"
    );
    for r in rows {
        let _ = writeln!(
            out,
            "{:>10} {:>10.2} {:>10.1} {:>10.1} {:>12} {:>7}",
            format_size(r.bytes()),
            r.num("gbps"),
            r.num("p50_us"),
            r.num("p99_us"),
            r.opt("baseline_gbps", 2),
            r.opt("ratio", 3)
        );
    }
    out
}

/// Per-GPU GB/s side by side, then the aggregate columns, labelled as sums over the GPUs.
pub fn multi_table(rows: &[Row]) -> String {
    let gpus = gpus(rows);
    let n = gpus.len();
    let sum_label = format!("SUM({n} GPUs)");
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# GB/s (10^9 B/s) per GPU pair; SUM = sum over the {n} GPU pairs, which ran \
         concurrently (each swept its sizes on its own clock)"
    );
    let _ = write!(out, "{:>10}", "size");
    for g in &gpus {
        let _ = write!(
            out,
            " {:>8}",
            g.map_or("pair".into(), |g| format!("gpu{g}"))
        );
    }
    let _ = writeln!(
        out,
        " | {sum_label:>14} {:>14} {:>7}",
        "baseline SUM", "ratio"
    );
    for (bytes, g, base) in sums(rows) {
        let _ = write!(out, "{:>10}", format_size(bytes));
        for gpu in &gpus {
            match find(rows, *gpu, bytes) {
                Some(r) => {
                    let _ = write!(out, " {:>8.2}", r.num("gbps"));
                }
                None => {
                    let _ = write!(out, " {:>8}", "-");
                }
            }
        }
        let ratio = if base > 0.0 { g / base } else { 0.0 };
        let _ = writeln!(out, " | {g:>14.2} {base:>14.2} {ratio:>7.3}");
    }
    if let Some((bytes, g, _)) = sums(rows).into_iter().max_by(|a, b| a.1.total_cmp(&b.1)) {
        let _ = writeln!(
            out,
            "peak aggregate: {g:.2} GB/s at {} (SUM over {n} GPU pairs)",
            format_size(bytes)
        );
    }
    out
}

/// The kv rows (`tcpx-bench kv`) as the kv client prints them, with the pair's GPU first
/// when there are several pairs: steady rows, then each phase's first transfer.
pub fn kv_table(rows: &[Row]) -> String {
    let several = gpus(rows).len() > 1;
    let text = |r: &Row, key: &str| {
        r.fields
            .get(key)
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string()
    };
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# kv (tcpx-bench kv): scattered blocks by one-sided write / read vs the same bytes \
         contiguous, two-sided and raw TCP; GB/s = 10^9 B/s per pair; first rows: one \
         transfer, its time under p50"
    );
    if several {
        let _ = write!(out, "{:>5} ", "gpu");
    }
    let _ = writeln!(
        out,
        "{:>11} {:<22} {:>8} {:>10} {:>10} {:>9} {:>7} {:>9}",
        "shape", "transfer", "GB/s", "p50 µs", "p99 µs", "vs contig", "vs raw", "first/p50"
    );
    for r in rows {
        let first = r.fields.get("first").and_then(Value::as_bool) == Some(true);
        let (op, layout) = (text(r, "op"), text(r, "layout"));
        let what = match (op.as_str(), layout.as_str()) {
            ("send", _) => "send/recv".to_string(),
            ("raw-tcp", _) => "raw TCP".to_string(),
            (op, "contiguous") => format!("{op} contiguous"),
            (op, _) => op.to_string(),
        };
        let (label, p50, p99) = if first {
            (
                format!("first {what}"),
                r.opt("first_us", 1),
                "-".to_string(),
            )
        } else {
            (what, r.opt("p50_us", 1), r.opt("p99_us", 1))
        };
        if several {
            let _ = write!(
                out,
                "{:>5} ",
                r.gpu.map_or("-".to_string(), |g| g.to_string())
            );
        }
        let _ = writeln!(
            out,
            "{:>11} {:<22} {:>8.2} {:>10} {:>10} {:>9} {:>7} {:>9}",
            text(r, "shape"),
            label,
            r.num("gbps"),
            p50,
            p99,
            r.opt("vs_contiguous", 3),
            r.opt("ratio", 3),
            r.opt("first_vs_p50", 1)
        );
    }
    out
}

/// Formats a size with a binary unit when it divides evenly (`4KiB`, `64MiB`, `1000B`).
pub fn format_size(n: u64) -> String {
    for (unit, shift) in [("GiB", 30), ("MiB", 20), ("KiB", 10)] {
        if n >= 1 << shift && n % (1 << shift) == 0 {
            return format!("{}{unit}", n >> shift);
        }
    }
    format!("{n}B")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::pairs::Pair;

    fn outcome(gpu: Option<u32>, json: &str) -> PairOutcome {
        PairOutcome {
            pair: Pair {
                gpu,
                gpu_arg: gpu.map(|g| g.to_string()),
                port: 1,
                stem: "p".into(),
            },
            json: json.into(),
        }
    }

    #[test]
    fn rows_tables_and_csv() {
        let a = r#"{"bytes":4096,"gbps":1.5,"baseline_gbps":2.0,"memory":"host"}
{"bytes":8192,"gbps":2.5,"baseline_gbps":3.0,"memory":"host","note":"a,b"}"#;
        let b = r#"{"bytes":4096,"gbps":1.0,"baseline_gbps":1.0}"#;
        let rows = parse(&[outcome(Some(0), a), outcome(Some(1), b)], "r1", "local").unwrap();
        assert_eq!(rows.len(), 3);
        assert_eq!(sums(&rows)[0], (4096, 2.5, 3.0));
        let table = multi_table(&rows);
        assert!(table.contains("SUM(2 GPUs)"), "{table}");
        assert!(table.contains("peak aggregate: 2.50 GB/s"), "{table}");
        let csv = csv(&rows);
        let mut lines = csv.lines();
        assert!(lines.next().unwrap().starts_with("run,mode,gpu,bytes,gbps"));
        assert!(csv.contains("\"a,b\""));
        assert!(parse(&[outcome(None, "not json")], "r", "m").is_err());
        assert!(parse(&[outcome(None, "")], "r", "m").is_err());
    }

    #[test]
    fn kv_rows_print_as_the_client_does() {
        let json = r#"{"bench":"kv","shape":"64x1MiB","bytes":67108864,"op":"write","layout":"scattered","first":false,"gbps":2.5,"p50_us":26000.0,"p99_us":30000.0,"vs_contiguous":0.9,"ratio":0.8,"first_vs_p50":null}
{"bench":"kv","shape":"64x1MiB","bytes":67108864,"op":"write","layout":"scattered","first":true,"gbps":0.5,"first_us":130000.0,"p50_us":null,"ratio":null,"first_vs_p50":5.0}
{"bench":"kv","shape":"64x1MiB","bytes":67108864,"op":"raw-tcp","layout":"contiguous","first":false,"gbps":3.1,"ratio":1.0}"#;
        let rows = parse(&[outcome(None, json)], "r", "local").unwrap();
        let table = kv_table(&rows);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 5, "{table}");
        assert!(
            lines[2].contains("write") && lines[2].contains("26000.0"),
            "{table}"
        );
        assert!(
            lines[3].contains("first write") && lines[3].contains("130000.0"),
            "{table}"
        );
        assert!(lines[3].trim_end().ends_with("5.0"), "{table}");
        assert!(lines[4].contains("raw TCP"), "{table}");
        assert!(csv(&rows).lines().next().unwrap().contains("shape"));
    }

    #[test]
    fn sizes_format() {
        assert_eq!(format_size(4096), "4KiB");
        assert_eq!(format_size(64 << 20), "64MiB");
        assert_eq!(format_size(1000), "1000B");
    }
}
