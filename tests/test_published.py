"""The planner held to the world: every peak others measured on real GPUs and published (``published.json``), priced.

A row whose settings are all stated (nothing unstated moves the prediction) must be within 10%; a row that leaves
settings open must have its published figure inside the planner's range over them, widened by the planner's own
spread (what every plan carries). The spread stored in ``published.json`` must be the one the stated rows give now:
it is measured, never tuned. The table prints at the end.
"""
import dataclasses
import json

import pandas as pd
import pytest

from course_utils import planner
from course_utils.planner import published

TOLERANCE = 0.10
pytestmark = [pytest.mark.filterwarnings("ignore:.*FakeTensor.*"), pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture(scope="module")
def priced(request):
    frame = published.table()
    yield frame
    with request.config.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
        with pd.option_context("display.width", 250, "display.max_columns", 20, "display.max_colwidth", 40):
            print("\nPublished peaks, priced by the planner (GiB; tokens for the longest context)")
            print(frame.drop(columns=["card"]).round(2).to_string(index=False))
            stated = frame[frame["stated"]]
            print(f"stated rows: {len(stated)}, median error {stated['error %'].median():+.1f}%, median |error| "
                  f"{stated['error %'].abs().median():.1f}%, worst {stated['error %'].abs().max():.1f}%")


def test_the_table_has_enough_rows_from_enough_sources():
    rows = published.rows()
    assert len(rows) >= 20
    assert len({row["source"].split(",")[0] for row in rows}) >= 5
    assert sum(row["measured"] and row["figure"] != "longest_context" for row in rows) >= 12
    assert len({row["id"] for row in rows}) == len(rows)


@pytest.mark.parametrize("row", published.rows(), ids=lambda row: row["id"])
def test_each_row_says_what_it_is_and_where_it_was_published(row):
    assert row["figure"] in published.FIGURES and row["unit"] in published.UNITS
    assert row["quote"] and row["stated"] and row["notes"]
    assert "/" in row["source"].split(",")[0] or "paper" in row["source"], "repository and file, or paper and table"
    planner.get_gpu(row["hardware"])  # a preset
    planner.make_settings(published.row_model(row), **row["settings"])  # the settings are the planner's knobs
    knobs = {f.name for f in dataclasses.fields(planner.model.Settings)} | {"gpu", "figure"}
    for name, values in row["unstated"].items():  # each open setting: a knob, and the values it could take
        assert name in knobs and len(values) >= 2, name


def test_stated_rows_are_within_10_percent(priced):
    stated = priced[priced["stated"]]
    assert len(stated) >= 8
    off = stated[stated["error %"].abs() > 100 * TOLERANCE]
    assert off.empty, off.to_string()
    assert stated["error %"].abs().median() < 5


def test_rows_with_unstated_settings_hold_their_figure_in_the_range(priced):
    outside = priced[~priced["inside"]]
    assert outside.empty, outside.to_string()


def test_the_stored_spread_is_the_one_the_stated_rows_give(priced):
    stored = published.published_data()["spread"]
    fresh = published.spread(priced)
    assert (stored["low"], stored["high"], stored["rows"]) == (fresh["low"], fresh["high"], fresh["rows"]), (
        f"published.json's spread is {stored}; the rows give {fresh}: write that in")
    assert planner.plan_spread() == (stored["low"], stored["high"])
    assert stored["low"] <= 0 <= stored["high"]


def test_a_row_outside_its_range_is_caught():
    row = dict(next(r for r in published.rows() if r["id"] == "torchtune-llama-3.2-3b-packed"), value=30.0)
    assert not published.price(row)["inside"]
    assert published.price(row)["error"] < -0.4
    row = dict(next(r for r in published.rows() if r["id"] == "peft-llama-3.2-3b-lora-r32-qv-p99"), value=30e9)
    assert not published.price(row)["inside"]  # above every length the source leaves open


def test_the_range_is_over_the_unstated_values():
    row = next(r for r in published.rows() if r["id"] == "peft-llama-3.2-3b-lora-r32-qv-p99")
    p = published.price(row)
    assert p["low"] <= p["expected"] <= p["high"] and p["low"] < p["high"] and not p["stated"]
    short, long = (published.predict_figure(row, size=n) for n in row["unstated"]["size"])
    assert (p["low"], p["high"]) == (short, long)


def test_published_figures_are_converted_as_the_source_computed_them():
    assert published.published_value({"value": 15.57, "unit": "GB"}) == pytest.approx(15.57e9)
    assert published.published_value({"value": 25.5, "unit": "GiB"}) == 25.5 * 2**30
    assert published.published_value({"value": 14949, "unit": "MiB"}) == 14949 * 2**20


def test_the_json_is_package_data():
    from importlib import resources

    text = resources.files("course_utils.planner").joinpath("published.json").read_text(encoding="utf-8")
    assert json.loads(text)["rows"]


def test_what_was_left_out_says_why():
    excluded = published.published_data()["excluded"]
    assert len(excluded) >= 10
    assert all(entry["source"] and len(entry["why"]) > 20 for entry in excluded)
    assert any("torch.compile" in entry["why"] for entry in excluded)  # what the planner does not model, said
