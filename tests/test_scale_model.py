"""bench/scale_model.py: the cost model for 64-512 Perlmutter nodes that `make test-scale`'s figures feed.
Its fit (which form, its errors, the no-trend case), its α–β and checkpoint formulas by hand, and the docs'
tables (bench/scale_model.md, which docs/scale.md includes) against what it computes from the committed
figures (bench/scale_timings/*.json: runs of `make test-scale`, pooled)."""

from __future__ import annotations

import json
import sys

import pytest

from support.runs import REPO, run


def load_scale_model():
    sys.path.insert(0, str(REPO / "bench"))
    import scale_model
    return scale_model


def test_the_scale_models_fit_chooses_the_form_that_predicts_and_says_when_none_does():
    """bench/scale_model.py's fit: the form that predicts the largest node count from the others; a
    component no form predicts (noise above its growth) is projected as its largest value, and says so."""
    scale_model = load_scale_model()
    nodes = [2, 4, 8, 16]
    linear = scale_model.fit(nodes, [0.5 + 0.1 * n for n in nodes])
    assert linear["form"] == "linear" and linear["hold_out_relative_error"] < 1e-9
    assert linear["projected"][512] == pytest.approx(0.5 + 0.1 * 512)
    logarithmic = scale_model.fit(nodes, [1.0 + 0.3 * scale_model.math.log2(n) for n in nodes])
    assert logarithmic["form"] == "log2" and logarithmic["forms"]["linear"]["hold_out_relative_error"] > 0.05
    assert scale_model.fit(nodes, [2.0, 2.0, 2.0, 2.0])["form"] == "constant"
    noise = scale_model.fit(nodes, [0.6, 0.01, 0.6, 0.05])
    assert noise["form"] == "max" and noise["projected"][512] == 0.6
    # Two runs pooled (a node count twice): the hold-out predicts both values at the largest count.
    pooled = scale_model.fit([2, 2, 4, 4, 8, 8, 16, 16], [1.0, 1.2, 1.4, 1.6, 2.2, 2.4, 3.8, 4.0])
    assert pooled["form"] == "linear" and pooled["hold_out_relative_error"] < 0.05


def test_the_scale_model_projects_the_committed_scale_tier_figures_as_the_docs_quote_them(tmp_path):
    """bench/scale_model.py on the committed runs of `make test-scale` (its default): the α–β all-reduce and
    checkpoint figures by hand at one point, the fit errors reported, and docs/scale.md quoting its tables."""
    result = run([sys.executable, str(REPO / "bench" / "scale_model.py"), "--out", str(tmp_path)], timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    model = json.loads((tmp_path / "scale_model.json").read_text())
    assert set(model["projections"]) == {"64", "128", "256", "512"}
    at_512 = model["projections"]["512"]
    node_bandwidth = 4 * 25e9
    gradients = 1.3e9 * 2
    allreduce = at_512["allreduce_s"]["1.3B"]["all_gradients"]
    assert allreduce["ring"] == pytest.approx(2 * 511 * 9.6e-6 + 2 * 511 / 512 * gradients / node_bandwidth)
    assert allreduce["tree"] == pytest.approx(2 * 9 * 50e-6 + 2 * gradients / node_bandwidth)
    assert at_512["checkpoint_s"]["7B"]["network_and_file_system_peak"] == pytest.approx(7e9 * 12 / 5e12)
    assert at_512["image_lookups_per_job_start"] == {"resolved_once (slurm/lib/launch.sh)": 1, "every_rank": 2048}
    measured = model["inputs"]["measured_here"]
    committed_runs = len(list((REPO / "bench" / "scale_timings").glob("*.json")))
    assert measured["ddp_node_counts"] == [2, 4, 8, 16] and measured["tier_runs"] == committed_runs >= 2
    assert len(measured["ddp_runs"]) == 4 * measured["tier_runs"] and measured["import_torch"]["files_opened"] > 100
    no_trend_error = load_scale_model().NO_TREND_ERROR
    for name, error in model["fit_error"].items():  # a trend only where it predicts the largest count from the others
        assert error["form"] in ("constant", "log2", "linear", "max"), name
        assert (error["form"] == "max") == (error["hold_out_relative_error"] > no_trend_error), (name, error)
    assert (tmp_path / "scale_model.png").stat().st_size > 10_000
    # The docs' tables are this rendering of the committed figures (a number edited by hand fails here).
    assert (tmp_path / "scale_model.md").read_text() == (REPO / "bench" / "scale_model.md").read_text()
    assert "<!-- include bench/scale_model.md -->" in (REPO / "docs" / "scale.md").read_text()
