"""`python -m moe_gemm_client ...` runs the command line (same as `moe-gemm-client`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
