"""Helpers shared by the routers: body format, native per-request headers, responses."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import TypeVar

import torch
from fastapi import Request, Response

from ..codecs import check_json_finite, encode_json, encode_safetensors, tensor_to_json
from ..errors import APIError, bad_request
from ..service_weights import SAFETENSORS_TYPES, media_type

OCTET = "application/octet-stream"
JSON = "application/json"
_BIG = 256 << 10
T = TypeVar("T")


def body_format(request: Request) -> str:
    """"json" or "safetensors" from Content-Type (none = safetensors); 415 otherwise."""
    ctype = media_type(request)
    if ctype == JSON:
        return "json"
    if ctype is None or ctype in SAFETENSORS_TYPES:
        return "safetensors"
    raise APIError(415, f"unsupported Content-Type {ctype!r}; send safetensors "
                        f"({OCTET} or application/safetensors) or {JSON}")


# A JSON body beyond this many bytes is parsed in a worker thread: tens of MB of JSON take
# seconds to parse, and on the event loop that would stall every other request and the
# health probes. Smaller bodies parse inline (a thread hop costs ~50-100 us).
OFF_LOOP_BYTES = 1 << 20


async def off_loop_if_large(body: bytes | bytearray, parse: Callable[[], T]) -> T:
    if len(body) < OFF_LOOP_BYTES:
        return parse()
    return await asyncio.to_thread(parse)


def single_header(request: Request, name: str) -> str | None:
    """The header's value; a header sent more than once with different values is a 400 (which
    copy was meant cannot be known: taking the first would act on a value the client may not
    have meant, as two Content-Length values are an error in HTTP)."""
    values = request.headers.getlist(name)
    if len({_plain(v) for v in values}) > 1:
        raise bad_request(f"{name} is given {len(values)} times with different values")
    return values[0] if values else None


def _plain(value: str) -> str:
    """A header value as compared for sameness: stripped, and a decimal count without its
    leading zeros ("5" and "05" are one value)."""
    text = value.strip()
    return (text.lstrip("0") or "0") if text.isascii() and text.isdigit() else text


def _int_value(name: str, raw: str) -> int:
    text = raw.strip()
    # Plain decimal digits only (int() would also take "1_000" and "+5"), below 10^18: at most
    # 18 digits once leading zeros are dropped (a plain decimal count keeps its value with them,
    # as Inference-Header-Content-Length's does).
    if not (text.isascii() and text.isdigit()) or len(text.lstrip("0")) > 18:
        shown = raw if len(raw) <= 40 else raw[:40] + "..."
        raise bad_request(f"{name} must be a non-negative integer below 10^18; got {shown!r}")
    return int(text)


def _int_header(request: Request, name: str) -> int | None:
    """An integer header's value: every copy a plain count below 10^18, then single_header's
    rule (copies compared as numbers: "5" and "05" agree)."""
    for raw in request.headers.getlist(name):
        _int_value(name, raw)
    text = single_header(request, name)
    return None if text is None else int(text.strip())


def native_params(request: Request) -> tuple[int | None, int | None]:
    """(priority, timeout in microseconds) from X-Priority / X-Timeout-Us."""
    return _int_header(request, "x-priority"), _int_header(request, "x-timeout-us")


# JSON answers are for small requests: beyond this many numbers, ask for safetensors (a JSON
# number costs ~20 bytes and a Python float object to build; 4M of them is already ~80 MB).
MAX_JSON_ELEMENTS = 4 << 20


def check_json_answer(elements: int) -> None:
    """422 before running a request whose JSON answer would be too large."""
    if elements > MAX_JSON_ELEMENTS:
        raise APIError(422, f"the answer has {elements} numbers, more than the "
                            f"{MAX_JSON_ELEMENTS} a JSON answer may hold; send safetensors "
                            "(or, on v2, ask for binary_data outputs)")


def _json_body(tensors: Mapping[str, torch.Tensor], extra: Mapping[str, object] | None,
               as_list: str | None = None) -> bytes:
    if as_list:  # {"d": [d.0, d.1, ...]} (the grouped-gemm JSON form)
        obj: dict[str, object] = {as_list: [tensor_to_json(v) for v in tensors.values()]}
    else:
        obj = {k: tensor_to_json(v) for k, v in tensors.items()}
    obj.update(extra or {})
    return encode_json(obj)


async def tensors_response(tensors: Mapping[str, torch.Tensor], fmt: str,
                           extra: Mapping[str, object] | None = None) -> Response:
    if fmt in ("json", "json-list"):
        for key, t in tensors.items():
            check_json_finite(key, t, "send the request as safetensors (the answer is then "
                                      "safetensors too)")
        as_list = "d" if fmt == "json-list" else None
        if sum(t.numel() for t in tensors.values()) > 65536:  # keep the event loop free
            return Response(await asyncio.to_thread(_json_body, tensors, extra, as_list),
                            media_type=JSON)
        return Response(_json_body(tensors, extra, as_list), media_type=JSON)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    if size > _BIG:
        body = await asyncio.to_thread(encode_safetensors, tensors)
    else:
        body = encode_safetensors(tensors)
    return Response(body, media_type=OCTET)
