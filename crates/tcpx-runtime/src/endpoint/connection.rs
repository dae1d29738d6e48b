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
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use super::batch::{self, BatchContext};
use super::setup::Established;
use super::shared::EndpointShared;
use super::watch;
use crate::carrier::{segments_id, Carrier, JobSpec};
use crate::control::{ControlConn, ControlTx, EndpointInfo, Message};
use crate::eager::Eager;
use crate::engine::eager::NewEagerChannel;
use crate::engine::job::{staging_of, Job};
use crate::engine::stage::Staging;
use crate::engine::{Command, NewChannel};
use crate::error::{Direction, Error, Result};
use crate::link::{Link, Spread, Wake};
use crate::onesided::pack::PackPool;
use crate::onesided::state::Rma;
use crate::onesided::RemoteSegment;
pub use crate::registry::Segment;
use crate::registry::{Region, Registration};
use crate::spin_lock::SpinLock;
use crate::stats::ChannelStats;
use crate::transfer::Transfer;
use crate::wakeup::Wakeup;

/// A connection to one peer: `channels` send comms and as many receive comms, driven by the
/// endpoint's engines.
///
/// Dropping it closes it: pending transfers fail with [`Error::Closed`], the peer is told
/// (`Close`), the engines release the comms, and every registration made for it is released.
/// [`Connection::close`] first waits for pending transfers to finish.
pub struct Connection {
    link: Arc<Link>,
    /// How two-sided jobs reach the engines of `link`.
    carrier: Arc<Carrier>,
    shared: Arc<EndpointShared>,
    /// The control connection's sending half, shared with the one-sided half.
    writer: Arc<ControlTx>,
    /// The control loop: reads the control stream, answers one-sided operations and writes
    /// what `writer`'s users queue (see `watch`).
    watcher: Option<JoinHandle<()>>,
    stop: Arc<AtomicBool>,
    /// Next sequence number per direction; held while a transfer is numbered and handed to
    /// the engines, so every engine sees the direction's transfers in one order.
    send_order: SpinLock<u64>,
    recv_order: SpinLock<u64>,
    peer_info: EndpointInfo,
    /// The one-sided half: its own link over the RMA channels (see [`crate::onesided`]).
    rma: Arc<Rma>,
    /// Pack buffers of two-sided batches ([`Connection::send_batch`]).
    batch_pack: PackPool,
    /// Small two-sided messages in eager frames, when both sides offer them.
    eager: Option<Arc<Eager>>,
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
        // The count both sides agreed on in the handshake (the smaller of their own).
        let channels = established.channels;
        let driving = match ctl.local_addr() {
            Ok(local) => shared.engines_for(local, peer),
            Err(_) => shared.engines.len(),
        };
        let used_slots = usize::from(channels).min(driving);
        let engines: Vec<Sender<Command>> = shared.engines[..used_slots]
            .iter()
            .map(|e| e.sender().clone())
            .collect();
        let wakers = || {
            shared.engines[..used_slots]
                .iter()
                .map(|e| Box::new(e.waker()) as Box<dyn Wake>)
                .collect()
        };
        // Spread a lone small transfer over as many channels as both sides' engines drive.
        // From what both sides announced (their engines, `Config::spread` and channels), not
        // from `used_slots`: both must cut a spread transfer alike, and only one of them may
        // see the other as sharing its cores (see `engine_plan`).
        let spread = Spread {
            width: shared
                .info
                .spread
                .min(established.peer_info.spread)
                .min(channels)
                .max(1),
            // Both must cut every two-sided transfer alike.
            two_sided: shared.info.spread_two_sided && established.peer_info.spread_two_sided,
        };
        let link = Arc::new(Link::new(
            peer,
            channels,
            established.chunk_bytes,
            spread,
            config.timeout,
            wakers(),
            Some(shared.counters.clone()),
        ));
        let rma_link = Arc::new(Link::new(
            peer,
            channels,
            established.chunk_bytes,
            spread,
            config.timeout,
            wakers(),
            None,
        ));
        Link::pair(&link, &rma_link);
        shared.track(&link, &rma_link);
        let carrier = Arc::new(Carrier::new(
            link.clone(),
            engines.clone(),
            shared.registrations.clone(),
        ));
        let rma_carrier = Arc::new(Carrier::new(
            rma_link.clone(),
            engines,
            shared.registrations.clone(),
        ));
        // The reader keeps what the handshake read ahead: the peer may send its first
        // notification or request right behind its `Ready`, in the same segment.
        let (reader, writer) = ctl.split()?;
        let wakeup = Arc::new(Wakeup::new().map_err(|e| {
            Error::Internal(format!("cannot make the control loop's eventfd: {e}"))
        })?);
        let writer = Arc::new(ControlTx::new(writer, wakeup.clone()));
        let stop = Arc::new(AtomicBool::new(false));
        let rma = Arc::new(Rma::new(
            rma_carrier.clone(),
            link.clone(),
            shared.one_sided.clone(),
            config.clone(),
            writer.clone(),
            !shared.plugin_cuda,
        ));

        let eager = (established.eager_bytes > 0).then(|| {
            Arc::new(Eager::new(
                established.eager_bytes,
                config.eager_detach,
                // The built-in plugin, linked in or loaded as a library, reads ahead; both
                // ends run the same kind of plugin.
                shared.backend.name == tcpx::builtin::PLUGIN_NAME,
                link.clone(),
                config.wait_spin,
                channels,
            ))
        });
        if let Some(eager) = &eager {
            let eager: Arc<dyn crate::link::Pending> = eager.clone();
            link.count_pending(Arc::downgrade(&eager));
        }
        let mut conn = Self {
            link: link.clone(),
            carrier: carrier.clone(),
            shared: shared.clone(),
            writer,
            watcher: None,
            stop: stop.clone(),
            send_order: SpinLock::new(0),
            recv_order: SpinLock::new(0),
            peer_info: established.peer_info,
            rma: rma.clone(),
            batch_pack: PackPool::new(config.pack_buffers),
            eager: eager.clone(),
        };
        // From here on, dropping `conn` on error releases whatever was handed out.
        let pairs = established.sends.len();
        let (reply_tx, reply_rx) = crossbeam_channel::bounded(pairs);
        for (index, (send, recv)) in established
            .sends
            .into_iter()
            .zip(established.recvs)
            .enumerate()
        {
            // `index` < 3 · channels, a u16: channels N.. belong to the RMA link, 2N.. are
            // the eager ones.
            let set = index / usize::from(channels);
            let index = (index % usize::from(channels)) as u16;
            let engine = shared.engines[usize::from(index) % used_slots].sender();
            let command = match (set, &eager) {
                (0, _) | (1, _) => Command::AddChannel(
                    Box::new(NewChannel {
                        link: if set == 0 {
                            link.clone()
                        } else {
                            rma_link.clone()
                        },
                        index,
                        send,
                        recv,
                    }),
                    reply_tx.clone(),
                ),
                (_, Some(eager)) => Command::AddEager(
                    Box::new(NewEagerChannel {
                        eager: eager.clone(),
                        index,
                        send,
                        recv,
                        counter: shared.registrations.clone(),
                    }),
                    reply_tx.clone(),
                ),
                (_, None) => {
                    return Err(Error::Internal(
                        "eager comms set up without eager frames agreed".into(),
                    ))
                }
            };
            engine
                .send(command)
                .map_err(|_| Error::Internal("an engine thread has stopped".into()))?;
        }
        let deadline = Instant::now() + config.timeout;
        for _ in 0..pairs {
            let left = deadline.saturating_duration_since(Instant::now());
            reply_rx.recv_timeout(left).map_err(|_| {
                Error::Internal("an engine did not take its channel in time".into())
            })??;
        }
        // CUDA memory already registered on this endpoint will be staged: make every lane's
        // ring now rather than on its first transfer (issue 25: no first-transfer tax).
        if let Some(staging) = shared.staging() {
            if let Err(e) = conn.prepare_staging(&staging) {
                tracing::warn!(target: "tcpx_runtime", %peer, error = %e, "staging rings not made at connect; lanes make them at their first staged transfer");
            }
        }
        // Advertised regions are registered on the new one-sided link now (and regions
        // advertised later as they come), not by the first operation that names them.
        shared
            .one_sided
            .adopt(&rma_carrier, || rma.ready_pack_buffer());
        conn.watcher = Some(watch::spawn(carrier, reader, stop, rma, wakeup)?);
        Ok(conn)
    }

    /// The peer's control address.
    pub fn peer(&self) -> SocketAddr {
        self.link.peer
    }

    /// This side's address of the control connection: the address the peer sees as
    /// [`peer`](Self::peer) on its side (how a group rendezvous tells the acceptor who
    /// connected).
    pub fn local_control_addr(&self) -> Result<SocketAddr> {
        Ok(self.writer.local_addr()?)
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

    /// The largest chunk of this connection's transfers (one plugin request carries at most
    /// this): the smaller of both sides' configured sizes.
    pub fn chunk_bytes(&self) -> u32 {
        self.link.chunk_bytes
    }

    /// Counters per channel.
    pub fn stats(&self) -> Vec<ChannelStats> {
        self.link.counters.iter().map(|c| c.snapshot()).collect()
    }

    /// Bytes of this connection's one-sided operations that travelled inline, in control
    /// messages, not on the one-sided channels ([`crate::Config::inline_bytes`]).
    pub fn inline_stats(&self) -> crate::InlineStats {
        self.rma.link.inline.snapshot()
    }

    /// Counters per one-sided (RMA) channel (operations carried inline are in
    /// [`Connection::inline_stats`]).
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

    /// The error that failed the connection, if it failed. A peer that closed its end is not
    /// (yet) a failure: receives of what it sent before its goodbye may still complete, while
    /// new sends, one-sided operations and notifications are refused with
    /// [`Error::PeerClosed`].
    pub fn error(&self) -> Option<Error> {
        self.link.failure().cloned()
    }

    /// Transfers submitted and not finished: two-sided ones, one-sided operations this side
    /// initiated, and the data jobs of operations it serves for the peer.
    pub fn in_flight(&self) -> usize {
        self.link.in_flight_total()
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
    /// A write of host memory into host memory of at most [`crate::Config::inline_bytes`]
    /// in all (8 KiB by default) is copied out of `local` during this call and travels in
    /// its request; `local` may be reused as soon as the call returns.
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
    /// [`Error::Access`] (nothing read). A read of host memory into host memory of at most
    /// [`crate::Config::inline_bytes`] in all comes back in a control message. Dropping the [`Transfer`] does not cancel the read:
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
    ///
    /// A message of at most the connection's eager size ([`Connection::eager_bytes`]) is
    /// copied into an eager frame with whatever other small messages are queued, and sent
    /// with them as one plugin request (see [`crate::Config::eager_bytes`]). Its transfer
    /// finishes when its bytes are copied into the frame, usually before the frame is on the
    /// wire (as a socket `send` returns once the kernel has the bytes); do not change them
    /// before then.
    pub fn send(&self, region: &Region, offset: usize, len: usize) -> Result<Transfer> {
        if let Some(eager) = self.eager.as_ref().filter(|e| e.carries(len)) {
            if let Some(e) = self.link.refusal() {
                return Err(e);
            }
            Segment::new(region, offset, len).check_inside("segment 0")?;
            let mut next = self.send_order.lock();
            let transfer = eager.send(*next, region, offset, len);
            *next += 1;
            return Ok(transfer);
        }
        self.submit(Direction::Send, &[Segment::new(region, offset, len)], false)
    }

    /// Receives `len` bytes into `region` at `offset`; the peer sends the same length.
    /// Messages of at most [`Connection::eager_bytes`] arrive in eager frames and are copied
    /// out of them (see [`Connection::send`]).
    pub fn recv(&self, region: &Region, offset: usize, len: usize) -> Result<Transfer> {
        if let Some(eager) = self.eager.as_ref().filter(|e| e.carries(len)) {
            if let Some(e) = self.link.failure().cloned() {
                return Err(e);
            }
            Segment::new(region, offset, len).check_inside("segment 0")?;
            let mut next = self.recv_order.lock();
            let transfer = eager.recv(*next, region, offset, len);
            *next += 1;
            return Ok(transfer);
        }
        self.submit(Direction::Recv, &[Segment::new(region, offset, len)], false)
    }

    /// Engine threads driving this connection's channels: one per channel up to the
    /// endpoint's engines, and half the cores' worth when the automatic engine count applies
    /// and the peer competes for this process's cores (a local run; see
    /// [`crate::Config::engines_per_device`]).
    pub fn engine_count(&self) -> usize {
        self.carrier.engines().len()
    }

    /// Largest message [`Connection::send`] and [`Connection::recv`] carry in eager frames on
    /// this connection (the smaller of both sides' [`crate::Config::eager_bytes`]); 0: none.
    pub fn eager_bytes(&self) -> u32 {
        self.eager.as_ref().map_or(0, |e| e.max_message)
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

    /// Sends many messages in one submission: the segments travel as one batch, in order,
    /// into the peer's [`Connection::recv_batch`] of the same total (1 byte to
    /// [`crate::PACK_BYTES`]). With the same segment sizes on both sides, each message lands
    /// in its own receive segment; the batch completes as one [`Transfer`].
    ///
    /// For many small messages this is the fast path: a message sent alone costs one job,
    /// one plugin request and one completion (about 2 µs of the caller's time), a batch
    /// costs that once — on the wire it is one contiguous stream, cut into chunks over the
    /// channels. A scattered host-memory list is copied through a pooled pack buffer on the
    /// calling thread; staged CUDA memory goes through the engines' rings. Batches are
    /// numbered with the connection's sends: the k-th send of any kind pairs with the
    /// peer's k-th receive, which must be a `recv_batch`.
    pub fn send_batch(&self, segments: &[Segment<'_>]) -> Result<Transfer> {
        if let Some(e) = self.link.refusal() {
            return Err(e);
        }
        batch::submit(
            &self.batch_context(Direction::Send),
            Direction::Send,
            segments,
        )
    }

    /// Receives a batch sent with [`Connection::send_batch`] into `segments`, in order (the
    /// same total as the peer's batch). A scattered host-memory list is received into a
    /// pooled pack buffer and copied out when the transfer is waited on or polled: wait on
    /// it (or poll it until finished) before reading the segments.
    pub fn recv_batch(&self, segments: &[Segment<'_>]) -> Result<Transfer> {
        if let Some(e) = self.link.failure().cloned() {
            return Err(e);
        }
        batch::submit(
            &self.batch_context(Direction::Recv),
            Direction::Recv,
            segments,
        )
    }

    /// Allocates and registers (both directions) the pack buffers that `batches` batches of
    /// scattered host memory in flight need — at most [`crate::Config::pack_buffers`] — so
    /// that the first batches do not pay for them (about 1 ms and a registration per
    /// channel each). Returns the buffers now pooled. Without it the pool grows on demand.
    pub fn reserve_batches(&self, batches: usize) -> Result<usize> {
        self.batch_pack.reserve(batches, |region| {
            self.carrier.register_region(region, Direction::Send)?;
            self.carrier.register_region(region, Direction::Recv)?;
            Ok(())
        })
    }

    /// Packing counters of two-sided batches (see [`Connection::send_batch`]).
    pub fn batch_pack_stats(&self) -> crate::onesided::PackStats {
        self.batch_pack.stats()
    }

    fn batch_context(&self, direction: Direction) -> BatchContext<'_> {
        BatchContext {
            carrier: &self.carrier,
            order: match direction {
                Direction::Send => &self.send_order,
                Direction::Recv => &self.recv_order,
            },
            pool: &self.batch_pack,
            spin: self.shared.config.wait_spin,
        }
    }

    /// Registers `region` on this connection's comms now (both directions), instead of at
    /// its first transfer.
    /// A staged CUDA region is never registered with the plugin, only the engines' pinned
    /// rings are: this makes every lane's ring now (where not made yet), so that the first
    /// transfers do not pay for them.
    pub fn register(&self, region: &Region) -> Result<()> {
        if let Some(staging) = crate::engine::job::staging_for(region) {
            return self.prepare_staging(&staging);
        }
        self.registration(region, Direction::Send)?;
        self.registration(region, Direction::Recv)?;
        Ok(())
    }

    /// Pays now, for `region`, what the first one-sided operations naming it on this
    /// connection would pay at their start: its registration on the one-sided comms, in both
    /// directions (a write's source or a read's destination on this side; the target of the
    /// peer's writes and reads). One-sided traffic has comms of its own, which
    /// [`Self::register`] (the two-sided comms) does not touch. A staged CUDA region is never
    /// registered with the plugin: for it this does what [`Self::register`] does.
    pub fn warm_up(&self, region: &Region) -> Result<()> {
        self.warm_up_all(std::slice::from_ref(region))
    }

    /// [`Self::warm_up`] for many regions at once: every engine is asked for all of their
    /// registrations before any answer is awaited (a connection set up after a thousand
    /// registrations does not pay a thousand round trips to its engines). Returns the first
    /// failure; what registered stays.
    pub fn warm_up_all(&self, regions: &[Region]) -> Result<()> {
        let mut failure = None;
        // Staged regions are never registered: their lanes' rings are what they need.
        if let Some(staging) = regions.iter().find_map(crate::engine::job::staging_for) {
            if let Err(e) = self.prepare_staging(&staging) {
                failure.get_or_insert(e);
            }
        }
        if let Err(e) = self.rma.carrier.preregister(regions) {
            failure.get_or_insert(e);
        }
        failure.map_or(Ok(()), Err)
    }

    /// Testing aid: writes `message` on the control connection as this side's own, so that a
    /// test can play a peer that breaks the protocol — a crafted one-sided request — over a
    /// real, authenticated connection. Not for production use: nothing on this side expects
    /// an answer to it, and a message the peer finds wrong fails the connection.
    #[doc(hidden)]
    pub fn post_control(&self, message: &crate::control::Message) -> Result<()> {
        self.writer.post(message).map_err(Error::from)
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
        // A send after the peer's goodbye would never be matched, so it is refused at once; a
        // receive still may be (the peer's last sends can be in flight or in the socket), so
        // it only fails once the link does.
        let refusal = match direction {
            Direction::Send => self.link.refusal(),
            Direction::Recv => self.link.failure().cloned(),
        };
        if let Some(e) = refusal {
            return Err(e);
        }
        if segments.is_empty() {
            return Err(Error::InvalidArgument(
                "a vectored transfer needs at least one segment".into(),
            ));
        }
        for (i, s) in segments.iter().enumerate() {
            s.check_inside(format_args!("segment {i}"))?;
        }
        let staging = staging_of(segments.iter().map(|s| s.region), direction)?;
        let pieces = self.carrier.region_pieces(
            segments.iter().map(|s| (s.region, s.offset, s.len as u64)),
            direction,
            staging.is_some(),
        )?;

        let order = match direction {
            Direction::Send => &self.send_order,
            Direction::Recv => &self.recv_order,
        };
        let mut next = order.lock();
        let seq = *next;
        let job = self.carrier.new_job(JobSpec {
            direction,
            seq,
            pieces,
            staging,
            schedule: None,
            completion: None,
            packed: false,
        });
        let transfer = Transfer::new(
            job.completion.clone(),
            direction,
            job.len,
            self.shared.config.wait_spin,
        );
        *next += 1;
        if vectored {
            self.pair_segments(&job);
        } else {
            match self.link.two_sided_schedule(&[job.len], &[job.len]) {
                // Rotating by the sequence number spreads a stream of small transfers over
                // every channel; the peer cuts and rotates its matching transfer the same way.
                Ok(schedule) => job.set_schedule(schedule.rotated(seq)),
                Err(e) => job.fail(Error::InvalidArgument(e.to_string())),
            }
        }
        self.carrier.submit_job(&job);
        drop(next);
        Ok(transfer)
    }

    /// Sends this side's segment list and pairs the job with the peer's (now, if it came
    /// first, or when the watcher receives it).
    fn pair_segments(&self, job: &Arc<Job>) {
        if let Some(remote) = self.carrier.await_peer_segments(job) {
            crate::carrier::apply_segments(job, &remote);
        }
        let message = Message::Segments {
            transfer_id: segments_id(job.direction, job.seq),
            lens: job.local_lens(),
        };
        let sent = self.writer.post(&message);
        if let Err(e) = sent {
            self.link.fail(e.into());
            job.fail_with_link();
        }
    }

    /// Makes the staging rings of both halves (two-sided and one-sided lanes) for `staging`.
    fn prepare_staging(&self, staging: &Staging) -> Result<()> {
        let slot_bytes = self.link.chunk_bytes as usize;
        let made = self.carrier.prepare_staging(staging, slot_bytes)?
            + self.rma.carrier.prepare_staging(staging, slot_bytes)?;
        if made > 0 {
            tracing::debug!(target: "tcpx_runtime", peer = %self.link.peer, rings = made, "staging rings made ahead of the first transfer");
        }
        Ok(())
    }

    /// The registration of `region` on this connection in `direction`, made on first use.
    fn registration(&self, region: &Region, direction: Direction) -> Result<Arc<Registration>> {
        self.carrier.register_region(region, direction)
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        let peer = self.link.peer;
        self.link.fail(Error::Closed { peer });
        // What is queued leaves before `Close`.
        let _ = self.writer.close("connection closed by the application");
        self.writer.shutdown();
        self.stop.store(true, Ordering::Release);
        if let Some(watcher) = self.watcher.take() {
            if watcher.join().is_err() {
                tracing::error!(target: "tcpx_runtime", %peer, "control loop panicked");
            }
        }
        self.rma.close(Error::Closed { peer });
        let engines = self.carrier.engines();
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
        self.link.registrations.clear();
        self.rma.link.registrations.clear();
        self.carrier.abandon_segments();
        if let Some(eager) = &self.eager {
            eager.fail_all();
        }
        tracing::debug!(target: "tcpx_runtime", %peer, "connection closed");
    }
}
