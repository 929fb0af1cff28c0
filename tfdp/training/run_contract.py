"""What a trainer run is bound to before training, and how it batches.

`RunContract`: the run's `tfdp.DPSGD` (or a non-private run's key), its
steps and the checkpoint it continues; `Batching`: its sampler and batch
sizes; the run's `tfdp.dp.ClippingPlan` and the lines logged before training.
"""

import dataclasses

from tfdp import distribute
from tfdp import dp
from tfdp import engine as engine_lib
from tfdp import mechanism as mechanism_lib
from tfdp import samplers
from tfdp import secret_key as secret_key_lib
from tfdp.data import train_pipeline
from tfdp.training import privacy_unit as privacy_unit_lib
from tfdp.training import reporting
from tfdp.training import resume


@dataclasses.dataclass(frozen=True)
class Batching:
    """How a run batches its examples.

    Args:
        sampler: `tfdp.samplers.Sampler` of this host's batches.
        physical_batch_size: int. Rows per physical batch (global).
        replica_batch_size: int. Rows each replica's model call sees: the
            batch the sensitivity probe runs at.
        pad_granule: int or None. `tfdp.data.make_train_pipeline`'s.
        group_size: int. Rows of one privacy unit: k for users, else 1.
    """

    sampler: object
    physical_batch_size: int
    replica_batch_size: int
    pad_granule: object
    group_size: int


def make_batching(train_source, *, sampler, privacy_unit, group_size, logical_batch_size,
                  physical_batch_size, pad_granule, replicas, bands=1):
    """The run's `Batching`: examples by `sampler`, or users under `privacy_unit="user"`.

    `bands` > 1 needs `sampler="banded_poisson"`: b groups of the examples;
    under users, b groups of the users (`privacy_unit.user_sampler`).
    """
    if privacy_unit == "user":
        sampler, pad_granule = privacy_unit_lib.user_sampler(
            train_source, users_per_step=logical_batch_size,
            physical_batch_size=physical_batch_size, k=group_size, replicas=replicas,
            pad_granule=pad_granule, bands=bands)
    elif bands > 1:
        sampler = samplers.make_sampler(
            sampler, dataset_size=(train_source if isinstance(train_source, int)
                                   else len(train_source)),
            logical_batch_size=logical_batch_size,
            physical_batch_size=physical_batch_size, bands=bands)
    sampler = train_pipeline.train_sampler(
        train_source, sampler=sampler, physical_batch_size=physical_batch_size,
        logical_batch_size=logical_batch_size)
    return Batching(
        sampler=sampler, physical_batch_size=physical_batch_size,
        replica_batch_size=physical_batch_size // replicas,
        # With several replicas the physical batches stay whole.
        pad_granule=pad_granule if replicas == 1 else None, group_size=group_size)


def make_engine(config, sampler, *, steps, key):
    """The run's `tfdp.engine.DPEngine`: `config` (a `tfdp.DPSGDConfig`) bound to the run.

    Args:
        config: `tfdp.DPSGDConfig`. The run's privacy request; its δ=None is
            `tfdp.privacy.default_delta(N)`.
        sampler: `tfdp.samplers.Sampler`. The run's sampler.
        steps: int. The planned logical steps.
        key: `SecretKey`. The key of the noise and the batches, already
            agreed across the workers (`requested_key`).
    """
    engine = engine_lib.make_engine(config, sampler=sampler, steps=steps, key=key)
    mechanism = engine.mechanism
    if mechanism.calibrated:
        reporting.log(
            f"calibrated noise_multiplier={mechanism.noise_multiplier:.4f} for "
            f"epsilon={config.target_epsilon} at delta={mechanism.delta} over {steps} steps")
    return engine


def requested_key(strategy, insecure_reproducible_seed):
    """A fresh secret key (or an insecure seed's, loudly), the chief's on every worker.

    See `tfdp.distribute.agreed_key`.
    """
    if insecure_reproducible_seed is None:
        key = secret_key_lib.SecretKey.generate()
    else:
        key = secret_key_lib.SecretKey.insecure_from_seed(insecure_reproducible_seed)
        reporting.log("WARNING: " + secret_key_lib.INSECURE_WARNING.format(
            seed=insecure_reproducible_seed))
    return distribute.agreed_key(strategy, key)


@dataclasses.dataclass(frozen=True)
class RunContract:
    """The privacy contract of one run, and what it allows: its steps, its key.

    Private runs read C, σ, δ, the sampler and the key from `engine`
    (its `mechanism`) alone, and release through its aggregator; non-private runs have no mechanism, and draw their batches from
    `key` all the same. It is fixed before anything is built, and every
    stage of `tfdp.train` reads its steps and key from it.

    Args:
        sampler: `tfdp.samplers.Sampler`.
        total_steps: int. Logical steps planned for `OptimizationConfig.epochs`.
        engine: `tfdp.engine.DPEngine` or None (non-private): the contract,
            its aggregator and the guarantees (`tfdp.engine.make_engine`).
        resume_point: `resume.ResumePoint` or None: the checkpoint to
            continue, already checked against this contract.
        non_private_key: `SecretKey` of a non-private run's batches.
        ledger: `tfdp.privacy.PrivacyLedger` at step 0, or None
            (non-private). Made with the contract, so that its warnings (e.g.
            δ ≥ 1/N) come before anything is built.
    """

    sampler: object
    total_steps: int
    engine: object
    resume_point: object = None
    non_private_key: object = None
    ledger: object = None

    @property
    def mechanism(self):
        """The engine's `tfdp.DPSGD`, or None (non-private)."""
        return self.engine.mechanism if self.engine is not None else None

    @property
    def key(self):
        """The key of the noise and the batches (the mechanism's, when private)."""
        return self.mechanism.secret_key if self.mechanism is not None else self.non_private_key

    @property
    def sampling_key(self):
        return self.key.derive("sampling")

    @property
    def budget_steps(self):
        """The steps that fit the target ε (all of them without one)."""
        if self.engine is None:
            return self.total_steps
        return self.engine.budget_steps(self.total_steps)

    @property
    def steps_per_epoch(self):
        """Whole logical steps per epoch (for evaluation and checkpoints)."""
        return max(1, int(round(self.sampler.steps_per_epoch)))

    @property
    def delta(self):
        return self.mechanism.delta if self.mechanism is not None else None



def make_run_contract(sampler, *, epochs, key, workdir, read_checkpoint, engine_fn):
    """The `RunContract`: a resumed run continues its checkpoint's key, once checked.

    Args:
        sampler: `tfdp.samplers.Sampler`.
        epochs: float. `OptimizationConfig.epochs`.
        key: `SecretKey`. The key a fresh run asks for (`requested_key`).
        workdir: str. Where the checkpoints are.
        read_checkpoint: bool. False (a dry run) ignores any checkpoint.
        engine_fn: `(steps, key) -> tfdp.engine.DPEngine` (`make_engine`),
            or None for a non-private run.
    """
    total_steps = sampler.steps_for_epochs(epochs)
    engine = engine_fn(total_steps, key) if engine_fn is not None else None
    mechanism = engine.mechanism if engine is not None else None
    resume_point = resume.read_resume_point(workdir, mechanism) if read_checkpoint else None
    if resume_point is not None and resume_point.key is not None:
        key = resume_point.key  # Continue the checkpoint's noise and batches.
        engine = engine.with_key(key) if engine is not None else None
    return RunContract(sampler=sampler, total_steps=total_steps, engine=engine,
                       resume_point=resume_point, non_private_key=None if engine else key,
                       ledger=engine.ledger() if engine is not None else None)


def make_contract_and_batching(train_source, strategy, *, privacy, optimization, run, workdir,
                               read_checkpoint):
    """The run's `RunContract` and `Batching`, from its configs.

    The privacy contract: from here on, C, σ, δ, the sampler and the key are
    read from the contract's mechanism alone. A resumed run continues the
    checkpoint's key once the checkpoint's privacy record is this run's.

    Args:
        train_source: the training data.
        strategy: `tf.distribute.Strategy`. Its replicas split the batches.
        privacy: `tfdp.training.PrivacyConfig`. The privacy request, the
            sampler, the privacy unit and the key.
        optimization: `tfdp.training.OptimizationConfig`. The logical batch
            and the epochs.
        run: `tfdp.training.RunConfig`. The physical batch (None: the
            logical batch, in rows) and the padding granule.
        workdir: str. Where the checkpoints are.
        read_checkpoint: bool. False (a dry run) ignores any checkpoint.

    Returns:
        A tuple `(RunContract, Batching)`.
    """
    group_size = privacy.group_size
    batching = make_batching(
        train_source, sampler=privacy.sampler_name, privacy_unit=privacy.privacy_unit,
        group_size=group_size, logical_batch_size=optimization.logical_batch_size,
        physical_batch_size=(run.physical_batch_size
                             or optimization.logical_batch_size * group_size),
        pad_granule=run.pad_granule, replicas=strategy.num_replicas_in_sync,
        bands=privacy.bands if privacy.private else 1)
    contract = make_run_contract(
        batching.sampler, epochs=optimization.epochs, workdir=workdir,
        read_checkpoint=read_checkpoint,
        key=requested_key(strategy, privacy.insecure_reproducible_seed),
        # "optimized" band coefficients are fitted to the planned steps.
        engine_fn=None if privacy.dpsgd_config is None else lambda steps, key: make_engine(
            privacy.request_for(steps), batching.sampler, steps=steps, key=key))
    return contract, batching


def clipping_plan_headline(clipping_plan, path):
    """One line of a `tfdp.dp.ClippingPlan`: the method, the rules, the memory, the table's file.

    Args:
        clipping_plan: `tfdp.dp.ClippingPlan`.
        path: str or None. The file of its per-layer table; None: written
            by the chief alone.
    """
    rules = {}
    for layer in clipping_plan.layers:
        rules[layer.rule] = rules.get(layer.rule, 0) + 1
    counted = ", ".join(f"{count} {rule}" for rule, count in sorted(rules.items()))
    return (f"DP plan: method={clipping_plan.method}, physical batch={clipping_plan.batch_size}: "
            f"{len(clipping_plan.layers)} layers ({counted}), estimated clipping memory "
            f"{clipping_plan.memory_bytes / 2**20:.1f} MiB; per-layer table in "
            + (path or "the chief's clipping_plan.txt"))


def make_clipping_plan(model, batching, info, privacy):
    """The run's `tfdp.dp.ClippingPlan` at the batch one replica sees; None when non-private.

    Its `method` is the one training uses: `privacy.clipping_method`, with
    "auto" resolved (under `privacy.clipping_memory_budget_mb`, the fastest
    method that fits it).

    Args:
        model: keras.Model.
        batching: `Batching`.
        info: `tfdp.data.DatasetInfo`.
        privacy: `tfdp.training.PrivacyConfig`.
    """
    if not privacy.private:
        return None
    return dp.plan(model, info.image_shape, batching.replica_batch_size, privacy.clipping_method,
                   memory_budget_mb=privacy.clipping_memory_budget_mb)


def log_run_contract(model, contract, batching, *, dataset, clipping_plan, out_dir,
                     duplicates_kept=None):
    """The lines logged before training: the clipping plan, the data and steps, the contract.

    With `duplicates_kept` (`DataConfig.duplicates='keep'`), the copies
    trained on as distinct records and their group's planned ε
    (`privacy_unit.log_kept_copies`).

    The per-layer clipping table of `clipping_plan` (`make_clipping_plan`;
    None for non-private runs) goes to `<out_dir>/clipping_plan.txt` (not
    where `out_dir` is None: a non-chief worker), and the console gets its
    one-line headline.
    """
    import os

    sampler, mechanism = contract.sampler, contract.mechanism
    if mechanism is not None:
        path = None if out_dir is None else os.path.join(out_dir, "clipping_plan.txt")
        if path is not None:
            with open(path, "w") as f:
                f.write(str(clipping_plan) + "\n")
        reporting.log(clipping_plan_headline(clipping_plan, path))
        reporting.log(clipping_plan.reason())
    reporting.log(
        f"dataset={dataset} N={sampler.dataset_size} sampler={sampler.name} "
        f"q={sampler.sampling_rate:.5f} logical_batch={sampler.logical_batch_size} "
        f"physical_batch={batching.physical_batch_size} steps={contract.total_steps} "
        f"({contract.steps_per_epoch}/epoch) params={model.count_params()}"
    )
    if mechanism is None:
        return
    reporting.log(
        f"privacy: sigma={mechanism.noise_multiplier:.4f} C={mechanism.l2_norm_clip} "
        f"delta={mechanism.delta} accountant={mechanism.accountant} sampler={sampler.name} "
        f"(amplified: {sampler.amplified}); planned "
        f"{mechanism.ledger().describe_epsilon(steps=contract.total_steps)}"
    )
    if mechanism.bands > 1:
        coefficients = ", ".join(f"{c:.4f}" for c in mechanism.band_coefficients)
        reporting.log(
            f"banded matrix factorization: bands={mechanism.bands} coefficients=({coefficients}); "
            f"{mechanism.bands} groups of the {sampler.privacy_unit}s, each step samples one at "
            f"q={sampler.group_sampling_rate:.5f} within the group; epsilon counts "
            f"{sampler.unit_count(contract.total_steps)} rounds of {contract.total_steps} steps")
    if mechanism.hardened_noise:
        reporting.log(
            "noise: hardened against floating-point attacks (float64, a sum of independent "
            "draws, added on a public grid and rounded once); the same std sigma*C and "
            'epsilon (docs/PRIVACY.md, "Floating-point noise")')
    if mechanism.clipping == "automatic":
        reporting.log(
            f"clipping: automatic, each unit's gradient g contributes C*g/(|g| + "
            f"{mechanism.clipping_gamma:g}), of norm below C: the same sensitivity and "
            "epsilon as clipping to C")
    privacy_unit_lib.log_privacy_unit(mechanism, contract.total_steps)
    privacy_unit_lib.log_kept_copies(mechanism, contract.total_steps, duplicates_kept)
    weak = samplers.weak_amplification_warning(
        sampler, epsilon=mechanism.ledger().epsilon_after(contract.total_steps),
        delta=mechanism.delta)
    if weak:
        reporting.log(f"warning: {weak}")
    if contract.budget_steps < contract.total_steps:
        reporting.log(
            f"privacy budget epsilon={mechanism.target_epsilon} allows {contract.budget_steps} of "
            f"{contract.total_steps} steps; training will stop there.")
