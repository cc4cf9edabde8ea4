"""Ship ``nemo_rs_plugin.pth`` at the root of site-packages, for regular and editable installs.

The .pth line imports ``_nemo_rs_plugin_hook`` (standard library only), which activates the
plugin inside NeMo-RL without any edit to NeMo-RL; see that module's docstring.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "nemo_rs_plugin.pth"
HERE = Path(__file__).resolve().parent


class BuildPyWithPth(build_py):
    """Regular wheel: copy the .pth into the build root, so it lands in site-packages."""

    def run(self):
        super().run()
        shutil.copy(HERE / PTH, Path(self.build_lib) / PTH)

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [str(Path(self.build_lib) / PTH)]


cmdclass = {"build_py": BuildPyWithPth}

try:
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # setuptools < 64: no PEP 660 editable wheels
    editable_wheel = None

if editable_wheel is not None:

    class EditableWheelWithPth(editable_wheel):
        """Editable wheel: add the .pth next to setuptools' own editable .pth."""

        def _install_namespaces(self, installation_dir, pth_prefix):
            super()._install_namespaces(installation_dir, pth_prefix)
            shutil.copy(HERE / PTH, Path(installation_dir) / PTH)

    cmdclass["editable_wheel"] = EditableWheelWithPth

setup(cmdclass=cmdclass)
