"""Starting a run: the inputs it reads, the command line that starts its ranks (one launcher per framework
and backend), our own local spawner, the watchdog over the ranks, and hostfile reading and checking."""
