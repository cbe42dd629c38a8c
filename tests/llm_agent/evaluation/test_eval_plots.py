"""metrics_vis: the figures of a fixture run (files, formats, the data drawn), run discovery and the CLI."""
from __future__ import annotations

import os
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from PIL import Image

from for_evaluation import metrics_vis
from llm_agent.evaluation.plots import RunData, build_figures, figure_names, load_run, plot_runs

FIGURE_NAMES = figure_names(("cooperation", "emotion", "trust"))  # the shipped scenarios' figures
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
    written = write_run(tmp_path, "exp", scenario, steps=12)
    figures, _ = build_figures([load_run(resolve_run(tmp_path / "logs" / "exp"))], smooth=0.5)
    ax = _axes(figures["training_curves"], "completion rate (CR)")
    raw = [line for line in ax.lines if line.get_gid() == "raw"][0]
    smoothed = [line for line in ax.lines if line.get_gid() == "smoothed"][0]
    assert smoothed.get_label().endswith("(EMA 0.5)") and raw.get_alpha() >= 0.4  # labelled; raw stays visible
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
    np.testing.assert_allclose(val_line.get_xdata(), [0, 2, 4, 6, 8, 10, 12])  # step 0: before training
    np.testing.assert_allclose(val_line.get_ydata(), [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6])


def test_a_few_points_are_drawn_raw_so_the_line_ends_at_the_last_value(tmp_path, scenario):
    # 4 steps whose CR drops to 0 at the end: a 0.6 EMA would end at 0.054 above it; no EMA is drawn
    rows = [{"step": s, "dialogue/completion_rate": cr, "dialogue/adt": 3.0} for s, cr in
            [(1, 0.125), (2, 0.0625), (3, 0.0625), (4, 0.0)]]
    figures, _ = build_figures([RunData("few", steps=rows)], smooth=0.6)
    ax = _axes(figures["training_curves"], "completion rate (CR)")
    assert [line.get_gid() for line in ax.lines] == ["raw"]
    assert ax.lines[0].get_ydata()[-1] == 0.0 and list(ax.lines[0].get_xdata()) == [1, 2, 3, 4]


def test_an_undefined_metric_leaves_a_gap_and_says_so(tmp_path, scenario):
    # no call completed at steps 2 and 3: ATT was left out of the metrics there (undefined), ADT was not
    rows = [{"step": s, "dialogue/adt": 3.0, **({"dialogue/att": 4.0} if s not in (2, 3) else {})}
            for s in range(1, 6)]
    figures, _ = build_figures([RunData("gaps", steps=rows)], smooth=0.0)
    ax = _axes(figures["training_curves"], "turns per dialogue")
    att = next(line for line in ax.lines if line.get_label().startswith("att"))
    assert att.get_label() == "att (n/a at 2 steps)"
    ys = np.asarray(att.get_ydata(), dtype=float)
    assert list(att.get_xdata()) == [1, 2, 3, 4, 5] and np.isnan(ys[1:3]).all() and (ys[[0, 3, 4]] == 4.0).all()


def test_equal_series_are_one_line_named_after_both_and_others_differ_in_style():
    same = [{"step": s, "critic/score/mean": 0.5 * s, "critic/rewards/mean": 0.5 * s} for s in range(1, 5)]
    ax = _axes(build_figures([RunData("r", steps=same)], smooth=0.0)[0]["training_curves"],
               "reward (sequence score)")
    assert [line.get_label() for line in ax.lines] == ["score/mean = rewards/mean"]
    apart = [{**row, "critic/rewards/mean": row["critic/rewards/mean"] - 0.01} for row in same]
    ax = _axes(build_figures([RunData("r", steps=apart)], smooth=0.0)[0]["training_curves"],
               "reward (sequence score)")
    assert [line.get_label() for line in ax.lines] == ["score/mean", "rewards/mean"]
    assert ax.lines[0].get_linestyle() != ax.lines[1].get_linestyle()  # the lower one cannot hide the upper


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, scenario):
    """One fixture run with every metric (time split included) and 400 dialogues, its figures built once for the
    tests that only read them: (what was written, {figure name: Figure})."""
    root = tmp_path_factory.mktemp("full_run")
    written = write_run(root, "exp", scenario, with_time=True, n_dialogues=400)
    figures, _ = build_figures([load_run(resolve_run(root / "logs" / "exp"))])
    return written, figures


def test_no_title_is_clipped(full_run):
    _, figures = full_run
    for name, fig in figures.items():
        title = next(t for t in fig.texts if t.get_text() == fig.get_suptitle())
        # the layout engine makes room below the title but never moves it: its extent needs a renderer, no draw
        box, page = title.get_window_extent(FigureCanvasAgg(fig).get_renderer()), fig.bbox
        assert page.x0 <= box.x0 and box.x1 <= page.x1 and box.y1 <= page.y1, (name, box, page)
    assert "\n" in figures["training_time_split"].get_suptitle()  # wrapped, not cut


def test_cache_panel_draws_each_stages_configured_target(full_run):
    ax = _axes(full_run[1]["cache_hit_rate_by_stage"], "hit rate per stage")
    targets = {line.get_label(): line.get_ydata()[0] for line in ax.lines if line.get_gid() == "target"}
    assert targets == {"stage 0 target 0.90": 0.9, "stage 1 target 0.50": 0.5}
    stage0 = next(line for line in ax.lines if line.get_label() == "stage 0")
    assert list(stage0.get_xdata()) == [3, 4, 5, 6]  # steps 1-2 had nothing eligible: undefined, not drawn as 0


def test_cr_by_initial_state_shows_the_first_and_last_validation_side_by_side(full_run):
    written, figures = full_run
    ax = _axes(figures["cr_by_initial_state"], "trust")
    val_steps = sorted({d["step"] for d in written["dialogues"] if d["split"] == "val"})
    labels = [t.get_text() for t in ax.get_legend().texts]
    assert labels == [f"before: val, step {val_steps[0]}", f"after: val, step {val_steps[-1]}"]
    for container, step in zip(ax.containers[::2], (val_steps[0], val_steps[-1])):  # bars (errorbars between)
        chosen = [d for d in written["dialogues"] if d["split"] == "val" and d["step"] == step
                  and d["outcome"] != "error"]
        values = sorted({d["profile"]["trust"] for d in chosen})
        expected = [sum(d["outcome"] == "completed" for d in chosen if d["profile"]["trust"] == v)
                    / sum(d["profile"]["trust"] == v for d in chosen) for v in values]
        np.testing.assert_allclose([bar.get_height() for bar in container], expected)


def test_heatmap_cells_without_data_have_a_legend(full_run):
    figures = full_run[1]
    ax = _axes(figures["controller_trust"], "CR per value at the update")
    assert [t.get_text() for t in ax.get_legend().texts] == ["no data: no dialogue with that value at that update"]
    assert _axes(figures["controller_trust"], "sampling weight").get_legend() is None  # every cell has a weight


def test_controller_heatmap_holds_the_weights_per_value_and_step(full_run):
    figures = full_run[1]
    weights_ax = _axes(figures["controller_trust"], "sampling weight")
    matrix = np.ma.filled(weights_ax.images[0].get_array(), np.nan)
    assert matrix.shape == (4, 6)  # trust values 1..4 x steps 1..6
    hand = [[controller_weight(step, k, 4) for step in range(1, 7)] for k in range(4)]
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
    # an older log wrote 0 with nothing eligible; current ones leave the rate out
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
