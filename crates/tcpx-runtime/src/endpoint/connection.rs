//! [`Connection`]: N channels each way to one peer, the transfers on them, and their close.
//!
//! Matching rule: the k-th send on one side pairs with the k-th receive on the other, per
//! direction, in submission order (the plugin matches requests in posting order, and every
//! engine posts a connection's transfers in that order). A contiguous transfer must have the
//! same length on both sides; a vectored one may cut its bytes differently on each side
//! (both sides exchange their segment lists and derive the same schedule), but both sides
//! must use the vectored form and describe the same total.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::setup::Established;
use super::watch;
use super::EndpointShared;
use crate::control::{ControlConn, EndpointInfo, Message};
use crate::engine::job::{staging_of, Job, Piece};
use crate::engine::stats::ChannelStats;
use crate::engine::{Command, NewChannel, Signal};
use crate::error::{Direction, Error, Result};
use crate::link::{segments_id, Link};
use crate::onesided::state::Rma;
use crate::onesided::target::spawn_acker;
use crate::onesided::RemoteSegment;
use crate::registry::{CountedRegion, Region, Registration};
use crate::schedule::Schedule;
use crate::transfer::Transfer;

/// Peer segment lists held while their local transfer has not been submitted yet; a peer
/// running further ahead than this is treated as hostile.
const MAX_EARLY_SEGMENT_LISTS: usize = 4096;

/// One piece of a vectored transfer: `len` bytes at `offset` in `region`.
#[derive(Debug, Clone, Copy)]
pub struct Segment<'a> {
    /// The registered memory.
    pub region: &'a Region,
    /// Offset in the region.
    pub offset: usize,
    /// Bytes.
    pub len: usize,
}

impl<'a> Segment<'a> {
    /// `len` bytes at `offset` in `region`.
    pub fn new(region: &'a Region, offset: usize, len: usize) -> Self {
        Self {
            region,
            offset,
            len,
        }
    }
}

/// A connection to one peer: `channels` send comms and as many receive comms, driven by the
/// endpoint's engines.
///
/// Dropping it closes it: pending transfers fail with [`Error::Closed`], the peer is told
/// (`Close`), the engines release the comms, and every registration made for it is released.
/// [`Connection::close`] first waits for pending transfers to finish.
pub struct Connection {
    link: Arc<Link>,
    shared: Arc<EndpointShared>,
    writer: Arc<Mutex<ControlConn>>,
    watcher: Option<JoinHandle<()>>,
    stop: Arc<AtomicBool>,
    /// Next sequence number per direction; held while a transfer is numbered and handed to
    /// the engines, so every engine sees the direction's transfers in one order.
    send_order: Mutex<u64>,
    recv_order: Mutex<u64>,
    peer_info: EndpointInfo,
    /// The one-sided half: its own link over the RMA channels (see [`crate::onesided`]).
    rma: Arc<Rma>,
    /// Acknowledges served writes and delivers notifications, in control-stream order.
    acker: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("link", &self.link)
            .field("peer_info", &self.peer_info)
            .finish()
    }
}

impl Connection {
    /// Hands the set-up comms to the engines and starts watching the control stream.
    pub(crate) fn start(
        shared: Arc<EndpointShared>,
        ctl: ControlConn,
        established: Established,
    ) -> Result<Self> {
        let config = &shared.config;
        let peer = ctl.peer_addr();
        let channels = config.channels;
        let used_slots = usize::from(channels).min(shared.engines.len());
        let engines = shared.engines[..used_slots]
            .iter()
            .map(|e| e.sender().clone())
            .collect();
        let link = Arc::new(Link::new(peer, channels, config.timeout, engines));
        let rma_engines = link.engines().to_vec();
        let rma_link = Arc::new(Link::new(peer, channels, config.timeout, rma_engines));
        Link::pair(&link, &rma_link);
        let reader = ctl.try_clone()?;
        let writer = Arc::new(Mutex::new(ctl));
        let stop = Arc::new(AtomicBool::new(false));
        let rma = Arc::new(Rma::new(
            rma_link.clone(),
            link.clone(),
            shared.clone(),
            writer.clone(),
        ));

        let mut conn = Self {
            link: link.clone(),
            shared: shared.clone(),
            writer,
            watcher: None,
            stop: stop.clone(),
            send_order: Mutex::new(0),
            recv_order: Mutex::new(0),
            peer_info: established.peer_info,
            rma: rma.clone(),
            acker: None,
        };
        // From here on, dropping `conn` on error releases whatever was handed out.
        let (reply_tx, reply_rx) = crossbeam_channel::bounded(2 * usize::from(channels));
        for (index, (send, recv)) in established
            .sends
            .into_iter()
            .zip(established.recvs)
            .enumerate()
        {
            // `index` < 2 · channels, a u16: channels N.. belong to the RMA link.
            let (link, index) = match (index as u16).checked_sub(channels) {
                None => (link.clone(), index as u16),
                Some(rma_index) => (rma_link.clone(), rma_index),
            };
            let engine = shared.engines[shared.engine_of(index)].sender();
            let channel = Box::new(NewChannel {
                link,
                index,
                send,
                recv,
            });
            engine
                .send(Command::AddChannel(channel, reply_tx.clone()))
                .map_err(|_| Error::Internal("an engine thread has stopped".into()))?;
        }
        let deadline = Instant::now() + config.timeout;
        for _ in 0..2 * channels {
            let left = deadline.saturating_duration_since(Instant::now());
            reply_rx.recv_timeout(left).map_err(|_| {
                Error::Internal("an engine did not take its channel in time".into())
            })??;
        }
        let (acker_tx, acker_rx) = crossbeam_channel::unbounded();
        conn.acker = Some(spawn_acker(rma.clone(), acker_rx)?);
        conn.watcher = Some(watch::spawn(
            link,
            reader,
            stop,
            config.chunk_bytes,
            rma,
            acker_tx,
        )?);
        Ok(conn)
    }

    /// The peer's control address.
    pub fn peer(&self) -> SocketAddr {
        self.link.peer
    }

    /// What the peer said about itself in `Hello`.
    pub fn peer_info(&self) -> &EndpointInfo {
        &self.peer_info
    }

    /// The GPU index the peer announced in its `Hello` (its
    /// [`Config::gpu_index`](crate::Config)), if any.
    pub fn peer_gpu(&self) -> Option<u32> {
        self.peer_info.gpu_index
    }

    /// Channels each way.
    pub fn channels(&self) -> u16 {
        self.link.channels
    }

    /// Counters per channel.
    pub fn stats(&self) -> Vec<ChannelStats> {
        self.link.counters.iter().map(|c| c.snapshot()).collect()
    }

    /// Counters per one-sided (RMA) channel.
    pub fn one_sided_stats(&self) -> Vec<ChannelStats> {
        self.rma
            .link
            .counters
            .iter()
            .map(|c| c.snapshot())
            .collect()
    }

    /// Packing counters of the one-sided half: batches of small blocks moved through pack
    /// buffers, and fallbacks (see [`crate::onesided`]).
    pub fn pack_stats(&self) -> crate::onesided::PackStats {
        self.rma.pack.stats()
    }

    /// The error that failed the connection, if it failed.
    pub fn error(&self) -> Option<Error> {
        self.link.failure().cloned()
    }

    /// Transfers submitted and not finished: two-sided ones, one-sided operations this side
    /// initiated, and the data jobs of operations it serves for the peer.
    pub fn in_flight(&self) -> usize {
        self.link.in_flight.load(Ordering::Acquire)
            + self.rma.link.in_flight.load(Ordering::Acquire)
            + self.rma.pending_count()
    }

    /// Writes the bytes of `local` into the peer's advertised memory `remote` (one-sided:
    /// the peer application makes no call). Both lists describe the same total; entries
    /// contiguous in one region are merged into large chunks on the wire, and the whole
    /// batch travels as one control message (at most about 26 000 entries).
    ///
    /// The transfer completes once the peer acknowledged that every byte landed — or fails
    /// with [`Error::Access`] naming the first bad remote entry (unknown or revoked region,
    /// wrong key, out of bounds), in which case nothing was written. `notification`, if
    /// given (at most 64 KiB), reaches the peer's [`crate::Endpoint::notifications`] only
    /// after the data has landed (and never for a refused write). Operations of one
    /// connection are served in issue order on the target: a later read sees the data of
    /// every earlier write.
    ///
    /// Dropping the returned [`Transfer`] does not cancel the write: its data still goes out
    /// (the peer's receives are already ordered behind it), so both sides stay in step.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tcpx_runtime::{Backend, Config, Endpoint, RemoteSegment, Segment};
    /// # std::env::set_var("TCPX_SOCKET_IFNAME", "lo"); // keep doc-test traffic on loopback
    /// # let config = Config::builder().backend(Backend::Builtin)
    /// #     .control_addr("127.0.0.1:0".parse().unwrap()).channels(2).build()?;
    /// # let target = Endpoint::new(config.clone())?;
    /// # let initiator = Endpoint::new(config)?;
    /// # let meta = target.metadata().clone();
    /// # let served = std::thread::spawn(move || target.accept().map(|c| (target, c)));
    /// # let conn = initiator.connect(&meta)?;
    /// # let (target, _peer) = served.join().unwrap()?;
    /// // Target: advertise a region and hand the descriptor's bytes to the initiator.
    /// let kv = target.alloc_host(1 << 20)?;
    /// let descriptor = target.advertise(&kv)?.to_bytes();
    ///
    /// // Initiator: write two 16 KiB blocks into it, with a notification.
    /// let remote = tcpx_runtime::Descriptor::from_bytes(&descriptor).unwrap();
    /// let blocks = initiator.alloc_host(32 << 10)?;
    /// let write = conn.write(
    ///     &[Segment::new(&blocks, 0, 32 << 10)],
    ///     &[RemoteSegment::new(remote, 0, 16 << 10), RemoteSegment::new(remote, 64 << 10, 16 << 10)],
    ///     Some(b"layer 0 ready"),
    /// )?;
    /// assert_eq!(write.wait(Duration::from_secs(20))?, 32 << 10);
    /// # let start = std::time::Instant::now();
    /// # let mut got = Vec::new();
    /// # while got.is_empty() && start.elapsed() < Duration::from_secs(20) {
    /// #     got = target.notifications();
    /// # }
    /// # assert_eq!(got[0].1, b"layer 0 ready");
    /// # Ok::<(), tcpx_runtime::Error>(())
    /// ```
    pub fn write(
        &self,
        local: &[Segment<'_>],
        remote: &[RemoteSegment],
        notification: Option<&[u8]>,
    ) -> Result<Transfer> {
        self.rma.write(local, remote, notification)
    }

    /// Reads the peer's advertised memory `remote` into `local` (one-sided; same list rules
    /// as [`Connection::write`]). Completes once every byte arrived, or fails with
    /// [`Error::Access`] (nothing read). Dropping the [`Transfer`] does not cancel the read:
    /// its data still arrives into `local`.
    pub fn read(&self, local: &[Segment<'_>], remote: &[RemoteSegment]) -> Result<Transfer> {
        self.rma.read(local, remote)
    }

    /// Sends a standalone notification (at most 64 KiB) to the peer's
    /// [`crate::Endpoint::notifications`], delivered after every notification and every
    /// write this side issued before it.
    pub fn notify(&self, bytes: &[u8]) -> Result<()> {
        self.rma.notify(bytes)
    }

    /// Sends `len` bytes at `offset` in `region`; the peer posts a receive of the same length.
    pub fn send(&self, region: &Region, offset: usize, len: usize) -> Result<Transfer> {
        self.submit(Direction::Send, &[Segment::new(region, offset, len)], false)
    }

    /// Receives `len` bytes into `region` at `offset`; the peer sends the same length.
    pub fn recv(&self, region: &Region, offset: usize, len: usize) -> Result<Transfer> {
        self.submit(Direction::Recv, &[Segment::new(region, offset, len)], false)
    }

    /// Sends the concatenation of `segments` as one transfer; the peer receives it with
    /// [`Connection::recv_vectored`], cut however it likes.
    pub fn send_vectored(&self, segments: &[Segment<'_>]) -> Result<Transfer> {
        self.submit(Direction::Send, segments, true)
    }

    /// Receives one transfer into `segments`, in order; the peer sends it with
    /// [`Connection::send_vectored`].
    pub fn recv_vectored(&self, segments: &[Segment<'_>]) -> Result<Transfer> {
        self.submit(Direction::Recv, segments, true)
    }

    /// Registers `region` on this connection's comms now (both directions), instead of at
    /// its first transfer.
    /// A staged CUDA region needs nothing here: the plugin never sees it, only the engines'
    /// pinned rings, which are registered once per channel.
    pub fn register(&self, region: &Region) -> Result<()> {
        if region.is_staged() {
            return Ok(());
        }
        self.registration(region, Direction::Send)?;
        self.registration(region, Direction::Recv)?;
        Ok(())
    }

    /// Waits (up to the configured timeout) for pending transfers to finish, then closes.
    /// Returns an error if some were still pending (they then fail with [`Error::Closed`]).
    pub fn close(self) -> Result<()> {
        let deadline = Instant::now() + self.link.timeout;
        while self.in_flight() > 0 {
            if Instant::now() >= deadline {
                return Err(Error::WaitTimedOut(self.link.timeout));
            }
            std::thread::sleep(Duration::from_micros(500));
        }
        Ok(())
    }

    fn submit(
        &self,
        direction: Direction,
        segments: &[Segment<'_>],
        vectored: bool,
    ) -> Result<Transfer> {
        if let Some(e) = self.link.failure() {
            return Err(e.clone());
        }
        if segments.is_empty() {
            return Err(Error::InvalidArgument(
                "a vectored transfer needs at least one segment".into(),
            ));
        }
        for (i, s) in segments.iter().enumerate() {
            if s.offset
                .checked_add(s.len)
                .is_none_or(|end| end > s.region.len())
            {
                return Err(Error::InvalidArgument(format!(
                    "segment {i}: {} bytes at offset {} lie outside a region of {} bytes",
                    s.len,
                    s.offset,
                    s.region.len()
                )));
            }
        }
        let staging = staging_of(segments.iter().map(|s| s.region), direction)?;
        let pieces = segments
            .iter()
            .map(|s| {
                region_piece(
                    &self.link,
                    &self.shared,
                    s.region,
                    s.offset,
                    s.len as u64,
                    direction,
                    staging.is_some(),
                )
            })
            .collect::<Result<Vec<_>>>()?;

        let order = match direction {
            Direction::Send => &self.send_order,
            Direction::Recv => &self.recv_order,
        };
        let mut next = order.lock().unwrap_or_else(|p| p.into_inner());
        let seq = *next;
        let job = Arc::new(Job::new(
            direction,
            self.link.clone(),
            seq,
            pieces,
            staging,
            Instant::now(),
        ));
        let transfer = Transfer::new(job.completion.clone(), direction, job.len);
        self.link.in_flight.fetch_add(1, Ordering::AcqRel);
        *next += 1;
        if vectored {
            self.pair_segments(&job);
        } else {
            match Schedule::contiguous(job.len, self.shared.config.chunk_bytes, self.link.channels)
            {
                // Rotating by the sequence number spreads a stream of small transfers over
                // every channel; the peer rotates its matching transfer the same way.
                Ok(schedule) => job.set_schedule(schedule.rotated(seq)),
                Err(e) => job.fail(Error::InvalidArgument(e.to_string())),
            }
        }
        submit_job(&self.link, &job);
        drop(next);
        Ok(transfer)
    }

    /// Sends this side's segment list and pairs the job with the peer's (now, if it came
    /// first, or when the watcher receives it).
    fn pair_segments(&self, job: &Arc<Job>) {
        let key = (job.direction, job.seq);
        let early = {
            let mut book = self.link.segments.lock().unwrap_or_else(|p| p.into_inner());
            let early = book.arrived.remove(&key);
            if early.is_none() {
                book.waiting.insert(key, job.clone());
            }
            early
        };
        if let Some(remote) = early {
            apply_segments(job, &remote, self.shared.config.chunk_bytes);
        }
        let message = Message::Segments {
            transfer_id: segments_id(job.direction, job.seq),
            lens: job.local_lens(),
        };
        let sent = self
            .writer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(&message);
        if let Err(e) = sent {
            self.link.fail(e.into());
            job.fail_with_link();
        }
    }

    /// The registration of `region` on this connection in `direction`, made on first use.
    fn registration(&self, region: &Region, direction: Direction) -> Result<Arc<Registration>> {
        register_region(&self.link, &self.shared, region, direction)
    }
}

/// `len` bytes at `offset` in `region` as a piece of a job on `link` in `direction`:
/// registered on the link's comms, unless the transfer is `staged` (the plugin then only sees
/// the engines' rings, so a staged region is never registered).
pub(crate) fn region_piece(
    link: &Arc<Link>,
    shared: &EndpointShared,
    region: &Region,
    offset: usize,
    len: u64,
    direction: Direction,
    staged: bool,
) -> Result<Piece> {
    let registration = if staged {
        None
    } else {
        Some(register_region(link, shared, region, direction)?)
    };
    Ok(Piece {
        registration,
        memory: region.memory().clone(),
        offset,
        len,
        cuda: region.cuda_device().cloned(),
    })
}

/// The registration of `region` on `link`'s comms in `direction`, made on first use and
/// cached on the link.
pub(crate) fn register_region(
    link: &Arc<Link>,
    shared: &EndpointShared,
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
    let key = (region.inner.id, direction);
    let cached = link
        .registrations
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&key)
        .cloned();
    if let Some(registration) = cached {
        return Ok(registration);
    }

    let engines = link.engines();
    let (tx, rx) = crossbeam_channel::bounded(engines.len());
    for engine in engines {
        engine
            .send(Command::Register {
                link: link.id,
                direction,
                memory: region.memory().clone(),
                counter: shared.registrations.clone(),
                reply: tx.clone(),
            })
            .map_err(|_| Error::Internal("an engine thread has stopped".into()))?;
    }
    drop(tx);
    let mut by_channel: Vec<Option<CountedRegion>> = (0..link.channels).map(|_| None).collect();
    let deadline = Instant::now() + link.timeout;
    for _ in engines {
        let left = deadline.saturating_duration_since(Instant::now());
        let reply = rx.recv_timeout(left).map_err(|_| {
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
    let registration = link
        .registrations
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry(key)
        .or_insert_with(|| Arc::new(Registration { by_channel }))
        .clone();
    region.note_link(link);
    Ok(registration)
}

/// Hands `job` to the engines of `link` that own a channel with chunks of it (every engine
/// of the link while its schedule is unknown). Contiguous transfers thus go only to the
/// engines they touch (a 1 MiB transfer on 8 channels of 512 KiB chunks touches 2).
pub(crate) fn submit_job(link: &Link, job: &Arc<Job>) {
    if job.is_finished() {
        return;
    }
    let engines = link.engines();
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

/// Builds a vectored job's schedule from both segment lists and publishes it; a mismatch
/// fails the connection (both applications disagree on what this transfer is).
pub(crate) fn apply_segments(job: &Arc<Job>, remote: &[u64], chunk_bytes: u32) {
    let link = &job.link;
    match Schedule::vectored(&job.local_lens(), remote, chunk_bytes, link.channels) {
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

/// Records a peer segment list that arrived before its local transfer; `false` when the
/// peer is too far ahead.
pub(crate) fn hold_early_segments(link: &Link, key: (Direction, u64), lens: Vec<u64>) -> bool {
    let mut book = link.segments.lock().unwrap_or_else(|p| p.into_inner());
    if book.arrived.len() >= MAX_EARLY_SEGMENT_LISTS {
        return false;
    }
    book.arrived.insert(key, lens);
    true
}

impl Drop for Connection {
    fn drop(&mut self) {
        let peer = self.link.peer;
        self.link.fail(Error::Closed { peer });
        {
            let mut writer = self.writer.lock().unwrap_or_else(|p| p.into_inner());
            let _ = writer.close("connection closed by the application");
            writer.shutdown();
        }
        self.stop.store(true, Ordering::Release);
        if let Some(watcher) = self.watcher.take() {
            if watcher.join().is_err() {
                tracing::error!(target: "tcpx_runtime", %peer, "control watcher panicked");
            }
        }
        // The watcher is gone, and with it the acknowledger's queue: it ends once the
        // failed link's jobs are abandoned.
        if let Some(acker) = self.acker.take() {
            if acker.join().is_err() {
                tracing::error!(target: "tcpx_runtime", %peer, "acknowledger panicked");
            }
        }
        self.rma.close(Error::Closed { peer });
        let engines = self.link.engines();
        let (tx, rx) = crossbeam_channel::bounded(2 * engines.len());
        let mut asked = 0;
        for engine in engines {
            for link in [self.link.id, self.rma.link.id] {
                if engine
                    .send(Command::Remove {
                        link,
                        reply: tx.clone(),
                    })
                    .is_ok()
                {
                    asked += 1;
                }
            }
        }
        let deadline = Instant::now() + self.link.timeout;
        for _ in 0..asked {
            let left = deadline.saturating_duration_since(Instant::now());
            if rx.recv_timeout(left).is_err() {
                tracing::error!(target: "tcpx_runtime", %peer, "an engine did not release the connection's channels in time");
                break;
            }
        }
        let registrations = std::mem::take(
            &mut *self
                .link
                .registrations
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        );
        drop(registrations);
        let rma_registrations = std::mem::take(
            &mut *self
                .rma
                .link
                .registrations
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        );
        drop(rma_registrations);
        let mut book = self.link.segments.lock().unwrap_or_else(|p| p.into_inner());
        for job in book.waiting.drain().map(|(_, job)| job) {
            job.fail_with_link();
        }
        book.arrived.clear();
        tracing::debug!(target: "tcpx_runtime", %peer, "connection closed");
    }
}
