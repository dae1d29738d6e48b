//! [`PackedRanges`]: many ranges of host memory seen as one stream, copied into or out of a
//! buffer stretch by stretch, by several threads at once (engines packing a list of small
//! blocks into a pack buffer, each the chunks of its own channel).

use crate::error::{Error, Result};
use crate::memory::{MemoryKind, Operation, SharedMemory};

/// Ranges of host memory, in order, read or written as one contiguous stream.
///
/// Built once, by the thread that submits the list: every range is checked against its
/// memory there (kind, bounds), and its start address recorded, so the threads that move the
/// list copy any stretch of the stream ([`PackedRanges::copy`]) with one search and no
/// per-range checks or virtual calls, touching only the list, the bytes and each memory's
/// in-flight counter.
///
/// The memories stay alive as long as the list. As with [`SharedMemory::copy_ranges`], each
/// copy counts as an operation in flight on the memories it touches (once per run of
/// consecutive ranges in one memory), so it fails with `Busy` while the CPU holds a slice of
/// one of them, and a slice cannot be taken while it runs.
#[derive(Debug)]
pub struct PackedRanges {
    /// Distinct memories: one per run of consecutive ranges in one memory.
    memories: Vec<SharedMemory>,
    ranges: Vec<Range>,
    total: u64,
}

#[derive(Debug, Clone, Copy)]
struct Range {
    /// Index into `memories`.
    memory: u32,
    /// Address of the range's first byte.
    addr: usize,
    len: usize,
    /// Offset of its first byte in the stream.
    start: u64,
}

impl PackedRanges {
    /// The stream of `(memory, offset, len)` ranges, in order; each must lie inside its host
    /// memory and be non-empty.
    pub fn new<'m>(
        ranges: impl IntoIterator<Item = (&'m SharedMemory, usize, usize)>,
    ) -> Result<Self> {
        const API: &str = "PackedRanges::new";
        let mut memories: Vec<SharedMemory> = Vec::new();
        let mut list = Vec::new();
        let mut total = 0u64;
        for (i, (memory, offset, len)) in ranges.into_iter().enumerate() {
            if memory.kind() != MemoryKind::Host {
                return Err(Error::invalid(
                    API,
                    format!(
                        "range {i}: {:?} memory is not CPU-accessible",
                        memory.kind()
                    ),
                ));
            }
            if len == 0 {
                return Err(Error::invalid(API, format!("range {i} is empty")));
            }
            memory.check_range(API, offset, len)?;
            if !memories.last().is_some_and(|m| m.same_as(memory)) {
                memories.push(memory.clone());
            }
            let index = u32::try_from(memories.len() - 1)
                .map_err(|_| Error::invalid(API, "more than 2^32 memories in one list"))?;
            list.push(Range {
                memory: index,
                addr: memory.as_ptr() as usize + offset,
                len,
                start: total,
            });
            total += len as u64;
        }
        Ok(Self {
            memories,
            ranges: list,
            total,
        })
    }

    /// Bytes in the stream.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Copies the stream's `len` bytes from `offset` into `buffer` at `at` (`into_buffer`: a
    /// gather) or from `buffer` at `at` into the ranges (a scatter). `buffer` must be host
    /// memory; both spans must lie inside what they name. Returns the bytes copied (`len`).
    pub fn copy(
        &self,
        buffer: &SharedMemory,
        at: usize,
        offset: u64,
        len: usize,
        into_buffer: bool,
    ) -> Result<usize> {
        const API: &str = "PackedRanges::copy";
        if buffer.kind() != MemoryKind::Host {
            return Err(Error::invalid(
                API,
                format!("{:?} memory is not CPU-accessible", buffer.kind()),
            ));
        }
        buffer.check_range(API, at, len)?;
        if offset
            .checked_add(len as u64)
            .is_none_or(|end| end > self.total)
        {
            return Err(Error::invalid(
                API,
                format!(
                    "{len} bytes at offset {offset} of a stream of {} bytes",
                    self.total
                ),
            ));
        }
        let _buffer_op = buffer.borrow_operation(API)?;
        let base = buffer.as_ptr();
        // The first range that ends past `offset`.
        let first = self
            .ranges
            .partition_point(|r| r.start + r.len as u64 <= offset);
        let mut run: Option<(u32, Operation<'_>)> = None;
        let mut done = 0usize;
        for range in &self.ranges[first..] {
            if done == len {
                break;
            }
            // Where this range's part of the stretch begins (the stretch's first byte lies
            // in the first range; every later one starts where the stretch has got to).
            let skip = (offset + done as u64 - range.start) as usize;
            let n = (range.len - skip).min(len - done);
            if run.as_ref().is_none_or(|(m, _)| *m != range.memory) {
                let memory = &self.memories[range.memory as usize];
                run = Some((range.memory, memory.borrow_operation(API)?));
            }
            let there = (range.addr + skip) as *mut u8;
            let here = base.wrapping_add(at + done);
            let (src, dst) = if into_buffer {
                (there.cast_const(), here)
            } else {
                (here.cast_const(), there)
            };
            // SAFETY: `there..there+n` lies inside its memory (checked in `new`; memories
            // never shrink and stay alive in `self.memories`), `here..here+n` inside
            // `buffer` (checked above); the operation tokens held exclude CPU slices of
            // either; `copy` (memmove) is correct should the two overlap.
            unsafe { std::ptr::copy(src, dst, n) };
            done += n;
        }
        Ok(done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counting(len: usize, from: u8) -> SharedMemory {
        let m = SharedMemory::host(len).unwrap();
        m.with_bytes_mut(|b| {
            b.iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x = from.wrapping_add(i as u8))
        })
        .unwrap();
        m
    }

    #[test]
    fn stretches_gather_and_scatter_across_ranges_and_memories() {
        let a = counting(64, 0);
        let b = counting(64, 100);
        // Two runs on `a`, one on `b`: the stream is 40 41 42 | 1 2 | 100 101.
        let list = PackedRanges::new([(&a, 40, 3), (&a, 1, 2), (&b, 0, 2)]).unwrap();
        assert_eq!(list.total(), 7);
        let pack = SharedMemory::host(32).unwrap();
        // Gathered in two stretches, the first ending inside a range.
        assert_eq!(list.copy(&pack, 4, 0, 4, true).unwrap(), 4);
        assert_eq!(list.copy(&pack, 8, 4, 3, true).unwrap(), 3);
        pack.with_bytes(|m| assert_eq!(&m[4..11], &[40, 41, 42, 1, 2, 100, 101]))
            .unwrap();
        // Scattered into another list, from the middle of the stream.
        let c = SharedMemory::host(16).unwrap();
        let out = PackedRanges::new([(&c, 10, 4), (&c, 0, 3)]).unwrap();
        assert_eq!(out.copy(&pack, 6, 2, 5, false).unwrap(), 5);
        c.with_bytes(|m| {
            assert_eq!(
                &m[12..14],
                &[42, 1],
                "stream bytes 2..4 at range 0's offset 2"
            );
            assert_eq!(&m[..3], &[2, 100, 101]);
        })
        .unwrap();
        for m in [&a, &b, &c, &pack] {
            assert_eq!(m.in_flight(), 0, "every copy's operations ended");
        }
    }

    #[test]
    fn bad_ranges_and_stretches_are_refused() {
        let a = counting(16, 0);
        assert!(PackedRanges::new([(&a, 10, 7)]).is_err(), "past the memory");
        assert!(PackedRanges::new([(&a, 3, 0)]).is_err(), "empty");
        let list = PackedRanges::new([(&a, 0, 8)]).unwrap();
        let pack = SharedMemory::host(8).unwrap();
        assert!(list.copy(&pack, 0, 4, 5, true).is_err(), "past the stream");
        assert!(list.copy(&pack, 4, 0, 5, true).is_err(), "past the buffer");
        assert!(
            list.copy(&pack, 0, u64::MAX, 1, true).is_err(),
            "offset overflow"
        );
        // Refused while the CPU holds a slice of a listed memory (and nothing copied).
        let held = a.with_bytes(|_| list.copy(&pack, 0, 0, 8, true).is_err());
        assert!(held.unwrap());
        pack.with_bytes(|m| assert_eq!(m, &[0u8; 8][..])).unwrap();
    }
}
