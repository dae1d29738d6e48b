//! Batches of small two-sided messages ([`crate::Connection::send_batch`]): many messages in
//! one submission and, on the wire, one contiguous stream cut into chunks.
//!
//! Why: a message sent on its own costs one job, one hand-off to the engines, one plugin
//! request and one completion — about 1.9 µs of the submitting thread's time on an H200
//! (issue 25), so 4 KiB messages one by one stop near 2 GB/s whatever the wire could do,
//! and TCPX's 16 requests per comm cap what a channel has in flight. A batch pays that once
//! for all its messages: both sides know the batch's total (the same on both sides, as for a
//! contiguous transfer), so both derive the packed schedule of that total
//! ([`packed_schedule`]) without exchanging segment lists, and a chunk carries as many
//! messages as fit in it.
//!
//! Each side copies only where its own list is scattered: host memory through a pooled pack
//! buffer, chunk by chunk, by the engine of each chunk's channel — gathered just before the
//! chunk is posted, scattered once its receive is done (see
//! [`crate::engine::job::HostParts`]); staged CUDA memory through the lanes' ring slots,
//! chunk by chunk; a list that is one run is sent from or received into in place. CUDA
//! memory a plugin takes directly has no pack buffer, so a scattered list of it is refused.
//!
//! The packed stream is the same whoever copies it, so either side may pack or not
//! whatever the other does.

use crate::carrier::{Carrier, JobSpec};
use crate::engine::job::staging_of;
use crate::error::{Direction, Error, Result};
use crate::onesided::pack::{host_parts, lease_pieces, packed_schedule, PackPool, Part};
use crate::onesided::PACK_BYTES;
use crate::registry::Segment;
use crate::spin_lock::SpinLock;
use crate::transfer::Transfer;

/// What a batch needs from its connection.
pub(crate) struct BatchContext<'a> {
    /// The two-sided carrier (jobs, registrations).
    pub(crate) carrier: &'a Carrier,
    /// The direction's sequence counter: held while the batch is numbered and handed to the
    /// engines, as for every two-sided transfer.
    pub(crate) order: &'a SpinLock<u64>,
    /// The connection's pack buffers for batches.
    pub(crate) pool: &'a PackPool,
    /// How long a wait on the transfer spins before sleeping.
    pub(crate) spin: std::time::Duration,
}

/// Submits `segments` as one batch in `direction` (see the module docs).
pub(crate) fn submit(
    cx: &BatchContext<'_>,
    direction: Direction,
    segments: &[Segment<'_>],
) -> Result<Transfer> {
    let total = check(segments)?;
    let staging = staging_of(segments.iter().map(|s| s.region), direction)?;
    let staged = staging.is_some();
    let parts: Vec<Part> = segments
        .iter()
        .map(|s| Part {
            region: s.region.clone(),
            offset: s.offset as u64,
            len: s.len as u64,
        })
        .collect();
    let in_place = one_run(&parts);
    if !staged
        && !in_place
        && parts
            .iter()
            .any(|p| p.region.memory().kind() != tcpx::MemoryKind::Host)
    {
        return Err(Error::InvalidArgument(
            "a batch of scattered CUDA memory needs staging (a plugin that takes CUDA memory \
             directly has no pack buffer for it): send the blocks as one contiguous region, \
             or with send_vectored / recv_vectored"
                .into(),
        ));
    }
    // A batch has no unpacked fallback (both sides cut the packed stream), so a sender, like
    // a receiver, takes a one-off buffer when the pool is exhausted.
    let lease = if staged || in_place {
        None
    } else {
        Some(cx.pool.for_receiver(total, false)?)
    };
    // The engines copy the blocks of a packed batch chunk by chunk; the plugin never sees
    // them, so they are not registered.
    let host_parts = match &lease {
        Some(_) => Some(host_parts(&parts)?),
        None => None,
    };
    let pieces = match &lease {
        // Within one pack buffer (checked above): one piece.
        Some(lease) => lease_pieces(cx.carrier, lease, direction)?,
        // Staged: every part stays a piece; the lanes gather or scatter them per chunk.
        None if staged => parts
            .iter()
            .map(|p| {
                cx.carrier
                    .region_piece(&p.region, p.offset as usize, p.len, direction, true)
            })
            .collect::<Result<_>>()?,
        // One run: the whole batch in place.
        None => smallvec::smallvec![cx.carrier.region_piece(
            &parts[0].region,
            parts[0].offset as usize,
            total,
            direction,
            false,
        )?],
    };
    let mut next = cx.order.lock();
    let seq = *next;
    let schedule = packed_schedule(total, &cx.carrier.link, seq, false)
        .map_err(|e| Error::InvalidArgument(format!("batch #{seq}: {e}")))?;
    let spec = JobSpec {
        direction,
        seq,
        pieces,
        staging,
        schedule: Some(schedule),
        completion: None,
        // A staged list stays scattered under the packed schedule: the lanes gather (or
        // scatter) the pieces each chunk covers through their ring slots.
        packed: staged,
    };
    let job = match host_parts {
        Some(parts) => cx.carrier.new_packed_host_job(spec, parts),
        None => cx.carrier.new_job(spec),
    };
    *next += 1;
    cx.carrier.submit_job(&job);
    drop(next);
    if let Some(lease) = lease {
        match direction {
            Direction::Send => cx.pool.count_sent(),
            Direction::Recv => cx.pool.count_received(),
        }
        // Back to the pool once the job finished (its last chunk copied out, on a receive).
        cx.pool.hold(job.clone(), lease);
    }
    Ok(Transfer::new(
        job.completion.clone(),
        direction,
        total,
        cx.spin,
    ))
}

/// The batch's total, once every segment lies inside its region and the total fits one pack
/// buffer (the cap both sides know).
fn check(segments: &[Segment<'_>]) -> Result<u64> {
    if segments.is_empty() {
        return Err(Error::InvalidArgument(
            "a batch needs at least one segment".into(),
        ));
    }
    let mut total = 0u64;
    for (i, s) in segments.iter().enumerate() {
        s.check_inside(format_args!("batch segment {i}"))?;
        total += s.len as u64;
    }
    if total == 0 || total > PACK_BYTES {
        return Err(Error::InvalidArgument(format!(
            "a batch carries 1 byte to {PACK_BYTES} bytes, not {total}: split it into several \
             batches (or send larger data contiguously)"
        )));
    }
    Ok(total)
}

/// Whether the parts are one run: each starts where the previous one ends, in one region.
fn one_run(parts: &[Part]) -> bool {
    parts.windows(2).all(|w| {
        w[0].region.memory().same_as(w[1].region.memory()) && w[0].offset + w[0].len == w[1].offset
    })
}
