//! How a transfer is cut into chunks and spread over channels (sans-IO).
//!
//! The plugin matches sends and receives on a comm in posting order, and each plugin request
//! is one contiguous buffer. So both peers must post, on every channel, the same sequence of
//! chunk sizes, and no chunk may span two buffers (segments) on either side.
//!
//! # The rule
//!
//! A transfer is a logical byte stream `[0, L)`. Each side describes its memory as a list of
//! segment lengths (regions, in stream order) summing to `L`; the two lists may differ.
//!
//! 1. Cut the stream at every segment boundary of **both** sides (the union of the two sets
//!    of boundaries). This gives *extents*: stretches that are contiguous on both sides.
//! 2. Cut each extent into chunks of `chunk_bytes`, starting at the extent's beginning (the
//!    last chunk of an extent may be shorter).
//! 3. Number the chunks in stream order; chunk `i` goes to channel `(i + r) mod N`, where the
//!    rotation `r` is 0 unless set with [`Schedule::rotated`] (the runtime rotates by the
//!    transfer's sequence number, which both peers know, so that a stream of transfers
//!    smaller than `N` chunks still spreads over every channel).
//!
//! # Spreading one transfer
//!
//! Rotation spreads a *stream* of transfers; a single transfer waited for on its own (a 1 MiB
//! write, one at a time) would still ride only `L / chunk_bytes` channels: two of eight at
//! 512 KiB chunks. [`Schedule::spread_over`] cuts such a transfer finer so that it rides
//! `W` channels: the cut becomes `ceil(L / W)` rounded up to 4 KiB, never below
//! [`SPREAD_FLOOR_BYTES`] and never above `chunk_bytes`. The cut depends only on the total,
//! the chunk size and `W`, which both peers know (the runtime agrees `W` in the handshake:
//! the smaller of the two sides' engine counts, because pieces beyond the threads that move
//! them only add requests; on a 2-core box that is 1, and spreading is off). Both peers must
//! also agree *whether* a transfer spreads: the runtime spreads one-sided operations whose
//! request says so (see `Rma::spreads` in the runtime), and two-sided transfers on connections
//! where both sides announced it in the handshake, with a coarser floor
//! ([`TWO_SIDED_SPREAD_FLOOR_BYTES`], [`Schedule::spread_over_floor`]): a two-sided transfer
//! carries no flag, so every one of them is cut alike, the lone ones and the streams.
//!
//! The union of boundaries is symmetric, so the sender (local = its list, remote = the
//! receiver's) and the receiver (the other way round) compute the same chunks in the same
//! order, and each chunk maps to one contiguous piece of one segment on each side. The remote
//! list travels over the control plane ([`Message::Segments`](crate::control::message::Message::Segments)). A contiguous
//! transfer is the case of one segment per side: chunks are then cut at multiples of
//! `chunk_bytes`.
//!
//! Cutting each extent from its own start (rather than at global multiples of the chunk size)
//! keeps chunk starts at `segment start + k · chunk_bytes` when the two lists agree, which
//! preserves the 4 KiB alignment TCPX wants and avoids a sliver chunk per segment.
//!
//! A schedule stores O(segments) data; chunks are computed on the fly by [`Schedule::iter`]
//! and [`Schedule::chunk`] without allocating.
//!
//! ```
//! use tcpx_proto::schedule::Schedule;
//!
//! // The sender has one 1 MiB buffer; the receiver two of 256 KiB and 768 KiB.
//! let sender = Schedule::vectored(&[1 << 20], &[256 << 10, 768 << 10], 512 << 10, 2).unwrap();
//! let receiver = Schedule::vectored(&[256 << 10, 768 << 10], &[1 << 20], 512 << 10, 2).unwrap();
//! let sizes = |s: &Schedule| s.iter().map(|c| (c.channel, c.len)).collect::<Vec<_>>();
//! assert_eq!(sizes(&sender), [(0, 256 << 10), (1, 512 << 10), (0, 256 << 10)]);
//! assert_eq!(sizes(&sender), sizes(&receiver));
//! ```

use smallvec::SmallVec;

/// Chunk size Google's TCPX configurations use (`NCCL_DYNAMIC_CHUNK_SIZE=524288`).
pub const DEFAULT_CHUNK_BYTES: u32 = 512 * 1024;

/// Largest chunk a plugin request can carry: ncclNet v7 sizes are C `int`.
pub const MAX_CHUNK_BYTES: u32 = i32::MAX as u32;

/// Smallest piece [`Schedule::spread_over`] cuts a transfer into. Below it a piece's own
/// costs (a request on each side, an engine hand-off) outweigh what running it in parallel
/// saves: on 16 cores a lone 1 MiB message over 8 channels took 40–49 µs in 128 KiB pieces,
/// 70 µs in 256 KiB pieces and 100–121 µs in the default two 512 KiB chunks.
pub const SPREAD_FLOOR_BYTES: u32 = 128 * 1024;

/// Smallest piece a two-sided transfer is spread into ([`Schedule::spread_over_floor`]).
///
/// Coarser than [`SPREAD_FLOOR_BYTES`] because a two-sided transfer cannot say whether it is
/// alone (the receiver posts its pieces before anything arrives), so streams are cut the same
/// way as lone transfers. Measured on 16 cores per peer, two processes (issue 25,
/// thirty-third session): at 256 KiB a lone 1 MiB send took 64–73 µs against 112–140 in two
/// 512 KiB chunks and streams of 512 KiB–2 MiB held their rate; at 128 KiB the lone send took
/// 32–40 µs but streams of 1 MiB lost a quarter (four times the requests).
pub const TWO_SIDED_SPREAD_FLOOR_BYTES: u32 = 256 * 1024;

/// Spread cuts are multiples of this (TCPX wants 4 KiB-aligned buffers).
const SPREAD_ALIGN: u64 = 4096;

/// A schedule could not be built from the given parameters.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// `chunk_bytes` was 0.
    #[error("chunk size must be at least 1 byte")]
    ZeroChunk,
    /// `chunk_bytes` exceeds what one plugin request can carry.
    #[error("chunk size {0} exceeds the plugin's limit of {MAX_CHUNK_BYTES} bytes")]
    ChunkTooLarge(u32),
    /// No channels to spread chunks over.
    #[error("a schedule needs at least one channel")]
    ZeroChannels,
    /// The two sides describe streams of different lengths.
    #[error("local segments total {local} bytes but the peer's total {remote}; both sides must describe the same number of bytes")]
    LengthMismatch {
        /// Sum of the local segment lengths.
        local: u64,
        /// Sum of the remote segment lengths.
        remote: u64,
    },
    /// The segment lengths of one side add up to more than `u64::MAX`.
    #[error("segment lengths overflow a 64-bit total")]
    Overflow,
}

/// One chunk of a transfer: one plugin request on each side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    /// Position in the schedule (posting order across all channels).
    pub index: u64,
    /// Channel that carries it: `(index + rotation) mod channels`.
    pub channel: u16,
    /// Offset in the logical stream.
    pub offset: u64,
    /// Bytes in the chunk (at most the schedule's chunk size, never 0).
    pub len: u32,
    /// Index of the local segment holding it (into the local list given to the schedule).
    pub segment: usize,
    /// Offset of the chunk inside that segment.
    pub segment_offset: u64,
}

/// A stretch of the stream contiguous on both sides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Extent {
    /// Offset in the stream.
    offset: u64,
    len: u64,
    /// Local segment index and offset inside it.
    segment: usize,
    segment_offset: u64,
    /// Index of the extent's first chunk.
    first_chunk: u64,
}

/// The chunks of one transfer and the channel of each, as both peers derive them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    /// Inline for the common transfers (one segment each side, or two: one or a few extents)
    /// so that a schedule costs no allocation of its own: every message builds one, and the
    /// allocation (made by the submitting thread, freed by an engine) was a tenth of a small
    /// message's submission (`tcpx-bench overhead --transfer-bytes 4KiB` under callgrind).
    extents: SmallVec<[Extent; 2]>,
    total_len: u64,
    /// The chunk size the schedule was built with: the most any chunk holds (what a staging
    /// slot must hold).
    chunk_bytes: u32,
    /// Where extents are cut: `chunk_bytes`, or less once spread ([`Schedule::spread_over`]).
    cut_bytes: u32,
    channels: u16,
    /// Channel of chunk 0.
    first_channel: u16,
    chunk_count: u64,
}

impl Schedule {
    /// A contiguous transfer of `len` bytes on both sides.
    pub fn contiguous(len: u64, chunk_bytes: u32, channels: u16) -> Result<Self, ScheduleError> {
        Self::vectored(&[len], &[len], chunk_bytes, channels)
    }

    /// A vectored transfer: `local_lens` are this side's segment lengths, `remote_lens` the
    /// peer's, both in stream order. Zero-length segments are allowed and carry no chunk.
    pub fn vectored(
        local_lens: &[u64],
        remote_lens: &[u64],
        chunk_bytes: u32,
        channels: u16,
    ) -> Result<Self, ScheduleError> {
        if chunk_bytes == 0 {
            return Err(ScheduleError::ZeroChunk);
        }
        if chunk_bytes > MAX_CHUNK_BYTES {
            return Err(ScheduleError::ChunkTooLarge(chunk_bytes));
        }
        if channels == 0 {
            return Err(ScheduleError::ZeroChannels);
        }
        let local = checked_sum(local_lens)?;
        let remote = checked_sum(remote_lens)?;
        if local != remote {
            return Err(ScheduleError::LengthMismatch { local, remote });
        }

        let mut extents = SmallVec::with_capacity(local_lens.len() + remote_lens.len());
        // End (in the stream) of the remote segment containing the current position.
        let mut remote_iter = remote_lens.iter();
        let mut remote_end = 0u64;
        let mut seg_start = 0u64;
        let mut next_chunk = 0u64;
        for (segment, &seg_len) in local_lens.iter().enumerate() {
            let seg_end = seg_start + seg_len; // no overflow: bounded by the checked total
            let mut pos = seg_start;
            while pos < seg_end {
                // Skip remote segments that end at or before `pos` (zero-length ones too).
                while remote_end <= pos {
                    match remote_iter.next() {
                        Some(&len) => remote_end += len,
                        // Totals are equal, so a remote segment always covers `pos`.
                        None => break,
                    }
                }
                let cut = seg_end.min(remote_end.max(pos + 1));
                let len = cut - pos;
                extents.push(Extent {
                    offset: pos,
                    len,
                    segment,
                    segment_offset: pos - seg_start,
                    first_chunk: next_chunk,
                });
                next_chunk += len.div_ceil(u64::from(chunk_bytes));
                pos = cut;
            }
            seg_start = seg_end;
        }

        Ok(Self {
            extents,
            total_len: local,
            chunk_bytes,
            cut_bytes: chunk_bytes,
            channels,
            first_channel: 0,
            chunk_count: next_chunk,
        })
    }

    /// The same transfer cut so that it rides `width` channels (at most the schedule's
    /// channel count) when it is smaller than `width` chunks; see the module's *Spreading one
    /// transfer*. A width of 0 or 1, or a chunk size at or below [`SPREAD_FLOOR_BYTES`],
    /// changes nothing. Both peers must spread by the same width, before rotating.
    #[must_use]
    pub fn spread_over(self, width: u16) -> Self {
        self.spread_over_floor(width, SPREAD_FLOOR_BYTES)
    }

    /// [`Schedule::spread_over`] with pieces of at least `floor` bytes (rounded up to 4 KiB;
    /// [`TWO_SIDED_SPREAD_FLOOR_BYTES`] for two-sided transfers): a transfer then rides at
    /// most `ceil(L / floor)` channels. A chunk size at or below the floor changes nothing.
    #[must_use]
    pub fn spread_over_floor(mut self, width: u16, floor: u32) -> Self {
        let cut = spread_cut(
            self.total_len,
            self.chunk_bytes,
            width.min(self.channels),
            floor,
        );
        if cut == self.cut_bytes {
            return self;
        }
        self.cut_bytes = cut;
        let mut next_chunk = 0u64;
        for extent in &mut self.extents {
            extent.first_chunk = next_chunk;
            next_chunk += extent.len.div_ceil(u64::from(cut));
        }
        self.chunk_count = next_chunk;
        self
    }

    /// The same chunks, with chunk 0 on channel `first_channel mod channels` and the rest
    /// following round-robin. Both peers must rotate by the same amount.
    #[must_use]
    pub fn rotated(mut self, first_channel: u64) -> Self {
        // Below `channels`, a u16.
        self.first_channel = (first_channel % u64::from(self.channels)) as u16;
        self
    }

    /// Channel of chunk 0.
    pub fn first_channel(&self) -> u16 {
        self.first_channel
    }

    /// Index of the first chunk `channel` carries (it may be past the end).
    pub fn first_index_on(&self, channel: u16) -> u64 {
        let n = u64::from(self.channels);
        (u64::from(channel) + n - u64::from(self.first_channel)) % n
    }

    /// Bytes in the transfer.
    pub fn total_len(&self) -> u64 {
        self.total_len
    }

    /// The transfer has no bytes (and so no chunks).
    pub fn is_empty(&self) -> bool {
        self.total_len == 0
    }

    /// The chunk size the schedule was built with: no chunk is larger (a staging slot of this
    /// size holds any of them).
    pub fn chunk_bytes(&self) -> u32 {
        self.chunk_bytes
    }

    /// Where extents are cut: [`Self::chunk_bytes`] unless [`Self::spread_over`] cut finer.
    pub fn cut_bytes(&self) -> u32 {
        self.cut_bytes
    }

    /// Channels the chunks are spread over.
    pub fn channels(&self) -> u16 {
        self.channels
    }

    /// Number of chunks (plugin requests per side).
    pub fn chunk_count(&self) -> u64 {
        self.chunk_count
    }

    /// Number of chunks carried by `channel` (0 for a channel out of range).
    pub fn chunk_count_on(&self, channel: u16) -> u64 {
        if channel >= self.channels {
            return 0;
        }
        let n = u64::from(self.channels);
        let c = self.first_index_on(channel);
        if self.chunk_count > c {
            (self.chunk_count - c).div_ceil(n)
        } else {
            0
        }
    }

    /// Chunk number `index`, or `None` past the end. O(log segments).
    pub fn chunk(&self, index: u64) -> Option<Chunk> {
        if index >= self.chunk_count {
            return None;
        }
        let pos = self.extents.partition_point(|e| e.first_chunk <= index);
        let extent = self.extents.get(pos.checked_sub(1)?)?;
        let within = (index - extent.first_chunk) * u64::from(self.cut_bytes);
        Some(self.make_chunk(index, extent, within))
    }

    /// All chunks in posting order.
    pub fn iter(&self) -> Chunks<'_> {
        Chunks {
            schedule: self,
            extent: 0,
            within: 0,
            index: 0,
        }
    }

    /// The chunks carried by `channel`, in that channel's posting order.
    pub fn on_channel(&self, channel: u16) -> ChannelChunks<'_> {
        ChannelChunks {
            schedule: self,
            next: if channel < self.channels {
                self.first_index_on(channel)
            } else {
                0
            },
            // An out-of-range channel yields nothing.
            end: if channel < self.channels {
                self.chunk_count
            } else {
                0
            },
        }
    }

    fn make_chunk(&self, index: u64, extent: &Extent, within: u64) -> Chunk {
        let len = (extent.len - within).min(u64::from(self.cut_bytes));
        Chunk {
            index,
            // Reduced mod `channels`, so below it: a u16.
            channel: ((index + u64::from(self.first_channel)) % u64::from(self.channels)) as u16,
            offset: extent.offset + within,
            // At most `chunk_bytes`, a u32.
            len: len as u32,
            segment: extent.segment,
            segment_offset: extent.segment_offset + within,
        }
    }
}

impl<'a> IntoIterator for &'a Schedule {
    type Item = Chunk;
    type IntoIter = Chunks<'a>;

    fn into_iter(self) -> Chunks<'a> {
        self.iter()
    }
}

/// The cut that spreads `total` bytes over `width` channels (see [`Schedule::spread_over`]).
fn spread_cut(total: u64, chunk_bytes: u32, width: u16, floor: u32) -> u32 {
    let floor = u64::from(floor).div_ceil(SPREAD_ALIGN) * SPREAD_ALIGN;
    if width <= 1 || u64::from(chunk_bytes) <= floor {
        return chunk_bytes;
    }
    let share = total.div_ceil(u64::from(width)).div_ceil(SPREAD_ALIGN) * SPREAD_ALIGN;
    // Between the floor and `chunk_bytes` (a u32), whatever the total.
    share.clamp(floor, u64::from(chunk_bytes)) as u32
}

fn checked_sum(lens: &[u64]) -> Result<u64, ScheduleError> {
    lens.iter()
        .try_fold(0u64, |acc, &l| acc.checked_add(l))
        .ok_or(ScheduleError::Overflow)
}

/// Iterator over a schedule's chunks in posting order; see [`Schedule::iter`].
#[derive(Debug, Clone)]
pub struct Chunks<'a> {
    schedule: &'a Schedule,
    extent: usize,
    /// Offset of the next chunk inside the current extent.
    within: u64,
    index: u64,
}

impl Iterator for Chunks<'_> {
    type Item = Chunk;

    fn next(&mut self) -> Option<Chunk> {
        let extent = loop {
            let extent = self.schedule.extents.get(self.extent)?;
            if self.within < extent.len {
                break extent;
            }
            self.extent += 1;
            self.within = 0;
        };
        let chunk = self.schedule.make_chunk(self.index, extent, self.within);
        self.within += u64::from(chunk.len);
        self.index += 1;
        Some(chunk)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.schedule.chunk_count - self.index;
        match usize::try_from(left) {
            Ok(n) => (n, Some(n)),
            Err(_) => (usize::MAX, None),
        }
    }
}

/// Iterator over the chunks of one channel; see [`Schedule::on_channel`].
#[derive(Debug, Clone)]
pub struct ChannelChunks<'a> {
    schedule: &'a Schedule,
    next: u64,
    end: u64,
}

impl Iterator for ChannelChunks<'_> {
    type Item = Chunk;

    fn next(&mut self) -> Option<Chunk> {
        if self.next >= self.end {
            return None;
        }
        let chunk = self.schedule.chunk(self.next)?;
        self.next += u64::from(self.schedule.channels);
        Some(chunk)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lens(s: &Schedule) -> Vec<u32> {
        s.iter().map(|c| c.len).collect()
    }

    #[test]
    fn contiguous_transfer_is_cut_at_chunk_multiples() {
        let s = Schedule::contiguous(1300, 500, 2).unwrap();
        assert_eq!(lens(&s), [500, 500, 300]);
        let offsets: Vec<_> = s.iter().map(|c| c.offset).collect();
        assert_eq!(offsets, [0, 500, 1000]);
        let channels: Vec<_> = s.iter().map(|c| c.channel).collect();
        assert_eq!(channels, [0, 1, 0]);
    }

    #[test]
    fn empty_transfer_has_no_chunks() {
        let s = Schedule::contiguous(0, 500, 4).unwrap();
        assert!(s.is_empty());
        assert_eq!(s.chunk_count(), 0);
        assert_eq!(s.iter().next(), None);
        assert_eq!(s.chunk(0), None);
    }

    #[test]
    fn chunks_never_span_either_sides_segments() {
        // Local boundaries at 300, remote at 200 and 700.
        let s = Schedule::vectored(&[300, 700], &[200, 500, 300], 1000, 3).unwrap();
        assert_eq!(lens(&s), [200, 100, 400, 300]);
        let segs: Vec<_> = s.iter().map(|c| (c.segment, c.segment_offset)).collect();
        assert_eq!(segs, [(0, 0), (0, 200), (1, 0), (1, 400)]);
    }

    #[test]
    fn zero_length_segments_carry_no_chunk() {
        let s = Schedule::vectored(&[0, 10, 0, 10, 0], &[20], 8, 1).unwrap();
        let segs: Vec<_> = s.iter().map(|c| (c.segment, c.len)).collect();
        assert_eq!(segs, [(1, 8), (1, 2), (3, 8), (3, 2)]);
    }

    #[test]
    fn mismatched_totals_are_refused() {
        assert_eq!(
            Schedule::vectored(&[10], &[4, 5], 8, 1),
            Err(ScheduleError::LengthMismatch {
                local: 10,
                remote: 9
            })
        );
    }

    #[test]
    fn bad_parameters_are_refused() {
        assert_eq!(Schedule::contiguous(1, 0, 1), Err(ScheduleError::ZeroChunk));
        assert_eq!(
            Schedule::contiguous(1, 1, 0),
            Err(ScheduleError::ZeroChannels)
        );
        assert_eq!(
            Schedule::contiguous(1, u32::MAX, 1),
            Err(ScheduleError::ChunkTooLarge(u32::MAX))
        );
        assert_eq!(
            Schedule::vectored(&[u64::MAX, 1], &[1], 1, 1),
            Err(ScheduleError::Overflow)
        );
    }

    #[test]
    fn rotation_moves_chunk_zero_and_keeps_round_robin() {
        let s = Schedule::contiguous(10, 1, 3).unwrap().rotated(4);
        let channels: Vec<_> = s.iter().map(|c| c.channel).collect();
        assert_eq!(channels, [1, 2, 0, 1, 2, 0, 1, 2, 0, 1]);
        for ch in 0..3 {
            let via_iter: Vec<_> = s.iter().filter(|c| c.channel == ch).collect();
            let via_channel: Vec<_> = s.on_channel(ch).collect();
            assert_eq!(via_iter, via_channel, "channel {ch}");
            assert_eq!(s.chunk_count_on(ch), via_iter.len() as u64);
            assert_eq!(s.chunk(s.first_index_on(ch)).map(|c| c.channel), Some(ch));
        }
    }

    #[test]
    fn a_lone_transfer_spreads_over_the_agreed_width() {
        const K: u64 = 1024;
        let s = Schedule::contiguous(1 << 20, 512 << 10, 8).unwrap();
        assert_eq!(lens(&s), [512 << 10, 512 << 10]);
        // 8 pieces of 128 KiB on 8 channels.
        let spread = s.clone().spread_over(8).rotated(3);
        assert_eq!(lens(&spread), [128 << 10; 8]);
        assert_eq!(spread.chunk_bytes(), 512 << 10);
        assert_eq!(spread.cut_bytes(), 128 << 10);
        let channels: Vec<_> = spread.iter().map(|c| c.channel).collect();
        assert_eq!(channels, [3, 4, 5, 6, 7, 0, 1, 2]);
        // Width 3: ceil(1 MiB / 3) rounded up to 4 KiB.
        let three = s.clone().spread_over(3);
        let cut = (((1 << 20) as u64).div_ceil(3).div_ceil(4 * K) * 4 * K) as u32;
        assert_eq!(lens(&three), [cut, cut, (1 << 20) - 2 * cut]);
        // Never below the floor: 256 KiB over 8 channels is two pieces, not eight.
        let small = Schedule::contiguous(256 * K, 512 << 10, 8)
            .unwrap()
            .spread_over(8);
        assert_eq!(lens(&small), [128 << 10; 2]);
        // Large transfers keep their chunks; width 1 and small chunk sizes change nothing.
        let big = Schedule::contiguous(64 << 20, 512 << 10, 8).unwrap();
        assert_eq!(big.clone().spread_over(8), big);
        assert_eq!(s.clone().spread_over(1), s);
        let fine = Schedule::contiguous(1 << 20, 64 << 10, 8).unwrap();
        assert_eq!(fine.clone().spread_over(8), fine);
        // The width is capped by the channels.
        assert_eq!(
            Schedule::contiguous(1 << 20, 512 << 10, 2)
                .unwrap()
                .spread_over(8),
            Schedule::contiguous(1 << 20, 512 << 10, 2).unwrap()
        );
    }

    #[test]
    fn a_two_sided_spread_keeps_pieces_of_its_floor() {
        const K: u32 = 1024;
        let cut = |len: u64| {
            let s = Schedule::contiguous(len, 512 * K, 8)
                .unwrap()
                .spread_over_floor(8, TWO_SIDED_SPREAD_FLOOR_BYTES);
            lens(&s)
        };
        // 1 MiB: four 256 KiB pieces (not eight of 128 KiB, not two of 512 KiB).
        assert_eq!(cut(1 << 20), [256 * K; 4]);
        // 2 MiB: every channel, 256 KiB each; 3 MiB: every channel, 384 KiB each.
        assert_eq!(cut(2 << 20), [256 * K; 8]);
        assert_eq!(cut(3 << 20), [384 * K; 8]);
        // 512 KiB: two pieces; 256 KiB and less: one, as before.
        assert_eq!(cut(512 << 10), [256 * K; 2]);
        assert_eq!(cut(256 << 10), [256 * K]);
        assert_eq!(cut(100 << 10), [100 * K]);
        // 4 MiB and more: whole chunks, as without spreading.
        assert_eq!(cut(4 << 20), [512 * K; 8]);
        // A floor at or above the chunk size changes nothing; a floor not a multiple of
        // 4 KiB is rounded up to one.
        let s = Schedule::contiguous(1 << 20, 256 * K, 8).unwrap();
        assert_eq!(s.clone().spread_over_floor(8, 256 * K), s);
        let odd = Schedule::contiguous(1 << 20, 512 * K, 8)
            .unwrap()
            .spread_over_floor(8, 200 * K + 1);
        assert_eq!(odd.cut_bytes(), 204 * K);
        // The default floor is `spread_over`'s.
        let s = Schedule::contiguous(1 << 20, 512 * K, 8).unwrap();
        assert_eq!(
            s.clone().spread_over_floor(8, SPREAD_FLOOR_BYTES),
            s.spread_over(8)
        );
    }

    #[test]
    fn spread_pieces_never_span_either_sides_segments() {
        // Local: 100 KiB + 924 KiB, remote: 600 KiB + 424 KiB; cut 128 KiB.
        const K: u64 = 1024;
        let s = Schedule::vectored(&[100 * K, 924 * K], &[600 * K, 424 * K], 512 << 10, 8)
            .unwrap()
            .spread_over(8);
        let k = |v: u64| (v * K) as u32;
        assert_eq!(
            lens(&s),
            [
                k(100),
                k(128),
                k(128),
                k(128),
                k(116),
                k(128),
                k(128),
                k(128),
                k(40)
            ]
        );
        assert_eq!(
            s.chunk(4).map(|c| (c.segment, c.segment_offset)),
            Some((1, 384 * K))
        );
    }

    #[test]
    fn per_channel_iterator_yields_every_nth_chunk() {
        let s = Schedule::contiguous(10, 1, 3).unwrap();
        let idx: Vec<_> = s.on_channel(1).map(|c| c.index).collect();
        assert_eq!(idx, [1, 4, 7]);
        assert_eq!(s.chunk_count_on(0), 4);
        assert_eq!(s.chunk_count_on(1), 3);
        assert_eq!(s.chunk_count_on(3), 0);
        assert_eq!(s.on_channel(3).next(), None);
    }
}
