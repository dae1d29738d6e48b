// TCPX receive "unpack": gather the fragments of completed receives from the bounce buffer into
// their destinations (docs/NCCL_NET_ABI.md §6).
//
// Built two ways, from this one file:
// * checked in as PTX: `nvcc -ptx -arch=compute_80 -o unpack.ptx unpack.cu` (see README.md here;
//   loaded with cuModuleLoadData, no compiler needed at run time);
// * at run time with NVRTC (the fallback when the driver cannot load that PTX).
// So: no #include (NVRTC has no system headers), C++14, extern "C" entry points.
//
// The Rust side (crates/tcpx/src/cuda/unpack.rs) mirrors the structs below byte for byte and its
// CI tests check the sizes against the `.param` declaration of the checked-in PTX.

typedef unsigned char tcpx_u8;
typedef unsigned short tcpx_u16;
typedef unsigned int tcpx_u32;
typedef unsigned long long tcpx_u64;

#define TCPX_UNPACK_MAX_ENTRIES 64
#define TCPX_UNPACK_UNROLL 8

// One fragment (tcpxLoadMeta, 16 bytes): bounce_buf + src_off -> dst + dst_off, len bytes.
struct tcpx_load_meta {
  tcpx_u32 src_off;
  tcpx_u32 len;
  tcpx_u64 dst_off;
};

// One completed receive (56 bytes).
struct tcpx_unpack_entry {
  tcpx_u64 metas;       // device address of tcpx_load_meta[count] (16-aligned; may be mapped host)
  tcpx_u64 bounce;      // device address of the bounce buffer
  tcpx_u64 bounce_len;  // readable bytes from `bounce` (~0 when unknown)
  tcpx_u64 dst;         // device address of the receive's destination
  tcpx_u64 dst_len;     // writable bytes from `dst`
  tcpx_u32 count;       // fragments (>= 1)
  tcpx_u32 first_chunk; // chunks of all earlier entries of this launch
  tcpx_u32 index;       // the caller's index of this entry, reported on errors
  tcpx_u32 pad;
};

// Where the first out-of-range fragment is reported (32 bytes; sticky until the host clears
// `bad`).
struct tcpx_unpack_status {
  tcpx_u32 bad;
  tcpx_u32 seq;
  tcpx_u32 entry;
  tcpx_u32 fragment;
  tcpx_u32 src_off;
  tcpx_u32 len;
  tcpx_u64 dst_off;
};

// The kernel's only parameter, passed by value (3608 bytes < the 4 KiB parameter limit).
struct tcpx_unpack_batch {
  tcpx_u64 status;          // device address of tcpx_unpack_status, 0 for none
  tcpx_u32 num_entries;     // 1..=TCPX_UNPACK_MAX_ENTRIES
  tcpx_u32 total_chunks;    // sum over entries of ceil(count / frags_per_block)
  tcpx_u32 frags_per_block; // fragments staged in shared memory per chunk
  tcpx_u32 seq;             // launch sequence number, reported on errors
  tcpx_unpack_entry entries[TCPX_UNPACK_MAX_ENTRIES];
};

// Copies len bytes with T-sized accesses; src and dst are both sizeof(T)-aligned. The warp's
// lanes take consecutive elements; each lane keeps UNROLL loads in flight before storing.
template <typename T>
__device__ __forceinline__ void tcpx_copy_body(const tcpx_u8* __restrict__ src,
                                               tcpx_u8* __restrict__ dst, tcpx_u32 len,
                                               tcpx_u32 lane) {
  const tcpx_u32 n = len / (tcpx_u32)sizeof(T);
  const T* __restrict__ s = reinterpret_cast<const T*>(src);
  T* __restrict__ d = reinterpret_cast<T*>(dst);
  tcpx_u32 i = lane;
  for (; i + 32u * (TCPX_UNPACK_UNROLL - 1) < n; i += 32u * TCPX_UNPACK_UNROLL) {
    T v[TCPX_UNPACK_UNROLL];
#pragma unroll
    for (int u = 0; u < TCPX_UNPACK_UNROLL; ++u) v[u] = __ldg(s + i + 32u * u);
#pragma unroll
    for (int u = 0; u < TCPX_UNPACK_UNROLL; ++u) d[i + 32u * u] = v[u];
  }
  for (; i < n; i += 32u) d[i] = __ldg(s + i);
  const tcpx_u32 done = n * (tcpx_u32)sizeof(T);
  if (lane < len - done) dst[done + lane] = src[done + lane];  // tail: fewer than sizeof(T)
}

// One warp copies one fragment. The access width is the widest of 16/8/4/2/1 bytes that src and
// dst can share (their addresses agree modulo it); a head of fewer than 16 bytes brings src (and
// so dst) to that alignment, the body runs at full width and a tail finishes `len`.
__device__ __forceinline__ void tcpx_copy_fragment(const tcpx_u8* src, tcpx_u8* dst, tcpx_u32 len,
                                                   tcpx_u32 lane) {
  const tcpx_u32 rel = (tcpx_u32)(((tcpx_u64)src ^ (tcpx_u64)dst) & 15u);
  const tcpx_u32 width = rel == 0 ? 16u : (rel & 7u) == 0 ? 8u : (rel & 3u) == 0 ? 4u
                         : (rel & 1u) == 0 ? 2u : 1u;
  tcpx_u32 head = (0u - (tcpx_u32)(tcpx_u64)src) & (width - 1u);
  if (head > len) head = len;
  if (lane < head) dst[lane] = src[lane];
  src += head;
  dst += head;
  len -= head;
  switch (width) {
    case 16u: tcpx_copy_body<uint4>(src, dst, len, lane); break;
    case 8u: tcpx_copy_body<tcpx_u64>(src, dst, len, lane); break;
    case 4u: tcpx_copy_body<tcpx_u32>(src, dst, len, lane); break;
    case 2u: tcpx_copy_body<tcpx_u16>(src, dst, len, lane); break;
    default: tcpx_copy_body<tcpx_u8>(src, dst, len, lane); break;
  }
}

// Grid-stride over chunks: chunk c belongs to the last entry whose first_chunk <= c and covers
// its fragments [(c - first_chunk) * frags_per_block, +frags_per_block). The chunk's metas are
// staged in (dynamic) shared memory by the whole block, then each warp copies every
// (blockDim.x / 32)-th fragment. Fragments outside bounce_len / dst_len are skipped and the first
// one is reported in the status word.
extern "C" __global__ void tcpx_unpack(const tcpx_unpack_batch batch) {
  extern __shared__ uint4 tcpx_smeta[];
  const tcpx_u32 lane = threadIdx.x & 31u;
  const tcpx_u32 warp = threadIdx.x >> 5;
  const tcpx_u32 nwarps = blockDim.x >> 5;
  const tcpx_u32 fpb = batch.frags_per_block;
  for (tcpx_u32 chunk = blockIdx.x; chunk < batch.total_chunks; chunk += gridDim.x) {
    tcpx_u32 lo = 0, hi = batch.num_entries - 1u;
    while (lo < hi) {
      const tcpx_u32 mid = (lo + hi + 1u) >> 1;
      if (batch.entries[mid].first_chunk <= chunk) lo = mid; else hi = mid - 1u;
    }
    const tcpx_u32 first = (chunk - batch.entries[lo].first_chunk) * fpb;
    const tcpx_u32 count = batch.entries[lo].count;
    const tcpx_u32 n = count - first < fpb ? count - first : fpb;
    const uint4* metas = reinterpret_cast<const uint4*>(batch.entries[lo].metas) + first;
    const tcpx_u8* bounce = reinterpret_cast<const tcpx_u8*>(batch.entries[lo].bounce);
    tcpx_u8* dst = reinterpret_cast<tcpx_u8*>(batch.entries[lo].dst);
    const tcpx_u64 bounce_len = batch.entries[lo].bounce_len;
    const tcpx_u64 dst_len = batch.entries[lo].dst_len;

    __syncthreads();  // the previous chunk's metas are no longer read
    for (tcpx_u32 i = threadIdx.x; i < n; i += blockDim.x) tcpx_smeta[i] = metas[i];
    __syncthreads();

    for (tcpx_u32 i = warp; i < n; i += nwarps) {
      const uint4 m = tcpx_smeta[i];
      const tcpx_u32 src_off = m.x;
      const tcpx_u32 len = m.y;
      const tcpx_u64 dst_off = (tcpx_u64)m.z | ((tcpx_u64)m.w << 32);
      const bool ok = (tcpx_u64)src_off + len <= bounce_len && dst_off <= dst_len &&
                      (tcpx_u64)len <= dst_len - dst_off;
      if (!ok) {
        if (lane == 0 && batch.status != 0) {
          tcpx_unpack_status* st = reinterpret_cast<tcpx_unpack_status*>(batch.status);
          if (atomicCAS(&st->bad, 0u, 1u) == 0u) {
            st->seq = batch.seq;
            st->entry = batch.entries[lo].index;
            st->fragment = first + i;
            st->src_off = src_off;
            st->len = len;
            st->dst_off = dst_off;
            __threadfence_system();
          }
        }
        continue;
      }
      tcpx_copy_fragment(bounce + src_off, dst + dst_off, len, lane);
    }
  }
}
