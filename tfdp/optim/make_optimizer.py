"""Optimizer factory for DP-SGD runs."""

import gin
import keras

# Matched by `re.search` against variable names: biases and norm parameters
# are never decayed, like `weight_decay_variables`.
NO_DECAY_NAMES = ("bias", "gamma", "beta", "embeddings")


@gin.configurable(module="tfdp.optim")
def make_optimizer(
    name="sgd",
    learning_rate=0.1,
    momentum=0.9,
    nesterov=True,
    weight_decay=0.0,
    decoupled_weight_decay=False,
):
    """Builds the Keras optimizer that applies the privatised gradient.

    The paper uses SGD with Nesterov momentum 0.9. Its weight decay (1e-4) is
    the term `0.5 * wd * sum(w**2)` over conv and dense kernels, added
    **inside each example's loss**, so it is clipped together with the rest
    of that example's gradient. That is the DP engine's job (its
    `weight_decay` argument, over `weight_decay_variables(model)`), so by
    default this optimizer adds no decay at all, and asking for coupled decay
    here is an error rather than a silent double decay.

    `decoupled_weight_decay=True` instead uses the Keras optimizer's own
    decoupled decay, `w -= learning_rate * weight_decay * w` before each
    update, on every variable except biases and norm/embedding parameters.
    It is applied after clipping and noise and depends only on the current
    weights, so it is post-processing and costs no privacy, but it is not
    the paper's formulation.

    Args:
        name: str. `"sgd"` or `"adam"` (case-insensitive). Defaults to
            `"sgd"`.
        learning_rate: float or `LearningRateSchedule`. E.g. a
            `warmup_cosine_schedule`. Defaults to `0.1`.
        momentum: float. SGD momentum; ignored by Adam. Defaults to `0.9`.
        nesterov: bool. Nesterov momentum for SGD; ignored by Adam.
            Defaults to `True`.
        weight_decay: float. Decoupled decay rate; must be 0 unless
            `decoupled_weight_decay`. Defaults to `0.0`.
        decoupled_weight_decay: bool. Let the optimizer apply `weight_decay`
            itself. Defaults to `False`.

    Returns:
        A `keras.optimizers.Optimizer`.
    """
    key = str(name).lower()
    if key not in ("sgd", "adam"):
        raise ValueError(f"`name` must be 'sgd' or 'adam'. Received: name={name!r}")
    if weight_decay < 0:
        raise ValueError(
            f"`weight_decay` must be >= 0. Received: weight_decay={weight_decay}"
        )
    if weight_decay and not decoupled_weight_decay:
        raise ValueError(
            "Coupled weight decay belongs inside the per-example loss, so pass "
            "it to the DP engine; set decoupled_weight_decay=True to have the "
            f"optimizer decay instead. Received: weight_decay={weight_decay}, "
            f"decoupled_weight_decay={decoupled_weight_decay}"
        )
    if not 0 <= momentum < 1:
        raise ValueError(f"`momentum` must be in [0, 1). Received: momentum={momentum}")
    decay = float(weight_decay) if weight_decay else None
    if key == "sgd":
        optimizer = keras.optimizers.SGD(
            learning_rate=learning_rate,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=decay,
        )
    else:
        optimizer = keras.optimizers.Adam(
            learning_rate=learning_rate, weight_decay=decay
        )
    if decay:
        optimizer.exclude_from_weight_decay(var_names=list(NO_DECAY_NAMES))
    return optimizer
