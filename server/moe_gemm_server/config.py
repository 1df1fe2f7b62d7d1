"""Settings: every knob of the service, from flags, MOE_GEMM_* environment variables or code.

Precedence: command-line flag > environment variable > default. Each field `foo_bar` reads
`MOE_GEMM_FOO_BAR`; list fields (`api_key`, `warmup_rows`) take comma-separated values there.
Limits are on by default (body size, rows and FLOPs per request, queue bound), and the default
host is 127.0.0.1: exposing the service is a deliberate choice.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

MiB = 1 << 20
GiB = 1 << 30

# Microsecond settings stay below a request's own bound (X-Timeout-Us, v2's parameters.timeout:
# routers/common.py), which also keeps them within the uint64 fields of Triton's model config
# (default_timeout_microseconds, max_queue_delay_microseconds) that /v2/models/{name}/config
# reports them in.
MAX_US = 10**18
# The queue bound is reported as Triton's max_queue_size, a uint32.
MAX_QUEUE = (1 << 32) - 1

# What a key may hold: it arrives in an `Authorization: Bearer <key>` header, which clients
# send as ASCII (moe_gemm_client refuses anything else; curl sends UTF-8 bytes, which the server
# reads as Latin-1). A key beyond ASCII was accepted at start and then matched no request.
_KEY_RE = re.compile(r"[\x21-\x7e]+")
_KEY_WHY = "keys travel in an 'Authorization: Bearer <key>' header"


def default_data_dir() -> Path:
    """$XDG_DATA_HOME/moe-gemm-server, else ~/.local/share/moe-gemm-server."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                            "share")
    return Path(base) / "moe-gemm-server"


class Settings(BaseSettings):
    """Service configuration (see server/README.md for the flags table)."""

    model_config = SettingsConfigDict(env_prefix="MOE_GEMM_", extra="ignore")

    # network
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    timeout_keep_alive: int = Field(5, ge=1, description="idle keep-alive seconds")

    # persistence
    data_dir: Path = Field(default_factory=default_data_dir)
    # rescan the data directory for sets other servers wrote or deleted (0 = never; sync.py)
    sync_interval_s: float = Field(2.0, ge=0, allow_inf_nan=False)

    # auth: none configured = open matmul/read routes
    api_key: Annotated[list[str], NoDecode] = Field(default_factory=list)
    admin_key: str | None = None
    # a non-loopback host without an admin key refuses to start unless this is set
    insecure_no_auth: bool = False

    # TLS (uvicorn's): a PEM certificate (chain) and its private key
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None

    # limits
    max_body_bytes: int = Field(64 * MiB, ge=1)
    # longest pause between pieces of a request body before a 408 (limits.BodyLimitMiddleware)
    body_timeout_s: float = Field(60.0, gt=0, allow_inf_nan=False)
    max_weight_bytes: int = Field(16 * GiB, ge=1, description="body limit of PUT /v1/weights "
                                  "(JSON bodies: also max_body_bytes)")
    max_rows: int = Field(65536, ge=1, description="rows (T, or sum of M_i) per request")
    max_flops: int = Field(1 << 40, ge=1, description="2*M*N*K summed, per request")
    max_problems: int = Field(4096, ge=1, description="problems per grouped-gemm request")
    max_output_bytes: int = Field(1 * GiB, ge=1, description="bytes of one request's result "
                                  "(sum of M_i*N_i*itemsize; bounds K=0 problems too)")
    max_resident_bytes: int | None = Field(None, ge=1, description="budget for the resident "
                                           "weight sets on the device (None = device memory)")

    # engine
    device: str = "auto"
    backend: Literal["auto", "cute", "torch"] = "auto"
    warmup_rows: Annotated[list[int] | None, NoDecode] = None
    tune_at_start: bool = Field(False, description="tune each weight set's shapes before "
                                "warming it (online autotune, cached on disk)")

    # batching and admission
    batching: bool = True
    batch_delay_us: int = Field(0, ge=0)
    max_batch_rows: int = Field(65536, ge=1)
    max_batch_flops: int = Field(1 << 42, ge=1)
    max_batch_requests: int = Field(256, ge=1)
    max_queue: int = Field(1024, ge=1)
    default_timeout_us: int = Field(0, ge=0, description="0 = no timeout")
    default_priority: int = Field(2, ge=1, description="level of requests with priority 0")
    # finite: uvicorn's graceful-shutdown timeout is derived from it with int(), and an
    # infinite (or NaN) wait would only ever be a typo (allow_inf_nan also makes nan fail
    # with a clear "finite number" message rather than a confusing ">= 0")
    drain_timeout_s: float = Field(30.0, ge=0, allow_inf_nan=False)

    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"

    @field_validator("api_key", mode="before")
    @classmethod
    def _split_keys(cls, v: object) -> object:
        if isinstance(v, str):
            keys = [k.strip() for k in v.split(",") if k.strip()]
            # A value of commas alone ("," from a template whose key was empty) meant "no
            # keys": the matmul and read routes open, where the operator asked for keys.
            if v.strip() and not keys:
                raise ValueError(f"{v!r} names no key (keys are comma-separated); leave it "
                                 "unset or empty for none")
            return keys
        return v

    @field_validator("data_dir", mode="before")
    @classmethod
    def _data_dir_nonempty(cls, v: object) -> object:
        # Path("") is Path("."): an empty flag or variable would silently make the current
        # directory the data directory, and the server would serve (and delete) whatever
        # .safetensors files happen to be there.
        if isinstance(v, str) and not v.strip():
            raise ValueError("the data directory must be a non-empty path")
        return v

    @field_validator("ssl_certfile", "ssl_keyfile", mode="before")
    @classmethod
    def _tls_path_nonempty(cls, v: object, info: ValidationInfo) -> object:
        # Path("") is Path("."), a directory: the start was refused with "Is a directory",
        # naming neither the flag nor the variable. Refused here as an empty --data-dir is
        # (not read as unset: a TLS file left empty by a template would serve plain HTTP).
        if isinstance(v, str) and not v.strip():
            name = info.field_name or ""
            what = ("a PEM certificate's path, or set neither to serve plain HTTP"
                    if name == "ssl_certfile" else
                    "a PEM private key's path, or set neither where --ssl-certfile holds the key")
            raise ValueError(f"the path is empty (--{name.replace('_', '-')} or "
                             f"MOE_GEMM_{name.upper()}): give {what}")
        return v

    @field_validator("admin_key", mode="before")
    @classmethod
    def _strip_admin_key(cls, v: object) -> object:
        # As API keys are: a key read from a file or a secret often ends in a newline, and a
        # key holds no whitespace, so what surrounds it is never part of it.
        return v.strip() if isinstance(v, str) else v

    @field_validator("warmup_rows", mode="before")
    @classmethod
    def _split_rows(cls, v: object) -> object:
        if isinstance(v, str):
            v = v.strip()
            if v in ("", "auto"):
                return None
            # (an empty item, "1,,2" or "1,", is left in: refused below as not an int, not
            # dropped to stand for a list the value does not spell)
            return [t.strip() for t in v.split(",")]
        return v

    @field_validator("batch_delay_us", "default_timeout_us", "max_queue")
    @classmethod
    def _triton_bounds(cls, v: int, info: ValidationInfo) -> int:
        # (here rather than as Field(lt=...): pydantic's "Input should be less than
        # 1000000000000000000" would say neither why nor in which unit)
        if info.field_name == "max_queue":
            if v > MAX_QUEUE:
                raise ValueError(f"must be at most {MAX_QUEUE} (2^32 - 1): the model "
                                 "configuration reports it as Triton's max_queue_size, a uint32")
        elif v >= MAX_US:
            raise ValueError("must be below 10^18 microseconds, the bound of a request's own "
                             "timeout (X-Timeout-Us, parameters.timeout)")
        return v

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, v: object) -> object:
        return v.lower() if isinstance(v, str) else v

    @field_validator("api_key")
    @classmethod
    def _keys_nonempty(cls, v: list[str]) -> list[str]:
        for k in v:
            if not _KEY_RE.fullmatch(k):
                raise ValueError("API keys must be non-empty printable ASCII without "
                                 f"whitespace; {_KEY_WHY}")
        return v

    @field_validator("admin_key")
    @classmethod
    def _admin_nonempty(cls, v: str | None) -> str | None:
        if v is not None and not _KEY_RE.fullmatch(v):
            raise ValueError("the admin key must be non-empty printable ASCII without "
                             f"whitespace; {_KEY_WHY}")
        return v

    @field_validator("warmup_rows")
    @classmethod
    def _rows_nonneg(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(t < 0 for t in v):
            raise ValueError("warmup rows must be >= 0")
        return v

    @model_validator(mode="after")
    def _batching_limits(self) -> Settings:
        if not self.batching:
            self.max_batch_requests = 1
        return self

    @model_validator(mode="after")
    def _warmup_within_launch(self) -> Settings:
        # No launch carries more rows than max(--max-rows, --max-batch-rows) (the engine's own
        # max_rows, service.build_engine): a warm-up row count beyond it compiles nothing that
        # is served, and only allocates (T, K) inputs per set. A typo such as 10000000000 was
        # taken silently; then every stored set failed to load and every upload answered 500.
        cap = max(self.max_rows, self.max_batch_rows)
        if self.warmup_rows and max(self.warmup_rows) > cap:
            raise ValueError(
                f"warmup_rows (--warmup-rows): {max(self.warmup_rows)} is more rows than one "
                f"launch can carry ({cap}, the larger of --max-rows and --max-batch-rows)")
        return self

    @property
    def batch_delay_s(self) -> float:
        return self.batch_delay_us / 1e6

    @property
    def open_admin(self) -> bool:
        """Weight changes need no key: no admin key and no API key configured."""
        return self.admin_key is None and not self.api_key


@functools.lru_cache(maxsize=1)
def get_settings() -> Settings:
    """Settings from the environment (cached); the CLI builds its own from flags."""
    return Settings()
