//! The payloads of the one-sided control messages (codes 0x0100–0x0105, see
//! [`Message`](super::message::Message)), hand-written little-endian like the rest of the protocol:
//!
//! | message | payload |
//! |---|---|
//! | `WriteRequest` 0x0100 | op_id u64, entries, local lens, notification (u8 0 = none, 1 = u32 length + bytes), flags u8 (bit 0: packed, bit 1: spread, bit 2: inline), with bit 2 the data: u32 length + bytes (protocol version 6) |
//! | `ReadRequest` 0x0101 | op_id u64, entries, local lens, flags u8 (bit 0: packing offered, bit 1: spread, bit 2: answer inline, protocol version 6) |
//! | `Notify` 0x0102 | u32 length + bytes |
//! | `WriteAck` 0x0103 | op_id u64, u8 0 = done / 1 = refused then a refusal |
//! | `ReadData` 0x0104 | op_id u64, u8 0 = unpacked / 1 = packed |
//! | `ReadRefused` 0x0105 | op_id u64, refusal |
//! | `ReadInline` 0x0106 | op_id u64, u32 length + bytes (protocol version 6) |
//!
//! *entries* is a u32 count then per entry region_id u64, key u64, offset u64, len u64;
//! *local lens* is a u32 count then u64 lengths; a *refusal* is the entry index u32 and a
//! reason code u8 ([`RefusalReason`]). Counts are checked against the bytes present before
//! anything is allocated; a notification longer than [`MAX_NOTIFICATION`] is refused; a flag
//! byte with an unknown bit set is refused.

use crate::wire::{Reader, TooLong, WireError, Writer};

/// Largest notification, standalone or attached to a write.
pub const MAX_NOTIFICATION: usize = 64 << 10;

/// Largest data a [`WriteRequest`] may carry inline (the runtime's own threshold is lower).
pub const MAX_INLINE: usize = 64 << 10;

/// Bytes of one encoded [`RemoteEntry`].
pub const ENTRY_BYTES: usize = 32;

/// One entry of a request's remote list, as it travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteEntry {
    /// The target's region id (from the descriptor).
    pub region_id: u64,
    /// The descriptor's access key.
    pub key: u64,
    /// Offset in the region.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// A one-sided write: the initiator has already queued the data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteRequest {
    /// The initiator's operation id (echoed in the `WriteAck`).
    pub op_id: u64,
    /// Where the data goes, in stream order.
    pub entries: Vec<RemoteEntry>,
    /// The initiator's (coalesced) segment lengths, in stream order.
    pub local_lens: Vec<u64>,
    /// Delivered to the target application once every byte has landed.
    pub notification: Option<Vec<u8>>,
    /// The data travels packed: one contiguous transfer of the total length, which the
    /// target receives into a pack buffer and scatters (the initiator decided).
    pub packed: bool,
    /// Both sides cut the data finer, over the connection's agreed spread width
    /// ([`Schedule::spread_over`](crate::schedule::Schedule::spread_over)); the initiator
    /// decides (a lone operation, no staged memory on either side).
    pub spread: bool,
    /// The data itself, in stream order, when it travels in this message instead of on the
    /// one-sided comms (a small write of host memory: the target copies it in and answers;
    /// never together with `packed`). At most [`MAX_INLINE`] bytes.
    pub inline: Option<Vec<u8>>,
}

/// A one-sided read: the target answers `ReadData` (and sends), `ReadInline` (the data itself, when
/// asked) or `ReadRefused`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadRequest {
    /// The initiator's operation id.
    pub op_id: u64,
    /// Where the data comes from, in stream order.
    pub entries: Vec<RemoteEntry>,
    /// The initiator's (coalesced) segment lengths, in stream order.
    pub local_lens: Vec<u64>,
    /// The initiator can receive the data packed (it holds a pack buffer for it); the
    /// target, which sends the data, decides and says so in `ReadData`.
    pub pack: bool,
    /// Both sides cut the data finer, as in [`WriteRequest::spread`] (the initiator decides;
    /// packed or not).
    pub spread: bool,
    /// The target answers with the data itself in a `ReadInline` message (a small read into
    /// host memory), not `ReadData` and the one-sided comms; never together with `pack`.
    pub inline: bool,
}

/// Bit 0 of a request's flag byte: packed (write) / packing offered (read).
const FLAG_PACKED: u8 = 1;
/// Bit 1: spread.
const FLAG_SPREAD: u8 = 2;
/// Bit 2 (`WriteRequest` only): the data follows inline.
const FLAG_INLINE: u8 = 4;

fn flag_bits(packed: bool, spread: bool) -> u8 {
    (if packed { FLAG_PACKED } else { 0 }) | if spread { FLAG_SPREAD } else { 0 }
}

fn write_flags(w: &mut Writer<'_>, packed: bool, spread: bool) {
    w.u8(flag_bits(packed, spread));
}

/// The flag byte, with any bit outside `known` refused.
fn read_flag_byte(r: &mut Reader<'_>, known: u8) -> Result<u8, WireError> {
    let flags = r.u8("flags")?;
    if flags & !known != 0 {
        return Err(WireError::Invalid {
            field: "flags",
            why: "unknown flag bits",
        });
    }
    Ok(flags)
}

/// Why a target refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RefusalReason {
    /// No region with that id is advertised.
    UnknownRegion,
    /// The key does not match the advertised one.
    WrongKey,
    /// The descriptor was revoked.
    Revoked,
    /// Offset + length lies past the region's end.
    OutOfBounds,
    /// The list mixes staged CUDA regions (CUDA memory on a host-only plugin, moved through
    /// the engines' pinned rings) with other memory: one operation is staged as a whole or
    /// not at all. The entry named is the first whose memory differs from the first entry's.
    UnsupportedMemory,
}

impl RefusalReason {
    fn code(self) -> u8 {
        match self {
            Self::UnknownRegion => 1,
            Self::WrongKey => 2,
            Self::Revoked => 3,
            Self::OutOfBounds => 4,
            Self::UnsupportedMemory => 5,
        }
    }

    fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            1 => Self::UnknownRegion,
            2 => Self::WrongKey,
            3 => Self::Revoked,
            4 => Self::OutOfBounds,
            5 => Self::UnsupportedMemory,
            _ => return None,
        })
    }
}

impl std::fmt::Display for RefusalReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::UnknownRegion => "unknown region",
            Self::WrongKey => "wrong access key",
            Self::Revoked => "descriptor revoked",
            Self::OutOfBounds => "offset + length outside the region",
            Self::UnsupportedMemory => {
                "the list mixes staged CUDA regions with other memory (one operation is staged \
                 as a whole or not at all: split it)"
            }
        })
    }
}

/// A refused request: which entry of its remote list, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    /// Index of the first bad entry in the request's remote list.
    pub index: u32,
    /// What was wrong with it.
    pub reason: RefusalReason,
}

fn count32(field: &'static str, n: usize) -> Result<u32, TooLong> {
    u32::try_from(n).map_err(|_| TooLong {
        field,
        len: n,
        max: u32::MAX as usize,
    })
}

fn write_entries(w: &mut Writer<'_>, entries: &[RemoteEntry]) -> Result<(), TooLong> {
    w.u32(count32("entries", entries.len())?);
    for e in entries {
        w.u64(e.region_id);
        w.u64(e.key);
        w.u64(e.offset);
        w.u64(e.len);
    }
    Ok(())
}

fn read_entries(r: &mut Reader<'_>) -> Result<Vec<RemoteEntry>, WireError> {
    let count = r.u32("entries")? as usize;
    if count
        .checked_mul(ENTRY_BYTES)
        .is_none_or(|n| n > r.remaining())
    {
        return Err(WireError::Invalid {
            field: "entries",
            why: "count exceeds the payload",
        });
    }
    let mut entries = Vec::with_capacity(count);
    for _ in 0..count {
        entries.push(RemoteEntry {
            region_id: r.u64("entries")?,
            key: r.u64("entries")?,
            offset: r.u64("entries")?,
            len: r.u64("entries")?,
        });
    }
    Ok(entries)
}

fn write_lens(w: &mut Writer<'_>, lens: &[u64]) -> Result<(), TooLong> {
    w.u32(count32("local_lens", lens.len())?);
    for &len in lens {
        w.u64(len);
    }
    Ok(())
}

fn read_lens(r: &mut Reader<'_>) -> Result<Vec<u64>, WireError> {
    let count = r.u32("local_lens")? as usize;
    if count.checked_mul(8).is_none_or(|n| n > r.remaining()) {
        return Err(WireError::Invalid {
            field: "local_lens",
            why: "count exceeds the payload",
        });
    }
    let mut lens = Vec::with_capacity(count);
    for _ in 0..count {
        lens.push(r.u64("local_lens")?);
    }
    Ok(lens)
}

/// Writes notification bytes with a u32 length prefix.
pub(crate) fn write_blob(w: &mut Writer<'_>, bytes: &[u8]) -> Result<(), TooLong> {
    if bytes.len() > MAX_NOTIFICATION {
        return Err(TooLong {
            field: "notification",
            len: bytes.len(),
            max: MAX_NOTIFICATION,
        });
    }
    w.u32(count32("notification", bytes.len())?);
    w.bytes(bytes);
    Ok(())
}

/// Reads notification bytes written by [`write_blob`].
pub(crate) fn read_blob(r: &mut Reader<'_>) -> Result<Vec<u8>, WireError> {
    let len = r.u32("notification")? as usize;
    if len > MAX_NOTIFICATION {
        return Err(WireError::Invalid {
            field: "notification",
            why: "longer than the 64 KiB cap",
        });
    }
    Ok(r.take("notification", len)?.to_vec())
}

/// Writes inline data: u32 length + bytes, at most [`MAX_INLINE`].
pub(crate) fn write_inline(w: &mut Writer<'_>, data: &[u8]) -> Result<(), TooLong> {
    if data.len() > MAX_INLINE {
        return Err(TooLong {
            field: "inline",
            len: data.len(),
            max: MAX_INLINE,
        });
    }
    w.u32(count32("inline", data.len())?);
    w.bytes(data);
    Ok(())
}

/// Reads inline data written by [`write_inline`] (the length checked against the cap and
/// the bytes present before anything is allocated).
pub(crate) fn read_inline(r: &mut Reader<'_>) -> Result<Vec<u8>, WireError> {
    let len = r.u32("inline")? as usize;
    if len > MAX_INLINE {
        return Err(WireError::Invalid {
            field: "inline",
            why: "longer than the 64 KiB cap",
        });
    }
    Ok(r.take("inline", len)?.to_vec())
}

/// Writes a refusal.
pub(crate) fn write_refusal(w: &mut Writer<'_>, refusal: &Refusal) {
    w.u32(refusal.index);
    w.u8(refusal.reason.code());
}

/// Reads a refusal.
pub(crate) fn read_refusal(r: &mut Reader<'_>) -> Result<Refusal, WireError> {
    let index = r.u32("refusal_index")?;
    let reason = RefusalReason::from_code(r.u8("refusal_reason")?).ok_or(WireError::Invalid {
        field: "refusal_reason",
        why: "unknown reason code",
    })?;
    Ok(Refusal { index, reason })
}

impl WriteRequest {
    /// Encoded payload bytes (to check the frame cap before queueing any data).
    pub fn payload_len(&self) -> usize {
        8 + 4
            + self.entries.len() * ENTRY_BYTES
            + 4
            + self.local_lens.len() * 8
            + 1
            + self.notification.as_ref().map_or(0, |n| 4 + n.len())
            + 1
            + self.inline.as_ref().map_or(0, |d| 4 + d.len())
    }

    pub(crate) fn write(&self, w: &mut Writer<'_>) -> Result<(), TooLong> {
        w.u64(self.op_id);
        write_entries(w, &self.entries)?;
        write_lens(w, &self.local_lens)?;
        match &self.notification {
            None => w.u8(0),
            Some(bytes) => {
                w.u8(1);
                write_blob(w, bytes)?;
            }
        }
        match &self.inline {
            None => write_flags(w, self.packed, self.spread),
            Some(data) => {
                w.u8(flag_bits(self.packed, self.spread) | FLAG_INLINE);
                write_inline(w, data)?;
            }
        }
        Ok(())
    }

    pub(crate) fn read(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let op_id = r.u64("op_id")?;
        let entries = read_entries(r)?;
        let local_lens = read_lens(r)?;
        let notification = match r.u8("notification")? {
            0 => None,
            1 => Some(read_blob(r)?),
            _ => {
                return Err(WireError::Invalid {
                    field: "notification",
                    why: "presence flag is neither 0 nor 1",
                })
            }
        };
        let flags = read_flag_byte(r, FLAG_PACKED | FLAG_SPREAD | FLAG_INLINE)?;
        let (packed, spread) = (flags & FLAG_PACKED != 0, flags & FLAG_SPREAD != 0);
        let inline = if flags & FLAG_INLINE != 0 {
            if packed {
                return Err(WireError::Invalid {
                    field: "flags",
                    why: "inline data cannot also be packed",
                });
            }
            Some(read_inline(r)?)
        } else {
            None
        };
        Ok(Self {
            op_id,
            entries,
            local_lens,
            notification,
            packed,
            spread,
            inline,
        })
    }
}

impl ReadRequest {
    /// Encoded payload bytes (to check the frame cap before sending).
    pub fn payload_len(&self) -> usize {
        8 + 4 + self.entries.len() * ENTRY_BYTES + 4 + self.local_lens.len() * 8 + 1
    }

    pub(crate) fn write(&self, w: &mut Writer<'_>) -> Result<(), TooLong> {
        w.u64(self.op_id);
        write_entries(w, &self.entries)?;
        write_lens(w, &self.local_lens)?;
        let inline = if self.inline { FLAG_INLINE } else { 0 };
        w.u8(flag_bits(self.pack, self.spread) | inline);
        Ok(())
    }

    pub(crate) fn read(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let op_id = r.u64("op_id")?;
        let entries = read_entries(r)?;
        let local_lens = read_lens(r)?;
        let flags = read_flag_byte(r, FLAG_PACKED | FLAG_SPREAD | FLAG_INLINE)?;
        let (pack, inline) = (flags & FLAG_PACKED != 0, flags & FLAG_INLINE != 0);
        if pack && inline {
            return Err(WireError::Invalid {
                field: "flags",
                why: "an inline answer cannot also be packed",
            });
        }
        Ok(Self {
            op_id,
            entries,
            local_lens,
            pack,
            spread: flags & FLAG_SPREAD != 0,
            inline,
        })
    }
}
