import sys

from vramcal.cli import main

sys.exit(main())
