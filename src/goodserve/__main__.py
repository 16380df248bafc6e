"""`python -m goodserve` (what torchrun's `-m goodserve worker` runs): the `goodserve` command."""

import sys

from goodserve.cli import main

sys.exit(main())
