"""TF-Privacy's microbatches on a `tfdp.DPOptimizer`: the groups clipped, and their sensitivity.

With `num_microbatches=M`, TF-Privacy splits a batch into `M` consecutive
microbatches and clips each one's mean gradient. `Microbatches` gives a
`DPOptimizer` subclass that split (`clipping_groups`) and what it does to
the privacy statement: one example moves its microbatch's clipped mean by
up to 2C, so the ledger accounts sensitivity 2 (`sensitivity`), and
`describe_epsilon` says why. `DPKerasOptimizer` (and so every TF-Privacy
optimizer) is one.
"""

import tensorflow as tf


class Microbatches:
    """TF-Privacy's `num_microbatches`, for a `tfdp.DPOptimizer` subclass.

    A mixin listed before `tfdp.DPOptimizer` among the bases: it reads the
    optimizer's `num_microbatches` (None: one example per microbatch) and
    `fit_route`, and defers to `DPOptimizer` for per-example clipping.
    """

    def clipping_groups(self, x, batch_size=None):
        """`(x, rows)`: TF-Privacy's microbatches of the batch `x`.

        With `num_microbatches=M`, a batch of `M * m` rows is split into `M`
        consecutive groups of `m` rows, and group j's loss is the mean of its
        rows' (weighted) losses; each group's gradient is clipped to C.

        The group size must be a Python int, so it comes from the traced batch
        dimension, else from the `fit` batch size; either way every batch must
        then have exactly `M` groups (TF-Privacy would resize the groups of a
        short last batch instead, which a static size cannot). XLA drops the
        assertion; the compat optimizer refuses XLA where the batch size is
        not static.

        Raises:
            ValueError: under several replicas, or for a batch size that is
                not a multiple of `num_microbatches`.
        """
        if self.num_microbatches is None:
            return super().clipping_groups(x, batch_size)
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        if replicas > 1:
            # Each replica would split its share of the batch into microbatches
            # of other rows than TF-Privacy's split of the whole batch.
            raise ValueError(
                "TF-Privacy microbatches train on one replica. Under a tf.distribute "
                "strategy use tfdp.DPOptimizer (per-example clipping, "
                "`gradient_accumulation_steps` for virtual steps). Received: "
                f"num_microbatches={self.num_microbatches} with {replicas} replicas"
            )
        m = int(self.num_microbatches)
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

    @property
    def microbatch_size(self):
        """Examples per microbatch in the last `fit`, or None (per example, or not yet known)."""
        route = self.fit_route
        if self.num_microbatches is None or route is None or not route.physical_batch_size:
            return None
        return route.physical_batch_size // self.num_microbatches

    @property
    def sensitivity(self):
        """How far one example moves a pass's clipped sum, in units of C: 1 or 2.

        1 when each example is clipped alone (`num_microbatches=None`, or
        microbatches of one example). 2 with microbatches of several
        examples, or of a size not yet known: zeroing out or replacing one
        example moves its microbatch's clipped mean gradient from one vector
        of norm <= C to another, by up to 2C. The ledger then accounts
        noise multiplier sigma / 2 (TF-Privacy's `used_microbatching=True`).
        """
        if self.num_microbatches is None or self.microbatch_size == 1:
            return 1
        return 2

    def describe_epsilon(self, *, brief=False, **kwargs):
        """`DPOptimizer.describe_epsilon`, saying why microbatches double the sensitivity.

        Args:
            brief: bool. Leave out the descriptions (lines that repeat).
            **kwargs: as `DPOptimizer.describe_epsilon`.

        Returns:
            A str, e.g. `epsilon=... at delta=1e-05 (zero_out adjacency: ...;
            sensitivity 2C, so noise multiplier 1.1 counts as 0.55;
            replace-one epsilon=...); clipped per microbatch (...)`.
        """
        text = super().describe_epsilon(brief=brief, **kwargs)
        if self.sensitivity == 1 or brief:
            return text
        size = (f"{self.microbatch_size} examples" if self.microbatch_size
                else "several examples")
        return (
            f"{text}; clipped per microbatch ({self.num_microbatches} microbatches of "
            f"{size} a batch): one example can move its microbatch's clipped mean "
            "gradient by up to 2C, which halves the effective noise multiplier, as "
            "TF-Privacy's used_microbatching=True"
        )
