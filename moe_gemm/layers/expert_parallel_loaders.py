"""ExpertParallelMoE's constructors: this rank's shard of a whole MoE, of a transformers block
or of a checkpoint (the ExpertParallelLoaders mixin, which the layer inherits).

Each builds the local layer with MoE's own loaders (layers/expert_shards.py cuts the shard) and
then the layer itself. A rank whose arguments are refused while doing so joins the replica
check flagged (replica_check.refusing), so that the other ranks raise too instead of waiting
for it in the check's all-gather.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from moe_gemm.config import GemmConfig
from moe_gemm.layers.dispatch import Dispatcher
from moe_gemm.layers.expert_shards import (
    dispatcher_or_default,
    local_moe,
    router_of,
    shard_of_state_dict,
)
from moe_gemm.layers.moe import MoE
from moe_gemm.layers.replica_check import refusing
from moe_gemm.layers.routing import check_flag

if TYPE_CHECKING:
    from moe_gemm.layers.expert_parallel import ExpertParallelMoE

__all__ = ["ExpertParallelLoaders"]


class ExpertParallelLoaders:
    """ExpertParallelMoE's from_* constructors (the layer inherits them): each builds a `cls`
    layer over this rank's experts, every rank of the group calling it alike."""

    @classmethod
    def from_moe(
        cls,
        moe: MoE,
        *,
        group: dist.ProcessGroup | None = None,
        dispatcher: Dispatcher | None = None,
        copy: bool = True,
        check_replicated: bool = True,
    ) -> ExpertParallelMoE:
        """This rank's shard of a whole MoE layer: its routing options (the router jitter
        too), training / eval mode, activation, shared experts, `config` and `fused` come
        along.

        Args:
            moe: the full layer (every rank passes an equal one).
            group, dispatcher, check_replicated: see ExpertParallelMoE.
            copy: copy the local experts (so the full tensors can be freed); False keeps
                views into `moe`'s storage.
        """
        dispatcher = dispatcher_or_default(dispatcher, group)
        with refusing(dispatcher):
            local = local_moe(moe, dispatcher, check_flag("copy", copy))
        layer = cls(local, router_of(moe), moe.num_experts, dispatcher=dispatcher,
                    check_replicated=check_replicated)
        return layer.train(moe.training)  # (moe's mode: whether its router jitter applies)

    @classmethod
    def from_hf(
        cls,
        block: nn.Module,
        *,
        group: dist.ProcessGroup | None = None,
        dispatcher: Dispatcher | None = None,
        config: GemmConfig | None = None,
        copy: bool = True,
        check_replicated: bool = True,
    ) -> ExpertParallelMoE:
        """This rank's shard of a transformers MoE block (the blocks `MoE.from_hf` takes)."""
        dispatcher = dispatcher_or_default(dispatcher, group)
        with refusing(dispatcher):
            moe = MoE.from_hf(block, config=config)
        return cls.from_moe(moe, dispatcher=dispatcher, copy=copy,
                            check_replicated=check_replicated)

    @classmethod
    def from_state_dict(
        cls,
        state_dict: Mapping[str, torch.Tensor],
        top_k: int,
        *,
        prefix: str = "",
        strict: bool = True,
        group: dist.ProcessGroup | None = None,
        dispatcher: Dispatcher | None = None,
        check_replicated: bool = True,
        **options: Any,
    ) -> ExpertParallelMoE:
        """This rank's shard of one MoE block of a checkpoint; reads only the local experts.

        Accepts every layout `MoE.from_state_dict` does. Per-expert keys
        ("experts.{e}.w1.weight", "experts.{e}.gate_proj.weight", ...) of other ranks' experts
        are never read; fused ones ("experts.gate_up_proj" [E, 2I, H], vLLM's "w13_weight")
        are sliced to the local experts (read lazily by a mapping whose tensors are lazy).
        This layer's own `state_dict()` is read too: each rank passes its own (it holds that
        rank's experts only), in a group of the size that saved it (another size: ValueError).

        Args:
            state_dict: name -> tensor (any Mapping; only the needed keys are indexed).
            top_k, prefix, strict, **options: as `MoE.from_state_dict` (routing options).
            group, dispatcher, check_replicated: see ExpertParallelMoE.
        """
        dispatcher = dispatcher_or_default(dispatcher, group)
        # A rank whose checkpoint or options are refused joins the replica check flagged.
        with refusing(dispatcher):
            local, router, E = shard_of_state_dict(state_dict, top_k, prefix, strict,
                                                   dispatcher, options)
        return cls(local, router, E, dispatcher=dispatcher, check_replicated=check_replicated)
