"""Virtual-step DP-SGD: accumulate, noise once, normalise, update.

A logical step is one or more physical batches. Each physical batch adds its
sum of clipped per-example gradients to accumulators; at the end of the
logical step, Gaussian noise of std σ·C is added once to the total, which is
divided by the *expected* logical batch size (fixed, public; dividing by the
realised Poisson batch size would leak it), and the optimizer updates once.

Under a tf.distribute strategy (build the step inside `strategy.scope()`):
- every replica clips its own examples and keeps its own partial sums: the
  accumulators are ON_READ/SUM variables, local to each replica (a read in
  cross-replica context, e.g. a checkpoint, sees the sum over replicas);
- at `apply()` each replica hands the optimizer
  `(local_sum + noise / R) / B` (`tfdp.dp.NoisyAggregator`, shared with the
  Keras `DPOptimizer`), where `noise` ~ N(0, (σC)²) is drawn from the
  stateless seed `step_seed(noise_key, optimizer.iterations)`, so it is the
  SAME tensor on every replica (`noise / R` is drawn directly with std σC/R
  from the same words), R = `num_replicas_in_sync` and B the global expected
  logical batch size;
- Keras 3's optimizer, called in replica context, all-reduces the gradients
  with a SUM before updating (`TFOptimizer._all_reduce_sum_gradients` in
  keras/src/backend/tensorflow/optimizer.py): every replica then applies
  `(Σ_r local_sum_r + noise) / B`, the one-device update, with the noise
  counted exactly once. The SUM (not MEAN) is pinned by
  tests/test_distribute.py (σ = 0 equals one device; σ > 0 has std σC/B,
  rejecting R× and √R× mistakes).

With a banded matrix-factorization strategy (`DPSGD.bands` > 1) the noise
is correlated across steps (`tfdp.dp.NoisyAggregator`): the step keeps the
last b − 1 noise tensors in `noise_state`, per replica as w / R (ON_READ/SUM
like the accumulators, so a checkpoint holds w and a restore on R' replicas
gives each w / R'). The state is as secret as the key: it belongs in the
training checkpoints (`tfdp.checkpointing.RunCheckpoint(noise_state=...)`)
and never in an exported model, which holds the model's variables only.

Why one common draw rather than independent N(0, σ²C²/R) per replica: the
update is then a function of (key, step) and the examples only, not of the
number of devices, so a run on 8 GPUs reproduces the one-device run up to
float summation order, and the noise cannot be over- or under-counted by a
change of device count. The all-reduce also makes every replica apply the
same bits even if a device's RNG differed.
"""

import tensorflow as tf

from tfdp import dpsgd_config
from tfdp import mechanism as mechanism_lib
from tfdp.dp import augmentation_multiplicity as augmentation_multiplicity_lib
from tfdp.dp import clipping
from tfdp.dp import logical_step_state
from tfdp.dp import noisy_aggregator


def _float32_loss(loss_fn):
    """The loss on float32 predictions: under mixed precision (bf16 compute)
    the per-example losses, their gradients at the output and the norms are
    float32."""

    def loss(y_true, y_pred):
        if y_pred.dtype != tf.float32:
            y_pred = tf.cast(y_pred, tf.float32)
        return loss_fn(y_true, y_pred)

    return loss


def is_mixed_precision(model):
    """Whether some layer computes in a lower precision than its variables."""
    for layer in model._flatten_layers(include_self=True, recursive=True):
        policy = getattr(layer, "dtype_policy", None)
        if policy is not None and policy.compute_dtype != policy.variable_dtype:
            return True
    return False


def _local_variable(initial_value, name):
    """A per-replica variable: each replica updates its own copy; a read in
    cross-replica context returns the sum over replicas."""
    return tf.Variable(
        initial_value,
        trainable=False,
        name=name,
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=tf.VariableAggregation.SUM,
    )


class PrivateTrainStep:
    """DP-SGD train step with virtual steps, on one device or data-parallel.

    Construct it inside `strategy.scope()` (the model and optimizer too) to
    train under a tf.distribute strategy; it uses the strategy in scope at
    construction. `accumulate` then takes either distributed values (from
    `strategy.distribute_datasets_from_function` or
    `experimental_distribute_dataset`, one per-replica batch each) or plain
    tensors holding the global physical batch, which are split across the
    replicas (padded with weight-0 examples to a multiple of the replica
    count). See the module docstring for where the noise goes.

    Args:
        model: keras.Model. Built; trained in place.
        optimizer: keras.optimizers.Optimizer. Applied once per logical step.
        per_example_loss_fn: callable. `(y_true, y_pred) -> [B]`.
        mechanism: `tfdp.DPSGD`. The privacy contract: C, σ, the divisor
            and the secret key. Or leave it None and pass the keyword
            conveniences below, which build one.
        engine: `tfdp.engine.DPEngine` or None. A route's engine (the
            trainer's): its mechanism and its aggregator, instead of
            `mechanism`.
        l2_norm_clip: float. Clipping bound C (without `mechanism`).
        noise_multiplier: float. σ; the noise std on the sum is σ·C
            (without `mechanism`).
        expected_batch_size: float. Divides the noisy sum (q·N for Poisson),
            over all replicas (without `mechanism`).
        secret_key: `tfdp.secret_key.SecretKey` or None. The key (without
            `mechanism`). Defaults to None: fresh from the OS's entropy.
        method: str. Clipping method (see `clipped_grad_sum`). Defaults to
            "auto".
        weight_decay: float. In-loss L2 coefficient, clipped with the
            gradient. Defaults to 0.
        seed: int. Public seed of the augmentations (K > 1). Defaults to 0.
            It has no part in the noise.
        jit_compile: bool. XLA-compile the per-replica gradient computation.
            Defaults to False (on CPU, XLA slowed every DP path).
        augmentation_multiplicity: int. K > 1 averages each example's
            gradient over K on-device augmentations before clipping.
            Defaults to 1.
        augment_fn: callable. `(images, seed) -> images` for K > 1.
            Defaults to a random flip and a 4-px translation.
        group_size: int. Rows of one privacy unit in each physical batch,
            clipped as one group: 1 for example-level privacy, k for user
            blocks of k rows (`tfdp.dp.user_groups`). Each row's K
            augmentations sit next to it, so a group is k·K rows. The
            statistics (`examples`, `clipped`, ...) then count groups.
            Defaults to 1.
    """

    def __init__(
        self,
        model,
        optimizer,
        per_example_loss_fn,
        *,
        mechanism=None,
        engine=None,
        l2_norm_clip=None,
        noise_multiplier=None,
        expected_batch_size=None,
        secret_key=None,
        method="auto",
        weight_decay=0.0,
        seed=0,
        jit_compile=False,
        augmentation_multiplicity=1,
        augment_fn=None,
        group_size=1,
    ):
        if int(augmentation_multiplicity) < 1:
            raise ValueError(
                "augmentation_multiplicity must be >= 1. "
                f"Received: augmentation_multiplicity={augmentation_multiplicity}"
            )
        if engine is not None:
            if mechanism is not None:
                raise ValueError(
                    "Pass the engine or a mechanism, not both: the engine holds its "
                    "mechanism. Received: engine and mechanism")
            mechanism = engine.mechanism
        if mechanism is None:
            if noise_multiplier is None:
                raise ValueError(
                    "PrivateTrainStep needs a mechanism (tfdp.DPSGD) or an explicit "
                    "noise_multiplier. Received: noise_multiplier=None"
                )
            mechanism = mechanism_lib.DPSGD.from_config(
                dpsgd_config.DPSGDConfig(l2_norm_clip, noise_multiplier),
                expected_batch_size=expected_batch_size, secret_key=secret_key,
            )
        elif any(v is not None for v in (l2_norm_clip, noise_multiplier, expected_batch_size,
                                         secret_key)):
            raise ValueError(
                "Pass the privacy parameters in the mechanism only, so that they are "
                "set in one place. Received: a mechanism and l2_norm_clip, "
                "noise_multiplier, expected_batch_size or secret_key"
            )
        self.mechanism = mechanism
        self.augmentation_multiplicity = int(augmentation_multiplicity)
        if isinstance(group_size, bool) or int(group_size) != group_size or group_size < 1:
            raise ValueError(f"group_size must be an integer >= 1. Received: group_size={group_size}")
        self.group_size = int(group_size)
        self.augment_fn = augment_fn or augmentation_multiplicity_lib.flip_and_translate
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = _float32_loss(per_example_loss_fn)
        # The engine's release (`tfdp.engine.DPEngine.aggregator`); a bare
        # mechanism's, made the same way.
        self.aggregator = (engine.aggregator if engine is not None else
                           noisy_aggregator.NoisyAggregator.for_mechanism(mechanism))
        self.method = clipping.resolve_method(model, method)
        self.weight_decay = float(weight_decay)
        self.seed = int(seed)
        self.strategy = tf.distribute.get_strategy()
        self.num_replicas = int(self.strategy.num_replicas_in_sync)
        self.variables = model.trainable_variables
        with self.strategy.scope():
            self.optimizer.build(self.variables)
            self.stats = {
                name: _local_variable(0.0, f"dp_{name}")
                for name in ("examples", "norm_sum", "clipped", "nonfinite")
            }
            # The logical step's replica-local accumulators, batch counter
            # (with the step, it seeds the augmentations: reproducible on
            # resume) and the noise scheme's state, as w / R per replica
            # (see the module docstring). float32 whatever the compute
            # dtype: clipped sums and noise are accumulated in float32
            # under mixed precision too.
            self.step_state = logical_step_state.LogicalStepState(
                self.aggregator, accumulator_dtype=tf.float32)
            self.step_state.build(self.variables)
        grad_fn = self._grads_and_stats
        # No autograph: the step's Python control flow is all on static
        # values, and converting the clipping engine's code took 27 of the
        # 32 s of the default run's first trace on a loaded 2-core machine.
        self._replica_grads = (
            tf.function(grad_fn, jit_compile=True, autograph=False) if jit_compile else grad_fn
        )
        # reduce_retracing: Poisson steps end in physical batches of varying
        # length; from the second length on, one trace with an unknown batch
        # size serves them all (each length cost a ~1 s trace, 4 in the
        # default run). XLA (`jit_compile`) still compiles per length; naive
        # loops over the examples in Python, so it needs the static length.
        self._accumulate_fn = tf.function(
            self._distributed_accumulate, autograph=False,
            reduce_retracing=self.method != "naive",
        )
        self._apply_fn = tf.function(self._distributed_apply, autograph=False)

    # ------------------------------------------------------------------
    # Per replica.
    # ------------------------------------------------------------------

    def _grad_sum(self, x, y, weights):
        k = self.augmentation_multiplicity
        if k > 1:
            seed = tf.stack([
                tf.cast(self.seed, tf.int64) + 1,
                tf.cast(self.optimizer.iterations, tf.int64) * 100_003
                + tf.cast(self.step_state.micro_batches, tf.int64),
            ])
            x, y, weights = augmentation_multiplicity_lib.repeat_and_augment(
                x, y, weights, k, seed, self.augment_fn
            )
        return clipping.clipped_grad_sum(
            self.model,
            self.loss_fn,
            x,
            y,
            method=self.method,
            sample_weight=weights,
            weight_decay=self.weight_decay,
            augmentation_multiplicity=k * self.group_size,
            **self.mechanism.clip_settings(),
        )

    def _grads_and_stats(self, x, y, weights):
        weights = tf.cast(weights, tf.float32)
        grads, norms = self._grad_sum(x, y, weights)
        grads = [tf.cast(tf.convert_to_tensor(g), tf.float32) for g in grads]
        norms = tf.cast(norms, tf.float32)
        real = tf.cast(weights > 0, tf.float32)
        if self.group_size > 1:  # One norm per group: a group is real if any row is.
            real = tf.reduce_max(tf.reshape(real, [-1, self.group_size]), 1)
        finite = tf.math.is_finite(norms)
        safe_norms = tf.where(finite, norms, tf.zeros_like(norms))
        finite = tf.cast(finite, tf.float32)
        stats = {
            "examples": tf.reduce_sum(real),
            "norm_sum": tf.reduce_sum(safe_norms * real),
            "clipped": tf.reduce_sum(
                real * finite * tf.cast(norms > self.mechanism.l2_norm_clip, tf.float32)
            ),
            "nonfinite": tf.reduce_sum(real * (1.0 - finite)),
        }
        return grads, stats

    def _replica_accumulate(self, x, y, weights):
        grads, stats = self._replica_grads(x, y, weights)
        self.step_state.accumulate(grads)
        for name, value in stats.items():
            self.stats[name].assign_add(value)

    def _replica_apply(self):
        # Noise placement (see the module docstring): each replica adds
        # noise / R of one common draw; the optimizer's cross-replica SUM
        # adds the R contributions back to exactly one N(0, (σC)²).
        grads = self.step_state.noisy_mean(
            self.optimizer.iterations, empty=self.step_state.is_empty())
        # Keras 3 (TF backend) all-reduces these with SUM in replica context.
        self.optimizer.apply(grads, self.variables)
        self.step_state.reset()

    # ------------------------------------------------------------------
    # The logical step's state (`tfdp.dp.LogicalStepState`).
    # ------------------------------------------------------------------

    @property
    def accumulators(self):
        """The replica-local float32 clipped sums of the logical step, one per variable."""
        return self.step_state.accumulators

    @property
    def noise_state(self):
        """The noise scheme's state, w / R per replica ([] without one)."""
        return self.step_state.noise_state or []

    def variables_to_checkpoint(self):
        """What the training checkpoints keep of the logical step: the noise state."""
        return self.step_state.variables_to_checkpoint()

    # ------------------------------------------------------------------
    # Cross-replica drivers (tf.functions).
    # ------------------------------------------------------------------

    def _distributed_accumulate(self, x, y, weights):
        self.strategy.run(self._replica_accumulate, args=(x, y, weights))

    def _distributed_apply(self):
        self.strategy.run(self._replica_apply)

    def _split_global_batch(self, x, y, weights):
        """Plain tensors (the global physical batch) -> per-replica values."""
        r = self.num_replicas
        x, y, weights = (tf.convert_to_tensor(t) for t in (x, y, weights))
        n = int(x.shape[0])
        per = -(-n // r)
        per = -(-per // self.group_size) * self.group_size  # No group split over replicas.
        pad = per * r - n

        def padded(t):
            if not pad:
                return t
            paddings = [[0, pad]] + [[0, 0]] * (t.shape.rank - 1)
            return tf.pad(t, paddings)

        # Weight-0 padding contributes nothing and is not counted.
        parts = [tf.split(padded(t), r) for t in (x, y, tf.cast(weights, tf.float32))]
        return [
            self.strategy.experimental_distribute_values_from_function(
                lambda ctx, p=p: p[ctx.replica_id_in_sync_group]
            )
            for p in parts
        ]

    # ------------------------------------------------------------------
    # Public API.
    # ------------------------------------------------------------------

    def accumulate(self, x, y, weights):
        """Adds one physical batch's clipped gradient sum.

        With several replicas, `x, y, weights` are distributed values (each
        replica's share), or plain tensors holding the global batch, which
        are split across the replicas.
        """
        if self.num_replicas > 1 and not isinstance(x, tf.distribute.DistributedValues):
            x, y, weights = self._split_global_batch(x, y, weights)
        self._accumulate_fn(x, y, weights)

    def trace_for(self, element_spec):
        """Traces the accumulation once, for batches of these specs.

        Poisson steps end in a physical batch of varying length. Traced for
        the training pipeline's specs, whose batch size is then unknown,
        every length shares one trace; otherwise the first length gets a
        trace of its own (0.8 s of the default run). On several replicas,
        and for `naive` (which needs the static length), this does nothing.

        Args:
            element_spec: the training pipeline's `element_spec`,
                `(images, labels, weights, ...)`; the first three are used.
        """
        if self.num_replicas > 1 or self.needs_static_batch:
            return
        self._accumulate_fn.get_concrete_function(*element_spec[:3])

    @property
    def needs_static_batch(self):
        """Whether a trace needs the batch's length: `naive` loops over the examples."""
        return self.method == "naive"

    def apply(self):
        """Ends the logical step: noise once, normalise, update (on every
        replica at the same time)."""
        self._apply_fn()

    def pop_stats(self):
        """Mean norm, clipped and non-finite fractions since the last call,
        over all replicas."""
        values = {k: float(v.numpy()) for k, v in self.stats.items()}
        for v in self.stats.values():
            v.assign(0.0)
        n = max(values["examples"], 1.0)
        return {
            "examples": values["examples"],
            "mean_grad_norm": values["norm_sum"] / n,
            "clipped_fraction": values["clipped"] / n,
            "nonfinite": values["nonfinite"],
        }


class NonPrivateTrainStep(PrivateTrainStep):
    """The same virtual-step loop without clipping or noise (e.g. pretraining).

    The gradient is Σ_i w_i ∇L_i divided by the expected logical batch size,
    so with σ=0 and a huge C it equals the private step exactly.
    """

    def __init__(self, model, optimizer, per_example_loss_fn, *, expected_batch_size,
                 weight_decay=0.0, seed=0, jit_compile=False):
        super().__init__(
            model, optimizer, per_example_loss_fn,
            l2_norm_clip=1.0, noise_multiplier=0.0,
            expected_batch_size=expected_batch_size, method="naive",
            weight_decay=weight_decay, seed=seed, jit_compile=jit_compile,
        )
        self._decayed = clipping.default_weight_decay_variables(model) if weight_decay else []

    @property
    def needs_static_batch(self):
        """One batched gradient: every length of a Poisson step shares a trace."""
        return False

    def _grad_sum(self, x, y, weights):
        with tf.GradientTape() as tape:
            losses = tf.reshape(self.loss_fn(y, self.model(x, training=True)), [-1])
            total = tf.reduce_sum(tf.cast(losses, tf.float32) * weights)
            if self._decayed:
                real = tf.reduce_sum(tf.cast(weights > 0, tf.float32))
                total += real * 0.5 * self.weight_decay * tf.add_n(
                    [tf.reduce_sum(tf.square(v)) for v in self._decayed]
                )
        grads = tape.gradient(
            total, self.variables, unconnected_gradients=tf.UnconnectedGradients.ZERO
        )
        return grads, tf.zeros_like(weights)
