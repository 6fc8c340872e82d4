"""What `flowloop send --data` checks of a payload before sending it: the keys no field of
the event's model takes are refused (pydantic would drop them without a word), unless the
model decides itself what becomes of its input; and the names of the workflows a file
defines, read without importing it, for the hint of a misspelt name."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from pydantic import BaseModel, model_validator

from flowloop.definition import unknown_payload_keys
from flowloop.loader import MAX_SCANNED_BYTES, workflow_names_in

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from pydantic import root_validator

    class Legacy(BaseModel):
        """A v1-style model that renames its input before validation."""

        by: str = ""

        @root_validator(pre=True)
        def _renamed(cls, values: dict[str, Any]) -> dict[str, Any]:
            return {"by": values.get("who", "")} if "who" in values else values


class Modern(BaseModel):
    by: str = ""

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, values: Any) -> Any:
        return {"by": values["who"]} if isinstance(values, dict) and "who" in values else values


class Plain(BaseModel):
    by: str = ""


def test_a_model_that_renames_its_input_decides_its_keys_itself() -> None:
    # Before: a v1 root_validator(pre=True), filed by pydantic apart from the model
    # validators, was not seen: `--data '{"who": "bob"}'` was refused, which it takes.
    assert Legacy.model_validate({"who": "bob"}).by == "bob"
    assert unknown_payload_keys(Legacy, ["who"]) == []
    assert unknown_payload_keys(Modern, ["who"]) == []
    assert unknown_payload_keys(Plain, ["who"]) == ["who"]


FLOW = 'from flowloop import Workflow\n\nbig = Workflow("big_flow")\n'


def test_a_file_too_large_to_parse_for_names_defines_none_here(tmp_path: Path) -> None:
    # Before: a 36 MB module of data was parsed on the error path of a misspelt name (47 s,
    # 5.5 GB). A file of data (no `Workflow` in it) is not parsed either.
    small = tmp_path / "small.py"
    small.write_text(FLOW)
    assert workflow_names_in(small) == ["big_flow"]
    large = tmp_path / "large.py"
    large.write_text(FLOW + "#" * MAX_SCANNED_BYTES + "\n")
    assert workflow_names_in(large) == []
