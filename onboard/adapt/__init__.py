"""The adapt stage: map a checkpoint onto the reference engine and prove logit parity."""
