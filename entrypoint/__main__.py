import sys

from entrypoint.cli import main

sys.exit(main())
