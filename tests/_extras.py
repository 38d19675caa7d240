"""The suite's one rule for tests that need an optional package (a test extra of ``pyproject.toml``).

On a developer's machine a missing package skips the test (or the module) with the package named. On
CI (``CI=true``, set by ``.ci/run``) it fails instead: CI installs ``.[test]``, which has every such
package, so a missing one is a broken install, and a skip would let the run turn green without the tests.

Checked with ``importlib.util.find_spec`` (nothing is imported). At module level the failure is a
collection error, which stops the run before its first test: the install is what to fix. A module that
Ray's workers import by name (only its own file is shipped to them) imports this helper inside its ``if``
on the missing package, a branch the workers never take.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import pytest


def missing(*modules: str) -> list:
    """The ``modules`` that are not installed."""
    return [name for name in modules if importlib.util.find_spec(name) is None]


def require(*modules: str) -> None:
    """Skip the calling test (or, at module level, the module) unless every one of ``modules`` is
    installed; on CI, fail."""
    absent = missing(*modules)
    if not absent:
        return
    reason = f"not installed: {', '.join(absent)}"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}, on CI, which installs every package the tests need (pip install -c constraints.txt "
                    f"-e '.[test]'): the install is broken; CI fails rather than skip these tests", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def importorskip(module: str):
    """``pytest.importorskip`` under :func:`require`'s rule: the module, or a skip (on CI, a failure)."""
    require(module)
    return importlib.import_module(module)
