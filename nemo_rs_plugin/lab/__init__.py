"""The lab: GRPO on a tiny mixture-of-experts with a real sampler/trainer mismatch (docs/lab.md).

``nemo-rs lab`` or ``python -m nemo_rs_plugin.lab``. The top layer: it imports the core (the
loss, as NeMo-RL calls it) and ``tools`` (the reports' tables and progress bar); nothing of the
package imports it but the ``nemo-rs`` program. ``transformers`` (its model), SciPy and
statsmodels (its statistics) are imported here only.

Modules: :mod:`.cli` (the command line), :mod:`.runs` (each kind of run and what it writes),
:mod:`.experiment` (settings and the training loop), :mod:`.pool` (runs over worker processes),
:mod:`.arms` (the arms, from the presets), :mod:`.model` (model, task, sampler, chance),
:mod:`.run_report` (a single-lag run's tables and figures), :mod:`.dose` and
:mod:`.dose_report` (the dose-response run), :mod:`.confirm` (the confirmatory protocol),
:mod:`.length` (the length study), :mod:`.stats` (the tests and intervals).

Light at import (``nemo-rs --help`` reads :data:`HELP`); the command is :func:`.cli.main`.
"""

HELP = "GRPO on a tiny MoE with a real sampler/trainer mismatch (docs/lab.md)"
