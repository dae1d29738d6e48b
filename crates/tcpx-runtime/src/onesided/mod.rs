//! One-sided operations: WRITE and READ into a peer's advertised memory, with notifications
//! (the semantics NIXL backends offer), on top of the two-sided runtime.
//!
//! - [`descriptor`]: [`Descriptor`] (region id, length, memory kind, random access key) and
//!   its fixed byte form; [`RemoteSegment`];
//! - `adverts`: an endpoint's advertised regions and the validation of every request;
//! - [`wire`]: the request / answer payloads of the control messages 0x0100–0x0105 (defined
//!   in [`crate::control::rma`], re-exported here);
//! - `coalesce`: merging list entries contiguous in one region (both sides, identically);
//! - `remote_runs`: the remote list as a request carries it, adjacent segments of one region
//!   (same key) merged by the initiator, and the map that names a refused entry's segments;
//! - `pack`: moving batches of small scattered blocks as one contiguous transfer through
//!   pack buffers ([`PackStats`]);
//! - `state`: a connection's one-sided state and the initiator's calls;
//! - `target`: serving requests on the connection's control loop, and the acknowledger that
//!   answers them once their data landed;
//! - `inbox`: delivered notifications waiting for [`crate::Endpoint::notifications`].
//!
//! # Why separate comms
//! The plugin matches sends and receives on a comm in posting order. Two-sided traffic is
//! ordered by both applications; one-sided traffic is ordered by the engines, on the side that
//! did not call anything. Mixing both on the same comms would need a global order agreement
//! per transfer (a control round trip before every two-sided post). So every connection opens
//! N more send + receive comm pairs at set-up (the handshake's `ConnectHandles` carries 2N
//! handles; N..2N are the RMA channels), modelled as a second link — own sequence, channels,
//! counters, registrations — driven by the same engines and the same job / schedule
//! machinery. The connection owns both; closing or failing either fails both.
//!
//! # The order rule on RMA comms: the data sender is the authority
//! On each direction, the side that sends data queues its send job and writes a marker on
//! the control stream in one critical section (holding the control writer's lock), and the
//! receiver queues its receive jobs in the order the markers arrive (its watcher handles them
//! one by one). The markers are `WriteRequest` (initiator → target: the initiator's data is
//! queued at once) and `ReadData` (target → initiator, once the target accepted a
//! `ReadRequest` and queued its sends). Both sides know both lists from the request, so both
//! derive the same vectored schedule (rotated by the operation id).
//!
//! # Refusals keep the lanes in step
//! A target validates every entry of a request (known region, matching key, not revoked,
//! offset + length within bounds). A refused write's data is already on the wire, so the
//! target still posts its receives — into a chunk-sized discard region, every chunk at offset
//! 0 — and nothing reaches application memory; it then answers `WriteAck` with the refusal.
//! A refused read is answered `ReadRefused` and no data moves. The initiator's transfer fails
//! with [`crate::Error::Access`] naming the entry; the target counts the refusal
//! ([`crate::Endpoint::access_refusals`]). The target application makes no call per transfer.
//!
//! # Packing small scattered blocks
//! Coalescing cannot help blocks that are not adjacent (paged KV caches): each would be one
//! plugin request, and at 4 KiB the per-request cost dominates (0.25–0.33 of two-sided on
//! loopback). So the data sender packs a batch of host memory whose blocks average fewer
//! than [`crate::Config::pack_below`] bytes (default 32 KiB, measured; staged GPU memory on
//! either side: [`crate::Config::pack_staged_below`], 512 KiB) and that fits its pool's pack
//! buffers ([`PACK_BYTES`] each, up to [`PACKED_HOST_MAX_BYTES`] in several; staged on both
//! sides: no cap): both sides then use the contiguous schedule of the total (the flag travels
//! in `WriteRequest`, and for reads in `ReadData` after the initiator offered in
//! `ReadRequest`), and a side whose list is scattered gathers into / scatters from pooled,
//! registered pack buffers (a side whose list is one run uses it in place). A stream in
//! several buffers is cut over them by that side's own schedule, which cuts it as the peer's
//! contiguous one does because each buffer holds whole chunks; where the chunk size does not
//! divide a buffer, a host side packs one buffer's worth at most.
//! The copies run in the engines, chunk by chunk: each chunk's blocks are gathered into the
//! pack buffer just before its send and scattered out of it once its receive is done, on
//! the engine of the chunk's channel (see `engine::job::HostParts`), so a packed job
//! finishes with every byte in place — before a write's notification and `WriteAck`, before
//! a read completes; a read is served only after every earlier write landed. (Done by one
//! thread per batch before, the copies of a 4 MiB batch of 4 KiB blocks capped it near
//! 8 GB/s on 16 cores and ran from memory that had left the caches.) The watcher only
//! builds jobs. A refused packed write lands in a pack buffer and is not
//! scattered. A sender with no free pooled buffer sends unpacked.
//!
//! Staged memory (CUDA memory on a host-only plugin) packs too, without pack buffers: the
//! engines already copy every chunk of it through a pinned ring slot, so a staged side's job
//! keeps its scattered pieces under the contiguous schedule and each lane gathers the pieces a
//! chunk covers into its slot in one GPU launch (or scatters the slot into them), see
//! `engine::stage`. Before this, a KV list of 1024 × 16 KiB GPU blocks was 1024
//! chunks with a copy and an event each, and moved at 0.3 × the speed of 64 × 1 MiB. With no
//! pack buffer on a staged side, a batch of staged ↔ staged memory has no size cap (one with a
//! host side fits that side's pack buffers); an initiator packs toward CUDA descriptors only when
//! its own endpoint stages CUDA memory (same plugin on both ends: the target stages too). A
//! target takes a packed write into CUDA memory through its rings in any case, and discards a
//! refused one past a pack buffer chunk by chunk, as an unpacked one. CUDA memory a plugin
//! takes directly (TCPX) never packs on the initiating side.
//!
//! A batch alone on its connection (no other one-sided operation in flight) packs only when
//! it has more runs than the connection can have requests in flight
//! ([`crate::Config::pack_lone_runs`], channels × window by default): fewer pieces ride the
//! channels in parallel with no copy, where packed they are gathered into one chunk on one
//! channel and scattered (2 × 16 KiB between two processes: 27 µs unpacked against 35
//! packed on host memory, 47 against 90 on GPUs).
//!
//! # Small operations travel inline
//! A write of at most [`crate::Config::inline_bytes`] in all (8 KiB by default) carries its
//! data in its `WriteRequest`: the initiator gathers the bytes during the call and queues the
//! request; the target validates it as any other, copies the bytes in on its control loop
//! when the request reaches the head of its items — after every earlier write of the peer
//! landed, so a later write to the same bytes still lands last, and before any later read is
//! served — and answers `WriteAck`. No job, plugin request or engine hand-off on either side:
//! through the comms a 4 KiB write cost a job and a request on each side, three thread
//! hand-offs and a receive posted only once the request was read, 0.2–0.5 × a two-sided send
//! on an H100 host (docs/RESULTS.md, twenty-second session). The order rule of the comms does
//! not concern it (no data on them). A refused inline write changes nothing and is answered
//! like any refusal. Target memory the application holds a CPU slice of when the bytes land
//! fails the connection, as a receive into it does.
//!
//! A lone operation of host memory goes inline up to [`crate::Config::inline_lone_bytes`]
//! (32 KiB by default): while the connection has no other one-sided operation in flight
//! (none waiting for its answer, no read through the comms still receiving), two copies and
//! a control message each way cost a quarter to a third less than the comms at 12–24 KiB
//! (UCCL's benchmark over `tcpx.p2p`, two processes on an H200: a 16 KiB read 19.5–23.4 µs
//! against 32.5–34.0, docs/RESULTS.md, thirtieth session); past about 32 KiB the comms, which
//! spread a lone operation over several channels, are as fast, and with several in flight
//! the one control stream carries less than the channels.
//!
//! A read of at most the same size asks for its data inline (`ReadRequest` flag bit 2): the
//! target, when the request reaches the head of its items, reads the bytes and answers
//! `ReadInline` with them; the initiator's control loop copies them into the read's memory
//! and completes it. A refusal is `ReadRefused` as for any read.
//! [`crate::Endpoint::inline_served`] counts what a target served inline.
//!
//! Either side's memory may be host or CUDA memory, staged or not: host memory is copied by
//! the CPU (`SharedMemory::read_ranges` / `write_ranges`, allowed while other transfers of
//! the region are in flight), CUDA memory by one synchronous copy per run of blocks on one
//! GPU through its [`tcpx::cuda::SmallCopier`] (pinned bounce buffers and streams of its own,
//! 6.5–8 µs a GPU round trip on an H200): on the initiator's side in the application's call
//! (a write) or on its control loop (a read's data), on the target's on its control loop.
//! An operation with GPU memory on either side goes inline up to
//! [`crate::Config::inline_gpu_bytes`] (64 KiB by default) instead of `inline_bytes`, and
//! only while fewer than two operations of the connection are pending: the copies run one at
//! a time on each side, where the comms pipeline theirs. A lone 4 KiB GPU write takes 30–34
//! µs p50 inline against 37–41 through the staged comms (docs/RESULTS.md, twenty-third
//! session). A target region that the control loop cannot copy (CUDA memory whose GPU has no
//! copier in this process) is refused with [`RefusalReason::UnsupportedMemory`].
//!
//! # Staged regions (CUDA memory on a host-only plugin)
//! A staged region ([`crate::Region::is_staged`]) never reaches the plugin: one-sided jobs
//! over it carry `staging` and unregistered pieces, and the engines copy every chunk through
//! their pinned rings, exactly as for two-sided transfers. Staging is each side's own
//! business (the wire carries the same chunks either way), so staged ↔ staged, staged ↔
//! host and host ↔ staged all work. A job is staged as a whole or not at all, so each side's
//! list must be all staged or none: the initiator refuses a mixed local list up front
//! ([`crate::Error::InvalidArgument`]); a target refuses a mixed remote list with
//! [`RefusalReason::UnsupportedMemory`] like any other refusal (the lanes stay in step, the
//! discard region is host memory). A staged region is advertised as CUDA memory, emulated
//! ones included, so an emulation run exercises the same protocol as a GPU run; batches of
//! small blocks naming it travel packed through the rings (above). A write's notification
//! still follows its bytes: a staged receive chunk is retired only once its ring → memory
//! copy (or scatter) is seen done.
//!
//! # Notifications
//! Standalone ([`crate::Connection::notify`]) or attached to a write; delivered to
//! [`crate::Endpoint::notifications`] in send order per connection, a write's only after
//! every byte of it landed (and a standalone one after every earlier write's).
//!
//! # Order of landing
//! Writes in flight at the same time land in no defined order among themselves: their chunks
//! ride different channels and lanes (as RDMA writes do over several rails), so two of them
//! to the same bytes leave either one's bytes there. A write issued after another one
//! completed lands after it; an inline write lands after every earlier write of the peer
//! (above); notifications keep their send order whatever the landing order.
//!
//! # Cancellation and failure
//! Dropping a [`crate::Transfer`] detaches it: the jobs it started run to completion (they
//! hold their registrations), so the two sides' posting orders never diverge. A lost peer,
//! a plugin error or an unanswered operation past the configured timeout fails the
//! connection, and with it every pending operation on both sides.

use std::sync::Arc;

use tcpx_proto::coalesce;

use crate::carrier::Carrier;
use crate::registry::Region;
use crate::weak_list::WeakList;

pub mod descriptor;
/// The payloads of the one-sided control messages; they live in [`crate::control::rma`], with
/// the messages that carry them.
pub use crate::control::rma as wire;

pub(crate) mod adverts;
pub(crate) mod inbox;
pub(crate) mod inline;
pub(crate) mod pack;
pub(crate) mod remote_runs;
pub(crate) mod spare;
pub(crate) mod state;
pub(crate) mod target;

pub use descriptor::{Descriptor, DescriptorError, RemoteSegment};
pub use pack::{batches_per_pack_buffer, PackStats, PACKED_HOST_MAX_BYTES, PACK_BYTES, PACK_SLICE};
pub use wire::{ReadRequest, Refusal, RefusalReason, RemoteEntry, WriteRequest, MAX_NOTIFICATION};

/// What the one-sided half of every connection shares with its endpoint: the regions it
/// advertised (every request is validated against them), the inbox notifications land in,
/// and the connections' one-sided carriers (advertised regions are registered on each).
#[derive(Default)]
pub(crate) struct OneSidedShared {
    /// Regions advertised for one-sided access, and the count of refused requests.
    pub(crate) adverts: adverts::AdvertBook,
    /// Delivered notifications, waiting for [`crate::Endpoint::notifications`].
    pub(crate) inbox: inbox::Inbox,
    /// The one-sided carriers of the endpoint's connections.
    carriers: WeakList<Carrier>,
    /// One-sided operations from peers served inline here: writes whose data came in their
    /// request and landed, reads answered with their data (see [`crate::Config::inline_bytes`]).
    pub(crate) inline_served: std::sync::atomic::AtomicU64,
}

impl OneSidedShared {
    /// Registers every advertised region on a new connection's one-sided `carrier`, both
    /// ways, and keeps the carrier for regions advertised later. A region is then registered
    /// on a connection at connect or advertise time, not by the connection's first operation
    /// naming it: a first 1 MiB write waited 43–595 µs for the target's engines to register
    /// its region (H100, two processes). Failures are logged: the operation that needs the
    /// registration tries again and reports its own error.
    ///
    /// Where host memory is advertised, the peer's packed writes and reads of scattered
    /// blocks will go through this side's pack buffers: the connection's first one
    /// (`ready_pack_buffer`, the connection's `Rma::ready_pack_buffer`) is registered in the
    /// same round.
    pub(crate) fn adopt(
        &self,
        carrier: &Arc<Carrier>,
        ready_pack_buffer: impl FnOnce() -> Option<Region>,
    ) {
        self.carriers.add(carrier);
        let mut regions = self.adverts.live_regions();
        if regions.iter().any(packs_through_buffers) {
            regions.extend(ready_pack_buffer());
        }
        if let Err(e) = carrier.preregister(&regions) {
            tracing::debug!(target: "tcpx_runtime", peer = %carrier.link.peer, error = %e, "advertised regions not registered at connect; the first operation naming them registers them");
        }
    }

    /// Registers a newly advertised `region` on every connection's one-sided carrier, both
    /// ways (see [`Self::adopt`]). (A connection made before any host memory was advertised
    /// registers its first pack buffer at its first packed transfer.)
    pub(crate) fn register_everywhere(&self, region: &Region) {
        for carrier in self.carriers.live() {
            if let Err(e) = carrier.preregister(std::slice::from_ref(region)) {
                tracing::debug!(target: "tcpx_runtime", peer = %carrier.link.peer, error = %e, "advertised region not registered on this connection; the first operation naming it registers it");
            }
        }
    }
}

/// Whether one-sided traffic naming `region` may pass through pack buffers: unstaged host
/// memory (staged and CUDA memory pack through the engines' rings).
pub(crate) fn packs_through_buffers(region: &Region) -> bool {
    !region.is_staged() && region.memory().kind() == tcpx::MemoryKind::Host
}
