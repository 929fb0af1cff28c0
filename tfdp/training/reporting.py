"""`RunReporter`: what a training run tells its user, and how it is labelled.

The adversary of the guarantee sees everything a run prints or writes. So the
figures computed from private data without noise (the training loss and
accuracy, gradient norms, clip fractions, counts of non-finite, undecodable
and duplicate training examples, the figures of test and validation sets
held out of the training data, and the exact sizes of the splits: N, the
validation and test counts) are kept apart from ε and the figures of a
separate test set, and labelled wherever they appear:
- on the console, in the `| non-DP:` column of the progress and epoch lines,
  which the run explains once, before its first use (the data line and the
  warnings say `not covered by epsilon`);
- in TensorBoard, under the `non_dp/` tags (test figures under `test/`, ε
  under `privacy/epsilon`);
- in `summary.json`, under `not_covered_by_epsilon`.
"""

import json
import math
import os
import sys
import time

import tensorflow as tf

NOT_COVERED = "not covered by epsilon"
# The column of the progress and epoch lines that holds the figures computed
# from private data without noise; `RunReporter` explains it once.
NON_DP_COLUMN = "| non-DP:"
NON_DP_TAG_PREFIX = "non_dp/"


# Whether the terminal's last line is the progress bar (`RunReporter.tick`),
# which the next line then overwrites.
_bar_shown = False


def log(message):
    """One console line, flushed (progress must show under pipes)."""
    global _bar_shown
    if _bar_shown:
        sys.stdout.write("\r\033[K")
        _bar_shown = False
    print(message, flush=True)


def duration(seconds):
    """`seconds` for a person: s, min or h."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def guarantee_statement(ledger, key):
    """The summary's one-line statement of what the printed epsilon means.

    Args:
        ledger: `tfdp.privacy.PrivacyLedger` or None (non-private).
        key: `SecretKey` of the noise and the batches.
    """
    if ledger is None:
        return "none: non-private training"
    if not key.is_secret:
        return (f"DOES NOT HOLD against anyone who knows insecure_reproducible_seed="
                f"{key.insecure_seed}: the noise and sampling were derived from it")
    return (f"(epsilon, delta)-DP under {ledger.adjacency} adjacency "
            f"({ledger.adjacency_description}) against an adversary who knows the code, "
            "the configuration and every output, but not the training data nor the secret "
            "key, which is stored only in checkpoints/")


def held_out_warning(held_out):
    """What the run says of the examples held out of its training data, or None.

    Args:
        held_out: dict of split name -> size, for the splits held out of the
            training data (`{"test": 200}`).
    """
    if not held_out:
        return None
    sizes = " and ".join(f"{size} {name}" for name, size in held_out.items())
    fixes = {"test": "set DataConfig.test_dataset to a separate test set",
             "validation": "set DataConfig.validation_fraction = 0"}
    fix = " and ".join(fixes[name] for name in held_out)
    return (f"the {sizes} examples held out of the training data are NOT protected by "
            "epsilon: they are private data evaluated without noise every epoch, and their "
            f"figures are labelled {NOT_COVERED!r}. To hold out none, {fix}.")


def data_lines(notes, *, n, validation_size, test_size, info, class_counts,
               report_non_dp_statistics=True, held_out=None, duplicates_dropped=None):
    """The data lines, the counts of private data labelled as not covered by ε.

    N, the validation count and the held-out counts are exact counts of the
    private data, released without noise (N also sets q = B/N, which the
    plan line prints): they are labelled whatever `report_non_dp_statistics`
    says. The class counts and the duplicate count are optional.

    Args:
        notes: str. How the data was read.
        n: int. Training examples.
        validation_size: int.
        test_size: int.
        info: `DatasetInfo`.
        class_counts: callable. Training examples per class.
        report_non_dp_statistics: bool. Print the class counts and the
            duplicate count (not covered by epsilon).
        held_out: dict or None. Split name -> size, for the splits held out
            of the training data (`held_out_warning`).
        duplicates_dropped: dict or None. Split name -> exact duplicates
            dropped (`tfdp.data.duplicates`).
    """
    log(f"data: {notes}")
    line = (f"data: train N={n} validation={validation_size} test={test_size} "
            f"classes={info.num_classes} input={tuple(info.image_shape)} "
            f"| {NOT_COVERED}: these exact counts")
    if report_non_dp_statistics:
        line += f", train examples per class {class_counts()}"
        if duplicates_dropped:
            counts = ", ".join(f"{k}={v}" for k, v in duplicates_dropped.items())
            line += f", exact duplicates dropped {counts}"
    log(line)
    warning = held_out_warning(held_out)
    if warning:
        log(f"data: WARNING: {warning}")


def finished_summary(out_dir, start_step, budget_steps, workdir):
    """A finished run's `summary.json`, announced, when the workdir holds one; else None.

    A rerun of a finished command then says so at once, instead of
    evaluating and exporting the same model again.
    """
    path = os.path.join(out_dir, "summary.json")
    if not (start_step and start_step >= budget_steps and os.path.exists(path)):
        return None
    with open(path) as f:
        summary = json.load(f)
    delta = summary.get("delta")
    log(f"finished: {workdir} already holds this run's {start_step} steps "
        f"(test_accuracy={summary.get('test_accuracy', math.nan):.4f} "
        f"epsilon={summary.get('epsilon', math.nan):.4f} "
        f"delta={'none' if delta is None else format(delta, 'g')}; {path}). "
        "To train again, pass another --workdir.")
    return summary


class RunReporter:
    """Console lines, TensorBoard scalars and `summary.json` of one run.

    Args:
        out_dir: str or None. Where `tensorboard/` and `summary.json` go;
            None writes neither (a non-chief worker, which prints only).
        steps_per_epoch: float. For the epoch shown in each line.
        total_steps: int. For the "step s/T" shown in each line.
        delta: float or None (non-private). Shown beside ε.
        ledger: `PrivacyLedger` or None. Names the neighbouring relation
            beside every ε (and the replace-one ε, where the sampler reports
            one). Defaults to None (no privacy line: non-private runs).
        report_non_dp_statistics: bool. False drops every figure that ε does
            not cover, except the validation and held-out test sets', which
            a user asks for by holding them out, and the exact sizes of the
            splits, which the accounting needs (q = B/N).
        held_out: dict or None. Split name -> size, for the test and
            validation sets held out of the training data: private examples,
            whose figures are labelled and which `summary.json` names as
            unprotected. Defaults to None (none held out).
        duplicates_dropped: dict or None. Exact duplicates dropped, per
            split; in `summary.json` under `not_covered_by_epsilon`.
        data_preparation: dict or None. What was read: the examples of each
            split and the image files dropped as undecodable when the data
            was loaded (`summary.json`'s
            `not_covered_by_epsilon.data_preparation`: exact counts of
            private data). Defaults to None.
        adapted_state: list or None. The model's state set before training
            that ε does not cover (`tfdp.dp.adapted_state.as_records`);
            `summary.json`'s `not_covered_by_epsilon.adapted_state`.
            Defaults to None (none).
        start_step: int. The step training starts from (a resumed run's),
            for the ETA. Defaults to 0.
        progress_bar: bool or None. Redraw a progress bar with an ETA after
            every step. Defaults to None: on a terminal only (a log gets
            the periodic lines alone).
    """

    def __init__(self, out_dir, *, steps_per_epoch, total_steps, delta, ledger=None,
                 report_non_dp_statistics=True, held_out=None, duplicates_dropped=None,
                 data_preparation=None, adapted_state=None, start_step=0,
                 progress_bar=None):
        self.out_dir = out_dir
        self.data_preparation = dict(data_preparation or {})
        self.adapted_state = list(adapted_state or [])
        self.start_step = start_step
        self.progress_bar = sys.stdout.isatty() if progress_bar is None else progress_bar
        self.steps_per_epoch = steps_per_epoch
        self.total_steps = total_steps
        self.delta = delta
        self.ledger = ledger
        self.report_non_dp_statistics = report_non_dp_statistics
        self.held_out = dict(held_out or {})
        self.test_held_out = "test" in self.held_out
        self.duplicates_dropped = dict(duplicates_dropped or {})
        self.writer = (tf.summary.create_noop_writer() if out_dir is None else
                       tf.summary.create_file_writer(os.path.join(out_dir, "tensorboard")))
        self.test_metrics = {}
        self.non_dp_metrics = {}
        self.t_start = time.time()
        self._legend_shown = False

    def _legend(self):
        """Once, before the first line with a non-DP column: what the column is."""
        if not self._legend_shown:
            log(f"the figures after '{NON_DP_COLUMN}' are computed from private data without "
                f"noise: they are {NOT_COVERED.upper()}")
            self._legend_shown = True

    def _write_non_dp(self, step, values):
        with self.writer.as_default(step=step):
            for name, value in values.items():
                if math.isfinite(value):
                    tf.summary.scalar(f"{NON_DP_TAG_PREFIX}{name}", value)

    def eta(self, step):
        """The time left, from the pace since `start_step`; None before the first step."""
        done = step - self.start_step
        if done <= 0:
            return None
        return (time.time() - self.t_start) / done * max(self.total_steps - step, 0)

    def tick(self, step):
        """Redraws the terminal's progress bar after `step` (no-op off a terminal)."""
        global _bar_shown
        if not self.progress_bar:
            return
        width = 30
        filled = int(width * step / max(self.total_steps, 1))
        eta = self.eta(step)
        sys.stdout.write(
            f"\r  [{'#' * filled}{'.' * (width - filled)}] step {step}/{self.total_steps}"
            + ("" if eta is None else f"  ETA {duration(eta)}") + "\033[K")
        sys.stdout.flush()
        _bar_shown = True

    def progress(self, step, *, learning_rate, examples_per_second, stats):
        """The periodic progress line; `stats` is `PrivateTrainStep.pop_stats()`."""
        eta = self.eta(step)
        line = (f"  step {step}/{self.total_steps} "
                f"({step / max(self.total_steps, 1):.0%}"
                + ("" if eta is None else f", ETA {duration(eta)}") + ") "
                f"lr={learning_rate:.4g} {examples_per_second:.0f} ex/s")
        with self.writer.as_default(step=step):
            tf.summary.scalar("learning_rate", learning_rate)
        # Gradient norms and clipping are DP-SGD's: a non-private run has none.
        if self.report_non_dp_statistics and self.delta is not None:
            self._legend()
            line += (f" {NON_DP_COLUMN} grad_norm={stats['mean_grad_norm']:.3f} "
                     f"clipped={stats['clipped_fraction']:.0%}")
            self._write_non_dp(step, {k: stats[k] for k in
                                      ("mean_grad_norm", "clipped_fraction", "nonfinite")})
        log(line)
        if self.report_non_dp_statistics and self.delta is not None and stats["nonfinite"]:
            log(f"  warning ({NOT_COVERED}): {stats['nonfinite']:.0f} examples had "
                "non-finite gradients and were dropped from their steps")

    def evaluation(self, step, *, epsilon, test, validation=None, train=None,
                   skipped_test=0, skipped_train=None):
        """The end-of-epoch line and scalars.

        Args:
            step: int.
            epsilon: float. ε so far.
            test: dict. Test-set metrics (not covered by ε when the test
                set was held out of the training data).
            validation: dict or None. The held-out validation split's.
            train: dict or None. The training subset's (not covered by ε).
            skipped_test: int. Undecodable test images in this evaluation.
            skipped_train: int or None. Undecodable training images so far.
        """
        self.test_metrics = dict(test)
        test_shown = f"test_acc={test['accuracy']:.4f} test_loss={test['loss']:.4f}"
        with self.writer.as_default(step=step):
            if not self.test_held_out:
                for name, value in test.items():
                    tf.summary.scalar(f"test/{name}", value)
                tf.summary.scalar("test/skipped_undecodable", skipped_test)
            if math.isfinite(epsilon):
                tf.summary.scalar("privacy/epsilon", epsilon)
        privacy = f"epsilon={epsilon:.3f} (non-private)"
        if self.ledger is not None:
            privacy = self._write_relation(step, epsilon)
        line = (
            f"epoch {step / self.steps_per_epoch:5.2f} step {step}/{self.total_steps}: "
            f"{'' if self.test_held_out else test_shown + ' '}"
            f"{privacy} [{time.time() - self.t_start:.0f}s]"
        )
        non_dp = {}
        if self.test_held_out:
            non_dp.update({"test_" + k: v for k, v in test.items()})
            non_dp["skipped_undecodable_test"] = skipped_test
        non_dp.update({"validation_" + k: v for k, v in (validation or {}).items()})
        if train is not None:
            non_dp.update({"train_" + k: v for k, v in train.items()})
        if skipped_train is not None:
            non_dp["skipped_undecodable_train"] = skipped_train
        if non_dp:
            self.non_dp_metrics.update(non_dp)
            self._write_non_dp(step, non_dp)
            shown = [test_shown] if self.test_held_out else []
            shown += [f"val_acc={validation['accuracy']:.4f}"] if validation else []
            if train is not None:
                shown += [f"train_loss={train['loss']:.4f}", f"train_acc={train['accuracy']:.4f}"]
            if shown:
                self._legend()
                line += f" {NON_DP_COLUMN} " + " ".join(shown)
        log(line)
        if skipped_test:
            label = f" ({NOT_COVERED})" if self.test_held_out else ""
            log(f"  warning{label}: skipped {skipped_test} undecodable test images in this "
                "evaluation")
        if skipped_train:
            log(f"  warning ({NOT_COVERED}): skipped {skipped_train} undecodable training "
                "images so far (weight 0: no gradient)")

    def _write_relation(self, step, epsilon):
        """TensorBoard's relation text and replace-one ε; returns the console's ε."""
        replace_one = self.ledger.epsilon_replace_one(step)
        with self.writer.as_default(step=step):
            tf.summary.text("privacy/adjacency", self.ledger.describe_epsilon(epsilon, step))
            if replace_one is not None and math.isfinite(replace_one):
                tf.summary.scalar("privacy/epsilon_replace_one", replace_one)
        return self.ledger.describe_epsilon(epsilon, step, brief=True)

    def summary(self, *, epsilon, delta, steps, noise_multiplier, dataset_size,
                validation_size, privacy_guarantee, not_private=None, privacy_unit=None,
                bands=1, sampling_probability=None, duplicates_kept=None):
        """Writes `summary.json` (unless `out_dir` is None), prints the `final:` lines;
        returns the dict.

        Args:
            epsilon: float. ε spent.
            delta: float.
            steps: int. Steps taken.
            noise_multiplier: float.
            dataset_size: int. N: an exact count of private data, written
                under `not_covered_by_epsilon`.
            validation_size: int. Under `not_covered_by_epsilon` too.
            privacy_guarantee: str. What ε means, for `summary.json`; the
                figures and examples that it does not cover are added here.
            not_private: str or None. Why no ε holds although the run is
                private (an insecure reproducible seed); the `final:` lines
                with ε then start with "NOT PRIVATE". Defaults to None.
            privacy_unit: dict or None. The privacy unit's entries of
                `summary.json` (`privacy_unit`, and for users the
                group-privacy comparison). Defaults to None.
            bands: int. b of a banded matrix-factorization strategy; 1 for
                DP-SGD and non-private runs. Defaults to 1.
            sampling_probability: float or None. Each privacy unit's
                probability in a step it can be drawn in: B / N, and for
                b > 1 the rate within its group, b·B / N (the accounted q).
                Defaults to None.
            duplicates_kept: dict or None. Under `DataConfig.duplicates =
                'keep'`, the copies trained on and their group's (ε, δ)
                (`privacy_unit.kept_copies_summary`): counts of the private
                data, under `not_covered_by_epsilon`. Defaults to None.
        """
        if self.report_non_dp_statistics and self.duplicates_dropped:
            self.non_dp_metrics.update(
                {f"duplicates_dropped_{k}": v for k, v in self.duplicates_dropped.items()})
        if not_private is None and self.ledger is not None:
            privacy_guarantee = " ".join(filter(None, [
                privacy_guarantee.rstrip(".") + ".",
                "Not covered: the counts and figures under not_covered_by_epsilon, computed "
                "from the private data without noise"
                + (", and the model's state set before training that it lists under "
                   "adapted_state." if self.adapted_state else "."),
                held_out_warning(self.held_out),
            ]))
        summary = {
            "test_accuracy": self.test_metrics["accuracy"], "epsilon": epsilon, "delta": delta,
            "steps": steps, "noise_multiplier": noise_multiplier, "bands": bands,
            "sampling_probability": sampling_probability,
            "wall_time_s": time.time() - self.t_start,
            "privacy_guarantee": privacy_guarantee,
        }
        # Exact counts of the private data, released without noise: never
        # beside ε, whatever `report_non_dp_statistics` says.
        not_covered = {"dataset_size": dataset_size, "validation_size": validation_size}
        if self.data_preparation:
            not_covered["data_preparation"] = dict(self.data_preparation)
        if self.adapted_state:
            not_covered["adapted_state"] = list(self.adapted_state)
        if duplicates_kept:
            not_covered["duplicates_kept"] = dict(duplicates_kept)
        not_covered.update(self.non_dp_metrics)
        if self.ledger is not None:
            summary["adjacency"] = self.ledger.adjacency
            summary["adjacency_description"] = self.ledger.adjacency_description
            summary["epsilon_replace_one"] = self.ledger.epsilon_replace_one(steps)
            summary["privacy_unit"] = self.ledger.privacy_unit
        summary.update(privacy_unit or {})
        if self.test_held_out:
            del summary["test_accuracy"]  # Under not_covered_by_epsilon.
        if self.held_out:
            summary["held_out_not_protected"] = dict(self.held_out)
        summary["not_covered_by_epsilon"] = not_covered
        if self.out_dir is not None:
            with open(os.path.join(self.out_dir, "summary.json"), "w") as f:
                json.dump(summary, f, indent=2)
        self.writer.flush()
        if "validation_accuracy" in self.non_dp_metrics:
            log(f"final: validation_accuracy={self.non_dp_metrics['validation_accuracy']:.4f} "
                f"(N={validation_size}, held out from training, {NOT_COVERED}; tune on this)")
        prefix = f"NOT PRIVATE ({not_private}) " if not_private else ""
        if self.ledger is not None:
            replace_one = summary["epsilon_replace_one"]
            log(f"final: {prefix}epsilon={epsilon:.4f} at delta={delta:g} holds for "
                f"{self.ledger.adjacency} adjacency ({self.ledger.adjacency_description})"
                + ("" if replace_one is None else
                   f"; replace-one epsilon={replace_one:.4f} at delta={delta:g}"))
        test = f"test_accuracy={self.test_metrics['accuracy']:.4f} "
        if self.test_held_out:
            log(f"final: {test.strip()} (N={self.held_out['test']}, held out from training, "
                f"{NOT_COVERED})")
            test = ""
        if bands > 1:
            log(f"final: banded matrix factorization, bands={bands}, sampling probability "
                f"q={sampling_probability:.5f} within a group, "
                f"{-(-steps // bands)} rounds accounted")
        privacy = "(non-private)" if delta is None else f"delta={delta:g}"
        log(f"final: {prefix}{test}epsilon={epsilon:.4f} {privacy} steps={steps}")
        return summary


def make_run_reporter(out_dir, contract, state, data, *, adapted_state, report_non_dp_statistics):
    """The `RunReporter` of a run about to train.

    Args:
        out_dir: str or None. This worker's output directory; None writes
            no file (a non-chief worker).
        contract: `tfdp.training.run_contract.RunContract`. Steps, δ.
        state: `tfdp.training.resume.RunState`. The ledger and the step
            training starts from.
        data: `tfdp.training.run_data.RunData`. What was held out, dropped
            and prepared.
        adapted_state: list or None. `guards.check_adapted_state`'s records.
        report_non_dp_statistics: bool. As `RunConfig.report_non_dp_statistics`.
    """
    return RunReporter(
        out_dir, steps_per_epoch=contract.sampler.steps_per_epoch,
        total_steps=contract.total_steps,
        delta=contract.delta, ledger=state.ledger, start_step=state.start_step,
        report_non_dp_statistics=report_non_dp_statistics, held_out=data.held_out,
        duplicates_dropped=data.duplicates_dropped, data_preparation=data.preparation(),
        adapted_state=adapted_state)
