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


def rel(a, b):
    """Relative difference of a from the reference b."""
    return abs(a - b) / max(abs(b), 1e-30)
