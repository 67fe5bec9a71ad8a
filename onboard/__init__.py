"""onboard: a model-onboarding pipeline (quantize, eval, speculator, adapt, smoke)."""

__version__ = "0.15.0"  # = pyproject.toml's version (a test pins it)
