import sys

from entrypoint import pid1 as init
from entrypoint.cli import main

sys.exit(init.run(main, sys.argv[1:]))
