"""Reading MOE_GEMM_* environment switches on the per-call hot path.

`os.environ.get` encodes the key and decodes the value on every call (~0.5 us each on the
H200 host, 2 us on the CI machine); grouped_mm's cached-plan path checks three switches per
call, which was most of its gap to torch's own grouped_mm (issue 4, host overhead). On POSIX
`os.environ` keeps its bytes mapping in `_data`, kept in step by `os.environ[...] = ...`,
`del` and pytest's monkeypatch, so a lookup there sees every change made through os.environ.
"""

from __future__ import annotations

import os
import sys

_ENCODING = sys.getfilesystemencoding()
_DATA = getattr(os.environ, "_data", None)
_BYTES = isinstance(_DATA, dict) and all(isinstance(k, bytes) for k in list(_DATA)[:8])


def env_get(name: str) -> str | None:
    """os.environ.get(name), without the per-call encode/decode where the platform allows."""
    if _BYTES:
        # The same codec and error handler os.environ uses for its keys and values.
        value = _DATA.get(name.encode(_ENCODING, "surrogateescape"))  # type: ignore[union-attr]
        return None if value is None else value.decode(_ENCODING, "surrogateescape")
    return os.environ.get(name)


def env_switch(name: str) -> bool:
    """A default-on MOE_GEMM_* switch: off when set to 0, false or no (any case)."""
    value = env_get(name)
    return value is None or value.strip().lower() not in ("0", "false", "no")
