import sys

from tfdp.tuning.cli import main

sys.exit(main())
