"""layer_checks: what MoE, moe_forward and the expert-parallel layer refuse, called directly."""

from __future__ import annotations

import pytest
import torch

from moe_gemm.layers.layer_checks import (
    check_hidden_states,
    check_layer_args,
    check_parameters,
    check_routing,
)

H, I, E = 16, 8, 4


def _params(**change: object) -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    p: dict[str, object] = {"gate_up_proj": torch.randn(E, 2 * I, H, generator=g),
                            "down_proj": torch.randn(E, H, I, generator=g),
                            "router_weight": torch.randn(E, H, generator=g)}
    p.update(change)
    return p


def test_check_parameters_passes_matching_weights_and_names_each_mismatch() -> None:
    check_parameters(_params(), H)
    cases = [
        (_params(gate_up_proj=None), TypeError, "gate_up_proj must be a tensor; got NoneType"),
        (_params(gate_up_proj=torch.zeros(E, 2 * I + 1, H)), ValueError,
         r"gate_up_proj must be \(E, 2I, H\) = \(E, 2I, 16\); got \(4, 17, 16\)"),
        (_params(down_proj=torch.zeros(E, H, I + 1)), ValueError,
         r"down_proj must be \(E, H, I\) = \(4, 16, 8\)"),
        (_params(down_proj=torch.zeros(E, H, I, dtype=torch.bfloat16)), TypeError,
         "down_proj is torch.bfloat16 but its gate_up_proj is torch.float32"),
        (_params(down_proj=torch.zeros(E, H, I, device="meta")), ValueError,
         "down_proj is on meta but its gate_up_proj is on cpu"),
        (_params(router_weight=torch.zeros(E + 1, H)), ValueError, "router_weight"),
        (_params(router_weight=torch.zeros(E, H, device="meta")), ValueError,
         "router_weight is on meta but its expert weights are on cpu"),
        # An FP8 router passed the fast path (is_floating_point) and routed tokens cast to
        # float8 with no scale: the loaders' TypeError now.
        (_params(router_weight=torch.zeros(E, H).to(torch.float8_e4m3fn)), TypeError,
         "router_weight must be a floating-point tensor"),
    ]
    for params, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            check_parameters(params, H)


def test_check_hidden_states_returns_the_input_or_names_what_is_wrong() -> None:
    x = torch.randn(2, 3, H)
    assert check_hidden_states(x, H, x.device) is x
    with pytest.raises(TypeError, match=r"must be a torch.Tensor \(\.\.\., H\); got list"):
        check_hidden_states([1.0], H, x.device)
    with pytest.raises(ValueError, match=r"must be \(\.\.\., H\) = \(\.\.\., 16\); got \(3, 15\)"):
        check_hidden_states(torch.randn(3, H - 1), H, x.device)
    with pytest.raises(TypeError, match="got torch.float64"):
        check_hidden_states(x.double(), H, x.device)
    with pytest.raises(ValueError, match="hidden_states is on cpu but the layer's weights are on "
                                         "meta"):
        check_hidden_states(x, H, torch.device("meta"))


def test_check_routing_and_layer_args() -> None:
    check_routing(8, 2, "softmax", 1, 1, 1.0)
    check_routing(8, 4, "sigmoid", 4, 2, 2.5, False)
    for args, exc, pattern in [
        ((8, 9, "softmax", 1, 1, 1.0), ValueError, r"top_k must be in \[1, num_experts=8\]"),
        ((8, 2, "tanh", 1, 1, 1.0), ValueError, "scoring must be 'softmax', 'sigmoid' or 'sqrtsoftplus'"),
        ((8, 2, "softmax", 3, 1, 1.0), ValueError, "divide E=8"),
        ((8, 4, "softmax", 4, 1, 2.0), ValueError, "cannot be chosen"),
        ((8, 2, "softmax", 1, 1, float("inf")), ValueError, "routed_scaling_factor must be finite"),
        ((8.0, 2, "softmax", 1, 1, 1.0), TypeError, "num_experts must be an int"),
    ]:
        with pytest.raises(exc, match=pattern):
            check_routing(*args)
    good = dict(hidden_size=H, intermediate_size=I, shared_intermediate_size=0, num_experts=E,
                top_k=2, scoring="sigmoid", renormalize=True, n_group=1, topk_group=1,
                routed_scaling_factor=1.0, correction_bias=None, router_fp32=None,
                shared_expert_gate=False, activation="silu", config=None, fused=None,
                dtype=None, router_jitter_noise=0.0)
    assert check_layer_args(**good) is True  # sigmoid scoring keeps a correction bias
    assert check_layer_args(**{**good, "scoring": "softmax"}) is False
    with pytest.raises(ValueError, match="router_jitter_noise must be a finite float >= 0"):
        check_layer_args(**{**good, "router_jitter_noise": -0.1})
    with pytest.raises(TypeError, match="correction_bias must be a bool or None"):
        check_layer_args(**{**good, "correction_bias": torch.zeros(E)})
    with pytest.raises(ValueError, match="shared_expert_gate needs a shared expert"):
        check_layer_args(**{**good, "shared_expert_gate": True})
    default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        with pytest.raises(TypeError, match="pass one as dtype="):
            check_layer_args(**good)
        assert check_layer_args(**{**good, "dtype": torch.float32}) is True
    finally:
        torch.set_default_dtype(default)


def test_a_device_string_torch_cannot_parse_is_a_value_error() -> None:
    # "gpu" reached torch.empty inside the constructor: torch's RuntimeError ("Expected one
    # of cpu, cuda, ...") from deep in MoE.__init__, not the layer's argument check.
    from moe_gemm.layers.moe import MoE

    for bad in ("gpu", "cuda:x", ""):
        with pytest.raises(ValueError, match=f"device must be a torch.device, a device string "
                                             f"such as 'cpu' or 'cuda:0', or an index; got "
                                             f"{bad!r}"):
            MoE(H, I, E, 2, device=bad, dtype=torch.float32)
    assert MoE(H, I, E, 2, device="cpu", dtype=torch.float32).router_weight.device.type == "cpu"
    assert MoE(H, I, E, 2, device="meta", dtype=torch.float32).gate_up_proj.is_meta


def test_an_fp8_router_assigned_to_a_built_layer_is_refused_at_forward() -> None:
    import moe_gemm

    m = moe_gemm.MoE(32, 16, 4, 2)
    m.router_weight = torch.nn.Parameter(m.router_weight.data.to(torch.float8_e4m3fn),
                                         requires_grad=False)
    with pytest.raises(TypeError, match="router_weight must be a floating-point tensor"):
        with torch.no_grad():
            m(torch.randn(3, 32))


@pytest.mark.parametrize("name", ["gate_up_proj", "down_proj", "router_weight"])
def test_a_parametrized_or_plain_tensor_weight_runs_as_the_forward_reads_it(name) -> None:
    # A parametrization moves the Parameter to layer.parametrizations, and a plain tensor set
    # after `del` lives in __dict__: the checks indexed _parameters, a KeyError.
    import torch.nn.utils.parametrize as P

    import moe_gemm

    torch.manual_seed(0)
    m = moe_gemm.MoE(32, 16, 4, 2, dtype=torch.float32)
    x = torch.randn(5, 32)

    class Scale(torch.nn.Module):
        def forward(self, w):
            return w * 0.5

    ref = moe_gemm.MoE(32, 16, 4, 2, dtype=torch.float32)
    ref.load_state_dict(m.state_dict())
    with torch.no_grad():
        getattr(ref, name).mul_(0.5)
        want = ref(x)
        P.register_parametrization(m, name, Scale())
        torch.testing.assert_close(m(x), want)
        P.remove_parametrizations(m, name, leave_parametrized=True)
        plain = getattr(m, name).detach().clone()
        delattr(m, name)
        setattr(m, name, plain)  # (a plain tensor attribute, not a Parameter)
        torch.testing.assert_close(m(x), want)
        setattr(m, name, plain[:1])
        with pytest.raises(ValueError, match=name):
            m(x)
