"""A lab per-seed outcome row (lab/dose.SEED_FIELDS) built by hand, for the lab's table tests."""

from __future__ import annotations

import math

from nemo_rs_plugin.lab.dose import SEED_FIELDS


def seed_outcome(config: str, lag: int, seed: int, **values) -> dict:
    """Every column of the per-seed CSV: 0.0, no band, no flag raised; ``values`` override."""
    o = {k: 0.0 for k in SEED_FIELDS}
    o.update(
        config=config,
        lag=lag,
        seed=seed,
        collapsed=False,
        at_chance=False,
        spiked=False,
        warned=False,
        evals=3,
        chance=0.0554,
        band_lower=math.nan,
        band_upper=math.nan,
    )
    o.update(values)
    return o
