"""`python -m tfdp.bench`: see `tfdp.bench.cli`."""

import sys

from tfdp.bench import cli

if __name__ == "__main__":
    sys.exit(cli.main())
