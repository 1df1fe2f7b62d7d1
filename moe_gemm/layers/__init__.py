"""nn.Modules and routing built on the ops: the MoE layer, its routers and token permutation,
and the checkpoint loaders."""
