//! The server of `tcpx-bench kv`: the target. Per shape it allocates its region, fills it with
//! the pattern, advertises it, then accepts the client's fresh connection and hands over the
//! descriptor. During one-sided phases it makes no call on the data path: it watches for the
//! client's FINISHED (failing once nothing moves for `--timeout`), then collects the phase's
//! notifications and, with `--verify`, checks what was written. It receives the two-sided
//! phase (acknowledging every transfer) and the raw-TCP streams.

use std::collections::VecDeque;
use std::net::TcpListener;
use std::time::{Duration, Instant};

use anyhow::anyhow;
use tcpx_runtime::{Connection, Descriptor, Endpoint, Region, Transfer};

use super::layout::{Layout, Side, Verdict};
use super::{alloc_region, msg, note, Op, Phase, Plan, Shape, ACK_BYTES};
use crate::bench::control::{self, Control};
use crate::bench::pair::{exit, peer_failure, Failure};
use crate::bench::rawtcp::{self, Strangers};

/// Serves every shape of `plan`, one connection each, then returns.
pub fn serve(endpoint: &Endpoint, baseline: &TcpListener, plan: &Plan) -> Result<(), Failure> {
    let token = rawtcp::new_token()?;
    let mut strangers = Strangers::default();
    for (index, &shape) in plan.shapes.iter().enumerate() {
        let layout = Layout::new(shape, Side::Target);
        let region = alloc_region(endpoint, plan, layout.region_len())?;
        region.write(0, &layout.image())?;
        let descriptor = endpoint.advertise(&region)?;
        // The client starts after this process printed its metadata and builds its regions
        // before it connects: the first accept waits longer.
        let wait = if index == 0 {
            plan.timeout * 4
        } else {
            plan.timeout
        };
        let conn = endpoint.accept_timeout(wait).map_err(|e| {
            peer_failure(anyhow::Error::from(e).context(format!("shape {shape}: accept")))
        })?;
        let mut target = Target {
            endpoint,
            conn: &conn,
            plan,
            shape,
            layout: &layout,
            region: &region,
        };
        let served = target.serve(&descriptor, baseline, token, &mut strangers);
        endpoint.revoke(&descriptor);
        served.map_err(|f| Failure {
            code: f.code,
            error: f.error.context(format!("shape {shape}")),
        })?;
        conn.close().map_err(peer_failure)?;
    }
    Ok(())
}

/// One shape's connection and memory.
struct Target<'a> {
    endpoint: &'a Endpoint,
    conn: &'a Connection,
    plan: &'a Plan,
    shape: Shape,
    layout: &'a Layout,
    region: &'a Region,
}

impl Target<'_> {
    fn serve(
        &mut self,
        descriptor: &Descriptor,
        baseline: &TcpListener,
        token: u64,
        strangers: &mut Strangers,
    ) -> Result<(), Failure> {
        let plan = self.plan;
        let ctl = Control::new(self.endpoint, self.conn, plan.timeout)?;
        let d: [u64; 4] =
            control::pack_bytes(&descriptor.to_bytes()).expect("a descriptor fits in 4 words");
        ctl.send([
            msg::HELLO,
            token,
            plan.fingerprint(),
            d[0],
            d[1],
            d[2],
            d[3],
        ])?;
        let acks = self.endpoint.alloc_host(ACK_BYTES)?;
        self.conn.register(&acks)?;
        for phase in plan.phases() {
            let verdict = match phase {
                Phase::OneSided { op, scattered } => {
                    let writes = op == Op::Write;
                    if writes && plan.verify {
                        self.poison(scattered)?;
                    }
                    ctl.send([msg::READY, phase.code(), 0])?;
                    self.one_sided(&ctl, phase, writes, scattered)?
                }
                Phase::Send => {
                    if plan.verify {
                        self.poison(false)?;
                    }
                    ctl.send([msg::READY, phase.code(), 0])?;
                    self.receive_sends(&acks)?;
                    if plan.verify {
                        self.check(false)?
                    } else {
                        Verdict::Ok
                    }
                }
                Phase::RawTcp => {
                    ctl.send([msg::READY, phase.code(), 0])?;
                    rawtcp::receive(baseline, &plan.streams(self.shape), token, strangers)
                        .map_err(|e| peer_failure(e.context("raw-TCP baseline")))?;
                    continue;
                }
            };
            let [v0, v1, v2] = verdict.to_words();
            ctl.send([msg::VERDICT, v0, v1, v2])?;
            if let Some(text) = verdict.describe(&format!("{} {}", phase.op(), phase.layout())) {
                return Err(Failure {
                    code: if verdict.is_data() {
                        exit::VERIFY
                    } else {
                        exit::ERROR
                    },
                    error: anyhow!(text),
                });
            }
        }
        Ok(())
    }

    /// Waits out a one-sided phase, then judges it: every notification in order (writes),
    /// every byte where it belongs (`--verify`, writes).
    fn one_sided(
        &self,
        ctl: &Control<'_>,
        phase: Phase,
        writes: bool,
        scattered: bool,
    ) -> Result<Verdict, Failure> {
        let mut notes: Vec<Vec<u8>> = Vec::new();
        let mut last = one_sided_bytes(self.conn);
        let [kind, code, total] = ctl.recv_watching("the client's FINISHED", || {
            // Drained as they come: the inbox holds a bounded number.
            let before = notes.len();
            notes.extend(self.endpoint.notifications().into_iter().map(|(_, n)| n));
            let now = one_sided_bytes(self.conn);
            let moved = notes.len() > before || now != last;
            last = now;
            moved
        })?;
        if kind != msg::FINISHED || code != phase.code() {
            return Err(anyhow!(
                "the client sent message {kind:#x} for phase {code}, expected FINISHED for {}: \
                 give both processes the same options",
                phase.code()
            )
            .into());
        }
        if !writes {
            return Ok(Verdict::Ok);
        }
        let want = total as usize;
        let verdict = self.notifications(&mut notes, phase, want);
        if verdict != Verdict::Ok || !self.plan.verify {
            return Ok(verdict);
        }
        self.check(scattered)
    }

    /// Collects the phase's notifications (each write's comes after its bytes landed, so they
    /// are due by now; a short grace covers delivery) and checks their order.
    fn notifications(&self, notes: &mut Vec<Vec<u8>>, phase: Phase, want: usize) -> Verdict {
        let deadline = Instant::now() + self.plan.timeout;
        while notes.len() < want && Instant::now() < deadline {
            let more = self.endpoint.notifications();
            if more.is_empty() {
                std::thread::sleep(Duration::from_millis(1));
            }
            notes.extend(more.into_iter().map(|(_, n)| n));
        }
        let in_order = notes
            .iter()
            .enumerate()
            .take_while(|(seq, n)| n.as_slice() == note(phase, *seq))
            .count();
        if in_order == want && notes.len() == want {
            Verdict::Ok
        } else {
            Verdict::Notifications {
                got: if in_order < want {
                    in_order
                } else {
                    notes.len()
                },
                want,
            }
        }
    }

    /// Receives the two-sided phase (`depth` receives posted ahead), acknowledging each
    /// transfer once it arrived.
    fn receive_sends(&self, acks: &Region) -> Result<(), Failure> {
        let plan = self.plan;
        let total = plan.total(self.shape);
        let (offset, len) = (self.layout.contiguous_offset(), self.shape.bytes());
        let mut recvs: VecDeque<Transfer> = VecDeque::with_capacity(plan.depth);
        let mut sent: VecDeque<Transfer> = VecDeque::with_capacity(plan.depth + 1);
        let mut posted = 0;
        for _ in 0..total {
            while posted < total && recvs.len() < plan.depth {
                recvs.push_back(self.conn.recv(self.region, offset, len)?);
                posted += 1;
            }
            let t = recvs.pop_front().expect("a receive is posted");
            let got = t.wait(plan.timeout).map_err(peer_failure)?;
            if got as usize != len {
                return Err(anyhow!("received {got} bytes for a {len}-byte transfer").into());
            }
            sent.push_back(self.conn.send(acks, 0, ACK_BYTES)?);
            while sent.len() > plan.depth {
                let ack = sent.pop_front().expect("non-empty");
                ack.wait(plan.timeout).map_err(peer_failure)?;
            }
        }
        for ack in sent {
            ack.wait(plan.timeout).map_err(peer_failure)?;
        }
        Ok(())
    }

    /// Zeroes the area a phase writes, so that a transfer that never lands cannot pass for
    /// one that did.
    fn poison(&self, scattered: bool) -> Result<(), Failure> {
        let (offset, len) = self.area(scattered);
        self.region.write(offset, &vec![0u8; len])?;
        Ok(())
    }

    /// Checks the area a phase wrote.
    fn check(&self, scattered: bool) -> Result<Verdict, Failure> {
        let (offset, len) = self.area(scattered);
        let mut bytes = vec![0u8; len];
        self.region.read(offset, &mut bytes)?;
        Ok(if scattered {
            self.layout.check_scattered(&bytes)
        } else {
            self.layout.check_contiguous(&bytes)
        })
    }

    fn area(&self, scattered: bool) -> (usize, usize) {
        if scattered {
            (0, self.layout.scattered_len())
        } else {
            (self.layout.contiguous_offset(), self.shape.bytes())
        }
    }
}

/// Bytes the connection's one-sided channels moved so far (the target's sign of life of a
/// one-sided phase, where it makes no call).
fn one_sided_bytes(conn: &Connection) -> u64 {
    conn.one_sided_stats()
        .iter()
        .map(|s| s.bytes_sent + s.bytes_received)
        .sum()
}
