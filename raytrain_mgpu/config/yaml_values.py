"""YAML as people write numbers: ``1e-3`` is a float, ``None`` is null.

PyYAML implements YAML 1.1, whose float rule needs a dot (``1.0e-3``): ``lr: 1e-3`` and
``--lr 1e-3`` arrived as the string ``'1e-3'`` and were refused. YAML 1.2's core schema (what
every other YAML library, and JSON, reads) takes ``1e-3``, ``5E-4`` and ``.5``. This loader is
PyYAML's safe loader with that float rule added, and Python's spelling ``None`` read as null
beside YAML's ``null``/``~`` (the CLI's help prints defaults as Python writes them). Everything
else is PyYAML's, so ``1_000`` stays the integer 1000 and quoted text stays text.

One reader for every YAML value a user writes: config files, ``--field VALUE`` on the command
line, and ``tune --param`` values.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

__all__ = ["load", "Loader"]


class Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's floats and Python's ``None``."""


# PyYAML keys its implicit resolvers by first character; YAML 1.2's floats may start with any of these.
_FLOAT_12 = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)(?:[eE][-+]?[0-9]+)?$")
Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+0123456789."))
Loader.add_implicit_resolver("tag:yaml.org,2002:null", re.compile(r"^None$"), ["N"])

# The int rule is tried first (PyYAML's own resolvers come before these for each first character), so "1000"
# stays an int: only forms YAML 1.1 calls text (an exponent without a dot) become floats (tests/test_config.py).


def load(text: str) -> Any:
    """``text`` read as YAML with YAML 1.2's numbers (``1e-3``) and ``None`` as null."""
    return yaml.load(text, Loader=Loader)
