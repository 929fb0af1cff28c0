"""The shared check of a per-layer rule: equivalence with the naive loop."""

import numpy as np
import tensorflow as tf

from tests.dp import dp_test_case
from tfdp import dp
from tfdp.dp import layer_taps
from tfdp.dp import rules

TAPPED = ("ghost", "mixed", "bk")


def images(batch, size, channels=3, seed=0):
    """Random images with one large example, so that C at the median clips some."""
    x = np.random.default_rng(seed).normal(size=(batch, size, size, channels)).astype("float32")
    x[1] *= 5.0
    return tf.constant(x)


def weights(batch):
    """Ones, except a padding example (0) and a weighted one (2)."""
    w = np.ones(batch, "float32")
    w[2], w[3] = 0.0, 2.0
    return tf.constant(w)


class RuleTestCase(dp_test_case.DPTestCase):
    """`assert_rule_matches_naive`: the check every rule's test file makes."""

    def assert_rule_matches_naive(self, model, x, y, rule, loss_fn=dp_test_case.per_example_xent,
                                  methods=TAPPED + ("vectorized",), **kwargs):
        """`model` uses `rule` for some layer; every method equals the naive loop.

        Also checks that each tapped method bounds every example's
        contribution by C (`dp.check_sensitivity`).

        Args:
            model: keras.Model. Has at least one layer handled by `rule`.
            x: tensor. A batch of at least 4 inputs.
            y: tensor. Labels.
            rule: str. The rule's `name`.
            loss_fn: callable. Per-example loss. Defaults to cross-entropy.
            methods: sequence of str. Methods compared with "naive".
            **kwargs: passed to `assert_methods_match_naive` (e.g.
                `sample_weight`, `weight_decay`, `weight_decay_variables`).
        """
        rules.install_taps(model)
        used = {layer._tfdp_rule.name for layer in layer_taps.tapped_layers(model)}
        self.assertIn(rule, used)
        clip = self.assert_methods_match_naive(model, loss_fn, x, y, methods, **kwargs)
        decay = {k: v for k, v in kwargs.items() if k.startswith("weight_decay")}
        weights = kwargs.get("sample_weight")
        probe = (x[:4], y[:4], None if weights is None else weights[:4])
        for method in TAPPED:
            figure = dp.check_sensitivity(model, loss_fn, probe, clip, method, **decay)
            self.assertLessEqual(figure, 1.0 + 1e-4, msg=method)
