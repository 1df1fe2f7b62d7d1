"""The torch-facing layer: validate -> cached launch plan -> compiled kernel (or the torch
backend).

Modules, top to bottom (imports only go down):
    api          grouped_gemm, grouped_mm, GroupedGemmPlan: the public ops
    fused        fused_grouped_mm: grouped_mm with the MoE gather, bias, gate and row
                 weights in the kernel (fused_validation, fused_launch, fused_reference,
                 fused_custom_ops: its checks, host side, torch backend, registered ops)
    custom_ops   the same ops registered with torch.library (torch.compile, fake tensors)
    launch       torch tensors -> kernel arguments: cached plans, workspaces, the launch
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
