#include "train/lr_schedule.h"

#include <algorithm>
#include <cmath>

namespace llava::train {

double LrSchedule::Progress(int64_t step, double elapsed_s, double warm_s) const {
  if (step < warmup_steps) return 0;
  double p = steps > warmup_steps ? static_cast<double>(step - warmup_steps) /
                                        static_cast<double>(steps - warmup_steps)
                                  : 1.0;
  if (budget_s > 0) {
    const double left = budget_s - warm_s;
    p = std::max(p, left > 0 ? (elapsed_s - warm_s) / left : 1.0);
  }
  return std::clamp(p, 0.0, 1.0);
}

double LrSchedule::Rate(int64_t step, double elapsed_s, double warm_s) const {
  const double warm =
      warmup_steps > 0 ? std::min(1.0, (static_cast<double>(step) + 1) / warmup_steps) : 1.0;
  const double cosine = 0.5 * (1 + std::cos(M_PI * Progress(step, elapsed_s, warm_s)));
  return peak * warm * (floor_ratio + (1 - floor_ratio) * cosine);
}

}  // namespace llava::train
