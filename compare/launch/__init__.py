"""Starting a run: the inputs it reads and the run itself (runner), the command line that starts its ranks
(launchers: one function per launcher), our own local spawner (spawn), the watchdog over the ranks, and
hostfile reading and checking (hosts); inside a Slurm allocation the ranks are one srun step (slurm, and
slurm_rank in each task). sample.py starts a finished run's framework once more, for the
greedy continuation the report shows."""
