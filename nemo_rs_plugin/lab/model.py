"""The lab's model, task and sampler: a tiny Qwen3-MoE decoder counting on, sampled with a KV cache.

No training here (that is :mod:`~nemo_rs_plugin.lab.experiment`): the model built from
a tiny config (random initialisation, nothing downloaded), the task's reward, autoregressive
sampling with the sampler's own log-probs, the trainer's log-probs of a batch, and the MoE
routing recorded on both sides.
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = [
    "DTYPES",
    "ModelSize",
    "RoutingRecorder",
    "build_model",
    "chance_reward",
    "model_vocab_size",
    "reward_of",
    "routing_diff",
    "sample",
    "token_logprobs",
]

#: ``--sampler-dtype`` names.
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class ModelSize(Protocol):
    """What :func:`build_model` reads (the lab's settings have these fields)."""

    vocab: int
    hidden: int
    layers: int
    experts: int
    top_k: int
    length: int


def build_model(s: "ModelSize", dtype: torch.dtype = torch.float32):
    """A tiny Qwen3-MoE decoder, randomly initialised from the global RNG."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=model_vocab_size(s.vocab),
        hidden_size=s.hidden,
        intermediate_size=2 * s.hidden,
        moe_intermediate_size=s.hidden,
        num_hidden_layers=s.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=s.hidden // 4,
        num_experts=s.experts,
        num_experts_per_tok=s.top_k,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        max_position_embeddings=s.length + 8,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return Qwen3MoeForCausalLM(cfg).to(dtype).eval()


class RoutingRecorder:
    """Records each MoE router's top-k expert indices, per call, via forward hooks."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls: list[list[torch.Tensor]] = []
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
        if not routers:
            raise RuntimeError("no MoE router found in the model")
        for m in routers:
            self._hooks.append(m.register_forward_hook(self._hook))
        self.n_layers = len(routers)
        self._current: list[torch.Tensor] = []

    def _hook(self, module: torch.nn.Module, args: tuple, out: tuple) -> None:
        self._current.append(out[2].detach().sort(-1).values)
        if len(self._current) == self.n_layers:
            self.calls.append(self._current)
            self._current = []

    def clear(self) -> None:
        self.calls, self._current = [], []


def model_vocab_size(vocab: int) -> int:
    """The model's vocabulary: the task's ``vocab`` tokens and BOS (id ``vocab``)."""
    return vocab + 1


def chance_reward(vocab: int, length: int) -> float:
    """Expected :func:`reward_of` of a sampler uniform over the model's whole vocabulary.

    The policy samples from :func:`model_vocab_size` tokens (BOS included, which is never
    right and makes the next token wrong). The first response token follows the start token
    (a task token): right with probability ``1/(V+1)``. Every later token follows a uniform
    token, a task token with probability ``V/(V+1)``, and is then right with ``1/(V+1)``.
    The reward is the mean over the ``length`` tokens: for ``vocab`` 16 and ``length`` 64,
    0.0554 (below ``1/vocab`` = 0.0625, which ignores BOS).
    """
    if vocab < 1 or length < 1:
        raise ValueError(f"vocab and length must be at least 1, got {vocab}, {length}")
    n = model_vocab_size(vocab)
    first, later = 1.0 / n, vocab / n**2
    return (first + (length - 1) * later) / length


def reward_of(responses: torch.Tensor, start: torch.Tensor, vocab: int) -> torch.Tensor:
    """Fraction of response tokens equal to their predecessor + 1 (mod vocab); BOS is wrong."""
    prev = torch.cat([start[:, None], responses[:, :-1]], dim=1)
    ok = (responses == (prev + 1) % vocab) & (responses < vocab) & (prev < vocab)
    return ok.float().mean(-1)


@torch.no_grad()
def sample(model, prompts: torch.Tensor, length: int, gen: torch.Generator):
    """Autoregressive sampling at temperature 1 with a KV cache; the sampler's own log-probs."""
    out = model(input_ids=prompts, use_cache=True)
    tokens, logps = [], []
    for t in range(length):
        logp = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
        tok = torch.multinomial(logp.exp(), 1, generator=gen)
        tokens.append(tok)
        logps.append(logp.gather(-1, tok))
        if t + 1 < length:
            out = model(input_ids=tok, past_key_values=out.past_key_values, use_cache=True)
    return torch.cat(tokens, 1), torch.cat(logps, 1)


def token_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """``[B, S-1]`` log-prob of each next token (NeMo-RL's ``next_token_logprobs``)."""
    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def routing_diff(sampler_calls, trainer_calls, B: int, P: int, L: int) -> float:
    """Fraction of response tokens whose top-k expert set differs (any layer), sampler vs trainer.

    A response token is routed when it is fed back as input: the sampler's decode steps
    1..L-1 route responses 0..L-2, the trainer's forward routes positions P..S-2 (the same
    tokens); the last response token is never an input and is not counted.
    """
    if L < 2 or not trainer_calls or len(sampler_calls) < L:
        return float("nan")
    trainer = trainer_calls[0]
    differs = torch.zeros(B, L - 1, dtype=torch.bool)
    for layer in range(len(trainer)):
        tr = trainer[layer].view(B, P + L, -1)[:, P : P + L - 1]
        sa = torch.stack([sampler_calls[1 + t][layer].view(B, -1) for t in range(L - 1)], dim=1)
        differs |= (tr != sa).any(-1)
    return float(differs.float().mean())
