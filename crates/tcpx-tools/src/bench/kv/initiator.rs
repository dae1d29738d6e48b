//! The client of `tcpx-bench kv`: the initiator. Per shape it builds its regions (source,
//! and read destination when reading), connects afresh, learns the target's descriptor and
//! the raw-TCP token, and runs every phase: the first transfer alone, the warm-up, then the
//! measured transfers with `depth` in flight. Its clock is the only one; the server's
//! verdict and the client's own checks come after each phase's timed part.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use anyhow::anyhow;
use tcpx_runtime::control::metadata::EndpointMetadata;
use tcpx_runtime::{Connection, Descriptor, Endpoint, Region, RemoteSegment, Segment, Transfer};

use super::layout::{Layout, Side, Verdict};
use super::report::{self, Measured, Row};
use super::{alloc_region, msg, note, Op, Phase, Plan, Shape, ACK_BYTES};
use crate::bench::control::{self, Control};
use crate::bench::pair::{exit, peer_failure, Failure};
use crate::bench::rawtcp;
use crate::bench::stats;

/// Runs every shape of `plan` against the server `peer`; `on_phase` after each phase (for a
/// progress bar), `on_rows` with each shape's rows.
pub fn drive(
    endpoint: &Endpoint,
    peer: &EndpointMetadata,
    plan: &Plan,
    mut on_phase: impl FnMut(),
    mut on_rows: impl FnMut(&[Row]),
) -> Result<Vec<Row>, Failure> {
    let mut all = Vec::new();
    for &shape in &plan.shapes {
        let measured =
            shape_run(endpoint, peer, plan, shape, &mut on_phase).map_err(|f| Failure {
                code: f.code,
                error: f.error.context(format!("shape {shape}")),
            })?;
        let rows = report::rows(plan, shape, &measured);
        on_rows(&rows);
        all.extend(rows);
    }
    Ok(all)
}

/// One shape on a fresh connection.
fn shape_run(
    endpoint: &Endpoint,
    peer: &EndpointMetadata,
    plan: &Plan,
    shape: Shape,
    on_phase: &mut impl FnMut(),
) -> Result<Vec<Measured>, Failure> {
    // Memory first, as an application registers its KV cache before it connects: its cost
    // is not a transfer's.
    let src_layout = Layout::new(shape, Side::Source);
    let src = alloc_region(endpoint, plan, src_layout.region_len())?;
    src.write(0, &src_layout.image())?;
    let back_layout = Layout::new(shape, Side::Back);
    let back = if plan.ops.contains(&Op::Read) {
        let back = alloc_region(endpoint, plan, back_layout.region_len())?;
        // Zeros, written: every page is touched before the first read.
        back.write(0, &vec![0u8; back_layout.region_len()])?;
        Some(back)
    } else {
        None
    };
    let conn = endpoint.connect(peer).map_err(peer_failure)?;
    let ctl = Control::new(endpoint, &conn, plan.timeout)?;
    let [kind, token, fingerprint, d0, d1, d2, d3] = ctl.recv("the server's HELLO")?;
    if kind != msg::HELLO {
        return Err(anyhow!("the server sent message {kind:#x}, expected HELLO").into());
    }
    if fingerprint != plan.fingerprint() {
        return Err(Failure {
            code: exit::USAGE,
            error: anyhow!(
                "the server runs other kv settings (--shapes, --op, --iters, --min-bytes, \
                 --warmup, --depth, --channels, --chunk, --baseline, --verify): give both \
                 processes the same options"
            ),
        });
    }
    let bytes = control::encode(&[d0, d1, d2, d3]);
    let descriptor = Descriptor::from_bytes(&bytes[..Descriptor::BYTES])
        .map_err(|e| anyhow!("the server's descriptor: {e}"))?;
    let acks = endpoint.alloc_host(ACK_BYTES * plan.depth)?;
    conn.register(&acks)?;
    let initiator = Initiator {
        conn: &conn,
        plan,
        shape,
        descriptor,
        target: Layout::new(shape, Side::Target),
        src_layout,
        src,
        back_layout,
        back,
        acks,
    };
    let baseline_addr = rawtcp::baseline_addr(peer.control_addr);
    let mut measured = Vec::new();
    for phase in plan.phases() {
        if let Phase::OneSided { op: Op::Read, .. } = phase {
            if plan.verify {
                initiator.poison_back(phase)?;
            }
        }
        let [kind, code, _] = ctl.recv("the server's READY")?;
        if kind != msg::READY || code != phase.code() {
            return Err(anyhow!(
                "the server sent message {kind:#x} for phase {code}, expected READY for {}: \
                 give both processes the same options",
                phase.code()
            )
            .into());
        }
        let m = match phase {
            Phase::OneSided { op, .. } => {
                let before = conn.pack_stats();
                let mut m = initiator.one_sided(phase)?;
                let after = conn.pack_stats();
                m.packed = Some(match op {
                    Op::Write => after.packed_sent - before.packed_sent,
                    Op::Read => after.packed_received - before.packed_received,
                });
                ctl.send([msg::FINISHED, phase.code(), plan.total(shape) as u64])?;
                verdict(&ctl, phase)?;
                if op == Op::Read && plan.verify {
                    initiator.check_back(phase)?;
                }
                m
            }
            Phase::Send => {
                let m = initiator.sends()?;
                verdict(&ctl, phase)?;
                m
            }
            Phase::RawTcp => {
                let streams = plan.streams(shape);
                let took = rawtcp::send(baseline_addr, &streams, token).map_err(|e| {
                    peer_failure(e.context(format!("raw-TCP baseline to {baseline_addr}")))
                })?;
                Measured {
                    phase,
                    gbps: stats::gbps(shape.bytes() * streams.messages, took),
                    latencies: Vec::new(),
                    first: None,
                    transfers: streams.messages,
                    packed: None,
                }
            }
        };
        measured.push(m);
        on_phase();
    }
    drop(ctl);
    drop(initiator);
    conn.close().map_err(peer_failure)?;
    Ok(measured)
}

/// Reads the server's VERDICT on `phase` and turns a bad one into the failure it names.
fn verdict(ctl: &Control<'_>, phase: Phase) -> Result<(), Failure> {
    let [kind, v0, v1, v2] = ctl.recv("the server's verdict")?;
    let verdict = (kind == msg::VERDICT)
        .then(|| Verdict::from_words([v0, v1, v2]))
        .flatten()
        .ok_or_else(|| anyhow!("the server sent message {kind:#x}, expected a verdict"))?;
    fail_on(verdict, phase, "at the target")
}

fn fail_on(verdict: Verdict, phase: Phase, place: &str) -> Result<(), Failure> {
    match verdict.describe(&format!("{} {} {place}", phase.op(), phase.layout())) {
        None => Ok(()),
        Some(text) => Err(Failure {
            code: if verdict.is_data() {
                exit::VERIFY
            } else {
                exit::ERROR
            },
            error: anyhow!(text),
        }),
    }
}

/// One shape's connection, memory and lists.
struct Initiator<'a> {
    conn: &'a Connection,
    plan: &'a Plan,
    shape: Shape,
    descriptor: Descriptor,
    target: Layout,
    src_layout: Layout,
    src: Region,
    back_layout: Layout,
    back: Option<Region>,
    acks: Region,
}

/// A transfer on its way: `done` completing means delivered (a one-sided operation, or the
/// server's acknowledgement of a send); `also` is waited after it (the send itself).
struct InFlight {
    done: Transfer,
    also: Option<Transfer>,
    started: Instant,
}

impl Initiator<'_> {
    /// The region and local offsets a one-sided phase uses on this side.
    fn local(&self, op: Op) -> Result<(&Region, &Layout), Failure> {
        Ok(match op {
            Op::Write => (&self.src, &self.src_layout),
            Op::Read => (
                self.back
                    .as_ref()
                    .ok_or_else(|| anyhow!("no read destination allocated"))?,
                &self.back_layout,
            ),
        })
    }

    /// A one-sided phase: the lists are built once (the application's work, not the
    /// transport's), then every transfer reuses them.
    fn one_sided(&self, phase: Phase) -> Result<Measured, Failure> {
        let Phase::OneSided { op, scattered } = phase else {
            unreachable!("one_sided runs one-sided phases")
        };
        let (region, layout) = self.local(op)?;
        let b = self.shape.block;
        let (local, remote): (Vec<Segment<'_>>, Vec<RemoteSegment>) = if scattered {
            layout
                .offsets
                .iter()
                .zip(&self.target.offsets)
                .map(|(&l, &r)| {
                    (
                        Segment::new(region, l, b),
                        RemoteSegment::new(self.descriptor, r as u64, b as u64),
                    )
                })
                .unzip()
        } else {
            let n = self.shape.bytes();
            (
                vec![Segment::new(region, layout.contiguous_offset(), n)],
                vec![RemoteSegment::new(
                    self.descriptor,
                    self.target.contiguous_offset() as u64,
                    n as u64,
                )],
            )
        };
        self.measure(phase, |seq| {
            let started = Instant::now();
            let done = match op {
                Op::Write => self.conn.write(&local, &remote, Some(&note(phase, seq)))?,
                Op::Read => self.conn.read(&local, &remote)?,
            };
            Ok(InFlight {
                done,
                also: None,
                started,
            })
        })
    }

    /// The two-sided phase: each transfer is one send of the contiguous bytes, delivered when
    /// the server's acknowledgement is back (as a write is).
    fn sends(&self) -> Result<Measured, Failure> {
        let offset = self.src_layout.contiguous_offset();
        let len = self.shape.bytes();
        self.measure(Phase::Send, |seq| {
            let slot = seq % self.plan.depth;
            let started = Instant::now();
            let done = self.conn.recv(&self.acks, slot * ACK_BYTES, ACK_BYTES)?;
            let also = Some(self.conn.send(&self.src, offset, len)?);
            Ok(InFlight {
                done,
                also,
                started,
            })
        })
    }

    /// Times a phase: the first transfer alone, then the warm-up and the measured transfers
    /// with `depth` in flight; the steady clock starts when the warm-up is done.
    fn measure(
        &self,
        phase: Phase,
        mut start: impl FnMut(usize) -> Result<InFlight, Failure>,
    ) -> Result<Measured, Failure> {
        let plan = self.plan;
        let wait = |f: InFlight| -> Result<Duration, Failure> {
            f.done.wait(plan.timeout).map_err(peer_failure)?;
            let took = f.started.elapsed();
            if let Some(also) = f.also {
                also.wait(plan.timeout).map_err(peer_failure)?;
            }
            Ok(took)
        };
        let first = wait(start(0)?)?;
        let rest = plan.total(self.shape) - 1;
        let transfers = plan.transfers(self.shape);
        let mut latencies = Vec::with_capacity(transfers);
        let mut in_flight: VecDeque<InFlight> = VecDeque::with_capacity(plan.depth);
        let (mut posted, mut done) = (0, 0);
        let mut clock = Instant::now();
        while done < rest {
            while posted < rest && in_flight.len() < plan.depth {
                if !plan.gap.is_zero() && posted >= plan.warmup {
                    // A measured transfer after a pause (depth 1: nothing is in flight).
                    std::thread::sleep(plan.gap);
                }
                posted += 1;
                in_flight.push_back(start(posted)?);
            }
            let took = wait(in_flight.pop_front().expect("a transfer is in flight"))?;
            done += 1;
            if done == plan.warmup {
                clock = Instant::now();
            } else if done > plan.warmup {
                latencies.push(took);
            }
        }
        // With pauses, the transfers' own time: the clock also ran through the pauses.
        let elapsed = if plan.gap.is_zero() {
            clock.elapsed()
        } else {
            latencies.iter().sum()
        };
        Ok(Measured {
            phase,
            gbps: stats::gbps(self.shape.bytes() * transfers, elapsed),
            latencies,
            first: Some(first),
            transfers,
            packed: None,
        })
    }

    /// The area of the read destination a read phase fills.
    fn back_area(&self, phase: Phase) -> (usize, usize) {
        match phase {
            Phase::OneSided {
                scattered: true, ..
            } => (0, self.back_layout.scattered_len()),
            _ => (self.back_layout.contiguous_offset(), self.shape.bytes()),
        }
    }

    /// Zeroes what a read phase will fill, so a read that never lands cannot pass.
    fn poison_back(&self, phase: Phase) -> Result<(), Failure> {
        let (offset, len) = self.back_area(phase);
        if let Some(back) = &self.back {
            back.write(offset, &vec![0u8; len])?;
        }
        Ok(())
    }

    /// Checks what a read phase brought.
    fn check_back(&self, phase: Phase) -> Result<(), Failure> {
        let Some(back) = &self.back else {
            return Ok(());
        };
        let (offset, len) = self.back_area(phase);
        let mut bytes = vec![0u8; len];
        back.read(offset, &mut bytes)?;
        let verdict = match phase {
            Phase::OneSided {
                scattered: true, ..
            } => self.back_layout.check_scattered(&bytes),
            _ => self.back_layout.check_contiguous(&bytes),
        };
        fail_on(verdict, phase, "at the initiator")
    }
}
