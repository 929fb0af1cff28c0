"""tfdp's layers keep the Keras serialization names that saved `.keras` files refer to."""

import keras
import tensorflow as tf

from tfdp import layers


class SerializationNamesTest(tf.test.TestCase):
    def test_registered_under_tfdp(self):
        # A `.keras` file names each layer "tfdp>Class"; a rename or another
        # package name would make every saved model fail to load.
        for name in layers.__all__:
            cls = getattr(layers, name)
            self.assertEqual(keras.saving.get_registered_name(cls), f"tfdp>{name}")
            self.assertIs(keras.saving.get_registered_object(f"tfdp>{name}"), cls)


if __name__ == "__main__":
    tf.test.main()
