"""`Sampler`: which examples form each logical step, and what that costs.

A sampler is the one place that knows how a run's logical batches are drawn:
- its steps per epoch and expected batch size (the divisor of the noisy sum);
- the indices of step `s`, a pure function of the run's secret sampling key
  and `s` (so a resumed run sees the batches it would have seen);
- its DP event: what the accountant composes for a number of steps.

Everything else (the pipeline, the accountant, the ledger, the trainer, the
Keras path) asks the sampler and never branches on its name. Adding a
sampler is one module with one class, registered with `@register`.

Imports no TensorFlow at module level: `python -m tfdp.privacy` uses the
samplers' DP events without paying TensorFlow's import.
"""

import abc
import fractions
import math
import numbers

import dp_accounting

_REGISTRY = {}


def register(cls):
    """Class decorator: makes a `Sampler` subclass available by its `name`."""
    if not cls.name or cls.name in _REGISTRY:
        raise ValueError(f"A sampler needs a new, unique name. Received: name={cls.name!r}")
    _REGISTRY[cls.name] = cls
    return cls


def names():
    """The registered sampler names."""
    return tuple(_REGISTRY)


def sampler_class(name):
    """The registered class of `name`; a clear error for unknown names."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"Unknown sampler. Expected one of {names()}. Received: sampler={name!r}"
        ) from None


def resolve_name(requested, *, privacy_unit="example", bands=1):
    """The registered sampler a run draws with: the one place names are mapped.

    A run asks for a sampler by name (`"poisson"`, `"shuffle"`, ...), a
    privacy unit and a number of bands; the sampler that really draws its
    batches is the requested one's form for that unit (`user_form`: users
    sampled instead of examples) and, with `bands` > 1, its b-group form
    (`banded_form`: each unit's steps at least `bands` apart). Each sampler
    class declares its forms, so a new sampler adds no table here.

    Args:
        requested: str. A registered sampler name.
        privacy_unit: str. "example" or "user". Defaults to "example".
        bands: int. b of banded noise; 1 for DP-SGD. Defaults to 1.

    Returns:
        str: a registered sampler name.

    Raises:
        ValueError: for an unknown name, or a sampler with no form for the
            unit or the bands.
    """
    cls = sampler_class(requested)
    if privacy_unit not in ("example", "user"):
        raise ValueError(
            f"privacy_unit must be 'example' or 'user'. Received: privacy_unit={privacy_unit!r}")
    if privacy_unit != cls.privacy_unit:
        if cls.user_form is None:
            raise ValueError(
                "privacy_unit='user' draws users by Poisson sampling (sampler='poisson'); "
                f"sampler={requested!r} has no user-level form. Received: "
                f"sampler={requested!r}, privacy_unit={privacy_unit!r}")
        cls = sampler_class(cls.user_form)
    if positive_int("bands", bands) > 1:
        if cls.banded_form is None:
            raise ValueError(
                "bands > 1 samples each privacy unit in steps at least `bands` apart "
                "(Poisson sampling within b groups: sampler='poisson' or 'banded_poisson'); "
                f"sampler={requested!r} cannot. Received: sampler={requested!r}, "
                f"bands={bands!r}")
        cls = sampler_class(cls.banded_form)
    return cls.name


def positive_int(name, value):
    """`value` as an int, or a clear error unless it is a positive integer."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        if isinstance(value, float) and value.is_integer() and value >= 1:
            return int(value)
        raise ValueError(f"`{name}` must be a positive integer. Received: {name}={value!r}")
    return int(value)


class Sampler(abc.ABC):
    """How the examples of each logical step are drawn.

    Args:
        dataset_size: int. N, the training examples.
        logical_batch_size: int. B: expected (Poisson) or exact (shuffle)
            examples per logical step, over all hosts.
        physical_batch_size: int or None. P: examples per physical batch,
            per host. Defaults to the per-host logical batch.
        num_hosts: int. Input pipelines that share each step. Defaults to 1.
    """

    name = None
    # What one ε protects: "example" (one example's presence), or "user"
    # (everything one user contributed; `dataset_size` then counts users).
    privacy_unit = "example"
    # True when the DP event uses privacy amplification by sampling, which
    # needs batches drawn at random with a key the adversary does not know.
    amplified = False
    # Random access to any example by index is needed (else a stream works).
    needs_random_access = True
    # Every step holds exactly B examples (else the step sizes vary).
    fixed_size_steps = False
    # Two steps that can hold the same privacy unit are at least this many
    # steps apart: the bands a banded matrix-factorization strategy may have
    # (`tfdp.samplers.BandedPoissonSampler`). 1: any two steps.
    bands = 1
    # True for a sampler that takes a `bands` argument.
    takes_bands = False
    # The registered names of this sampler's user-level form and of its
    # b-group form, or None where there is none (`resolve_name`).
    user_form = None
    banded_form = None

    def __init__(self, dataset_size, logical_batch_size, physical_batch_size=None, num_hosts=1):
        self.dataset_size = positive_int("dataset_size", dataset_size)
        self.logical_batch_size = positive_int("logical_batch_size", logical_batch_size)
        self.num_hosts = positive_int("num_hosts", num_hosts)
        if physical_batch_size is None:
            physical_batch_size = max(self.logical_batch_size // self.num_hosts, 1)
        self.physical_batch_size = positive_int("physical_batch_size", physical_batch_size)
        if self.logical_batch_size > self.dataset_size:
            raise ValueError(
                "`logical_batch_size` must not exceed the dataset size. Received: "
                f"logical_batch_size={self.logical_batch_size}, dataset_size={self.dataset_size}"
            )
        self._validate()

    def _validate(self):
        """Subclass hook for further checks of the batch sizes."""

    @property
    def sampling_rate(self):
        """q = B / N."""
        return self.logical_batch_size / self.dataset_size

    @property
    @abc.abstractmethod
    def expected_batch_size(self):
        """The expected logical batch size: the public divisor of the noisy sum."""

    @property
    @abc.abstractmethod
    def steps_per_epoch(self):
        """Logical steps per pass over the data (a float where not whole)."""

    def steps_for_epochs(self, epochs):
        """`ceil(epochs × steps_per_epoch)`, formed exactly (no float rounding).

        A partial last step still touches data, so it counts as a step.
        """
        if isinstance(epochs, bool) or not isinstance(epochs, numbers.Real) or not (
            math.isfinite(epochs) and epochs > 0
        ):
            raise ValueError(f"`epochs` must be > 0. Received: epochs={epochs!r}")
        per_epoch = self.steps_per_epoch
        exact = fractions.Fraction(str(epochs)) * (
            fractions.Fraction(self.dataset_size, self.logical_batch_size)
            if isinstance(per_epoch, float) else per_epoch
        )
        return max(1, math.ceil(exact))

    @property
    def num_examples(self):
        """The examples of the source it draws from: N for example-level samplers."""
        return self.dataset_size

    @property
    def max_step_rows(self):
        """The most rows (real examples) one step can hold, over all hosts."""
        return self.dataset_size

    @property
    def group_size(self):
        """Rows of one privacy unit in a batch, clipped as one group: 1 per example."""
        return 1

    @property
    def physical_batches_per_step(self):
        """Physical batches per logical step, per host (expected, for random sizes)."""
        return self.expected_batch_size / self.num_hosts / self.physical_batch_size

    # ------------------------------------------------------------------
    # Accounting.
    # ------------------------------------------------------------------

    # The neighbouring relation the DP event is composed under (the
    # accountant's), and the name and words of the relation the printed ε
    # holds for. Every printer asks the sampler for these.
    neighboring_relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    adjacency = "add_or_remove_one"
    adjacency_description = "add or remove one example"
    # Where the bound is stated for a relation weaker than add/remove-one,
    # the replace-one ε is also reported: replacing one example moves the
    # unit event's sum by this many C, so it is the ε of the same run with
    # σ divided by it. None: no replace-one figure is reported.
    replace_one_sensitivity = None

    @abc.abstractmethod
    def unit_event(self, noise_multiplier):
        """The `DpEvent` of one unit of composition (a step, or a pass)."""

    @abc.abstractmethod
    def unit_count(self, steps):
        """How many units `steps` logical steps compose."""

    def dp_event(self, noise_multiplier, steps):
        """The `DpEvent` of `steps` logical steps with noise multiplier σ."""
        return dp_accounting.SelfComposedDpEvent(
            self.unit_event(noise_multiplier), self.unit_count(steps)
        )

    def replace_one_dp_event(self, noise_multiplier, steps):
        """The `DpEvent` of `steps` steps under replace-one adjacency, or None.

        None when the sampler reports no replace-one figure
        (`replace_one_sensitivity` is None).
        """
        if self.replace_one_sensitivity is None:
            return None
        return self.dp_event(noise_multiplier / self.replace_one_sensitivity, steps)

    @classmethod
    def supports_accountant(cls, accountant):
        """Whether `accountant` ("rdp" or "pld") can account this sampler."""
        del accountant
        return True

    # ------------------------------------------------------------------
    # Batches (TensorFlow, in the tf.data graph).
    # ------------------------------------------------------------------

    @abc.abstractmethod
    def step_indices(self, sampling_key, step, host=0, granule=None):
        """This host's share of step `step`.

        Args:
            sampling_key: int64 `[2]`. The run's secret sampling sub-key.
            step: int64 scalar tensor.
            host: int. This input pipeline's index.
            granule: int or None. A divisor of P: a step of random size is
                padded to a multiple of it only (the pipeline then makes its
                last physical batch smaller). Defaults to None (P).

        Returns:
            `(indices, weights)`: int64 `[L]` (-1 for padding) and float32
            `[L]` (1 real, 0 padding), L a positive multiple of the granule,
            the same on every host.
        """

    def ordered_step_indices(self, step, host=0):
        """This host's share of step `step` in the data's own order (no draw).

        Only samplers with fixed-size steps have an order to follow (Keras'
        `fit(shuffle=False)`); the others refuse.
        """
        raise ValueError(
            f"sampler={self.name!r} draws steps of random size and has no data order "
            "to follow. Use sampler='shuffle' for the data's own order.")

    def index_batches(self, sampling_key, steps, host=0, granule=None, ordered=False):
        """The physical batches of indices of the logical steps `steps`.

        The one place where a logical step's draw is cut into physical
        batches, for every route that reads rows by index (the trainer's
        random-access pipeline and Keras fit's arrays): P rows each, or
        fewer in a step's last batch where `granule` < P. A step's batches
        never mix with another step's.

        Args:
            sampling_key: int64 `[2]`. The run's secret sampling sub-key.
            steps: `tf.data.Dataset` of int64 scalars. The logical steps.
            host: int. This input pipeline's index.
            granule: int or None. As `step_indices`'. Defaults to None (P).
            ordered: bool. The data's own order (`ordered_step_indices`)
                instead of the secret draw. Defaults to `False`.

        Returns:
            A `tf.data.Dataset` of dicts: "step" (int64), "start" (int32, the
            batch's first row within the step), "step_rows" (int32, the
            step's rows on this host), "indices" (int64 `[n]`, -1 for
            padding), "weights" (float32 `[n]`, 0 for padding) and "last"
            (bool, True on the step's last batch).
        """
        import tensorflow as tf

        p = self.physical_batch_size
        key = tf.constant(sampling_key, tf.int64)

        def step_batches(step):
            if ordered:
                indices, weights = self.ordered_step_indices(step, host)
            else:
                indices, weights = self.step_indices(key, step, host, granule=granule)
            rows = tf.shape(indices)[0]
            count = (rows + p - 1) // p

            def physical_batch(chunk):
                start = tf.cast(chunk, tf.int32) * p
                window = slice(start, tf.minimum(start + p, rows))
                return {"step": step, "start": start, "step_rows": rows,
                        "indices": indices[window], "weights": weights[window],
                        "last": tf.greater_equal(start + p, rows)}

            return tf.data.Dataset.range(tf.cast(count, tf.int64)).map(
                tf.autograph.experimental.do_not_convert(physical_batch))

        return steps.flat_map(tf.autograph.experimental.do_not_convert(step_batches))

    def check_source(self, source):
        """Refuses a source this sampler cannot draw from, naming the fix."""
        if self.needs_random_access and not getattr(source, "random_access", False):
            raise ValueError(
                f"sampler={self.name!r} needs a random-access source (an ArraySource, "
                "an in-memory dataset, or a tfds dataset prepared with "
                "`--file_format=array_record`). For a streaming source use "
                "sampler='shuffle', accounted without amplification. "
                f"Received: {type(source).__name__}"
            )

    def with_hosts(self, num_hosts, physical_batch_size=None):
        """The same sampler split over `num_hosts` input pipelines."""
        return type(self)(self.dataset_size, self.logical_batch_size,
                          physical_batch_size or self.physical_batch_size, num_hosts)

    # ------------------------------------------------------------------

    def describe(self):
        """One line for logs."""
        return (f"sampler={self.name} N={self.dataset_size} B={self.logical_batch_size} "
                f"q={self.sampling_rate:.6g} steps/epoch={self.steps_per_epoch:.6g} "
                f"amplified={self.amplified} adjacency={self.adjacency}")

    def __repr__(self):
        return (f"{type(self).__name__}(dataset_size={self.dataset_size}, "
                f"logical_batch_size={self.logical_batch_size}, "
                f"physical_batch_size={self.physical_batch_size}, num_hosts={self.num_hosts})")

    def __eq__(self, other):
        return type(self) is type(other) and repr(self) == repr(other)

    def __hash__(self):
        return hash(repr(self))


def make_sampler(sampler, *, dataset_size, logical_batch_size, physical_batch_size=None,
                 num_hosts=1, **options):
    """A `Sampler` from a registered name (or a `Sampler`, returned as is).

    Args:
        sampler: str or `Sampler`. E.g. "poisson" or "shuffle".
        dataset_size, logical_batch_size, physical_batch_size, num_hosts:
            see `Sampler`.
        **options: the sampler's own keyword arguments (e.g. `user_ids`
            and `max_examples_per_user` of "user_poisson").
    """
    if isinstance(sampler, Sampler):
        return sampler
    return sampler_class(sampler)(
        dataset_size, logical_batch_size, physical_batch_size, num_hosts, **options
    )


def for_accounting(sampler, sampling_rate, dataset_size=None, batch_size=None, **options):
    """A sampler for accounting only, from q, or from N and B.

    Given only q, N and B are the exact integer ratio of q: the events
    depend on them through B / N (and N // B) only.

    Args:
        sampler: str or `Sampler` (returned as is).
        sampling_rate: float. q = B / N.
        dataset_size, batch_size: int or None. N and B.
        **options: the sampler's own keyword arguments that its event
            depends on (e.g. `bands` of "banded_poisson").
    """
    if isinstance(sampler, Sampler):
        return sampler
    if dataset_size is None or batch_size is None:
        batch_size, dataset_size = float(sampling_rate).as_integer_ratio()
    return sampler_class(sampler)(dataset_size, batch_size, 1, **options)
