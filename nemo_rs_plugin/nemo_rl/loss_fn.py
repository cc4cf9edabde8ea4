"""``RSClippedPGLossFn``: the NeMo-RL loss class that recipes select with ``loss_fn.name: rs_clipped_pg``.

It subclasses NeMo-RL's ``ClippedPGLossFn`` (``isinstance``, ``loss_type``, ``input_type``,
``metric_normalizations``, ``use_fused_linear_logprobs``, pickling) and forwards ``__call__`` to
the host-independent :class:`~nemo_rs_plugin.core.loss.CorrectedPGLoss`; with
``sharded_logits_input`` to :func:`~nemo_rs_plugin.parallel.sharded.sharded_loss`, with the TP
and CP groups read from megatron-core's ``parallel_state``. The rules that depend on the
NeMo-RL version are in :mod:`nemo_rs_plugin.nemo_rl.host`; how recipes reach this class is in
:mod:`nemo_rs_plugin.nemo_rl.activation`; what NeMo-RL's wrappers hold that the call's arguments
do not carry (its ``prepare_fn``'s keywords, the packed microbatch) reaches it through
:mod:`nemo_rs_plugin.nemo_rl.seam` (:meth:`RSClippedPGLossFn.nemo_rl_call`).

Supported hosts: NeMo-RL v0.6.0 (TypedDict config), v0.7.0 and main (pydantic config), all
with the loss in ``nemo_rl.algorithms.loss`` taking next-token log-probs.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Optional

import torch

try:
    from nemo_rl.algorithms.loss import ClippedPGLossFn
    from nemo_rl.algorithms.loss.interfaces import LossInputType
except ImportError as exc:  # pragma: no cover - exercised where NeMo-RL is absent
    raise ImportError(
        "RSClippedPGLossFn needs NeMo-RL, which is not importable here "
        f"({exc}). NeMo-RL is not on PyPI: install it from its git repository "
        "(git clone https://github.com/NVIDIA-NeMo/RL && uv sync, or use its container), "
        "or point PYTHONPATH at a checkout. The core loss, nemo_rs_plugin.CorrectedPGLoss, "
        "works without it."
    ) from exc

from nemo_rs_plugin.core.batch.inputs import LossInputs
from nemo_rs_plugin.core.batch.microbatch import MicrobatchTotals, current_policy_problems, needs_microbatch_totals
from nemo_rs_plugin.core.distributed import SequenceGroups
from nemo_rs_plugin.core.loss import CorrectedPGLoss
from nemo_rs_plugin.core.settings.config import ConfigError, RSClippedPGLossConfig, as_plain_dict
from nemo_rs_plugin.nemo_rl import seam
from nemo_rs_plugin.nemo_rl.host import (
    host_accepts_fused_flag,
    host_api,
    host_config,
    host_field_problems,
    per_sequence_packing_problem,
    v06_semantics,
)
from nemo_rs_plugin.nemo_rl.packing import HostCall, SequenceGather, TotalsCache, WrapperCall, is_microbatch
from nemo_rs_plugin.nemo_rl.recording import FAILURES_METRIC, LogprobRecorder
from nemo_rs_plugin.nemo_rl.refusals import run_time_refusal

__all__ = ["RSClippedPGLossFn", "batch_data_parallel_group", "megatron_groups"]

try:  # v0.7.0 has no MetricNormalizer; main does
    from nemo_rl.algorithms.loss.interfaces import MetricNormalizer
except ImportError:  # pragma: no cover - depends on the host version
    MetricNormalizer = None


class RSClippedPGLossFn(ClippedPGLossFn):
    """NeMo-RL's clipped PG loss with decoupled IS level and composable rejection sampling.

    Formula, fields and metrics: :mod:`nemo_rs_plugin.core.loss` and ``docs/guide.md``. With no
    plugin field set every output equals NeMo-RL's ``ClippedPGLossFn`` on the same inputs.

    Args:
        cfg: ``loss_fn`` section (NeMo-RL's pydantic config, a dict, or any mapping);
            validated here, at construction.
        use_fused_linear_logprobs: as NeMo-RL's (``prepare_loss_input`` reads it).
    """

    def __init__(self, cfg: Any, use_fused_linear_logprobs: bool = False):
        api = host_api()
        # NeMo-RL's wrappers must hand this loss its context (nemo_rs_plugin.nemo_rl.seam): a
        # NeMo-RL where they cannot is refused here, before training.
        seam.require()
        if api == "typeddict":
            cfg = v06_semantics(cfg)
        raw = as_plain_dict(cfg)
        # Every problem at once: the host's fields (nemo_rs_plugin.nemo_rl.host, the rule
        # `nemo-rs check` reads too) and the plugin's validation.
        host_only, problems = host_field_problems(raw)
        problems = [f"loss_fn.{p}" for p in problems]
        try:  # the name chose this class (the registry); the config itself is nameless
            config = RSClippedPGLossConfig.from_any({k: v for k, v in raw.items() if k != "name"})
        except ConfigError as exc:
            raise ConfigError(problems + exc.problems, prefix="") from None
        if problems:
            raise ConfigError(problems, prefix="")
        host_cfg = host_config(config, api, host_only)
        if host_accepts_fused_flag():
            super().__init__(host_cfg, use_fused_linear_logprobs=use_fused_linear_logprobs)
        else:
            super().__init__(host_cfg)
        self.use_fused_linear_logprobs = use_fused_linear_logprobs
        # The host saw truncation disabled (its asserts reject some decoupled-level
        # combinations); expose the real values to code that reads these attributes.
        self.truncated_importance_sampling_type = config.truncated_importance_sampling_type
        self.truncated_importance_sampling_ratio = config.truncated_importance_sampling_ratio
        self.truncated_importance_sampling_ratio_min = config.truncated_importance_sampling_ratio_min
        self.rs_config = config
        # NeMo-RL sums every metric over calls, microbatches and ranks: per-call metrics would be wrong there.
        self.core = CorrectedPGLoss(config, per_call_metrics=False)
        self._needs_microbatch_totals = needs_microbatch_totals(config)
        # What NeMo-RL's wrapper now calling the loss handed it (nemo_rs_plugin.nemo_rl.seam): None
        # outside such a call (a direct call: NeMo-RL's defaults, no packing).
        self._host: Optional[HostCall] = None
        # Under NeMo-RL's per-sequence packing wrapper (nemo_rs_plugin.nemo_rl.packing): the
        # sequences gathered into one call, or, where the wrapper cannot promise their order, the
        # microbatch totals per call.
        self._gather = SequenceGather()
        self._totals = TotalsCache()
        # record_logprobs: what `nemo-rs calibrate --from DIR` reads (nemo_rs_plugin.nemo_rl.recording)
        self._recorder = LogprobRecorder(config.record_dir, config.record_every) if config.record_logprobs else None
        if self._recorder is not None:
            self._recorder.check()  # a ConfigError naming record_dir and the cause, before step 1
        # The recipe-dependent refusals are those of nemo_rs_plugin.nemo_rl.refusals (`nemo-rs check` reads them too).
        problem = run_time_refusal("fused_linear_logprobs").judge(
            config.sharded_logits_input, use_fused_linear_logprobs
        )
        if problem is not None:
            raise ConfigError([problem])
        # See: docs/parallelism.md#sharded-input
        self.input_type = LossInputType.LOGIT if config.sharded_logits_input else LossInputType.LOGPROB
        if MetricNormalizer is not None:
            self.metric_normalizations = {k: MetricNormalizer(v) for k, v in self.core.metric_normalizations().items()}
            if self._recorder is not None:  # a count of records, summed as it is
                self.metric_normalizations[FAILURES_METRIC] = MetricNormalizer("none")

    def __getstate__(self) -> dict:
        """Pickled for NeMo-RL's Ray workers without a microbatch's gathered sequences, totals or wrapper call."""
        state = dict(self.__dict__)
        state["_gather"], state["_totals"], state["_host"] = SequenceGather(), TotalsCache(), None
        return state

    def __setstate__(self, state: dict) -> None:
        """Unpickled in a Ray worker: the seam is installed there too (its environment may lack the start-up hook)."""
        seam.require()
        self.__dict__.update(state)

    @contextmanager
    def nemo_rl_call(self, call: HostCall) -> Iterator[None]:
        """The seam: while open, the calls of this loss belong to NeMo-RL's wrapper call ``call``.

        Opened by the plugin's versions of NeMo-RL's wrappers (:mod:`nemo_rs_plugin.nemo_rl.seam`)
        around NeMo-RL's own call: ``call`` holds the keywords of its ``prepare_fn`` and, for the
        per-sequence wrapper, its microbatch (:class:`~nemo_rs_plugin.nemo_rl.packing.HostCall`).
        A microbatch whose calls stopped part-way (the wrapper raised) is forgotten on exit.
        """
        outer, self._host = self._host, call
        try:
            yield
        finally:
            self._host = outer
            if call.sequences is not None:
                self._gather.clear()

    def __call__(
        self,
        next_token_logprobs: Any = None,
        data: Optional[Mapping[str, Any]] = None,
        global_valid_seqs: Any = None,
        global_valid_toks: Any = None,
        logits: Any = None,
    ) -> tuple[Any, dict]:
        """NeMo-RL's ``ClippedPGLossFn.__call__``; with ``sharded_logits_input``, ``logits``.

        The sharded path reads the TP and CP groups from megatron-core's ``parallel_state``
        (NeMo-RL's Megatron worker initialises it) and returns this rank's loss share; see
        :mod:`nemo_rs_plugin.parallel.sharded` for why NeMo-RL's ``/ cp`` post-processing then gives the
        gathered path's gradients.

        Raises ``ValueError`` for a ``token_mask`` other than 0/1 and for a global count below the
        microbatch's own other than the split API's placeholder, 1 for both (which warns once per
        process; decided on the one host transfer of the metrics: no extra sync); a count at least
        the microbatch's own but below the true global batch's cannot be detected here
        (docs/troubleshooting.md#input-errors).
        """
        if data is None:
            raise TypeError("rs_clipped_pg: the data dict is required")
        dp_group = batch_data_parallel_group(self.rs_config)
        host = self._host
        packed = host.next_call() if host is not None else None
        microbatch = None
        if packed is not None and packed.sequence_index is None:
            # no position: one sequence computed per call (nemo_rs_plugin.nemo_rl.packing)
            microbatch = self._per_sequence_totals(packed, dp_group)
        if packed is None or packed.sequence_index is None:
            self._gather.clear()  # nothing of a wrapper call that stopped part-way outlives it
        if not self.rs_config.sharded_logits_input:
            if next_token_logprobs is None:
                raise TypeError(
                    "rs_clipped_pg: next_token_logprobs is required (input_type LOGPROB); set "
                    "sharded_logits_input: true to pass logits"
                )
            if packed is not None and packed.sequence_index is not None:
                gathered = self._gather.add(packed, next_token_logprobs, data)
                if gathered is None:  # not the microbatch's last sequence: counted in the last call
                    dtype = self.core.loss_dtype(next_token_logprobs, data)  # the wrapper sums into this zero
                    return next_token_logprobs.new_zeros((), dtype=dtype), {}
                next_token_logprobs, data = gathered
            if self._recorder is not None:
                self._recorder.observe(global_valid_toks, _whole_microbatch(packed, data))
            return self._with_record_failures(
                self.core(
                    next_token_logprobs,
                    data,
                    global_valid_seqs,
                    global_valid_toks,
                    SequenceGroups.of(data_parallel=dp_group),
                    microbatch,
                )
            )
        if logits is None:
            raise TypeError("rs_clipped_pg with sharded_logits_input: logits are required")
        prepare = host.prepare_keywords if host is not None else {}
        _refuse_training_time_filtering(prepare.get("sampling_params"))
        chunk_size = _logprob_chunk_size(prepare)
        if self._recorder is not None:
            self._recorder.observe(global_valid_toks, _whole_microbatch(packed, data))
        from nemo_rs_plugin.parallel.sharded import sharded_loss, sharded_loss_inputs, sharded_loss_of_inputs

        tp_group, cp_group = megatron_groups()
        if packed is not None and packed.sequence_index is not None:
            # Each call makes its sequence's CP-local inputs (the log-softmax over the local vocabulary
            # shard, with its TP all-gather); the last computes the stacked microbatch once.
            try:
                inputs = sharded_loss_inputs(
                    logits, data, cp_group=cp_group, tp_group=tp_group, pad_to_shard=True, chunk_size=chunk_size
                )
            except Exception:
                self._gather.clear()  # the kept sequences (and their logits' graphs) go with the failed call
                raise
            stacked = self._gather.add_inputs(packed, inputs)
            if stacked is None:  # not the microbatch's last sequence: counted in the last call
                return logits.new_zeros((), dtype=inputs.compute_dtype()), {}
            return self._with_record_failures(
                sharded_loss_of_inputs(
                    self.core,
                    stacked,
                    global_valid_seqs,
                    global_valid_toks,
                    cp_group=cp_group,
                    data_parallel_group=dp_group,
                )
            )
        return self._with_record_failures(
            sharded_loss(
                self.core,
                logits,
                data,
                global_valid_seqs,
                global_valid_toks,
                cp_group=cp_group,
                tp_group=tp_group,
                pad_to_shard=True,
                data_parallel_group=dp_group,
                microbatch=microbatch,
                chunk_size=chunk_size,
            )
        )

    def _with_record_failures(self, result: tuple[Any, dict]) -> tuple[Any, dict]:
        """With ``record_logprobs``: the metric ``record_write_failures`` added to a call's metrics.

        Records this rank did not write since the last call that returned metrics (host-side, no
        collective): NeMo-RL sums it over microbatches and ranks into the step's count.
        """
        loss, metrics = result
        if self._recorder is not None:
            metrics[FAILURES_METRIC] = float(self._recorder.take_failures())
        return loss, metrics

    def _per_sequence_totals(self, call: WrapperCall, dp_group: Any) -> Optional[MicrobatchTotals]:
        """The whole microbatch's totals for a per-sequence call computed on its own sequence.

        Such a call (a wrapper that cannot promise the sequences' order:
        :mod:`nemo_rs_plugin.nemo_rl.packing`) gets its sequence's slice of the microbatch; the
        wrapper's own ``data`` is the whole microbatch. The totals the configuration reads
        (:mod:`nemo_rs_plugin.core.batch.microbatch`) are computed from it once per microbatch, so
        every sequence is corrected as in one call on the microbatch; with
        ``is_batch_normalization: data_parallel`` the data-parallel SUM is then issued once per
        microbatch, as unpacked, whatever the number of sequences a rank holds.
        ``tests/nemo_rl/test_packing.py`` checks, at every supported NeMo-RL, that the loss, its
        gradient and the logged metrics equal the unpacked call's.

        Raises:
            ConfigError: the totals need the current policy's log-probs of every sequence
                (:func:`~nemo_rs_plugin.core.batch.microbatch.current_policy_problems`), or the
                wrapper's microbatch cannot be read.
        """
        if not self._needs_microbatch_totals:
            return None
        problems = current_policy_problems(self.rs_config)
        full = call.microbatch
        if not is_microbatch(full, call.sequences):
            problems.append(
                f"the packing wrapper's microbatch (its `data`, {call.sequences} sequences by its cu_seqlens_q) "
                "cannot be read here"
            )
        if problems:
            problem = per_sequence_packing_problem(problems, logits_input=self.rs_config.sharded_logits_input)
            raise ConfigError([problem], prefix="")

        def compute() -> MicrobatchTotals:
            token_mask = full["token_mask"]
            placeholder = torch.zeros(
                token_mask.shape[0],
                token_mask.shape[1] - 1,
                dtype=full["generation_logprobs"].dtype,
                device=token_mask.device,
            )  # the current policy: read by no total the configuration is allowed here
            inputs = LossInputs.from_nemo_rl(
                placeholder,
                full,
                need_prev=not self.rs_config.force_on_policy_ratio,
                need_reference=False,
            )
            return self.core.microbatch_totals(inputs, SequenceGroups.of(data_parallel=dp_group))

        return self._totals.get(full, compute)


def _logprob_chunk_size(prepare_keywords: Mapping[str, Any]) -> Optional[int]:
    """NeMo-RL's ``policy.logprob_chunk_size`` as its log-prob preparation would use it (``None``: unset).

    ``None`` (unset, or NeMo-RL v0.6.0, which does not pass it to training's preparation) takes
    the plugin's default; a value that is not a positive integer is refused by name here, where
    NeMo-RL's own chunked path would divide by it.
    """
    value = prepare_keywords.get("chunk_size")
    problem = run_time_refusal("logprob_chunk_size").judge(True, value)
    if problem is not None:
        raise ConfigError([problem])
    return value


def _whole_microbatch(packed: Optional[WrapperCall], data: Any) -> Any:
    """The microbatch a call belongs to: the per-sequence wrapper's, where readable, else ``data``."""
    if packed is not None and is_microbatch(packed.microbatch, packed.sequences):
        return packed.microbatch
    return data


def _refuse_training_time_filtering(params: Any) -> None:
    """Top-k/top-p training-time filtering cannot be honoured from logits: refuse it."""
    if params is None:
        return
    problem = run_time_refusal("training_time_filtering").judge(
        True, getattr(params, "top_k", None), getattr(params, "top_p", 1.0)
    )
    if problem is not None:
        raise ConfigError([problem])


def _megatron_parallel_state() -> Any:
    """megatron-core's ``parallel_state`` where it is importable and initialised, else ``None``."""
    try:
        from megatron.core import parallel_state
    except ImportError:
        return None
    return parallel_state if parallel_state.model_parallel_is_initialized() else None


def megatron_groups() -> tuple[Any, Any]:
    """``(tp_group, cp_group)`` from megatron-core's ``parallel_state``.

    ``(None, None)`` when megatron-core is absent or not initialised (single process,
    DTensor backend).
    """
    parallel_state = _megatron_parallel_state()
    if parallel_state is None:
        return None, None
    return (
        parallel_state.get_tensor_model_parallel_group(),
        parallel_state.get_context_parallel_group(),
    )


def batch_data_parallel_group(config: RSClippedPGLossConfig) -> Any:
    """The data-parallel group ``is_batch_normalization: data_parallel`` reduces over, or None.

    Megatron backend: megatron-core's ``get_data_parallel_group()`` (without CP: on NeMo-RL's
    gathered path every CP rank holds whole copies of the same sequences, and the sharded
    path sums the CP split through its sequence groups). A single process needs none.
    NeMo-RL's DTensor worker keeps its device mesh to itself, so with several ranks and no
    megatron-core the group is unknown: a ``ConfigError`` rather than a silent per-rank mean.
    See: docs/guide.md#batch-normalisation
    """
    if config.is_batch_normalization != "data_parallel":
        return None
    parallel_state = _megatron_parallel_state()
    if parallel_state is not None:
        return parallel_state.get_data_parallel_group()
    import torch.distributed as dist

    ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    problem = run_time_refusal("data_parallel_group").judge(config.is_batch_normalization, False, ranks)
    if problem is not None:
        raise ConfigError([problem])
    return None
