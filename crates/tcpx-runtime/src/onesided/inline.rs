//! The copies of small one-sided operations carried inline in control messages (see
//! [`crate::onesided`], "Small operations travel inline"): out of and into the blocks of an
//! operation, whatever memory they are in.
//!
//! Host memory (an emulated staged region included) is copied by the CPU, one operation per
//! run of blocks in one region; CUDA memory by its GPU's [`tcpx::cuda::SmallCopier`], one
//! synchronous copy per run of blocks on one GPU, whatever regions they are in: a GPU round
//! trip costs 6.5–8 µs on an H200 whatever the size, and a list of small tensors, each
//! registered on its own (UCCL's `writev`), would otherwise pay one per tensor.

use tcpx::MemoryKind;

use crate::registry::{Region, Segment};

/// Whether the bytes of `region` can travel inline: CPU-accessible memory, or CUDA memory
/// whose GPU's small copier this process has (found once per region, then kept with it).
/// Anything else goes through the comms on the initiator's side, and is refused
/// (`UnsupportedMemory`) on the target's, rather than failing the connection when the copy
/// cannot be made.
pub(crate) fn copyable(region: &Region) -> bool {
    match region.kind() {
        MemoryKind::Host => true,
        MemoryKind::Cuda => region.small_copier().is_ok(),
    }
}

/// One block of an inline operation: where in which region.
pub(crate) trait Piece {
    fn region(&self) -> &Region;
    fn offset(&self) -> usize;
    fn len(&self) -> usize;
}

impl Piece for (Region, usize, usize) {
    fn region(&self) -> &Region {
        &self.0
    }
    fn offset(&self) -> usize {
        self.1
    }
    fn len(&self) -> usize {
        self.2
    }
}

impl Piece for Segment<'_> {
    fn region(&self) -> &Region {
        self.region
    }
    fn offset(&self) -> usize {
        self.offset
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// Appends the bytes of `pieces` to `out`, in order.
pub(crate) fn gather<P: Piece>(pieces: &[P], out: &mut Vec<u8>) -> tcpx::Result<()> {
    for run in pieces.chunk_by(|a, b| a.region().copied_with(b.region())) {
        let region = run[0].region();
        let ranges = run.iter().map(|p| (p.offset(), p.len()));
        match region.kind() {
            MemoryKind::Host => region.memory().read_ranges(ranges, out)?,
            MemoryKind::Cuda => region.small_copier()?.gather(
                run.iter()
                    .map(|p| (p.region().memory(), p.offset(), p.len())),
                out,
            )?,
        }
    }
    Ok(())
}

/// Copies inline data (a write's on the target, a read's on the initiator) into its
/// `pieces`, in order. The pieces' lengths add up to `data`'s (checked when the request
/// came).
pub(crate) fn land<P: Piece>(pieces: &[P], data: &[u8]) -> tcpx::Result<()> {
    let mut at = 0;
    for run in pieces.chunk_by(|a, b| a.region().copied_with(b.region())) {
        let region = run[0].region();
        // Each piece's bytes, in order: the runs share one cursor into `data`.
        let start = at;
        at += run.iter().map(Piece::len).sum::<usize>();
        let mut cursor = start;
        let bytes = run.iter().map(move |p| {
            let piece = &data[cursor..cursor + p.len()];
            cursor += p.len();
            (p, piece)
        });
        match region.kind() {
            MemoryKind::Host => region
                .memory()
                .write_ranges(bytes.map(|(p, piece)| (p.offset(), piece)))?,
            MemoryKind::Cuda => region
                .small_copier()?
                .scatter(bytes.map(|(p, piece)| (p.region().memory(), p.offset(), piece)))?,
        }
    }
    Ok(())
}
