"""`python -m omni_core.fuzz`: see `omni_core.fuzz.cli`."""

import sys

from omni_core.fuzz.cli import main

sys.exit(main())
