"""tf.distribute for DP-SGD: the strategy, sharded input, chief, precision.

- `get_strategy(name)`: one flag picks the strategy.
- `distribute_train_pipeline`: builds each worker's share of the training
  pipeline and hands every replica its part of each physical batch, so that
  all replicas see the `last` flag of a logical step at the same time.
- `is_chief`: only the chief writes checkpoints, the privacy ledger and the
  run's outputs; the other workers take part in each save (as the TF
  multi-worker docs require) into a scratch directory
  (`tfdp.training.workers`).
- `agreed_key`: the chief's secret key on every worker, so that all draw
  one sample and one noise per step (the trainer's and Keras `fit`'s).
- `precision_policy`: Keras mixed_bfloat16 (bf16 compute, float32
  variables) while the model is built.

How the gradient is reduced and where the noise goes: see
`tfdp/dp/private_step.py` and docs/DISTRIBUTED.md.
"""

import contextlib
import json
import os

import numpy as np
import tensorflow as tf

from tfdp import secret_key as secret_key_lib

STRATEGIES = ("one_device", "mirrored", "multi_worker_mirrored", "tpu")


def get_strategy(name="one_device", tpu_address=None):
    """Returns a tf.distribute strategy by name.

    Args:
        name: str. One of "one_device", "mirrored", "multi_worker_mirrored",
            "tpu". Defaults to "one_device".
        tpu_address: str. TPU name or address for "tpu". Defaults to None
            (the environment variable TPU_NAME, else the local TPU VM).
    """
    if name == "one_device":
        gpus = tf.config.list_logical_devices("GPU")
        return tf.distribute.OneDeviceStrategy(gpus[0].name if gpus else "/cpu:0")
    if name == "mirrored":
        return tf.distribute.MirroredStrategy()
    if name == "multi_worker_mirrored":
        return tf.distribute.MultiWorkerMirroredStrategy()
    if name == "tpu":
        # "" is the TPU VM's own TPU; TPU_NAME (or tpu_address) another one.
        tpu = tpu_address or os.environ.get("TPU_NAME", "")
        try:
            resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)
        except ValueError as e:
            raise ValueError(
                f"No TPU found ({e}). Run on a Cloud TPU VM, or set TPU_NAME to the TPU's "
                f"name or address. Received: strategy='tpu', tpu={tpu!r}"
            ) from None
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
        return tf.distribute.TPUStrategy(resolver)
    raise ValueError(f"Unknown strategy; expected one of {STRATEGIES}. Received: strategy={name!r}")


# ---------------------------------------------------------------------------
# Workers.
# ---------------------------------------------------------------------------


def task(strategy):
    """(task_type, task_id) of this process; (None, None) on a single host."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return None, None
    return getattr(resolver, "task_type", None), getattr(resolver, "task_id", None)


def is_chief(strategy):
    """Whether this process writes checkpoints, the ledger and exports.

    The chief is task "chief", or "worker" 0 when the cluster has no
    "chief" task (as MultiWorkerMirroredStrategy allows); a single-host
    strategy (one_device, mirrored, tpu from its VM) is its own chief.
    """
    task_type, task_id = task(strategy)
    return is_chief_task(task_type, task_id, lambda: strategy.cluster_resolver.cluster_spec())


def is_chief_task(task_type, task_id, cluster_spec):
    """`is_chief`'s rule for a task; `cluster_spec()` gives the cluster when needed."""
    if task_type is None:
        return True
    if task_type == "chief":
        return True
    if task_type == "worker":
        try:
            cluster = cluster_spec().as_dict()
        except Exception:  # pylint: disable=broad-except
            cluster = {}
        return "chief" not in cluster and int(task_id or 0) == 0
    return False


def is_chief_process():
    """Whether this process is the chief of its job, from `TF_CONFIG` alone (no strategy).

    For decisions taken before (or without) a strategy, such as removing a
    workdir after a configuration error: only the chief may.
    """
    config = json.loads(os.environ.get("TF_CONFIG") or "{}")
    task_ = config.get("task") or {}
    cluster = config.get("cluster") or {}
    return is_chief_task(task_.get("type"), task_.get("index"),
                         lambda: tf.train.ClusterSpec(cluster))


def num_workers(strategy):
    """The number of worker processes (input pipelines)."""
    return int(getattr(strategy.extended, "_num_workers", 1) or 1)


def agreed_key(strategy, key):
    """The chief's key, on every worker of `strategy`.

    Every process resolves a key of its own (a fresh secret one, or an
    insecure seed's). The workers of one job must use one: with their own
    keys they would take their shares of different Poisson samples (an
    example in one step twice, on two workers) and each add `noise / R` of
    its own draw (the noise std σ·C/√W instead of σ·C). A variable created in
    a multi-worker strategy's scope starts from the chief's value (a
    broadcast), so reading it back gives every worker the chief's key. On
    one worker (every single-process strategy) the key is returned as is.

    Every worker must call this at the same point of its program: the
    broadcast is a collective, ordered with the other variables' creation.

    Args:
        strategy: a `tf.distribute` strategy.
        key: `tfdp.secret_key.SecretKey`. This process's key.

    Returns:
        A `SecretKey`: the chief's words, `key`'s insecure seed.

    Raises:
        ValueError: where this worker's key is an insecure seed's and the
            chief's is another key, or the chief's is an insecure seed's and
            this one's secret: the workers were not started alike, and the
            key's secrecy would be reported wrongly.
    """
    if num_workers(strategy) == 1:
        return key
    insecure = 0 if key.is_secret else 1
    with strategy.scope():
        agreed = tf.Variable(np.append(key.words, insecure), dtype=tf.int64, trainable=False,
                             name="tfdp_agreed_key")
    values = agreed.numpy()
    words, chief_insecure = values[:2], int(values[2])
    if chief_insecure != insecure or (insecure and not np.array_equal(words, key.words)):
        task_type, task_id = task(strategy)
        mine = "an insecure seed's key" if insecure else "a secret key"
        chief = ("a secret key" if not chief_insecure
                 else "another insecure seed's key" if insecure else "an insecure seed's key")
        raise ValueError(
            "The workers of a multi-worker job must all pass the same "
            "insecure_reproducible_seed, or all none (a fresh secret key, the chief's). "
            f"Received: on {task_type}{task_id}, {mine}, on the chief {chief}"
        )
    return secret_key_lib.SecretKey(words, insecure_seed=key.insecure_seed)


# ---------------------------------------------------------------------------
# State.
# ---------------------------------------------------------------------------


def replica_local_variable(initial_value, name, aggregation="sum"):
    """A variable each replica updates on its own, without communication.

    Under a multi-replica strategy (created inside `strategy.scope()`) every
    replica holds its own copy (`ON_READ`); on one device it is a plain
    variable.

    Args:
        initial_value: the initial value (tensor or Python value).
        name: str. The variable's name.
        aggregation: str. What a cross-replica read returns: `"sum"`, the
            sum of the replicas' copies (partial sums, e.g. clipped gradient
            sums); or `"first"`, the first replica's copy (state every
            replica updates alike, e.g. a step counter). A cross-replica
            assignment sets every copy. Defaults to `"sum"`.

    Returns:
        A `tf.Variable`, not trainable.
    """
    aggregations = {"sum": tf.VariableAggregation.SUM,
                    "first": tf.VariableAggregation.ONLY_FIRST_REPLICA}
    if aggregation not in aggregations:
        raise ValueError(
            f"aggregation must be one of {sorted(aggregations)}. Received: "
            f"aggregation={aggregation!r}"
        )
    return tf.Variable(
        initial_value,
        trainable=False,
        name=name,
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=aggregations[aggregation],
    )


def is_replica_local(variable):
    """Whether `variable` has one copy per replica of the strategy in scope.

    False for a plain variable used under a multi-replica strategy (e.g.
    created outside `strategy.scope()`), which the replicas would all
    update.
    """
    if tf.distribute.get_strategy().num_replicas_in_sync == 1:
        return True
    return isinstance(variable, tf.distribute.DistributedValues)


# ---------------------------------------------------------------------------
# Input.
# ---------------------------------------------------------------------------


def _split_for_replicas(num_local):
    """One host batch of P_host -> num_local consecutive per-replica batches.

    distribute_datasets_from_function deals consecutive elements to the
    worker's replicas in turn; splitting each host batch into exactly
    `num_local` elements keeps every round inside one physical batch, so
    the `last` flag is the same on every replica.
    """

    def split(images, labels, weights, last):
        def parts(t):
            shape = tf.concat([[num_local, tf.shape(t)[0] // num_local], tf.shape(t)[1:]], 0)
            out = tf.reshape(t, shape)
            if t.shape[0] is not None:
                out.set_shape([num_local, t.shape[0] // num_local] + t.shape.as_list()[1:])
            return out

        lasts = tf.fill([num_local], last)
        return tf.data.Dataset.from_tensor_slices((parts(images), parts(labels), parts(weights), lasts))

    return split


def distribute_train_pipeline(strategy, make_pipeline, physical_batch_size):
    """The training pipeline, sharded per worker and split per replica.

    Args:
        strategy: a tf.distribute strategy.
        make_pipeline: callable `(physical_batch_size=, input_context=) ->
            tf.data.Dataset` of `(images, labels, weights, last)` physical
            batches (e.g. `functools.partial(tfdp.data.make_train_pipeline,
            source, ...)`). It is called once per worker with that worker's
            share `physical_batch_size / num_workers` and its InputContext.
        physical_batch_size: int. The GLOBAL physical batch P (all replicas
            together). Must be a multiple of the number of replicas; each
            replica gets P / R examples per physical batch.

    Returns:
        The plain dataset on one replica, else a distributed dataset whose
        elements are tuples of per-replica values.
    """
    replicas = int(strategy.num_replicas_in_sync)
    if replicas == 1:
        return make_pipeline(physical_batch_size=physical_batch_size, input_context=None)
    if physical_batch_size % replicas:
        raise ValueError(
            "physical_batch_size (global, over all replicas) must be a multiple of the "
            f"number of replicas. Received: physical_batch_size={physical_batch_size}, "
            f"num_replicas={replicas}"
        )

    def dataset_fn(input_context):
        hosts = input_context.num_input_pipelines
        local = input_context.num_replicas_in_sync // hosts
        ds = make_pipeline(
            physical_batch_size=physical_batch_size // hosts,
            input_context=input_context if hosts > 1 else None,
        )
        if local > 1:
            ds = ds.flat_map(_split_for_replicas(local))
        return ds.prefetch(tf.data.AUTOTUNE)

    return strategy.distribute_datasets_from_function(dataset_fn)


def local_value(strategy, value):
    """This worker's first replica's value (e.g. the shared `last` flag)."""
    return strategy.experimental_local_results(value)[0]


def is_last(strategy, last):
    """The `last` flag of a (possibly distributed) physical batch, as a bool."""
    return bool(local_value(strategy, last))


def num_examples(strategy, images):
    """Examples (padding included) in a global physical batch."""
    local = sum(int(t.shape[0]) for t in strategy.experimental_local_results(images))
    return local * num_workers(strategy)


# ---------------------------------------------------------------------------
# Precision.
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def precision_policy(mixed_precision):
    """Builds models under Keras "mixed_bfloat16" when `mixed_precision`.

    bfloat16 compute, float32 variables; `tfdp.dp.PrivateTrainStep` keeps
    losses, per-example norms, clipped sums and noise in float32. bfloat16
    needs no loss scaling (float32's exponent range). The previous global
    policy is restored on exit; built layers keep theirs.
    """
    if not mixed_precision:
        yield
        return
    import keras

    previous = keras.mixed_precision.dtype_policy()
    keras.mixed_precision.set_dtype_policy("mixed_bfloat16")
    try:
        yield
    finally:
        keras.mixed_precision.set_dtype_policy(previous)
