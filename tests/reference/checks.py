"""Pass/fail bookkeeping shared by the reference tests."""


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
