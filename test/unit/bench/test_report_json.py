"""Benchmark reports as compact JSON (`bench/report_json.py`): the same value as a
plain dump, each request's record and each column of scalars on one line."""

import json
import math

import pytest

from gyrfalcon.bench import report_json

REPORT = {
    "bench": "spec",
    "rows": [{"concurrency": 1, "speedup": 1.81}, {"concurrency": 16, "speedup": 1.51}],
    "per_request": {"16": {"spec": [{"latency_s": 0.2, "error": ""}] * 3}},
    "columns": {"ttft_s": [0.1, 0.25, 0.5], "output_tokens": [3, 4, 5]},
    "nested": {"empty": {}, "none": None, "lists": [[1, 2], [3]]},
}


def test_a_report_round_trips_with_scalar_containers_on_one_line(tmp_path):
    text = report_json.dumps(REPORT)
    assert json.loads(text) == REPORT
    lines = text.splitlines()
    assert '        {"latency_s":0.2,"error":""},' in lines  # a record: one line
    assert '    "ttft_s": [0.1,0.25,0.5],' in lines  # a column: one line
    assert lines[0] == "{" and lines[1] == '  "bench": "spec",'  # objects still indented
    assert len(text) < len(json.dumps(REPORT, indent=2))
    report_json.write(tmp_path / "r.json", REPORT)
    assert json.loads((tmp_path / "r.json").read_text()) == REPORT


def test_nan_is_refused_as_in_a_plain_dump():
    with pytest.raises(ValueError):
        report_json.dumps({"rows": [{"x": math.nan}]})
