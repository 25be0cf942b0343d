"""How often to checkpoint (lesson 12, notebooks/12_checkpoints_and_failures.ipynb).

A save every τ seconds costs δ each time; a failure throws away the work since the last save,
on average half an interval. With failures arriving at random, a mean time M between them, the
fraction of a job's time lost is, to first order,

    lost(τ) = δ / τ + τ / (2 M)

which is smallest at Young's interval

    τ = √(2 δ M)

(J. W. Young, "A first order approximation to the optimum checkpoint interval", Communications of
the ACM 17(9), 1974, 530-531), where the time lost is √(2 δ / M). J. T. Daly, "A higher order
estimate of the optimum checkpoint interval for restart dumps", Future Generation Computer Systems
22(3), 2006, 303-312, adds the restart time and higher-order terms to the cost (the restart time
drops out of his optimum interval); his Fig. 3 case (M = 24 h, δ = 5 min, restart R = 10 min) gives
τopt = 117 min, where Young's formula gives 120 min. First order leaves out the restart time,
failures during a save or a restart, and more than one failure in an interval: it holds for δ much
smaller than M.
"""

from __future__ import annotations

import math

# Llama Team, "The Llama 3 Herd of Models", 2024, §3.3.4 and Table 5: 419 unexpected
# interruptions in a 54-day snapshot of pre-training on up to 16,384 H100 GPUs
LLAMA3_INTERRUPTIONS, LLAMA3_DAYS = 419, 54
LLAMA3_MTBF_S = LLAMA3_DAYS * 24 * 3600 / LLAMA3_INTERRUPTIONS  # 3.1 h, our arithmetic

# Daly (2006), Fig. 3's case: the mean time between failures, the dump time, and the optimum
# interval his higher-order model predicts (quoted, in minutes)
DALY_FIG3_MTBF_MIN, DALY_FIG3_SAVE_MIN, DALY_FIG3_OPTIMUM_MIN = 24 * 60, 5, 117


def young_interval(save_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum: the seconds between saves, √(2 δ M)."""
    return math.sqrt(2 * save_s * mtbf_s)


def lost_fraction(interval_s: float, save_s: float, mtbf_s: float) -> float:
    """The fraction of the job's time spent saving (δ / τ) or redoing lost work (τ / 2M), to
    first order."""
    return save_s / interval_s + interval_s / (2 * mtbf_s)
