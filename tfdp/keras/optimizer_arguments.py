"""The arguments of `tfdp.DPOptimizer` that are not the privacy request.

C, σ, δ and the sampler are the `tfdp.DPSGDConfig`'s to validate (through
`tfdp.keras.mechanism_builder`); these are the wrapped optimizer, virtual
steps and the clipping method.
"""

import keras

from tfdp.dp import clipping


def check(optimizer, kwargs, *, num_microbatches, gradient_accumulation_steps, method,
          wrapper_class):
    """The wrapped Keras optimizer, after checking `DPOptimizer`'s other arguments.

    Args:
        optimizer: a `keras.optimizers.Optimizer` or its identifier.
        kwargs: dict. Arguments `DPOptimizer` does not take (a `seed`, base
            optimizer arguments): any is refused.
        num_microbatches: must be None.
        gradient_accumulation_steps: int >= 1.
        method: str. One of `tfdp.dp.clipping.METHODS`.
        wrapper_class: type. `DPOptimizer`, which may not wrap itself.

    Returns:
        The wrapped `keras.optimizers.Optimizer`.

    Raises:
        ValueError: naming the first argument refused.
    """
    if "seed" in kwargs:
        raise ValueError(
            "DPOptimizer takes no `seed`: the noise comes from a secret key "
            "drawn from the OS's entropy, so that no one who knows the "
            "configuration can subtract it. For tests only, pass "
            "`insecure_reproducible_seed=`. "
            f"Received: seed={kwargs['seed']!r}"
        )
    if kwargs:
        raise ValueError(
            "DPOptimizer does not take base optimizer arguments; set them "
            f"on the wrapped optimizer. Received: {sorted(kwargs)}"
        )
    if num_microbatches is not None:
        raise ValueError(
            "tfdp always clips per example (num_microbatches equal to the "
            "batch size). For several batches per noisy update use "
            "`gradient_accumulation_steps`. "
            f"Received: num_microbatches={num_microbatches}"
        )
    optimizer = keras.optimizers.get(optimizer)
    if isinstance(optimizer, wrapper_class):
        raise ValueError("DPOptimizer cannot wrap another DPOptimizer.")
    if getattr(optimizer, "gradient_accumulation_steps", None):
        raise ValueError(
            "Set virtual steps on the DPOptimizer "
            "(`gradient_accumulation_steps=`), not on the wrapped "
            "optimizer, whose accumulation would average noisy updates. "
            "Received: optimizer.gradient_accumulation_steps="
            f"{optimizer.gradient_accumulation_steps}"
        )
    k = gradient_accumulation_steps
    if not (isinstance(k, int) and not isinstance(k, bool) and k >= 1):
        raise ValueError(
            "gradient_accumulation_steps must be an int >= 1. "
            f"Received: gradient_accumulation_steps={k}"
        )
    if method not in clipping.METHODS:
        raise ValueError(
            f"Unknown clipping method. Expected one of {clipping.METHODS}. "
            f"Received: method={method!r}"
        )
    return optimizer
