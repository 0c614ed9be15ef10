// llava-train's learning rate: a linear warm-up over the first steps, then a cosine decay to a
// floor. The decay runs over the planned steps or, with a time budget, over whichever of the
// two is used up first: a run told "at most 58 minutes" then ends its decay at the 58th minute
// on a slow machine too, instead of being stopped by the clock part way down the cosine (the
// twelfth session's one-hour run stopped at step 3,856 of 4,400 with the rate still at 13% of
// the peak; docs/TRAINING.md).
#pragma once

#include <cstdint>

namespace llava::train {

struct LrSchedule {
  double peak = 3e-4;
  double floor_ratio = 0.1;  // the rate at the end, as a fraction of the peak
  int64_t warmup_steps = 150;
  int64_t steps = 3000;  // the decay ends here at the latest
  double budget_s = 0;   // > 0: the decay also ends when this much time has passed

  // The rate for `step` (0-based), `elapsed_s` seconds after the run began; `warm_s` is when
  // the warm-up ended (the elapsed time at step warmup_steps; ignored before it).
  double Rate(int64_t step, double elapsed_s, double warm_s) const;

  // Where the decay stands in [0, 1]: 0 until the warm-up ends, 1 when the steps or the time
  // are used up.
  double Progress(int64_t step, double elapsed_s, double warm_s) const;
};

}  // namespace llava::train
