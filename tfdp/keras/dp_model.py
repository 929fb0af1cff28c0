"""`DPModel` / `make_private`: a Keras model whose `train_step` is DP-SGD.

`DPModel` wraps any built or unbuilt Keras model (Functional, Sequential or
subclassed). Its `fit` runs one way: it checks its inputs
(`tfdp.keras.fit_inputs`), fixes its route once (`tfdp.keras.fit_route.route_fit`:
the route's kind, the sampler, the mechanism, the steps of an epoch), draws the
route's batches (Poisson or shuffled batches of arrays, Poisson-sampled users, or a
stream's batches, never a step across two epochs), and trains them with
Keras' loop (`tfdp.keras.fit_loop`, `tfdp.keras.train_function`), whose
`train_step` is the private update (`tfdp.keras.private_update`: clip,
accumulate, noise, apply).
`evaluate`, `predict`, `save` and `load_model` work as for any Keras model
(the wrapper and `DPOptimizer` are registered serialisables;
`dp_model.model` is the plain inner model).

The per-example loss comes from the compiled loss (see
`tfdp.keras.per_example_loss_fn`); its reduction is ignored: DP-SGD sums the
clipped per-example gradients and divides the noisy sum by the expected
logical batch size. A `sample_weight` scales each example's loss *before*
clipping (so it is still bounded by C); weight 0 is padding (no
contribution, no norm). The divisor does not depend on the weights.
"""

import functools

import keras
import tensorflow as tf
from keras.src.losses import loss as loss_module

from tfdp.data import duplicates as duplicates_lib
from tfdp.dp import layer_taps
from tfdp.keras import fit_inputs
from tfdp.keras import fit_route as fit_route_lib
from tfdp.keras import private_update
from tfdp.keras import release_guard
from tfdp.keras import train_function
from tfdp.keras import train_step_probe
from tfdp.keras.dp_optimizer import DPOptimizer
from tfdp.keras.fit_loop import FitLoop
from tfdp.keras.per_example_loss import per_example_loss_fn


@keras.saving.register_keras_serializable(package="tfdp")
class DPModel(FitLoop, keras.Model):
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

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # A subclass's own train_step may change the batch before the private
        # update (MixUp across rows): it is probed before its first update.
        if "train_step" in vars(cls):
            cls.train_step = _probed(cls.train_step)

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
            sample_weight=None, steps_per_epoch=None, user_ids=None, duplicates="refuse",
            **kwargs):
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

        Whatever the route (`tfdp.keras.release_guard`): a target ε of the
        contract is kept (no step beyond `DPSGD.budget_steps` of what the
        route accounts; a warning where it cuts the planned steps); labels
        and targets are checked before any step (`fit_inputs.TargetRule`:
        arrays up front, a stream's batches before their release); the
        parameters are checked after each release (`FloatingPointError` on
        NaN/Inf, before any later callback); examples dropped by the
        clipping for a NaN/Inf gradient are counted, a figure not covered
        by ε.

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
        releases nothing, and `fit` stops with a `ValueError`. Where each
        copy is a distinct record that shares its content (two patients'
        blank scans), `duplicates="keep"` trains on them: `fit` warns with
        the count and what ε would be for the largest group of identical
        rows were it one record (`tfdp.privacy.copies_claim`), before
        training for arrays and after it for a stream.

        Args: as `keras.Model.fit`, and
            user_ids: array `[n]` or None. The user of each example (integers
                or strings), under `privacy_unit="user"` only. Defaults to
                None.
            duplicates: str. "refuse" exact copies (the default) or "keep"
                them as distinct records.
        `class_weight` is not supported with arrays (use `sample_weight`).
        """
        optimizer = self.dp_optimizer
        strategy = self.distribute_strategy
        duplicates_lib.validate_policy(duplicates)
        replicas = train_function.check_strategy(strategy, optimizer)
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
        # Labels out of range or non-finite targets: refused before any step
        # (arrays, here) or before the batch's release (a stream's).
        target_rule = fit_inputs.TargetRule.of(
            self.model, self._dp_loss_fn, x if fit_inputs.is_array(x) else None)
        if fit_inputs.is_array(x):
            if y is not None:
                target_rule.check(y)
            x, y, sample_weight, ids, dataset_size, common["validation_data"], kept = (
                fit_inputs.prepare_arrays(
                    x, y, sample_weight, user_ids=user_ids, by_user=by_user,
                    class_weight=class_weight, validation_split=validation_split,
                    validation_data=validation_data, duplicates_policy=duplicates))
            physical = batch_size or 32  # Keras' default for arrays.
            route = fit_route_lib.route_fit(optimizer, arrays=True, dataset_size=dataset_size,
                                            physical_batch_size=physical,
                                            shuffle=bool(shuffle), user_ids=ids, epochs=epochs)
            logical_steps = steps_per_epoch or route.steps_per_epoch
            guard = release_guard.ReleaseGuard.for_fit(
                optimizer, logical_steps, epochs - kwargs.get("initial_epoch", 0))
            if guard.spent(optimizer):  # The budget allows no step: run none.
                return release_guard.empty_history(self)
            fit_inputs.warn_kept_copies(optimizer, kept, "fit's x", logical_steps * epochs)
            return self._fit_arrays(x, y, sample_weight, route, logical_steps,
                                    [guard] + callbacks, common)
        fit_inputs.check_stream_route(
            x, replicas_synchronise=train_function.synchronises(strategy),
            replicas=replicas, jit_compile=self.jit_compile)
        physical = fit_inputs.stream_batch_size(x, batch_size)
        route = fit_route_lib.route_fit(optimizer, arrays=False, physical_batch_size=physical,
                                        shuffle=bool(shuffle), epochs=epochs)
        route.target_rule = target_rule
        pass_limit = optimizer.account.pass_limit
        if pass_limit is not None and isinstance(x, tf.data.Dataset):
            fit_inputs.check_stream_pass(x, pass_limit)
        guard = release_guard.ReleaseGuard.for_fit(
            optimizer, None, epochs - kwargs.get("initial_epoch", 0))
        if guard.spent(optimizer):  # The budget allows no step: run none.
            return release_guard.empty_history(self)
        self._dp_prepare(route, physical, None)
        optimizer.account.keep_copies = duplicates == duplicates_lib.KEEP
        common["callbacks"] = [train_function.EpochBoundary(check_pass=True),
                               guard] + callbacks
        history = super().fit(x, y, batch_size=batch_size, validation_split=validation_split,
                              shuffle=shuffle, class_weight=class_weight,
                              sample_weight=sample_weight, steps_per_epoch=steps_per_epoch,
                              **common)
        fit_inputs.warn_kept_copies(optimizer, optimizer.account.kept_copies,
                                    "a pass over the training stream")
        return history

    def train_step(self, data):
        # Traced before the first update: an override the step would ignore
        # fails here, before anything is released.
        refuse_ignored_loss(self)
        last = None
        if getattr(self, "_dp_marks_last", False):
            x, y, sample_weight, last = data
        else:
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = private_update.private_update(
            self.model, self.dp_optimizer, self._dp_loss_fn, x, y, sample_weight,
            batch_size=getattr(self, "_dp_fit_batch_size", None), last=last,
            release=not train_function.synchronises(self.distribute_strategy),
        )
        loss = self._compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )
        # Keras scales the loss by 1 / R under a strategy; the log shows it whole.
        self._loss_tracker.update_state(loss_module.unscale_loss_for_distribution(loss),
                                        sample_weight=tf.shape(x)[0])
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

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
        """One line: ε, δ, the neighbouring relation (see `DPOptimizer.describe_epsilon`)."""
        return self.dp_optimizer.describe_epsilon(**kwargs)

    def example_level_claim(self, **kwargs):
        """Under users: what example-level accounting would claim (see `DPOptimizer`)."""
        return self.dp_optimizer.example_level_claim(**kwargs)

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


def _probed(train_step):
    """A subclass's `train_step`, probed once before it first runs (`train_step_probe`).

    The probe replays it on synthetic batches shaped like `data`, and
    refuses it when what it hands to the private update mixes examples or
    holds one example in several clipping units. Only the outermost
    `train_step` of a call is probed (an overriding subclass's, which
    calls its parents').
    """

    @functools.wraps(train_step)
    def probed(self, data):
        if train_step_probe.outermost():
            optimizer = self.dp_optimizer
            route = optimizer.fit_route
            train_step_probe.probe_train_step(
                self, train_step, data, rows=getattr(self, "_dp_fit_batch_size", None),
                group=route.group_size if route is not None else 1,
                marks_last=getattr(self, "_dp_marks_last", False))
        with train_step_probe.stepping():
            return train_step(self, data)

    return probed


def refuse_ignored_loss(model):
    """Raises when a `DPModel` subclass overrides `compute_loss`, which DP-SGD ignores.

    The private step clips the gradients of the compiled per-example loss
    (`per_example_loss_fn`), row by row; an overridden `compute_loss`
    (a penalty, another reduction) would only change the logged loss, so
    the model would silently train on another loss than its author's.
    `compute_metrics` may be overridden: metrics take no part in the update.

    Args:
        model: `DPModel`.

    Raises:
        ValueError: naming the overriding class.
    """
    owner = next(klass for klass in type(model).__mro__ if "compute_loss" in vars(klass))
    if not issubclass(owner, DPModel):  # Keras' own: the loss the step logs.
        return
    raise ValueError(
        f"{owner.__name__} overrides `compute_loss`, which a private model does not "
        "train on: DP-SGD clips the gradient of each example's compiled loss "
        "(`compile(loss=...)`), and the override would change only the logged loss. "
        "Put the loss in `compile(loss=...)` as a per-example loss `(y_true, y_pred) "
        "-> [batch]` (a data-free weight penalty: `DPOptimizer(weight_decay=...)`), "
        f"and remove the override. Received: {owner.__module__}.{owner.__qualname__}"
        ".compute_loss")


def make_private(model):
    """Returns `model` wrapped in a `DPModel` (or `model` if already private).

    The returned model shares the inner model's layers and weights; compile
    it with a `tfdp.DPOptimizer` and train it with `fit`.
    """
    if isinstance(model, DPModel):
        return model
    return DPModel(model)
