// GPU round trips for small copies: what every way of moving a few KiB between host and
// device memory, and knowing it is done, costs on this machine (the floor under the runtime's
// small GPU operations; docs/RESULTS.md, twenty-seventh session).
//
// Part 1, one 4 KiB transfer at a time, p50 / p10 / p99 in µs: the copy engines
// (cudaMemcpyAsync, waited for by polling the stream or by a flag the stream writes into
// host memory), a kernel carrying the bytes in its parameters, kernels reading or writing
// mapped pinned host memory (zero-copy) with a flag, an empty kernel, a 1-byte memset.
// Part 2, lists of n × 4 KiB pieces that do not touch each other, p50 µs per list: a copy
// each, one cuMemcpyBatchAsync, each direction and device to device, and through a
// device scratch buffer (one contiguous copy plus a device-to-device batch).
// Part 3, one 4 KiB copy after the CPU touched 0 B … 8 MiB of other memory: the driver's
// submission (cuMemcpyAsync returning) against the wait for the GPU, p50 µs.
//
// Build and run on the GPU machine (nvcc there; no cargo needed):
//   nvcc -O2 -arch=sm_90 -o /tmp/roundtrip scripts/gpu/roundtrip.cu -lcuda && /tmp/roundtrip
#include <cuda_runtime.h>
#include <cuda.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <vector>
#include <algorithm>
#define CK(x) do{cudaError_t e=(x); if(e!=cudaSuccess){printf("%s:%d %s\n",__FILE__,__LINE__,cudaGetErrorString(e)); exit(1);} }while(0)
#define DK(x) do{CUresult e=(x); if(e!=CUDA_SUCCESS){printf("%s:%d cu %d\n",__FILE__,__LINE__,(int)e); exit(1);} }while(0)
constexpr int N = 4096;
struct Payload { unsigned int w[N/4]; };
__global__ void param_write(Payload p, unsigned int* dst) { for (int i = threadIdx.x; i < N/4; i += blockDim.x) dst[i] = p.w[i]; }
__global__ void param_write_flag(Payload p, unsigned int* dst, volatile unsigned int* flag, unsigned int v) {
  for (int i = threadIdx.x; i < N/4; i += blockDim.x) dst[i] = p.w[i];
  __syncthreads(); if (threadIdx.x==0){ __threadfence_system(); *flag = v; } }
__global__ void d2h_kernel(const uint4* src, uint4* host, int n16, volatile unsigned int* flag, unsigned int v) {
  for (int i = threadIdx.x; i < n16; i += blockDim.x) host[i] = src[i];
  __syncthreads(); if (threadIdx.x==0){ __threadfence_system(); *flag = v; } }
__global__ void h2d_kernel(const uint4* host, uint4* dst, int n16, volatile unsigned int* flag, unsigned int v) {
  for (int i = threadIdx.x; i < n16; i += blockDim.x) dst[i] = host[i];
  __syncthreads(); if (threadIdx.x==0){ __threadfence_system(); *flag = v; } }
__global__ void empty() {}
using clk = std::chrono::steady_clock;
template<class F> void bench(const char* name, F f, int iters=3000) {
  std::vector<double> t; for (int i=0;i<200;i++) f(i);
  for (int i=0;i<iters;i++){ auto a=clk::now(); f(i); auto b=clk::now(); t.push_back(std::chrono::duration<double,std::micro>(b-a).count()); }
  std::sort(t.begin(),t.end()); printf("%-48s p50 %6.2f  p10 %6.2f  p99 %6.2f us\n", name, t[t.size()/2], t[t.size()/10], t[t.size()*99/100]);
}
template<class F> double median(F f, int iters=1000) {
  std::vector<double> t; for (int i=0;i<100;i++) f();
  for (int i=0;i<iters;i++){ auto a=clk::now(); f(); auto b=clk::now(); t.push_back(std::chrono::duration<double,std::micro>(b-a).count()); }
  std::sort(t.begin(),t.end()); return t[t.size()/2];
}
int main(){
  // Part 1

  CK(cudaSetDeviceFlags(cudaDeviceScheduleSpin | cudaDeviceMapHost));
  cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  unsigned char *dev, *dev2; CK(cudaMalloc(&dev, 1<<20)); CK(cudaMalloc(&dev2, 1<<20));
  unsigned char* pin; CK(cudaHostAlloc(&pin, 1<<20, cudaHostAllocMapped));
  unsigned char* pinw; CK(cudaHostAlloc(&pinw, 1<<20, cudaHostAllocMapped|cudaHostAllocWriteCombined));
  unsigned int* flag; CK(cudaHostAlloc(&flag, 4096, cudaHostAllocMapped)); *flag=0;
  unsigned int* dflag; CK(cudaHostGetDevicePointer(&dflag, flag, 0));
  unsigned char* dpin; CK(cudaHostGetDevicePointer(&dpin, pin, 0));
  unsigned char* dpinw; CK(cudaHostGetDevicePointer(&dpinw, pinw, 0));
  Payload p; memset(&p, 7, sizeof p);
  auto spin=[&](){ while (cudaStreamQuery(s)==cudaErrorNotReady){} };
  bench("empty kernel + query spin", [&](int){ empty<<<1,1,0,s>>>(); spin(); });
  bench("empty kernel + cudaStreamSynchronize", [&](int){ empty<<<1,1,0,s>>>(); CK(cudaStreamSynchronize(s)); });
  bench("H2D memcpyAsync 4K pinned + query spin", [&](int){ CK(cudaMemcpyAsync(dev,pin,N,cudaMemcpyHostToDevice,s)); spin(); });
  bench("D2H memcpyAsync 4K pinned + query spin", [&](int){ CK(cudaMemcpyAsync(pin,dev,N,cudaMemcpyDeviceToHost,s)); spin(); });
  bench("H2D param kernel 4K + query spin", [&](int){ param_write<<<1,256,0,s>>>(p,(unsigned int*)dev); spin(); });
  bench("H2D param kernel 4K + host flag spin", [&](int i){ unsigned v=i+1000000; param_write_flag<<<1,256,0,s>>>(p,(unsigned int*)dev,dflag,v); while(*(volatile unsigned*)flag!=v){} });
  bench("H2D zero-copy kernel 4K + host flag spin", [&](int i){ unsigned v=i+2000000; h2d_kernel<<<1,256,0,s>>>((const uint4*)dpin,(uint4*)dev,N/16,dflag,v); while(*(volatile unsigned*)flag!=v){} });
  bench("D2H zero-copy kernel 4K + host flag spin", [&](int i){ unsigned v=i+3000000; d2h_kernel<<<1,256,0,s>>>((const uint4*)dev,(uint4*)dpin,N/16,dflag,v); while(*(volatile unsigned*)flag!=v){} });
  bench("D2H zero-copy kernel 4K + query spin", [&](int i){ d2h_kernel<<<1,256,0,s>>>((const uint4*)dev,(uint4*)dpin,N/16,dflag,1); spin(); });
  bench("H2D memcpy + streamWriteValue flag spin", [&](int i){ unsigned v=i+4000000; CK(cudaMemcpyAsync(dev,pin,N,cudaMemcpyHostToDevice,s)); cuStreamWriteValue32((CUstream)s,(CUdeviceptr)dflag,v,0); while(*(volatile unsigned*)flag!=v){} });
  bench("D2H memcpy + streamWriteValue flag spin", [&](int i){ unsigned v=i+5000000; CK(cudaMemcpyAsync(pin,dev,N,cudaMemcpyDeviceToHost,s)); cuStreamWriteValue32((CUstream)s,(CUdeviceptr)dflag,v,0); while(*(volatile unsigned*)flag!=v){} });
  bench("memsetAsync 1B + query spin", [&](int){ CK(cudaMemsetAsync(dev,1,1,s)); spin(); });
  // The kernels moved the right bytes.
  memset(pin, 0, N); d2h_kernel<<<1,256,0,s>>>((const uint4*)dev,(uint4*)dpin,N/16,dflag,1); CK(cudaStreamSynchronize(s));
  param_write<<<1,256,0,s>>>(p,(unsigned int*)dev2); CK(cudaStreamSynchronize(s)); CK(cudaMemcpy(pin+N,dev2,N,cudaMemcpyDeviceToHost));
  printf("param check %s\n", memcmp(pin+N,&p,N)==0?"ok":"BAD");
  { // Part 2 (its own scope: its buffers shadow part 1's)
  const size_t P = 4096, STRIDE = 8192; const int MAXN = 64;
  unsigned char *dev, *scratch; CK(cudaMalloc(&dev, MAXN*STRIDE)); CK(cudaMalloc(&scratch, MAXN*P));
  unsigned char* pin; CK(cudaHostAlloc(&pin, MAXN*STRIDE, 0));
  auto spin=[&](){ while (cudaStreamQuery(s)==cudaErrorNotReady){} };
  auto batch=[&](int n, std::vector<void*>& dst, std::vector<void*>& src){
    std::vector<size_t> sz(n, P); CUmemcpyAttributes attr = {}; attr.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
    size_t attrIdx = 0; size_t fail = 0;
#if CUDA_VERSION >= 13000
    (void)fail; DK(cuMemcpyBatchAsync((CUdeviceptr*)dst.data(), (CUdeviceptr*)src.data(), sz.data(), n, &attr, &attrIdx, 1, (CUstream)s));
#else
    DK(cuMemcpyBatchAsync((CUdeviceptr*)dst.data(), (CUdeviceptr*)src.data(), sz.data(), n, &attr, &attrIdx, 1, &fail, (CUstream)s));
#endif
  };
  for (int n : {1, 4, 16, 64}) {
    std::vector<void*> hs(n), ds(n), sc(n);
    for (int i=0;i<n;i++){ hs[i]=pin+i*STRIDE; ds[i]=dev+i*STRIDE; sc[i]=scratch+i*P; }
    double h2d_each = median([&]{ for(int i=0;i<n;i++) CK(cudaMemcpyAsync(ds[i],hs[i],P,cudaMemcpyHostToDevice,s)); spin(); });
    double d2h_each = median([&]{ for(int i=0;i<n;i++) CK(cudaMemcpyAsync(hs[i],ds[i],P,cudaMemcpyDeviceToHost,s)); spin(); });
    double d2d_each = median([&]{ for(int i=0;i<n;i++) CK(cudaMemcpyAsync(ds[i],sc[i],P,cudaMemcpyDeviceToDevice,s)); spin(); });
    double h2d_batch = median([&]{ batch(n, ds, hs); spin(); });
    double d2h_batch = median([&]{ batch(n, hs, ds); spin(); });
    double d2d_batch = median([&]{ batch(n, ds, sc); spin(); });
    double h2d_via = median([&]{ CK(cudaMemcpyAsync(scratch,pin,n*P,cudaMemcpyHostToDevice,s)); batch(n, ds, sc); spin(); });
    double d2h_via = median([&]{ batch(n, sc, ds); CK(cudaMemcpyAsync(pin,scratch,n*P,cudaMemcpyDeviceToHost,s)); spin(); });
    double h2d_one = median([&]{ CK(cudaMemcpyAsync(scratch,pin,n*P,cudaMemcpyHostToDevice,s)); spin(); });
    printf("n=%2d x 4KiB: each H2D %6.1f D2H %6.1f D2D %6.1f | batch H2D %6.1f D2H %6.1f D2D %6.1f | via scratch H2D %6.1f D2H %6.1f | one contiguous H2D %6.1f us\n",
      n, h2d_each, d2h_each, d2d_each, h2d_batch, d2h_batch, d2d_batch, h2d_via, d2h_via, h2d_one);
  }
  }
  { // Part 3: submission against what the CPU touched since the last copy
    CUstream cs = (CUstream)s;
    unsigned char *dev3; CK(cudaMalloc(&dev3, 1<<20));
    unsigned char *pin3; CK(cudaHostAlloc(&pin3, 1<<20, 0));
    std::vector<unsigned char> junk(64<<20, 1);
    volatile unsigned sink = 0;
    size_t touch[] = {0, 256<<10, 2<<20, 8<<20};
    size_t off = 0;
    for (size_t t : touch) for (int h2d = 0; h2d < 2; h2d++) {
      std::vector<double> sub, wait;
      for (int i = 0; i < 1200; i++) {
        for (size_t k = 0; k < t; k += 64) { sink += junk[(off + k) % junk.size()]++; }
        off += t;
        auto a = clk::now();
        if (h2d) DK(cuMemcpyAsync((CUdeviceptr)dev3, (CUdeviceptr)pin3, 4096, cs));
        else DK(cuMemcpyAsync((CUdeviceptr)pin3, (CUdeviceptr)dev3, 4096, cs));
        auto b = clk::now();
        while (cuStreamQuery(cs) == CUDA_ERROR_NOT_READY) {}
        auto d = clk::now();
        if (i >= 200) {
          sub.push_back(std::chrono::duration<double,std::micro>(b-a).count());
          wait.push_back(std::chrono::duration<double,std::micro>(d-b).count());
        }
      }
      std::sort(sub.begin(), sub.end()); std::sort(wait.begin(), wait.end());
      printf("%5zu KiB touched before each copy, %s: submit p50 %5.2f  wait p50 %5.2f us\n",
        t >> 10, h2d ? "H2D" : "D2H", sub[sub.size()/2], wait[wait.size()/2]);
    }
  }
  return 0;
}
