//! The copies of small one-sided operations carried inline in control messages (see
//! [`crate::onesided`], "Small operations travel inline"): out of and into the blocks of an
//! operation, whatever memory they are in.
//!
//! Host memory (an emulated staged region included) is copied by the CPU; CUDA memory by the
//! GPU's [`tcpx::cuda::SmallCopier`], one synchronous copy per run of blocks in one region
//! (a few µs for 4 KiB on an H100, against a ring slot, an engine hand-off and a plugin
//! request on each side through the staged comms).

use tcpx::MemoryKind;

use crate::registry::Region;

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

/// Appends the bytes of the `(offset, len)` ranges of `region` to `out`.
pub(crate) fn read_ranges(
    region: &Region,
    ranges: impl IntoIterator<Item = (usize, usize)>,
    out: &mut Vec<u8>,
) -> tcpx::Result<()> {
    match region.kind() {
        MemoryKind::Host => region.memory().read_ranges(ranges, out),
        MemoryKind::Cuda => region
            .small_copier()?
            .read_ranges(region.memory(), ranges, out),
    }
}

/// Copies each `(offset, bytes)` piece into `region`.
pub(crate) fn write_ranges<'a>(
    region: &Region,
    pieces: impl IntoIterator<Item = (usize, &'a [u8])>,
) -> tcpx::Result<()> {
    match region.kind() {
        MemoryKind::Host => region.memory().write_ranges(pieces),
        MemoryKind::Cuda => region.small_copier()?.write_ranges(region.memory(), pieces),
    }
}

/// Copies inline data (a write's on the target, a read's on the initiator) into its pieces
/// `(region, offset, len)`, in order: one operation on each region per run of pieces in it.
/// The pieces' lengths add up to `data`'s (checked when the request came).
pub(crate) fn land(pieces: &[(Region, usize, usize)], data: &[u8]) -> tcpx::Result<()> {
    let mut at = 0;
    for run in pieces.chunk_by(|a, b| a.0.same(&b.0)) {
        let ranges = run.iter().map(|&(_, offset, len)| {
            let piece = (offset, &data[at..at + len]);
            at += len;
            piece
        });
        write_ranges(&run[0].0, ranges)?;
    }
    Ok(())
}

/// Appends the bytes of `pieces` `(region, offset, len)` to `out`, in order: one operation on
/// each region per run of pieces in it.
pub(crate) fn gather(pieces: &[(Region, usize, usize)], out: &mut Vec<u8>) -> tcpx::Result<()> {
    for run in pieces.chunk_by(|a, b| a.0.same(&b.0)) {
        read_ranges(
            &run[0].0,
            run.iter().map(|&(_, offset, len)| (offset, len)),
            out,
        )?;
    }
    Ok(())
}
