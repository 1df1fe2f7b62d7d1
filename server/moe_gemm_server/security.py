"""Secure by default: exposure checks at start-up, TLS settings, and the audit log of admin actions.

- A server bound to anything but a loopback address without an admin key would let anyone who
  can reach it upload and delete weight sets: `check_exposure` refuses that start with one line,
  unless --insecure-no-auth says it is meant (then every start logs a warning).
- TLS is uvicorn's: --ssl-certfile / --ssl-keyfile; the files are checked before binding.
- Every admin action (weight upload, delete), allowed or refused, writes one `audit` line with
  the action, the set, the outcome, the client address and the key's id: the first 12 hex
  digits of its SHA-256, never the key (the same id names the same key across lines and
  restarts, so an operator can tell keys apart without the log revealing any).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import logging
import os
import re
import ssl
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass

from starlette.requests import ClientDisconnect, Request

from .auth import bearer_token
from .config import Settings
from .errors import APIError
from .logs import log_field

log = logging.getLogger("moe_gemm_server")
audit_log = logging.getLogger("moe_gemm_server.audit")
# Audit lines are written whatever --log-level says (a warning-level server still audits).
audit_log.setLevel(logging.INFO)

LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")


class InsecureStart(ValueError):
    """The settings would expose weight changes without a key."""


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and the names of localhost; False for 0.0.0.0, ::, other
    addresses and other names (a name may resolve to a public address)."""
    h = host.strip().strip("[]").lower()
    if h in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def check_exposure(settings: Settings) -> list[str]:
    """Refuse an exposed start without an admin key; returns the warnings to log.

    Raises:
        InsecureStart: non-loopback host, no admin key and no --insecure-no-auth.
    """
    warnings = []
    exposed = not is_loopback(settings.host)
    if exposed and settings.admin_key is None:
        if not settings.insecure_no_auth:
            raise InsecureStart(
                f"refusing to listen on {settings.host} without an admin key: anyone who can "
                "reach it could upload and delete weight sets; set --admin-key (or "
                "MOE_GEMM_ADMIN_KEY), bind to 127.0.0.1, or pass --insecure-no-auth to run "
                "exposed without one"
            )
        warnings.append(
            f"INSECURE: listening on {settings.host} with --insecure-no-auth and no admin key"
            + ("; weight changes are open to anyone who can reach this port"
               if settings.open_admin else "; weight changes are disabled (no admin key)")
        )
    if exposed and not settings.api_key:
        warnings.append(f"matmul and read routes on {settings.host} need no key (no --api-key)")
    if exposed and settings.ssl_certfile is None:
        warnings.append(f"listening on {settings.host} without TLS: keys cross the network in "
                        "clear text (see --ssl-certfile / --ssl-keyfile)")
    return warnings


def check_tls(settings: Settings) -> None:
    """The certificate and key files exist, are readable and form a usable pair (before
    binding the port).

    uvicorn loads them only once it starts serving, after "listening on https://..." is
    logged, and turns a bad file into a traceback ending in `ssl.SSLError: [SSL] PEM lib`;
    loading them here into a throwaway SSLContext refuses the start with one line instead.

    Raises:
        ValueError: a key without a certificate, a file that cannot be read, a file that holds
            no PEM certificate / private key, an encrypted key (uvicorn would prompt for its
            password on the terminal: a hang under a supervisor), or a key that does not
            match the certificate.
    """
    if settings.ssl_keyfile is not None and settings.ssl_certfile is None:
        raise ValueError("--ssl-keyfile needs --ssl-certfile")
    contents: dict[str, bytes] = {}
    for flag, path in (("--ssl-certfile", settings.ssl_certfile),
                       ("--ssl-keyfile", settings.ssl_keyfile)):
        if path is None:
            continue
        contents[flag] = _read_pem_file(flag, path)
    if settings.ssl_certfile is None:
        return
    # OpenSSL says only "PEM lib" for either file: look for the PEM blocks first, so that the
    # message can name the file at fault.
    if b"-----BEGIN CERTIFICATE-----" not in contents["--ssl-certfile"]:
        raise ValueError(f"--ssl-certfile {settings.ssl_certfile}: no PEM certificate in it "
                         "(expected a -----BEGIN CERTIFICATE----- block)")
    key_flag = "--ssl-keyfile" if settings.ssl_keyfile is not None else "--ssl-certfile"
    key_path = settings.ssl_keyfile if settings.ssl_keyfile is not None else settings.ssl_certfile
    if not re.search(rb"-----BEGIN [A-Z ]*PRIVATE KEY-----", contents[key_flag]):
        hint = "" if settings.ssl_keyfile is not None else " (give the key with --ssl-keyfile)"
        raise ValueError(f"{key_flag} {key_path}: no PEM private key in it{hint}")

    def no_password() -> bytes:
        raise ValueError(f"{key_flag} {key_path}: the private key is encrypted; give an "
                         "unencrypted key (the server has no way to ask for its password)")

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(str(settings.ssl_certfile),
                            str(settings.ssl_keyfile) if settings.ssl_keyfile else None,
                            password=no_password)
    except ssl.SSLError as e:
        files = (f"--ssl-certfile {settings.ssl_certfile}" if settings.ssl_keyfile is None
                 else f"--ssl-certfile {settings.ssl_certfile} and --ssl-keyfile "
                 f"{settings.ssl_keyfile}")
        # OpenSSL's reason for a malformed PEM body is the bare "PEM lib"
        reason = e.reason if e.reason and e.reason != "PEM lib" else f"unreadable PEM data ({e})"
        if reason == "KEY_VALUES_MISMATCH":
            reason = "the private key does not match the certificate"
        raise ValueError(f"{files}: not a usable certificate and key: {reason}") from None
    except OSError as e:  # the file vanished or changed between the reads above and here
        raise ValueError(f"--ssl-certfile {settings.ssl_certfile}: {e.strerror or e}") from None


# Certificate chains and keys are a few KB (a CA bundle a few hundred): a larger file is not
# one, and reading it whole would only cost memory.
MAX_PEM_BYTES = 16 << 20


def _read_pem_file(flag: str, path: os.PathLike[str] | str) -> bytes:
    """The bytes of a TLS file: a regular file of at most MAX_PEM_BYTES (ValueError naming the
    flag otherwise). A device or a FIFO is refused before it is read: /dev/zero or
    /dev/urandom filled memory without end, and a FIFO with no writer hung the start."""
    try:
        # O_NONBLOCK: opening a FIFO without a writer would block; fstat then refuses it.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror or e}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{flag} {path}: not a regular file (a PEM certificate or key file "
                             "is expected)")
        with os.fdopen(fd, "rb") as f:
            fd = -1  # (the file object owns it now)
            data = f.read(MAX_PEM_BYTES + 1)
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror or e}") from None
    finally:
        if fd >= 0:
            os.close(fd)
    if len(data) > MAX_PEM_BYTES:
        raise ValueError(f"{flag} {path}: larger than {MAX_PEM_BYTES} bytes, too large for a "
                         "PEM certificate or key file")
    return data


def key_id(token: str | None) -> str:
    """A stable, non-reversible id of a key for logs: "sha256:" + 12 hex digits, or "none"."""
    if token is None:
        return "none"
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()[:12]


@dataclass
class AuditRecord:
    action: str
    name: str
    status: int = 0
    detail: str = ""


def _client(request: Request) -> str:
    c = request.client
    return f"{c.host}:{c.port}" if c is not None else "-"


def write_audit(request: Request, record: AuditRecord, elapsed_s: float) -> None:
    """One line per admin action. The fields a client chooses (the name, its address, the
    detail, which may quote the name) are escaped (logs.log_field, repr), so that no request can
    end the line or write a line of its own."""
    outcome = "ok" if 200 <= record.status < 300 else "refused"
    audit_log.info(
        "audit action=%s name=%s outcome=%s status=%d key_id=%s client=%s elapsed_ms=%.1f%s",
        record.action, log_field(record.name), outcome, record.status,
        key_id(bearer_token(request)), log_field(_client(request)), elapsed_s * 1e3,
        f" detail={record.detail!r}" if record.detail else "",
    )


@contextlib.contextmanager
def audited(request: Request, action: str, name: str) -> Iterator[AuditRecord]:
    """Audit one admin action: the block sets `record.status` on success; an APIError (or any
    other exception, as 500) is audited with its status and re-raised."""
    record = AuditRecord(action, name)
    t0 = time.monotonic()
    try:
        yield record
    except APIError as e:
        record.status, record.detail = e.status, e.message[:200]
        raise
    except (asyncio.CancelledError, ClientDisconnect):  # (mid-body: starlette's exception)
        record.status, record.detail = 499, "client disconnected"
        raise
    except BaseException:
        record.status, record.detail = 500, "internal error"
        raise
    finally:
        write_audit(request, record, time.monotonic() - t0)
