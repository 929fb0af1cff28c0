"""The trainer's last stage: what a finished run writes into its workdir."""

import os

import gin

from tfdp import report
from tfdp.training import model_setup
from tfdp.training import privacy_unit as privacy_unit_lib
from tfdp.training import reporting


def write_outputs(out_dir, model, ema, reporter, contract, state, data, *, steps, epsilon,
                  config):
    """The operative config, the exported model, `summary.json` and `report.html`.

    Nothing but the summary's `final:` lines where `out_dir` is None (a
    non-chief worker).

    Args:
        out_dir: str or None. This worker's output directory; None writes
            no file.
        model: keras.Model. The trained model.
        ema: `tfdp.optim.ParameterEMA` or None. Exported in place of the
            parameters when given.
        reporter: `tfdp.training.reporting.RunReporter`. Writes the summary.
        contract: `tfdp.training.run_contract.RunContract`.
        state: `tfdp.training.resume.RunState`. Its ledger has every step.
        data: `tfdp.training.run_data.RunData`.
        steps: int. The steps taken.
        epsilon: float. ε spent.
        config: `tfdp.training.RunConfig`. Its `export_model` and
            `write_html_report`.

    Returns:
        The summary dict (`summary.json`).
    """
    if out_dir is not None:
        with open(os.path.join(out_dir, "operative_config.gin"), "w") as f:
            f.write(gin.operative_config_str())
    if config.export_model and out_dir is not None:
        model_setup.export_model(model, ema, out_dir)
    mechanism, key = contract.mechanism, contract.key
    bands = mechanism.bands if mechanism is not None else 1
    summary = reporter.summary(
        bands=bands,
        # The accounted rate: within an example's group when banded.
        sampling_probability=(contract.sampler.group_sampling_rate if bands > 1
                              else contract.sampler.sampling_rate),
        epsilon=epsilon, delta=contract.delta, steps=steps,
        noise_multiplier=mechanism.noise_multiplier if mechanism else 0.0,
        dataset_size=contract.sampler.dataset_size, validation_size=len(data.validation or []),
        privacy_guarantee=reporting.guarantee_statement(state.ledger, key),
        not_private=(None if mechanism is None or key.is_secret else
                     f"insecure_reproducible_seed={key.insecure_seed}: epsilon does not "
                     "hold against anyone who knows the seed"),
        privacy_unit=privacy_unit_lib.privacy_unit_summary(
            state.ledger, steps, contract.sampler.group_size),
        duplicates_kept=privacy_unit_lib.kept_copies_summary(
            state.ledger, steps, data.duplicates_kept),
    )
    if config.write_html_report and out_dir is not None:
        reporting.log(f"report: {report.write_report(out_dir)}")
    return summary
