"""Starting a run: the checks before any worker starts and the hand-over to the backend (launcher), the machines a
scheduler started the command on (cluster), what a worker process runs (worker), the workdir's lock (workdir_lock),
and signals during training (interrupts)."""
