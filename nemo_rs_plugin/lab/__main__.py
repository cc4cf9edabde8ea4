"""``python -m nemo_rs_plugin.lab``: the same as ``nemo-rs lab``."""

import sys

from nemo_rs_plugin.lab.cli import main

sys.exit(main())
