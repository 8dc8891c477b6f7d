"""`python -m slipstream ...` and `torchrun -m slipstream train ...`."""

import sys

from .cli import main

sys.exit(main())
