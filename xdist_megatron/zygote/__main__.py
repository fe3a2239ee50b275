"""`python -m xdist_megatron.zygote FD OPTIONS_JSON`: the zygote's entry point (server.py)."""

import sys

from .server import main

sys.exit(main(sys.argv))
