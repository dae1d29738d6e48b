// The floor under a one-sided 4 KiB write of GPU memory through a host-memory plugin: one
// copy device → host on the initiator, one host → device on the target (docs/RESULTS.md,
// thirty-sixth session). p50 / p10 / p99 in µs of one 4 KiB copy waited for each way the
// driver offers (a stream poll, as the runtime's `SmallCopier` does; synchronous copies;
// `cuStreamSynchronize`; an event; pageable sources; a context pushed and popped per copy),
// then with a thread copying on the other GPU beside it, and last the write's shape: a copy
// on GPU 0 here, handed to a thread that copies on GPU 1 and hands back.
//
// Build and run on the GPU machine (nvcc there; no cargo needed); an argument of any
// value sets CU_CTX_SCHED_SPIN on GPU 0's primary context first:
//   nvcc -O2 -arch=sm_90 -o /tmp/copy_waits scripts/gpu/copy_waits.cu -lcuda && /tmp/copy_waits
#include <cuda.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <vector>
#include <thread>
#include <atomic>
#include <algorithm>
#define DK(x) do{CUresult e=(x); if(e!=CUDA_SUCCESS){printf("%s:%d cu %d\n",__FILE__,__LINE__,(int)e); exit(1);} }while(0)
using clk = std::chrono::steady_clock;
static double us(clk::time_point a, clk::time_point b){return std::chrono::duration<double,std::micro>(b-a).count();}
template<class F> void bench(const char* name, F f, int iters=3000) {
  std::vector<double> t; for (int i=0;i<200;i++) f();
  for (int i=0;i<iters;i++){ auto a=clk::now(); f(); auto b=clk::now(); t.push_back(us(a,b)); }
  std::sort(t.begin(),t.end()); printf("%-56s p50 %6.2f  p10 %6.2f  p99 %6.2f us\n", name, t[t.size()/2], t[t.size()/10], t[t.size()*99/100]); fflush(stdout);
}
static void spin_query(CUstream s){ CUresult r; while((r=cuStreamQuery(s))==CUDA_ERROR_NOT_READY){} DK(r); }
int main(int argc, char** argv){
  DK(cuInit(0)); int n=0; DK(cuDeviceGetCount(&n));
  CUdevice d0, d1; DK(cuDeviceGet(&d0,0)); DK(cuDeviceGet(&d1, n>1?1:0));
  CUcontext c0, c1; DK(cuDevicePrimaryCtxRetain(&c0,d0)); DK(cuDevicePrimaryCtxRetain(&c1,d1));
  if (argc>1) { DK(cuDevicePrimaryCtxSetFlags(d0, CU_CTX_SCHED_SPIN)); }
  DK(cuCtxSetCurrent(c0));
  CUstream s; DK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUdeviceptr dev; DK(cuMemAlloc(&dev, 1<<20));
  void* pin; DK(cuMemHostAlloc(&pin, 1<<20, 0));
  void* pageable = malloc(1<<20); memset(pageable, 1, 1<<20);
  CUevent ev; DK(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
  const size_t N=4096;
  bench("D2H async + spin query", [&]{ DK(cuMemcpyDtoHAsync(pin, dev, N, s)); spin_query(s); });
  bench("H2D async + spin query", [&]{ DK(cuMemcpyHtoDAsync(dev, pin, N, s)); spin_query(s); });
  bench("D2H sync cuMemcpyDtoH (pinned)", [&]{ DK(cuMemcpyDtoH(pin, dev, N)); });
  bench("H2D sync cuMemcpyHtoD (pinned)", [&]{ DK(cuMemcpyHtoD(dev, pin, N)); });
  bench("D2H async + cuStreamSynchronize", [&]{ DK(cuMemcpyDtoHAsync(pin, dev, N, s)); DK(cuStreamSynchronize(s)); });
  bench("H2D async + event + spin event query", [&]{ DK(cuMemcpyHtoDAsync(dev, pin, N, s)); DK(cuEventRecord(ev, s)); CUresult r; while((r=cuEventQuery(ev))==CUDA_ERROR_NOT_READY){} DK(r); });
  bench("H2D async from pageable + spin query", [&]{ DK(cuMemcpyHtoDAsync(dev, pageable, N, s)); spin_query(s); });
  bench("H2D async from pageable 1 KiB + spin query", [&]{ DK(cuMemcpyHtoDAsync(dev, pageable, 1024, s)); spin_query(s); });
  bench("D2H async + spin, push/pop ctx each", [&]{ DK(cuCtxPushCurrent(c0)); DK(cuMemcpyDtoHAsync(pin, dev, N, s)); spin_query(s); CUcontext p; DK(cuCtxPopCurrent(&p)); });
  // submit-only timings
  {
    std::vector<double> sub, wt; for(int i=0;i<3000;i++){ auto a=clk::now(); DK(cuMemcpyHtoDAsync(dev, pin, N, s)); auto b=clk::now(); spin_query(s); auto c=clk::now(); if(i>=200){sub.push_back(us(a,b)); wt.push_back(us(b,c));} }
    std::sort(sub.begin(),sub.end()); std::sort(wt.begin(),wt.end()); printf("H2D split: submit p50 %.2f wait p50 %.2f us\n", sub[sub.size()/2], wt[wt.size()/2]);
  }
  // A neighbour thread copying on the other GPU's context (as in one onesided process).
  std::atomic<bool> stop{false};
  std::thread other([&]{ DK(cuCtxSetCurrent(c1)); CUstream s1; DK(cuStreamCreate(&s1, CU_STREAM_NON_BLOCKING)); CUdeviceptr d; DK(cuMemAlloc(&d, 1<<20)); void* p; DK(cuMemHostAlloc(&p, 1<<20, 0));
    while(!stop.load()){ DK(cuMemcpyHtoDAsync(d, p, N, s1)); spin_query(s1); } });
  bench("D2H async + spin, neighbour copying on GPU1", [&]{ DK(cuMemcpyDtoHAsync(pin, dev, N, s)); spin_query(s); });
  bench("H2D async + spin, neighbour copying on GPU1", [&]{ DK(cuMemcpyHtoDAsync(dev, pin, N, s)); spin_query(s); });
  stop=true; other.join();
  // Ping-pong: copy on GPU0 in this thread, then hand to a thread that copies on GPU1 (the write's shape).
  {
    std::atomic<int> turn{0}; std::atomic<bool> done{false};
    std::thread t([&]{ DK(cuCtxSetCurrent(c1)); CUstream s1; DK(cuStreamCreate(&s1, CU_STREAM_NON_BLOCKING)); CUdeviceptr d; DK(cuMemAlloc(&d, 1<<20));
      while(!done.load()){ if(turn.load(std::memory_order_acquire)==1){ DK(cuMemcpyHtoDAsync(d, pin, N, s1)); spin_query(s1); turn.store(0, std::memory_order_release);} } });
    bench("D2H here then H2D on GPU1 in another thread", [&]{ DK(cuMemcpyDtoHAsync(pin, dev, N, s)); spin_query(s); turn.store(1, std::memory_order_release); while(turn.load(std::memory_order_acquire)!=0){} });
    done=true; t.join();
  }
  printf("done\n");
}
