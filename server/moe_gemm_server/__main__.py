"""`python -m moe_gemm_server` = `moe-gemm-server`."""

from .cli import main

main()
