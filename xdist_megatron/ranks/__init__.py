"""What runs in the zygote (the fork server that preloads torch and the suite's libraries) and on
the ranks forked from it: the rank loop, its own pytest session, capture, and the isolation of
process-global state between tests. Nothing here imports `driver/` or `controller/`."""
