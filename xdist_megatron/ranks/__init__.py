"""What runs on the ranks the zygote forks: the rank loop, its own pytest session, capture, and
the isolation of process-global state between tests. Nothing here imports `driver/` or
`controller/`."""
