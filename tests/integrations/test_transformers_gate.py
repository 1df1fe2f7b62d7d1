"""integrations/transformers.py: the experts' gate is the one transformers' forwards call,
`experts._apply_gate` looked up on the module (a gate set on one instance included), on the
fused path, in the weight checks and in MoE.from_hf."""

from __future__ import annotations

import copy
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("needs transformers >= 5 (ExpertsInterface)", allow_module_level=True)

from transformers import MixtralConfig  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import (  # noqa: E402
    MixtralExperts,
    MixtralSparseMoeBlock,
)

from moe_gemm.integrations import register_transformers  # noqa: E402
from moe_gemm.layers.moe import MoE  # noqa: E402

H, I, E, K = 32, 16, 8, 2


def _config() -> MixtralConfig:
    return MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E,
                         num_experts_per_tok=K)


def _random(module: torch.nn.Module) -> torch.nn.Module:
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return module.eval()


def _tanh_gate(self: torch.nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.tanh(gate) * up


def _inputs(T: int = 13) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(T, H)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    return x, ids, torch.rand(T, K)


@pytest.mark.parametrize("fused", [None, False, True])
def test_a_gate_set_on_one_experts_module_is_the_one_run(fused: bool | None) -> None:
    # The fused path (the default on a Hopper GPU; fused=True forces it here) took the
    # class's default silu gate for a gate set on the instance: a silently wrong result.
    register_transformers()
    experts = _random(MixtralExperts(_config()))
    experts._apply_gate = types.MethodType(_tanh_gate, experts)
    experts.moe_gemm_fused = fused
    x, ids, w = _inputs()
    ref = _float64_batched_mm(experts)
    with torch.no_grad():
        want = ref(x.double(), ids, w.double())
        experts.config._experts_implementation = "moe_gemm"
        got = experts(x, ids, w)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def _float64_batched_mm(experts: torch.nn.Module) -> torch.nn.Module:
    """The module in float64 on transformers' batched_mm, which calls `self._apply_gate` (its
    per-expert loop computes act_fn(gate) * up itself), with the instance gate."""
    ref = copy.deepcopy(experts).double()
    ref._apply_gate = types.MethodType(_tanh_gate, ref)
    ref.config = copy.copy(experts.config)
    ref.config._experts_implementation = "batched_mm"
    return ref


def test_moe_from_hf_refuses_a_gate_set_on_the_blocks_experts() -> None:
    # MoE holds the default act(gate) * up: a block whose experts run another gate is refused
    # by name (it was taken, and the layer's output differed from the block's).
    block = _random(MixtralSparseMoeBlock(_config()))
    block.experts._apply_gate = types.MethodType(_tanh_gate, block.experts)
    with pytest.raises(ValueError, match="MixtralExperts with a custom _apply_gate"):
        MoE.from_hf(block)
    del block.experts._apply_gate  # the class's gate again: taken
    moe = MoE.from_hf(block)
    x = torch.randn(2, 5, H)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), block(x), rtol=1e-5, atol=1e-6)
