// Host -> device without the copy engines: stream memory operations (`cuStreamBatchMemOp`,
// 64-bit writes whose values travel in the command stream, no DMA read of host memory)
// against one `cuMemcpyHtoDAsync` from pinned memory, both waited for by polling the stream
// as the runtime's `SmallCopier` does (docs/RESULTS.md, fortieth session: the memory
// operations are far slower — 10.8 µs for eight of them, 360 µs for the 512 a 4 KiB block
// takes — so they cannot shorten the target's copy of a small GPU write). Each size's
// memory-operation result is checked byte for byte.
//
// Build and run on the GPU machine (nvcc there; no cargo needed); the argument is the GPU:
//   nvcc -O2 -arch=sm_90 -o /tmp/stream_memops scripts/gpu/stream_memops.cu -lcuda && /tmp/stream_memops 0
#include <cuda.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <vector>
#include <algorithm>
#define DK(x) do{CUresult e=(x); if(e!=CUDA_SUCCESS){const char*s; cuGetErrorString(e,&s); printf("%s:%d cu %d %s\n",__FILE__,__LINE__,(int)e,s); exit(1);} }while(0)
using clk = std::chrono::steady_clock;
static double us(clk::time_point a, clk::time_point b){return std::chrono::duration<double,std::micro>(b-a).count();}
template<class F> void bench(const char* name, F f, int iters=4000) {
  std::vector<double> t; for (int i=0;i<300;i++) f();
  for (int i=0;i<iters;i++){ auto a=clk::now(); f(); auto b=clk::now(); t.push_back(us(a,b)); }
  std::sort(t.begin(),t.end()); printf("%-60s p50 %6.2f  p10 %6.2f  p90 %6.2f p99 %6.2f us\n", name, t[t.size()/2], t[t.size()/10], t[t.size()*9/10], t[t.size()*99/100]); fflush(stdout);
}
static void spin(CUstream s){ CUresult r; while((r=cuStreamQuery(s))==CUDA_ERROR_NOT_READY){} DK(r); }
int main(int argc, char** argv){
  DK(cuInit(0));
  int dev_index = argc > 1 ? atoi(argv[1]) : 0;
  CUdevice d; DK(cuDeviceGet(&d, dev_index));
  int a1=0,a2=0,a3=0; cuDeviceGetAttribute(&a1, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, d);
  cuDeviceGetAttribute(&a2, CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR, d);
  printf("64-bit mem ops %d, wait nor %d\n", a1, a2);
  CUcontext c; DK(cuDevicePrimaryCtxRetain(&c,d)); DK(cuCtxSetCurrent(c));
  CUstream s; DK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUdeviceptr dev; DK(cuMemAlloc(&dev, 1<<20));
  void* pin; DK(cuMemHostAlloc(&pin, 1<<20, CU_MEMHOSTALLOC_PORTABLE));
  unsigned char* src = (unsigned char*)pin;
  for (int i=0;i<(1<<20);i++) src[i] = (unsigned char)(i*7+3);
  std::vector<CUstreamBatchMemOpParams> ops(1024);
  auto memops = [&](size_t bytes, unsigned flags, size_t per_call) {
    size_t n = bytes/8; const unsigned long long* v = (const unsigned long long*)src;
    for (size_t i=0;i<n;i++){ memset(&ops[i],0,sizeof(ops[i])); ops[i].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64; ops[i].writeValue.address = dev + i*8; ops[i].writeValue.value64 = v[i]; ops[i].writeValue.flags = flags; }
    for (size_t at=0; at<n; at+=per_call) { size_t k = std::min(per_call, n-at); DK(cuStreamBatchMemOp(s, (unsigned)k, &ops[at], 0)); }
  };
  for (size_t sz : {size_t(64), size_t(512), size_t(2048), size_t(4096), size_t(8192)}) {
    printf("--- %zu bytes\n", sz);
    bench("H2D cuMemcpyHtoDAsync pinned + spin query", [&]{ DK(cuMemcpyHtoDAsync(dev, pin, sz, s)); spin(s); });
    bench("H2D mem ops 64-bit, 255/call, default flags + spin", [&]{ memops(sz, 0, 255); spin(s); });
    bench("H2D mem ops 64-bit, 64/call, default flags + spin", [&]{ memops(sz, 0, 64); spin(s); });
    // verify
    DK(cuMemsetD8(dev, 0, sz)); memops(sz, 0, 255); spin(s);
    std::vector<unsigned char> back(sz); DK(cuMemcpyDtoH(back.data(), dev, sz));
    printf("verified: %s\n", memcmp(back.data(), src, sz)==0 ? "yes" : "NO");
    bench("D2H cuMemcpyDtoHAsync pinned + spin query", [&]{ DK(cuMemcpyDtoHAsync(pin, dev, sz, s)); spin(s); });
  }
  printf("done\n");
}
