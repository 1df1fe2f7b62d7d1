"""Typed results of the API, as plain frozen dataclasses (no pydantic, no torch).

They mirror docs/HTTP-API.md. `from_json` checks every field it needs and ignores extra ones, so
a newer server that adds fields does not break an older client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["WeightInfo", "WeightDeleted", "WeightLayout", "DTypeName"]

WeightLayout = Literal["w", "w_t"]
DTypeName = Literal["bfloat16", "float16", "float32"]


def _field(data: dict[str, Any], key: str, kind: type) -> Any:
    if key not in data:
        raise ValueError(f"missing field {key!r} in {data!r:.200}")
    value = data[key]
    # bool is an int subclass; a JSON true is never a valid count.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"field {key!r} must be {kind.__name__}; got {value!r:.80}")
    return value


@dataclass(frozen=True)
class WeightInfo:
    """A resident weight set on the server.

    Attributes:
        name: Its name (1-128 characters from [A-Za-z0-9._-], not starting with ".").
        experts: E, the number of experts.
        k: K, the input width.
        n: N, the output width.
        dtype: "bfloat16", "float16" or "float32".
        bytes: Size of the weights on the server.
        layout: "w" if uploaded as (E, K, N), "w_t" if as (E, N, K).
    """

    name: str
    experts: int
    k: int
    n: int
    dtype: str
    bytes: int
    layout: str

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, K, N), the logical shape grouped_mm multiplies by, whatever the upload layout."""
        return (self.experts, self.k, self.n)

    @classmethod
    def from_json(cls, data: object) -> WeightInfo:
        """Build from the server's JSON; ValueError when a field is missing or mistyped."""
        if not isinstance(data, dict):
            raise ValueError(f"WeightInfo must be a JSON object; got {data!r:.200}")
        return cls(
            name=_field(data, "name", str),
            experts=_field(data, "experts", int),
            k=_field(data, "k", int),
            n=_field(data, "n", int),
            dtype=_field(data, "dtype", str),
            bytes=_field(data, "bytes", int),
            layout=_field(data, "layout", str),
        )

    def to_json(self) -> dict[str, Any]:
        """The wire form, as the server sends it."""
        return {
            "name": self.name,
            "experts": self.experts,
            "k": self.k,
            "n": self.n,
            "dtype": self.dtype,
            "bytes": self.bytes,
            "layout": self.layout,
        }


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
