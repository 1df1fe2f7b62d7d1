"""Which failures the server cannot carry on after, and how a refusal for space reads.

A *sticky* CUDA error (an illegal address, an illegal instruction, a kernel trap or device-side
assert, an uncorrectable ECC error, a launch failure) poisons the CUDA context of the process:
every later call on the device fails the same way, and only a new process recovers. The server
therefore turns not-ready (so load balancers stop sending), answers what is queued with 503,
and exits with EXIT_DEVICE_FAILED so its supervisor (Kubernetes, systemd, Ray, docker's
restart policy) starts a fresh process. Weight sets survive: an upload is acknowledged only
after its file is durable in the data directory, and a restart loads every stored set.

Out-of-memory is not sticky (the caching allocator frees and the next launch works) and stays
a per-request 503, and a weight set that does not fit is a 507 (see Service).

The errors are recognised by their CUDA text, whatever the exception class (torch raises
RuntimeError or, from 2.8, torch.AcceleratorError "CUDA error: an illegal memory access was
encountered"; the CUDA driver API under the CuTe DSL's launches names the enum,
CUDA_ERROR_ILLEGAL_ADDRESS; the runtime API its own, cudaErrorIllegalAddress).
"""

from __future__ import annotations

import errno

from .errors import APIError

# sysexits' EX_SOFTWARE: "an internal software error has been detected"; any non-zero code
# restarts the process under a supervisor, this one tells the cause in `echo $?`.
EXIT_DEVICE_FAILED = 70

# Sticky errors as each API spells them (CUDA 12 driver/runtime error names and messages).
_STICKY = (
    "illegal memory access",
    "illegal address",
    "illegaladdress",
    "illegal_address",
    "illegal instruction",
    "illegalinstruction",
    "illegal_instruction",
    "misaligned address",
    "misalignedaddress",
    "misaligned_address",
    "invalid program counter",
    "invalidpc",
    "invalid_pc",
    "hardware stack error",
    "hardwarestackerror",
    "hardware_stack_error",
    "unspecified launch failure",
    "launchfailure",
    "launch_failed",
    "device-side assert",
    "assert triggered",
    "cudaerrorassert",
    "cuda_error_assert",
    "uncorrectable ecc error",
    "eccuncorrectable",
    "ecc_uncorrectable",
    "kernel trap",
    "cuda_error_launch_timeout",
    "launch timed out",
    "device has fallen off the bus",
    "cuda_error_device_unavailable",
)

NO_SPACE_ERRNOS = frozenset(e for e in (errno.ENOSPC, getattr(errno, "EDQUOT", None)) if e)


def device_failure(exc: BaseException) -> str | None:
    """A one-line description if `exc` is a sticky device error, else None.

    Follows __cause__ / __context__ (an engine wrapper may re-raise the CUDA error). The
    server's own refusals (APIError, and what they were raised from) and filesystem errors
    are never device errors, and their text holds what a client chose (a tensor's or a set's
    name, a path): a chain is not read past an APIError, nor an OSError's text.
    """
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, APIError):
            return None
        text = f"{type(e).__name__}: {e}"
        low = text.lower()
        if not isinstance(e, OSError) and any(p in low for p in _STICKY):
            return text.splitlines()[0][:300]
        e = e.__cause__ or e.__context__
    return None


def is_no_space(exc: BaseException) -> bool:
    """The data directory's filesystem is full (or the quota is)."""
    return isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS
