"""GPU lane: on CUDA the loss makes no host sync beyond its one metric transfer.

Skipped without a GPU (CI has none); run it where one is available.
"""

import warnings

import pytest
import torch

from nemo_rs_plugin import RSClippedPGLoss
from tests.test_inputs import FULL

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("cfg", [{}, FULL])
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
