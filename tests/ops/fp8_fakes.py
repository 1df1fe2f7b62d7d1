"""The FP8 host path on the CPU: an emulator in place of the compiled FP8 kernel.

Fp8KernelEmulator takes exactly the arguments ops/scaled_launch.py passes the compiled kernel
and computes what GroupedGemmFp8Sm90 computes from them, reading each argument the way the
kernel does (kernels/sm90/grouped_gemm_fp8.py and problems.py): offsets clamped into [0, T]
with a decreasing entry an empty expert, problem E the zero tail, A scales as sa[row, kb]
and B scales as sb[kb, n_block] (block) or sa[row, 0] and sb[0, col] (outer), the general
form's operands, outputs and scales found from the raw addresses and strides of its two
tables. The result is the exact product (fp64) rounded once to the output dtype, so the host
path's plumbing is checked against the torch backend without a GPU.
"""

from __future__ import annotations

import torch

from moe_gemm.ops import scaled, scaled_launch

SCALE_BLOCK = 128


def _dequant_a(x, sa, block):
    v = x.double()
    s = sa.double()
    if block:
        return v * s.repeat_interleave(SCALE_BLOCK, 1)[:, : v.shape[1]]
    return v * s[:, :1]


def _dequant_b(w_kn, sb, block):
    v = w_kn.double()
    s = sb.double()
    if block:
        return v * s.repeat_interleave(SCALE_BLOCK, 0)[: v.shape[0]].repeat_interleave(
            SCALE_BLOCK, 1)[:, : v.shape[1]]
    return v * s[:1, :]


class Memory:
    """Tensors the general form's tables may point into, found again by address."""

    def __init__(self, tensors):
        self.tensors = [t for t in tensors if isinstance(t, torch.Tensor)]

    def view(self, address, dtype, shape, stride):
        for t in self.tensors:
            st = t.untyped_storage()
            base = st.data_ptr()
            if t.dtype == dtype and base <= address < base + max(1, st.nbytes()):
                offset = (address - base) // t.element_size()
                out = torch.empty(0, dtype=dtype)
                out.set_(st, offset, shape, stride)
                return out
        raise AssertionError(f"address {address:#x} of {dtype} is in no known tensor")


class Fp8KernelEmulator:
    """Records each call and computes the kernel's result (see the module docstring)."""

    def __init__(self, key, memory: Memory | None = None):
        self.key = key
        self.memory = memory
        self.calls: list[tuple] = []

    def __call__(self, x, w, out, sfa, sfb, smeta, meta, meta32, offs, table, workspace, trace,
                 num_problems, num_ctas, swizzle, a_policy, b_policy, pdl, d_base):
        self.calls.append((x, w, out, sfa, sfb, smeta, meta, offs, num_problems, num_ctas))
        block = self.key.scale_mode == "block"
        assert 1 <= num_ctas <= 132
        if self.key.form == "varlen":
            T, E, N = x.shape[0], offs.shape[0], out.shape[1]
            assert num_problems in (E, E + 1)
            assert sfa.shape[0] == T and sfb.shape[0] == E
            assert sfa.shape[1] == (x.shape[1] // SCALE_BLOCK if block else 1)
            assert sfb.shape[2] == (-(-N // SCALE_BLOCK) if block else N)
            for p in range(num_problems):
                begin = max(min(int(offs[p - 1]), T), 0) if p > 0 else 0
                end = max(min(int(offs[p]), T), 0) if p < E else T
                if end <= begin:
                    continue
                if p == E:
                    out[begin:end] = 0
                    continue
                res = _dequant_a(x[begin:end], sfa[begin:end], block) @ _dequant_b(
                    w[p], sfb[p], block)
                out[begin:end] = res.to(out.dtype)
        elif self.key.form == "batched":
            G = x.shape[0]
            assert num_problems == G and sfa.shape[:2] == x.shape[:2] and sfb.shape[0] == G
            for g in range(G):
                out[g] = (_dequant_a(x[g], sfa[g], block) @ _dequant_b(w[g], sfb[g], block)
                          ).to(out.dtype)
        else:
            self._general(meta, meta32, smeta, num_problems, d_base, out.dtype, block)

    def _general(self, meta, meta32, smeta, G, d_base, d_dtype, block):
        mem = self.memory
        assert mem is not None and meta.shape == (G, 8) and smeta.shape == (G, 8)
        ab = torch.float8_e4m3fn if self.key.ab_dtype == "float8_e4m3fn" else torch.float8_e5m2
        for p in range(G):
            row, srow = [int(v) for v in meta[p]], [int(v) for v in smeta[p]]
            M, N, K = row[6] & 0xFFFFFFFF, row[6] >> 32, row[7]
            # The kernel reads M, N, K through the int32 view at columns 12..14.
            assert (int(meta32[p, 12]), int(meta32[p, 13]), int(meta32[p, 14])) == (M, N, K)
            if M == 0 or N == 0:
                continue
            d = mem.view(row[2] + d_base, d_dtype, (M, N), (row[5], 1))
            if K == 0:
                d.zero_()
                continue
            a = mem.view(row[0], ab, (M, K), (row[3], 1))
            b_nk = mem.view(row[1], ab, (N, K), (row[4], 1))
            kb = K // SCALE_BLOCK if block else 1
            cols = -(-N // SCALE_BLOCK) if block else N
            sa = mem.view(srow[0], torch.float32, (M, kb), (srow[1], srow[2]))
            sb = mem.view(srow[3], torch.float32, (kb, cols), (srow[4], srow[5]))
            d.copy_((_dequant_a(a, sa, block) @ _dequant_b(b_nk.t(), sb, block)).to(d_dtype))


class KernelFactory:
    """Stands in for scaled_launch._kernel: an emulator per compile key, all remembered."""

    def __init__(self):
        self.made: list[Fp8KernelEmulator] = []
        self.memory: Memory | None = None

    def __call__(self, key):
        emu = Fp8KernelEmulator(key, self.memory)
        self.made.append(emu)
        return emu

    @property
    def calls(self):
        return [c for e in self.made for c in e.calls]


def install(monkeypatch, factory: KernelFactory) -> None:
    """scaled_grouped_mm / scaled_grouped_gemm through ops/scaled_launch.py on the CPU."""
    from host_fakes import NSM
    from host_fakes import install as install_launch

    install_launch(monkeypatch, None)
    monkeypatch.setattr(scaled, "cute_problem", lambda device=None: None)
    monkeypatch.setattr(scaled_launch, "sm_count", lambda device: NSM)
    monkeypatch.setattr(scaled_launch, "_kernel", factory)
    scaled._clear_plans()
