"""The request check every engine runs first (``engine.check_request``): one line per bad setting."""

from __future__ import annotations

import pytest

from treegrpo.rollout.engine import SamplingParams, check_request


@pytest.mark.parametrize(
    ("contexts", "params", "message"),
    [
        ([[1]], SamplingParams(max_new_tokens=0), "max_new_tokens must be >= 1, got 0"),
        ([[1]], SamplingParams(temperature=-0.5), "temperature must be >= 0, got -0.5"),
        ([[1]], SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
        ([[1]], SamplingParams(stop_strings=("</a>", "")), "stop_strings must be non-empty strings"),
        ([[1], []], SamplingParams(max_new_tokens=4), "context 1 is empty"),
        (
            [[1, 2, 3]],
            SamplingParams(max_new_tokens=8),
            "context 0 has 3 tokens; with max_new_tokens=8 it exceeds LIMIT=10",
        ),
    ],
)
def test_a_bad_request_is_one_line_naming_it(
    contexts: list[list[int]], params: SamplingParams, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_request(contexts, params, 10, "LIMIT")


def test_a_request_within_bounds_passes() -> None:
    check_request([[1, 2]], SamplingParams(max_new_tokens=8), 10, "LIMIT")  # 2 + 8 = 10: fits
    check_request([[1] * 500], SamplingParams(max_new_tokens=8), None, "unused")  # no bound
