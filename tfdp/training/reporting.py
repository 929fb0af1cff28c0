"""`RunReporter`: what a training run tells its user, and how it is labelled.

The adversary of the guarantee sees everything a run prints or writes. So the
figures computed from private data without noise (the training loss and
accuracy, gradient norms, clip fractions, counts of non-finite and
undecodable training examples, and the held-out validation split's figures)
are kept apart from the test-set figures and ε, and labelled wherever they
appear:
- on the console, after `| not covered by epsilon:`;
- in TensorBoard, under the `non_dp/` tags (test figures under `test/`, ε
  under `privacy/epsilon`);
- in `summary.json`, under `not_covered_by_epsilon`.
"""

import json
import math
import os
import time

import tensorflow as tf

NOT_COVERED = "not covered by epsilon"
NON_DP_TAG_PREFIX = "non_dp/"


def log(message):
    """One console line, flushed (progress must show under pipes)."""
    print(message, flush=True)


def data_lines(notes, *, n, validation_size, test_size, info, class_counts,
               report_non_dp_statistics=True):
    """The data lines: N is public in the accounting (q = B/N); class counts are not."""
    log(f"data: {notes}")
    line = (f"data: train N={n} validation={validation_size} test={test_size} "
            f"classes={info.num_classes} input={tuple(info.image_shape)}")
    if report_non_dp_statistics:
        line += f" | {NOT_COVERED}: train examples per class {class_counts()}"
    log(line)


class RunReporter:
    """Console lines, TensorBoard scalars and `summary.json` of one run.

    Args:
        out_dir: str. Where `tensorboard/` and `summary.json` go.
        steps_per_epoch: float. For the epoch shown in each line.
        total_steps: int. For the "step s/T" shown in each line.
        delta: float. Shown beside ε.
        report_non_dp_statistics: bool. False drops every figure that ε does
            not cover, except the validation split's, which a user asks for
            by holding one out.
    """

    def __init__(self, out_dir, *, steps_per_epoch, total_steps, delta,
                 report_non_dp_statistics=True):
        self.out_dir = out_dir
        self.steps_per_epoch = steps_per_epoch
        self.total_steps = total_steps
        self.delta = delta
        self.report_non_dp_statistics = report_non_dp_statistics
        self.writer = tf.summary.create_file_writer(os.path.join(out_dir, "tensorboard"))
        self.test_metrics = {}
        self.non_dp_metrics = {}
        self.t_start = time.time()

    def _write_non_dp(self, step, values):
        with self.writer.as_default(step=step):
            for name, value in values.items():
                if math.isfinite(value):
                    tf.summary.scalar(f"{NON_DP_TAG_PREFIX}{name}", value)

    def progress(self, step, *, learning_rate, examples_per_second, stats):
        """The periodic progress line; `stats` is `PrivateTrainStep.pop_stats()`."""
        line = (f"  step {step}/{self.total_steps} lr={learning_rate:.4g} "
                f"{examples_per_second:.0f} ex/s")
        with self.writer.as_default(step=step):
            tf.summary.scalar("learning_rate", learning_rate)
        if self.report_non_dp_statistics:
            line += (f" | {NOT_COVERED}: grad_norm={stats['mean_grad_norm']:.3f} "
                     f"clipped={stats['clipped_fraction']:.0%}")
            self._write_non_dp(step, {k: stats[k] for k in
                                      ("mean_grad_norm", "clipped_fraction", "nonfinite")})
        log(line)
        if self.report_non_dp_statistics and stats["nonfinite"]:
            log(f"  warning ({NOT_COVERED}): {stats['nonfinite']:.0f} examples had "
                "non-finite gradients and were dropped from their steps")

    def evaluation(self, step, *, epsilon, test, validation=None, train=None,
                   skipped_test=0, skipped_train=None):
        """The end-of-epoch line and scalars.

        Args:
            step: int.
            epsilon: float. ε so far.
            test: dict. Test-set metrics.
            validation: dict or None. The held-out validation split's.
            train: dict or None. The training subset's (not covered by ε).
            skipped_test: int. Undecodable test images in this evaluation.
            skipped_train: int or None. Undecodable training images so far.
        """
        self.test_metrics = dict(test)
        with self.writer.as_default(step=step):
            for name, value in test.items():
                tf.summary.scalar(f"test/{name}", value)
            if math.isfinite(epsilon):
                tf.summary.scalar("privacy/epsilon", epsilon)
            tf.summary.scalar("test/skipped_undecodable", skipped_test)
        line = (
            f"epoch {step / self.steps_per_epoch:5.2f} step {step}/{self.total_steps}: "
            f"test_acc={test['accuracy']:.4f} test_loss={test['loss']:.4f} "
            f"epsilon={epsilon:.3f} (delta={self.delta}) [{time.time() - self.t_start:.0f}s]"
        )
        non_dp = {"validation_" + k: v for k, v in (validation or {}).items()}
        if train is not None:
            non_dp.update({"train_" + k: v for k, v in train.items()})
        if skipped_train is not None:
            non_dp["skipped_undecodable_train"] = skipped_train
        if non_dp:
            self.non_dp_metrics.update(non_dp)
            self._write_non_dp(step, non_dp)
            shown = [f"val_acc={validation['accuracy']:.4f}"] if validation else []
            if train is not None:
                shown += [f"train_loss={train['loss']:.4f}", f"train_acc={train['accuracy']:.4f}"]
            if shown:
                line += f" | {NOT_COVERED}: " + " ".join(shown)
        log(line)
        if skipped_test:
            log(f"  warning: skipped {skipped_test} undecodable test images in this evaluation")
        if skipped_train:
            log(f"  warning ({NOT_COVERED}): skipped {skipped_train} undecodable training "
                "images so far (weight 0: no gradient)")

    def summary(self, *, epsilon, delta, steps, noise_multiplier, dataset_size,
                validation_size, privacy_guarantee):
        """Writes `summary.json`, prints the `final:` lines; returns the dict."""
        summary = {
            "test_accuracy": self.test_metrics["accuracy"], "epsilon": epsilon, "delta": delta,
            "steps": steps, "noise_multiplier": noise_multiplier,
            "dataset_size": dataset_size, "validation_size": validation_size,
            "wall_time_s": time.time() - self.t_start,
            "privacy_guarantee": privacy_guarantee,
        }
        if self.non_dp_metrics:
            summary["not_covered_by_epsilon"] = dict(self.non_dp_metrics)
        with open(os.path.join(self.out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        self.writer.flush()
        if "validation_accuracy" in self.non_dp_metrics:
            log(f"final: validation_accuracy={self.non_dp_metrics['validation_accuracy']:.4f} "
                f"(N={validation_size}, held out from training, {NOT_COVERED}; tune on this)")
        log(f"final: test_accuracy={summary['test_accuracy']:.4f} epsilon={epsilon:.4f} "
            f"delta={delta:g} steps={steps}")
        return summary
