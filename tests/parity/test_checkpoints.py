"""Checkpoints: exact resume, resume on another layout, crash safety, corruption.

  - Resume exactness: 2N steps straight vs N steps, stop, resume for N more: the losses of the
    resumed steps are bitwise identical (compared as the strings metrics.jsonl holds), single rank
    and dp2 x tp2 with the distributed optimizer and sequence parallelism.
  - Reshard: a checkpoint saved at step N under each of {1 rank, dp2, tp2, dp2 x tp2 distributed
    optimizer} resumes under each other layout; the next steps' losses match the uninterrupted
    single-rank run within the layout-invariance tolerance (1e-5 relative, tests/parity/
    test_layouts.py explains it).
  - Crash safety: the job is killed (SIGKILL, every rank) at random moments while it saves a
    checkpoint every step; every time, a resume succeeds from a complete checkpoint (`latest`
    names one) and continues the loss curve.
  - Corruption: a flipped byte, a truncated rank file, a missing rank file, and a checkpoint of
    another model are each refused (exit 2) with a message naming the file (and tensor), and the
    checkpoint directory is left untouched.

Usage: /usr/bin/python3 test_checkpoints.py --tetra BIN --workdir DIR [--mpirun MPIRUN]
"""
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import harness
from harness import Checks

LOSS_RTOL = 1e-5
N = 6  # steps before the stop

checks = Checks()
check = checks.check


MODEL = {"vocab_size": 64, "make_vocab_size_divisible_by": 1, "seq_len": 16, "num_layers": 2, "hidden_size": 64, "num_heads": 8,
         "num_kv_heads": 4, "ffn_hidden_size": 96, "norm": "rmsnorm", "activation": "swiglu",
         "position": "rope", "tie_embeddings": False, "bias": False}


def config(workdir, name, steps, layout, ckpt_dir, every=0, resume="auto", precision="fp32", exit_at=0,
           training=None):
    dp, tp, sp, dist_opt = layout
    out = os.path.join(workdir, name)
    cfg = {
        "model": MODEL,
        "parallel": {"dp": dp, "tp": tp, "sequence_parallel": sp, "distributed_optimizer": dist_opt,
                     "bucket_size": 3000},
        "training": {"micro_batch_size": 2, "global_batch_size": 8, "steps": steps, "threads": 1,
                     "peak_gflops": 100, "seed": 11, "precision": precision, "exit_interval": exit_at},
        "optimizer": {"lr": 1e-2, "warmup_steps": 2},
        "data": {"synthetic": True},
        "checkpoint": {"dir": ckpt_dir, "every": every, "keep": 2, "resume": resume, "save_on_exit": True},
        "logging": {"dir": out, "level": "warn"},
    }
    cfg["training"].update(training or {})
    return harness.write_config(out, cfg, fresh=False), out


def launch(args, path, layout):
    return harness.tetra_command(args, ["--config", path], layout[0] * layout[1])


def run(args, path, layout, expect=0):
    return harness.run_tetra(args, ["--config", path], layout[0] * layout[1], expect=expect)


def losses(out):
    """{step: loss as written} of the last run in out/metrics.jsonl (raw strings: bitwise)."""
    return {step: raw for step, (raw, _) in harness.last_run(out).items()}


def popen(cmd, env):
    """The run in a session of its own, so that finish() can end all of its processes."""
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)


def finish(proc, timeout=120):
    """The run's output once it exits; a run still going after `timeout` s is killed (every rank),
    so that a failure leaves no process behind, and the output says so."""
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate()[0] + f"\n(killed: still running after {timeout} s)"


def tree_digest(path):
    h = hashlib.sha256()
    for root, _, files in sorted(os.walk(path)):
        for name in sorted(files):
            p = os.path.join(root, name)
            h.update(p.encode())
            with open(p, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


LAYOUTS = {"single": (1, 1, False, False), "dp2": (2, 1, False, False), "tp2": (1, 2, False, False),
           "dp2tp2": (2, 2, True, True)}


def main():
    args = harness.parse_args()
    w = args.workdir

    # The uninterrupted reference, 2N steps, single rank.
    path, out = config(w, "straight", 2 * N, LAYOUTS["single"], os.path.join(w, "ck_straight"))
    check(run(args, path, LAYOUTS["single"]).returncode == 0, "straight run")
    straight = losses(out)
    check(len(straight) == 2 * N, f"straight run logged {len(straight)} steps")

    # Exactness on the same layout.
    for name in ("single", "dp2tp2"):
        lay = LAYOUTS[name]
        ck = os.path.join(w, f"ck_exact_{name}")
        ref_path, ref_out = config(w, f"exact_{name}_ref", 2 * N, lay, os.path.join(w, f"ck_exact_{name}_ref"))
        run(args, ref_path, lay)
        ref = losses(ref_out)
        p1, o1 = config(w, f"exact_{name}_a", 2 * N, lay, ck, exit_at=N)
        r1 = run(args, p1, lay)
        check(r1.returncode == 0 and os.path.exists(os.path.join(ck, "latest")), f"{name}: first {N} steps, checkpoint saved")
        p2, o2 = config(w, f"exact_{name}_b", 2 * N, lay, ck)
        r2 = run(args, p2, lay)
        resumed = losses(o2)
        check(r2.returncode == 0 and sorted(resumed) == list(range(N + 1, 2 * N + 1)),
              f"{name}: resumed run continues at step {N + 1} (steps {sorted(resumed)})")
        same = all(resumed.get(s) == ref.get(s) for s in range(N + 1, 2 * N + 1))
        check(same, f"{name}: steps {N + 1}..{2 * N} bitwise identical to the uninterrupted run")

    # Reshard: save under each layout, resume under each other one.
    for src, src_lay in LAYOUTS.items():
        ck = os.path.join(w, f"ck_from_{src}")
        p1, _ = config(w, f"save_{src}", 2 * N, src_lay, ck, exit_at=N)
        if run(args, p1, src_lay).returncode != 0:
            check(False, f"save under {src}")
            continue
        for dst, dst_lay in LAYOUTS.items():
            if dst == src:
                continue
            ck_copy = os.path.join(w, f"ck_{src}_to_{dst}")
            shutil.copytree(ck, ck_copy)
            p2, o2 = config(w, f"resume_{src}_to_{dst}", 2 * N, dst_lay, ck_copy)
            r = run(args, p2, dst_lay)
            got = losses(o2)
            worst = max((abs(float(got[s]) - float(straight[s])) / abs(float(straight[s]))
                         for s in range(N + 1, 2 * N + 1) if s in got), default=float("inf"))
            check(r.returncode == 0 and len(got) == N and worst <= LOSS_RTOL,
                  f"saved under {src}, resumed under {dst}: {N} steps within {LOSS_RTOL:g} (worst {worst:.2e})")

    # Crash safety: kill -9 while saving every step.
    ck = os.path.join(w, "ck_crash")
    rng = random.Random(5)
    survived = 0
    deadline = time.time() + 60
    for attempt in range(8):
        if time.time() > deadline:
            break
        p, o = config(w, f"crash_{attempt}", 1000, LAYOUTS["dp2"], ck, every=1)
        cmd, env = launch(args, p, LAYOUTS["dp2"])
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                                start_new_session=True)
        time.sleep(rng.uniform(1.5, 3.5))
        # Every process of the job (mpirun and its ranks: their command lines name the config).
        subprocess.run(["pkill", "-KILL", "-f", p], check=False)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for _ in range(100):
            if subprocess.run(["pgrep", "-f", p], capture_output=True).returncode != 0:
                break
            time.sleep(0.05)
        # The next run resumes from a complete checkpoint and continues.
        latest_path = os.path.join(ck, "latest")
        if not os.path.exists(latest_path):  # killed before the first save completed
            continue
        with open(latest_path) as f:
            latest = f.read().strip()
        step = int(latest.split("_")[1])
        p2, o2 = config(w, f"after_crash_{attempt}", step + 1, LAYOUTS["single"], ck)
        r = run(args, p2, LAYOUTS["single"])
        got = losses(o2)
        ok = r.returncode == 0 and list(got) == [step + 1]
        survived += ok
        check(ok, f"kill -9 #{attempt}: resumed from {latest} (complete) and trained step {step + 1}")
    check(survived >= 3, f"{survived} kill -9 rounds survived")

    # A signal (Slurm's --signal=USR1@..., or SIGTERM) stops every rank after the same step, with
    # a checkpoint, and exit code 0; the resumed run continues from there.
    for signame in ("SIGUSR1", "SIGTERM"):
        ck = os.path.join(w, f"ck_{signame}")
        p, o = config(w, f"signal_{signame}", 100000, LAYOUTS["dp2"], ck)
        cmd, env = launch(args, p, LAYOUTS["dp2"])
        if signame == "SIGTERM":  # mpirun turns SIGTERM into a kill of its ranks: signal them directly
            proc = popen(cmd, env)
            time.sleep(2.5)
            subprocess.run(["pkill", "-TERM", "-f", f"^{args.tetra} --config {p}"], check=False)
        else:  # mpirun forwards SIGUSR1 to every rank
            proc = popen(cmd, env)
            time.sleep(2.5)
            proc.send_signal(signal.SIGUSR1)
        out_text = finish(proc)
        done = losses(o)
        latest = os.path.join(ck, "latest")
        saved = open(latest).read().strip() if os.path.exists(latest) else ""
        last = max(done) if done else 0
        check(proc.returncode == 0 and saved == f"step_{last:08d}" and 0 < last < 100000,
              f"{signame}: exit {proc.returncode} after step {last}, checkpoint {saved or 'missing'}")
        # Rank 0's last lines reach the job's output (the README's advice: SIGUSR1 to mpirun).
        check(f"stopping after step {last}" in out_text,
              f"{signame}: rank 0's closing lines are printed")

    # A signal during an evaluation far too long to finish ends it on every rank after the same
    # validation batch, and the run stops after the step being evaluated, with its checkpoint.
    ck = os.path.join(w, "ck_eval_signal")
    p, o = config(w, "eval_signal", 3, LAYOUTS["dp2"], ck, training={"eval_every": 1, "eval_steps": 10**8})
    cmd, env = launch(args, p, LAYOUTS["dp2"])
    proc = popen(cmd, env)
    time.sleep(6.0)  # step 1 is done in well under a second of it, the evaluation never
    proc.send_signal(signal.SIGUSR1)
    out_text = finish(proc)
    latest = os.path.join(ck, "latest")
    saved = open(latest).read().strip() if os.path.exists(latest) else ""
    check(proc.returncode == 0 and saved == "step_00000001" and "evaluation stopped after" in out_text
          and "stopping after step 1 (a signal)" in out_text,
          f"signal during evaluation: exit {proc.returncode}, checkpoint {saved or 'missing'}, "
          f"{'evaluation stopped' if 'evaluation stopped after' in out_text else 'no stop in the evaluation'}")

    # Corruption: each refused with the file named, nothing changed on disk.
    base = os.path.join(w, "ck_from_dp2tp2")
    step_dir = os.path.join(base, open(os.path.join(base, "latest")).read().strip())
    rank_files = sorted(f for f in os.listdir(step_dir) if f.startswith("rank_"))

    def corrupt(name, damage, want):
        ck_bad = os.path.join(w, f"ck_bad_{name}")
        shutil.copytree(base, ck_bad)
        target_dir = os.path.join(ck_bad, os.path.basename(step_dir))
        damage(target_dir)
        before = tree_digest(ck_bad)
        p, o = config(w, f"bad_{name}", 2 * N, LAYOUTS["single"], ck_bad)
        r = run(args, p, LAYOUTS["single"], expect=2)
        check(r.returncode == 2 and want in r.stderr, f"corrupt ({name}): exit {r.returncode}, message names '{want}'")
        check(tree_digest(ck_bad) == before, f"corrupt ({name}): the checkpoint directory is untouched")

    def flip(d):
        p = os.path.join(d, rank_files[0])
        data = bytearray(open(p, "rb").read())
        data[-5] ^= 0x40
        open(p, "wb").write(bytes(data))

    def truncate(d):
        p = os.path.join(d, rank_files[-1])
        data = open(p, "rb").read()
        open(p, "wb").write(data[: len(data) // 2])

    corrupt("flipped_byte", flip, rank_files[0])
    corrupt("truncated", truncate, rank_files[-1])
    corrupt("missing_rank_file", lambda d: os.remove(os.path.join(d, rank_files[1])), rank_files[1])

    ck_other = os.path.join(w, "ck_other_model")
    shutil.copytree(base, ck_other)
    p, o = config(w, "other_model", 2 * N, LAYOUTS["single"], ck_other)
    cfg = json.load(open(p))
    cfg["model"]["num_layers"] = 3
    json.dump(cfg, open(p, "w"))
    r = run(args, p, LAYOUTS["single"], expect=2)
    check(r.returncode == 2 and "model.num_layers" in r.stderr and "another model" in r.stderr,
          "a checkpoint of another model: exit 2 naming model.num_layers")

    return checks.report()


if __name__ == "__main__":
    sys.exit(main())
