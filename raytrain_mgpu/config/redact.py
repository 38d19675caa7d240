"""One function that removes credentials embedded in URIs before they are shown or stored.

``s3://KEY:SECRET@bucket/runs`` is a valid storage URI for pyarrow; without this the
secret would be copied into every checkpoint's ``meta.json``, the start-up banner and
error messages.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["redact"]

# scheme://user[:password]@host -> scheme://***@host (user names can be access keys too)
_USERINFO_RE = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/@\s'\"]+)@")
# query-string credentials pyarrow and fsspec accept: ?access_key=...&secret_key=...
_QUERY_RE = re.compile(r"(?i)(?P<key>[?&](?:access_key|secret_key|session_token|aws_access_key_id|"
                       r"aws_secret_access_key|token|password)=)[^&\s'\"]*")


def redact(value: Any) -> Any:
    """``value`` with URI credentials replaced by ``***``; dicts and lists are redacted
    recursively (a checkpoint's config), other non-strings are returned unchanged."""
    if isinstance(value, str):
        return _QUERY_RE.sub(r"\g<key>***", _USERINFO_RE.sub(r"\g<scheme>***@", value))
    if isinstance(value, dict):
        return {k: redact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v) for v in value)
    return value
