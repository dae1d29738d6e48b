//! The control loop's side of one-sided operations: serving the peer's requests (target),
//! taking the peer's answers (initiator), and the [`Acknowledger`].
//!
//! Everything here runs on the connection's control loop (`endpoint::watch`), one message
//! at a time, in stream order: that order *is* the posting order of the RMA receive lanes.
//! The loop never waits on data. What must wait for a job — a served write's `WriteAck`
//! and notification, an initiated write answered before its sends
//! were done — is queued as a [`TargetItem`], and the [`Acknowledger`] hands the items over
//! in stream order once their jobs finish: it answers `WriteAck` and then delivers the
//! notification (after the answer was written, so that a target torn down at the
//! notification has answered already); it queues each accepted read's send job and answers
//! `ReadData` (or `ReadRefused`). So a notification reaches the application only after its
//! write's bytes have landed, and after every earlier write's; a read is served only after
//! every earlier write landed; and two endpoints whose control streams are both full cannot
//! deadlock (both loops keep reading).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::coalesce::coalesce;
use super::inline;
use super::pack::{
    spans_buffers, worth_packing, PackLease, Part, ONE_OFF_MAX_BYTES, PACKED_HOST_MAX_BYTES,
    PACK_BYTES,
};
use super::state::{access_error, OpCut, PendingKind, PendingOp, Rma};
use crate::carrier::JobSpec;
use crate::control::rma::{
    ReadRequest, Refusal, RefusalReason, RemoteEntry, WriteRequest, MAX_INLINE,
};
use crate::control::Message;
use crate::engine::job::{staging_for, Job, Piece, Pieces};
use crate::engine::stage::Staging;
use crate::error::{Direction, Error, Result};
use crate::registry::Region;
use crate::schedule::Schedule;
use crate::transfer::Transfer;
use crate::wakeup::Wakeup;

/// Most chunks a refused write may carry into the discard region (one piece each); a peer
/// asking for more is treated as hostile (128 GiB at the default 512 KiB chunks).
const MAX_DISCARD_CHUNKS: u64 = 1 << 18;

/// Grace after a job's own deadline before the acknowledger gives up on it (the engine
/// fails the connection at the deadline; this only bounds the wait).
const ACK_GRACE: Duration = Duration::from_secs(1);

/// Where a packed write's bytes go on the target.
enum PackedInto {
    /// Staged (or CUDA) memory: scattered by the lanes out of their ring slots.
    Staged(Vec<Region>, Staging),
    /// Host memory (or nowhere, refused): through a pack buffer, scattered into these parts.
    Host(Vec<Part>),
}

/// What the [`Acknowledger`] hands over, in control-stream order.
pub(crate) enum TargetItem {
    /// A write this side serves: its receive job (into the application's regions, or the
    /// discard region when refused).
    Write {
        job: Arc<Job>,
        op_id: u64,
        refusal: Option<Refusal>,
        notification: Option<Vec<u8>>,
        /// A packed write's pack buffer (the engines scatter it into the application's
        /// blocks; a refused write's bytes stay in it), back to the pool once handled.
        pack: Option<PackLease>,
    },
    /// A write whose data came in its request ([`crate::Config::inline_bytes`]): where each
    /// piece of `data` goes, in order (empty when refused).
    InlineWrite {
        op_id: u64,
        pieces: Vec<(Region, usize, usize)>,
        data: Vec<u8>,
        refusal: Option<Refusal>,
        notification: Option<Vec<u8>>,
    },
    /// A read that asked for its data inline: where its pieces are read from, in order
    /// (empty when refused).
    ServeInlineRead {
        op_id: u64,
        pieces: Vec<(Region, usize, usize)>,
        refusal: Option<Refusal>,
    },
    /// A standalone notification.
    Notify(Vec<u8>),
    /// A read this side serves: its send job (`None` when refused) is queued and `ReadData`
    /// (or `ReadRefused`) written here, not on the watcher, so the watcher never writes to
    /// the control stream and never waits on it, and a read is answered only after every
    /// earlier write from the same peer landed (read-after-write order per connection).
    ServeRead {
        job: Option<Arc<Job>>,
        op_id: u64,
        refusal: Option<Refusal>,
        /// The read travels packed (`ReadData` says so).
        packed: bool,
        /// A packed read's pack buffer (none when sent in place; the engines gather the
        /// blocks into it as they send), back to the pool once the job is done.
        pack: Option<PackLease>,
    },
    /// Initiator side: a write the target answered while this side's send job was still
    /// finishing; complete it once the job is done (the watcher never waits on data).
    Complete {
        job: Arc<Job>,
        op: Box<PendingOp>,
        refusal: Option<Refusal>,
    },
}

impl Rma {
    /// Handles one one-sided control message. An error is a protocol violation or a local
    /// failure that leaves the lanes out of step: the caller fails the connection.
    pub(crate) fn on_message(&self, message: Message, items: &mut Items) -> Result<()> {
        match message {
            Message::WriteRequest(request) => self.on_write_request(request, items),
            Message::ReadRequest(request) => self.on_read_request(request, items),
            Message::Notify { bytes } => {
                items.push_back(TargetItem::Notify(bytes));
                Ok(())
            }
            Message::WriteAck { op_id, refusal } => self.on_write_ack(op_id, refusal, items),
            Message::ReadData { op_id, packed } => self.on_read_data(op_id, packed),
            Message::ReadRefused { op_id, refusal } => {
                let op = self.answered(op_id, "ReadRefused")?;
                op.completion
                    .finish(Err(access_error(&self.link, refusal, &op.segments)));
                Ok(())
            }
            Message::ReadInline { op_id, data } => self.on_read_inline(op_id, data),
            other => Err(self.violation(format!("{:?} is not a one-sided message", other.kind()))),
        }
    }

    fn violation(&self, what: String) -> Error {
        Error::Violation {
            peer: self.link.peer,
            what,
        }
    }

    /// The schedule this side derives for a request: its own lengths are the coalesced remote
    /// list, the peer's are the request's local lengths (the initiator derives the mirror).
    fn request_schedule(
        &self,
        entries: &[RemoteEntry],
        peer_lens: &[u64],
        op_id: u64,
        spread: bool,
    ) -> Result<Schedule> {
        let own = super::state::remote_lens(entries);
        self.link
            .schedule(&own, peer_lens, spread)
            .map(|s| s.rotated(op_id))
            .map_err(|e| self.violation(format!("one-sided request #{op_id}: {e}")))
    }

    /// Pieces of the coalesced `entries` in `regions` (validated), registered for `direction`;
    /// or, when the regions are staged (validation made sure it is all of them or none), left
    /// unregistered with the staging the job copies through (staged regions must never
    /// reach `register_region` or the plugin).
    fn pieces(
        &self,
        entries: &[RemoteEntry],
        regions: &[Region],
        direction: Direction,
    ) -> Result<(Pieces, Option<Staging>)> {
        let staging = regions.first().and_then(staging_for);
        if regions.iter().any(|r| r.is_staged() != staging.is_some()) {
            return Err(Error::Internal(
                "validated regions mix staged and other memory".into(),
            ));
        }
        self.pieces_staged(entries, regions, direction, staging)
    }

    /// As [`Self::pieces`], staged through `staging` when given (unregistered pieces), else
    /// registered for `direction`.
    fn pieces_staged(
        &self,
        entries: &[RemoteEntry],
        regions: &[Region],
        direction: Direction,
        staging: Option<Staging>,
    ) -> Result<(Pieces, Option<Staging>)> {
        // Validation yields one region per entry, and a run's `first` is an entry's index:
        // checked once here, so the runs index the regions without a check each.
        if regions.len() != entries.len() {
            return Err(Error::Internal("validated region missing".into()));
        }
        let runs = coalesce(entries.iter().map(|e| (e.region_id, e.offset, e.len)));
        let pieces = self.carrier.region_pieces(
            runs.iter().map(|run| {
                // Validated: offset + len lies within the region, a usize.
                (&regions[run.first], run.offset as usize, run.len)
            }),
            direction,
            staging.is_some(),
        )?;
        Ok((pieces, staging))
    }

    /// Target: a write. Its data is already on the way, so a receive job is queued either
    /// way — into the application's regions, or into the discard region when refused.
    fn on_write_request(&self, request: WriteRequest, items: &mut Items) -> Result<()> {
        let WriteRequest {
            op_id,
            entries,
            local_lens,
            notification,
            packed,
            spread,
            inline,
        } = request;
        if let Some(data) = inline {
            return self.on_inline_write(op_id, entries, notification, data, items);
        }
        if packed {
            return self.on_packed_write(op_id, &entries, &local_lens, notification, spread, items);
        }
        let schedule = self.request_schedule(&entries, &local_lens, op_id, spread)?;
        // Refused (a mixed staged / other list included): the data goes to the discard
        // region, host memory that is never staged.
        let (pieces, staging, schedule, refusal) = match self.shared.adverts.validate(&entries) {
            Ok(regions) => {
                let (pieces, staging) = self.pieces(&entries, &regions, Direction::Recv)?;
                (pieces, staging, schedule, None)
            }
            Err(refusal) => {
                tracing::debug!(target: "tcpx_runtime", peer = %self.link.peer, op_id, index = refusal.index, reason = %refusal.reason, "one-sided write refused; discarding its data");
                let (pieces, schedule) = self.discard(&schedule, &local_lens, op_id)?;
                (pieces, None, schedule, Some(refusal))
            }
        };
        let job = self.carrier.new_job(JobSpec {
            direction: Direction::Recv,
            seq: op_id,
            pieces,
            staging,
            schedule: Some(schedule),
            completion: None,
            packed: false,
        });
        self.carrier.submit_job(&job);
        items.push_back(TargetItem::Write {
            job,
            op_id,
            refusal,
            notification,
            pack: None,
        });
        Ok(())
    }

    /// A write whose data came in its request: validated now, copied in when it reaches the
    /// head of the items (after every earlier write of the peer landed, so a later write to
    /// the same bytes lands last), then answered like any write.
    fn on_inline_write(
        &self,
        op_id: u64,
        entries: Vec<RemoteEntry>,
        notification: Option<Vec<u8>>,
        data: Vec<u8>,
        items: &mut Items,
    ) -> Result<()> {
        let total = entries.iter().try_fold(0u64, |a, e| a.checked_add(e.len));
        if total != Some(data.len() as u64) {
            return Err(self.violation(format!(
                "inline write #{op_id} carries {} bytes for entries of {total:?}",
                data.len()
            )));
        }
        let (pieces, refusal) = self.inline_pieces(op_id, "write", &entries);
        items.push_back(TargetItem::InlineWrite {
            op_id,
            pieces,
            data,
            refusal,
            notification,
        });
        Ok(())
    }

    /// A read that asked for its data inline: validated now, its bytes read and sent in
    /// `ReadInline` when it reaches the head of the items (after every earlier write of the
    /// peer landed), or refused.
    fn on_inline_read(&self, op_id: u64, entries: &[RemoteEntry], items: &mut Items) -> Result<()> {
        let total = entries.iter().try_fold(0u64, |a, e| a.checked_add(e.len));
        if total.is_none_or(|t| t > MAX_INLINE as u64) {
            return Err(self.violation(format!(
                "inline read #{op_id} of {total:?} bytes (at most {MAX_INLINE} travel inline)"
            )));
        }
        let (pieces, refusal) = self.inline_pieces(op_id, "read", entries);
        items.push_back(TargetItem::ServeInlineRead {
            op_id,
            pieces,
            refusal,
        });
        Ok(())
    }

    /// Initiator: the data of a read that asked for it inline; copied into the read's memory
    /// here (the control loop), and the read completes.
    fn on_read_inline(&self, op_id: u64, data: Vec<u8>) -> Result<()> {
        let op = self.answered(op_id, "ReadInline")?;
        let PendingKind::InlineRead { local } = &op.kind else {
            return Err(self.violation(format!(
                "ReadInline for operation #{op_id}, which did not ask for its data inline"
            )));
        };
        if data.len() as u64 != op.len {
            return Err(self.violation(format!(
                "ReadInline brought {} bytes for read #{op_id} of {}",
                data.len(),
                op.len
            )));
        }
        // The application's own memory refusing the bytes (it holds a CPU slice of it) fails
        // this read, not the connection.
        let outcome = inline::land(local, &data)
            .map(|()| {
                self.link.inline.received(op.len);
                op.len
            })
            .map_err(|e| Error::InvalidArgument(format!("one-sided read #{op_id}: {e}")));
        op.completion.finish(outcome);
        Ok(())
    }

    /// Where each entry of inline `what` (a write or a read) `op_id` goes on this side, or why
    /// it is refused (logged): the advertised regions must hold them, in memory the control
    /// loop can copy into and out of ([`inline::copyable`]: host memory, or CUDA memory
    /// through its GPU's small copier).
    fn inline_pieces(
        &self,
        op_id: u64,
        what: &str,
        entries: &[RemoteEntry],
    ) -> (Vec<(Region, usize, usize)>, Option<Refusal>) {
        // Copied entry by entry: a list may mix staged regions with others.
        let checked = match self.shared.adverts.validate_entries(entries) {
            Ok(regions) => match regions.iter().position(|r| !inline::copyable(r)) {
                None => (
                    regions
                        .into_iter()
                        .zip(entries)
                        // Validated: inside the region, so the offset fits a usize.
                        .map(|(region, e)| (region, e.offset as usize, e.len as usize))
                        .collect(),
                    None,
                ),
                Some(index) => {
                    self.shared.adverts.count_refusal();
                    let refusal = Refusal {
                        index: u32::try_from(index).unwrap_or(u32::MAX),
                        reason: RefusalReason::UnsupportedMemory,
                    };
                    (Vec::new(), Some(refusal))
                }
            },
            Err(refusal) => (Vec::new(), Some(refusal)),
        };
        if let Some(refusal) = &checked.1 {
            tracing::debug!(target: "tcpx_runtime", peer = %self.link.peer, op_id, index = refusal.index, reason = %refusal.reason, "inline one-sided {what} refused");
        }
        checked
    }

    /// The total of a packed request, checked: not empty, and both lists agree. (Whether it
    /// must fit a pack buffer depends on this side's memory: see the callers.)
    fn packed_total(&self, entries: &[RemoteEntry], peer_lens: &[u64], op_id: u64) -> Result<u64> {
        let total = entries.iter().try_fold(0u64, |a, e| a.checked_add(e.len));
        let peer_total = peer_lens.iter().try_fold(0u64, |a, &l| a.checked_add(l));
        match total {
            Some(t) if t > 0 && peer_total == total => Ok(t),
            _ => Err(self.violation(format!(
                "packed request #{op_id}: empty, or the lists disagree"
            ))),
        }
    }

    /// How validated `regions` take a packed stream through the lanes' rings: their GPU (or
    /// the emulation) when they are all staged, or all CUDA memory the plugin could take
    /// directly (a peer packs toward CUDA memory only when its own plugin stages it; a plugin
    /// that takes CUDA pointers here takes host memory too, so the stream can still go
    /// through rings); `None` for host memory (pack buffers).
    fn packed_staging(regions: &[Region]) -> Option<Staging> {
        let first = regions.first()?;
        if let Some(staging) = staging_for(first) {
            return Some(staging);
        }
        let device = first.cuda_device()?;
        regions
            .iter()
            .all(|r| {
                r.memory().kind() == tcpx::MemoryKind::Cuda
                    && r.cuda_device().map(|d| d.ordinal()) == Some(device.ordinal())
            })
            .then(|| Staging::Cuda(device.clone()))
    }

    /// Where a packed batch's bytes go (or come from) in validated `regions`, merged runs in
    /// stream order; every region must be unstaged host memory (the initiator checked the
    /// descriptors' kind, and staged regions are advertised as CUDA memory, so anything else
    /// is a protocol violation).
    fn parts(&self, entries: &[RemoteEntry], regions: &[Region], op_id: u64) -> Result<Vec<Part>> {
        let runs = coalesce(entries.iter().map(|e| (e.region_id, e.offset, e.len)));
        let mut parts = Vec::with_capacity(runs.len());
        for run in runs {
            let region = regions
                .get(run.first)
                .ok_or_else(|| Error::Internal("validated region missing".into()))?;
            if region.is_staged() || region.memory().kind() != tcpx::MemoryKind::Host {
                return Err(self.violation(format!(
                    "packed request #{op_id} names {} memory",
                    if region.is_staged() {
                        "staged".to_string()
                    } else {
                        format!("{:?}", region.memory().kind())
                    }
                )));
            }
            parts.push(Part {
                region: region.clone(),
                offset: run.offset,
                len: run.len,
            });
        }
        Ok(parts)
    }

    /// Target: a packed write. Into staged (or CUDA) memory, its chunks are scattered out of
    /// the lanes' ring slots as they land; into host memory, it is received into a pack buffer
    /// (an accepted list of one run: in place) and the engines scatter each chunk as it lands,
    /// unless refused, so the job finishes before the acknowledgement. A refused write's data still lands (the wire
    /// carries the same contiguous schedule either way): in a pack buffer, or, past one, in
    /// the discard region chunk by chunk.
    fn on_packed_write(
        &self,
        op_id: u64,
        entries: &[RemoteEntry],
        peer_lens: &[u64],
        notification: Option<Vec<u8>>,
        spread: bool,
        items: &mut Items,
    ) -> Result<()> {
        let total = self.packed_total(entries, peer_lens, op_id)?;
        let (into, refusal) = match self.shared.adverts.validate(entries) {
            Ok(regions) => match Self::packed_staging(&regions) {
                Some(staging) => (PackedInto::Staged(regions, staging), None),
                None if total <= PACKED_HOST_MAX_BYTES => (
                    PackedInto::Host(self.parts(entries, &regions, op_id)?),
                    None,
                ),
                None => {
                    return Err(self.violation(format!(
                        "packed request #{op_id} of {total} bytes into host memory: past \
                         {PACKED_HOST_MAX_BYTES} bytes"
                    )))
                }
            },
            Err(refusal) => {
                tracing::debug!(target: "tcpx_runtime", peer = %self.link.peer, op_id, index = refusal.index, reason = %refusal.reason, "packed one-sided write refused; not scattering it");
                (PackedInto::Host(Vec::new()), Some(refusal))
            }
        };
        let schedule = super::pack::packed_schedule(total, &self.link, op_id, spread)
            .map_err(|e| self.violation(format!("packed request #{op_id}: {e}")))?;
        let (pieces, staging, schedule, pack) = match (into, &refusal) {
            (PackedInto::Staged(regions, staging), _) => {
                let (pieces, staging) =
                    self.pieces_staged(entries, &regions, Direction::Recv, Some(staging))?;
                (pieces, staging, schedule, None)
            }
            // Refused past a pack buffer: the data goes to the discard region.
            (PackedInto::Host(_), Some(_)) if total > PACK_BYTES => {
                let (pieces, schedule) = self.discard(&schedule, &[total], op_id)?;
                (pieces, None, schedule, None)
            }
            // An accepted list of one run is received in place; anything else (a scattered
            // list, or a refused write's data) lands in a pack buffer.
            (PackedInto::Host(parts), refusal) => {
                let (own, pack) = match (refusal, parts.as_slice()) {
                    (None, [part]) => {
                        let own = smallvec::smallvec![self.carrier.region_piece(
                            &part.region,
                            // Validated: within the region, a usize.
                            part.offset as usize,
                            total,
                            Direction::Recv,
                            false,
                        )?];
                        (own, None)
                    }
                    _ => {
                        if !self.pack.overflow_room(total) {
                            return Err(self.violation(format!(
                                "packed request #{op_id} of {total} bytes: the peer has more \
                                 than {ONE_OFF_MAX_BYTES} bytes of packed writes in flight past \
                                 this side's pack buffers, more than any pool sends"
                            )));
                        }
                        let spans = spans_buffers(total, schedule.cut_bytes());
                        let lease = self.pack.for_receiver(total, spans)?;
                        (Pieces::new(), Some((lease, parts)))
                    }
                };
                let (pieces, schedule) = self.packed_job_parts(
                    pack.as_ref().map(|(lease, _)| lease),
                    own,
                    total,
                    Direction::Recv,
                    false,
                    OpCut { op_id, spread },
                )?;
                (pieces, None, schedule, pack)
            }
        };
        let spec = JobSpec {
            direction: Direction::Recv,
            seq: op_id,
            pieces,
            staging,
            schedule: Some(schedule),
            completion: None,
            packed: true,
        };
        // An accepted scattered list: the engines scatter each chunk out of the pack buffer
        // as it lands, so the job finishes with every byte in place. A refused write's data
        // stays in the buffer.
        let job = match (&pack, &refusal) {
            (Some((_, parts)), None) => self.packed_host_job(spec, parts)?,
            _ => self.carrier.new_job(spec),
        };
        let pack = pack.map(|(lease, _)| lease);
        // Counted first: the transfer may complete before this thread runs on.
        self.pack.count_received();
        self.carrier.submit_job(&job);
        items.push_back(TargetItem::Write {
            job,
            op_id,
            refusal,
            notification,
            pack,
        });
        Ok(())
    }

    /// The discard job of a refused write: one piece per chunk of the schedule the accepted
    /// write would have had, each at offset 0 of the chunk-sized discard region. The chunk
    /// boundaries include every boundary of both lists, so cutting this side's list at them
    /// yields the same chunks on the same channels: the lanes stay in step.
    fn discard(
        &self,
        schedule: &Schedule,
        peer_lens: &[u64],
        op_id: u64,
    ) -> Result<(Pieces, Schedule)> {
        if schedule.chunk_count() > MAX_DISCARD_CHUNKS {
            return Err(self.violation(format!(
                "refused write #{op_id} would carry {} chunks",
                schedule.chunk_count()
            )));
        }
        let (scratch_memory, scratch) = self.scratch()?;
        let (lens, schedule) = discard_schedule(schedule, peer_lens, op_id)
            .map_err(|e| Error::Internal(format!("discard schedule: {e}")))?;
        let pieces = lens
            .into_iter()
            .map(|len| Piece {
                registration: Some(scratch.clone()),
                memory: scratch_memory.clone(),
                offset: 0,
                len,
                cuda: None,
            })
            .collect();
        Ok((pieces, schedule))
    }

    /// Target: a read. Accepted: its send job is built here and handed to the acknowledger,
    /// which queues it and writes `ReadData` in one critical section (this side sends the
    /// data, so it sets the order). Refused: `ReadRefused`, and nothing moves.
    fn on_read_request(&self, request: ReadRequest, items: &mut Items) -> Result<()> {
        let ReadRequest {
            op_id,
            entries,
            local_lens,
            pack,
            spread,
            inline,
        } = request;
        if inline {
            return self.on_inline_read(op_id, &entries, items);
        }
        let validated = self.shared.adverts.validate(&entries);
        if pack {
            if let Ok(regions) = &validated {
                if let Some(item) =
                    self.packed_read(op_id, &entries, &local_lens, regions, spread)?
                {
                    items.push_back(item);
                    return Ok(());
                }
            }
        }
        let schedule = self.request_schedule(&entries, &local_lens, op_id, spread)?;
        let item = match validated {
            Ok(regions) => {
                let (pieces, staging) = self.pieces(&entries, &regions, Direction::Send)?;
                TargetItem::ServeRead {
                    job: Some(self.carrier.new_job(JobSpec {
                        direction: Direction::Send,
                        seq: op_id,
                        pieces,
                        staging,
                        schedule: Some(schedule),
                        completion: None,
                        packed: false,
                    })),
                    op_id,
                    refusal: None,
                    packed: false,
                    pack: None,
                }
            }
            Err(refusal) => {
                tracing::debug!(target: "tcpx_runtime", peer = %self.link.peer, op_id, index = refusal.index, reason = %refusal.reason, "one-sided read refused");
                TargetItem::ServeRead {
                    job: None,
                    op_id,
                    refusal: Some(refusal),
                    packed: false,
                    pack: None,
                }
            }
        };
        items.push_back(item);
        Ok(())
    }

    /// Target: an accepted read the initiator offered to receive packed (it can take the
    /// contiguous stream: see `Rma::pack_side`). This side sends the data, so it decides:
    /// packed when its own rule says so and its memory can be gathered — staged (or CUDA)
    /// memory chunk by chunk into the lanes' ring slots, any size; unstaged host memory
    /// through pooled buffers (none free: unpacked), at most what the pool holds
    /// (`Rma::host_pack_cap`). `None` serves it unpacked.
    fn packed_read(
        &self,
        op_id: u64,
        entries: &[RemoteEntry],
        peer_lens: &[u64],
        regions: &[Region],
        spread: bool,
    ) -> Result<Option<TargetItem>> {
        let total = self.packed_total(entries, peer_lens, op_id)?;
        let own_runs = coalesce(entries.iter().map(|e| (e.region_id, e.offset, e.len))).len();
        let runs = own_runs.max(peer_lens.len());
        if let Some(staging) = Self::packed_staging(regions) {
            if !worth_packing(total, runs, self.config.pack_staged_below, u64::MAX) {
                return Ok(None);
            }
            let (pieces, staging) =
                self.pieces_staged(entries, regions, Direction::Send, Some(staging))?;
            let (pieces, schedule) = self.packed_job_parts(
                None,
                pieces,
                total,
                Direction::Send,
                true,
                OpCut { op_id, spread },
            )?;
            let job = self.carrier.new_job(JobSpec {
                direction: Direction::Send,
                seq: op_id,
                pieces,
                staging,
                schedule: Some(schedule),
                completion: None,
                packed: true,
            });
            return Ok(Some(TargetItem::ServeRead {
                job: Some(job),
                op_id,
                refusal: None,
                packed: true,
                pack: None,
            }));
        }
        // Host memory here: the reader offered by its own rule, below the staged threshold
        // when its memory is staged, below the host one when it is host memory, and the
        // request does not say which. So an offer is taken below the larger of the two:
        // the reader already declined whatever its side would lose by.
        let below = self.config.pack_below.max(self.config.pack_staged_below);
        if !worth_packing(total, runs, below, self.host_pack_cap(total, spread))
            || regions
                .iter()
                .any(|r| r.is_staged() || r.memory().kind() != tcpx::MemoryKind::Host)
        {
            return Ok(None);
        }
        let parts = self.parts(entries, regions, op_id)?;
        // One run is sent from in place; a scattered list needs a pooled buffer.
        let (own, pack) = if parts.len() == 1 {
            // Unstaged (checked above): registered pieces.
            (self.pieces(entries, regions, Direction::Send)?.0, None)
        } else {
            let Some(lease) = self.pack.for_sender(total)? else {
                return Ok(None);
            };
            (Pieces::new(), Some((lease, parts)))
        };
        let (pieces, schedule) = self.packed_job_parts(
            pack.as_ref().map(|(lease, _)| lease),
            own,
            total,
            Direction::Send,
            false,
            OpCut { op_id, spread },
        )?;
        let spec = JobSpec {
            direction: Direction::Send,
            seq: op_id,
            pieces,
            staging: None,
            schedule: Some(schedule),
            completion: None,
            packed: true,
        };
        // The engines gather the blocks chunk by chunk as they send, after the job is queued
        // (behind every earlier write of the peer, landed in full: see `handle`).
        let job = match &pack {
            Some((_, parts)) => self.packed_host_job(spec, parts)?,
            None => self.carrier.new_job(spec),
        };
        let pack = pack.map(|(lease, _)| lease);
        Ok(Some(TargetItem::ServeRead {
            job: Some(job),
            op_id,
            refusal: None,
            packed: true,
            pack,
        }))
    }

    fn answered(&self, op_id: u64, what: &str) -> Result<super::state::PendingOp> {
        self.take_pending(op_id).ok_or_else(|| {
            self.violation(format!(
                "{what} for operation #{op_id}, which is not pending"
            ))
        })
    }

    /// Initiator: the target accepted a read and queued its data; queue the receive (into
    /// the pack buffer offered, if the target packed: the engines scatter it chunk by chunk).
    fn on_read_data(&self, op_id: u64, packed: bool) -> Result<()> {
        let op = self.answered(op_id, "ReadData")?;
        match op.kind {
            PendingKind::Read { offered: false, .. } if packed => Err(self.violation(format!(
                "packed ReadData for read #{op_id}, which did not offer packing"
            ))),
            PendingKind::Read {
                pieces,
                pack: None,
                staging,
                spread,
                ..
            } if packed => {
                // A staged list: the lanes scatter each chunk out of their ring slots, and the
                // read completes once every chunk's copy was seen done. A host list that is
                // one run: the packed data lands in place.
                let staged = staging.is_some();
                let (pieces, schedule) = self.packed_job_parts(
                    None,
                    pieces,
                    op.len,
                    Direction::Recv,
                    staged,
                    OpCut { op_id, spread },
                )?;
                let job = self.carrier.new_job(JobSpec {
                    direction: Direction::Recv,
                    seq: op_id,
                    pieces,
                    staging,
                    schedule: Some(schedule),
                    completion: Some(op.completion),
                    packed: true,
                });
                // Counted first: the transfer may complete before this thread runs on.
                self.pack.count_received();
                self.carrier.submit_job(&job);
                Ok(())
            }
            PendingKind::Read {
                pack: Some(pack),
                spread,
                ..
            } if packed => {
                let (pieces, schedule) = self.packed_job_parts(
                    Some(&pack.lease),
                    Pieces::new(),
                    op.len,
                    Direction::Recv,
                    false,
                    OpCut { op_id, spread },
                )?;
                // The engines scatter each chunk out of the pack buffer as it lands: the job
                // (the application's transfer) finishes with every byte in place.
                let job = self.packed_host_job(
                    JobSpec {
                        direction: Direction::Recv,
                        seq: op_id,
                        pieces,
                        staging: None,
                        schedule: Some(schedule),
                        completion: Some(op.completion),
                        packed: true,
                    },
                    &pack.parts,
                )?;
                // Counted first: the transfer may complete before this thread runs on.
                self.pack.count_received();
                self.carrier.submit_job(&job);
                // Back to the pool once the job finished (never while a request is on it).
                self.pack.hold(job, pack.lease);
                Ok(())
            }
            PendingKind::Read {
                pieces,
                schedule,
                staging,
                ..
            } => {
                // A staged read completes (`op.completion`) only once the receive job did,
                // i.e. after every chunk's ring → memory copy was seen done.
                let job = self.carrier.new_job(JobSpec {
                    direction: Direction::Recv,
                    seq: op_id,
                    pieces,
                    staging,
                    schedule: Some(schedule),
                    completion: Some(op.completion),
                    packed: false,
                });
                self.carrier.submit_job(&job);
                Ok(())
            }
            PendingKind::Write { .. } | PendingKind::InlineWrite => {
                Err(self.violation(format!("ReadData for write #{op_id}")))
            }
            PendingKind::InlineRead { .. } => Err(self.violation(format!(
                "ReadData for read #{op_id}, which asked for its data inline"
            ))),
        }
    }

    /// Initiator: the target's verdict on a write. Completes the transfer once this side's
    /// send job is done too (its memory is then free for the CPU again): now, or through the
    /// acknowledger if the job is still finishing.
    fn on_write_ack(&self, op_id: u64, refusal: Option<Refusal>, items: &mut Items) -> Result<()> {
        let op = self.answered(op_id, "WriteAck")?;
        let job = match &op.kind {
            PendingKind::Write { job } => job.clone(),
            // Nothing of this side's to wait for: the data left in the request.
            PendingKind::InlineWrite => {
                let outcome = match refusal {
                    Some(refusal) => Err(access_error(&self.link, refusal, &op.segments)),
                    None => Ok(op.len),
                };
                op.completion.finish(outcome);
                return Ok(());
            }
            PendingKind::Read { .. } | PendingKind::InlineRead { .. } => {
                return Err(self.violation(format!("WriteAck for read #{op_id}")))
            }
        };
        if job.is_finished() {
            complete_write(&self.link, &job, op, refusal, Duration::ZERO);
        } else {
            // Boxed: rare (the answer came before the engine retired the sends), and the
            // operation would make every item of the queue as large as itself.
            items.push_back(TargetItem::Complete {
                job,
                op: Box::new(op),
                refusal,
            });
        }
        Ok(())
    }
}

/// This side's list for discarding `schedule`'s data (one segment per chunk) and the schedule
/// built from it, which has the same chunks on the same channels.
fn discard_schedule(
    schedule: &Schedule,
    peer_lens: &[u64],
    op_id: u64,
) -> std::result::Result<(Vec<u64>, Schedule), crate::schedule::ScheduleError> {
    let lens: Vec<u64> = schedule.iter().map(|c| u64::from(c.len)).collect();
    let discard = Schedule::vectored(
        &lens,
        peer_lens,
        schedule.chunk_bytes(),
        schedule.channels(),
    )?
    .rotated(op_id);
    Ok((lens, discard))
}

/// Completes an answered write: the refusal, else the send job's outcome (waited for, up to
/// its deadline: the target has every byte, so the sends are done or about to be).
fn complete_write(
    link: &crate::link::Link,
    job: &Job,
    op: PendingOp,
    refusal: Option<Refusal>,
    spin: Duration,
) {
    let left = job.deadline.saturating_duration_since(Instant::now()) + ACK_GRACE;
    let sent = Transfer::new(job.completion.clone(), Direction::Send, job.len, spin).wait(left);
    let outcome = match (refusal, sent) {
        (Some(refusal), _) => Err(access_error(link, refusal, &op.segments)),
        (None, Ok(_)) => Ok(op.len),
        (None, Err(e)) => Err(e),
    };
    op.completion.finish(outcome);
}

/// Fails what an item the acknowledger gives up on holds, with the link's error: its jobs
/// (one never handed to the engines would otherwise never finish), the application's
/// completions, and its pack buffer (a job may still post into it: never reused).
fn fail_item(link: &crate::link::Link, item: TargetItem) {
    match item {
        TargetItem::Write { job, pack, .. } => {
            job.fail_with_link();
            if let Some(lease) = pack {
                lease.poison();
            }
        }
        TargetItem::Notify(_)
        | TargetItem::InlineWrite { .. }
        | TargetItem::ServeInlineRead { .. } => {}
        TargetItem::ServeRead { job, pack, .. } => {
            if let Some(job) = job {
                job.fail_with_link();
            }
            if let Some(lease) = pack {
                lease.poison();
            }
        }
        TargetItem::Complete { job, op, .. } => {
            job.fail_with_link();
            op.completion.finish(Err(link.failure_or_closed()));
        }
    }
}

/// The items the control loop still has to answer or complete, in control-stream order: a
/// FIFO, so a read is served only after every earlier write landed, and notifications are
/// delivered in the order the peer sent them.
pub(crate) type Items = VecDeque<TargetItem>;

impl TargetItem {
    /// The job this item waits for before it can be handled, if any.
    fn awaits(&self) -> Option<&Arc<Job>> {
        match self {
            Self::Write { job, .. } | Self::Complete { job, .. } => Some(job),
            Self::Notify(_)
            | Self::ServeRead { .. }
            | Self::InlineWrite { .. }
            | Self::ServeInlineRead { .. } => None,
        }
    }
}

/// The notifications the control loop holds until the answers before them are written.
///
/// Answers (`WriteAck`, `ReadData`, `ReadRefused`) are queued on the connection's
/// [`crate::control::ControlTx`] and written by the loop with everything else queued, one
/// syscall for all that is ready, without the loop ever waiting for the socket. A
/// notification must not become visible before its write's answer left (an application that
/// tears its endpoint down at the notification would take the answer with it), so each waits
/// here, in stream order, until the stream position after its answer is written.
#[derive(Default)]
struct Answers {
    /// Notifications of answered writes (and standalone ones behind them), in stream order,
    /// each with the [`ControlTx::queued_mark`](crate::control::ControlTx::queued_mark) it
    /// waits for.
    notifications: VecDeque<(u64, Vec<u8>)>,
}

impl Answers {
    /// Queues `message` (the loop writes it, or this thread when the loop sleeps: drain).
    fn queue(&mut self, rma: &Rma, message: &Message) {
        if let Err(e) = rma.writer.post(message) {
            rma.link.fail(e.into());
        }
    }

    /// Queues a send job's marker (`ReadData`) with the job in one critical section (see
    /// the order rule in [`crate::onesided`]).
    fn queue_with_job(&mut self, rma: &Rma, job: &Arc<Job>, message: &Message) {
        let ((), queued) = rma
            .writer
            .queue_with(|| rma.carrier.submit_job(job), message);
        if let Err(e) = queued.and_then(|()| rma.writer.signal()) {
            rma.link.fail(e.into());
        }
    }

    /// Holds `bytes` until everything queued so far (its write's answer included) is written.
    fn hold(&mut self, rma: &Rma, bytes: Vec<u8>) {
        self.notifications
            .push_back((rma.writer.queued_mark(), bytes));
    }

    /// Delivers the notifications whose answers are written; with `wait`, writes what is
    /// queued first (on this thread, waiting for the socket) and delivers them all.
    fn deliver(&mut self, rma: &Rma, wait: bool) {
        if self.notifications.is_empty() {
            return;
        }
        if wait {
            if let Err(e) = rma.writer.flush() {
                rma.link.fail(e.into());
            }
        }
        let written = rma.writer.written();
        let peer = rma.link.peer;
        // A failed link writes nothing more: what is held is delivered all the same (its
        // bytes landed; only the answer could not be written).
        let failed = rma.link.is_failed();
        while let Some((mark, _)) = self.notifications.front() {
            if !(wait || failed || *mark <= written) {
                break;
            }
            if let Some((_, bytes)) = self.notifications.pop_front() {
                rma.shared.inbox.deliver(peer, bytes);
            }
        }
    }
}

/// What the control loop answers, completes and delivers (see the module docs), without
/// ever blocking on data while the loop runs.
#[derive(Default)]
pub(crate) struct Acknowledger {
    items: Items,
    answers: Answers,
}

impl Acknowledger {
    /// Where the message handlers queue what they leave to be answered.
    pub(crate) fn items(&mut self) -> &mut Items {
        &mut self.items
    }

    /// Handles every item at the head whose job has finished (an item past its job's
    /// deadline and a grace fails the connection instead: the engines should have failed the
    /// job by then). Answers are queued, not written. Returns whether it handled anything.
    pub(crate) fn advance(&mut self, rma: &Rma) -> bool {
        let mut handled = false;
        while let Some(head) = self.items.front() {
            if let Some(job) = head.awaits() {
                if !job.is_finished() {
                    if Instant::now() < job.deadline + ACK_GRACE {
                        break;
                    }
                    rma.link.fail(Error::Timeout {
                        channel: 0,
                        peer: rma.link.peer,
                        waited: rma.link.timeout,
                        what: "a one-sided operation's data (its job never finished)".into(),
                    });
                    if let Some(item) = self.items.pop_front() {
                        fail_item(&rma.link, item);
                    }
                    handled = true;
                    continue;
                }
            }
            if let Some(item) = self.items.pop_front() {
                handle(rma, item, &mut self.answers);
                handled = true;
            }
        }
        handled
    }

    /// Called after the loop wrote what the socket took: delivers the notifications whose
    /// answers are on the wire.
    pub(crate) fn delivered(&mut self, rma: &Rma) {
        self.answers.deliver(rma, false);
    }

    /// Before the loop sleeps: how long it may, having the head's job wake it when it
    /// finishes: at most `at_most`, zero when the head can be handled now.
    pub(crate) fn may_sleep(&self, wakeup: &Arc<Wakeup>, at_most: Duration) -> Duration {
        let Some(head) = self.items.front() else {
            return at_most;
        };
        match head.awaits() {
            Some(job) if !job.completion.wake_on_finish(wakeup) => (job.deadline + ACK_GRACE)
                .saturating_duration_since(Instant::now())
                .min(at_most),
            // No job to wait for, or it finished meanwhile.
            _ => Duration::ZERO,
        }
    }

    /// The loop ended (the stream ended, or the connection closed): handles what is left in
    /// order, waiting for each job (its bytes may still land: a peer that closed right after
    /// its write still has its notification delivered), then delivers the notifications.
    pub(crate) fn drain(mut self, rma: &Rma) {
        while let Some(item) = self.items.pop_front() {
            handle(rma, item, &mut self.answers);
        }
        self.answers.deliver(rma, true);
    }
}

/// Waits for `job` (up to its deadline and a grace: only the drain at the end waits; the
/// running loop hands over finished jobs only).
fn wait_job(rma: &Rma, job: &Job, direction: Direction) -> Result<u64> {
    let left = job.deadline.saturating_duration_since(Instant::now()) + ACK_GRACE;
    Transfer::new(
        job.completion.clone(),
        direction,
        job.len,
        rma.config.wait_spin,
    )
    .wait(left)
}

/// Handles one item (see the module docs: the hand-off between a served write's last chunk
/// and its notification and `WriteAck`).
/// Blocks only for a job that has not finished, which the running loop never hands it.
fn handle(rma: &Rma, item: TargetItem, answers: &mut Answers) {
    match item {
        // Behind every earlier write's notification, as the peer sent it.
        TargetItem::Notify(bytes) => answers.hold(rma, bytes),
        TargetItem::ServeInlineRead {
            op_id,
            pieces,
            refusal,
        } => {
            if let Some(refusal) = refusal {
                answers.queue(rma, &Message::ReadRefused { op_id, refusal });
                return;
            }
            let mut data = Vec::with_capacity(pieces.iter().map(|p| p.2).sum());
            if let Err(e) = inline::gather(&pieces, &mut data) {
                // As for a send out of it: memory the application holds a CPU slice of (or
                // a GPU copy that failed) fails the connection.
                rma.link.fail(Error::InvalidArgument(format!(
                    "inline one-sided read #{op_id}: {e}"
                )));
                return;
            }
            rma.shared
                .inline_served
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            rma.link.inline.sent(data.len() as u64);
            answers.queue(rma, &Message::ReadInline { op_id, data });
        }
        TargetItem::InlineWrite {
            op_id,
            pieces,
            data,
            refusal,
            notification,
        } => {
            if let Err(e) = inline::land(&pieces, &data) {
                // Memory that cannot take the bytes now (the application holds a CPU slice
                // of it): as for an eager receive, the connection fails with why.
                rma.link.fail(Error::InvalidArgument(format!(
                    "inline one-sided write #{op_id}: {e}"
                )));
                return;
            }
            if refusal.is_none() {
                rma.shared
                    .inline_served
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                rma.link.inline.received(data.len() as u64);
            }
            // As for any write: the answer leaves before the notification is visible.
            answers.queue(rma, &Message::WriteAck { op_id, refusal });
            if refusal.is_none() {
                if let Some(bytes) = notification {
                    answers.hold(rma, bytes);
                }
            }
        }
        TargetItem::ServeRead {
            job,
            op_id,
            refusal,
            packed,
            pack,
        } => {
            // Packed: the engines gather the blocks once the job is queued here, after every
            // earlier write of the peer landed in full.
            match (&job, refusal) {
                (Some(job), _) => {
                    // Counted before `ReadData` leaves: the initiator may complete the read
                    // (and look at the counters) before this thread runs on.
                    if packed {
                        rma.pack.count_sent();
                    }
                    answers.queue_with_job(rma, job, &Message::ReadData { op_id, packed });
                }
                (None, Some(refusal)) => {
                    answers.queue(rma, &Message::ReadRefused { op_id, refusal })
                }
                (None, None) => {}
            }
            // A job never handed to the engines (the connection failed) still finishes.
            if let Some(job) = job {
                if rma.link.is_failed() {
                    job.fail_with_link();
                }
                if let Some(lease) = pack {
                    // Back to the pool once the sends are done.
                    rma.pack.hold(job, lease);
                }
            }
        }
        TargetItem::Complete { job, op, refusal } => {
            complete_write(&rma.link, &job, *op, refusal, rma.config.wait_spin)
        }
        TargetItem::Write {
            job,
            op_id,
            refusal,
            notification,
            pack,
        } => {
            // The receive job completes only once every chunk is in the application's
            // memory: for a staged write (CUDA, or emulated) the lane retires a chunk only
            // after its ring → memory copy was seen done (`consume_recv` in
            // `engine/channel.rs` returns before a slot whose copy is still running), so the
            // notification never precedes the bytes it announces.
            // A packed write's bytes are in the application's memory once its job finished:
            // the engines scatter each chunk as it lands (a refused one's never are).
            let landed = wait_job(rma, &job, Direction::Recv);
            if let Some(lease) = pack {
                if !job.is_finished() {
                    lease.poison();
                }
            }
            match landed {
                Ok(_) => {
                    // The answer leaves before the notification is visible (`Answers`
                    // delivers it after the flush that writes the answer): an application
                    // that tears its endpoint down as soon as it sees the notification must
                    // not take the initiator's answer with it (the initiator's write would
                    // fail with `PeerClosed` although every byte landed).
                    answers.queue(rma, &Message::WriteAck { op_id, refusal });
                    if refusal.is_none() {
                        if let Some(bytes) = notification {
                            answers.hold(rma, bytes);
                        }
                    }
                }
                // The connection failed (the engines failed the job with its error) or the
                // job is stuck past its deadline: either way no answer is owed.
                Err(e) => {
                    rma.link.fail(e);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn lens() -> impl Strategy<Value = Vec<u64>> {
        proptest::collection::vec(1u64..5000, 1..20)
    }

    proptest! {
        /// The invariant refusals rely on: discarding keeps every chunk's channel and length,
        /// so the initiator's sends and the target's discard receives pair one to one.
        #[test]
        fn discarding_keeps_the_chunks_of_the_accepted_schedule(
            own in lens(),
            cuts in proptest::collection::vec(any::<u64>(), 0..20),
            chunk in 1u32..3000,
            channels in 1u16..6,
            op_id in any::<u64>(),
        ) {
            // The peer cuts the same total elsewhere.
            let total: u64 = own.iter().sum();
            let mut points: Vec<u64> = cuts.iter().map(|c| c % total).filter(|&p| p > 0).collect();
            points.push(total);
            points.sort_unstable();
            points.dedup();
            let mut peer = Vec::new();
            let mut at = 0;
            for p in points {
                peer.push(p - at);
                at = p;
            }
            let accepted = Schedule::vectored(&own, &peer, chunk, channels).unwrap().rotated(op_id);
            let initiator = Schedule::vectored(&peer, &own, chunk, channels).unwrap().rotated(op_id);
            let (discard_lens, discard) = discard_schedule(&accepted, &peer, op_id).unwrap();
            prop_assert!(discard_lens.iter().all(|&l| l <= u64::from(chunk)));
            let shape = |s: &Schedule| s.iter().map(|c| (c.index, c.channel, c.offset, c.len)).collect::<Vec<_>>();
            prop_assert_eq!(shape(&discard), shape(&accepted));
            prop_assert_eq!(shape(&initiator), shape(&accepted));
            // Every discard chunk is one whole piece: it lands at offset 0 of the scratch.
            prop_assert!(discard.iter().all(|c| c.segment_offset == 0));
        }
    }
}
