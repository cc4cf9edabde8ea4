"""Shared helpers: NeMo-RL-shaped batches and the location of the recorded fixtures."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis.configuration import set_hypothesis_home_dir

# Property tests are reproducible and leave nothing behind: examples are derived from each
# test's own name (derandomize), and no example database is written (no .hypothesis/ in the
# tree). HYPOTHESIS_PROFILE=explore draws fresh random examples, still without a database.
settings.register_profile("nemo-rs", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, database=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "nemo-rs"))
# Hypothesis also caches constants read from the source on disk, database or not: keep them
# in a private temporary directory, removed at exit, instead of ``.hypothesis/`` in the tree.
_HYPOTHESIS_HOME = tempfile.TemporaryDirectory(prefix="nemo-rs-hypothesis-")
set_hypothesis_home_dir(_HYPOTHESIS_HOME.name)

# Under pytest-xdist (CI and the README's command run `-n auto`): the workers share the cores, so
# each takes its share of torch's intra-op threads instead of every worker taking all of them, and
# so does every process a test starts (gloo ranks, scripts the fork server runs, other venvs'
# interpreters, which read OMP_NUM_THREADS from the environment they inherit). Left at the cores'
# count, each such process ran two OpenMP threads beside the other worker's on 2 cores: the
# NeMo-RL packing, seam and live-parity files took 154 s against 120 s with one thread each
# (2026-11-29). A value the caller set is kept.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _THREADS = max(1, (os.cpu_count() or 1) // _WORKERS)
    torch.set_num_threads(_THREADS)
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURE_NAME = "upstream_clipped_pg_public.pt"
SHIPPED_FIXTURES = Path(__file__).resolve().parent / "data"


def fixtures_path() -> Path:
    """NeMo-RL's recorded outputs: ``$NEMO_RS_FIXTURES`` if set, else the copy in ``tests/data``.

    The recording ships with the repository (see ``tests/data/README.md``), so the parity
    tests run in a clean clone. A ``$NEMO_RS_FIXTURES`` that does not hold the file is an
    error, not a silent fall-back to the shipped copy.
    """
    override = os.environ.get("NEMO_RS_FIXTURES")
    folder = Path(override) if override else SHIPPED_FIXTURES
    path = folder / FIXTURE_NAME
    if not path.is_file():
        where = f"$NEMO_RS_FIXTURES={override}" if override else str(folder)
        raise FileNotFoundError(f"{FIXTURE_NAME} not found in {where}")
    return path


def make_batch(
    curr,
    prev,
    gen,
    *,
    advantages=None,
    token_mask=None,
    sample_mask=None,
    ref=None,
    rewards=None,
):
    """NeMo-RL data dict from aligned ``[B, T]`` tensors (a dummy position 0 is prepended).

    Returns ``(next_token_logprobs, data, global_valid_seqs, global_valid_toks)`` with the
    global counts equal to this batch's own.
    """
    curr = torch.as_tensor(curr, dtype=torch.float32)
    prev = torch.as_tensor(prev, dtype=torch.float32)
    gen = torch.as_tensor(gen, dtype=torch.float32)
    B, T = curr.shape
    advantages = torch.ones(B, T) if advantages is None else torch.as_tensor(advantages, dtype=torch.float32)
    token_mask = torch.ones(B, T, dtype=torch.long) if token_mask is None else torch.as_tensor(token_mask).long()
    sample_mask = torch.ones(B) if sample_mask is None else torch.as_tensor(sample_mask, dtype=torch.float32)
    ref = prev.clone() if ref is None else torch.as_tensor(ref, dtype=torch.float32)

    def pad(x):
        return torch.cat([torch.zeros(B, 1, dtype=x.dtype), x], dim=1)

    data = {
        "input_ids": torch.zeros(B, T + 1, dtype=torch.long),
        "advantages": pad(advantages),
        "prev_logprobs": pad(prev),
        "generation_logprobs": pad(gen),
        "reference_policy_logprobs": pad(ref),
        "token_mask": pad(token_mask),
        "sample_mask": sample_mask,
    }
    if rewards is not None:
        data["rewards"] = torch.as_tensor(rewards, dtype=torch.float32)
    valid = token_mask.float() * sample_mask[:, None]
    gvs = sample_mask.sum()
    gvt = valid.sum()
    lp = curr.clone().requires_grad_(True)
    return lp, data, gvs, gvt


def random_batch(B, T, *, spread=1.0, curr_noise=0.05, gen_noise=0.1, ref_noise=None, rewards=None):
    """:func:`make_batch` of random log-probs near one another, from torch's global generator.

    ``prev`` is uniform on ``[-spread, 0]``; ``curr``, ``gen`` (and ``ref`` with ``ref_noise``)
    are ``prev`` plus Gaussian noise of those scales, drawn in that order, then moved down
    together to at most 0 (the log-ratios unchanged); advantages are standard normal. The one
    builder of the core tests' random batches (the autouse ``_seed`` makes each test's draw the same).
    """
    from tests.support.logprobs import at_most_zero

    prev = -torch.rand(B, T) * spread
    noisy = [prev + curr_noise * torch.randn(B, T), prev, prev + gen_noise * torch.randn(B, T)]
    if ref_noise is not None:
        noisy.append(prev + ref_noise * torch.randn(B, T))
    curr, prev, gen, *ref = at_most_zero(*noisy)
    return make_batch(curr, prev, gen, ref=ref[0] if ref else None, advantages=torch.randn(B, T), rewards=rewards)


@pytest.fixture(autouse=True)
def _own_worker_path(tmp_path, monkeypatch):
    """The start-up hook's worker-path link goes under this test's tmp_path (in every
    interpreter the test starts), never to a folder shared between tests or runs."""
    monkeypatch.setenv("NEMO_RS_PLUGIN_WORKER_PATH", str(tmp_path / "worker-path"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_xdist_make_scheduler(config, log):
    """One work unit per test file, and per NeMo-RL checkout where a test takes a ``host``.

    ``--dist loadgroup`` (pyproject's ``addopts``) schedules by :mod:`tests.support.xdist_units`:
    a module's shared world (a multi-process run of every case) stays in one worker, and the three
    checkouts' worlds of one file run side by side. Without xdist this hook is never called.
    """
    from tests.support.xdist_units import make_scheduler

    return make_scheduler(config, log)
