"""The framework-neutral side of dpcompare. Nothing here imports mlx or torch.

The commands sit at the top (cli, flags, matrix, submit, diagnose, doctor, export); the rest is three parts:
  launch/   start a run's ranks as subprocesses and watch them (runner, launchers, spawn, watchdog, hosts;
            slurm and slurm_rank inside a Slurm allocation), and sample a finished run (sample)
  report/   judge parity and write the report, reading run directories only
  machine/  what this machine offers: BLAS, MPI, versions, matmul peaks, the fabric between ranks
"""
