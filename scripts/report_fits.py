"""`python scripts/report_fits.py REPORT.html`: exit 1, naming each card, when a card's content is
wider than the card at 1300 or 800 px in headless Chromium (CI runs it on the quick demo's report).

A value that does not wrap pushes its card's other values out of sight and the page sideways: the
tests check the reports of tiny runs, this checks the one a new user opens first.
"""

import sys
from pathlib import Path

from onboard.report.screenshot import overflowing

WIDTHS = (1300, 800)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/report_fits.py REPORT.html", file=sys.stderr)
        return 2
    report = Path(argv[0])
    wide = {width: overflowing(report, width) for width in WIDTHS}
    for width, lines in wide.items():
        for line in lines:
            print(f"{report} at {width} px: {line}", file=sys.stderr)
    if any(wide.values()):
        return 1
    print(f"{report}: every card holds its content at {' and '.join(f'{w} px' for w in WIDTHS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
