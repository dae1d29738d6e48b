//! The remote list of a one-sided operation as its request carries it: segments that follow
//! one another in one advertised region (same region, same access key, each starting where
//! the one before ends) travel as one entry.
//!
//! Why the initiator merges them: the target validated, coalesced and held a region handle
//! for every entry, and every entry was 32 bytes of the request both control loops move.
//! A list of 32 adjacent 4 KiB blocks was a 1 KiB request for what is one run of 128 KiB;
//! at 32 operations in flight both control loops spent most of their time moving those
//! requests, and the two control hops of a write took 45–60 µs against 12 alone
//! (docs/RESULTS.md, thirty-fourth session). Merged, the same writes and reads moved 14–19 %
//! more in an alternated comparison (0.85 / 0.82 → 0.97 / 0.98 × a two-sided send of the
//! same bytes). The target still coalesces what it receives (an older initiator sends every
//! segment), so the wire format and the schedule both sides derive do not change.
//!
//! What the merge costs: a refusal names an entry of the request, which may stand for several
//! of the caller's segments. [`SegmentMap`] maps it back to the first of them and says which
//! segments the entry covered, so the error still says where.

use super::descriptor::RemoteSegment;
use crate::control::rma::{Refusal, RemoteEntry};

/// How the entries of a request map back to the caller's remote segments.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct SegmentMap {
    /// The index of each entry's first segment, and the segment count after the last; empty
    /// when no two segments merged (entry `i` is segment `i`), so that a scattered list, the
    /// usual one, carries no map.
    firsts: Box<[u32]>,
}

impl SegmentMap {
    /// The caller's segment index to report for `refusal`, and its reason: naming the
    /// segments the refused entry stood for when it stood for several.
    pub(crate) fn name(&self, refusal: &Refusal) -> (usize, String) {
        let index = refusal.index as usize;
        let reason = refusal.reason.to_string();
        match (self.firsts.get(index), self.firsts.get(index + 1)) {
            (Some(&first), Some(&end)) if end > first + 1 => (
                first as usize,
                format!(
                    "{reason} (in remote segments {first}..={}, adjacent in one region and \
                     checked as one)",
                    end - 1
                ),
            ),
            (Some(&first), _) => (first as usize, reason),
            (None, _) => (index, reason),
        }
    }
}

/// The request entries of `remote`, adjacent segments merged, and the map back to them.
pub(crate) fn remote_entries(remote: &[RemoteSegment]) -> (Vec<RemoteEntry>, SegmentMap) {
    let mut entries: Vec<RemoteEntry> = Vec::with_capacity(remote.len());
    // Filled only once a merge happens: until then entry `i` is segment `i`.
    let mut firsts: Vec<u32> = Vec::new();
    for (index, segment) in remote.iter().enumerate() {
        let entry = RemoteEntry {
            region_id: segment.descriptor.region_id(),
            key: segment.descriptor.key(),
            offset: segment.offset,
            len: segment.len,
        };
        if let Some(last) = entries.last_mut() {
            if let Some(len) = follows(last, &entry) {
                last.len = len;
                if firsts.is_empty() {
                    firsts.extend(0..entries.len() as u32);
                }
                continue;
            }
        }
        if !firsts.is_empty() {
            firsts.push(index as u32);
        }
        entries.push(entry);
    }
    if !firsts.is_empty() {
        firsts.push(remote.len() as u32);
    }
    let map = SegmentMap {
        firsts: firsts.into_boxed_slice(),
    };
    (entries, map)
}

/// The merged length when `next` continues `last` in the same region under the same key
/// (never across an overflow: such an entry is the target's to refuse, as it is).
fn follows(last: &RemoteEntry, next: &RemoteEntry) -> Option<u64> {
    let same_region = last.region_id == next.region_id && last.key == next.key;
    if same_region && last.offset.checked_add(last.len) == Some(next.offset) {
        last.len.checked_add(next.len)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::rma::RefusalReason;
    use crate::onesided::descriptor::Descriptor;
    use proptest::prelude::*;

    fn descriptor(region_id: u64, key: u64) -> Descriptor {
        Descriptor::new(region_id, 1 << 40, tcpx::MemoryKind::Host, key)
    }

    /// The model: each segment its own entry, then merged pairwise as the rule says.
    fn model(remote: &[RemoteSegment]) -> Vec<(u64, u64, u64, u64, Vec<usize>)> {
        let mut out: Vec<(u64, u64, u64, u64, Vec<usize>)> = Vec::new();
        for (i, s) in remote.iter().enumerate() {
            let (id, key) = (s.descriptor.region_id(), s.descriptor.key());
            match out.last_mut() {
                Some(last)
                    if last.0 == id
                        && last.1 == key
                        && last.2.checked_add(last.3) == Some(s.offset)
                        && last.3.checked_add(s.len).is_some() =>
                {
                    last.3 += s.len;
                    last.4.push(i);
                }
                _ => out.push((id, key, s.offset, s.len, vec![i])),
            }
        }
        out
    }

    fn segments() -> impl Strategy<Value = Vec<RemoteSegment>> {
        // Few regions, keys and offsets, so that adjacency happens often.
        prop::collection::vec((0u64..3, 0u64..2, 0u64..8, 1u64..4), 1..40).prop_map(|raw| {
            let mut at = 0;
            raw.into_iter()
                .map(|(region, key, jump, len)| {
                    // A jump of 0 or 1 continues the previous segment; more leaves a gap.
                    if jump > 1 {
                        at += jump;
                    }
                    let s = RemoteSegment::new(descriptor(region, key), at * 4096, len * 4096);
                    at += len;
                    s
                })
                .collect()
        })
    }

    proptest! {
        /// Entries match the model, cover the same bytes in the same order, and every
        /// refusal of an entry names the first segment it stands for.
        #[test]
        fn entries_merge_adjacent_segments_and_map_back(remote in segments()) {
            let (entries, map) = remote_entries(&remote);
            let want = model(&remote);
            prop_assert_eq!(entries.len(), want.len());
            for (index, (entry, (id, key, offset, len, covered))) in
                entries.iter().zip(&want).enumerate()
            {
                prop_assert_eq!((entry.region_id, entry.key, entry.offset, entry.len),
                    (*id, *key, *offset, *len));
                let refusal = Refusal { index: index as u32, reason: RefusalReason::OutOfBounds };
                let (named, reason) = map.name(&refusal);
                prop_assert_eq!(named, covered[0]);
                prop_assert_eq!(covered.len() > 1, reason.contains("adjacent"), "{}", reason);
            }
            let total: u64 = remote.iter().map(|s| s.len).sum();
            prop_assert_eq!(entries.iter().map(|e| e.len).sum::<u64>(), total);
        }
    }

    #[test]
    fn a_scattered_list_carries_no_map() {
        let d = descriptor(1, 7);
        let remote = [
            RemoteSegment::new(d, 0, 4096),
            RemoteSegment::new(d, 8192, 4096),
        ];
        let (entries, map) = remote_entries(&remote);
        assert_eq!(entries.len(), 2);
        assert_eq!(map, SegmentMap::default());
        let refusal = Refusal {
            index: 1,
            reason: RefusalReason::Revoked,
        };
        assert_eq!(map.name(&refusal).0, 1);
    }

    #[test]
    fn segments_under_another_key_or_region_stay_apart() {
        let remote = [
            RemoteSegment::new(descriptor(1, 7), 0, 4096),
            RemoteSegment::new(descriptor(1, 8), 4096, 4096),
            RemoteSegment::new(descriptor(2, 8), 8192, 4096),
        ];
        assert_eq!(remote_entries(&remote).0.len(), 3);
    }

    #[test]
    fn a_merge_that_would_overflow_is_left_to_the_target() {
        let d = descriptor(1, 7);
        let remote = [
            RemoteSegment::new(d, 0, u64::MAX),
            RemoteSegment::new(d, u64::MAX, 1),
        ];
        // u64::MAX + 0 ends at u64::MAX, where the next starts: the sum of lengths overflows.
        assert_eq!(remote_entries(&remote).0.len(), 2);
    }
}
