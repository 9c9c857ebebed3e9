import sys

from switchbench.cli import main

sys.exit(main())
