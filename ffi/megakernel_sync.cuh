// Cross-CTA hand-over for the persistent megakernels (megakernel_fwd.cu,
// megakernel_bwd.cu): gpu-scope release/acquire on int32 counters in global
// memory, the proxy fence before TMA reads of rows other CTAs wrote, and a
// bounded spin that turns a broken protocol (or a lost peer) into a trap
// with a flag instead of a hang.
#pragma once

#include <cstdint>

namespace mok::cuda::sync {

// A wait that lasts this long means a broken protocol (or a lost peer at
// EP > 1): flag it and trap rather than hang.
constexpr uint64_t kWaitTimeoutNs = 20ull * 1000 * 1000 * 1000;

__device__ __forceinline__ int ld_acquire(const int32_t* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release(int32_t* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void red_release_add(int32_t* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// Orders this thread's acquired view before its later async-proxy (TMA) reads.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}
__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// Spins until *p >= target (acquire). Traps after kWaitTimeoutNs with flags bit 1.
__device__ __forceinline__ void wait_at_least(const int32_t* p, int target, int32_t* flags) {
  if (ld_acquire(p) >= target) return;
  const uint64_t t0 = global_ns();
  for (;;) {
    __nanosleep(128);
    if (ld_acquire(p) >= target) return;
    if (global_ns() - t0 > kWaitTimeoutNs) {
      atomicOr(flags, 2);
      __threadfence_system();
      __trap();
    }
  }
}

}  // namespace mok::cuda::sync
