// Process-level libtorch setup. Torch-free header.
#pragma once

namespace llava {

// Sets libtorch's intra-op thread count (Debian's libtorch starts with 1 on these machines).
// `threads` <= 0 means one per hardware core. Returns the count in effect. Also makes
// OpenBLAS single-threaded: the engine's fp32 products are split over libtorch's threads
// (PanelLinear in llava_model.h), and OpenBLAS's own threads would compete with them.
int InitTorchThreads(int threads);

}  // namespace llava
