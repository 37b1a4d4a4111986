"""Pass/fail bookkeeping shared by the reference and parity tests, and the plumbing the reference
tests share: their command line, running a tool with its output logged, one config at a time."""
import argparse
import os
import subprocess


class Checks:
    """Collects pass/fail lines; the test fails if any check failed."""

    def __init__(self):
        self.failed, self.passed = [], 0

    def check(self, ok, what):
        print(f"  [{'ok' if ok else 'FAIL'}] {what}")
        if ok:
            self.passed += 1
        else:
            self.failed.append(what)
        return ok

    def report(self):
        """Prints the summary; returns the exit status (1 if any check failed)."""
        print(f"\n{self.passed} checks passed, {len(self.failed)} failed")
        for f in self.failed:
            print(f"  FAILED: {f}")
        return 1 if self.failed else 0


def rel(a, b):
    """Relative difference of a from the reference b."""
    return abs(a - b) / max(abs(b), 1e-30)


def reference_args(doc, configs):
    """--tetra BIN --workdir DIR [--only CONFIG]; the work directory is created if missing."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--tetra", required=True, help="path of the tetra binary")
    ap.add_argument("--workdir", required=True, help="scratch directory (recreated)")
    ap.add_argument("--only", choices=sorted(configs), help="run one config only")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    return args


def run_logged(cmd, log_path):
    """Runs cmd (echoed), its output (stdout and stderr merged) written to log_path; returns the
    output. RuntimeError with the end of it when the exit code is not 0."""
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)
    with open(log_path, "w") as f:
        f.write(proc.stdout)
    if proc.returncode != 0:
        raise RuntimeError(f"{os.path.basename(cmd[0])} exited with {proc.returncode}; last "
                           f"output:\n{proc.stdout[-3000:]}")
    return proc.stdout


def run_each(names, run_config, checks, errors):
    """run_config(name) for each name; an exception of the kinds `errors` fails that config (a
    failed check naming it) and the next one runs."""
    for name in names:
        try:
            run_config(name)
        except errors as e:
            checks.check(False, f"{name}: {type(e).__name__}: {e}")
