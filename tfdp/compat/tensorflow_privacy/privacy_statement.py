"""TF-Privacy's `compute_dp_sgd_privacy_statement` and `compute_dp_sgd_privacy`.

Both figures of the statement are RDP bounds from `dp_accounting`'s
`RdpAccountant` with its default orders (as TF-Privacy 0.9), for
add-or-remove-one adjacency:

- "each example occurring once per epoch": each epoch releases a Gaussian
  mechanism on the example (no subsampling amplification), composed over
  `ceil(num_epochs)` epochs. This holds whatever the data order.
- "assuming Poisson sampling": the Poisson-subsampled Gaussian with
  `q = batch_size / number_of_examples`, composed over
  `ceil(num_epochs / q)` steps. It holds only if batches really are Poisson
  samples, which is what `tfdp.data`'s Poisson sampler does.

With `used_microbatching=True` (TF-Privacy's default) the noise multiplier
is halved: one example changes its microbatch's clipped mean gradient by up
to 2C under add/remove adjacency. With `max_examples_per_user=k`, a
user-level epsilon follows by group privacy (Vadhan 2017, Lemma 2.2), with
the example-level delta found by a line search.
"""

import logging
import math
import textwrap

import dp_accounting

from tfdp import privacy
from tfdp import validation

# TF-Privacy's `compute_dp_sgd_privacy` orders (not dp_accounting's defaults).
_LEGACY_ORDERS = (
    [1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 3.5, 4.0, 4.5] + list(range(5, 64)) + [128, 256, 512]
)


class PrivacyStatement(str):
    """TF-Privacy's privacy statement text, with its figures as attributes.

    It is a `str` (print it, or compare it), and also carries:

    Attributes:
        epsilon_once_per_epoch: float. Example-level epsilon with each
            example occurring once per epoch (any data order).
        epsilon_poisson: float. Example-level epsilon assuming Poisson
            sampling.
        user_epsilon_once_per_epoch: float or None. User-level epsilon
            (given `max_examples_per_user`), once per epoch.
        user_epsilon_poisson: float or None. User-level epsilon assuming
            Poisson sampling.
    """

    epsilon_once_per_epoch = None
    epsilon_poisson = None
    user_epsilon_once_per_epoch = None
    user_epsilon_poisson = None


def _example_epsilon(num_epochs, noise_multiplier, delta, used_microbatching, q=None):
    """Example-level epsilon, add-or-remove-one, as TF-Privacy computes it."""
    if num_epochs <= 0:
        raise ValueError(f"num_epochs must be > 0. Received: num_epochs={num_epochs}")
    validation.validate_noise_multiplier(noise_multiplier)
    if not 0 <= delta <= 1:
        raise ValueError(f"delta must be in [0, 1]. Received: delta={delta}")
    sigma = noise_multiplier / 2 if used_microbatching else noise_multiplier
    if q is None:
        # One unamplified Gaussian per epoch: a Poisson rate of 1 is exactly
        # the Gaussian mechanism in dp_accounting's RDP.
        steps, q = int(math.ceil(num_epochs)), 1.0
    else:
        steps = int(math.ceil(num_epochs / q))
    if sigma == 0:
        return math.inf
    if delta == 0:
        return math.inf
    if delta == 1:
        return 0.0
    return privacy.epsilon(sigma, steps, delta, sampling_rate=q, sampler="poisson")


def _logexpm1(x):
    return x + math.log(-math.expm1(-x))


def _user_epsilon(num_epochs, noise_multiplier, user_delta, max_examples_per_user,
                  used_microbatching, q=None):
    """User-level epsilon by group privacy (Vadhan 2017, Lemma 2.2).

    Finds the example-level delta whose group-privacy delta for k examples is
    `user_delta` (bisection in log delta), then returns k * example epsilon.
    """
    k = max_examples_per_user
    if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
        raise ValueError(
            "max_examples_per_user must be a positive int. "
            f"Received: max_examples_per_user={k!r}"
        )
    if not 0 <= user_delta <= 1:
        raise ValueError(f"delta must be in [0, 1]. Received: delta={user_delta}")
    if k == 1:
        return _example_epsilon(num_epochs, noise_multiplier, user_delta, used_microbatching, q)
    target = math.log(user_delta)
    cache = {}

    def example_eps(log_delta):
        if log_delta not in cache:
            cache[log_delta] = _example_epsilon(
                num_epochs, noise_multiplier, math.exp(log_delta), used_microbatching, q
            )
        return cache[log_delta]

    def gap(log_delta):
        eps = example_eps(log_delta)
        # The bound in the last line of Lemma 2.2's proof:
        # user_delta = delta * (e^{k eps} - 1) / (e^{eps} - 1).
        return log_delta + _logexpm1(k * eps) - _logexpm1(eps) - target

    # gap increases with the example delta; bracket the root from below.
    high = target
    low = high - math.log(10)
    gap_low = gap(low)
    while gap_low > 0:
        high = low - gap_low
        low = high - math.log(10)
        gap_low = gap(low)
        if not math.isfinite(gap_low):
            logging.warning(
                "No finite user-level epsilon with %d examples per user.", k
            )
            return math.inf
    low -= gap_low
    for _ in range(200):
        mid = 0.5 * (low + high)
        if gap(mid) > 0:
            high = mid
        else:
            low = mid
        if high - low < 1e-12:
            break
    return k * example_eps(0.5 * (low + high))


def _fill(text):
    return textwrap.fill(text, width=80)


def compute_dp_sgd_privacy_statement(
    number_of_examples,
    batch_size,
    num_epochs,
    noise_multiplier,
    delta,
    used_microbatching=True,
    max_examples_per_user=None,
):
    """TF-Privacy's privacy statement of a DP-SGD run, with the same figures.

    ```python
    statement = compute_dp_sgd_privacy_statement(
        number_of_examples=60000, batch_size=256, num_epochs=60,
        noise_multiplier=1.1, delta=1e-5, used_microbatching=False)
    print(statement)
    statement.epsilon_once_per_epoch, statement.epsilon_poisson  # 56.95..., 2.59...
    ```

    Args:
        number_of_examples: int. N, the training set size.
        batch_size: int. Examples per step, however they are grouped into
            microbatches.
        num_epochs: float. Passes over the data; may be fractional.
        noise_multiplier: float. Noise std over the clipping norm per step.
        delta: float. Target delta.
        used_microbatching: bool. Whether microbatches of more than one
            example were clipped (doubles the sensitivity). Defaults to
            `True`, as in TF-Privacy; tfdp's own training clips per example,
            so pass `False` for it.
        max_examples_per_user: int or None. With a bound, a user-level
            guarantee is added. Defaults to `None`.

    Returns:
        A `PrivacyStatement`: the statement text (a `str`), with
        `.epsilon_once_per_epoch` and `.epsilon_poisson` (and the user-level
        figures, or None).
    """
    q = batch_size / number_of_examples
    micro = "with" if used_microbatching else "without"
    head = (
        f"DP-SGD performed over {number_of_examples} examples with {batch_size} "
        f"examples per iteration, noise multiplier {noise_multiplier} for "
        f"{num_epochs} epochs {micro} microbatching"
    )
    if max_examples_per_user is None:
        head += ", and no bound on number of examples per user."
    else:
        head += f", and at most {max_examples_per_user} examples per user."
    paragraphs = [
        _fill(head),
        _fill(
            "This privacy guarantee protects the release of all model "
            "checkpoints in addition to the final model."
        ),
    ]
    eps_epoch = _example_epsilon(num_epochs, noise_multiplier, delta, used_microbatching)
    eps_poisson = _example_epsilon(num_epochs, noise_multiplier, delta, used_microbatching, q)
    paragraphs.append(
        _fill(
            f"Example-level DP with add-or-remove-one adjacency at delta = {delta} "
            "computed with RDP accounting:"
        )
        + _figures(f"{eps_epoch:12.3f}", f"{eps_poisson:12.3f}")
    )
    user_epoch = user_poisson = None
    infinite_user = False
    if max_examples_per_user is None:
        paragraphs.append(
            _fill(
                "No user-level privacy guarantee is possible without a bound on "
                "the number of examples per user."
            )
        )
    else:
        user_epoch = _user_epsilon(
            num_epochs, noise_multiplier, delta, max_examples_per_user, used_microbatching
        )
        user_poisson = _user_epsilon(
            num_epochs, noise_multiplier, delta, max_examples_per_user, used_microbatching, q
        )
        infinite_user = math.isinf(user_epoch) or math.isinf(user_poisson)

        def shown(value):
            return "    inf (**)" if math.isinf(value) else f"{value:12.3f}"

        paragraphs.append(
            _fill(
                f"User-level DP with add-or-remove-one adjacency at delta = {delta} "
                "computed using RDP accounting and group privacy:"
            )
            + _figures(shown(user_epoch), shown(user_poisson))
        )
    paragraphs.append(
        _fill(
            "(*) Poisson sampling is not usually done in training pipelines, but "
            "assuming that the data was randomly shuffled, it is believed that "
            "the actual epsilon should be closer to this value than the "
            "conservative assumption of an arbitrary data order."
        )
    )
    if infinite_user:
        paragraphs.append(
            _fill(
                "(**) A finite example-level epsilon implies a finite user-level "
                "epsilon at any `max_examples_per_user`, but because conversion "
                "from example-level to user-level DP is not exact, it is possible "
                "for the upper bound on the user-level epsilon to still be "
                "infinite."
            )
        )
    statement = PrivacyStatement("\n\n".join(paragraphs) + "\n")
    statement.epsilon_once_per_epoch = eps_epoch
    statement.epsilon_poisson = eps_poisson
    statement.user_epsilon_once_per_epoch = user_epoch
    statement.user_epsilon_poisson = user_poisson
    return statement


def _figures(once_per_epoch, poisson):
    return (
        "\n    Epsilon with each example occurring once per epoch:  " + once_per_epoch
        + "\n    Epsilon assuming Poisson sampling (*):               " + poisson
    )


def compute_dp_sgd_privacy(n, batch_size, noise_multiplier, epochs, delta):
    """TF-Privacy's deprecated `compute_dp_sgd_privacy`: Poisson RDP epsilon.

    Assumes Poisson sampling at `q = batch_size / n` for
    `ceil(epochs * n / batch_size)` steps, with TF-Privacy's RDP orders, and
    ignores microbatching. Prefer `compute_dp_sgd_privacy_statement`, or
    `tfdp.privacy.epsilon` for what tfdp's pipeline really did.

    Args:
        n: int. Number of training examples.
        batch_size: int. Batch size.
        noise_multiplier: float. Noise multiplier.
        epochs: float. Number of epochs.
        delta: float. Target delta.

    Returns:
        `(epsilon, optimal_order)`.
    """
    logging.warning(
        "compute_dp_sgd_privacy is deprecated (as in TF-Privacy): it assumes "
        "Poisson sampling and ignores microbatching. Use "
        "compute_dp_sgd_privacy_statement, or tfdp.privacy.epsilon."
    )
    q = batch_size / n
    if q > 1:
        raise ValueError(
            f"n must be at least the batch size. Received: n={n}, batch_size={batch_size}"
        )
    steps = int(math.ceil(epochs * n / batch_size))
    accountant = dp_accounting.rdp.RdpAccountant(_LEGACY_ORDERS)
    accountant.compose(privacy.make_dp_event(noise_multiplier, steps, sampling_rate=q))
    eps, order = accountant.get_epsilon_and_optimal_order(delta)
    return eps, order
