"""The Engine's launches: one request or several callers' requests in ONE grouped launch.

`grouped_mm_many` / `grouped_gemm_many` merge the requests a batcher collected into one
grouped problem and split the result back (see engine.py's docstring); `_check_mm_requests`
is what a request must satisfy against its weight set. Held by a mixin the Engine inherits;
every launch runs under the Engine's `_launch()` (its lock and CUDA stream).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from moe_gemm.config import GemmConfig
from moe_gemm.ops.api import grouped_gemm, grouped_mm
from moe_gemm.ops.validation import SUPPORTED_DTYPES, shape_text

from .fp8_weights import fp8_mm

if TYPE_CHECKING:
    from .engine import WeightSet

# Staging buffers larger than this are not kept between launches (see Engine._buffer).
_MAX_BUFFER_BYTES = 512 << 20


class LaunchMixin:
    """Engine's launch methods (Engine inherits them).

    They use the Engine's device, config and registry (get_weights), its `_launch()` context
    (lock, stream, out-of-memory guard), `_to_device`, and per-engine state: the staging
    buffers, the thread-local warm-up flag and the launch counter.
    """

    device: torch.device
    config: GemmConfig
    launches: int
    _buffers: dict[str, torch.Tensor]
    _tls: threading.local

    def grouped_mm(
        self,
        ws: WeightSet | str,
        x: torch.Tensor,
        counts: torch.Tensor,
        *,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """One request: y [T, N] = rows of x grouped by `counts` times each expert's weights.

        Args:
            ws: a WeightSet or the name of a resident one.
            x: [T, K], the set's dtype or float32 (converted to the set's dtype).
            counts: [E] integer rows per expert, non-negative, summing to T.
            out_dtype: dtype of y; default x's dtype.

        Returns:
            y [T, N] on the CPU.
        """
        return self.grouped_mm_many(ws, [(x, counts)], out_dtype=out_dtype)[0]

    def grouped_mm_many(
        self,
        ws: WeightSet | str,
        requests: Sequence[tuple[torch.Tensor, torch.Tensor]],
        *,
        out_dtype: torch.dtype | None = None,
    ) -> list[torch.Tensor]:
        """Several requests against one weight set in ONE grouped launch.

        Request r's rows for expert e are placed after the rows of requests 0..r-1 for the
        same expert, so the merged input is again grouped by expert (offs = cumulative sum
        of the summed counts) and no padding is needed; the output rows are scattered back to
        each request's own order.

        Args:
            ws: a WeightSet or the name of a resident one.
            requests: (x_r [T_r, K], counts_r [E]) pairs; every x_r has one dtype, the set's
                or float32.
            out_dtype: dtype of every y_r; default the x_r dtype.

        Returns:
            [y_r [T_r, N]] on the CPU, in request order.

        Raises:
            KeyError: no resident set of that name.
            TypeError / ValueError: shapes, dtypes or counts that do not fit the set.
            EngineOutOfMemory: the launch did not fit in device memory.
        """
        if isinstance(ws, str):
            ws = self.get_weights(ws)
        if not requests:
            return []
        xs, cs = self._check_mm_requests(ws, requests)
        odt = out_dtype if out_dtype is not None else xs[0].dtype
        if odt not in SUPPORTED_DTYPES:
            raise TypeError(f"out_dtype must be bfloat16, float16 or float32; got {odt}")
        rows = [x.shape[0] for x in xs]
        C = torch.stack(cs)  # (R, E) int64 on the CPU
        total = sum(rows)
        offs = torch.cumsum(C.sum(0), 0).to(torch.int32)
        if len(xs) == 1:
            with self._launch():
                x_dev = self._to_device(xs[0])
                y = self._mm(ws, x_dev, self._to_device(offs), odt)
                y_host = y.to("cpu")
                self._count_launch()
            return [y_host]
        perm = _merge_permutation(C, rows)
        K, N = ws.K, ws.N
        with self._launch():
            # Staging buffers are kept between launches (pinned on CUDA: one DMA each way):
            # a fresh host allocation of a large merged batch costs more in page faults than
            # the copies themselves.
            x_cat = self._buffer("x_host", (total, K), xs[0].dtype, "cpu")
            torch.cat(xs, out=x_cat)
            perm_dev = self._to_device(perm)
            if self.device.type == "cpu":
                x_m = self._buffer("x_merged", (total, K), xs[0].dtype, "cpu")
                torch.index_select(x_cat, 0, perm_dev, out=x_m)
                if x_m.dtype != ws.dtype and ws.scale is None:
                    x_m = self._buffer("x_cast", (total, K), ws.dtype, "cpu").copy_(x_m)
                y_m = self._buffer("y_merged", (total, N), odt, "cpu")
                self._mm(ws, x_m, offs, odt, out=y_m)
                y_req = self._buffer("y_host", (total, N), odt, "cpu")
                y_req.index_copy_(0, perm_dev, y_m)
            else:
                x_dev = x_cat.to(self.device, non_blocking=True)
                x_m = x_dev.index_select(0, perm_dev)
                y = self._mm(ws, x_m, self._to_device(offs), odt)
                y_dev = torch.empty_like(y)
                y_dev.index_copy_(0, perm_dev, y)
                y_req = self._buffer("y_host", (total, N), odt, "cpu")
                y_req.copy_(y_dev)
            # the buffers are reused by the next launch: hand out copies
            outs = [t.clone() for t in y_req.split(rows)]
            self._count_launch()
        return outs

    def _mm(self, ws: WeightSet, x: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """The set's grouped GEMM: grouped_mm, or for an FP8 set the activations quantized
        on the device and scaled_grouped_mm (fp8_weights.fp8_mm)."""
        if ws.scale is not None:
            return fp8_mm(ws, x, offs, out_dtype, self.config, out)
        x = x.to(ws.dtype)
        if out is not None:
            return grouped_mm(x, ws.w, offs, out=out, config=self.config)
        return grouped_mm(x, ws.w, offs, config=self.config, out_dtype=out_dtype)

    def _count_launch(self) -> None:
        if not getattr(self._tls, "warming", False):
            self.launches += 1  # serving launches (under the lock)

    def _buffer(self, name: str, shape: tuple[int, int], dtype: torch.dtype, where: str
                ) -> torch.Tensor:
        """A [shape] view of a persistent staging buffer (grown geometrically, pinned when on
        the host of a CUDA engine). Only for launches under the lock; very large requests get
        a plain allocation so the engine does not hold gigabytes between batches."""
        nbytes = shape[0] * shape[1] * dtype.itemsize
        if nbytes > _MAX_BUFFER_BYTES:
            return torch.empty(shape, dtype=dtype, device=where)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < nbytes:
            size = max(nbytes, 2 * (buf.numel() if buf is not None else 0), 1 << 20)
            size = min(size, _MAX_BUFFER_BYTES)
            pin = where == "cpu" and self.device.type == "cuda"
            buf = torch.empty(size, dtype=torch.uint8, device=where, pin_memory=pin)
            self._buffers[name] = buf
        return buf[:nbytes].view(dtype).view(shape)

    def grouped_gemm_many(
        self,
        requests: Sequence[tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]],
        *,
        out_dtype: torch.dtype | None = None,
    ) -> list[list[torch.Tensor]]:
        """Several requests' ad-hoc problem lists in ONE grouped_gemm launch.

        Args:
            requests: (a_list, b_list) per request, a_i [M_i, K_i], b_i [K_i, N_i]; one dtype
                across all requests.
            out_dtype: dtype of every d_i; default the inputs' dtype.

        Returns:
            Per request, its [d_i [M_i, N_i]] on the CPU.
        """
        if not requests:
            return []
        a_all: list[torch.Tensor] = []
        b_all: list[torch.Tensor] = []
        sizes = []
        for r, (a, b) in enumerate(requests):
            if len(a) != len(b):
                raise ValueError(
                    f"request {r}: expected one b per a; got {len(a)} a and {len(b)} b"
                )
            a_all.extend(a)
            b_all.extend(b)
            sizes.append(len(a))
        with self._launch():
            a_dev = [self._to_device(t) for t in a_all]
            b_dev = [self._to_device(t) for t in b_all]
            d = grouped_gemm(a_dev, b_dev, config=self.config, out_dtype=out_dtype)
            d_host = [t.to("cpu") for t in d]
            self._count_launch()
        out, i = [], 0
        for n in sizes:
            out.append(d_host[i:i + n])
            i += n
        return out

    def grouped_gemm(
        self, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], *,
        out_dtype: torch.dtype | None = None,
    ) -> list[torch.Tensor]:
        """One request's ad-hoc problems: [a_i @ b_i] on the CPU."""
        return self.grouped_gemm_many([(a, b)], out_dtype=out_dtype)[0]

    def _check_mm_requests(
        self, ws: WeightSet, requests: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        xs, cs = [], []
        dtype = None
        for r, (x, counts) in enumerate(requests):
            if not isinstance(x, torch.Tensor) or not isinstance(counts, torch.Tensor):
                raise TypeError(f"request {r}: x and counts must be torch.Tensors")
            if x.dim() != 2 or x.shape[1] != ws.K:
                raise ValueError(
                    f"request {r}: x must be (T, K) = (T, {ws.K}) for weight set "
                    f"{ws.name!r}; got {shape_text(x)}"
                )
            if x.dtype not in ws.request_dtypes:
                if ws.scale is not None:
                    raise TypeError(
                        f"request {r}: x must be bfloat16, float16 or float32 (weight set "
                        f"{ws.name!r} is FP8: the engine quantizes activations); got "
                        f"{str(x.dtype)[6:]}")
                allowed = "" if ws.dtype == torch.float32 else " or float32"
                raise TypeError(
                    f"request {r}: x must be {str(ws.dtype)[6:]} (the weight set's dtype)"
                    f"{allowed}; got {str(x.dtype)[6:]}"
                )
            if dtype is None:
                dtype = x.dtype
            elif x.dtype != dtype:
                raise TypeError(
                    f"request {r}: x is {str(x.dtype)[6:]} but request 0 is "
                    f"{str(dtype)[6:]}; one launch takes one dtype"
                )
            if counts.dim() != 1 or counts.shape[0] != ws.E:
                raise ValueError(
                    f"request {r}: counts must be (E,) = ({ws.E},) for weight set "
                    f"{ws.name!r}; got {shape_text(counts)}"
                )
            if counts.dtype.is_floating_point or counts.dtype == torch.bool:
                raise TypeError(f"request {r}: counts must be integers; got {counts.dtype}")
            c = counts.detach().to("cpu", torch.int64)
            if ws.E and int(c.min()) < 0:
                raise ValueError(f"request {r}: counts must be >= 0; got min {int(c.min())}")
            if ws.E and int(c.max()) > x.shape[0]:  # checked before the sum, which could wrap
                raise ValueError(f"request {r}: counts must be <= T = {x.shape[0]}; got max "
                                 f"{int(c.max())}")
            if int(c.sum()) != x.shape[0]:
                raise ValueError(
                    f"request {r}: counts must sum to T = {x.shape[0]}; they sum to "
                    f"{int(c.sum())}"
                )
            xs.append(x)
            cs.append(c)
        return xs, cs


def _merge_permutation(C: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """perm [total] int64: merged row j takes concatenated-input row perm[j].

    C is (R, E) counts. Merged order is expert-major, request-minor: block (e, r) holds
    request r's rows for expert e. In the concatenated input, request r starts at
    sum(rows[:r]) and its expert-e rows start sum(C[r, :e]) after that.
    """
    R, E = C.shape
    row_start = torch.tensor([0] + rows[:-1], dtype=torch.int64).cumsum(0)  # (R,)
    src = row_start[:, None] + (torch.cumsum(C, 1) - C)  # (R, E) source block starts
    sizes = C.t().reshape(-1)  # (E*R,) in merged order
    src_flat = src.t().reshape(-1)
    dst_flat = torch.cumsum(sizes, 0) - sizes
    total = int(sizes.sum())
    return torch.repeat_interleave(src_flat - dst_flat, sizes, output_size=total) + torch.arange(
        total, dtype=torch.int64
    )
