import sys

from scripts.toolchain.cli import main

sys.exit(main())
