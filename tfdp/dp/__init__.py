"""The DP engine: per-example clipping, ghost norms, noise and accumulation."""

from tfdp.dp.adapted_state import declare_public
from tfdp.dp.adapted_state import find_adapted_state
from tfdp.dp.clip_rule import clip_coefficients
from tfdp.dp.clipping import METHODS
from tfdp.dp.clipping import TAPE_METHODS
from tfdp.dp.clipping import clipped_grad_sum
from tfdp.dp.clipping import default_weight_decay_variables
from tfdp.dp.clipping import resolve_method
from tfdp.dp.freezing import freeze_unclippable
from tfdp.dp.jacobian_clipping import jacobian_clipped_sum
from tfdp.dp.layerwise_plan import ClippingPlan
from tfdp.dp.layerwise_plan import plan
from tfdp.dp.logical_step_state import LogicalStepState
from tfdp.dp.logical_steps import run_logical_steps
from tfdp.dp.noise import add_noise
from tfdp.dp.noise import step_seed
from tfdp.dp.noise_schemes import NoiseScheme
from tfdp.dp.noisy_aggregator import NoisyAggregator
from tfdp.dp.private_step import NonPrivateTrainStep
from tfdp.dp.private_step import PrivateTrainStep
from tfdp.dp.sensitivity import check_sensitivity
