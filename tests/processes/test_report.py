"""``cadence report``: a self-contained HTML page (and a PNG) of a real run's model dir."""

from __future__ import annotations

import base64
import json
import math
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from cadence.config import config_from_dict
from cadence.errors import CadenceError
from cadence.reports.run_report import build_report
from cadence.sidecar.evaluator import EvaluationLog
from cadence.summaries.metrics_file import read_metrics
from cadence.summaries.writer import SummaryWriter
from cli_run import run_cadence as cadence

PIL_Image = pytest.importorskip("PIL.Image", reason="Pillow (a matplotlib dependency) is needed to check the PNG")

TASKS = Path(__file__).parents[1] / "tasks.py"
TRAIN_BLUE = (0x1F, 0x77, 0xB4)  # the colour of the training series (cadence.reports.run_report._TRAIN_COLOR)


def train(model_dir: Path, **trainer) -> None:
    from cadence.torch import run_training

    cfg = config_from_dict({
        "model_dir": str(model_dir), "task": {"class": f"{TASKS}:TinyTask"},
        "trainer": {"train_steps": 20, "steps_per_loop": 5, "validation_interval": 10, "checkpoint_interval": 10,
                    "seed": 0, **trainer},
    })
    run_training(cfg, progress=False)


def tree(directory: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.rglob("*")}


class _Refs(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.refs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.refs += [value or "" for name, value in attrs if name in ("src", "href", "srcset", "action")]


def external_refs(page: str) -> list[str]:
    """Every src=/href= (and srcset=, action=) of the page's tags that is not an inline data: URL."""
    parser = _Refs()
    parser.feed(page)
    return [ref for ref in parser.refs if not ref.startswith("data:")]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    model_dir = tmp_path_factory.mktemp("report") / "run"
    train(model_dir, best_checkpoint={"metric": "accuracy", "higher_is_better": True})
    return model_dir


def test_report_of_a_finished_run(finished_run):
    checkpoints_before = tree(finished_run / "checkpoints")
    proc = cadence("report", str(finished_run))
    assert proc.returncode == 0, proc.stderr
    html_path, png_path = finished_run / "report.html", finished_run / "report.png"
    assert proc.stdout.split() == [str(html_path), str(png_path)]
    assert tree(finished_run / "checkpoints") == checkpoints_before  # read only

    page = html_path.read_text()
    train_names = {k for r in read_metrics(finished_run / "train") for k in r} - {"step", "time"}
    eval_names = {k for r in read_metrics(finished_run / "eval") for k in r} - {"step", "time"}
    assert {"loss", "learning_rate", "steps_per_second"} <= train_names and eval_names == {"loss", "accuracy"}
    cells = set(re.findall(r"<td>([^<]*)</td>", page))
    assert train_names | eval_names <= cells  # each one a row of the metrics table
    best = json.loads((finished_run / "best" / "best.json").read_text())
    assert f"step {best['step']}: accuracy = {best['value']:.6g}" in page
    assert "finished (FINAL at step 20)" in page
    assert re.search(r"<td>20</td>.*?<td>FINAL, [^<]*latest</td>", page)  # the checkpoint timeline
    assert "<td>10</td>" in page and "train_steps: 20" in page  # ckpt-10 and the resolved config
    assert "no sidecar evaluations" in page

    assert external_refs(page) == []
    images = re.findall(r'<img [^>]*src="data:image/png;base64,([^"]+)"', page)
    assert len(images) == 1 and base64.b64decode(images[0]) == png_path.read_bytes()
    with PIL_Image.open(png_path) as image:
        image.verify()
    with PIL_Image.open(png_path) as image:
        assert image.format == "PNG" and image.width >= 600 and image.height >= 400


def test_out_puts_the_png_next_to_the_page(finished_run, tmp_path):
    paths = build_report(str(finished_run), str(tmp_path / "reports" / "run-7.html"))
    assert paths.html == str(tmp_path / "reports" / "run-7.html")
    assert paths.png == str(tmp_path / "reports" / "run-7.png")
    assert Path(paths.html).read_text().startswith("<!DOCTYPE html>")
    assert Path(paths.png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_report_is_never_written_into_checkpoints(finished_run):
    proc = cadence("report", str(finished_run), "--out", str(finished_run / "checkpoints" / "r.html"))
    assert proc.returncode == 2 and "never written into checkpoints/" in proc.stderr
    assert not (finished_run / "checkpoints" / "r.html").exists()


def test_out_replaces_only_a_report_cadence_wrote(finished_run, tmp_path):
    """Issue 39: a page or a PNG of the user's at --out (or beside it) is refused: exit 2, one line, both
    files as they were, nothing added; cadence's own earlier report there is replaced."""
    (tmp_path / "notes.html").write_text("<html>my notes</html>")
    (tmp_path / "plot.png").write_bytes(b"\x89PNG\r\n\x1a\nmine")
    (tmp_path / "dir.html").mkdir()
    before = tree(tmp_path)
    contents = {p: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    for name, why in (("notes.html", "exists and is not a report cadence wrote"),
                      ("plot.html", f"the PNG beside it, {tmp_path / 'plot.png'}, exists and is not one cadence wrote"),
                      ("dir.html", "is a directory")):
        proc = cadence("report", str(finished_run), "--out", str(tmp_path / name))
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip() == (f"cadence: error: --out {tmp_path / name}: {why}; choose another path or "
                                       "remove it (nothing was written)")
        assert tree(tmp_path) == before and {p: p.read_bytes() for p in contents} == contents
    out = tmp_path / "run.html"
    for _ in range(2):  # the second replaces the first
        proc = cadence("report", str(finished_run), "--out", str(out))
        assert proc.returncode == 0, proc.stderr
    assert '<meta name="generator" content="cadence report">' in out.read_text()
    with PIL_Image.open(tmp_path / "run.png") as image:
        assert image.text["Software"] == "cadence report"


def test_sidecar_evaluations_are_shown(tmp_path):
    from tasks import TinyTask

    from cadence.sidecar.evaluator import SidecarEvaluator
    from cadence.torch import Context, build_runners

    model_dir = tmp_path / "run"
    train(model_dir, in_process_validation=False)
    assert not (model_dir / "eval").exists()
    # a checkpoint whose files do not match its manifest: the sidecar records it as failed
    (model_dir / "checkpoints" / "ckpt-10" / "model.safetensors").write_bytes(b"garbage")
    _, evaluator = build_runners(TinyTask(), Context.create(), train=False)
    result = SidecarEvaluator(evaluator, str(model_dir), name="holdout", poll_interval=0.01, timeout=30,
                              max_retries=0).start()
    assert result.stop_reason == "final" and result.evaluated == [20] and result.failed == [10]

    paths = build_report(str(model_dir))
    page = Path(paths.html).read_text()
    assert "eval_holdout/evaluations.jsonl: 2 records" in page
    records = EvaluationLog(str(model_dir / "eval_holdout")).records()
    failed, evaluated = records
    assert (failed["step"], failed["status"], evaluated["step"], evaluated["status"]) == (10, "failed", 20, "evaluated")
    assert re.search(r"<td>10</td><td>failed</td><td>[^<]+</td><td></td><td>[^<]*corrupt checkpoint", page)
    shown = "  ".join(f"{k}={v:.6g}" for k, v in evaluated["metrics"].items())
    assert "<td>20</td><td>evaluated</td>" in page and f"<td>{shown}</td>" in page
    assert "<td>eval_holdout</td><td>accuracy</td>" in page  # its metrics are a series of their own
    assert "no best/" in page and "not finished" not in page


def test_a_dir_that_is_not_a_model_dir_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    proc = cadence("report", str(tmp_path))
    assert proc.returncode == 2  # bad input, as for every command
    assert proc.stderr.strip() == f"cadence: error: not a cadence model dir (no config.yaml, checkpoints/ or train/): {tmp_path}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]

    missing = tmp_path / "nowhere"
    proc = cadence("report", str(missing))  # bad input: exit 2, as for every command
    assert proc.returncode == 2 and proc.stderr.strip() == f"cadence: error: model dir not found: {missing}"
    with pytest.raises(CadenceError, match="not a cadence model dir"):
        build_report(str(tmp_path))


def test_names_are_escaped_and_odd_values_are_handled(tmp_path):
    """A run with training logs only (no eval, no checkpoint, no best), a metric name holding HTML,
    NaN and inf values, non-scalar values, and a sidecar record with HTML in its error."""
    model_dir = tmp_path / "run"
    evil = '<img src="http://x.invalid/a.png">&"acc" $\\x$'  # also mathtext for matplotlib
    with SummaryWriter(str(model_dir / "train")) as writer:
        for step in (1, 2, 3):
            writer.write(step, {"loss": [1.0, math.nan, 0.5][step - 1], evil: step / 10, "grad": math.inf})
    with open(model_dir / "train" / "metrics.jsonl", "a") as f:  # non-scalars another writer might leave
        f.write(json.dumps({"step": 4, "time": 1.7e9, "loss": 0.25, "note": "text", "hist": [1, 2]}) + "\n")
    EvaluationLog(str(model_dir / "eval_x")).append(
        {"step": 3, "status": "failed", "time": 1.7e9, "error": "<script>alert(1)</script>"})

    paths = build_report(str(model_dir))
    page = Path(paths.html).read_text()
    assert "<script>" not in page and evil not in page and external_refs(page) == []
    assert html_escape(evil) in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    # loss: 4 points, one NaN; grad: all inf; the non-scalars are left out
    assert re.search(r"<td>train</td><td>loss</td><td>4</td><td>4</td><td>0.25</td><td>0.25</td><td>1</td><td>1</td>", page)
    assert re.search(r"<td>train</td><td>grad</td><td>3</td><td>3</td><td>inf</td><td></td><td></td><td>3</td>", page)
    assert "<td>note</td>" not in page and "<td>hist</td>" not in page
    assert "no committed checkpoints" in page and "none (no best/)" in page and "not finished" in page
    with PIL_Image.open(paths.png) as image:
        assert image.width >= 600


def html_escape(text: str) -> str:
    import html

    return html.escape(text, quote=True)


def test_without_matplotlib_the_command_says_what_to_install(finished_run, tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None\n"  # a real import failure of matplotlib
            "from cadence.cli.main import main\n"
            f"sys.exit(main(['report', {str(finished_run)!r}, '--out', {str(tmp_path / 'r.html')!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cadence: failed: cadence report needs matplotlib")
    assert lines[0].endswith("pip install 'cadence[report]'")
    assert list(tmp_path.iterdir()) == []


def _browser() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if found := shutil.which(name):
            return found
    return None


def test_page_renders_its_plots_in_headless_chromium(finished_run, tmp_path):
    browser = _browser()
    if browser is None:
        pytest.skip("no headless browser: none of chromium, chromium-browser, google-chrome on PATH "
                    "(Debian: apt-get install chromium)")
    paths = build_report(str(finished_run), str(tmp_path / "report.html"))
    shot = tmp_path / "shot.png"
    proc = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1280,2000",
         Path(paths.html).as_uri()],
        capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0 and shot.is_file(), proc.stderr[-2000:]
    with PIL_Image.open(shot) as image:
        pixels = np.asarray(image.convert("RGB"), dtype=np.int16)
    assert pixels.shape == (2000, 1280, 3)
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50  # not blank
    # the training curves: only the embedded plot uses that colour (the page's CSS does not)
    ys, xs = np.nonzero((np.abs(pixels - np.array(TRAIN_BLUE)) <= 24).all(axis=2))
    assert len(xs) > 300
    assert xs.max() - xs.min() > 400 and ys.max() - ys.min() > 100  # curves across the plot area
