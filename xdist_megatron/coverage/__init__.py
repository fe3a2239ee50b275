"""Coverage of the code the zygote and the ranks run, and of torchrun ranks, into one report."""
