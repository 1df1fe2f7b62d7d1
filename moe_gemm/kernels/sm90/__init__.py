"""sm_90a (H100, H200): the persistent warp-specialized grouped GEMM.

    grouped_gemm    GroupedGemmSm90, the kernel class (imports the CuTe DSL)
    tile_scheduler  device-side helpers of the scheduler warp (prefix sum, rasterization)
    compile         CompileKey (static choices only) and the fake-tensor compile
    constants       numbers the kernel and the host agree on (no DSL import)
"""
