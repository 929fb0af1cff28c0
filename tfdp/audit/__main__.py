"""`python -m tfdp.audit`: see `tfdp.audit.cli`."""

import sys

from tfdp.audit import cli

if __name__ == "__main__":
    sys.exit(cli.main())
