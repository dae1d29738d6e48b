//! [`Carrier`]: how transfers of one link reach its engines — registering regions on the
//! link's comms, building a job's pieces, handing jobs to the engines that own their
//! channels, and pairing vectored transfers with the peer's segment lists.
//!
//! Two-sided connections ([`crate::endpoint`]) and one-sided operations ([`crate::onesided`])
//! both submit through a carrier, so this module sits below both of them and above the
//! engines: `link` → `engine` → `carrier` → `onesided` → `endpoint`.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};

use crate::engine::job::{HostParts, Job, Piece, Pieces};
use crate::engine::stage::Staging;
use crate::engine::{Command, RegisterReply};
use crate::error::{Direction, Error, Result};
use crate::link::{Link, Signal};
use crate::registry::{CountedRegion, Region, Registration, RegistrationCounter};
use crate::schedule::Schedule;
use crate::transfer::Completion;

/// Peer segment lists held while their local transfer has not been submitted yet; a peer
/// running further ahead than this is treated as hostile.
const MAX_EARLY_SEGMENT_LISTS: usize = 4096;

/// What [`Carrier::new_job`] builds a job from.
pub(crate) struct JobSpec {
    /// Send or receive.
    pub(crate) direction: Direction,
    /// The transfer's sequence number (two-sided) or operation id (one-sided).
    pub(crate) seq: u64,
    /// The local pieces, in order.
    pub(crate) pieces: Pieces,
    /// Set when the pieces are staged regions (the lanes copy through their rings).
    pub(crate) staging: Option<Staging>,
    /// The chunk schedule when known now (a vectored two-sided transfer learns it from the
    /// peer's segment list).
    pub(crate) schedule: Option<Schedule>,
    /// Completion shared with an operation that already handed out its transfer.
    pub(crate) completion: Option<Arc<Completion>>,
    /// `schedule` is the packed one: a staged job's lanes gather or scatter the pieces each
    /// chunk covers.
    pub(crate) packed: bool,
}

/// The submission side of one link: its engines' queues and what is in transit to them.
pub(crate) struct Carrier {
    /// The link whose channels carry the jobs.
    pub(crate) link: Arc<Link>,
    /// The engines owning the link's channels: engine `k` owns channels `c` with
    /// `c % engines.len() == k`.
    engines: Vec<Sender<Command>>,
    /// The endpoint's count of live plugin registrations (leak checks).
    counter: RegistrationCounter,
    /// Vectored transfers waiting for the peer's segment list, or lists waiting for theirs.
    segments: Mutex<SegmentsBook>,
}

impl std::fmt::Debug for Carrier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Carrier")
            .field("link", &self.link)
            .field("engines", &self.engines.len())
            .finish()
    }
}

impl Carrier {
    pub(crate) fn new(
        link: Arc<Link>,
        engines: Vec<Sender<Command>>,
        counter: RegistrationCounter,
    ) -> Self {
        Self {
            link,
            engines,
            counter,
            segments: Mutex::new(SegmentsBook::default()),
        }
    }

    /// The engines owning the link's channels.
    pub(crate) fn engines(&self) -> &[Sender<Command>] {
        &self.engines
    }

    /// `len` bytes at `offset` in `region` as a piece of a job in `direction`: registered on
    /// the link's comms, unless the transfer is `staged` (the plugin then only sees the
    /// engines' rings, so a staged region is never registered).
    pub(crate) fn region_piece(
        &self,
        region: &Region,
        offset: usize,
        len: u64,
        direction: Direction,
        staged: bool,
    ) -> Result<Piece> {
        let registration = if staged {
            None
        } else {
            Some(self.register_region(region, direction)?)
        };
        Ok(Piece {
            registration,
            memory: region.memory().clone(),
            offset,
            len,
            cuda: region.cuda_device().cloned(),
        })
    }

    /// [`Self::region_piece`] for a list of `(region, offset, len)`: a piece in the same region
    /// as the one before it shares that piece's registration, memory and GPU instead of
    /// looking them up again: a scattered list of 1024 KV blocks in one region otherwise
    /// took the registration cache's lock and hashed its key 1024 times.
    pub(crate) fn region_pieces<'r>(
        &self,
        runs: impl IntoIterator<Item = (&'r Region, usize, u64)>,
        direction: Direction,
        staged: bool,
    ) -> Result<Pieces> {
        let runs = runs.into_iter();
        let mut pieces = Pieces::with_capacity(runs.size_hint().0);
        let mut last_region = None;
        for (region, offset, len) in runs {
            let piece = match pieces.last() {
                Some(prev) if last_region == Some(region.inner.id) => Piece {
                    registration: prev.registration.clone(),
                    memory: prev.memory.clone(),
                    offset,
                    len,
                    cuda: prev.cuda.clone(),
                },
                _ => self.region_piece(region, offset, len, direction, staged)?,
            };
            last_region = Some(region.inner.id);
            pieces.push(piece);
        }
        Ok(pieces)
    }

    /// The registration of `region` on the link's comms in `direction`, made on first use
    /// (by the engines, which drive the comms) and cached on the link.
    pub(crate) fn register_region(
        &self,
        region: &Region,
        direction: Direction,
    ) -> Result<Arc<Registration>> {
        if region.is_staged() {
            // The plugin cannot take this memory: only the engines' staged path moves it,
            // through their pinned rings (two-sided and one-sided callers check `is_staged`
            // and never come here with a staged region; this is the backstop).
            return Err(Error::Unsupported(
                "a staged CUDA region (CUDA memory on a host-only plugin) is never registered \
                 with the plugin: it moves through the engines' pinned rings"
                    .into(),
            ));
        }
        if let Some(registration) = self.link.registrations.get(region, direction) {
            return Ok(registration);
        }
        let replies = self.begin_registration(region, direction)?;
        self.finish_registration(region, direction, &replies)
    }

    /// Registers `regions` in both directions on the link's comms now, every engine's work for
    /// all of them asked for before any answer is awaited, so that the first one-sided
    /// operation naming them does not wait for it (issue 25: no first-transfer tax). Staged
    /// regions never register, and cached ones are skipped. Every registration is waited
    /// for; the first failure is returned (what did register stays cached).
    pub(crate) fn preregister(&self, regions: &[Region]) -> Result<()> {
        let mut pending = Vec::new();
        let mut failure = None;
        for region in regions.iter().filter(|r| !r.is_staged()) {
            for direction in [Direction::Send, Direction::Recv] {
                if self.link.registrations.get(region, direction).is_some() {
                    continue;
                }
                match self.begin_registration(region, direction) {
                    Ok(replies) => pending.push((region, direction, replies)),
                    Err(e) => {
                        failure.get_or_insert(e);
                    }
                }
            }
        }
        for (region, direction, replies) in pending {
            if let Err(e) = self.finish_registration(region, direction, &replies) {
                failure.get_or_insert(e);
            }
        }
        failure.map_or(Ok(()), Err)
    }

    /// Asks every engine to register `region` on its channels of the link; the answers
    /// come on the returned channel (one per engine).
    fn begin_registration(
        &self,
        region: &Region,
        direction: Direction,
    ) -> Result<Receiver<RegisterReply>> {
        let (tx, rx) = crossbeam_channel::bounded(self.engines.len());
        for engine in &self.engines {
            engine
                .send(Command::Register {
                    link: self.link.id,
                    direction,
                    memory: region.memory().clone(),
                    counter: self.counter.clone(),
                    reply: tx.clone(),
                })
                .map_err(|_| Error::Internal("an engine thread has stopped".into()))?;
        }
        Ok(rx)
    }

    /// Collects the engines' answers to [`Self::begin_registration`] (up to the link's
    /// timeout) and caches the registration on the link.
    fn finish_registration(
        &self,
        region: &Region,
        direction: Direction,
        replies: &Receiver<RegisterReply>,
    ) -> Result<Arc<Registration>> {
        let link = &self.link;
        let mut by_channel: Vec<Option<CountedRegion>> = (0..link.channels).map(|_| None).collect();
        let deadline = Instant::now() + link.timeout;
        for _ in &self.engines {
            let left = deadline.saturating_duration_since(Instant::now());
            let reply = replies.recv_timeout(left).map_err(|_| {
                Error::Internal("an engine did not answer a registration in time".into())
            })?;
            for (channel, result) in reply {
                let region = result.map_err(|source| Error::Plugin {
                    channel,
                    direction,
                    peer: link.peer,
                    source: Arc::new(source),
                })?;
                if let Some(slot) = by_channel.get_mut(usize::from(channel)) {
                    *slot = Some(region);
                }
            }
        }
        let by_channel = by_channel
            .into_iter()
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                // The link failed or closed while registering: its channels are gone.
                link.failure()
                    .cloned()
                    .unwrap_or_else(|| Error::Internal("a channel was not registered".into()))
            })?;
        Ok(link
            .registrations
            .insert(region, direction, Registration { by_channel }))
    }

    /// Makes the staging rings of every lane of the link for `staging` (slots of
    /// `slot_bytes`: the link's chunk size) now, where a lane has none, so that the first
    /// staged transfers find them ready (the engines make them: they drive the comms the rings
    /// are registered on). Returns how many rings were made; waits at most the link's
    /// timeout.
    pub(crate) fn prepare_staging(&self, staging: &Staging, slot_bytes: usize) -> Result<u16> {
        let link = &self.link;
        let (tx, rx) = crossbeam_channel::bounded(self.engines.len());
        for engine in &self.engines {
            engine
                .send(Command::Prepare {
                    link: link.id,
                    staging: staging.clone(),
                    slot_bytes,
                    reply: tx.clone(),
                })
                .map_err(|_| Error::Internal("an engine thread has stopped".into()))?;
        }
        drop(tx);
        let deadline = Instant::now() + link.timeout;
        let mut made = 0u16;
        for _ in &self.engines {
            let left = deadline.saturating_duration_since(Instant::now());
            let reply = rx.recv_timeout(left).map_err(|_| {
                Error::Internal("an engine did not make its staging rings in time".into())
            })?;
            for (channel, result) in reply {
                made += result.map_err(|source| Error::Staging {
                    channel,
                    direction: Direction::Send,
                    peer: link.peer,
                    source: Arc::new(source),
                })?;
            }
        }
        Ok(made)
    }

    /// Builds a job of this link from `spec` and counts it in the link's in-flight
    /// transfers: every job (two-sided transfers, one-sided initiators and targets) is made
    /// here and handed to the engines by [`submit_job`](Self::submit_job).
    pub(crate) fn new_job(&self, spec: JobSpec) -> Arc<Job> {
        self.make_job(spec, None)
    }

    /// [`Self::new_job`] for a batch of scattered host memory whose one piece is a pack
    /// buffer: the engines copy each chunk's share of `parts` into it (send) or out of it
    /// (receive) (see [`crate::engine::job::HostParts`]).
    pub(crate) fn new_packed_host_job(&self, spec: JobSpec, parts: HostParts) -> Arc<Job> {
        self.make_job(spec, Some(parts))
    }

    fn make_job(&self, spec: JobSpec, host_parts: Option<HostParts>) -> Arc<Job> {
        let staged = spec.staging.is_some();
        let mut job = Job::new(
            spec.direction,
            self.link.clone(),
            spec.seq,
            spec.pieces,
            spec.staging,
            Instant::now(),
        );
        if spec.packed && staged {
            job.set_packed();
        }
        if let Some(completion) = spec.completion {
            job.completion = completion;
        }
        job.host_parts = host_parts.map(Box::new);
        self.link.in_flight.fetch_add(1, Ordering::AcqRel);
        let job = Arc::new(job);
        if let Some(schedule) = spec.schedule {
            job.set_schedule(schedule);
        }
        job
    }

    /// Hands `job` to the engines that own a channel with chunks of it (every engine of the
    /// link while its schedule is unknown). Contiguous transfers thus go only to the engines
    /// they touch (a 1 MiB transfer on 8 channels of 512 KiB chunks touches 2).
    pub(crate) fn submit_job(&self, job: &Arc<Job>) {
        if job.is_finished() {
            return;
        }
        let link = &self.link;
        let engines = &self.engines;
        let wanted = |k: usize| match job.schedule() {
            Some(schedule) => (0..link.channels)
                .any(|c| usize::from(c) % engines.len() == k && schedule.chunk_count_on(c) > 0),
            None => true,
        };
        for (k, engine) in engines.iter().enumerate() {
            if !wanted(k) {
                continue;
            }
            if engine.send(Command::Submit(job.clone())).is_err() {
                link.fail(Error::Internal("an engine thread has stopped".into()));
                job.fail_with_link();
                break;
            }
        }
    }

    fn segments(&self) -> MutexGuard<'_, SegmentsBook> {
        self.segments.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Pairs a local vectored `job` with the peer's segment list: returns the list if it
    /// arrived first, else parks the job until [`Carrier::on_peer_segments`] brings it.
    pub(crate) fn await_peer_segments(&self, job: &Arc<Job>) -> Option<Vec<u64>> {
        let key = (job.direction, job.seq);
        let mut book = self.segments();
        let early = book.arrived.remove(&key);
        if early.is_none() {
            book.waiting.insert(key, job.clone());
        }
        early
    }

    /// A peer segment list (`Segments.transfer_id`, `lens`) arrived: completes the schedule of
    /// its waiting local transfer, or holds the list until that transfer is submitted.
    /// Fails the link, and returns `false`, when the peer runs too far ahead of this side's
    /// transfers.
    #[must_use]
    pub(crate) fn on_peer_segments(&self, transfer_id: u64, lens: Vec<u64>) -> bool {
        let key = local_key_of_peer_segments(transfer_id);
        let waiting = {
            let mut book = self.segments();
            match book.waiting.remove(&key) {
                Some(job) => Some(job),
                None if book.arrived.len() >= MAX_EARLY_SEGMENT_LISTS => {
                    drop(book);
                    self.link.fail(Error::Violation {
                        peer: self.link.peer,
                        what: "too many segment lists ahead of this side's transfers".into(),
                    });
                    return false;
                }
                None => {
                    book.arrived.insert(key, lens);
                    return true;
                }
            }
        };
        if let Some(job) = waiting {
            apply_segments(&job, &lens);
        }
        true
    }

    /// Fails every vectored transfer still waiting for the peer's list and forgets early
    /// lists (the connection closed).
    pub(crate) fn abandon_segments(&self) {
        let mut book = self.segments();
        for job in book.waiting.drain().map(|(_, job)| job) {
            job.fail_with_link();
        }
        book.arrived.clear();
    }
}

/// Builds a vectored job's schedule from both segment lists and publishes it; a mismatch
/// fails the connection (both applications disagree on what this transfer is).
pub(crate) fn apply_segments(job: &Arc<Job>, remote: &[u64]) {
    let link = &job.link;
    // Cut as a contiguous two-sided transfer of the same total is (spread on connections
    // that agreed to), and at both sides' segment boundaries besides.
    match link.two_sided_schedule(&job.local_lens(), remote) {
        Ok(schedule) => {
            job.set_schedule(schedule.rotated(job.seq));
            link.wake_engines(Signal::Wake);
        }
        Err(e) => {
            link.fail(Error::Incompatible {
                peer: link.peer,
                what: format!("vectored {}: {e}", job.describe()),
            });
            job.fail_with_link();
        }
    }
}

/// Pairs vectored transfers with the peer's segment lists (`Segments` messages), which may
/// arrive before or after the local submission.
#[derive(Default)]
struct SegmentsBook {
    /// Local vectored transfers still waiting for the peer's list, by (direction, sequence).
    waiting: HashMap<(Direction, u64), Arc<Job>>,
    /// Peer lists that arrived before the local submission.
    arrived: HashMap<(Direction, u64), Vec<u64>>,
}

/// `Segments.transfer_id` on the wire: the sequence number of the transfer in its direction,
/// shifted left once, with the low bit saying which side sent the list (0: the data sender,
/// 1: the data receiver). Both directions share one control connection, so the bit keeps
/// send #k and receive #k of the *other* direction apart.
pub(crate) fn segments_id(direction: Direction, seq: u64) -> u64 {
    (seq << 1)
        | match direction {
            Direction::Send => 0,
            Direction::Recv => 1,
        }
}

/// The local (direction, sequence) a peer's `Segments.transfer_id` refers to: the peer's
/// send #k pairs with our receive #k and vice versa.
fn local_key_of_peer_segments(transfer_id: u64) -> (Direction, u64) {
    let local = if transfer_id & 1 == 0 {
        Direction::Recv
    } else {
        Direction::Send
    };
    (local, transfer_id >> 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_segments_map_to_the_opposite_direction() {
        for seq in [0, 1, 7, u64::MAX >> 1] {
            assert_eq!(
                local_key_of_peer_segments(segments_id(Direction::Send, seq)),
                (Direction::Recv, seq)
            );
            assert_eq!(
                local_key_of_peer_segments(segments_id(Direction::Recv, seq)),
                (Direction::Send, seq)
            );
        }
    }
}
