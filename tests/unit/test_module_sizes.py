"""Every module of the installed package fits one screenful of jobs: at most 600 lines (the house
rule; a module past it is split by owner, not trimmed)."""
from __future__ import annotations

from tests.unit.source_modules import REPO, installed_modules

LIMIT = 600


def test_no_module_of_the_package_is_over_the_limit():
    long = sorted(f"{path.relative_to(REPO)}: {n} lines" for path in installed_modules().values()
                  if (n := len(path.read_text().splitlines())) > LIMIT)
    assert not long, f"modules over {LIMIT} lines (split them by owner):\n" + "\n".join(long)
