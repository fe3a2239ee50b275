"""Suites whose own harness spawns processes for every test, run on the session's gangs: the
harness's parent side stays in the driver, what its spawned children would run runs on the ranks
(DESIGN: "Suites whose harness spawns per test"). `pytorch.py`: PyTorch's `MultiProcessTestCase`
family, recognised and adapted in the driver; `pytorch_child.py`: a child's part, on a rank."""
