"""A cost model of one optimizer step, calibrated on a measured run: time and memory per rank for any
(framework, strategy, N, link, dtype). Framework-neutral; `dpcompare plan` and `compare`'s `prediction` use
it, docs/scaling.md explains it with worked examples. Each strategy's own terms (its work and state shares,
its collectives, its memory terms, which of its communication is exposed) live with its object in
common/parallel/ (ddp.py, fsdp.py, tp.py, pp.py); the modules here compose them and ask no strategy's name.

    links.py      Link, Collective: a collective's time over a link (the ring formulas), the links a run records
    workload.py   Workload: what a step trains
    calibrate.py  Calibration: a measured run reduced to per-phase seconds
    fit.py        each axis's host work per byte its collectives move, fitted on an N=2 run of its strategy
    predict.py    Prediction: a step's time and memory at any N over any link, and its bottleneck
    memory.py     memory per rank, and the predicted peak with the frameworks' fitted factors
    rates.py      link rates as users write them (--link 1gbit);  probe.py: the all-reduce a run times

Time of one step at N ranks:

    step_s    = compute_s + exposed_comm_s
    compute_s = (forward + backward) x f_work(strategy, N) + optimizer x f_state(strategy, N) + other [+ host_s]
    exposed_comm_s = the strategy's rule over the step's collectives' time, sum of calls x t(collective):
                     (1 - overlap) x that [+ ddp's sync_overhead_s]; tp all of it; pp its critical path

  - forward, backward, optimizer, other: the calibration run's breakdown, scaled so that they add up to its
    measured step less its communication, then divided by its own f (so every phase is "one rank doing the
    whole global batch"). fsdp, tp and pp run their collectives inside forward and backward
    (common/train/breakdown.py), so for such a calibration run the model's own estimate of those collectives
    is subtracted first.
  - f_work: the share of the global batch's matmul FLOPs (common/model/flops.py) one rank computes; f_state: the
    share of the parameters a rank updates (AdamW touches what it holds). `other` (host overhead per step) is
    taken as constant; host_s is each axis's host work per byte it moves (fit.py where an N=2 run was fitted, else its
    strategy's constants: fsdp's on a CPU), added once where ranks share cores, and on an axis across a two-level
    link's slow level only beyond that axis's exposed time (predict.py's host_s).
  - overlap: measured from a calibration run at N > 1 with a known link, as 1 - exposed / modelled (the
    breakdown's `communication` is the synced minus the unsynced step; without a link record, against the
    loopback figures); a sync that costs more than the collectives alone is overlap 0 plus that excess as a
    fixed cost per step (sync_overhead_s: copies, threads waiting for a core). Unmeasured:
    common/parallel/layout.py's DEFAULT_OVERLAP, 0, measured on the reference machine.

Collectives and links: links.py. Memory per rank (bytes): params + grads + optimizer + activations + gathered +
update + overhead, memory.py.
"""
