"""The run report: one self-contained HTML page summarising a run directory (`onboard report`)."""

from onboard.report.build import write_report

__all__ = ["write_report"]
