"""moe_gemm_client: a light Python client for moe-gemm-server (sync and async, typed, retrying).

Installs without torch or CUDA (httpx, numpy, safetensors, ml_dtypes). Arrays go in and come
out as numpy (bfloat16 through ml_dtypes) or, when the caller passes torch tensors, as torch
tensors; torch is never imported otherwise.

    from moe_gemm_client import Client

    with Client("http://127.0.0.1:8000", api_key="...") as client:
        client.put_weights("layer0", w)                     # w (E, K, N)
        client.put_weights("layer1", w8, scale=s)           # FP8 w8 with its float32 scale
        y = client.grouped_mm("layer0", x, counts=counts)   # x (T, K), counts (E,) -> y (T, N)

Public API:
    Client, AsyncClient          the two clients (same methods; AsyncClient's are coroutines)
    WeightInfo, WeightDeleted    typed answers (KernelInfo: an entry of WeightInfo.kernels)
    MoeGemmError and subclasses  one exception class per kind of failure (see _exceptions)
"""

__version__ = "0.1.0"

from ._async_client import AsyncClient  # noqa: E402
from ._calls import ProgressCallback, TimeoutTypes  # noqa: E402
from ._client import Client  # noqa: E402
from ._constants import (  # noqa: E402
    DEFAULT_BASE_URL,
    DEFAULT_MAX_RETRIES,
    DEFAULT_TIMEOUT,
)
from ._exceptions import (  # noqa: E402
    APIConnectionError,
    APIError,
    APIResponseValidationError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    ClientClosedError,
    GatewayTimeoutError,
    InternalServerError,
    MoeGemmError,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    RateLimitError,
    ServerError,
    ServiceUnavailableError,
    UnprocessableEntityError,
)
from .types import KernelInfo, NotLoadedInfo, WeightDeleted, WeightInfo, WeightList  # noqa: E402

__all__ = [
    "__version__",
    "Client",
    "AsyncClient",
    "WeightInfo",
    "WeightList",
    "NotLoadedInfo",
    "WeightDeleted",
    "KernelInfo",
    "ProgressCallback",
    "TimeoutTypes",
    "DEFAULT_BASE_URL",
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_TIMEOUT",
    "MoeGemmError",
    "APIError",
    "APIStatusError",
    "BadRequestError",
    "AuthenticationError",
    "PermissionDeniedError",
    "NotFoundError",
    "PayloadTooLargeError",
    "UnprocessableEntityError",
    "RateLimitError",
    "ServerError",
    "InternalServerError",
    "ServiceUnavailableError",
    "GatewayTimeoutError",
    "APIConnectionError",
    "APITimeoutError",
    "APIResponseValidationError",
    "ClientClosedError",
]
