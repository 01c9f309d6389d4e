"""RL for flow models: SDE rollouts with per-step log-probs, exact replay with gradients, weight sync.

``Pipeline.rollout`` / ``Pipeline.log_prob`` are the entry points; ``kl`` is Flow-GRPO's KL term on two
replays; ``losses`` holds the policy losses (PPO's clipped surrogate, GRPO-Guard's regulated ratio, DiffusionNFT's
loss) and ``denoiser`` the prediction at states a trainer makes (forward-process training); ``RolloutPool`` spreads
rollouts over Ray actors and ``RolloutEngine`` serves a separate trainer process from them
(``pip install 'omnispec-diffusion[ray]'``).
"""

from .forward import Denoiser, denoiser
from .losses import NFTLoss, clipped_surrogate, guard_log_ratio, nft_loss, nft_noised, nft_steps
from .pipeline import RLPipeline
from .rollout import Replay, Rollout, kl, log_prob, rollout
from .weights import reference, scale_lora, set_lora, update_weights

__all__ = ["RLPipeline", "Replay", "Rollout", "RolloutPool", "kl", "log_prob", "reference", "rollout", "scale_lora",
           "set_lora", "update_weights", "Denoiser", "NFTLoss", "clipped_surrogate", "denoiser", "guard_log_ratio",
           "nft_loss", "nft_noised", "nft_steps", "RolloutEngine"]


def __getattr__(name: str):
    if name == "RolloutPool":
        from .pool import RolloutPool

        return RolloutPool
    if name == "RolloutEngine":
        from .engine import RolloutEngine

        return RolloutEngine
    raise AttributeError(name)
