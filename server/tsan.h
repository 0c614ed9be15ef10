// ThreadSanitizer and gRPC built without it: a reactor's call into gRPC (StartWrite, Finish)
// happens before gRPC's call back into it (OnWriteDone, OnDone) on another thread, but that
// order is kept by gRPC's library, whose synchronisation TSan cannot see. These two marks tell
// it; they compile to nothing outside a TSan build (`make test-tsan`: clang, -fsanitize=thread).
#pragma once

#if defined(__SANITIZE_THREAD__)  // gcc
#define LLAVA_TSAN 1
#elif defined(__has_feature)  // clang
#if __has_feature(thread_sanitizer)
#define LLAVA_TSAN 1
#endif
#endif

#if defined(LLAVA_TSAN)
#include <sanitizer/tsan_interface.h>
#define LLAVA_HANDED_TO_GRPC(p) __tsan_release(static_cast<void*>(p))
#define LLAVA_CALLED_BY_GRPC(p) __tsan_acquire(static_cast<void*>(p))
#else
#define LLAVA_HANDED_TO_GRPC(p) ((void)0)
#define LLAVA_CALLED_BY_GRPC(p) ((void)0)
#endif
