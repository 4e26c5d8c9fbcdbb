import sys

from entrypoint import init
from entrypoint.cli import main

sys.exit(init.run(main, sys.argv[1:]))
