"""The clipping rule: how a unit's gradient norm becomes its factor c_i.

Every clipping method (`clipping.clipped_grad_sum`'s five, and
`jacobian_clipping.jacobian_clipped_sum`) forms its sum as Σ_i c_i·g_i with
c_i from `clip_coefficients`, the one place where a unit's factor is
computed: "standard" clipping or "automatic" normalising, with non-finite
gradients dropped. `ClipRule` holds C and the rule, validated once.
"""

import tensorflow as tf

from tfdp import validation


def clip_coefficients(norms, l2_norm_clip, mask, clipping="standard",
                      clipping_gamma=validation.DEFAULT_CLIPPING_GAMMA):
    """Each unit's factor c_i, zero for padding and for non-finite gradients.

    - "standard": c_i = min(1, C/‖g_i‖), clipping (Abadi et al. 2016).
    - "automatic": c_i = C/(‖g_i‖ + γ), normalising (Bu et al. 2023, AUTO-S):
      every unit contributes C·g_i/(‖g_i‖ + γ), of norm below C, so the
      sensitivity (and ε) is that of clipping to C, and no C needs tuning
      (it only scales the update, as the learning rate does).

    An example whose gradient is NaN/Inf contributes nothing: dropping one
    example's contribution keeps the sensitivity bound. This is the one place
    where a unit's factor is computed, for every clipping method.

    Args:
        norms: float tensor `[B]`. The units' gradient norms.
        l2_norm_clip: float. C.
        mask: float tensor `[B]`. 1 for real units, 0 for padding.
        clipping: str. "standard" or "automatic". Defaults to "standard".
        clipping_gamma: float. γ of "automatic". Defaults to 0.01.
    """
    norms = tf.convert_to_tensor(norms)
    clip = tf.cast(l2_norm_clip, norms.dtype)
    if clipping == "automatic":
        coeffs = clip / (norms + tf.cast(clipping_gamma, norms.dtype))
    else:
        coeffs = clip / tf.maximum(norms, clip)
    coeffs = tf.where(tf.math.is_finite(norms), coeffs, tf.zeros_like(coeffs))
    return coeffs * mask


class ClipRule:
    """C and the rule that turns a unit's norm into its factor (`clip_coefficients`).

    Args:
        l2_norm_clip: float. C > 0.
        clipping: str. "standard" or "automatic". Defaults to "standard".
        clipping_gamma: float. γ > 0 of "automatic". Defaults to 0.01.
    """

    def __init__(self, l2_norm_clip, clipping="standard",
                 clipping_gamma=validation.DEFAULT_CLIPPING_GAMMA):
        self.l2_norm_clip = validation.validate_l2_norm_clip(l2_norm_clip)
        self.clipping = validation.validate_clipping(clipping)
        self.clipping_gamma = validation.validate_clipping_gamma(clipping_gamma)

    def coefficients(self, norms, mask):
        """The units' factors (`clip_coefficients`)."""
        return clip_coefficients(norms, self.l2_norm_clip, mask, self.clipping,
                                 self.clipping_gamma)
