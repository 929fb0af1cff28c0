"""`npz:<file>`: NumPy arrays of images and labels (`tfdp.data.arrays`)."""

from tfdp.data import arrays
from tfdp.data import custom_data
from tfdp.data import registry


@registry.register
class NpzKind(custom_data.ImageDataKind):
    """`x_train`/`y_train` (or `images`/`labels`, `x`/`y`) and optionally `x_test`/`y_test`."""

    name = "npz"
    form = "'npz:<file>'"

    def read(self, location, options):
        del options  # Arrays need no reading options.
        train, test, notes = arrays.load_npz(location)
        return custom_data.Read(train, test, notes=notes)

    def load_test(self, location, options, train_kind, class_names):
        del options, train_kind, class_names  # Arrays carry their labels.
        train, test, notes = arrays.load_npz(location)
        return (test if test is not None else train), notes
