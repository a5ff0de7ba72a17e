"""Flattening trajectories into text: every shape a harness submits, and the shapes it must refuse."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from engine import flatten


@dataclass
class Message:
    role: str
    content: Any


@dataclass
class Part:
    type: str
    text: str | None = None


def test_string_is_itself() -> None:
    assert flatten("The answer is 4.") == "The answer is 4."
    assert flatten("") == ""


def test_none_is_no_text() -> None:
    assert flatten(None) == ""


def test_list_of_strings_joined_with_newlines() -> None:
    assert flatten(["a", "b", "c"]) == "a\nb\nc"
    assert flatten(("a", "b")) == "a\nb"
    assert flatten([]) == ""


def test_message_dicts() -> None:
    trajectory = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    assert flatten(trajectory) == "What is 2+2?\n4"


def test_message_objects_with_attributes() -> None:
    trajectory = [Message("user", "What is 2+2?"), Message("assistant", "4")]
    assert flatten(trajectory) == "What is 2+2?\n4"
    assert flatten(Message("assistant", "alone")) == "alone"


def test_tool_call_message_with_null_content_is_skipped() -> None:
    trajectory = [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "function": {"name": "calc"}}]},
        {"role": "tool", "content": "4"},
        Message("assistant", None),
        {"role": "assistant", "content": "It is 4."},
    ]
    assert flatten(trajectory) == "4\nIt is 4."


def test_text_field_when_there_is_no_content() -> None:
    assert flatten({"type": "output_text", "text": "hi"}) == "hi"
    assert flatten({"content": None, "text": "fallback"}) == "fallback"


def test_content_parts_with_text_and_image_parts() -> None:
    trajectory = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                Part("text", "this picture?"),
                Part("image"),
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
    ]
    assert flatten(trajectory) == "What is in\nthis picture?\nA cat."


def test_nested_lists() -> None:
    assert flatten([["a", ["b", None]], [], [[{"content": "c"}]]]) == "a\nb\nc"


def test_elements_without_text_leave_no_blank_lines() -> None:
    image = {"type": "image_url", "image_url": {"url": "https://example.invalid/cat.png"}}
    trajectory = [
        {"role": "user", "content": [image]},  # a message of images only
        [None, [], [None]],
        {"role": "assistant", "content": ""},
        {"role": "assistant", "content": "A cat."},
        Message("assistant", [Part("image")]),
    ]
    assert flatten(trajectory) == "A cat."
    assert flatten([[None], "a", [[]], "b"]) == "a\nb"


@pytest.mark.parametrize(
    ("trajectory", "shape", "path"),
    [
        (42, "int", "trajectory"),
        (b"bytes", "bytes", "trajectory"),
        (["ok", 3.5], "float", "trajectory[1]"),
        ([{"role": "user", "content": ["ok", {"role": "x"}]}], "dict", "trajectory[0].content[1]"),
        ([{"role": "user"}], "dict", "trajectory[0]"),
        ([{"role": "user", "content": [b"raw"]}], "bytes", "trajectory[0].content[0]"),
        ({1, 2}, "set", "trajectory"),
        (object(), "object", "trajectory"),
    ],
)
def test_unknown_shapes_raise_type_error_naming_the_path(trajectory: Any, shape: str, path: str) -> None:
    with pytest.raises(TypeError) as info:
        flatten(trajectory)
    message = str(info.value)
    assert f"{shape} at {path}" in message, message
    assert message.startswith("cannot flatten trajectory")
