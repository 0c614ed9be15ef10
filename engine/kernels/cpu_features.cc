#include "engine/kernels/cpu_features.h"

#include <cstdio>
#include <cstdlib>

namespace llava {

CpuPath DetectedCpuPath() {
#if defined(__x86_64__) || defined(__i386__)
  // libgcc's checks include the OS's XSAVE support for the AVX and AVX-512 register states.
  static const CpuPath path = [] {
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
    if (avx512 && __builtin_cpu_supports("avx512bf16")) return CpuPath::kAvx512Bf16;
    if (avx512) return CpuPath::kAvx512;
    if (avx2) return CpuPath::kAvx2;
    return CpuPath::kGeneric;
  }();
  return path;
#else
  return CpuPath::kGeneric;
#endif
}

CpuPath ClampCpuPath(CpuPath requested, CpuPath detected) {
  return requested < detected ? requested : detected;
}

CpuPath ActiveCpuPath() {
  static const CpuPath path = [] {
    const CpuPath detected = DetectedCpuPath();
    const char* env = std::getenv("LLAVA_CPU_PATH");
    if (env == nullptr || *env == '\0') return detected;
    CpuPath requested;
    if (!ParseCpuPath(env, &requested)) {
      std::fprintf(stderr,
                   "LLAVA_CPU_PATH=%s is not one of generic, avx2, avx512, avx512bf16; using %s\n",
                   env, CpuPathName(detected));
      return detected;
    }
    if (requested > detected) {
      std::fprintf(stderr, "LLAVA_CPU_PATH=%s: this CPU supports only %s; using it\n", env,
                   CpuPathName(detected));
    }
    return ClampCpuPath(requested, detected);
  }();
  return path;
}

const char* CpuPathName(CpuPath p) {
  switch (p) {
    case CpuPath::kGeneric:
      return "generic";
    case CpuPath::kAvx2:
      return "avx2";
    case CpuPath::kAvx512:
      return "avx512";
    case CpuPath::kAvx512Bf16:
      return "avx512bf16";
  }
  return "generic";
}

bool ParseCpuPath(const std::string& name, CpuPath* out) {
  for (CpuPath p : {CpuPath::kGeneric, CpuPath::kAvx2, CpuPath::kAvx512, CpuPath::kAvx512Bf16}) {
    if (name == CpuPathName(p)) {
      *out = p;
      return true;
    }
  }
  return false;
}

bool ResolveDType(const std::string& name, const std::string& device, CpuPath path,
                  int64_t parameters, DType* out, std::string* why) {
  std::string reason;
  if (name == "bf16" || name == "f32") {
    *out = name == "bf16" ? DType::kBF16 : DType::kF32;
    reason = name + " (forced by --dtype)";
  } else if (name != "auto") {
    return false;
  } else if (device.rfind("cuda", 0) == 0) {
    *out = DType::kBF16;
    reason = "bf16 (auto: GPU)";
  } else if (path == CpuPath::kAvx512Bf16) {
    *out = DType::kBF16;
    reason = "bf16 (auto: the avx512bf16 kernels multiply bf16 natively)";
  } else if (path >= CpuPath::kAvx2 && (parameters < 0 || parameters > kAutoF32MaxParameters)) {
    *out = DType::kBF16;
    reason = std::string("bf16 (auto: the ") + CpuPathName(path) +
             " kernels read bf16 weights and compute in fp32)";
  } else if (path >= CpuPath::kAvx2) {
    *out = DType::kF32;
    reason = "f32 (auto: " + std::to_string(parameters) +
             " parameters: a small model's first token comes sooner in fp32 on the " +
             CpuPathName(path) + " path)";
  } else {
    *out = DType::kF32;
    reason = "f32 (auto: the generic CPU path has no vector bf16 kernels)";
  }
  if (why != nullptr) *why = reason;
  return true;
}

}  // namespace llava
