"""`python -m build ...` from the repo root runs this package (see README: the repo is a workspace)."""
import sys

from build.cli.main import main

sys.exit(main())
