"""`tfrecord:<glob>`: `tf.train.Example`s of an encoded image and a label (`tfdp.data.tfrecord`)."""

from tfdp.data import custom_data
from tfdp.data import registry
from tfdp.data import tfrecord


def _read_options(options):
    # Test files need no user feature: they are not trained on.
    return dict(image_key=options.image_key, label_key=options.label_key,
                cache_dir=options.cache_dir, in_memory_max_bytes=options.in_memory_max_bytes)


@registry.register
class TFRecordKind(custom_data.ImageDataKind):
    """TFRecord files, read into memory or converted once to ArrayRecord for random access.

    The test split is the files beside the training files with `train` in
    their name replaced by `test` (or `validation`), unless `test_dataset`
    is set.
    """

    name = "tfrecord"
    form = "'tfrecord:<glob>'"

    def read(self, location, options):
        train, notes = tfrecord.load_tfrecord(location, user_key=options.user_key,
                                              **_read_options(options))
        held_out = None
        if options.test_dataset is None:
            held_out = tfrecord.held_out_pattern(location)
        if held_out is None:
            return custom_data.Read(train, notes=notes)
        split, pattern = held_out
        test, test_notes = tfrecord.load_tfrecord(pattern, **_read_options(options))
        return custom_data.Read(train, test, notes=f"{notes}; test: {split} files {pattern}, "
                                f"{test_notes}", origins={"test": pattern})

    def load_test(self, location, options, train_kind, class_names):
        del train_kind, class_names  # Records carry their labels.
        return tfrecord.load_tfrecord(location, **_read_options(options))
