"""`folder:<dir>`: one subfolder per class (`tfdp.data.folder`); copied files are dropped."""

import os

from tfdp.data import custom_data
from tfdp.data import folder
from tfdp.data import registry


@registry.register
class FolderKind(custom_data.ImageDataKind):
    """Image files in class folders: `train/<class>/`, optionally `test/` and `validation/`.

    Every file is an example of its own, so a copied file is dropped (the
    first of each group kept, in sorted path order) rather than refused.
    """

    name = "folder"
    form = "'folder:<dir>'"
    drops_duplicates = True

    def read(self, location, options):
        found = folder.load_folder(location, in_memory_max_bytes=options.in_memory_max_bytes)
        return custom_data.Read(found["train"], found["test"], found["validation"],
                                found["notes"], class_names=found["class_names"])

    def load_test(self, location, options, train_kind, class_names):
        if not os.path.isdir(location):
            raise ValueError(
                f"Image folder not found. Received: test_dataset={options.test_dataset!r}")
        if class_names is None:
            raise ValueError(
                "A test folder names its classes by subfolder, which needs folder: training "
                f"data. Received: dataset prefix {train_kind.name!r}, "
                f"test_dataset={options.test_dataset!r}"
            )
        _, test, how = folder.class_folder_source(
            location, class_names, options.in_memory_max_bytes)
        return test, f"{location} {how}"
