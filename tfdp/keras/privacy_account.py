"""`PrivacyAccount`: what a private Keras run has released, and the budget's cap.

The ledger composes the noisy updates taken (`iterations`) or, for a
streamed input, at least one whole pass per epoch that released a step; the
budget of `tfdp.callbacks.PrivacyBudget` is enforced here, inside the train
step, so that it holds at batch granularity; and a stream's pass is counted
against N, and its rows are compared by content hash, since the per-pass
bound needs each example at most once a pass.
"""

import numpy as np
import tensorflow as tf

from tfdp import distribute
from tfdp.data import duplicates


def _state(initial_value, name):
    """Bookkeeping every replica updates alike, on its own (no communication)."""
    return distribute.replica_local_variable(initial_value, name, aggregation="first")


class PrivacyAccount:
    """The release bookkeeping of a `DPOptimizer`.

    Its variables are plain `tf.Variable`s held by this object, deliberately
    not optimizer variables, so nothing that saves the model or the
    optimizer holds them (under a strategy, one copy per replica, which
    every replica updates alike): whether this epoch released a step, the
    budget set by `PrivacyBudget`, and, for a stream, the examples of this epoch's
    pass, the most one pass may hold (N), whether this epoch went over it,
    and how many of its rows copy an earlier row of the pass. The count of
    passes that released a step is the optimizer's saved variable `passes`,
    handed over by `build`.
    """

    def __init__(self):
        self.passes = None
        self.counts_passes = False
        self._epoch_released = _state(False, "dp_epoch_released")
        self._max_steps = _state(tf.constant(-1, tf.int64), "dp_max_steps")
        self._pass_steps = _state(tf.constant(0, tf.int64), "dp_pass_steps")
        # A stream's examples in this epoch, the most one pass may hold (N;
        # -1: not checked, e.g. tfdp's own array batches) and whether this
        # epoch went over it (then nothing more is released).
        self._pass_examples = _state(tf.constant(0, tf.int64), "dp_pass_examples")
        self._pass_limit = _state(tf.constant(-1, tf.int64), "dp_pass_limit")
        self._pass_overflow = _state(False, "dp_pass_overflow")
        # A stream's rows of this epoch that repeat an earlier row's input
        # bytes (`tfdp.data.duplicates`), and the digests seen (host memory).
        self._pass_copies = _state(tf.constant(0, tf.int64), "dp_pass_copies")
        self._copies = duplicates.CopyCounter()
        self._checks_copies = False
        # `fit(duplicates="keep")`: copies are counted, not refused; the
        # largest count of one pass so far (`kept_copies`).
        self.keep_copies = False
        self.kept_copies = None
        # Privacy units the clipping dropped for a NaN/Inf gradient, over the
        # optimizer's life (summed over replicas): not covered by ε.
        self._nonfinite = distribute.replica_local_variable(
            tf.constant(0.0), "dp_nonfinite_units", aggregation="sum")
        # The step caps by source ("contract": the mechanism's target ε,
        # kept by `fit`; "callback": `PrivacyBudget`); the tightest holds.
        self._caps = {}

    def build(self, passes):
        """Takes the optimizer's saved count of passes that released a step."""
        self.passes = passes

    def set_route(self, counts_passes, pass_limit):
        """Whether a stream's passes are counted, and N for its pass (or None)."""
        self.counts_passes = bool(counts_passes)
        self._checks_copies = self.counts_passes
        with tf.init_scope():  # May run while a train step is traced.
            self._pass_limit.assign(-1 if pass_limit is None else int(pass_limit))

    @property
    def pass_limit(self):
        """The most examples one pass of a stream may hold (N), or None."""
        limit = int(self._pass_limit.numpy())
        return None if limit < 0 else limit

    def start_epoch(self):
        """A new epoch: nothing released yet, no example of its pass counted."""
        self._epoch_released.assign(False)
        self._pass_examples.assign(0)
        self._pass_overflow.assign(False)
        self._pass_copies.assign(0)
        self._copies.reset()

    # ------------------------------------------------------------------
    # In the traced train step.
    # ------------------------------------------------------------------

    def count_examples(self, examples):
        """Counts a stream batch's examples against N, before any of it is released.

        A pass above N holds some example twice, and none of its steps from
        here on may be applied.
        """
        count = self._pass_examples.assign_add(tf.cast(examples, tf.int64))
        over = tf.logical_and(self._pass_limit >= 0, count > self._pass_limit)
        self._pass_overflow.assign(tf.logical_or(self._pass_overflow, over))

    def count_copies(self, rows, weights=None):
        """Counts a stream batch's rows that copy an earlier row of the pass.

        Each row's input bytes are hashed on the host (`tfdp.data.duplicates`,
        the digest of every route); rows of weight 0 are not examples. From
        the first copy on, nothing of the pass is released (`check_pass`
        then stops `fit`). Does nothing for tfdp's own array batches, whose
        arrays are checked before training.

        Args:
            rows: tensor `[B, ...]`. The batch's inputs.
            weights: float tensor `[B]` or None. The rows' sample weights.
        """
        if not self._checks_copies:
            return
        if weights is None:
            weights = tf.ones(tf.shape(rows)[:1], tf.float32)
        copies = tf.numpy_function(self._add_rows, [rows, weights], tf.int64, stateful=True)
        self._pass_copies.assign_add(tf.reshape(copies, []))

    def count_nonfinite(self, units):
        """Adds a batch's privacy units dropped for a NaN/Inf gradient (traced)."""
        self._nonfinite.assign_add(tf.cast(units, tf.float32))

    def _add_rows(self, rows, weights):
        kept = rows[np.asarray(weights).reshape(-1) != 0]
        copies = self._copies.add(duplicates.row_digests(kept))
        if self.keep_copies:
            found = self._copies.kept()
            if found is not None and (self.kept_copies is None
                                      or found.copies >= self.kept_copies.copies):
                self.kept_copies = found
            return np.int64(0)  # Kept as distinct records: the pass goes on.
        return np.int64(copies)

    def release_allowed(self, step):
        """Whether step `step` may be released: within the budget, no pass above N."""
        new_pass = tf.where(self._epoch_released, tf.constant(0, tf.int64),
                            tf.constant(1, tf.int64))
        passes = tf.cast(self.passes, tf.int64) + new_pass
        accounted = tf.maximum(step + 1, passes * self._pass_steps)
        within = tf.logical_or(self._max_steps < 0, accounted <= self._max_steps)
        clean = tf.logical_and(tf.logical_not(self._pass_overflow),
                               tf.equal(self._pass_copies, 0))
        return tf.logical_and(within, clean)

    def record_release(self):
        """Counts a released step (and, for a stream, its pass)."""
        if self.counts_passes:
            first_of_pass = tf.logical_not(self._epoch_released.read_value())
            self.passes.assign_add(tf.cast(first_of_pass, self.passes.dtype))
        self._epoch_released.assign(True)

    # ------------------------------------------------------------------
    # Eager.
    # ------------------------------------------------------------------

    def check_pass(self):
        """Raises once a stream's pass has delivered more than N examples, or a copy.

        The batch that takes the count above N or holds a row that repeats
        an earlier row of the pass, and every later one of the epoch,
        releases nothing, so the logical step it belongs to is never
        applied; `fit` calls this after each batch to stop with this error.

        Raises:
            ValueError: naming N and the count, or the copies found.
        """
        copies = int(self._pass_copies.numpy())
        if copies:
            raise ValueError(duplicates.copies_error(
                copies, self._copies.rows, "A pass over the training stream",
                "The logical step in progress and the rest of the pass were not applied; "
                "the pass was not read to its end, so there may be more copies."))
        if not bool(self._pass_overflow.numpy()):
            return
        raise ValueError(too_many_examples_error(
            int(self._pass_examples.numpy()), int(self._pass_limit.numpy()),
            "The logical step in progress and the rest of the pass were not applied."))

    def accounted_steps(self, steps, pass_steps=None):
        """The step count the ledger composes.

        `steps` (the noisy updates), or for a streamed input at least one
        whole pass per epoch that released a step: the per-pass bound counts
        passes, and a stream's epochs may hold fewer than N // B steps.

        Args:
            steps: int. The noisy updates taken.
            pass_steps: int or None. Logical steps per pass (N // B).
        """
        if self.counts_passes and self.passes is not None and pass_steps:
            steps = max(steps, int(self.passes.numpy()) * int(pass_steps))
        return steps

    @property
    def nonfinite_examples(self):
        """Privacy units dropped so far for a NaN/Inf gradient (eager; not covered by ε)."""
        return int(round(float(self._nonfinite.numpy())))

    def set_budget(self, max_steps, pass_steps=0, source="callback"):
        """Caps the accounted steps at `max_steps` (-1 removes this source's cap).

        The caps of the sources (`"contract"`: the mechanism's target ε,
        kept by `fit`; `"callback"`: `PrivacyBudget`) hold together: the
        smallest applies.

        Args:
            max_steps: int. The most accounted steps, or -1.
            pass_steps: int. Logical steps per pass of a stream (N // B).
            source: str. Whose cap this is. Defaults to `"callback"`.
        """
        if int(max_steps) < 0:
            self._caps.pop(source, None)
        else:
            self._caps[source] = int(max_steps)
        with tf.init_scope():  # May run while a train step is traced.
            self._max_steps.assign(min(self._caps.values()) if self._caps else -1)
            # The route's N // B, whichever source gives it; kept while a cap holds.
            if pass_steps or not self._caps:
                self._pass_steps.assign(int(pass_steps) if self.counts_passes else 0)

    @property
    def max_steps(self):
        """The cap on the accounted steps in force, or None."""
        return min(self._caps.values()) if self._caps else None


def too_many_examples_error(count, dataset_size, applied):
    """The message for a stream whose pass holds more than N examples.

    Args:
        count: int. The examples the pass delivered (so far).
        dataset_size: int. N.
        applied: str. What was (not) applied of that pass.
    """
    return (
        f"A pass over the training stream delivered more than dataset_size={dataset_size} "
        f"examples ({count}): it holds some example more than once per epoch "
        "(e.g. `.repeat()` before `.batch()`, or duplicated files), so one example could "
        "sit twice in a logical step and the per-pass privacy bound would not hold. "
        f"{applied} Give a stream that holds each example at most once per epoch, or the "
        f"true `dataset_size`. Received: {count} examples in one pass, "
        f"dataset_size={dataset_size}"
    )
