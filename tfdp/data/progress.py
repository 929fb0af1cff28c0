"""Progress bars for the one-time passes over a user's data (reads, conversions)."""

import sys


def progress(iterable=None, *, total=None, desc="", unit="img"):
    """A tqdm progress bar on stderr, or the plain iterable without tqdm.

    Args:
        iterable: iterable, optional. What to iterate. Defaults to `None`
            (update the bar by hand).
        total: int, optional. Expected number of items. Defaults to `None`.
        desc: str. Label of the bar. Defaults to `""`.
        unit: str. Unit of the items. Defaults to `"img"`.
    """
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional: no bar, same work.
        return _NoBar(iterable)
    return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr,
                mininterval=1.0, leave=False)


class _NoBar:
    def __init__(self, iterable):
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable)

    def update(self, n=1):
        del n

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
