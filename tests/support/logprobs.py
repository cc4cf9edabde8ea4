"""Valid log-probs for test batches: at most 0 wherever they are finite.

Random batches are built as ``prev + noise``, and the noise puts some values above 0, which
the loss warns about (``InputWarning``: probabilities passed as log-probs). Moving every input
of a token down by the same amount keeps each log-ratio between them (``curr - prev``,
``prev - gen``, ``ref - curr``, ...) as drawn (up to rounding), so what a test checks on ratios
does not change; only the probabilities ``exp(log p)`` of the moved tokens do, and they become
probabilities.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def at_most_zero(*logprobs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``logprobs`` moved down together, token by token, so that no finite entry is above 0.

    At each position the shift is the largest finite entry there (0 where none is above 0), so
    tokens already at most 0 are untouched. Non-finite entries stay as they are (a ``+inf``
    injected on purpose still warns). Shapes must broadcast to one another.
    """
    stacked = torch.stack(torch.broadcast_tensors(*logprobs))
    finite = torch.where(torch.isfinite(stacked), stacked, torch.full_like(stacked, -math.inf))
    shift = finite.amax(0).clamp_min(0)
    return tuple(t - shift for t in logprobs)


def at_most_zero_lists(*logprobs: Sequence[Sequence[float]]) -> tuple[list[list[float]], ...]:
    """:func:`at_most_zero` for ``[B][T]`` nested lists of floats (modified copies)."""
    rows, cols = len(logprobs[0]), len(logprobs[0][0]) if logprobs[0] else 0
    out = [[list(row) for row in lp] for lp in logprobs]
    for i in range(rows):
        for t in range(cols):
            shift = max([lp[i][t] for lp in logprobs if math.isfinite(lp[i][t])] + [0.0])
            if shift > 0:
                for lp in out:
                    lp[i][t] -= shift
    return tuple(out)
