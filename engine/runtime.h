// Process-level libtorch setup. Torch-free header.
#pragma once

namespace llava {

// Sets libtorch's intra-op thread count (Debian's libtorch starts with 1 on these machines).
// `threads` <= 0 means one per hardware core. Returns the count in effect.
int InitTorchThreads(int threads);

}  // namespace llava
