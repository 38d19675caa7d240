"""The test extras (pyproject.toml's ``test``) a module needs, checked without importing them."""

from __future__ import annotations

import importlib.util

import pytest


def skip_unless_installed(*modules: str, reason: str = "") -> None:
    """At a test module's top: skip the module when one of ``modules`` (a test extra) is not installed.
    Unlike ``pytest.importorskip`` it does not import them: every pytest process collects every
    module, and importing torchvision, transformers and mlflow at collection was ~8 CPU-s in each
    (the tests import them where they use them)."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(reason or f"not installed: {', '.join(missing)}", allow_module_level=True)
