"""ε at several δ, as the paper's Appendix I reports it, and its text table.

No TensorFlow is imported here, so `python -m tfdp.privacy` starts quickly.
"""

from tfdp.privacy.accounting import ACCOUNTANTS
from tfdp.privacy.accounting import DEFAULT_DELTAS
from tfdp.privacy.accounting import PrivacyQuery
from tfdp.privacy.accounting import format_epsilon
from tfdp.privacy.accounting import validate_accountant
from tfdp.validation import validate_delta


def epsilon_table(
    noise_multiplier,
    steps,
    deltas=DEFAULT_DELTAS,
    *,
    sampling_rate=None,
    dataset_size=None,
    batch_size=None,
    accountant="rdp",
    sampler="poisson",
):
    """Returns epsilon at several deltas, as in the paper's Appendix I.

    Args:
        noise_multiplier: float. Noise multiplier `sigma` of the logical
            batch.
        steps: int. Number of optimizer steps.
        deltas: sequence of float. Deltas to report. Defaults to
            `(1e-5, 1e-6, 1e-7, 1e-8)`.
        sampling_rate: float or None. `q`. Defaults to `None`.
        dataset_size: int or None. `N`. Defaults to `None`.
        batch_size: int or None. `B`. Defaults to `None`.
        accountant: str. `"rdp"`, `"pld"` or `"both"`. Defaults to `"rdp"`.
        sampler: str or `tfdp.samplers.Sampler`. `"poisson"` or `"shuffle"`,
            or a sampler instance. Defaults to `"poisson"`.

    Returns:
        A list with one dict per delta, with keys `delta`,
        `epsilon_rdp` and/or `epsilon_pld`, `noise_multiplier`,
        `sampling_rate`, `steps` and `sampler`.
    """
    if accountant == "both":
        accountants = ACCOUNTANTS
    else:
        accountants = (validate_accountant(accountant),)
    deltas = tuple(deltas)
    if not deltas:
        raise ValueError(
            f"`deltas` must not be empty. Received: deltas={deltas}"
        )
    deltas = tuple(validate_delta(delta) for delta in deltas)
    # One query per accountant, asked at each delta; the δ warning is for
    # the largest δ.
    queries = {
        acc: PrivacyQuery(
            noise_multiplier, steps, max(deltas), sampling_rate=sampling_rate,
            dataset_size=dataset_size, batch_size=batch_size, accountant=acc,
            sampler=sampler, stacklevel=3,
        )
        for acc in accountants
    }
    query = queries[accountants[0]]
    rows = []
    for delta in deltas:
        row = {
            "delta": delta,
            "noise_multiplier": query.noise_multiplier,
            "sampling_rate": query.sampling_rate,
            "steps": query.steps,
            "sampler": sampler,
        }
        for acc in accountants:
            row[f"epsilon_{acc}"] = queries[acc].epsilon(delta=delta)
        rows.append(row)
    return rows


def format_epsilon_table(rows):
    """Formats the output of `epsilon_table` as a fixed-width text table.

    Args:
        rows: list of dict. Rows returned by `epsilon_table`.

    Returns:
        The table as a string, one line per delta, without a trailing
        newline.
    """
    columns = [
        c for c in ("epsilon_rdp", "epsilon_pld") if rows and c in rows[0]
    ]
    header = f"{'delta':>8}" + "".join(f"{c:>14}" for c in columns)
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{row['delta']:>8.0e}"
            + "".join(f"{format_epsilon(row[c]):>14}" for c in columns)
        )
    return "\n".join(lines)
