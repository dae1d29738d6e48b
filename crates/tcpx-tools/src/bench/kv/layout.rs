//! Where a shape's blocks sit and what they hold.
//!
//! Every region (the target's, the initiator's source, the initiator's read destination) is
//! 3 × N × B bytes: a scattered area of 2N block slots, of which the N even slots hold the
//! blocks in a shuffled order — so no two blocks of a list are adjacent and nothing
//! coalesces, as in a paged KV cache — and a contiguous area of N × B after it for the
//! one-block reference. Each side shuffles with its own seed, so block j sits at a
//! different place on each side.
//!
//! Block j holds bytes `j·B .. (j+1)·B` of the benchmark pattern and the contiguous area the
//! pattern from 0, so a block landing in the wrong slot, or half a block, is caught.

use super::Shape;
use crate::bench::pair::pattern_byte;

/// Which side a list of offsets belongs to (each shuffles with its own seed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The target's advertised region.
    Target,
    /// The initiator's source of writes and sends.
    Source,
    /// The initiator's destination of reads.
    Back,
}

/// One shape's placement.
#[derive(Clone, Debug)]
pub struct Layout {
    /// The shape.
    pub shape: Shape,
    /// Byte offset of block j in the region, for each j.
    pub offsets: Vec<usize>,
}

impl Layout {
    /// The placement of `shape`'s blocks on `side`.
    pub fn new(shape: Shape, side: Side) -> Self {
        let seed = (shape.blocks as u64) << 40 ^ (shape.block as u64) << 4 ^ side as u64;
        let mut rng = SplitMix(seed);
        let mut slots: Vec<usize> = (0..shape.blocks).map(|k| 2 * k).collect();
        for i in (1..slots.len()).rev() {
            let j = (rng.next() % (i as u64 + 1)) as usize;
            slots.swap(i, j);
        }
        Self {
            shape,
            offsets: slots.into_iter().map(|s| s * shape.block).collect(),
        }
    }

    /// Bytes of the region: the scattered area and the contiguous area.
    pub fn region_len(&self) -> usize {
        3 * self.shape.bytes()
    }

    /// Bytes of the scattered area (2N slots), which starts at 0.
    pub fn scattered_len(&self) -> usize {
        2 * self.shape.bytes()
    }

    /// Where the contiguous area starts.
    pub fn contiguous_offset(&self) -> usize {
        self.scattered_len()
    }

    /// The region's intended content: the pattern in every block and in the contiguous area,
    /// zeros in the empty slots.
    pub fn image(&self) -> Vec<u8> {
        let n = self.shape.bytes();
        let pattern = pattern(n);
        let mut image = vec![0u8; self.region_len()];
        let b = self.shape.block;
        for (j, &off) in self.offsets.iter().enumerate() {
            image[off..off + b].copy_from_slice(&pattern[j * b..(j + 1) * b]);
        }
        image[2 * n..].copy_from_slice(&pattern);
        image
    }

    /// Checks the scattered area (`area` = bytes `0 .. scattered_len()` of the region).
    pub fn check_scattered(&self, area: &[u8]) -> Verdict {
        let b = self.shape.block;
        let pattern = pattern(self.shape.bytes());
        for (j, &off) in self.offsets.iter().enumerate() {
            let want = &pattern[j * b..(j + 1) * b];
            let got = &area[off..off + b];
            if got != want {
                let i = first_difference(got, want);
                return Verdict::BlockDiffers { block: j, byte: i };
            }
        }
        Verdict::Ok
    }

    /// Checks the contiguous area (`area` = its N × B bytes).
    pub fn check_contiguous(&self, area: &[u8]) -> Verdict {
        let pattern = pattern(self.shape.bytes());
        if area == pattern.as_slice() {
            Verdict::Ok
        } else {
            Verdict::ContiguousDiffers {
                byte: first_difference(area, &pattern),
            }
        }
    }
}

/// What a check found; travels in the server's VERDICT message as three words.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Every byte (and every notification) as expected.
    Ok,
    /// Block `block` of the list differs at byte `byte`.
    BlockDiffers {
        /// Index in the list.
        block: usize,
        /// Byte in the block.
        byte: usize,
    },
    /// The contiguous transfer differs at byte `byte`.
    ContiguousDiffers {
        /// Byte in the transfer.
        byte: usize,
    },
    /// The target got `got` of the phase's notifications in order, not `want`.
    Notifications {
        /// Notifications that arrived during the phase.
        got: usize,
        /// How many were expected.
        want: usize,
    },
}

impl Verdict {
    /// The words of the VERDICT message.
    pub fn to_words(self) -> [u64; 3] {
        match self {
            Verdict::Ok => [0, 0, 0],
            Verdict::BlockDiffers { block, byte } => [1, block as u64, byte as u64],
            Verdict::ContiguousDiffers { byte } => [2, byte as u64, 0],
            Verdict::Notifications { got, want } => [3, got as u64, want as u64],
        }
    }

    /// Decodes [`Verdict::to_words`]; `None` for anything else.
    pub fn from_words(w: [u64; 3]) -> Option<Self> {
        Some(match w[0] {
            0 => Verdict::Ok,
            1 => Verdict::BlockDiffers {
                block: w[1] as usize,
                byte: w[2] as usize,
            },
            2 => Verdict::ContiguousDiffers {
                byte: w[1] as usize,
            },
            3 => Verdict::Notifications {
                got: w[1] as usize,
                want: w[2] as usize,
            },
            _ => return None,
        })
    }

    /// The verdict as a sentence (`None` when all is well).
    pub fn describe(self, what: &str) -> Option<String> {
        match self {
            Verdict::Ok => None,
            Verdict::BlockDiffers { block, byte } => Some(format!(
                "verification failed: {what}: block {block} of the list differs at byte {byte}"
            )),
            Verdict::ContiguousDiffers { byte } => Some(format!(
                "verification failed: {what}: the transfer differs at byte {byte}"
            )),
            Verdict::Notifications { got, want } => Some(format!(
                "{what}: the target got {got} notifications in order, expected {want}"
            )),
        }
    }

    /// Whether this is a data difference (exit 4) rather than a lost notification.
    pub fn is_data(self) -> bool {
        matches!(
            self,
            Verdict::BlockDiffers { .. } | Verdict::ContiguousDiffers { .. }
        )
    }
}

/// The first `n` bytes of the pattern.
fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(pattern_byte).collect()
}

fn first_difference(a: &[u8], b: &[u8]) -> usize {
    a.iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .unwrap_or(a.len().min(b.len()))
}

/// splitmix64: a small, well-mixed generator for reproducible shuffles (both processes
/// compute the same placement from the shape alone).
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(blocks: usize, block: usize) -> Shape {
        Shape::new(blocks, block).unwrap()
    }

    #[test]
    fn blocks_are_scattered_shuffled_and_never_adjacent() {
        let s = shape(64, 4096);
        let t = Layout::new(s, Side::Target);
        let mut sorted = t.offsets.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 64, "distinct slots");
        assert!(
            sorted.windows(2).all(|w| w[1] - w[0] >= 2 * 4096),
            "never adjacent"
        );
        assert!(*sorted.last().unwrap() + 4096 <= t.scattered_len());
        assert_ne!(sorted, t.offsets, "shuffled");
        let src = Layout::new(s, Side::Source);
        assert_ne!(src.offsets, t.offsets, "each side has its own placement");
        assert_eq!(
            Layout::new(s, Side::Target).offsets,
            t.offsets,
            "reproducible"
        );
    }

    #[test]
    fn the_image_passes_its_checks_and_a_moved_block_does_not() {
        let l = Layout::new(shape(16, 512), Side::Back);
        let mut image = l.image();
        let (scattered, contiguous) = image.split_at(l.contiguous_offset());
        assert_eq!(l.check_scattered(scattered), Verdict::Ok);
        assert_eq!(l.check_contiguous(contiguous), Verdict::Ok);
        // Swap the first two blocks of the list: both are intact, but misplaced.
        let (a, b) = (l.offsets[0], l.offsets[1]);
        for i in 0..512 {
            image.swap(a + i, b + i);
        }
        assert!(matches!(
            l.check_scattered(&image[..l.scattered_len()]),
            Verdict::BlockDiffers { block: 0, .. }
        ));
        image[l.contiguous_offset() + 700] ^= 1;
        assert_eq!(
            l.check_contiguous(&image[l.contiguous_offset()..]),
            Verdict::ContiguousDiffers { byte: 700 }
        );
    }

    proptest::proptest! {
        /// Any shape: N distinct, never adjacent, in-bounds block slots on every side, and
        /// the image passes its own checks.
        #[test]
        fn every_shape_places_its_blocks_apart(blocks in 1usize..300, block in 1usize..3000) {
            let s = shape(blocks, block);
            for side in [Side::Target, Side::Source, Side::Back] {
                let l = Layout::new(s, side);
                let mut sorted = l.offsets.clone();
                sorted.sort_unstable();
                sorted.dedup();
                proptest::prop_assert_eq!(sorted.len(), blocks);
                proptest::prop_assert!(sorted.windows(2).all(|w| w[1] - w[0] >= 2 * block));
                proptest::prop_assert!(sorted.iter().all(|&o| o % block == 0 && o + block <= l.scattered_len()));
                let image = l.image();
                let (scattered, contiguous) = image.split_at(l.contiguous_offset());
                proptest::prop_assert_eq!(l.check_scattered(scattered), Verdict::Ok);
                proptest::prop_assert_eq!(l.check_contiguous(contiguous), Verdict::Ok);
            }
        }

        /// A verdict comes from the peer: any three words decode to a verdict or to nothing,
        /// never a panic, and what decodes encodes back to the same words.
        #[test]
        fn any_verdict_words_decode_without_panic(w in proptest::array::uniform3(proptest::num::u64::ANY)) {
            if let Some(v) = Verdict::from_words(w) {
                let again = Verdict::from_words(v.to_words());
                proptest::prop_assert_eq!(again, Some(v));
                let _ = v.describe("write scattered");
            }
        }
    }

    #[test]
    fn verdicts_round_trip() {
        for v in [
            Verdict::Ok,
            Verdict::BlockDiffers { block: 3, byte: 9 },
            Verdict::ContiguousDiffers { byte: 5 },
            Verdict::Notifications { got: 1, want: 2 },
        ] {
            assert_eq!(Verdict::from_words(v.to_words()), Some(v));
        }
        assert_eq!(Verdict::from_words([9, 0, 0]), None);
    }
}
