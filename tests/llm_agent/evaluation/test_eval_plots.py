"""metrics_vis: the figures of a fixture run (files, formats, the data drawn), run discovery and the CLI."""
from __future__ import annotations

import os
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from PIL import Image

from for_evaluation import metrics_vis
from llm_agent.evaluation.plots import FIGURE_NAMES, build_figures, load_run, plot_runs
from llm_agent.evaluation.run_data import find_latest_run, read_step_metrics, resolve_run
from llm_agent.evaluation.series import cache_stage_series, ema, outcome_mix

from tests.helpers.report_fixtures import controller_weight, write_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _check_png(path):
    assert path.read_bytes()[:8] == PNG_SIGNATURE, path
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.size[0] > 300 and im.size[1] > 200


def _check_svg(path):
    root = ET.parse(path).getroot()
    assert root.tag.endswith("svg"), path


def _axes(fig, title):
    found = [ax for ax in fig.axes if ax.get_title() == title]
    assert found, f"no axes titled {title!r}: {[ax.get_title() for ax in fig.axes]}"
    return found[0]


def test_fixture_run_writes_every_figure_as_png_and_svg(tmp_path, scenario):
    write_run(tmp_path / "outputs", "exp", scenario, with_time=True)
    out = tmp_path / "plots"
    result = plot_runs([load_run(find_latest_run(tmp_path / "outputs"))], out)
    expected = {f"{name}.{fmt}" for name in FIGURE_NAMES for fmt in ("png", "svg")}
    assert {p.name for p in result.files} == expected
    assert {p.name for p in out.iterdir()} == expected
    for path in result.files:
        (_check_png if path.suffix == ".png" else _check_svg)(path)
    assert all("panel" in note for note in result.notes), result.notes  # at most a panel lacks its keys


def test_missing_keys_skip_their_figure_with_a_note(tmp_path, scenario):
    write_run(tmp_path, "exp", scenario, with_time=False)
    result = plot_runs([load_run(resolve_run(tmp_path / "logs" / "exp"))], tmp_path / "plots", formats=("png",))
    names = {p.stem for p in result.files}
    assert names == set(FIGURE_NAMES) - {"training_time_split"}
    assert any("training_time_split" in n and "rollout/time_generate_s" in n for n in result.notes)


def test_curves_draw_the_logged_values_and_a_debiased_ema(tmp_path, scenario):
    written = write_run(tmp_path, "exp", scenario)
    figures, _ = build_figures([load_run(resolve_run(tmp_path / "logs" / "exp"))], smooth=0.5)
    ax = _axes(figures["training_curves"], "completion rate (CR)")
    raw = [line for line in ax.lines if line.get_gid() == "raw"][0]
    smoothed = [line for line in ax.lines if line.get_gid() == "smoothed"][0]
    expected = [row["dialogue/completion_rate"] for row in written["rows"]]
    np.testing.assert_allclose(raw.get_xdata(), [row["step"] for row in written["rows"]])
    np.testing.assert_allclose(raw.get_ydata(), expected)
    hand, acc = [], 0.0
    for t, x in enumerate(expected, start=1):  # debiased EMA written out: acc_t / (1 - 0.5^t)
        acc = 0.5 * acc + 0.5 * x
        hand.append(acc / (1 - 0.5 ** t))
    np.testing.assert_allclose(smoothed.get_ydata(), hand)
    val_ax = _axes(figures["validation_curves"], "completion rate (CR)")
    val_line = val_ax.lines[0]
    np.testing.assert_allclose(val_line.get_xdata(), [0, 2, 4, 6])  # step 0: validation before training
    np.testing.assert_allclose(val_line.get_ydata(), [0.0, 0.1, 0.2, 0.3])


def test_controller_heatmap_holds_the_weights_per_value_and_step(tmp_path, scenario):
    write_run(tmp_path, "exp", scenario, steps=5)
    figures, _ = build_figures([load_run(resolve_run(tmp_path / "logs" / "exp"))])
    weights_ax = _axes(figures["controller_trust"], "sampling weight")
    matrix = np.ma.filled(weights_ax.images[0].get_array(), np.nan)
    assert matrix.shape == (4, 5)  # trust values 1..4 x steps 1..5
    hand = [[controller_weight(step, k, 4) for step in range(1, 6)] for k in range(4)]
    np.testing.assert_allclose(matrix, hand)
    cr = np.ma.filled(_axes(figures["controller_trust"], "CR per value at the update").images[0].get_array(), np.nan)
    assert np.isnan(cr[0, 0]) and cr[1, 0] == pytest.approx(0.1)  # step 1: value 1 unseen, value 2 seen


def test_outcome_mix_shares_are_rates_times_the_non_error_share():
    rows = [{"step": 1, "dialogue/completion_rate": 0.5, "dialogue/hang_up_rate": 0.25,
             "dialogue/agent_ended_rate": 0.25, "dialogue/timeout_rate": 0.0, "dialogue/truncated_rate": 0.0,
             "dialogue/error_rate": 0.2}, {"step": 2, "dialogue/completion_rate": 1.0}]
    steps, shares = outcome_mix(rows, "dialogue/")
    assert steps.tolist() == [1.0]  # step 2 lacks rates
    assert shares["completed"][0] == pytest.approx(0.4) and shares["hung_up"][0] == pytest.approx(0.2)
    assert shares["error"][0] == pytest.approx(0.2)
    assert sum(s[0] for s in shares.values()) == pytest.approx(1.0)


def test_cache_series_drop_steps_without_eligible_lookups():
    rows = [{"step": 1, "cache/hit_rate/stage0": 0.0, "cache/eligible/stage0": 0.0},
            {"step": 2, "cache/hit_rate/stage0": 0.5, "cache/eligible/stage0": 4.0}]
    steps, rates = cache_stage_series(rows)["stage 0"]
    assert steps.tolist() == [2.0] and rates.tolist() == [0.5]


def test_ema_by_hand():
    np.testing.assert_allclose(ema([1.0, 2.0, 3.0], 0.5), [1.0, 1.25 / 0.75, 2.125 / 0.875])
    np.testing.assert_allclose(ema([4.0, -1.0], 0.0), [4.0, -1.0])
    with pytest.raises(ValueError, match="smoothing"):
        ema([1.0], 1.0)


def test_two_runs_share_the_axes_in_their_own_colours(tmp_path, scenario):
    write_run(tmp_path, "a", scenario, steps=4)
    write_run(tmp_path / "other", "b", scenario, steps=6, seed=1)
    runs = [load_run(resolve_run(tmp_path / "logs" / "a")), load_run(resolve_run(tmp_path / "other" / "logs" / "b"))]
    figures, _ = build_figures(runs, smooth=0.0)
    lines = _axes(figures["training_curves"], "completion rate (CR)").lines
    assert [len(line.get_xdata()) for line in lines] == [4, 6]
    assert lines[0].get_color() != lines[1].get_color()
    assert [t.get_text() for t in _axes(figures["training_curves"], "completion rate (CR)").get_legend().texts] \
        == ["a", "b"]


def test_cli_without_arguments_plots_the_latest_run(tmp_path, scenario, capsys, monkeypatch):
    write_run(tmp_path / "outputs", "old", scenario, steps=2)
    write_run(tmp_path / "outputs", "new", scenario, steps=3, with_time=True)
    old = tmp_path / "outputs" / "logs" / "old" / "metrics.jsonl"
    os.utime(old, (1, 1))  # "new" was written last
    monkeypatch.chdir(tmp_path)
    assert metrics_vis.main(["--format", "png"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed and all(p.startswith("outputs/plots/new/") and p.endswith(".png") for p in printed)
    assert len(printed) == len(FIGURE_NAMES)


def test_cli_error_without_a_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="make demo"):
        metrics_vis.main([])


def test_bad_metrics_line_names_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a": "x"}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: metric 'a'"):
        read_step_metrics(path)
    path.write_text('{"step": 1, "a": 1.0}\n{"step": 1, "a": 2.0}\n{"step": 2, "a"')  # resumed; torn last line
    assert read_step_metrics(path) == [{"step": 1.0, "a": 2.0}]
