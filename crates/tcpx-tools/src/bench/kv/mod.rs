//! `tcpx-bench kv`: a paged KV cache handed from one process to another, the way vLLM's
//! NixlConnector moves it. Each transfer is N blocks of B bytes at shuffled, non-adjacent
//! offsets in a region twice their size, on both sides (nothing coalesces), moved by one-sided
//! WRITE with a notification and by one-sided READ, against the same bytes as one contiguous
//! one-sided transfer, as a two-sided send/recv and over raw TCP with as many streams as
//! channels — all in the same run, over one connection per shape.
//!
//! Roles: the server is the target (it allocates and advertises its region and makes no call
//! during one-sided phases), the client the initiator (it times everything). They meet the
//! way `tcpx-bench server/client` do: the server prints its metadata, the client connects
//! with it. Each shape gets a fresh connection, so the first transfer of each phase — the
//! first use of that connection and that list shape — is timed on its own row and kept out
//! of the steady-state figures.
//!
//! Modules: [`layout`] (where the blocks sit, the pattern, the checks), `target` (the
//! server), `initiator` (the client), [`report`] (rows and the table).

pub mod layout;
pub mod report;

mod initiator;
mod target;

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde::Serialize;
use tcpx_runtime::{Endpoint, Region};

pub use initiator::drive;
pub use target::serve;

use super::pair::{messages_for, Failure};
use super::rawtcp::StreamPlan;
use super::sizes::{format_size, parse_size};

/// Blocks per transfer accepted by `--shapes`: the runtime carries one operation's list in one
/// control message (about 26 000 entries).
pub const MAX_BLOCKS: usize = 16_384;

/// The largest region one side allocates per shape (3 × N × B must stay below this).
pub const MAX_REGION: usize = 16 << 30;

/// Fewest measured transfers per phase, whatever `--iters` and `--min-bytes` say (a p99
/// needs a few samples).
const MIN_TRANSFERS: usize = 4;

/// One transfer shape: `blocks` blocks of `block` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Shape {
    /// Blocks per transfer (N).
    pub blocks: usize,
    /// Bytes per block (B).
    pub block: usize,
}

impl Shape {
    /// Bytes per transfer (N × B).
    pub fn bytes(&self) -> usize {
        self.blocks * self.block
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}x{}", self.blocks, format_size(self.block))
    }
}

impl FromStr for Shape {
    type Err = anyhow::Error;

    /// `NxSIZE`: `1024x16KiB`, `64x1MiB`.
    fn from_str(text: &str) -> Result<Self> {
        let t = text.trim();
        let Some((n, b)) = t.split_once(['x', 'X', '*']) else {
            bail!("`{t}` is not a shape: write BLOCKSxSIZE, e.g. 1024x16KiB");
        };
        let blocks: usize = n
            .trim()
            .parse()
            .map_err(|_| anyhow::anyhow!("`{t}`: `{n}` is not a block count"))?;
        let block = parse_size(b)?;
        Shape::new(blocks, block).map_err(|e| anyhow::anyhow!("`{t}`: {e}"))
    }
}

impl Shape {
    /// A shape, checked: at least one block of at least one byte, at most [`MAX_BLOCKS`]
    /// blocks, and a region (3 × N × B) below [`MAX_REGION`].
    pub fn new(blocks: usize, block: usize) -> Result<Self> {
        if blocks == 0 || block == 0 {
            bail!("a transfer needs at least one block of at least one byte");
        }
        if blocks > MAX_BLOCKS {
            bail!("{blocks} blocks: at most {MAX_BLOCKS} per transfer");
        }
        let shape = Shape { blocks, block };
        if blocks
            .checked_mul(block)
            .and_then(|b| b.checked_mul(3))
            .is_none_or(|r| r > MAX_REGION)
        {
            bail!(
                "{shape}: each side would allocate 3 × {} (scattered area twice the blocks, plus \
                 the contiguous area), above {}",
                format_size(blocks.saturating_mul(block)),
                format_size(MAX_REGION)
            );
        }
        Ok(shape)
    }
}

/// Parses a comma list of shapes (`1024x16KiB,512x64KiB,64x1MiB`).
pub fn parse_shapes(text: &str) -> Result<Vec<Shape>> {
    let shapes: Vec<Shape> = text
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(str::parse)
        .collect::<Result<_>>()?;
    if shapes.is_empty() {
        bail!("no shape given (e.g. 1024x16KiB,64x1MiB)");
    }
    Ok(shapes)
}

/// A one-sided operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    /// Initiator → target, with a notification.
    Write,
    /// Target → initiator.
    Read,
}

impl FromStr for Op {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s.trim() {
            "write" => Op::Write,
            "read" => Op::Read,
            other => bail!("`{other}` is not an operation: write or read"),
        })
    }
}

/// One timed phase of a shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// A one-sided operation over the scattered blocks, or over one contiguous block of the
    /// same bytes.
    OneSided {
        /// Write or read.
        op: Op,
        /// Scattered blocks (else one contiguous block).
        scattered: bool,
    },
    /// Two-sided send/recv of the same bytes, each transfer acknowledged by the server.
    Send,
    /// The same bytes over raw TCP streams.
    RawTcp,
}

impl Phase {
    /// A number both sides put in their READY / FINISHED messages (a mismatch means the two
    /// processes run different plans).
    pub fn code(self) -> u64 {
        match self {
            Phase::OneSided { op, scattered } => {
                1 + u64::from(op == Op::Read) * 2 + u64::from(!scattered)
            }
            Phase::Send => 5,
            Phase::RawTcp => 6,
        }
    }

    /// `op` of the row.
    pub fn op(self) -> &'static str {
        match self {
            Phase::OneSided { op: Op::Write, .. } => "write",
            Phase::OneSided { op: Op::Read, .. } => "read",
            Phase::Send => "send",
            Phase::RawTcp => "raw-tcp",
        }
    }

    /// `layout` of the row: where the bytes sit on both sides.
    pub fn layout(self) -> &'static str {
        match self {
            Phase::OneSided {
                scattered: true, ..
            } => "scattered",
            _ => "contiguous",
        }
    }

    /// Whether this phase has a first transfer of its own (raw TCP has none to speak of).
    pub fn has_first(self) -> bool {
        self != Phase::RawTcp
    }
}

/// What both processes run; both must be given the same options (the client checks).
#[derive(Clone, Debug)]
pub struct Plan {
    /// Transfer shapes, in order, one connection each.
    pub shapes: Vec<Shape>,
    /// One-sided operations (each also as one contiguous block).
    pub ops: Vec<Op>,
    /// Measured transfers per phase (raised to move at least `min_bytes`, capped near 1 GiB).
    pub iters: usize,
    /// Bytes each phase moves at least.
    pub min_bytes: usize,
    /// Unmeasured transfers per phase after the first.
    pub warmup: usize,
    /// Transfers in flight at once.
    pub depth: usize,
    /// Pause before each measured transfer (with `depth` 1; zero: none). Only the initiator
    /// acts on it, so it is not part of the [`Plan::fingerprint`].
    pub gap: Duration,
    /// Channels (and raw-TCP streams).
    pub channels: usize,
    /// Chunk size: how the raw-TCP baseline cuts a transfer, as the stack does.
    pub chunk: usize,
    /// Run the raw-TCP phase.
    pub baseline: bool,
    /// Check every byte after each phase's timed part.
    pub verify: bool,
    /// Every wait gives up after this long without progress.
    pub timeout: Duration,
    /// "host" or "cuda".
    pub memory: &'static str,
    /// With `memory == "cuda"`: the GPU of this process.
    pub gpu: usize,
}

impl Plan {
    /// The phases of every shape, in order.
    pub fn phases(&self) -> Vec<Phase> {
        let mut phases = Vec::new();
        for &op in &self.ops {
            phases.push(Phase::OneSided {
                op,
                scattered: true,
            });
            phases.push(Phase::OneSided {
                op,
                scattered: false,
            });
        }
        phases.push(Phase::Send);
        if self.baseline {
            phases.push(Phase::RawTcp);
        }
        phases
    }

    /// Measured transfers of `shape` per phase.
    pub fn transfers(&self, shape: Shape) -> usize {
        messages_for(shape.bytes(), self.iters, self.min_bytes, MIN_TRANSFERS)
    }

    /// Every transfer of a timed phase: the first, the warm-up and the measured ones.
    pub fn total(&self, shape: Shape) -> usize {
        1 + self.warmup + self.transfers(shape)
    }

    /// The raw-TCP phase of `shape`: the measured transfers as messages over the streams.
    pub fn streams(&self, shape: Shape) -> StreamPlan {
        StreamPlan {
            size: shape.bytes(),
            messages: self.transfers(shape),
            chunk: self.chunk,
            channels: self.channels,
            timeout: self.timeout,
            // Every transfer moves the same block list: its bytes are the footprint.
            footprint: shape.bytes(),
        }
    }

    /// A digest of everything both sides must agree on ([`super::control::fingerprint`]).
    pub fn fingerprint(&self) -> u64 {
        super::control::fingerprint(&format!(
            "{:?}|{:?}|{}|{}|{}|{}|{}|{}|{}|{}",
            self.shapes,
            self.ops,
            self.iters,
            self.min_bytes,
            self.warmup,
            self.depth,
            self.channels,
            self.chunk,
            self.baseline,
            self.verify
        ))
    }
}

/// Bytes of one acknowledgement of the two-sided phase.
const ACK_BYTES: usize = 8;

/// A write's notification: the phase's code and the transfer's sequence number in it, so the
/// target can tell that every one arrived, in order.
fn note(phase: Phase, seq: usize) -> [u8; 16] {
    let mut n = [0u8; 16];
    n[..8].copy_from_slice(&phase.code().to_le_bytes());
    n[8..].copy_from_slice(&(seq as u64).to_le_bytes());
    n
}

/// `len` bytes of the plan's memory (host, or CUDA on the plan's GPU), registered with the
/// endpoint.
fn alloc_region(endpoint: &Endpoint, plan: &Plan, len: usize) -> Result<Region, Failure> {
    Ok(match plan.memory {
        "cuda" => {
            let gpu = tcpx::cuda::CudaDevice::new(plan.gpu)
                .with_context(|| format!("open GPU {} for --memory cuda", plan.gpu))?;
            endpoint.alloc_cuda_on(&gpu, len)?
        }
        _ => endpoint.alloc_host(len)?,
    })
}

/// Messages of the kv protocol (the first word of every control message).
mod msg {
    /// Server → client at a shape's start: token, plan fingerprint, descriptor words.
    pub const HELLO: u64 = 0x4b56_0001;
    /// Server → client: the phase may start (second word: the phase code).
    pub const READY: u64 = 0x4b56_0002;
    /// Client → server: a one-sided phase is over (second word: transfers issued).
    pub const FINISHED: u64 = 0x4b56_0003;
    /// Server → client: what the server found (second word: a [`super::layout::Verdict`]
    /// code, then two details).
    pub const VERDICT: u64 = 0x4b56_0004;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_parse_and_refuse() {
        let s = parse_shapes("1024x16KiB, 512x64KiB,64x1MiB").unwrap();
        assert_eq!(
            s,
            vec![
                Shape {
                    blocks: 1024,
                    block: 16 << 10
                },
                Shape {
                    blocks: 512,
                    block: 64 << 10
                },
                Shape {
                    blocks: 64,
                    block: 1 << 20
                }
            ]
        );
        assert_eq!(s[0].to_string(), "1024x16KiB");
        assert_eq!(s[0].bytes(), 16 << 20);
        for bad in [
            "",
            "16KiB",
            "0x4KiB",
            "4x0",
            "ax4KiB",
            "99999x4KiB",
            "16x4GiB",
            "4x4parsecs",
        ] {
            assert!(parse_shapes(bad).is_err(), "{bad}");
        }
    }

    proptest::proptest! {
        /// Whatever is typed after --shapes is a list of shapes or an error, never a panic;
        /// what parses prints back to itself.
        #[test]
        fn any_shape_text_parses_or_is_refused(text in "[0-9xX*,kKmMgGiIbB ]{0,24}") {
            if let Ok(shapes) = parse_shapes(&text) {
                for s in shapes {
                    proptest::prop_assert_eq!(s.to_string().parse::<Shape>().ok(), Some(s));
                }
            }
        }
    }

    #[test]
    fn phases_and_codes() {
        let plan = Plan {
            shapes: vec![Shape::new(4, 4096).unwrap()],
            ops: vec![Op::Write, Op::Read],
            iters: 3,
            min_bytes: 0,
            warmup: 1,
            depth: 1,
            gap: Duration::ZERO,
            channels: 2,
            chunk: 1 << 19,
            baseline: true,
            verify: false,
            timeout: Duration::from_secs(1),
            memory: "host",
            gpu: 0,
        };
        let phases = plan.phases();
        assert_eq!(phases.len(), 6);
        let mut codes: Vec<u64> = phases.iter().map(|p| p.code()).collect();
        codes.dedup();
        assert_eq!(codes.len(), 6, "every phase has its own code");
        assert_eq!(plan.transfers(plan.shapes[0]), MIN_TRANSFERS);
        assert_eq!(plan.total(plan.shapes[0]), 1 + 1 + MIN_TRANSFERS);
        let other = Plan {
            depth: 2,
            ..plan.clone()
        };
        assert_ne!(plan.fingerprint(), other.fingerprint());
        // Only the initiator pauses: the server need not be given the same gap.
        let paused = Plan {
            gap: Duration::from_millis(5),
            ..plan.clone()
        };
        assert_eq!(plan.fingerprint(), paused.fingerprint());
    }
}
