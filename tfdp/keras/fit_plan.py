"""`FitPlan`: how one `DPModel.fit` call feeds the examples to the optimizer."""

# How `fit` feeds the examples (the route), whatever the sampler:
SAMPLED = "sampled"  # Arrays, batches drawn by the sampler with the secret key.
ORDERED = "ordered"  # Arrays, `shuffle=False`: the arrays' order.
STREAM = "stream"  # A tf.data.Dataset (or other iterable): the user's batches.
ARRAY_ROUTES = (SAMPLED, ORDERED)


class FitPlan:
    """What `DPOptimizer.plan_fit` decided for one `fit` call.

    Args:
        route: str. One of `SAMPLED`, `ORDERED`, `STREAM`.
        sampler: `tfdp.samplers.Sampler` or None. Draws the array routes'
            logical steps, with the fit batch size as physical batch size;
            for a stream, accounts its passes (None without a known N).
        steps_per_epoch: int or None. Logical steps per Keras epoch (array
            routes).
        sampler_name: str. The registered name of the sampler the route is
            accounted with, also when `sampler` is None (a stream of unknown
            N, which a callback's `dataset_size=` can still account).
    """

    def __init__(self, route, sampler, steps_per_epoch, sampler_name):
        self.route = route
        self.sampler = sampler
        self.steps_per_epoch = steps_per_epoch
        self.sampler_name = sampler_name

    @property
    def marks_last_batch(self):
        """Whether the batches carry the `last` flag of their logical step."""
        return self.route in ARRAY_ROUTES

    @property
    def ordered(self):
        """Whether the arrays are taken in their own order (`shuffle=False`)."""
        return self.route == ORDERED

    @property
    def variable_steps(self):
        """Whether the array steps vary in size (so epochs vary in batches)."""
        return self.route in ARRAY_ROUTES and not self.sampler.fixed_size_steps

    @property
    def counts_passes(self):
        """Whether the ledger counts the passes of the user's stream."""
        return self.route == STREAM

    @property
    def group_size(self):
        """Rows of one privacy unit in a physical batch, clipped as one group."""
        if self.route in ARRAY_ROUTES:
            return self.sampler.group_size
        return 1
