"""The xdist controller's side of `--dist megatron`: the `--dist` choice, `-n auto`, worker
setup, and the scheduler that places (module, world size) units on device blocks."""
