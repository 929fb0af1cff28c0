"""`tfdp.report`: the run's HTML page, checked in a real headless browser."""

import json
import os
import re
import shutil
import subprocess

import pytest
import tensorflow as tf

from tfdp import report
from tfdp.privacy import ledger as ledger_lib


def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("CI"):  # .ci/run installs it: a skip would hide a failure.
        pytest.fail("No headless Chromium on PATH (`apt-get install chromium`).")
    pytest.skip("No headless Chromium on PATH (`apt-get install chromium`).")


def _rendered(path):
    """(plots, plots decoded) as the page itself counts them after loading."""
    result = subprocess.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu",
         "--virtual-time-budget=5000", "--dump-dom", "file://" + os.path.abspath(path)],
        capture_output=True, text=True, timeout=120,
    )
    match = re.search(r'data-plots="(\d+)" data-rendered="(\d+)"', result.stdout)
    assert match, (result.stdout[-500:], result.stderr[-2000:])
    return int(match[1]), int(match[2])


def _make_workdir(root, *, audit=False):
    """A workdir as the trainer leaves it, at 40 steps of 2 epochs."""
    os.makedirs(os.path.join(root, "checkpoints"))
    ledger = ledger_lib.PrivacyLedger(1.1, 0.064, delta=1e-5, steps=40, sampler="poisson",
                                      dataset_size=4000, batch_size=256, l2_norm_clip=1.0)
    with open(os.path.join(root, "checkpoints", "privacy_ledger.json"), "w") as f:
        f.write(ledger.to_json())
    with open(os.path.join(root, "summary.json"), "w") as f:
        json.dump({"test_accuracy": 0.9, "epsilon": ledger.epsilon(), "delta": 1e-5}, f)
    writer = tf.summary.create_file_writer(os.path.join(root, "tensorboard"))
    with writer.as_default():
        for step in (20, 40):
            tf.summary.scalar("test/accuracy", 0.5 + step / 100, step=step)
            tf.summary.scalar("privacy/epsilon", ledger.epsilon_after(step), step=step)
            tf.summary.scalar("non_dp/validation_accuracy", 0.4 + step / 100, step=step)
        for step in range(5, 41, 5):
            tf.summary.scalar("non_dp/clipped_fraction", 1.0 - step / 50, step=step)
            tf.summary.scalar("non_dp/mean_grad_norm", 10.0 / step, step=step)
        tf.summary.text("privacy/guarantee", "epsilon=1.0 at delta=1e-05", step=40)
    writer.flush()
    if audit:
        with open(os.path.join(root, report.AUDIT_NAME), "w") as f:
            json.dump({"epsilon_lower": 0.7, "accountant_epsilon": 2.0, "delta": 1e-5,
                       "confidence": 0.95}, f)
    return root


def test_scalars_are_read_back(tmp_path):
    workdir = _make_workdir(str(tmp_path / "run"))
    scalars = report.read_scalars(os.path.join(workdir, "tensorboard"))
    assert [s for s, _ in scalars["test/accuracy"]] == [20, 40]
    assert scalars["test/accuracy"][1][1] == pytest.approx(0.9)
    assert len(scalars["non_dp/clipped_fraction"]) == 8


def test_report_plots_render_in_a_browser(tmp_path):
    workdir = _make_workdir(str(tmp_path / "run"))
    path = report.write_report(workdir)
    assert path == os.path.join(workdir, "report.html")
    with open(path) as f:
        page = f.read()
    # Self-contained: no file or address besides its own data: URIs.
    assert "http://" not in page and "https://" not in page
    assert "ε against steps" in page and "Privacy profile" in page
    assert "Clipping statistics (not covered by ε)" in page
    assert "validation accuracy (not covered by ε)" not in page  # A plot label, not text.
    assert _rendered(path) == (4, 4)


def test_audit_is_shown_beside_the_accountant(tmp_path):
    workdir = _make_workdir(str(tmp_path / "run"), audit=True)
    path = report.write_report(workdir)
    with open(path) as f:
        assert "Audit: empirical lower bound" in f.read()
    assert _rendered(path) == (5, 5)


def test_private_counts_and_adapted_state_are_labelled(tmp_path):
    workdir = _make_workdir(str(tmp_path / "run"))
    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)
    summary["not_covered_by_epsilon"] = {
        "dataset_size": 4000, "validation_size": 0,
        "data_preparation": {"train_examples": 4000, "test_examples": 1000},
        "adapted_state": [{"layer": "normalization", "variable": "normalization/mean",
                           "reason": "Normalization adapted"}]}
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f)
    with open(report.write_report(workdir)) as f:
        page = f.read()
    # The ledger's N in the header, and the summary's counts and state.
    assert "<th>dataset_size (not covered by ε)</th><td>4000</td>" in page
    assert "Counts and state (not covered by ε)" in page
    assert "<th>train_examples</th><td>4000</td>" in page
    assert "<code>normalization/mean</code>: Normalization adapted" in page


def test_a_banded_run_shows_its_bands_and_group_rate(tmp_path):
    root = str(tmp_path / "run")
    os.makedirs(os.path.join(root, "checkpoints"))
    ledger = ledger_lib.PrivacyLedger(
        2.0, 0.064, delta=1e-5, steps=40, sampler="banded_poisson", dataset_size=4000,
        batch_size=256, l2_norm_clip=1.0, bands=4, band_coefficients=(0.8, 0.45, 0.3, 0.25))
    with open(os.path.join(root, "checkpoints", "privacy_ledger.json"), "w") as f:
        f.write(ledger.to_json())
    with open(os.path.join(root, "summary.json"), "w") as f:
        json.dump({"test_accuracy": 0.9, "epsilon": ledger.epsilon(), "delta": 1e-5,
                   "bands": 4, "sampling_probability": 0.256}, f)
    with open(report.write_report(root)) as f:
        page = f.read()
    assert "<th>bands</th><td>4</td>" in page
    assert "<th>band_coefficients</th><td>0.8, 0.45, 0.3, 0.25</td>" in page
    assert "<th>sampling_probability (within a group)</th><td>0.256</td>" in page
    # DP-SGD's page has no such rows.
    plain = _make_workdir(str(tmp_path / "plain"))
    with open(report.write_report(plain)) as f:
        assert "bands" not in f.read()


def test_missing_workdir_is_an_error_and_the_cli_exits_2(tmp_path, capsys):
    assert report.main([str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.startswith("error: No such run directory")
