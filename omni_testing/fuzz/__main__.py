"""`python -m omni_testing.fuzz`: see `omni_testing.fuzz.cli`."""

import sys

from omni_testing.fuzz.cli import main

sys.exit(main())
