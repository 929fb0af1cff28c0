"""`GaussianNoise`: DP-SGD's independent N(0, (σC)²) noise, drawn once per logical step."""

from tfdp.dp import noise as noise_lib
from tfdp.dp.noise_schemes import base


@base.register
class GaussianNoise(base.NoiseScheme):
    """Independent Gaussian noise each step, from `step_seed(noise_key, step)`.

    No state. Accounted by the sampler's own event
    (`tfdp.samplers.Sampler.dp_event`): the default `dp_event`. With
    `hardened_noise`, the hardened draw and release (`tfdp.dp.noise`).
    """

    name = "gaussian"

    def noise(self, like, *, stddev, noise_key, step, state=None):
        """N(0, stddev²) per coordinate (see `NoiseScheme.noise`); `state` is unused."""
        del state  # No state.
        return noise_lib.gaussian_noise(like, stddev, noise_lib.step_seed(noise_key, step),
                                        self.hardened_noise)

    def noisy_mean(self, sums, *, stddev, noise_key, step, divisor, state=None):
        """`(sums + noise) / divisor`, each draw consumed before the next starts.

        The same values as `NoiseScheme.noisy_mean` over `noise`, with the
        peak memory of one draw (`tfdp.dp.noise.noisy_divided`).
        """
        del state  # No state.
        # noise / R drawn directly as N(0, (σC/R)²) from the same words.
        return noise_lib.noisy_divided(
            sums, stddev, noise_lib.step_seed(noise_key, step), divisor, self.hardened_noise)
