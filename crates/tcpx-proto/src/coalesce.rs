//! Merging list entries that are contiguous in one region (sans-IO).
//!
//! Both sides of a one-sided operation run this on the remote list independently (the
//! initiator to derive the schedule, the target to build its job), so it must be a pure
//! function of the list: same input, same runs. A batch of adjacent 16 KiB KV-cache blocks
//! thus travels as a few chunk-sized plugin requests instead of one request per block.

/// A stretch of consecutive entries that are contiguous in one region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    /// Index of the run's first entry (its region is the run's region).
    pub first: usize,
    /// Offset of the run in its region.
    pub offset: u64,
    /// Bytes in the run.
    pub len: u64,
}

/// Merges consecutive `(region identity, offset, len)` entries where each starts where the
/// previous one ended in the same region. Zero-length entries are dropped.
pub fn coalesce(entries: impl IntoIterator<Item = (u64, u64, u64)>) -> Vec<Run> {
    let mut runs: Vec<Run> = Vec::new();
    let mut last_region = None;
    for (index, (region, offset, len)) in entries.into_iter().enumerate() {
        if len == 0 {
            continue;
        }
        if let Some(run) = runs.last_mut() {
            if last_region == Some(region) && run.offset.checked_add(run.len) == Some(offset) {
                // No overflow: offset + len of an entry is checked by whoever built it, and
                // a sum past u64::MAX stays a separate run.
                if let Some(merged) = run.len.checked_add(len) {
                    run.len = merged;
                    continue;
                }
            }
        }
        runs.push(Run {
            first: index,
            offset,
            len,
        });
        last_region = Some(region);
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adjacent_blocks_of_one_region_merge() {
        let runs = coalesce([
            (1, 0, 4),
            (1, 4, 4),
            (1, 12, 4),
            (2, 16, 4),
            (2, 20, 0),
            (2, 20, 4),
        ]);
        assert_eq!(
            runs,
            [
                Run {
                    first: 0,
                    offset: 0,
                    len: 8
                },
                Run {
                    first: 2,
                    offset: 12,
                    len: 4
                },
                Run {
                    first: 3,
                    offset: 16,
                    len: 8
                },
            ]
        );
    }

    #[test]
    fn out_of_order_blocks_do_not_merge() {
        assert_eq!(coalesce([(1, 4, 4), (1, 0, 4)]).len(), 2);
        assert_eq!(coalesce([(1, 0, 4), (2, 4, 4)]).len(), 2);
        assert!(coalesce([(1, 0, 0)]).is_empty());
    }
}
