"""The optimizer methods of TF-Privacy's custom loop, and the refusal of plain gradients.

TF-Privacy's Keras optimizers also train in a custom loop: the loop records
a vector of per-example losses under a `tf.GradientTape` and hands it to
`minimize`, or to `_compute_gradients` and then `apply_gradients`.
`CustomLoopMethods` gives `DPKerasOptimizer` those methods, on
`custom_loop`'s functions, and `declare_model`, which names the model and
loss that the loop's training probe checks. `apply_gradients` and `apply`
take only the noised gradients `_compute_gradients` has just returned: a
plain Keras model, whose `train_step` hands the optimizer the gradients of
the reduced loss, gets `PlainGradientsError`, naming the fix.
"""

from tfdp.compat.tensorflow_privacy import custom_loop
from tfdp.keras import dp_optimizer

_PLAIN_MODEL = (
    "A TF-Privacy optimizer was asked to apply the gradients of Keras' own "
    "`train_step` (a plain Keras model), or of a custom one. Keras 3 hands an "
    "optimizer neither the model nor the batch, only the gradients of the "
    "reduced loss, which cannot be clipped per example or per microbatch. Make "
    "the model private before compiling it, keeping this optimizer: "
    "`model = tfdp.make_private(model)`, or build it as "
    "tensorflow_privacy.DPSequential / DPModel."
)


class CustomLoopMethods:
    """TF-Privacy's custom-loop methods, for `DPKerasOptimizer`.

    A mixin listed before `tfdp.DPOptimizer` among the bases (whose
    `apply_gradients` and `apply` refuse every call): it overrides them to
    apply a custom loop's noised gradients, and adds `declare_model`,
    `minimize`, `_compute_gradients` and `get_gradients`. The state that
    they and `custom_loop`'s functions keep on the optimizer
    (`declared_model`, `released_gradients`, `custom_loop_rows`) is set by
    `DPKerasOptimizer.__init__`.
    """

    def apply_gradients(self, grads_and_vars):
        """Applies the noised gradients `_compute_gradients` just returned; refuses others.

        As TF-Privacy's: `grads_and_vars = optimizer._compute_gradients(...)`
        then `optimizer.apply_gradients(grads_and_vars)` applies them through
        the wrapped optimizer, once. Any other gradients (those of Keras' own
        `train_step` for a plain model, or modified ones) could be plain
        gradients and raise `PlainGradientsError` before any update.

        Args:
            grads_and_vars: list of `(gradient, variable)`: the very list of
                tensors `_compute_gradients` returned.
        """
        released = custom_loop.take_released(self, grads_and_vars)
        if released is None:
            raise dp_optimizer.PlainGradientsError(_PLAIN_MODEL)
        custom_loop.apply_released(self, *released)

    def apply(self, grads, trainable_variables=None):
        """`apply_gradients(zip(grads, trainable_variables))`, with the same refusal."""
        if trainable_variables is None:
            raise dp_optimizer.PlainGradientsError(_PLAIN_MODEL)
        self.apply_gradients(list(zip(grads, trainable_variables)))

    def declare_model(self, model, loss=None, *, input_spec=None, target_spec=None):
        """Declares the Keras model and per-example loss of a custom loop (required).

        Before its first release a custom loop runs the training probe of
        every route (`tfdp.dp.sensitivity.probe_training`) on this model and
        loss, with random inputs (never the training data) at the batch size
        of the loss vector: a layer or a loss that mixes examples, or a
        layer that writes state from the batch, is refused, naming it,
        before any update. `minimize` and `_compute_gradients` refuse to run
        undeclared, or with a variable the model does not train. The loss
        vector handed to them must be this loss of this model's outputs,
        row by row (`tfdp.compat.tensorflow_privacy.custom_loop`).

        Args:
            model: keras.Model. The model whose trainable variables the loop
                updates.
            loss: a Keras loss, its name, or `(y_true, y_pred) -> [B]`.
                Defaults to None: the model's compiled loss.
            input_spec: `tf.TensorSpec` of a batch of inputs, or None: the
                model's `keras.Input`. Needed for a model without one.
            target_spec: `tf.TensorSpec` of a batch of targets, or None:
                class ids for a sparse loss, else float32 shaped like the
                model's output.

        Returns:
            The optimizer, so that `opt = DPKerasSGDOptimizer(...).declare_model(model, loss)`.

        Raises:
            ValueError: for a model that is not a Keras model, no loss, or
                no input shape.
        """
        self.declared_model = custom_loop.declare_model(model, loss, input_spec, target_spec)
        return self

    def minimize(self, loss, var_list, tape=None):
        """One DP-SGD batch of a custom loop: clip, accumulate, noise, apply.

        Each microbatch's mean loss gradient is clipped to C and summed;
        after `gradient_accumulation_steps` batches the sum gets noise of std
        σ·C once, is divided by the microbatches and applied by the wrapped
        optimizer (`iterations` counts it).

        Args:
            loss: tensor `[B, ...]` of per-example losses recorded by `tape`,
                or a callable returning it.
            var_list: list of variables, or a callable returning it.
            tape: `tf.GradientTape` or None. Required for a tensor loss.
        """
        custom_loop.minimize(self, loss, var_list, tape)

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        """TF-Privacy's noised gradients of one batch: `[(gradient, variable)]`.

        The clipped microbatch gradients are summed, noised once (σ·C) and
        divided by the number of microbatches. Returning them releases them:
        the release is counted in `iterations` (so in the ledger) here.
        `apply_gradients` then applies exactly these tensors, once, through
        the wrapped optimizer (as TF-Privacy's); `minimize` does both.

        Args:
            loss: tensor or callable, as `minimize`.
            var_list: variables, as `minimize`.
            grad_loss: must be None (TF-Privacy ignores it too).
            tape: `tf.GradientTape` or None, as `minimize`.

        Returns:
            A list of `(noised gradient, variable)`.
        """
        if grad_loss is not None:
            raise ValueError(
                "grad_loss is not supported by DP optimizers: the per-example losses are "
                f"differentiated as they are. Received: grad_loss={grad_loss!r}")
        if self.accumulation_steps > 1:
            raise ValueError(
                "With gradient_accumulation_steps > 1 the noise is added once per update "
                "of k batches, so one batch's noised gradients are not defined: call "
                "minimize(loss, var_list, tape=tape) for each batch. Received: "
                f"gradient_accumulation_steps={self.accumulation_steps}")
        return custom_loop.noisy_gradients(self, loss, var_list, tape)

    def get_gradients(self, loss, params):
        """Raises: Keras 2's graph-mode `get_gradients` has no Keras 3 counterpart."""
        raise NotImplementedError(
            "get_gradients is Keras 2's graph-mode API (used by tf.estimator, which "
            "TensorFlow no longer has); Keras 3 optimizers have no such method. In a "
            "custom loop, record the per-example loss vector under a tf.GradientTape and "
            "call minimize(loss, var_list, tape=tape), or _compute_gradients for the "
            "noised gradients. Received: get_gradients(loss, params)")
