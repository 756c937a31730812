import sys

from scripts.toolchain.cli import main

# `python -m scripts` is the toolchain's command line, as documented before scripts/ had wings.
sys.exit(main())
