"""Runnable example: the IS level on a synthetic long-response batch (NeMo-RL PR #2269).

Eight responses of ~9k tokens with a ~2% per-token log-prob mismatch between the inference
engine (``gen``) and the trainer (``prev``). Prints, per correction, the loss, the mean and
minimum IS weight, the effective sample size and the fraction of sequences rejected.

Run: ``python -m nemo_rs_plugin.example``
"""

from __future__ import annotations

import torch

from nemo_rs_plugin import RSClippedPGLoss

CORRECTIONS = {
    "none (NeMo-RL default)": {},
    "token": {"use_importance_sampling_correction": True, "is_correction_level": "token"},
    "sequence": {"use_importance_sampling_correction": True, "is_correction_level": "sequence"},
    "sequence_mean": {"use_importance_sampling_correction": True, "is_correction_level": "sequence_mean"},
    "sequence_mean + Geo-RS + veto": {
        "use_importance_sampling_correction": True,
        "is_correction_level": "sequence_mean",
        "rejection_sampling": [
            {"level": "sequence", "metric": "ratio", "agg": "mean", "lower": 0.97, "upper": 1.03},
            {"level": "sequence", "metric": "ratio", "agg": "any", "lower": 1e-4, "upper": 100},
        ],
    },
}


def synthetic_batch(batch: int = 8, response_tokens: int = 9000, prompt_tokens: int = 256,
                    mismatch: float = 0.02, seed: int = 0):
    """A NeMo-RL data dict with per-token mismatch ``d = prev - gen ~ N(-mismatch/2, mismatch)``."""
    g = torch.Generator().manual_seed(seed)
    S = prompt_tokens + response_tokens
    prev = -torch.rand(batch, S, generator=g) * 2
    d = mismatch * torch.randn(batch, S, generator=g) - mismatch / 2
    token_mask = torch.zeros(batch, S, dtype=torch.long)
    for i in range(batch):
        length = response_tokens - int(torch.randint(0, response_tokens // 4, (1,), generator=g))
        token_mask[i, prompt_tokens : prompt_tokens + length] = 1
    data = {
        "input_ids": torch.zeros(batch, S, dtype=torch.long),
        "advantages": torch.randn(batch, 1, generator=g).expand(batch, S).contiguous(),
        "prev_logprobs": prev * token_mask,
        "generation_logprobs": (prev - d) * token_mask,
        "reference_policy_logprobs": prev * token_mask,
        "token_mask": token_mask,
        "sample_mask": torch.ones(batch),
    }
    curr = (prev + 0.005 * torch.randn(batch, S, generator=g))[:, 1:]
    valid = token_mask[:, 1:].float()
    return curr, data, torch.tensor(float(batch)), valid.sum()


def main() -> None:
    curr, data, gvs, gvt = synthetic_batch()
    print(f"{int(gvs)} responses, {int(gvt)} response tokens, ~2% per-token mismatch")
    print(f"{'correction':<32} {'loss':>9} {'IS mean':>9} {'IS min':>9} {'ESS':>6} {'seq rej':>8}")
    for name, cfg in CORRECTIONS.items():
        lp = curr.clone().requires_grad_(True)
        loss, m = RSClippedPGLoss(cfg)(lp, data, gvs, gvt)
        loss.backward()
        print(
            f"{name:<32} {m['loss']:9.4f} {m['is_weight_mean']:9.4f} {m['is_weight_min']:9.3g} "
            f"{m['is_ess']:6.3f} {m.get('rs_seq_rejected_frac', 0.0):8.3f}"
        )


if __name__ == "__main__":
    main()
