"""Parity of SEAD's rollout correction with upstream veRL's on random inputs (a manual check, never run in CI).

Upstream veRL's package is also called ``verl``, so it lives in a scratch virtual environment of its own, e.g.::

    python3.11 -m venv /tmp/verl_up && /tmp/verl_up/bin/pip install torch==2.13.0 && \\
        /tmp/verl_up/bin/pip install --no-deps verl==0.9.1 && \\
        /tmp/verl_up/bin/pip install packaging numpy tensordict omegaconf transformers ray codetiming orjson
    .venv/bin/python utils/rollout_corr_parity.py --upstream-python /tmp/verl_up/bin/python

The same calls (``verl.trainer.ppo.rollout_corr_helper``'s functions, with veRL's signatures) run under both
interpreters on the same random inputs (log-probs with user-turn gaps in the mask), in float32 and float64; the
table gives, per function and dtype, the largest absolute difference of the weights and metrics, whether the
masks and metric names agree. Rows without a loss token are left out of the inputs: SEAD leaves such rows out
of per-sequence statistics, veRL counts them (docs/verl_compatibility.md).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

IS_SETTINGS = [("token", 2.0, False), ("token", "0.5_5.0", False), ("token", 1.5, True),
               ("sequence", 2.0, False), ("sequence", "0.2_5.0", True), ("sequence", 10.0, True)]
RS_SETTINGS = [("token_k1", "0.5_2.0"), ("token_k2", 0.02), ("token_k3", 0.02), ("seq_sum_k1", "0.2_5.0"),
               ("seq_sum_k2", 0.5), ("seq_sum_k3", 0.5), ("seq_mean_k1", 1.05), ("seq_mean_k2", 0.01),
               ("seq_mean_k3", 0.01), ("seq_max_k2", 0.1), ("seq_max_k3", 0.1),
               ("token_k1,seq_mean_k3,seq_max_k2", "0.6_1.6,0.01,0.2")]


def _inputs(seed: int, dtype: torch.dtype, rows: int = 16, length: int = 48) -> dict[str, torch.Tensor]:
    """Log-probs of a policy and a perturbed rollout policy, and a mask of 1-4 agent turns per row with user
    turns (0) between them and padding after; every row has a loss token."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, length, generator=gen, dtype=torch.float64) * 3
    rollout = old + torch.randn(rows, length, generator=gen, dtype=torch.float64) * 0.15
    mask = torch.zeros(rows, length)
    for i in range(rows):
        pos = 0
        for _ in range(int(torch.randint(1, 5, (1,), generator=gen))):
            pos += int(torch.randint(0, 4, (1,), generator=gen))
            run = int(torch.randint(1, 10, (1,), generator=gen))
            mask[i, pos:pos + run] = 1
            pos += run
    mask[:, 0] = 1
    return {"old": old.to(dtype), "rollout": rollout.to(dtype), "mask": mask}


def _calls() -> list[tuple[str, str, dict]]:
    calls = [(f"weights {level} {thr} norm={norm}", "weights",
              {"rollout_is": level, "rollout_is_threshold": thr, "rollout_is_batch_normalize": norm})
             for level, thr, norm in IS_SETTINGS]
    calls += [(f"rejection {rs} {thr}", "rejection", {"rollout_rs": rs, "rollout_rs_threshold": thr})
              for rs, thr in RS_SETTINGS]
    calls.append(("combined sequence-TIS + token_k1,seq_max_k3", "combined",
                  {"rollout_is": "sequence", "rollout_is_threshold": 2.0, "rollout_rs": "token_k1,seq_max_k3",
                   "rollout_rs_threshold": "0.5_2.0,0.05"}))
    calls.append(("offpolicy metrics", "offpolicy", {}))
    return calls


def compute(in_path: str, out_path: str) -> None:
    """Run every call with whichever ``verl`` this interpreter imports; save the results."""
    import verl.trainer.ppo.rollout_corr_helper as helper

    cases = torch.load(in_path)
    results = []
    for case in cases:
        x = case["inputs"]
        log_ratio = x["old"] - x["rollout"]
        kind, kwargs = case["kind"], case["kwargs"]
        weights, mask = None, None
        if kind == "weights":
            weights, metrics = helper.compute_rollout_correction_weights(log_ratio, x["mask"], **kwargs)
        elif kind == "rejection":
            mask, metrics = helper.compute_rollout_rejection_mask(log_ratio, x["mask"], **kwargs)
        elif kind == "combined":
            proto, mask, metrics = helper.compute_rollout_correction_and_rejection_mask(
                x["old"], x["rollout"], x["mask"], **kwargs)
            weights = proto.batch["rollout_is_weights"]
        else:
            metrics = helper.compute_offpolicy_metrics(x["old"], x["rollout"], x["mask"])
        results.append({"weights": weights, "mask": mask, "metrics": {k: float(v) for k, v in metrics.items()}})
    torch.save(results, out_path)


def _run(python: str, in_path: Path, out_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([python, str(Path(__file__).resolve()), "--compute", str(in_path), str(out_path)], check=True,
                   cwd=in_path.parent, env=env)  # a neutral directory: no stray `verl` or `ray` on the path


def _max_diff(a: dict[str, float], b: dict[str, float]) -> tuple[float, float, str]:
    """Largest absolute and relative difference over the shared metrics, and the metric of the largest relative."""
    worst_abs, worst_rel, name = 0.0, 0.0, ""
    for key in a.keys() & b.keys():
        x, y = a[key], b[key]
        if math.isinf(x) and x == y:
            continue
        diff = abs(x - y)
        rel = diff / max(abs(y), 1e-12)
        worst_abs = max(worst_abs, diff)
        if rel > worst_rel:
            worst_rel, name = rel, key
    return worst_abs, worst_rel, name


def main() -> None:
    """Generate the inputs, run both implementations and print (and optionally save) the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream-python", help="python of the scratch venv with upstream veRL")
    parser.add_argument("--compute", nargs=2, metavar=("IN", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--json", help="write the table as JSON here")
    args = parser.parse_args()
    if args.compute:
        compute(*args.compute)
        return
    if not args.upstream_python:
        parser.error("--upstream-python is required")
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp_dir = Path(tmp)
        cases = [{"kind": kind, "kwargs": kwargs, "name": name, "dtype": str(dtype),
                  "inputs": _inputs(seed, dtype)}
                 for dtype in (torch.float32, torch.float64) for seed in range(args.seeds)
                 for name, kind, kwargs in _calls()]
        torch.save(cases, tmp_dir / "in.pt")
        _run(sys.executable, tmp_dir / "in.pt", tmp_dir / "sead.pt")
        _run(args.upstream_python, tmp_dir / "in.pt", tmp_dir / "upstream.pt")
        ours, theirs = torch.load(tmp_dir / "sead.pt"), torch.load(tmp_dir / "upstream.pt")
    rows: dict[tuple[str, str], dict] = {}
    for case, a, b in zip(cases, ours, theirs):
        row = rows.setdefault((case["name"], case["dtype"]), {"weights": 0.0, "metric_abs": 0.0, "metric_rel": 0.0,
                                                             "worst": "", "masks_equal": True, "same_names": True})
        if a["weights"] is not None:
            row["weights"] = max(row["weights"], float((a["weights"].double() - b["weights"].double()).abs().max()))
        if a["mask"] is not None:
            row["masks_equal"] &= bool(torch.equal(a["mask"].float(), b["mask"].float()))
        row["same_names"] &= set(a["metrics"]) == set(b["metrics"])
        diff_abs, diff_rel, worst = _max_diff(a["metrics"], b["metrics"])
        row["metric_abs"] = max(row["metric_abs"], diff_abs)
        if diff_rel >= row["metric_rel"]:
            row["metric_rel"], row["worst"] = diff_rel, worst
    print(f"{'call':58s} {'dtype':14s} {'weights':>9s} {'metr.abs':>9s} {'metr.rel':>9s} masks names")
    for (name, dtype), row in rows.items():
        print(f"{name:58s} {dtype:14s} {row['weights']:9.2e} {row['metric_abs']:9.2e} {row['metric_rel']:9.2e} "
              f"{'same' if row['masks_equal'] else 'DIFF':5s} {'same' if row['same_names'] else 'DIFF'}")
        table.append({"call": name, "dtype": dtype, **row})
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
