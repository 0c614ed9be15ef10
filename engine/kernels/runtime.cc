#include "engine/kernels/runtime.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>

#include <thread>

namespace llava {

int InitTorchThreads(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  at::set_num_threads(threads);
  // OpenBLAS, libtorch's fp32 BLAS on Debian, runs its own pthreads, which busy-wait for about
  // 0.1 s after each call: the OpenMP threads of the next ATen op then wait for a core, and a
  // prefill in fp32 panels ran at 4-20 GFLOP/s instead of 70 (docs/BENCHMARKS.md, "CPU
  // paths"). The engine splits its fp32 products over the OpenMP threads itself
  // (PanelLinear), so OpenBLAS runs on the calling thread. Looked up by name: another BLAS
  // behind libblas.so.3 has no such call and nothing to change.
  using SetThreads = void (*)(int);
  if (auto set = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    set(1);
  }
  return at::get_num_threads();
}

}  // namespace llava
