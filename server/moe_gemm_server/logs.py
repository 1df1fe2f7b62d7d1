"""Logging with the request id on every line.

The id of the request being handled lives in a context variable (set by the observability
middleware); a logging filter copies it into each record as `request_id`, so any log line
written while handling a request, in any module, carries it.
"""

from __future__ import annotations

import contextvars
import logging
import sys
from urllib.parse import quote

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")

FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"


def log_field(value: object) -> str:
    """A client-given value (a path, a weight-set name, a client's id) as one token of a log line.

    Percent-encoded beyond letters, digits and `_.-~/:@[]+,` (so a valid name or path reads as
    is): a newline, a space or an `=` in the value can then neither end the line nor fake
    another field, e.g. a name "x\nFORGED audit action=delete_weights ..." that would otherwise
    write a forged audit line. urllib.parse.unquote gives the value back.
    """
    return quote(str(value), safe="/:@[]+,")


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get()
        return True


def configure_logging(level: str = "info") -> None:
    """Root handler on stderr with the request-id format; uvicorn's loggers propagate to it."""
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_moe_gemm", False):
            root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(RequestIdFilter())
    handler._moe_gemm = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers.clear()
        lg.propagate = True
