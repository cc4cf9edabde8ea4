"""``policy.logprob_chunk_size`` reaching the loss: a bad value is refused by name, a good one is used.

docs/parallelism.md and docs/cli.md promise that NeMo-RL's ``policy.logprob_chunk_size`` of 0,
2.5 or ``true`` reaching the loss on the logits input is refused by name, never replaced by the
plugin's default. Only the slow real-Megatron test passed a bad value; these are fast: the glue
(``_logprob_chunk_size``) and a call of the loss through the host's
``wrap_loss_fn_with_input_preparation`` as the seam replaced it (``nemo_rs_plugin.nemo_rl.seam``),
with NeMo-RL's ``prepare_fn`` (a ``functools.partial`` binding ``sampling_params`` and
``chunk_size``), against tests/fake_hosts/supported in this process.
"""

import functools
import sys
from pathlib import Path

import pytest
import torch

from nemo_rs_plugin.core.settings.config import ConfigError
from tests.conftest import make_batch

FAKE = Path(__file__).resolve().parents[1] / "fake_hosts" / "supported"
BAD = [0, -3, 2.5, True, "64"]


def _is_host(name):
    return name == "nemo_rl" or name.startswith("nemo_rl.") or name == "nemo_rs_plugin.nemo_rl.loss_fn"


@pytest.fixture
def glue(monkeypatch):
    """``nemo_rs_plugin.nemo_rl.loss_fn`` imported against the stand-in host; the modules restored after."""
    saved = {k: v for k, v in sys.modules.items() if _is_host(k)}
    for k in saved:
        del sys.modules[k]
    sys.path.insert(0, str(FAKE))
    try:
        from nemo_rs_plugin.nemo_rl import loss_fn

        yield loss_fn
    finally:
        sys.path.remove(str(FAKE))
        for k in [k for k in sys.modules if _is_host(k)]:
            del sys.modules[k]
        sys.modules.update(saved)
        import nemo_rs_plugin.nemo_rl as package

        if "nemo_rs_plugin.nemo_rl.loss_fn" in saved:
            package.loss_fn = saved["nemo_rs_plugin.nemo_rl.loss_fn"]
        elif hasattr(package, "loss_fn"):
            del package.loss_fn


@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_the_glue_refuses_a_bad_chunk_size_by_name(glue, bad):
    with pytest.raises(ConfigError) as info:
        glue._logprob_chunk_size({"sampling_params": None, "chunk_size": bad})
    assert f"policy.logprob_chunk_size: got {bad!r}; allowed: a positive integer" in str(info.value)


def test_the_glue_takes_a_good_chunk_size_and_none_for_unset(glue):
    assert glue._logprob_chunk_size({"sampling_params": None, "chunk_size": 7}) == 7
    assert glue._logprob_chunk_size({"sampling_params": None}) is None
    assert glue._logprob_chunk_size({}) is None


def _prepare(logits, data, loss_fn, vocab_parallel_rank=None, sampling_params=None, chunk_size=None):
    """NeMo-RL's ``prepare_loss_input`` for a LOGIT-input loss: the raw logits."""
    return {"logits": logits}, data


def _wrapper_call(loss, logits, data, gvs, gvt, chunk_size):
    """NeMo-RL's unpacked wrapper (the seam's): its ``prepare_fn`` binds the chunk size."""
    from nemo_rl.algorithms import loss as host_loss

    from nemo_rs_plugin.nemo_rl import seam

    assert seam.UNPACKED in seam.installed_in(host_loss)
    prepare_fn = functools.partial(_prepare, sampling_params=None, chunk_size=chunk_size)
    return host_loss.wrap_loss_fn_with_input_preparation(logits, data, gvs, gvt, loss, prepare_fn)


@pytest.fixture
def sharded_loss_and_batch(glue):
    loss = glue.RSClippedPGLossFn(
        {"name": "rs_clipped_pg", "use_importance_sampling_correction": True, "sharded_logits_input": True}
    )
    prev = -torch.rand(2, 5)
    _, data, gvs, gvt = make_batch(prev, prev, prev, advantages=torch.randn(2, 5))
    logits = torch.randn(2, 6, 11)
    return loss, logits, data, gvs, gvt


@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_a_bad_chunk_size_bound_into_prepare_fn_is_refused_by_the_loss(sharded_loss_and_batch, bad):
    loss, logits, data, gvs, gvt = sharded_loss_and_batch
    with pytest.raises(ConfigError, match=r"policy\.logprob_chunk_size: got "):
        _wrapper_call(loss, logits, data, gvs, gvt, bad)


@pytest.mark.parametrize("chunk_size", [3, None])
def test_a_good_chunk_size_bound_into_prepare_fn_reaches_the_sharded_loss(
    sharded_loss_and_batch, monkeypatch, chunk_size
):
    from nemo_rs_plugin.parallel import sharded

    seen = {}

    def fake_sharded_loss(core, logits, data, gvs, gvt, **kwargs):
        seen.update(kwargs)
        return logits.sum() * 0, {}

    monkeypatch.setattr(sharded, "sharded_loss", fake_sharded_loss)
    loss, logits, data, gvs, gvt = sharded_loss_and_batch
    _wrapper_call(loss, logits, data, gvs, gvt, chunk_size)
    assert seen["chunk_size"] == chunk_size
