"""Stand-in for NeMo-RL's ``examples/run_grpo.py`` (written for these tests).

Imports GRPO first, loads the recipe with ``nemo_rl.utils.config.load_config``, builds the
loss where GRPO's setup builds it, and reports the environment the driver hands its Ray
workers (NeMo-RL passes ``os.environ`` on); with ``--pickle`` it writes the loss as Ray would
send it to a policy worker.
"""

import argparse
import json
import os
import pickle
import sys

from nemo_rl.algorithms import grpo
from nemo_rl.algorithms.loss import ClippedPGLossConfig
from nemo_rl.utils.config import load_config

parser = argparse.ArgumentParser()
parser.add_argument("--config", required=True)
parser.add_argument("--pickle")
args = parser.parse_args()

config = load_config(args.config)
loss_fn = grpo.build_loss(ClippedPGLossConfig(**config["loss_fn"]))
if args.pickle:
    with open(args.pickle, "wb") as fh:
        pickle.dump(loss_fn, fh)
print(json.dumps({"loss": type(loss_fn).__name__, "python": sys.executable, "worker_env": dict(os.environ)}))
