// Which x86-64 instruction set the CPU kernels use, chosen once per process. The build never
// assumes more than baseline x86-64 (no -march=native): each path's kernels are compiled with
// their own target attributes, and every call site asks ActiveCpuPath() before calling one, so
// the binary runs on any x86-64 CPU. Torch-free.
//
// LLAVA_CPU_PATH=generic|avx2|avx512|avx512bf16 forces a lower path on a better CPU (to test
// and benchmark every path on one machine); a path the CPU cannot run is clamped to the best it
// can, with a warning, never an illegal instruction.
#pragma once

#include <cstdint>
#include <string>

#include "engine/io/safetensors.h"  // DType

namespace llava {

enum class CpuPath {
  kGeneric = 0,     // portable C++ loops (any x86-64, or another architecture)
  kAvx2 = 1,        // AVX2 + FMA + F16C: bf16 converted to fp32 in registers
  kAvx512 = 2,      // AVX-512 F/BW/VL without BF16 dot products
  kAvx512Bf16 = 3,  // AVX512-BF16: vdpbf16ps on bf16 weights and caches as stored
};

// The best path this CPU (and OS) supports.
CpuPath DetectedCpuPath();
// The path the kernels use: DetectedCpuPath(), or LLAVA_CPU_PATH's when lower. Read once.
CpuPath ActiveCpuPath();
// True when the active path is `p` or better.
inline bool CpuPathAtLeast(CpuPath p) { return ActiveCpuPath() >= p; }

const char* CpuPathName(CpuPath p);  // "generic", "avx2", "avx512", "avx512bf16"
// Parses a name of CpuPathName; false for anything else.
bool ParseCpuPath(const std::string& name, CpuPath* out);

// Resolves a requested path against the detected one: the lower of the two. Exposed for tests.
CpuPath ClampCpuPath(CpuPath requested, CpuPath detected);

// The --dtype flag of the server and tools: "bf16" and "f32" force the weights' storage type;
// "auto" picks it for the device, the CPU path and the checkpoint's size:
// - bf16 on a GPU and on the AVX512-BF16 path (native bf16 products);
// - on the AVX2 and AVX-512 paths, bf16 (the kernels read bf16 weights and compute in fp32
//   registers, and decoding is bound by the bytes read), except for a checkpoint of at most
//   kAutoF32MaxParameters parameters (`parameters`; -1 when unknown): fp32 gives such a model
//   its first token in about half the time (no bf16 round trip around every op of the
//   prefill), at the price of decoding at ~0.6x (twice the bytes per step; docs/BENCHMARKS.md,
//   "`--dtype auto` by model size");
// - f32 on the generic path (ATen's fp32 BLAS; its bf16 products are slow there).
// False for another name. `why` (may be null) gets a one-line reason for the start-up log.
inline constexpr int64_t kAutoF32MaxParameters = int64_t{16} << 20;
bool ResolveDType(const std::string& name, const std::string& device, CpuPath path,
                  int64_t parameters, DType* out, std::string* why);

}  // namespace llava
