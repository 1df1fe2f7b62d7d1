"""Defaults shared by `Client`, `AsyncClient` and the command line.

They live in one leaf module so that the two clients and the CLI cannot disagree, and so tests
can read the exact numbers the retry loop uses. The retry numbers follow openai-python: a first
delay of 0.5 s doubling up to 8 s, with up to 25 % jitter so that many clients that failed
together do not come back together.
"""

from __future__ import annotations

import httpx

DEFAULT_BASE_URL = "http://127.0.0.1:8000"

# Environment variables read when the matching argument is not given.
ENV_BASE_URL = "MOE_GEMM_BASE_URL"
ENV_API_KEY = "MOE_GEMM_API_KEY"

# httpx timeouts apply per phase (connect, each read, each write), not to the whole request.
# 5 s to connect catches a dead host quickly; 300 s per read leaves room for a large grouped
# GEMM queued behind others, or a weight upload that the server fsyncs before answering.
DEFAULT_TIMEOUT = httpx.Timeout(300.0, connect=5.0)
DEFAULT_MAX_RETRIES = 2
# The longest timeout taken (~31 years; None is no timeout): the sync transport hands it to
# socket.settimeout, which refuses more than ~9.2e9 s (int64 nanoseconds) with an OverflowError.
MAX_TIMEOUT = 1e9
# Idle pooled connections are dropped after 4 s, before the server closes its side (uvicorn's
# keep-alive, moe-gemm-server's --timeout-keep-alive, 5 s by default): a pool that kept them as
# long raced the server's close, and a request sent on a connection closing under it failed
# with a ReadError (retried, but after a backoff).
KEEPALIVE_EXPIRY = 4.0
DEFAULT_CONNECTION_LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20,
                                         keepalive_expiry=KEEPALIVE_EXPIRY)

INITIAL_RETRY_DELAY = 0.5  # seconds, before the first retry
MAX_RETRY_DELAY = 8.0  # seconds, the cap of the exponential backoff
RETRY_JITTER = 0.25  # a backoff delay is multiplied by a factor drawn from (1 - 0.25, 1]
MAX_RETRY_AFTER = 60.0  # a server's Retry-After is honoured up to this many seconds

# Statuses that say "nothing was done, try again later". 500 is not here (a server bug
# repeats) and neither is 504 (the request's own deadline passed; repeating it ignores it).
RETRYABLE_STATUSES = frozenset({408, 429, 502, 503})
# Error codes (the body's "code") of answers of those statuses that last until the caller acts:
# a stored weight set whose file cannot be read as a set (503) stays so until it is uploaded
# again or deleted, so a retry only delays the error.
PERMANENT_ERROR_CODES = frozenset({"weight_set_unreadable"})

# Bodies larger than this are streamed in chunks of STREAM_CHUNK_BYTES instead of being joined
# into one bytes object, so a multi-GB weight upload never needs a second copy in memory.
STREAM_THRESHOLD_BYTES = 8 << 20
STREAM_CHUNK_BYTES = 1 << 20

REQUEST_ID_HEADER = "X-Request-Id"
TIMEOUT_US_HEADER = "X-Timeout-Us"
PRIORITY_HEADER = "X-Priority"
SAFETENSORS_CONTENT_TYPE = "application/octet-stream"
