"""`python -m moe_scale ...` (and `deepspeed --module moe_scale ...`) is the `moe-scale` command."""

import sys

from moe_scale.cli import main

sys.exit(main())
