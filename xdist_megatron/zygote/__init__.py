"""The zygote: a fork server that imports torch and the suite's libraries once and forks ranks
(and, under xdist, the workers). `server.py` serves the drivers' requests and forks; `preload.py`
imports what the ranks need without spoiling CUDA for them; `worker.py` makes a forked process
an xdist worker. Started as `python -m xdist_megatron.zygote`; nothing here imports the driver's
or the controller's side."""
