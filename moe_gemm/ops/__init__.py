"""The torch-facing layer: validate -> cached launch plan -> compiled kernel (or the torch
backend).

Modules, top to bottom (imports only go down):
    api          grouped_gemm, grouped_mm, GroupedGemmPlan: the public ops
    scaled       scaled_grouped_mm, scaled_grouped_gemm: the FP8 ops (scaled_validation,
                 scaled_support, scaled_launch, scaled_reference, heuristics_fp8 beside them)
    masked       grouped_mm_masked, scaled_grouped_mm_masked: the batched form on each
                 problem's first masked_m[g] rows (masked_validation, masked_launch,
                 masked_custom_ops beside it); fused_masked: fused_grouped_mm_masked, the
                 masked layout with the fused bias, gate and row weights
    quantize     FP8 quantization helpers (1x128 groups, 128x128 blocks, rows, tensors);
                 quantize_custom_ops: the block ones as registered ops, opaque to torch.compile
    fused        fused_grouped_mm: grouped_mm with the MoE gather, bias, gate and row
                 weights in the kernel (fused_validation, fused_launch, fused_reference,
                 fused_custom_ops: its checks, host side, torch backend, registered ops)
    custom_ops   the same ops registered with torch.library (torch.compile, fake tensors;
                 custom_ops_fp8 for the FP8 ones)
    mm_launch    torch tensors -> kernel arguments for grouped_mm: varlen and batched plans
    general_launch
                 the same for grouped_gemm's lists: plans, per-problem metadata uploads
    launch_kernel
                 the compiled kernel of a choice, its grid, the PDL switch
    launch_resources
                 workspaces, placeholder tensors, pinned staging, capture and stream state
    launch_info  what the last launch used (last_launch, trace_assignment)
    heuristics   config choice from host-known shapes (tuned tables first, then rules)
    schedule     the tile schedule in plain Python: the truth the kernel follows
    support      what the sm90 kernels can take (16-byte TMA rules), pure torch
    validation   argument checks whose messages name the expected shape and dtype
    reference    the torch backend and float32 references
    aliasing     does an output share memory with an operand
    autograd     the inference-only link (backward through a kernel result raises)
    kernel_cache compiled kernels: in memory and on disk
"""

from .api import GroupedGemmPlan, grouped_gemm, grouped_mm

__all__ = ["GroupedGemmPlan", "grouped_gemm", "grouped_mm"]
