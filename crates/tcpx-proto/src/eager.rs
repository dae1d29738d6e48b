//! Eager frames: many small two-sided messages in one plugin message.
//!
//! A message of at most the agreed eager size (both sides' `Hello` carry theirs; the smaller
//! wins, 0 turns it off) does not get a plugin request of its own on the connection's
//! channels. The sender's engines copy queued small messages into a frame of at most
//! [`EAGER_FRAME_BYTES`] and send the frame on an eager comm, one of a set of comms that
//! carry nothing else; the receiver keeps frames posted on every eager comm and hands each
//! message to the receive with the same sequence number. Both sides know which messages go
//! eager from the length alone (the k-th send and the k-th receive have the same length), so
//! the connection's other comms keep their posting order.
//!
//! Why: TCPX admits 16 requests per comm and every request costs a job, a hand-off and a
//! completion; a stream of 4 KiB messages sent one request each ran at 0.05–0.14 × raw TCP
//! (issue 25). A frame pays that once for every message it carries.
//!
//! Layout (little-endian):
//!
//! | size | field |
//! |---|---|
//! | 4 | magic `b"TXEF"` |
//! | 4 | message count `n`, 1 ..= [`EAGER_MAX_MESSAGES`] |
//! | 12 · n | per message: sequence number u64, length u32 (top bit: [`DETACHED`]) |
//! | Σ length | the inline messages' bytes, in the order of the entries |
//!
//! # Detached messages
//! A message whose entry has the [`DETACHED`] bit is not in the frame: its bytes follow as a
//! plugin message of their own on the same comm, right after the frame (the detached entries
//! of a frame in entry order), sent straight from the application's memory. Copying a 64 KiB
//! message into a frame was a fifth of a sending engine's time, and the message was copied
//! twice on the sender (into the frame, into the socket) where raw TCP copies it once: on
//! 16 shared cores 64 KiB messages ran at 0.6 × raw TCP, and 0.85 with the copy left out.
//! Detached entries come after the frame's inline ones (the receiver lands the inline
//! messages before the detached ones arrive, and receives finish in sequence order), at most
//! [`EAGER_MAX_DETACHED`] per frame (a frame and its payloads stay within the comm's
//! requests). The sender chooses which messages to detach; the receiver follows the entries.
//!
//! A frame ends where its last message ends: the decoder refuses missing bytes and reads no
//! further (a plugin that reports no sizes, like nccl-fastsocket, hands over the whole posted
//! buffer, so what follows the frame is not the peer's).

use crate::wire::{Reader, WireError};

/// First four bytes of an eager frame.
pub const EAGER_FRAME_MAGIC: [u8; 4] = *b"TXEF";

/// Largest eager frame, header included: what a receiver posts per frame.
pub const EAGER_FRAME_BYTES: usize = 256 << 10;

/// Largest message the eager path carries (a frame holds at least three of them).
pub const EAGER_MAX_MESSAGE: u32 = 64 << 10;

/// Most messages in one frame.
pub const EAGER_MAX_MESSAGES: usize = 1024;

/// Most detached messages in one frame: with two frames in flight per comm, a frame and its
/// payloads are at most 8 of the 16 requests a comm may have.
pub const EAGER_MAX_DETACHED: usize = 7;

/// Bit of an entry's length word that marks the message detached (see the module docs).
pub const DETACHED: u32 = 1 << 31;

/// Consecutive messages that go to one eager channel: message `seq` travels on channel
/// [`channel_of`]`(seq, channels)`. Both sides know the rule, so each side's state can be
/// split by channel (one engine and the application meet on a channel's share, never all
/// engines on one lock), and a run long enough fills frames while short enough that a
/// stream still rides every channel.
pub const EAGER_RUN: u64 = 32;

/// The eager channel message `seq` travels on, of `channels` (at least 1).
pub fn channel_of(seq: u64, channels: u16) -> u16 {
    // The remainder is below `channels`, a u16.
    ((seq / EAGER_RUN) % u64::from(channels.max(1))) as u16
}

/// Bytes before the first entry.
pub const EAGER_HEADER_BYTES: usize = 8;

/// Bytes per message entry.
pub const EAGER_ENTRY_BYTES: usize = 12;

/// One message of a frame: its two-sided sequence number and its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EagerEntry {
    /// The message's sequence number among the connection's sends (the receive it matches).
    pub seq: u64,
    /// Its length in bytes.
    pub len: u32,
    /// Whether its bytes follow the frame as a plugin message of their own.
    pub detached: bool,
}

/// Bytes a frame of `entries` takes before its payload.
pub fn header_len(entries: usize) -> usize {
    EAGER_HEADER_BYTES + entries * EAGER_ENTRY_BYTES
}

/// Whether one more inline message of `len` bytes fits a frame that holds `entries` messages
/// and `payload` bytes of them (a detached message takes only its entry: `len` 0).
pub fn fits(entries: usize, payload: usize, len: u32) -> bool {
    entries < EAGER_MAX_MESSAGES
        && header_len(entries + 1) + payload + len as usize <= EAGER_FRAME_BYTES
}

/// Writes the header of a frame carrying `entries` into `out` (at least
/// [`header_len`]`(entries.len())` bytes); the payload follows it. Returns the header's length.
///
/// # Panics
/// If `out` is too short or `entries` is empty or longer than [`EAGER_MAX_MESSAGES`]: the
/// sender builds frames with [`fits`], so either is a bug on this side.
pub fn write_header(entries: &[EagerEntry], out: &mut [u8]) -> usize {
    assert!(
        !entries.is_empty() && entries.len() <= EAGER_MAX_MESSAGES,
        "an eager frame carries 1 to {EAGER_MAX_MESSAGES} messages, not {}",
        entries.len()
    );
    let len = header_len(entries.len());
    let out = &mut out[..len];
    out[..4].copy_from_slice(&EAGER_FRAME_MAGIC);
    // At most EAGER_MAX_MESSAGES (checked above): fits a u32.
    out[4..8].copy_from_slice(&(entries.len() as u32).to_le_bytes());
    for (entry, at) in entries
        .iter()
        .zip(out[8..].chunks_exact_mut(EAGER_ENTRY_BYTES))
    {
        at[..8].copy_from_slice(&entry.seq.to_le_bytes());
        let word = if entry.detached {
            entry.len | DETACHED
        } else {
            entry.len
        };
        at[8..].copy_from_slice(&word.to_le_bytes());
    }
    len
}

/// A received frame's messages: where each one's bytes lie in the frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EagerMessage {
    /// The message's entry.
    pub entry: EagerEntry,
    /// Offset of its bytes in the frame (0 for a detached message: its bytes are at the start
    /// of the plugin message that brings them).
    pub offset: usize,
}

/// Decodes the header of `frame` (the bytes the plugin reported received) into `out`
/// (cleared first; reused across frames so that the receive path does not allocate), checking
/// that every inline message lies inside `frame`, that none is empty or longer than
/// `max_message`, that sequence numbers rise strictly within the frame and that detached
/// messages (at most [`EAGER_MAX_DETACHED`]) come after the inline ones. Returns the frame's
/// length (where its last inline message ends); bytes after it are not read.
pub fn decode(
    frame: &[u8],
    max_message: u32,
    out: &mut Vec<EagerMessage>,
) -> Result<usize, WireError> {
    out.clear();
    let invalid = |field, why| WireError::Invalid { field, why };
    if frame.len() > EAGER_FRAME_BYTES {
        return Err(invalid("eager frame", "longer than an eager frame may be"));
    }
    let mut r = Reader::new(frame);
    if r.array::<4>("eager magic")? != EAGER_FRAME_MAGIC {
        return Err(invalid("eager magic", "not an eager frame"));
    }
    let count = r.u32("eager count")? as usize;
    if count == 0 || count > EAGER_MAX_MESSAGES {
        return Err(invalid("eager count", "a frame carries 1 to 1024 messages"));
    }
    let mut offset = header_len(count);
    if offset > frame.len() {
        return Err(WireError::Truncated {
            field: "eager entries",
            needed: offset,
            available: frame.len(),
        });
    }
    let mut last: Option<u64> = None;
    let mut detached_seen = 0;
    for _ in 0..count {
        let seq = r.u64("eager seq")?;
        let word = r.u32("eager len")?;
        let (len, detached) = (word & !DETACHED, word & DETACHED != 0);
        if len == 0 || len > max_message {
            return Err(invalid(
                "eager len",
                "a message is empty or longer than the agreed eager size",
            ));
        }
        if last.is_some_and(|l| seq <= l) {
            return Err(invalid(
                "eager seq",
                "sequence numbers do not rise within the frame",
            ));
        }
        last = Some(seq);
        if detached {
            detached_seen += 1;
            if detached_seen > EAGER_MAX_DETACHED {
                return Err(invalid(
                    "eager len",
                    "more detached messages in a frame than a comm has requests for",
                ));
            }
            out.push(EagerMessage {
                entry: EagerEntry { seq, len, detached },
                offset: 0,
            });
            continue;
        }
        if detached_seen > 0 {
            return Err(invalid(
                "eager len",
                "an inline message after a detached one in the same frame",
            ));
        }
        out.push(EagerMessage {
            entry: EagerEntry { seq, len, detached },
            offset,
        });
        let end = offset + len as usize;
        if end > frame.len() {
            return Err(WireError::Truncated {
                field: "eager payload",
                needed: end - offset,
                available: frame.len() - offset,
            });
        }
        offset = end;
    }
    Ok(offset)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn frame(messages: &[(u64, Vec<u8>)]) -> Vec<u8> {
        mixed(messages, &[])
    }

    #[test]
    fn a_frame_round_trips_its_messages_in_order() {
        let messages = vec![(3, vec![1; 10]), (4, vec![2; 4096]), (9, vec![3; 1])];
        let bytes = frame(&messages);
        let mut out = Vec::new();
        decode(&bytes, EAGER_MAX_MESSAGE, &mut out).unwrap();
        assert_eq!(out.len(), 3);
        for (m, (seq, payload)) in out.iter().zip(&messages) {
            assert_eq!(m.entry.seq, *seq);
            assert_eq!(
                &bytes[m.offset..m.offset + m.entry.len as usize],
                &payload[..]
            );
        }
    }

    #[test]
    fn malformed_frames_name_what_is_wrong() {
        let good = frame(&[(1, vec![7; 100]), (2, vec![8; 100])]);
        let mut out = Vec::new();
        let err = |bytes: &[u8], max| decode(bytes, max, &mut Vec::new()).unwrap_err().to_string();
        assert!(err(&good[..good.len() - 1], EAGER_MAX_MESSAGE).contains("payload"));
        // A plugin that reports no sizes hands over the whole posted buffer: what follows
        // the frame is not read.
        let mut long = good.clone();
        long.extend_from_slice(&[0xee; 100]);
        assert_eq!(decode(&long, EAGER_MAX_MESSAGE, &mut out), Ok(good.len()));
        assert!(err(&good, 99).contains("agreed eager size"));
        let mut magic = good.clone();
        magic[0] = b'X';
        assert!(err(&magic, EAGER_MAX_MESSAGE).contains("not an eager frame"));
        let backwards = frame(&[(5, vec![1]), (5, vec![2])]);
        assert!(err(&backwards, EAGER_MAX_MESSAGE).contains("rise"));
        let mut none = good.clone();
        none[4..8].copy_from_slice(&0u32.to_le_bytes());
        assert!(err(&none, EAGER_MAX_MESSAGE).contains("1 to 1024"));
        decode(&good, EAGER_MAX_MESSAGE, &mut out).unwrap();
        assert_eq!(out.len(), 2);
    }

    /// A frame of inline and detached messages as the sender builds it: entries, then the
    /// inline payloads only.
    fn mixed(inline: &[(u64, Vec<u8>)], detached: &[(u64, u32)]) -> Vec<u8> {
        let mut entries: Vec<_> = inline
            .iter()
            .map(|(seq, bytes)| EagerEntry {
                seq: *seq,
                len: bytes.len() as u32,
                detached: false,
            })
            .collect();
        entries.extend(detached.iter().map(|&(seq, len)| EagerEntry {
            seq,
            len,
            detached: true,
        }));
        let mut out = vec![0; header_len(entries.len())];
        write_header(&entries, &mut out);
        for (_, bytes) in inline {
            out.extend_from_slice(bytes);
        }
        out
    }

    #[test]
    fn detached_messages_take_an_entry_and_no_frame_bytes() {
        let bytes = mixed(&[(1, vec![5; 64])], &[(2, 65536), (3, 40000)]);
        let mut out = Vec::new();
        assert_eq!(
            decode(&bytes, EAGER_MAX_MESSAGE, &mut out),
            Ok(header_len(3) + 64)
        );
        let seen: Vec<_> = out
            .iter()
            .map(|m| (m.entry.seq, m.entry.len, m.entry.detached, m.offset))
            .collect();
        assert_eq!(
            seen,
            [
                (1, 64, false, header_len(3)),
                (2, 65536, true, 0),
                (3, 40000, true, 0)
            ]
        );
        // A frame of detached messages only is its header.
        let only = mixed(&[], &[(7, 65536)]);
        assert_eq!(
            decode(&only, EAGER_MAX_MESSAGE, &mut out),
            Ok(header_len(1))
        );
    }

    #[test]
    fn detached_messages_break_no_rule_of_the_frame() {
        let err = |bytes: &[u8]| {
            decode(bytes, EAGER_MAX_MESSAGE, &mut Vec::new())
                .unwrap_err()
                .to_string()
        };
        // An inline message after a detached one: the receiver would land it before the
        // detached one arrives.
        let mut bytes = mixed(&[(1, vec![1; 8]), (3, vec![2; 8])], &[]);
        let word = 8 | DETACHED;
        bytes[EAGER_HEADER_BYTES + 8..EAGER_HEADER_BYTES + 12].copy_from_slice(&word.to_le_bytes());
        assert!(err(&bytes).contains("after a detached"));
        let many: Vec<_> = (0..=EAGER_MAX_DETACHED as u64).map(|s| (s, 100)).collect();
        assert!(err(&mixed(&[], &many)).contains("requests"));
        assert!(err(&mixed(&[], &[(1, EAGER_MAX_MESSAGE + 1)])).contains("agreed eager size"));
        assert!(err(&mixed(&[], &[(1, 0)])).contains("agreed eager size"));
        let ok: Vec<_> = (0..EAGER_MAX_DETACHED as u64).map(|s| (s, 100)).collect();
        assert!(decode(&mixed(&[], &ok), EAGER_MAX_MESSAGE, &mut Vec::new()).is_ok());
    }

    #[test]
    fn runs_of_messages_rotate_over_the_channels() {
        assert_eq!(channel_of(0, 8), 0);
        assert_eq!(channel_of(EAGER_RUN - 1, 8), 0);
        assert_eq!(channel_of(EAGER_RUN, 8), 1);
        assert_eq!(channel_of(8 * EAGER_RUN, 8), 0);
        assert_eq!(channel_of(u64::MAX, 1), 0);
        assert_eq!(channel_of(5, 0), 0);
    }

    #[test]
    fn fits_keeps_frames_within_their_size_and_count() {
        assert!(fits(0, 0, EAGER_MAX_MESSAGE));
        let per = EAGER_MAX_MESSAGE as usize;
        // Three 64 KiB messages fit, the fourth would overrun the header's room.
        assert!(fits(2, 2 * per, EAGER_MAX_MESSAGE));
        assert!(!fits(3, 3 * per, EAGER_MAX_MESSAGE));
        assert!(!fits(EAGER_MAX_MESSAGES, 0, 1));
    }

    proptest! {
        /// Peer input: any bytes decode to an error or to entries that tile a prefix of them.
        #[test]
        fn any_bytes_decode_to_an_error_or_a_tiled_prefix(
            bytes in proptest::collection::vec(any::<u8>(), 0..2048),
            max in 1u32..=EAGER_MAX_MESSAGE,
        ) {
            let mut out = Vec::new();
            if let Ok(end) = decode(&bytes, max, &mut out) {
                let mut at = header_len(out.len());
                let mut detached = 0;
                for m in &out {
                    prop_assert!(m.entry.len >= 1 && m.entry.len <= max);
                    if m.entry.detached {
                        detached += 1;
                        prop_assert_eq!(m.offset, 0);
                        continue;
                    }
                    // Inline messages tile the frame and come before any detached one.
                    prop_assert_eq!(detached, 0);
                    prop_assert_eq!(m.offset, at);
                    at += m.entry.len as usize;
                }
                prop_assert!(detached <= EAGER_MAX_DETACHED);
                prop_assert_eq!(at, end);
                prop_assert!(end <= bytes.len());
            }
        }

        /// Valid frames, then one byte flipped: never a panic, and an unflipped frame
        /// decodes to what was written.
        #[test]
        fn frames_round_trip_and_survive_a_flipped_byte(
            lens in proptest::collection::vec(1usize..300, 1..20),
            flip in any::<prop::sample::Index>(),
        ) {
            let messages: Vec<(u64, Vec<u8>)> = lens
                .iter()
                .enumerate()
                .map(|(i, &l)| (i as u64 * 3 + 1, vec![i as u8; l]))
                .collect();
            let bytes = frame(&messages);
            let mut out = Vec::new();
            prop_assert_eq!(decode(&bytes, EAGER_MAX_MESSAGE, &mut out), Ok(bytes.len()));
            prop_assert_eq!(out.len(), messages.len());
            let mut flipped = bytes.clone();
            let i = flip.index(flipped.len());
            flipped[i] ^= 0xff;
            let _ = decode(&flipped, EAGER_MAX_MESSAGE, &mut out);
        }
    }
}
