"""integrations/inputs.py: the transformers experts forwards' inputs, each mistake named."""

from __future__ import annotations

import pytest
import torch

from moe_gemm.integrations.inputs import check_expert_inputs

H = 32
CPU = torch.device("cpu")


def _inputs(T: int = 9, k: int = 2):
    return (torch.randn(T, H), torch.randint(0, 8, (T, k)), torch.rand(T, k))


@pytest.mark.parametrize("change,error,pattern", [
    (lambda x, i, w: (x[None], i, w), ValueError, r"hidden_states must be \(T, H\) = \(T, 32\)"),
    (lambda x, i, w: (x[:, :16], i, w), ValueError, r"hidden_states must be \(T, H\)"),
    (lambda x, i, w: (x.long(), i, w), TypeError, "hidden_states must be a float tensor"),
    (lambda x, i, w: (x, i[:3], w[:3]), ValueError,
     r"top_k_index must be \(T, k\) = \(9, k >= 1\)"),
    (lambda x, i, w: (x, i[:, :0], w[:, :0]), ValueError,
     r"top_k_index must be \(T, k\) = \(9, k >= 1\); got \(9, 0\)"),
    (lambda x, i, w: (x, i[:, 0], w[:, 0]), ValueError, r"top_k_index must be \(T, k\)"),
    (lambda x, i, w: (x, i.float(), w), TypeError, "top_k_index must hold integer expert ids"),
    (lambda x, i, w: (x, i, w[:, :1]), ValueError, "top_k_weights must match top_k_index"),
    (lambda x, i, w: (x, i, w.long()), TypeError, "top_k_weights must be a float tensor"),
    (lambda x, i, w: (x.to("meta"), i, w), ValueError, "hidden_states is on meta"),
    (lambda x, i, w: (x, i.tolist(), w), TypeError, "top_k_index must be a torch.Tensor"),
], ids=["3d-hidden", "other-h", "int-hidden", "other-t", "no-slots", "1d-ids", "float-ids",
        "weights-shape", "int-weights", "device", "list-ids"])
def test_each_mistake_is_named(change, error, pattern):
    with pytest.raises(error, match=pattern):
        check_expert_inputs(*change(*_inputs()), hidden_size=H, device=CPU)


def test_what_fits_passes_and_token_dtypes_can_be_narrowed():
    x, ids, w = _inputs()
    for i in (ids, ids.to(torch.uint8), ids.int()):  # integer ids of any width
        check_expert_inputs(x.double(), i, w.half(), hidden_size=H, device=CPU)
    with pytest.raises(TypeError, match="hidden_states must be one of torch.bfloat16"):
        check_expert_inputs(x.double(), ids, w, hidden_size=H, device=CPU,
                            token_dtypes=(torch.bfloat16, torch.float32))
    check_expert_inputs(x[:0], ids[:0], w[:0], hidden_size=H, device=CPU)  # no tokens


def test_a_mistake_is_named_when_compiled_with_dynamic_shapes():
    """The shapes in the message are the call's sizes, also where torch.compile traces them
    as symbols (it could not format them before: the message was lost)."""
    import torch._dynamo

    def check(x, i, w):
        check_expert_inputs(x, i, w, hidden_size=H, device=CPU)
        return x * 2

    x, ids, w = _inputs(T=9)
    torch._dynamo.reset()
    f = torch.compile(check, fullgraph=True, dynamic=True, backend="eager")
    torch.testing.assert_close(f(x, ids, w), x * 2)
    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        f(x[:, :16], ids, w)
    assert r"hidden_states must be (T, H) = (T, 32); got (9, 16)" in str(info.value.__cause__)
    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        f(x, ids, w[:, :1])
    assert "got (9, 1)" in str(info.value.__cause__)
    torch._dynamo.reset()
