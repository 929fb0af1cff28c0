"""The loop over logical steps, shared by the trainer, the audit and the bench.

A logical step is one or more physical batches: each is accumulated, and after
the last one of the step the noisy update is applied once.
"""


def run_logical_steps(step_fn, batches, *, is_last=bool, before_apply=None, on_batch=None):
    """Drives `step_fn` over physical batches; yields after each applied step.

    Args:
        step_fn: `PrivateTrainStep` (or `NonPrivateTrainStep`).
        batches: iterable of `(images, labels, weights, last)`, `last` True
            on the final physical batch of a logical step.
        is_last: callable. `last -> bool`; under a tf.distribute strategy
            `tfdp.distribute.is_last`. Defaults to `bool`.
        before_apply: callable or None. Called before each update (e.g. a
            check that the step's gradients are finite). Defaults to None.
        on_batch: callable or None. `images -> None` after each physical
            batch is accumulated (e.g. to count examples). Defaults to None.

    Yields:
        None, once after each logical step is applied.
    """
    for images, labels, weights, last in batches:
        step_fn.accumulate(images, labels, weights)
        if on_batch is not None:
            on_batch(images)
        if not is_last(last):
            continue
        if before_apply is not None:
            before_apply()
        step_fn.apply()
        yield
