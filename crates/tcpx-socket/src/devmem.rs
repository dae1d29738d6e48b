//! Devmem emulation (`TCPX_SOCKET_DEVMEM=1`): the receive side of GPUDirect-TCPX without TCPX.
//!
//! With devmem-TCP, received payload lands in GPU pages the kernel picked (a "bounce buffer"),
//! not in the user's buffer; the plugin tells the consumer where each fragment landed and the
//! consumer gathers the fragments into the destination with a kernel, then calls
//! `irecvConsumed` (docs/NCCL_NET_ABI.md §6). This module reproduces what the consumer sees:
//!
//! * On accept, per receive comm: the unpack metadata (`mem[16][2048]` of 16-byte `loadMeta`,
//!   then `cnt[16]` at byte 524288, 524416 bytes) in pinned host memory mapped into the GPU; a
//!   GPU bounce buffer of 16 slot regions of [`SLOT_PAGES`] 4 KiB pages; the 24-byte device
//!   struct `{meta, bounce_buf, head = u64::MAX}` in device memory, whose address goes into the
//!   caller's device handle (UNPACK, version 7).
//! * A receive into CUDA memory (at most [`MAX_RECV_BYTES`], so at most 2048 fragments) reads
//!   the payload from the sockets into a host staging buffer. When `test` is about to report it
//!   done, [`plan`] cuts it into fragments of at most 4 KiB split at the destination's page
//!   boundaries (about one page in four is split once more at a random point, so some fragments
//!   are short), gives each fragment its own page of the slot's region, in a random order and at
//!   a random offset inside the page (what devmem gives: scattered, unaligned), copies the pages
//!   to the GPU (one synchronous host-to-device copy of the region's used span), then writes the
//!   `loadMeta`s and `cnt[slot]`. The user's destination is never written by the plugin.
//! * A receive into host memory in this mode lands in its buffer directly; `cnt[slot]` is 0.
//!
//! Slot `s` (= the receive's posting position mod 16, TCPX's `tail % 16`) and its pages stay
//! the consumer's until `irecvConsumed` for that receive, in FIFO order (the receive ring
//! enforces it).

use std::sync::atomic::{fence, Ordering};

use tcpx_sys::{
    ncclNetDeviceHandle_v8_t, tcpxLoadMeta, tcpxUnpackDeviceHandle, ResultCode, MAX_REQUESTS,
    NCCL_NET_DEVICE_UNPACK, NCCL_NET_DEVICE_UNPACK_VERSION, NET_UNPACK_MAX_SLICE_PAGES,
    UNPACK_CNT_OFFSET, UNPACK_META_SIZE,
};

use crate::cuda::{CudaFail, DevPtr, Gpu};
use crate::log::log_warn;

/// Page size of devmem (and of the emulated bounce buffer).
pub(crate) const PAGE: usize = 4096;
/// Receive slots per comm (`tail % 16`).
pub(crate) const SLOTS: usize = MAX_REQUESTS;
/// Most fragments one receive may have (TCPX: 4 MiB slice / 4 KiB pages × 2).
pub(crate) const MAX_FRAGMENTS: usize = NET_UNPACK_MAX_SLICE_PAGES as usize;
/// Largest receive into CUDA memory in devmem mode (4 MiB: the slice TCPX's limits assume).
pub(crate) const MAX_RECV_BYTES: usize = 4 << 20;
/// Pages beyond one page per 4 KiB of [`MAX_RECV_BYTES`]: room for split fragments and gaps.
const SPARE_PAGES: usize = 64;
/// Pages of one slot's region of the bounce buffer.
pub(crate) const SLOT_PAGES: usize = MAX_RECV_BYTES / PAGE + SPARE_PAGES;
/// Bytes of the bounce buffer (16 slot regions; about 68 MiB).
pub(crate) const BOUNCE_BYTES: usize = SLOTS * SLOT_PAGES * PAGE;
/// Bytes of the device struct the device handle points at.
const DEVICE_STRUCT_BYTES: usize = std::mem::size_of::<tcpxUnpackDeviceHandle>();

const _: () = assert!(DEVICE_STRUCT_BYTES == 24);
const _: () = assert!(SLOT_PAGES <= MAX_FRAGMENTS);
const _: () = assert!(BOUNCE_BYTES <= u32::MAX as usize);
const _: () = assert!(UNPACK_CNT_OFFSET == SLOTS * MAX_FRAGMENTS * 16);

/// A small deterministic generator (xorshift64*): the fragment layout only has to look like
/// devmem's, not be unpredictable.
#[derive(Clone, Debug)]
pub(crate) struct Rng(u64);

impl Rng {
    /// A generator from `seed` (0 is replaced: xorshift must not start at 0).
    pub(crate) fn new(seed: u64) -> Self {
        Rng(if seed == 0 {
            0x9E37_79B9_7F4A_7C15
        } else {
            seed
        })
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform-enough in `0..n` (`n` > 0).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Byte offset of slot `slot`'s region in the bounce buffer.
pub(crate) fn slot_base(slot: usize) -> usize {
    slot * SLOT_PAGES * PAGE
}

/// Cuts a received message of `len` bytes (≤ [`MAX_RECV_BYTES`]) for slot `slot` into
/// fragments, written to `out` in destination order: each ≤ 4 KiB, none crossing a page of the
/// destination or of the bounce buffer, each on its own page of the slot's region (pages in a
/// random order, at a random offset inside the page). Returns how many pages from the start of
/// the slot's region the fragments use (the span to copy to the GPU).
pub(crate) fn plan(len: usize, slot: usize, rng: &mut Rng, out: &mut Vec<tcpxLoadMeta>) -> usize {
    out.clear();
    debug_assert!(len <= MAX_RECV_BYTES && slot < SLOTS);
    let chunks = len.div_ceil(PAGE);
    // Splitting a chunk costs one more page; stay inside the slot's region.
    let mut extra = SLOT_PAGES.saturating_sub(chunks);
    for k in 0..chunks {
        let start = k * PAGE;
        let clen = (len - start).min(PAGE);
        if clen >= 2 && extra > 0 && rng.below(4) == 0 {
            let cut = 1 + rng.below(clen - 1);
            out.push(meta(0, cut, start));
            out.push(meta(0, clen - cut, start + cut));
            extra -= 1;
        } else {
            out.push(meta(0, clen, start));
        }
    }
    let n = out.len();
    if n == 0 {
        return 0;
    }
    // A window a little larger than needed, so pages are not only permuted but also leave gaps.
    let window = (n + n / 8 + 1).min(SLOT_PAGES);
    let mut pages: Vec<u32> = (0..window as u32).collect();
    // Partial Fisher–Yates: the first n entries become a random choice of distinct pages.
    for i in 0..n {
        let j = i + rng.below(window - i);
        pages.swap(i, j);
    }
    let base = slot_base(slot);
    for (m, &page) in out.iter_mut().zip(&pages) {
        let flen = m.len as usize;
        let in_page = if flen < PAGE {
            rng.below(PAGE - flen + 1)
        } else {
            0
        };
        m.src_off = (base + page as usize * PAGE + in_page) as u32;
    }
    window
}

fn meta(src_off: u32, len: usize, dst_off: usize) -> tcpxLoadMeta {
    tcpxLoadMeta {
        src_off,
        len: len as u32,
        dst_off: dst_off as u64,
    }
}

/// Copies each fragment's bytes from the received message `stage` into `region`, the host
/// image of slot `slot`'s region of the bounce buffer. Fragments come from [`plan`].
pub(crate) fn scatter(stage: &[u8], metas: &[tcpxLoadMeta], slot: usize, region: &mut [u8]) {
    let base = slot_base(slot);
    for m in metas {
        let (s, d, n) = (
            m.src_off as usize - base,
            m.dst_off as usize,
            m.len as usize,
        );
        region[s..s + n].copy_from_slice(&stage[d..d + n]);
    }
}

/// The devmem resources of one receive comm. Dropped (all GPU memory freed) on `closeRecv`.
pub(crate) struct DevmemRecv {
    gpu: &'static Gpu,
    /// Host address of the mapped unpack metadata (`tcpxUnpackMeta`).
    meta_host: *mut u8,
    /// Its device address.
    meta_dev: DevPtr,
    /// The bounce buffer ([`BOUNCE_BYTES`]).
    bounce: DevPtr,
    /// The 24-byte device struct.
    handle_dev: DevPtr,
    /// Host staging of each slot's payload (grown to the posted size on demand).
    stages: [Vec<u8>; SLOTS],
    /// Host image of one slot's region, reused by every publication.
    region: Vec<u8>,
    metas: Vec<tcpxLoadMeta>,
    rng: Rng,
    name: String,
}

// SAFETY: the raw pointers are this comm's own allocations; the comm is used by one thread at
// a time (NCCL's contract) and may move between threads.
unsafe impl Send for DevmemRecv {}

impl DevmemRecv {
    /// Allocates the metadata, bounce buffer and device struct on `gpu`. On failure, whatever
    /// was allocated is freed and the error is logged; the result is UnhandledCudaError.
    pub(crate) fn new(gpu: &'static Gpu, seed: u64, name: &str) -> Result<Box<Self>, ResultCode> {
        let mut me = Box::new(Self {
            gpu,
            meta_host: std::ptr::null_mut(),
            meta_dev: 0,
            bounce: 0,
            handle_dev: 0,
            stages: Default::default(),
            region: Vec::new(),
            metas: Vec::with_capacity(MAX_FRAGMENTS),
            rng: Rng::new(seed),
            name: name.to_string(),
        });
        let result = gpu.scoped(|g| {
            let (host, dev) = g.host_alloc_mapped(UNPACK_META_SIZE)?;
            me.meta_host = host;
            me.meta_dev = dev;
            // SAFETY: a fresh allocation of UNPACK_META_SIZE bytes, not yet shared.
            unsafe { std::ptr::write_bytes(host, 0, UNPACK_META_SIZE) };
            me.bounce = g.alloc(BOUNCE_BYTES)?;
            me.handle_dev = g.alloc(DEVICE_STRUCT_BYTES)?;
            let st = tcpxUnpackDeviceHandle {
                meta: dev as *mut _,
                bounce_buf: me.bounce as *mut _,
                head: u64::MAX,
            };
            // SAFETY: `st` is 24 readable bytes; `handle_dev` is a fresh 24-byte allocation.
            unsafe {
                g.htod(
                    me.handle_dev,
                    (&st as *const tcpxUnpackDeviceHandle).cast(),
                    DEVICE_STRUCT_BYTES,
                )
            }
        });
        match result {
            Ok(()) => Ok(me),
            Err(e) => {
                log_warn!(
                    "tcpx-socket: {name}: devmem emulation could not set up on GPU {}: {e} (it \
                     needs about {} MiB of GPU memory per receive comm)",
                    gpu.ordinal,
                    BOUNCE_BYTES >> 20
                );
                Err(ResultCode::UNHANDLED_CUDA_ERROR)
            }
        }
    }

    /// The device handle to give the accept caller: UNPACK v7, pointing at the device struct.
    pub(crate) fn device_handle(&self) -> ncclNetDeviceHandle_v8_t {
        ncclNetDeviceHandle_v8_t {
            netDeviceType: NCCL_NET_DEVICE_UNPACK,
            netDeviceVersion: NCCL_NET_DEVICE_UNPACK_VERSION,
            handle: self.handle_dev as *mut _,
            size: DEVICE_STRUCT_BYTES,
            needsProxyProgress: 0,
        }
    }

    /// The host staging buffer of slot `slot`, with room for `cap` bytes (≤ [`MAX_RECV_BYTES`]).
    /// Only called while the slot is free, so no receive is writing into it.
    pub(crate) fn stage(&mut self, slot: usize, cap: usize) -> *mut u8 {
        let stage = &mut self.stages[slot];
        if stage.len() < cap {
            stage.resize(cap, 0);
        }
        stage.as_mut_ptr()
    }

    /// Publishes the completed receive of slot `slot`: for a CUDA receive of `total` bytes,
    /// scatters its pages into the bounce buffer and writes its `loadMeta`s; then `cnt[slot]`
    /// (0 for a host receive, whose bytes are already in place).
    pub(crate) fn publish(&mut self, slot: usize, total: usize, cuda: bool) -> Result<(), String> {
        let mut count = 0;
        if cuda && total > 0 {
            let window = plan(total, slot, &mut self.rng, &mut self.metas);
            let span = window * PAGE;
            if self.region.len() < span {
                self.region.resize(span, 0);
            }
            scatter(
                &self.stages[slot][..total],
                &self.metas,
                slot,
                &mut self.region,
            );
            let (gpu, dst, src) = (
                self.gpu,
                self.bounce + slot_base(slot) as u64,
                self.region.as_ptr(),
            );
            gpu.scoped(|g| {
                // SAFETY: `region` holds `span` readable bytes; the destination is this slot's
                // region of our bounce buffer (span ≤ SLOT_PAGES pages), which no consumer reads
                // while the slot is free (it was consumed before this receive was posted).
                unsafe { g.htod(dst, src, span) }
            })
            .map_err(|e: CudaFail| format!("copying slot {slot} to the bounce buffer: {e}"))?;
            count = self.metas.len();
            // SAFETY: mem[slot][..count] lies inside the mapped metadata (count ≤ SLOT_PAGES ≤
            // 2048); the slot is not being read (not yet reported done, previous use consumed).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.metas.as_ptr(),
                    self.meta_host
                        .add(slot * MAX_FRAGMENTS * 16)
                        .cast::<tcpxLoadMeta>(),
                    count,
                );
            }
        }
        // The metas must be visible before the count that announces them.
        fence(Ordering::Release);
        // SAFETY: cnt[slot] is an aligned u64 inside the mapped metadata; volatile because the
        // GPU (or another host thread) reads it.
        unsafe {
            std::ptr::write_volatile(
                self.meta_host
                    .add(UNPACK_CNT_OFFSET + slot * 8)
                    .cast::<u64>(),
                count as u64,
            );
        }
        fence(Ordering::SeqCst);
        Ok(())
    }
}

impl Drop for DevmemRecv {
    fn drop(&mut self) {
        let (meta, bounce, handle) = (self.meta_host, self.bounce, self.handle_dev);
        let result = self.gpu.scoped(|g| {
            let mut first: Result<(), CudaFail> = Ok(());
            // SAFETY: each pointer is this comm's own allocation, freed once; the comm is being
            // closed, so no receive of it is in flight any more.
            unsafe {
                if handle != 0 {
                    first = first.and(g.free(handle));
                }
                if bounce != 0 {
                    first = first.and(g.free(bounce));
                }
                if !meta.is_null() {
                    first = first.and(g.host_free(meta));
                }
            }
            first
        });
        if let Err(e) = result {
            log_warn!(
                "tcpx-socket: {}: freeing devmem resources failed: {e}",
                self.name
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(len: usize, seed: u64) -> Vec<u8> {
        let mut r = Rng::new(seed);
        (0..len).map(|_| r.next() as u8).collect()
    }

    /// Plans, scatters into a host image of the whole bounce buffer region and gathers back.
    fn round_trip(len: usize, slot: usize, seed: u64) -> Vec<tcpxLoadMeta> {
        let data = pattern(len, seed);
        let mut rng = Rng::new(seed ^ 0x55);
        let mut metas = Vec::new();
        let window = plan(len, slot, &mut rng, &mut metas);
        let mut region = vec![0u8; SLOT_PAGES * PAGE];
        scatter(&data, &metas, slot, &mut region);
        let base = slot_base(slot);
        let mut back = vec![0u8; len];
        let mut pages = std::collections::HashSet::new();
        let mut next_dst = 0u64;
        for m in &metas {
            let s = m.src_off as usize;
            assert!(m.len as usize <= PAGE && m.len > 0, "{m:?}");
            assert!(
                s >= base && s + m.len as usize <= base + window * PAGE,
                "{m:?}"
            );
            // Never crosses a bounce page nor a destination page.
            assert_eq!(s / PAGE, (s + m.len as usize - 1) / PAGE, "{m:?}");
            let d = m.dst_off as usize;
            assert_eq!(d / PAGE, (d + m.len as usize - 1) / PAGE, "{m:?}");
            assert!(pages.insert(s / PAGE), "two fragments share a page: {m:?}");
            assert_eq!(m.dst_off, next_dst, "fragments in destination order");
            next_dst += m.len as u64;
            let r = s - base;
            back[d..d + m.len as usize].copy_from_slice(&region[r..r + m.len as usize]);
        }
        assert_eq!(next_dst as usize, len);
        assert!(metas.len() <= MAX_FRAGMENTS);
        assert!(back == data, "gather of {len} bytes differs");
        metas
    }

    #[test]
    fn fragments_cover_the_message_scattered_and_page_bounded() {
        for (i, len) in [1, 2, 4095, 4096, 4097, 65_537, 1 << 20, MAX_RECV_BYTES]
            .into_iter()
            .enumerate()
        {
            round_trip(len, i % SLOTS, i as u64 + 1);
        }
        assert!(round_trip(0, 3, 9).is_empty());
    }

    #[test]
    fn large_messages_are_out_of_order_with_short_fragments() {
        let metas = round_trip(1 << 20, 15, 42);
        let in_order = metas.windows(2).all(|w| w[0].src_off < w[1].src_off);
        assert!(!in_order, "pages should be scattered");
        let short = metas.iter().filter(|m| (m.len as usize) < PAGE).count();
        assert!(short > 10, "only {short} short fragments");
        let unaligned = metas.iter().filter(|m| m.src_off % 16 != 0).count();
        assert!(unaligned > 10, "only {unaligned} unaligned fragments");
        // A full 4 MiB receive stays within 2048 fragments and the slot's pages.
        let metas = round_trip(MAX_RECV_BYTES, 0, 7);
        assert!(metas.len() <= SLOT_PAGES);
    }
}
