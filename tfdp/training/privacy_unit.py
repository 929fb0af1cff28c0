"""What ε protects in a trainer run: one example, or everything one user contributed."""

from tfdp import privacy
from tfdp import samplers
from tfdp.data import batch_padding
from tfdp.dp import user_groups
from tfdp.training import reporting


def user_sampler(train_source, *, users_per_step, physical_batch_size, k, replicas,
                 pad_granule, bands=1):
    """The `UserPoissonSampler` of the training data's users, and its padding granule.

    With `bands` > 1, the `BandedUserPoissonSampler`: b secret groups of the
    users, step t sampling group t mod b.

    Args:
        train_source: The training source; it must carry `user_ids`.
        users_per_step: int. Expected users per logical step.
        physical_batch_size: int. Rows per physical batch (global).
        k: int. `max_examples_per_user`.
        replicas: int. Replicas in sync: each clips its share of a batch,
            so a user's block of k rows must not straddle two.
        pad_granule: int, "auto" or None. As `RunConfig.pad_granule`.
        bands: int. b >= 1, the groups of users. Defaults to 1.
    """
    if physical_batch_size % (replicas * k):
        raise ValueError(
            "Under privacy_unit='user', physical_batch_size must be a multiple of "
            "max_examples_per_user times the number of replicas. Received: "
            f"physical_batch_size={physical_batch_size}, max_examples_per_user={k}, "
            f"replicas={replicas}")
    user_ids = getattr(train_source, "user_ids", None)
    if user_ids is None:
        raise ValueError(
            "privacy_unit='user' needs the user of every training example: a folder:'s "
            "users.csv (path,user), a tfrecord: feature named by load_dataset.user_key, an "
            "npz: file's `user_ids` array, or an ArraySource(user_ids=...). Received: training "
            f"data without user ids ({type(train_source).__name__})")
    ids, num_users = user_groups.compact_user_ids(user_ids)
    if users_per_step > num_users:
        raise ValueError(
            "Under privacy_unit='user', logical_batch_size is the expected users per step "
            "and must not exceed the number of users. Received: "
            f"logical_batch_size={users_per_step}, users={num_users}")
    banded = {"bands": bands} if bands > 1 else {}
    sampler = samplers.make_sampler(
        samplers.resolve_name("poisson", privacy_unit="user", bands=bands),
        dataset_size=num_users,
        logical_batch_size=users_per_step, physical_batch_size=physical_batch_size,
        user_ids=ids, max_examples_per_user=k, **banded)
    if pad_granule == "auto":  # The finest of P/8, P/4, P/2, P holding whole users.
        pad_granule = next(g for g in (physical_batch_size // d for d in (8, 4, 2, 1))
                           if physical_batch_size % g == 0 and g % k == 0)
    elif pad_granule is not None:
        pad_granule = batch_padding.resolve_pad_granule(pad_granule, physical_batch_size)
    return sampler, pad_granule


def log_privacy_unit(mechanism, steps):
    """Under users: N, the users per step, k, and the group-privacy comparison."""
    sampler = mechanism.sampler
    if sampler.privacy_unit != "user":
        return
    k = sampler.max_examples_per_user
    ledger = mechanism.ledger()
    reporting.log(
        f"privacy unit: user (N={sampler.dataset_size} users, expected "
        f"{sampler.logical_batch_size} users per step, at most {k} examples of a user per "
        f"step); planned {ledger.describe_epsilon(steps=steps)}")
    if ledger.bands > 1:  # No group-privacy comparison holds for banded runs.
        return
    claim = privacy.example_level_claim(ledger, k, steps)
    reporting.log(f"for comparison, {privacy.describe_example_level_claim(claim)} "
                  f"({claim['how']})")


def privacy_unit_summary(ledger, steps, k):
    """`summary.json`'s privacy unit, with the group-privacy comparison for users.

    The comparison is left out of banded runs (`ledger.bands` > 1), for
    which group privacy is not established.
    """
    if ledger is None:
        return None
    unit = {"privacy_unit": ledger.privacy_unit}
    if ledger.privacy_unit == "user":
        unit["max_examples_per_user"] = k
        if ledger.bands == 1:
            unit["example_level_group_privacy"] = privacy.example_level_claim(
                ledger, k, steps)
    return unit


def log_kept_copies(mechanism, steps, kept):
    """Under `DataConfig.duplicates='keep'`: the copies kept, and their group's ε.

    Args:
        mechanism: `tfdp.DPSGD` or None (a non-private run: nothing to say).
        steps: int. The planned steps.
        kept: `tfdp.data.duplicates.KeptCopies` or None.
    """
    if kept is None or mechanism is None:
        return
    reporting.log(kept.describe("training data"))
    claim = privacy.copies_claim(mechanism.ledger(), kept.largest_group, steps)
    reporting.log(f"planned: {privacy.describe_copies_claim(claim)}")


def kept_copies_summary(ledger, steps, kept):
    """`summary.json`'s `duplicates_kept`: the counts and the group's (ε, δ), or None."""
    if kept is None or ledger is None:
        return None
    return dict(kept.to_dict(), **privacy.copies_claim(ledger, kept.largest_group, steps))
