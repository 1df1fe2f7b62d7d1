"""`python -m moe_gemm.tuning` = `moe-gemm tune`."""

import sys

from moe_gemm.tuning.cli import main

sys.exit(main())
