"""When rejection eats the batch: the threshold, and the run-time warning.

A rejection filter is healthy while it removes a small share of the batch: the sequences it
drops are the far tail of the mismatch. When it drops a large share, the gradient rests on
the few survivors (AdamW rescales a small gradient to a full-size step) and learning slows
or stops: in the lab, Geo-RS ``[0.99, 1.01]`` under staleness rejected most of the sequences
and lost to a band calibrated from the run (the numbers: docs/lab.md#confirmation).
``UNHEALTHY_SEQ_REJECTION`` is the line the docs, ``nemo-rs check --mismatch`` and this warning
share: more than 20% of sequences rejected.

:class:`RejectionMonitor` counts, per loss instance, the sequences the filters dropped and
the sequences with a valid token, over windows of at least ``window`` sequences, from numbers
the loss has already moved to the host (no extra sync). When a window's rejected share exceeds
the threshold it logs a warning on the ``nemo_rs_plugin`` logger, rate-limited: at the 1st,
10th, 100th, ... unhealthy window, each message saying how many there were.
"""

from __future__ import annotations

import logging
from typing import Optional

__all__ = ["UNHEALTHY_SEQ_REJECTION", "RejectionMonitor", "LOGGER"]

#: More than this share of sequences rejected is unhealthy (docs/guide.md, "When rejection eats the batch").
UNHEALTHY_SEQ_REJECTION = 0.2

LOGGER = logging.getLogger("nemo_rs_plugin")


class RejectionMonitor:
    """Windows of rejected/valid sequence counts; a rate-limited warning above the threshold."""

    def __init__(self, threshold: float = UNHEALTHY_SEQ_REJECTION, window: float = 256.0) -> None:
        self.threshold, self.window = threshold, window
        self.dropped = self.valid = 0.0  # the current window
        self.unhealthy_windows = 0
        self._next_report = 1  # warn at the 1st, 10th, 100th, ... unhealthy window

    def observe(self, dropped: float, valid: float) -> Optional[str]:
        """Add one loss call's counts; the warning's text when one is logged, else ``None``."""
        self.dropped += dropped
        self.valid += valid
        if self.valid < self.window:
            return None
        share = self.dropped / self.valid
        sequences = self.valid
        self.dropped = self.valid = 0.0
        if share <= self.threshold:
            return None
        self.unhealthy_windows += 1
        if self.unhealthy_windows < self._next_report:
            return None
        self._next_report *= 10
        message = (
            f"rejection sampling dropped {share:.0%} of the last {sequences:.0f} sequences (more than "
            f"{self.threshold:.0%}; {self.unhealthy_windows} such window(s) so far): the gradient rests on "
            "the few survivors. Widen the bounds or calibrate them to your mismatch "
            "(nemo-rs calibrate; docs/guide.md, 'When rejection eats the batch')"
        )
        LOGGER.warning(message)
        return message
