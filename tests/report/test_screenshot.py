"""The report in a real browser: headless Chromium renders it (not blank) without console errors."""

import shutil
from pathlib import Path

import pytest
from PIL import Image, ImageStat

from onboard.errors import OnboardError
from onboard.recipes import Quantize
from onboard.report import screenshot as shot
from onboard.report import write_report

from .runs import write
from .test_parity_card import w4a4_parity

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


@pytest.mark.parametrize("width", [1300, 800])
def test_every_card_holds_its_content(full_run_dir: Path, width: int) -> None:
    """The longest values a run writes (the W4A4 parity rule's sentence, eight bench columns) wrap
    inside their cards: none pushes its card's other values out of sight or the page sideways."""
    write(full_run_dir, "adapt/parity.json", w4a4_parity())
    assert shot.overflowing(write_report(full_run_dir), width) == []


# The mixed runs the tests below build anyway (test_mla_artifacts.py's CASES: DeepSeek-V3's MLA names).
@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_each_familys_report_fits_its_cards(family: str, quantized_run, request, tmp_path: Path) -> None:
    """The quantize card of each family's mixed-precision run (its module names, its formats): the
    run test_mla_artifacts.py and test_nvfp4_format.py build."""
    from quantize.test_mla_artifacts import settings_for
    from quantize.test_nvfp4_format import CALIB, PINS

    source = request.getfixturevalue(f"tiny_{family}")
    settings = Quantize(formats=PINS, calibration=CALIB) if family == "llama" else settings_for(family, "mixed")
    run = tmp_path / "run"
    shutil.copytree(quantized_run(source, settings), run)
    report = write_report(run)
    assert {width: shot.overflowing(report, width) for width in (1300, 800)} == {1300: [], 800: []}


def test_a_value_wider_than_its_card_is_caught(tmp_path: Path) -> None:
    page = tmp_path / "p.html"
    long = "x" * 400
    page.write_text(
        f'<html><body><section class="card" style="width:300px"><h2>Wide</h2><span style="white-space:nowrap">{long}'
        "</span></section></body></html>"
    )
    wide = shot.overflowing(page, 800)
    assert len(wide) == 2 and wide[1].startswith("Wide: ") and wide[0].startswith("the page: ")


def test_the_ci_check_fails_on_a_wide_card_and_passes_a_fitting_page(tmp_path: Path, capsys) -> None:
    """scripts/report_fits.py, run by .ci/run on the quick demo's report.html."""
    import runpy

    main = runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "report_fits.py"))["main"]
    wide, narrow = tmp_path / "wide.html", tmp_path / "narrow.html"
    card = '<html><body><section class="card" style="width:300px"><h2>{}</h2><span>{}</span></section></body></html>'
    wide.write_text(card.format("Wide", f'<span style="white-space:nowrap">{"x" * 400}</span>'))
    narrow.write_text(card.format("Narrow", "x " * 200))
    assert main([str(wide)]) == 1
    assert "at 1300 px: Wide: " in capsys.readouterr().err
    assert main([str(narrow)]) == 0


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
