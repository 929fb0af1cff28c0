"""What the trainer prints: a weak-amplification warning, no DP statistics without DP."""

import gin
import pytest

from tfdp import config
from tfdp import train
from tfdp.training import reporting


def test_a_dry_run_warns_of_weak_amplification(tmp_path, capsys):
    # 1,000 of the ~1,400 digits per step: q is about 0.7.
    config.parse(["mnist_default.gin"], [
        "DataConfig.dataset = 'digits'", "OptimizationConfig.logical_batch_size = 1000",
        "OptimizationConfig.epochs = 2"])
    try:
        train.train(str(tmp_path), dry_run=True)
    finally:
        gin.clear_config()
    out = capsys.readouterr().out
    assert "Weak privacy amplification" in out
    assert "a smaller batch size" in out


@pytest.mark.parametrize("private", [True, False])
def test_progress_shows_gradient_norms_only_for_dp_sgd(tmp_path, capsys, private):
    ledger = object() if private else None
    reporter = reporting.RunReporter(str(tmp_path), steps_per_epoch=10, total_steps=20,
                                     delta=1e-5 if private else None, ledger=ledger,
                                     progress_bar=False)
    reporter.progress(5, learning_rate=0.1, examples_per_second=100.0,
                      stats={"mean_grad_norm": 0.0, "clipped_fraction": 0.0, "nonfinite": 0})
    assert ("grad_norm" in capsys.readouterr().out) == private
