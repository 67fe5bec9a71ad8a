"""The report in a real browser: headless Chromium renders it (not blank) without console errors."""

import shutil
from pathlib import Path

import pytest
from PIL import Image, ImageStat

from onboard.errors import OnboardError
from onboard.report import screenshot as shot
from onboard.report import write_report

pytestmark = pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium")


def test_screenshot_is_a_rendered_page(full_run_dir: Path, tmp_path: Path) -> None:
    report = write_report(full_run_dir)
    png = tmp_path / "report.png"
    shot.screenshot(report, png, width=1280, height=1000)
    with Image.open(png) as image:
        assert image.format == "PNG"
        assert image.size == (1280, 1000)
        rgb = image.convert("RGB")
        colours = rgb.getcolors(maxcolors=1 << 20)
        assert colours is not None and len(colours) > 200  # text, cards, tiles: not a blank page
        assert max(ImageStat.Stat(rgb).stddev) > 20
        # The verdict card is at the top and FAIL is red: plenty of strongly red pixels.
        red = sum(n for n, (r, g, b) in colours if r > 180 and g < 80 and b < 80)
        assert red > 500


def test_report_has_no_console_errors(full_run_dir: Path) -> None:
    assert shot.console_errors(write_report(full_run_dir)) == []


def test_console_errors_are_caught(tmp_path: Path) -> None:
    page = tmp_path / "bad.html"
    page.write_text('<!doctype html><p>hi</p><script>console.error("deliberate-x"); nope();</script>')
    errors = shot.console_errors(page)
    assert any("deliberate-x" in e for e in errors)
    assert any("Uncaught ReferenceError" in e for e in errors)


def test_missing_chromium_is_a_user_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    page = tmp_path / "p.html"
    page.write_text("<p>x</p>")
    monkeypatch.setattr(shot.shutil, "which", lambda name: None)
    with pytest.raises(OnboardError, match="chromium not found"):
        shot.screenshot(page, tmp_path / "p.png")
