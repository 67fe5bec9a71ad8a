"""onboard: a model-onboarding pipeline (quantize, eval, speculator, adapt, smoke)."""

__version__ = "0.16.0"  # = pyproject.toml's version (a test pins it)
