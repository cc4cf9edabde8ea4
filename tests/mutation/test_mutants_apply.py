"""Every mutant of tests/mutation/mutants.py still applies: its old text occurs once in its file.

The mutation run (``python tests/mutation/run.py``) is not part of CI; without this check an
edit of the code under a mutant leaves the mutant silently unapplicable (six did so in one
session: their lines were rewritten for speed) and the score counts what no longer exists.
"""

import pytest

from tests.mutation.mutants import MUTANTS
from tests.mutation.run import check_text


@pytest.mark.parametrize("number", range(1, len(MUTANTS) + 1))
def test_the_mutant_applies(number):
    problem = check_text(MUTANTS[number - 1])
    assert problem is None, f"mutant {number} ({MUTANTS[number - 1].description}): {problem}"
