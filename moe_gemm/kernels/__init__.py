"""CuTe DSL kernels, one subpackage per architecture. Importing this package does not import
the DSL: the kernel modules do, when the host side first compiles or loads a variant."""
