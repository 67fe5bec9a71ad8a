"""`python -m onboard`: what `torchrun -m onboard quantize ...` starts in each process."""

from onboard.cli import main

main()
