"""TF-Privacy's `compute_dp_sgd_privacy_statement` and `compute_dp_sgd_privacy`.

The statement's figures are `dp_accounting` bounds, by its `RdpAccountant`
with the default orders or its `PLDAccountant` (`accountant_type`, as
TF-Privacy), for add-or-remove-one adjacency:

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
user-level epsilon follows by group privacy, as TF-Privacy computes it now
(`tfdp.privacy.group_epsilon`): once per epoch, the k examples may meet in
one step, so σ / k; with Poisson sampling, Vadhan (2017) Lemma 2.2 with a
line search for the example-level delta (RDP), or a mixture of Gaussians
(PLD, Ganesh 2024).
"""

import enum
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


class AccountantType(enum.Enum):
    """TF-Privacy's choice of accountant for the privacy statement."""

    RDP = "RDP"
    PLD = "PLD"


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


def _accountant(accountant_type):
    """TF-Privacy's `AccountantType` (or its value, 'RDP' or 'PLD') as tfdp's name."""
    if isinstance(accountant_type, AccountantType):
        return accountant_type
    try:
        return AccountantType(accountant_type)
    except ValueError:
        raise ValueError(
            "accountant_type must be AccountantType.RDP or AccountantType.PLD "
            f"(or 'RDP', 'PLD'). Received: accountant_type={accountant_type!r}"
        ) from None


def _check_run(num_epochs, noise_multiplier, delta):
    if num_epochs <= 0:
        raise ValueError(f"num_epochs must be > 0. Received: num_epochs={num_epochs}")
    validation.validate_noise_multiplier(noise_multiplier)
    if not 0 <= delta <= 1:
        raise ValueError(f"delta must be in [0, 1]. Received: delta={delta}")


def _compositions(num_epochs, q):
    # One Gaussian per epoch without sampling; one per expected step with it.
    return int(math.ceil(num_epochs)) if q is None else int(math.ceil(num_epochs / q))


def _example_epsilon(num_epochs, noise_multiplier, delta, used_microbatching, q, accountant):
    """Example-level epsilon, add-or-remove-one, as TF-Privacy computes it."""
    _check_run(num_epochs, noise_multiplier, delta)
    return _user_epsilon(num_epochs, noise_multiplier, delta, 1, used_microbatching, q,
                         accountant)


def _user_epsilon(num_epochs, noise_multiplier, delta, max_examples_per_user,
                  used_microbatching, q, accountant):
    """User-level epsilon by group privacy (`tfdp.privacy.group_epsilon`)."""
    _check_run(num_epochs, noise_multiplier, delta)
    k = max_examples_per_user
    if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
        raise ValueError(
            "max_examples_per_user must be a positive int. "
            f"Received: max_examples_per_user={k!r}"
        )
    sigma = noise_multiplier / 2 if used_microbatching else noise_multiplier
    if delta == 0:
        return math.inf
    if delta == 1:
        return 0.0
    return privacy.group_epsilon(
        sigma, _compositions(num_epochs, q), delta, k, sampling_rate=q,
        accountant=accountant.value.lower(),
    )


def example_epsilon(num_epochs, noise_multiplier, example_delta, used_microbatching=True,
                    poisson_subsampling_probability=None, accountant_type=AccountantType.RDP):
    """Example-level ε of the statement, add-or-remove-one.

    TF-Privacy's `_compute_dp_sgd_example_privacy` (the package also offers
    it under that name, which TF-Privacy's tests call).

    Args:
        num_epochs: float. Passes over the data, > 0.
        noise_multiplier: float. σ >= 0.
        example_delta: float. δ in [0, 1].
        used_microbatching: bool. Halves σ (sensitivity 2C). Defaults to `True`.
        poisson_subsampling_probability: float or None. q of Poisson
            sampling, or None: each example once per epoch. Defaults to `None`.
        accountant_type: `AccountantType` or 'RDP' / 'PLD'. Defaults to RDP.

    Returns:
        float ε.
    """
    return _example_epsilon(num_epochs, noise_multiplier, example_delta, used_microbatching,
                            poisson_subsampling_probability, _accountant(accountant_type))


def user_epsilon(num_epochs, noise_multiplier, user_delta, max_examples_per_user,
                 used_microbatching=True, poisson_subsampling_probability=None,
                 accountant_type=AccountantType.RDP):
    """User-level ε of the statement, by group privacy, add-or-remove-one-user.

    TF-Privacy's `_compute_dp_sgd_user_privacy` (the package also offers it
    under that name, which TF-Privacy's tests call).

    Args:
        num_epochs: float. Passes over the data, > 0.
        noise_multiplier: float. σ >= 0.
        user_delta: float. δ in [0, 1].
        max_examples_per_user: int. k >= 1.
        used_microbatching: bool. Halves σ (sensitivity 2C). Defaults to `True`.
        poisson_subsampling_probability: float or None. As `example_epsilon`.
        accountant_type: `AccountantType` or 'RDP' / 'PLD'. Defaults to RDP.

    Returns:
        float ε.
    """
    return _user_epsilon(num_epochs, noise_multiplier, user_delta, max_examples_per_user,
                         used_microbatching, poisson_subsampling_probability,
                         _accountant(accountant_type))


def logexpm1(x):
    """log(e^x − 1) for x > 0, without overflow: TF-Privacy's `_logexpm1`.

    Group privacy's δ for k examples is δ · (e^(kε) − 1) / (e^ε − 1);
    TF-Privacy's tests check the user-level figures with it.
    """
    return x + math.log(-math.expm1(-x))


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
    accountant_type=AccountantType.RDP,
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
        accountant_type: `AccountantType` (or `'RDP'`, `'PLD'`). The
            accountant of every figure. Defaults to `AccountantType.RDP`.

    Returns:
        A `PrivacyStatement`: the statement text (a `str`), with
        `.epsilon_once_per_epoch` and `.epsilon_poisson` (and the user-level
        figures, or None).
    """
    accountant = _accountant(accountant_type)
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
    run = (num_epochs, noise_multiplier, delta)
    eps_epoch = _example_epsilon(*run, used_microbatching, None, accountant)
    eps_poisson = _example_epsilon(*run, used_microbatching, q, accountant)
    paragraphs.append(
        _fill(
            f"Example-level DP with add-or-remove-one adjacency at delta = {delta} "
            f"computed with {accountant.value} accounting:"
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
            *run, max_examples_per_user, used_microbatching, None, accountant
        )
        user_poisson = _user_epsilon(
            *run, max_examples_per_user, used_microbatching, q, accountant
        )
        infinite_user = math.isinf(user_epoch) or math.isinf(user_poisson)

        def shown(value):
            return "    inf (**)" if math.isinf(value) else f"{value:12.3f}"

        paragraphs.append(
            _fill(
                f"User-level DP with add-or-remove-one adjacency at delta = {delta} "
                f"computed using {accountant.value} accounting and group privacy:"
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
