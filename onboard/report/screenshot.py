"""Headless Chromium: a PNG screenshot of the report, and the console messages a page produces.

Both run Debian's `chromium` with a fresh profile and no network-facing background services.
`console_errors` relies on `--enable-logging=stderr`: Chromium logs every console message and
every uncaught exception of the page as a line like
    [1654:1654:1130/133735.432202:INFO:CONSOLE:1] "Uncaught ReferenceError: f", source: file:///x.html (1)
(older builds write `CONSOLE(1)]`). The report has no script, so any such line is a defect.
"""

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from onboard.errors import OnboardError

TIMEOUT_S = 60
CONSOLE = re.compile(r":CONSOLE(?::\d+|\(\d+\))\]\s*(.*)$")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


def _chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        raise OnboardError("chromium not found on PATH: install Debian's chromium package to render screenshots")
    return path


def _run(args: list[str], width: int, height: int, html: Path) -> subprocess.CompletedProcess[str]:
    html = Path(html).resolve()
    if not html.is_file():
        raise OnboardError(f"no such page: {html}")
    with tempfile.TemporaryDirectory(prefix="onboard-chromium-") as profile:
        command = [
            _chromium(),
            *FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}",
            *args,
            html.as_uri(),
        ]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired as exc:
            raise OnboardError(f"chromium did not finish within {TIMEOUT_S} s rendering {html}") from exc
        except OSError as exc:
            raise OnboardError(f"could not start chromium: {exc}") from exc
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise OnboardError(f"chromium exited with status {result.returncode}: {last}")
    return result


def screenshot(html: Path, png: Path, width: int = 1280, height: int = 1000) -> None:
    """Render `html` in a `width` x `height` window and write the visible part to `png`."""
    png = Path(png).resolve()
    png.parent.mkdir(parents=True, exist_ok=True)
    png.unlink(missing_ok=True)
    _run([f"--screenshot={png}"], width, height, html)
    if not png.is_file() or png.stat().st_size == 0:
        raise OnboardError(f"chromium wrote no screenshot to {png}")


# Run on load in a copy of the page (the report itself has no script): each card (and the page)
# whose content is wider than the box, named by its heading, written into the DOM Chromium dumps.
_OVERFLOW_PROBE = """<script>
addEventListener("load", () => {
  const wide = [];
  const root = document.documentElement;
  if (root.scrollWidth > root.clientWidth) wide.push(`the page: ${root.scrollWidth} px in ${root.clientWidth}`);
  for (const card of document.querySelectorAll(".card, .tile")) {
    if (card.scrollWidth > card.clientWidth) {
      const head = card.querySelector("h2, .label");
      const name = (head ? head.firstChild : card).textContent.trim().slice(0, 40);
      wide.push(`${name}: ${card.scrollWidth} px in ${card.clientWidth}`);
    }
  }
  const out = document.createElement("pre");
  out.id = "onboard-overflow";
  out.textContent = JSON.stringify(wide);
  document.body.append(out);
});
</script>"""
_OVERFLOW = re.compile(r'<pre id="onboard-overflow">(.*?)</pre>', re.S)


def overflowing(html: Path, width: int) -> list[str]:
    """The cards of `html` whose content is wider than the card at a `width`-pixel window (a value
    that does not wrap pushes the card's other values out of sight), and the page if it scrolls
    sideways: one line each, empty when everything fits."""
    import html as entities
    import json

    page = Path(html).read_text()
    with tempfile.TemporaryDirectory(prefix="onboard-layout-") as tmp:
        probe = Path(tmp) / Path(html).name
        probe.write_text(page.replace("</body>", _OVERFLOW_PROBE + "</body>"))
        dom = _run(["--dump-dom", "--virtual-time-budget=5000"], width, 1000, probe).stdout
    match = _OVERFLOW.search(dom)
    if match is None:
        raise OnboardError(f"chromium ran no layout probe on {html}")
    return json.loads(entities.unescape(match.group(1)))


def console_errors(html: Path) -> list[str]:
    """Every console message and uncaught error `html` produces when loaded (empty for a clean page)."""
    with tempfile.TemporaryDirectory(prefix="onboard-shot-") as tmp:
        result = _run(["--enable-logging=stderr", "--v=0", f"--screenshot={Path(tmp) / 'page.png'}"], 800, 600, html)
    messages = []
    for line in result.stderr.splitlines():
        match = CONSOLE.search(line)
        if match:
            messages.append(match.group(1))
        elif "Uncaught" in line:
            messages.append(line.strip())
    return messages
