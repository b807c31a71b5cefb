import sys

from vramcal.calibrate.cli import main

sys.exit(main())
