"""What this machine offers, found without importing a framework in this process: BLAS, MPI, versions and
free ports (environment), the backends and devices each framework build has (backends), matmul peaks
(peak), and the measured fabric between ranks (fabric)."""
