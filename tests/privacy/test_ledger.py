"""Tests for tfdp.privacy.PrivacyLedger (no TensorFlow)."""

import json
import warnings

from absl.testing import absltest
from absl.testing import parameterized

from tests.privacy import closed_forms as cf
from tfdp import privacy
from tfdp.privacy import PrivacyLedger


def _ledger(**overrides):
    kw = dict(
        noise_multiplier=1.1,
        delta=1e-6,
        dataset_size=60_000,
        batch_size=256,
    )
    kw.update(overrides)
    sigma = kw.pop("noise_multiplier")
    return PrivacyLedger(sigma, **kw)


class PrivacyLedgerTest(parameterized.TestCase, cf.ClosedFormAssertions):
    def test_fields(self):
        ledger = _ledger()
        self.assertEqual(ledger.noise_multiplier, 1.1)
        self.assertEqual(ledger.sampling_rate, 256 / 60_000)
        self.assertEqual(ledger.steps, 0)
        self.assertEqual(ledger.sampler, "poisson")
        self.assertEqual(ledger.accountant, "rdp")
        self.assertEqual(ledger.delta, 1e-6)
        self.assertEqual(ledger.dataset_size, 60_000)
        self.assertEqual(ledger.batch_size, 256)
        self.assertEqual(ledger.epsilon(), 0.0)

    def test_record_step(self):
        ledger = _ledger()
        self.assertEqual(ledger.record_step(), 1)
        self.assertEqual(ledger.record_step(9), 10)
        self.assertEqual(ledger.record_step(0), 10)
        self.assertEqual(ledger.steps, 10)
        with self.assertRaisesRegex(ValueError, "Received: n=-1"):
            ledger.record_step(-1)
        with self.assertRaisesRegex(ValueError, "Received: n=1.0"):
            ledger.record_step(1.0)

    @parameterized.parameters(
        ("poisson", "rdp"), ("shuffle", "rdp"), ("poisson", "pld"),
        ("shuffle", "pld"),
    )
    def test_epsilon_matches_function(self, sampler, accountant):
        ledger = _ledger(sampler=sampler, accountant=accountant)
        ledger.record_step(40)
        expected = privacy.epsilon(
            1.1,
            40,
            1e-6,
            dataset_size=60_000,
            batch_size=256,
            sampler=sampler,
            accountant=accountant,
        )
        self.assertEqual(ledger.epsilon(), expected)
        self.assertEqual(ledger.epsilon_after(40), expected)

    @parameterized.parameters(
        ("poisson", "rdp"), ("shuffle", "rdp"), ("poisson", "pld"),
        ("shuffle", "pld"),
    )
    def test_save_restore_equals_uninterrupted(self, sampler, accountant):
        if sampler == "shuffle":
            # N // B = 234 steps per pass: 230 steps are one pass and 240
            # two, so epsilon grows across the restore (it is constant
            # within a pass).
            steps_a, steps_b = 230, 10
        else:
            steps_a, steps_b = (30, 70) if accountant == "rdp" else (3, 7)
        first = _ledger(sampler=sampler, accountant=accountant)
        first.record_step(steps_a)
        text = first.to_json()
        restored = PrivacyLedger.from_json(text)
        self.assertEqual(restored, first)
        self.assertEqual(restored.to_json(), text)
        restored.record_step(steps_b)

        uninterrupted = _ledger(sampler=sampler, accountant=accountant)
        for _ in range(steps_a + steps_b):
            uninterrupted.record_step()
        self.assertEqual(restored, uninterrupted)
        self.assertEqual(restored.to_json(), uninterrupted.to_json())
        self.assertEqual(restored.epsilon(), uninterrupted.epsilon())
        self.assertGreater(restored.epsilon(), first.epsilon())

    def test_json_round_trip_exact_floats(self):
        ledger = PrivacyLedger(
            0.1 + 0.2, sampling_rate=1 / 3, delta=1 / 7, steps=12_345
        )
        restored = PrivacyLedger.from_json(ledger.to_json())
        self.assertEqual(restored.noise_multiplier, 0.1 + 0.2)
        self.assertEqual(restored.sampling_rate, 1 / 3)
        self.assertEqual(restored.delta, 1 / 7)
        self.assertEqual(restored.steps, 12_345)
        self.assertIsNone(restored.dataset_size)
        self.assertEqual(restored, ledger)
        # Also through bytes, as read from a checkpoint side file.
        self.assertEqual(
            PrivacyLedger.from_json(ledger.to_json().encode()), ledger
        )

    def test_to_dict(self):
        d = _ledger(steps=5).to_dict()
        self.assertEqual(
            d,
            {
                "version": 1,
                "noise_multiplier": 1.1,
                "sampling_rate": 256 / 60_000,
                "steps": 5,
                "sampler": "poisson",
                "delta": 1e-6,
                "accountant": "rdp",
                "dataset_size": 60_000,
                "batch_size": 256,
                "l2_norm_clip": None,
            },
        )
        json.dumps(d, allow_nan=False)
        self.assertEqual(PrivacyLedger.from_dict(d), _ledger(steps=5))

    def test_differences_name_every_fixed_parameter_but_steps(self):
        base = _ledger(steps=3, l2_norm_clip=1.0)
        self.assertEqual(base.differences(_ledger(steps=9, l2_norm_clip=1.0)), {})
        self.assertEqual(base.differences(_ledger(l2_norm_clip=2.0)), {"l2_norm_clip": (1.0, 2.0)})
        self.assertEqual(set(base.differences(_ledger(noise_multiplier=1.2, delta=1e-5,
                                                      l2_norm_clip=1.0))),
                         {"noise_multiplier", "delta"})
        with self.assertRaisesRegex(ValueError, "l2_norm_clip must be > 0"):
            _ledger(l2_norm_clip=0.0)

    def test_equality(self):
        self.assertEqual(_ledger(), _ledger())
        self.assertNotEqual(_ledger(), _ledger(noise_multiplier=1.2))
        self.assertNotEqual(_ledger(), _ledger(steps=1))
        self.assertNotEqual(_ledger(), _ledger(sampler="shuffle"))
        self.assertNotEqual(_ledger(), "ledger")
        with self.assertRaises(TypeError):
            hash(_ledger())

    def test_epsilon_after_is_monotone_and_stateless(self):
        ledger = _ledger(steps=10)
        eps = [ledger.epsilon_after(t) for t in (0, 10, 11, 100)]
        self.assertEqual(eps[0], 0.0)
        self.assertEqual(eps[1], ledger.epsilon())
        self.assertEqual(eps, sorted(eps))
        self.assertEqual(ledger.steps, 10)

    @parameterized.parameters(("poisson", 2.0), ("shuffle", 5.0))
    def test_max_steps_within(self, sampler, target):
        ledger = _ledger(sampler=sampler, steps=3)
        t = ledger.max_steps_within(target)
        self.assertGreater(t, 3)
        self.assertLessEqual(ledger.epsilon_after(t), target)
        self.assertGreater(ledger.epsilon_after(t + 1), target)
        self.assertEqual(
            t,
            privacy.max_steps_within(
                target,
                1.1,
                1e-6,
                dataset_size=60_000,
                batch_size=256,
                sampler=sampler,
            ),
        )
        # The stopping rule a trainer uses lands exactly there.
        while ledger.epsilon_after(ledger.steps + 1) <= target:
            ledger.record_step(t - ledger.steps if ledger.steps < t - 1 else 1)
        self.assertEqual(ledger.steps, t)

    def test_max_steps_within_zero_noise(self):
        ledger = _ledger(noise_multiplier=0.0)
        self.assertEqual(ledger.max_steps_within(10.0), 0)

    @parameterized.named_parameters(
        ("negative_sigma", dict(noise_multiplier=-1.0), "noise_multiplier"),
        ("delta", dict(delta=0.0), "delta"),
        ("steps", dict(steps=-3), "steps"),
        ("sampler", dict(sampler="uniform"), "sampler"),
        ("accountant", dict(accountant="gdp"), "accountant"),
        ("batch", dict(batch_size=70_000), "batch_size"),
    )
    def test_constructor_validation(self, overrides, name):
        with self.assertRaisesRegex(ValueError, f"Received: .*{name}="):
            _ledger(**overrides)

    def test_pld_shuffle_accepted(self):
        # PLD accounts shuffle now: one Gaussian(sigma) per pass of
        # N // B = 234 steps; 235 steps are two passes.
        import dp_accounting
        from dp_accounting import pld as dp_pld

        ledger = _ledger(sampler="shuffle", accountant="pld", steps=235)
        direct = dp_pld.PLDAccountant(
            neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
        )
        direct.compose(dp_accounting.GaussianDpEvent(1.1), count=2)
        self.assertAlmostEqual(ledger.epsilon(), direct.get_epsilon(1e-6), places=9)
        # The exact epsilon of the mu = sqrt(2) / 1.1 Gaussian.
        self.assertGaussianPld(ledger.epsilon(), 1.1, 2, 1e-6)
        self.assertEqual(ledger.epsilon_after(468), ledger.epsilon())
        self.assertGreater(ledger.epsilon_after(469), ledger.epsilon())
        self.assertEqual(PrivacyLedger.from_json(ledger.to_json()), ledger)

    def test_shuffle_with_rate_only(self):
        by_rate = PrivacyLedger(
            1.1, 256 / 60_000, delta=1e-6, steps=40, sampler="shuffle"
        )
        self.assertEqual(
            by_rate.epsilon(), _ledger(sampler="shuffle", steps=40).epsilon()
        )
        self.assertEqual(PrivacyLedger.from_json(by_rate.to_json()), by_rate)

    def test_needs_a_rate(self):
        with self.assertRaisesRegex(ValueError, "sampling_rate"):
            PrivacyLedger(1.0, delta=1e-5)

    def test_warns_on_large_delta(self):
        with self.assertWarnsRegex(UserWarning, "1/dataset_size"):
            _ledger(delta=1e-4)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _ledger(delta=1e-6)

    @parameterized.parameters(
        '{"noise_multiplier": 1.0, "delta": 1e-5, "steps": 0, "foo": 1, '
        '"sampling_rate": 0.1}',
        '{"noise_multiplier": 1.0, "steps": 0, "sampling_rate": 0.1}',
        '{"version": 2, "noise_multiplier": 1.0, "delta": 1e-5, "steps": 0, '
        '"sampling_rate": 0.1}',
        '{"noise_multiplier": 1.0, "delta": 1e-5, "steps": -1, '
        '"sampling_rate": 0.1}',
        "[1, 2]",
        "not json",
    )
    def test_from_json_rejects(self, text):
        with self.assertRaises(ValueError):
            PrivacyLedger.from_json(text)

    def test_sensitivity_two_accounts_half_sigma_for_both_relations(self):
        # Microbatches: zero-out and replace-one both move one clipped vector
        # of norm <= C to another, so both are the epsilon of sigma / 2.
        kw = dict(sampler="shuffle", steps=40)
        ledger = _ledger(sensitivity=2, **kw)
        half = _ledger(noise_multiplier=0.55, **kw)
        self.assertEqual(ledger.noise_multiplier, 1.1)
        self.assertEqual(ledger.effective_noise_multiplier, 0.55)
        self.assertAlmostEqual(ledger.epsilon(), half.epsilon(), places=12)
        self.assertAlmostEqual(ledger.epsilon_replace_one(), half.epsilon(), places=12)
        # 40 steps of the 234 in a pass: one Gaussian mechanism at sigma / 2.
        self.assertGaussianRdp(ledger.epsilon(), 0.55, 1, 1e-6)
        self.assertIn("sensitivity 2C", ledger.describe_epsilon())
        self.assertEqual(PrivacyLedger.from_json(ledger.to_json()), ledger)
        self.assertEqual(ledger.differences(_ledger(**kw)), {"sensitivity": (2, 1)})
        # Per-example ledgers keep their JSON.
        self.assertNotIn("sensitivity", _ledger(**kw).to_dict())
        with self.assertRaisesRegex(ValueError, r"sensitivity must be .*Received: sensitivity=3"):
            _ledger(sensitivity=3)

    def test_str_and_repr(self):
        ledger = _ledger(steps=100)
        self.assertIn("steps=100", repr(ledger))
        self.assertIn("epsilon=", str(ledger))


if __name__ == "__main__":
    absltest.main()
