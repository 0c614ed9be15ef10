#include "engine/runtime.h"

#include <ATen/Parallel.h>

#include <thread>

namespace llava {

int InitTorchThreads(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  at::set_num_threads(threads);
  return at::get_num_threads();
}

}  // namespace llava
