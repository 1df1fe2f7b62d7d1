"""expert_shards: one rank's view of a checkpoint, and one rank's experts of a whole layer."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import pytest
import torch

from moe_gemm.layers.dispatch import Dispatcher
from moe_gemm.layers.expert_shards import (
    LocalShard,
    Renamed,
    dispatcher_or_default,
    local_moe,
    router_of,
    shard_of_state_dict,
)
from moe_gemm.layers.moe import MoE


class Recording(Mapping[str, torch.Tensor]):
    """A checkpoint mapping that records which keys were indexed (a lazy safetensors file
    reads a tensor only when it is indexed)."""

    def __init__(self, sd: dict[str, torch.Tensor]):
        self.sd = sd
        self.read: list[str] = []

    def __getitem__(self, key: str) -> torch.Tensor:
        self.read.append(key)
        return self.sd[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.sd)

    def __len__(self) -> int:
        return len(self.sd)


class Rank(Dispatcher):
    """A dispatcher that only says which rank this is (the loaders read nothing else)."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def dispatch(self, *args, **kwargs):  # pragma: no cover - never called here
        raise AssertionError("not a forward")

    def combine(self, *args, **kwargs):  # pragma: no cover - never called here
        raise AssertionError("not a forward")


def _per_expert_checkpoint(E: int, H: int, I: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {"mlp.gate.weight": torch.randn(E, H, generator=g)}
    for e in range(E):
        for name, shape in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
            sd[f"mlp.experts.{e}.{name}.weight"] = torch.randn(*shape, generator=g)
    return sd


def test_local_shard_keeps_the_local_experts_and_hides_the_others() -> None:
    sd = Recording(_per_expert_checkpoint(8, 16, 8, seed=1))
    view = LocalShard(sd, "mlp.", 4, 6, 8)  # rank 2 of 4
    experts = sorted(k for k in view if ".experts." in k)
    # the checkpoint's own numbers, which the loader's messages name
    assert experts == [f"mlp.experts.{e}.{n}.weight" for e in (4, 5) for n in ("w1", "w2", "w3")]
    assert sd.read == []  # building the view indexes nothing
    assert view["mlp.experts.5.w3.weight"] is sd.sd["mlp.experts.5.w3.weight"]
    assert torch.equal(view["mlp.gate.weight"], sd.sd["mlp.gate.weight"][4:6])
    with pytest.raises(KeyError):
        view["mlp.experts.2.w1.weight"]  # another rank's expert is not there
    assert all(k.startswith(("mlp.experts.4.", "mlp.experts.5.", "mlp.gate.")) for k in sd.read)


def test_local_shard_slices_fused_experts_and_keeps_a_per_tensor_scale_whole() -> None:
    g = torch.Generator().manual_seed(2)
    sd = {"experts.gate_up_proj": torch.randn(6, 8, 4, generator=g),
          "experts.down_proj": torch.randn(6, 4, 4, generator=g),
          "experts.gate_up_proj_scale_inv": torch.randn(6, 1, 1, generator=g),
          "experts.down_proj_scale_inv": torch.tensor(0.5),
          "gate.e_score_correction_bias": torch.randn(6, generator=g),
          "shared_experts.up_proj.weight": torch.randn(4, 4, generator=g)}
    view = LocalShard(sd, "", 2, 4, 6)
    assert torch.equal(view["experts.gate_up_proj"], sd["experts.gate_up_proj"][2:4])
    assert torch.equal(view["experts.down_proj"], sd["experts.down_proj"][2:4])
    assert torch.equal(view["experts.gate_up_proj_scale_inv"],
                       sd["experts.gate_up_proj_scale_inv"][2:4])
    assert view["experts.down_proj_scale_inv"] is sd["experts.down_proj_scale_inv"]
    assert view.full_bias is sd["gate.e_score_correction_bias"]  # the router's, whole
    assert torch.equal(view["gate.e_score_correction_bias"], sd["gate.e_score_correction_bias"][2:4])
    assert view["shared_experts.up_proj.weight"] is sd["shared_experts.up_proj.weight"]


def test_renamed_reads_own_names_as_checkpoint_names_lazily() -> None:
    sd = Recording({"p.router_weight": torch.ones(2), "p.other": torch.zeros(1), "q": torch.ones(3)})
    view = Renamed(sd, "p.", {"router_weight": "gate.weight"})
    assert sorted(view) == ["p.gate.weight", "p.other", "q"] and sd.read == []
    assert view["p.gate.weight"] is sd.sd["p.router_weight"]
    assert len(view) == 3


def test_shard_of_state_dict_reads_only_this_ranks_experts() -> None:
    full = _per_expert_checkpoint(8, 16, 8, seed=3)
    sd = Recording(full)
    local, router, E = shard_of_state_dict(sd, 2, "mlp.", True, Rank(1, 4), {})
    assert E == 8 and local.num_experts == 2
    assert router["top_k"] == 2 and router["router_weight"] is full["mlp.gate.weight"]
    assert router["e_score_correction_bias"] is None
    read_experts = {k.split(".")[2] for k in sd.read if ".experts." in k}
    assert read_experts == {"2", "3"}
    want = MoE.from_state_dict(full, 2, prefix="mlp.")
    torch.testing.assert_close(local.gate_up_proj, want.gate_up_proj[2:4], rtol=0, atol=0)
    torch.testing.assert_close(local.down_proj, want.down_proj[2:4], rtol=0, atol=0)


def test_shard_of_state_dict_names_what_is_missing_or_wrong() -> None:
    with pytest.raises(TypeError, match="state_dict must be a mapping"):
        shard_of_state_dict([1, 2], 2, "", True, Rank(0, 2), {})
    with pytest.raises(KeyError, match="no router weight 'x.gate.weight'"):
        shard_of_state_dict({"x.other": torch.ones(1)}, 2, "x.", True, Rank(0, 2), {})
    sd = _per_expert_checkpoint(4, 16, 8, seed=4)
    sd["mlp.gate.e_score_correction_bias"] = torch.zeros(4)
    with pytest.raises(ValueError, match="correction_bias=False"):
        shard_of_state_dict(sd, 2, "mlp.", True, Rank(0, 2), {"correction_bias": False})


def test_local_moe_takes_this_ranks_experts_and_the_shared_expert_whole() -> None:
    torch.manual_seed(5)
    moe = MoE(16, 8, 8, 2, shared_intermediate_size=12, dtype=torch.float32)
    for copy in (True, False):
        local = local_moe(moe, Rank(3, 4), copy)
        assert local.num_experts == 2
        assert torch.equal(local.gate_up_proj, moe.gate_up_proj[6:8])
        shares = local.gate_up_proj.untyped_storage().data_ptr() == \
            moe.gate_up_proj.untyped_storage().data_ptr()
        assert shares is not copy
        assert torch.equal(local.shared_experts.up_proj.weight, moe.shared_experts.up_proj.weight)
    with pytest.raises(TypeError, match="moe must be a moe_gemm MoE"):
        local_moe(torch.nn.Linear(2, 2), Rank(0, 2), True)


def test_router_of_and_the_dispatcher_default() -> None:
    moe = MoE(16, 8, 8, 3, dtype=torch.float32)
    r = router_of(moe)
    assert r["top_k"] == 3 and r["router_weight"] is moe.router_weight
    assert set(r) >= {"scoring", "renormalize", "n_group", "topk_group",
                      "routed_scaling_factor", "router_fp32", "e_score_correction_bias"}
    mine = Rank(0, 1)
    assert dispatcher_or_default(mine, None) is mine
    with pytest.raises(TypeError, match="dispatcher must be a Dispatcher"):
        dispatcher_or_default(object(), None)


def test_shard_of_state_dict_refuses_experts_that_disagree_with_the_router() -> None:
    # MoE.from_state_dict refuses these checkpoints; each rank's share of them passed
    # (experts past the router's E hidden on every rank, fused tensors of another count of
    # experts sliced) or was refused with the local layer's sizes.
    sd = _per_expert_checkpoint(6, 16, 8, seed=6)
    for n, shape in (("w1", (8, 16)), ("w3", (8, 16)), ("w2", (16, 8))):
        sd[f"mlp.experts.6.{n}.weight"] = torch.randn(*shape)
    for rank in range(3):
        with pytest.raises(ValueError, match=r"'mlp.experts.6.w1.weight' is expert 6 but the "
                                             r"router 'mlp.gate.weight' \(6, 16\) has 6"):
            shard_of_state_dict(sd, 2, "mlp.", True, Rank(rank, 3), {})
    sd = _per_expert_checkpoint(6, 16, 8, seed=7)
    for n in ("w1", "w2", "w3"):
        del sd[f"mlp.experts.3.{n}.weight"]
    shard_of_state_dict(sd, 2, "mlp.", True, Rank(0, 3), {})  # experts 0 and 1 are whole
    with pytest.raises(ValueError, match=r"experts \[3\] of the router's 6 have no weights under "
                                         r"'mlp.experts.' \(this rank holds experts \[2, 4\)\)"):
        shard_of_state_dict(sd, 2, "mlp.", True, Rank(1, 3), {})
    full = MoE.from_state_dict(_per_expert_checkpoint(6, 16, 8, seed=8), 2, prefix="mlp.")
    for name, t in (("experts.gate_up_proj", full.gate_up_proj.data[:5]),
                    ("experts.down_proj", torch.cat([full.down_proj.data] * 2))):
        fused = {"gate.weight": full.router_weight.data,
                 "experts.gate_up_proj": full.gate_up_proj.data,
                 "experts.down_proj": full.down_proj.data, name: t}
        for rank in range(3):
            with pytest.raises(ValueError, match=f"'{name}' {tuple(t.shape)} must hold the "
                                                 "router's 6 experts".replace("(", r"\(")
                                                 .replace(")", r"\)")):
                shard_of_state_dict(fused, 2, "", True, Rank(rank, 3), {})
    fused["gate.e_score_correction_bias"] = torch.zeros(6, 1)
    with pytest.raises(ValueError, match=r"'gate.e_score_correction_bias' \(6, 1\) must be "
                                         r"\(6,\)"):
        shard_of_state_dict(fused, 2, "", True, Rank(1, 3), {})


def test_shard_of_state_dict_names_the_checkpoints_own_keys() -> None:
    # The local layer's loader saw the local experts renumbered from 0: its messages named
    # another expert's key (mlp.experts.1.w2.weight for expert 5's).
    sd = _per_expert_checkpoint(6, 16, 8, seed=9)
    sd["mlp.experts.5.w2.weight"] = torch.randn(16, 9)
    with pytest.raises(ValueError, match=r"mlp.experts.5.w2.weight is \(16, 9\), expected "
                                         r"\(16, 8\) to match mlp.experts.4.w1.weight"):
        shard_of_state_dict(sd, 2, "mlp.", True, Rank(2, 3), {})
    sd = _per_expert_checkpoint(6, 16, 8, seed=10)
    del sd["mlp.experts.4.w3.weight"]
    with pytest.raises(ValueError, match=r"expert 4 has no mlp.experts.4.w3.weight"):
        shard_of_state_dict(sd, 2, "mlp.", True, Rank(2, 3), {})
    sd = _per_expert_checkpoint(6, 16, 8, seed=11)
    sd["mlp.experts.3.w1.bias"] = torch.zeros(8)
    with pytest.raises(ValueError, match=r"does not use .*\['mlp.experts.3.w1.bias'\]"):
        shard_of_state_dict(sd, 2, "mlp.", True, Rank(1, 3), {})


def test_shard_of_state_dict_checks_the_router_and_prefix_types() -> None:
    sd = _per_expert_checkpoint(4, 16, 8, seed=12)
    with pytest.raises(TypeError, match="prefix must be a str"):
        shard_of_state_dict(sd, 2, 3, True, Rank(0, 2), {})  # type: ignore[arg-type]
    for router, exc, pattern in ((1.0, TypeError, r"state_dict\['mlp.gate.weight'\] must be a "
                                                  "torch.Tensor; got float"),
                                 (torch.randn(4), ValueError, "must be 2-D")):
        with pytest.raises(exc, match=pattern):
            shard_of_state_dict({**sd, "mlp.gate.weight": router}, 2, "mlp.", True,
                                Rank(0, 2), {})
