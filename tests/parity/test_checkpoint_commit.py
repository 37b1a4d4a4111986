"""The checkpoint commit protocol (trainer/checkpoint/commit.h) under a kill -9 at every
filesystem call of a save.

For each scenario the save's filesystem calls are first counted (TETRA_FAULT_SAVE_LOG); then, for
every call k, a fresh copy of the checkpoint directory is taken, the command runs with
TETRA_FAULT_SAVE_AT=k (the process kills itself with SIGKILL just before its k-th call), and the
very same command runs again without the fault. That rerun must succeed, and what it leaves must
be the uninterrupted run's: right after the kill `latest` names a complete checkpoint (the
protocol's invariant); after the rerun it names the final step, whose rank files are bitwise those of
a run that was never interrupted, and `tetra ckpt inspect` verifies every step_* directory.

Scenarios, on one rank and on dp 2 (under mpirun: every rank has its own count, so the kill hits
rank 0 or rank 1 at each of its calls):
  - fresh step: resume (auto) from step 4, train to 6: step 6 is saved for the first time and
    step 2 is rotated away (keep 2);
  - re-saved step: resume explicitly from step 4 while step 6 exists, train to 6: step 6 is saved
    again over the complete one (the exchange path; and, on one rank, with TETRA_FAULT_NO_EXCHANGE,
    the set-aside path of filesystems that cannot exchange two names).

Usage: /usr/bin/python3 test_checkpoint_commit.py --tetra BIN --workdir DIR [--mpirun MPIRUN]
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys

import harness
from harness import Checks

checks = Checks()
check = checks.check

MODEL = {"vocab_size": 64, "seq_len": 16, "num_layers": 2, "hidden_size": 32, "num_heads": 4,
         "num_kv_heads": 2, "ffn_hidden_size": 64}


def config(path, out, ckpt, steps, dp, resume="auto", exit_at=0):
    cfg = {
        "model": MODEL,
        "parallel": {"dp": dp, "distributed_optimizer": dp > 1},
        "training": {"micro_batch_size": 2, "global_batch_size": 4, "steps": steps, "threads": 1,
                     "peak_gflops": 10, "seed": 5, "exit_interval": exit_at},
        "data": {"synthetic": True},
        "checkpoint": {"dir": ckpt, "every": 2, "keep": 2, "resume": resume, "save_on_exit": True},
        "logging": {"dir": out, "level": "warn"},
    }
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def run(args, path, dp, env=None):
    return harness.run_tetra(args, ["--config", path], dp, timeout=120, env=env, expect=None)


def rank_files_digest(step_dir):
    h = hashlib.sha256()
    for name in sorted(os.listdir(step_dir)):
        if name.startswith("rank_"):
            h.update(name.encode())
            h.update(open(os.path.join(step_dir, name), "rb").read())
    return h.hexdigest()


def scenario(args, name, dp, resave, env=None):
    w = os.path.join(args.workdir, name)
    os.makedirs(w)
    # The pristine directory: steps 2 and 4 (fresh) or 4 and 6 (re-save); the reference step 6.
    ref_ck = os.path.join(w, "ref_ckpt")
    r = run(args, config(os.path.join(w, "ref", "config.json"), os.path.join(w, "ref", "logs"), ref_ck, 6, dp), dp)
    check(r.returncode == 0, f"{name}: the reference run (exit {r.returncode})")
    if r.returncode != 0:
        return
    want = rank_files_digest(os.path.join(ref_ck, "step_00000006"))
    pristine = os.path.join(w, "pristine")
    # (training.steps is 6 in every run: the learning-rate schedule depends on it)
    r = run(args, config(os.path.join(w, "seed", "config.json"), os.path.join(w, "seed", "logs"), pristine,
                         6, dp, exit_at=0 if resave else 4), dp)
    check(r.returncode == 0, f"{name}: the run that makes the starting checkpoints (exit {r.returncode})")
    if r.returncode != 0:
        return

    ck = os.path.join(w, "ckpt")
    cfg = config(os.path.join(w, "run", "config.json"), os.path.join(w, "run", "logs"), ck, 6, dp,
                 resume=os.path.join(ck, "step_00000004") if resave else "auto")

    # Count the calls of the save: the command once, uninterrupted, on a copy.
    shutil.copytree(pristine, ck)
    log = os.path.join(w, "calls.log")
    r = run(args, cfg, dp, env={**(env or {}), "TETRA_FAULT_SAVE_LOG": log})
    calls = max(int(line.split()[0]) for line in open(log)) if os.path.exists(log) else 0
    check(r.returncode == 0 and calls >= 10, f"{name}: the uninterrupted save makes {calls} filesystem calls")
    if resave:
        ops = open(log).read()
        how = ".old" if env else " exchange "
        check(how in ops, f"{name}: the save replaces the existing step ({'set aside' if env else 'exchanged'})")
    shutil.rmtree(ck)

    failures = []
    for k in range(1, calls + 1):
        shutil.copytree(pristine, ck)
        killed = run(args, cfg, dp, env={**(env or {}), "TETRA_FAULT_SAVE_AT": str(k)})
        # At the instant of the kill, `latest` names a complete checkpoint (on a filesystem that
        # cannot exchange names, possibly its set-aside or staged copy, which the resolver reads).
        named = open(os.path.join(ck, "latest")).read().strip() if os.path.exists(os.path.join(ck, "latest")) else ""
        copies = [named] + ([f".{named}.tmp", f".{named}.old"] if env else [])
        latest_complete = any(os.path.exists(os.path.join(ck, c, "manifest.json")) for c in copies)
        rerun = run(args, cfg, dp, env=env)
        latest = open(os.path.join(ck, "latest")).read().strip() if os.path.exists(os.path.join(ck, "latest")) else ""
        problems = []
        if killed.returncode == 0:
            problems.append("the fault did not stop the run")
        if not latest_complete:
            problems.append(f"after the kill, latest names '{named}', which is not a complete checkpoint")
        if rerun.returncode != 0:
            problems.append(f"the rerun exited {rerun.returncode}: {rerun.stderr.strip()[-300:]}")
        if latest != "step_00000006":
            problems.append(f"latest is '{latest}'")
        elif rank_files_digest(os.path.join(ck, latest)) != want:
            problems.append("step_00000006 differs from the uninterrupted run's")
        for d in sorted(os.listdir(ck)):
            if d.startswith("step_"):
                ok, err = harness.inspect_checkpoint(args, os.path.join(ck, d))
                if not ok:
                    problems.append(f"inspect {d}: {err}")
        if problems:
            failures.append(f"kill at call {k}: " + "; ".join(problems))
        shutil.rmtree(ck)
    check(not failures, f"{name}: a kill -9 at each of the {calls} filesystem calls, then the same command: "
                        f"{calls - len(failures)} of {calls} resumed to the uninterrupted result"
                        + ("".join("\n    " + f for f in failures[:5])))


def main():
    args = harness.parse_args()
    for dp in (1, 2):
        for resave in (False, True):
            scenario(args, f"{'resave' if resave else 'fresh'}_dp{dp}", dp, resave)
    # A filesystem that cannot exchange two names: the re-save sets the old copy aside.
    scenario(args, "resave_set_aside_dp1", 1, True, env={"TETRA_FAULT_NO_EXCHANGE": "1"})
    return checks.report()


if __name__ == "__main__":
    sys.exit(main())
