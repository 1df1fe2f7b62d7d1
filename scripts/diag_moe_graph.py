"""Device diagnosis: MoE layer (cute backend) eager vs CUDA-graph replay."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from moe_gemm import GemmConfig, MoE, grouped_mm  # noqa: E402


def main() -> None:
    T, H = 96, 512
    torch.manual_seed(0)
    moe = MoE(H, 256, 32, 4, device="cuda", dtype=torch.bfloat16,
              config=GemmConfig(backend="cute"), shared_intermediate_size=128)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 1.0 / p.shape[-1] ** 0.5)
    static_x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        e1, e2 = moe(static_x), moe(static_x)
        torch.cuda.synchronize()
        print("eager twice equal:", torch.equal(e1, e2))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                moe(static_x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = moe(static_x)
        for trial in range(3):
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16) * (1 + trial)
            static_x.copy_(x)
            static_y.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            eager = moe(x)
            torch.cuda.synchronize()
            d = (static_y.float() - eager.float()).abs()
            print(f"trial {trial}: nan-after-replay={bool(torch.isnan(static_y).any())} "
                  f"equal={torch.equal(static_y, eager)} maxdiff={d.nan_to_num(1e9).max().item():.3g} "
                  f"rows-differing={int((d.nan_to_num(1e9) > 0).any(1).sum())}")
        # grouped_mm alone after a side-stream warm-up
        E, K, N = 8, 256, 128
        xx = torch.randn(300, K, device="cuda", dtype=torch.bfloat16)
        ww = torch.randn(E, K, N, device="cuda", dtype=torch.bfloat16)
        offs = torch.tensor([10, 50, 50, 120, 200, 260, 290, 300], dtype=torch.int32,
                            device="cuda")
        side2 = torch.cuda.Stream()
        with torch.cuda.stream(side2):
            grouped_mm(xx, ww, offs)
        torch.cuda.synchronize()
        g2 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g2):
            yy = grouped_mm(xx, ww, offs)
        yy.fill_(float("nan"))
        g2.replay()
        torch.cuda.synchronize()
        print("grouped_mm graph after side-stream warmup: nan-left",
              bool(torch.isnan(yy).any()), "equal-eager", torch.equal(yy, grouped_mm(xx, ww, offs)))


if __name__ == "__main__":
    main()
