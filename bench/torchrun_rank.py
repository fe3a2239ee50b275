"""One torchrun rank of `bench/real_suite.py`: pytest as `-m pytest` would run it, with a junit
file and a stream of reports of its own (torchrun cannot give each rank its own `--junitxml`).

    python -m torch.distributed.run ... bench/torchrun_rank.py FOLDER -- PYTEST_ARGS

Its module level imports only the standard library. A test's multiprocessing `spawn` child runs
the main script again, as `__mp_main__`, with the rank's sys.path, which no longer holds bench/:
when real_suite.py itself was the rank's script, that import failed in every such child, and
Megatron-LM's checkpointing tests that save through one failed under torchrun only. Under
`torchrun -m pytest` the child imports `pytest.__main__` instead, which does nothing.
"""

import os
import sys


def main(folder: str, pytest_args: list[str]) -> int:
    import pytest
    from stream_reports import StreamReports

    sys.path[0] = os.getcwd()  # as under `python -m pytest`
    rank = os.environ["RANK"]
    args = [*pytest_args, f"--junitxml={folder}/rank{rank}.xml"]
    return pytest.main(args, plugins=[StreamReports(f"{folder}/rank{rank}.jsonl")])


if __name__ == "__main__":
    argv = sys.argv[1:]
    sys.exit(main(argv[0], argv[2:] if argv[1:2] == ["--"] else argv[1:]))
