"""TF-Privacy's `DPFTRLTreeAggregationOptimizer`: DP-FTRL by tree aggregation.

Kairouz et al. 2021, "Practical and Private (Deep) Learning without Sampling
or Shuffling". TF-Privacy builds it as its generic DP SGD optimizer on a
`TreeResidualSumQuery` (wrapped in a `RestartQuery` with `restart_period`):
each step hands SGD the clipped sum plus the increment of the tree's noisy
prefix sum, divided by the microbatches. Plain SGD then follows
θ_t = θ_0 − lr · (noisy prefix sum of the gradients) within a tree: FTRL; with
`momentum` it is FTRL with momentum, as in the paper.

Here the increment is the engine's (`tfdp.dp.tree_noise`, through the
aggregator's `tree=` option), each node drawn from the secret key, and the
ledger is dp_accounting's tree-aggregation event
(`tfdp.privacy.tree_aggregation`), not the shuffle sampler's DP-SGD bound.

With `gradient_accumulation_steps=k`, TF-Privacy's query releases a noisy
increment at every batch (a tree leaf, its restarts counting batches) and
the optimizer applies the mean of k of them. Here the update after k
batches adds the sum of those k leaves' increments once (σ is each node's,
not scaled by √k) to the sum of the k clipped sums, divided by k times the
microbatches: the same update; the ledger accounts the leaves' tree.
"""

import keras

from tfdp import secret_key as secret_key_lib
from tfdp.compat.tensorflow_privacy import dp_keras_optimizer
from tfdp.privacy import tree_aggregation


@keras.saving.register_keras_serializable(package="tfdp.compat")
class DPFTRLTreeAggregationOptimizer(dp_keras_optimizer.DPKerasOptimizer):
    """DP-FTRL: SGD on the increments of a tree-aggregated noisy prefix sum.

    TF-Privacy's arguments, then `keras.optimizers.SGD`'s (`learning_rate`,
    `momentum`, `nesterov`, ...). Compile it into `tfdp.make_private(model)`
    (or a `DPSequential` / `DPModel`), or call `minimize(loss, var_list,
    tape=tape)` in a custom loop.

    - Noise: every node of the binary tree over a tree's steps is
      N(0, (l2_norm_clip · noise_multiplier)²); step t releases the clipped
      sum plus cum(t + 1) − cum(t), cum(n) the sum of the nodes covering the
      first n steps, divided by the microbatches (the batch size without
      `num_microbatches`). A restart starts a new tree: the noise of the
      finished tree stays in the weights, as in TF-Privacy. With
      `gradient_accumulation_steps=k` the leaves are the batches: an update
      releases the k batches' clipped sums plus their k increments, divided
      by k times the microbatches (TF-Privacy's mean of k noisy batches).
    - Restarts: after leaf `restart_warmup`, then every `restart_period`
      leaves (TF-Privacy's `PeriodicRoundRestartIndicator`, which counts
      batches). The paper restarts once per epoch:
      `restart_period=batches_per_epoch`.
    - Accounting (`ledger()`, `describe_epsilon()`): fixed-size batches, each
      example in one batch (leaf) per pass, under zero-out adjacency, with
      dp_accounting's `SingleEpochTreeAggregationDpEvent` pass by pass when
      every tree lies within a pass; a tree across m passes (no restarts, or
      a period longer than a pass) is accounted as a Gaussian of noise
      multiplier σ / (m·√depth) (`tfdp.privacy.tree_aggregation`).
      Microbatches of several examples double the sensitivity, as for the
      DP-SGD optimizers.

    Args:
        l2_norm_clip: float. C > 0.
        noise_multiplier: float. σ >= 0 of each tree node.
        var_list_or_model: a Keras model or variables, or None. TF-Privacy
            needs it for the noise's shapes; here the shapes come from the
            model the optimizer is built for, so it is only kept. Defaults
            to `None`.
        num_microbatches: int or None. As `DPKerasSGDOptimizer`'s.
        gradient_accumulation_steps: int. k >= 1: batches per update. Each
            batch is a leaf of the tree, as in TF-Privacy: the update adds
            the k leaves' noise increments to the k batches' clipped sums
            and divides by k times the microbatches. Defaults to `1`.
        restart_period: int or None. Leaves (batches) per tree; None: one
            tree.
        restart_warmup: int or None. Leaves of the first tree, in
            [1, restart_period − 1]; needs `restart_period`.
        noise_seed: int or None. INSECURE: a public seed of the run's key,
            as `tfdp.DPOptimizer(insecure_reproducible_seed=...)` (it
            warns). Defaults to `None`: a fresh secret key.
        hardened_noise: bool. Tree nodes hardened against floating-point
            attacks (`tfdp.DPOptimizer`'s). Defaults to `False`.
        *args, **kwargs: `keras.optimizers.SGD`'s.
    """

    def __init__(self, l2_norm_clip, noise_multiplier, var_list_or_model=None,
                 num_microbatches=None, gradient_accumulation_steps=1, restart_period=None,
                 restart_warmup=None, noise_seed=None, *args,
                 unconnected_gradients_to_zero=False, hardened_noise=False, **kwargs):
        restarts = tree_aggregation.TreeRestarts(restart_period, restart_warmup)
        if gradient_accumulation_steps is None:  # SGD's own config key.
            gradient_accumulation_steps = 1
        super().__init__(
            keras.optimizers.SGD(*args, **kwargs), l2_norm_clip, noise_multiplier,
            num_microbatches=num_microbatches,
            gradient_accumulation_steps=gradient_accumulation_steps,
            unconnected_gradients_to_zero=unconnected_gradients_to_zero,
            name=kwargs.get("name"), hardened_noise=hardened_noise)
        self.restarts = restarts
        self.var_list_or_model = var_list_or_model
        self.noise_seed = noise_seed
        if noise_seed is not None:
            # TF-Privacy's seed is public; so is the key derived from it.
            self.mechanism_builder.secret_key = secret_key_lib.SecretKey.resolve(
                insecure_seed=noise_seed)
        self.mechanism_builder.set_aggregator_options(
            tree=restarts, leaves_per_step=self.accumulation_steps)

    @staticmethod
    def accumulation_noise_scale(k):
        """1: each of the k leaves of an update draws its own nodes of σ (no √k)."""
        return 1.0

    restart_period = property(lambda self: self.restarts.restart_period)
    restart_warmup = property(lambda self: self.restarts.restart_warmup)

    def clipping_groups(self, x, batch_size=None):
        """As `DPKerasOptimizer.clipping_groups`; refuses a streamed `fit` input.

        The tree accounting takes pass p as steps [p·N//B, (p+1)·N//B), which
        is where fit's array batches put it (their passes follow the global
        step). A stream's passes are its epochs, of any length: an example
        could then sit twice in one accounted pass. Runs while the train
        step is traced, before any update.
        """
        route = self.fit_route
        if route is not None and route.counts_passes:
            raise ValueError(
                "DPFTRLTreeAggregationOptimizer accounts its trees pass by pass, at steps "
                "that are multiples of N // B, which fit's array batches keep and a "
                "stream's epochs need not: give fit arrays (numpy or tensors), or use "
                "`minimize` in a custom loop whose passes are N // B steps each. "
                "Received: a streamed input")
        return super().clipping_groups(x, batch_size)

    def ledger(self, *, dataset_size=None, delta=None, steps=None):
        """The run's `tfdp.privacy.tree_aggregation.TreeAggregationLedger`.

        N, B and δ are those the DP-SGD optimizers account (the route's, or
        `dataset_size` and `delta`); `steps` (updates) defaults to the
        accounted steps. With `gradient_accumulation_steps=k` the tree is
        over the k · steps leaves (batches), k · (N // B) a pass.
        """
        mech = self.accounting_mechanism(dataset_size, delta)
        sampler = mech.sampler
        if steps is None:
            steps = self.accounted_steps(sampler.steps_per_epoch)
        return tree_aggregation.TreeAggregationLedger(
            mech.noise_multiplier, delta=mech.delta, steps=steps,
            dataset_size=sampler.dataset_size, batch_size=sampler.logical_batch_size,
            restarts=self.restarts, sensitivity=self.sensitivity,
            l2_norm_clip=self.l2_norm_clip, leaves_per_step=self.accumulation_steps)

    def get_config(self):
        # The noise seed is left out: a saved model must not carry its noise.
        return dp_keras_optimizer.flat_config(
            self, restart_period=self.restart_period, restart_warmup=self.restart_warmup)

    @classmethod
    def from_config(cls, config, custom_objects=None):
        return dp_keras_optimizer.from_flat_config(cls, config, custom_objects)
