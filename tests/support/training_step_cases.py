"""What ``tests/nemo_rl/test_training_step.py`` trains: loss sections, splits and the batch (no NeMo-RL here).

Imported by the test (to read the expectations) and by ``tests/support/training_step_host.py``
(in the ranks, to build the step). Everything is deterministic: the batch is drawn from fixed
seeds, and the only thing the ranks add to it is the model's own log-probs (``prev_logprobs``).

The batch: ``NUM_GLOBAL_BATCHES_MAX * GBS`` sequences of 6-20 tokens (a 2-4 token prompt, the
rest response) on a vocabulary of ``VOCAB``. The mismatch ``d = prev - gen`` is drawn per token
and shaped per sequence (:data:`SHIFTS`, :data:`OUTLIERS`) so that each filter of
:data:`CORRECTED` rejects known sequences, a different share in each global batch, and one
sequence of each global batch is masked out (``sample_mask`` 0) with an outlier of its own, which
no filter may count.
"""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 64
#: Sequences per global batch (``train_global_batch_size``).
GBS = 8
NUM_GLOBAL_BATCHES_MAX = 2
NUM_SEQUENCES = GBS * NUM_GLOBAL_BATCHES_MAX
#: Padded length of the batch's rows (NeMo-RL right-pads; the longest sequence is 20 tokens).
MAX_LEN = 20
#: ``sample_mask`` 0 (one per global batch).
MASKED = (5, 12)
#: A constant added to every response token's ``d`` of a sequence: its geometric-mean ratio leaves
#: ``[0.9, 1.1]`` (Geo-RS rejects it).
SHIFTS = {1: 0.25, 3: -0.2, 9: 0.3}
#: One token with ``d = 1.7`` (ratio 5.47 > 5) and the sequence's other tokens compensating so
#: its mean ``d`` stays 0 (only the ``agg: max`` filter rejects it; the token filter rejects that
#: token). Sequence 5 is masked out: never counted.
OUTLIERS = (6, 11, 14, 5)
#: Tokens with ``d = 0.9`` (ratio 2.46): above the TIS bound 2, inside the token filter's band.
TRUNCATED = ((8, 0), (13, 2), (15, 1))

#: The loss sections with only NeMo-RL's own fields: NeMo-RL's ``ClippedPGLossFn`` is the control.
PARITY: dict[str, dict[str, Any]] = {
    # NeMo-RL's defaults: PPO clip 0.2, k3 KL penalty 0.01 to the reference policy
    "nemo_rl/ppo": {},
    # NeMo-RL's own token-level IS correction with TIS at 2
    "nemo_rl/is_tis": {
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 2.0,
    },
    # GSPO: the sequence-level policy ratio, the mean of per-sequence means
    "nemo_rl/gspo": {"sequence_level_importance_ratios": True, "token_level_loss": False},
}
#: Sequence-level correction with two sequence filters (``agg: max`` is labelled ``largest``).
SEQUENCE_FILTERS = [
    {"level": "sequence", "statistic": "ratio", "agg": "mean", "lower": 0.9, "upper": 1.1},
    {"level": "sequence", "agg": "max", "upper": 5.0},
]
#: The plugin's corrections (is_batch_normalization is left out on purpose: see the test).
CORRECTED: dict[str, dict[str, Any]] = {
    "rs/sequence_mean+filters": {
        "use_importance_sampling_correction": True,
        "is_correction_level": "sequence_mean",
        "rejection_sampling": SEQUENCE_FILTERS,
    },
    "rs/token_tis+token_filter": {
        "use_importance_sampling_correction": True,
        "is_correction_level": "token",
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 2.0,
        "rejection_sampling": [{"level": "token", "statistic": "ratio", "lower": 0.2, "upper": 5.0}],
    },
}
#: Metric labels of :data:`SEQUENCE_FILTERS` (the plugin's defaults) and what each rejects.
SEQUENCE_FILTER_LABELS = ("sequence_ratio_mean", "sequence_ratio_largest")


#: The cover of :func:`splits`: each kind of split once (one and two global batches, one and
#: several microbatches, both packing lengths, uneven packed shards), with the one-rank references
#: (:func:`reference_split`) and the packed runs NeMo-RL's GSPO metric is compared with.
COVER = {
    1: ("dp1/gb1/mbs8", "dp1/gb2/mbs8", "dp1/gb2/mbs2", "dp1/gb1/packed40", "dp1/gb2/packed40"),
    2: ("dp2/gb1/mbs4", "dp2/gb2/mbs2", "dp2/gb2/packed64", "dp2/gb2/packed40-uneven"),
}


def splits(dp: int, every: bool = True) -> dict[str, dict[str, Any]]:
    """The splits of one step run in a ``dp``-rank world, by name (``every=False``: their :data:`COVER`).

    ``mbs``: ``train_micro_batch_size`` (no packing); ``tokens``: sequence packing's
    ``train_mb_tokens``; ``uneven``: packing with hand-made shards, one bin moved from rank 1 to
    rank 0 in every global batch (rank 1 then runs NeMo-RL's dummy microbatch).
    """
    local = GBS // dp
    sizes = [m for m in (8, 4, 2, 1) if m <= local][: 3 if dp == 1 else 4]
    out = {}
    for ngb in (1, 2):
        for mbs in sizes:
            out[f"dp{dp}/gb{ngb}/mbs{mbs}"] = {"dp": dp, "ngb": ngb, "mbs": mbs, "packing": None}
        for tokens in (40, 64):
            out[f"dp{dp}/gb{ngb}/packed{tokens}"] = {"dp": dp, "ngb": ngb, "mbs": 1, "packing": tokens}
        if dp == 2:
            out[f"dp{dp}/gb{ngb}/packed40-uneven"] = {
                "dp": dp,
                "ngb": ngb,
                "mbs": 1,
                "packing": 40,
                "uneven": True,
            }
    return out if every else {name: split for name, split in out.items() if name in COVER[dp]}


def reference_split(ngb: int) -> str:
    """One microbatch per global batch on one rank, no packing."""
    return f"dp1/gb{ngb}/mbs{GBS}"


def batch_spec() -> dict[str, torch.Tensor]:
    """Everything of the batch but the log-probs: ids, lengths, masks, advantages and ``d = prev - gen``."""
    g = torch.Generator().manual_seed(1234)
    B, S = NUM_SEQUENCES, MAX_LEN
    lengths = torch.randint(6, MAX_LEN + 1, (B,), generator=g)
    lengths[[6, 14, 5]] = torch.tensor([MAX_LEN, MAX_LEN - 1, 16])  # room for an outlier and its compensation
    prompts = torch.randint(2, 5, (B,), generator=g)
    input_ids = torch.randint(1, VOCAB, (B, S), generator=g)  # 0 is the pad/eos id
    token_mask = torch.zeros(B, S, dtype=torch.long)
    for i in range(B):
        input_ids[i, lengths[i] :] = 0
        token_mask[i, prompts[i] : lengths[i]] = 1
    sample_mask = torch.ones(B)
    sample_mask[list(MASKED)] = 0.0
    advantages = torch.randn(B, 1, generator=g).expand(B, S).clone()
    advantages[4] = 0.0  # a sequence without gradient signal
    d = 0.03 * torch.randn(B, S, generator=g)
    for i, shift in SHIFTS.items():
        d[i] += shift
    for i in OUTLIERS:
        valid = token_mask[i].nonzero().flatten()
        d[i, valid] = -1.7 / (len(valid) - 1)
        d[i, valid[len(valid) // 2]] = 1.7
    for i, k in TRUNCATED:
        valid = token_mask[i].nonzero().flatten()
        d[i, valid[k]] = 0.9
    d = d * token_mask
    return {
        "input_ids": input_ids,
        "input_lengths": lengths,
        "token_mask": token_mask,
        "sample_mask": sample_mask,
        "advantages": advantages,
        "d": d,
    }


def _sequence_values(spec: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence: the geometric-mean ratio and the largest token ratio over the loss tokens.

    NeMo-RL's loss sees ``token_mask[:, 1:]`` (position 0 is dropped): the first response token
    is at ``prompt >= 2``, so every response token is in the loss.
    """
    mask = spec["token_mask"].to(torch.float64)
    d = spec["d"].to(torch.float64)
    mean = torch.exp((d * mask).sum(-1) / mask.sum(-1))
    largest = torch.exp(torch.where(mask.bool(), d, torch.full_like(d, -torch.inf)).amax(-1))
    return mean, largest


def expected_sequence_rejections(ngb: int) -> dict[str, float]:
    """The step's ``rs/<label>/seq_rejected_frac`` of :data:`SEQUENCE_FILTERS`, from the batch alone.

    Per global batch: the valid sequences (``sample_mask`` 1) a filter rejects and an earlier
    one did not, over the global batch's valid sequences; the step's value is their mean over the
    global batches (NeMo-RL divides every metric by the number of global batches and sums).
    """
    spec = batch_spec()
    mean, largest = _sequence_values(spec)
    out = dict.fromkeys(SEQUENCE_FILTER_LABELS, 0.0)
    for gb in range(ngb):
        rows = slice(gb * GBS, (gb + 1) * GBS)
        valid = spec["sample_mask"][rows].bool()
        first = valid & ((mean[rows] < 0.9) | (mean[rows] > 1.1))
        second = valid & ~first & (largest[rows] > 5.0)
        n = float(valid.sum())
        out["sequence_ratio_mean"] += float(first.sum()) / n / ngb
        out["sequence_ratio_largest"] += float(second.sum()) / n / ngb
    return out
