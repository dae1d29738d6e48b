//! Properties of the chunk schedule: both peers derive the same per-channel posting order,
//! and every chunk is one contiguous piece on both sides.

use proptest::prelude::*;
use tcpx_runtime::schedule::{Chunk, Schedule, SPREAD_FLOOR_BYTES};

/// Segment lengths (zeros included) and a chunk size small enough to give many chunks.
fn lens() -> impl Strategy<Value = Vec<u64>> {
    proptest::collection::vec(prop_oneof![1 => Just(0u64), 8 => 1u64..5000], 0..12)
}

/// A second list with the same total, cut at other places.
fn split(total: u64, cuts: Vec<u64>) -> Vec<u64> {
    let mut points: Vec<u64> = cuts.into_iter().map(|c| c % (total + 1)).collect();
    points.sort_unstable();
    let mut out = Vec::with_capacity(points.len() + 1);
    let mut prev = 0;
    for p in points {
        out.push(p - prev);
        prev = p;
    }
    out.push(total - prev);
    out
}

fn boundaries(lens: &[u64]) -> Vec<u64> {
    lens.iter()
        .scan(0u64, |acc, l| {
            *acc += l;
            Some(*acc)
        })
        .collect()
}

fn per_channel(s: &Schedule) -> Vec<Vec<u32>> {
    (0..s.channels())
        .map(|c| s.on_channel(c).map(|ch| ch.len).collect())
        .collect()
}

fn check_against_local(s: &Schedule, local: &[u64], remote: &[u64]) -> Result<(), TestCaseError> {
    let chunks: Vec<Chunk> = s.iter().collect();
    prop_assert_eq!(chunks.len() as u64, s.chunk_count());
    prop_assert_eq!(s.iter().size_hint(), (chunks.len(), Some(chunks.len())));
    let local_starts: Vec<u64> = std::iter::once(0).chain(boundaries(local)).collect();
    let mut cuts = boundaries(local);
    cuts.extend(boundaries(remote));
    let mut pos = 0u64;
    for (i, c) in chunks.iter().enumerate() {
        // Tiling: chunks follow one another without gap or overlap.
        prop_assert_eq!(c.index, i as u64);
        prop_assert_eq!(c.offset, pos);
        prop_assert!(c.len >= 1 && c.len <= s.chunk_bytes());
        prop_assert_eq!(
            c.channel as u64,
            (c.index + u64::from(s.first_channel())) % u64::from(s.channels())
        );
        let end = c.offset + u64::from(c.len);
        // No boundary of either side falls strictly inside a chunk.
        prop_assert!(
            !cuts.iter().any(|&b| c.offset < b && b < end),
            "chunk {c:?} spans a boundary"
        );
        // The local mapping points into the right segment.
        prop_assert!(c.segment_offset + u64::from(c.len) <= local[c.segment]);
        prop_assert_eq!(local_starts[c.segment] + c.segment_offset, c.offset);
        // Random access agrees with iteration.
        prop_assert_eq!(s.chunk(c.index), Some(*c));
        pos = end;
    }
    prop_assert_eq!(pos, s.total_len());
    prop_assert_eq!(s.chunk(s.chunk_count()), None);
    let total_on_channels: u64 = (0..s.channels()).map(|c| s.chunk_count_on(c)).sum();
    prop_assert_eq!(total_on_channels, s.chunk_count());
    for ch in 0..s.channels() {
        // The per-channel view is exactly the channel's chunks, in order.
        let from_iter: Vec<Chunk> = chunks.iter().filter(|c| c.channel == ch).copied().collect();
        let from_channel: Vec<Chunk> = s.on_channel(ch).collect();
        prop_assert_eq!(&from_iter, &from_channel);
        prop_assert_eq!(s.chunk_count_on(ch), from_iter.len() as u64);
        if let Some(first) = from_iter.first() {
            prop_assert_eq!(s.first_index_on(ch), first.index);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn contiguous_chunks_tile_the_transfer(
        len in 0u64..100_000,
        chunk in 1u32..20_000,
        channels in 1u16..9,
    ) {
        let s = Schedule::contiguous(len, chunk, channels).unwrap();
        check_against_local(&s, &[len], &[len])?;
        prop_assert_eq!(s.chunk_count(), len.div_ceil(u64::from(chunk)));
    }

    #[test]
    fn both_sides_derive_the_same_per_channel_order(
        local in lens(),
        cuts in proptest::collection::vec(any::<u64>(), 0..12),
        chunk in 1u32..3000,
        channels in 1u16..9,
        rotation in any::<u64>(),
    ) {
        let total: u64 = local.iter().sum();
        let remote = split(total, cuts);
        let mine = Schedule::vectored(&local, &remote, chunk, channels).unwrap().rotated(rotation);
        let theirs = Schedule::vectored(&remote, &local, chunk, channels).unwrap().rotated(rotation);
        check_against_local(&mine, &local, &remote)?;
        check_against_local(&theirs, &remote, &local)?;
        prop_assert_eq!(per_channel(&mine), per_channel(&theirs));
        let offsets = |s: &Schedule| s.iter().map(|c| (c.offset, c.len)).collect::<Vec<_>>();
        prop_assert_eq!(offsets(&mine), offsets(&theirs));
    }

    #[test]
    fn spread_schedules_agree_and_tile(
        local in proptest::collection::vec(prop_oneof![1 => Just(0u64), 8 => 1u64..700_000], 0..6),
        cuts in proptest::collection::vec(any::<u64>(), 0..6),
        chunk in prop_oneof![Just(512u32 << 10), Just(1u32 << 20), 100_000u32..1_200_000],
        channels in 1u16..17,
        width in 0u16..20,
        rotation in any::<u64>(),
    ) {
        let total: u64 = local.iter().sum();
        let remote = split(total, cuts);
        let build = |a: &[u64], b: &[u64]| {
            Schedule::vectored(a, b, chunk, channels).unwrap().spread_over(width).rotated(rotation)
        };
        let (mine, theirs) = (build(&local, &remote), build(&remote, &local));
        check_against_local(&mine, &local, &remote)?;
        check_against_local(&theirs, &remote, &local)?;
        prop_assert_eq!(per_channel(&mine), per_channel(&theirs));
        // The cut lies between the floor and the chunk size; spreading only ever cuts finer.
        let plain = Schedule::vectored(&local, &remote, chunk, channels).unwrap();
        prop_assert!(mine.cut_bytes() <= chunk);
        prop_assert!(mine.cut_bytes() >= chunk.min(SPREAD_FLOOR_BYTES));
        prop_assert!(mine.chunk_count() >= plain.chunk_count());
        let w = u64::from(width.min(channels));
        if w <= 1 || chunk <= SPREAD_FLOOR_BYTES {
            prop_assert_eq!(mine.cut_bytes(), chunk);
        } else if local.len() <= 1 && total >= w * u64::from(SPREAD_FLOOR_BYTES)
            && total < w * u64::from(chunk) && remote.iter().filter(|&&l| l > 0).count() <= 1
        {
            // One contiguous transfer of fewer than `w` chunks rides exactly `w` channels.
            prop_assert_eq!(mine.chunk_count(), w);
        }
    }

    #[test]
    fn different_totals_are_refused(
        local in lens(),
        remote in lens(),
    ) {
        let (l, r): (u64, u64) = (local.iter().sum(), remote.iter().sum());
        prop_assume!(l != r);
        prop_assert!(Schedule::vectored(&local, &remote, 64, 2).is_err());
    }
}
