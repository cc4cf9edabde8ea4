"""GPU lane: on CUDA the loss makes no host sync beyond its one metric transfer.

Skipped without a GPU (CI has none); run it where one is available.
"""

import warnings

import pytest
import torch

from nemo_rs_plugin import RSClippedPGLoss
from tests.test_inputs import FULL

# Issue 9's additions, all at once: probability-space and curr-based statistics, both KL
# directions, an advantage-conditioned filter and batch normalisation (its extra reduction
# included), at token and sequence level.
PEER_MODES = {
    "use_importance_sampling_correction": True, "is_correction_level": "token",
    "truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 2.0,
    "is_batch_normalization": "data_parallel",
    "rejection_sampling": [
        {"level": "sequence", "metric": "ratio", "agg": "min", "lower": 1e-4},
        {"level": "token", "metric": "binary_kl", "upper": 0.05},
        {"level": "sequence", "metric": "total_variation", "agg": "mean", "upper": 0.2},
        {"level": "sequence", "metric": "mult_prob_error", "agg": "mean", "upper": 1.5},
        {"level": "sequence", "metric": "kl_k1", "agg": "mean", "upper": 0.01, "log_ratio": "curr-gen",
         "negative_advantages_only": True},
        {"level": "token", "metric": "kl_k3", "upper": 0.4, "log_ratio": "gen-prev"},
    ],
}
PEER_MODES_SEQUENCE = {**PEER_MODES, "is_correction_level": "sequence", "is_batch_normalization": "microbatch"}

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("cfg", [{}, FULL, PEER_MODES, PEER_MODES_SEQUENCE])
def test_single_host_sync_on_cuda(cfg):
    from tests.test_inputs import batch

    lp, data, gvs, gvt = batch()
    lp = lp.detach().cuda().requires_grad_(True)
    data = {k: v.cuda() for k, v in data.items()}
    loss_fn = RSClippedPGLoss(cfg)
    loss_fn(lp, data, gvs.cuda(), gvt.cuda())  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss, _ = loss_fn(lp, data, gvs.cuda(), gvt.cuda())
            loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
