"""`DPModel` / `make_private`: a Keras model whose `train_step` is DP-SGD.

`DPModel` wraps any built or unbuilt Keras model (Functional, Sequential or
subclassed) and overrides `fit` (which draws the logical steps: Poisson or
shuffled batches of arrays, Poisson-sampled users, or a stream's batches,
never a step across two epochs; see `DPModel.fit`), `make_train_function`
(for steps of random size, one Keras step is one logical step) and
`train_step`: `evaluate`, `predict`, `save` and `load_model` work as for any
Keras model (the wrapper and `DPOptimizer` are registered serialisables;
`dp_model.model` is the plain inner model).

The per-example loss comes from the compiled loss (see
`per_example_loss_fn`); its reduction is ignored: DP-SGD sums the clipped
per-example gradients and divides the noisy sum by the expected logical batch
size. A `sample_weight` scales each example's loss *before* clipping (so it
is still bounded by C); weight 0 is padding (no contribution, no norm). The
divisor does not depend on the weights.

`private_update` is the DP half of the train step (clip, accumulate, noise,
update); `tfdp.compat.tensorflow_privacy` also runs it for plain Keras models
compiled with a TF-Privacy optimizer, with TF-Privacy's microbatches.
"""

import threading
import weakref

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.tensorflow.trainer import reduce_per_replica
from keras.src.losses import loss as loss_module
from keras.src.trainers.data_adapters import array_slicing

from tfdp import distribute
from tfdp.data import duplicates
from tfdp.dp import adapted_state
from tfdp.dp import clipping
from tfdp.dp import layer_taps
from tfdp.dp import model_probe
from tfdp.dp import sensitivity
from tfdp.dp import user_groups
from tfdp.keras import array_batches
from tfdp.keras import privacy_account
from tfdp.keras.dp_optimizer import DPOptimizer


def per_example_loss_fn(loss, loss_weights=None):
    """Turns a compiled Keras loss into `(y_true, y_pred) -> [B]` losses.

    - A string is resolved with `keras.losses.get` (as `compile` does).
    - A `keras.losses.Loss` object is evaluated through its `call` method,
      which returns unreduced values whatever its `reduction` (for the
      built-in losses, `LossFunctionWrapper.call` applies the wrapped
      function with the object's own arguments, e.g. `from_logits`).
    - A plain function must return one value per example.

    Values with extra axes (e.g. per time step) are averaged over them.

    Args:
        loss: the `loss` given to `compile`. A single loss (or a list/dict
            with exactly one).
        loss_weights: optional scalar (or one-element list/dict) weight.

    Returns:
        A function `(y_true, y_pred) -> float32 [B]`.
    """
    loss = _single(loss, "loss")
    weight = _single(loss_weights, "loss_weights")
    weight = 1.0 if weight is None else float(weight)
    if loss is None:
        raise ValueError(
            "A private model must be compiled with a `loss`. Received: loss=None"
        )
    if isinstance(loss, (str, dict)):
        loss = keras.losses.get(loss)
    if isinstance(loss, keras.losses.Loss):
        loss_object = loss

        def fn(y_true, y_pred):
            dtype = loss_object.dtype
            return loss_object.call(
                keras.ops.convert_to_tensor(y_true, dtype=dtype),
                keras.ops.convert_to_tensor(y_pred, dtype=dtype),
            )

    elif callable(loss):
        fn = loss
    else:
        raise ValueError(f"Unsupported loss for a private model. Received: loss={loss!r}")

    def per_example(y_true, y_pred):
        values = tf.cast(fn(y_true, y_pred), tf.float32)
        if values.shape.rank is not None and values.shape.rank > 1:
            values = tf.reduce_mean(values, axis=list(range(1, values.shape.rank)))
        values = tf.reshape(values, [-1])
        return values * weight if weight != 1.0 else values

    # Errors about the loss (e.g. the training probe's) name the user's loss.
    per_example.__name__ = (getattr(loss, "name", None) or getattr(loss, "__name__", None)
                            or type(loss).__name__)
    return per_example


def _single(value, what):
    if isinstance(value, dict) and not (what == "loss" and "class_name" in value):
        values = list(value.values())
    elif isinstance(value, (list, tuple)):
        values = list(value)
    else:
        return value
    if len(values) != 1:
        raise NotImplementedError(
            "Private models support a single output and a single loss. "
            f"Received: {what}={value!r}"
        )
    return values[0]


def _regularized_layers(model):
    found = []
    for layer in model._flatten_layers(include_self=True, recursive=True):
        for attr in ("kernel_regularizer", "bias_regularizer", "activity_regularizer",
                     "embeddings_regularizer", "gamma_regularizer", "beta_regularizer"):
            if getattr(layer, attr, None) is not None:
                found.append(f"{layer.name}.{attr}")
    return found


def private_update(model, optimizer, per_example_loss, x, y, sample_weight=None, *,
                   batch_size=None, last=None, physical_batch_size=None, release=True):
    """The DP-SGD half of a `fit` step: clip, accumulate, noise, update.

    Clips each privacy unit's gradient to the optimizer's `l2_norm_clip`:
    each example's, or under `privacy_unit="user"` the mean of a user's
    block of `max_examples_per_user` rows (`DPOptimizer.group_size`), or,
    for an optimizer with a `num_microbatches` attribute, as in
    `tfdp.compat.tensorflow_privacy`, each microbatch's mean gradient. Adds
    the sum to the optimizer's accumulators and, on the last batch of a
    logical step, noises once and updates. Runs inside a traced train step.

    Microbatches follow TF-Privacy: with `num_microbatches=M`, a batch of
    `M * m` rows is split into `M` consecutive groups of `m` rows, and group
    j's loss is the mean of its rows' (weighted) losses.

    Args:
        model: `keras.Model`. The (plain, inner) model whose
            `trainable_variables` are updated.
        optimizer: `tfdp.DPOptimizer`. Clipping bound, noise and state.
        per_example_loss: callable. `(y_true, y_pred) -> [B]` losses (see
            `per_example_loss_fn`).
        x: tensor. Inputs, batch first (a single tensor).
        y: tensor. Targets.
        sample_weight: optional tensor [B]. Scales each row's loss before
            clipping. Defaults to `None` (ones).
        batch_size: int or None. The `fit` batch size; needed with
            microbatches when the traced batch dimension is unknown.
            Defaults to `None`.
        last: bool scalar tensor or None. True on the last physical batch of
            a logical step (tfdp's array batches). Defaults to `None`: the
            step ends after the optimizer's `gradient_accumulation_steps`
            batches of one epoch.
        physical_batch_size: int or None. The rows of the training probe
            (`probe_before_training`). Defaults to the traced batch size,
            else `batch_size`, else the array sampler's physical batch.
        release: bool. End the logical step on its last batch here; False
            under several replicas, where the train function ends it
            (`DPOptimizer.release_step`). Defaults to `True`.

    Returns:
        The predictions of the clipping forward pass (for metrics).
    """
    num_microbatches = getattr(optimizer, "num_microbatches", None)
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    if num_microbatches is not None and replicas > 1:
        # Each replica would split its share of the batch into microbatches
        # of other rows than TF-Privacy's split of the whole batch.
        raise ValueError(
            "TF-Privacy microbatches train on one replica. Under a tf.distribute "
            "strategy use tfdp.DPOptimizer (per-example clipping, "
            "`gradient_accumulation_steps` for virtual steps). Received: "
            f"num_microbatches={num_microbatches} with {replicas} replicas"
        )
    regularized = _regularized_layers(model)
    if regularized:
        raise NotImplementedError(
            "Layer regularizers are not part of the per-example loss of a "
            f"private model (found {regularized}). Use "
            "`DPOptimizer(weight_decay=...)` for an L2 penalty that is "
            "clipped with the gradient."
        )
    if not tf.is_tensor(x) and not isinstance(x, np.ndarray):
        raise NotImplementedError(
            "Private models take a single input tensor. "
            f"Received: x of type {type(x).__name__}"
        )
    if not model.built:  # First trace only: creates the variables.
        model(x, training=False)
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    rows = tf.shape(x)[0]
    weights = None
    if sample_weight is not None:
        weights = tf.reshape(tf.cast(sample_weight, tf.float32), [rows])
    # A stream's rows are compared with the pass's earlier rows before
    # anything of this batch is released (`PrivacyAccount.count_copies`).
    optimizer.account.count_copies(x, weights)
    x, group = _microbatch_rows(x, num_microbatches, batch_size)
    if num_microbatches is None:
        group = optimizer.group_size
    method = clipping.resolve_method(model, optimizer.method)
    captured = []

    def capturing_loss_fn(y_true, y_pred):
        captured.append(y_pred)
        return per_example_loss(y_true, y_pred)

    probe_before_training(model, optimizer, per_example_loss, x, y, group,
                          rows=(x.shape[0] or physical_batch_size or batch_size
                                or _planned_batch_size(optimizer)),
                          method=method)
    variables = model.trainable_variables
    clipped_sum, _ = clipping.clipped_grad_sum(
        model,
        capturing_loss_fn,
        x,
        y,
        l2_norm_clip=optimizer.l2_norm_clip,
        method=method,
        sample_weight=weights,
        weight_decay=optimizer.weight_decay,
        augmentation_multiplicity=group,
    )
    if method in clipping.TAPPED_METHODS and len(captured) == 1:
        y_pred = captured[0]  # The batched forward pass of the clipping.
    else:  # Per-example forward passes: recompute the batch's predictions.
        y_pred = model(x, training=True)
    examples = None
    if optimizer.counts_passes:  # A stream's rows are counted against N.
        examples = rows if weights is None else tf.math.count_nonzero(weights, dtype=tf.int32)
    optimizer.dp_accumulate(clipped_sum, variables, last=last, examples=examples,
                            release=release)
    return y_pred


# The probes each DPOptimizer ran (`probe_before_training`); under a
# strategy every replica traces the train step, and one probe serves them.
_PROBED = weakref.WeakKeyDictionary()
_PROBE_LOCK = threading.Lock()


def _planned_batch_size(optimizer):
    plan = optimizer.fit_plan
    if plan is None or not plan.marks_last_batch:
        return None
    return plan.sampler.physical_batch_size


def probe_before_training(model, optimizer, per_example_loss, x, y, group=1, *, rows, method):
    """Runs the training probe once per model, loss and batch size (see below).

    `tfdp.dp.sensitivity.probe_training` on distinct random examples (never
    the training data) shaped like `x` and `y`, with `rows` rows (the
    physical batch size; at least 4) and the compiled per-example loss:
    refuses a layer or a loss that mixes examples, or a clipped sum that
    one example moves by more than C·(1 + 1e-4). Runs eagerly, also while
    the train step is traced (on a helper thread), so that the refusal
    comes before any update. Cached on the optimizer.

    Args:
        model: keras.Model. The inner model.
        optimizer: `DPOptimizer`.
        per_example_loss: callable. `(y_true, y_pred) -> [B]`.
        x: tensor. A batch of inputs (symbolic while tracing).
        y: tensor. Its targets.
        group: int. Rows clipped together (a user's block, TF-Privacy's
            microbatches).
        rows: int or None. The physical batch size.
        method: str. The resolved clipping method.
    """
    if y is None:
        return
    x, y = tf.convert_to_tensor(x), tf.convert_to_tensor(y)
    rows = max(int(rows or 0), model_probe.MIN_PROBE_ROWS)
    rows += (-rows) % group
    # Unknown dimensions (e.g. a sequence length) are probed at 8.
    x_shape = tuple(8 if d is None else int(d) for d in x.shape[1:])
    y_shape = tuple(8 if d is None else int(d) for d in y.shape[1:])
    key = (id(model), id(per_example_loss), rows, method, group, x_shape, x.dtype.name,
           y_shape, y.dtype.name, optimizer.l2_norm_clip, optimizer.weight_decay)
    def run():
        # Before the first update: state set before training (an adapted
        # Normalization's mean) is released as it is, not covered by ε.
        adapted_state.warn_adapted_state(model)
        batch = sensitivity.synthetic_batch(model, rows, x_shape, x.dtype, y_shape, y.dtype)
        sensitivity.probe_training(
            model, per_example_loss, batch, optimizer.l2_norm_clip, method,
            weight_decay=optimizer.weight_decay, augmentation_multiplicity=group)

    with _PROBE_LOCK:
        probed = _PROBED.setdefault(optimizer, set())
        if key in probed:
            return
        model_probe.run_eagerly(run)
        probed.add(key)


def _microbatch_rows(x, num_microbatches, batch_size):
    """`x` checked against the microbatch layout, and the rows per group.

    The group size must be a Python int, so it comes from the traced batch
    dimension, else from the `fit` batch size; either way every batch must
    then have exactly `num_microbatches` groups (TF-Privacy would resize the
    groups of a short last batch instead, which a static size cannot). XLA
    drops the assertion; the compat optimizer refuses XLA where the batch
    size is not static.
    """
    if num_microbatches is None:
        return x, 1
    m = int(num_microbatches)
    x = tf.convert_to_tensor(x)
    static_rows = x.shape[0]
    full = static_rows or batch_size or m
    if full % m:
        raise ValueError(
            f"The batch size must be a multiple of num_microbatches. "
            f"Received: batch_size={full}, num_microbatches={m}"
        )
    hint = "" if static_rows or batch_size else (
        ", or, for microbatches of more than one example, use "
        "tensorflow_privacy.DPSequential / DPModel, whose `fit` knows the "
        "batch size"
    )
    tf.debugging.assert_equal(
        tf.shape(x)[0], full,
        message=(
            f"With num_microbatches={m}, every batch must have {full} rows "
            f"({m} microbatches of {full // m}); a short last batch cannot be "
            "split the same way. Make the dataset size a multiple of the "
            f"batch size (or drop the remainder){hint}."
        ),
    )
    return x, full // m


@keras.saving.register_keras_serializable(package="tfdp")
class DPModel(keras.Model):
    """A Keras model trained with DP-SGD by `fit`.

    Wraps `model` and delegates `call` to it. Compile it with a
    `tfdp.DPOptimizer`; `fit` then draws the logical steps (see `fit`),
    clips each example's gradient, accumulates the clipped sums over the
    step's physical batches, adds noise once per logical step and updates.
    Compiled metrics are computed from the predictions of the clipping
    forward pass.

    Args:
        model: `keras.Model`. The model to train privately; it must not
            contain BatchNormalization (see `tfdp.models.replace_batchnorm`)
            and must take a single input tensor and give a single output.
        name: str or None. Defaults to `"<model.name>_private"`.
    """

    def __init__(self, model, name=None, **kwargs):
        if isinstance(model, DPModel):
            raise ValueError("The model is already private (a DPModel).")
        if not isinstance(model, keras.Model):
            raise ValueError(
                f"DPModel wraps a keras.Model. Received: model={type(model).__name__}"
            )
        # Raises a ValueError naming `tfdp.models.replace_batchnorm` on any
        # BatchNormalization layer, before anything is compiled.
        layer_taps.tapped_layers(model)
        super().__init__(name=name or f"{model.name}_private", **kwargs)
        self.model = model
        if model.built:
            self.built = True

    def call(self, inputs, training=None):
        return self.model(inputs, training=training)

    def build(self, input_shape):
        if not self.model.built:
            self.model.build(input_shape)
        self.built = True

    def get_layer(self, name=None, index=None):
        try:
            return super().get_layer(name=name, index=index)
        except ValueError:
            return self.model.get_layer(name=name, index=index)

    # ------------------------------------------------------------------
    # compile / fit
    # ------------------------------------------------------------------

    def compile(self, optimizer=None, loss=None, loss_weights=None, jit_compile=False,
                **kwargs):
        """Compiles with a `DPOptimizer`; `jit_compile` defaults to False.

        XLA is off by default because on CPU it made every DP clipping path
        slower (8-10x for vectorized per-example gradients, ~2x for
        book-keeping); measure it on your accelerator before turning it on.
        """
        if not isinstance(optimizer, DPOptimizer):
            raise TypeError(
                "A private model must be compiled with a tfdp.DPOptimizer "
                "(which holds the clipping bound, noise multiplier and virtual "
                "steps); a plain optimizer would make DP-SGD undefined. Wrap it: "
                "`optimizer=tfdp.DPOptimizer(keras.optimizers.SGD(...), "
                "l2_norm_clip=..., noise_multiplier=...)`. "
                f"Received: optimizer={optimizer!r}"
            )
        self._dp_loss_fn = per_example_loss_fn(loss, loss_weights)
        super().compile(
            optimizer=optimizer, loss=loss, loss_weights=loss_weights,
            jit_compile=jit_compile, **kwargs,
        )
        if not isinstance(self.optimizer, DPOptimizer):
            raise TypeError(
                "The DPOptimizer was wrapped by compile (e.g. in a "
                "LossScaleOptimizer for a mixed-precision policy); private "
                f"models do not support that. Received: {self.optimizer!r}"
            )

    def compile_from_config(self, config):
        # Keras skips `compile` on load when it is overridden; ours takes the
        # same arguments, so compile as Keras would.
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if self.built:
            self.optimizer.build(self.model.trainable_variables)

    @property
    def dp_optimizer(self):
        optimizer = getattr(self, "optimizer", None)
        if not isinstance(optimizer, DPOptimizer):
            raise TypeError(
                "This private model is not compiled with a tfdp.DPOptimizer. "
                f"Received: optimizer={optimizer!r}"
            )
        return optimizer

    def fit(self, x=None, y=None, batch_size=None, epochs=1, callbacks=None,
            validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
            sample_weight=None, steps_per_epoch=None, user_ids=None, **kwargs):
        """`keras.Model.fit` with DP-SGD batches and accounting.

        Arrays (numpy or tensors) are batched by tfdp (see
        `tfdp.keras.array_batches`): with the sampler "poisson" (the
        default for arrays) each logical step holds each example
        independently with probability q = B/N, drawn with the mechanism's
        secret sampling key; with "shuffle" each pass is cut into N // B steps
        of exactly B examples in a secret random order (`shuffle=False`: the
        arrays' order). Either way the step is split into physical batches of
        `batch_size`, padded with weight-0 examples, and an epoch is N/B
        logical steps (`steps_per_epoch` overrides it, in logical steps).
        Poisson steps take a random number of physical batches, so there
        each Keras step (a callback's batch, a tick of the progress bar) is
        one whole logical step; for fixed-size steps it is one physical
        batch.

        Under `privacy_unit="user"` (see `DPOptimizer`), `user_ids` gives
        each example's user and N is the number of users: each logical step
        holds each user independently with probability q = B/N, each drawn
        user with at most `max_examples_per_user` of their examples, chosen
        at random with the secret key and laid out as one block of that many
        rows (padded with weight-0 rows), whose mean gradient is clipped to
        C as one vector. `batch_size` counts rows and must be a multiple of
        `max_examples_per_user`. The ids are checked by
        `tfdp.validation.validate_user_ids` (None, NaN, inf or a mix of
        numbers and strings is refused). `validation_split` then holds out
        whole users: the last users in the order of their first example,
        with all their rows (`tfdp.dp.user_groups.split_last_users`), so that
        no user is on both sides. Validation figures are not covered by ε.

        Any other input (a `tf.data.Dataset`, a generator) is a stream of the
        user's batches, `gradient_accumulation_steps` per logical step,
        accounted once per pass; it must hold each example at most once per
        epoch. Its sampler must be "shuffle": Poisson sampling needs arrays,
        and a stream carries no user ids. With a known N (`dataset_size`), a
        pass of more than N examples is refused: a `tf.data.Dataset` is
        counted once before training (`check_stream_pass`), and every epoch
        is counted as it runs: the batch that takes the count above N
        releases nothing, and `fit` stops with a `ValueError`.

        In every case a logical step never spans two epochs: an unfinished
        step is discarded, unreleased, at each epoch start.

        Under `MirroredStrategy`, `MultiWorkerMirroredStrategy` or
        `TPUStrategy` (model and optimizer created in its scope), arrays are
        split over the replicas: each physical batch of `batch_size` rows
        (a multiple of the replicas) into consecutive per-replica shares;
        each replica clips its own rows, and the noise is added once per
        logical step, so the update (and ε) is the one-device one. Streams
        and other strategies are refused there with a `ValueError`.

        Exact duplicates (rows with the same input bytes, whatever their
        label or target; `tfdp.data.duplicates`) would make one example
        count twice. Arrays with copies are refused before any step (under
        `privacy_unit="user"`, copies held by one user are allowed; rows of
        sample weight 0 are not compared). A stream's rows are hashed as
        each pass runs: the batch that repeats an earlier row of its pass
        releases nothing, and `fit` stops with a `ValueError`.

        Args: as `keras.Model.fit`, and
            user_ids: array `[n]` or None. The user of each example (integers
                or strings), under `privacy_unit="user"` only. Defaults to
                None.
        `class_weight` is not supported with arrays (use `sample_weight`).
        """
        optimizer = self.dp_optimizer
        strategy = self.distribute_strategy
        replicas = _check_strategy(strategy, optimizer)
        if self.model.built and not optimizer.built:
            with strategy.scope():  # Replica-local accumulators under a strategy.
                optimizer.build(self.model.trainable_variables)
        callbacks = list(callbacks or [])
        common = dict(epochs=epochs, validation_data=validation_data, **kwargs)
        by_user = optimizer.privacy_unit != "example"
        if user_ids is not None and not by_user:
            raise ValueError(
                "fit(user_ids=...) is for user-level privacy: build the optimizer with "
                "`privacy_unit='user', max_examples_per_user=k`. Received: user_ids with "
                f"privacy_unit={optimizer.privacy_unit!r}"
            )
        if _is_array(x):
            if class_weight is not None:
                raise ValueError(
                    "A private model's fit on arrays takes `sample_weight`, not "
                    f"`class_weight`. Received: class_weight={class_weight!r}"
                )
            if y is None:
                raise ValueError("A private model's fit on arrays needs targets. Received: y=None")
            ids = None
            if by_user and user_ids is not None:
                ids, _ = user_groups.compact_user_ids(user_ids, len(x))
            if validation_split and validation_data is None:
                if ids is None:
                    (x, y, sample_weight), common["validation_data"] = (
                        array_slicing.train_validation_split(
                            (x, y, sample_weight), validation_split=validation_split))
                else:
                    # By user, so that no user is on both sides.
                    kept, held = user_groups.split_last_users(ids, validation_split)
                    common["validation_data"] = _take_rows((x, y, sample_weight), held)
                    x, y, sample_weight = _take_rows((x, y, sample_weight), kept)
                    ids = ids[kept]
            dataset_size = len(x)
            if ids is not None:
                ids, dataset_size = user_groups.compact_user_ids(ids)
            # One example twice would be a group of two; refused before any step.
            duplicates.check_rows(x, where="fit's x", user_ids=ids,
                                  sample_weight=sample_weight)
            physical = batch_size or 32  # Keras' default for arrays.
            plan = optimizer.plan_fit(arrays=True, dataset_size=dataset_size,
                                      physical_batch_size=physical, shuffle=bool(shuffle),
                                      user_ids=ids)
            logical_steps = steps_per_epoch or plan.steps_per_epoch
            if _synchronises(strategy):
                return self._fit_replicas(x, y, sample_weight, plan, physical, logical_steps,
                                          callbacks, common)
            dataset = array_batches.step_batches(
                x, y, sample_weight, plan.sampler, optimizer.sampling_key,
                ordered=plan.ordered, first_step=optimizer.epoch_first_step,
                steps_per_epoch=None if plan.variable_steps else logical_steps,
            )
            if plan.variable_steps:
                # Keras counts logical steps (`make_train_function`); the
                # dataset runs on, from step to step, across the epochs.
                common["steps_per_epoch"] = logical_steps
            else:
                # N // B steps of B / P batches each: Keras knows each epoch's end.
                dataset = dataset.apply(tf.data.experimental.assert_cardinality(
                    logical_steps * (plan.sampler.logical_batch_size // physical)))
            common["callbacks"] = [_EpochBoundary(
                logical_steps if plan.variable_steps else None)] + callbacks
            common.setdefault("validation_batch_size", physical)
            self._dp_prepare(plan, physical, logical_steps)
            return self._fit_batches(dataset, x, y, physical, common)
        if _synchronises(strategy):
            raise ValueError(
                "Under a tf.distribute strategy a private model's fit takes arrays "
                "(numpy arrays or tensors), which tfdp batches and splits over the "
                "replicas itself; give `fit(x, y, batch_size=...)` arrays instead of "
                f"a stream. Received: x of type {type(x).__name__} with {replicas} replicas"
            )
        if self.jit_compile:
            # Each batch's rows are hashed on the host before its release
            # (`PrivacyAccount.count_copies`), which XLA cannot compile.
            raise ValueError(
                "A private model's fit on a stream compares each batch's rows with the "
                "pass's earlier rows on the host, which XLA cannot compile: compile with "
                "jit_compile=False (the default), or give arrays. Received: jit_compile=True "
                f"and x of type {type(x).__name__}"
            )
        physical = _stream_batch_size(x, batch_size)
        plan = optimizer.plan_fit(arrays=False, physical_batch_size=physical,
                                  shuffle=bool(shuffle))
        if optimizer.pass_limit is not None and isinstance(x, tf.data.Dataset):
            check_stream_pass(x, optimizer.pass_limit)
        self._dp_prepare(plan, physical, None)
        common["callbacks"] = [_EpochBoundary(check_pass=True)] + callbacks
        return super().fit(x, y, batch_size=batch_size, validation_split=validation_split,
                           shuffle=shuffle, class_weight=class_weight,
                           sample_weight=sample_weight, steps_per_epoch=steps_per_epoch,
                           **common)

    def _fit_replicas(self, x, y, sample_weight, plan, physical, logical_steps, callbacks,
                      common):
        """`fit` on arrays over the strategy's R replicas (see `fit`).

        Every physical batch of P rows is split into R consecutive
        per-replica batches of P / R (`tfdp.distribute.distribute_train_pipeline`,
        as the trainer's), each worker building its share; all carry the
        step's `last` flag, so every replica releases together. Each replica
        clips and sums its own rows; the noise is added once
        (`DPOptimizer.noisy_mean`), so the update is the one-device update.
        """
        optimizer = self.dp_optimizer
        strategy = self.distribute_strategy
        replicas = strategy.num_replicas_in_sync
        group = plan.group_size
        if physical % (replicas * group):
            unit = f" times max_examples_per_user={group}" if group > 1 else ""
            raise ValueError(
                "Under a tf.distribute strategy the fit batch size is split evenly over "
                f"the replicas: it must be a multiple of the number of replicas{unit}. "
                f"Received: batch_size={physical} with {replicas} replicas"
            )

        def make_pipeline(physical_batch_size, input_context):
            del physical_batch_size  # P / W: the sampler's host split (`step_batches`).
            # Without end: Keras keeps one iterator and counts the epochs' steps.
            return array_batches.step_batches(
                x, y, sample_weight, plan.sampler, optimizer.sampling_key,
                ordered=plan.ordered, first_step=optimizer.epoch_first_step,
                steps_per_epoch=None, input_context=input_context)

        if replicas == 1:  # E.g. one worker of MultiWorkerMirroredStrategy: no split.
            dataset = strategy.distribute_datasets_from_function(
                lambda context: make_pipeline(physical, None))
        else:
            dataset = distribute.distribute_train_pipeline(strategy, make_pipeline, physical)
        if plan.variable_steps:
            common["steps_per_epoch"] = logical_steps
        else:
            common["steps_per_epoch"] = logical_steps * (
                plan.sampler.logical_batch_size // physical)
        common["callbacks"] = [_EpochBoundary(
            logical_steps if plan.variable_steps else None)] + callbacks
        common.setdefault("validation_batch_size", physical)
        self._dp_prepare(plan, physical // replicas, logical_steps)
        return self._fit_batches(dataset, x, y, physical // replicas, common)

    def _fit_batches(self, dataset, x, y, rows, common):
        """Keras' `fit` on tfdp's `(x, y, weights, last)` batches of the arrays.

        Under a strategy scope Keras builds the metrics from a batch it reads
        from the input, whose `last` flag is no model input; a replica's
        share of the arrays' first rows serves instead.
        """
        self._dp_build_batch = (tf.convert_to_tensor(x[:rows]), tf.convert_to_tensor(y[:rows]))
        try:
            return super().fit(dataset, shuffle=False, **common)
        finally:
            self._dp_build_batch = None

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        batch = getattr(self, "_dp_build_batch", None)
        if iterator is not None and batch is not None:
            iterator, data_batch = None, batch
        return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

    def _dp_prepare(self, plan, physical_batch_size, logical_steps):
        """Retraces the train step when the route or the mechanism changed."""
        optimizer = self.dp_optimizer
        traced_for = (plan.route, plan.variable_steps, id(optimizer.mechanism))
        if getattr(self, "_dp_traced_for", None) != traced_for:
            self.train_function = None
            self._dp_traced_for = traced_for
        self._dp_marks_last = plan.marks_last_batch
        self._dp_fit_batch_size = physical_batch_size
        self._dp_logical_steps = logical_steps if plan.variable_steps else None

    def make_train_function(self, force=False):
        """Keras' train function; for steps of random size, one call is one logical step.

        A Poisson step takes a random number of physical batches, so an
        epoch of N/B logical steps has a random number of them, which Keras'
        epoch loop cannot know in advance. `fit` gives Keras the logical
        steps as `steps_per_epoch` instead, and each call of this function
        runs physical batches until the one that ends a logical step.
        Fixed-size steps use Keras' own function (one call per physical
        batch).
        """
        if self.train_function is not None and not force:
            return self.train_function
        variable_steps = getattr(self, "_dp_logical_steps", None) is not None
        if _synchronises(self.distribute_strategy):
            # The release synchronises the replicas: outside the train step.
            self.train_function = _LogicalStepFunction(self, whole_steps=variable_steps)
        elif variable_steps:
            self.train_function = _LogicalStepFunction(self)
        else:
            return super().make_train_function(force=force)
        return self.train_function

    # ------------------------------------------------------------------
    # The DP train step
    # ------------------------------------------------------------------

    def train_step(self, data):
        last = None
        if getattr(self, "_dp_marks_last", False):
            x, y, sample_weight, last = data
        else:
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = private_update(
            self.model, self.dp_optimizer, self._dp_loss_fn, x, y, sample_weight,
            batch_size=getattr(self, "_dp_fit_batch_size", None), last=last,
            release=not _synchronises(self.distribute_strategy),
        )
        loss = self._compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )
        # Keras scales the loss by 1 / R under a strategy; the log shows it whole.
        self._loss_tracker.update_state(loss_module.unscale_loss_for_distribution(loss),
                                        sample_weight=tf.shape(x)[0])
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    # ------------------------------------------------------------------
    # Privacy
    # ------------------------------------------------------------------

    def privacy_ledger(self, **kwargs):
        """`self.optimizer.ledger(**kwargs)`: the run's `PrivacyLedger`."""
        return self.dp_optimizer.ledger(**kwargs)

    def epsilon(self, **kwargs):
        """Epsilon after the noisy updates taken so far, at the ledger's δ.

        It holds for the sampler's neighbouring relation
        (`privacy_ledger().adjacency`) and protects one privacy unit
        (`privacy_ledger().privacy_unit`: an example, or all of one user's
        data); `describe_epsilon` says which, with δ and, for shuffled,
        fixed-order or streamed batches, the replace-one epsilon.
        """
        return self.privacy_ledger(**kwargs).epsilon()

    def describe_epsilon(self, **kwargs):
        """One line: epsilon, δ, the neighbouring relation (and replace-one ε).

        Under `privacy_unit="user"` it also names the unit, N in users and
        the most examples of a user per step, and what example-level
        accounting with group privacy would claim (`example_level_claim`).
        """
        return self.dp_optimizer.describe_epsilon(**kwargs)

    def example_level_claim(self, **kwargs):
        """Under users: what example-level accounting with group privacy would claim.

        See `DPOptimizer.example_level_claim`.
        """
        return self.dp_optimizer.example_level_claim(**kwargs)

    # ------------------------------------------------------------------
    # Serialisation
    # ------------------------------------------------------------------

    def get_config(self):
        return {
            "name": self.name,
            "model": keras.saving.serialize_keras_object(self.model),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        model = keras.saving.deserialize_keras_object(
            config.pop("model"), custom_objects=custom_objects
        )
        return cls(model, **config)


def check_stream_pass(dataset, dataset_size):
    """Refuses a `tf.data.Dataset` whose pass holds more than N examples (eager).

    Counts one pass (rows of the first input tensor; rows of weight 0 are
    not examples) before any update, so that a stream that repeats its
    examples (`.repeat(2).shuffle(...).batch(...)`) is refused before its
    first update. Where the cardinality and a static batch size already
    bound the pass by N, nothing is read; else this runs the input pipeline
    once, without the model. The train step counts every epoch again
    (`DPOptimizer.check_pass`), for streams whose passes differ.

    Args:
        dataset: `tf.data.Dataset`. Batches `x`, `(x, y)` or `(x, y, w)`.
        dataset_size: int. N.

    Raises:
        ValueError: when one pass holds more than N examples.
    """
    cardinality = int(dataset.cardinality())
    dims = [s.shape[0] for s in tf.nest.flatten(dataset.element_spec)
            if isinstance(s, tf.TensorSpec) and s.shape.rank]
    if cardinality >= 0 and dims and dims[0] is not None and cardinality * dims[0] <= dataset_size:
        return

    def add(total, element):
        x, _, w = keras.utils.unpack_x_y_sample_weight(element)
        if w is not None:
            return total + tf.math.count_nonzero(tf.reshape(w, [-1]), dtype=tf.int64)
        return total + tf.shape(tf.nest.flatten(x)[0], out_type=tf.int64)[0]

    count = int(dataset.reduce(tf.constant(0, tf.int64), add))
    if count > dataset_size:
        raise ValueError(privacy_account.too_many_examples_error(
            count, dataset_size, "Nothing was trained."))


def _is_array(x):
    return isinstance(x, np.ndarray) or (tf.is_tensor(x) and x.shape.rank)


def _stream_batch_size(x, batch_size):
    """The physical batch size of a streamed input, or None if unknown.

    A `tf.data.Dataset`'s static batch dimension, else its first batch's
    (the iterator is re-created by `fit`); `batch_size` for other inputs.
    """
    if not isinstance(x, tf.data.Dataset):
        return batch_size
    if x.cardinality() == tf.data.INFINITE_CARDINALITY:
        # Keras' epochs would then not be passes: a logical step could span
        # two and hold an example twice, and the passes would be miscounted.
        raise ValueError(
            "A private model's fit needs one pass over the data per epoch: give "
            "a finite dataset (no `.repeat()`), or arrays. Received: a dataset "
            "of infinite cardinality"
        )
    dims = [s.shape[0] for s in tf.nest.flatten(x.element_spec)
            if isinstance(s, tf.TensorSpec) and s.shape.rank]
    if dims and dims[0] is not None:
        return int(dims[0])
    for element in x.take(1):
        return int(tf.shape(tf.nest.flatten(element)[0])[0])
    return None


def _take_rows(arrays, rows):
    """The rows `rows` of each array (numpy or tensor) of `arrays`; None stays None."""
    return tuple(None if a is None else tf.gather(a, rows) if tf.is_tensor(a)
                 else np.take(np.asarray(a), rows, axis=0) for a in arrays)


class _LogicalStepFunction:
    """The train function of steps of random size: one call, one logical step.

    Each call runs physical batches until the one that ends a logical step
    (its `last` flag), `steps_per_execution` logical steps per call but
    never past the epoch's end, and returns the last batch's logs.

    Under several replicas it also serves fixed-size steps (one call, one
    physical batch) and ends each logical step itself, after its last batch
    (`DPOptimizer.release_step`): the update all-reduces the replicas'
    sums, which cannot happen inside the train step's control flow.

    Args:
        model: `DPModel`. Its `train_step` runs each physical batch.
        whole_steps: bool. One Keras step is one logical step (else one
            physical batch). Defaults to `True`.
    """

    def __init__(self, model, whole_steps=True):
        self._model = model
        self._whole_steps = whole_steps
        self._left = None
        strategy = model.distribute_strategy
        self._release = None
        if _synchronises(strategy):
            self._release = lambda: model.dp_optimizer.release_step(
                strategy, model.model.trainable_variables)

        # As Keras' own train function: the train step is traced as written,
        # not rewritten by AutoGraph.
        @tf.autograph.experimental.do_not_convert
        def one_batch(data):
            outputs = model.distribute_strategy.run(model.train_step, args=(data,))
            return reduce_per_replica(outputs, model.distribute_strategy, reduction="auto")

        if not model.run_eagerly:
            one_batch = tf.function(one_batch, reduce_retracing=True,
                                    jit_compile=model.jit_compile)

        @tf.autograph.experimental.do_not_convert
        def next_batch(iterator):
            data = iterator.get_next()
            return one_batch(data), data[-1]

        if not model.run_eagerly:
            # Not under XLA: reading the iterator cannot be compiled.
            next_batch = tf.function(next_batch, reduce_retracing=True)
        self._next_batch = next_batch

    def start_epoch(self, logical_steps):
        """The epoch's logical steps, which the calls of the epoch take."""
        self._left = int(logical_steps)

    def __call__(self, iterator):
        steps = self._model.steps_per_execution
        if self._left is not None:
            steps = max(1, min(steps, self._left))
            self._left -= steps
        logs = None
        for _ in range(steps):
            while True:
                logs, last = self._next_batch(iterator)
                # Under a strategy every replica holds the same flag.
                last = distribute.is_last(self._model.distribute_strategy, last)
                if last and self._release is not None:
                    self._release()
                if last or not self._whole_steps:
                    break
        return logs


class _EpochBoundary(keras.callbacks.Callback):
    """Starts each epoch with an empty logical step (see `DPOptimizer.start_epoch`).

    Args:
        logical_steps: int or None. The logical steps of each epoch, when
            each Keras step is one logical step (`make_train_function`).
        check_pass: bool. Stop with an error once a stream's pass went
            above N (`DPOptimizer.check_pass`).
    """

    def __init__(self, logical_steps=None, check_pass=False):
        super().__init__()
        self.logical_steps = logical_steps
        self.check_pass = check_pass

    def on_train_batch_end(self, batch, logs=None):
        if self.check_pass:
            self.model.dp_optimizer.check_pass()

    def on_epoch_begin(self, epoch, logs=None):
        self.model.dp_optimizer.start_epoch()
        function = self.model.train_function
        if self.logical_steps is not None and isinstance(function, _LogicalStepFunction):
            function.start_epoch(self.logical_steps)


# Strategies whose replicas Keras' optimizer all-reduces with a SUM in
# replica context, as `DPOptimizer.noisy_mean` needs.
_STRATEGIES = ("MirroredStrategy", "MultiWorkerMirroredStrategy", "CollectiveAllReduceStrategy",
               "TPUStrategy", "OneDeviceStrategy", "_DefaultDistributionStrategy")


def _synchronises(strategy):
    """Whether Keras' optimizer synchronises the replicas of `strategy` (all-reduce).

    Then the update cannot run inside the train step's control flow (also
    with one replica), so the train function ends each logical step.
    """
    name = type(strategy).__name__
    return name not in ("OneDeviceStrategy", "_DefaultDistributionStrategy")


def _check_strategy(strategy, optimizer):
    """The number of replicas of a strategy `fit` supports; else a `ValueError`.

    Supported: the default (no strategy), `OneDeviceStrategy`,
    `MirroredStrategy`, `MultiWorkerMirroredStrategy` and `TPUStrategy`,
    with the optimizer (and model) created inside `strategy.scope()`, so
    that each replica keeps its own clipped sums.
    """
    name = type(strategy).__name__
    if not any(name == n or name.startswith(n) for n in _STRATEGIES):
        raise ValueError(
            "A private model's fit supports no strategy, OneDeviceStrategy, "
            "MirroredStrategy, MultiWorkerMirroredStrategy and TPUStrategy (each replica "
            "clips its own rows, the sums are all-reduced and the noise added once). "
            f"Received: strategy={name}"
        )
    replicas = int(strategy.num_replicas_in_sync)
    if replicas > 1:
        with strategy.scope():
            local = optimizer.has_replica_local_state()
        if not local:
            raise ValueError(
                "Under a tf.distribute strategy create the DPOptimizer inside "
                "`strategy.scope()` (with the model, before `compile`), so that each "
                f"replica keeps its own clipped sums. Received: strategy={name} with "
                f"{replicas} replicas and a DPOptimizer created outside its scope"
            )
    return replicas


def make_private(model):
    """Returns `model` wrapped in a `DPModel` (or `model` if already private).

    The returned model shares the inner model's layers and weights; compile
    it with a `tfdp.DPOptimizer` and train it with `fit`.
    """
    if isinstance(model, DPModel):
        return model
    return DPModel(model)
