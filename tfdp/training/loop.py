"""The trainer's loop stage: logical steps, progress, evaluation and checkpoints."""

import contextlib
import math
import time

import keras
import numpy as np

from tfdp import data as data_lib
from tfdp import distribute
from tfdp import dp
from tfdp.training import evaluation
from tfdp.training import guards
from tfdp.training import reporting


def epoch_evaluation(model, data, ema, reporter, *, config):
    """`(step, epsilon, skipped_train) -> None`: evaluates the splits and reports.

    Args:
        model: keras.Model.
        data: `tfdp.training.run_data.RunData`.
        ema: `tfdp.optim.ParameterEMA` or None. Evaluated in place of the
            parameters when given.
        reporter: `tfdp.training.reporting.RunReporter`.
        config: `tfdp.training.RunConfig`. Its `eval_batch_size`, its
            `train_eval_examples` (evaluated, evenly spaced, for the train
            loss and accuracy, not covered by ε) and its
            `report_non_dp_statistics` (False evaluates no training example).
    """
    eval_batch_size, train_eval_examples = config.eval_batch_size, config.train_eval_examples
    report_non_dp_statistics = config.report_non_dp_statistics
    evaluate = evaluation.make_evaluator(model, data.info.num_classes)
    test_stats = data_lib.DecodeStats()

    def pipeline(source, stats=None):
        return data_lib.make_eval_pipeline(source, eval_batch_size,
                                           preprocess_fn=data.eval_preprocess,
                                           decode_stats=stats or data_lib.DecodeStats())

    test_ds = pipeline(data.test, test_stats)
    validation_ds = None if data.validation is None else pipeline(data.validation)
    train_eval_ds = None
    if report_non_dp_statistics:
        train_eval_src = data.train
        if getattr(data.train, "random_access", False) and len(data.train) > train_eval_examples:
            # Evenly spaced: folder data is ordered by class.
            every = np.linspace(0, len(data.train) - 1, train_eval_examples)
            train_eval_src = data_lib.validation.subset(data.train, every.round().astype(np.int64))
        train_eval_ds = pipeline(train_eval_src)

    def evaluate_epoch(step, epsilon, skipped_train):
        test_stats.reset()
        with ema.swapped() if ema is not None else contextlib.nullcontext():
            test = evaluate(test_ds)
            validation = None if validation_ds is None else evaluate(validation_ds)
            train = None if train_eval_ds is None else evaluate(train_eval_ds)
        reporter.evaluation(
            step, epsilon=epsilon, test=test, validation=validation, train=train,
            skipped_test=test_stats.value(),
            skipped_train=skipped_train if report_non_dp_statistics else None,
        )

    return evaluate_epoch


def train_loop(strategy, step_fn, ema, state, contract, batching, data, reporter, evaluate_epoch,
               *, seed, config):
    """Runs the logical steps from `state.start_step`; returns (the last step, ε).

    A run with a target ε stops before the first step that would exceed it,
    and says so.

    Args:
        strategy: `tf.distribute.Strategy`.
        step_fn: the run's train step (`accumulate`, `apply`, `pop_stats`).
        ema: `tfdp.optim.ParameterEMA` or None. Updated after every step.
        state: `tfdp.training.resume.RunState`. Its ledger records each step.
        contract: `tfdp.training.run_contract.RunContract`. Steps, sampler and key.
        batching: `tfdp.training.run_contract.Batching`.
        data: `tfdp.training.run_data.RunData`.
        reporter: `tfdp.training.reporting.RunReporter`.
        evaluate_epoch: `epoch_evaluation`'s function.
        seed: int. The public seed of the augmentation.
        config: `tfdp.training.RunConfig`. Its `log_every_steps` (the
            progress line period) and `checkpoint_every_steps` (None: once
            per epoch).
    """
    ckpt, ledger, start_step = state.checkpoint, state.ledger, state.start_step
    log_every_steps = config.log_every_steps
    checkpoint_every = config.checkpoint_every_steps or contract.steps_per_epoch
    end_step = contract.budget_steps
    # Undecodable training images are skipped (weight 0, no gradient) and counted.
    train_decode_stats = data_lib.DecodeStats()
    # Each worker builds its share; each replica gets P / R of every batch.
    pipeline = distribute.distribute_train_pipeline(strategy, lambda **per_worker: (
        data_lib.make_train_pipeline(
            data.train, sampler=contract.sampler, num_steps=end_step,
            start_step=min(start_step, end_step), seed=seed,
            sampling_key=contract.sampling_key, preprocess_fn=data.train_preprocess,
            decode_stats=train_decode_stats, pad_granule=batching.pad_granule, **per_worker,
        )), batching.physical_batch_size)
    step_fn.trace_for(pipeline.element_spec)
    step = start_step
    epsilon = ledger.epsilon() if ledger is not None else math.inf
    evaluated_at = None
    t_log = time.time()
    examples_since_log = 0

    def count_examples(images):
        nonlocal examples_since_log
        examples_since_log += distribute.num_examples(strategy, images)

    # No stop looks at the training examples (guards.check_parameters_are_finite).
    logical_steps = dp.run_logical_steps(
        step_fn, pipeline, is_last=lambda last: distribute.is_last(strategy, last),
        on_batch=count_examples,
    )
    for _ in guards.out_of_memory_as_error(logical_steps, batching.physical_batch_size,
                                           contract.sampler.logical_batch_size):
        if ema is not None:
            ema.update()
        step += 1
        reporter.tick(step)
        epoch_end = step % contract.steps_per_epoch == 0 or step == end_step
        if ledger is not None:
            ledger.record_step()
            epsilon = ledger.epsilon() if epoch_end else epsilon
        if step % log_every_steps == 0:
            stats = step_fn.pop_stats()
            now = time.time()
            learning_rate = keras.ops.convert_to_numpy(step_fn.optimizer.learning_rate)
            reporter.progress(
                step, stats=stats, learning_rate=float(np.asarray(learning_rate)),
                examples_per_second=examples_since_log / max(now - t_log, 1e-9),
            )
            t_log, examples_since_log = now, 0
        save = step % checkpoint_every == 0 or step == end_step
        if epoch_end or save:
            guards.check_parameters_are_finite(step_fn.model.trainable_variables, step, ckpt)
        if epoch_end:
            evaluate_epoch(step, epsilon, train_decode_stats.value())
            evaluated_at = step
        if save:
            ckpt.save(step, ledger)
    if evaluated_at != step:  # Nothing trained (or not since the last report).
        evaluate_epoch(step, epsilon, train_decode_stats.value())
    if contract.budget_steps < contract.total_steps and step >= contract.budget_steps:
        reporting.log(f"stopped at step {step}: one more step would exceed the budget "
                      f"epsilon={contract.mechanism.target_epsilon} (epsilon now {epsilon:.3f}).")
    return step, epsilon
