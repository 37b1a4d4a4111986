"""What the parity scripts share: their command line, running Tetra, reading metrics.jsonl, and
the comparisons every layout test makes.

Used by tests/parity/test_*.py (each layout against the single-rank run, under mpirun) and by
tests/cuda/test_train_parity.py (the CUDA backend against the CPU one). Not a test itself: ctest
registers tests/parity/test_*.py only. The pass/fail bookkeeping (Checks) and `rel` are those of
tests/reference/checks.py, the safetensors reader that of tests/reference/safetensors_io.py; both
are re-exported here so that a script imports from one place.

Each script keeps what it checks, with its tolerances and their reasons; only the plumbing lives
here. Helpers that check take the script's Checks and the run's name for the messages.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "reference"))
from checks import Checks, rel  # noqa: E402
from safetensors_io import read_safetensors  # noqa: E402

__all__ = ["Checks", "rel", "read_safetensors", "parse_args", "write_config", "tetra_command", "run_tetra",
           "inspect_checkpoint", "metrics_lines", "raw_field", "step_records", "last_run", "worst_step_rel",
           "check_loss_curve", "check_loss_falls", "tensors_worst", "check_gradients", "comm_mismatches"]


# ---- command line and work directory ------------------------------------------------------------

def parse_args(mpirun=True, flags=()):
    """--tetra BIN --workdir DIR [--mpirun MPIRUN] (as tests/CMakeLists.txt passes them) plus the
    store-true `flags`; the work directory is recreated empty."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--tetra", required=True)
    ap.add_argument("--workdir", required=True)
    if mpirun:
        ap.add_argument("--mpirun", default=shutil.which("mpirun") or "mpirun")
    for flag in flags:
        ap.add_argument(flag, action="store_true")
    args = ap.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    return args


def write_config(out, cfg, fresh=True):
    """Writes cfg as out/config.json, out recreated empty first when `fresh`; returns its path."""
    if fresh:
        shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "config.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


# ---- running Tetra ------------------------------------------------------------------------------

def tetra_command(args, tetra_args, world=1, env=None):
    """(command line, environment) that run `tetra tetra_args` on `world` ranks: the process itself
    for one rank, else under mpirun (--oversubscribe: more ranks than cores). One OpenMP thread per
    rank; mpirun may run as root (containers, CI). `env` overrides the environment, a None value
    removes a variable."""
    cmd = [args.tetra, *tetra_args]
    if world > 1:
        cmd = [args.mpirun, "--oversubscribe", "-np", str(world)] + cmd
    e = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    for k, v in (env or {}).items():
        if v is None:
            e.pop(k, None)
        else:
            e[k] = v
    return cmd, e


def run_tetra(args, tetra_args, world=1, timeout=300, env=None, expect=0):
    """Runs tetra (tetra_command) to its end; returns the CompletedProcess (output as text). Prints
    the end of its output when the exit code is not `expect` (None: never)."""
    cmd, e = tetra_command(args, tetra_args, world, env)
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", env=e, timeout=timeout)
    if expect is not None and r.returncode != expect:
        print(r.stdout[-3000:], r.stderr[-3000:])
    return r


def inspect_checkpoint(args, step_dir, timeout=120):
    """`tetra ckpt inspect` on one checkpoint step: (True if it verifies that every tensor is covered
    exactly once, the end of its stderr). A tetra that cannot run is (False, why): a failed check,
    never a skipped one."""
    cmd = [args.tetra, "ckpt", "inspect", step_dir]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"cannot run {' '.join(cmd)}: {e}"
    return r.returncode == 0 and "every tensor covered exactly once" in r.stdout, r.stderr.strip()[-500:]


# ---- metrics.jsonl ------------------------------------------------------------------------------

def metrics_lines(out):
    """The records of out/metrics.jsonl, each as (the line as written, the parsed record)."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [(line, json.loads(line)) for line in f]


def raw_field(line, key):
    """A number of a metrics.jsonl line as written (a string: equal strings are equal bits)."""
    return line.split(f'"{key}":', 1)[1].split(",", 1)[0]


def step_records(out):
    """The step records of out/metrics.jsonl (of every run that wrote to it), in order."""
    return [j for _, j in metrics_lines(out) if "step" in j]


def last_run(out):
    """{step: (loss as written, record)} of the last run in out/metrics.jsonl (the step records
    after its last "start" event)."""
    runs = []
    for line, j in metrics_lines(out):
        if j.get("event") == "start":
            runs.append({})
        elif "step" in j:
            runs[-1][j["step"]] = (raw_field(line, "loss"), j)
    return runs[-1] if runs else {}


# ---- comparisons --------------------------------------------------------------------------------

def worst_step_rel(steps, ref_steps, key="loss"):
    """The largest relative difference of `key` between paired step records; infinite when the two
    runs logged different numbers of steps (or none), so that a short curve can never pass."""
    if len(steps) != len(ref_steps) or not steps:
        return float("inf")
    return max(rel(s[key], r[key]) for s, r in zip(steps, ref_steps))


def check_loss_curve(checks, name, steps, ref_steps, n_steps, rtol, norm_rtol=None):
    """A run's step records against the reference run's: n_steps logged, every step's loss within
    rtol, and (with norm_rtol) every step's gradient norm within norm_rtol."""
    checks.check(len(steps) == n_steps and len(ref_steps) == n_steps,
                 f"{name}: {len(steps)} steps logged, the reference {len(ref_steps)}, {n_steps} expected")
    worst = worst_step_rel(steps, ref_steps)
    checks.check(worst <= rtol, f"{name}: losses of {n_steps} steps within {rtol:g} (worst {worst:.2e})")
    if norm_rtol is not None:
        worst_norm = worst_step_rel(steps, ref_steps, "grad_norm")
        checks.check(worst_norm <= norm_rtol, f"{name}: gradient norms within {norm_rtol:g} (worst {worst_norm:.2e})")


def check_loss_falls(checks, name, losses, by=0.1):
    """The guard against a vacuous pass: the run learns (its last loss is `by` below its first)."""
    checks.check(losses[-1] < losses[0] - by, f"{name}: the loss falls ({losses[0]:.4f} -> {losses[-1]:.4f})")


def tensors_worst(ref, got):
    """Per tensor of ref, the relative error ||got - ref|| / ||ref||: (the worst, its name, the
    names got lacks or holds in another shape)."""
    worst, worst_name, missing = 0.0, "", []
    for k, r in ref.items():
        if k not in got or got[k].shape != r.shape:
            missing.append(k)
            continue
        e = float(np.linalg.norm(got[k] - r) / max(np.linalg.norm(r), 1e-30))
        if e > worst:
            worst, worst_name = e, k
    return worst, worst_name, missing


def check_gradients(checks, name, ref, got, rtol):
    """Every step-0 gradient tensor of ref is in got, each within rtol (tensors_worst)."""
    worst, worst_name, missing = tensors_worst(ref, got)
    for k in missing:
        checks.check(False, f"{name}: gradient {k} missing or of another shape")
    checks.check(worst <= rtol, f"{name}: step-0 gradient of every tensor within {rtol:g} "
                                f"(worst {worst:.2e}, {worst_name})")


def comm_mismatches(records, exact=True):
    """Measured against predicted communication in step records: (the steps where some group's
    measurement does not match the prediction, each printed; every group seen). With `exact` the
    measured figures must also equal the predicted ones; without, the record's own "match" verdict
    decides (it matches data-dependent payloads, such as routed tokens, on their calls only)."""
    bad, seen = [], set()
    for s in records:
        for group, c in s.get("comm", {}).items():
            seen.add(group)
            if not c["match"] or (exact and c["measured"] != c["predicted"]):
                print(f"  step {s['step']} {group}: measured {c['measured']} predicted {c['predicted']}")
                if s["step"] not in bad:
                    bad.append(s["step"])
    return bad, seen
