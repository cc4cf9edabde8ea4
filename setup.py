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
    """Regular wheel: the .pth at the build root, and the recipes as package data.

    The .pth lands at the root of site-packages; the recipes in ``nemo_rs_plugin/recipes/``
    (a source tree reads ``recipes/``). Both come from the sdist (MANIFEST.in).
    """

    def run(self):
        super().run()
        shutil.copy(HERE / PTH, Path(self.build_lib) / PTH)
        target = Path(self.build_lib) / "nemo_rs_plugin" / "recipes"
        target.mkdir(parents=True, exist_ok=True)
        for recipe in sorted((HERE / "recipes").glob("*.yaml")):
            shutil.copy(recipe, target / recipe.name)

    def get_outputs(self, include_bytecode=True):
        extra = [str(Path(self.build_lib) / PTH)]
        extra += [
            str(Path(self.build_lib) / "nemo_rs_plugin" / "recipes" / p.name)
            for p in sorted((HERE / "recipes").glob("*.yaml"))
        ]
        return super().get_outputs(include_bytecode) + extra


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
