"""onboard: a model-onboarding pipeline (quantize, eval, speculator, adapt, smoke)."""

__version__ = "0.1.0"
