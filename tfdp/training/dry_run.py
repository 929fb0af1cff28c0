"""`--dry_run`: the clipping plan, the probe, two real steps on mock data, a time estimate."""

import math
import time

import numpy as np
import tensorflow as tf

from tfdp import samplers
from tfdp.training import guards
from tfdp.training import reporting

# Examples the sensitivity probe of a dry run uses at most (training probes
# its whole physical batch): at least `model_probe.MIN_PROBE_ROWS`.
DRY_RUN_PROBE_EXAMPLES = 8


def dry_run(model, step_fn, info, contract, batching, *, clipping_plan, probe_settings):
    """Two real steps on mock data of the right shapes; returns the dry run's summary.

    Args:
        model: keras.Model.
        step_fn: the run's train step.
        info: `tfdp.data.DatasetInfo`.
        contract: `tfdp.training.run_contract.RunContract`.
        batching: `tfdp.training.run_contract.Batching`.
        clipping_plan: `tfdp.dp.ClippingPlan` or None. The run's clipping plan
            (`run_contract.make_clipping_plan`); None for non-private runs (no
            clipping, no probe).
        probe_settings: dict. `guards.check_sensitivity`'s keyword arguments.
    """
    sampler, ledger = contract.sampler, contract.ledger
    sensitivity = None
    if clipping_plan is not None:
        reporting.log(str(clipping_plan))
        guards.check_adapted_state(model)
        # A dry run checks that the model and the loss can be probed, on a few
        # rows: at ImageNet's physical batches the full probe needs the
        # accelerators of the real run. Training probes again at its batch.
        training_examples = batching.replica_batch_size // batching.group_size
        examples = min(training_examples, DRY_RUN_PROBE_EXAMPLES)
        sensitivity = guards.check_sensitivity(model, info, examples, **probe_settings)
        if examples < training_examples:
            reporting.log(
                f"dry run: probed {examples} examples; training probes its physical batch of "
                f"{training_examples} per replica before its first step")
    probe = min(batching.physical_batch_size, 4 * sampler.group_size)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(probe,) + tuple(info.image_shape)).astype("float32"))
    y = tf.constant(rng.integers(0, info.num_classes, probe), tf.int32)
    w = tf.ones([probe])
    times = []
    for _ in range(2):
        start = time.time()
        step_fn.accumulate(x, y, w)
        step_fn.apply()
        times.append(time.time() - start)
    per_example = times[-1] / probe
    per_epoch = per_example * sampler.dataset_size
    epsilon = ledger.epsilon_after(contract.total_steps) if ledger else math.inf
    summary = {
        "dry_run": True, "model_params": model.count_params(), "dataset_size": sampler.dataset_size,
        "sampling_rate": sampler.sampling_rate, "steps": contract.total_steps,
        "noise_multiplier": ledger.noise_multiplier if ledger else 0.0,
        "epsilon": epsilon, "delta": contract.delta,
        "seconds_per_epoch_estimate": per_epoch, "sensitivity": sensitivity,
        "bands": getattr(sampler, "bands", 1),
    }
    total = per_epoch * contract.total_steps / max(sampler.steps_per_epoch, 1e-9)
    reporting.log(
        f"dry run: 2 steps on mock data OK ({times[-1]:.2f}s for {probe} examples); "
        f"estimated {reporting.duration(per_epoch)} per epoch, {reporting.duration(total)} in total on the "
        f"current devices (linear in examples; a physical batch of "
        f"{batching.physical_batch_size} is usually faster per example)"
    )
    if ledger is not None:
        reporting.log(
            f"dry run: sigma={ledger.noise_multiplier:.4f} q={sampler.sampling_rate:.6f} "
            f"steps={contract.total_steps} "
            f"{ledger.describe_epsilon(epsilon, steps=contract.total_steps)}")
        weak = samplers.weak_amplification_warning(sampler, epsilon=epsilon, delta=contract.delta)
        if weak:
            reporting.log(f"dry run: warning: {weak}")
    return summary
