"""The `moe-gemm-client` command: talk to a moe-gemm-server from a shell.

    moe-gemm-client [--url URL] [--api-key KEY] [--timeout S] [--max-retries N] COMMAND ...

    health                                   is the server live?        (exit 0 yes, 1 no)
    ready [--wait SECONDS]                   is it ready to compute?    (exit 0 yes, 1 no,
                                             3 unreachable, with --wait: at the deadline)
    list [--json]                            resident weight sets
    info NAME                                one weight set, as JSON (FP8: with "scales")
    upload NAME FILE.safetensors [--tensor KEY] [--layout w|w_t] [--scale-tensor KEY]
                                 [--progress|--no-progress]
    delete NAME
    grouped-mm NAME --x X (--counts C | --offs O) --out Y.npy|Y.safetensors
    grouped-gemm --in PROBLEMS.safetensors --out D.safetensors

An FP8 (F8_E4M3 / F8_E5M2) tensor is uploaded with the file's F32 "scale" tensor (or the one
--scale-tensor names) beside it. Arrays are read from .npy files or .safetensors files (the
tensor named like the option, e.g. "x", or the file's only tensor); counts/offs may also be
given inline as "3,0,5". A .npy of dtype V2 (what numpy writes for an ml_dtypes.bfloat16 array)
is read as bfloat16.
Exit codes: 0 success, 1 the server said no (an HTTP error, or not live/ready), 2 bad arguments
or files, 3 the server could not be reached (connection error or timeout).
The URL and key default to $MOE_GEMM_BASE_URL and $MOE_GEMM_API_KEY.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import IO, Any

import numpy as np

from . import __version__
from . import _constants as C
from ._client import Client
from ._exceptions import APIConnectionError, APIError
from ._tensors import BFLOAT16, decode_safetensors, encode_safetensors

__all__ = ["main", "ProgressBar"]

EXIT_OK, EXIT_API, EXIT_USAGE, EXIT_CONNECTION = 0, 1, 2, 3
# The reader of our output went away (`moe-gemm-client list --json | head -1`): the status a
# shell reports for a tool that SIGPIPE ended (128 + 13), quietly, as such tools end.
EXIT_BROKEN_PIPE = 141


class UsageError(Exception):
    """Bad arguments or input files (exit code 2)."""


class ProgressBar:
    """A one-line upload progress bar on a terminal stream, with no dependencies.

    Used as a `progress(bytes_sent, bytes_total)` callback; redraws at most 10 times a second.
    """

    def __init__(self, label: str, stream: IO[str] | None = None, width: int = 30) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self._start = time.monotonic()
        self._last_draw = -1.0
        self._done = False

    def __call__(self, sent: int, total: int) -> None:
        now = time.monotonic()
        if sent == 0:
            self._start = now  # a retry starts the body again
            self._done = False
        finished = sent >= total
        if not finished and now - self._last_draw < 0.1:
            return
        if self._done:
            return
        self._last_draw = now
        frac = sent / total if total else 1.0
        filled = int(frac * self.width)
        rate = sent / max(now - self._start, 1e-9) / 2**20
        self.stream.write(
            f"\r{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {frac * 100:5.1f}% "
            f"{sent / 2**20:.1f}/{total / 2**20:.1f} MiB {rate:.1f} MiB/s"
        )
        if finished:
            self.stream.write("\n")
            self._done = True
        self.stream.flush()


# ------------------------------------------------------------------------------------------
# array files


def _fix_bf16(arr: np.ndarray) -> np.ndarray:
    # np.save writes ml_dtypes.bfloat16 as an opaque 2-byte void ("<V2"); read it back as bf16.
    if arr.dtype.kind == "V" and arr.dtype.itemsize == 2 and arr.dtype.names is None:
        return arr.view(BFLOAT16)
    return arr


def load_array(path: str, key: str) -> np.ndarray:
    """Load one array from a .npy file or a .safetensors file (tensor `key` or the only one)."""
    _check_input_file(path)
    try:
        if path.endswith(".safetensors"):
            with open(path, "rb") as f:
                tensors = decode_safetensors(f.read())
            if key in tensors:
                return tensors[key]
            if len(tensors) == 1:
                return next(iter(tensors.values()))
            raise UsageError(f"{path} holds {sorted(tensors)}; expected a tensor named {key!r} "
                             "or a single tensor")
        if path.endswith(".npy"):
            # The .npy reader itself, not np.load: np.load hands back an NpzFile for a zip
            # archive and raises EOFError for an empty file (tracebacks, exit 1); read_array
            # raises ValueError for both, as for every other file that is not a .npy.
            with open(path, "rb") as f:
                return _fix_bf16(np.lib.format.read_array(f, allow_pickle=False))
    except (ValueError, OSError) as exc:
        raise UsageError(f"{path}: {exc}") from exc
    raise UsageError(f"{path}: expected a .npy or .safetensors file")


def _check_input_file(path: str) -> None:
    """An input path names a file: "no such file" for a directory sends the user looking for
    a typo that is not there."""
    if os.path.isdir(path):
        raise UsageError(f"{path}: is a directory, not a file")
    if not os.path.isfile(path):
        raise UsageError(f"{path}: no such file")


def check_output_path(path: str) -> None:
    """The result can be written to `path`: checked before the request is sent, so that a
    typo in --out does not cost the server's work (and the message names the user's path,
    not the temporary file the result is first written to)."""
    if os.path.isdir(path):
        raise UsageError(f"--out {path}: is a directory")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(f"--out {path}: no such directory {parent}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--out {path}: directory {parent} is not writable")


def load_index(spec: str, key: str) -> np.ndarray | list[int]:
    """counts/offs from a file, or inline as comma-separated ints ("3,0,5")."""
    if spec.endswith((".npy", ".safetensors")):
        return load_array(spec, key)
    try:
        # Python ints: the client checks their range (a ValueError naming int32, exit 2);
        # numpy's int64 conversion raised an OverflowError past 2^63, a traceback. An empty
        # field is an error (int('') raises), not skipped: "3,,5" read as [3, 5] would be a
        # request for another routing, answered without a word when E is 2.
        return [int(v) for v in spec.split(",")]
    except ValueError:
        raise UsageError(f"--{key} must be a .npy/.safetensors file or comma-separated ints; "
                         f"got {spec!r}") from None


def save_arrays(path: str, tensors: dict[str, np.ndarray]) -> None:
    """Write results: .safetensors (all tensors) or .npy (exactly one).

    Raises:
        UsageError: a bad suffix, or the file cannot be written (the message names `path`,
            not the temporary file).
    """
    if path.endswith(".safetensors"):
        data = encode_safetensors(tensors).to_bytes()
    elif path.endswith(".npy"):
        if len(tensors) != 1:
            raise UsageError(f"{path}: .npy holds one array; use .safetensors for "
                             f"{len(tensors)} outputs")
        data = None
    else:
        raise UsageError(f"{path}: --out must end in .npy or .safetensors")
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            if data is None:  # an open file: np.save would append ".npy" to a bare name
                np.save(f, next(iter(tensors.values())), allow_pickle=False)
            else:
                f.write(data)
        os.replace(tmp, path)  # a reader never sees a half-written result
    except OSError as exc:
        with contextlib.suppress(OSError):  # the temporary file may never have been made
            os.unlink(tmp)
        raise UsageError(f"cannot write --out {path}: {exc.strerror or exc}") from None


# ------------------------------------------------------------------------------------------
# commands


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2))


def _cmd_health(client: Client, args: argparse.Namespace) -> int:
    live = client.health()
    _print_json({"live": live})
    return EXIT_OK if live else EXIT_API


def _cmd_ready(client: Client, args: argparse.Namespace) -> int:
    # Still unreachable at the deadline: the connection error (exit 3, as `ready` without
    # --wait), not "not ready" (exit 1: the server answered no).
    ok = (client.wait_until_ready(args.wait, raise_unreachable=True) if args.wait
          else client.ready())
    _print_json({"ready": ok})
    return EXIT_OK if ok else EXIT_API


def _cmd_list(client: Client, args: argparse.Namespace) -> int:
    weights = client.list_weights()
    if args.json:
        _print_json(weights.to_json())
        return EXIT_OK
    rows = [("NAME", "E", "K", "N", "DTYPE", "LAYOUT", "MiB")]
    rows += [(w.name, str(w.experts), str(w.k), str(w.n), w.dtype, w.layout,
              f"{w.bytes / 2**20:.1f}") for w in weights]
    _print_table(rows)
    if weights.not_loaded:
        # Stored on the server but not served from memory: requests naming them get the
        # status shown (507: no room now; 503: the file cannot be read as a set).
        print("\nnot loaded:")
        _print_table([("NAME", "STATUS", "ERROR")]
                     + [(n.name, str(n.status), n.error) for n in weights.not_loaded])
    return EXIT_OK


def _print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(wd) for c, wd in zip(r, widths)).rstrip())


def _cmd_info(client: Client, args: argparse.Namespace) -> int:
    _print_json(client.get_weights(args.name).to_json())
    return EXIT_OK


def _cmd_upload(client: Client, args: argparse.Namespace) -> int:
    _check_input_file(args.file)
    size = os.path.getsize(args.file)
    show = args.progress if args.progress is not None else (
        sys.stderr.isatty() and size >= C.STREAM_THRESHOLD_BYTES)
    progress = ProgressBar(f"upload {args.name}") if show else None
    try:
        info = client.upload_safetensors(args.name, args.file, tensor=args.tensor,
                                         layout=args.layout, scale_tensor=args.scale_tensor,
                                         progress=progress)
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from exc
    _print_json(info.to_json())
    return EXIT_OK


def _cmd_delete(client: Client, args: argparse.Namespace) -> int:
    _print_json({"deleted": client.delete_weights(args.name).deleted})
    return EXIT_OK


def _cmd_grouped_mm(client: Client, args: argparse.Namespace) -> int:
    if not args.out.endswith((".npy", ".safetensors")):
        raise UsageError(f"{args.out}: --out must end in .npy or .safetensors")
    check_output_path(args.out)
    x = load_array(args.x, "x")
    counts = load_index(args.counts, "counts") if args.counts is not None else None
    offs = load_index(args.offs, "offs") if args.offs is not None else None
    try:
        y, request_id = client.grouped_mm(args.name, x, counts=counts, offs=offs,
                                          return_request_id=True)
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from exc
    save_arrays(args.out, {"y": y})
    print(json.dumps({"out": args.out, "shape": list(y.shape), "dtype": str(y.dtype),
                      "request_id": request_id}))
    return EXIT_OK


def _cmd_grouped_gemm(client: Client, args: argparse.Namespace) -> int:
    if not args.out.endswith(".safetensors"):
        raise UsageError(f"{args.out}: --out must end in .safetensors")
    check_output_path(args.out)
    _check_input_file(args.inp)
    try:
        with open(args.inp, "rb") as f:
            tensors = decode_safetensors(f.read())
    except (ValueError, OSError) as exc:
        raise UsageError(f"{args.inp}: {exc}") from exc
    n = 0
    while f"a.{n}" in tensors:
        n += 1
    if n == 0 or any(f"b.{i}" not in tensors for i in range(n)):
        raise UsageError(f"{args.inp} must hold a.0, b.0, a.1, b.1, ...; it holds "
                         f"{sorted(tensors)}")
    # Problems are a.0/b.0 .. a.(n-1)/b.(n-1); anything else (a gap in the numbering: a.0,
    # a.2; a stray tensor) would be silently left out of the answer.
    unused = sorted(set(tensors) - {f"{p}.{i}" for p in "ab" for i in range(n)},
                    key=_natural_key)
    if unused:
        raise UsageError(f"{args.inp}: problems must be numbered a.0/b.0 .. a.N/b.N without "
                         f"gaps; after the {n} problem(s) a.0..a.{n - 1} it holds "
                         f"{', '.join(unused)}, which would not be used")
    try:
        outs, request_id = client.grouped_gemm([tensors[f"a.{i}"] for i in range(n)],
                                               [tensors[f"b.{i}"] for i in range(n)],
                                               return_request_id=True)
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from exc
    save_arrays(args.out, {f"d.{i}": d for i, d in enumerate(outs)})
    print(json.dumps({"out": args.out, "problems": n, "request_id": request_id}))
    return EXIT_OK


def _natural_key(name: str) -> list[object]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _seconds(*, positive: bool) -> Any:
    """An argparse type for a duration flag: finite and >= 0 (> 0 with `positive`). The
    error names the flag (argparse prefixes "argument --flag:"), where httpx would later say
    only "Invalid value NaN (not a number)"."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number of seconds, got {text!r}")
        if value < 0 or (positive and value == 0):
            bound = "> 0" if positive else ">= 0"
            raise argparse.ArgumentTypeError(f"must be {bound} seconds, got {text!r}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moe-gemm-client",
        description="Command line client of moe-gemm-server.",
        epilog="Exit codes: 0 ok, 1 server said no, 2 bad arguments/files, 3 unreachable.",
    )
    p.add_argument("--url", default=None,
                   help=f"server URL (default: ${C.ENV_BASE_URL} or {C.DEFAULT_BASE_URL})")
    p.add_argument("--api-key", default=None, help=f"API key (default: ${C.ENV_API_KEY})")
    p.add_argument("--timeout", type=_seconds(positive=True), default=None,
                   help="seconds per connect/read/write (default: 5 to connect, 300 otherwise)")
    p.add_argument("--max-retries", type=int, default=C.DEFAULT_MAX_RETRIES,
                   help=f"retries on connection errors and HTTP "
                        f"{', '.join(map(str, sorted(C.RETRYABLE_STATUSES)))} (default "
                        f"{C.DEFAULT_MAX_RETRIES})")
    p.add_argument("--version", action="version", version=f"moe-gemm-client {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("health", help="is the server live?")
    s.set_defaults(func=_cmd_health)
    s = sub.add_parser("ready", help="is the server ready to compute?")
    s.add_argument("--wait", type=_seconds(positive=False), default=0.0,
                   metavar="SECONDS",
                   help="poll until ready for up to this long (exit 3 if the server is still "
                        "unreachable then, 1 if it answers not ready)")
    s.set_defaults(func=_cmd_ready)
    s = sub.add_parser("list", help="list resident weight sets")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.set_defaults(func=_cmd_list)
    s = sub.add_parser("info", help="show one weight set")
    s.add_argument("name")
    s.set_defaults(func=_cmd_info)
    s = sub.add_parser("upload", help="upload a .safetensors tensor (FP8: with its scale) as a "
                                      "weight set")
    s.add_argument("name")
    s.add_argument("file", help=".safetensors file")
    s.add_argument("--tensor", default=None,
                   help="tensor in the file (default: w, else w_t, else the only one besides "
                        "the scale)")
    s.add_argument("--layout", choices=("w", "w_t"), default=None,
                   help="w = (E, K, N), w_t = (E, N, K) (default: the tensor's name, else w)")
    s.add_argument("--scale-tensor", default=None, metavar="KEY",
                   help="for an FP8 tensor, the file's F32 tensor holding its decoding scale "
                        "(default: scale)")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="always show a progress bar on stderr")
    g.add_argument("--no-progress", dest="progress", action="store_false",
                   help="never show one (default: on a terminal, for files of 8 MiB or more)")
    s.set_defaults(func=_cmd_upload)
    s = sub.add_parser("delete", help="delete a weight set")
    s.add_argument("name")
    s.set_defaults(func=_cmd_delete)
    s = sub.add_parser("grouped-mm", help="y = x @ w per expert against a weight set")
    s.add_argument("name")
    s.add_argument("--x", required=True, help="x (T, K): .npy or .safetensors")
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("--counts", help="rows per expert (E,): file or '3,0,5'")
    g.add_argument("--offs", help="cumulative end rows (E,): file or '3,3,8'")
    s.add_argument("--out", required=True, help="y (T, N): .npy or .safetensors")
    s.set_defaults(func=_cmd_grouped_mm)
    s = sub.add_parser("grouped-gemm", help="D_i = A_i @ B_i from a.i/b.i tensors")
    s.add_argument("--in", dest="inp", required=True, help=".safetensors with a.0, b.0, ...")
    s.add_argument("--out", required=True, help=".safetensors for d.0, d.1, ...")
    s.set_defaults(func=_cmd_grouped_gemm)
    return p


def _make_client(args: argparse.Namespace) -> Client:
    timeout = C.DEFAULT_TIMEOUT if args.timeout is None else args.timeout
    return Client(base_url=args.url, api_key=args.api_key, timeout=timeout,
                  max_retries=args.max_retries)


def _discard_stdout() -> None:
    """Point stdout at /dev/null: the interpreter flushes it at exit, which would raise the
    broken pipe again (and print it) after main returned."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):
        pass  # not a file descriptor (a test's captured stdout): nothing will flush to a pipe


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        client = _make_client(args)
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        with client:
            return int(args.func(client, args))
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except APIConnectionError as exc:
        print(f"error: cannot reach {client.base_url}: {exc}", file=sys.stderr)
        return EXIT_CONNECTION
    except APIError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_API
    except BrokenPipeError:
        _discard_stdout()
        return EXIT_BROKEN_PIPE
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, TypeError) as exc:
        # Local validation of names and arguments, raised before any request.
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # `python -m moe_gemm_client.cli` must act as the console script (which exits with main()).
    sys.exit(main())
