"""Any other name: a tfds dataset prepared in `data_dir` (`tfdp.data.tfds_loading`).

Its training split is checked for exact copies like every route's
(`tfdp.data.duplicates`): in memory or by index before training, a stream
in one sequential read before training. Copies are refused, with their
count: tfds data is taken as given, and which copy to keep is the data
owner's call.
"""

from tfdp.data import dataset_splits
from tfdp.data import duplicates
from tfdp.data import preprocessing
from tfdp.data import registry
from tfdp.data import tfds_loading

# tfds datasets whose published held-out split is called "validation".
VALIDATION_AS_TEST = ("imagenet2012", "places365_small")
# What to do about copies in a tfds dataset: it has no user ids.
DEDUPLICATE_TFDS = (
    "Write the training split without its copies (keep one of each group) as your own data, "
    "'npz:<file>' or 'tfrecord:<glob>' (or 'folder:<dir>', which drops copied files itself), "
    "and train on that. If each copy is a distinct record that happens to share its content, "
    "set DataConfig.duplicates = 'keep'.")


@registry.register
class TfdsKind(registry.DatasetKind):
    """A prepared tfds dataset: its `train` split, and its `test` (or `validation`) split to test."""

    name = "tfds"
    prefixed = False
    fallback = True
    options = ()
    takes_test_dataset = False

    def load(self, location, options):
        name = location
        train = tfds_loading.load_tfds(name, "train", data_dir=options.data_dir)
        # Before the test split is read: copies refuse the data.
        kept_copies = duplicates.check_source(
            train, where=f"tfds {name} (training data)", remedy=DEDUPLICATE_TFDS,
            policy=options.duplicates)
        test_split = "validation" if name in VALIDATION_AS_TEST else "test"
        test = tfds_loading.load_tfds(name, test_split, data_dir=options.data_dir)
        notes = f"tfds {name} ({type(train).__name__}); test: tfds split {test_split!r}"
        train_pre = eval_pre = None
        if name.startswith("cifar"):
            train_pre = preprocessing.cifar_train_preprocess()
            eval_pre = preprocessing.cifar_eval_preprocess()
        elif name in VALIDATION_AS_TEST:
            train_pre = preprocessing.imagenet_train_preprocess()
            eval_pre = preprocessing.imagenet_eval_preprocess()
        return dataset_splits.DatasetSplits(train, None, test, train.info, train_pre, eval_pre,
                                            notes, duplicates_kept=kept_copies)
