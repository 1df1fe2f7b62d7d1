"""CuTe DSL kernels for sm_90a. Importing this package does not import the DSL: the kernel
modules (grouped_gemm_sm90, host_sm90) do, lazily, on first use."""
