import os

__path__.append(
    os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir, "supported", "nemo_rl", "algorithms")
)
