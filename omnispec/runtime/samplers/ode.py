"""The deterministic sampler: each walk steps with its own stepper (Euler, or the scheduler's ``step``)."""


class Deterministic:
    stochastic = False


ODE = Deterministic()
