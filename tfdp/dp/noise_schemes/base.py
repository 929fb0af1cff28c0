"""`NoiseScheme`: the noise a logical step releases, its state and its accounting.

A noise scheme is the one place that knows, for one way of noising the
summed clipped gradients:
- the noise of a logical step: a pure function of the run's secret noise
  key, the step, the shapes and this replica's share of the std (σC / R), and
  of the scheme's state where it has one;
- its state across steps: its shape per variable, its initial value, and
  whether it belongs in the training checkpoints;
- its accounting options: what `tfdp.privacy.noise_accounting`, where each
  scheme's accounting is written without TensorFlow, needs of it to form
  the DP event of a number of steps (`accounting_options`).

`tfdp.dp.NoisyAggregator` owns the rest of the step (accumulating, the
replicas' split of the std, an empty step, the divisor) and asks its scheme
for the noise; it never branches on the scheme. Adding a scheme is one
module in this package with one subclass, registered with `@register`
(importing the package imports every module in it), and its accounting
registered in `tfdp.privacy.noise_accounting`.
"""

import abc

import tensorflow as tf

from tfdp import validation
from tfdp.dp import noise as noise_lib
from tfdp.privacy import noise_accounting

_REGISTRY = {}


def register(cls):
    """Class decorator: makes a `NoiseScheme` subclass available by its `name`.

    Args:
        cls: a `NoiseScheme` subclass with a class attribute `name`.

    Returns:
        `cls`.

    Raises:
        ValueError: if `cls` is no `NoiseScheme`, its name is empty or taken,
            or no accounting is registered for it
            (`tfdp.privacy.noise_accounting.register`).
    """
    if not (isinstance(cls, type) and issubclass(cls, NoiseScheme)):
        raise ValueError(f"Only a NoiseScheme subclass can be registered. Received: {cls!r}")
    if not cls.name or cls.name in _REGISTRY:
        raise ValueError(f"A noise scheme needs a new, unique name. Received: name={cls.name!r}")
    if cls.name not in noise_accounting.names():
        raise ValueError(
            "A noise scheme needs its accounting, registered in "
            "tfdp.privacy.noise_accounting under the same name. Received: "
            f"name={cls.name!r}")
    _REGISTRY[cls.name] = cls
    return cls


def names():
    """The registered noise scheme names."""
    return tuple(_REGISTRY)


def scheme_class(name):
    """The registered class of `name`.

    Args:
        name: str. A registered noise scheme's name.

    Returns:
        A `NoiseScheme` subclass.

    Raises:
        ValueError: for a name no scheme registered.
    """
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"Unknown noise scheme. Expected one of {names()}. Received: scheme={name!r}"
        ) from None


class NoiseScheme(abc.ABC):
    """One way of noising a logical step's summed clipped gradients.

    Subclasses set `name`, implement `noise` and, where they keep a state or
    take options, override `state_shape` and `from_options`. A subclass
    draws its noise with `tfdp.dp.noise`'s functions, passing them
    `hardened_noise`, and combines the draws in their dtype (float64 when
    hardened), so that `noisy_mean` rounds once.

    Args:
        hardened_noise: bool. Draw and release the hardened noise
            (`tfdp.dp.noise`, docs/PRIVACY.md "Floating-point noise").
            Defaults to `False`.
    """

    name = None
    # Whether the state belongs in the training checkpoints: a resumed run
    # must continue it to release the same noise. The trainer saves the
    # state it keeps (`tfdp.checkpointing.RunCheckpoint(noise_state=...)`);
    # the Keras route keeps it in memory only. Never in a model or optimizer
    # save: a state of past noise is as secret as the key.
    checkpoint_state = False

    def __init__(self, *, hardened_noise=False):
        self.hardened_noise = validation.validate_hardened_noise(hardened_noise)

    @classmethod
    def from_options(cls, *, coefficients=(1.0,), tree=None, leaves_per_step=1,
                     hardened_noise=False):
        """The scheme for `NoisyAggregator`'s noise options.

        A scheme that takes none of them (the default) refuses any that is
        not its default, rather than ignore it. Every scheme takes
        `hardened_noise`.

        Args:
            coefficients: tuple of floats. A banded strategy's c_0 … c_{b-1}.
                Defaults to `(1.0,)`.
            tree: `tfdp.privacy.tree_aggregation.TreeRestarts` or None.
                Defaults to `None`.
            leaves_per_step: int. Tree leaves per step. Defaults to `1`.
            hardened_noise: bool. As the constructor's. Defaults to `False`.

        Returns:
            A `NoiseScheme`.

        Raises:
            ValueError: if an option is given that the scheme does not take.
        """
        if tuple(coefficients) != (1.0,) or tree is not None or leaves_per_step != 1:
            raise ValueError(
                f"The {cls.name!r} noise scheme takes no coefficients, tree or "
                f"leaves_per_step. Received: coefficients={coefficients!r}, tree={tree!r}, "
                f"leaves_per_step={leaves_per_step!r}")
        return cls(hardened_noise=hardened_noise)

    @property
    def has_state(self):
        """Whether the noise depends on earlier steps' noise, kept in a state."""
        return self.state_shape([]) is not None

    def state_shape(self, shape):
        """The shape of the state of one variable of `shape`, or None without a state.

        Args:
            shape: list of ints (or a `TensorShape`). The variable's shape.

        Returns:
            list of ints, or None.
        """
        del shape  # No state.
        return None

    def initial_state(self, shape):
        """The state of one variable of `shape` before the first step (float32), or None.

        Args:
            shape: list of ints (or a `TensorShape`). The variable's shape.

        Returns:
            A float32 tensor of `state_shape(shape)`, or None without a state.
        """
        state_shape = self.state_shape(shape)
        return None if state_shape is None else tf.zeros(state_shape, tf.float32)

    @abc.abstractmethod
    def noise(self, like, *, stddev, noise_key, step, state=None):
        """The noise of one logical step, shaped like each tensor of `like`.

        On R replicas each replica adds its share of one common draw: the
        same key and step, with `stddev` σC / R, so that the replicas' sum
        holds the scheme's noise once.

        Args:
            like: list of float tensors. The step's sums: only their static
                shapes and dtypes are used.
            stddev: float. σC / R, this replica's share of the std.
            noise_key: int64 tensor `[2]`. The run's secret noise sub-key.
            step: int scalar (tensor). The 0-based logical step.
            state: list of float variables or None. With a state, one per
                tensor of `like`, shaped by `state_shape`; read and advanced
                here. Defaults to `None`.

        Returns:
            A list of tensors, one per tensor of `like`: float64 with
            `hardened_noise`, else in the dtypes of `like`.
        """

    def noisy_mean(self, sums, *, stddev, noise_key, step, divisor, state=None):
        """`(sums + noise) / divisor`, tensor by tensor (`tfdp.dp.noise.release`).

        With `hardened_noise`, added in float64 on the hardened grid and
        rounded once to the sums' dtypes.

        Args:
            sums: list of float tensors. The step's summed clipped gradients.
            stddev, noise_key, step, state: as `noise`'s.
            divisor: float. B, the public expected batch size.

        Returns:
            A list of tensors like `sums`.
        """
        noise = self.noise(sums, stddev=stddev, noise_key=noise_key, step=step, state=state)
        return noise_lib.release(sums, noise, stddev, divisor, self.hardened_noise)

    def accounting_options(self):
        """What the scheme's accounting needs of it (`tfdp.privacy.noise_accounting`).

        Returns:
            dict: keyword arguments of `SchemeAccounting.dp_event`; none by
            default.
        """
        return {}

    def dp_event(self, sampler, noise_multiplier, steps):
        """The `DpEvent` of `steps` logical steps drawn by `sampler`.

        The scheme's registered accounting (`tfdp.privacy.noise_accounting`),
        the one the ledger uses: e.g. the sampler's own event for DP-SGD.

        Args:
            sampler: `tfdp.samplers.Sampler`. How the steps were drawn.
            noise_multiplier: float. σ.
            steps: int. Logical steps released.

        Returns:
            A `dp_accounting.DpEvent`.
        """
        return noise_accounting.dp_event(self.name, sampler, noise_multiplier, steps,
                                         **self.accounting_options())

    def __repr__(self):
        return f"{type(self).__name__}({'hardened_noise=True' if self.hardened_noise else ''})"
