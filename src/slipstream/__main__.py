"""`python -m slipstream ...` and `torchrun -m slipstream train ...`."""

import atexit
import os
import sys

from .cli import main

rc = main()
if "TORCHELASTIC_RUN_ID" in os.environ:
    # A torchrun rank whose work is done (outputs written, process group destroyed) skips the
    # interpreter's C-level teardown: there, gloo's objects aborted a finished rank ("terminate
    # called without an active exception", no Python frame) in 2 of 76 two-rank runs on host B,
    # and torchrun then failed the whole run. Python's own exit handlers still run.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(rc or 0))
sys.exit(rc)
