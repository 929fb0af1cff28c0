"""The dataset kinds `load_dataset` reads, one module each, registered on import.

See `tfdp.data.registry`. Adding a kind of data is one module here, with a
`registry.DatasetKind` subclass decorated `@registry.register`, and its
import below.
"""

from tfdp.data.kinds import folder
from tfdp.data.kinds import tfrecord
from tfdp.data.kinds import npz
from tfdp.data.kinds import offline
from tfdp.data.kinds import tfds

__all__ = ["folder", "npz", "offline", "tfds", "tfrecord"]
