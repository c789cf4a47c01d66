"""Schedule data: action text round trips, the text form of a schedule, its parse errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeengine.schedule import Action, ScheduleError, compile_schedule, format_schedule, parse_schedule, validate

ASSETS = Path(__file__).parent.parent / "assets"


def test_text_fixture_matches_compiled_1f1b() -> None:
    text = (ASSETS / "1f1b_pp4_m8.txt").read_text()
    assert format_schedule(compile_schedule("1f1b", 4, 8)) == text
    parsed = parse_schedule(text)
    assert parsed.lowered and parsed.pp == 4 and parsed.microbatches == 8
    validate(parsed)
    assert parsed.programs == compile_schedule("1f1b", 4, 8).programs


@pytest.mark.parametrize("text", ["F0", "B12.3", "W7", "sendF3>1", "recvF3.2<0", "sendB0>4", "recvB1<2"])
def test_action_text_round_trip(text: str) -> None:
    assert str(Action.parse(text)) == text


@pytest.mark.parametrize("text,match", [
    ("X3", "cannot parse"), ("sendF3<1", "send points '>'"), ("F", "cannot parse")])
def test_action_parse_errors(text: str, match: str) -> None:
    with pytest.raises(ScheduleError, match=match):
        Action.parse(text)
