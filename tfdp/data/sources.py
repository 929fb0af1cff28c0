"""The source classes and loaders, under the names other modules have always used.

Every source follows `tfdp.data.data_source.DataSource`; the classes live
in modules of their own:

* `ArraySource` (`tfdp.data.array_source`): arrays or encoded images in
  memory, and `decode_in_memory`;
* `RandomAccessSource`, `StreamingSource` (`tfdp.data.tfds_sources`): a
  prepared tfds split read by index or as a stream;
* `load_tfds`, `tfds_preparation_status` (`tfdp.data.tfds_loading`);
* `load_offline`, `OFFLINE_DATASETS` (`tfdp.data.offline`): the small
  datasets shipped in packages.

Sources with `random_access = True` expose `fetch(index)`, a
graph-compatible function from a scalar int64 index to `(image, label)`,
which Poisson sampling needs. Streaming sources only expose
`as_dataset(...)` and support shuffle sampling and evaluation. `fetch` may
return the image as a scalar `tf.string` of encoded bytes (JPEG or PNG);
the preprocessing functions in `tfdp.data.preprocessing` accept both.
"""

from tfdp.data.array_source import ArraySource
from tfdp.data.array_source import decode_in_memory
from tfdp.data.data_source import DataSource
from tfdp.data.data_source import DatasetInfo
from tfdp.data.data_source import indexed_dataset
from tfdp.data.offline import OFFLINE_DATASETS
from tfdp.data.offline import load_offline
from tfdp.data.tfds_loading import load_tfds
from tfdp.data.tfds_loading import tfds_preparation_status
from tfdp.data.tfds_sources import RandomAccessSource
from tfdp.data.tfds_sources import StreamingSource

__all__ = [
    "OFFLINE_DATASETS",
    "ArraySource",
    "DataSource",
    "DatasetInfo",
    "RandomAccessSource",
    "StreamingSource",
    "decode_in_memory",
    "indexed_dataset",
    "load_offline",
    "load_tfds",
    "tfds_preparation_status",
]
