"""Steppers: turn (state, prediction, step index) into the next state, for every latent stream. The deterministic
ones are in ``steppers.py``; the stochastic window, its stepper and log-probs in ``stochastic.py``; each sampler
kind's step in its own file, looked up through ``spec.recipe.SAMPLERS``."""

from .steppers import EulerStepper, SchedulerStepper, Stepper, StepResult, euler
from .stochastic import (
    HALF_LOG_2PI,
    SDE_SEED_OFFSET,
    StochasticStepper,
    Transition,
    gaussian_log_prob,
    reused_steps,
    sde_generators,
    squared_error_log_prob,
    stochastic_step,
    stochastic_stepper,
    window_mask,
)

__all__ = ["HALF_LOG_2PI", "SDE_SEED_OFFSET", "EulerStepper", "SchedulerStepper", "StepResult", "Stepper",
           "StochasticStepper", "Transition", "euler", "gaussian_log_prob", "reused_steps", "sde_generators",
           "squared_error_log_prob", "stochastic_step", "stochastic_stepper", "window_mask"]
