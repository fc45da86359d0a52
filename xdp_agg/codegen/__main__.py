"""`python -m xdp_agg.codegen [--check]`: write the generated C and P4 files (or report drift)."""

import sys

from .generate import main

sys.exit(main())
