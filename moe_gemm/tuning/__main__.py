"""`python -m moe_gemm.tuning` = `moe-gemm tune` (through the CLI's entry point, which also
ends quietly when whoever reads stdout has gone)."""

import sys

from moe_gemm.cli import main

sys.exit(main(["tune", *sys.argv[1:]]))
