import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from absl import flags  # noqa: E402

# tf.test / absltest helpers (create_tempdir, ...) read absl flags, which
# pytest never parses.
if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
