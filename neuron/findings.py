"""What one host check found: the shared base of kvferry.neuron.envcheck's reports.

A :class:`Finding` says what was found and, when something is missing, what to do about
it; ``blocking`` marks what stops NIXL's LIBFABRIC backend (the CLI exits 1 on any).
The Trainium host checks (envcheck.py) and the NIXL LIBFABRIC plugin checks
(envcheck_libfabric.py) both report in it, so one report and one exit code cover both.
"""

from __future__ import annotations

from dataclasses import dataclass

OK, MISSING, WARN = "ok", "missing", "warn"


@dataclass(frozen=True)
class Finding:
    """One environment check's answer: what is missing and how to fix it; ``blocking``:
    kvferry cannot run on Neuron without it."""

    check: str
    status: str  # ok | missing | warn
    detail: str
    fix: str = ""
    blocking: bool = False

    def line(self) -> str:
        mark = {OK: "[ ok ]", MISSING: "[FAIL]" if self.blocking else "[miss]", WARN: "[warn]"}
        s = f"{mark[self.status]} {self.check}: {self.detail}"
        return s + (f"\n       -> {self.fix}" if self.fix else "")


def passed(check: str, detail: str) -> Finding:
    """A check that found what it looked for."""
    return Finding(check, OK, detail)


def blocking(findings: list[Finding]) -> list[Finding]:
    """The findings that stop the LIBFABRIC backend (what makes the CLI exit 1)."""
    return [f for f in findings if f.blocking and f.status != OK]
