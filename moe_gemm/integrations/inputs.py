"""The transformers experts forwards' inputs, checked (both integrations, 16-bit and FP8).

transformers calls an experts implementation as fn(self, hidden_states (T, H), top_k_index
(T, k), top_k_weights (T, k)). The paths gather rows by id and combine T x k slots, so a
3-D or mismatched input would fail inside an index op or give a result of the routing's
shape rather than the tokens'; each mistake is a TypeError or ValueError naming the input.
"""

from __future__ import annotations

import torch

from moe_gemm.ops.validation import shape_text

ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def check_expert_inputs(hidden_states: object, top_k_index: object, top_k_weights: object, *,
                        hidden_size: int, device: torch.device,
                        token_dtypes: tuple[torch.dtype, ...] | None = None) -> None:
    """Raise unless hidden_states is (T, hidden_size), top_k_index integer (T, k) and
    top_k_weights floating (T, k), all on `device`; token_dtypes: the hidden_states dtypes
    taken (None: any floating dtype)."""
    for name, t, hint in (("hidden_states", hidden_states, "(T, H)"),
                          ("top_k_index", top_k_index, "(T, k)"),
                          ("top_k_weights", top_k_weights, "(T, k)")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor {hint}; got {type(t).__name__}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the experts are on {device}")
    assert isinstance(hidden_states, torch.Tensor) and isinstance(top_k_index, torch.Tensor)
    assert isinstance(top_k_weights, torch.Tensor)
    if hidden_states.dim() != 2 or hidden_states.shape[1] != hidden_size:
        raise ValueError(f"hidden_states must be (T, H) = (T, {hidden_size}); got "
                         f"{shape_text(hidden_states)}")
    if token_dtypes is not None and hidden_states.dtype not in token_dtypes:
        names = ", ".join(str(d) for d in token_dtypes)
        raise TypeError(f"hidden_states must be one of {names}; got {hidden_states.dtype}")
    if token_dtypes is None and not hidden_states.is_floating_point():
        raise TypeError(f"hidden_states must be a float tensor; got {hidden_states.dtype}")
    T = hidden_states.shape[0]
    # k >= 1 as moe_experts asks: with no slot the combine's row stride k is zero, and it
    # failed inside torch ("step must be nonzero").
    if top_k_index.dim() != 2 or top_k_index.shape[0] != T or top_k_index.shape[1] < 1:
        raise ValueError(f"top_k_index must be (T, k) = ({T}, k >= 1); got "
                         f"{shape_text(top_k_index)}")
    if top_k_index.dtype not in ID_DTYPES:
        raise TypeError(f"top_k_index must hold integer expert ids; got {top_k_index.dtype}")
    if tuple(top_k_weights.shape) != tuple(top_k_index.shape):
        raise ValueError(f"top_k_weights must match top_k_index {shape_text(top_k_index)}; "
                         f"got {shape_text(top_k_weights)}")
    if not top_k_weights.is_floating_point():
        raise TypeError(f"top_k_weights must be a float tensor; got {top_k_weights.dtype}")
