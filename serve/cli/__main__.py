"""`python -m serve.cli ...` runs the `jaxhybrid` command."""

import sys

from serve.cli import main

sys.exit(main())
