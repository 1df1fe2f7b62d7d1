"""`python -m moe_gemm` = the `moe-gemm` command (where the console script is not on PATH,
e.g. a --user or --target install)."""

import sys

from moe_gemm.cli import main

sys.exit(main())
