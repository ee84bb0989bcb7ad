"""The cost model's predictions from measured runs: `dpcompare plan --from RUN_DIR` (command.py), `compare`'s
`prediction` and `memory_prediction` in each run's summary.json (predictions.py), and the `doctor --fabric --out`
file (links.py).

    runs.py         reading runs: summary and model spec, calibration, the N=1 run beside, cores shared
    predictions.py  compare's per-run predictions (step and memory), and the fits they take
    table.py        a plan's rows per strategy and N, its table and its figure (no run read)
    meshes.py       `plan --meshes`: every mesh per N, the fastest named
    links.py        the link(s) a plan predicts over (one, or two levels); the fabric file written and read
    command.py      `dpcompare plan`: the flags, the run, its link, plan.json, plan.png and the printout
"""
from compare.plan.command import run_plan
from compare.plan.links import predicted_backend, write_fabric
from compare.plan.predictions import add_memory_predictions, add_predictions, fit_runs, predicted_record
from compare.plan.runs import cores_shared_by, n1_beside

__all__ = ["add_memory_predictions", "add_predictions", "cores_shared_by", "fit_runs", "n1_beside",
           "predicted_backend", "predicted_record", "run_plan", "write_fabric"]
