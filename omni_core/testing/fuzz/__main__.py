"""`python -m omni_core.testing.fuzz`: see `omni_core.testing.fuzz.cli`."""

import sys

from omni_core.testing.fuzz.cli import main

sys.exit(main())
