"""The guarantee against an adversary who knows everything but the data and
the secret key: secret randomness, safe resume, labelled non-DP figures.

Each test runs `python -m tfdp.train` as a user would.
"""

import pytest
import glob
import json
import os
import shutil

import numpy as np
import tensorflow as tf

from tests.test_train import FINAL
from tests.test_train import run_train
from tfdp import checkpointing

TINY = [
    "--gin_param=DataConfig.dataset = 'digits'",
    "--gin_param=OptimizationConfig.epochs = 1",
    "--gin_param=OptimizationConfig.logical_batch_size = 128",
    "--gin_param=RunConfig.physical_batch_size = 64",
    "--gin_param=PrivacyConfig.noise_multiplier = 1.0",
    "--gin_param=PrivacyConfig.target_epsilon = None",
    "--gin_param=RunConfig.log_every_steps = 5",
]
NON_PRIVATE = ["--gin_param=PrivacyConfig.private = False"]


def _model_weights(workdir):
    path = tf.train.latest_checkpoint(os.path.join(workdir, "checkpoints"))
    reader = tf.train.load_checkpoint(path)
    return {
        name: reader.get_tensor(name)
        for name in reader.get_variable_to_shape_map()
        if "_trainable_variables/" in name and name.endswith("VARIABLE_VALUE")
    }


def _key_patterns(key):
    """Every encoding of the key's and its sub-keys' words a file might hold."""
    words = list(key.words) + list(key.derive("noise")) + list(key.derive("sampling"))
    patterns = []
    for w in words:
        w = np.int64(w)
        unsigned = int(w.view(np.uint64))
        patterns += [w.tobytes(), w.byteswap().tobytes()]
        patterns += [s.encode() for s in (str(int(w)), str(unsigned), f"{unsigned:x}")]
    return patterns


def _files_holding(root, patterns, skip_dir=None):
    found = []
    for path in glob.glob(os.path.join(root, "**", "*"), recursive=True):
        if not os.path.isfile(path) or (skip_dir and path.startswith(skip_dir + os.sep)):
            continue
        with open(path, "rb") as f:
            data = f.read()
        found += [(path, p) for p in patterns if p in data]
    return found


class SecretRandomnessTest(tf.test.TestCase):

    @pytest.mark.slow
    def test_two_runs_differ_and_the_key_stays_in_the_checkpoints(self):
        workdirs = [self.create_tempdir().full_path for _ in range(2)]
        for workdir in workdirs:
            result = run_train(*TINY, "--seed=0", workdir=workdir)
            self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        first, second = (_model_weights(w) for w in workdirs)
        self.assertNotEmpty(first)
        differ = [n for n in first if not np.array_equal(first[n], second[n])]
        self.assertNotEmpty(differ, "same --seed gave bit-identical weights: the noise is public")

        workdir = workdirs[0]
        _, _, key = checkpointing.read_latest(os.path.join(workdir, "checkpoints"))
        self.assertTrue(key.is_secret)
        self.assertNotEqual(key, checkpointing.read_latest(
            os.path.join(workdirs[1], "checkpoints"))[2])
        patterns = _key_patterns(key)
        ckpt_dir = os.path.join(workdir, "checkpoints")
        # The search can find the key: the checkpoint holds it.
        self.assertNotEmpty(_files_holding(ckpt_dir, patterns[:2]))
        # Nothing else the run wrote does: model.keras, the SavedModel, gin
        # configs, summary.json, TensorBoard events.
        self.assertTrue(os.path.isfile(os.path.join(workdir, "model.keras")))
        self.assertEqual(_files_holding(workdir, patterns, skip_dir=ckpt_dir), [])

    @pytest.mark.slow
    def test_insecure_seed_reproduces_and_says_so(self):
        args = [*TINY, "--gin_param=PrivacyConfig.insecure_reproducible_seed = 4",
                "--gin_param=RunConfig.export_model = False"]
        weights = []
        for _ in range(2):
            workdir = self.create_tempdir().full_path
            result = run_train(*args, workdir=workdir)
            self.assertEqual(result.returncode, 0, result.stderr[-3000:])
            self.assertIn("WARNING: INSECURE", result.stdout)
            with open(os.path.join(workdir, "summary.json")) as f:
                self.assertIn("DOES NOT HOLD", json.load(f)["privacy_guarantee"])
            weights.append(_model_weights(workdir))
        for name, value in weights[0].items():
            self.assertAllClose(value, weights[1][name], rtol=1e-5, atol=1e-6)

    @pytest.mark.slow
    def test_resumed_run_continues_with_the_same_key(self):
        args = [*TINY, "--gin_param=OptimizationConfig.epochs = 2",
                "--gin_param=RunConfig.checkpoint_every_steps = 4",
                "--gin_param=RunConfig.export_model = False"]
        uninterrupted = self.create_tempdir().full_path
        result = run_train(*args, workdir=uninterrupted)
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        reference = FINAL.search(result.stdout)
        ckpt_dir = os.path.join(uninterrupted, "checkpoints")
        _, _, key = checkpointing.read_latest(ckpt_dir)

        # A copy rewound to step 16 of 23 resumes with the same key, so it
        # retraces the same noise and batches to the same model.
        resumed = self.create_tempdir().full_path
        shutil.copytree(ckpt_dir, os.path.join(resumed, "checkpoints"))
        with open(os.path.join(resumed, "checkpoints", "checkpoint"), "w") as f:
            f.write('model_checkpoint_path: "ckpt-16"\nall_model_checkpoint_paths: "ckpt-16"\n')
        result = run_train(*args, workdir=resumed)
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        self.assertIn("resumed from", result.stdout)
        self.assertIn("ckpt-16", result.stdout)
        again = FINAL.search(result.stdout)
        self.assertEqual(again["steps"], reference["steps"])
        self.assertEqual(again["eps"], reference["eps"])
        self.assertEqual(checkpointing.read_latest(os.path.join(resumed, "checkpoints"))[2], key)
        final, want = _model_weights(resumed), _model_weights(uninterrupted)
        for name, value in want.items():
            self.assertAllClose(final[name], value, rtol=1e-4, atol=1e-5)


class ResumeRefusalTest(tf.test.TestCase):

    def _refused(self, first, *refusals):
        """Trains `first`; then each `(args, expected)` of `refusals` is refused."""
        workdir = self.create_tempdir().full_path
        result = run_train(*first, "--gin_param=RunConfig.export_model = False", workdir=workdir)
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        for second, expected in refusals:
            with self.subTest(expected=expected):
                result = run_train(*second, workdir=workdir)
                self.assertEqual(result.returncode, 2, result.stdout[-2000:])
                errors = [l for l in result.stderr.splitlines() if l.startswith("error:")]
                self.assertLen(errors, 1, result.stderr[-2000:])
                self.assertRegex(errors[0], expected)
                self.assertIn("new --workdir or delete", errors[0])
                self.assertNotIn("Traceback", result.stderr)
                self.assertNotIn("final:", result.stdout)

    @pytest.mark.slow
    def test_private_run_refuses_a_non_private_checkpoint(self):
        # The repro: the private run used to resume the non-private
        # model, train nothing and print epsilon=0.
        self._refused([*TINY, *NON_PRIVATE], (TINY, "written by a non-private run"))

    @pytest.mark.slow
    def test_non_private_run_refuses_a_private_checkpoint(self):
        self._refused(TINY, ([*TINY, *NON_PRIVATE], "written by a private run"))

    @pytest.mark.slow
    def test_any_change_of_privacy_parameters_or_key_is_refused(self):
        changes = [
            ("PrivacyConfig.l2_norm_clip = 2.0", "l2_norm_clip"),
            ("PrivacyConfig.noise_multiplier = 1.5", "noise_multiplier"),
            ("PrivacyConfig.delta = 1e-6", "delta"),
            ("PrivacyConfig.sampler = 'shuffle'", "sampler"),
            ("OptimizationConfig.logical_batch_size = 64", "sampling_rate"),
            ("PrivacyConfig.insecure_reproducible_seed = 1", "secret key.*insecure seed 1"),
        ]
        self._refused(TINY, *[([*TINY, f"--gin_param={binding}"], expected)
                              for binding, expected in changes])


class NonDpStatisticsTest(tf.test.TestCase):

    def _tags(self, workdir):
        tags = set()
        for path in glob.glob(os.path.join(workdir, "tensorboard", "events.*")):
            for event in tf.compat.v1.train.summary_iterator(path):
                tags.update(v.tag for v in event.summary.value)
        return tags

    @pytest.mark.slow
    def test_labelled_where_they_appear_and_one_switch_turns_them_off(self):
        workdir = self.create_tempdir().full_path
        result = run_train(*TINY, "--gin_param=RunConfig.export_model = False", workdir=workdir)
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        lines = result.stdout.splitlines()
        legend = [i for i, line in enumerate(lines) if "'| non-DP:'" in line]
        self.assertLen(legend, 1)  # Explained once, before the column's first use.
        self.assertIn("NOT COVERED BY EPSILON", lines[legend[0]])
        for i, line in enumerate(lines):
            for name in ("train_acc", "train_loss", "grad_norm", "clipped="):
                if name in line:
                    self.assertGreater(i, legend[0])
                    self.assertIn("| non-DP:", line)
                    self.assertLess(line.index("| non-DP:"), line.index(name))
        self.assertIn("train_acc=", result.stdout)
        with open(os.path.join(workdir, "summary.json")) as f:
            summary = json.load(f)
        self.assertIn("train_accuracy", summary["not_covered_by_epsilon"])
        self.assertNotIn("train_accuracy", summary)
        # The default (Poisson) route: add/remove-one, no replace-one figure.
        self.assertEqual(summary["adjacency"], "add_or_remove_one")
        self.assertIsNone(summary["epsilon_replace_one"])
        self.assertIn("add_or_remove_one adjacency", result.stdout)
        tags = self._tags(workdir)
        self.assertIn("privacy/adjacency", tags)
        self.assertIn("non_dp/train_accuracy", tags)
        self.assertIn("non_dp/clipped_fraction", tags)
        self.assertIn("test/accuracy", tags)
        self.assertIn("privacy/epsilon", tags)
        untagged = {t for t in tags if any(s in t for s in ("train_", "grad_norm", "clipped"))}
        self.assertEqual({t for t in untagged if not t.startswith("non_dp/")}, set())

        workdir = self.create_tempdir().full_path
        result = run_train(*TINY, "--gin_param=RunConfig.export_model = False",
                           "--gin_param=RunConfig.report_non_dp_statistics = False",
                           workdir=workdir)
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        for text in ("train_acc", "grad_norm", "clipped=", "per class", "non-DP"):
            self.assertNotIn(text, result.stdout)
        # The sizes of the splits stay (the accounting needs N), labelled.
        self.assertRegex(result.stdout, r"(?m)^data: train N=\d+ .* \| not covered by "
                                        r"epsilon: these exact counts$")
        with open(os.path.join(workdir, "summary.json")) as f:
            not_covered = json.load(f)["not_covered_by_epsilon"]
        self.assertEqual(set(not_covered),
                         {"dataset_size", "validation_size", "data_preparation"})
        self.assertEqual({t for t in self._tags(workdir) if t.startswith("non_dp/")}, set())
        self.assertIsNotNone(FINAL.search(result.stdout))


class RelationTest(tf.test.TestCase):
    """The shuffle route prints zero-out adjacency and the replace-one ε."""

    def test_shuffle_run_states_zero_out_and_replace_one(self):
        workdir = self.create_tempdir().full_path
        result = run_train(*TINY, "--gin_param=RunConfig.export_model = False",
                           "--gin_param=PrivacyConfig.sampler = 'shuffle'",
                           "--gin_param=RunConfig.report_non_dp_statistics = False",
                           workdir=workdir)
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        with open(os.path.join(workdir, "summary.json")) as f:
            summary = json.load(f)
        self.assertEqual(summary["adjacency"], "zero_out")
        self.assertGreater(summary["epsilon_replace_one"], summary["epsilon"])
        self.assertIn("zero_out", summary["privacy_guarantee"])
        epoch_lines = [line for line in result.stdout.splitlines() if line.startswith("epoch ")]
        self.assertNotEmpty(epoch_lines)
        for line in epoch_lines + [line for line in result.stdout.splitlines()
                                   if line.startswith("privacy:")]:
            # The privacy line describes the relation; the epoch lines name it.
            self.assertRegex(line, r"epsilon=\S+ at delta=1e-05 \(zero_out adjacency[:;].*"
                                   r"replace-one epsilon=")
        self.assertRegex(result.stdout, r"(?m)^final: epsilon=\S+ at delta=1e-05 holds for "
                                        r"zero_out adjacency \(.*\); replace-one epsilon=")


if __name__ == "__main__":
    tf.test.main()
