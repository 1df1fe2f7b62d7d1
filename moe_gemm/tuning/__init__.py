"""Tuning our kernel configs: `moe-gemm tune` (cli), the search (space, tuner), the device
side (runner, timing, compile_pool, ceilings), the tables it writes (table_io), the online
autotune (online) and the model zoo the tables cover (zoo).

Nothing here is imported by the ops on their hot path: the tables these tools write are read
by moe_gemm.ops.tuned.
"""
