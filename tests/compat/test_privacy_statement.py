"""compute_dp_sgd_privacy_statement / compute_dp_sgd_privacy against TF-Privacy."""

import math

import dp_accounting
import pytest

from tfdp.compat import tensorflow_privacy


def _reference(n, batch, epochs, sigma, delta, used_microbatching):
    """TF-Privacy's two figures, from dp_accounting primitives directly."""
    sigma = sigma / 2 if used_microbatching else sigma
    q = batch / n
    once = dp_accounting.SelfComposedDpEvent(
        dp_accounting.GaussianDpEvent(sigma), int(math.ceil(epochs))
    )
    poisson = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)),
        int(math.ceil(epochs / q)),
    )
    return tuple(
        dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(delta)
        for event in (once, poisson)
    )


def test_issue_figures_as_tf_privacy_prints_them():
    # TF-Privacy 0.9 on TF 2.15: 56.950 and 2.597 (per-example clipping).
    statement = tensorflow_privacy.compute_dp_sgd_privacy_statement(
        60000, 256, 60, 1.1, 1e-5, used_microbatching=False
    )
    assert isinstance(statement, str)
    assert "Epsilon with each example occurring once per epoch:        56.950" in statement
    assert "Epsilon assuming Poisson sampling (*):                      2.597" in statement
    assert statement.epsilon_once_per_epoch == pytest.approx(56.950, abs=5e-4)
    assert statement.epsilon_poisson == pytest.approx(2.597, abs=5e-4)
    assert statement.user_epsilon_poisson is None


def test_microbatching_halves_the_noise_multiplier():
    statement = tensorflow_privacy.compute_dp_sgd_privacy_statement(
        60000, 256, 60, 1.1, 1e-5
    )
    assert "with microbatching" in statement
    assert statement.epsilon_once_per_epoch == pytest.approx(164.961, abs=5e-4)
    assert statement.epsilon_poisson == pytest.approx(16.420, abs=5e-4)


@pytest.mark.parametrize(
    "n, batch, epochs, sigma, delta, used_microbatching",
    [
        (50000, 512, 20, 0.8, 1e-6, True),
        (1281167, 4096, 10.5, 2.5, 1e-7, False),
    ],
)
def test_figures_follow_tf_privacy_formula(n, batch, epochs, sigma, delta, used_microbatching):
    statement = tensorflow_privacy.compute_dp_sgd_privacy_statement(
        n, batch, epochs, sigma, delta, used_microbatching=used_microbatching
    )
    once, poisson = _reference(n, batch, epochs, sigma, delta, used_microbatching)
    assert statement.epsilon_once_per_epoch == pytest.approx(once, rel=1e-9)
    assert statement.epsilon_poisson == pytest.approx(poisson, rel=1e-9)
    assert f"{once:12.3f}" in statement and f"{poisson:12.3f}" in statement


_TF_PRIVACY_USER_STATEMENT = """\
DP-SGD performed over 10000 examples with 64 examples per iteration, noise
multiplier 2.0 for 5.0 epochs with microbatching, and at most 3 examples per
user.

This privacy guarantee protects the release of all model checkpoints in addition
to the final model.

Example-level DP with add-or-remove-one adjacency at delta = 1e-06 computed with
RDP accounting:
    Epsilon with each example occurring once per epoch:        13.376
    Epsilon assuming Poisson sampling (*):                      1.616

User-level DP with add-or-remove-one adjacency at delta = 1e-06 computed using
RDP accounting and group privacy:
    Epsilon with each example occurring once per epoch:        56.224
    Epsilon assuming Poisson sampling (*):                      6.425

(*) Poisson sampling is not usually done in training pipelines, but assuming
that the data was randomly shuffled, it is believed that the actual epsilon
should be closer to this value than the conservative assumption of an arbitrary
data order.
"""


def test_user_level_statement_text_matches_tf_privacy():
    # The expected text is TF-Privacy's own unit-test expectation.
    statement = tensorflow_privacy.compute_dp_sgd_privacy_statement(
        10000, 64, 5.0, 2.0, 1e-6, max_examples_per_user=3
    )
    assert statement == _TF_PRIVACY_USER_STATEMENT
    assert statement.user_epsilon_once_per_epoch == pytest.approx(56.224, abs=5e-4)
    # The same text through the accountant's enum or TF-Privacy's spelling.
    for accountant_type in (tensorflow_privacy.AccountantType.RDP, "RDP"):
        assert tensorflow_privacy.compute_dp_sgd_privacy_statement(
            10000, 64, 5.0, 2.0, 1e-6, max_examples_per_user=3,
            accountant_type=accountant_type) == _TF_PRIVACY_USER_STATEMENT


def test_once_per_epoch_user_level_divides_sigma_by_the_cap():
    # Without sampling a user's k examples can meet in one step: sensitivity k.
    statement = tensorflow_privacy.compute_dp_sgd_privacy_statement(
        10000, 64, 5.0, 2.0, 1e-6, max_examples_per_user=3)
    assert statement.user_epsilon_once_per_epoch == pytest.approx(
        _reference(10000, 64, 5.0, 2.0 / 3, 1e-6, True)[0], rel=1e-9)


def test_pld_statement_matches_tf_privacy():
    # TF-Privacy's expectations (10,000 examples, batch 64, sigma 2, 5
    # epochs, delta 1e-6, with microbatching, at most 2 examples per user).
    statement = tensorflow_privacy.compute_dp_sgd_privacy_statement(
        10000, 64, 5.0, 2.0, 1e-6, max_examples_per_user=2, accountant_type="PLD")
    assert "computed with\nPLD accounting:" in statement
    assert "computed using\nPLD accounting and group privacy:" in statement
    for figure in ("12.595", "1.199", "30.579", "2.532"):
        assert f"{float(figure):12.3f}" in statement
    assert statement.user_epsilon_poisson == pytest.approx(2.532, abs=5e-4)


def test_unknown_accountant_type_is_refused():
    with pytest.raises(ValueError, match="Received: accountant_type='rdp2'"):
        tensorflow_privacy.compute_dp_sgd_privacy_statement(
            10000, 64, 5.0, 2.0, 1e-6, accountant_type="rdp2")


def test_user_level_is_group_privacy_of_example_level():
    # Vadhan (2017) Lemma 2.2: k examples per user at the example delta whose
    # group delta is the user delta give k times the example epsilon.
    k, example_delta = 3, 1e-8
    example = tensorflow_privacy.compute_dp_sgd_privacy_statement(
        10000, 2, 5, 1.1, example_delta, used_microbatching=False
    ).epsilon_poisson
    user_delta = example_delta * math.expm1(k * example) / math.expm1(example)
    user = tensorflow_privacy.compute_dp_sgd_privacy_statement(
        10000, 2, 5, 1.1, user_delta, used_microbatching=False, max_examples_per_user=k
    ).user_epsilon_poisson
    assert user == pytest.approx(k * example, rel=1e-6)


def test_unbounded_user_epsilon_is_reported_as_infinite():
    # TF-Privacy prints 366.374 once per epoch and inf (**) under Poisson.
    statement = tensorflow_privacy.compute_dp_sgd_privacy_statement(
        10000, 64, 5.0, 2.0, 1e-6, max_examples_per_user=10
    )
    assert "366.374" in statement
    assert math.isinf(statement.user_epsilon_poisson)
    assert "inf (**)" in statement and "(**) A finite example-level epsilon" in statement


@pytest.mark.parametrize(
    "n, batch, sigma, epochs, delta, eps, order",
    # TF-Privacy's own unit-test values.
    [(60000, 150, 1.3, 15, 1e-5, 0.7242234026109595, 19.0),
     (100000, 100, 1.0, 30, 1e-7, 1.4154988495444845, 13.0)],
)
def test_compute_dp_sgd_privacy(n, batch, sigma, epochs, delta, eps, order):
    got_eps, got_order = tensorflow_privacy.compute_dp_sgd_privacy(n, batch, sigma, epochs, delta)
    assert got_eps == pytest.approx(eps, rel=1e-9)
    assert got_order == order


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="num_epochs"):
        tensorflow_privacy.compute_dp_sgd_privacy_statement(100, 10, 0, 1.0, 1e-5)
    with pytest.raises(ValueError, match="noise_multiplier"):
        tensorflow_privacy.compute_dp_sgd_privacy_statement(100, 10, 1, -1.0, 1e-5)
    with pytest.raises(ValueError, match="batch size"):
        tensorflow_privacy.compute_dp_sgd_privacy(10, 100, 1.0, 1, 1e-5)


def test_statement_imports_no_tensorflow():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from tfdp.compat.tensorflow_privacy import compute_dp_sgd_privacy_statement\n"
        "print(compute_dp_sgd_privacy_statement(100, 10, 1, 1.0, 1e-3).epsilon_poisson)\n"
        "assert 'tensorflow' not in sys.modules, 'tensorflow imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
