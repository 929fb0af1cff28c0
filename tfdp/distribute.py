"""`get_strategy`: one flag picks the tf.distribute strategy."""

import tensorflow as tf

STRATEGIES = ("one_device", "mirrored", "multi_worker_mirrored", "tpu")


def get_strategy(name="one_device", tpu_address=None):
    """Returns a tf.distribute strategy by name.

    Args:
        name: str. One of "one_device", "mirrored", "multi_worker_mirrored",
            "tpu". Defaults to "one_device".
        tpu_address: str. TPU name or address for "tpu". Defaults to None
            (the local TPU VM).
    """
    if name == "one_device":
        gpus = tf.config.list_logical_devices("GPU")
        return tf.distribute.OneDeviceStrategy(gpus[0].name if gpus else "/cpu:0")
    if name == "mirrored":
        return tf.distribute.MirroredStrategy()
    if name == "multi_worker_mirrored":
        return tf.distribute.MultiWorkerMirroredStrategy()
    if name == "tpu":
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu_address or "")
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
        return tf.distribute.TPUStrategy(resolver)
    raise ValueError(f"Unknown strategy; expected one of {STRATEGIES}. Received: strategy={name!r}")
