"""An exponential moving average of the parameters, for evaluation.

Averaging iterates is post-processing of the private updates, so it costs no
privacy (De et al. 2022 found it one of the largest accuracy levers).
"""

import contextlib

import tensorflow as tf


class ParameterEMA(tf.Module):
    """EMA of a list of variables; checkpointable (it is a tf.Module).

    Args:
        variables: list of variables. The parameters to average.
        decay: float. EMA decay in [0, 1). Defaults to 0.999.
    """

    def __init__(self, variables, decay=0.999):
        super().__init__(name="parameter_ema")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1). Received: decay={decay}")
        self.decay = float(decay)
        self._targets = list(variables)
        self.averages = [
            tf.Variable(tf.convert_to_tensor(v), trainable=False, name="ema") for v in self._targets
        ]
        self._update = tf.function(self._update_fn)

    def _update_fn(self):
        for average, v in zip(self.averages, self._targets):
            average.assign(self.decay * average + (1.0 - self.decay) * tf.convert_to_tensor(v))

    def update(self):
        """Moves the averages one step towards the current parameters."""
        self._update()

    @contextlib.contextmanager
    def swapped(self):
        """Temporarily loads the averages into the parameters."""
        saved = [tf.convert_to_tensor(v) for v in self._targets]
        for v, average in zip(self._targets, self.averages):
            v.assign(average)
        try:
            yield
        finally:
            for v, value in zip(self._targets, saved):
                v.assign(value)

    def copy_to_parameters(self):
        """Loads the averages into the parameters for good (final export)."""
        for v, average in zip(self._targets, self.averages):
            v.assign(average)
