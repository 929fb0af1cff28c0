"""`python -m tfdp.privacy`: see `tfdp.privacy.cli`."""

import sys

from tfdp.privacy import cli

if __name__ == "__main__":
    sys.exit(cli.main())
