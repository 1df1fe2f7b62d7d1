"""Typed results of the API, as plain frozen dataclasses (no pydantic, no torch).

They mirror docs/HTTP-API.md. `from_json` checks every field it needs and ignores extra ones, so
a newer server that adds fields does not break an older client; fields a server sends only
sometimes (WeightInfo.scales, .kernels) default to "absent", so an older server that never
sends them works too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["KernelInfo", "WeightInfo", "WeightList", "NotLoadedInfo", "WeightDeleted",
           "WeightLayout", "DTypeName", "ScaleGranularity"]

WeightLayout = Literal["w", "w_t"]
DTypeName = Literal["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2"]
ScaleGranularity = Literal["block", "row", "tensor"]


def _field(data: dict[str, Any], key: str, kind: type) -> Any:
    if key not in data:
        raise ValueError(f"missing field {key!r} in {data!r:.200}")
    value = data[key]
    # bool is an int subclass; a JSON true is never a valid count.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"field {key!r} must be {kind.__name__}; got {value!r:.80}")
    return value


def _optional(data: dict[str, Any], key: str, kind: type) -> Any:
    # Absent (an older server, or a set it does not apply to) and JSON null both mean None.
    return None if data.get(key) is None else _field(data, key, kind)


@dataclass(frozen=True)
class KernelInfo:
    """The kernel config the server runs one warmed row count of a weight set with.

    Attributes:
        rows: T, the row count it was warmed for.
        config: The config's name, as `moe-gemm tune` prints it (e.g. "coop 128x256 s3 p16").
        source: Where it came from: "table:exact", "table:neighbours" or "rules", with
            "+waves" where the whole-wave fit then moved its tile.
    """

    rows: int
    config: str
    source: str

    @classmethod
    def from_json(cls, data: object) -> KernelInfo:
        if not isinstance(data, dict):
            raise ValueError(f"a kernels entry must be a JSON object; got {data!r:.200}")
        return cls(rows=_field(data, "rows", int), config=_field(data, "config", str),
                   source=_field(data, "source", str))

    def to_json(self) -> dict[str, Any]:
        return {"rows": self.rows, "config": self.config, "source": self.source}


@dataclass(frozen=True)
class WeightInfo:
    """A resident weight set on the server.

    Attributes:
        name: Its name (1-128 characters from [A-Za-z0-9._-], not starting with ".").
        experts: E, the number of experts.
        k: K, the input width.
        n: N, the output width.
        dtype: "bfloat16", "float16" or "float32"; FP8 sets "float8_e4m3fn" or "float8_e5m2".
        bytes: Size of the weights on the server (an FP8 set's scale included).
        layout: "w" if uploaded as (E, K, N), "w_t" if as (E, N, K).
        scales: An FP8 set's scale granularity: "block" (128x128), "row" (per output channel)
            or "tensor" (per expert / one value); None for other sets and older servers.
        kernels: Where the server's Hopper kernels serve the set, the config each warmed row
            count runs; () otherwise (other backends, older servers).
    """

    name: str
    experts: int
    k: int
    n: int
    dtype: str
    bytes: int
    layout: str
    scales: str | None = None
    kernels: tuple[KernelInfo, ...] = ()

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, K, N), the logical shape grouped_mm multiplies by, whatever the upload layout."""
        return (self.experts, self.k, self.n)

    @classmethod
    def from_json(cls, data: object) -> WeightInfo:
        """Build from the server's JSON; ValueError when a field is missing or mistyped."""
        if not isinstance(data, dict):
            raise ValueError(f"WeightInfo must be a JSON object; got {data!r:.200}")
        kernels = _optional(data, "kernels", list) or []
        return cls(
            name=_field(data, "name", str),
            experts=_field(data, "experts", int),
            k=_field(data, "k", int),
            n=_field(data, "n", int),
            dtype=_field(data, "dtype", str),
            bytes=_field(data, "bytes", int),
            layout=_field(data, "layout", str),
            scales=_optional(data, "scales", str),
            kernels=tuple(KernelInfo.from_json(k) for k in kernels),
        )

    def to_json(self) -> dict[str, Any]:
        """The wire form, as the server sends it (scales and kernels only when present)."""
        out: dict[str, Any] = {
            "name": self.name,
            "experts": self.experts,
            "k": self.k,
            "n": self.n,
            "dtype": self.dtype,
            "bytes": self.bytes,
            "layout": self.layout,
        }
        if self.scales is not None:
            out["scales"] = self.scales
        if self.kernels:
            out["kernels"] = [k.to_json() for k in self.kernels]
        return out


@dataclass(frozen=True)
class NotLoadedInfo:
    """A weight set stored on the server but not in its memory (GET /v1/weights' `not_loaded`).

    Attributes:
        name: The set's name.
        status: What a request naming it is answered: 507 (left out: it does not fit the
            budget or the device now) or 503 (its file cannot be read as a set).
        error: The server's message: what it needs against what is free, or why the file
            cannot be read.
    """

    name: str
    status: int
    error: str

    @classmethod
    def from_json(cls, data: object) -> NotLoadedInfo:
        if not isinstance(data, dict):
            raise ValueError(f"a not_loaded entry must be a JSON object; got {data!r:.200}")
        return cls(name=_field(data, "name", str), status=_field(data, "status", int),
                   error=_field(data, "error", str))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "error": self.error}


class WeightList(list[WeightInfo]):
    """The resident weight sets (a list of WeightInfo, as list_weights always returned), with
    `not_loaded`: the sets stored on the server that it does not serve from memory now, each
    with the status a request naming it gets. Empty from an older server that does not say."""

    not_loaded: tuple[NotLoadedInfo, ...]

    def __init__(self, weights: Any = (), not_loaded: Any = ()) -> None:
        super().__init__(weights)
        self.not_loaded = tuple(not_loaded)

    def __repr__(self) -> str:
        return f"WeightList({list(self)!r}, not_loaded={self.not_loaded!r})"

    def __eq__(self, other: object) -> bool:
        # Compares as a list (so `== []` and list equality keep holding); a WeightList also
        # compares its not_loaded part.
        if isinstance(other, WeightList) and self.not_loaded != other.not_loaded:
            return False
        return list.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = None  # type: ignore[assignment]  # a list: unhashable

    @classmethod
    def from_json(cls, data: object) -> WeightList:
        """Build from GET /v1/weights' JSON; ValueError when it is not that shape."""
        if not isinstance(data, dict) or not isinstance(data.get("weights"), list):
            raise ValueError(f'expected {{"weights": [...]}}; got {data!r:.200}')
        not_loaded = _optional(data, "not_loaded", list) or []
        return cls((WeightInfo.from_json(item) for item in data["weights"]),
                   (NotLoadedInfo.from_json(item) for item in not_loaded))

    def to_json(self) -> dict[str, Any]:
        """The wire form, as the server sends it."""
        return {"weights": [w.to_json() for w in self],
                "not_loaded": [n.to_json() for n in self.not_loaded]}


@dataclass(frozen=True)
class WeightDeleted:
    """The answer to delete_weights.

    Attributes:
        deleted: The name of the weight set that was deleted.
    """

    deleted: str

    @classmethod
    def from_json(cls, data: object) -> WeightDeleted:
        if not isinstance(data, dict):
            raise ValueError(f"delete answer must be a JSON object; got {data!r:.200}")
        return cls(deleted=_field(data, "deleted", str))
